//! Co-residency: a launch takes `min(grid, multiprocessors × blocks per multiprocessor)`
//! resident-block slots of its device while it runs, and waits (as blocks that cannot start)
//! when too few are free. Kernels whose blocks wait for each other therefore meet when their
//! grids fit the device together, and time out through their own deadlines when they do not —
//! as on a GPU, where several ranks share one.
//!
//! Every wait of these tests is bounded; the only deadline meant to fire is the short one of
//! the ranks that cannot all be resident, and nothing depends on how fast the machine is: what
//! may run when is decided by slots, which a kernel holds until it returns.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_multimem::{Driver, Error, Function, LaunchConfig, Module, Stream};
use cuda_multimem_sim::{register_kernel, KernelError, SimConfig, Simulator};
use cuda_multimem_sys::CUresult;

/// How long a test waits for something that should happen at once (only a failing test
/// waits this long).
const PATIENCE: Duration = Duration::from_secs(120);

/// One device of `sms` multiprocessors, and a module declaring `names` (kernels without
/// parameters).
fn machine(sms: i32, names: &[&str]) -> (Simulator, Driver, Module) {
    let sim =
        Simulator::start(SimConfig::new(1, 13030).with_all(|d| d.multiprocessors = sms)).unwrap();
    let driver = cuda_multimem_sim::driver_over(&sim).unwrap();
    let mut ptx = String::from(".version 8.0\n.target sm_90\n.address_size 64\n");
    for n in names {
        ptx += &format!(".visible .entry {n}()\n{{\n    ret;\n}}\n");
    }
    let module = Module::load_ptx(&driver.device(0).unwrap(), &ptx).unwrap();
    (sim, driver, module)
}

fn launch(f: &Function, blocks: u32, stream: &Stream) {
    // SAFETY: the kernels take no parameters and touch no device memory.
    unsafe { f.launch_u64(&LaunchConfig::linear(blocks, 1024), stream, &[]) }.unwrap();
}

/// Poll `cond` until it holds (at most [`PATIENCE`]).
fn eventually(what: &str, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < PATIENCE,
            "{what} did not happen within {PATIENCE:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A kernel that spins until `release` is set (or [`PATIENCE`] passed: then it fails).
fn holder(
    started: Arc<AtomicBool>,
    release: Arc<AtomicBool>,
) -> impl Fn(&cuda_multimem_sim::LaunchArgs) -> Result<(), KernelError> {
    move |_| {
        started.store(true, Ordering::SeqCst);
        let start = Instant::now();
        while !release.load(Ordering::SeqCst) {
            if start.elapsed() > PATIENCE {
                return Err(KernelError::Failed("never released".into()));
            }
            std::thread::yield_now();
        }
        Ok(())
    }
}

/// A rank's barrier kernel: it counts itself present, waits (until `deadline`) for `team`
/// ranks to be present at once, counts itself gone, and records a timeout in `timeouts` (as
/// the collectives' kernels set their error word) instead of failing.
fn rank(
    team: u32,
    present: Arc<AtomicU32>,
    timeouts: Arc<AtomicU32>,
    deadline: Duration,
) -> impl Fn(&cuda_multimem_sim::LaunchArgs) -> Result<(), KernelError> {
    // Once all were present at once the barrier is passed, whoever leaves first.
    let met = Arc::new(AtomicBool::new(false));
    move |_| {
        present.fetch_add(1, Ordering::SeqCst);
        let start = Instant::now();
        loop {
            if present.load(Ordering::SeqCst) >= team {
                met.store(true, Ordering::SeqCst);
            }
            if met.load(Ordering::SeqCst) {
                break;
            }
            if start.elapsed() > deadline {
                timeouts.fetch_add(1, Ordering::SeqCst);
                break;
            }
            std::thread::yield_now();
        }
        present.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }
}

#[test]
fn a_launch_waits_for_the_slots_a_running_kernel_holds_and_runs_when_they_free() {
    // 2 multiprocessors, 2 blocks of 1024 threads each: 4 slots.
    let (sim, driver, module) = machine(2, &["cr_hold", "cr_probe"]);
    let (started, release) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    // `order` numbers the holder's end and the probe's start
    let order = Arc::new(AtomicU64::new(0));
    let (hold_end, probe_start) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    {
        let hold = holder(started.clone(), release.clone());
        let (order, hold_end) = (order.clone(), hold_end.clone());
        register_kernel("cr_hold", move |a| {
            hold(a)?;
            hold_end.store(order.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
            Ok(())
        });
    }
    {
        let (order, probe_start) = (order.clone(), probe_start.clone());
        register_kernel("cr_probe", move |_| {
            probe_start.store(order.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
            Ok(())
        });
    }
    let d = driver.device(0).unwrap();
    let (s1, s2) = (Stream::new(&d).unwrap(), Stream::new(&d).unwrap());
    launch(&module.function("cr_hold").unwrap(), 3, &s1);
    eventually("the holding kernel starts", || {
        started.load(Ordering::SeqCst)
    });
    // 2 blocks, 1 slot free: the probe waits
    launch(&module.function("cr_probe").unwrap(), 2, &s2);
    eventually("the probe waits for slots", || sim.residency_waits() == 1);
    assert_eq!(
        probe_start.load(Ordering::SeqCst),
        0,
        "the probe ran without its slots"
    );
    assert!(!s2.is_idle().unwrap());
    release.store(true, Ordering::SeqCst);
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    assert_eq!(
        (
            hold_end.load(Ordering::SeqCst),
            probe_start.load(Ordering::SeqCst)
        ),
        (1, 2),
        "the probe starts once the holder has ended"
    );
    assert_eq!(sim.residency_waits(), 1);
}

#[test]
fn spin_waiting_ranks_whose_grids_fit_together_meet() {
    // 4 ranks on one device of 8 multiprocessors: each rank's grid is its share of the
    // device, from the kernel's real occupancy (what the collectives' planner does).
    let (sim, driver, module) = machine(8, &["cr_rank_fit"]);
    let (present, timeouts) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    register_kernel("cr_rank_fit", rank(4, present, timeouts.clone(), PATIENCE));
    let d = driver.device(0).unwrap();
    let f = module.function("cr_rank_fit").unwrap();
    let per_sm = f.max_active_blocks_per_multiprocessor(1024, 0).unwrap();
    let sms = d.multiprocessor_count().unwrap() as u32;
    assert_eq!((per_sm, sms), (2, 8));
    let share = per_sm * sms / 4;
    let streams: Vec<Stream> = (0..4).map(|_| Stream::new(&d).unwrap()).collect();
    for s in &streams {
        launch(&f, share, s);
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    assert_eq!(timeouts.load(Ordering::SeqCst), 0, "the ranks did not meet");
    assert_eq!(sim.residency_waits(), 0);
}

#[test]
fn spin_waiting_ranks_whose_grids_exceed_the_device_time_out_through_their_own_deadlines() {
    // 2 ranks of 3 blocks on 4 slots: the second cannot start while the first spins.
    let (sim, driver, module) = machine(2, &["cr_rank_over"]);
    let (present, timeouts) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    // 50 ms: meant to fire (each rank waits alone for the other)
    register_kernel(
        "cr_rank_over",
        rank(2, present, timeouts.clone(), Duration::from_millis(50)),
    );
    let d = driver.device(0).unwrap();
    let f = module.function("cr_rank_over").unwrap();
    let (s1, s2) = (Stream::new(&d).unwrap(), Stream::new(&d).unwrap());
    launch(&f, 3, &s1);
    launch(&f, 3, &s2);
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    assert_eq!(
        timeouts.load(Ordering::SeqCst),
        2,
        "both ranks time out, one after the other"
    );
    assert_eq!(sim.residency_waits(), 1);
}

#[test]
fn a_launch_that_never_gets_its_slots_fails_after_the_residency_limit() {
    let (sim, driver, module) = machine(2, &["cr_hold_all", "cr_late"]);
    let (started, release) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    register_kernel("cr_hold_all", holder(started.clone(), release.clone()));
    let ran = Arc::new(AtomicU32::new(0));
    {
        let ran = ran.clone();
        register_kernel("cr_late", move |_| {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
    }
    // meant to fire: the holder keeps every slot until the test releases it
    sim.set_residency_limit(Duration::from_millis(50));
    let d = driver.device(0).unwrap();
    let (s1, s2) = (Stream::new(&d).unwrap(), Stream::new(&d).unwrap());
    launch(&module.function("cr_hold_all").unwrap(), 4, &s1);
    eventually("the holding kernel starts", || {
        started.load(Ordering::SeqCst)
    });
    let late = module.function("cr_late").unwrap();
    launch(&late, 1, &s2);
    match s2.synchronize() {
        Err(Error::Driver { code, .. }) => assert_eq!(code, CUresult::CUDA_ERROR_LAUNCH_TIMEOUT),
        other => panic!("expected the launch to time out waiting for slots, got {other:?}"),
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    release.store(true, Ordering::SeqCst);
    s1.synchronize().unwrap();
    // the slots are back: the same launch runs now
    launch(&late, 1, &s2);
    s2.synchronize().unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

#[test]
fn a_grid_larger_than_the_device_holds_all_of_it_and_no_more() {
    // 10000 blocks on 4 slots: the launch takes the 4 (its blocks run in waves), so a
    // one-block launch beside it waits until it is done.
    let (sim, driver, module) = machine(2, &["cr_big", "cr_small"]);
    let (started, release) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    register_kernel("cr_big", holder(started.clone(), release.clone()));
    register_kernel("cr_small", |_| Ok(()));
    let d = driver.device(0).unwrap();
    let (s1, s2) = (Stream::new(&d).unwrap(), Stream::new(&d).unwrap());
    launch(&module.function("cr_big").unwrap(), 10_000, &s1);
    eventually("the big kernel starts", || started.load(Ordering::SeqCst));
    launch(&module.function("cr_small").unwrap(), 1, &s2);
    eventually("the small launch waits", || sim.residency_waits() == 1);
    assert!(!s2.is_idle().unwrap());
    release.store(true, Ordering::SeqCst);
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
}
