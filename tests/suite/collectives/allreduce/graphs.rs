//! Graph capture: a captured allreduce replays with new inputs, nothing reset from the host.

use super::*;

// ---- graphs ----

/// Capture one f32 sum of `count` elements per rank, out of place (`mem`: symmetric buffers or
/// the caller's own memory), replay it four times with new inputs (the table's runner); returns
/// what the last rank's captured call chose.
fn graph_replay(comm: &Communicator, count: usize, mem: Mem) -> Choice {
    let s = streams(comm);
    let call = Call::all_reduce(ReduceOp::Sum);
    let mut q = Queued::<f32>::new(comm, call.at(), count, call.params, mem, false);
    let chose = cuda_multimem_tests::collectives::capture_and_replay(
        comm,
        &s,
        &mut [&mut q],
        CaptureMode::Global,
        4,
        &mut Rng::new(77),
    );
    *chose[0].last().unwrap()
}

#[test]
fn a_captured_graph_replays_the_allreduce_without_host_resets() {
    let e = ar_env();
    let Some(comm) = team(&e, "graph_symmetric") else {
        return;
    };
    graph_replay(&comm, 5000, Mem::SYM);
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
    let c = graph_replay(&comm, 100_000, Mem::SYM);
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
    let c = graph_replay(&comm, 100_003, Mem::OWN);
    assert!(c.staged_chunks > 1, "{c}");
}

/// And one that one-shot serves directly, on the caller's own memory.
#[test]
fn a_captured_graph_replays_a_direct_call_on_the_callers_own_memory() {
    let e = ar_env();
    let Some(comm) = team(&e, "graph_own_direct") else {
        return;
    };
    let c = graph_replay(&comm, 5000, Mem::OWN);
    assert_eq!(c.staged_chunks, 0, "{c}");
}
