//! Multicast objects: their tables, binds (private views of the bound memory), mappings whose
//! stores reach every bound device, and the cross-process shared table of an exported object.
//! The model this implements is described in the crate's public `multicast` module
//! (`src/multicast.rs`).
// `is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_ulonglong;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_multimem_sys::*;
use parking_lot::{Condvar, Mutex};

use super::device::same_clique;
use super::memory::{Memory, Redirect, Region, RegionKind};
use super::vmm::Shareable;
use crate::state::{current, is_kind, new_handle, Kind, SimResult, State};

/// How long a bind or map waits for missing devices before the simulator calls it a deadlock.
pub const BLOCK_LIMIT: Duration = Duration::from_secs(2);
/// The same for an exported or imported object, whose devices other processes add.
pub const SHARED_BLOCK_LIMIT: Duration = Duration::from_secs(30);
use super::shared::{
    inode, view_of, Bind as SharedBind, MAX_BINDS as MAX_SHARED_BINDS,
    MAX_DEVICES as MAX_SHARED_DEVICES,
};
const TABLE_MAGIC: &[u8; 8] = b"SIMMCTB1";

const HT_POSIX: u64 = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0 as u64;
const HT_FABRIC: u64 = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC.0 as u64;
const MEMFD_PREFIX: &str = "cuda-multimem-sim-mc/";
const FABRIC_MAGIC: &[u8; 8] = b"SIMMC001";
const RECOMMENDED_FACTOR: usize = 32;

static NEXT_OBJECT: AtomicU64 = AtomicU64::new(1);

#[derive(Debug)]
struct Binding {
    len: usize,
    /// Host address of the bound memory (inside `view`).
    target: usize,
    /// The private view `(addr, len)` made for this binding.
    view: (usize, usize),
    /// The bound allocation's memfd, kept open so other processes can map it.
    fd: OwnedFd,
    /// Offset of the view in that memfd.
    file_offset: u64,
}

struct Object {
    num_devices: u32,
    size: usize,
    handle_types: u64,
    gran: usize,
    /// Devices added (by this process, or by any process once the object has a shared table).
    devices: Vec<i32>,
    /// The cross-process table, once exported or imported.
    table: Option<Table>,
    /// Views of other processes' bound memory.
    remote: super::shared::RemoteViews,
    /// Exported or imported: binds only shareable memory.
    shared: bool,
    /// (device, offset) -> binding
    bindings: BTreeMap<(i32, usize), Binding>,
    /// Live handles referring to it, plus live mappings.
    refs: u32,
    handles: u32,
    mappings: u32,
}

impl Object {
    fn members(&self) -> Vec<i32> {
        match &self.table {
            Some(t) => t.with(|d| d.devices[..d.ndev as usize].to_vec()),
            None => self.devices.clone(),
        }
    }
    fn complete(&self) -> bool {
        self.members().len() as u32 == self.num_devices
    }
    /// Forget this process's entries in the shared table and unmap views of other processes'.
    fn detach(&mut self) {
        if let Some(t) = &self.table {
            t.with(|d| super::shared::unregister(&mut d.binds, |_| true));
        }
        self.remote.unmap_all();
    }
}

/// The data of a multicast object's shared table.
#[repr(C)]
struct SharedData {
    magic: [u8; 8],
    creator_pid: u32,
    num_devices: u32,
    oid: u64,
    size: u64,
    handle_types: u64,
    gran: u64,
    ndev: u32,
    next_gen: u32,
    devices: [i32; MAX_SHARED_DEVICES],
    binds: [SharedBind; MAX_SHARED_BINDS],
}

type Table = super::shared::Table<SharedData>;

/// A new shared table describing object `oid`.
fn create_table(oid: u64, o: &Object) -> SimResult<Table> {
    let me = std::process::id();
    Table::create(&format!("{MEMFD_PREFIX}{me}/{oid}"), |d| {
        d.magic = *TABLE_MAGIC;
        d.creator_pid = me;
        d.num_devices = o.num_devices;
        d.oid = oid;
        d.size = o.size as u64;
        d.handle_types = o.handle_types;
        d.gran = o.gran as u64;
        for (i, &dev) in o.devices.iter().enumerate() {
            d.devices[i] = dev;
        }
        d.ndev = o.devices.len() as u32;
        for (&(dev, off), b) in &o.bindings {
            register(d, dev, off, b)?;
        }
        Ok(())
    })
}

/// Record a binding of this process in a table.
fn register(d: &mut SharedData, dev: i32, offset: usize, b: &Binding) -> SimResult {
    super::shared::register(
        &mut d.binds,
        &mut d.next_gen,
        dev,
        offset as u64,
        b.len as u64,
        b.fd.as_raw_fd(),
        (b.target - b.view.0) as u64 + b.file_offset,
    )
}

struct McMapping {
    object: u64,
    size: usize,
    /// Offset into the object.
    offset: usize,
}

#[derive(Default)]
struct Tables {
    objects: HashMap<u64, Object>,
    /// handle -> object
    handles: HashMap<u64, u64>,
    /// start address -> mapping
    mappings: BTreeMap<usize, McMapping>,
}

/// Multicast state of a session.
#[derive(Default)]
pub(crate) struct Multicasts {
    t: Mutex<Tables>,
    added: Condvar,
}

fn invalid<T>() -> SimResult<T> {
    Err(CUresult::CUDA_ERROR_INVALID_VALUE)
}

/// (minimum, recommended) granularity for `prop`, validating it.
pub(crate) fn granularity(st: &State, p: &CUmulticastObjectProp) -> SimResult<(usize, usize)> {
    if p.numDevices == 0 || p.flags != 0 {
        return invalid();
    }
    if p.handleTypes & !(HT_POSIX | HT_FABRIC) != 0 {
        return invalid();
    }
    let capable: Vec<_> = st
        .config
        .devices
        .iter()
        .filter(|d| d.multicast && d.vmm)
        .collect();
    if capable.is_empty() {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    // A team may span processes and nodes (more devices than this machine has); the simulator
    // records at most MAX_SHARED_DEVICES members.
    if p.numDevices as usize > MAX_SHARED_DEVICES {
        return invalid();
    }
    if p.handleTypes & HT_POSIX != 0 && !capable.iter().any(|d| d.posix_fd_handle) {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    if p.handleTypes & HT_FABRIC != 0
        && (!capable.iter().any(|d| d.fabric_handle) || st.version() < 12030)
    {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    let min = capable
        .iter()
        .map(|d| d.granularity.0)
        .max()
        .unwrap_or(2 << 20);
    Ok((min, min * RECOMMENDED_FACTOR))
}

impl Tables {
    fn object_of(&self, handle: u64) -> SimResult<u64> {
        if !is_kind(handle, Kind::Multicast) {
            return invalid();
        }
        self.handles
            .get(&handle)
            .copied()
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
    }

    /// The object behind `handle`, with its id.
    fn object_mut(&mut self, handle: u64) -> SimResult<(u64, &mut Object)> {
        let oid = self.object_of(handle)?;
        let o = self
            .objects
            .get_mut(&oid)
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        Ok((oid, o))
    }
}

/// Wait (up to [`BLOCK_LIMIT`]) until the object of `handle` has every device; returns the
/// locked tables and the object id.
fn wait_complete<'a>(
    mc: &'a Multicasts,
    handle: u64,
) -> SimResult<(parking_lot::MutexGuard<'a, Tables>, u64)> {
    let start = Instant::now();
    let mut g = mc.t.lock();
    loop {
        let (oid, o) = g.object_mut(handle)?;
        if o.complete() {
            return Ok((g, oid));
        }
        // Devices of a shared object are added by other processes too: poll its table.
        let shared = o.table.is_some();
        let limit = if shared {
            SHARED_BLOCK_LIMIT
        } else {
            BLOCK_LIMIT
        };
        if start.elapsed() >= limit {
            return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
        }
        if shared {
            drop(g);
            std::thread::sleep(Duration::from_millis(5));
            g = mc.t.lock();
        } else {
            mc.added.wait_until(&mut g, start + limit);
        }
    }
}

/// The memory a bind names, once resolved.
pub(crate) struct Source {
    fd: OwnedFd,
    offset: usize,
    device: Option<i32>,
    numa: Option<i32>,
    shareable: bool,
}

/// Bind `size` bytes of `src` at `mc_offset` for `dev` (`None`: the memory's own device).
pub(crate) fn bind(
    st: &State,
    handle: u64,
    dev: Option<i32>,
    mc_offset: usize,
    src: Source,
    size: usize,
    flags: c_ulonglong,
) -> SimResult {
    if flags != 0 || size == 0 {
        return invalid();
    }
    // Which device the binding is for: the named one (v2), whose memory it must be (device memory)
    // or whose nearest NUMA node it must be (host NUMA memory); else the memory's device.
    let dev = match (dev, src.device, src.numa) {
        (Some(d), Some(m), _) if d != m => return Err(CUresult::CUDA_ERROR_INVALID_DEVICE),
        (Some(d), None, Some(n)) if st.device(d)?.host_numa_id != n => return invalid(),
        (Some(d), _, _) => d,
        (None, Some(m), _) => m,
        (None, None, _) => return invalid(),
    };
    let mc = st.ext::<Multicasts>();
    let (mut g, oid) = wait_complete(&mc, handle)?;
    let o = g
        .objects
        .get_mut(&oid)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if !o.members().contains(&dev) {
        return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
    }
    if mc_offset % o.gran != 0 || size % o.gran != 0 || src.offset % o.gran != 0 {
        return invalid();
    }
    if mc_offset.checked_add(size).is_none_or(|e| e > o.size) {
        return invalid();
    }
    if o.shared && !src.shareable {
        return invalid();
    }
    let end = mc_offset + size;
    if o.bindings
        .range((dev, 0)..(dev, end))
        .any(|(&(_, off), b)| off + b.len > mc_offset)
    {
        return invalid();
    }
    let v = view_of(src.fd.as_raw_fd(), src.offset, size)?;
    let b = Binding {
        len: size,
        target: v,
        view: (v, size),
        fd: src.fd,
        file_offset: src.offset as u64,
    };
    if let Some(t) = &o.table {
        if let Err(e) = t.with(|d| register(d, dev, mc_offset, &b)) {
            super::memory::unmap(v, size);
            return Err(e);
        }
    }
    o.bindings.insert((dev, mc_offset), b);
    st.live_add("multicast bindings", 1);
    Ok(())
}

pub(crate) fn source_of_handle(
    st: &State,
    mem: u64,
    mem_offset: usize,
    size: usize,
) -> SimResult<Source> {
    let a = super::vmm::allocation_info(st, mem)?;
    if mem_offset.checked_add(size).is_none_or(|e| e > a.size) {
        return invalid();
    }
    Ok(Source {
        fd: a.fd,
        offset: mem_offset,
        device: a.device,
        numa: a.numa,
        shareable: a.shareable,
    })
}

pub(crate) fn source_of_addr(st: &State, ptr: usize, size: usize) -> SimResult<Source> {
    let (a, offset, mapped) = super::vmm::allocation_at(st, ptr)?;
    // The bound range lies inside one mapping of one allocation.
    if size > mapped || offset.checked_add(size).is_none_or(|e| e > a.size) {
        return invalid();
    }
    Ok(Source {
        fd: a.fd,
        offset,
        device: a.device,
        numa: a.numa,
        shareable: a.shareable,
    })
}

pub(crate) fn unbind(
    st: &State,
    handle: u64,
    dev: i32,
    mc_offset: usize,
    size: usize,
) -> SimResult {
    st.device(dev)
        .map_err(|_| CUresult::CUDA_ERROR_INVALID_DEVICE)?;
    let mc = st.ext::<Multicasts>();
    let mut g = mc.t.lock();
    let (_, o) = g.object_mut(handle)?;
    if mc_offset % o.gran != 0
        || size % o.gran != 0
        || mc_offset.checked_add(size).is_none_or(|e| e > o.size)
    {
        return invalid();
    }
    match o.bindings.get(&(dev, mc_offset)) {
        Some(b) if b.len == size => {}
        _ => return invalid(),
    }
    if o.mappings > 0 {
        return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
    }
    let b = o.bindings.remove(&(dev, mc_offset)).expect("checked");
    if let Some(t) = &o.table {
        t.with(|d| {
            super::shared::unregister(&mut d.binds, |e| {
                e.dev == dev && e.offset == mc_offset as u64
            })
        });
    }
    super::memory::unmap(b.view.0, b.view.1);
    st.live_add("multicast bindings", -1);
    Ok(())
}

/// Drop one reference of object `oid`; frees it at zero.
fn unref(st: &State, g: &mut Tables, oid: u64) {
    let Some(o) = g.objects.get_mut(&oid) else {
        return;
    };
    o.refs -= 1;
    if o.refs == 0 {
        let mut o = g.objects.remove(&oid).expect("present");
        o.detach();
        for b in o.bindings.into_values() {
            super::memory::unmap(b.view.0, b.view.1);
            st.live_add("multicast bindings", -1);
        }
        st.live_add("multicast objects", -1);
    }
}

struct McRedirect {
    object: u64,
    offset: usize,
}

impl Redirect for McRedirect {
    fn targets(&self, offset: usize, len: usize) -> SimResult<Vec<usize>> {
        let st = current().ok_or(CUresult::CUDA_ERROR_DEINITIALIZED)?;
        targets_of(&st, self.object, self.offset + offset, len)
    }
}

fn targets_of(st: &State, oid: u64, at: usize, len: usize) -> SimResult<Vec<usize>> {
    let mc = st.ext::<Multicasts>();
    let mut g = mc.t.lock();
    let o = g
        .objects
        .get_mut(&oid)
        .ok_or(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)?;
    let end = at
        .checked_add(len)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if o.table.is_some() {
        return shared_targets(o, at, end);
    }
    // Bindings are ordered by device, so targets come lowest device first.
    let t: Vec<usize> = o
        .bindings
        .iter()
        .filter(|(&(_, off), b)| off <= at && end <= off + b.len)
        .map(|(&(_, off), b)| b.target + (at - off))
        .collect();
    if t.is_empty() {
        return Err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
    }
    Ok(t)
}

/// Targets of a shared object: every process's bindings, from its table (lowest device first).
fn shared_targets(o: &mut Object, at: usize, end: usize) -> SimResult<Vec<usize>> {
    let me = std::process::id();
    let mut entries: Vec<(usize, SharedBind)> = o
        .table
        .as_ref()
        .map(|t| {
            t.with(|d| {
                d.binds
                    .iter()
                    .enumerate()
                    .filter(|(_, b)| {
                        b.live != 0 && b.offset <= at as u64 && end as u64 <= b.offset + b.len
                    })
                    .map(|(i, b)| (i, *b))
                    .collect()
            })
        })
        .unwrap_or_default();
    entries.sort_by_key(|(_, b)| b.dev);
    let mut t = Vec::with_capacity(entries.len());
    for (slot, e) in entries {
        let base = if e.pid == me {
            match o.bindings.get(&(e.dev, e.offset as usize)) {
                Some(b) => b.target,
                None => continue,
            }
        } else {
            o.remote.view(slot, &e)?
        };
        t.push(base + (at - e.offset as usize));
    }
    if t.is_empty() {
        return Err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
    }
    Ok(t)
}

/// For simulated kernels: the address of every bound device's memory behind the multicast
/// address range `[addr, addr + len)` (lowest device first), to implement `multimem.ld_reduce`
/// (read all, reduce), `multimem.st` and `multimem.red` (write / update all). The range must lie
/// inside one multicast mapping and one binding per device; `CUDA_ERROR_ILLEGAL_ADDRESS` otherwise.
pub fn multicast_targets(addr: usize, len: usize) -> Result<Vec<usize>, CUresult> {
    let st = current().ok_or(CUresult::CUDA_ERROR_DEINITIALIZED)?;
    let (oid, at) = {
        let mc = st.ext::<Multicasts>();
        let g = mc.t.lock();
        let (&start, m) = g
            .mappings
            .range(..=addr)
            .next_back()
            .ok_or(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)?;
        if addr.checked_add(len).is_none_or(|e| e > start + m.size) {
            return Err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        }
        (m.object, m.offset + (addr - start))
    };
    targets_of(&st, oid, at, len)
}

/// `cuMemMap` of a multicast handle (called by the VMM area for handles of the multicast kind).
pub(crate) fn mem_map(
    st: &State,
    ptr: usize,
    size: usize,
    offset: usize,
    handle: u64,
    flags: c_ulonglong,
) -> SimResult {
    if flags != 0 || size == 0 {
        return invalid();
    }
    if !super::vmm::free_in_reservation(st, ptr, size) {
        return invalid();
    }
    let mc = st.ext::<Multicasts>();
    let (mut g, oid) = wait_complete(&mc, handle)?;
    let end = ptr + size;
    if g.mappings
        .range(..end)
        .next_back()
        .is_some_and(|(s, m)| s + m.size > ptr)
    {
        return invalid();
    }
    let o = g
        .objects
        .get_mut(&oid)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if ptr % o.gran != 0
        || size % o.gran != 0
        || offset % o.gran != 0
        || offset.checked_add(size).is_none_or(|e| e > o.size)
    {
        return invalid();
    }
    o.refs += 1;
    o.mappings += 1;
    g.mappings.insert(
        ptr,
        McMapping {
            object: oid,
            size,
            offset,
        },
    );
    st.ext::<Memory>().insert(
        ptr,
        Region {
            len: size,
            kind: RegionKind::Multicast,
            device: None,
            readable: false,
            writable: false,
            redirect: Some(Arc::new(McRedirect {
                object: oid,
                offset,
            })),
        },
    );
    st.live_add("multicast mappings", 1);
    Ok(())
}

/// Whether `[ptr, ptr + size)` overlaps a multicast mapping.
pub(crate) fn overlaps_mapping(st: &State, ptr: usize, size: usize) -> bool {
    let mc = st.ext::<Multicasts>();
    let g = mc.t.lock();
    let end = ptr.saturating_add(size);
    g.mappings
        .range(..end)
        .next_back()
        .is_some_and(|(s, m)| s + m.size > ptr)
}

/// `cuMemUnmap` of a multicast mapping: `None` when the range is not one (the VMM area handles it).
pub(crate) fn mem_unmap(st: &State, ptr: usize, size: usize) -> Option<SimResult> {
    let mc = st.ext::<Multicasts>();
    let g = mc.t.lock();
    let m = g.mappings.get(&ptr)?;
    if m.size != size {
        return Some(invalid());
    }
    // Queued work may still store through it.
    drop(g);
    for dev in 0..st.device_count() as i32 {
        if let Err(e) = super::stream::synchronize_device(st, dev) {
            return Some(Err(e));
        }
    }
    let mut g = mc.t.lock();
    let m = g.mappings.remove(&ptr)?;
    st.ext::<Memory>().remove(ptr);
    if let Some(o) = g.objects.get_mut(&m.object) {
        o.mappings -= 1;
    }
    unref(st, &mut g, m.object);
    st.live_add("multicast mappings", -1);
    Some(Ok(()))
}

/// `cuMemSetAccess` over a multicast mapping: `None` when the range is not one.
pub(crate) fn mem_set_access(
    st: &State,
    ptr: usize,
    size: usize,
    descs: &[CUmemAccessDesc],
) -> Option<SimResult> {
    let mc = st.ext::<Multicasts>();
    let g = mc.t.lock();
    let m = g.mappings.get(&ptr)?;
    let r = (|| {
        if m.size != size {
            return invalid();
        }
        let o = g
            .objects
            .get(&m.object)
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        let (mut r, mut w) = (false, false);
        for d in descs {
            if d.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE {
                return invalid();
            }
            // SAFETY: `id` is the member for device locations.
            let dev = unsafe { d.location.__bindgen_anon_1.id };
            st.device(dev)
                .map_err(|_| CUresult::CUDA_ERROR_INVALID_DEVICE)?;
            if !o.members().contains(&dev) {
                return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
            }
            match d.flags {
                CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE => (r, w) = (true, true),
                CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ => r = true,
                CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE => {}
                _ => return invalid(),
            }
        }
        st.ext::<Memory>().set_access(ptr, r || w, w);
        Ok(())
    })();
    Some(r)
}

/// `cuMemRelease` of a multicast handle.
pub(crate) fn release(st: &State, handle: u64) -> SimResult {
    let mc = st.ext::<Multicasts>();
    let mut g = mc.t.lock();
    let (oid, o) = g.object_mut(handle)?;
    if o.handles == 1 && !o.bindings.is_empty() {
        return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
    }
    o.handles -= 1;
    g.handles.remove(&handle);
    unref(st, &mut g, oid);
    Ok(())
}

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// `cuMemExportToShareableHandle` of a multicast handle: gives the object its shared table (first
/// export) and hands out a descriptor of it, or a fabric handle naming it.
pub(crate) fn export(
    st: &State,
    handle: u64,
    ty: CUmemAllocationHandleType,
) -> SimResult<Shareable> {
    let mc = st.ext::<Multicasts>();
    let mut g = mc.t.lock();
    let (oid, o) = g.object_mut(handle)?;
    let t = ty.0 as u64;
    if t != HT_POSIX && t != HT_FABRIC {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    if o.handle_types & t == 0 {
        return invalid();
    }
    if o.table.is_none() {
        o.table = Some(create_table(oid, o)?);
    }
    o.shared = true;
    let table = o.table.as_ref().expect("just made");
    if t == HT_POSIX {
        Ok(Shareable::Fd(super::shared::dup(table.fd.as_raw_fd())?))
    } else {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(FABRIC_MAGIC);
        b[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        b[12..16].copy_from_slice(&table.fd.as_raw_fd().to_le_bytes());
        b[16..24].copy_from_slice(&oid.to_le_bytes());
        b[24..32].copy_from_slice(&inode(table.fd.as_raw_fd())?.to_le_bytes());
        let c = checksum(&b[..56]);
        b[56..].copy_from_slice(&c.to_le_bytes());
        Ok(Shareable::Fabric(b))
    }
}

/// Import a shared table: the same object if this process created it, else a new object that
/// shares the table.
fn import_table(st: &State, fd: OwnedFd) -> SimResult<u64> {
    let table = Table::map(fd, TABLE_MAGIC)?;
    let (creator, oid, n, size, ht, gran) = table.with(|d| {
        (
            d.creator_pid,
            d.oid,
            d.num_devices,
            d.size as usize,
            d.handle_types,
            d.gran as usize,
        )
    });
    if n == 0 || n as usize > MAX_SHARED_DEVICES || gran == 0 || size == 0 || size % gran != 0 {
        return invalid();
    }
    let mc = st.ext::<Multicasts>();
    let mut g = mc.t.lock();
    let local = if creator == std::process::id() {
        Some(oid).filter(|o| g.objects.get(o).is_some_and(|x| x.table.is_some()))
    } else {
        None
    };
    let oid = match local {
        Some(oid) => {
            let o = g.objects.get_mut(&oid).expect("present");
            o.refs += 1;
            o.handles += 1;
            oid
        }
        None => {
            let oid = NEXT_OBJECT.fetch_add(1, Ordering::Relaxed);
            g.objects.insert(
                oid,
                Object {
                    num_devices: n,
                    size,
                    handle_types: ht,
                    gran,
                    devices: Vec::new(),
                    table: Some(table),
                    remote: Default::default(),
                    shared: true,
                    bindings: BTreeMap::new(),
                    refs: 1,
                    handles: 1,
                    mappings: 0,
                },
            );
            st.live_add("multicast objects", 1);
            oid
        }
    };
    let h = new_handle(Kind::Multicast);
    g.handles.insert(h, oid);
    Ok(h)
}

/// `cuMemImportFromShareableHandle` of a POSIX fd: `None` when the fd is not an exported
/// multicast object (the VMM area handles it).
pub(crate) fn import_fd(st: &State, fd: RawFd) -> Option<SimResult<u64>> {
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    link.to_string_lossy()
        .strip_prefix("/memfd:")?
        .strip_prefix(MEMFD_PREFIX)?;
    // Our own descriptor: the caller's stays theirs.
    Some(super::shared::dup(fd).and_then(|d| import_table(st, d)))
}

/// `cuMemImportFromShareableHandle` of a fabric handle: `None` when it is not a multicast one.
pub(crate) fn import_fabric(st: &State, b: &[u8; 64]) -> Option<SimResult<u64>> {
    if &b[..8] != FABRIC_MAGIC {
        return None;
    }
    Some((|| {
        if b[56..] != checksum(&b[..56]).to_le_bytes() {
            return invalid();
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let fd = super::shared::open_remote(u32_at(8), u32_at(12) as i32)?;
        if inode(fd.as_raw_fd())? != u64_at(24) {
            return invalid();
        }
        import_table(st, fd)
    })())
}

/// End of a session: drop every binding's view.
pub(crate) fn teardown(st: &State) {
    let mc = st.ext::<Multicasts>();
    let mut g = mc.t.lock();
    for o in g.objects.values_mut() {
        o.detach();
        for b in std::mem::take(&mut o.bindings).into_values() {
            super::memory::unmap(b.view.0, b.view.1);
        }
    }
    g.objects.clear();
    g.handles.clear();
    g.mappings.clear();
}

/// `cuMulticastCreate` (the description `p` already read); the new handle.
pub(crate) fn create(st: &State, p: &CUmulticastObjectProp) -> SimResult<u64> {
    let (min, _) = granularity(st, p)?;
    if p.size == 0 || p.size % min != 0 {
        return invalid();
    }
    let oid = NEXT_OBJECT.fetch_add(1, Ordering::Relaxed);
    let handle = new_handle(Kind::Multicast);
    let mc = st.ext::<Multicasts>();
    let mut g = mc.t.lock();
    g.objects.insert(
        oid,
        Object {
            num_devices: p.numDevices,
            size: p.size,
            handle_types: p.handleTypes,
            gran: min,
            devices: Vec::new(),
            table: None,
            remote: Default::default(),
            shared: false,
            bindings: BTreeMap::new(),
            refs: 1,
            handles: 1,
            mappings: 0,
        },
    );
    g.handles.insert(handle, oid);
    st.live_add("multicast objects", 1);
    Ok(handle)
}

/// `cuMulticastAddDevice`.
pub(crate) fn add_device(st: &State, h: u64, dev: i32) -> SimResult {
    let c = st.device(dev)?;
    let mc = st.ext::<Multicasts>();
    let mut g = mc.t.lock();
    let oid = g.object_of(h)?;
    let o = g
        .objects
        .get_mut(&oid)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if !c.multicast || !c.vmm {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    let n = o.num_devices;
    let check = |members: &[i32], bound: bool| -> SimResult {
        if members.contains(&dev) || members.len() as u32 >= n || bound {
            return invalid();
        }
        if members.first().is_some_and(|&d| !same_clique(st, d, dev)) {
            return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
        }
        Ok(())
    };
    match &o.table {
        // Check and add in one critical section of the table: other processes add too.
        Some(t) => t.with(|d| {
            let bound = d.binds.iter().any(|b| b.live != 0);
            check(&d.devices[..d.ndev as usize], bound)?;
            d.devices[d.ndev as usize] = dev;
            d.ndev += 1;
            Ok(())
        })?,
        None => check(&o.devices, !o.bindings.is_empty())?,
    }
    o.devices.push(dev);
    mc.added.notify_all();
    Ok(())
}
