//! Devices, their attributes, primary contexts, the current context, peer access.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_int, c_uint};

use cuda_multimem_sys::*;
use parking_lot::Mutex;

use crate::dispatch::sim_api;
use crate::state::{is_kind, new_handle, out, Kind, SimResult, State};

/// Contexts: primary context per device (retain counts) and enabled peer access.
#[derive(Default)]
pub(crate) struct Contexts {
    inner: Mutex<CtxInner>,
}

#[derive(Default)]
struct CtxInner {
    /// device -> (handle, retain count)
    primary: HashMap<i32, (u64, u32)>,
    /// handle -> device
    by_handle: HashMap<u64, i32>,
    /// (from device, to device) pairs with peer access enabled
    peers: HashSet<(i32, i32)>,
    /// device -> the sticky error of its primary context (a kernel fault); cleared when the
    /// context is destroyed (its last release)
    sticky: HashMap<i32, CUresult>,
}

/// Statuses after which a real context is unusable ("sticky"): every later call in it returns
/// the error again, until the process (or the primary context) starts over.
pub(crate) fn is_sticky(code: CUresult) -> bool {
    code == CUresult::CUDA_ERROR_ILLEGAL_ADDRESS || code == CUresult::CUDA_ERROR_LAUNCH_FAILED
}

/// Mark device `dev`'s context as dead with `code` (the first fault wins).
pub(crate) fn poison(st: &State, dev: i32, code: CUresult) {
    st.ext::<Contexts>()
        .inner
        .lock()
        .sticky
        .entry(dev)
        .or_insert(code);
}

/// The sticky error of device `dev`'s context, if it faulted.
pub(crate) fn sticky_error(st: &State, dev: i32) -> Option<CUresult> {
    st.ext::<Contexts>().inner.lock().sticky.get(&dev).copied()
}

/// The sticky error of the calling thread's current context, if it faulted.
pub(crate) fn current_sticky_error(st: &State) -> Option<CUresult> {
    let h = CURRENT_CTX.with(|c| c.get());
    if h == 0 {
        return None;
    }
    let c = st.ext::<Contexts>();
    let g = c.inner.lock();
    let dev = g.by_handle.get(&h)?;
    g.sticky.get(dev).copied()
}

/// Calls that a dead context does not refuse: those that need no context (device queries,
/// choosing and releasing contexts, error names) and the teardown calls (destroy, release, free,
/// unmap, unload, unbind), which the simulator lets through so that a program — and the
/// simulator's live-resource accounting — can still clean up. Every other call made while the
/// current context is dead returns its sticky error.
pub(crate) fn ignores_sticky(name: &str) -> bool {
    const CONTEXT_FREE: &[&str] = &[
        "cuInit",
        "cuDriverGetVersion",
        "cuGetProcAddress",
        "cuGetErrorName",
        "cuGetErrorString",
        "cuDeviceGet",
        "cuDeviceGetCount",
        "cuDeviceGetName",
        "cuDeviceGetAttribute",
        "cuDeviceTotalMem",
        "cuDeviceGetUuid",
        "cuDeviceCanAccessPeer",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease",
        "cuDevicePrimaryCtxGetState",
        "cuCtxSetCurrent",
        "cuCtxGetCurrent",
        "cuCtxGetDevice",
        // Scoped by their stream's context, not the current one: they check it themselves.
        "cuStreamSynchronize",
        "cuStreamQuery",
    ];
    CONTEXT_FREE.contains(&name)
        || [
            "Destroy",
            "Release",
            "Free",
            "Unmap",
            "Unload",
            "Unbind",
            "Unregister",
        ]
        .iter()
        .any(|w| name.contains(w))
}

thread_local! {
    static CURRENT_CTX: Cell<u64> = const { Cell::new(0) };
}

/// The device of the calling thread's current context.
pub(crate) fn current_device(st: &State) -> SimResult<i32> {
    let h = CURRENT_CTX.with(|c| c.get());
    if h == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
    }
    st.ext::<Contexts>()
        .inner
        .lock()
        .by_handle
        .get(&h)
        .copied()
        .ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)
}

/// The device of context handle `ctx` (null: the current one).
pub(crate) fn context_device(st: &State, ctx: CUcontext) -> SimResult<i32> {
    if ctx.is_null() {
        return current_device(st);
    }
    st.ext::<Contexts>()
        .inner
        .lock()
        .by_handle
        .get(&(ctx as u64))
        .copied()
        .ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)
}

/// Whether devices `a` and `b` share an NVLink clique.
pub(crate) fn same_clique(st: &State, a: i32, b: i32) -> bool {
    match (st.device(a), st.device(b)) {
        (Ok(x), Ok(y)) => x.clique == y.clique,
        _ => false,
    }
}

/// The CUDA version that introduced device attribute `a`, by the headers' history (attributes
/// past the driver's maximum are `CUDA_ERROR_INVALID_VALUE`, as measured on a 13.0 driver for
/// 153-158).
fn attribute_introduced(a: u32) -> i32 {
    match a {
        0..=131 => 12000,
        132..=133 => 12010,
        134 => 12020,
        135..=140 => 12040,
        141..=148 => 12060,
        149..=152 => 13000,
        153..=158 => 13030,
        _ => 13050,
    }
}

fn attribute(st: &State, attr: CUdevice_attribute, dev: i32) -> SimResult<c_int> {
    use CUdevice_attribute as A;
    let d = st.device(dev)?;
    if attr.0 == 0
        || attr.0 >= A::CU_DEVICE_ATTRIBUTE_MAX.0
        || attribute_introduced(attr.0) > st.version()
    {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let b = |x: bool| x as c_int;
    Ok(match attr {
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => d.compute_capability.0,
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => d.compute_capability.1,
        A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => d.multiprocessors,
        A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK => 1024,
        A::CU_DEVICE_ATTRIBUTE_WARP_SIZE => 32,
        A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING => 1,
        A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY => 1,
        A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED => b(d.vmm),
        A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED => b(d.posix_fd_handle),
        A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED => b(d.fabric_handle),
        A::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED => b(d.multicast),
        A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS => b(d.concurrent_managed_access),
        A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS => 0,
        A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID => d.host_numa_id,
        A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED => 1,
        A::CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED => 0,
        A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED => {
            b(d.vmm && d.host_numa_id >= 0)
        }
        A::CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED => b(d.vmm),
        A::CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_UNICAST_SUPPORTED => b(d.logical_endpoint_unicast),
        A::CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_MULTICAST_SUPPORTED => {
            b(d.logical_endpoint_multicast)
        }
        A::CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_COUNTED_OPS_SUPPORTED => {
            b(d.logical_endpoint_multicast)
        }
        A::CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_UNICAST_ACCESS_ON_OWNER_DEVICE_SUPPORTED => {
            b(d.logical_endpoint_unicast)
        }
        A::CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_SUPPORTED_HANDLE_TYPES
            if d.fabric_handle && (d.logical_endpoint_unicast || d.logical_endpoint_multicast) =>
        {
            1 << CUlogicalEndpointIpcHandleType::CU_LOGICAL_ENDPOINT_IPC_HANDLE_TYPE_FABRIC.0
        }
        _ => 0,
    })
}

/// `cuDeviceGetP2PAttribute`'s answer for the pair (`src` != `dst`, both valid): peers are the
/// devices of one NVLink clique, with native atomics and array access over the link, performance
/// rank 0 (the best); devices of different cliques report no access and rank 0.
fn p2p_attribute(st: &State, attr: CUdevice_P2PAttribute, src: i32, dst: i32) -> SimResult<c_int> {
    use CUdevice_P2PAttribute as P;
    let peers = same_clique(st, src, dst) as c_int;
    Ok(match attr {
        P::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK => 0,
        P::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED
        | P::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
        | P::CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED => peers,
        P::CU_DEVICE_P2P_ATTRIBUTE_ONLY_PARTIAL_NATIVE_ATOMIC_SUPPORTED => 0,
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    })
}

/// The fabric cliques of device `dev`, sorted by type as the driver sorts them: the unicast
/// pointer clique (every device with fabric handles), the multicast pointer clique (with
/// multicast), and the logical-endpoint cliques (with logical endpoints, which 13.3+ drivers
/// report). The id is the configured NVLink clique. A device without fabric handles is not on a
/// fabric: `CUDA_ERROR_NOT_SUPPORTED`.
fn cliques(st: &State, dev: i32) -> SimResult<Vec<CUcliqueInfo>> {
    use CUcliqueType as T;
    let d = st.device(dev)?;
    if !d.fabric_handle {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    let mut v = vec![T::CU_CLIQUE_TYPE_UNICAST_POINTER];
    if d.multicast {
        v.push(T::CU_CLIQUE_TYPE_MULTICAST_POINTER);
    }
    if d.logical_endpoint_unicast {
        v.push(T::CU_CLIQUE_TYPE_UNICAST_LOGICAL_ENDPOINT);
    }
    if d.logical_endpoint_multicast {
        v.push(T::CU_CLIQUE_TYPE_MULTICAST_LOGICAL_ENDPOINT);
    }
    Ok(v.into_iter()
        .map(|type_| CUcliqueInfo {
            type_,
            id: d.clique,
        })
        .collect())
}

/// The fabric cluster of device `dev`: one UUID per configured clique (the simulated machine's
/// cliques are its NVLink domains).
fn fabric_cluster_uuid(st: &State, dev: i32) -> SimResult<CUuuid> {
    let d = st.device(dev)?;
    if !d.fabric_handle {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    let mut u = CUuuid::default();
    for (i, b) in u.bytes.iter_mut().enumerate() {
        *b = (0xc1 ^ (d.clique as u8).wrapping_mul(17) ^ (i as u8).wrapping_mul(3)) as c_char;
    }
    Ok(u)
}

sim_api! {
    cuDeviceGetCount @ 2000 as PFN_cuDeviceGetCount_v2000 => fn device_get_count(st, count: *mut c_int) {
        out(count, st.device_count() as c_int)
    }
    cuDeviceGet @ 2000 as PFN_cuDeviceGet_v2000 => fn device_get(st, dev: *mut CUdevice, ordinal: c_int) {
        st.device(ordinal)?;
        out(dev, ordinal)
    }
    cuDeviceGetName @ 2000 as PFN_cuDeviceGetName_v2000 => fn device_get_name(st, name: *mut c_char, len: c_int, dev: CUdevice) {
        let d = st.device(dev)?;
        if name.is_null() || len <= 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let bytes = d.name.as_bytes();
        let n = bytes.len().min(len as usize - 1);
        std::ptr::copy_nonoverlapping(bytes.as_ptr() as *const c_char, name, n);
        *name.add(n) = 0;
        Ok(())
    }
    cuDeviceTotalMem @ 3020 as PFN_cuDeviceTotalMem_v3020 => fn device_total_mem(st, bytes: *mut usize, dev: CUdevice) {
        out(bytes, st.device(dev)?.memory as usize)
    }
    cuDeviceGetUuid @ 11040 as PFN_cuDeviceGetUuid_v11040 => fn device_get_uuid(st, uuid: *mut CUuuid, dev: CUdevice) {
        st.device(dev)?;
        let mut u = CUuuid::default();
        for (i, b) in u.bytes.iter_mut().enumerate() {
            *b = (0x5a ^ (dev as u8).wrapping_mul(31) ^ i as u8) as c_char;
        }
        out(uuid, u)
    }
    cuDeviceGetAttribute @ 2000 as PFN_cuDeviceGetAttribute_v2000 => fn device_get_attribute(st, pi: *mut c_int, attrib: CUdevice_attribute, dev: CUdevice) {
        let v = attribute(st, attrib, dev)?;
        out(pi, v)
    }
    cuDeviceGetP2PAttribute @ 8000 as PFN_cuDeviceGetP2PAttribute_v8000 => fn device_get_p2p_attribute(st, value: *mut c_int, attrib: CUdevice_P2PAttribute, src: CUdevice, dst: CUdevice) {
        st.device(src)?;
        st.device(dst)?;
        if src == dst {
            return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
        }
        let v = p2p_attribute(st, attrib, src, dst)?;
        out(value, v)
    }
    cuDeviceGetFabricClusterUuid @ 13040 as PFN_cuDeviceGetFabricClusterUuid_v13040 => fn device_get_fabric_cluster_uuid(st, uuid: *mut CUuuid, dev: CUdevice) {
        let u = fabric_cluster_uuid(st, dev)?;
        out(uuid, u)
    }
    cuDeviceGetCliqueCount @ 13040 as PFN_cuDeviceGetCliqueCount_v13040 => fn device_get_clique_count(st, count: *mut usize, dev: CUdevice) {
        let n = cliques(st, dev)?.len();
        out(count, n)
    }
    cuDeviceGetCliqueInfo @ 13040 as PFN_cuDeviceGetCliqueInfo_v13040 => fn device_get_clique_info(st, info: *mut CUcliqueInfo, count: *mut usize, dev: CUdevice) {
        let all = cliques(st, dev)?;
        // `count` is the array's size going in, the entries written coming out.
        let cap = crate::state::read(count)?;
        if info.is_null() && cap > 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let n = cap.min(all.len());
        for (i, c) in all.iter().take(n).enumerate() {
            info.add(i).write(*c);
        }
        out(count, n)
    }
    cuDeviceCanAccessPeer @ 4000 as PFN_cuDeviceCanAccessPeer_v4000 => fn device_can_access_peer(st, can: *mut c_int, dev: CUdevice, peer: CUdevice) {
        st.device(dev)?;
        st.device(peer)?;
        out(can, (dev != peer && same_clique(st, dev, peer)) as c_int)
    }
    cuDevicePrimaryCtxRetain @ 7000 as PFN_cuDevicePrimaryCtxRetain_v7000 => fn primary_ctx_retain(st, pctx: *mut CUcontext, dev: CUdevice) {
        st.device(dev)?;
        if pctx.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let c = st.ext::<Contexts>();
        let mut g = c.inner.lock();
        let entry = g.primary.entry(dev).or_insert((0, 0));
        if entry.1 == 0 {
            entry.0 = new_handle(Kind::Context);
            st.live_add("primary contexts", 1);
        }
        entry.1 += 1;
        let h = entry.0;
        g.by_handle.insert(h, dev);
        out(pctx, h as CUcontext)
    }
    cuDevicePrimaryCtxRelease @ 11000 as PFN_cuDevicePrimaryCtxRelease_v11000 => fn primary_ctx_release(st, dev: CUdevice) {
        st.device(dev)?;
        let c = st.ext::<Contexts>();
        let mut g = c.inner.lock();
        let entry = g.primary.get_mut(&dev).filter(|e| e.1 > 0).ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
        entry.1 -= 1;
        if entry.1 == 0 {
            let h = entry.0;
            g.by_handle.remove(&h);
            g.peers.retain(|&(a, b)| a != dev && b != dev);
            // A new primary context starts healthy.
            g.sticky.remove(&dev);
            st.live_add("primary contexts", -1);
        }
        Ok(())
    }
    cuDevicePrimaryCtxGetState @ 7000 as PFN_cuDevicePrimaryCtxGetState_v7000 => fn primary_ctx_get_state(st, dev: CUdevice, flags: *mut c_uint, active: *mut c_int) {
        st.device(dev)?;
        let c = st.ext::<Contexts>();
        let n = c.inner.lock().primary.get(&dev).map_or(0, |e| e.1);
        out(flags, 0)?;
        out(active, (n > 0) as c_int)
    }
    cuCtxSetCurrent @ 4000 as PFN_cuCtxSetCurrent_v4000 => fn ctx_set_current(st, ctx: CUcontext) {
        let h = ctx as u64;
        if h != 0 && (!is_kind(h, Kind::Context) || !st.ext::<Contexts>().inner.lock().by_handle.contains_key(&h)) {
            return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        CURRENT_CTX.with(|c| c.set(h));
        Ok(())
    }
    cuCtxGetCurrent @ 4000 as PFN_cuCtxGetCurrent_v4000 => fn ctx_get_current(st, ctx: *mut CUcontext) {
        out(ctx, CURRENT_CTX.with(|c| c.get()) as CUcontext)
    }
    cuCtxGetDevice @ 2000 as PFN_cuCtxGetDevice_v2000 => fn ctx_get_device(st, dev: *mut CUdevice) {
        let d = current_device(st)?;
        out(dev, d)
    }
    cuCtxSynchronize @ 2000 as PFN_cuCtxSynchronize_v2000 => fn ctx_synchronize(st) {
        let d = current_device(st)?;
        crate::stream::synchronize_device(st, d)
    }
    cuCtxEnablePeerAccess @ 4000 as PFN_cuCtxEnablePeerAccess_v4000 => fn ctx_enable_peer_access(st, peer: CUcontext, flags: c_uint) {
        if flags != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let me = current_device(st)?;
        let other = context_device(st, peer)?;
        if me == other || !same_clique(st, me, other) {
            return Err(CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
        }
        if !st.ext::<Contexts>().inner.lock().peers.insert((me, other)) {
            return Err(CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
        }
        Ok(())
    }
    cuCtxDisablePeerAccess @ 4000 as PFN_cuCtxDisablePeerAccess_v4000 => fn ctx_disable_peer_access(st, peer: CUcontext) {
        let me = current_device(st)?;
        let other = context_device(st, peer)?;
        if !st.ext::<Contexts>().inner.lock().peers.remove(&(me, other)) {
            return Err(CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
        }
        Ok(())
    }
}
