//! The multimem allreduce: barriers after a timeout, the order of sums, every dtype and op on
//! teams of 2 to 5, messages in chunks, disagreement, dead ranks, and the multicast policy.

use super::*;

/// A team of 3 with the multimem path forced where rank 2 never calls. Rank 0 queues two calls
/// and runs them to the end (timed out) before rank 1, slower, queues its two. The arrival words
/// are additive: if rank 0 kept arriving after its first barrier failed, its arrivals plus rank
/// 1's own would complete rank 1's barriers without rank 2, and rank 1 would reduce without it
/// and report nothing. Every calling rank must time out instead.
#[test]
fn a_rank_whose_multimem_barrier_timed_out_completes_no_later_barrier_of_its_peers() {
    for algorithm in [Algorithm::OneShot, Algorithm::TwoShot] {
        let Some(e) = mm_machine(
            "a_rank_whose_multimem_barrier_timed_out_completes_no_later_barrier_of_its_peers",
            3,
        ) else {
            return;
        };
        let devices = e.driver.devices();
        let comm = cuda_multimem_tests::team_on(
            &devices,
            CommConfig {
                algorithm: Some(algorithm),
                max_blocks: 2,
                threads: 64,
                timeout: Duration::from_millis(200),
                first_call_timeout: Some(Duration::from_millis(200)),
                ..Default::default()
            },
            MulticastPolicy::Always,
        )
        .0;
        let s: Vec<Stream> = devices.iter().map(|d| Stream::new(d).unwrap()).collect();
        let count = 4096;
        let mut buf = comm.alloc::<f32>(count).unwrap();
        for r in 0..3 {
            buf.write(r, 0, &vec![1f32; count]).unwrap();
        }
        let (h0, h1) = (comm.rank(0).unwrap(), comm.rank(1).unwrap());
        for _ in 0..2 {
            let c = h0
                .all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[0])
                .unwrap();
            assert_eq!(c.path, Path::Multimem);
        }
        s[0].synchronize().unwrap();
        // Rank 1 calls only now, after rank 0's two calls timed out (nobody has looked yet, so
        // the team still takes calls): its barrier must not be completed by rank 0's arrivals.
        h1.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1])
            .unwrap();
        s[1].synchronize().unwrap();
        match h1.check() {
            Err(Error::Timeout { after, .. }) => {
                assert_eq!(after, Duration::from_millis(200), "{algorithm}")
            }
            other => panic!("{algorithm}: rank 1's call completed without rank 2 ({other:?})"),
        }
        match h0.check() {
            Err(Error::Timeout { .. }) => {}
            other => panic!("{algorithm}: rank 0: expected a timeout, got {other:?}"),
        }
        assert!(matches!(
            h1.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1]),
            Err(Error::Unusable { .. })
        ));
    }
}

/// What the multimem path guarantees for sums, on a simulated team of 3 whose switch reduces
/// in an order of its own: two-shot results are bit-identical on every rank (each part is
/// reduced once and multicast-stored) and one-shot results are close to the rank-order
/// reference, but neither is the rank-order sum bit for bit.
#[test]
fn multimem_sums_are_not_in_rank_order_and_two_shot_is_the_same_on_every_rank() {
    let Some(e) = mm_machine(
        "multimem_sums_are_not_in_rank_order_and_two_shot_is_the_same_on_every_rank",
        3,
    ) else {
        return;
    };
    let devices = e.driver.devices();
    let count = 20_000;
    // magnitudes over several binades, so that the order of the additions shows in the bits
    let mut rng = cuda_multimem_tests::Rng::new(7);
    let inputs: Vec<Vec<f32>> = (0..3)
        .map(|_| {
            (0..count)
                .map(|_| {
                    let scale = (1u32 << (rng.next_u64() % 12)) as f32;
                    rng.f32() * scale
                })
                .collect()
        })
        .collect();
    let refs: Vec<&[f32]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference(ReduceOp::Sum, &refs);
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    for algorithm in [Algorithm::OneShot, Algorithm::TwoShot] {
        let comm = cuda_multimem_tests::team_on(
            &devices,
            CommConfig {
                algorithm: Some(algorithm),
                ..Default::default()
            },
            MulticastPolicy::Always,
        )
        .0;
        let s: Vec<Stream> = devices.iter().map(|d| Stream::new(d).unwrap()).collect();
        let mut buf = comm.alloc::<f32>(count).unwrap();
        for (r, x) in inputs.iter().enumerate() {
            buf.write(r, 0, x).unwrap();
        }
        for (r, st) in s.iter().enumerate() {
            let c = comm
                .rank(r)
                .unwrap()
                .all_reduce_in_place(&mut buf, ReduceOp::Sum, st)
                .unwrap();
            assert_eq!(c.path, Path::Multimem);
        }
        for st in &s {
            st.synchronize().unwrap();
        }
        comm.check().unwrap();
        let got: Vec<Vec<f32>> = (0..3).map(|r| buf.to_vec(r).unwrap()).collect();
        for (r, g) in got.iter().enumerate() {
            if let Some(m) = cuda_multimem_tests::first_beyond_sum_tolerance(
                cuda_multimem_collectives::DType::F32,
                3,
                &bytes(g),
                &bytes(&want),
            ) {
                panic!("{algorithm}: rank {r}: {m}");
            }
            assert_ne!(
                g, &want,
                "{algorithm}: rank {r} summed in rank order, bit for bit"
            );
        }
        if algorithm == Algorithm::TwoShot {
            assert!(
                got.iter().all(|g| g == &got[0]),
                "two-shot: every rank gets the same bits"
            );
        }
    }
}

// ---- the multicast policy and the multimem path (simulator only) ----

/// A communicator over every device of a simulated machine of `n` with `policy` and a small
/// multimem region.
fn mm_team(e: &Env, policy: MulticastPolicy, config: CommConfig) -> Communicator {
    cuda_multimem_tests::team_on(
        &e.driver.devices(),
        CommConfig {
            multimem_capacity: 2 << 20,
            scratch_bytes: 1 << 20,
            ..config
        },
        policy,
    )
    .0
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
            // f32 min and max, and product and average of every type, have no multimem form:
            // the peer-to-peer path serves them
            let want_path = if !cuda_multimem_collectives::multimem_supports(T::DTYPE, op) {
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
    let Some(e) = mm_machine(&format!("multimem_round (a team of {n})"), n) else {
        return;
    };
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
    let Some(e) = mm_machine("multimem_messages_larger_than_the_region_run_in_chunks", 4) else {
        return;
    };
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
        let Some(e) = mm_machine("multimem_ranks_that_disagree_are_reported_not_reduced", 3) else {
            return;
        };
        let comm = mm_team(
            &e,
            MulticastPolicy::Always,
            CommConfig {
                max_blocks: 2,
                threads: 64,
                // a disagreement is reported when the ranks meet: no timeout is expected
                timeout: cuda_multimem_tests::TEAM_TIMEOUT,
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
    let Some(e) = mm_machine(
        "multimem_with_a_dead_rank_times_out_on_every_calling_rank",
        3,
    ) else {
        return;
    };
    let comm = mm_team(
        &e,
        MulticastPolicy::Always,
        CommConfig {
            timeout: Duration::from_millis(300),
            first_call_timeout: Some(Duration::from_millis(300)),
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
    // the next call reports it, without check: the multimem kernels mirrored the error word
    match comm
        .rank(1)
        .unwrap()
        .all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1])
        .unwrap_err()
    {
        Error::Timeout { what, after } => {
            assert!(what.contains("multimem"), "{what}");
            assert_eq!(after, Duration::from_millis(300));
        }
        e => panic!("expected a timeout, got {e}"),
    }
    match comm.check().unwrap_err() {
        Error::Unusable { cause } => assert!(cause.contains("multimem"), "{cause}"),
        e => panic!("expected Unusable naming the timeout, got {e}"),
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
    let e = sim(SimConfig::new(
        8,
        cuda_multimem_tests::sim_version().max(13030),
    ));
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

/// Below CUDA 12.1 there is no multicast: a team that must have the multimem path is refused
/// naming the missing entry point and the versions, and the default policy builds a
/// peer-to-peer team that says why it has no multimem path (the multimem tests skip there).
#[test]
/// The kernels' PTX needs CUDA 12.1 (ISA 8.1) for the peer-to-peer families and 12.2 (ISA 8.2)
/// for the multimem ones: below 12.1 every communicator is refused naming the device, what it
/// has and what the kernels need; at 12.1 a multimem team is refused the same way, and the
/// default policy builds without it and says why.
fn before_cuda_12_1_a_multimem_team_is_refused_and_the_default_policy_says_why() {
    let e = sim(SimConfig::new(4, 12000));
    for policy in [MulticastPolicy::Always, MulticastPolicy::WhenItPaysOff] {
        match Communicator::builder(&e.driver.devices())
            .multicast(policy)
            .build()
        {
            Err(Error::HardwareTooOld { device, needs, .. }) => {
                assert_eq!(device, 0);
                assert!(needs.contains("CUDA 12.1"), "{needs}");
            }
            other => panic!("expected HardwareTooOld, got {:?}", other.map(|_| ())),
        }
    }
    drop(e);
    let e = sim(SimConfig::new(4, 12010));
    match Communicator::builder(&e.driver.devices())
        .multicast(MulticastPolicy::Always)
        .build()
    {
        Err(Error::HardwareTooOld { needs, what, .. }) => {
            assert!(what.contains("multimem"), "{what}");
            assert!(needs.contains("CUDA 12.2"), "{needs}");
        }
        other => panic!("expected HardwareTooOld, got {:?}", other.map(|_| ())),
    }
    let comm = Communicator::new(&e.driver.devices()).unwrap();
    assert!(!comm.multimem_active());
    let why = comm.multimem_unavailable_reason().unwrap();
    assert!(why.contains("12.2"), "{why}");
    let c = comm
        .choice(DType::Bf16, ReduceOp::Sum, 1 << 24, Operands::Symmetric)
        .unwrap();
    assert_eq!(c.path, Path::PeerToPeer);
}

#[test]
fn the_never_policy_never_picks_multimem() {
    let e = sim(SimConfig::new(8, cuda_multimem_tests::sim_version()));
    if let Some(why) = cuda_multimem_tests::collectives_unsupported(&e.driver) {
        return cuda_multimem_tests::skip("the_never_policy_never_picks_multimem", why);
    }
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
    let e = sim(SimConfig::new(2, cuda_multimem_tests::sim_version()));
    if let Some(why) = cuda_multimem_tests::collectives_unsupported(&e.driver) {
        return cuda_multimem_tests::skip(
            "on_a_2_device_machine_when_it_pays_off_does_not_pick_multimem_and_says_why",
            why,
        );
    }
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
    let e = sim(SimConfig::new(4, cuda_multimem_tests::sim_version()));
    if let Some(why) = cuda_multimem_tests::collectives_unsupported(&e.driver) {
        return cuda_multimem_tests::skip(
            "always_fails_to_build_with_disabled_where_the_guard_refuses_multicast",
            why,
        );
    }
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
