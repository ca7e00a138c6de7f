//! The collectives through the typed `Communicator` and the hierarchical communicator:
//! allreduce, reduce-scatter, all-gather, broadcast, the fused allreduce + residual add +
//! RMSNorm, the multimem path, failures, hostile input and cudarc operands. This module holds
//! the allreduce tests' shared helpers.

// Ranks index their streams and buffers: `for r in 0..n` reads as the protocol does.
#![allow(clippy::needless_range_loop)]

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cuda_multimem::{CaptureMode, Device, DeviceBuffer, Driver, Error, Stream};
use cuda_multimem_collectives::testing::{random_bytes, random_input, reference, reference_bytes};
use cuda_multimem_collectives::{
    bf16, f16, multimem_pays_off, Algorithm, Bootstrap, Choice, CommConfig, Communicator, DType,
    Dst, Element, MulticastPolicy, Operands, ReduceOp, Src, SymmetricBuffer,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::collectives::{Call, Elem, Mem, Queued};
use cuda_multimem_tests::{env, sim, skip, Env, Rng};

// ---- harness ----

/// The driver chosen by `CUDA_MULTIMEM_DRIVER`, with the kernels' simulator equivalents
/// installed (a no-op on the real driver).
fn ar_env() -> Env {
    cuda_multimem_collectives::sim::install();
    env()
}

/// A simulated machine of `n` devices for one test, with the kernels' equivalents installed.
fn ar_sim(n: usize) -> Env {
    cuda_multimem_collectives::sim::install();
    sim(SimConfig::new(n, 13000))
}

/// Apply `$f::<T>(args)` with `T` the element type of the run-time `$dtype`.
macro_rules! for_dtype {
    ($dtype:expr, $f:ident ( $($arg:expr),* $(,)? )) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::Bf16 => $f::<bf16>($($arg),*),
            d => panic!("{d} is not reduced"),
        }
    };
}

fn streams(comm: &Communicator) -> Vec<Stream> {
    comm.local_ranks()
        .into_iter()
        .map(|r| Stream::new(comm.device(r).unwrap()).unwrap())
        .collect()
}

fn sync(streams: &[Stream]) {
    for s in streams {
        s.synchronize().unwrap();
    }
}

fn refs<T>(v: &[Vec<T>]) -> Vec<&[T]> {
    v.iter().map(|x| x.as_slice()).collect()
}

/// The first element whose bits differ (so -0 and +0 differ too).
fn first_mismatch<T: Element>(got: &[T], want: &[T]) -> Option<String> {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .position(|(g, w)| g.to_bits64() != w.to_bits64())
        .map(|i| format!("element {i}: got {:?} want {:?}", got[i], want[i]))
}

fn first_mismatch_bytes(dtype: DType, got: &[u8], want: &[u8]) -> Option<String> {
    let es = dtype.size();
    assert_eq!(got.len(), want.len());
    (0..want.len() / es)
        .find(|&i| got[i * es..(i + 1) * es] != want[i * es..(i + 1) * es])
        .map(|i| {
            format!(
                "element {i}: got {} want {}",
                dtype.load(got, i),
                dtype.load(want, i)
            )
        })
}

/// For sums the switch adds in its own order: the first element farther from the rank-order
/// reference than the rounding of `n` additions of the inputs' magnitudes.
fn first_far<T: Element>(got: &[T], want: &[T], inputs: &[Vec<T>]) -> Option<String> {
    let eps = match T::DTYPE {
        DType::F32 => f32::EPSILON,
        DType::F16 => 1.0 / 1024.0,
        DType::Bf16 => 1.0 / 128.0,
        _ => 0.0,
    };
    (0..want.len())
        .find(|&i| {
            let (g, w) = (got[i].to_f32(), want[i].to_f32());
            let mag: f32 = inputs.iter().map(|x| x[i].to_f32().abs()).sum();
            (g - w).abs() > eps * mag.max(1.0) * inputs.len() as f32
        })
        .map(|i| format!("element {i}: got {:?} want {:?}", got[i], want[i]))
}

fn invalid_arg(e: Error) -> &'static str {
    match e {
        Error::InvalidArgument { arg, .. } => arg,
        e => panic!("expected an invalid argument, got {e}"),
    }
}

/// Two devices of `e` that reach each other, or a printed skip.
fn two_devices(e: &Env, test: &str) -> Option<Vec<Device>> {
    let devices = e.driver.devices();
    if devices.len() < 2 {
        skip(
            test,
            format!("needs 2 devices, the machine has {}", devices.len()),
        );
        return None;
    }
    if !devices[0].can_access_peer(&devices[1]).unwrap_or(false) {
        skip(test, "devices 0 and 1 cannot access each other (no P2P)");
        return None;
    }
    Some(devices[..2].to_vec())
}

/// A peer-to-peer team of the first two devices with `config` (the harness's `team_on`).
fn team_with(e: &Env, test: &str, config: CommConfig) -> Option<Communicator> {
    let d = two_devices(e, test)?;
    Some(cuda_multimem_tests::team_on(&d, config, MulticastPolicy::Never).0)
}

fn team(e: &Env, test: &str) -> Option<Communicator> {
    team_with(e, test, CommConfig::default())
}

mod allreduce;
mod alltoall;
mod cudarc_ops;
mod failures;
mod gather;
mod hier;
mod hostile_buffers;
mod hostile_collectives;
mod moe;
mod multimem;
mod norm;
mod norm_fp8;
mod recovery;
mod shared;
mod smoke;
mod table;
mod types;
