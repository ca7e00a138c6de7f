//! The protocol: back to back with allreduce and random delays, staging reuse, low-latency
//! broadcasts from one root, graph replays, disagreement and absence, drops with calls in flight,
//! bad arguments refused before any launch.

use super::*;

/// Back-to-back calls of every collective, interleaved with allreduce, of random sizes, types
/// and operand kinds, with random per-device delays, checked only once all have run: the
/// counters, slot parities and header parities of one call must not disturb the next.
#[test]
fn back_to_back_collectives_interleaved_with_allreduce_stay_correct_on_teams_of_2_to_8() {
    for (n, seed) in [(2usize, 1u64), (3, 2), (5, 3), (8, 4)] {
        let (_e, comm) = delayed_team(n, seed);
        back_to_back(&comm, seed, 16, &[1, 5, 64, 333, 1500, 2048]);
    }
}

/// A staged reduce-scatter or all-gather of several rounds, then at once a one-shot allreduce
/// (it pushes into the staging before its first barrier), on teams of 2 and 3 with random
/// delays before every phase B: a peer still reading my last round's sub-slot must not find
/// the allreduce's data there. The ring's sub-slots map onto the staging parities so that a
/// call's first parity is never the one of the previous call's last round; the mapping that
/// puts two consecutive rounds into one parity fails here.
#[test]
fn a_one_shot_allreduce_right_after_a_staged_call_leaves_its_last_round_alone() {
    for (n, seed) in [(2usize, 5u64), (3, 6)] {
        let (_e, comm) = delayed_team(n, seed);
        let s = streams(&comm);
        let mut data = Rng::new(seed + 200);
        let mut pending: Vec<Box<dyn Pending>> = Vec::new();
        for i in 0..24 {
            let kind = if i % 2 == 0 {
                Call::reduce_scatter(ReduceOp::Sum)
            } else {
                Call::all_gather()
            };
            let count = [1500, 1100, 900][i % 3];
            let p = queue::<f32>(&comm, &s, kind, count, Mem::OWN, false, &mut data);
            assert_eq!(p.choices.last().unwrap().algorithm, Algorithm::PushStaged);
            pending.push(Box::new(p));
            let p = queue::<f32>(
                &comm,
                &s,
                Call::all_reduce(ReduceOp::Sum),
                700,
                Mem::SYM,
                false,
                &mut data,
            );
            assert_eq!(p.choices.last().unwrap().algorithm, Algorithm::OneShot);
            pending.push(Box::new(p));
        }
        sync(&s);
        comm.check().unwrap();
        for p in &pending {
            p.check();
        }
    }
}

/// Low-latency broadcasts from one root, back to back: the root hears nothing from the
/// others in a broadcast, yet it must not overwrite a slot a slow receiver still polls two
/// calls later. The non-roots' presence words (every rank hears from every peer in every call)
/// hold it back; without them a receiver finds a newer call's flags and times out, or a rank
/// reads data of another call. Teams of 2, 3 and 5 with random delays; interleaved all-gathers
/// change nothing of the rule.
#[test]
fn back_to_back_low_latency_broadcasts_from_one_root_wait_for_every_receiver() {
    for (n, seed) in [(2usize, 5u64), (3, 6), (5, 7)] {
        let e = sim(SimConfig::new(n, 13000));
        let devices = e.driver.devices();
        let comm = cuda_multimem_tests::team_on(
            &devices,
            CommConfig {
                timeout: cuda_multimem_tests::TEAM_TIMEOUT,
                ..Default::default()
            },
            MulticastPolicy::Never,
        )
        .0;
        let s = streams(&comm);
        let mut data = seed;
        // every buffer allocated and written first: nothing between the calls synchronises
        let calls = 40;
        let count = |i: usize| 40 + i;
        let mut ins = Vec::new();
        let mut outs = Vec::new();
        let mut want = Vec::new();
        for i in 0..calls {
            let ag = i % 8 == 7;
            let (il, ol) = if ag {
                (count(i), n * count(i))
            } else {
                (count(i), count(i))
            };
            let b_in = comm.alloc::<f32>(il).unwrap();
            let x: Vec<Vec<f32>> = (0..n).map(|_| random_input(il, &mut data)).collect();
            for (r, x) in x.iter().enumerate() {
                b_in.write(r, 0, x).unwrap();
            }
            let refs: Vec<&[f32]> = x.iter().map(|v| v.as_slice()).collect();
            want.push(if ag {
                all_gather_reference(&refs)
            } else {
                broadcast_reference(&refs, 0)
            });
            ins.push(b_in);
            outs.push(comm.alloc::<f32>(ol).unwrap());
        }
        e.sim
            .as_ref()
            .unwrap()
            .set_kernel_delays(Duration::from_micros(400), seed);
        for (i, (b_in, b_out)) in ins.iter().zip(outs.iter_mut()).enumerate() {
            for (r, st) in s.iter().enumerate() {
                let h = comm.rank(r).unwrap();
                let c = if i % 8 == 7 {
                    h.all_gather(b_in, &mut *b_out, st).unwrap()
                } else {
                    h.broadcast(b_in, &mut *b_out, 0, st).unwrap()
                };
                assert_eq!(c.algorithm, Algorithm::PushLl);
            }
        }
        sync(&s);
        comm.check().unwrap_or_else(|e| panic!("{n} ranks: {e}"));
        for (i, (b, w)) in outs.iter().zip(&want).enumerate() {
            for r in 0..n {
                assert_eq!(&b.to_vec(r).unwrap(), w, "{n} ranks, call {i}, rank {r}");
            }
        }
    }
}

/// A captured sequence (reduce-scatter, all-gather, broadcast, staged and direct) replays
/// correctly with new inputs each time: nothing is reset from the host.
#[test]
fn captured_collectives_replay_with_new_inputs() {
    let e = sim(SimConfig::new(3, 13000));
    let devices = e.driver.devices();
    let comm = cuda_multimem_tests::team_on(
        &devices,
        CommConfig {
            ll_max_bytes: 1024,
            gather_ll_max_bytes: 1024,
            broadcast_ll_max_bytes: 1024,
            one_shot_max_bytes: Some(4096),
            stage_bytes: Some(4096),
            max_blocks: 2,
            ..Default::default()
        },
        MulticastPolicy::Never,
    )
    .0;
    let s = streams(&comm);
    let count = 700;
    // (call, count, in place, what it must run: None where any form will do); the low-latency
    // ones: 3 x 80 f32 scattered, 3 x 64 gathered, 200 broadcast (at most 1 KiB)
    let cases = [
        (Call::reduce_scatter(ReduceOp::Max), count, false, None),
        (
            Call::all_gather(),
            count,
            false,
            Some(Algorithm::PushDirect),
        ),
        (Call::all_gather(), 100, true, Some(Algorithm::PushStaged)),
        (Call::broadcast(2), count, true, None),
        (
            Call::reduce_scatter(ReduceOp::Sum),
            80,
            false,
            Some(Algorithm::PushLl),
        ),
        (Call::all_gather(), 64, true, Some(Algorithm::PushLl)),
        (Call::broadcast(1), 200, true, Some(Algorithm::PushLl)),
    ];
    let mut queued: Vec<Queued<f32>> = cases
        .iter()
        .map(|&(call, count, in_place, _)| {
            Queued::new(&comm, call.at(), count, call.params, Mem::SYM, in_place)
        })
        .collect();
    let mut refs: Vec<&mut dyn Pending> =
        queued.iter_mut().map(|q| q as &mut dyn Pending).collect();
    let chose = table::capture_and_replay(
        &comm,
        &s,
        &mut refs,
        CaptureMode::Relaxed,
        3,
        &mut Rng::new(77),
    );
    for (i, (call, _, _, want)) in cases.iter().enumerate() {
        if let Some(want) = want {
            for c in &chose[i] {
                assert_eq!(c.algorithm, *want, "{call:?}: {c}");
            }
        }
    }
}

/// A simulated team of `n` with or without the low-latency forms (then with a short timeout).
fn small_team(n: usize, ll: bool) -> (Env, Communicator, Vec<Stream>) {
    cuda_multimem_tests::sim_team(
        n,
        CommConfig {
            gather_ll_max_bytes: if ll { 64 << 10 } else { 0 },
            broadcast_ll_max_bytes: if ll { 64 << 10 } else { 0 },
            // a disagreement is reported when the ranks meet (the staged kernel's barrier, the
            // low-latency polls' flags): no timeout is expected to fire
            ..Default::default()
        },
    )
}

/// The timeout of the teams whose tests expect it to fire.
const SHORT: Duration = Duration::from_millis(300);

/// Rank 0 and rank 1 call different things; `check()` must say the ranks disagree: the staged
/// kernel compares call headers at its barrier; the low-latency forms (flags in the data, no
/// header exchange) see the peer's flags of the same call counter and another shape. Neither
/// waits for the timeout (the suite's generous one: a test that ends reported it first).
fn expect_disagreement(
    what: &str,
    ll: bool,
    a: impl Fn(&Communicator, &Stream, &mut SymmetricBuffer<f32>),
    b: impl Fn(&Communicator, &Stream, &mut SymmetricBuffer<f32>),
) {
    let (_e, comm, s) = small_team(2, ll);
    let mut buf = comm.alloc::<f32>(30_000).unwrap();
    a(&comm, &s[0], &mut buf);
    b(&comm, &s[1], &mut buf);
    sync(&s);
    match (ll, comm.check()) {
        (_, Err(Error::RanksDisagree { .. })) => {}
        (_, other) => panic!("{what} (low-latency: {ll}): got {other:?}"),
    }
}

fn rank_of(c: &Communicator, s: &Stream) -> usize {
    c.local_ranks()
        .into_iter()
        .find(|&r| c.device(r).unwrap() == s.device())
        .unwrap()
}

#[test]
fn ranks_that_disagree_on_size_collective_or_root_are_reported_by_check() {
    disagreements(false);
}

/// The same disagreements on the low-latency forms: the flags fold the call header (size,
/// collective, root, operator) beside the call counter, so nobody takes a disagreeing peer's
/// words, and a flag of this call's counter with another header is the disagreement, reported
/// at once (before the fix every one of these waited for the timeout).
#[test]
fn ranks_that_disagree_on_a_low_latency_call_are_reported_not_waited_for() {
    disagreements(true);
    // a low-latency all-gather against a low-latency allreduce of the same bytes
    expect_disagreement(
        "all-gather / low-latency allreduce",
        true,
        |c, s, b| {
            c.rank(rank_of(c, s))
                .unwrap()
                .all_gather_in_place(b.slice_mut(..256).unwrap(), s)
                .unwrap();
        },
        |c, s, b| {
            let ch = c
                .rank(rank_of(c, s))
                .unwrap()
                .all_reduce_in_place(b.slice_mut(..256).unwrap(), ReduceOp::Sum, s)
                .unwrap();
            assert_eq!(ch.algorithm, Algorithm::OneShotLl);
        },
    );
}

fn disagreements(ll: bool) {
    let ag = |count: usize| {
        move |c: &Communicator, s: &Stream, b: &mut SymmetricBuffer<f32>| {
            c.rank(rank_of(c, s))
                .unwrap()
                .all_gather_in_place(b.slice_mut(..2 * count).unwrap(), s)
                .unwrap();
        }
    };
    expect_disagreement("all-gather sizes 64 / 128", ll, ag(64), ag(128));
    expect_disagreement(
        "reduce-scatter / all-gather",
        ll,
        |c, s, b| {
            c.rank(rank_of(c, s))
                .unwrap()
                .reduce_scatter_in_place(b.slice_mut(..256).unwrap(), ReduceOp::Sum, s)
                .unwrap();
        },
        ag(128),
    );
    expect_disagreement(
        "broadcast roots 0 / 1",
        ll,
        |c, s, b| {
            c.rank(rank_of(c, s))
                .unwrap()
                .broadcast_in_place(b.slice_mut(..256).unwrap(), 0, s)
                .unwrap();
        },
        |c, s, b| {
            c.rank(rank_of(c, s))
                .unwrap()
                .broadcast_in_place(b.slice_mut(..256).unwrap(), 1, s)
                .unwrap();
        },
    );
    expect_disagreement(
        "reduce-scatter sum / max",
        ll,
        |c, s, b| {
            c.rank(rank_of(c, s))
                .unwrap()
                .reduce_scatter_in_place(b.slice_mut(..256).unwrap(), ReduceOp::Sum, s)
                .unwrap();
        },
        |c, s, b| {
            c.rank(rank_of(c, s))
                .unwrap()
                .reduce_scatter_in_place(b.slice_mut(..256).unwrap(), ReduceOp::Max, s)
                .unwrap();
        },
    );
    // an allreduce above the low-latency limit (the low-latency protocol has no barrier and no
    // header: a peer that calls something else only makes it time out)
    expect_disagreement("all-gather / allreduce", ll, ag(128), |c, s, b| {
        c.rank(rank_of(c, s))
            .unwrap()
            .all_reduce_in_place(b.slice_mut(..30_000).unwrap(), ReduceOp::Sum, s)
            .unwrap();
    });
}

/// Dropping the buffers and the communicator while their calls are still queued (an error path
/// that returns before synchronising) must not unmap memory under the running kernels and
/// copies: the streams finish without an error and a new team on the same devices computes
/// correctly (on a GPU a kernel touching unmapped memory poisons the context for good).
#[test]
fn dropping_buffers_and_the_team_with_calls_in_flight_leaves_the_devices_healthy() {
    let e = env();
    let big = if e.driver.is_simulated() {
        1 << 14
    } else {
        8 << 20
    };
    {
        let Some(comm) = team(&e, CommConfig::default()) else {
            return;
        };
        let s = streams(&comm);
        let mut seed = Rng::new(77);
        let mut pending = Vec::new();
        for kind in [
            Call::all_gather(),
            Call::reduce_scatter(ReduceOp::Sum),
            Call::broadcast(1),
            Call::all_reduce(ReduceOp::Sum),
        ] {
            for mem in [Mem::SYM, Mem::OWN] {
                pending.push(queue::<bf16>(&comm, &s, kind, big, mem, false, &mut seed));
            }
        }
        drop(pending);
        drop(comm);
        for st in &s {
            st.synchronize()
                .expect("the queued calls ran to the end on mapped memory");
        }
    }
    let Some(comm) = team(&e, CommConfig::default()) else {
        return;
    };
    let s = streams(&comm);
    let mut seed = Rng::new(78);
    once::<f32>(
        &comm,
        &s,
        Call::all_gather(),
        4096,
        Mem::SYM,
        false,
        &mut seed,
    );
    once::<bf16>(
        &comm,
        &s,
        Call::reduce_scatter(ReduceOp::Sum),
        1 << 20,
        Mem::SYM,
        false,
        &mut seed,
    );
}

#[test]
fn a_peer_that_never_calls_is_reported_as_a_timeout() {
    let ll = |on: bool| CommConfig {
        gather_ll_max_bytes: if on { 64 << 10 } else { 0 },
        broadcast_ll_max_bytes: if on { 64 << 10 } else { 0 },
        ..Default::default()
    };
    let mut cases = Vec::new();
    for kind in [
        Call::reduce_scatter(ReduceOp::Sum),
        Call::all_gather(),
        Call::broadcast(0),
        Call::broadcast(2),
    ] {
        cases.push((kind, ll(true), Algorithm::PushLl));
        cases.push((kind, ll(false), Algorithm::PushStaged));
    }
    // the copy-engine forms: their barrier launches time out (the missing rank as a
    // broadcast's root, too)
    for kind in [Call::all_gather(), Call::broadcast(0), Call::broadcast(2)] {
        cases.push((kind, ce_config(), Algorithm::CopyEngine));
    }
    for (kind, config, want) in cases {
        let (_e, comm, s) = cuda_multimem_tests::sim_team(
            3,
            CommConfig {
                timeout: SHORT,
                first_call_timeout: Some(SHORT),
                ..config
            },
        );
        let mut q = Queued::<f32>::new(&comm, kind.at(), 100, kind.params, Mem::SYM, false);
        q.fill(&mut Rng::new(7));
        // ranks 0 and 1 call; rank 2 never does (as the root of a broadcast, too)
        for (r, st) in s.iter().enumerate().take(2) {
            let c = q.call(&comm, r, st).unwrap();
            assert_eq!(c.algorithm, want, "{kind:?}");
        }
        sync(&s);
        match comm.check() {
            Err(Error::Timeout { after, .. }) => {
                assert_eq!(after, SHORT, "{kind:?}")
            }
            other => panic!("{kind:?} ({want}): expected a timeout, got {other:?}"),
        }
    }
}

fn arg_of(r: cuda_multimem::Result<Choice>) -> &'static str {
    match r {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn bad_lengths_roots_and_overlaps_are_refused_before_any_launch() {
    let (_e, comm, s) = cuda_multimem_tests::sim_team(2, CommConfig::default());
    let h = comm.rank(0).unwrap();
    let st = &s[0];
    let a = comm.alloc::<f32>(1000).unwrap();
    let mut b = comm.alloc::<f32>(1000).unwrap();
    // reduce-scatter: the input holds N chunks of the output's length
    assert_eq!(
        arg_of(h.reduce_scatter(
            a.slice(..300).unwrap(),
            b.slice_mut(..100).unwrap(),
            ReduceOp::Sum,
            st
        )),
        "input"
    );
    // all-gather: the output holds N chunks of the input's length
    assert_eq!(
        arg_of(h.all_gather(a.slice(..100).unwrap(), b.slice_mut(..300).unwrap(), st)),
        "output"
    );
    // broadcast: equal lengths, a root of the team
    assert_eq!(
        arg_of(h.broadcast(a.slice(..100).unwrap(), b.slice_mut(..99).unwrap(), 0, st)),
        "output"
    );
    assert_eq!(
        arg_of(h.broadcast(a.slice(..100).unwrap(), b.slice_mut(..100).unwrap(), 2, st)),
        "root"
    );
    assert_eq!(arg_of(h.broadcast_in_place(&mut b, 9, st)), "root");
    // in place: a whole number of chunks
    assert_eq!(
        arg_of(h.all_gather_in_place(b.slice_mut(..101).unwrap(), st)),
        "buf"
    );
    assert_eq!(
        arg_of(h.reduce_scatter_in_place(b.slice_mut(..101).unwrap(), ReduceOp::Min, st)),
        "buf"
    );
    // overlaps other than the in-place forms: the caller's own memory, shifted by one element
    let d = comm.device(0).unwrap();
    let mut own = DeviceBuffer::<f32>::zeroed(d, 1000).unwrap();
    let p = own.device_ptr();
    // SAFETY: ranges inside `own`; refused before any launch.
    let (i, o) = unsafe {
        (
            Src::<f32>::from_raw(p, 100),
            Dst::<f32>::from_raw(p + 4, 200),
        )
    };
    assert_eq!(arg_of(h.all_gather(i, o, st)), "output");
    let (i, o) = unsafe {
        (
            Src::<f32>::from_raw(p, 200),
            Dst::<f32>::from_raw(p + 4, 100),
        )
    };
    assert_eq!(arg_of(h.reduce_scatter(i, o, ReduceOp::Sum, st)), "output");
    // lengths whose byte size overflows
    let (i, o) = unsafe {
        (
            Src::<f32>::from_raw(p, usize::MAX / 2),
            Dst::<f32>::from_raw(p, 100),
        )
    };
    assert_eq!(arg_of(h.broadcast(i, o, 0, st)), "input");
    let (i, o) = unsafe {
        (
            Src::<f32>::from_raw(p, usize::MAX / 8),
            Dst::<f32>::from_raw(p, usize::MAX / 8 + 1),
        )
    };
    assert_eq!(arg_of(h.all_gather(i, o, st)), "output");
    let _ = &mut own;
    // nothing was launched: a correct call on both ranks still works
    let mut seed = Rng::new(5);
    once::<f32>(
        &comm,
        &s,
        Call::all_gather(),
        10,
        Mem::SYM,
        false,
        &mut seed,
    );
}
