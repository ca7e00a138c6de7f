//! Managed memory: `cuMemAllocManaged`, advice (`cuMemAdvise` at both ABIs), prefetch
//! (`cuMemPrefetchAsync` at both ABIs, `cuMemPrefetchBatchAsync`), discard
//! (`cuMemDiscardBatchAsync`, `cuMemDiscardAndPrefetchBatchAsync`) and the range-attribute
//! queries, following the documentation of each call in `cuda.h`.
//!
//! Each allocation is tracked per CPU page (4 KiB): where the page lives, and the advice it
//! carries (read-mostly, preferred location, accessed-by set), plus the last location it was
//! explicitly prefetched to. The bytes themselves are ordinary host memory registered as
//! [`RegionKind::Managed`] in [`Memory`], so copies and kernels reach them. Range operations are
//! stream-ordered: the residency change (and, for a discard, the poisoning of the contents with
//! [`DISCARD_POISON`]) happens when the stream reaches the operation; the "last prefetch
//! location" is recorded when the call is made, as the documentation says it reflects the request,
//! not its completion.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cuda_multimem_sys::*;
use parking_lot::Mutex;

use super::context::current_device;
use super::memory::{map_anonymous, unmap, Memory, Region, RegionKind};
use super::stream;
use crate::state::{SimResult, State};

/// The CPU page size by which ranges are rounded (start down, end up).
const PAGE: usize = 4096;

/// The byte a discard writes over the discarded range, so a test can see that a discard happened
/// (the driver documents the contents as indeterminate).
pub const DISCARD_POISON: u8 = 0xDB;

/// `CU_DEVICE_CPU`.
const DEVICE_CPU: i32 = -1;
/// `CU_DEVICE_INVALID`.
const DEVICE_INVALID: i32 = -2;

/// A resolved location of managed pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loc {
    Device(i32),
    Host,
    HostNuma(i32),
    /// A prefetch request for "the calling thread's node", recorded as such (a 13.0 driver
    /// reports it back as `CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT`); pages go to the node it
    /// resolves to.
    HostNumaCurrent,
}

impl Loc {
    /// The legacy (`CUdevice`) answer: a device ordinal, or `CU_DEVICE_CPU` for any host location.
    fn legacy(self) -> i32 {
        match self {
            Loc::Device(d) => d,
            Loc::Host | Loc::HostNuma(_) | Loc::HostNumaCurrent => DEVICE_CPU,
        }
    }
    fn type_and_id(self) -> (CUmemLocationType, i32) {
        match self {
            Loc::Device(d) => (CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, d),
            Loc::Host => (CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, DEVICE_CPU),
            Loc::HostNuma(n) => (CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA, n),
            Loc::HostNumaCurrent => (CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT, 0),
        }
    }
    /// The accessed-by bit of this processor (bit 0: the host; bit d+1: device d).
    fn bit(self) -> u128 {
        match self {
            Loc::Device(d) => 1 << (d as u32 + 1),
            Loc::Host | Loc::HostNuma(_) | Loc::HostNumaCurrent => 1,
        }
    }
}

/// The state of one CPU page of a managed allocation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Page {
    /// Where the page's data lives (`None`: not populated, or discarded).
    resident: Option<Loc>,
    read_mostly: bool,
    preferred: Option<Loc>,
    /// Processors with `CU_MEM_ADVISE_SET_ACCESSED_BY` (bit 0 host, bit d+1 device d).
    accessed_by: u128,
    last_prefetch: Option<Loc>,
}

struct Alloc {
    id: u64,
    len: usize,
    pages: Vec<Page>,
}

/// The managed allocations of a session, by start address.
#[derive(Default)]
pub(crate) struct Managed {
    allocs: Mutex<BTreeMap<usize, Alloc>>,
}

impl Drop for Managed {
    fn drop(&mut self) {
        for (a, alloc) in std::mem::take(&mut *self.allocs.lock()) {
            unmap(a, alloc.len);
        }
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A validated range: the allocation it lies in (start, id) and its pages.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    base: usize,
    id: u64,
    first_page: usize,
    end_page: usize,
}

/// Find the managed allocation containing `[ptr, ptr + count)` entirely; anything else (a zero
/// count, memory that is not managed, a range running past its allocation) is
/// `CUDA_ERROR_INVALID_VALUE`, as the range calls document.
fn span(m: &BTreeMap<usize, Alloc>, ptr: CUdeviceptr, count: usize) -> SimResult<Span> {
    let ptr = ptr as usize;
    if count == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let (base, a) = m
        .range(..=ptr)
        .next_back()
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let end = ptr
        .checked_add(count)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if end > base + a.len {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    Ok(Span {
        base: *base,
        id: a.id,
        first_page: (ptr - base) / PAGE,
        end_page: (end - base).div_ceil(PAGE),
    })
}

fn with_pages<T>(
    st: &State,
    ptr: CUdeviceptr,
    count: usize,
    f: impl FnOnce(&mut [Page]) -> T,
) -> SimResult<T> {
    let m = st.ext::<Managed>();
    let mut g = m.allocs.lock();
    let s = span(&g, ptr, count)?;
    let a = g
        .get_mut(&s.base)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    Ok(f(&mut a.pages[s.first_page..s.end_page]))
}

/// Whether device `dev` accesses managed memory concurrently with the CPU.
fn concurrent(st: &State, dev: i32) -> SimResult<bool> {
    Ok(st.device(dev)?.concurrent_managed_access)
}

/// The host NUMA node of the calling thread's CPU (the simulated host: node 0, or plain host
/// memory when it has no NUMA nodes).
fn current_numa(st: &State) -> Loc {
    if st.config.host_numa_nodes > 0 {
        Loc::HostNuma(0)
    } else {
        Loc::Host
    }
}

fn numa(st: &State, id: i32) -> SimResult<Loc> {
    if id < 0 || id >= st.config.host_numa_nodes {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    Ok(Loc::HostNuma(id))
}

/// A GPU named as a target of a prefetch or an advice: a valid ordinal with concurrent managed
/// access.
fn managed_device(st: &State, dev: i32) -> SimResult<Loc> {
    if !concurrent(st, dev)? {
        return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
    }
    Ok(Loc::Device(dev))
}

fn location_type(l: &CUmemLocation) -> CUmemLocationType {
    l.type_
}

fn location_id(l: &CUmemLocation) -> i32 {
    // SAFETY: `id` is the union's plain-int view; every bit pattern is a valid c_int.
    unsafe { l.__bindgen_anon_1.id }
}

/// A prefetch destination (`cuMemPrefetchAsync` v2 and the batch calls): a device with
/// concurrent managed access (an ordinal the machine lacks is `CUDA_ERROR_INVALID_DEVICE`), the
/// host, a host NUMA node the host has, or the current thread's node. Every other type,
/// device locality domains included, is `CUDA_ERROR_INVALID_VALUE` (as measured on a 13.0
/// driver).
pub(crate) fn prefetch_location(st: &State, l: &CUmemLocation) -> SimResult<Loc> {
    use CUmemLocationType as T;
    match location_type(l) {
        T::CU_MEM_LOCATION_TYPE_DEVICE => managed_device(st, location_id(l)),
        T::CU_MEM_LOCATION_TYPE_HOST => Ok(Loc::Host),
        T::CU_MEM_LOCATION_TYPE_HOST_NUMA => numa(st, location_id(l)),
        T::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => Ok(Loc::HostNumaCurrent),
        _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
}

/// Where pages prefetched to `l` end up.
fn resolve(st: &State, l: Loc) -> Loc {
    match l {
        Loc::HostNumaCurrent => current_numa(st),
        l => l,
    }
}

/// A legacy `CUdevice` argument: `CU_DEVICE_CPU` or a device ordinal.
pub(crate) fn legacy_location(st: &State, dev: CUdevice) -> SimResult<Loc> {
    if dev == DEVICE_CPU {
        Ok(Loc::Host)
    } else {
        managed_device(st, dev)
    }
}

/// Apply `advice` (location already resolved where the advice takes one) to `[ptr, ptr+count)`.
pub(crate) fn apply_advice(
    st: &State,
    ptr: CUdeviceptr,
    count: usize,
    advice: CUmem_advise,
    loc: Option<Loc>,
) -> SimResult {
    use CUmem_advise as A;
    with_pages(st, ptr, count, |pages| {
        for p in pages {
            match advice {
                A::CU_MEM_ADVISE_SET_READ_MOSTLY => p.read_mostly = true,
                A::CU_MEM_ADVISE_UNSET_READ_MOSTLY => p.read_mostly = false,
                A::CU_MEM_ADVISE_SET_PREFERRED_LOCATION => p.preferred = loc,
                A::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION => p.preferred = None,
                A::CU_MEM_ADVISE_SET_ACCESSED_BY => {
                    p.accessed_by |= loc.map_or(0, Loc::bit);
                }
                A::CU_MEM_ADVISE_UNSET_ACCESSED_BY => {
                    p.accessed_by &= !loc.map_or(0, Loc::bit);
                }
                _ => {}
            }
        }
    })
}

pub(crate) fn check_advice(advice: CUmem_advise) -> SimResult {
    if !(1..=6).contains(&advice.0) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

/// Whether `advice` takes a location argument (the others ignore it).
pub(crate) fn advice_takes_location(advice: CUmem_advise) -> bool {
    use CUmem_advise as A;
    matches!(
        advice,
        A::CU_MEM_ADVISE_SET_PREFERRED_LOCATION
            | A::CU_MEM_ADVISE_SET_ACCESSED_BY
            | A::CU_MEM_ADVISE_UNSET_ACCESSED_BY
    )
}

/// The location of `cuMemAdvise` v2 for `advice`, by its documented rules: preferred location
/// takes a device, the host, a host NUMA node or the current node (whose resolved node is
/// recorded, as the documentation says); accessed-by takes a device or the host only. A device
/// ordinal the machine lacks, a locality domain and every other type are
/// `CUDA_ERROR_INVALID_VALUE` (as measured on a 13.0 driver); an existing device without
/// concurrent managed access is `CUDA_ERROR_INVALID_DEVICE`.
pub(crate) fn advice_location(
    st: &State,
    advice: CUmem_advise,
    l: &CUmemLocation,
) -> SimResult<Loc> {
    use CUmemLocationType as T;
    let device = |id: i32| {
        st.device(id)
            .map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
        managed_device(st, id)
    };
    if advice == CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION {
        return match location_type(l) {
            T::CU_MEM_LOCATION_TYPE_DEVICE => device(location_id(l)),
            T::CU_MEM_LOCATION_TYPE_HOST => Ok(Loc::Host),
            T::CU_MEM_LOCATION_TYPE_HOST_NUMA => numa(st, location_id(l)),
            T::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => Ok(current_numa(st)),
            _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
        };
    }
    match location_type(l) {
        T::CU_MEM_LOCATION_TYPE_DEVICE => device(location_id(l)),
        T::CU_MEM_LOCATION_TYPE_HOST => Ok(Loc::Host),
        _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
}

/// One range operation, applied when its stream reaches it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RangeOp {
    Prefetch(Loc),
    Discard,
    DiscardAndPrefetch(Loc),
}

/// Validate a range and record the request (last prefetch location); returns what the queued
/// operation needs.
pub(crate) fn request(
    st: &State,
    ptr: CUdeviceptr,
    size: usize,
    op: RangeOp,
) -> SimResult<(Span, usize, usize)> {
    let m = st.ext::<Managed>();
    let mut g = m.allocs.lock();
    let s = span(&g, ptr, size)?;
    if let RangeOp::Prefetch(l) | RangeOp::DiscardAndPrefetch(l) = op {
        let a = g
            .get_mut(&s.base)
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        for p in &mut a.pages[s.first_page..s.end_page] {
            p.last_prefetch = Some(l);
        }
    }
    Ok((s, ptr as usize, size))
}

/// Carry out range operations (on the stream's worker).
fn perform(st: &State, ops: &[(Span, usize, usize, RangeOp)]) -> SimResult {
    let m = st.ext::<Managed>();
    let mut g = m.allocs.lock();
    for &(s, ptr, size, op) in ops {
        // Freed (or replaced) since it was queued: nothing left to act on.
        let Some(a) = g.get_mut(&s.base).filter(|a| a.id == s.id) else {
            continue;
        };
        if matches!(op, RangeOp::Discard | RangeOp::DiscardAndPrefetch(_)) {
            // SAFETY: `[ptr, ptr + size)` lies inside this live allocation (checked at enqueue
            // time; the allocation is the same one, by id, and cannot be freed while we hold
            // the lock).
            unsafe { std::ptr::write_bytes(ptr as *mut u8, DISCARD_POISON, size) };
        }
        for p in &mut a.pages[s.first_page..s.end_page] {
            p.resident = match op {
                RangeOp::Prefetch(l) | RangeOp::DiscardAndPrefetch(l) => Some(resolve(st, l)),
                RangeOp::Discard => None,
            };
        }
    }
    Ok(())
}

pub(crate) fn enqueue_ops(
    st: &Arc<State>,
    stream: CUstream,
    ops: Vec<(Span, usize, usize, RangeOp)>,
) -> SimResult {
    let s2 = st.clone();
    let ops = Arc::new(ops);
    stream::enqueue(st, stream, Arc::new(move || perform(&s2, &ops)))
}

/// The device of `stream` must access managed memory concurrently (documented for prefetches to
/// a device).
pub(crate) fn check_stream_device(st: &State, stream: CUstream) -> SimResult {
    let dev = stream::stream(st, stream)?.device;
    if !concurrent(st, dev)? {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    Ok(())
}

pub(crate) fn batch(
    st: &Arc<State>,
    ranges: Vec<(CUdeviceptr, usize)>,
    ops: Vec<RangeOp>,
    stream: CUstream,
) -> SimResult {
    // Validate every range before recording anything.
    {
        let m = st.ext::<Managed>();
        let g = m.allocs.lock();
        for &(p, s) in &ranges {
            span(&g, p, s)?;
        }
    }
    let mut queued = Vec::with_capacity(ranges.len());
    for (&(p, s), &op) in ranges.iter().zip(&ops) {
        let (sp, ptr, size) = request(st, p, s, op)?;
        queued.push((sp, ptr, size, op));
    }
    enqueue_ops(st, stream, queued)
}

/// What a range attribute answers for a range's pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RangeValue {
    /// One 32-bit value.
    Int(i32),
    /// `CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY`: the processors with the advice on every page
    /// (devices in order, then `CU_DEVICE_CPU`); the caller's array is padded with
    /// `CU_DEVICE_INVALID`.
    Processors(Vec<i32>),
}

/// `CU_DEVICE_INVALID`, which pads an accessed-by answer.
pub(crate) const NO_DEVICE: i32 = DEVICE_INVALID;

/// What range attribute `attr` answers for `pages` (`CUDA_ERROR_INVALID_VALUE` for an attribute
/// the driver version lacks or does not know).
pub(crate) fn range_attribute(
    st: &State,
    attr: CUmem_range_attribute,
    pages: &[Page],
) -> SimResult<RangeValue> {
    use CUmem_range_attribute as R;
    if attr.0 >= 5 && st.version() < 12020 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let all_same = |f: &dyn Fn(&Page) -> Option<Loc>| -> Option<Loc> {
        let first = f(pages.first()?)?;
        pages.iter().all(|p| f(p) == Some(first)).then_some(first)
    };
    let preferred = all_same(&|p| p.preferred);
    let prefetched = all_same(&|p| p.last_prefetch);
    let int = RangeValue::Int;
    Ok(match attr {
        R::CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY => int(pages.iter().all(|p| p.read_mostly) as i32),
        R::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION => {
            int(preferred.map_or(DEVICE_INVALID, Loc::legacy))
        }
        R::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION => {
            int(prefetched.map_or(DEVICE_INVALID, Loc::legacy))
        }
        R::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE => {
            int(preferred.map_or(0, |l| l.type_and_id().0 .0 as i32))
        }
        R::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID => {
            int(preferred.map_or(DEVICE_INVALID, |l| l.type_and_id().1))
        }
        R::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE => {
            int(prefetched.map_or(0, |l| l.type_and_id().0 .0 as i32))
        }
        R::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID => {
            int(prefetched.map_or(DEVICE_INVALID, |l| l.type_and_id().1))
        }
        R::CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY => {
            let common = pages.iter().fold(u128::MAX, |acc, p| acc & p.accessed_by);
            let mut ids: Vec<i32> = (0..st.device_count() as i32)
                .filter(|d| common & Loc::Device(*d).bit() != 0)
                .collect();
            if common & 1 != 0 {
                ids.push(DEVICE_CPU);
            }
            RangeValue::Processors(ids)
        }
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    })
}

/// The pages of the managed range `[ptr, ptr + count)`, as they are now.
pub(crate) fn range_pages(st: &State, ptr: CUdeviceptr, count: usize) -> SimResult<Vec<Page>> {
    with_pages(st, ptr, count, |p| p.to_vec())
}

/// Free a managed allocation (`cuMemFree` of a pointer that `cuMemAlloc` did not return).
pub(crate) fn free(st: &State, ptr: usize) -> SimResult {
    let m = st.ext::<Managed>();
    let alloc = m
        .allocs
        .lock()
        .remove(&ptr)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if let Ok(dev) = current_device(st) {
        stream::synchronize_device(st, dev)?;
    }
    st.ext::<Memory>().remove(ptr);
    unmap(ptr, alloc.len);
    st.live_add("managed allocations", -1);
    Ok(())
}

/// `cuMemAllocManaged` of `size` bytes (non-zero); the address.
pub(crate) fn alloc(st: &State, size: usize) -> SimResult<usize> {
    let a = map_anonymous(size)?;
    st.ext::<Memory>().insert(
        a,
        Region {
            len: size,
            kind: RegionKind::Managed,
            device: None,
            readable: true,
            writable: true,
            redirect: None,
        },
    );
    let alloc = Alloc {
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        len: size,
        pages: vec![Page::default(); size.div_ceil(PAGE)],
    };
    st.ext::<Managed>().allocs.lock().insert(a, alloc);
    st.live_add("managed allocations", 1);
    Ok(a)
}

/// Where the managed range `[ptr, ptr + len)` lives now, when all of it lives at one location
/// (see `Simulator::managed_residence`).
pub(crate) fn residence(st: &State, ptr: u64, len: usize) -> Option<(CUmemLocationType, i32)> {
    let pages = range_pages(st, ptr as CUdeviceptr, len).ok()?;
    let first = pages.first()?.resident?;
    pages
        .iter()
        .all(|p| p.resident == Some(first))
        .then(|| first.type_and_id())
}
