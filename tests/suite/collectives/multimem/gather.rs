//! Reduce-scatter, all-gather and broadcast on the multimem path: every dtype, op and operand
//! kind, windows, back to back, graphs, disagreement, absence, the policy, bad arguments.

use super::*;

#[test]
fn multimem_collectives_equal_the_host_reference_for_every_dtype_op_and_operand_kind() {
    let test = "multimem_collectives_equal_the_host_reference_for_every_dtype_op_and_operand_kind";
    if skipped_on_real_driver(test) {
        return;
    }
    mm_sweep(4, &[3, 1001, 4096], 31);
}

#[test]
fn multimem_collectives_equal_the_host_reference_on_teams_of_2_and_8() {
    if skipped_on_real_driver("multimem_collectives_equal_the_host_reference_on_teams_of_2_and_8") {
        return;
    }
    mm_sweep(2, &[13, 2000], 32);
    mm_sweep(8, &[7, 520], 33);
}

/// Windows of one rank's chunk that a multimem gather moves per launch: the regions hold N
/// slots of it (reduce-scatter, all-gather) or one (broadcast), 16-byte multiples.
fn windows(kind: Call, n: usize, region: usize, chunk_bytes: usize) -> u32 {
    let slots = if kind.name == "broadcast" { 1 } else { n };
    chunk_bytes.div_ceil((region / slots) & !15) as u32
}

/// Messages larger than the regions go through them in windows (several launches, the copies
/// in and out of every window on the caller's stream), for every operand kind, in place too.
/// Regions are at least 2 MiB (`CommConfig::multimem_capacity`): on a team of 2 a window of
/// reduce-scatter or all-gather is 1 MiB of one rank's chunk, of broadcast 2 MiB.
#[test]
fn multimem_collectives_larger_than_the_regions_run_in_windows() {
    let test = "multimem_collectives_larger_than_the_regions_run_in_windows";
    let n = 2;
    let Some(e) = mm_sim(test, n) else { return };
    let region = 2 << 20;
    let comm = mm_comm(
        &e,
        CommConfig {
            multimem_capacity: region,
            ..Default::default()
        },
    );
    let s = mm_streams(&comm);
    let mut seed = Rng::new(41);
    // counts per chunk a little above one window, with a scalar tail in the last one
    let (w_f32, w_bf16) = (300_001usize, 600_001usize);
    let cases = [
        (Call::reduce_scatter(ReduceOp::Sum), false),
        (Call::reduce_scatter(ReduceOp::Max), true),
        (Call::all_gather(), false),
        (Call::all_gather(), true),
        (Call::broadcast(1), false),
        (Call::broadcast(0), true),
    ];
    let mems = [
        (Mem::SYM, false),
        (Mem::SYM, true),
        (Mem::SYM_ODD, false),
        (Mem::OWN, false),
        (Mem::OWN, true),
    ];
    for (kind, half) in cases {
        let scale = if kind.name == "broadcast" { 2 } else { 1 };
        for (mem, in_place) in mems {
            let (c, bytes) = if half {
                let count = scale * w_bf16;
                let c = mm_once::<bf16>(&comm, &s, kind, count, mem, in_place, &mut seed);
                (c, count * 2)
            } else {
                let count = scale * w_f32;
                let c = mm_once::<f32>(&comm, &s, kind, count, mem, in_place, &mut seed);
                (c, count * 4)
            };
            let want = windows(kind, n, region, bytes);
            assert_eq!(want, 2, "{kind:?}: the case must need two windows");
            assert_eq!(c.staged_chunks, want, "{kind:?} of {bytes} bytes: {c}");
        }
    }
}

/// Calls of every collective queued back to back (no synchronisation between them), random
/// kinds, types, sizes and roots, the multimem gathers interleaved with multimem allreduces
/// and peer-to-peer calls (f32 min and max have no multimem form), random per-device delays,
/// on teams of 2, 3, 5 and 8.
#[test]
fn back_to_back_multimem_collectives_interleaved_with_allreduce_on_teams_of_2_to_8() {
    let test = "back_to_back_multimem_collectives_interleaved_with_allreduce_on_teams_of_2_to_8";
    for (n, seed) in [(2usize, 51u64), (3, 52), (5, 53), (8, 54)] {
        let Some(e) = mm_sim(test, n) else { return };
        e.sim
            .as_ref()
            .unwrap()
            .set_kernel_delays(Duration::from_micros(300), seed);
        let comm = mm_comm(
            &e,
            CommConfig {
                max_blocks: 3,
                threads: 64,
                ..Default::default()
            },
        );
        let s = mm_streams(&comm);
        let mut rng = cuda_multimem_tests::Rng::new(seed);
        let mut seed = Rng::new(seed);
        let mut pending: Vec<Box<dyn Fn()>> = Vec::new();
        let mut paths = Vec::new();
        for _ in 0..12 {
            let op = ReduceOp::ALL[(rng.next_u64() % 3) as usize];
            let kind = match rng.next_u64() % 4 {
                0 => Call::reduce_scatter(op),
                1 => Call::all_gather(),
                2 => Call::broadcast((rng.next_u64() % n as u64) as usize),
                _ => Call::all_reduce(op),
            };
            let count = 1 + (rng.next_u64() % 3000) as usize;
            let mem = [Mem::SYM, Mem::SYM_ODD, Mem::OWN][(rng.next_u64() % 3) as usize];
            let in_place = rng.next_u64().is_multiple_of(2);
            macro_rules! q {
                ($t:ty) => {{
                    let p = mm_queue::<$t>(&comm, &s, kind, count, mem, in_place, &mut seed);
                    assert_path(&p, want_path(kind, <$t as Element>::DTYPE));
                    paths.push(p.choices[0].path);
                    pending.push(Box::new(move || p.check()));
                }};
            }
            match rng.next_u64() % 3 {
                0 => q!(f32),
                1 => q!(f16),
                _ => q!(bf16),
            }
        }
        mm_sync(&s);
        comm.check().unwrap();
        for p in &pending {
            p();
        }
        assert!(
            paths.contains(&Path::Multimem),
            "team of {n}: no call took the multimem path"
        );
    }
}

/// A captured sequence of multimem collectives (two windows each through the 2 MiB regions, in
/// place, the caller's own memory, a sum) replays correctly with new inputs each time: nothing is reset
/// from the host.
#[test]
fn captured_multimem_collectives_replay_with_new_inputs() {
    let test = "captured_multimem_collectives_replay_with_new_inputs";
    let n = 4;
    let Some(e) = mm_sim(test, n) else { return };
    let comm = mm_comm(
        &e,
        CommConfig {
            multimem_capacity: 2 << 20,
            ..Default::default()
        },
    );
    let s = mm_streams(&comm);
    // windows of 512 KiB (reduce-scatter, all-gather) and 2 MiB (broadcast): two each
    let (rs_count, ag_count, bc_count, sum_count) =
        (300_000usize, 150_000usize, 600_000usize, 700usize);
    let mut rs = Queued::<f16>::new(
        &comm,
        Call::reduce_scatter(ReduceOp::Max).at(),
        rs_count,
        Params::op(ReduceOp::Max),
        Mem::SYM,
        false,
    );
    let mut ag = Queued::<f32>::new(
        &comm,
        Call::all_gather().at(),
        ag_count,
        Params::sum(),
        Mem::SYM,
        true,
    );
    let mut bc = Queued::<f32>::new(
        &comm,
        Call::broadcast(3).at(),
        bc_count,
        Params::root(3),
        Mem::OWN,
        false,
    );
    let mut sum = Queued::<f32>::new(
        &comm,
        Call::reduce_scatter(ReduceOp::Sum).at(),
        sum_count,
        Params::sum(),
        Mem::SYM,
        true,
    );
    // the sum reduces in the switch's order: within its rounding (the other chunks of the
    // in-place buffer keep this rank's input, bit for bit)
    sum.switch_order = true;
    let chose = table::capture_and_replay(
        &comm,
        &s,
        &mut [&mut rs, &mut ag, &mut bc, &mut sum],
        CaptureMode::Relaxed,
        3,
        &mut Rng::new(61),
    );
    for r in 0..n {
        let cs: Vec<Choice> = chose.iter().map(|c| c[r]).collect();
        for c in &cs {
            assert_eq!(c.path, Path::Multimem, "{c}");
        }
        assert_eq!(
            cs.iter().map(|c| c.staged_chunks).collect::<Vec<_>>(),
            [2, 2, 2, 1],
            "windows per call"
        );
    }
}

/// One call of a disagreement case.
#[derive(Debug, Clone, Copy)]
enum Disagree {
    Rs(ReduceOp, usize),
    Ag(usize),
    Bc(usize, usize),
    /// An allreduce of this many elements.
    Ar(usize),
}

/// Ranks of a multimem team that disagree (the same one-block grid, so the barriers alone
/// would pass and the kernels would mix different calls) are reported as a disagreement, not
/// as results: another collective, root, operator or size, or an allreduce of the same bytes.
#[test]
fn multimem_collectives_whose_ranks_disagree_are_reported() {
    let test = "multimem_collectives_whose_ranks_disagree_are_reported";
    let n = 3;
    let cases = [
        (Disagree::Ag(1000), Disagree::Bc(1000, 0)),
        (Disagree::Bc(1000, 0), Disagree::Bc(1000, 1)),
        (
            Disagree::Rs(ReduceOp::Sum, 1000),
            Disagree::Rs(ReduceOp::Max, 1000),
        ),
        (
            Disagree::Rs(ReduceOp::Sum, 1000),
            Disagree::Rs(ReduceOp::Sum, 1008),
        ),
        (Disagree::Ag(1000), Disagree::Ar(3000)),
        (Disagree::Rs(ReduceOp::Min, 1000), Disagree::Ag(1000)),
    ];
    for (mine, theirs) in cases {
        let Some(e) = mm_sim(test, n) else { return };
        let comm = mm_comm(
            &e,
            CommConfig {
                max_blocks: 1,
                // a disagreement is reported when the ranks meet: no timeout is expected
                timeout: cuda_multimem_tests::TEAM_TIMEOUT,
                ..Default::default()
            },
        );
        let s = mm_streams(&comm);
        let input = comm.alloc::<bf16>(n * 1008).unwrap();
        let mut output = comm.alloc::<bf16>(n * 1008).unwrap();
        for (r, st) in s.iter().enumerate() {
            let h = comm.rank(r).unwrap();
            let call = if r == 0 { mine } else { theirs };
            let c = match call {
                Disagree::Rs(op, c) => h.reduce_scatter(
                    input.slice(..n * c).unwrap(),
                    output.slice_mut(..c).unwrap(),
                    op,
                    st,
                ),
                Disagree::Ag(c) => h.all_gather(
                    input.slice(..c).unwrap(),
                    output.slice_mut(..n * c).unwrap(),
                    st,
                ),
                Disagree::Bc(c, root) => h.broadcast(
                    input.slice(..c).unwrap(),
                    output.slice_mut(..c).unwrap(),
                    root,
                    st,
                ),
                Disagree::Ar(c) => h.all_reduce(
                    input.slice(..c).unwrap(),
                    output.slice_mut(..c).unwrap(),
                    ReduceOp::Sum,
                    st,
                ),
            }
            .unwrap();
            assert_eq!(c.path, Path::Multimem, "{call:?}: {c}");
            assert_eq!(c.blocks, 1);
        }
        mm_sync(&s);
        let err = comm.check().unwrap_err();
        assert!(
            matches!(err, Error::RanksDisagree { .. }),
            "{mine:?} against {theirs:?}: {err}"
        );
        let again = comm
            .rank(0)
            .unwrap()
            .all_gather(
                input.slice(..8).unwrap(),
                output.slice_mut(..8 * n).unwrap(),
                &s[0],
            )
            .unwrap_err();
        assert!(matches!(again, Error::Unusable { .. }), "{again}");
    }
}

/// A rank that never calls: every calling rank's multimem reduce-scatter, all-gather or
/// broadcast times out (bounded), `check()` says so naming the multimem path, and the team
/// refuses further calls. The callers queue two calls each and drift apart, so a rank that gave
/// up would reach its next barrier while the other still waits (and must not complete it).
#[test]
fn a_missing_peer_of_a_multimem_collective_is_reported_as_a_timeout() {
    let test = "a_missing_peer_of_a_multimem_collective_is_reported_as_a_timeout";
    let n = 3;
    for kind in [
        Call::reduce_scatter(ReduceOp::Sum),
        Call::all_gather(),
        Call::broadcast(2),
        Call::broadcast(0),
    ] {
        let Some(e) = mm_sim(test, n) else { return };
        e.sim
            .as_ref()
            .unwrap()
            .set_kernel_delays(Duration::from_millis(100), 71);
        let comm = mm_comm(
            &e,
            CommConfig {
                max_blocks: 2,
                threads: 64,
                timeout: Duration::from_millis(300),
                first_call_timeout: Some(Duration::from_millis(300)),
                ..Default::default()
            },
        );
        let s = mm_streams(&comm);
        let count = 2048;
        let mut q = Queued::<bf16>::new(&comm, kind.at(), count, kind.params, Mem::SYM, false);
        q.fill(&mut Rng::new(72));
        // rank 2 never calls
        for _ in 0..2 {
            for r in 0..2 {
                let c = q.call(&comm, r, &s[r]).unwrap();
                assert_eq!(c.path, Path::Multimem, "{kind:?}: {c}");
            }
        }
        let t = std::time::Instant::now();
        mm_sync(&s[..2]);
        assert!(t.elapsed() < Duration::from_secs(20), "{kind:?}");
        for r in 0..2 {
            match comm.rank(r).unwrap().check() {
                Err(Error::Timeout { what, after }) => {
                    assert!(what.contains("multimem"), "{kind:?}: {what}");
                    assert_eq!(after, Duration::from_millis(300));
                }
                Err(Error::Unusable { .. }) if r == 1 => {}
                other => panic!("{kind:?}: rank {r}: expected a timeout, got {other:?}"),
            }
        }
        let err = q.call(&comm, 0, &s[0]).unwrap_err();
        assert!(matches!(err, Error::Unusable { .. }), "{kind:?}: {err}");
    }
}

/// The choice: with the default policy (WhenItPaysOff) a team of 8 takes the multimem path for
/// whole buffers of at least `multimem_min_bytes` (and reduce-scatter only where
/// `multimem.ld_reduce` has the type and operator), peer-to-peer below; a team of 3 and the
/// `Never` policy never do. The returned `Choice` says which ran, and the results are right.
#[test]
fn the_multimem_collectives_are_chosen_by_the_policy_and_the_choice_says_so() {
    let test = "the_multimem_collectives_are_chosen_by_the_policy_and_the_choice_says_so";
    let min = 64 << 10;
    let config = CommConfig {
        multimem_min_bytes: min,
        max_blocks: 2,
        ..Default::default()
    };
    let mut seed = Rng::new(81);
    let at_min = min / 16;
    // one simulator at a time (per thread): the team of 8 first, in its own scope
    {
        let Some(e) = mm_sim(test, 8) else { return };
        let comm = cuda_multimem_tests::team_on(
            &e.driver.devices(),
            config.clone(),
            MulticastPolicy::WhenItPaysOff,
        )
        .0;
        assert_eq!(comm.multicast_policy(), MulticastPolicy::WhenItPaysOff);
        assert!(
            comm.multimem_active(),
            "{:?}",
            comm.multimem_unavailable_reason()
        );
        let s = mm_streams(&comm);
        // bf16 on 8 ranks: the whole buffer is 8 x 2 x count bytes (broadcast: 2 x count)
        let cases = [
            (Call::reduce_scatter(ReduceOp::Sum), at_min, Path::Multimem),
            (Call::reduce_scatter(ReduceOp::Max), at_min, Path::Multimem),
            (
                Call::reduce_scatter(ReduceOp::Sum),
                at_min - 1,
                Path::PeerToPeer,
            ),
            (Call::all_gather(), at_min, Path::Multimem),
            (Call::all_gather(), at_min - 1, Path::PeerToPeer),
            (Call::broadcast(5), 8 * at_min, Path::Multimem),
            (Call::broadcast(5), 8 * at_min - 1, Path::PeerToPeer),
        ];
        for (kind, count, path) in cases {
            let p = mm_queue::<bf16>(&comm, &s, kind, count, Mem::OWN, false, &mut seed);
            assert_path(&p, path);
            mm_sync(&s);
            comm.check().unwrap();
            p.check();
        }
        // f32 reduces only with add through the switch: min and max go peer-to-peer
        let p = mm_queue::<f32>(
            &comm,
            &s,
            Call::reduce_scatter(ReduceOp::Min),
            at_min,
            Mem::SYM,
            false,
            &mut seed,
        );
        assert_path(&p, Path::PeerToPeer);
        let q = mm_queue::<f32>(
            &comm,
            &s,
            Call::reduce_scatter(ReduceOp::Sum),
            at_min,
            Mem::SYM,
            false,
            &mut seed,
        );
        assert_path(&q, Path::Multimem);
        mm_sync(&s);
        comm.check().unwrap();
        p.check();
        q.check();
        // Never, and a team of 3 by default (multicast does not pay off there): peer-to-peer
        let never = cuda_multimem_tests::team_on(
            &e.driver.devices(),
            config.clone(),
            MulticastPolicy::Never,
        )
        .0;
        assert!(!never.multimem_active());
        let s8 = mm_streams(&never);
        let p = mm_queue::<bf16>(
            &never,
            &s8,
            Call::all_gather(),
            4 * at_min,
            Mem::SYM,
            false,
            &mut seed,
        );
        assert_path(&p, Path::PeerToPeer);
        mm_sync(&s8);
        never.check().unwrap();
        p.check();
    }
    let Some(e3) = mm_sim(test, 3) else { return };
    let three =
        cuda_multimem_tests::team_on(&e3.driver.devices(), config, MulticastPolicy::WhenItPaysOff)
            .0;
    assert!(!three.multimem_active());
    let s3 = mm_streams(&three);
    let p = mm_queue::<bf16>(
        &three,
        &s3,
        Call::reduce_scatter(ReduceOp::Sum),
        4 * at_min,
        Mem::SYM,
        true,
        &mut seed,
    );
    assert_path(&p, Path::PeerToPeer);
    mm_sync(&s3);
    three.check().unwrap();
    p.check();
}

/// On a multimem team, bad arguments are refused before any launch, naming the argument (the
/// peer-to-peer path's checks): afterwards the ranks still agree and a correct call runs.
#[test]
fn bad_arguments_to_multimem_collectives_are_refused_before_any_launch() {
    let test = "bad_arguments_to_multimem_collectives_are_refused_before_any_launch";
    let n = 4;
    let Some(e) = mm_sim(test, n) else { return };
    let comm = mm_comm(&e, CommConfig::default());
    let s = mm_streams(&comm);
    let mut a = comm.alloc::<f32>(n * 100).unwrap();
    let mut b = comm.alloc::<f32>(n * 100).unwrap();
    let h = comm.rank(1).unwrap();
    let arg = |e: Error| match e {
        Error::InvalidArgument { arg, .. } => arg,
        e => panic!("expected an invalid argument, got {e}"),
    };
    // lengths not in the collective's ratio
    assert_eq!(
        arg(h
            .reduce_scatter(
                a.slice(..n * 100 - 1).unwrap(),
                b.slice_mut(..100).unwrap(),
                ReduceOp::Sum,
                &s[1]
            )
            .unwrap_err()),
        "input"
    );
    assert_eq!(
        arg(h
            .all_gather(
                a.slice(..100).unwrap(),
                b.slice_mut(..n * 100 - 4).unwrap(),
                &s[1]
            )
            .unwrap_err()),
        "output"
    );
    assert_eq!(
        arg(h
            .broadcast(
                a.slice(..100).unwrap(),
                b.slice_mut(..99).unwrap(),
                0,
                &s[1]
            )
            .unwrap_err()),
        "output"
    );
    // a root outside the team
    assert_eq!(
        arg(h.broadcast_in_place(&mut a, n, &s[1]).unwrap_err()),
        "root"
    );
    // not a whole number of chunks in place
    assert_eq!(
        arg(h
            .all_gather_in_place(a.slice_mut(..n * 100 - 1).unwrap(), &s[1])
            .unwrap_err()),
        "buf"
    );
    // overlap other than the in-place one (raw pointers into one buffer of rank 1's device)
    let own = DeviceBuffer::<f32>::zeroed(comm.device(1).unwrap(), n * 100 + 1).unwrap();
    let p = own.device_ptr();
    // SAFETY: both ranges lie inside `own` (n x 100 + 1 f32), alive during the call; the call
    // is refused before any launch.
    let (src, dst) = unsafe {
        (
            Src::<f32>::from_raw(p, 100),
            Dst::<f32>::from_raw(p + 4, n * 100),
        )
    };
    assert_eq!(arg(h.all_gather(src, dst, &s[1]).unwrap_err()), "output");
    // the ranks made no call: a correct one now runs on every rank and agrees
    let mut seed = Rng::new(91);
    let x: Vec<Vec<f32>> = (0..n).map(|_| seed.input(100)).collect();
    for r in 0..n {
        a.write(r, 0, &x[r]).unwrap();
    }
    for (r, st) in s.iter().enumerate() {
        let c = comm
            .rank(r)
            .unwrap()
            .all_gather(a.slice(..100).unwrap(), &mut b, st)
            .unwrap();
        assert_eq!(c.path, Path::Multimem);
    }
    mm_sync(&s);
    comm.check().unwrap();
    let xr: Vec<&[f32]> = x.iter().map(|v| v.as_slice()).collect();
    for r in 0..n {
        assert_eq!(b.to_vec(r).unwrap(), all_gather_reference(&xr), "rank {r}");
    }
}
