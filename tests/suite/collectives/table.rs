//! The collectives' table, iterated: every collective, every element type, every operator and
//! root the table names, every operand kind (symmetric buffers aligned and not, the caller's
//! own memory), in place and out of place, equals the library's host reference — on a team of
//! 2 on the driver `CUDA_MULTIMEM_DRIVER` selects and on simulated teams of 3 to 8; and every
//! collective replays from a captured graph with new inputs.

use cuda_multimem::{CaptureMode, Device};
use cuda_multimem_collectives::kernels::MAX_RANKS;
use cuda_multimem_collectives::{Algorithm, CommConfig, MulticastPolicy, ReduceOp};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::collectives::{
    calls, capture_and_replay, once, Call, Elem, Mem, Pending, Queued,
};
use cuda_multimem_tests::{env, sim, skip, team_on, Rng};

/// The first two devices of the chosen driver, or a printed skip.
fn two_devices(test: &str) -> Option<(cuda_multimem_tests::Env, Vec<Device>)> {
    let e = env();
    let d = e.driver.devices();
    if d.len() < 2 {
        skip(
            test,
            format!("needs 2 devices, the machine has {}", d.len()),
        );
        return None;
    }
    if !d[0].can_access_peer(&d[1]).unwrap_or(false) {
        skip(test, "devices 0 and 1 cannot access each other");
        return None;
    }
    let two = d[..2].to_vec();
    Some((e, two))
}

/// Every call of the table at `counts`, every operand placement of `mems`, in place and not.
fn sweep<T: Elem>(devices: &[Device], counts: &[usize], mems: &[Mem], seed: u64) {
    let (comm, s) = team_on(devices, CommConfig::default(), MulticastPolicy::Never);
    let mut rng = Rng::new(seed);
    for call in calls(devices.len()) {
        for &count in counts {
            for &mem in mems {
                for in_place in [false, true] {
                    once::<T>(&comm, &s, call, count, mem, in_place, &mut rng);
                }
            }
        }
    }
}

#[test]
fn every_collective_equals_its_host_reference_for_every_dtype_and_operand_kind() {
    let Some((_e, devices)) = two_devices("collectives::table::every_collective") else {
        return;
    };
    cuda_multimem_tests::for_each_elem!(sweep(&devices, &[1, 7, 1000, 4099], &Mem::ALL, 3));
}

#[test]
fn every_collective_equals_its_host_reference_on_simulated_teams_of_3_to_8() {
    for (n, seed) in [(3usize, 4u64), (5, 5), (8, 6)] {
        let e = sim(SimConfig::new(n, 13000));
        let devices = e.driver.devices();
        cuda_multimem_tests::for_each_elem!(sweep(&devices, &[1, 7, 1000], &Mem::ALL, seed));
    }
}

/// Small staging and low-latency areas for the largest teams on the simulator (every rank's are
/// `2 × N` slots): 16 KiB one-shot staging, 8 KiB low-latency slots, few blocks of few threads.
fn small_areas() -> CommConfig {
    CommConfig {
        ll_max_bytes: 4 << 10,
        gather_ll_max_bytes: 8 << 10,
        broadcast_ll_max_bytes: 4 << 10,
        norm_ll_max_bytes: 4 << 10,
        one_shot_max_bytes: Some(16 << 10),
        stage_bytes: Some(16 << 10),
        scratch_bytes: 3 << 20,
        threads: 64,
        push_threads: 64,
        max_blocks: 2,
        ..CommConfig::default()
    }
}

/// One pass of the table (every collective, its first operator or root and its last root, f32,
/// symmetric and own operands, one count in the low-latency forms and one above them) on
/// simulated teams of 16 and of `MAX_RANKS` (one NVL72 domain): the team sizes the pad, the
/// barrier's three rounds of warp 0 and the parts of fewer elements than ranks (7 elements on
/// 16 or 72 ranks) take.
#[test]
fn every_collective_equals_its_host_reference_on_simulated_teams_of_16_and_max_ranks() {
    for (n, seed) in [(16usize, 11u64), (MAX_RANKS, 12)] {
        let e = sim(SimConfig::new(n, 13000));
        let devices = e.driver.devices();
        let (comm, s) = team_on(&devices, small_areas(), MulticastPolicy::Never);
        let mut rng = Rng::new(seed);
        let mut seen = Vec::new();
        for call in calls(n) {
            // one operator per reducing collective (every operator runs at 3 to 8 ranks)
            if seen.contains(&(call.name, call.params.root)) {
                continue;
            }
            seen.push((call.name, call.params.root));
            for (count, mem) in [(7, Mem::SYM), (1500, Mem::OWN), (1000, Mem::SYM_ODD)] {
                once::<f32>(&comm, &s, call, count, mem, false, &mut rng);
            }
        }
        assert!(seen.len() >= 6, "{seen:?}");
        // the two-shots (the pass above ran the one-shots) and the norm's two-shot, forced, at
        // counts below the team size (parts and norm rows of which most ranks own none) and above
        for alg in [Algorithm::TwoShot, Algorithm::TwoShotPush] {
            let config = CommConfig {
                algorithm: Some(alg),
                ..small_areas()
            };
            let (comm, s) = team_on(&devices, config, MulticastPolicy::Never);
            for count in [7, 1000] {
                let sum = Call::all_reduce(ReduceOp::Sum);
                let q = once::<f32>(&comm, &s, sum, count, Mem::SYM, false, &mut rng);
                if count == 1000 {
                    assert_eq!(q.choices[0].algorithm, alg, "{n} ranks: {}", q.choices[0]);
                }
            }
            if alg == Algorithm::TwoShot {
                // 5 rows of 64: fewer rows than ranks
                once::<f32>(&comm, &s, Call::norm(64), 5 * 64, Mem::SYM, false, &mut rng);
            }
        }
    }
}

/// Every collective, both operand kinds, in place and not, captured on every rank into one
/// graph and replayed three times with new inputs.
fn replays<T: Elem>(devices: &[Device], count: usize, seed: u64) {
    let (comm, s) = team_on(devices, CommConfig::default(), MulticastPolicy::Never);
    let mut rng = Rng::new(seed);
    let n = devices.len();
    let mut cases: Vec<Queued<T>> = Vec::new();
    for call in calls(n) {
        for mem in Mem::KINDS {
            for in_place in [false, true] {
                cases.push(Queued::new(
                    &comm,
                    call.at(),
                    count,
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
fn every_collective_replays_from_a_captured_graph_with_new_inputs() {
    if let Some((_e, devices)) = two_devices("collectives::table::graph_replays") {
        cuda_multimem_tests::for_each_elem!(replays(&devices, 1000, 7));
    }
    let e = sim(SimConfig::new(3, 13000));
    replays::<f32>(&e.driver.devices(), 3001, 8);
}

/// The table's shape: every entry's counts, in-place offsets and bandwidth factor are
/// consistent (what the runner relies on), for teams of 1 to 72.
#[test]
fn the_table_describes_every_collective_consistently_for_teams_of_1_to_72() {
    let table = cuda_multimem_tests::collectives::table::<f32>();
    let names: Vec<&str> = table.iter().map(|c| c.name).collect();
    assert_eq!(
        names,
        [
            "all_reduce",
            "reduce_scatter",
            "all_gather",
            "broadcast",
            "all_reduce_add_rms_norm"
        ]
    );
    for c in &table {
        for n in 1..=72 {
            for count in [0usize, 1, 7, 1000] {
                let (il, ol) = (c.counts)(n, count);
                for r in 0..n {
                    let ip = (c.in_place)(n, r, count);
                    assert!(ip.input + il <= ip.len, "{c:?} n {n} rank {r}");
                    assert!(ip.output + ol <= ip.len, "{c:?} n {n} rank {r}");
                    assert_eq!(ip.len, il.max(ol), "{c:?} n {n}");
                }
            }
            let f = (c.bus_factor)(n);
            assert!((0.0..=2.0).contains(&f), "{c:?} n {n}: {f}");
        }
        let call = Call {
            name: c.name,
            params: Default::default(),
        };
        assert_eq!(call.counts(4, 10), (c.counts)(4, 10));
    }
}
