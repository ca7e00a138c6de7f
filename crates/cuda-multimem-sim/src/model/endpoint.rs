//! Logical endpoints: id ranges, endpoint objects and their construction, binds, the
//! cross-process shared table of an exported endpoint, and fabric copies. The model this
//! implements is described in the crate's public `endpoint` module (`src/endpoint.rs`).
// `is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{c_uint, c_ulonglong};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cuda_multimem_sys::*;
use parking_lot::Mutex;

use super::device::same_clique;
use super::memory::{Memory, RegionKind};
use super::shared;
use super::stream;
use super::vmm::AllocInfo;
use crate::state::{current, SimResult, State};

/// The most ids one process may hold reserved.
const MAX_IDS: u64 = 1 << 16;
/// Largest multicast endpoint (per device), in bytes.
const MAX_MULTICAST_SIZE: u64 = 64 << 30;
const FABRIC_MAGIC: &[u8; 8] = b"SIMLEP01";
/// `ipcHandleTypes` is a bitmask over `CUlogicalEndpointIpcHandleType`: bit `1 << type`, as the
/// device attribute `LOGICAL_ENDPOINT_SUPPORTED_HANDLE_TYPES` reports it.
const FABRIC_FLAG: c_uint =
    1 << CUlogicalEndpointIpcHandleType::CU_LOGICAL_ENDPOINT_IPC_HANDLE_TYPE_FABRIC.0;
const COUNTED_OPS: c_uint = CUlogicalEndpointFlag::CU_LOGICAL_ENDPOINT_FLAG_COUNTED_OPS.0;

static NEXT_OBJECT: AtomicU64 = AtomicU64::new(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Type {
    Unicast(i32),
    Multicast(u32),
}

/// One binding: `len` bytes of a device's memory at endpoint offset `offset`.
struct Binding {
    len: u64,
    /// The host address of the bound memory: a private view `(addr, len)` of the allocation's
    /// memfd, unmapped at unbind (so the binding survives an unmap of the address it came from).
    view: (usize, usize),
    /// The allocation's memfd, kept open so other processes can map it.
    fd: OwnedFd,
    /// Offset of the view in that memfd.
    file_offset: u64,
    /// The id through which it was bound (unbound when that id is destroyed).
    via: u32,
}

/// The endpoint's resources, shared by every id that refers to it (created or imported).
struct Object {
    id: u64,
    ty: Type,
    size: u64,
    ipc: c_uint,
    align: u64,
    devices: Vec<i32>,
    /// Queries that covered it since its team was complete.
    polls: u32,
    /// (device, offset) -> binding of this process
    bindings: BTreeMap<(i32, u64), Binding>,
    /// Ids referring to it.
    refs: u32,
    /// The cross-process table, once exported or imported from another process.
    table: Option<EpTable>,
    /// Views of other processes' bound memory.
    remote: shared::RemoteViews,
}

impl Object {
    fn members(&self) -> Vec<i32> {
        match &self.table {
            Some(t) => t.with(|d| d.devices[..d.ndev as usize].to_vec()),
            None => self.devices.clone(),
        }
    }
    fn polls(&self) -> u32 {
        self.table
            .as_ref()
            .map_or(self.polls, |t| t.with(|d| d.polls))
    }
    /// One query covered it: count it once the team is complete (up to `needed`).
    fn poll(&mut self, needed: u32) {
        if !self.complete() {
            return;
        }
        match &self.table {
            Some(t) => t.with(|d| d.polls = (d.polls + 1).min(needed.max(d.polls))),
            None => self.polls = (self.polls + 1).min(needed.max(self.polls)),
        }
    }
    fn constructed(&self, needed: u32) -> bool {
        self.complete() && self.polls() >= needed
    }
    fn complete(&self) -> bool {
        match self.ty {
            Type::Unicast(_) => true,
            Type::Multicast(n) => self.members().len() as u32 == n,
        }
    }
    /// Remove this process's binding at `key`: from the table too, and unmap its view.
    fn remove_binding(&mut self, st: &State, key: (i32, u64)) {
        if let Some(b) = self.bindings.remove(&key) {
            if let Some(t) = &self.table {
                t.with(|d| {
                    shared::unregister(&mut d.binds, |e| e.dev == key.0 && e.offset == key.1)
                });
            }
            super::memory::unmap(b.view.0, b.view.1);
            st.live_add("logical endpoint bindings", -1);
        }
    }
    /// Forget this process's table entries and unmap views of other processes' memory.
    fn detach(&mut self) {
        if let Some(t) = &self.table {
            t.with(|d| shared::unregister(&mut d.binds, |_| true));
        }
        self.remote.unmap_all();
    }
}

/// The data of an exported endpoint's shared table.
#[repr(C)]
struct EpShared {
    magic: [u8; 8],
    creator_pid: u32,
    /// 1: unicast (`arg` = owner), 2: multicast (`arg` = team size).
    kind: u32,
    arg: i32,
    ipc: u32,
    oid: u64,
    size: u64,
    align: u64,
    polls: u32,
    ndev: u32,
    next_gen: u32,
    _pad: u32,
    devices: [i32; shared::MAX_DEVICES],
    binds: [shared::Bind; shared::MAX_BINDS],
}

type EpTable = shared::Table<EpShared>;
const TABLE_MAGIC: &[u8; 8] = b"SIMLETB1";

fn create_table(o: &Object) -> SimResult<EpTable> {
    let me = std::process::id();
    EpTable::create(&format!("cuda-multimem-sim-le/{me}/{}", o.id), |d| {
        d.magic = *TABLE_MAGIC;
        d.creator_pid = me;
        (d.kind, d.arg) = match o.ty {
            Type::Unicast(owner) => (1, owner),
            Type::Multicast(n) => (2, n as i32),
        };
        d.ipc = o.ipc;
        d.oid = o.id;
        d.size = o.size;
        d.align = o.align;
        d.polls = o.polls;
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

fn register(d: &mut EpShared, dev: i32, offset: u64, b: &Binding) -> SimResult {
    shared::register(
        &mut d.binds,
        &mut d.next_gen,
        dev,
        offset,
        b.len,
        b.fd.as_raw_fd(),
        b.file_offset,
    )
}

struct Endpoint {
    object: u64,
    /// A query covering this id answered "ready".
    seen_ready: bool,
    imported: bool,
}

#[derive(Default)]
struct Inner {
    reserved: BTreeSet<u32>,
    next: u32,
    endpoints: HashMap<u32, Endpoint>,
    objects: HashMap<u64, Object>,
}

/// Logical endpoint state of a session.
#[derive(Default)]
pub(crate) struct Endpoints {
    inner: Mutex<Inner>,
}

fn invalid<T>() -> SimResult<T> {
    Err(CUresult::CUDA_ERROR_INVALID_VALUE)
}

/// Decoded, validated properties.
pub(crate) struct Prop {
    ty: Type,
    size: u64,
    ipc: c_uint,
}

/// Validate `prop` against the machine; returns it with the bind alignment and maximum size.
///
pub(crate) fn prop(st: &State, p: &CUlogicalEndpointProp) -> SimResult<(Prop, u64, u64)> {
    let t = p.type_;
    // SAFETY: plain integers in a union; the type field says which one is meant.
    let (ty, devices): (Type, Vec<i32>) = unsafe {
        if t == CUlogicalEndpointType::CU_LOGICAL_ENDPOINT_TYPE_UNICAST {
            let d = p.__bindgen_anon_1.unicast.device;
            st.device(d)
                .map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
            (Type::Unicast(d), vec![d])
        } else if t == CUlogicalEndpointType::CU_LOGICAL_ENDPOINT_TYPE_MULTICAST {
            let n = p.__bindgen_anon_1.multicast.numDevices;
            if n == 0 || n as usize > shared::MAX_DEVICES {
                return invalid();
            }
            (Type::Multicast(n), (0..st.device_count() as i32).collect())
        } else {
            return invalid();
        }
    };
    if p.ipcHandleTypes & !FABRIC_FLAG != 0 || p.flags & !COUNTED_OPS != 0 {
        return invalid();
    }
    let supported = |d: i32| -> SimResult<bool> {
        let c = st.device(d)?;
        Ok(match ty {
            Type::Unicast(_) => c.logical_endpoint_unicast,
            Type::Multicast(_) => c.logical_endpoint_multicast,
        } && (p.flags & COUNTED_OPS == 0 || c.logical_endpoint_multicast)
            && (p.ipcHandleTypes & FABRIC_FLAG == 0 || c.fabric_handle))
    };
    // Unicast: the owner must support it; multicast: some device must (members are checked as
    // they are added).
    let mut any = false;
    for &d in &devices {
        any |= supported(d)?;
    }
    if !any {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    let align = devices
        .iter()
        .filter_map(|&d| st.device(d).ok())
        .map(|c| c.granularity.0 as u64)
        .max()
        .unwrap_or(2 << 20);
    let max = match ty {
        Type::Unicast(d) => st.device(d)?.memory / align * align,
        Type::Multicast(_) => MAX_MULTICAST_SIZE,
    };
    Ok((
        Prop {
            ty,
            size: p.size,
            ipc: p.ipcHandleTypes,
        },
        align,
        max,
    ))
}

/// The ids `[base, base + count)`, refusing overflow and zero counts.
fn id_range(base: u32, count: u32) -> SimResult<std::ops::Range<u32>> {
    let end = base
        .checked_add(count)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if count == 0 {
        return invalid();
    }
    Ok(base..end)
}

impl Inner {
    fn endpoint(&self, id: u32) -> SimResult<(&Endpoint, &Object)> {
        let e = self
            .endpoints
            .get(&id)
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        let o = self
            .objects
            .get(&e.object)
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        Ok((e, o))
    }

    /// Check a bind's arguments; returns the object id.
    fn check_bind(
        &self,
        id: u32,
        dev: i32,
        offset: u64,
        size: u64,
        flags: c_ulonglong,
        shareable: Option<bool>,
    ) -> SimResult<u64> {
        let (e, o) = self.endpoint(id)?;
        if flags != 0 || !e.seen_ready || size == 0 {
            return invalid();
        }
        match o.ty {
            Type::Unicast(owner) if owner != dev || e.imported => return invalid(),
            Type::Multicast(_) if !o.members().contains(&dev) => return invalid(),
            _ => {}
        }
        if offset % o.align != 0 || size % o.align != 0 {
            return invalid();
        }
        if offset.checked_add(size).is_none_or(|end| end > o.size) {
            return invalid();
        }
        // Exported-capable or imported multicast endpoints bind only shareable memory.
        if matches!(o.ty, Type::Multicast(_))
            && (o.ipc != 0 || e.imported)
            && shareable == Some(false)
        {
            return invalid();
        }
        let end = offset + size;
        let overlaps = o
            .bindings
            .range((dev, 0)..(dev, end))
            .any(|(&(_, off), b)| off + b.len > offset);
        if overlaps {
            return invalid();
        }
        Ok(e.object)
    }

    fn unbind_all_via(&mut self, id: u32, st: &State) {
        let Some(e) = self.endpoints.get(&id) else {
            return;
        };
        let Some(o) = self.objects.get_mut(&e.object) else {
            return;
        };
        let gone: Vec<_> = o
            .bindings
            .iter()
            .filter(|(_, b)| b.via == id)
            .map(|(k, _)| *k)
            .collect();
        for k in gone {
            o.remove_binding(st, k);
        }
    }
}

/// Whether `[ptr, ptr + size)` is VMM-mapped memory of device `dev` (one or more mappings).
fn is_mapped_on(st: &State, dev: i32, ptr: usize, size: usize) -> bool {
    let m = st.ext::<Memory>();
    let mut a = ptr;
    let Some(end) = ptr.checked_add(size) else {
        return false;
    };
    while a < end {
        match m.find(a) {
            Some((s, r)) if r.kind == RegionKind::Mapping && r.device == Some(dev) => a = s + r.len,
            _ => return false,
        }
    }
    true
}

/// The fabric handle of an exported endpoint: magic, pid, the table's descriptor number in this
/// process, object id, the table's inode, checksum.
fn fabric_bytes(object: u64, table: &EpTable) -> SimResult<[u8; 64]> {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(FABRIC_MAGIC);
    b[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    b[12..16].copy_from_slice(&table.fd.as_raw_fd().to_le_bytes());
    b[16..24].copy_from_slice(&object.to_le_bytes());
    b[24..32].copy_from_slice(&shared::inode(table.fd.as_raw_fd())?.to_le_bytes());
    let sum = checksum(&b[..56]);
    b[56..].copy_from_slice(&sum.to_le_bytes());
    Ok(b)
}

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Addresses of every device's memory bound to endpoint `id` at `[offset, offset + len)`: one per
/// bound device (multicast), or the owner's (unicast). For simulated kernels and fabric copies.
/// The range must lie inside one binding per device.
pub fn endpoint_targets(id: u32, offset: u64, len: u64) -> Result<Vec<usize>, CUresult> {
    let st = current().ok_or(CUresult::CUDA_ERROR_DEINITIALIZED)?;
    let eps = st.ext::<Endpoints>();
    let mut g = eps.inner.lock();
    let (e, _) = g.endpoint(id)?;
    if !e.seen_ready {
        return invalid();
    }
    let oid = e.object;
    let o = g
        .objects
        .get_mut(&oid)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let end = offset
        .checked_add(len)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let mut targets = Vec::new();
    if o.table.is_some() {
        // Every process's bindings, from the shared table (lowest device first).
        let me = std::process::id();
        let mut entries: Vec<(usize, shared::Bind)> = o
            .table
            .as_ref()
            .map(|t| {
                t.with(|d| {
                    d.binds
                        .iter()
                        .enumerate()
                        .filter(|(_, b)| {
                            b.live != 0 && b.offset <= offset && end <= b.offset + b.len
                        })
                        .map(|(i, b)| (i, *b))
                        .collect()
                })
            })
            .unwrap_or_default();
        entries.sort_by_key(|(_, b)| b.dev);
        for (slot, b) in entries {
            let base = if b.pid == me {
                match o.bindings.get(&(b.dev, b.offset)) {
                    Some(l) => l.view.0,
                    None => continue,
                }
            } else {
                o.remote.view(slot, &b)?
            };
            targets.push(base + (offset - b.offset) as usize);
        }
    } else {
        for (&(_, off), b) in &o.bindings {
            if off <= offset && end <= off + b.len {
                targets.push(b.view.0 + (offset - off) as usize);
            }
        }
    }
    if targets.is_empty() {
        return Err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
    }
    Ok(targets)
}

/// One planned fabric copy.
enum Copy {
    /// (dst, src, len)
    PtrPtr(usize, usize, usize),
    /// (endpoint, offset, src, len)
    PtrLe(u32, u64, usize, usize),
    /// (dst, endpoint, offset, len)
    LePtr(usize, u32, u64, usize),
}

/// End of a session: drop every binding's private view.
pub(crate) fn teardown(st: &State) {
    let eps = st.ext::<Endpoints>();
    let mut g = eps.inner.lock();
    for o in g.objects.values_mut() {
        o.detach();
        for b in std::mem::take(&mut o.bindings).into_values() {
            super::memory::unmap(b.view.0, b.view.1);
        }
    }
}

/// Bind `size` bytes of allocation `a` from `at`, checking that it is `dev`'s memory (or the
/// memory of `dev`'s nearest host NUMA node).
#[allow(clippy::too_many_arguments)]
fn bind_view(
    st: &State,
    id: u32,
    dev: i32,
    offset: u64,
    size: u64,
    flags: c_ulonglong,
    a: AllocInfo,
    at: usize,
) -> SimResult {
    let ok = match (a.device, a.numa) {
        (Some(d), _) => d == dev,
        (None, Some(n)) => st.device(dev)?.host_numa_id == n,
        _ => false,
    };
    if !ok || size == 0 {
        return invalid();
    }
    let v = shared::view_of(a.fd.as_raw_fd(), at, size as usize)?;
    let b = Binding {
        len: size,
        view: (v, size as usize),
        fd: a.fd,
        file_offset: at as u64,
        via: id,
    };
    let eps = st.ext::<Endpoints>();
    let mut g = eps.inner.lock();
    let obj = match g.check_bind(id, dev, offset, size, flags, Some(a.shareable)) {
        Ok(o) => o,
        Err(e) => {
            super::memory::unmap(v, size as usize);
            return Err(e);
        }
    };
    let o = g
        .objects
        .get_mut(&obj)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if let Some(t) = &o.table {
        if let Err(e) = t.with(|d| register(d, dev, offset, &b)) {
            super::memory::unmap(v, size as usize);
            return Err(e);
        }
    }
    o.bindings.insert((dev, offset), b);
    st.live_add("logical endpoint bindings", 1);
    Ok(())
}

/// `cuLogicalEndpointIdReserve` of `count` (non-zero) ids; the first.
pub(crate) fn reserve_ids(st: &State, count: u32) -> SimResult<u32> {
    let eps = st.ext::<Endpoints>();
    let mut g = eps.inner.lock();
    if g.reserved.len() as u64 + count as u64 > MAX_IDS {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    // First fit from the rolling cursor (ids are not reused at once, which catches stale ids).
    let mut b = g.next;
    loop {
        let Some(end) = b.checked_add(count) else {
            b = 0;
            continue;
        };
        match g.reserved.range(b..end).next_back() {
            None => break,
            Some(&taken) => b = taken + 1,
        }
    }
    for i in b..b + count {
        g.reserved.insert(i);
    }
    g.next = b + count;
    st.live_add("logical endpoint ids", count as i64);
    Ok(b)
}

/// `cuLogicalEndpointIdRelease`.
pub(crate) fn release_ids(st: &State, base: u32, count: u32) -> SimResult {
    let r = id_range(base, count)?;
    let eps = st.ext::<Endpoints>();
    let mut g = eps.inner.lock();
    if r.clone()
        .any(|i| !g.reserved.contains(&i) || g.endpoints.contains_key(&i))
    {
        return invalid();
    }
    for i in r {
        g.reserved.remove(&i);
    }
    st.live_add("logical endpoint ids", -(count as i64));
    Ok(())
}

/// `cuLogicalEndpointCreate` of id `id` as `p` describes.
pub(crate) fn create(st: &State, id: u32, p: &CUlogicalEndpointProp) -> SimResult {
    let (p, align, max) = prop(st, p)?;
    if p.size == 0 || p.size % align != 0 || p.size > max {
        return invalid();
    }
    let eps = st.ext::<Endpoints>();
    let mut g = eps.inner.lock();
    if !g.reserved.contains(&id) || g.endpoints.contains_key(&id) {
        return invalid();
    }
    let oid = NEXT_OBJECT.fetch_add(1, Ordering::Relaxed);
    g.objects.insert(
        oid,
        Object {
            id: oid,
            ty: p.ty,
            size: p.size,
            ipc: p.ipc,
            align,
            devices: match p.ty {
                Type::Unicast(d) => vec![d],
                Type::Multicast(_) => Vec::new(),
            },
            polls: 0,
            bindings: BTreeMap::new(),
            refs: 1,
            table: None,
            remote: Default::default(),
        },
    );
    g.endpoints.insert(
        id,
        Endpoint {
            object: oid,
            seen_ready: false,
            imported: false,
        },
    );
    st.live_add("logical endpoints", 1);
    Ok(())
}

/// `cuLogicalEndpointAddDevice`.
pub(crate) fn add_device(st: &State, id: u32, dev: i32) -> SimResult {
    let c = st
        .device(dev)
        .map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let eps = st.ext::<Endpoints>();
    let mut g = eps.inner.lock();
    let oid = g.endpoint(id)?.0.object;
    let o = g
        .objects
        .get_mut(&oid)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let Type::Multicast(n) = o.ty else {
        return invalid();
    };
    // Counted operations come with multicast endpoint support on the simulated devices.
    if !c.logical_endpoint_multicast {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    let check = |members: &[i32]| -> SimResult {
        if members.contains(&dev) || members.len() as u32 >= n {
            return invalid();
        }
        if members.first().is_some_and(|&d| !same_clique(st, d, dev)) {
            return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
        }
        Ok(())
    };
    match &o.table {
        // Check and add in one critical section: other processes add devices too.
        Some(t) => t.with(|d| {
            check(&d.devices[..d.ndev as usize])?;
            d.devices[d.ndev as usize] = dev;
            d.ndev += 1;
            Ok(())
        })?,
        None => check(&o.devices)?,
    }
    o.devices.push(dev);
    Ok(())
}

/// `cuLogicalEndpointQuery` of ids `[id, id + count)`: whether every one is constructed.
pub(crate) fn query(st: &State, id: u32, count: u32) -> SimResult<bool> {
    let r = id_range(id, count)?;
    let needed = st.config.endpoint_ready_polls;
    let eps = st.ext::<Endpoints>();
    let mut g = eps.inner.lock();
    let mut objs = Vec::new();
    for i in r.clone() {
        objs.push(g.endpoint(i)?.0.object);
    }
    objs.sort_unstable();
    objs.dedup();
    let mut all = true;
    for oid in &objs {
        let o = g
            .objects
            .get_mut(oid)
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        o.poll(needed);
        all &= o.constructed(needed);
    }
    if all {
        for i in r {
            if let Some(e) = g.endpoints.get_mut(&i) {
                e.seen_ready = true;
            }
        }
    }
    Ok(all)
}

/// `cuLogicalEndpointDestroy`.
pub(crate) fn destroy(st: &State, id: u32) -> SimResult {
    let eps = st.ext::<Endpoints>();
    let mut g = eps.inner.lock();
    g.endpoint(id)?;
    g.unbind_all_via(id, st);
    let e = g
        .endpoints
        .remove(&id)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let last = match g.objects.get_mut(&e.object) {
        Some(o) => {
            o.refs -= 1;
            o.refs == 0
        }
        None => false,
    };
    if last {
        if let Some(mut o) = g.objects.remove(&e.object) {
            o.detach();
        }
    }
    st.live_add("logical endpoints", -1);
    Ok(())
}

/// The bind alignment of endpoint `id`.
fn align_of(st: &State, id: u32) -> SimResult<u64> {
    let eps = st.ext::<Endpoints>();
    let g = eps.inner.lock();
    Ok(g.endpoint(id)?.1.align)
}

/// `cuLogicalEndpointBindAddr`.
pub(crate) fn bind_addr(
    st: &State,
    id: u32,
    dev: i32,
    offset: u64,
    ptr: usize,
    size: u64,
    flags: c_ulonglong,
) -> SimResult {
    st.device(dev)
        .map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let align = align_of(st, id)?;
    if (ptr as u64) % align != 0 || !is_mapped_on(st, dev, ptr, size as usize) {
        return invalid();
    }
    let (a, at, mapped) = super::vmm::allocation_at(st, ptr)?;
    if size as usize > mapped {
        return invalid();
    }
    bind_view(st, id, dev, offset, size, flags, a, at)
}

/// `cuLogicalEndpointBindMem`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bind_mem(
    st: &State,
    id: u32,
    dev: i32,
    offset: u64,
    mem: u64,
    mem_offset: u64,
    size: u64,
    flags: c_ulonglong,
) -> SimResult {
    st.device(dev)
        .map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let a = super::vmm::allocation_info(st, mem)?;
    let align = align_of(st, id)?;
    if mem_offset % align != 0
        || mem_offset
            .checked_add(size)
            .is_none_or(|e| e > a.size as u64)
    {
        return invalid();
    }
    bind_view(st, id, dev, offset, size, flags, a, mem_offset as usize)
}

/// `cuLogicalEndpointUnbind`: whole bindings of `dev` that exactly tile `[offset, offset + size)`.
pub(crate) fn unbind(st: &State, id: u32, dev: i32, offset: u64, size: u64) -> SimResult {
    let eps = st.ext::<Endpoints>();
    let mut g = eps.inner.lock();
    let oid = g.endpoint(id)?.0.object;
    let o = g
        .objects
        .get_mut(&oid)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if size == 0 || offset % o.align != 0 || size % o.align != 0 {
        return invalid();
    }
    let end = offset
        .checked_add(size)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    // The offset starts a binding, and the range encloses whole bindings exactly.
    if !o.bindings.contains_key(&(dev, offset)) {
        return invalid();
    }
    let covered: Vec<(u64, u64)> = o
        .bindings
        .range((dev, offset)..(dev, end))
        .map(|(&(_, off), b)| (off, b.len))
        .collect();
    let mut at = offset;
    for &(off, len) in &covered {
        if off != at {
            return invalid();
        }
        at = off + len;
    }
    if at != end {
        return invalid();
    }
    for (off, _) in covered {
        o.remove_binding(st, (dev, off));
    }
    Ok(())
}

/// `cuLogicalEndpointExport` of `id` as a fabric handle: its 64 bytes.
pub(crate) fn export(st: &State, id: u32) -> SimResult<[u8; 64]> {
    let eps = st.ext::<Endpoints>();
    let mut g = eps.inner.lock();
    let oid = g.endpoint(id)?.0.object;
    let o = g
        .objects
        .get_mut(&oid)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if o.ipc & FABRIC_FLAG == 0 {
        return invalid();
    }
    if o.table.is_none() {
        o.table = Some(create_table(o)?);
    }
    fabric_bytes(o.id, o.table.as_ref().expect("just made"))
}

/// `cuLogicalEndpointImport` of fabric handle `b` as id `id`.
pub(crate) fn import(st: &State, id: u32, b: &[u8; 64]) -> SimResult {
    if &b[..8] != FABRIC_MAGIC || b[56..] != checksum(&b[..56]).to_le_bytes() {
        return invalid();
    }
    let pid = u32::from_le_bytes(b[8..12].try_into().unwrap_or_default());
    let fd = i32::from_le_bytes(b[12..16].try_into().unwrap_or_default());
    let oid = u64::from_le_bytes(b[16..24].try_into().unwrap_or_default());
    let ino = u64::from_le_bytes(b[24..32].try_into().unwrap_or_default());
    // Another process's endpoint: share its table (opened through /proc, same user).
    let table = if pid != std::process::id() {
        let f = shared::open_remote(pid, fd)?;
        if shared::inode(f.as_raw_fd())? != ino {
            return invalid();
        }
        Some(EpTable::map(f, TABLE_MAGIC)?)
    } else {
        None
    };
    let eps = st.ext::<Endpoints>();
    let mut g = eps.inner.lock();
    if !g.reserved.contains(&id) || g.endpoints.contains_key(&id) {
        return invalid();
    }
    let oid = match table {
        None => {
            let o = g
                .objects
                .get_mut(&oid)
                .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
            o.refs += 1;
            oid
        }
        Some(t) => {
            let (kind, arg, ipc, size, align) = t.with(|d| (d.kind, d.arg, d.ipc, d.size, d.align));
            let ty = match kind {
                1 => Type::Unicast(arg),
                2 if arg > 0 => Type::Multicast(arg as u32),
                _ => return invalid(),
            };
            let local = NEXT_OBJECT.fetch_add(1, Ordering::Relaxed);
            g.objects.insert(
                local,
                Object {
                    id: local,
                    ty,
                    size,
                    ipc,
                    align,
                    devices: Vec::new(),
                    polls: 0,
                    bindings: BTreeMap::new(),
                    refs: 1,
                    table: Some(t),
                    remote: Default::default(),
                },
            );
            local
        }
    };
    g.endpoints.insert(
        id,
        Endpoint {
            object: oid,
            seen_ready: false,
            imported: true,
        },
    );
    st.live_add("logical endpoints", 1);
    Ok(())
}

/// `cuFabricCpyBatchAsync` (flags and stream checked by the caller): validate every operation
/// now, run them in order when `stream` reaches the batch.
pub(crate) fn fabric_copy(
    st: &Arc<State>,
    ops: &[CUDA_FABRIC_COPY_BATCH_OP],
    stream: CUstream,
) -> SimResult {
    let ptr = CUfabricCpyOperandType::CU_FABRIC_COPY_OPERAND_TYPE_POINTER;
    let le = CUfabricCpyOperandType::CU_FABRIC_COPY_OPERAND_TYPE_LOGICAL_ENDPOINT;
    // Validate every operation at enqueue time (operands of no-op sizes too).
    let mut plan = Vec::with_capacity(ops.len());
    {
        let eps = st.ext::<Endpoints>();
        let g = eps.inner.lock();
        for op in ops {
            if op.flags != 0 {
                return invalid();
            }
            let check_le = |id: u32, offset: u64, unicast_only: bool| -> SimResult<()> {
                let (e, o) = g.endpoint(id)?;
                if !e.seen_ready
                    || offset
                        .checked_add(op.size as u64)
                        .is_none_or(|end| end > o.size)
                {
                    return invalid();
                }
                if unicast_only && !matches!(o.ty, Type::Unicast(_)) {
                    return invalid();
                }
                Ok(())
            };
            // SAFETY: each operand's type says which member of its union is meant.
            unsafe {
                match (op.src.type_, op.dst.type_) {
                    (s, d) if s == ptr && d == ptr => plan.push(Copy::PtrPtr(
                        op.dst.op.ptr.ptr as usize,
                        op.src.op.ptr.ptr as usize,
                        op.size,
                    )),
                    (s, d) if s == ptr && d == le => {
                        check_le(op.dst.op.le.id, op.dst.op.le.offset, false)?;
                        plan.push(Copy::PtrLe(
                            op.dst.op.le.id,
                            op.dst.op.le.offset,
                            op.src.op.ptr.ptr as usize,
                            op.size,
                        ));
                    }
                    (s, d) if s == le && d == ptr => {
                        check_le(op.src.op.le.id, op.src.op.le.offset, true)?;
                        plan.push(Copy::LePtr(
                            op.dst.op.ptr.ptr as usize,
                            op.src.op.le.id,
                            op.src.op.le.offset,
                            op.size,
                        ));
                    }
                    _ => return invalid(),
                }
            }
        }
    }
    let s2 = st.clone();
    let plan = Arc::new(plan);
    stream::enqueue(
        st,
        stream,
        Arc::new(move || {
            for c in plan.iter() {
                match *c {
                    Copy::PtrPtr(dst, src, len) => super::memory::copy(&s2, dst, src, len)?,
                    Copy::PtrLe(id, off, src, len) if len > 0 => {
                        for t in endpoint_targets(id, off, len as u64)? {
                            super::memory::copy(&s2, t, src, len)?;
                        }
                    }
                    Copy::LePtr(dst, id, off, len) if len > 0 => {
                        let t = endpoint_targets(id, off, len as u64)?;
                        super::memory::copy(&s2, dst, t[0], len)?;
                    }
                    _ => {}
                }
            }
            Ok(())
        }),
    )
}
