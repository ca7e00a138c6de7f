//! Device management: count, ordinals, names, memory, UUIDs, attributes, peer attributes and
//! NVLink/fabric cliques.

use std::ffi::{c_char, c_int};

use cuda_multimem_sys::*;

use super::gate::{out, read, sim_api};
use crate::model::device;

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
        let u = device::uuid(st, dev)?;
        out(uuid, u)
    }
    cuDeviceGetAttribute @ 2000 as PFN_cuDeviceGetAttribute_v2000 => fn device_get_attribute(st, pi: *mut c_int, attrib: CUdevice_attribute, dev: CUdevice) {
        let v = device::attribute(st, attrib, dev)?;
        out(pi, v)
    }
    cuDeviceGetP2PAttribute @ 8000 as PFN_cuDeviceGetP2PAttribute_v8000 => fn device_get_p2p_attribute(st, value: *mut c_int, attrib: CUdevice_P2PAttribute, src: CUdevice, dst: CUdevice) {
        st.device(src)?;
        st.device(dst)?;
        if src == dst {
            return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
        }
        let v = device::p2p_attribute(st, attrib, src, dst)?;
        out(value, v)
    }
    cuDeviceGetFabricClusterUuid @ 13040 as PFN_cuDeviceGetFabricClusterUuid_v13040 => fn device_get_fabric_cluster_uuid(st, uuid: *mut CUuuid, dev: CUdevice) {
        let u = device::fabric_cluster_uuid(st, dev)?;
        out(uuid, u)
    }
    cuDeviceGetCliqueCount @ 13040 as PFN_cuDeviceGetCliqueCount_v13040 => fn device_get_clique_count(st, count: *mut usize, dev: CUdevice) {
        let n = device::cliques(st, dev)?.len();
        out(count, n)
    }
    cuDeviceGetCliqueInfo @ 13040 as PFN_cuDeviceGetCliqueInfo_v13040 => fn device_get_clique_info(st, info: *mut CUcliqueInfo, count: *mut usize, dev: CUdevice) {
        let all = device::cliques(st, dev)?;
        // `count` is the array's size going in, the entries written coming out.
        let cap = read(count)?;
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
        out(can, (dev != peer && device::same_clique(st, dev, peer)) as c_int)
    }
}
