//! Logical endpoints (CUDA 13.3): id ranges, unicast and multicast endpoints, asynchronous
//! construction, binds, limits, fabric export/import, and the multicast guard.
// `is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#![allow(clippy::manual_is_multiple_of)]

use std::sync::Arc;
use std::time::Duration;

use cuda_multimem::endpoint::{EndpointFabricHandle, EndpointSpec, LogicalEndpoint};
use cuda_multimem::multicast::disable_multicast_on_this_thread;
use cuda_multimem::sys::{CUlogicalEndpointProp, CUlogicalEndpointType, CUresult};
use cuda_multimem::vmm::{Access, HandleTypes, Location, Mapping, PhysicalAllocation};
use cuda_multimem::{Driver, Error};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{env, fail_each_call, sim, skip};

use crate::safe::multicast::{dtoh, leftovers};
use cuda_multimem_tests::random_bytes as random;

const MIB: usize = 1 << 20;
/// [`MIB`] for raw driver calls, which take `u64`.
const MIB64: u64 = 1 << 20;

fn memory(d: &Driver, dev: i32, size: usize, ht: HandleTypes) -> Arc<PhysicalAllocation> {
    PhysicalAllocation::builder(d, Location::Device(dev))
        .handle_types(ht)
        .create(size)
        .unwrap()
}

fn ready_config(devices: usize, polls: u32) -> SimConfig {
    let mut c = SimConfig::new(devices, 13030);
    c.endpoint_ready_polls = polls;
    c
}

/// How long a test waits for construction it expects to finish (generous: the simulator is
/// ready after a few polls, a loaded machine may be slow to make them).
const READY: Duration = Duration::from_secs(30);

#[test]
fn logical_endpoints_are_unsupported_before_13_3() {
    let e = env();
    let d0 = e.driver.device(0).unwrap();
    let spec = EndpointSpec::unicast(&d0, 2 * MIB);
    if e.driver.version() >= 13030 {
        if !e.driver.is_simulated() {
            return skip(
                "logical_endpoints_are_unsupported_before_13_3",
                format!("driver {} has logical endpoints", e.driver.version()),
            );
        }
        let ep = LogicalEndpoint::create(&e.driver, &spec).unwrap();
        assert_eq!(ep.spec(), &spec);
        return;
    }
    let err = LogicalEndpoint::create(&e.driver, &spec).unwrap_err();
    match &err {
        Error::Unsupported { symbol, needed, .. } => {
            assert_eq!(
                (*symbol, *needed),
                ("cuLogicalEndpointCreate", 13030),
                "{err}"
            )
        }
        e => panic!("expected Unsupported, got {e:?}"),
    }
    assert_eq!(d0.logical_endpoint_multicast().unwrap(), None);
    if let Some(s) = &e.sim {
        assert_eq!(s.calls("cuLogicalEndpointIdReserve"), 0);
    }
}

#[test]
fn a_unicast_endpoint_is_ready_after_the_driver_finishes_constructing_it() {
    let e = sim(ready_config(2, 3));
    let s = e.sim.as_ref().unwrap();
    let d0 = e.driver.device(0).unwrap();
    let ep = LogicalEndpoint::create(&e.driver, &EndpointSpec::unicast(&d0, 2 * MIB)).unwrap();
    assert!(!ep.is_ready().unwrap());
    assert!(!ep.is_ready().unwrap());
    assert!(ep.is_ready().unwrap(), "ready on the third query");
    assert_eq!(s.calls("cuLogicalEndpointQuery"), 3);
    assert!(ep.is_ready().unwrap());
    assert_eq!(
        s.calls("cuLogicalEndpointQuery"),
        3,
        "remembered, not asked again"
    );
}

#[test]
fn a_multicast_endpoint_is_ready_only_after_every_member_was_added() {
    let e = sim(ready_config(3, 2));
    let d = &e.driver;
    let ep = LogicalEndpoint::create(d, &EndpointSpec::multicast(2, 2 * MIB)).unwrap();
    ep.add_device(&d.device(0).unwrap()).unwrap();
    let err = ep.wait_ready(Duration::from_millis(30)).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    ep.add_device(&d.device(1).unwrap()).unwrap();
    ep.wait_ready(READY).unwrap();
    assert_eq!(ep.members(), vec![0, 1]);
    let full = ep.add_device(&d.device(2).unwrap()).unwrap_err();
    assert!(full.to_string().contains("full"), "{full}");
    let twice = ep.add_device(&d.device(0).unwrap()).unwrap_err();
    assert!(twice.to_string().contains("already"), "{twice}");
}

#[test]
fn using_an_endpoint_before_it_is_ready_is_refused_before_the_driver() {
    let e = sim(ready_config(2, 5));
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let d0 = d.device(0).unwrap();
    let ep = LogicalEndpoint::create(d, &EndpointSpec::unicast(&d0, 2 * MIB)).unwrap();
    let a = memory(d, 0, 2 << 20, HandleTypes::NONE);
    let err = ep.bind_mem(&d0, 0, &a, 0, 2 * MIB).unwrap_err();
    assert!(err.to_string().contains("not ready"), "{err}");
    assert_eq!(s.calls("cuLogicalEndpointBindMem"), 0);
    // The raw driver refuses too (a bind before a query said ready).
    d0.bind().unwrap();
    // SAFETY: a live endpoint id and allocation handle.
    let rc = unsafe {
        d.sys().cuLogicalEndpointBindMem().unwrap()(ep.id(), 0, 0, a.raw(), 0, 2 * MIB64, 0)
    };
    assert_eq!(rc, CUresult::CUDA_ERROR_INVALID_VALUE);
    ep.wait_ready(READY).unwrap();
    let b = ep.bind_mem(&d0, 0, &a, 0, 2 * MIB).unwrap();
    assert_eq!((b.device(), b.offset(), b.size()), (0, 0, 2 * MIB));
}

#[test]
fn a_batch_shares_one_id_range_released_with_its_last_endpoint() {
    let e = sim(ready_config(2, 1));
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let d0 = d.device(0).unwrap();
    let d1 = d.device(1).unwrap();
    let specs = [
        EndpointSpec::unicast(&d0, 2 * MIB),
        EndpointSpec::unicast(&d1, 4 * MIB),
        EndpointSpec::unicast(&d0, 2 * MIB).counted_ops(true),
    ];
    let mut eps = LogicalEndpoint::create_batch(d, &specs).unwrap();
    let range = eps[0].id_range().clone();
    assert_eq!(range.len(), 3);
    for (i, ep) in eps.iter().enumerate() {
        assert_eq!(ep.id(), range.base() + i as u32, "consecutive ids");
        assert!(Arc::ptr_eq(ep.id_range(), &range));
    }
    assert!(range.query().unwrap(), "one query over the whole range");
    assert!(eps.iter().all(|e| e.is_ready().unwrap()));
    assert_eq!(
        s.calls("cuLogicalEndpointQuery"),
        1,
        "the range query marked all ready"
    );
    drop(range);
    eps.truncate(1);
    assert_eq!(s.live_resources().get("logical endpoint ids"), Some(&3));
    assert_eq!(s.calls("cuLogicalEndpointIdRelease"), 0);
    drop(eps);
    assert_eq!(s.calls("cuLogicalEndpointIdRelease"), 1);
    assert_eq!(leftovers(s), Default::default());
}

#[test]
fn a_batch_range_is_queried_and_waited_for_after_one_of_its_endpoints_is_dropped() {
    let e = sim(ready_config(2, 1));
    let d = &e.driver;
    let d0 = d.device(0).unwrap();
    let specs = [
        EndpointSpec::unicast(&d0, 2 * MIB),
        EndpointSpec::unicast(&d0, 2 * MIB),
        EndpointSpec::unicast(&d0, 2 * MIB),
    ];
    let mut eps = LogicalEndpoint::create_batch(d, &specs).unwrap();
    let range = eps[0].id_range().clone();
    // The middle one goes before anybody asked: the range stays for the other two.
    drop(eps.remove(1));
    range.wait_ready(READY).unwrap();
    assert!(range.query().unwrap());
    for ep in &eps {
        assert!(ep.is_ready().unwrap(), "endpoint {} is ready", ep.id());
    }
    let a = memory(d, 0, 2 << 20, HandleTypes::NONE);
    eps[1].bind_mem(&d0, 0, &a, 0, 2 * MIB).unwrap();
}

#[test]
fn bound_memory_is_reached_through_the_endpoint_and_unbound_on_drop() {
    let mut cfg = ready_config(2, 0);
    cfg.version = 13050;
    let e = sim(cfg);
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let ep = LogicalEndpoint::create(d, &EndpointSpec::multicast(2, 4 * MIB)).unwrap();
    for dev in d.devices() {
        ep.add_device(&dev).unwrap();
    }
    ep.wait_ready(READY).unwrap();
    let a0 = memory(d, 0, 4 << 20, HandleTypes::NONE);
    let m1 = Arc::new(
        Mapping::map_whole(
            &memory(d, 1, 4 << 20, HandleTypes::NONE),
            &[(Location::Device(1), Access::ReadWrite)],
        )
        .unwrap(),
    );
    let b0 = ep
        .bind_mem(&d.device(0).unwrap(), 2 * MIB, &a0, 2 * MIB, 2 * MIB)
        .unwrap();
    let b1 = ep.bind_addr(&d.device(1).unwrap(), 0, &m1).unwrap();
    // Device 0 is bound only at [2, 4) MiB; device 1 across [0, 4) MiB.
    let both = cuda_multimem_sim::endpoint::endpoint_targets(ep.id(), 2 * MIB64 + 8, 8).unwrap();
    assert_eq!(both.len(), 2);
    let one = cuda_multimem_sim::endpoint::endpoint_targets(ep.id(), 8, 8).unwrap();
    assert_eq!(one.len(), 1);
    let data = random(4096, 5);
    for &t in &both {
        // SAFETY: the simulator says `t` is 4096+ bytes of bound memory (host memory).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (t - 8) as *mut u8, 4096) };
    }
    let mut back = vec![0u8; 4096];
    dtoh(d, &mut back, m1.device_ptr() + 2 * MIB64).unwrap();
    assert!(back == data, "device 1's mapping sees the bytes");
    assert_eq!(
        s.live_resources().get("logical endpoint bindings"),
        Some(&2)
    );
    drop((b0, b1));
    assert_eq!(s.calls("cuLogicalEndpointUnbind"), 2);
    assert_eq!(s.live_resources().get("logical endpoint bindings"), None);
}

#[test]
fn bad_binds_are_rejected_before_the_driver() {
    let e = sim(ready_config(3, 0));
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let dev = d.devices();
    let ep = LogicalEndpoint::create(d, &EndpointSpec::multicast(2, 4 * MIB)).unwrap();
    ep.add_device(&dev[0]).unwrap();
    ep.add_device(&dev[1]).unwrap();
    ep.wait_ready(READY).unwrap();
    let align = ep.limits().bind_alignment;
    assert!(align.is_power_of_two());
    let a0 = memory(d, 0, 8 << 20, HandleTypes::NONE);
    let a2 = memory(d, 2, 2 << 20, HandleTypes::NONE);
    let before = s.calls("cuLogicalEndpointBindMem");
    let cases: Vec<(&str, Error)> = vec![
        (
            "offset",
            ep.bind_mem(&dev[0], align / 2, &a0, 0, align).unwrap_err(),
        ),
        (
            "size",
            ep.bind_mem(&dev[0], 0, &a0, 0, align + 1).unwrap_err(),
        ),
        (
            "memory offset",
            ep.bind_mem(&dev[0], 0, &a0, align / 2, align).unwrap_err(),
        ),
        (
            "size",
            ep.bind_mem(&dev[0], 2 * MIB, &a0, 0, 4 * MIB).unwrap_err(),
        ),
        (
            "size",
            ep.bind_mem(&dev[0], 0, &a0, 6 * MIB, 4 * MIB).unwrap_err(),
        ),
        (
            "device",
            ep.bind_mem(&dev[2], 0, &a2, 0, 2 * MIB).unwrap_err(),
        ),
        (
            "memory",
            ep.bind_mem(&dev[1], 0, &a0, 0, 2 * MIB).unwrap_err(),
        ),
        ("size", ep.bind_mem(&dev[0], 0, &a0, 0, 0).unwrap_err()),
    ];
    for (arg, err) in cases {
        assert!(
            matches!(&err, Error::InvalidArgument { arg: a, .. } if *a == arg),
            "expected a complaint about {arg}, got {err}"
        );
    }
    assert_eq!(s.calls("cuLogicalEndpointBindMem"), before);
    let uni = LogicalEndpoint::create(d, &EndpointSpec::unicast(&dev[0], 2 * MIB)).unwrap();
    uni.wait_ready(READY).unwrap();
    let a1 = memory(d, 1, 2 << 20, HandleTypes::NONE);
    let owner = uni.bind_mem(&dev[1], 0, &a1, 0, 2 * MIB).unwrap_err();
    assert!(owner.to_string().contains("owner"), "{owner}");
    let add = uni.add_device(&dev[1]).unwrap_err();
    assert!(add.to_string().contains("unicast"), "{add}");
}

#[test]
fn specs_are_checked_against_the_limits_and_the_devices() {
    let mut cfg = ready_config(2, 0);
    cfg.devices[1].logical_endpoint_unicast = false;
    cfg.devices[1].fabric_handle = false;
    let e = sim(cfg);
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let d0 = d.device(0).unwrap();
    let d1 = d.device(1).unwrap();
    let l = EndpointSpec::multicast(2, 2 * MIB).limits(d).unwrap();
    let err =
        LogicalEndpoint::create(d, &EndpointSpec::multicast(2, l.bind_alignment + 1)).unwrap_err();
    assert!(err.to_string().contains("bind alignment"), "{err}");
    let err = LogicalEndpoint::create(
        d,
        &EndpointSpec::multicast(2, l.max_size + l.bind_alignment),
    )
    .unwrap_err();
    assert!(err.to_string().contains("maximum"), "{err}");
    let err = LogicalEndpoint::create(d, &EndpointSpec::unicast(&d1, 2 * MIB)).unwrap_err();
    assert!(
        matches!(err, Error::DeviceUnsupported { device: 1, .. }),
        "{err}"
    );
    let err = LogicalEndpoint::create(d, &EndpointSpec::multicast(0, 2 * MIB)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let err = LogicalEndpoint::create(d, &EndpointSpec::unicast(&d0, 0)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let err = LogicalEndpoint::create_batch(d, &[]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert_eq!(s.calls("cuLogicalEndpointCreate"), 0);
    assert_eq!(s.calls("cuLogicalEndpointIdReserve"), 0);
}

#[test]
fn the_simulator_follows_the_documented_rules_for_raw_calls() {
    let e = sim(ready_config(2, 0));
    let d = &e.driver;
    d.device(0).unwrap().bind().unwrap();
    let sys = d.sys();
    let mut base = 0;
    let mut prop = CUlogicalEndpointProp {
        type_: CUlogicalEndpointType::CU_LOGICAL_ENDPOINT_TYPE_UNICAST,
        size: 2 * MIB64,
        ..Default::default()
    };
    let a = memory(d, 0, 4 << 20, HandleTypes::NONE);
    // SAFETY (whole block): valid out-pointers, property blocks and handles made here.
    unsafe {
        let reserve = sys.cuLogicalEndpointIdReserve().unwrap();
        let release = sys.cuLogicalEndpointIdRelease().unwrap();
        let create = sys.cuLogicalEndpointCreate().unwrap();
        let destroy = sys.cuLogicalEndpointDestroy().unwrap();
        let query = sys.cuLogicalEndpointQuery().unwrap();
        let bind = sys.cuLogicalEndpointBindMem().unwrap();
        let unbind = sys.cuLogicalEndpointUnbind().unwrap();
        assert_eq!(reserve(&mut base, 0), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(reserve(&mut base, 2), CUresult::CUDA_SUCCESS);
        assert_eq!(
            create(base + 5, &prop),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "not reserved"
        );
        assert_eq!(create(base, &prop), CUresult::CUDA_SUCCESS);
        assert_eq!(
            create(base, &prop),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "id in use"
        );
        let mut status = 7;
        assert_eq!(
            query(base, 2, &mut status),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "id without endpoint"
        );
        prop.size = 4 * MIB64;
        assert_eq!(create(base + 1, &prop), CUresult::CUDA_SUCCESS);
        assert_eq!(query(base, 2, &mut status), CUresult::CUDA_SUCCESS);
        assert_eq!(status, 1);
        assert_eq!(
            release(base, 2),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "endpoints still live"
        );
        assert_eq!(
            bind(base + 1, 0, 0, a.raw(), 0, 2 * MIB64, 0),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            bind(base + 1, 0, 2 * MIB64, a.raw(), 2 * MIB64, 2 * MIB64, 0),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            bind(base + 1, 0, 0, a.raw(), 0, 2 * MIB64, 0),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "overlap"
        );
        assert_eq!(
            bind(base + 1, 1, 0, a.raw(), 0, 2 * MIB64, 0),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "not the owner"
        );
        assert_eq!(
            unbind(base + 1, 0, 2 * MIB64, 4 * MIB64),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "past the bindings"
        );
        assert_eq!(
            unbind(base + 1, 0, MIB64, MIB64),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "not at a bind offset"
        );
        assert_eq!(
            unbind(base + 1, 0, 0, 4 * MIB64),
            CUresult::CUDA_SUCCESS,
            "two binds at once"
        );
        assert_eq!(
            bind(base + 1, 0, 0, a.raw(), 0, 2 * MIB64, 0),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(destroy(base + 1), CUresult::CUDA_SUCCESS, "destroy unbinds");
        assert_eq!(destroy(base), CUresult::CUDA_SUCCESS);
        assert_eq!(destroy(base), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(release(base, 2), CUresult::CUDA_SUCCESS);
        assert_eq!(
            release(base, 2),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "released twice"
        );
    }
    assert_eq!(
        leftovers(e.sim.as_ref().unwrap()).get("logical endpoint bindings"),
        None
    );
}

#[test]
fn fabric_handles_round_trip_and_garbage_is_rejected() {
    let e = sim(ready_config(2, 1));
    let d = &e.driver;
    let spec = EndpointSpec::multicast(2, 2 * MIB).fabric_handle(true);
    let ep = LogicalEndpoint::create(d, &spec).unwrap();
    let h = ep.export_fabric().unwrap();
    let imported = LogicalEndpoint::import_fabric(d, &h, &spec).unwrap();
    assert!(imported.is_imported() && imported.id() != ep.id());
    ep.add_device(&d.device(0).unwrap()).unwrap();
    ep.add_device(&d.device(1).unwrap()).unwrap();
    ep.wait_ready(READY).unwrap();
    imported.wait_ready(READY).unwrap();
    // An exportable multicast endpoint binds only shareable memory.
    let plain = memory(d, 1, 2 << 20, HandleTypes::NONE);
    // SAFETY: live ids and handles.
    let rc = unsafe {
        d.device(1).unwrap().bind().unwrap();
        d.sys().cuLogicalEndpointBindMem().unwrap()(
            imported.id(),
            1,
            0,
            plain.raw(),
            0,
            2 * MIB64,
            0,
        )
    };
    assert_eq!(rc, CUresult::CUDA_ERROR_INVALID_VALUE);
    let shareable = memory(d, 1, 2 << 20, HandleTypes::FABRIC);
    let b = imported
        .bind_mem(&d.device(1).unwrap(), 0, &shareable, 0, 2 * MIB)
        .unwrap();
    let t = cuda_multimem_sim::endpoint::endpoint_targets(ep.id(), 0, 64).unwrap();
    assert_eq!(
        t.len(),
        1,
        "the exporter's endpoint sees the importer's binding"
    );
    drop(b);
    let short = EndpointFabricHandle::from_bytes(&[0u8; 12]).unwrap_err();
    assert!(
        matches!(short, Error::InvalidArgument { arg: "bytes", .. }),
        "{short}"
    );
    let garbage =
        LogicalEndpoint::import_fabric(d, &EndpointFabricHandle([7; 64]), &spec).unwrap_err();
    assert_eq!(
        garbage.code(),
        Some(CUresult::CUDA_ERROR_INVALID_VALUE),
        "{garbage}"
    );
    let plain_ep = LogicalEndpoint::create(d, &EndpointSpec::multicast(2, 2 * MIB)).unwrap();
    assert!(plain_ep.export_fabric().is_err(), "not created exportable");
    drop((imported, ep, plain_ep, plain, shareable));
    assert_eq!(leftovers(e.sim.as_ref().unwrap()), Default::default());
}

#[test]
fn the_guard_refuses_multicast_endpoints_but_not_unicast_ones() {
    let e = sim(ready_config(2, 0));
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let _off = disable_multicast_on_this_thread();
    let err = LogicalEndpoint::create(d, &EndpointSpec::multicast(2, 2 * MIB)).unwrap_err();
    assert!(matches!(err, Error::Disabled { .. }), "{err}");
    let err = EndpointSpec::multicast(2, 2 * MIB).limits(d).unwrap_err();
    assert!(matches!(err, Error::Disabled { .. }), "{err}");
    assert_eq!(
        s.calls("cuLogicalEndpointGetLimits"),
        0,
        "refused before any driver call"
    );
    assert_eq!(s.calls("cuLogicalEndpointIdReserve"), 0);
    LogicalEndpoint::create(d, &EndpointSpec::unicast(&d.device(0).unwrap(), 2 * MIB)).unwrap();
}

#[test]
fn a_failure_at_any_step_leaks_nothing() {
    let e = sim(ready_config(2, 1));
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let attempt = || -> Result<_, Error> {
        let eps = LogicalEndpoint::create_batch(
            d,
            &[
                EndpointSpec::multicast(2, 2 * MIB),
                EndpointSpec::unicast(&d.device(1).unwrap(), 2 * MIB),
            ],
        )?;
        for dev in d.devices() {
            eps[0].add_device(&dev)?;
        }
        eps[0].id_range().wait_ready(READY)?;
        let a = PhysicalAllocation::builder(d, Location::Device(1)).create(2 << 20)?;
        let b0 = eps[0].bind_mem(&d.device(1).unwrap(), 0, &a, 0, 2 * MIB)?;
        let b1 = eps[1].bind_mem(&d.device(1).unwrap(), 0, &a, 0, 2 * MIB)?;
        Ok((b0, b1, eps, a))
    };
    drop(attempt().unwrap()); // resolve every entry point first
    let injected = fail_each_call(s, attempt, |_| {});
    assert!(injected >= 8, "{injected}");
}

/// Child mode of the next test: the hex bytes of the exported endpoint.
const CHILD_HANDLE: &str = "CUDA_MULTIMEM_LE_CHILD_HANDLE";

fn endpoint_child(hex: &str) {
    use std::io::{BufRead, Write};
    let mut cfg = ready_config(2, 2);
    cfg.version = 13050;
    let e = sim(cfg);
    let d = &e.driver;
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let spec = EndpointSpec::multicast(2, 2 * MIB).fabric_handle(true);
    let ep = LogicalEndpoint::import_fabric(
        d,
        &EndpointFabricHandle::from_bytes(&bytes).unwrap(),
        &spec,
    )
    .unwrap();
    let dev1 = d.device(1).unwrap();
    ep.add_device(&dev1).unwrap();
    ep.wait_ready(Duration::from_secs(30)).unwrap();
    let mem = memory(d, 1, 2 << 20, HandleTypes::FABRIC);
    let own = Mapping::map_whole(&mem, &[(Location::Device(1), Access::ReadWrite)]).unwrap();
    let b = ep.bind_mem(&dev1, 0, &mem, 0, 2 * MIB).unwrap();
    let say = |s: &str| {
        println!("@@{s}");
        std::io::stdout().flush().unwrap();
    };
    say("BOUND");
    let mut lines = std::io::stdin().lock().lines();
    assert_eq!(lines.next().unwrap().unwrap(), "CHECK");
    let mut back = vec![0u8; 4096];
    dtoh(d, &mut back, own.device_ptr() + 4096).unwrap();
    say(if back == random(4096, 91) {
        "SAW-OK"
    } else {
        "SAW-BAD"
    });
    assert_eq!(lines.next().unwrap().unwrap(), "DONE");
    drop((b, ep, own, mem));
}

#[test]
fn an_endpoint_exported_as_a_fabric_handle_works_in_another_process() {
    use std::io::{BufRead, BufReader, Write};
    if let Ok(h) = std::env::var(CHILD_HANDLE) {
        return endpoint_child(&h);
    }
    let mut cfg = ready_config(2, 2);
    cfg.version = 13050;
    let e = sim(cfg);
    let d = &e.driver;
    let spec = EndpointSpec::multicast(2, 2 * MIB).fabric_handle(true);
    let ep = LogicalEndpoint::create(d, &spec).unwrap();
    let hex: String = ep
        .export_fabric()
        .unwrap()
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dev0 = d.device(0).unwrap();
    ep.add_device(&dev0).unwrap();
    let mut child = cuda_multimem_tests::child_test(
        "safe::endpoint::an_endpoint_exported_as_a_fabric_handle_works_in_another_process",
    )
    .env(CHILD_HANDLE, hex)
    .stdin(std::process::Stdio::piped())
    .stdout(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let mut to_child = child.stdin.take().unwrap();
    let mut from_child = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut expect = |what: &str| loop {
        let l = from_child.next().expect("child output").unwrap();
        if let Some(i) = l.find("@@") {
            let got = l[i + 2..].trim().to_string();
            if got.starts_with("SAW-") || got == what {
                return got;
            }
        }
    };
    // Ready only once the child added its device: the team is shared.
    ep.wait_ready(Duration::from_secs(30)).unwrap();
    let mem = memory(d, 0, 2 << 20, HandleTypes::FABRIC);
    let own = Mapping::map_whole(&mem, &[(Location::Device(0), Access::ReadWrite)]).unwrap();
    let b = ep.bind_mem(&dev0, 0, &mem, 0, 2 * MIB).unwrap();
    assert_eq!(expect("BOUND"), "BOUND");
    // A fabric copy to the endpoint reaches both processes' memory.
    let team_targets = cuda_multimem_sim::endpoint::endpoint_targets(ep.id(), 4096, 4096).unwrap();
    assert_eq!(team_targets.len(), 2, "both processes' bindings");
    let data = random(4096, 91);
    let stream = cuda_multimem::Stream::new(&dev0).unwrap();
    let mut op = cuda_multimem::sys::CUDA_FABRIC_COPY_BATCH_OP {
        size: 4096,
        ..Default::default()
    };
    op.src.type_ = cuda_multimem::sys::CUfabricCpyOperandType::CU_FABRIC_COPY_OPERAND_TYPE_POINTER;
    op.src.op.ptr.ptr = data.as_ptr() as u64;
    op.dst.type_ =
        cuda_multimem::sys::CUfabricCpyOperandType::CU_FABRIC_COPY_OPERAND_TYPE_LOGICAL_ENDPOINT;
    op.dst.op.le.id = ep.id();
    op.dst.op.le.offset = 4096;
    // SAFETY: one operation; `data` outlives the synchronisation below.
    let rc = unsafe { d.sys().cuFabricCpyBatchAsync().unwrap()(1, &mut op, 0, stream.raw()) };
    assert_eq!(rc, CUresult::CUDA_SUCCESS);
    stream.synchronize().unwrap();
    let mut back = vec![0u8; 4096];
    dtoh(d, &mut back, own.device_ptr() + 4096).unwrap();
    assert!(back == data, "the exporter's memory");
    writeln!(to_child, "CHECK").unwrap();
    assert_eq!(
        expect("SAW-OK"),
        "SAW-OK",
        "the importer's memory got the copy"
    );
    writeln!(to_child, "DONE").unwrap();
    drop(to_child);
    assert!(child.wait().unwrap().success());
    drop((b, ep, stream, own, mem));
    assert_eq!(leftovers(e.sim.as_ref().unwrap()), Default::default());
}
