//! VMM: physical allocations, reservations, mappings, access, shareable handles, growable
//! buffers — and that memory comes back.
// `usize::is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#![allow(clippy::manual_is_multiple_of)]

mod mappings;
mod raw;
mod sharing;
mod unmap;

use std::sync::Arc;

use cuda_multimem::sys::{CUdeviceptr, CUresult};
use cuda_multimem::vmm::{
    Access, AllocationSpec, FabricHandle, Granularity, HandleTypes, Location, Mapping,
    PhysicalAllocation, Reservation, Rounding, VmmBuffer,
};
use cuda_multimem::{Driver, Error};
use cuda_multimem_sim::{FailurePlan, SimConfig};
use cuda_multimem_tests::{env, random_bytes as random, sim, skip};

const MIB: usize = 1 << 20;

/// Copy host bytes to device memory with device 0's context current, and wait until they are
/// there: a pageable `cuMemcpyHtoD` returns before its DMA has finished, so another context, a
/// peer device or another process could read the old bytes (the simulator models that).
fn htod(d: &Driver, dst: CUdeviceptr, src: &[u8]) -> Result<(), Error> {
    // SAFETY: the driver checks the device range; `src` is live for the call.
    unsafe { d.device(0)?.copy_from_host_blocking(dst, src) }
}

/// Copy device memory to host bytes (`cuMemcpyDtoH`), with device 0's context current.
fn dtoh(d: &Driver, dst: &mut [u8], src: CUdeviceptr) -> Result<(), Error> {
    d.device(0)?.bind()?;
    let f = d.sys().cuMemcpyDtoH()?;
    // SAFETY: `dst` is valid for `dst.len()` bytes; the device range is checked by the driver.
    let r = unsafe { f(dst.as_mut_ptr().cast(), src, dst.len()) };
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver {
            call: "cuMemcpyDtoH",
            code: r,
        })
    }
}

/// Run every VMM path once, so the loader has resolved (and cached) every entry point before a
/// test injects failures (a failed `cuGetProcAddress` is not what those tests are about).
fn warm_up(d: &Driver) {
    let a = PhysicalAllocation::builder(d, Location::Device(0))
        .create(2 * MIB)
        .unwrap();
    let m = Mapping::map_whole(&a, &rw0()).unwrap();
    m.access(Location::Device(0)).unwrap();
    let mut b = VmmBuffer::new(
        PhysicalAllocation::builder(d, Location::Device(0)),
        2 * MIB,
        &[],
    )
    .unwrap();
    b.grow(4 * MIB).unwrap();
    let blocker = Reservation::builder(d, 2 * MIB)
        .address_hint(b.device_ptr() + b.size() as u64)
        .reserve()
        .unwrap();
    b.grow(6 * MIB).unwrap();
    drop((blocker, b, m, a));
}

fn rw0() -> [(Location, Access); 1] {
    [(Location::Device(0), Access::ReadWrite)]
}

fn gran(d: &Driver) -> usize {
    AllocationSpec::device(0)
        .granularity(d, Granularity::Minimum)
        .unwrap()
}
