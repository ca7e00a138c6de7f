//! Results equal the host references for every type, operator and operand kind, in place and
//! not; direct stores and staged rounds; the low-latency forms and their limits.

use super::*;

#[test]
fn reduce_scatter_equals_the_host_reference_for_every_dtype_op_and_operand_kind() {
    sweep_both(&ReduceOp::ALL.map(Call::reduce_scatter));
}

#[test]
fn all_gather_equals_the_host_reference_for_every_dtype_and_operand_kind() {
    sweep_both(&[Call::all_gather()]);
}

#[test]
fn broadcast_from_every_root_equals_the_host_reference_for_every_dtype_and_operand_kind() {
    sweep_both(&[Call::broadcast(0), Call::broadcast(1)]);
}

/// The direct path (symmetric outputs above the one-shot limit, lowered here) and many staged
/// rounds (slots of 4 KiB shared by the blocks), on both drivers.
#[test]
fn direct_stores_and_staged_rounds_equal_the_host_reference() {
    let e = env();
    let config = CommConfig {
        one_shot_max_bytes: Some(4096),
        stage_bytes: Some(4096),
        max_blocks: 4,
        gather_ll_max_bytes: 0,
        broadcast_ll_max_bytes: 0,
        ..Default::default()
    };
    let Some(comm) = team(&e, config) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = Rng::new(11);
    for kind in [
        Call::all_gather(),
        Call::broadcast(1),
        Call::reduce_scatter(ReduceOp::Sum),
    ] {
        for mem in [Mem::SYM, Mem::SYM_ODD, Mem::OWN] {
            for in_place in [false, true] {
                let c = once::<bf16>(&comm, &s, kind, 20_000, mem, in_place, &mut seed);
                let direct = mem != Mem::OWN && kind != Call::reduce_scatter(ReduceOp::Sum);
                assert_eq!(
                    c.algorithm,
                    if direct {
                        Algorithm::PushDirect
                    } else {
                        Algorithm::PushStaged
                    },
                    "{kind:?} {mem:?}"
                );
                once::<f32>(&comm, &s, kind, 3001, mem, in_place, &mut seed);
            }
        }
    }
}

#[test]
fn small_messages_run_one_low_latency_launch_with_few_threads() {
    let e = env();
    // low-latency up to 64 KiB of whole buffer (one word per thread), else staged (16-byte
    // units, at least 64 threads)
    for (config, alg, threads) in [
        (CommConfig::default(), Algorithm::PushLl, 128),
        (staged_only(), Algorithm::PushStaged, 64),
    ] {
        let Some(comm) = team(&e, config) else {
            return;
        };
        let s = streams(&comm);
        let mut seed = Rng::new(3);
        for kind in [
            Call::reduce_scatter(ReduceOp::Sum),
            Call::all_gather(),
            Call::broadcast(0),
        ] {
            // 1 KiB gathered / scattered: 256 f32 in all, 128 per rank
            for mem in [Mem::SYM, Mem::OWN] {
                let count = if kind == Call::broadcast(0) { 256 } else { 128 };
                let c = once::<f32>(&comm, &s, kind, count, mem, false, &mut seed);
                let t = if kind == Call::broadcast(0) && alg == Algorithm::PushLl {
                    256
                } else {
                    threads
                };
                assert_eq!(c.algorithm, alg, "{kind:?} {mem:?}");
                assert_eq!((c.blocks, c.threads, c.staged_chunks), (1, t, 0));
            }
        }
    }
}

/// The low-latency forms take whole buffers (reduce-scatter's input, all-gather's output) up to
/// `gather_ll_max_bytes` and broadcast messages up to `broadcast_ll_max_bytes` (a smaller
/// limit here, so a broadcast just above it is still within the other), whatever the operands'
/// alignment; one element more runs the staged kernel.
#[test]
fn the_low_latency_forms_take_whole_buffers_up_to_gather_ll_max_bytes() {
    let e = env();
    let Some(comm) = team(
        &e,
        CommConfig {
            gather_ll_max_bytes: 8192,
            broadcast_ll_max_bytes: 4096,
            ..Default::default()
        },
    ) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = Rng::new(21);
    for kind in [
        Call::reduce_scatter(ReduceOp::Max),
        Call::all_gather(),
        Call::broadcast(1),
    ] {
        // whole buffer of 8192 bytes: 4096 bf16, 2048 per rank; broadcast, its own limit:
        // 4096 bytes, 2048 bf16 (one more is within the others' limit, not within its own)
        let at = 2048;
        for mem in [Mem::SYM, Mem::SYM_ODD, Mem::OWN] {
            for in_place in [false, true] {
                let c = once::<bf16>(&comm, &s, kind, at, mem, in_place, &mut seed);
                assert_eq!(
                    c.algorithm,
                    Algorithm::PushLl,
                    "{kind:?} {mem:?} at the limit"
                );
                let c = once::<bf16>(&comm, &s, kind, at + 1, mem, in_place, &mut seed);
                assert_eq!(c.algorithm, Algorithm::PushStaged, "{kind:?} {mem:?} above");
            }
        }
    }
}
