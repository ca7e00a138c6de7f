//! The copy-engine all-gather and broadcast: results, thresholds, back to back with the kernel
//! forms, complete for the next work on the stream, graph replays, disagreement.

use super::*;

/// All-gather and broadcast through the copy engines equal the host references for every type,
/// in place and out of place, at any offset of the symmetric output; into the caller's own
/// memory they, and reduce-scatter, keep their kernels, also correct; an empty all-gather
/// queues nothing. Both drivers.
#[test]
fn copy_engine_all_gather_and_broadcast_equal_the_host_reference_for_every_dtype_and_operand_kind()
{
    let e = env();
    let Some(comm) = team(&e, ce_config()) else {
        return;
    };
    let s = streams(&comm);
    // an empty all-gather queues nothing, even with the threshold at 0 bytes: rank 0 alone
    // calls it, and no barrier waits for rank 1
    let mut empty = comm.alloc::<f32>(4).unwrap();
    let c = comm
        .rank(0)
        .unwrap()
        .all_gather_in_place(empty.slice_mut(0..0).unwrap(), &s[0])
        .unwrap();
    assert_ne!(c.algorithm, Algorithm::CopyEngine);
    sync(&s);
    comm.check().unwrap();
    let mut seed = Rng::new(23);
    let mut kinds = ReduceOp::ALL.map(Call::reduce_scatter).to_vec();
    kinds.extend([Call::all_gather(), Call::broadcast(1)]);
    for kind in kinds {
        for count in [3, 1000, 20_000] {
            for mem in [Mem::SYM, Mem::SYM_ODD, Mem::OWN] {
                for in_place in [false, true] {
                    for c in [
                        once::<f32>(&comm, &s, kind, count, mem, in_place, &mut seed),
                        once::<f16>(&comm, &s, kind, count, mem, in_place, &mut seed),
                        once::<bf16>(&comm, &s, kind, count, mem, in_place, &mut seed),
                    ] {
                        let ce = matches!(kind.name, "all_gather" | "broadcast") && mem != Mem::OWN;
                        assert_eq!(
                            c.algorithm == Algorithm::CopyEngine,
                            ce,
                            "{kind:?} of {count}, {mem:?}, in place {in_place}: {c}"
                        );
                    }
                }
            }
        }
    }
}

/// The copy engines take an all-gather or a broadcast from `gather_ce_min_bytes` /
/// `broadcast_ce_min_bytes` of whole buffer, in place or not (one rule, so ranks that differ in
/// that choose alike); below, the kernels.
#[test]
fn copy_engine_forms_start_at_their_threshold_in_place_or_not() {
    let e = env();
    let Some(comm) = team(
        &e,
        CommConfig {
            gather_ce_min_bytes: 64 << 10,
            broadcast_ce_min_bytes: 64 << 10,
            ..ce_config()
        },
    ) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = Rng::new(5);
    // f32: an all-gather of 2 x 8191 x 4 bytes is just under 64 KiB, of 2 x 8192 x 4 64 KiB;
    // a broadcast of 16383 or 16384
    for (kind, count, ce) in [
        (Call::all_gather(), 8191, false),
        (Call::all_gather(), 8192, true),
        (Call::broadcast(1), 16_383, false),
        (Call::broadcast(1), 16_384, true),
    ] {
        for in_place in [false, true] {
            let c = once::<f32>(&comm, &s, kind, count, Mem::SYM, in_place, &mut seed);
            assert_eq!(
                c.algorithm == Algorithm::CopyEngine,
                ce,
                "{kind:?} of {count}, in place {in_place}: {c}"
            );
        }
    }
    // rank 0 in place, rank 1 out of place: the same form, correct results
    let count = 8192;
    let input = comm.alloc::<f32>(count).unwrap();
    let mut output = comm.alloc::<f32>(2 * count).unwrap();
    let ins: Vec<Vec<f32>> = (0..2).map(|_| seed.input(count)).collect();
    output.write(0, 0, &ins[0]).unwrap();
    input.write(1, 0, &ins[1]).unwrap();
    let c0 = comm
        .rank(0)
        .unwrap()
        .all_gather_in_place(&mut output, &s[0])
        .unwrap();
    let c1 = comm
        .rank(1)
        .unwrap()
        .all_gather(&input, &mut output, &s[1])
        .unwrap();
    assert_eq!(
        (c0.algorithm, c1.algorithm),
        (Algorithm::CopyEngine, Algorithm::CopyEngine)
    );
    sync(&s);
    comm.check().unwrap();
    let refs: Vec<&[f32]> = ins.iter().map(|v| v.as_slice()).collect();
    for r in 0..2 {
        assert_eq!(
            output.to_vec(r).unwrap(),
            all_gather_reference(&refs),
            "rank {r}"
        );
    }
}

/// Copy-engine all-gathers back to back with every kernel form (low-latency, staged, direct,
/// the allreduce), random sizes, types and operand kinds, random per-device delays, checked
/// once all have run, on teams of 2 to 8: the copies of one call (on the caller's stream and
/// the rank's second one) must not run into the previous call's or the next one's work.
#[test]
fn copy_engine_calls_back_to_back_with_the_kernel_forms_stay_correct_on_teams_of_2_to_8() {
    for (n, seed) in [(2usize, 11u64), (3, 12), (5, 13), (8, 14)] {
        let (_e, comm) = delayed_team_ce(n, seed, 8192);
        let ran = back_to_back(&comm, seed, 48, &[64, 1500, 3000, 6000]);
        let ce = ran.iter().filter(|&&a| a == Algorithm::CopyEngine).count();
        assert!(ce >= 2, "team of {n}: only {ce} copy-engine calls");
    }
}

/// The gathered output is complete in the caller's stream order when the call returns to it:
/// a copy of it queued next on the same stream sees every rank's chunk, though the peers'
/// copies into it start late (random delays before every simulated copy and launch). Without
/// the final barrier the snapshot misses chunks.
#[test]
fn a_copy_engine_all_gather_is_complete_for_the_next_work_on_the_stream() {
    for (n, seed) in [(2usize, 21u64), (3, 22), (5, 23)] {
        let (_e, comm) = delayed_team_ce(n, seed, 0);
        let s = streams(&comm);
        let count = 3000;
        let mut data = seed;
        let input = comm.alloc::<f32>(count).unwrap();
        let mut output = comm.alloc::<f32>(n * count).unwrap();
        for round in 0..4 {
            let ins: Vec<Vec<f32>> = (0..n).map(|_| random_input(count, &mut data)).collect();
            for (r, x) in ins.iter().enumerate() {
                input.write(r, 0, x).unwrap();
            }
            let mut snaps = Vec::new();
            for (r, st) in s.iter().enumerate() {
                let c = comm
                    .rank(r)
                    .unwrap()
                    .all_gather(&input, &mut output, st)
                    .unwrap();
                assert_eq!(c.algorithm, Algorithm::CopyEngine);
                let snap = DeviceBuffer::<f32>::zeroed(comm.device(r).unwrap(), n * count).unwrap();
                // SAFETY: both ranges are n * count f32 of this rank's device memory (its part
                // of the symmetric output, the snapshot), queued on a live stream of it.
                unsafe {
                    st.as_stream_ref()
                        .copy_dtod_async(
                            snap.device_ptr(),
                            output.device_ptr(r).unwrap(),
                            n * count * 4,
                        )
                        .unwrap()
                };
                snaps.push(snap);
            }
            sync(&s);
            comm.check().unwrap();
            let refs: Vec<&[f32]> = ins.iter().map(|v| v.as_slice()).collect();
            let want = all_gather_reference(&refs);
            for (r, snap) in snaps.iter().enumerate() {
                assert_eq!(
                    snap.to_vec().unwrap(),
                    want,
                    "team of {n}, round {round}, rank {r}"
                );
            }
        }
    }
}

/// Copy-engine all-gathers and a broadcast captured in a graph (out of place: the fork onto the rank's second
/// stream and the join inside the capture) replay correctly with new inputs, between staged
/// reduce-scatters.
#[test]
fn captured_copy_engine_calls_replay_with_new_inputs() {
    let e = sim(SimConfig::new(3, 13000));
    let comm =
        cuda_multimem_tests::team_on(&e.driver.devices(), ce_config(), MulticastPolicy::Never).0;
    captured_copy_engine_calls(&comm);
}

/// The same on the chosen driver's first two devices (real GPUs under `test-hw`).
#[test]
fn captured_copy_engine_calls_replay_with_new_inputs_on_two_devices() {
    let e = env();
    if let Some(comm) = team(&e, ce_config()) {
        captured_copy_engine_calls(&comm);
    }
}

fn captured_copy_engine_calls(comm: &Communicator) {
    let s = streams(comm);
    let count = 5000;
    // a staged reduce-scatter between the copy-engine all-gathers (the caller's own input into
    // a symmetric output, in place) and broadcast (in place)
    let mut rs = Queued::<f32>::new(
        comm,
        Call::reduce_scatter(ReduceOp::Sum).at(),
        count,
        Params::sum(),
        Mem::SYM,
        false,
    );
    let mut ag = Queued::<bf16>::new(
        comm,
        Call::all_gather().at(),
        count,
        Params::sum(),
        Mem::OWN_TO_SYM,
        false,
    );
    let mut ag_in_place = Queued::<f32>::new(
        comm,
        Call::all_gather().at(),
        count,
        Params::sum(),
        Mem::SYM,
        true,
    );
    let mut bc = Queued::<f16>::new(
        comm,
        Call::broadcast(1).at(),
        count,
        Params::root(1),
        Mem::SYM,
        true,
    );
    let chose = table::capture_and_replay(
        comm,
        &s,
        &mut [&mut rs, &mut ag, &mut ag_in_place, &mut bc],
        CaptureMode::Relaxed,
        3,
        &mut Rng::new(91),
    );
    for (i, want) in [
        Algorithm::PushStaged,
        Algorithm::CopyEngine,
        Algorithm::CopyEngine,
        Algorithm::CopyEngine,
    ]
    .into_iter()
    .enumerate()
    {
        for c in &chose[i] {
            assert_eq!(c.algorithm, want, "case {i}: {c}");
        }
    }
}

/// A copy-engine call whose peer calls something else (another size; another broadcast root;
/// the staged kernel, its output being its own memory) is reported by `check()` as a
/// disagreement (a peer that never calls: `a_peer_that_never_calls_is_reported_as_a_timeout`).
#[test]
fn copy_engine_calls_whose_peer_calls_something_else_are_reported() {
    let team_of = |n: usize| cuda_multimem_tests::sim_team(n, ce_config());
    // sizes 2000 / 4000 per rank
    {
        let (_e, comm, s) = team_of(2);
        let input = comm.alloc::<f32>(4000).unwrap();
        let mut output = comm.alloc::<f32>(8000).unwrap();
        for (r, count) in [(0usize, 2000usize), (1, 4000)] {
            let c = comm
                .rank(r)
                .unwrap()
                .all_gather(
                    input.slice(..count).unwrap(),
                    output.slice_mut(..2 * count).unwrap(),
                    &s[r],
                )
                .unwrap();
            assert_eq!(c.algorithm, Algorithm::CopyEngine);
        }
        expect_reported_disagreement(&comm, &s, "all-gather sizes 2000 / 4000");
    }
    // broadcasts through the copy engines from roots 0 / 1
    {
        let (_e, comm, s) = team_of(2);
        let mut buf = comm.alloc::<f32>(8000).unwrap();
        for (r, root) in [(0usize, 0usize), (1, 1)] {
            let c = comm
                .rank(r)
                .unwrap()
                .broadcast_in_place(&mut buf, root, &s[r])
                .unwrap();
            assert_eq!(c.algorithm, Algorithm::CopyEngine);
        }
        expect_reported_disagreement(&comm, &s, "broadcast roots 0 / 1");
    }
    // rank 0's all-gather through the copy engines, rank 1's staged (own output)
    {
        let (_e, comm, s) = team_of(2);
        let input = comm.alloc::<f32>(4000).unwrap();
        let mut output = comm.alloc::<f32>(8000).unwrap();
        let mut own = DeviceBuffer::<f32>::zeroed(comm.device(1).unwrap(), 8000).unwrap();
        let c0 = comm
            .rank(0)
            .unwrap()
            .all_gather(&input, &mut output, &s[0])
            .unwrap();
        let c1 = comm
            .rank(1)
            .unwrap()
            .all_gather(&input, &mut own, &s[1])
            .unwrap();
        assert_eq!(c0.algorithm, Algorithm::CopyEngine);
        assert_eq!(c1.algorithm, Algorithm::PushStaged);
        expect_reported_disagreement(&comm, &s, "copy engines / staged");
    }
}

/// Wait for the team's calls, then expect `check()` to report ranks that disagree.
fn expect_reported_disagreement(comm: &Communicator, s: &[Stream], what: &str) {
    sync(s);
    match comm.check() {
        Err(Error::RanksDisagree { .. }) => {}
        other => panic!("{what}: got {other:?}"),
    }
}
