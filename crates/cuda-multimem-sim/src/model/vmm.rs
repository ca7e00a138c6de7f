//! Virtual memory management: physical allocations (`cuMemCreate`), address reservations,
//! mappings, access, granularity, and shareable handles (POSIX fds and fabric handles).
//!
//! A physical allocation is a memfd of its size. A reservation is a `PROT_NONE` anonymous
//! mapping; `cuMemMap` maps the memfd over part of it (`MAP_FIXED | MAP_SHARED`), so two mappings
//! of one allocation — in one process or in two — see the same bytes. A mapping starts with no
//! access; `cuMemSetAccess` makes it readable (and writable) for the simulated devices and the
//! host. `cuMemUnmap` takes the range out of the memory map at once and puts the `PROT_NONE`
//! reservation back once the work queued before it on the devices granted access has finished
//! (see [`Retired`]).
//!
//! The memory of an allocation is given back when its last handle reference is released and its
//! last mapping unmapped (`cuMemRelease`'s rule); then the device's memory, as `cuMemGetInfo`
//! reports it, is free again.
//!
//! Shareable handles: a POSIX fd is a `dup` of the memfd; an importer recognises it by the memfd's
//! name (`/proc/self/fd/N` reads `/memfd:cuda-multimem-sim/...`), which also carries the
//! allocation's location and handle types. A fabric handle is 64 bytes — magic, version, the
//! exporter's pid and the fd number of the memfd it keeps open, size, inode, location, handle
//! types, checksum — that another process of the same user imports by opening
//! `/proc/<pid>/fd/<n>` while the exporter keeps the allocation.
// `usize::is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use cuda_multimem_sys::*;
use parking_lot::Mutex;

use super::device::same_clique;
use super::memory::{Memory, Region, RegionKind};
use super::stream;
use crate::state::{is_kind, new_handle, Kind, SimResult, State};

const MEMFD_PREFIX: &str = "cuda-multimem-sim/";
const FABRIC_MAGIC: u32 = 0x434D_4D46; // "CMMF"
const FABRIC_VERSION: u16 = 1;

pub(crate) const HT_POSIX: u32 =
    CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
pub(crate) const HT_WIN32: u32 = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_WIN32.0;
pub(crate) const HT_WIN32_KMT: u32 = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_WIN32_KMT.0;
pub(crate) const HT_FABRIC: u32 = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC.0;

const LOC_DEVICE: u32 = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE.0;
const LOC_HOST: u32 = CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST.0;
const LOC_HOST_NUMA: u32 = CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA.0;

const PROT_NONE: u32 = CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE.0;
const PROT_READ: u32 = CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ.0;
const PROT_RW: u32 = CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE.0;

/// One physical allocation (possibly imported): its memfd and what it was created with.
struct Alloc {
    fd: OwnedFd,
    size: usize,
    loc_type: u32,
    loc_id: i32,
    handle_types: u32,
    rdma: u8,
    /// The device whose memory was charged for it (created here on a device).
    charged: Option<i32>,
    /// Handle references plus mappings; the memory goes when it reaches zero.
    refs: u32,
}

struct Mapping {
    size: usize,
    alloc: u64,
    /// Offset of the mapping in its allocation.
    offset: usize,
    /// Access per location `(type, id)`.
    access: BTreeMap<(u32, i32), u32>,
}

struct Reservation {
    size: usize,
    /// Whether it lies in the arena (else it is a mapping of its own, at a caller's hint).
    in_arena: bool,
    /// Mappings inside it, by start address.
    mappings: BTreeMap<usize, Mapping>,
}

/// An unmapped range whose host pages stay mapped until the work that could still use them has
/// finished. `cuMemUnmap` does not wait (the real driver does not: measured on 2 x H200), but a
/// simulated device's memory is host memory, and putting `PROT_NONE` back under a kernel that
/// reads it would crash the process instead of faulting a device. So the unmap takes the range
/// out of the memory map at once — work that checks it from then on (a launch, a copy, a kernel's
/// range check) fails as with an illegal address — and records, on every stream of the devices
/// granted access to it, the operations queued so far (its epoch); when each stream has
/// completed them (its worker runs the callback), the pages go. Work that checked the range
/// before the unmap was queued before it, so it is inside some epoch: a kernel already running
/// keeps reading the old pages. On a GPU that kernel's accesses after the unmap are undefined
/// behaviour; the simulator stays lenient there.
///
/// For the driver's API the mapping is gone at once: its allocation reference is dropped (so the
/// allocation, once released, is freed and its device memory counted free), and it is no live
/// resource; the host mapping keeps the memfd's pages alive until it is replaced.
struct Retired {
    start: usize,
    size: usize,
    /// Streams whose epoch has not passed yet, plus one for the unmap until it has registered
    /// with all of them.
    waiting: usize,
}

#[derive(Default)]
struct Tables {
    next_alloc: u64,
    allocs: HashMap<u64, Alloc>,
    /// handle -> (allocation id, references through this handle)
    handles: HashMap<u64, (u64, u32)>,
    /// start -> reservation
    reservations: BTreeMap<usize, Reservation>,
    arena: Option<Arena>,
    next_retired: u64,
    /// Unmapped ranges still mapped on the host, by id.
    retired: HashMap<u64, Retired>,
    /// start -> a reservation freed (`cuMemAddressFree`) while retired ranges inside it were
    /// still mapped: its addresses are given back when the last of them goes.
    draining: BTreeMap<usize, Reservation>,
}

/// The VMM area's state.
#[derive(Default)]
pub(crate) struct Vmm {
    t: Mutex<Tables>,
}

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

pub(crate) fn location(l: &CUmemLocation) -> (u32, i32) {
    // SAFETY: `id` is the union member for every location type this module accepts (device,
    // host, host NUMA); reading it as an int is valid for any bit pattern.
    (l.type_.0, unsafe { l.__bindgen_anon_1.id })
}

/// The allocation granularity (minimum, recommended) for a location, after validating it as
/// `cuMemCreate` does.
fn granularity_for(
    st: &State,
    loc_type: u32,
    loc_id: i32,
    handle_types: u32,
) -> SimResult<(usize, usize)> {
    match loc_type {
        LOC_DEVICE => {
            let d = st.device(loc_id)?;
            if !d.vmm {
                return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
            }
            if handle_types & HT_POSIX != 0 && !d.posix_fd_handle {
                return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
            }
            if handle_types & HT_FABRIC != 0 && !d.fabric_handle {
                return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
            }
            Ok(d.granularity)
        }
        LOC_HOST | LOC_HOST_NUMA => {
            // Host VMM allocations arrived with the host-VMM device attributes (141, 145).
            if st.version() < 12060 || !st.config.devices.iter().any(|d| d.vmm) {
                return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
            }
            if handle_types != 0 {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            if loc_type == LOC_HOST_NUMA
                && (loc_id < 0 || loc_id >= st.config.host_numa_nodes.max(1))
            {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            Ok(st.config.devices[0].granularity)
        }
        _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
}

/// Validate an allocation property block; returns (location type, id, handle types, granularity).
pub(crate) fn check_prop(
    st: &State,
    prop: &CUmemAllocationProp,
) -> SimResult<(u32, i32, u32, (usize, usize))> {
    if prop.type_ != CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let ht = prop.requestedHandleTypes.0;
    if ht & !(HT_POSIX | HT_WIN32 | HT_WIN32_KMT | HT_FABRIC) != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    if ht & (HT_WIN32 | HT_WIN32_KMT) != 0 {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    if !prop.win32HandleMetaData.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let (lt, id) = location(&prop.location);
    let g = granularity_for(st, lt, id, ht)?;
    Ok((lt, id, ht, g))
}

fn memfd_name(loc_type: u32, loc_id: i32, ht: u32, rdma: u8) -> std::ffi::CString {
    std::ffi::CString::new(format!(
        "{MEMFD_PREFIX}loc={loc_type}.{loc_id}/ht={ht}/rdma={rdma}"
    ))
    .unwrap_or_default()
}

/// Parse the name of one of our memfds (as `/proc/self/fd/N` shows it).
fn parse_memfd_link(link: &str) -> Option<(u32, i32, u32, u8)> {
    let rest = link.strip_prefix("/memfd:")?.strip_prefix(MEMFD_PREFIX)?;
    let rest = rest.strip_suffix(" (deleted)").unwrap_or(rest);
    let mut it = rest.split('/');
    let loc = it.next()?.strip_prefix("loc=")?;
    let (t, i) = loc.split_once('.')?;
    let ht = it.next()?.strip_prefix("ht=")?.parse().ok()?;
    let rdma = it.next()?.strip_prefix("rdma=")?.parse().ok()?;
    Some((t.parse().ok()?, i.parse().ok()?, ht, rdma))
}

fn fd_link(fd: RawFd) -> Option<String> {
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

fn fstat(fd: RawFd) -> SimResult<libc::stat> {
    // SAFETY: an all-zero stat is a valid value to be overwritten.
    let mut s: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `s` is valid for one write; fstat on a bad fd only fails.
    if unsafe { libc::fstat(fd, &mut s) } != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    Ok(s)
}

fn create_memfd(size: usize, name: &std::ffi::CStr) -> SimResult<OwnedFd> {
    // SAFETY: a NUL-terminated name; the fd returned is owned below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    // SAFETY: a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on an fd we own.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok(fd)
}

/// `dup` with close-on-exec.
fn dup_fd(fd: RawFd) -> SimResult<OwnedFd> {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on any fd only fails or returns a new fd we then own.
    let n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if n < 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// Replace `[addr, addr+len)` by a fresh inaccessible reservation.
fn reserve_fixed(addr: usize, len: usize) -> SimResult {
    // SAFETY: the range belongs to one of our reservations; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            addr as *mut c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok(())
}

fn munmap(addr: usize, len: usize) {
    if len > 0 {
        // SAFETY: the range was mapped by this module and nothing refers to it any more.
        unsafe { libc::munmap(addr as *mut c_void, len) };
    }
}

/// The simulated device address space: one big `PROT_NONE` range, handed out lowest-first like
/// a driver's own VA allocator (so the range right after a reservation is usually free, and a
/// growing buffer can extend in place through an address hint).
struct Arena {
    base: usize,
    len: usize,
    /// start -> length of the ranges handed out
    used: BTreeMap<usize, usize>,
}

impl Arena {
    fn new() -> Option<Arena> {
        for len in [8usize << 40, 1 << 40, 64 << 30] {
            // SAFETY: a fresh inaccessible anonymous mapping; no existing memory is affected.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                return Some(Arena {
                    base: p as usize,
                    len,
                    used: BTreeMap::new(),
                });
            }
        }
        None
    }

    fn contains(&self, a: usize, size: usize) -> bool {
        a >= self.base
            && a.checked_add(size)
                .is_some_and(|e| e <= self.base + self.len)
    }

    fn is_free(&self, a: usize, size: usize) -> bool {
        self.contains(a, size)
            && self
                .used
                .range(..a + size)
                .next_back()
                .is_none_or(|(s, l)| s + l <= a)
    }

    /// The hinted range if it is free and aligned, else the lowest free aligned range.
    fn take(&mut self, size: usize, align: usize, hint: usize) -> Option<usize> {
        let at = if hint != 0 && hint % align == 0 && self.is_free(hint, size) {
            hint
        } else {
            let mut cur = self.base.next_multiple_of(align);
            let mut found = None;
            for (s, l) in &self.used {
                if cur + size <= *s {
                    found = Some(cur);
                    break;
                }
                cur = cur.max((s + l).next_multiple_of(align));
            }
            let at = found.unwrap_or(cur);
            if !self.contains(at, size) {
                return None;
            }
            at
        };
        self.used.insert(at, size);
        Some(at)
    }
}

/// Reserve `size` bytes aligned to `align` at `hint` if that range is free, else anywhere.
/// Returns the start and whether it lies in the arena.
fn reserve(
    arena: &mut Option<Arena>,
    size: usize,
    align: usize,
    hint: usize,
) -> SimResult<(usize, bool)> {
    if arena.is_none() {
        *arena = Arena::new();
    }
    let a = arena.as_mut().ok_or(CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
    if hint != 0 && !a.contains(hint, size) && hint % align == 0 {
        // A hint outside the arena: honour it when the process has nothing there.
        let flags = libc::MAP_PRIVATE
            | libc::MAP_ANONYMOUS
            | libc::MAP_NORESERVE
            | libc::MAP_FIXED_NOREPLACE;
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping.
        let p = unsafe { libc::mmap(hint as *mut c_void, size, libc::PROT_NONE, flags, -1, 0) };
        if p != libc::MAP_FAILED {
            if p as usize == hint {
                return Ok((hint, false));
            }
            munmap(p as usize, size);
        }
    }
    a.take(size, align, hint)
        .map(|s| (s, true))
        .ok_or(CUresult::CUDA_ERROR_OUT_OF_MEMORY)
}

impl Tables {
    /// Whether a retired range overlaps `[start, end)`.
    fn retired_overlaps(&self, start: usize, end: usize) -> bool {
        self.retired
            .values()
            .any(|r| r.start < end && start < r.start + r.size)
    }

    /// Give a reservation's addresses back (to the arena, or to the system).
    fn give_back(&mut self, start: usize, r: &Reservation) {
        if r.in_arena {
            self.arena
                .as_mut()
                .expect("arena reservations need the arena")
                .used
                .remove(&start);
        } else {
            munmap(start, r.size);
        }
    }

    /// Free a retired range: put the inaccessible reservation back over it (which lets its
    /// pages go) — except where a newer mapping, or another retired range still in use, covers
    /// it; give the addresses of a freed reservation back once nothing retired is left in it.
    fn free_retired(&mut self, r: Retired) {
        let end = r.start + r.size;
        let mut covered: Vec<(usize, usize)> = self
            .retired
            .values()
            .filter(|x| x.start < end && r.start < x.start + x.size)
            .map(|x| (x.start, x.start + x.size))
            .collect();
        if let Some((rs, res)) = self.reservations.range(..=r.start).next_back() {
            if r.start < rs + res.size {
                covered.extend(
                    res.mappings
                        .range(..end)
                        .filter(|(s, m)| *s + m.size > r.start)
                        .map(|(s, m)| (*s, s + m.size)),
                );
            }
        }
        covered.sort_unstable();
        let mut at = r.start;
        for (s, e) in covered {
            if s > at {
                // Best effort: nothing waits for this any more, and failing to replace our own
                // mapping leaves it readable, not unsafe.
                let _ = reserve_fixed(at, s.min(end) - at);
            }
            at = at.max(e);
        }
        if at < end {
            let _ = reserve_fixed(at, end - at);
        }
        let drained: Vec<usize> = self
            .draining
            .iter()
            .filter(|(s, d)| !self.retired_overlaps(**s, **s + d.size))
            .map(|(s, _)| *s)
            .collect();
        for s in drained {
            let d = self.draining.remove(&s).expect("listed");
            self.give_back(s, &d);
        }
    }

    /// Drop one reference of allocation `id`; frees it at zero.
    fn unref(&mut self, st: &State, id: u64) {
        let Some(a) = self.allocs.get_mut(&id) else {
            return;
        };
        a.refs -= 1;
        if a.refs == 0 {
            let a = self.allocs.remove(&id).expect("present");
            if let Some(dev) = a.charged {
                st.ext::<Memory>().charge(dev, -(a.size as i64));
            }
            st.live_add("vmm allocations", -1);
        }
    }

    fn new_alloc(&mut self, a: Alloc) -> u64 {
        self.next_alloc += 1;
        self.allocs.insert(self.next_alloc, a);
        self.next_alloc
    }

    fn new_handle_for(&mut self, id: u64) -> u64 {
        let h = new_handle(Kind::Allocation);
        self.handles.insert(h, (id, 1));
        h
    }

    fn alloc_of(&self, handle: u64) -> SimResult<(u64, &Alloc)> {
        if !is_kind(handle, Kind::Allocation) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let (id, _) = self
            .handles
            .get(&handle)
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        Ok((
            *id,
            self.allocs
                .get(id)
                .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?,
        ))
    }

    /// The reservation containing `[ptr, ptr+size)` entirely.
    fn reservation_of(&mut self, ptr: usize, size: usize) -> SimResult<(usize, &mut Reservation)> {
        let end = ptr
            .checked_add(size)
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        let (s, r) = self
            .reservations
            .range_mut(..=ptr)
            .next_back()
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        if end > s + r.size {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        Ok((*s, r))
    }

    /// The starts of the mappings that exactly tile `[ptr, ptr+size)`.
    fn tiling(&mut self, ptr: usize, size: usize) -> SimResult<(usize, Vec<usize>)> {
        if size == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let (rs, r) = self.reservation_of(ptr, size)?;
        let mut starts = Vec::new();
        let mut a = ptr;
        while a < ptr + size {
            let m = r
                .mappings
                .get(&a)
                .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
            starts.push(a);
            a += m.size;
        }
        if a != ptr + size {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        Ok((rs, starts))
    }
}

/// Apply a mapping's access table to the host protection and the memory map.
fn apply_access(st: &State, start: usize, m: &Mapping) -> SimResult {
    let best = m.access.values().copied().max().unwrap_or(PROT_NONE);
    let (prot, r, w) = match best {
        PROT_RW => (libc::PROT_READ | libc::PROT_WRITE, true, true),
        PROT_READ => (libc::PROT_READ, true, false),
        _ => (libc::PROT_NONE, false, false),
    };
    // SAFETY: the range is one of our mappings.
    if unsafe { libc::mprotect(start as *mut c_void, m.size, prot) } != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    st.ext::<Memory>().set_access(start, r, w);
    Ok(())
}

/// The 64-byte fabric handle of an allocation.
fn fabric_encode(a: &Alloc) -> SimResult<[u8; 64]> {
    let s = fstat(a.fd.as_raw_fd())?;
    let mut b = [0u8; 64];
    b[0..4].copy_from_slice(&FABRIC_MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&FABRIC_VERSION.to_le_bytes());
    b[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    b[12..16].copy_from_slice(&a.fd.as_raw_fd().to_le_bytes());
    b[16..24].copy_from_slice(&(a.size as u64).to_le_bytes());
    b[24..32].copy_from_slice(&(s.st_ino as u64).to_le_bytes());
    b[32..36].copy_from_slice(&a.loc_type.to_le_bytes());
    b[36..40].copy_from_slice(&a.loc_id.to_le_bytes());
    b[40..44].copy_from_slice(&a.handle_types.to_le_bytes());
    b[44] = a.rdma;
    let c = checksum(&b[..56]);
    b[56..64].copy_from_slice(&c.to_le_bytes());
    Ok(b)
}

fn checksum(b: &[u8]) -> u64 {
    // FNV-1a, 64 bit.
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Decode and open a fabric handle: the allocation's memfd (a new fd), size, location, types.
fn fabric_open(b: &[u8; 64]) -> SimResult<(OwnedFd, usize, u32, i32, u32, u8)> {
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let bad = CUresult::CUDA_ERROR_INVALID_VALUE;
    if u32_at(0) != FABRIC_MAGIC
        || u16::from_le_bytes([b[4], b[5]]) != FABRIC_VERSION
        || u64_at(56) != checksum(&b[..56])
    {
        return Err(bad);
    }
    let (pid, fd, size, ino) = (
        u32_at(8),
        u32_at(12) as i32,
        u64_at(16) as usize,
        u64_at(24),
    );
    let path = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}")).map_err(|_| bad)?;
    // SAFETY: a NUL-terminated path; the fd returned is owned below.
    let n = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if n < 0 {
        return Err(bad);
    }
    // SAFETY: a fresh fd that nothing else owns.
    let f = unsafe { OwnedFd::from_raw_fd(n) };
    let link = fd_link(f.as_raw_fd()).ok_or(bad)?;
    parse_memfd_link(&link).ok_or(bad)?;
    let s = fstat(f.as_raw_fd())?;
    if s.st_ino as u64 != ino || s.st_size as u64 != size as u64 {
        return Err(bad);
    }
    Ok((f, size, u32_at(32), u32_at(36) as i32, u32_at(40), b[44]))
}

fn import(st: &State, fd: OwnedFd, size: usize, lt: u32, id: i32, ht: u32, rdma: u8) -> u64 {
    let vmm = st.ext::<Vmm>();
    let mut t = vmm.t.lock();
    let aid = t.new_alloc(Alloc {
        fd,
        size,
        loc_type: lt,
        loc_id: id,
        handle_types: ht,
        rdma,
        charged: None,
        refs: 1,
    });
    st.live_add("vmm allocations", 1);
    t.new_handle_for(aid)
}

/// A shareable handle of an allocation or a multicast object, for the caller to own.
pub(crate) enum Shareable {
    /// A POSIX file descriptor.
    Fd(OwnedFd),
    /// The 64 bytes of a fabric handle.
    Fabric([u8; 64]),
}

/// `cuMemCreate`: `size` bytes as `p` describes; the new handle.
pub(crate) fn create(st: &State, size: usize, p: &CUmemAllocationProp) -> SimResult<u64> {
    let (lt, id, ht, (min, _)) = check_prop(st, p)?;
    if size == 0 || size % min != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let m = st.ext::<Memory>();
    let charged = (lt == LOC_DEVICE).then_some(id);
    if let Some(dev) = charged {
        if m.used(dev).saturating_add(size as u64) > st.device(dev)?.memory {
            return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
    }
    let rdma = p.allocFlags.gpuDirectRDMACapable;
    let fd = create_memfd(size, &memfd_name(lt, id, ht, rdma))?;
    if let Some(dev) = charged {
        m.charge(dev, size as i64);
    }
    let vmm = st.ext::<Vmm>();
    let mut t = vmm.t.lock();
    let aid = t.new_alloc(Alloc {
        fd,
        size,
        loc_type: lt,
        loc_id: id,
        handle_types: ht,
        rdma,
        charged,
        refs: 1,
    });
    st.live_add("vmm allocations", 1);
    Ok(t.new_handle_for(aid))
}

/// `cuMemRelease` of an allocation handle.
pub(crate) fn release(st: &State, handle: u64) -> SimResult {
    let vmm = st.ext::<Vmm>();
    let mut t = vmm.t.lock();
    let (id, _) = t.alloc_of(handle)?;
    let e = t.handles.get_mut(&handle).expect("checked");
    e.1 -= 1;
    if e.1 == 0 {
        t.handles.remove(&handle);
    }
    t.unref(st, id);
    Ok(())
}

/// `cuMemGetAllocationPropertiesFromHandle` of an allocation handle.
pub(crate) fn properties(st: &State, handle: u64) -> SimResult<CUmemAllocationProp> {
    let vmm = st.ext::<Vmm>();
    let t = vmm.t.lock();
    let (_, a) = t.alloc_of(handle)?;
    let mut p = CUmemAllocationProp {
        type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: CUmemAllocationHandleType(a.handle_types),
        ..Default::default()
    };
    p.location.type_ = CUmemLocationType(a.loc_type);
    p.location.__bindgen_anon_1.id = a.loc_id;
    p.allocFlags.gpuDirectRDMACapable = a.rdma;
    Ok(p)
}

/// `cuMemRetainAllocationHandle`: a (new reference to a) handle of the allocation mapped at
/// `a`.
pub(crate) fn retain_handle(st: &State, a: usize) -> SimResult<u64> {
    let vmm = st.ext::<Vmm>();
    let mut t = vmm.t.lock();
    let (_, r) = t.reservation_of(a, 1)?;
    let (ms, m) = r
        .mappings
        .range(..=a)
        .next_back()
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if a >= ms + m.size {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let aid = m.alloc;
    // The handle the mapping was made with, if it is still live; else a fresh one.
    let existing = t
        .handles
        .iter()
        .find(|(_, (id, _))| *id == aid)
        .map(|(h, _)| *h);
    let h = match existing {
        Some(h) => {
            t.handles.get_mut(&h).expect("found").1 += 1;
            h
        }
        None => t.new_handle_for(aid),
    };
    t.allocs
        .get_mut(&aid)
        .expect("mapped allocations are live")
        .refs += 1;
    Ok(h)
}

/// `cuMemAddressReserve` (arguments checked by the caller): the range's start.
pub(crate) fn reserve_range(
    st: &State,
    size: usize,
    alignment: usize,
    hint: usize,
) -> SimResult<usize> {
    let page = page_size();
    let default_align = st
        .config
        .devices
        .iter()
        .map(|d| d.granularity.0)
        .max()
        .unwrap_or(page);
    let align = alignment.max(default_align).max(page);
    let vmm = st.ext::<Vmm>();
    let mut t = vmm.t.lock();
    let (start, in_arena) = reserve(&mut t.arena, size, align, hint)?;
    t.reservations.insert(
        start,
        Reservation {
            size,
            in_arena,
            mappings: BTreeMap::new(),
        },
    );
    st.live_add("vmm reservations", 1);
    Ok(start)
}

/// `cuMemAddressFree`; `mapped_elsewhere` says whether another area (multicast) still maps
/// part of the range (asked while the VMM tables are held).
pub(crate) fn free_range(
    st: &State,
    ptr: usize,
    size: usize,
    mapped_elsewhere: impl FnOnce() -> bool,
) -> SimResult {
    let vmm = st.ext::<Vmm>();
    let mut t = vmm.t.lock();
    let r = t
        .reservations
        .get(&ptr)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if r.size != size || !r.mappings.is_empty() || mapped_elsewhere() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let r = t.reservations.remove(&ptr).expect("checked");
    if t.retired_overlaps(ptr, ptr + size) {
        // Unmapped memory in it is still mapped on the host for work queued before the
        // unmap: its addresses stay taken until that work has finished.
        t.draining.insert(ptr, r);
    } else {
        t.give_back(ptr, &r);
    }
    st.live_add("vmm reservations", -1);
    Ok(())
}

/// `cuMemMap` of an allocation handle.
pub(crate) fn map(
    st: &State,
    p: usize,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> SimResult {
    if flags != 0 || size == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let vmm = st.ext::<Vmm>();
    let mut t = vmm.t.lock();
    let (aid, a) = t.alloc_of(handle)?;
    let (min, _) =
        granularity_for(st, a.loc_type, a.loc_id, 0).unwrap_or(st.config.devices[0].granularity);
    if p % min != 0 || size % min != 0 || offset % min != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // cuda.h: the offset "currently must be zero". Measured on a 13.0 H200: a range past the
    // allocation's end, and a mapping of only part of an allocation (2 MiB of 4 MiB from
    // offset 0), are both CUDA_ERROR_NOT_SUPPORTED: a mapping covers a whole allocation.
    if offset != 0 || size != a.size {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    let raw = a.fd.as_raw_fd();
    let device = (a.loc_type == LOC_DEVICE).then_some(a.loc_id);
    let (_, r) = t.reservation_of(p, size)?;
    let end = p + size;
    let overlaps = r
        .mappings
        .range(..end)
        .next_back()
        .is_some_and(|(s, m)| s + m.size > p);
    if overlaps {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: `[p, p+size)` lies inside our reservation and is not mapped; the memfd is ours
    // and at least `offset + size` long.
    let q = unsafe {
        libc::mmap(
            p as *mut c_void,
            size,
            libc::PROT_NONE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            raw,
            offset as libc::off_t,
        )
    };
    if q == libc::MAP_FAILED {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    r.mappings.insert(
        p,
        Mapping {
            size,
            alloc: aid,
            offset,
            access: BTreeMap::new(),
        },
    );
    t.allocs.get_mut(&aid).expect("checked").refs += 1;
    st.ext::<Memory>().insert(
        p,
        Region {
            len: size,
            kind: RegionKind::Mapping,
            device,
            readable: false,
            writable: false,
            redirect: None,
        },
    );
    st.live_add("vmm mappings", 1);
    Ok(())
}

/// `cuMemUnmap` of allocation mappings that tile `[ptr, ptr + size)`.
pub(crate) fn unmap(st: &Arc<State>, ptr: usize, size: usize) -> SimResult {
    // `cuMemUnmap` documents no synchronisation, and the real driver waits for no device
    // (measured on 2 x H200, driver 13.0: 0.1 ms under a running kernel of the mapping's own
    // device, 1.0 ms under another device's). So the unmap returns at once: the range leaves
    // the memory map now, and its host pages go once the work queued so far on the devices
    // granted access to it has finished (see `Retired`). The device whose memory it is is
    // not one of them unless it was granted access here: its kernels reach the allocation
    // through their own mappings, which this unmap leaves in place.
    let vmm = st.ext::<Vmm>();
    let (id, reaching) = {
        let mut t = vmm.t.lock();
        let (rs, starts) = t.tiling(ptr, size)?;
        let mut devs = std::collections::BTreeSet::new();
        for s in starts {
            let m = t
                .reservations
                .get_mut(&rs)
                .expect("found")
                .mappings
                .remove(&s)
                .expect("tiled");
            devs.extend(
                m.access
                    .iter()
                    .filter(|(k, f)| k.0 == LOC_DEVICE && **f != PROT_NONE)
                    .map(|(k, _)| k.1),
            );
            // From here on, work that checks the range fails (epochs are taken after this).
            st.ext::<Memory>().remove(s);
            st.live_add("vmm mappings", -1);
            t.unref(st, m.alloc);
        }
        t.next_retired += 1;
        let id = t.next_retired;
        t.retired.insert(
            id,
            Retired {
                start: ptr,
                size,
                waiting: 1,
            },
        );
        (id, devs)
    };
    for dev in reaching {
        for s in stream::device_streams(st, dev) {
            vmm.t
                .lock()
                .retired
                .get_mut(&id)
                .expect("held by this unmap")
                .waiting += 1;
            let st2 = st.clone();
            s.after_queued(Box::new(move || epoch_passed(&st2, id)));
        }
    }
    // The unmap's own share: with no queued work left anywhere, the pages go now.
    epoch_passed(st, id);
    Ok(())
}

/// `cuMemSetAccess` over allocation mappings that tile `[ptr, ptr + size)`.
pub(crate) fn set_access(
    st: &State,
    ptr: usize,
    size: usize,
    descs: &[CUmemAccessDesc],
) -> SimResult {
    let vmm = st.ext::<Vmm>();
    let mut t = vmm.t.lock();
    let (rs, starts) = t.tiling(ptr, size)?;
    // Validate every descriptor against every mapping before changing anything.
    let mut changes = Vec::new();
    for d in descs {
        let (lt, id) = location(&d.location);
        let f = d.flags.0;
        if f != PROT_NONE && f != PROT_READ && f != PROT_RW {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        for s in &starts {
            let m = &t.reservations[&rs].mappings[s];
            let a = &t.allocs[&m.alloc];
            match lt {
                LOC_DEVICE => {
                    st.device(id)
                        .map_err(|_| CUresult::CUDA_ERROR_INVALID_DEVICE)?;
                    if a.loc_type == LOC_DEVICE && a.loc_id != id && !same_clique(st, a.loc_id, id)
                    {
                        return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
                    }
                }
                LOC_HOST_NUMA if a.loc_type != LOC_HOST_NUMA => {
                    return Err(CUresult::CUDA_ERROR_INVALID_VALUE)
                }
                LOC_HOST | LOC_HOST_NUMA => {}
                _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
            }
        }
        let key = if lt == LOC_DEVICE {
            (lt, id)
        } else {
            (LOC_HOST, 0)
        };
        changes.push((key, f));
    }
    for s in &starts {
        let m = t
            .reservations
            .get_mut(&rs)
            .expect("found")
            .mappings
            .get_mut(s)
            .expect("tiled");
        for (k, f) in &changes {
            m.access.insert(*k, *f);
        }
        apply_access(st, *s, m)?;
    }
    Ok(())
}

/// `cuMemGetAccess`: the access flags of location `l` on the mapping at `a`.
pub(crate) fn access(st: &State, l: &CUmemLocation, a: usize) -> SimResult<u32> {
    let (lt, id) = location(l);
    let key = match lt {
        LOC_DEVICE => {
            st.device(id)
                .map_err(|_| CUresult::CUDA_ERROR_INVALID_DEVICE)?;
            (lt, id)
        }
        LOC_HOST | LOC_HOST_NUMA => (LOC_HOST, 0),
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    };
    let vmm = st.ext::<Vmm>();
    let mut t = vmm.t.lock();
    let (_, r) = t.reservation_of(a, 1)?;
    let (ms, m) = r
        .mappings
        .range(..=a)
        .next_back()
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if a >= ms + m.size {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    Ok(m.access.get(&key).copied().unwrap_or(PROT_NONE))
}

/// `cuMemExportToShareableHandle` of an allocation handle as handle type `ty`.
pub(crate) fn export(st: &State, handle: u64, ty: u32) -> SimResult<Shareable> {
    let vmm = st.ext::<Vmm>();
    let t = vmm.t.lock();
    let (_, a) = t.alloc_of(handle)?;
    match ty {
        HT_POSIX if a.handle_types & HT_POSIX != 0 => Ok(Shareable::Fd(dup_fd(a.fd.as_raw_fd())?)),
        HT_FABRIC if a.handle_types & HT_FABRIC != 0 => Ok(Shareable::Fabric(fabric_encode(a)?)),
        HT_WIN32 | HT_WIN32_KMT => Err(CUresult::CUDA_ERROR_NOT_SUPPORTED),
        _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
}

/// `cuMemImportFromShareableHandle` of an allocation's POSIX fd `raw` (the caller's stays
/// theirs); the new handle.
pub(crate) fn import_fd(st: &State, raw: RawFd) -> SimResult<u64> {
    let bad = CUresult::CUDA_ERROR_INVALID_VALUE;
    let link = fd_link(raw).ok_or(bad)?;
    let (lt, id, ht, rdma) = parse_memfd_link(&link).ok_or(bad)?;
    let size = fstat(raw)?.st_size as usize;
    if size == 0 {
        return Err(bad);
    }
    let fd = dup_fd(raw)?;
    Ok(import(st, fd, size, lt, id, ht, rdma))
}

/// `cuMemImportFromShareableHandle` of an allocation's fabric handle; the new handle.
pub(crate) fn import_fabric(st: &State, b: &[u8; 64]) -> SimResult<u64> {
    let (fd, size, lt, id, ht, rdma) = fabric_open(b)?;
    Ok(import(st, fd, size, lt, id, ht, rdma))
}

/// What multicast and endpoint binds need to know of an allocation.
pub(crate) struct AllocInfo {
    /// A new descriptor of the allocation's memfd.
    pub fd: OwnedFd,
    pub size: usize,
    /// The device whose memory it is.
    pub device: Option<i32>,
    /// The host NUMA node whose memory it is.
    pub numa: Option<i32>,
    /// Whether it was created with a shareable handle type.
    pub shareable: bool,
}

fn info(a: &Alloc) -> SimResult<AllocInfo> {
    Ok(AllocInfo {
        fd: dup_fd(a.fd.as_raw_fd())?,
        size: a.size,
        device: (a.loc_type == LOC_DEVICE).then_some(a.loc_id),
        numa: (a.loc_type == LOC_HOST_NUMA).then_some(a.loc_id),
        shareable: a.handle_types != 0,
    })
}

/// The allocation behind a handle (multicast and endpoint `BindMem`).
pub(crate) fn allocation_info(st: &State, handle: u64) -> SimResult<AllocInfo> {
    let vmm = st.ext::<Vmm>();
    let t = vmm.t.lock();
    info(t.alloc_of(handle)?.1)
}

/// The allocation mapped at `addr`, the offset of `addr` in it, and the bytes mapped from `addr`
/// to the end of that mapping (multicast and endpoint `BindAddr`).
pub(crate) fn allocation_at(st: &State, addr: usize) -> SimResult<(AllocInfo, usize, usize)> {
    let vmm = st.ext::<Vmm>();
    let t = vmm.t.lock();
    let bad = CUresult::CUDA_ERROR_INVALID_VALUE;
    let (rs, r) = t.reservations.range(..=addr).next_back().ok_or(bad)?;
    if addr >= rs + r.size {
        return Err(bad);
    }
    let (ms, m) = r.mappings.range(..=addr).next_back().ok_or(bad)?;
    if addr >= ms + m.size {
        return Err(bad);
    }
    let a = t.allocs.get(&m.alloc).ok_or(bad)?;
    Ok((info(a)?, m.offset + (addr - ms), ms + m.size - addr))
}

/// Whether `[ptr, ptr + size)` lies inside one reservation and overlaps none of its mappings
/// (multicast `cuMemMap`).
pub(crate) fn free_in_reservation(st: &State, ptr: usize, size: usize) -> bool {
    let vmm = st.ext::<Vmm>();
    let t = vmm.t.lock();
    let Some(end) = ptr.checked_add(size) else {
        return false;
    };
    let Some((rs, r)) = t.reservations.range(..=ptr).next_back() else {
        return false;
    };
    end <= rs + r.size
        && r.mappings
            .range(..end)
            .next_back()
            .is_none_or(|(s, m)| s + m.size <= ptr)
}

/// A stream that retired range `id` waited for has passed its epoch (or the unmap has
/// registered with all of them): free the range when it was the last.
fn epoch_passed(st: &State, id: u64) {
    let vmm = st.ext::<Vmm>();
    let mut t = vmm.t.lock();
    let Some(r) = t.retired.get_mut(&id) else {
        return;
    };
    r.waiting -= 1;
    if r.waiting == 0 {
        let r = t.retired.remove(&id).expect("present");
        t.free_retired(r);
    }
}

/// Unmapped ranges whose host pages still wait for work queued before the unmap (see
/// [`Retired`]).
pub(crate) fn pending_unmaps(st: &State) -> usize {
    st.ext::<Vmm>().t.lock().retired.len()
}

/// End of a session (after the streams' workers have stopped): free the unmapped ranges that
/// still waited for them, then unmap and free everything still there.
pub(crate) fn teardown(st: &State) {
    let vmm = st.ext::<Vmm>();
    let mut t = vmm.t.lock();
    let waiting: Vec<u64> = t.retired.keys().copied().collect();
    for id in waiting {
        let r = t.retired.remove(&id).expect("listed");
        t.free_retired(r);
    }
    for (s, r) in std::mem::take(&mut t.reservations) {
        if !r.in_arena {
            munmap(s, r.size);
        }
    }
    if let Some(a) = t.arena.take() {
        munmap(a.base, a.len);
    }
    t.handles.clear();
    t.allocs.clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_names_round_trip() {
        let n = memfd_name(LOC_DEVICE, 3, HT_POSIX | HT_FABRIC, 1);
        let link = format!("/memfd:{} (deleted)", n.to_str().unwrap());
        assert_eq!(parse_memfd_link(&link), Some((LOC_DEVICE, 3, 9, 1)));
        assert_eq!(parse_memfd_link("/memfd:other (deleted)"), None);
        assert_eq!(parse_memfd_link("/dev/null"), None);
    }

    #[test]
    fn checksums_differ_for_different_bytes() {
        assert_ne!(checksum(&[0u8; 56]), checksum(&[1u8; 56]));
    }
}
