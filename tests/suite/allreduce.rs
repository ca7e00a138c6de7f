//! Allreduce through the typed `Communicator`: results equal a host reference (reduced in rank
//! order) for every type and operator, on symmetric buffers and on the caller's own memory,
//! sizes with odd counts and misaligned offsets, back-to-back calls with random per-device delays
//! on teams of 2 to 8, graph replays; bad input is refused before any launch, and a peer that
//! disagrees or never arrives is reported, not waited for forever. The multimem path runs on
//! simulated teams only (real GPUs here must never create a multicast object).

// Ranks index their streams and buffers: `for r in 0..n` reads as the protocol does.
#![allow(clippy::needless_range_loop)]

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cuda_multimem::{CaptureMode, Device, DeviceBuffer, Driver, Error, GraphExec, Stream};
use cuda_multimem_collectives::{
    bf16, f16, multimem_pays_off, random_bytes, random_input, reference, reference_bytes,
    Algorithm, Bootstrap, Choice, CommConfig, Communicator, DType, Dst, Element, MulticastPolicy,
    Operands, Path, ReduceOp, Src, SymmetricBuffer,
};
use cuda_multimem_sim::SimConfig;
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
        .position(|(g, w)| g.to_f32().to_bits() != w.to_f32().to_bits())
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

/// A peer-to-peer team of the first two devices with `config`.
fn team_with(e: &Env, test: &str, config: CommConfig) -> Option<Communicator> {
    let d = two_devices(e, test)?;
    Some(
        Communicator::builder(&d)
            .config(config)
            .multicast(MulticastPolicy::Never)
            .build()
            .unwrap(),
    )
}

fn team(e: &Env, test: &str) -> Option<Communicator> {
    team_with(e, test, CommConfig::default())
}

/// One checked allreduce of `count` random elements on every rank, on symmetric buffers: the
/// input at element `in_off` of `inp`, the output at `out_off` of `out` (`None`: in place).
#[allow(clippy::too_many_arguments)]
fn check_sym<T: Element + Default>(
    comm: &Communicator,
    s: &[Stream],
    seed: &mut u64,
    inp: &mut SymmetricBuffer<T>,
    mut out: Option<&mut SymmetricBuffer<T>>,
    (in_off, out_off): (usize, usize),
    count: usize,
    op: ReduceOp,
) -> Choice {
    let n = comm.size();
    let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(count, seed)).collect();
    for (r, x) in inputs.iter().enumerate() {
        inp.write(r, in_off, x).unwrap();
    }
    let mut choice = None;
    for (r, st) in s.iter().enumerate() {
        let h = comm.rank(r).unwrap();
        let c = match &mut out {
            Some(o) => h.all_reduce(
                inp.slice(in_off..in_off + count).unwrap(),
                o.slice_mut(out_off..out_off + count).unwrap(),
                op,
                st,
            ),
            None => h.all_reduce_in_place(inp.slice_mut(in_off..in_off + count).unwrap(), op, st),
        }
        .unwrap();
        assert_eq!(c.staged_chunks, 0, "symmetric operands are never staged");
        choice = Some(c);
    }
    sync(s);
    comm.check().unwrap();
    let want = reference(op, &refs(&inputs));
    let (buf, off): (&SymmetricBuffer<T>, usize) = match &out {
        Some(o) => (o, out_off),
        None => (inp, in_off),
    };
    let choice = choice.unwrap();
    for r in 0..n {
        let mut got = vec![T::default(); count];
        buf.read(r, off, &mut got).unwrap();
        if let Some(m) = first_mismatch(&got, &want) {
            panic!(
                "rank {r}, {count} x {} {op} ({choice}), offsets {in_off}/{out_off}: {m}",
                T::DTYPE
            );
        }
    }
    choice
}

/// One checked allreduce on the caller's own memory (`DeviceBuffer`s): `in_place` or into a
/// second buffer; with `misaligned`, the input is read through `Src::from_raw` one element into
/// its buffer (not 16-byte aligned).
fn check_own<T: Element + Default>(
    comm: &Communicator,
    s: &[Stream],
    seed: &mut u64,
    count: usize,
    op: ReduceOp,
    in_place: bool,
    misaligned: bool,
) -> Choice {
    let n = comm.size();
    let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(count, seed)).collect();
    let mut choice = None;
    let mut keep = Vec::new();
    for (r, st) in s.iter().enumerate() {
        let h = comm.rank(r).unwrap();
        let d = comm.device(r).unwrap();
        let c = if in_place {
            let mut b = DeviceBuffer::from_host(d, &inputs[r]).unwrap();
            let c = h.all_reduce_in_place(&mut b, op, st).unwrap();
            keep.push((None, b));
            c
        } else if misaligned {
            let mut padded = vec![T::from_f32(9.0)];
            padded.extend_from_slice(&inputs[r]);
            let i = DeviceBuffer::from_host(d, &padded).unwrap();
            let mut o = DeviceBuffer::<T>::zeroed(d, count).unwrap();
            // SAFETY: `count` elements of `i`, one element in, live until the stream is synced.
            let src = unsafe {
                Src::<T>::from_raw(i.device_ptr() + std::mem::size_of::<T>() as u64, count)
            };
            let c = h.all_reduce(src, &mut o, op, st).unwrap();
            keep.push((Some(i), o));
            c
        } else {
            let i = DeviceBuffer::from_host(d, &inputs[r]).unwrap();
            let mut o = DeviceBuffer::<T>::zeroed(d, count).unwrap();
            let c = h.all_reduce(&i, &mut o, op, st).unwrap();
            keep.push((Some(i), o));
            c
        };
        choice = Some(c);
    }
    sync(s);
    comm.check().unwrap();
    let want = reference(op, &refs(&inputs));
    let choice = choice.unwrap();
    for (r, (_, o)) in keep.iter().enumerate() {
        if let Some(m) = first_mismatch(&o.to_vec().unwrap(), &want) {
            panic!(
                "rank {r}, {count} x {} {op} ({choice}), own memory, in place {in_place}, misaligned {misaligned}: {m}",
                T::DTYPE
            );
        }
    }
    choice
}

// ---- results equal the host reference ----

fn every_op_on_symmetric_offsets<T: Element + Default>(
    comm: &Communicator,
    s: &[Stream],
    seed: &mut u64,
) {
    // small (low-latency, one-shot), odd, vector-width tails, two-shot sizes; offsets break
    // 16-byte alignment
    let sizes = [1usize, 7, 1000, 4099, 40_000, 300_001];
    let mut buf = comm.alloc::<T>(300_010).unwrap();
    let mut out = comm.alloc::<T>(300_010).unwrap();
    for op in ReduceOp::ALL {
        for (i, &count) in sizes.iter().enumerate() {
            let offs = match i % 3 {
                0 => (0, 0),
                1 => (3, 3),
                _ => (0, 5),
            };
            check_sym(comm, s, seed, &mut buf, Some(&mut out), offs, count, op);
            check_sym(comm, s, seed, &mut buf, None, (offs.0, 0), count, op);
        }
    }
}

#[test]
fn peer_to_peer_allreduce_equals_the_host_reference_for_every_dtype_and_op() {
    let e = ar_env();
    let Some(comm) = team(&e, "peer_to_peer_allreduce") else {
        return;
    };
    let s = streams(&comm);
    let mut seed = 5;
    for dtype in DType::ALL {
        for_dtype!(dtype, every_op_on_symmetric_offsets(&comm, &s, &mut seed));
    }
}

#[test]
fn every_forced_algorithm_gives_the_reference_bits() {
    let e = ar_env();
    let Some(devices) = two_devices(&e, "forced_algorithms") else {
        return;
    };
    let mut seed = 11;
    for algorithm in [
        Algorithm::OneShotLl,
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::TwoShotPush,
        Algorithm::TwoShotCe,
    ] {
        let comm = Communicator::builder(&devices)
            .config(CommConfig {
                algorithm: Some(algorithm),
                ce_max_bytes: 1 << 20,
                ..Default::default()
            })
            .multicast(MulticastPolicy::Never)
            .build()
            .unwrap();
        let s = streams(&comm);
        let mut buf = comm.alloc::<bf16>(1 << 19).unwrap();
        for count in [6usize, 12_346, 32_768] {
            let planned = comm
                .choice(DType::Bf16, ReduceOp::Sum, count, Operands::Symmetric)
                .unwrap();
            assert_eq!(planned.algorithm, algorithm);
            let ran = check_sym(
                &comm,
                &s,
                &mut seed,
                &mut buf,
                None,
                (0, 0),
                count,
                ReduceOp::Sum,
            );
            assert_eq!(ran.algorithm, algorithm);
        }
    }
}

/// The configuration of the typed tests: one-shot up to 32 KiB (low-latency up to 4 KiB), so
/// small sizes run directly and larger ones on the caller's memory go through the scratch.
fn typed_config() -> CommConfig {
    CommConfig {
        one_shot_max_bytes: Some(32 << 10),
        ll_max_bytes: 4 << 10,
        ..Default::default()
    }
}

/// Sizes below the one-shot limit (32 KiB) for every type, and above it; odd counts and counts
/// that are not a multiple of 8.
const TYPED_SIZES: [usize; 6] = [1, 7, 1001, 8191, 20_003, 100_001];

fn typed_symmetric<T: Element + Default>(comm: &Communicator, s: &[Stream], seed: &mut u64) {
    let mut inp = comm.alloc::<T>(100_001).unwrap();
    let mut out = comm.alloc::<T>(100_001).unwrap();
    for op in ReduceOp::ALL {
        for count in TYPED_SIZES {
            let a = check_sym(comm, s, seed, &mut inp, Some(&mut out), (0, 0), count, op);
            let b = check_sym(comm, s, seed, &mut inp, None, (0, 0), count, op);
            let one_shot = count * std::mem::size_of::<T>() <= 32 << 10;
            for c in [a, b] {
                assert_eq!(
                    matches!(c.algorithm, Algorithm::OneShot | Algorithm::OneShotLl),
                    one_shot,
                    "{count} x {}: {c}",
                    T::DTYPE
                );
            }
        }
    }
}

#[test]
fn typed_allreduce_on_symmetric_buffers_equals_the_reference_for_every_dtype_and_op() {
    let e = ar_env();
    let Some(comm) = team_with(&e, "typed_symmetric", typed_config()) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = 31;
    for dtype in DType::ALL {
        for_dtype!(dtype, typed_symmetric(&comm, &s, &mut seed));
    }
}

fn typed_own<T: Element + Default>(comm: &Communicator, s: &[Stream], seed: &mut u64) {
    for op in ReduceOp::ALL {
        for count in TYPED_SIZES {
            let staged = count * std::mem::size_of::<T>() > 32 << 10;
            for in_place in [false, true] {
                let c = check_own::<T>(comm, s, seed, count, op, in_place, false);
                assert_eq!(
                    c.staged_chunks > 0,
                    staged,
                    "{count} x {} (in place {in_place}): {c}",
                    T::DTYPE
                );
                let planned = comm.choice(T::DTYPE, op, count, Operands::Local).unwrap();
                assert_eq!(planned.staged_chunks, c.staged_chunks);
            }
        }
    }
}

#[test]
fn typed_allreduce_on_the_callers_own_memory_equals_the_reference_for_every_dtype_and_op() {
    let e = ar_env();
    let Some(comm) = team_with(&e, "typed_own", typed_config()) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = 32;
    for dtype in DType::ALL {
        for_dtype!(dtype, typed_own(&comm, &s, &mut seed));
    }
}

#[test]
fn calls_on_the_callers_own_memory_go_through_a_small_scratch_in_several_chunks() {
    let e = ar_env();
    let Some(comm) = team_with(
        &e,
        "small_scratch",
        CommConfig {
            one_shot_max_bytes: Some(16 << 10),
            ll_max_bytes: 4 << 10,
            // three regions of 32 KiB (an input region, two output regions): a chunk is 32 KiB
            scratch_bytes: 96 << 10,
            ..Default::default()
        },
    ) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = 33;
    for op in ReduceOp::ALL {
        for in_place in [false, true] {
            // 200 004 bytes: 6 chunks of 32 KiB and a last one of 3 396 bytes
            let c = check_own::<f32>(&comm, &s, &mut seed, 50_001, op, in_place, false);
            assert_eq!(c.staged_chunks, 7, "{c}");
            let c = check_own::<bf16>(&comm, &s, &mut seed, 50_001, op, in_place, false);
            assert_eq!(c.staged_chunks, 4, "{c}");
        }
    }
    assert_eq!(
        comm.choice(DType::F32, ReduceOp::Sum, 50_001, Operands::Local)
            .unwrap()
            .staged_chunks,
        7
    );
}

/// Driver calls of `symbol` so far (the simulator's counter; `None` on the real driver).
fn sim_calls(e: &Env, symbol: &str) -> Option<u64> {
    e.sim.as_ref().map(|s| s.calls(symbol))
}

/// Staged calls of `T` on the caller's memory through 32 KiB chunks, each checked against the
/// reference; on the simulator also the kernels (one per chunk and rank) and the device-to-device
/// copies per rank: `copies` of them, whatever the chunk count — each chunk's copy out of the
/// scratch goes with the next chunk's kernel.
fn folded_copies<T: Element + Default>(e: &Env, comm: &Communicator, s: &[Stream], seed: &mut u64) {
    let n = comm.size() as u64;
    let es = std::mem::size_of::<T>();
    let whole = (32 << 10) / es;
    // (count, chunks, copies per rank): whole chunks (the last copy out only); a last chunk with
    // a scalar tail (copied into the input region first, its kernel still takes the copy out of
    // the chunk before); a last chunk one-shot serves (the copy out of the chunk before goes as
    // a plain copy before it, and nothing is left after it)
    let cases = [
        (4 * whole, 4, 1),
        (3 * whole + (20 << 10) / es + 1, 4, 2),
        (5 * whole + 100, 6, 1),
    ];
    for op in ReduceOp::ALL {
        for in_place in [false, true] {
            for (count, chunks, copies) in cases {
                let before = (
                    launches(e),
                    sim_calls(e, "cuMemcpyDtoDAsync"),
                    sim_calls(e, "cuMemcpyBatchAsync"),
                );
                let c = check_own::<T>(comm, s, seed, count, op, in_place, false);
                let what = format!("{count} x {} {op} in place {in_place}: {c}", T::DTYPE);
                assert_eq!(c.staged_chunks, chunks, "{what}");
                if let (Some(l), Some(d), Some(b)) = before {
                    assert_eq!(launches(e).unwrap() - l, n * chunks as u64, "{what}");
                    assert_eq!(
                        sim_calls(e, "cuMemcpyDtoDAsync").unwrap() - d,
                        n * copies,
                        "{what}: device-to-device copies"
                    );
                    assert_eq!(sim_calls(e, "cuMemcpyBatchAsync"), Some(b), "{what}");
                }
            }
        }
    }
}

#[test]
fn staged_calls_copy_each_chunk_out_in_the_next_chunks_kernel_and_only_the_last_one_apart() {
    let e = ar_env();
    // three grids: the default one, 3 blocks (not a power of two) and 1; 4 KiB staging slots,
    // so a chunk's kernel runs several rounds and the copy out comes in several slices
    for max_blocks in [0u32, 3, 1] {
        let Some(comm) = team_with(
            &e,
            "folded_copies",
            CommConfig {
                one_shot_max_bytes: Some(4 << 10),
                ll_max_bytes: 1 << 10,
                stage_bytes: Some(4 << 10),
                // three regions of 32 KiB: an input region, two output regions
                scratch_bytes: 96 << 10,
                max_blocks,
                ..Default::default()
            },
        ) else {
            return;
        };
        let s = streams(&comm);
        let mut seed = 36 + max_blocks as u64;
        for dtype in DType::ALL {
            for_dtype!(dtype, folded_copies(&e, &comm, &s, &mut seed));
        }
    }
}

/// A write-only two-shot call on symmetric buffers (no prologue copy): the reference in the
/// output, every other byte of both buffers as it was, no copy beside the kernels.
fn push_alone<T: Element + Default>(e: &Env, comm: &Communicator, s: &[Stream], seed: &mut u64) {
    let n = comm.size();
    let count = 40_000;
    let guard = 64;
    let total = count + 2 * guard;
    let inp = comm.alloc::<T>(total).unwrap();
    let mut out = comm.alloc::<T>(total).unwrap();
    let fill: Vec<Vec<T>> = (0..n).map(|_| random_input(total, seed)).collect();
    let filled: Vec<Vec<T>> = (0..n).map(|_| random_input(total, seed)).collect();
    for r in 0..n {
        inp.write(r, 0, &fill[r]).unwrap();
        out.write(r, 0, &filled[r]).unwrap();
    }
    let before = (launches(e), sim_calls(e, "cuMemcpyDtoDAsync"));
    for (r, st) in s.iter().enumerate() {
        let c = comm
            .rank(r)
            .unwrap()
            .all_reduce(
                inp.slice(guard..guard + count).unwrap(),
                out.slice_mut(guard..guard + count).unwrap(),
                ReduceOp::Sum,
                st,
            )
            .unwrap();
        assert_eq!(c.algorithm, Algorithm::TwoShotPush, "{c}");
    }
    sync(s);
    comm.check().unwrap();
    if let (Some(l), Some(d)) = before {
        assert_eq!(launches(e).unwrap() - l, n as u64);
        assert_eq!(sim_calls(e, "cuMemcpyDtoDAsync"), Some(d));
    }
    let inputs: Vec<Vec<T>> = fill
        .iter()
        .map(|x| x[guard..guard + count].to_vec())
        .collect();
    let want = reference(ReduceOp::Sum, &refs(&inputs));
    for r in 0..n {
        let mut got = vec![T::default(); total];
        out.read(r, 0, &mut got).unwrap();
        assert_eq!(
            first_mismatch(&got[guard..guard + count], &want),
            None,
            "rank {r}"
        );
        assert_eq!(
            first_mismatch(&got[..guard], &filled[r][..guard]),
            None,
            "rank {r}"
        );
        assert_eq!(
            first_mismatch(&got[guard + count..], &filled[r][guard + count..]),
            None,
            "rank {r}"
        );
        let mut got = vec![T::default(); total];
        inp.read(r, 0, &mut got).unwrap();
        assert_eq!(
            first_mismatch(&got, &fill[r]),
            None,
            "rank {r}: the input changed"
        );
    }
}

#[test]
fn a_write_only_two_shot_call_without_a_prologue_copy_writes_only_its_output() {
    let e = ar_env();
    let Some(comm) = small_stage_team(&e, 0) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = 37;
    for dtype in DType::ALL {
        for_dtype!(dtype, push_alone(&e, &comm, &s, &mut seed));
    }
}

fn misaligned_input<T: Element + Default>(comm: &Communicator, s: &[Stream], seed: &mut u64) {
    for op in ReduceOp::ALL {
        // below the one-shot limit (run directly, or on a copy in the scratch) and above it
        // (staged), counts not a multiple of 8
        for count in [1001usize, 30_001] {
            let c = check_own::<T>(comm, s, seed, count, op, false, true);
            // below the limit the team's form runs on a copy of this rank's misaligned input
            // in its scratch (a rank's own alignment never changes what the team runs): one
            // staged chunk; above it, the staged chunks
            let es = std::mem::size_of::<T>();
            if count * es > 16 << 10 {
                assert!(c.staged_chunks > 1, "{c}");
            } else {
                // one element off: the low-latency form needs 4-byte words, the one-shot
                // 16-byte vectors
                let need = if c.algorithm == Algorithm::OneShotLl {
                    4
                } else {
                    16
                };
                assert_eq!(c.staged_chunks, u32::from(!es.is_multiple_of(need)), "{c}");
            }
        }
    }
}

#[test]
fn an_input_that_is_not_16_byte_aligned_gives_the_reference_directly_and_staged() {
    let e = ar_env();
    let Some(comm) = team_with(
        &e,
        "misaligned_input",
        CommConfig {
            one_shot_max_bytes: Some(16 << 10),
            ll_max_bytes: 4 << 10,
            scratch_bytes: 64 << 10,
            ..Default::default()
        },
    ) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = 34;
    for dtype in DType::ALL {
        for_dtype!(dtype, misaligned_input(&comm, &s, &mut seed));
    }
}

#[test]
fn without_a_scratch_calls_on_the_callers_own_memory_above_one_shot_are_refused() {
    let e = ar_env();
    let Some(comm) = team_with(
        &e,
        "no_scratch",
        CommConfig {
            one_shot_max_bytes: Some(16 << 10),
            scratch_bytes: 0,
            ll_max_bytes: 4 << 10,
            ..Default::default()
        },
    ) else {
        return;
    };
    let s = streams(&comm);
    let d = comm.device(0).unwrap();
    let i = DeviceBuffer::<f32>::zeroed(d, 8192).unwrap();
    let mut o = DeviceBuffer::<f32>::zeroed(d, 8192).unwrap();
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce(&i, &mut o, ReduceOp::Sum, &s[0])
        .unwrap_err();
    assert_eq!(invalid_arg(err), "count");
    // below the limit they run directly
    let mut seed = 35;
    check_own::<f32>(&comm, &s, &mut seed, 1000, ReduceOp::Sum, false, false);
}

// ---- the run-time dtype entry ----

#[test]
fn all_reduce_dyn_on_byte_views_equals_the_reference_for_every_dtype() {
    let e = ar_env();
    let Some(comm) = team_with(&e, "all_reduce_dyn", typed_config()) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = 41;
    let mut inp = comm.alloc::<u8>(128 << 10).unwrap();
    let mut out = comm.alloc::<u8>(128 << 10).unwrap();
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            for count in [1001usize, 20_003] {
                let len = count * dtype.size();
                let inputs: Vec<Vec<u8>> = (0..2)
                    .map(|_| random_bytes(dtype, count, &mut seed))
                    .collect();
                let want = reference_bytes(dtype, op, &refs(&inputs));
                // symmetric byte views, out of place then in place
                for (r, x) in inputs.iter().enumerate() {
                    inp.write(r, 0, x).unwrap();
                }
                for (r, st) in s.iter().enumerate() {
                    comm.rank(r)
                        .unwrap()
                        .all_reduce_dyn(
                            dtype,
                            inp.slice(..len).unwrap(),
                            out.slice_mut(..len).unwrap(),
                            op,
                            st,
                        )
                        .unwrap();
                }
                sync(&s);
                comm.check().unwrap();
                for r in 0..2 {
                    let mut got = vec![0u8; len];
                    out.read(r, 0, &mut got).unwrap();
                    assert_eq!(
                        first_mismatch_bytes(dtype, &got, &want),
                        None,
                        "{dtype} {op} {count} rank {r}"
                    );
                }
                for (r, st) in s.iter().enumerate() {
                    comm.rank(r)
                        .unwrap()
                        .all_reduce_dyn_in_place(dtype, inp.slice_mut(..len).unwrap(), op, st)
                        .unwrap();
                }
                sync(&s);
                comm.check().unwrap();
                for r in 0..2 {
                    let mut got = vec![0u8; len];
                    inp.read(r, 0, &mut got).unwrap();
                    assert_eq!(
                        first_mismatch_bytes(dtype, &got, &want),
                        None,
                        "{dtype} {op} {count} in place, rank {r}"
                    );
                }
                // the caller's own byte buffers
                let mut keep = Vec::new();
                for (r, st) in s.iter().enumerate() {
                    let d = comm.device(r).unwrap();
                    let i = DeviceBuffer::from_host(d, &inputs[r]).unwrap();
                    let mut o = DeviceBuffer::<u8>::zeroed(d, len).unwrap();
                    comm.rank(r)
                        .unwrap()
                        .all_reduce_dyn(dtype, &i, &mut o, op, st)
                        .unwrap();
                    keep.push((i, o));
                }
                sync(&s);
                comm.check().unwrap();
                for (r, (_, o)) in keep.iter().enumerate() {
                    assert_eq!(
                        first_mismatch_bytes(dtype, &o.to_vec().unwrap(), &want),
                        None,
                        "{dtype} {op} {count} own memory, rank {r}"
                    );
                }
            }
        }
    }
}

/// Launches so far (the simulator's counter; `None` on the real driver).
fn launches(e: &Env) -> Option<u64> {
    e.sim.as_ref().map(|s| s.calls("cuLaunchKernel"))
}

#[test]
fn all_reduce_dyn_refuses_a_length_that_is_not_a_whole_number_of_elements() {
    let e = ar_env();
    let Some(comm) = team(&e, "dyn_length") else {
        return;
    };
    let s = streams(&comm);
    let mut buf = comm.alloc::<u8>(4096).unwrap();
    let before = launches(&e);
    let h = comm.rank(0).unwrap();
    let err = h
        .all_reduce_dyn_in_place(
            DType::F32,
            buf.slice_mut(..6).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "buf");
    let mut out = comm.alloc::<u8>(4096).unwrap();
    let err = h
        .all_reduce_dyn(
            DType::Bf16,
            buf.slice(..7).unwrap(),
            out.slice_mut(..7).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "input");
    assert_eq!(launches(&e), before);
}

#[test]
fn all_reduce_dyn_refuses_a_view_misaligned_for_its_dtype() {
    let e = ar_env();
    let Some(comm) = team(&e, "dyn_misaligned") else {
        return;
    };
    let s = streams(&comm);
    let buf = comm.alloc::<u8>(4096).unwrap();
    let mut out = comm.alloc::<u8>(4096).unwrap();
    let before = launches(&e);
    let h = comm.rank(0).unwrap();
    let err = h
        .all_reduce_dyn(
            DType::F32,
            buf.slice(2..66).unwrap(),
            out.slice_mut(..64).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "input");
    let err = h
        .all_reduce_dyn(
            DType::F16,
            buf.slice(..64).unwrap(),
            out.slice_mut(1..65).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "output");
    // the caller's own bytes, one byte in
    let d = comm.device(0).unwrap();
    let own = DeviceBuffer::<u8>::zeroed(d, 4096).unwrap();
    // SAFETY: 64 bytes inside `own`, which outlives the (refused) call.
    let src = unsafe { Src::<u8>::from_raw(own.device_ptr() + 1, 64) };
    let err = h
        .all_reduce_dyn(
            DType::F32,
            src,
            out.slice_mut(..64).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "input");
    assert_eq!(launches(&e), before);
}

// ---- bounds and foreign operands: refused before any launch ----

#[test]
fn views_past_the_end_are_refused_naming_the_range() {
    let e = ar_env();
    let Some(comm) = team(&e, "views_past_the_end") else {
        return;
    };
    let mut buf = comm.alloc::<f32>(1000).unwrap();
    let n = buf.len();
    for r in [
        buf.slice(..n + 1).map(|_| ()),
        buf.slice(usize::MAX..).map(|_| ()),
        buf.slice(0..=usize::MAX).map(|_| ()),
        buf.slice(n / 2..n / 4).map(|_| ()),
        buf.slice(..).unwrap().slice(1..=n).map(|_| ()),
    ] {
        assert_eq!(invalid_arg(r.unwrap_err()), "range");
    }
    for r in [
        buf.slice_mut(..n + 1).map(|_| ()),
        buf.slice_mut(usize::MAX..).map(|_| ()),
        buf.slice_mut(0..=usize::MAX).map(|_| ()),
    ] {
        assert_eq!(invalid_arg(r.unwrap_err()), "range");
    }
    let mut v = buf.slice_mut(10..20).unwrap();
    assert_eq!(invalid_arg(v.slice_mut(..11).unwrap_err()), "range");
    assert_eq!(invalid_arg(v.split_at_mut(11).unwrap_err()), "mid");
    assert_eq!(buf.slice(n..).unwrap().len(), 0);
    // host copies too
    assert_eq!(
        invalid_arg(buf.write(0, n - 1, &[1.0, 2.0]).unwrap_err()),
        "data"
    );
    assert_eq!(
        invalid_arg(buf.write(0, usize::MAX, &[1.0]).unwrap_err()),
        "data"
    );
    let mut out = [0f32; 2];
    assert_eq!(
        invalid_arg(buf.read(0, n - 1, &mut out).unwrap_err()),
        "out"
    );
}

#[test]
fn a_raw_count_whose_byte_size_overflows_is_refused_naming_the_operand() {
    let e = ar_env();
    let Some(comm) = team(&e, "raw_count_overflow") else {
        return;
    };
    let s = streams(&comm);
    let mut buf = comm.alloc::<f32>(1024).unwrap();
    let p = buf.device_ptr(0).unwrap();
    let before = launches(&e);
    let h = comm.rank(0).unwrap();
    // SAFETY (each): refused before anything reads the range.
    let err = h
        .all_reduce(
            unsafe { Src::<f32>::from_raw(p, usize::MAX) },
            &mut buf,
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "input");
    let err = h
        .all_reduce(
            &buf,
            unsafe { Dst::<f32>::from_raw(p, usize::MAX / 2) },
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "output");
    let err = h
        .all_reduce_in_place(
            unsafe { Dst::<bf16>::from_raw(p, usize::MAX) },
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "buf");
    assert_eq!(launches(&e), before);
}

#[test]
fn a_raw_pointer_range_that_wraps_the_address_space_is_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "raw_wrap") else {
        return;
    };
    let s = streams(&comm);
    let before = launches(&e);
    let top: u64 = !15;
    // SAFETY: refused before anything reads the range.
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce_in_place(
            unsafe { Dst::<f32>::from_raw(top, 8) },
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert!(err.to_string().contains("wrap"), "{err}");
    assert_eq!(invalid_arg(err), "buf");
    assert_eq!(launches(&e), before);
}

#[test]
fn operands_of_different_lengths_are_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "different_lengths") else {
        return;
    };
    let s = streams(&comm);
    let buf = comm.alloc::<f32>(1024).unwrap();
    let mut out = comm.alloc::<f32>(1024).unwrap();
    let before = launches(&e);
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce(
            buf.slice(..100).unwrap(),
            out.slice_mut(..101).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "output");
    assert_eq!(launches(&e), before);
}

#[test]
fn an_output_that_partly_overlaps_the_input_is_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "partial_overlap") else {
        return;
    };
    let s = streams(&comm);
    let d = comm.device(0).unwrap();
    let own = DeviceBuffer::<f32>::zeroed(d, 1024).unwrap();
    let p = own.device_ptr();
    let before = launches(&e);
    // SAFETY: both ranges inside `own`; refused before anything touches them.
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce(
            unsafe { Src::<f32>::from_raw(p, 64) },
            unsafe { Dst::<f32>::from_raw(p + 16, 64) },
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "output");
    assert_eq!(launches(&e), before);
    assert!(own.to_vec().unwrap().iter().all(|&x| x == 0.0));
}

#[test]
fn a_misaligned_raw_pointer_is_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "misaligned_raw") else {
        return;
    };
    let s = streams(&comm);
    let d = comm.device(0).unwrap();
    let own = DeviceBuffer::<f32>::zeroed(d, 1024).unwrap();
    let mut out = DeviceBuffer::<f32>::zeroed(d, 64).unwrap();
    let before = launches(&e);
    // SAFETY: inside `own`; refused before anything reads it.
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce(
            unsafe { Src::<f32>::from_raw(own.device_ptr() + 2, 64) },
            &mut out,
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "input");
    assert_eq!(launches(&e), before);
}

#[test]
fn a_buffer_of_another_communicator_is_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "foreign_buffer") else {
        return;
    };
    let other = team(&e, "foreign_buffer").unwrap();
    let s = streams(&comm);
    let foreign = other.alloc::<f32>(1024).unwrap();
    let mut buf = comm.alloc::<f32>(1024).unwrap();
    let before = launches(&e);
    let h = comm.rank(0).unwrap();
    let err = h
        .all_reduce(&foreign, &mut buf, ReduceOp::Sum, &s[0])
        .unwrap_err();
    assert_eq!(invalid_arg(err), "input");
    let mut foreign = foreign;
    let err = h
        .all_reduce(&buf, &mut foreign, ReduceOp::Sum, &s[0])
        .unwrap_err();
    assert_eq!(invalid_arg(err), "output");
    assert_eq!(launches(&e), before);
}

#[test]
fn a_device_buffer_of_another_device_is_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "foreign_device_buffer") else {
        return;
    };
    let s = streams(&comm);
    let on_1 = DeviceBuffer::<f32>::zeroed(comm.device(1).unwrap(), 64).unwrap();
    let mut on_0 = DeviceBuffer::<f32>::zeroed(comm.device(0).unwrap(), 64).unwrap();
    let before = launches(&e);
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce(&on_1, &mut on_0, ReduceOp::Sum, &s[0])
        .unwrap_err();
    assert!(err.to_string().contains("memory of device 1"), "{err}");
    assert_eq!(invalid_arg(err), "input");
    assert_eq!(launches(&e), before);
}

#[test]
fn a_stream_of_another_device_is_refused_saying_so() {
    let e = ar_env();
    let Some(comm) = team(&e, "foreign_stream_device") else {
        return;
    };
    let s = streams(&comm);
    let mut buf = comm.alloc::<f32>(64).unwrap();
    let before = launches(&e);
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1])
        .unwrap_err();
    assert!(err.to_string().contains("a stream of device 1"), "{err}");
    assert_eq!(invalid_arg(err), "stream");
    assert_eq!(launches(&e), before);
}

#[test]
fn a_stream_from_another_driver_value_is_refused_saying_so() {
    let e = ar_env();
    let Some(comm) = team(&e, "foreign_stream_driver") else {
        return;
    };
    let other = match &e.sim {
        Some(s) => cuda_multimem_sim::driver_over(s).unwrap(),
        None => Driver::from_env().unwrap(),
    };
    assert!(!other.same_as(&e.driver));
    let foreign = Stream::new(&other.device(0).unwrap()).unwrap();
    let mut buf = comm.alloc::<f32>(64).unwrap();
    let before = launches(&e);
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce_in_place(&mut buf, ReduceOp::Sum, &foreign)
        .unwrap_err();
    assert!(err.to_string().contains("another Driver value"), "{err}");
    assert_eq!(invalid_arg(err), "stream");
    assert_eq!(launches(&e), before);
}

#[test]
fn a_rank_the_process_does_not_drive_is_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "unknown_rank") else {
        return;
    };
    assert_eq!(invalid_arg(comm.rank(2).unwrap_err()), "rank");
    let buf = comm.alloc::<f32>(64).unwrap();
    assert_eq!(invalid_arg(buf.write(2, 0, &[1.0]).unwrap_err()), "rank");
}

#[test]
fn a_team_of_one_device_is_refused() {
    let e = ar_env();
    let d = e.driver.devices();
    let err = Communicator::new(&d[..1]).unwrap_err();
    assert_eq!(invalid_arg(err), "devices");
    if d.len() >= 2 {
        let err = Communicator::new(&[d[0].clone(), d[0].clone()]).unwrap_err();
        assert_eq!(invalid_arg(err), "devices");
    }
}

#[test]
fn alloc_refuses_zero_and_overflowing_lengths() {
    let e = ar_env();
    let Some(comm) = team(&e, "alloc_lengths") else {
        return;
    };
    assert_eq!(invalid_arg(comm.alloc::<f32>(0).unwrap_err()), "len");
    assert_eq!(
        invalid_arg(comm.alloc::<f32>(usize::MAX).unwrap_err()),
        "len"
    );
    assert_eq!(
        invalid_arg(comm.alloc::<f32>(usize::MAX / 4).unwrap_err()),
        "len"
    );
    // the communicator is still usable
    let mut seed = 3;
    let mut b = comm.alloc::<f32>(100).unwrap();
    let s = streams(&comm);
    check_sym(
        &comm,
        &s,
        &mut seed,
        &mut b,
        None,
        (0, 0),
        100,
        ReduceOp::Max,
    );
}

#[test]
fn config_fields_at_usize_max_are_refused_naming_the_field() {
    let e = ar_env();
    let Some(devices) = two_devices(&e, "config_fields") else {
        return;
    };
    let d = CommConfig::default;
    for (config, field) in [
        (
            CommConfig {
                one_shot_max_bytes: Some(usize::MAX),
                ..d()
            },
            "config.one_shot_max_bytes",
        ),
        (
            CommConfig {
                ll_max_bytes: usize::MAX,
                ..d()
            },
            "config.ll_max_bytes",
        ),
        (
            CommConfig {
                ce_max_bytes: usize::MAX,
                ..d()
            },
            "config.ce_max_bytes",
        ),
        (
            CommConfig {
                ce_min_bytes: usize::MAX,
                ..d()
            },
            "config.ce_min_bytes",
        ),
        (
            CommConfig {
                stage_bytes: Some(usize::MAX),
                ..d()
            },
            "config.stage_bytes",
        ),
        (
            CommConfig {
                scratch_bytes: usize::MAX,
                ..d()
            },
            "config.scratch_bytes",
        ),
        (
            CommConfig {
                multimem_min_bytes: usize::MAX,
                ..d()
            },
            "config.multimem_min_bytes",
        ),
        (
            CommConfig {
                multimem_capacity: usize::MAX,
                ..d()
            },
            "config.multimem_capacity",
        ),
        (
            CommConfig {
                threads: u32::MAX,
                ..d()
            },
            "config.threads",
        ),
        (
            CommConfig {
                max_blocks: u32::MAX,
                ..d()
            },
            "config.max_blocks",
        ),
        (
            CommConfig {
                timeout: Duration::MAX,
                ..d()
            },
            "config.timeout",
        ),
    ] {
        let err = Communicator::builder(&devices)
            .config(config)
            .build()
            .unwrap_err();
        assert_eq!(invalid_arg(err), field);
    }
}

// ---- back-to-back calls with random delays ----

/// Back-to-back calls on a simulated team of `n` with random per-device delays, through the
/// run-time dtype entry on byte views: every call reads its own input region and writes its own
/// output region, all are checked at the end.
fn back_to_back(n: usize, calls: usize, seed: u64) {
    let e = ar_sim(n);
    let sim = e.sim.as_ref().unwrap();
    sim.set_kernel_delays(Duration::from_micros(300), seed);
    let comm = Communicator::builder(&e.driver.devices())
        .config(CommConfig {
            one_shot_max_bytes: Some(8 << 10),
            ll_max_bytes: 4 << 10,
            // small slots: the write-only two-shot runs in several rounds per block
            stage_bytes: Some(8 << 10),
            // and between 8 and 24 KiB the copy-engine two-shot
            ce_max_bytes: 24 << 10,
            ce_min_bytes: 0,
            max_blocks: 4,
            threads: 64,
            scratch_bytes: 0,
            ..Default::default()
        })
        .multicast(MulticastPolicy::Never)
        .build()
        .unwrap();
    let s = streams(&comm);
    let mut rng = Rng::new(seed);
    let mut state = seed | 1;
    let region = 64 << 10;
    let mut plan = Vec::new();
    for c in 0..calls {
        let dtype = DType::ALL[(rng.next_u64() % 3) as usize];
        let op = ReduceOp::ALL[(rng.next_u64() % 3) as usize];
        let es = dtype.size();
        let count = 1 + (rng.next_u64() % (region as u64 / es as u64 - 16)) as usize;
        let count = if c % 4 == 0 { count % 3000 + 1 } else { count };
        // aligned half of the time (the write-only two-shot), else the reading two-shot
        let off = if rng.next_u64() & 1 == 0 {
            0
        } else {
            (rng.next_u64() % 8) as usize
        };
        let count = count.min(region / es - off);
        let inputs: Vec<Vec<u8>> = (0..n)
            .map(|_| random_bytes(dtype, count, &mut state))
            .collect();
        plan.push((dtype, op, count, off, inputs));
    }
    // every call's inputs in its own region of one input buffer, written before any call
    let inp = comm.alloc::<u8>(region * calls).unwrap();
    let mut out = comm.alloc::<u8>(region * calls).unwrap();
    for r in 0..n {
        let mut all = vec![0u8; region * calls];
        for (c, (dtype, _, _, off, inputs)) in plan.iter().enumerate() {
            let at = c * region + off * dtype.size();
            all[at..at + inputs[r].len()].copy_from_slice(&inputs[r]);
        }
        inp.write(r, 0, &all).unwrap();
    }
    for (c, (dtype, op, count, off, _)) in plan.iter().enumerate() {
        let at = c * region + off * dtype.size();
        let len = count * dtype.size();
        for (r, st) in s.iter().enumerate() {
            comm.rank(r)
                .unwrap()
                .all_reduce_dyn(
                    *dtype,
                    inp.slice(at..at + len).unwrap(),
                    out.slice_mut(at..at + len).unwrap(),
                    *op,
                    st,
                )
                .unwrap();
        }
    }
    sync(&s);
    comm.check().unwrap();
    for r in 0..n {
        let all = out.to_vec(r).unwrap();
        for (c, (dtype, op, count, off, inputs)) in plan.iter().enumerate() {
            let want = reference_bytes(*dtype, *op, &refs(inputs));
            let at = c * region + off * dtype.size();
            let got = &all[at..at + count * dtype.size()];
            if let Some(m) = first_mismatch_bytes(*dtype, got, &want) {
                panic!("team of {n}, call {c} ({count} x {dtype} {op}), rank {r}: {m}");
            }
        }
    }
}

#[test]
fn back_to_back_calls_with_random_delays_are_exact_on_a_team_of_2() {
    back_to_back(2, 24, 1);
}

#[test]
fn back_to_back_calls_with_random_delays_are_exact_on_a_team_of_3() {
    back_to_back(3, 16, 2);
}

#[test]
fn back_to_back_calls_with_random_delays_are_exact_on_a_team_of_5() {
    back_to_back(5, 10, 3);
}

#[test]
fn back_to_back_calls_with_random_delays_are_exact_on_a_team_of_8() {
    back_to_back(8, 8, 4);
}

// ---- graphs ----

#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    Symmetric,
    Own,
}

/// Capture one f32 sum of `count` elements per rank (symmetric buffers or the caller's own
/// memory), replay it four times with new inputs; returns what the captured call chose.
fn graph_replay(comm: &Communicator, count: usize, kind: Kind) -> Choice {
    let s = streams(comm);
    let n = comm.size();
    let op = ReduceOp::Sum;
    let inp = comm.alloc::<f32>(count).unwrap();
    let mut out = comm.alloc::<f32>(count).unwrap();
    let mut own: Vec<(DeviceBuffer<f32>, DeviceBuffer<f32>)> = (0..n)
        .map(|r| {
            let d = comm.device(r).unwrap();
            (
                DeviceBuffer::zeroed(d, count).unwrap(),
                DeviceBuffer::zeroed(d, count).unwrap(),
            )
        })
        .collect();
    let mut execs: Vec<GraphExec> = Vec::new();
    let mut choice = None;
    for (r, st) in s.iter().enumerate() {
        let sr = st.as_stream_ref();
        sr.begin_capture(CaptureMode::Global).unwrap();
        let h = comm.rank(r).unwrap();
        let c = match kind {
            Kind::Symmetric => h.all_reduce(&inp, &mut out, op, st),
            Kind::Own => {
                let (i, o) = &mut own[r];
                h.all_reduce(&*i, o, op, st)
            }
        }
        .unwrap();
        let graph = sr.end_capture().unwrap();
        // SAFETY: the team, buffers and streams the capture used outlive `execs` (dropped first).
        execs.push(unsafe { graph.instantiate() }.unwrap());
        choice = Some(c);
    }
    let mut seed = 77;
    for replay in 0..4 {
        let inputs: Vec<Vec<f32>> = (0..n).map(|_| random_input(count, &mut seed)).collect();
        for (r, x) in inputs.iter().enumerate() {
            match kind {
                Kind::Symmetric => inp.write(r, 0, x).unwrap(),
                Kind::Own => own[r].0.copy_from_host(0, x).unwrap(),
            }
        }
        for (r, st) in s.iter().enumerate() {
            execs[r].launch(st).unwrap();
        }
        sync(&s);
        comm.check().unwrap();
        let want = reference(op, &refs(&inputs));
        for r in 0..n {
            let got = match kind {
                Kind::Symmetric => out.to_vec(r).unwrap(),
                Kind::Own => own[r].1.to_vec().unwrap(),
            };
            if let Some(m) = first_mismatch(&got, &want) {
                panic!("{kind:?}, replay {replay}, rank {r}: {m}");
            }
        }
    }
    choice.unwrap()
}

#[test]
fn a_captured_graph_replays_the_allreduce_without_host_resets() {
    let e = ar_env();
    let Some(comm) = team(&e, "graph_symmetric") else {
        return;
    };
    graph_replay(&comm, 5000, Kind::Symmetric);
}

/// The copy-engine two-shot's copies are memcpy nodes of the captured graph: replays copy the
/// new inputs and reduce them, nothing reset from the host.
#[test]
fn a_captured_graph_replays_the_copy_engine_two_shot() {
    let e = ar_env();
    let Some(comm) = team_with(
        &e,
        "graph_ce",
        CommConfig {
            one_shot_max_bytes: Some(16 << 10),
            ce_max_bytes: 1 << 20,
            ce_min_bytes: 0,
            ..Default::default()
        },
    ) else {
        return;
    };
    assert_eq!(
        comm.choice(DType::F32, ReduceOp::Sum, 100_000, Operands::Symmetric)
            .unwrap()
            .algorithm,
        Algorithm::TwoShotCe
    );
    let c = graph_replay(&comm, 100_000, Kind::Symmetric);
    assert_eq!(c.algorithm, Algorithm::TwoShotCe);
}

/// A call on the caller's own memory above the one-shot limit goes through the scratch in
/// chunks (copies and kernels on the caller's stream): captured, it replays with new inputs.
#[test]
fn a_captured_graph_replays_a_staged_call_on_the_callers_own_memory() {
    let e = ar_env();
    let Some(comm) = team_with(
        &e,
        "graph_staged",
        CommConfig {
            one_shot_max_bytes: Some(16 << 10),
            ll_max_bytes: 4 << 10,
            scratch_bytes: 64 << 10,
            ..Default::default()
        },
    ) else {
        return;
    };
    let c = graph_replay(&comm, 100_003, Kind::Own);
    assert!(c.staged_chunks > 1, "{c}");
}

/// And one that one-shot serves directly, on the caller's own memory.
#[test]
fn a_captured_graph_replays_a_direct_call_on_the_callers_own_memory() {
    let e = ar_env();
    let Some(comm) = team(&e, "graph_own_direct") else {
        return;
    };
    let c = graph_replay(&comm, 5000, Kind::Own);
    assert_eq!(c.staged_chunks, 0, "{c}");
}

// ---- disagreements and peers that never arrive ----

fn short_timeout_config() -> CommConfig {
    CommConfig {
        timeout: Duration::from_millis(300),
        ..Default::default()
    }
}

fn short_timeout_team(n: usize) -> (Env, Communicator) {
    let e = ar_sim(n);
    let comm = Communicator::builder(&e.driver.devices())
        .config(short_timeout_config())
        .multicast(MulticastPolicy::Never)
        .build()
        .unwrap();
    (e, comm)
}

/// On a team of two: rank 0 sums `mine` (dtype, bytes), rank 1 `theirs`, in place at the start
/// of one byte buffer; what rank 0's call chose, and what `check` reports.
fn disagree(
    comm: &Communicator,
    s: &[Stream],
    buf: &mut SymmetricBuffer<u8>,
    mine: (DType, usize),
    theirs: (DType, usize),
) -> (Algorithm, Error) {
    let mut a = None;
    for (r, (dtype, bytes)) in [mine, theirs].into_iter().enumerate() {
        let c = comm
            .rank(r)
            .unwrap()
            .all_reduce_dyn_in_place(dtype, buf.slice_mut(..bytes).unwrap(), ReduceOp::Sum, &s[r])
            .unwrap();
        a.get_or_insert(c.algorithm);
    }
    sync(s);
    (a.unwrap(), comm.check().unwrap_err())
}

#[test]
fn ranks_that_disagree_on_the_size_are_reported_not_waited_for() {
    let (_e, comm) = short_timeout_team(2);
    let s = streams(&comm);
    let mut buf = comm.alloc::<u8>(1 << 20).unwrap();
    // above the low-latency limit, the call header names the disagreement
    let (_, err) = disagree(
        &comm,
        &s,
        &mut buf,
        (DType::F32, 80_000),
        (DType::F32, 80_004),
    );
    assert!(matches!(err, Error::RanksDisagree { .. }), "{err}");
}

#[test]
fn after_a_disagreement_the_team_refuses_further_calls() {
    let (_e, comm) = short_timeout_team(2);
    let s = streams(&comm);
    let mut buf = comm.alloc::<u8>(1 << 20).unwrap();
    disagree(
        &comm,
        &s,
        &mut buf,
        (DType::F32, 80_000),
        (DType::F32, 80_004),
    );
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce_dyn_in_place(
            DType::F32,
            buf.slice_mut(..400).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert!(matches!(err, Error::Unusable { .. }), "{err}");
    assert!(matches!(comm.check().unwrap_err(), Error::Unusable { .. }));
    assert!(matches!(
        comm.alloc::<f32>(16).unwrap_err(),
        Error::Unusable { .. }
    ));
}

#[test]
fn small_calls_that_disagree_are_reported_as_a_peer_that_did_not_arrive() {
    // the low-latency protocol folds the call header into its flags: no data is taken from a
    // rank that called something else, and the wait ends at the timeout
    let (_e, comm) = short_timeout_team(2);
    let s = streams(&comm);
    let mut buf = comm.alloc::<u8>(1 << 16).unwrap();
    let (a, err) = disagree(&comm, &s, &mut buf, (DType::F16, 200), (DType::Bf16, 200));
    assert_eq!(a, Algorithm::OneShotLl);
    match err {
        Error::Timeout { what, .. } => assert!(what.contains("called something else"), "{what}"),
        e => panic!("expected a timeout, got {e}"),
    }
}

#[test]
fn ranks_that_disagree_on_the_dtype_are_reported() {
    let (_e, comm) = short_timeout_team(2);
    let s = streams(&comm);
    let mut buf = comm.alloc::<u8>(1 << 20).unwrap();
    let (_, err) = disagree(
        &comm,
        &s,
        &mut buf,
        (DType::F16, 80_000),
        (DType::Bf16, 80_000),
    );
    assert!(matches!(err, Error::RanksDisagree { .. }), "{err}");
}

/// Two-shot calls whose ranks pass different symmetric buffers (or views at different offsets)
/// of the same size: each rank would read and write the others' wrong memory; the call header
/// (buffer id and offset) makes it a reported disagreement.
fn different_operands(same_buffer: bool) -> Error {
    let e = ar_sim(2);
    let comm = Communicator::builder(&e.driver.devices())
        .config(CommConfig {
            one_shot_max_bytes: Some(16 << 10),
            timeout: Duration::from_millis(500),
            ..Default::default()
        })
        .multicast(MulticastPolicy::Never)
        .build()
        .unwrap();
    let s = streams(&comm);
    let count = 40_000;
    let mut a = comm.alloc::<f32>(2 * count).unwrap();
    let mut b = comm.alloc::<f32>(2 * count).unwrap();
    let mut seed = 9;
    for r in 0..2 {
        a.write(r, 0, &random_input::<f32>(2 * count, &mut seed))
            .unwrap();
        b.write(r, 0, &random_input::<f32>(2 * count, &mut seed))
            .unwrap();
    }
    let c0 = comm
        .rank(0)
        .unwrap()
        .all_reduce_in_place(a.slice_mut(..count).unwrap(), ReduceOp::Sum, &s[0])
        .unwrap();
    assert_eq!(c0.algorithm, Algorithm::TwoShotPush);
    let other = if same_buffer {
        a.slice_mut(count..).unwrap()
    } else {
        b.slice_mut(..count).unwrap()
    };
    comm.rank(1)
        .unwrap()
        .all_reduce_in_place(other, ReduceOp::Sum, &s[1])
        .unwrap();
    sync(&s);
    comm.check().unwrap_err()
}

#[test]
fn ranks_that_pass_different_symmetric_buffers_are_reported_as_a_disagreement() {
    let err = different_operands(false);
    assert!(matches!(err, Error::RanksDisagree { .. }), "{err}");
}

#[test]
fn ranks_that_pass_different_offsets_are_reported_as_a_disagreement() {
    let err = different_operands(true);
    assert!(matches!(err, Error::RanksDisagree { .. }), "{err}");
}

/// A team of 3 whose rank 2 never calls: ranks 0 and 1 queue a small call; returns the team,
/// its streams, a buffer, and how long the streams took.
fn third_rank_absent() -> (
    Env,
    Communicator,
    Vec<Stream>,
    SymmetricBuffer<f32>,
    Duration,
) {
    let (e, comm) = short_timeout_team(3);
    let s = streams(&comm);
    let mut buf = comm.alloc::<f32>(1 << 14).unwrap();
    let t = Instant::now();
    for r in 0..2 {
        comm.rank(r)
            .unwrap()
            .all_reduce_in_place(buf.slice_mut(..64).unwrap(), ReduceOp::Sum, &s[r])
            .unwrap();
    }
    sync(&s);
    let took = t.elapsed();
    (e, comm, s, buf, took)
}

#[test]
fn a_peer_that_never_arrives_is_a_timeout_after_the_configured_time_not_a_hang() {
    let (_e, comm, _s, _buf, took) = third_rank_absent();
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(took >= Duration::from_millis(300), "took {took:?}");
    match comm.check().unwrap_err() {
        Error::Timeout { what, after } => {
            assert!(what.contains("barrier"), "{what}");
            assert_eq!(after, short_timeout_config().timeout);
        }
        e => panic!("expected a timeout, got {e}"),
    }
}

#[test]
fn after_a_timeout_later_calls_are_refused_as_unusable() {
    let (_e, comm, s, mut buf, _) = third_rank_absent();
    assert!(matches!(comm.check().unwrap_err(), Error::Timeout { .. }));
    for r in 0..3 {
        let err = comm
            .rank(r)
            .unwrap()
            .all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[r])
            .unwrap_err();
        match err {
            Error::Unusable { cause } => assert!(cause.contains("did not arrive"), "{cause}"),
            e => panic!("rank {r}: expected Unusable, got {e}"),
        }
    }
}

#[test]
fn a_second_stream_is_refused_while_the_first_has_work_in_flight() {
    let (e, comm) = short_timeout_team(2);
    let s = streams(&comm);
    let extra = Stream::new(comm.device(0).unwrap()).unwrap();
    let mut buf = comm.alloc::<f32>(1 << 14).unwrap();
    e.sim
        .as_ref()
        .unwrap()
        .set_kernel_delays(Duration::from_millis(50), 9);
    let call = |r: usize, b: &mut SymmetricBuffer<f32>, st: &Stream| {
        comm.rank(r)
            .unwrap()
            .all_reduce_in_place(b.slice_mut(..64).unwrap(), ReduceOp::Sum, st)
    };
    // rank 0 queues on s[0]; its kernel waits for rank 1, which has not been called yet
    call(0, &mut buf, &s[0]).unwrap();
    assert_eq!(
        invalid_arg(call(0, &mut buf, &extra).unwrap_err()),
        "stream"
    );
    call(1, &mut buf, &s[1]).unwrap();
    sync(&s);
    comm.check().unwrap();
    // once idle, the other stream may take over
    call(0, &mut buf, &extra).unwrap();
    call(1, &mut buf, &s[1]).unwrap();
    extra.synchronize().unwrap();
    sync(&s);
    comm.check().unwrap();
}

// ---- nothing leaks ----

fn live_without_contexts(
    sim: &cuda_multimem_sim::Simulator,
) -> std::collections::BTreeMap<String, i64> {
    sim.live_resources()
        .into_iter()
        .filter(|(k, _)| k != "primary contexts")
        .collect()
}

#[test]
fn a_team_leaves_nothing_behind() {
    let e = ar_sim(2);
    let sim = e.sim.as_ref().unwrap();
    let before = live_without_contexts(sim);
    {
        let comm = Communicator::new(&e.driver.devices()).unwrap();
        let s = streams(&comm);
        let mut buf = comm.alloc::<f32>(1 << 10).unwrap();
        let mut own: Vec<DeviceBuffer<f32>> = (0..2)
            .map(|r| DeviceBuffer::zeroed(comm.device(r).unwrap(), 10).unwrap())
            .collect();
        for (r, st) in s.iter().enumerate() {
            let h = comm.rank(r).unwrap();
            h.all_reduce_in_place(buf.slice_mut(..10).unwrap(), ReduceOp::Sum, st)
                .unwrap();
            h.all_reduce_in_place(&mut own[r], ReduceOp::Sum, st)
                .unwrap();
        }
        sync(&s);
        comm.check().unwrap();
    }
    assert_eq!(live_without_contexts(sim), before);
}

/// Fail each driver call of building a communicator (with `policy`) and allocating a buffer,
/// one per round: every failure is an error and leaves nothing behind.
fn fails_half_way(n: usize, policy: MulticastPolicy, floor: usize) {
    use cuda_multimem_sim::FailurePlan;
    use cuda_multimem_sys::CUresult;
    let e = ar_sim(n);
    let sim = e.sim.as_ref().unwrap();
    let devices = e.driver.devices();
    let small = CommConfig {
        one_shot_max_bytes: Some(4096),
        ll_max_bytes: 4096,
        stage_bytes: Some(4096),
        scratch_bytes: 16 << 10,
        multimem_capacity: 2 << 20,
        ..Default::default()
    };
    let build = || {
        Communicator::builder(&devices)
            .config(small.clone())
            .multicast(policy)
            .build()
    };
    // warm up: contexts retained, entry points resolved
    drop(build().unwrap());
    let before = live_without_contexts(sim);
    let mut failures = 0;
    for skip in 0.. {
        sim.inject_failure(FailurePlan {
            call: None,
            skip,
            code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        });
        let r = build().and_then(|c| {
            let b = c.alloc::<f32>(1 << 14)?;
            Ok((c, b))
        });
        let fired = sim.clear_failure();
        match r {
            Ok(cb) => {
                drop(cb);
                assert_eq!(live_without_contexts(sim), before);
                if fired.is_none() {
                    break;
                }
            }
            Err(err) => {
                assert!(fired.is_some(), "failed without an injected failure: {err}");
                failures += 1;
                assert_eq!(
                    live_without_contexts(sim),
                    before,
                    "after a failure at call #{skip} ({fired:?}): {err}"
                );
            }
        }
        assert!(skip < 4000, "construction never completed");
    }
    assert!(
        failures > floor,
        "only {failures} driver calls were exercised"
    );
}

#[test]
fn a_communicator_that_fails_half_way_leaks_nothing() {
    fails_half_way(2, MulticastPolicy::Never, 20);
}

#[test]
fn a_multimem_communicator_that_fails_half_way_leaks_nothing() {
    fails_half_way(2, MulticastPolicy::Always, 30);
}

// ---- the write-only two-shot in rounds, and the copy-engine two-shot ----

/// A team whose staging slots are one 4 KiB page: the write-only two-shot then needs many
/// rounds (with G blocks each block owns 256 / G vectors of a slot).
fn small_stage_team(e: &Env, max_blocks: u32) -> Option<Communicator> {
    team_with(
        e,
        "two_shot_push",
        CommConfig {
            one_shot_max_bytes: Some(4 << 10),
            ll_max_bytes: 1 << 10,
            stage_bytes: Some(4 << 10),
            max_blocks,
            ..Default::default()
        },
    )
}

fn push_rounds<T: Element + Default>(
    comm: &Communicator,
    s: &[Stream],
    seed: &mut u64,
    count: usize,
    op: ReduceOp,
) {
    let mut buf = comm.alloc::<T>(count + 64).unwrap();
    let mut out = comm.alloc::<T>(count + 64).unwrap();
    let c = check_sym(comm, s, seed, &mut buf, None, (0, 0), count, op);
    assert_eq!(c.algorithm, Algorithm::TwoShotPush, "{c}");
    let es = std::mem::size_of::<T>();
    // output 16 elements in: still 16-byte aligned for every type
    let c = check_sym(
        comm,
        s,
        seed,
        &mut buf,
        Some(&mut out),
        (16 / es * 2, 16),
        count,
        op,
    );
    assert_eq!(c.algorithm, Algorithm::TwoShotPush, "{c}");
}

#[test]
fn the_write_only_two_shot_is_the_default_above_one_shot_and_runs_in_rounds() {
    let e = ar_env();
    for max_blocks in [0u32, 3] {
        let Some(comm) = small_stage_team(&e, max_blocks) else {
            return;
        };
        let s = streams(&comm);
        let mut seed = 99 + max_blocks as u64;
        assert_eq!(
            comm.choice(DType::F32, ReduceOp::Sum, 100_000, Operands::Symmetric)
                .unwrap()
                .algorithm,
            Algorithm::TwoShotPush
        );
        assert_eq!(
            comm.choice(DType::F32, ReduceOp::Sum, 1000, Operands::Symmetric)
                .unwrap()
                .algorithm,
            Algorithm::OneShot
        );
        // counts that leave vector tails, in place and out of place, every dtype
        push_rounds::<f32>(&comm, &s, &mut seed, 100_003, ReduceOp::Sum);
        push_rounds::<bf16>(&comm, &s, &mut seed, 300_001, ReduceOp::Max);
        push_rounds::<f16>(&comm, &s, &mut seed, 400_000, ReduceOp::Min);
        push_rounds::<f32>(&comm, &s, &mut seed, 2_047, ReduceOp::Max);
        // misaligned operands: the reading two-shot runs instead, still exact
        let mut buf = comm.alloc::<f32>(60_000).unwrap();
        let mut out = comm.alloc::<f32>(60_000).unwrap();
        let c = check_sym(
            &comm,
            &s,
            &mut seed,
            &mut buf,
            Some(&mut out),
            (1, 1),
            50_000,
            ReduceOp::Sum,
        );
        assert_eq!(c.algorithm, Algorithm::TwoShot);
        let mut bb = comm.alloc::<bf16>(60_000).unwrap();
        let mut bo = comm.alloc::<bf16>(60_000).unwrap();
        let c = check_sym(
            &comm,
            &s,
            &mut seed,
            &mut bb,
            Some(&mut bo),
            (3, 5),
            50_000,
            ReduceOp::Sum,
        );
        assert_eq!(c.algorithm, Algorithm::TwoShot);
    }
}

/// Push calls (many rounds, both slot parities) queued back to back with one-shot calls that use
/// the same staging slots, nothing synchronised in between: a slot reused too early shows as a
/// wrong element.
#[test]
fn write_only_two_shot_and_one_shot_share_the_staging_back_to_back() {
    let e = ar_env();
    let Some(comm) = small_stage_team(&e, 5) else {
        return;
    };
    let s = streams(&comm);
    let calls = 12usize;
    let region = 256 << 10;
    let inp = comm.alloc::<u8>(region * calls).unwrap();
    let mut out = comm.alloc::<u8>(region * calls).unwrap();
    let mut rng = Rng::new(123);
    let mut state = 123u64;
    let mut plan = Vec::new();
    for c in 0..calls {
        let dtype = DType::ALL[c % 3];
        let op = ReduceOp::ALL[(c / 3) % 3];
        // alternate: push (16 KiB .. 256 KiB), one-shot (<= 4 KiB)
        let bytes = if c % 2 == 0 {
            (16 << 10) + (rng.next_u64() % (240 << 10)) as usize
        } else {
            1024 + (rng.next_u64() % 3072) as usize
        };
        let count = bytes / dtype.size();
        let inputs: Vec<Vec<u8>> = (0..2)
            .map(|_| random_bytes(dtype, count, &mut state))
            .collect();
        plan.push((dtype, op, count, inputs));
    }
    for r in 0..2 {
        let mut all = vec![0u8; region * calls];
        for (c, (_, _, _, inputs)) in plan.iter().enumerate() {
            all[c * region..c * region + inputs[r].len()].copy_from_slice(&inputs[r]);
        }
        inp.write(r, 0, &all).unwrap();
    }
    for (c, (dtype, op, count, _)) in plan.iter().enumerate() {
        let (at, len) = (c * region, count * dtype.size());
        for (r, st) in s.iter().enumerate() {
            let got = comm
                .rank(r)
                .unwrap()
                .all_reduce_dyn(
                    *dtype,
                    inp.slice(at..at + len).unwrap(),
                    out.slice_mut(at..at + len).unwrap(),
                    *op,
                    st,
                )
                .unwrap();
            let want = if c % 2 == 0 {
                Algorithm::TwoShotPush
            } else {
                Algorithm::OneShot
            };
            assert_eq!(got.algorithm, want, "call {c}");
        }
    }
    sync(&s);
    comm.check().unwrap();
    for r in 0..2 {
        let all = out.to_vec(r).unwrap();
        for (c, (dtype, op, count, inputs)) in plan.iter().enumerate() {
            let want = reference_bytes(*dtype, *op, &refs(inputs));
            let got = &all[c * region..c * region + count * dtype.size()];
            if let Some(m) = first_mismatch_bytes(*dtype, got, &want) {
                panic!("call {c} ({count} x {dtype} {op}), rank {r}: {m}");
            }
        }
    }
}

fn ce_every_op<T: Element + Default>(comm: &Communicator, s: &[Stream], seed: &mut u64) {
    let mut buf = comm
        .alloc::<T>((1 << 20) / std::mem::size_of::<T>() + 64)
        .unwrap();
    let mut out = comm
        .alloc::<T>((1 << 20) / std::mem::size_of::<T>() + 64)
        .unwrap();
    let es = std::mem::size_of::<T>();
    for op in ReduceOp::ALL {
        for count in [5_000usize, 131_075] {
            let count = count.min((1 << 20) / es);
            // from ce_min_bytes (16 KiB) on
            let alg = if count * es >= 16 << 10 {
                Algorithm::TwoShotCe
            } else {
                Algorithm::TwoShotPush
            };
            let c = check_sym(comm, s, seed, &mut buf, None, (0, 0), count, op);
            assert_eq!(c.algorithm, alg, "{count} x {}", T::DTYPE);
            let c = check_sym(
                comm,
                s,
                seed,
                &mut buf,
                Some(&mut out),
                (8 / es * 2, 24 / es * 2),
                count,
                op,
            );
            assert_eq!(c.algorithm, alg);
        }
    }
}

/// The copy-engine two-shot: chosen between `ce_min_bytes` and `ce_max_bytes`, exact for every
/// dtype and op in place and out of place with vector tails; misaligned operands fall back to
/// the reading two-shot; a forced call larger than the landing slots is refused.
#[test]
fn the_copy_engine_two_shot_is_chosen_up_to_its_limit_and_exact() {
    let e = ar_env();
    let Some(comm) = team_with(
        &e,
        "two_shot_ce",
        CommConfig {
            one_shot_max_bytes: Some(8 << 10),
            ll_max_bytes: 1 << 10,
            ce_max_bytes: 1 << 20,
            ce_min_bytes: 16 << 10,
            ..Default::default()
        },
    ) else {
        return;
    };
    let s = streams(&comm);
    let alg = |count| {
        comm.choice(DType::F32, ReduceOp::Sum, count, Operands::Symmetric)
            .unwrap()
            .algorithm
    };
    assert_eq!(alg(100_000), Algorithm::TwoShotCe);
    assert_eq!(alg(300_000), Algorithm::TwoShotPush);
    // below ce_min_bytes (16 KiB) but above the one-shot limit: the write-only two-shot
    assert_eq!(alg(3_000), Algorithm::TwoShotPush);
    let mut seed = 4242;
    for dtype in DType::ALL {
        for_dtype!(dtype, ce_every_op(&comm, &s, &mut seed));
    }
    // misaligned: the reading two-shot
    let mut buf = comm.alloc::<f32>(70_000).unwrap();
    let mut out = comm.alloc::<f32>(70_000).unwrap();
    let c = check_sym(
        &comm,
        &s,
        &mut seed,
        &mut buf,
        Some(&mut out),
        (3, 3),
        60_000,
        ReduceOp::Sum,
    );
    assert_eq!(c.algorithm, Algorithm::TwoShot);
    // forced beyond the landing slots: refused before anything is queued
    let forced = team_with(
        &e,
        "two_shot_ce",
        CommConfig {
            algorithm: Some(Algorithm::TwoShotCe),
            ce_max_bytes: 64 << 10,
            ..Default::default()
        },
    )
    .unwrap();
    let mut big = forced.alloc::<f32>(200_000).unwrap();
    let before = launches(&e);
    let err = forced
        .rank(0)
        .unwrap()
        .all_reduce_in_place(&mut big, ReduceOp::Sum, &s[0])
        .unwrap_err();
    assert_eq!(invalid_arg(err), "count");
    assert_eq!(launches(&e), before);
}

// ---- teams across processes: one process per device, rendezvous over a Unix socket ----

const MP_RANK: &str = "CMM_TEST_MP_RANK";
const MP_PATH: &str = "CMM_TEST_MP_PATH";
const MP_MODE: &str = "CMM_TEST_MP_MODE";

/// The driver of one rank's process: the real one under `CUDA_MULTIMEM_DRIVER=cuda`, else a
/// simulated two-device machine of its own (device memory shared through memfd handles).
fn mp_driver() -> Env {
    if std::env::var(cuda_multimem::DRIVER_ENV).as_deref() == Ok("cuda") {
        ar_env()
    } else {
        ar_sim(2)
    }
}

fn mp_config() -> CommConfig {
    CommConfig {
        one_shot_max_bytes: Some(64 << 10),
        // 80 KB and 300 KB calls by the copy-engine two-shot, 1.2 MB by the write-only one
        ce_max_bytes: 512 << 10,
        ce_min_bytes: 0,
        timeout: Duration::from_millis(1500),
        scratch_bytes: 256 << 10,
        // all-gathers into symmetric outputs of 512 KiB and more through the copy engines (the
        // low-latency forms, which come first, up to 512 KiB)
        gather_ce_min_bytes: 256 << 10,
        gather_ll_max_bytes: 512 << 10,
        ..Default::default()
    }
}

/// The calls both ranks make, and each rank's data (seeded by call and rank, so any process can
/// compute every rank's input).
fn mp_calls() -> Vec<(usize, DType, ReduceOp)> {
    vec![
        (1000, DType::F32, ReduceOp::Sum),
        (40_001, DType::Bf16, ReduceOp::Max),
        (150_003, DType::F16, ReduceOp::Sum),
        (300_000, DType::F32, ReduceOp::Min),
    ]
}

fn mp_input(call: usize, rank: usize, dtype: DType, count: usize) -> Vec<u8> {
    random_bytes(dtype, count, &mut (1000 + 10 * call as u64 + rank as u64))
}

/// One rank's whole life in a two-process team; returns a description of the first problem.
fn mp_rank(rank: usize, path: &std::path::Path, mode: &str) -> Result<(), String> {
    use cuda_multimem_collectives::UnixBootstrap;
    let e = mp_driver();
    let device = e.driver.device(rank).map_err(|x| x.to_string())?;
    let boot =
        UnixBootstrap::new(path, rank, 2, Duration::from_secs(30)).map_err(|x| x.to_string())?;
    if mode == "die-in-rendezvous" && rank == 1 {
        std::process::exit(0);
    }
    let comm = Communicator::builder_with_bootstrap(&device, Box::new(boot))
        .config(mp_config())
        .build()
        .map_err(|x| format!("rank {rank}: communicator: {x}"))?;
    let mut buf = comm.alloc::<u8>(2 << 20).map_err(|x| x.to_string())?;
    if mode == "die-before-collective" && rank == 1 {
        std::process::exit(0);
    }
    let stream = Stream::new(&device).map_err(|x| x.to_string())?;
    for (c, (count, dtype, op)) in mp_calls().into_iter().enumerate() {
        let len = count * dtype.size();
        buf.write(rank, 0, &mp_input(c, rank, dtype, count))
            .map_err(|x| x.to_string())?;
        comm.rank(rank)
            .and_then(|h| h.all_reduce_dyn_in_place(dtype, buf.slice_mut(..len)?, op, &stream))
            .map_err(|x| x.to_string())?;
        stream.synchronize().map_err(|x| x.to_string())?;
        comm.check()
            .map_err(|x| format!("rank {rank}, call {c}: {x}"))?;
        let inputs: Vec<Vec<u8>> = (0..2).map(|r| mp_input(c, r, dtype, count)).collect();
        let want = reference_bytes(dtype, op, &refs(&inputs));
        let mut got = vec![0u8; len];
        buf.read(rank, 0, &mut got).map_err(|x| x.to_string())?;
        if let Some(m) = first_mismatch_bytes(dtype, &got, &want) {
            return Err(format!(
                "rank {rank}, call {c} ({count} x {dtype} {op}): {m}"
            ));
        }
    }
    // the caller's own memory, staged through the scratch across processes
    let count = 100_001;
    let mine = random_input::<f32>(count, &mut (77 + rank as u64));
    let i = DeviceBuffer::from_host(&device, &mine).map_err(|x| x.to_string())?;
    let mut o = DeviceBuffer::<f32>::zeroed(&device, count).map_err(|x| x.to_string())?;
    let ch = comm
        .rank(rank)
        .and_then(|h| h.all_reduce(&i, &mut o, ReduceOp::Sum, &stream))
        .map_err(|x| x.to_string())?;
    stream.synchronize().map_err(|x| x.to_string())?;
    comm.check()
        .map_err(|x| format!("rank {rank}, own memory: {x}"))?;
    if ch.staged_chunks == 0 {
        return Err(format!("rank {rank}: own memory was not staged ({ch})"));
    }
    let inputs: Vec<Vec<f32>> = (0..2)
        .map(|r| random_input::<f32>(count, &mut (77 + r as u64)))
        .collect();
    let want = reference(ReduceOp::Sum, &refs(&inputs));
    if let Some(m) = first_mismatch(&o.to_vec().map_err(|x| x.to_string())?, &want) {
        return Err(format!("rank {rank}, own memory: {m}"));
    }
    mp_other_collectives(rank, &comm, &device, &stream)
}

/// The other collectives across the two processes: reduce-scatter on symmetric buffers (a
/// low-latency and a staged size), all-gather and broadcast on the caller's own memory, an
/// all-gather into a symmetric output through the copy engines, and
/// the fused allreduce + residual add + RMSNorm (split over clusters of blocks on the GPU),
/// each against its host reference.
fn mp_other_collectives(
    rank: usize,
    comm: &Communicator,
    device: &Device,
    stream: &Stream,
) -> Result<(), String> {
    use cuda_multimem_collectives::{
        add_rms_norm_reference, all_gather_reference, broadcast_reference,
        reduce_scatter_reference, rms_norm_within_tolerance,
    };
    let e = |x: Error| format!("rank {rank}: {x}");
    let h = comm.rank(rank).map_err(e)?;
    let data = |seed: u64, r: usize, len: usize| random_input::<bf16>(len, &mut (seed + r as u64));
    let done = |what: &str| -> Result<(), String> {
        stream.synchronize().map_err(e)?;
        comm.check()
            .map_err(|x| format!("rank {rank}, {what}: {x}"))
    };
    for count in [1000usize, 300_001] {
        let inputs: Vec<Vec<bf16>> = (0..2)
            .map(|r| data(500 + count as u64, r, 2 * count))
            .collect();
        let i: SymmetricBuffer<bf16> = comm.alloc(2 * count).map_err(e)?;
        let mut o: SymmetricBuffer<bf16> = comm.alloc(count).map_err(e)?;
        i.write(rank, 0, &inputs[rank]).map_err(e)?;
        h.reduce_scatter(&i, &mut o, ReduceOp::Sum, stream)
            .map_err(e)?;
        done("reduce-scatter")?;
        let want = &reduce_scatter_reference(ReduceOp::Sum, &refs(&inputs))[rank];
        if let Some(m) = first_mismatch(&o.to_vec(rank).map_err(e)?, want) {
            return Err(format!(
                "rank {rank}, reduce-scatter of {count} per rank: {m}"
            ));
        }
    }
    let count = 70_001;
    let inputs: Vec<Vec<bf16>> = (0..2).map(|r| data(900, r, count)).collect();
    let i = DeviceBuffer::from_host(device, &inputs[rank]).map_err(e)?;
    let mut o = DeviceBuffer::<bf16>::zeroed(device, 2 * count).map_err(e)?;
    h.all_gather(&i, &mut o, stream).map_err(e)?;
    done("all-gather")?;
    let want = all_gather_reference(&refs(&inputs));
    if let Some(m) = first_mismatch(&o.to_vec().map_err(e)?, &want) {
        return Err(format!("rank {rank}, all-gather: {m}"));
    }
    // through the copy engines: my input into the other process's mapping of the output
    let big = 300_001;
    let inputs_big: Vec<Vec<bf16>> = (0..2).map(|r| data(950, r, big)).collect();
    let ib = DeviceBuffer::from_host(device, &inputs_big[rank]).map_err(e)?;
    let mut ob: SymmetricBuffer<bf16> = comm.alloc(2 * big).map_err(e)?;
    let c = h.all_gather(&ib, &mut ob, stream).map_err(e)?;
    if c.algorithm != cuda_multimem_collectives::Algorithm::CopyEngine {
        return Err(format!("rank {rank}: symmetric all-gather ran {c}"));
    }
    done("copy-engine all-gather")?;
    let want = all_gather_reference(&refs(&inputs_big));
    if let Some(m) = first_mismatch(&ob.to_vec(rank).map_err(e)?, &want) {
        return Err(format!("rank {rank}, copy-engine all-gather: {m}"));
    }
    let mut o = DeviceBuffer::<bf16>::zeroed(device, count).map_err(e)?;
    h.broadcast(&i, &mut o, 1, stream).map_err(e)?;
    done("broadcast")?;
    let want = broadcast_reference(&refs(&inputs), 1);
    if let Some(m) = first_mismatch(&o.to_vec().map_err(e)?, &want) {
        return Err(format!("rank {rank}, broadcast: {m}"));
    }
    let (tokens, hidden) = (3, 4096);
    let xs: Vec<Vec<bf16>> = (0..2).map(|r| data(1300, r, tokens * hidden)).collect();
    let r0 = data(1400, 0, tokens * hidden);
    let gamma = data(1500, 0, hidden);
    let x = DeviceBuffer::from_host(device, &xs[rank]).map_err(e)?;
    let mut res = DeviceBuffer::from_host(device, &r0).map_err(e)?;
    let g = DeviceBuffer::from_host(device, &gamma).map_err(e)?;
    let mut out = DeviceBuffer::<bf16>::zeroed(device, tokens * hidden).map_err(e)?;
    h.all_reduce_add_rms_norm(&x, &mut res, &g, &mut out, hidden, 1e-6, stream)
        .map_err(e)?;
    done("fused norm")?;
    let (wr, wo) = add_rms_norm_reference(&refs(&xs), &r0, &gamma, hidden, 1e-6);
    if let Some(m) = first_mismatch(&res.to_vec().map_err(e)?, &wr) {
        return Err(format!("rank {rank}, fused norm residual_out: {m}"));
    }
    let got = out.to_vec().map_err(e)?;
    if let Some(i) = (0..wo.len()).find(|&i| !rms_norm_within_tolerance(got[i], wo[i])) {
        return Err(format!(
            "rank {rank}, fused norm out[{i}] = {:?}, reference {:?}",
            got[i], wo[i]
        ));
    }
    Ok(())
}

/// The child side (run by the parent test as a separate process of this binary).
#[test]
#[ignore = "runs only as the child process of the multi-process tests"]
fn multi_process_child_rank() {
    let (Ok(rank), Ok(path)) = (std::env::var(MP_RANK), std::env::var(MP_PATH)) else {
        return skip(
            "multi_process_child_rank",
            "only runs as a child of the multi-process tests",
        );
    };
    let mode = std::env::var(MP_MODE).unwrap_or_default();
    if let Err(e) = mp_rank(rank.parse().unwrap(), std::path::Path::new(&path), &mode) {
        panic!("{e}");
    }
}

fn spawn_child(path: &std::path::Path, mode: &str) -> std::process::Child {
    cuda_multimem_tests::child_test("allreduce::multi_process_child_rank")
        .env(MP_RANK, "1")
        .env(MP_PATH, path)
        .env(MP_MODE, mode)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

fn mp_skip(name: &str) -> bool {
    let e = mp_driver();
    let d = e.driver.devices();
    if d.len() < 2 || !d[0].supports_posix_fd_handle().unwrap_or(false) {
        skip(name, "needs 2 devices with POSIX-fd VMM handles");
        return true;
    }
    false
}

fn rendezvous_path(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("cmm-ar-{tag}-{}", std::process::id()))
}

#[test]
fn a_team_of_two_processes_allreduces_over_a_unix_socket_rendezvous() {
    if mp_skip("two_processes") {
        return;
    }
    let path = rendezvous_path("ok");
    let child = spawn_child(&path, "");
    let mine = mp_rank(0, &path, "");
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "child rank failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "the child ran no rank: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    mine.unwrap();
}

#[test]
fn a_peer_process_that_dies_during_rendezvous_is_an_error_not_a_hang() {
    if mp_skip("dies_in_rendezvous") {
        return;
    }
    let path = rendezvous_path("die1");
    let mut child = spawn_child(&path, "die-in-rendezvous");
    let t = Instant::now();
    let err = mp_rank(0, &path, "").unwrap_err();
    let _ = child.wait();
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t.elapsed()
    );
    assert!(err.contains("communicator"), "{err}");
}

#[test]
fn a_peer_process_that_dies_before_a_collective_is_a_timeout() {
    if mp_skip("dies_before_collective") {
        return;
    }
    let path = rendezvous_path("die2");
    let mut child = spawn_child(&path, "die-before-collective");
    let err = mp_rank(0, &path, "").unwrap_err();
    let _ = child.wait();
    assert!(err.contains("did not arrive"), "{err}");
}

// ---- a Bootstrap test double: the ranks of a team as threads of this process ----

/// What the hub does wrong, at exchange `k` (counted per rank, bytes and descriptors alike):
/// the same for every rank, so all fail at the same point instead of waiting for each other.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Fault {
    None,
    /// One entry fewer than the team size.
    Short(usize),
    /// The last rank's entry one byte (or one descriptor) off.
    Malformed(usize),
}

enum Entry {
    Bytes(Vec<u8>),
    Fds(Vec<OwnedFd>),
}

/// The rendezvous of the threads: exchange k collects one entry per rank.
struct Hub {
    n: usize,
    fault: Fault,
    exchanges: Mutex<HashMap<usize, Vec<Option<Entry>>>>,
    arrived: Condvar,
}

struct ThreadBootstrap {
    hub: Arc<Hub>,
    rank: usize,
    next: AtomicUsize,
    fds: bool,
}

impl ThreadBootstrap {
    fn exchange<X>(
        &self,
        mine: Entry,
        take: impl Fn(&Entry) -> X,
    ) -> cuda_multimem::Result<(usize, Vec<X>)> {
        let k = self.next.fetch_add(1, Ordering::Relaxed);
        let hub = &*self.hub;
        let mut ex = hub.exchanges.lock().unwrap();
        ex.entry(k)
            .or_insert_with(|| (0..hub.n).map(|_| None).collect())[self.rank] = Some(mine);
        hub.arrived.notify_all();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ex[&k].iter().all(Option::is_some) {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Err(Error::Timeout {
                    what: format!("test bootstrap exchange {k}"),
                    after: Duration::from_secs(30),
                });
            };
            ex = hub.arrived.wait_timeout(ex, left).unwrap().0;
        }
        Ok((
            k,
            ex[&k].iter().map(|e| take(e.as_ref().unwrap())).collect(),
        ))
    }
}

impl Bootstrap for ThreadBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.hub.n
    }
    fn all_gather(&self, data: &[u8]) -> cuda_multimem::Result<Vec<Vec<u8>>> {
        let (k, mut all) = self.exchange(Entry::Bytes(data.to_vec()), |e| match e {
            Entry::Bytes(b) => b.clone(),
            Entry::Fds(_) => Vec::new(),
        })?;
        match self.hub.fault {
            Fault::Short(at) if at == k => {
                all.pop();
            }
            Fault::Malformed(at) if at == k => all.last_mut().unwrap().push(0xEE),
            _ => {}
        }
        Ok(all)
    }
    fn all_gather_fds(&self, fds: &[BorrowedFd<'_>]) -> cuda_multimem::Result<Vec<Vec<OwnedFd>>> {
        let mine = fds
            .iter()
            .map(|f| f.try_clone_to_owned())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| Error::os("dup", e))?;
        let (k, all) = self.exchange(Entry::Fds(mine), |e| match e {
            Entry::Fds(f) => f.iter().map(|x| x.try_clone()).collect(),
            Entry::Bytes(_) => Ok(Vec::new()),
        })?;
        let mut all = all
            .into_iter()
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| Error::os("dup", e))?;
        match self.hub.fault {
            Fault::Short(at) if at == k => {
                all.pop();
            }
            Fault::Malformed(at) if at == k => {
                all.last_mut().unwrap().pop();
            }
            _ => {}
        }
        Ok(all)
    }
    fn passes_fds(&self) -> bool {
        self.fds
    }
}

/// Run `body(rank, device, bootstrap)` for every rank of a team of the first `n` devices of `e`,
/// each in its own thread, with one hub; the results by rank.
fn thread_team<R: Send>(
    e: &Env,
    n: usize,
    fault: Fault,
    body: impl Fn(usize, Device, Box<dyn Bootstrap>) -> R + Sync,
) -> Vec<R> {
    let hub = Arc::new(Hub {
        n,
        fault,
        exchanges: Mutex::new(HashMap::new()),
        arrived: Condvar::new(),
    });
    let devices = e.driver.devices();
    let fds = devices[0].supports_posix_fd_handle().unwrap_or(false);
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let boot = Box::new(ThreadBootstrap {
                    hub: hub.clone(),
                    rank,
                    next: AtomicUsize::new(0),
                    fds,
                });
                let d = devices[rank].clone();
                let body = &body;
                sc.spawn(move || body(rank, d, boot))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A small configuration for the thread teams (little memory per build).
fn thread_config() -> CommConfig {
    CommConfig {
        one_shot_max_bytes: Some(16 << 10),
        stage_bytes: Some(16 << 10),
        scratch_bytes: 64 << 10,
        // generous: the suite runs many simulated teams at once
        timeout: Duration::from_secs(20),
        ..Default::default()
    }
}

fn thread_build(d: &Device, boot: Box<dyn Bootstrap>) -> cuda_multimem::Result<Communicator> {
    Communicator::builder_with_bootstrap(d, boot)
        .config(thread_config())
        .build()
}

/// One checked in-place sum of `count` f32 on `buf` by `rank` of a team of `n` (threads).
fn thread_sum(
    comm: &Communicator,
    rank: usize,
    n: usize,
    buf: &mut SymmetricBuffer<f32>,
    count: usize,
) -> cuda_multimem::Result<()> {
    let input = |r: usize| random_input::<f32>(count, &mut (500 + r as u64));
    buf.write(rank, 0, &input(rank))?;
    let s = Stream::new(comm.device(rank)?)?;
    comm.rank(rank)?
        .all_reduce_in_place(buf.slice_mut(..count)?, ReduceOp::Sum, &s)?;
    s.synchronize()?;
    comm.check()?;
    let inputs: Vec<Vec<f32>> = (0..n).map(input).collect();
    let want = reference(ReduceOp::Sum, &refs(&inputs));
    let mut got = vec![0f32; count];
    buf.read(rank, 0, &mut got)?;
    assert_eq!(first_mismatch(&got, &want), None, "rank {rank}");
    Ok(())
}

#[test]
fn a_team_over_a_test_bootstrap_in_threads_allreduces() {
    let e = ar_sim(2);
    let ok = thread_team(&e, 2, Fault::None, |rank, d, boot| {
        let comm = thread_build(&d, boot)?;
        assert_eq!(comm.local_ranks(), vec![rank]);
        let mut buf = comm.alloc::<f32>(50_000)?;
        // one-shot and the write-only two-shot
        thread_sum(&comm, rank, 2, &mut buf, 1000)?;
        thread_sum(&comm, rank, 2, &mut buf, 50_000)
    });
    for (r, x) in ok.into_iter().enumerate() {
        x.unwrap_or_else(|err| panic!("rank {r}: {err}"));
    }
}

/// Fault every exchange of building in turn: each must fail the build on every rank with
/// `Error::Peer`, never give an Ok communicator; returns how many exchanges were faulted.
fn every_exchange_faulted(fault: fn(usize) -> Fault) -> usize {
    let e = ar_sim(2);
    for k in 0.. {
        let results = thread_team(&e, 2, fault(k), |_, d, boot| {
            thread_build(&d, boot).map(|_| ())
        });
        if results.iter().all(Result::is_ok) {
            return k;
        }
        for (r, x) in results.into_iter().enumerate() {
            match x {
                Err(Error::Peer { .. }) => {}
                other => panic!(
                    "{:?}, rank {r}: expected Error::Peer, got {other:?}",
                    fault(k)
                ),
            }
        }
        assert!(k < 200, "building never completed");
    }
    unreachable!()
}

#[test]
fn a_bootstrap_that_returns_fewer_entries_than_the_team_fails_the_build_with_a_peer_error() {
    let exchanges = every_exchange_faulted(Fault::Short);
    // counts, configurations, pad readiness, and a size and a handle exchange per symmetric area
    assert!(exchanges >= 8, "only {exchanges} exchanges");
}

#[test]
fn a_bootstrap_that_returns_a_malformed_entry_fails_the_build_with_a_peer_error() {
    let exchanges = every_exchange_faulted(Fault::Malformed);
    assert!(exchanges >= 8, "only {exchanges} exchanges");
}

#[test]
fn a_rank_that_refuses_a_collective_allocation_makes_every_rank_fail_and_the_team_stays_usable() {
    let e = ar_sim(2);
    let results = thread_team(&e, 2, Fault::None, |rank, d, boot| {
        let comm = thread_build(&d, boot).unwrap();
        let refused = comm.alloc::<f32>(if rank == 0 { 0 } else { 1024 });
        match (rank, refused) {
            (0, Err(Error::InvalidArgument { arg: "len", .. })) => {}
            (1, Err(Error::RanksDisagree { what })) => {
                assert!(what.contains("rank 0 refused"), "{what}")
            }
            (r, other) => panic!("rank {r}: {other:?}"),
        }
        let mut buf = comm.alloc::<f32>(1024).unwrap();
        thread_sum(&comm, rank, 2, &mut buf, 1000)
    });
    for (r, x) in results.into_iter().enumerate() {
        x.unwrap_or_else(|err| panic!("rank {r}: {err}"));
    }
}

#[test]
fn ranks_that_ask_for_different_allocation_sizes_all_fail_with_a_disagreement() {
    let e = ar_sim(2);
    let results = thread_team(&e, 2, Fault::None, |rank, d, boot| {
        let comm = thread_build(&d, boot).unwrap();
        let r = comm.alloc::<f32>(1024 + rank);
        assert!(
            matches!(r, Err(Error::RanksDisagree { .. })),
            "rank {rank}: {r:?}"
        );
        let mut buf = comm.alloc::<f32>(1024).unwrap();
        thread_sum(&comm, rank, 2, &mut buf, 1000)
    });
    for (r, x) in results.into_iter().enumerate() {
        x.unwrap_or_else(|err| panic!("rank {r}: {err}"));
    }
}

// ---- the multicast policy and the multimem path (simulator only) ----

/// A communicator over every device of a simulated machine of `n` with `policy` and a small
/// multimem region.
fn mm_team(e: &Env, policy: MulticastPolicy, config: CommConfig) -> Communicator {
    Communicator::builder(&e.driver.devices())
        .config(CommConfig {
            multimem_capacity: 2 << 20,
            scratch_bytes: 1 << 20,
            ..config
        })
        .multicast(policy)
        .build()
        .unwrap()
}

fn mm_every_op<T: Element + Default>(comm: &Communicator, s: &[Stream], seed: &mut u64) {
    let n = comm.size();
    let mut buf = comm.alloc::<T>(20_003).unwrap();
    for op in ReduceOp::ALL {
        for count in [5usize, 1001, 20_003] {
            let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(count, seed)).collect();
            for (r, x) in inputs.iter().enumerate() {
                buf.write(r, 0, x).unwrap();
            }
            let mut path = None;
            for (r, st) in s.iter().enumerate() {
                let c = comm
                    .rank(r)
                    .unwrap()
                    .all_reduce_in_place(buf.slice_mut(..count).unwrap(), op, st)
                    .unwrap();
                path = Some(c.path);
            }
            sync(s);
            comm.check().unwrap();
            // f32 min and max have no multimem form: the peer-to-peer path serves them
            let want_path = if T::DTYPE == DType::F32 && op != ReduceOp::Sum {
                Path::PeerToPeer
            } else {
                Path::Multimem
            };
            assert_eq!(path, Some(want_path), "{count} x {} {op}", T::DTYPE);
            let want = reference(op, &refs(&inputs));
            for r in 0..n {
                let mut got = vec![T::default(); count];
                buf.read(r, 0, &mut got).unwrap();
                let bad = if op == ReduceOp::Sum {
                    first_far(&got, &want, &inputs)
                } else {
                    first_mismatch(&got, &want)
                };
                if let Some(m) = bad {
                    panic!("team of {n}, {count} x {} {op}, rank {r}: {m}", T::DTYPE);
                }
            }
        }
    }
}

fn multimem_round(n: usize, seed: u64, forced: Option<Algorithm>) {
    let e = ar_sim(n);
    e.sim
        .as_ref()
        .unwrap()
        .set_kernel_delays(Duration::from_micros(200), seed);
    let comm = mm_team(
        &e,
        MulticastPolicy::Always,
        CommConfig {
            algorithm: forced,
            one_shot_max_bytes: Some(16 << 10),
            max_blocks: 3,
            threads: 64,
            ..Default::default()
        },
    );
    assert!(comm.multimem_active());
    let s = streams(&comm);
    let mut seed = seed;
    for dtype in DType::ALL {
        for_dtype!(dtype, mm_every_op(&comm, &s, &mut seed));
    }
}

#[test]
fn multimem_allreduce_equals_the_host_reference_on_a_simulated_team_of_2() {
    multimem_round(2, 21, None);
}

#[test]
fn multimem_allreduce_equals_the_host_reference_on_a_simulated_team_of_4() {
    multimem_round(4, 22, None);
}

#[test]
fn multimem_one_shot_and_two_shot_forced_on_a_simulated_team_of_5() {
    multimem_round(5, 23, Some(Algorithm::OneShot));
    multimem_round(5, 24, Some(Algorithm::TwoShot));
}

/// Messages larger than the multimem region go through it in chunks, on the caller's own memory
/// too.
#[test]
fn multimem_messages_larger_than_the_region_run_in_chunks() {
    let e = ar_sim(4);
    let comm = mm_team(&e, MulticastPolicy::Always, CommConfig::default());
    let s = streams(&comm);
    let n = 4;
    // 2 MiB regions: 1.5 M bf16 is 3 MB, two chunks
    let count = 1_500_001;
    let mut seed = 25;
    let inputs: Vec<Vec<bf16>> = (0..n).map(|_| random_input(count, &mut seed)).collect();
    let mut keep = Vec::new();
    for (r, st) in s.iter().enumerate() {
        let d = comm.device(r).unwrap();
        let i = DeviceBuffer::from_host(d, &inputs[r]).unwrap();
        let mut o = DeviceBuffer::<bf16>::zeroed(d, count).unwrap();
        let c = comm
            .rank(r)
            .unwrap()
            .all_reduce(&i, &mut o, ReduceOp::Max, st)
            .unwrap();
        assert_eq!((c.path, c.staged_chunks), (Path::Multimem, 2), "{c}");
        keep.push((i, o));
    }
    sync(&s);
    comm.check().unwrap();
    let want = reference(ReduceOp::Max, &refs(&inputs));
    for (r, (_, o)) in keep.iter().enumerate() {
        assert_eq!(
            first_mismatch(&o.to_vec().unwrap(), &want),
            None,
            "rank {r}"
        );
    }
}

/// Ranks of a multimem team that disagree (same grid, so the barriers alone would pass and the
/// reduction would mix different calls) are reported as a disagreement, not as results.
#[test]
fn multimem_ranks_that_disagree_are_reported_not_reduced() {
    // (rank 0's call, the other ranks' call) as (dtype, op, bytes): another op, another dtype
    // of the same size, another count with the same grid
    let cases = [
        (
            (DType::Bf16, ReduceOp::Sum, 8192usize),
            (DType::Bf16, ReduceOp::Max, 8192usize),
        ),
        (
            (DType::F16, ReduceOp::Sum, 8192),
            (DType::Bf16, ReduceOp::Sum, 8192),
        ),
        (
            (DType::F32, ReduceOp::Sum, 16_384),
            (DType::F32, ReduceOp::Sum, 16_000),
        ),
    ];
    for (mine, theirs) in cases {
        let e = ar_sim(3);
        let comm = mm_team(
            &e,
            MulticastPolicy::Always,
            CommConfig {
                max_blocks: 2,
                threads: 64,
                timeout: Duration::from_secs(2),
                ..Default::default()
            },
        );
        let s = streams(&comm);
        let blocks = |(dt, op, bytes): (DType, ReduceOp, usize)| {
            comm.choice(dt, op, bytes / dt.size(), Operands::Symmetric)
                .unwrap()
                .blocks
        };
        assert_eq!(blocks(mine), blocks(theirs));
        let mut buf = comm.alloc::<u8>(64 << 10).unwrap();
        for (r, st) in s.iter().enumerate() {
            let (dtype, op, bytes) = if r == 0 { mine } else { theirs };
            let c = comm
                .rank(r)
                .unwrap()
                .all_reduce_dyn_in_place(dtype, buf.slice_mut(..bytes).unwrap(), op, st)
                .unwrap();
            assert_eq!(c.path, Path::Multimem);
        }
        sync(&s);
        let err = comm.check().unwrap_err();
        assert!(
            matches!(err, Error::RanksDisagree { .. }),
            "{mine:?} against {theirs:?}: {err}"
        );
        // and the team refuses further calls
        let again = comm
            .rank(0)
            .unwrap()
            .all_reduce_dyn_in_place(
                DType::F32,
                buf.slice_mut(..64).unwrap(),
                ReduceOp::Sum,
                &s[0],
            )
            .unwrap_err();
        assert!(matches!(again, Error::Unusable { .. }), "{again}");
    }
}

#[test]
fn multimem_with_a_dead_rank_times_out_on_every_calling_rank() {
    let e = ar_sim(3);
    let comm = mm_team(
        &e,
        MulticastPolicy::Always,
        CommConfig {
            timeout: Duration::from_millis(300),
            ..Default::default()
        },
    );
    // ranks drift apart, so a rank that gave up reaches its next barrier while the other
    // still waits at this one
    e.sim
        .as_ref()
        .unwrap()
        .set_kernel_delays(Duration::from_millis(150), 7);
    let s = streams(&comm);
    let mut buf = comm.alloc::<bf16>(4096).unwrap();
    let mut seed = 26;
    for r in 0..3 {
        buf.write(r, 0, &random_input::<bf16>(4096, &mut seed))
            .unwrap();
    }
    // rank 2 never calls; ranks 0 and 1 queue two calls each
    for _ in 0..2 {
        for r in 0..2 {
            let c = comm
                .rank(r)
                .unwrap()
                .all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[r])
                .unwrap();
            assert_eq!(c.path, Path::Multimem);
        }
    }
    let t = Instant::now();
    sync(&s[..2]);
    assert!(t.elapsed() < Duration::from_secs(20));
    match comm.check().unwrap_err() {
        Error::Timeout { what, after } => {
            assert!(what.contains("multimem"), "{what}");
            assert_eq!(after, Duration::from_millis(300));
        }
        e => panic!("expected a timeout, got {e}"),
    }
    // every calling rank is refused afterwards, never handed a result
    for r in 0..2 {
        let err = comm
            .rank(r)
            .unwrap()
            .all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[r])
            .unwrap_err();
        assert!(matches!(err, Error::Unusable { .. }), "rank {r}: {err}");
    }
    assert!(matches!(comm.check().unwrap_err(), Error::Unusable { .. }));
}

#[test]
fn multimem_pays_off_only_for_teams_larger_than_3() {
    assert!(!multimem_pays_off(2) && !multimem_pays_off(3));
    assert!(multimem_pays_off(4) && multimem_pays_off(8));
}

#[test]
fn on_a_simulated_8_device_machine_the_default_policy_picks_multimem_for_large_sums_only() {
    cuda_multimem_collectives::sim::install();
    let e = sim(SimConfig::new(8, 13030));
    let comm = Communicator::new(&e.driver.devices()).unwrap();
    assert_eq!(comm.multicast_policy(), MulticastPolicy::WhenItPaysOff);
    assert!(
        comm.multimem_active(),
        "{:?}",
        comm.multimem_unavailable_reason()
    );
    assert_eq!(comm.multimem_unavailable_reason(), None);
    let path = |dtype, op, count| {
        comm.choice(dtype, op, count, Operands::Symmetric)
            .unwrap()
            .path
    };
    // 2 MiB and more: multimem; below multimem_min_bytes (1 MiB): peer-to-peer
    assert_eq!(path(DType::Bf16, ReduceOp::Sum, 1 << 20), Path::Multimem);
    assert_eq!(path(DType::F32, ReduceOp::Sum, 1 << 20), Path::Multimem);
    assert_eq!(path(DType::Bf16, ReduceOp::Sum, 1000), Path::PeerToPeer);
    // f32 max has no multimem form
    assert_eq!(path(DType::F32, ReduceOp::Max, 1 << 20), Path::PeerToPeer);
    // and a real call reports the path it ran, with a sum within the switch's rounding
    let s = streams(&comm);
    let count = 600_000;
    let mut buf = comm.alloc::<bf16>(count).unwrap();
    let mut seed = 27;
    let inputs: Vec<Vec<bf16>> = (0..8).map(|_| random_input(count, &mut seed)).collect();
    for (r, x) in inputs.iter().enumerate() {
        buf.write(r, 0, x).unwrap();
    }
    for (r, st) in s.iter().enumerate() {
        let c = comm
            .rank(r)
            .unwrap()
            .all_reduce_in_place(&mut buf, ReduceOp::Sum, st)
            .unwrap();
        assert_eq!(c.path, Path::Multimem, "{c}");
    }
    sync(&s);
    comm.check().unwrap();
    let want = reference(ReduceOp::Sum, &refs(&inputs));
    for r in 0..8 {
        assert_eq!(
            first_far(&buf.to_vec(r).unwrap(), &want, &inputs),
            None,
            "rank {r}"
        );
    }
}

#[test]
fn the_never_policy_never_picks_multimem() {
    let e = ar_sim(8);
    let comm = mm_team(&e, MulticastPolicy::Never, CommConfig::default());
    assert!(!comm.multimem_active());
    let why = comm.multimem_unavailable_reason().unwrap();
    assert!(why.contains("Never"), "{why}");
    for count in [1000usize, 1 << 20, 1 << 24] {
        let c = comm
            .choice(DType::Bf16, ReduceOp::Sum, count, Operands::Symmetric)
            .unwrap();
        assert_eq!(c.path, Path::PeerToPeer, "{count}");
    }
}

#[test]
fn on_a_2_device_machine_when_it_pays_off_does_not_pick_multimem_and_says_why() {
    let e = ar_sim(2);
    let comm = Communicator::new(&e.driver.devices()).unwrap();
    assert!(!comm.multimem_active());
    let why = comm.multimem_unavailable_reason().unwrap();
    assert!(why.contains("team of 2"), "{why}");
    let c = comm
        .choice(DType::Bf16, ReduceOp::Sum, 1 << 24, Operands::Symmetric)
        .unwrap();
    assert_eq!(c.path, Path::PeerToPeer);
}

#[test]
fn always_fails_to_build_with_disabled_where_the_guard_refuses_multicast() {
    let e = ar_sim(4);
    let before = e.sim.as_ref().unwrap().calls("cuMulticastCreate");
    let _off = cuda_multimem::multicast::disable_multicast_on_this_thread();
    match Communicator::builder(&e.driver.devices())
        .multicast(MulticastPolicy::Always)
        .build()
    {
        Err(Error::Disabled { .. }) => {}
        Err(e) => panic!("expected Disabled, got {e}"),
        Ok(_) => panic!("a multicast team was built where multicast is disabled"),
    }
    assert_eq!(e.sim.as_ref().unwrap().calls("cuMulticastCreate"), before);
    // where it pays off, the same machine falls back to peer-to-peer and says why
    let comm = Communicator::new(&e.driver.devices()).unwrap();
    assert!(!comm.multimem_active());
    assert!(comm.multimem_unavailable_reason().is_some());
}

#[test]
fn the_multimem_path_is_refused_where_multicast_is_disabled() {
    let e = ar_env();
    if e.sim.is_some() {
        return skip(
            "multimem_refused",
            "the site's variables apply to the real driver; always_fails_to_build_with_disabled_where_the_guard_refuses_multicast covers the simulator",
        );
    }
    if cuda_multimem::multicast::multicast_allowed().is_ok() {
        return skip("multimem_refused", "multicast is not disabled here, and this suite never creates a multicast object on real GPUs");
    }
    let Some(devices) = two_devices(&e, "multimem_refused") else {
        return;
    };
    match Communicator::builder(&devices)
        .multicast(MulticastPolicy::Always)
        .build()
    {
        Err(Error::Disabled { .. }) => {}
        Err(e) => panic!("expected Disabled, got {e}"),
        Ok(_) => panic!("a multicast team was built where multicast is disabled"),
    }
}
