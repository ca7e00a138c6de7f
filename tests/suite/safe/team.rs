//! Teams: a multicast range over devices, on logical endpoints (13.3+) or multicast objects.
//! Every team is built on an explicit simulator: building one on real GPUs creates multicast
//! objects, which the GPU machines forbid.

use cuda_multimem::multicast::disable_multicast_on_this_thread;
use cuda_multimem::team::{choose_backend, Backend, Team};
use cuda_multimem::Error;
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{env, fail_each_call, sim, Rng};

use crate::safe::multicast::leftovers;
use cuda_multimem_tests::random_bytes as random;

const MIB: usize = 1 << 20;

#[test]
fn the_backend_is_endpoints_from_13_3_and_multicast_objects_before() {
    for (v, expect) in [
        (13000, Backend::MulticastObject),
        (13010, Backend::MulticastObject),
        (13030, Backend::LogicalEndpoint),
        (13050, Backend::LogicalEndpoint),
    ] {
        let e = sim(SimConfig::new(2, v));
        let t = Team::new(&e.driver.devices(), 2 * MIB).unwrap();
        assert_eq!(t.backend(), expect, "driver {v}");
        assert_eq!(
            t.multicast_address().is_some(),
            expect == Backend::MulticastObject
        );
        assert_eq!(t.endpoint().is_some(), expect == Backend::LogicalEndpoint);
    }
    let e = sim(SimConfig::new(2, 13030).with_all(|d| {
        d.logical_endpoint_multicast = false;
    }));
    let t = Team::new(&e.driver.devices(), 2 * MIB).unwrap();
    assert_eq!(
        t.backend(),
        Backend::MulticastObject,
        "devices without endpoints"
    );
    drop((t, e));
    let e = sim(SimConfig::new(2, 13030));
    let t = Team::builder(&e.driver.devices())
        .size(2 * MIB)
        .backend(Backend::MulticastObject)
        .build()
        .unwrap();
    assert_eq!(t.backend(), Backend::MulticastObject, "forced");
}

fn store_reaches_every_member(version: i32, n: usize, seed: u64) {
    let e = sim(SimConfig::new(n, version));
    let t = Team::new(&e.driver.devices(), 3 * MIB).unwrap();
    assert_eq!(t.size(), 4 * MIB, "rounded up to the 2 MiB granularity");
    let mut rng = Rng::new(seed);
    for round in 0..4 {
        let len = 1 + (rng.next_u64() % (64 * 1024)) as usize;
        let offset = (rng.next_u64() as usize) % (t.size() - len);
        let data = random(len, seed + round);
        t.store(offset, &data).unwrap();
        for m in 0..n {
            let mut back = vec![0u8; len];
            t.load(m, offset, &mut back).unwrap();
            assert!(back == data, "member {m}, driver {version}, round {round}");
        }
    }
    drop(t);
    assert_eq!(leftovers(e.sim.as_ref().unwrap()), Default::default());
}

#[test]
fn a_store_reaches_every_member_on_multicast_objects() {
    store_reaches_every_member(13000, 2, 1);
    store_reaches_every_member(13010, 4, 2);
}

#[test]
fn a_store_reaches_every_member_on_logical_endpoints() {
    store_reaches_every_member(13050, 2, 3);
    store_reaches_every_member(13050, 3, 4);
}

#[test]
fn storing_through_endpoints_needs_the_13_5_fabric_copy() {
    let e = sim(SimConfig::new(2, 13030));
    let t = Team::new(&e.driver.devices(), 2 * MIB).unwrap();
    assert_eq!(t.backend(), Backend::LogicalEndpoint);
    let err = t.store(0, &[1, 2, 3]).unwrap_err();
    match err {
        Error::Unsupported { symbol, needed, .. } => {
            assert_eq!((symbol, needed), ("cuFabricCpyBatchAsync", 13050))
        }
        e => panic!("expected Unsupported, got {e:?}"),
    }
    // Each member's own memory is still there to use.
    let mut b = [9u8; 3];
    t.load(1, 0, &mut b).unwrap();
    assert_eq!(b, [0, 0, 0]);
}

#[test]
fn bad_teams_are_rejected_before_the_driver() {
    let mut cfg = SimConfig::new(4, 13010);
    cfg.devices[3].clique = 1;
    let e = sim(cfg);
    let s = e.sim.as_ref().unwrap();
    let dev = e.driver.devices();
    let one = Team::new(&dev[..1], 2 * MIB).unwrap_err();
    assert!(one.to_string().contains("one device"), "{one}");
    let cliques = Team::new(&[dev[0].clone(), dev[3].clone()], 2 * MIB).unwrap_err();
    assert!(cliques.to_string().contains("clique"), "{cliques}");
    let twice = Team::new(&[dev[0].clone(), dev[0].clone()], 2 * MIB).unwrap_err();
    assert!(twice.to_string().contains("twice"), "{twice}");
    let empty = Team::new(&dev[..2], 0).unwrap_err();
    assert!(
        matches!(empty, Error::InvalidArgument { arg: "size", .. }),
        "{empty}"
    );
    assert_eq!(s.calls("cuMulticastCreate"), 0);
    let t = Team::new(&dev[..3], 2 * MIB).unwrap();
    let out = t.store(t.size() - 1, &[1, 2]).unwrap_err();
    assert!(matches!(out, Error::InvalidArgument { .. }), "{out}");
    assert!(t.load(3, 0, &mut [0u8; 1]).is_err(), "no member 3");
}

#[test]
fn devices_of_two_driver_values_are_refused_as_such_not_as_other_cliques() {
    let e = sim(SimConfig::new(2, 13010));
    let s = e.sim.as_ref().unwrap();
    let other = cuda_multimem_sim::driver_over(s).unwrap();
    let (a, b) = (e.driver.devices(), other.devices());
    for members in [[a[0].clone(), b[1].clone()], [a[0].clone(), b[0].clone()]] {
        let err = Team::new(&members, 2 * MIB).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { arg: "devices", ref reason }
                if reason.contains("another Driver value")),
            "{err}"
        );
    }
    assert_eq!(s.calls("cuMulticastCreate"), 0);
}

#[test]
fn a_machine_without_multicast_gets_a_clear_error() {
    let e = sim(SimConfig::new(2, 13010).with_all(|d| d.multicast = false));
    let err = Team::new(&e.driver.devices(), 2 * MIB).unwrap_err();
    assert!(matches!(err, Error::DeviceUnsupported { .. }), "{err}");
    assert!(choose_backend(&e.driver, &e.driver.devices()).is_err());
}

#[test]
fn the_guard_refuses_both_backends_before_any_driver_call() {
    for v in [13010, 13030] {
        let e = sim(SimConfig::new(2, v));
        let s = e.sim.as_ref().unwrap();
        let _off = disable_multicast_on_this_thread();
        let err = Team::new(&e.driver.devices(), 2 * MIB).unwrap_err();
        assert!(matches!(err, Error::Disabled { .. }), "{err}");
        assert_eq!(
            s.calls("cuMulticastGetGranularity") + s.calls("cuMulticastCreate"),
            0
        );
        assert_eq!(
            s.calls("cuLogicalEndpointGetLimits") + s.calls("cuLogicalEndpointIdReserve"),
            0
        );
        assert_eq!(s.calls("cuMemCreate"), 0);
    }
}

#[test]
fn a_team_on_the_environment_driver_is_refused_when_multicast_is_off() {
    // Safe on real GPUs: the thread override refuses before anything is created.
    let e = env();
    if e.driver.device_count() < 2 {
        return cuda_multimem_tests::skip(
            "a_team_on_the_environment_driver_is_refused_when_multicast_is_off",
            "needs two devices",
        );
    }
    let _off = disable_multicast_on_this_thread();
    let err = Team::new(&e.driver.devices()[..2], 2 * MIB).unwrap_err();
    assert!(matches!(err, Error::Disabled { .. }), "{err}");
}

#[test]
fn a_failure_at_any_step_of_building_a_team_leaks_nothing() {
    for v in [13010, 13050] {
        let mut cfg = SimConfig::new(2, v);
        cfg.endpoint_ready_polls = 1;
        let e = sim(cfg);
        let s = e.sim.as_ref().unwrap();
        let devices = e.driver.devices();
        let build = || Team::new(&devices, 2 * MIB).and_then(|t| t.store(0, &[1]).map(|()| t));
        drop(build().unwrap()); // resolve every entry point first
        let injected = fail_each_call(s, build, |_| {});
        assert!(injected >= 10, "driver {v}: {injected}");
    }
}

#[test]
fn a_failure_at_any_step_of_building_an_endpoint_team_at_13_3_leaks_nothing() {
    let mut cfg = SimConfig::new(3, 13030);
    cfg.endpoint_ready_polls = 2;
    let e = sim(cfg);
    let s = e.sim.as_ref().unwrap();
    let devices = e.driver.devices();
    drop(Team::new(&devices, 2 * MIB).unwrap()); // resolve every entry point first
    let injected = fail_each_call(
        s,
        || Team::new(&devices, 2 * MIB),
        |t| assert_eq!(t.backend(), Backend::LogicalEndpoint),
    );
    assert!(injected >= 12, "{injected}");
}

#[test]
fn dropping_a_team_tears_down_in_the_drivers_order() {
    // The simulator refuses an unbind while mapped and a release while bound
    // (CUDA_ERROR_ILLEGAL_STATE), which would leave resources live: none may be.
    let e = sim(SimConfig::new(3, 13010));
    let s = e.sim.as_ref().unwrap();
    let t = Team::new(&e.driver.devices(), 4 * MIB).unwrap();
    let live = s.live_resources();
    assert_eq!(live.get("multicast bindings"), Some(&3));
    assert_eq!(live.get("multicast mappings"), Some(&1));
    drop(t);
    assert_eq!(leftovers(s), Default::default());
    assert_eq!(s.calls("cuMulticastUnbind"), 3);
}

#[test]
fn the_multicast_endpoint_and_team_types_can_move_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Team>();
    send_sync::<cuda_multimem::multicast::MulticastObject>();
    send_sync::<cuda_multimem::multicast::MulticastBinding>();
    send_sync::<cuda_multimem::multicast::MulticastMapping>();
    send_sync::<cuda_multimem::endpoint::LogicalEndpoint>();
    send_sync::<cuda_multimem::endpoint::EndpointBinding>();
    send_sync::<cuda_multimem::endpoint::IdRange>();
    // And a team built on one thread is used and dropped on another.
    let e = sim(SimConfig::new(2, 13010));
    let t = Team::new(&e.driver.devices(), 2 * MIB).unwrap();
    std::thread::spawn(move || {
        t.store(0, &[7; 16]).unwrap();
        let mut b = [0u8; 16];
        t.load(1, 0, &mut b).unwrap();
        assert_eq!(b, [7; 16]);
    })
    .join()
    .unwrap();
    assert_eq!(leftovers(e.sim.as_ref().unwrap()), Default::default());
}

#[test]
fn a_zero_length_store_or_load_is_a_no_op_with_its_offset_checked() {
    let e = sim(SimConfig::new(2, 13010));
    let t = Team::new(&e.driver.devices(), 2 * MIB).unwrap();
    let data = random(4096, 3);
    t.store(0, &data).unwrap();
    t.store(t.size(), &[]).unwrap();
    t.load(1, t.size(), &mut []).unwrap();
    let mut back = vec![0u8; 4096];
    t.load(1, 0, &mut back).unwrap();
    assert!(back == data, "nothing was changed");
    assert!(matches!(
        t.store(t.size() + 1, &[]),
        Err(Error::InvalidArgument { arg: "offset", .. })
    ));
    assert!(matches!(
        t.load(0, t.size() + 1, &mut []),
        Err(Error::InvalidArgument { arg: "offset", .. })
    ));
    assert!(t.load(2, 0, &mut []).is_err(), "no member 2");
    // the offset inside, the caller's slice reaching past the end: the slice is named
    assert!(matches!(
        t.store(t.size() - 8, &[0; 16]),
        Err(Error::InvalidArgument { arg: "data", .. })
    ));
    assert!(matches!(
        t.load(0, t.size() - 8, &mut [0; 16]),
        Err(Error::InvalidArgument { arg: "out", .. })
    ));
}
