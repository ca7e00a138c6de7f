//! Failure injection into the collectives on the simulator: every driver call of a symmetric
//! allocation, of each collective's forms (allreduce, reduce-scatter, all-gather, broadcast, the
//! fused allreduce + RMSNorm) and of a hierarchical team's build fails in turn. Each failed call
//! returns an error, leaks no driver object, leaves no stream waiting forever or in a capture
//! that cannot end, and leaves the team either reporting the failure (`check`) or computing
//! correct results; the clean round computes them too.

use std::collections::BTreeMap;
use std::time::Duration;

use cuda_multimem::{CaptureMode, Error, Stream};
use cuda_multimem_collectives::{
    Algorithm, CommConfig, Communicator, HierCommunicator, MulticastPolicy, ReduceOp, UnixBootstrap,
};
use cuda_multimem_sim::{FailurePlan, SimConfig, Simulator};
use cuda_multimem_sys::CUresult;
use cuda_multimem_tests::collectives::{Call, Mem, Queued};
use cuda_multimem_tests::{fail_each_call, sim, Gate, Rng};

const N: usize = 2;
/// How long a rank waits for a peer that never comes (the injected rank's peer). Short: many
/// rounds wait it out. The rounds whose ranks must meet hold both ranks' streams behind a
/// [`Gate`] until both calls are queued, so the timeout measures the kernels, never the host
/// queueing the second rank's call (slow on a loaded machine).
const TIMEOUT: Duration = Duration::from_millis(150);
/// Bound on any stream's drain in these tests: far above every kernel's own timeout.
const DRAIN: Duration = Duration::from_secs(10);
const EPS: f32 = 1e-5;

fn live(sim: &Simulator) -> BTreeMap<String, i64> {
    sim.live_resources()
        .into_iter()
        .filter(|(k, _)| k != "primary contexts")
        .collect()
}

/// Small limits, so every form runs at test sizes: low-latency up to 1 KiB, one-shot up to
/// 4 KiB, 4 KiB staging slots, a scratch of three 4 KiB regions.
fn small() -> CommConfig {
    CommConfig {
        timeout: TIMEOUT,
        first_call_timeout: Some(TIMEOUT),
        one_shot_max_bytes: Some(4096),
        ll_max_bytes: 1024,
        stage_bytes: Some(4096),
        scratch_bytes: 12 << 10,
        gather_ll_max_bytes: 1024,
        broadcast_ll_max_bytes: 1024,
        norm_ll_max_bytes: 1024,
        ..Default::default()
    }
}

fn build(e: &cuda_multimem_tests::Env, config: &CommConfig) -> Communicator {
    cuda_multimem_tests::team_on(
        &e.driver.devices()[..N],
        config.clone(),
        MulticastPolicy::Never,
    )
    .0
}

fn streams(comm: &Communicator) -> Vec<Stream> {
    (0..N)
        .map(|r| Stream::new(comm.device(r).unwrap()).unwrap())
        .collect()
}

fn drain(s: &[Stream]) {
    for (r, st) in s.iter().enumerate() {
        st.wait_idle(DRAIN)
            .unwrap_or_else(|e| panic!("rank {r}'s stream never drained: {e}"));
    }
}

// ---- what a case calls: an entry of the collectives' table ----

#[derive(Debug, Clone)]
struct Spec {
    /// The collective and its parameters.
    kind: Call,
    mem: Mem,
    in_place: bool,
    /// Elements per rank: allreduce/broadcast the message, reduce-scatter the output,
    /// all-gather the input, norm the rows × hidden.
    count: usize,
    config: CommConfig,
    /// What the clean call must run.
    expect: Algorithm,
}

/// One case's operands (f32), filled with data from `seed`.
fn setup(comm: &Communicator, spec: &Spec, seed: u64) -> Queued<f32> {
    let mut q = Queued::new(
        comm,
        spec.kind.at(),
        spec.count,
        spec.kind.params,
        spec.mem,
        spec.in_place,
    );
    q.fill(&mut Rng::new(seed));
    q
}

/// The whole case on every rank, cleanly: the form it expects, and the host reference.
fn clean_run(
    comm: &Communicator,
    spec: &Spec,
    s: &[Stream],
    seed: u64,
    gate: &Gate,
) -> Result<(), String> {
    let mut b = setup(comm, spec, seed);
    gate.hold(s);
    let called = (0..s.len()).try_for_each(|r| {
        let c = b
            .call(comm, r, &s[r])
            .map_err(|e| format!("rank {r}: {e}"))?;
        if c.algorithm != spec.expect {
            return Err(format!("rank {r} ran {c}; expected {}", spec.expect));
        }
        Ok(())
    });
    gate.open();
    called?;
    drain(s);
    comm.check().map_err(|e| format!("check: {e}"))?;
    b.verify()
}

/// Failures that the library ignores by design: the end-of-call event record (and the capture
/// query before it) only makes a later check on another stream conservative.
fn tolerated(fired: &str) -> bool {
    matches!(fired, "cuEventRecord" | "cuStreamIsCapturing")
}

/// Fail each driver call of rank 0's call of `spec`, one per round (rank 1 calls normally; in
/// `capture`, rank 0's call is captured and rank 1 is not called). Returns the failures
/// injected.
fn sweep(spec: &Spec, capture: bool) -> usize {
    let e = sim(SimConfig::new(N, 13000));
    let sim = e.sim.as_ref().unwrap();
    let gate = Gate::new(&e);
    let base = live(sim);
    // warm up: entry points resolved, the case itself checked
    {
        let comm = build(&e, &spec.config);
        let s = streams(&comm);
        if capture {
            let mut b = setup(&comm, spec, 1);
            let sr = s[0].as_stream_ref();
            sr.begin_capture(CaptureMode::Relaxed).unwrap();
            b.call(&comm, 0, &s[0]).unwrap();
            drop(sr.end_capture().unwrap());
            assert!(!sr.is_capturing().unwrap());
            drop(b);
        }
        clean_run(&comm, spec, &s, 2, &gate).unwrap_or_else(|m| panic!("{spec:?}: warm-up: {m}"));
    }
    assert_eq!(live(sim), base, "{spec:?}: the warm-up left resources");
    let mut injected = 0;
    for skip in 0.. {
        assert!(skip < 300, "{spec:?}: the call never completed");
        let comm = build(&e, &spec.config);
        let s = streams(&comm);
        let mut b = setup(&comm, spec, 10 + skip as u64);
        let before = live(sim);
        let sr = s[0].as_stream_ref();
        // both streams start what they are given only once every call of the round is queued
        gate.hold(&s);
        if capture {
            sr.begin_capture(CaptureMode::Relaxed).unwrap();
        }
        sim.inject_failure(FailurePlan {
            call: None,
            skip,
            code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        });
        let r = b.call(&comm, 0, &s[0]);
        let fired = sim.clear_failure();
        let what = format!("{spec:?}, capture {capture}, call #{skip} ({fired:?})");
        let graph = if capture {
            let g = sr.end_capture();
            assert!(!sr.is_capturing().unwrap(), "{what}: still capturing");
            if let Err(Error::Driver { code, .. }) = &g {
                assert_ne!(
                    *code,
                    CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
                    "{what}: the call left a fork of the capture unjoined"
                );
            }
            Some(g)
        } else {
            None
        };
        let Some(fired) = fired else {
            // the clean round
            let c = r.unwrap_or_else(|e| panic!("{what}: failed without a failure: {e}"));
            assert_eq!(c.algorithm, spec.expect, "{what}");
            if let Some(g) = graph {
                // SAFETY: the team, buffers and stream outlive the launch (drained below).
                let x = unsafe { g.unwrap().instantiate() }.unwrap();
                x.launch(&s[0]).unwrap();
            }
            b.call(&comm, 1, &s[1]).unwrap();
            gate.open();
            drain(&s);
            comm.check().unwrap();
            b.verify().unwrap_or_else(|m| panic!("{what}: {m}"));
            break;
        };
        injected += 1;
        if let Ok(c) = &r {
            assert!(
                tolerated(&fired),
                "{what}: succeeded ({c}) although {fired} failed"
            );
        }
        drop(graph);
        if !capture {
            // the peer makes its call: it meets rank 0's work, or times out
            match b.call(&comm, 1, &s[1]) {
                Ok(_) | Err(Error::Unusable { .. }) => {}
                Err(e) => panic!("{what}: rank 1's call: {e}"),
            }
        }
        gate.open();
        // nothing waits forever (a stream left waiting on a never-recorded event would)
        drain(&s);
        assert_eq!(live(sim), before, "{what}: leaked");
        match comm.check() {
            Err(Error::Timeout { .. } | Error::Unusable { .. }) => {
                // the team says so, and refuses further calls
                match b.call(&comm, 0, &s[0]) {
                    Err(Error::Unusable { .. }) => {}
                    other => panic!("{what}: a broken team took a call: {other:?}"),
                }
            }
            Err(e) => panic!("{what}: check: {e}"),
            Ok(()) => {
                if r.is_ok() && !capture {
                    b.verify().unwrap_or_else(|m| panic!("{what}: {m}"));
                }
                // the team still computes correct results (and the call released its lock)
                clean_run(&comm, spec, &s, 4, &gate)
                    .unwrap_or_else(|m| panic!("{what}: the team still reports no error but: {m}"));
            }
        }
        drop((b, sr));
        drop((s, comm));
        assert_eq!(live(sim), base, "{what}: left over after the team dropped");
    }
    injected
}

fn spec(mut kind: Call, mem: Mem, in_place: bool, count: usize, expect: Algorithm) -> Spec {
    kind.params.eps = EPS;
    Spec {
        kind,
        mem,
        in_place,
        count,
        config: small(),
        expect,
    }
}

fn sweep_all(specs: &[Spec], floor: usize) {
    for sp in specs {
        for capture in [false, true] {
            let n = sweep(sp, capture);
            assert!(n >= floor, "{sp:?}: only {n} driver calls failed");
        }
    }
}

// ---- symmetric allocation ----

#[test]
fn a_symmetric_allocation_that_fails_half_way_leaks_nothing_and_the_team_stays_usable() {
    let e = sim(SimConfig::new(N, 13000));
    let s_ = e.sim.as_ref().unwrap();
    let gate = Gate::new(&e);
    let comm = build(&e, &small());
    let s = streams(&comm);
    drop(comm.alloc::<f32>(1000).unwrap());
    let injected = fail_each_call(
        s_,
        || comm.alloc::<f32>(1000),
        |b| assert_eq!(b.len(), 1000),
    );
    assert!(injected >= 10, "only {injected} driver calls failed");
    comm.check().unwrap();
    for (k, sp) in [
        spec(
            Call::all_reduce(ReduceOp::Sum),
            Mem::SYM,
            true,
            64,
            Algorithm::OneShotLl,
        ),
        spec(
            Call::all_reduce(ReduceOp::Sum),
            Mem::SYM,
            false,
            4096,
            Algorithm::TwoShotPush,
        ),
        spec(
            Call::all_gather(),
            Mem::SYM,
            false,
            600,
            Algorithm::PushDirect,
        ),
    ]
    .iter()
    .enumerate()
    {
        clean_run(&comm, sp, &s, 100 + k as u64, &gate).unwrap();
    }
}

// ---- allreduce ----

#[test]
fn a_failing_low_latency_or_one_shot_allreduce_leaks_nothing_and_never_computes_wrong() {
    sweep_all(
        &[
            spec(
                Call::all_reduce(ReduceOp::Sum),
                Mem::SYM,
                true,
                64,
                Algorithm::OneShotLl,
            ),
            spec(
                Call::all_reduce(ReduceOp::Sum),
                Mem::SYM,
                false,
                512,
                Algorithm::OneShot,
            ),
            spec(
                Call::all_reduce(ReduceOp::Sum),
                Mem::OWN,
                false,
                512,
                Algorithm::OneShot,
            ),
        ],
        1,
    );
}

#[test]
fn a_failing_two_shot_allreduce_leaks_nothing_and_never_computes_wrong() {
    let mut ce = spec(
        Call::all_reduce(ReduceOp::Sum),
        Mem::SYM,
        false,
        4096,
        Algorithm::TwoShotCe,
    );
    ce.config.ce_max_bytes = 64 << 10;
    ce.config.ce_min_bytes = 8 << 10;
    sweep_all(
        &[
            spec(
                Call::all_reduce(ReduceOp::Sum),
                Mem::SYM,
                true,
                4096,
                Algorithm::TwoShotPush,
            ),
            spec(
                Call::all_reduce(ReduceOp::Sum),
                Mem::SYM_ODD,
                false,
                4096,
                Algorithm::TwoShot,
            ),
            ce,
        ],
        1,
    );
}

#[test]
fn a_failing_staged_allreduce_of_own_memory_leaks_nothing_and_never_computes_wrong() {
    // 6000 f32 = 24000 bytes: two chunks through 12 KiB regions, the first chunk's result
    // copied out by the second's kernel, the last one's by a copy; in place and not a whole
    // number of 16-byte vectors, the second chunk's input copied into the input region too
    let staged = |in_place, count| {
        let mut s = spec(
            Call::all_reduce(ReduceOp::Sum),
            Mem::OWN,
            in_place,
            count,
            Algorithm::TwoShotPush,
        );
        s.config.scratch_bytes = 36 << 10;
        s
    };
    sweep_all(&[staged(false, 6000), staged(true, 6001)], 3);
}

// ---- reduce-scatter, all-gather, broadcast ----

#[test]
fn a_failing_reduce_scatter_leaks_nothing_and_never_computes_wrong() {
    sweep_all(
        &[
            spec(
                Call::reduce_scatter(ReduceOp::Sum),
                Mem::SYM,
                false,
                64,
                Algorithm::PushLl,
            ),
            spec(
                Call::reduce_scatter(ReduceOp::Sum),
                Mem::SYM_ODD,
                true,
                1000,
                Algorithm::PushStaged,
            ),
            spec(
                Call::reduce_scatter(ReduceOp::Sum),
                Mem::OWN,
                false,
                1000,
                Algorithm::PushStaged,
            ),
        ],
        1,
    );
}

#[test]
fn a_failing_all_gather_leaks_nothing_and_never_computes_wrong() {
    sweep_all(
        &[
            spec(Call::all_gather(), Mem::SYM, true, 64, Algorithm::PushLl),
            spec(
                Call::all_gather(),
                Mem::OWN,
                false,
                1000,
                Algorithm::PushStaged,
            ),
            spec(
                Call::all_gather(),
                Mem::SYM,
                false,
                1000,
                Algorithm::PushDirect,
            ),
        ],
        1,
    );
}

#[test]
fn a_failing_copy_engine_all_gather_or_broadcast_leaks_nothing_and_joins_its_fork() {
    let ce = |kind, in_place, count| {
        let mut s = spec(kind, Mem::SYM, in_place, count, Algorithm::CopyEngine);
        s.config.gather_ce_min_bytes = 4096;
        s.config.broadcast_ce_min_bytes = 4096;
        s
    };
    sweep_all(
        &[
            ce(Call::all_gather(), false, 1024),
            ce(Call::all_gather(), true, 1024),
            ce(Call::broadcast(0), false, 2048),
            ce(Call::broadcast(1), false, 2048),
        ],
        3,
    );
}

#[test]
fn a_failing_broadcast_leaks_nothing_and_never_computes_wrong() {
    sweep_all(
        &[
            spec(Call::broadcast(0), Mem::SYM, false, 128, Algorithm::PushLl),
            spec(
                Call::broadcast(1),
                Mem::OWN,
                true,
                1000,
                Algorithm::PushStaged,
            ),
            spec(
                Call::broadcast(0),
                Mem::SYM,
                true,
                2000,
                Algorithm::PushDirect,
            ),
        ],
        1,
    );
}

// ---- the fused allreduce + RMSNorm ----

#[test]
fn a_failing_fused_allreduce_rms_norm_leaks_nothing_and_never_computes_wrong() {
    // rows of 1 KiB: one row low-latency; 3 rows one-shot; 10 rows (above the 4 KiB one-shot
    // limit) two-shot in three launches of at most 4 rows
    sweep_all(
        &[
            spec(
                Call::norm(256),
                Mem::SYM,
                false,
                256,
                Algorithm::NormOneShotLl,
            ),
            spec(
                Call::norm(256),
                Mem::SYM,
                false,
                3 * 256,
                Algorithm::NormOneShot,
            ),
        ],
        1,
    );
    sweep_all(
        &[spec(
            Call::norm(256),
            Mem::SYM,
            false,
            10 * 256,
            Algorithm::NormTwoShot,
        )],
        3,
    );
}

// ---- the hierarchical team's build ----

/// Driver calls that release an object (their failure is ignored by the drop that makes them).
fn releases(symbol: &str) -> bool {
    ["Free", "Destroy", "Release", "Unmap"]
        .iter()
        .any(|w| symbol.contains(w))
}

/// A 2 x 2 hierarchical team (threads over one simulator, the cross-domain test double) whose
/// build fails at call `skip` of any of its ranks: every rank's build returns (an error where
/// a rank failed), and nothing is left once they are dropped. A round whose failure hit a
/// release (`cuMemAddressFree`, ...) leaves that object, which the driver refused to free: the
/// later rounds count from there. (Counting from the start made the first version of this test
/// report such a refused free as a leak of the build.)
#[test]
fn a_hierarchical_build_that_fails_half_way_leaks_nothing() {
    let n = 4;
    let e = sim(SimConfig::new(n, 13000));
    let sim = e.sim.as_ref().unwrap();
    let attempt = |tag: &str| -> Vec<cuda_multimem::Result<HierCommunicator>> {
        let path = std::env::temp_dir().join(format!("cmm-fail-{tag}-{}", std::process::id()));
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (driver, path) = (e.driver.clone(), path.clone());
                std::thread::spawn(move || {
                    let device = driver.device(rank)?;
                    let boot = UnixBootstrap::new(&path, rank, n, Duration::from_secs(10)).unwrap();
                    HierCommunicator::builder(&device, Box::new(boot))
                        .domain_id((rank / 2) as u64)
                        .multicast(MulticastPolicy::Never)
                        .config(small())
                        .cross_domain_test_double()
                        .build()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    };
    let mut base = live(sim);
    drop(attempt("warm"));
    assert_eq!(live(sim), base);
    let mut injected = 0;
    // The calls of 4 threads interleave: inject at every 3rd call of the team's build.
    for skip in (0..).step_by(3) {
        assert!(skip < 3000, "the build never completed");
        sim.inject_failure(FailurePlan {
            call: None,
            skip,
            code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        });
        let built = attempt(&skip.to_string());
        let fired = sim.clear_failure();
        let failed = built.iter().filter(|b| b.is_err()).count();
        let errs: Vec<String> = built
            .iter()
            .map(|b| b.as_ref().err().map_or("built".into(), |e| e.to_string()))
            .collect();
        match fired {
            None => {
                assert_eq!(failed, 0, "failed without an injected failure");
                drop(built);
                assert_eq!(live(sim), base, "left over after the clean build");
                break;
            }
            Some(f) => {
                injected += 1;
                // (the PCI ids only help discover domains: explicit ids here)
                assert!(
                    failed > 0 || f == "cuDeviceGetAttribute" || releases(&f),
                    "every rank built although {f} failed"
                );
                drop(built);
                // (a release the driver refuses leaves its object: nothing to retry with)
                if releases(&f) {
                    base = live(sim);
                } else {
                    assert_eq!(
                        live(sim),
                        base,
                        "after failing {f} (call #{skip}): {errs:?}"
                    );
                }
            }
        }
    }
    assert!(injected > 30, "only {injected} failures injected");
}
