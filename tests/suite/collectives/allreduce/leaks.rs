//! Nothing leaks: a team leaves nothing behind, and a build that fails half way leaks nothing.

use super::*;

// ---- nothing leaks ----

fn live_without_contexts(
    sim: &cuda_multimem_sim::Simulator,
) -> std::collections::BTreeMap<String, i64> {
    sim.live_resources()
        .into_iter()
        .filter(|(k, _)| k != "primary contexts")
        .collect()
}

#[test]
fn a_team_leaves_nothing_behind() {
    let e = ar_sim(2);
    let sim = e.sim.as_ref().unwrap();
    let before = live_without_contexts(sim);
    {
        let comm = Communicator::new(&e.driver.devices()).unwrap();
        let s = streams(&comm);
        let mut buf = comm.alloc::<f32>(1 << 10).unwrap();
        let mut own: Vec<DeviceBuffer<f32>> = (0..2)
            .map(|r| DeviceBuffer::zeroed(comm.device(r).unwrap(), 10).unwrap())
            .collect();
        for (r, st) in s.iter().enumerate() {
            let h = comm.rank(r).unwrap();
            h.all_reduce_in_place(buf.slice_mut(..10).unwrap(), ReduceOp::Sum, st)
                .unwrap();
            h.all_reduce_in_place(&mut own[r], ReduceOp::Sum, st)
                .unwrap();
        }
        sync(&s);
        comm.check().unwrap();
    }
    assert_eq!(live_without_contexts(sim), before);
}

/// Fail each driver call of building a communicator (with `policy`) and allocating a buffer,
/// one per round: every failure is an error and leaves nothing behind.
fn fails_half_way(n: usize, policy: MulticastPolicy, floor: usize) {
    use cuda_multimem_sim::FailurePlan;
    use cuda_multimem_sys::CUresult;
    let e = ar_sim(n);
    let sim = e.sim.as_ref().unwrap();
    let devices = e.driver.devices();
    let small = CommConfig {
        one_shot_max_bytes: Some(4096),
        ll_max_bytes: 4096,
        stage_bytes: Some(4096),
        scratch_bytes: 16 << 10,
        multimem_capacity: 2 << 20,
        ..Default::default()
    };
    let build = || {
        Communicator::builder(&devices)
            .config(small.clone())
            .multicast(policy)
            .build()
    };
    // warm up: contexts retained, entry points resolved
    drop(build().unwrap());
    let before = live_without_contexts(sim);
    let mut failures = 0;
    for skip in 0.. {
        sim.inject_failure(FailurePlan {
            call: None,
            skip,
            code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        });
        let r = build().and_then(|c| {
            let b = c.alloc::<f32>(1 << 14)?;
            Ok((c, b))
        });
        let fired = sim.clear_failure();
        match r {
            Ok(cb) => {
                drop(cb);
                assert_eq!(live_without_contexts(sim), before);
                if fired.is_none() {
                    break;
                }
            }
            Err(err) => {
                assert!(fired.is_some(), "failed without an injected failure: {err}");
                failures += 1;
                assert_eq!(
                    live_without_contexts(sim),
                    before,
                    "after a failure at call #{skip} ({fired:?}): {err}"
                );
            }
        }
        assert!(skip < 4000, "construction never completed");
    }
    assert!(
        failures > floor,
        "only {failures} driver calls were exercised"
    );
}

#[test]
fn a_communicator_that_fails_half_way_leaks_nothing() {
    fails_half_way(2, MulticastPolicy::Never, 20);
}

#[test]
fn a_multimem_communicator_that_fails_half_way_leaks_nothing() {
    fails_half_way(2, MulticastPolicy::Always, 30);
}
