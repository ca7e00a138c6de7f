//! Graph capture: a captured allreduce replays with new inputs, nothing reset from the host.

use super::*;

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
