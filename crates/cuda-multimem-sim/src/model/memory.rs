//! Simulated device memory is real host memory: every device address is a host address, and the
//! simulator keeps a map of which ranges are device memory (whose, with what access), so copies
//! and kernels touching anything else fail with the driver's error instead of crashing.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cuda_multimem_sys::*;
use parking_lot::Mutex;

use super::context::current_device;
use super::stream::{self, Stream};
use crate::state::{SimResult, State};

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
    touchers: Mutex<BTreeMap<usize, Vec<std::sync::Weak<Stream>>>>,
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
pub(crate) fn copy_async(
    st: &Arc<State>,
    dst: usize,
    src: usize,
    len: usize,
    stream: CUstream,
) -> SimResult {
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
    let on = stream::stream(st, stream)?;
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
    stream::enqueue_on(
        st,
        &on,
        Arc::new(move || {
            super::delay::delay(&s2);
            copy(&s2, dst, src, len)
        }),
    )
}

/// A synchronous copy or memset: wait for what the real driver waits for first (the legacy
/// stream and the blocking streams of the current device, not its non-blocking streams), then
/// run `f` on the calling thread.
pub(crate) fn sync_then<T>(st: &State, f: impl FnOnce() -> SimResult<T>) -> SimResult<T> {
    if let Ok(dev) = current_device(st) {
        stream::synchronize_legacy(st, dev)?;
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
pub(crate) fn htod_sync(st: &Arc<State>, dst: usize, src: usize, len: usize) -> SimResult {
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
        let legacy = stream::stream(st, std::ptr::null_mut())?;
        let since = legacy.flushes();
        let l2 = legacy.clone();
        stream::implicit_order(st, &legacy)?;
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
pub(crate) fn memset_sync(
    st: &Arc<State>,
    dst: usize,
    v: u32,
    width: usize,
    n: usize,
) -> SimResult {
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
pub(crate) fn is_plain_device_memory(st: &State, addr: usize) -> bool {
    matches!(
        st.ext::<Memory>().find(addr),
        Some((_, r)) if !matches!(r.kind, RegionKind::Host | RegionKind::Managed)
    )
}

/// A synchronous device-to-device copy or a memset of device memory: no host-side
/// synchronisation, queued on the legacy stream (the real driver's behaviour).
pub(crate) fn on_legacy_stream(
    st: &Arc<State>,
    op: impl Fn(&State) -> SimResult + Send + Sync + 'static,
) -> SimResult {
    let s2 = st.clone();
    stream::enqueue(st, std::ptr::null_mut(), Arc::new(move || op(&s2)))
}

/// The current device's memory: (free, total) bytes.
pub(crate) fn info(st: &State) -> SimResult<(u64, u64)> {
    let dev = current_device(st)?;
    let t = st.device(dev)?.memory;
    let used = st.ext::<Memory>().used(dev);
    Ok((t.saturating_sub(used), t))
}

/// `cuMemAlloc` of `size` bytes (non-zero) on the current device; the address.
pub(crate) fn alloc(st: &State, size: usize) -> SimResult<usize> {
    let dev = current_device(st)?;
    let m = st.ext::<Memory>();
    if m.used(dev).saturating_add(size as u64) > st.device(dev)?.memory {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    let a = map_anonymous(size)?;
    m.insert(
        a,
        Region {
            len: size,
            kind: RegionKind::Alloc,
            device: Some(dev),
            readable: true,
            writable: true,
            redirect: None,
        },
    );
    m.allocs.lock().insert(a, (size, dev));
    m.charge(dev, size as i64);
    st.live_add("device allocations", 1);
    Ok(a)
}

/// `cuMemFree` of a `cuMemAlloc` allocation; `None` when `ptr` is not one (it may be managed).
pub(crate) fn free(st: &State, ptr: usize) -> Option<SimResult> {
    let m = st.ext::<Memory>();
    let (size, dev) = m.allocs.lock().remove(&ptr)?;
    Some((|| {
        // The real driver waits for the work queued on the device, non-blocking streams
        // included (2 x H200, driver 580: a free behind a 300 ms kernel and a copy reading the
        // buffer returned after 300 ms, the stream idle); a synchronous copy waits for less
        // (`sync_then`)...
        if let Ok(current) = current_device(st) {
            stream::synchronize_device(st, current)?;
        }
        // and for the other devices' streams given copies of this allocation (2 x H200: a free
        // on device 0 waited 300 ms for a copy reading it on a stream of device 1, and 0.1 ms
        // with unrelated work queued on device 1)
        let others: Vec<_> = m
            .touchers
            .lock()
            .remove(&ptr)
            .into_iter()
            .flatten()
            .filter_map(|w| w.upgrade())
            .collect();
        stream::synchronize_streams(others)?;
        m.remove(ptr);
        unmap(ptr, size);
        m.charge(dev, -(size as i64));
        st.live_add("device allocations", -1);
        Ok(())
    })())
}

/// `cuMemAllocHost` of `size` bytes (non-zero) of page-locked host memory; the address.
pub(crate) fn alloc_host(st: &State, size: usize) -> SimResult<usize> {
    let a = map_anonymous(size)?;
    let m = st.ext::<Memory>();
    m.insert(
        a,
        Region {
            len: size,
            kind: RegionKind::Host,
            device: None,
            readable: true,
            writable: true,
            redirect: None,
        },
    );
    m.hosts.lock().insert(a, size);
    st.live_add("host allocations", 1);
    Ok(a)
}

/// Whether `addr` lies in page-locked host memory (`cuMemAllocHost`, `cuMemHostAlloc`).
pub(crate) fn is_host_memory(st: &State, addr: usize) -> bool {
    st.ext::<Memory>()
        .find(addr)
        .is_some_and(|(_, r)| r.kind == RegionKind::Host)
}

/// `cuMemFreeHost`.
pub(crate) fn free_host(st: &State, p: usize) -> SimResult {
    let m = st.ext::<Memory>();
    let size = m
        .hosts
        .lock()
        .remove(&p)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    m.remove(p);
    unmap(p, size);
    st.live_add("host allocations", -1);
    Ok(())
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
