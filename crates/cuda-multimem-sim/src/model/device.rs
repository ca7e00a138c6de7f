//! What a simulated device is: its attributes (by the driver version that introduced each),
//! peer attributes and NVLink cliques, fabric cliques and cluster, name and UUID.

use std::ffi::{c_char, c_int};

use cuda_multimem_sys::*;

use crate::state::{SimResult, State};

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

pub(crate) fn attribute(st: &State, attr: CUdevice_attribute, dev: i32) -> SimResult<c_int> {
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
        // a PCI location of its own per device (a real machine's GPUs sit on distinct buses),
        // the same in every process that starts the same machine
        A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID => 0,
        A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID => 0x18 + dev,
        A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID => 0,
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
pub(crate) fn p2p_attribute(
    st: &State,
    attr: CUdevice_P2PAttribute,
    src: i32,
    dst: i32,
) -> SimResult<c_int> {
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
pub(crate) fn cliques(st: &State, dev: i32) -> SimResult<Vec<CUcliqueInfo>> {
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
pub(crate) fn fabric_cluster_uuid(st: &State, dev: i32) -> SimResult<CUuuid> {
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

/// The UUID of device `dev`.
pub(crate) fn uuid(st: &State, dev: i32) -> SimResult<CUuuid> {
    st.device(dev)?;
    let mut u = CUuuid::default();
    for (i, b) in u.bytes.iter_mut().enumerate() {
        *b = (0x5a ^ (dev as u8).wrapping_mul(31) ^ i as u8) as c_char;
    }
    Ok(u)
}
