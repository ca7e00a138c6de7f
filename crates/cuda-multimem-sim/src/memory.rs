//! Simulated device memory is real host memory: every device address is a host address, and the
//! simulator keeps a map of which ranges are device memory (whose, with what access), so copies
//! and kernels touching anything else fail with the driver's error instead of crashing.

use std::collections::BTreeMap;
use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cuda_multimem_sys::*;
use parking_lot::Mutex;

use crate::device::current_device;
use crate::dispatch::sim_api;
use crate::state::{out, SimResult, State};

/// What a registered range is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RegionKind {
    /// `cuMemAlloc`.
    Alloc,
    /// Page-locked host memory (`cuMemAllocHost`).
    Host,
    /// A VMM mapping.
    Mapping,
    /// Managed memory.
    Managed,
    /// A multicast mapping (stores reach every bound device's memory).
    Multicast,
}

/// Where stores into a multicast region go: the addresses backing `[offset, offset + len)` on
/// every bound device.
pub(crate) trait Redirect: Send + Sync {
    fn targets(&self, offset: usize, len: usize) -> SimResult<Vec<usize>>;
}

#[derive(Clone)]
pub(crate) struct Region {
    pub len: usize,
    pub kind: RegionKind,
    /// The device whose memory this is (`None`: host or managed).
    pub device: Option<i32>,
    /// Whether device code and copies may read / write it.
    pub readable: bool,
    pub writable: bool,
    pub redirect: Option<Arc<dyn Redirect>>,
}

/// A checked piece of a range: (address, length, multicast redirect with the piece's offset in its
/// region).
pub(crate) type Piece = (usize, usize, Option<(usize, Arc<dyn Redirect>)>);

#[derive(Default)]
pub(crate) struct Memory {
    regions: Mutex<BTreeMap<usize, Region>>,
    used: Mutex<BTreeMap<i32, u64>>,
    allocs: Mutex<BTreeMap<usize, (usize, i32)>>,
    hosts: Mutex<BTreeMap<usize, usize>>,
    pub bytes_copied: AtomicU64,
    /// By `cuMemAlloc` allocation (its start): the streams of other devices that were given
    /// copies to or from it (its free waits for them too, as the real driver's does).
    touchers: Mutex<BTreeMap<usize, Vec<std::sync::Weak<crate::stream::Stream>>>>,
}

impl Memory {
    pub fn insert(&self, start: usize, region: Region) {
        self.regions.lock().insert(start, region);
    }
    pub fn remove(&self, start: usize) -> Option<Region> {
        self.regions.lock().remove(&start)
    }
    /// Update the access of the region starting at `start`.
    pub fn set_access(&self, start: usize, readable: bool, writable: bool) {
        if let Some(r) = self.regions.lock().get_mut(&start) {
            r.readable = readable;
            r.writable = writable;
        }
    }
    /// The region containing `addr`, with its start.
    pub fn find(&self, addr: usize) -> Option<(usize, Region)> {
        let g = self.regions.lock();
        let (s, r) = g.range(..=addr).next_back()?;
        (addr < s + r.len).then(|| (*s, r.clone()))
    }
    /// Account `bytes` of device `dev`'s memory as used (negative: freed).
    pub fn charge(&self, dev: i32, bytes: i64) {
        let mut g = self.used.lock();
        let e = g.entry(dev).or_insert(0);
        *e = (*e as i64 + bytes).max(0) as u64;
    }
    pub fn used(&self, dev: i32) -> u64 {
        self.used.lock().get(&dev).copied().unwrap_or(0)
    }

    /// Check that `[addr, addr+len)` is covered by contiguous accessible regions. Returns the
    /// pieces, each with its redirect (multicast) if any.
    pub fn check(&self, addr: usize, len: usize, write: bool) -> SimResult<Vec<Piece>> {
        let mut pieces = Vec::new();
        let mut a = addr;
        let end = addr
            .checked_add(len)
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        while a < end {
            let (s, r) = self.find(a).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
            if !r.readable || (write && !r.writable) {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            let n = (s + r.len).min(end) - a;
            pieces.push((a, n, r.redirect.clone().map(|rd| (a - s, rd))));
            a += n;
        }
        Ok(pieces)
    }
}

/// Whether `addr` is device (or managed, or pinned) memory known to the simulator.
pub(crate) fn is_device_memory(st: &State, addr: usize) -> bool {
    st.ext::<Memory>().find(addr).is_some()
}

/// Anonymous read-write memory of `len` bytes (rounded to pages).
pub(crate) fn map_anonymous(len: usize) -> SimResult<usize> {
    // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok(p as usize)
}

/// Undo [`map_anonymous`].
pub(crate) fn unmap(addr: usize, len: usize) {
    // SAFETY: the range was mapped by this module and nothing refers to it any more.
    unsafe { libc::munmap(addr as *mut c_void, len.max(1)) };
}

/// Copy `len` bytes from `src` to `dst`, either of which may be device memory. Device ranges are
/// checked; stores into a multicast region reach every bound device.
pub(crate) fn copy(st: &State, dst: usize, src: usize, len: usize) -> SimResult {
    if len == 0 {
        return Ok(());
    }
    let m = st.ext::<Memory>();
    let src_pieces = match m.find(src) {
        Some(_) => m.check(src, len, false)?,
        None => Vec::new(),
    };
    // A plain load through a multicast region reads the lowest bound device's memory.
    let mut staged: Option<Vec<u8>> = None;
    if src_pieces.iter().any(|p| p.2.is_some()) {
        let mut buf = vec![0u8; len];
        let mut done = 0;
        for (a, n, redirect) in &src_pieces {
            let from = match redirect {
                Some((offset, r)) => r.targets(*offset, *n)?[0],
                None => *a,
            };
            // SAFETY: `from..from+n` is checked, readable device memory; `buf` has `len` bytes.
            unsafe { std::ptr::copy(from as *const u8, buf.as_mut_ptr().add(done), *n) };
            done += n;
        }
        staged = Some(buf);
    }
    let src = staged.as_ref().map_or(src, |b| b.as_ptr() as usize);
    let pieces = if m.find(dst).is_some() {
        Some(m.check(dst, len, true)?)
    } else {
        None
    };
    m.bytes_copied.fetch_add(len as u64, Ordering::Relaxed);
    match pieces {
        None => {
            // SAFETY: host destination given by the caller (as with the real driver, an invalid
            // host pointer is the caller's fault); the device source was checked above.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
        }
        Some(pieces) => {
            let mut done = 0;
            for (a, n, redirect) in pieces {
                let targets = match redirect {
                    Some((offset, r)) => r.targets(offset, n)?,
                    None => vec![a],
                };
                for t in targets {
                    // SAFETY: `t..t+n` is checked, writable device memory; the source is checked
                    // device memory or caller-provided host memory.
                    unsafe { std::ptr::copy((src + done) as *const u8, t as *mut u8, n) };
                }
                done += n;
            }
        }
    }
    Ok(())
}

/// Fill `count` elements of `width` bytes at `dst` with `value`.
pub(crate) fn fill(st: &State, dst: usize, value: u32, width: usize, count: usize) -> SimResult {
    let len = count
        .checked_mul(width)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if !dst.is_multiple_of(width) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // `repeat` doubles with memcpy: a byte loop took most of a second per 8 MiB in test builds
    let pattern = value.to_le_bytes()[..width].repeat(count);
    copy(st, dst, pattern.as_ptr() as usize, len)
}

/// An operation queued on `stream` that copies.
fn copy_async(st: &Arc<State>, dst: usize, src: usize, len: usize, stream: CUstream) -> SimResult {
    let m = st.ext::<Memory>();
    // Validate now, as the real driver does for the arguments it can check at enqueue time.
    if m.find(src).is_some() {
        m.check(src, len, false)?;
    }
    if m.find(dst).is_some() {
        m.check(dst, len, true)?;
    }
    // A copy of a device allocation queued on another device's stream: the allocation's free
    // waits for that stream.
    let on = crate::stream::stream(st, stream)?;
    for a in [src, dst] {
        let owner = m
            .allocs
            .lock()
            .range(..=a)
            .next_back()
            .map(|(&s, &(n, d))| (s, n, d));
        if let Some((start, _, _)) = owner.filter(|&(s, n, d)| a < s + n && d != on.device) {
            let mut t = m.touchers.lock();
            let v = t.entry(start).or_default();
            v.retain(|w| w.strong_count() > 0);
            if !v.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&on))) {
                v.push(Arc::downgrade(&on));
            }
        }
    }
    let s2 = st.clone();
    crate::stream::enqueue_on(
        st,
        &on,
        Arc::new(move || {
            crate::kernel::delay(&s2);
            copy(&s2, dst, src, len)
        }),
    )
}

/// A synchronous copy or memset: wait for what the real driver waits for first (the legacy
/// stream and the blocking streams of the current device, not its non-blocking streams), then
/// run `f` on the calling thread.
fn sync_then<T>(st: &State, f: impl FnOnce() -> SimResult<T>) -> SimResult<T> {
    if let Ok(dev) = current_device(st) {
        crate::stream::synchronize_legacy(st, dev)?;
    }
    f()
}

/// Bytes of a synchronous host-to-device copy from pageable memory that have reached the
/// device when the call returns; the rest is staged and lands in the legacy stream's order, as
/// soon as somebody waits for that stream (a synchronise, a synchronous copy, a blocking
/// stream's next operation) or at the latest [`PAGEABLE_DMA_MAX_DELAY`] later. The real driver
/// returns once pageable data are staged ("the DMA to final destination may not have
/// completed"); on 2 x H200 a kernel on a non-blocking stream read the old bytes past the first
/// MiB of such a copy.
pub const PAGEABLE_SYNC_BYTES: usize = 1 << 20;
/// See [`PAGEABLE_SYNC_BYTES`].
pub const PAGEABLE_DMA_MAX_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

/// `cuMemcpyHtoD`: pinned (or other simulator-known) sources copy at once; pageable ones copy
/// their first [`PAGEABLE_SYNC_BYTES`] at once and the rest, staged now, later on the legacy
/// stream.
fn htod_sync(st: &Arc<State>, dst: usize, src: usize, len: usize) -> SimResult {
    sync_then(st, || {
        if len <= PAGEABLE_SYNC_BYTES || st.ext::<Memory>().find(src).is_some() {
            return copy(st, dst, src, len);
        }
        st.ext::<Memory>().check(dst, len, true)?;
        copy(st, dst, src, PAGEABLE_SYNC_BYTES)?;
        // SAFETY: the caller's source is readable for `len` bytes during the call.
        let staged: Arc<Vec<u8>> = Arc::new(
            unsafe {
                std::slice::from_raw_parts(
                    (src + PAGEABLE_SYNC_BYTES) as *const u8,
                    len - PAGEABLE_SYNC_BYTES,
                )
            }
            .to_vec(),
        );
        let s2 = st.clone();
        let legacy = crate::stream::stream(st, std::ptr::null_mut())?;
        let since = legacy.flushes();
        let l2 = legacy.clone();
        crate::stream::implicit_order(st, &legacy)?;
        legacy.enqueue(Arc::new(move || {
            l2.wait_flush(since, PAGEABLE_DMA_MAX_DELAY);
            copy(
                &s2,
                dst + PAGEABLE_SYNC_BYTES,
                staged.as_ptr() as usize,
                staged.len(),
            )
        }))
    })
}

/// `cuMemsetD8`/`cuMemsetD32`: asynchronous with respect to the host, on the legacy stream,
/// except for pinned host and managed memory (synchronous).
fn memset_sync(st: &Arc<State>, dst: usize, v: u32, width: usize, n: usize) -> SimResult {
    if is_plain_device_memory(st, dst) {
        st.ext::<Memory>()
            .check(dst, n.saturating_mul(width), true)?;
        on_legacy_stream(st, move |st| fill(st, dst, v, width, n))
    } else {
        sync_then(st, || fill(st, dst, v, width, n))
    }
}

/// Device memory proper (allocations, VMM and multicast mappings): not pinned host memory, not
/// managed memory, not unknown (pageable) memory.
fn is_plain_device_memory(st: &State, addr: usize) -> bool {
    matches!(
        st.ext::<Memory>().find(addr),
        Some((_, r)) if !matches!(r.kind, RegionKind::Host | RegionKind::Managed)
    )
}

/// A synchronous device-to-device copy or a memset of device memory: no host-side
/// synchronisation, queued on the legacy stream (the real driver's behaviour).
fn on_legacy_stream(
    st: &Arc<State>,
    op: impl Fn(&State) -> SimResult + Send + Sync + 'static,
) -> SimResult {
    let s2 = st.clone();
    crate::stream::enqueue(st, std::ptr::null_mut(), Arc::new(move || op(&s2)))
}

/// One copy of a batch: destination, source, length, and the source's bytes as they were
/// during the call when its access order says so.
type BatchCopy = (usize, usize, usize, Option<Arc<Vec<u8>>>);

/// `cuMemcpyBatchAsync` at either ABI (`fail_idx`: the 12080 form's out-parameter, null for
/// the 13000 form). Checks what cuda.h documents, at enqueue time: a non-empty batch with its
/// three arrays, a stream that is not the legacy default stream (null or `CU_STREAM_LEGACY`),
/// between 1 and `count` attribute sets whose indices start at 0, increase strictly and stay
/// below `count`, each with a valid `srcAccessOrder` and known flags (`CUDA_ERROR_INVALID_VALUE`
/// otherwise); each copy's device ranges as `cuMemcpyAsync` checks them (a refused copy's index
/// goes to `fail_idx`, `usize::MAX` for errors of the batch as a whole). The batch then runs as
/// one operation in stream order (captured like the other asynchronous copies); a source with
/// `CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL` is read before the call returns, as that
/// order promises the caller, and `PREFER_OVERLAP_WITH_COMPUTE` changes nothing here.
///
/// # Safety
/// Non-null arrays are valid for `count` (`dsts`, `srcs`, `sizes`) and `num_attrs` (`attrs`,
/// `attrs_idxs`) reads; `fail_idx` is null or valid for one write.
#[allow(clippy::too_many_arguments)]
unsafe fn memcpy_batch(
    st: &Arc<State>,
    dsts: *const CUdeviceptr,
    srcs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    attrs: *const CUmemcpyAttributes,
    attrs_idxs: *const usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    h: CUstream,
) -> SimResult {
    let fail = |i: usize| {
        if !fail_idx.is_null() {
            // SAFETY: non-null, valid for one write (the caller's promise).
            unsafe { fail_idx.write(i) };
        }
    };
    fail(usize::MAX);
    let invalid = Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    if count == 0 || dsts.is_null() || srcs.is_null() || sizes.is_null() {
        return invalid;
    }
    if attrs.is_null() || attrs_idxs.is_null() || num_attrs == 0 || num_attrs > count {
        return invalid;
    }
    // `CU_STREAM_LEGACY` is handle 1; the per-thread default stream (2) is a real stream.
    if (h as u64) <= 1 {
        return invalid;
    }
    // SAFETY: non-null, and the caller promises `count` / `num_attrs` elements.
    let (dsts, srcs, sizes, attrs, idxs) = unsafe {
        (
            std::slice::from_raw_parts(dsts, count),
            std::slice::from_raw_parts(srcs, count),
            std::slice::from_raw_parts(sizes, count),
            std::slice::from_raw_parts(attrs, num_attrs),
            std::slice::from_raw_parts(attrs_idxs, num_attrs),
        )
    };
    if idxs[0] != 0 || idxs.windows(2).any(|w| w[0] >= w[1]) || idxs[num_attrs - 1] >= count {
        return invalid;
    }
    let known_flags = CUmemcpyFlags_enum::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE.0;
    type Order = CUmemcpySrcAccessOrder_enum;
    for a in attrs {
        let order_ok = matches!(
            a.srcAccessOrder,
            Order::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                | Order::CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL
                | Order::CU_MEMCPY_SRC_ACCESS_ORDER_ANY
        );
        if !order_ok || a.flags & !known_flags != 0 {
            return invalid;
        }
    }
    let s = crate::stream::stream(st, h)?;
    let m = st.ext::<Memory>();
    let mut copies: Vec<BatchCopy> = Vec::with_capacity(count);
    for i in 0..count {
        let (d, src, n) = (dsts[i] as usize, srcs[i] as usize, sizes[i]);
        let attr = &attrs[idxs.partition_point(|&k| k <= i) - 1];
        let checked = (|| {
            if m.find(src).is_some() {
                m.check(src, n, false)?;
            }
            if m.find(d).is_some() {
                m.check(d, n, true)?;
            }
            if attr.srcAccessOrder != Order::CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL {
                return Ok(None);
            }
            let mut now = vec![0u8; n];
            copy(st, now.as_mut_ptr() as usize, src, n)?;
            Ok(Some(Arc::new(now)))
        })();
        match checked {
            Ok(now) => copies.push((d, src, n, now)),
            Err(e) => {
                fail(i);
                return Err(e);
            }
        }
    }
    let s2 = st.clone();
    crate::stream::implicit_order(st, &s)?;
    s.enqueue(Arc::new(move || {
        for (d, src, n, now) in &copies {
            let from = now.as_ref().map_or(*src, |b| b.as_ptr() as usize);
            copy(&s2, *d, from, *n)?;
        }
        Ok(())
    }))
}

sim_api! {
    cuMemGetInfo @ 3020 as PFN_cuMemGetInfo_v3020 => fn mem_get_info(st, free: *mut usize, total: *mut usize) {
        let dev = current_device(st)?;
        let t = st.device(dev)?.memory;
        let used = st.ext::<Memory>().used(dev);
        out(free, t.saturating_sub(used) as usize)?;
        out(total, t as usize)
    }
    cuMemAlloc @ 3020 as PFN_cuMemAlloc_v3020 => fn mem_alloc(st, dptr: *mut CUdeviceptr, size: usize) {
        if dptr.is_null() || size == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let dev = current_device(st)?;
        let m = st.ext::<Memory>();
        if m.used(dev).saturating_add(size as u64) > st.device(dev)?.memory {
            return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
        let a = map_anonymous(size)?;
        m.insert(a, Region { len: size, kind: RegionKind::Alloc, device: Some(dev), readable: true, writable: true, redirect: None });
        m.allocs.lock().insert(a, (size, dev));
        m.charge(dev, size as i64);
        st.live_add("device allocations", 1);
        out(dptr, a as CUdeviceptr)
    }
    cuMemFree @ 3020 as PFN_cuMemFree_v3020 => fn mem_free(st, dptr: CUdeviceptr) {
        let m = st.ext::<Memory>();
        let Some((size, dev)) = m.allocs.lock().remove(&(dptr as usize)) else {
            return crate::managed::free(st, dptr as usize);
        };
        // The real driver waits for the work queued on the device, non-blocking streams
        // included (2 x H200, driver 580: a free behind a 300 ms kernel and a copy reading the
        // buffer returned after 300 ms, the stream idle); a synchronous copy waits for less
        // (`sync_then`)...
        if let Ok(current) = current_device(st) {
            crate::stream::synchronize_device(st, current)?;
        }
        // and for the other devices' streams given copies of this allocation (2 x H200: a free
        // on device 0 waited 300 ms for a copy reading it on a stream of device 1, and 0.1 ms
        // with unrelated work queued on device 1)
        let others: Vec<_> = m.touchers.lock().remove(&(dptr as usize)).into_iter().flatten().filter_map(|w| w.upgrade()).collect();
        crate::stream::synchronize_streams(others)?;
        m.remove(dptr as usize);
        unmap(dptr as usize, size);
        m.charge(dev, -(size as i64));
        st.live_add("device allocations", -1);
        Ok(())
    }
    cuMemAllocHost @ 3020 as PFN_cuMemAllocHost_v3020 => fn mem_alloc_host(st, pp: *mut *mut c_void, size: usize) {
        if pp.is_null() || size == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let a = map_anonymous(size)?;
        let m = st.ext::<Memory>();
        m.insert(a, Region { len: size, kind: RegionKind::Host, device: None, readable: true, writable: true, redirect: None });
        m.hosts.lock().insert(a, size);
        st.live_add("host allocations", 1);
        out(pp, a as *mut c_void)
    }
    cuMemFreeHost @ 2000 as PFN_cuMemFreeHost_v2000 => fn mem_free_host(st, p: *mut c_void) {
        let m = st.ext::<Memory>();
        let size = m.hosts.lock().remove(&(p as usize)).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        m.remove(p as usize);
        unmap(p as usize, size);
        st.live_add("host allocations", -1);
        Ok(())
    }
    cuMemcpy @ 4000 as PFN_cuMemcpy_v4000 => fn memcpy(st, dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        let (d, s) = (dst as usize, src as usize);
        match (is_plain_device_memory(st, d), is_plain_device_memory(st, s)) {
            (true, true) => {
                let m = st.ext::<Memory>();
                m.check(s, n, false)?;
                m.check(d, n, true)?;
                on_legacy_stream(st, move |st| copy(st, d, s, n))
            }
            (true, false) => htod_sync(st, d, s, n),
            _ => sync_then(st, || copy(st, d, s, n)),
        }
    }
    cuMemcpyHtoD @ 3020 as PFN_cuMemcpyHtoD_v3020 => fn memcpy_htod(st, dst: CUdeviceptr, src: *const c_void, n: usize) {
        if n > 0 && (src.is_null() || !is_device_memory(st, dst as usize)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        htod_sync(st, dst as usize, src as usize, n)
    }
    cuMemcpyDtoH @ 3020 as PFN_cuMemcpyDtoH_v3020 => fn memcpy_dtoh(st, dst: *mut c_void, src: CUdeviceptr, n: usize) {
        if n > 0 && (dst.is_null() || !is_device_memory(st, src as usize)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        sync_then(st, || copy(st, dst as usize, src as usize, n))
    }
    cuMemcpyDtoD @ 3020 as PFN_cuMemcpyDtoD_v3020 => fn memcpy_dtod(st, dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        if n > 0 && (!is_device_memory(st, src as usize) || !is_device_memory(st, dst as usize)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let (d, s) = (dst as usize, src as usize);
        let m = st.ext::<Memory>();
        m.check(s, n, false)?;
        m.check(d, n, true)?;
        on_legacy_stream(st, move |st| copy(st, d, s, n))
    }
    cuMemcpyAsync @ 4000 as PFN_cuMemcpyAsync_v4000 => fn memcpy_async(st, dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) {
        copy_async(st, dst as usize, src as usize, n, s)
    }
    cuMemcpyHtoDAsync @ 3020 as PFN_cuMemcpyHtoDAsync_v3020 => fn memcpy_htod_async(st, dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) {
        if n > 0 && (src.is_null() || !is_device_memory(st, dst as usize)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        copy_async(st, dst as usize, src as usize, n, s)
    }
    cuMemcpyDtoHAsync @ 3020 as PFN_cuMemcpyDtoHAsync_v3020 => fn memcpy_dtoh_async(st, dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) {
        if n > 0 && (dst.is_null() || !is_device_memory(st, src as usize)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        copy_async(st, dst as usize, src as usize, n, s)
    }
    cuMemcpyDtoDAsync @ 3020 as PFN_cuMemcpyDtoDAsync_v3020 => fn memcpy_dtod_async(st, dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) {
        copy_async(st, dst as usize, src as usize, n, s)
    }
    cuMemcpyBatchAsync @ 12080 as PFN_cuMemcpyBatchAsync_v12080 => fn memcpy_batch_async_v12080(st, dsts: *mut CUdeviceptr, srcs: *mut CUdeviceptr, sizes: *mut usize, count: usize, attrs: *mut CUmemcpyAttributes, attrs_idxs: *mut usize, num_attrs: usize, fail_idx: *mut usize, h: CUstream) {
        memcpy_batch(st, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, h)
    }
    cuMemcpyBatchAsync @ 13000 as PFN_cuMemcpyBatchAsync_v13000 => fn memcpy_batch_async_v13000(st, dsts: *mut CUdeviceptr, srcs: *mut CUdeviceptr, sizes: *mut usize, count: usize, attrs: *mut CUmemcpyAttributes, attrs_idxs: *mut usize, num_attrs: usize, h: CUstream) {
        memcpy_batch(st, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, std::ptr::null_mut(), h)
    }
    cuMemcpyPeer @ 4000 as PFN_cuMemcpyPeer_v4000 => fn memcpy_peer(st, dst: CUdeviceptr, dctx: CUcontext, src: CUdeviceptr, sctx: CUcontext, n: usize) {
        crate::device::context_device(st, dctx)?;
        crate::device::context_device(st, sctx)?;
        // device to device: no host-side synchronisation, in the legacy stream's order
        let (d, s) = (dst as usize, src as usize);
        let m = st.ext::<Memory>();
        m.check(s, n, false)?;
        m.check(d, n, true)?;
        on_legacy_stream(st, move |st| copy(st, d, s, n))
    }
    cuMemcpyPeerAsync @ 4000 as PFN_cuMemcpyPeerAsync_v4000 => fn memcpy_peer_async(st, dst: CUdeviceptr, dctx: CUcontext, src: CUdeviceptr, sctx: CUcontext, n: usize, s: CUstream) {
        crate::device::context_device(st, dctx)?;
        crate::device::context_device(st, sctx)?;
        copy_async(st, dst as usize, src as usize, n, s)
    }
    cuMemsetD8 @ 3020 as PFN_cuMemsetD8_v3020 => fn memset_d8(st, dst: CUdeviceptr, v: u8, n: usize) {
        memset_sync(st, dst as usize, v as u32, 1, n)
    }
    cuMemsetD32 @ 3020 as PFN_cuMemsetD32_v3020 => fn memset_d32(st, dst: CUdeviceptr, v: c_uint, n: usize) {
        memset_sync(st, dst as usize, v, 4, n)
    }
    cuMemsetD8Async @ 3020 as PFN_cuMemsetD8Async_v3020 => fn memset_d8_async(st, dst: CUdeviceptr, v: u8, n: usize, s: CUstream) {
        st.ext::<Memory>().check(dst as usize, n, true)?;
        let s2 = st.clone();
        crate::stream::enqueue(st, s, Arc::new(move || fill(&s2, dst as usize, v as u32, 1, n)))
    }
    cuMemsetD32Async @ 3020 as PFN_cuMemsetD32Async_v3020 => fn memset_d32_async(st, dst: CUdeviceptr, v: c_uint, n: usize, s: CUstream) {
        st.ext::<Memory>().check(dst as usize, n.saturating_mul(4), true)?;
        let s2 = st.clone();
        crate::stream::enqueue(st, s, Arc::new(move || fill(&s2, dst as usize, v, 4, n)))
    }
}

/// Free everything still allocated (end of the session).
pub(crate) fn teardown(st: &State) {
    let m = st.ext::<Memory>();
    for (a, (size, _)) in std::mem::take(&mut *m.allocs.lock()) {
        unmap(a, size);
    }
    for (a, size) in std::mem::take(&mut *m.hosts.lock()) {
        unmap(a, size);
    }
    m.regions.lock().clear();
}
