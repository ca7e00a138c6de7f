//! Several ranks on one GPU: teams of 2, 3, 4, 5 and 8 ranks placed round-robin on the devices
//! of the driver `CUDA_MULTIMEM_DRIVER` selects (on a one-GPU machine every rank shares it, so
//! `cargo xtask test-hw` runs the real kernels of every team size there), and on a simulated
//! machine of one device with the simulator's occupancy model: every collective of the table in
//! every form, every element type, both operand kinds, in place and not, against the host
//! reference; graph replay; a peer that never arrives is a timeout on every calling rank; the
//! launches are capped to each rank's share of the device; a team of 16 on one device (where
//! `CUDA_DEVICE_MAX_CONNECTIONS` gives each rank a hardware queue).

use std::time::Duration;

use cuda_multimem::{CaptureMode, Device, Error, Stream};
use cuda_multimem_collectives::{CommConfig, Communicator, MulticastPolicy};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::collectives::{
    calls, capture_and_replay, once, Elem, Mem, Pending, Queued,
};
use cuda_multimem_tests::{collectives_unsupported, env, placed, sim, skip, team_on, Env, Rng};

/// The team sizes the issue names.
const SIZES: [usize; 5] = [2, 3, 4, 5, 8];

/// Small limits so that small buffers reach every form: low-latency, one-shot, two-shot,
/// staged, direct and the copy engines.
fn forms_config(ll: bool) -> CommConfig {
    CommConfig {
        ll_max_bytes: if ll { 64 << 10 } else { 0 },
        gather_ll_max_bytes: if ll { 2 << 20 } else { 0 },
        broadcast_ll_max_bytes: if ll { 1 << 20 } else { 0 },
        norm_ll_max_bytes: if ll { 256 << 10 } else { 0 },
        one_shot_max_bytes: Some(8 << 10),
        gather_ce_min_bytes: 256 << 10,
        broadcast_ce_min_bytes: 256 << 10,
        stage_bytes: Some(512 << 10),
        scratch_bytes: 96 << 10,
        ..CommConfig::default()
    }
}

fn sweep<T: Elem>(devices: &[Device], counts: &[usize], config: CommConfig, seed: u64) {
    let (comm, s) = team_on(devices, config, MulticastPolicy::Never);
    assert!(!comm.multimem_active());
    let mut rng = Rng::new(seed);
    for call in calls(devices.len()) {
        for &count in counts {
            for mem in Mem::ALL {
                for in_place in [false, true] {
                    once::<T>(&comm, &s, call, count, mem, in_place, &mut rng);
                }
            }
        }
    }
}

/// The devices of the environment for a team of `n`, unless the collectives cannot run there.
fn team_devices(e: &Env, n: usize, test: &str) -> Option<Vec<Device>> {
    if let Some(why) = collectives_unsupported(&e.driver) {
        skip(test, why);
        return None;
    }
    Some(placed(e, n))
}

#[test]
fn every_collective_equals_its_host_reference_on_teams_of_2_to_8_sharing_the_devices() {
    let e = env();
    // every size and more counts where the kernels are the real ones (test-hw); on the
    // simulator, whose one-device test below covers every size, two of them
    let (sizes, counts): (&[usize], &[usize]) = if e.driver.is_simulated() {
        (&[3, 8], &[7, 40_000])
    } else {
        (&SIZES, &[1, 7, 1000, 4099, 40_000])
    };
    for (i, &n) in sizes.iter().enumerate() {
        let Some(devices) = team_devices(&e, n, "collectives::shared::every_collective") else {
            return;
        };
        for ll in [true, false] {
            let seed = 10 + i as u64 * 2 + ll as u64;
            cuda_multimem_tests::for_each_elem!(sweep(&devices, counts, forms_config(ll), seed));
        }
    }
}

#[test]
fn every_collective_equals_its_host_reference_on_one_simulated_device_shared_by_2_to_8_ranks() {
    for n in SIZES {
        let e = sim(SimConfig::new(1, 13050));
        let devices = placed(&e, n);
        for ll in [true, false] {
            sweep::<f32>(&devices, &[1, 1000, 40_000], forms_config(ll), n as u64);
        }
        // every launch within the rank's share of the device: nobody waited for resident slots
        assert_eq!(e.sim.as_ref().unwrap().residency_waits(), 0, "{n} ranks");
    }
}

/// A team of 16 ranks on one device (device 0 of the driver `CUDA_MULTIMEM_DRIVER` selects; the
/// real GPU under `cargo xtask test-hw`, which sets `CUDA_DEVICE_MAX_CONNECTIONS=32`): the table's
/// one pass (every collective, its first operator, both broadcast roots; f32; symmetric, odd and
/// own operands; low-latency forms and not) against the host reference, each rank's grid its
/// share of the device. 16 ranks of one process on one device need 16 hardware queues: where
/// `CUDA_DEVICE_MAX_CONNECTIONS` gives fewer, the build refuses naming it and the test skips
/// printing that refusal.
#[test]
fn every_collective_equals_its_host_reference_on_a_team_of_16_sharing_one_device() {
    const TEST: &str = "collectives::shared::team_of_16_on_one_device";
    let e = env();
    if let Some(why) = collectives_unsupported(&e.driver) {
        return skip(TEST, why);
    }
    let devices = vec![e.driver.devices()[0].clone(); 16];
    let refused = Communicator::builder(&devices)
        .allow_shared_devices(true)
        .build()
        .err();
    if let Some(err) = refused {
        match &err {
            Error::InvalidArgument { arg, reason }
                if *arg == "devices" && reason.contains("CUDA_DEVICE_MAX_CONNECTIONS") =>
            {
                return skip(
                    TEST,
                    format!("{err} (cargo xtask test-hw sets CUDA_DEVICE_MAX_CONNECTIONS=32)"),
                );
            }
            _ => panic!("a team of 16 ranks on one device builds: {err}"),
        }
    }
    let counts: &[usize] = if e.driver.is_simulated() {
        &[7, 3000]
    } else {
        &[7, 1000, 40_000]
    };
    for ll in [true, false] {
        let (comm, s) = team_on(&devices, forms_config(ll), MulticastPolicy::Never);
        let mut rng = Rng::new(1600 + ll as u64);
        let mut seen = Vec::new();
        for call in calls(16) {
            if seen.contains(&(call.name, call.params.root)) {
                continue;
            }
            seen.push((call.name, call.params.root));
            for &count in counts {
                for mem in Mem::ALL {
                    once::<f32>(&comm, &s, call, count, mem, false, &mut rng);
                }
            }
        }
    }
    if let Some(sim) = e.sim.as_ref() {
        // every launch within the rank's share of the device: nobody waited for resident slots
        assert_eq!(sim.residency_waits(), 0, "16 ranks");
    }
}

/// Each rank's launches take at most its share of the device: the kernels' occupancy times the
/// multiprocessors over the ranks on it (132 on the simulated H200-like device).
#[test]
fn launches_are_capped_to_each_ranks_share_of_the_device() {
    let e = sim(SimConfig::new(1, 13050));
    let one = placed(&e, 1);
    let (alone, _) = team_on(&one, CommConfig::default(), MulticastPolicy::Never);
    assert_eq!(alone.size(), 1);
    for n in SIZES {
        let devices = placed(&e, n);
        let (comm, _s) = team_on(&devices, CommConfig::default(), MulticastPolicy::Never);
        for count in [1usize << 10, 1 << 20, 1 << 24] {
            let c = comm
                .choice(
                    cuda_multimem_collectives::DType::F32,
                    cuda_multimem_collectives::ReduceOp::Sum,
                    count,
                    cuda_multimem_collectives::Operands::Symmetric,
                )
                .unwrap();
            // at most one block of 1024 threads per multiprocessor for the least resident
            // kernel, at most 2 (the simulator's 32 registers per thread), over n ranks
            assert!(c.blocks as usize * n <= 2 * 132, "{n} ranks, {count}: {c}");
        }
        let c = comm
            .add_rms_norm_choice(cuda_multimem_collectives::DType::Bf16, 16, 8192)
            .unwrap();
        assert!(c.blocks as usize * n <= 2 * 132, "{n} ranks, norm: {c}");
    }
}

/// A device listed twice is refused unless the builder allows it, naming `devices`.
#[test]
fn ranks_share_a_device_only_when_the_builder_allows_it() {
    let e = sim(SimConfig::new(1, 13050));
    let devices = placed(&e, 3);
    match Communicator::new(&devices) {
        Err(Error::InvalidArgument { arg, reason }) => {
            assert_eq!(arg, "devices");
            assert!(reason.contains("allow_shared_devices"), "{reason}");
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
    let comm = Communicator::builder(&devices)
        .allow_shared_devices(true)
        .multicast(MulticastPolicy::WhenItPaysOff)
        .build()
        .unwrap();
    assert!(!comm.multimem_active());
    assert!(
        comm.multimem_unavailable_reason()
            .unwrap()
            .contains("share"),
        "{:?}",
        comm.multimem_unavailable_reason()
    );
    let always = Communicator::builder(&devices)
        .allow_shared_devices(true)
        .multicast(MulticastPolicy::Always)
        .build();
    assert!(always.is_err());
}

/// Ranks sharing a device keep to one stream each (each needs a hardware queue of its own, see
/// `allow_shared_devices`): the copy-engine forms, which fork each rank onto a second stream,
/// are not chosen for such teams however large the gather.
#[test]
fn ranks_sharing_a_device_keep_to_one_stream_each() {
    let config = CommConfig {
        gather_ce_min_bytes: 1 << 10,
        broadcast_ce_min_bytes: 1 << 10,
        gather_ll_max_bytes: 0,
        broadcast_ll_max_bytes: 0,
        ..CommConfig::default()
    };
    let algorithms = |devices: &[Device]| {
        let (comm, s) = team_on(devices, config.clone(), MulticastPolicy::Never);
        let (n, count) = (devices.len(), 64usize << 10);
        let input = comm.alloc::<f32>(count).unwrap();
        let mut gathered = comm.alloc::<f32>(n * count).unwrap();
        let mut out = comm.alloc::<f32>(count).unwrap();
        let mut algs = Vec::new();
        for (r, st) in s.iter().enumerate() {
            let h = comm.rank(r).unwrap();
            algs.push(h.all_gather(&input, &mut gathered, st).unwrap().algorithm);
            algs.push(h.broadcast(&input, &mut out, 0, st).unwrap().algorithm);
        }
        cuda_multimem_tests::sync_all(&s);
        comm.check().unwrap();
        algs
    };
    let copy_engine = cuda_multimem_collectives::Algorithm::CopyEngine;
    let shared = algorithms(&placed(&sim(SimConfig::new(1, 13050)), 4));
    assert!(!shared.contains(&copy_engine), "{shared:?}");
    // the same calls on a device per rank do take the copy engines
    let two = sim(SimConfig::new(2, 13050));
    let own = algorithms(&placed(&two, 2));
    assert!(own.iter().all(|a| *a == copy_engine), "{own:?}");
}

fn replays<T: Elem>(devices: &[Device], seed: u64) {
    let (comm, s) = team_on(devices, forms_config(true), MulticastPolicy::Never);
    let mut rng = Rng::new(seed);
    let n = devices.len();
    let mut cases: Vec<Queued<T>> = Vec::new();
    for call in calls(n) {
        for mem in Mem::KINDS {
            for in_place in [false, true] {
                cases.push(Queued::new(
                    &comm,
                    call.at(),
                    1000,
                    call.params,
                    mem,
                    in_place,
                ));
            }
        }
    }
    let mut refs: Vec<&mut dyn Pending> = cases.iter_mut().map(|c| c as &mut dyn Pending).collect();
    let chose = capture_and_replay(&comm, &s, &mut refs, CaptureMode::Relaxed, 3, &mut rng);
    assert_eq!(chose.len(), calls(n).len() * 4);
}

#[test]
fn every_collective_replays_from_a_captured_graph_on_ranks_sharing_the_devices() {
    let e = env();
    for n in [3usize, 8] {
        let Some(devices) = team_devices(&e, n, "collectives::shared::graph_replays") else {
            return;
        };
        cuda_multimem_tests::for_each_elem!(replays(&devices, n as u64));
    }
}

/// A rank that never calls: every rank that did ends its barrier by its timeout and reports
/// it; nobody hangs, though all their blocks share one device.
#[test]
fn a_peer_that_never_arrives_is_a_timeout_on_every_calling_rank_of_a_shared_device() {
    let e = env();
    for n in [3usize, 5] {
        let Some(devices) = team_devices(&e, n, "collectives::shared::dead_peer") else {
            return;
        };
        let short = Duration::from_millis(500);
        let (comm, s) = team_on(
            &devices,
            CommConfig {
                timeout: short,
                first_call_timeout: Some(short),
                ll_max_bytes: 0,
                ..CommConfig::default()
            },
            MulticastPolicy::Never,
        );
        let mut buf = comm.alloc::<f32>(4096).unwrap();
        for (r, st) in s.iter().enumerate().take(n - 1) {
            comm.rank(r)
                .unwrap()
                .all_reduce_in_place(&mut buf, cuda_multimem_collectives::ReduceOp::Sum, st)
                .unwrap();
        }
        for st in s.iter().take(n - 1) {
            st.synchronize().unwrap();
        }
        for r in 0..n - 1 {
            match comm.rank(r).unwrap().check() {
                Err(Error::Timeout { .. }) | Err(Error::Unusable { .. }) => {}
                other => panic!("{n} ranks, rank {r}: expected a timeout, got {other:?}"),
            }
        }
        let _: &Stream = &s[n - 1];
    }
}

/// Ranks that disagree, on the real kernels where the driver is real (test-hw on one GPU):
/// low-latency calls of other sizes or collectives (the flags of this call's counter with
/// another header), and sizes that put one rank in the low-latency kernel and the other in a
/// barrier kernel (the polls' look at the first barrier's signals) are reported as
/// `RanksDisagree` on every rank, with the suite's generous timeout (a report that came first),
/// and the team recovers.
#[test]
fn ranks_sharing_a_device_that_disagree_are_reported_not_waited_for() {
    use cuda_multimem_collectives::ReduceOp::Sum;
    let e = env();
    let Some(devices) = team_devices(&e, 3, "collectives::shared::disagree") else {
        return;
    };
    let (comm, s) = team_on(&devices, forms_config(true), MulticastPolicy::Never);
    let mut buf = comm.alloc::<f32>(1 << 18).unwrap();
    type Step = fn(
        &cuda_multimem_collectives::RankHandle<'_>,
        &mut cuda_multimem_collectives::SymmetricBuffer<f32>,
        &Stream,
    );
    let cases: [(&str, Step, Step); 4] = [
        (
            "low-latency allreduce of 64 / 128 elements",
            |h, b, s| {
                h.all_reduce_in_place(b.slice_mut(..64).unwrap(), Sum, s)
                    .unwrap();
            },
            |h, b, s| {
                h.all_reduce_in_place(b.slice_mut(..128).unwrap(), Sum, s)
                    .unwrap();
            },
        ),
        (
            "low-latency all-gather of 96 / 192 elements",
            |h, b, s| {
                h.all_gather_in_place(b.slice_mut(..96 * 3).unwrap(), s)
                    .unwrap();
            },
            |h, b, s| {
                h.all_gather_in_place(b.slice_mut(..192 * 3).unwrap(), s)
                    .unwrap();
            },
        ),
        (
            "low-latency allreduce / two-shot allreduce",
            |h, b, s| {
                h.all_reduce_in_place(b.slice_mut(..64).unwrap(), Sum, s)
                    .unwrap();
            },
            |h, b, s| {
                h.all_reduce_in_place(b.slice_mut(..1 << 18).unwrap(), Sum, s)
                    .unwrap();
            },
        ),
        (
            "two-shot allreduce / low-latency broadcast",
            |h, b, s| {
                h.all_reduce_in_place(b.slice_mut(..1 << 18).unwrap(), Sum, s)
                    .unwrap();
            },
            |h, b, s| {
                h.broadcast_in_place(b.slice_mut(..300).unwrap(), 0, s)
                    .unwrap();
            },
        ),
    ];
    for (what, first, others) in cases {
        for (r, st) in s.iter().enumerate() {
            let h = comm.rank(r).unwrap();
            if r == 0 {
                first(&h, &mut buf, st)
            } else {
                others(&h, &mut buf, st)
            }
        }
        cuda_multimem_tests::sync_all(&s);
        match comm.check() {
            Err(Error::RanksDisagree { .. }) => {}
            other => panic!("{what}: expected a disagreement, got {other:?}"),
        }
        comm.recover().unwrap();
    }
}

/// Ranks of one process on one GPU each through a bootstrap of its own (threads) are refused on
/// every rank, naming the way that works (one Communicator over a device list with repeats): on
/// the simulator such teams ran their calls out of step.
#[test]
fn threads_of_one_process_on_one_device_with_bootstraps_of_their_own_are_refused() {
    use cuda_multimem_collectives::UnixBootstrap;
    let e = sim(SimConfig::new(1, 13050));
    let n = 3usize;
    let path = std::env::temp_dir().join(format!("cmm-shared-threads-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let driver = e.driver.clone();
            let path = path.clone();
            std::thread::spawn(move || {
                let device = driver.device(0).unwrap();
                let boot = UnixBootstrap::new(&path, rank, n, Duration::from_secs(60)).unwrap();
                Communicator::builder_with_bootstrap(&device, Box::new(boot))
                    .allow_shared_devices(true)
                    .multicast(MulticastPolicy::Never)
                    .build()
                    .map(|_| ())
            })
        })
        .collect();
    for h in handles {
        match h.join().unwrap() {
            Err(Error::InvalidArgument { arg, reason }) => {
                assert_eq!(arg, "device");
                assert!(reason.contains("allow_shared_devices"), "{reason}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}
