//! The protocol: back-to-back calls with random per-device delays; ranks that disagree or never
//! arrive are reported, not waited for; one stream per rank at a time.

use super::*;

// ---- back-to-back calls with random delays ----

/// Back-to-back calls on a simulated team of `n` with random per-device delays, through the
/// run-time dtype entry on byte views: every call reads its own input region and writes its own
/// output region, all are checked at the end.
fn back_to_back(n: usize, calls: usize, seed: u64) {
    let e = ar_sim(n);
    let sim = e.sim.as_ref().unwrap();
    sim.set_kernel_delays(Duration::from_micros(300), seed);
    let comm = cuda_multimem_tests::team_on(
        &e.driver.devices(),
        CommConfig {
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
        },
        MulticastPolicy::Never,
    )
    .0;
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

// ---- disagreements and peers that never arrive ----

fn short_timeout_config() -> CommConfig {
    CommConfig {
        timeout: Duration::from_millis(300),
        first_call_timeout: Some(Duration::from_millis(300)),
        ..Default::default()
    }
}

/// A simulated team of `n` whose tests expect a timeout to fire: a short one.
fn short_timeout_team(n: usize) -> (Env, Communicator) {
    team_of(n, short_timeout_config())
}

/// A simulated team of `n` whose tests expect no timeout (a disagreement is reported when the
/// ranks meet): the suite's generous one.
fn generous_team(n: usize) -> (Env, Communicator) {
    team_of(n, CommConfig::default())
}

fn team_of(n: usize, config: CommConfig) -> (Env, Communicator) {
    let e = ar_sim(n);
    let (comm, _) =
        cuda_multimem_tests::team_on(&e.driver.devices(), config, MulticastPolicy::Never);
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
    let (_e, comm) = generous_team(2);
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
    let (_e, comm) = generous_team(2);
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
fn small_low_latency_calls_that_disagree_are_reported_not_waited_for() {
    // the low-latency protocol puts the call counter and header into its flags: no data is
    // taken from a rank that called something else, and a flag of this call's counter with
    // another header is reported as the disagreement at once (the generous timeout never fires)
    let (_e, comm) = generous_team(2);
    let s = streams(&comm);
    let mut buf = comm.alloc::<u8>(1 << 16).unwrap();
    for (mine, theirs) in [
        ((DType::F16, 200), (DType::Bf16, 200)),
        ((DType::F32, 200), (DType::F32, 400)),
        ((DType::F32, 4000), (DType::F32, 200)),
    ] {
        let (a, err) = disagree(&comm, &s, &mut buf, mine, theirs);
        assert_eq!(a, Algorithm::OneShotLl);
        assert!(
            matches!(err, Error::RanksDisagree { .. }),
            "{mine:?} / {theirs:?}: {err}"
        );
        comm.recover().unwrap();
    }
}

/// Ranks whose sizes put them in different forms — one in the low-latency kernel (no barrier),
/// the other in a barrier kernel — are a disagreement too: the low-latency polls look, past a
/// short wait, for a peer waiting at this call's first barrier, and tell every rank.
#[test]
fn ranks_whose_sizes_choose_different_forms_are_reported_not_waited_for() {
    let (_e, comm) = generous_team(2);
    let s = streams(&comm);
    let mut buf = comm.alloc::<u8>(1 << 20).unwrap();
    for (mine, theirs) in [
        ((DType::F32, 256), (DType::F32, 1 << 20)),
        ((DType::F32, 1 << 20), (DType::F32, 256)),
        ((DType::Bf16, 512), (DType::Bf16, 48 << 10)),
    ] {
        let (_, err) = disagree(&comm, &s, &mut buf, mine, theirs);
        assert!(
            matches!(err, Error::RanksDisagree { .. }),
            "{mine:?} / {theirs:?}: {err}"
        );
        comm.recover().unwrap();
    }
}

#[test]
fn ranks_that_disagree_on_the_dtype_are_reported() {
    let (_e, comm) = generous_team(2);
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
    let comm = cuda_multimem_tests::team_on(
        &e.driver.devices(),
        CommConfig {
            one_shot_max_bytes: Some(16 << 10),
            // a disagreement is reported when the ranks meet: no timeout is expected to fire
            timeout: cuda_multimem_tests::TEAM_TIMEOUT,
            ..Default::default()
        },
        MulticastPolicy::Never,
    )
    .0;
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
fn a_call_on_a_second_stream_waits_for_the_first_on_the_gpu() {
    let (e, comm) = generous_team(2);
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
    let n = 2usize;
    let input: Vec<Vec<f32>> = (0..n)
        .map(|r| (0..64).map(|i| (i + r) as f32).collect())
        .collect();
    for (r, x) in input.iter().enumerate() {
        buf.write(r, 0, x).unwrap();
    }
    // rank 0 queues on s[0]; its kernel waits for rank 1, which has not been called yet; its
    // next call, on another stream, is taken and ordered after it on the GPU
    call(0, &mut buf, &s[0]).unwrap();
    call(0, &mut buf, &extra).unwrap();
    call(1, &mut buf, &s[1]).unwrap();
    call(1, &mut buf, &s[1]).unwrap();
    extra.synchronize().unwrap();
    sync(&s);
    comm.check().unwrap();
    // two sums in a row: every element is N times the first sum
    let once: Vec<f32> = (0..64).map(|i| input.iter().map(|x| x[i]).sum()).collect();
    let twice: Vec<f32> = once.iter().map(|v| v * n as f32).collect();
    for r in 0..n {
        assert_eq!(buf.to_vec(r).unwrap()[..64], twice[..], "rank {r}");
    }
}
