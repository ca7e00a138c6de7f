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
use std::ffi::{c_uint, c_ulonglong, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cuda_multimem_sys::*;
use parking_lot::Mutex;

use crate::device::current_device;
use crate::dispatch::sim_api;
use crate::memory::{map_anonymous, unmap, Memory, Region, RegionKind};
use crate::state::{out, SimResult, State};

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
enum Loc {
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
struct Page {
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
struct Span {
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
fn prefetch_location(st: &State, l: &CUmemLocation) -> SimResult<Loc> {
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
fn legacy_location(st: &State, dev: CUdevice) -> SimResult<Loc> {
    if dev == DEVICE_CPU {
        Ok(Loc::Host)
    } else {
        managed_device(st, dev)
    }
}

/// Apply `advice` (location already resolved where the advice takes one) to `[ptr, ptr+count)`.
fn apply_advice(
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

fn check_advice(advice: CUmem_advise) -> SimResult {
    if !(1..=6).contains(&advice.0) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

/// Whether `advice` takes a location argument (the others ignore it).
fn advice_takes_location(advice: CUmem_advise) -> bool {
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
fn advice_location(st: &State, advice: CUmem_advise, l: &CUmemLocation) -> SimResult<Loc> {
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
enum RangeOp {
    Prefetch(Loc),
    Discard,
    DiscardAndPrefetch(Loc),
}

/// Validate a range and record the request (last prefetch location); returns what the queued
/// operation needs.
fn request(
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

fn enqueue_ops(
    st: &Arc<State>,
    stream: CUstream,
    ops: Vec<(Span, usize, usize, RangeOp)>,
) -> SimResult {
    let s2 = st.clone();
    let ops = Arc::new(ops);
    crate::stream::enqueue(st, stream, Arc::new(move || perform(&s2, &ops)))
}

/// The device of `stream` must access managed memory concurrently (documented for prefetches to
/// a device).
fn check_stream_device(st: &State, stream: CUstream) -> SimResult {
    let dev = crate::stream::stream(st, stream)?.device;
    if !concurrent(st, dev)? {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    Ok(())
}

/// Checks shared by the batch calls: every device has concurrent managed access, the stream is
/// not the legacy NULL stream, flags are zero, the arrays are present.
fn check_batch(
    st: &State,
    dptrs: *mut CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    flags: c_ulonglong,
    stream: CUstream,
) -> SimResult<Vec<(CUdeviceptr, usize)>> {
    if dptrs.is_null() || sizes.is_null() || count == 0 || flags != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // The legacy NULL stream: 0 or CU_STREAM_LEGACY (0x1).
    if (stream as usize) <= 1 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    crate::stream::stream(st, stream)?;
    if st
        .config
        .devices
        .iter()
        .any(|d| !d.concurrent_managed_access)
    {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    // SAFETY: the caller passes `count` entries in each array (non-null, checked above).
    let (d, s) = unsafe {
        (
            std::slice::from_raw_parts(dptrs, count),
            std::slice::from_raw_parts(sizes, count),
        )
    };
    Ok(d.iter().copied().zip(s.iter().copied()).collect())
}

/// The per-operation locations of a batch from `prefetchLocs`/`prefetchLocIdxs`: the first index
/// is 0, indices strictly increase and stay below `count`, and there are at most `count` entries.
fn batch_locations(
    st: &State,
    locs: *mut CUmemLocation,
    idxs: *mut usize,
    n: usize,
    count: usize,
) -> SimResult<Vec<Loc>> {
    if locs.is_null() || idxs.is_null() || n == 0 || n > count {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller passes `n` entries in each array (non-null, checked above).
    let (locs, idxs) = unsafe {
        (
            std::slice::from_raw_parts(locs, n),
            std::slice::from_raw_parts(idxs, n),
        )
    };
    // Documented: "each entry must be greater than the previous entry". (A 13.0 driver was
    // measured to accept equal neighbours; the simulator holds callers to the documentation.)
    if idxs[0] != 0 || idxs.windows(2).any(|w| w[1] <= w[0]) || idxs[n - 1] >= count {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let resolved = locs
        .iter()
        .map(|l| prefetch_location(st, l))
        .collect::<SimResult<Vec<_>>>()?;
    let mut per_op = Vec::with_capacity(count);
    for k in 0..n {
        let end = if k + 1 < n { idxs[k + 1] } else { count };
        per_op.extend(std::iter::repeat_n(resolved[k], end - idxs[k]));
    }
    Ok(per_op)
}

fn batch(
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

/// What a range attribute answers for `pages`.
// `usize::is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#[allow(clippy::manual_is_multiple_of)]
fn attribute(
    st: &State,
    attr: CUmem_range_attribute,
    pages: &[Page],
    data: *mut c_void,
    size: usize,
) -> SimResult {
    use CUmem_range_attribute as R;
    if data.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    if attr.0 >= 5 && st.version() < 12020 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let all_same = |f: &dyn Fn(&Page) -> Option<Loc>| -> Option<Loc> {
        let first = f(pages.first()?)?;
        pages.iter().all(|p| f(p) == Some(first)).then_some(first)
    };
    let write_i32 = |v: i32| -> SimResult {
        if size != 4 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null; the caller passes `size` (4) writable bytes.
        unsafe { (data as *mut i32).write_unaligned(v) };
        Ok(())
    };
    let preferred = all_same(&|p| p.preferred);
    let prefetched = all_same(&|p| p.last_prefetch);
    match attr {
        R::CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY => {
            write_i32(pages.iter().all(|p| p.read_mostly) as i32)
        }
        R::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION => {
            write_i32(preferred.map_or(DEVICE_INVALID, Loc::legacy))
        }
        R::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION => {
            write_i32(prefetched.map_or(DEVICE_INVALID, Loc::legacy))
        }
        R::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE => {
            write_i32(preferred.map_or(0, |l| l.type_and_id().0 .0 as i32))
        }
        R::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID => {
            write_i32(preferred.map_or(DEVICE_INVALID, |l| l.type_and_id().1))
        }
        R::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE => {
            write_i32(prefetched.map_or(0, |l| l.type_and_id().0 .0 as i32))
        }
        R::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID => {
            write_i32(prefetched.map_or(DEVICE_INVALID, |l| l.type_and_id().1))
        }
        R::CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY => {
            if size == 0 || size % 4 != 0 {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            let common = pages.iter().fold(u128::MAX, |acc, p| acc & p.accessed_by);
            let mut ids: Vec<i32> = (0..st.device_count() as i32)
                .filter(|d| common & Loc::Device(*d).bit() != 0)
                .collect();
            if common & 1 != 0 {
                ids.push(DEVICE_CPU);
            }
            let slots = size / 4;
            for i in 0..slots {
                let v = ids.get(i).copied().unwrap_or(DEVICE_INVALID);
                // SAFETY: `i < size / 4`, inside the caller's buffer.
                unsafe { (data as *mut i32).add(i).write_unaligned(v) };
            }
            Ok(())
        }
        _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
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
        crate::stream::synchronize_device(st, dev)?;
    }
    st.ext::<Memory>().remove(ptr);
    unmap(ptr, alloc.len);
    st.live_add("managed allocations", -1);
    Ok(())
}

sim_api! {
    cuMemAllocManaged @ 6000 as PFN_cuMemAllocManaged_v6000 => fn mem_alloc_managed(st, dptr: *mut CUdeviceptr, size: usize, flags: c_uint) {
        if dptr.is_null() || size == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        if flags != CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL.0 && flags != CUmemAttach_flags::CU_MEM_ATTACH_HOST.0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        current_device(st)?;
        let a = map_anonymous(size)?;
        st.ext::<Memory>().insert(a, Region { len: size, kind: RegionKind::Managed, device: None, readable: true, writable: true, redirect: None });
        let alloc = Alloc { id: NEXT_ID.fetch_add(1, Ordering::Relaxed), len: size, pages: vec![Page::default(); size.div_ceil(PAGE)] };
        st.ext::<Managed>().allocs.lock().insert(a, alloc);
        st.live_add("managed allocations", 1);
        out(dptr, a as CUdeviceptr)
    }
    cuMemAdvise @ 8000 as PFN_cuMemAdvise_v8000 => fn mem_advise_v8000(st, ptr: CUdeviceptr, count: usize, advice: CUmem_advise, dev: CUdevice) {
        check_advice(advice)?;
        let loc = if advice_takes_location(advice) { Some(legacy_location(st, dev)?) } else { None };
        apply_advice(st, ptr, count, advice, loc)
    }
    cuMemAdvise @ 12020 as PFN_cuMemAdvise_v12020 => fn mem_advise_v12020(st, ptr: CUdeviceptr, count: usize, advice: CUmem_advise, location: CUmemLocation) {
        check_advice(advice)?;
        let loc = if advice_takes_location(advice) { Some(advice_location(st, advice, &location)?) } else { None };
        apply_advice(st, ptr, count, advice, loc)
    }
    cuMemPrefetchAsync @ 8000 as PFN_cuMemPrefetchAsync_v8000 => fn mem_prefetch_async_v8000(st, ptr: CUdeviceptr, count: usize, dev: CUdevice, stream: CUstream) {
        let loc = legacy_location(st, dev)?;
        if let Loc::Device(_) = loc {
            check_stream_device(st, stream)?;
        } else {
            crate::stream::stream(st, stream)?;
        }
        let (s, p, n) = request(st, ptr, count, RangeOp::Prefetch(loc))?;
        enqueue_ops(st, stream, vec![(s, p, n, RangeOp::Prefetch(loc))])
    }
    cuMemPrefetchAsync @ 12020 as PFN_cuMemPrefetchAsync_v12020 => fn mem_prefetch_async_v12020(st, ptr: CUdeviceptr, count: usize, location: CUmemLocation, flags: c_uint, stream: CUstream) {
        if flags != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let loc = prefetch_location(st, &location)?;
        if let Loc::Device(_) = loc {
            check_stream_device(st, stream)?;
        } else {
            crate::stream::stream(st, stream)?;
        }
        let (s, p, n) = request(st, ptr, count, RangeOp::Prefetch(loc))?;
        enqueue_ops(st, stream, vec![(s, p, n, RangeOp::Prefetch(loc))])
    }
    cuMemPrefetchBatchAsync @ 13000 as PFN_cuMemPrefetchBatchAsync_v13000 => fn mem_prefetch_batch_async(st, dptrs: *mut CUdeviceptr, sizes: *mut usize, count: usize, locs: *mut CUmemLocation, idxs: *mut usize, nlocs: usize, flags: c_ulonglong, stream: CUstream) {
        let ranges = check_batch(st, dptrs, sizes, count, flags, stream)?;
        let per_op = batch_locations(st, locs, idxs, nlocs, count)?;
        batch(st, ranges, per_op.into_iter().map(RangeOp::Prefetch).collect(), stream)
    }
    cuMemDiscardBatchAsync @ 13000 as PFN_cuMemDiscardBatchAsync_v13000 => fn mem_discard_batch_async(st, dptrs: *mut CUdeviceptr, sizes: *mut usize, count: usize, flags: c_ulonglong, stream: CUstream) {
        let ranges = check_batch(st, dptrs, sizes, count, flags, stream)?;
        let ops = vec![RangeOp::Discard; ranges.len()];
        batch(st, ranges, ops, stream)
    }
    cuMemDiscardAndPrefetchBatchAsync @ 13000 as PFN_cuMemDiscardAndPrefetchBatchAsync_v13000 => fn mem_discard_and_prefetch_batch_async(st, dptrs: *mut CUdeviceptr, sizes: *mut usize, count: usize, locs: *mut CUmemLocation, idxs: *mut usize, nlocs: usize, flags: c_ulonglong, stream: CUstream) {
        let ranges = check_batch(st, dptrs, sizes, count, flags, stream)?;
        let per_op = batch_locations(st, locs, idxs, nlocs, count)?;
        batch(st, ranges, per_op.into_iter().map(RangeOp::DiscardAndPrefetch).collect(), stream)
    }
    cuMemRangeGetAttribute @ 8000 as PFN_cuMemRangeGetAttribute_v8000 => fn mem_range_get_attribute(st, data: *mut c_void, size: usize, attr: CUmem_range_attribute, ptr: CUdeviceptr, count: usize) {
        let pages = with_pages(st, ptr, count, |p| p.to_vec())?;
        attribute(st, attr, &pages, data, size)
    }
    cuMemRangeGetAttributes @ 8000 as PFN_cuMemRangeGetAttributes_v8000 => fn mem_range_get_attributes(st, data: *mut *mut c_void, sizes: *mut usize, attrs: *mut CUmem_range_attribute, n: usize, ptr: CUdeviceptr, count: usize) {
        if data.is_null() || sizes.is_null() || attrs.is_null() || n == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let pages = with_pages(st, ptr, count, |p| p.to_vec())?;
        for i in 0..n {
            attribute(st, *attrs.add(i), &pages, *data.add(i), *sizes.add(i))?;
        }
        Ok(())
    }
}

impl crate::Simulator {
    /// Where the simulated driver keeps the managed range `[ptr, ptr + len)` now: the location
    /// type and id when every page of it lives at one location (after the stream operations that
    /// moved it ran), `None` when its pages are spread, not populated, discarded, or the range is
    /// not managed memory. For tests; the real driver has no such query.
    pub fn managed_residence(&self, ptr: u64, len: usize) -> Option<(CUmemLocationType, i32)> {
        let st = &self.session.state;
        let pages = with_pages(st, ptr as CUdeviceptr, len, |p| p.to_vec()).ok()?;
        let first = pages.first()?.resident?;
        pages
            .iter()
            .all(|p| p.resident == Some(first))
            .then(|| first.type_and_id())
    }
}
