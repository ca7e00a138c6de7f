//! Managed memory: advice with read-back, prefetch (one range, many by loop and by batch),
//! discard and discard-and-prefetch, the CUDA 12 fallbacks, and bad input rejected before the
//! driver is called. Tests through `env()` run on the real driver too; tests through `sim()`
//! pin a driver version or a capability.

mod advice;
mod prefetch;
mod raw;

use std::collections::BTreeSet;

use cuda_multimem::managed::{
    self, Location, ManagedBuffer, ManagedRange, PrefetchPolicy, AUTO_BATCH_MIN_MEAN_RANGE,
};
use cuda_multimem::sys::{CUmemLocationType, CUresult};
use cuda_multimem::{Device, Error, Stream};
use cuda_multimem_sim::{SimConfig, DISCARD_POISON};
use cuda_multimem_tests::{env, fail_each_call, sim, skip, Env, Rng};

const MIB: usize = 1 << 20;

/// The driver versions every call is exercised at on explicit simulators.
const VERSIONS: [i32; 4] = [12000, 12080, 13000, 13030];

fn device0(e: &Env) -> Device {
    e.driver.device(0).expect("device 0")
}

/// Skip (returning true) when device 0 lacks concurrent managed access, which prefetching to a
/// device and host access need.
fn lacks_concurrent_access(name: &str, d: &Device) -> bool {
    if !d.concurrent_managed_access().unwrap() {
        skip(name, "device 0 has no concurrent managed access");
        return true;
    }
    false
}

fn is_invalid(e: &Error, arg: &str) -> bool {
    matches!(e, Error::InvalidArgument { arg: a, .. } if *a == arg)
}

fn is_driver(e: &Error, code: CUresult) -> bool {
    e.code() == Some(code)
}

fn host_like(l: Option<Location>) -> bool {
    matches!(l, Some(Location::Host | Location::HostNuma(_)))
}

/// Fill a buffer with random bytes through the host, returning them.
fn fill_random(buf: &mut ManagedBuffer, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; buf.len()];
    Rng::new(seed).fill(&mut data);
    buf.host_slice_mut().unwrap().copy_from_slice(&data);
    data
}

/// `n` ranges of `size` bytes cut from one buffer.
fn ranges(buf: &ManagedBuffer, n: usize, size: usize) -> Vec<ManagedRange<'_>> {
    (0..n)
        .map(|i| buf.subrange(i * size, size).unwrap())
        .collect()
}
