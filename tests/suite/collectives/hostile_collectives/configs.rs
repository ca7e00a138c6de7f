//! Configurations at the edges of what `validate` accepts, and the reports of what a call
//! would run: every collective still gives its host reference.

use super::*;

// ---- the communicator's reports ----

/// `Communicator::choice` reports `staged_chunks` as a u32 (0 means "no copies"): a count whose
/// chunks through the scratch do not fit must be refused naming it, not truncated to a report
/// that says the operands are used in place.
#[test]
fn a_choice_whose_chunk_count_does_not_fit_its_report_is_refused() {
    let (_e, comm, _s) = team(
        2,
        CommConfig {
            // the smallest scratch: three 4 KiB regions
            scratch_bytes: 1,
            ..Default::default()
        },
    );
    // 2^45 bytes in 4 KiB chunks: 2^33 chunks, 0 as a u32
    let count = 1usize << 43;
    assert_eq!(
        arg_of(comm.choice(DType::F32, ReduceOp::Sum, count, Operands::Local)),
        "count"
    );
    // a count that fits is reported with its chunks (16 MiB, above the 8 MiB one-shot limit)
    let c = comm
        .choice(DType::F32, ReduceOp::Sum, 1 << 22, Operands::Local)
        .unwrap();
    assert_eq!(c.staged_chunks, 4096);
}

// ---- configurations at the edges of what `validate` accepts ----

trait Elem: Element + Default + Copy + std::fmt::Debug {}
impl<T: Element + Default + Copy + std::fmt::Debug> Elem for T {}

fn bits<T: Elem>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

/// Every collective once at `count` elements per rank (allreduce on symmetric buffers and on
/// the caller's own memory, reduce-scatter, all-gather, broadcast from the last rank, the fused
/// norm at hidden `count` up to 400), each compared with its host reference.
fn every_collective<T: Elem>(comm: &Communicator, s: &[Stream], count: usize, what: &str) {
    let n = comm.size();
    let mut seed = 17 + count as u64;
    let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(n * count, &mut seed)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let firsts: Vec<&[T]> = inputs.iter().map(|v| &v[..count]).collect();
    let what = format!("{what}, {count} x {}", T::DTYPE);
    // allreduce, symmetric, in place
    let mut buf = comm.alloc::<T>(count).unwrap();
    for (r, x) in firsts.iter().enumerate() {
        buf.write(r, 0, x).unwrap();
    }
    for (r, st) in s.iter().enumerate() {
        comm.rank(r)
            .unwrap()
            .all_reduce_in_place(&mut buf, ReduceOp::Sum, st)
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    let want = reference(ReduceOp::Sum, &firsts);
    for r in 0..n {
        assert_eq!(
            bits(&buf.to_vec(r).unwrap()),
            bits(&want),
            "{what}: allreduce rank {r}"
        );
    }
    // allreduce, the caller's own memory, out of place
    let ins: Vec<DeviceBuffer<T>> = (0..n)
        .map(|r| DeviceBuffer::from_host(comm.device(r).unwrap(), firsts[r]).unwrap())
        .collect();
    let mut outs: Vec<DeviceBuffer<T>> = (0..n)
        .map(|r| DeviceBuffer::zeroed(comm.device(r).unwrap(), count).unwrap())
        .collect();
    for r in 0..n {
        comm.rank(r)
            .unwrap()
            .all_reduce(&ins[r], &mut outs[r], ReduceOp::Max, &s[r])
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    let want = reference(ReduceOp::Max, &firsts);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(
            bits(&o.to_vec().unwrap()),
            bits(&want),
            "{what}: own allreduce rank {r}"
        );
    }
    // reduce-scatter, all-gather, broadcast on symmetric buffers
    let whole = comm.alloc::<T>(n * count).unwrap();
    let mut part = comm.alloc::<T>(count).unwrap();
    let mut gathered = comm.alloc::<T>(n * count).unwrap();
    for r in 0..n {
        whole.write(r, 0, refs[r]).unwrap();
        part.write(r, 0, firsts[r]).unwrap();
    }
    for (r, st) in s.iter().enumerate() {
        comm.rank(r)
            .unwrap()
            .reduce_scatter(&whole, &mut part, ReduceOp::Min, st)
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    let want = reduce_scatter_reference(ReduceOp::Min, &refs);
    for (r, w) in want.iter().enumerate() {
        assert_eq!(
            bits(&part.to_vec(r).unwrap()),
            bits(w),
            "{what}: reduce-scatter rank {r}"
        );
    }
    let chunks: Vec<Vec<T>> = (0..n).map(|r| part.to_vec(r).unwrap()).collect();
    for (r, st) in s.iter().enumerate() {
        comm.rank(r)
            .unwrap()
            .all_gather(&part, &mut gathered, st)
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    let crefs: Vec<&[T]> = chunks.iter().map(|v| v.as_slice()).collect();
    let want = all_gather_reference(&crefs);
    for r in 0..n {
        assert_eq!(
            bits(&gathered.to_vec(r).unwrap()),
            bits(&want),
            "{what}: all-gather rank {r}"
        );
    }
    for (r, st) in s.iter().enumerate() {
        comm.rank(r)
            .unwrap()
            .broadcast_in_place(&mut part, n - 1, st)
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    for r in 0..n {
        assert_eq!(
            bits(&part.to_vec(r).unwrap()),
            bits(&chunks[n - 1]),
            "{what}: broadcast rank {r}"
        );
    }
    // the fused norm: 3 tokens of hidden `count` (at most 400: a row fits a 4 KiB staging slot
    // twice), the caller's own memory
    let (tokens, hidden) = (3, count.min(400));
    let xs: Vec<Vec<T>> = (0..n)
        .map(|_| random_input(tokens * hidden, &mut seed))
        .collect();
    let res0: Vec<T> = random_input(tokens * hidden, &mut seed);
    let gamma: Vec<T> = random_input(hidden, &mut seed);
    let xrefs: Vec<&[T]> = xs.iter().map(|v| v.as_slice()).collect();
    let (want_res, want_out) = add_rms_norm_reference(&xrefs, &res0, &gamma, hidden, 1e-6);
    let mut bufs: Vec<_> = (0..n)
        .map(|r| {
            let d = comm.device(r).unwrap();
            (
                DeviceBuffer::from_host(d, &xs[r]).unwrap(),
                DeviceBuffer::from_host(d, &res0).unwrap(),
                DeviceBuffer::from_host(d, &gamma).unwrap(),
                DeviceBuffer::<T>::zeroed(d, tokens * hidden).unwrap(),
            )
        })
        .collect();
    for (r, (x, res, g, out)) in bufs.iter_mut().enumerate() {
        comm.rank(r)
            .unwrap()
            .all_reduce_add_rms_norm(&*x, &mut *res, &*g, &mut *out, hidden, 1e-6, &s[r])
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    for (r, (_, res, _, out)) in bufs.iter().enumerate() {
        assert_eq!(
            bits(&res.to_vec().unwrap()),
            bits(&want_res),
            "{what}: norm residual rank {r}"
        );
        let out = out.to_vec().unwrap();
        for (i, (&g, &w)) in out.iter().zip(&want_out).enumerate() {
            assert!(
                rms_norm_within_tolerance(g, w),
                "{what}: norm out rank {r} element {i}: {g:?} vs {w:?}"
            );
        }
    }
}

/// Configurations `validate` accepts at the edges of every field, thresholds inverted or
/// turned off: every collective still equals its host reference (no panic, no hang, no wrong
/// bits), on a team of 3 (chunks that do not divide evenly) at counts from 1 to beyond the
/// smallest staging slot.
#[test]
fn configurations_at_the_edges_of_validity_still_give_the_reference() {
    let base = CommConfig {
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let configs = [
        (
            "everything smallest, low-latency and one-shot off",
            CommConfig {
                threads: 64,
                push_threads: 64,
                max_blocks: 1,
                stage_bytes: Some(4096),
                one_shot_max_bytes: Some(0),
                ll_max_bytes: 0,
                gather_ll_max_bytes: 0,
                broadcast_ll_max_bytes: 0,
                norm_ll_max_bytes: 0,
                scratch_bytes: 1,
                multimem_capacity: 0,
                ..base.clone()
            },
        ),
        (
            "copy engines from 0 bytes, inverted ce thresholds",
            CommConfig {
                ll_max_bytes: 0,
                one_shot_max_bytes: Some(0),
                ce_min_bytes: 0,
                ce_max_bytes: 64 << 10,
                gather_ce_min_bytes: 0,
                broadcast_ce_min_bytes: 0,
                gather_ll_max_bytes: 0,
                broadcast_ll_max_bytes: 0,
                stage_bytes: Some(4096),
                ..base.clone()
            },
        ),
        (
            "everything largest per launch, low-latency limits above the one-shot limit",
            CommConfig {
                threads: 1024,
                push_threads: 1024,
                max_blocks: MAX_BLOCKS as u32,
                one_shot_max_bytes: Some(4096),
                stage_bytes: Some(4096),
                ll_max_bytes: 1 << 20,
                norm_ll_max_bytes: 1 << 20,
                gather_ll_max_bytes: 1 << 20,
                broadcast_ll_max_bytes: 1 << 20,
                ..base.clone()
            },
        ),
        (
            "one-shot forced, the smallest staging",
            CommConfig {
                algorithm: Some(Algorithm::OneShot),
                stage_bytes: Some(4096),
                one_shot_max_bytes: Some(0),
                ..base.clone()
            },
        ),
    ];
    for (what, config) in configs {
        config.validate().unwrap();
        let forced = config.algorithm.is_some();
        let (_e, comm, s) = team_as_is(3, config);
        for count in [1, 7, 1000, 5000] {
            if forced && count * 4 > 4096 {
                // a forced one-shot on symmetric buffers larger than its staging is refused
                let mut big = comm.alloc::<f32>(count).unwrap();
                let r = comm.rank(0).unwrap();
                assert_eq!(
                    arg_of(r.all_reduce_in_place(&mut big, ReduceOp::Sum, &s[0])),
                    "count"
                );
                continue;
            }
            every_collective::<f32>(&comm, &s, count, what);
        }
        every_collective::<bf16>(&comm, &s, 999, what);
    }
}
