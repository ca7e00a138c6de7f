//! Multicast objects: granularity, create, add device, binds (12.1 and per-device 13.1 ABIs),
//! mapping, stores reaching every bound device, teardown order, export/import, the guard.
//!
//! Everything that creates a multicast object runs on an explicit simulator (`sim(...)`), never
//! on `env()`: the GPU machines must never create one. On the real driver only the guard and the
//! capability report run.
#![allow(clippy::manual_is_multiple_of)]

mod guard;
mod objects;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_multimem::multicast::{
    disable_multicast_on_this_thread, multicast_allowed, multicast_allowed_for, policy_from,
    MulticastObject, MulticastSpec, DISABLE_MULTICAST_ENV, NVLS_ENABLE_ENV,
    NVSHMEM_DISABLE_NVLS_ENV, TORCH_SYMM_MEM_DISABLE_MULTICAST_ENV,
};
use cuda_multimem::sys::{CUdeviceptr, CUmulticastObjectProp, CUresult};
use cuda_multimem::vmm::{Access, Granularity, HandleTypes, Location, Mapping, PhysicalAllocation};
use cuda_multimem::{Driver, Error};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{env, fail_each_call, random_bytes as random, sim, skip};

const MIB: usize = 1 << 20;

/// Copy host bytes to device memory with device 0's context current, and wait until they are
/// there: a pageable `cuMemcpyHtoD` returns before its DMA has finished, so another context, a
/// peer device or another process could read the old bytes (the simulator models that).
pub(crate) fn htod(d: &Driver, dst: CUdeviceptr, src: &[u8]) -> Result<(), Error> {
    // SAFETY: the driver checks the device range; `src` is live for the call.
    unsafe { d.device(0)?.copy_from_host_blocking(dst, src) }
}

pub(crate) fn dtoh(d: &Driver, dst: &mut [u8], src: CUdeviceptr) -> Result<(), Error> {
    d.device(0)?.bind()?;
    let f = d.sys().cuMemcpyDtoH()?;
    // SAFETY: `dst` is valid for its length; the driver checks the device range.
    match unsafe { f(dst.as_mut_ptr().cast(), src, dst.len()) } {
        CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(Error::Driver {
            call: "cuMemcpyDtoH",
            code,
        }),
    }
}

/// Live simulated resources other than primary contexts (which the driver value retains).
pub(crate) fn leftovers(
    s: &cuda_multimem_sim::Simulator,
) -> std::collections::BTreeMap<String, i64> {
    let mut l = s.live_resources();
    l.remove("primary contexts");
    l
}

/// Each device's memory, mapped read-write for all `n` devices.
fn member_memory(d: &Driver, n: usize, size: usize, ht: HandleTypes) -> Vec<Arc<Mapping>> {
    let access: Vec<_> = (0..n as i32)
        .map(|i| (Location::Device(i), Access::ReadWrite))
        .collect();
    (0..n as i32)
        .map(|i| {
            let a = PhysicalAllocation::builder(d, Location::Device(i))
                .handle_types(ht)
                .create(size)
                .unwrap();
            Arc::new(Mapping::map_whole(&a, &access).unwrap())
        })
        .collect()
}

fn full_object(d: &Driver, n: u32, size: usize) -> MulticastObject {
    let o = MulticastObject::new(d, &MulticastSpec::new(n, size)).unwrap();
    for i in 0..n as usize {
        o.add_device(&d.device(i).unwrap()).unwrap();
    }
    o
}
