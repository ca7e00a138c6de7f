//! Multicast objects on the simulator: granularity, create, add, binds, mapping, stores that
//! reach every bound device, teardown order, export and import, failures at every step.

use super::*;

#[test]
fn multicast_is_unsupported_before_driver_12_1_and_nothing_is_called() {
    let e = sim(SimConfig::new(2, 12000));
    let s = e.sim.as_ref().unwrap();
    let err = MulticastObject::new(&e.driver, &MulticastSpec::new(2, 2 * MIB)).unwrap_err();
    match &err {
        Error::Unsupported {
            symbol,
            needed,
            driver,
            ..
        } => {
            assert_eq!(*symbol, "cuMulticastGetGranularity");
            assert_eq!((*needed, *driver), (12010, 12000));
        }
        e => panic!("expected Unsupported, got {e:?}"),
    }
    assert_eq!(s.calls("cuMulticastCreate"), 0);
    assert!(!e.driver.device(0).unwrap().supports_multicast().unwrap());
}

#[test]
fn granularity_is_reported_and_the_size_is_rounded_up_to_it() {
    for v in [12010, 13000, 13010, 13050] {
        let e = sim(SimConfig::new(2, v));
        let spec = MulticastSpec::new(2, 3 * MIB);
        let min = spec.granularity(&e.driver, Granularity::Minimum).unwrap();
        let rec = spec
            .granularity(&e.driver, Granularity::Recommended)
            .unwrap();
        assert!(min.is_power_of_two() && rec % min == 0, "{min} {rec}");
        let o = MulticastObject::new(&e.driver, &spec).unwrap();
        assert_eq!(o.size(), (3 * MIB).next_multiple_of(min));
        assert_eq!(o.granularity(), min);
    }
}

/// Create, add, bind each device's memory, map; store through the multicast address; read on
/// each device.
fn store_reaches_every_device(version: i32, n: usize, by_address: bool) {
    let e = sim(SimConfig::new(n, version));
    let d = &e.driver;
    let size = 4 * MIB;
    let o = full_object(d, n as u32, size);
    let mem = member_memory(d, n, size, HandleTypes::NONE);
    let devices = d.devices();
    let bindings: Vec<_> = mem
        .iter()
        .zip(&devices)
        .map(|(m, dev)| {
            if by_address {
                o.bind_addr(dev, 0, m).unwrap()
            } else {
                o.bind_mem(dev, 0, m.allocation(), 0, size).unwrap()
            }
        })
        .collect();
    let mapping = o.map_whole(&devices).unwrap();
    let data = random(3 * MIB + 77, version as u64 + n as u64);
    let at = 2 * MIB - 5;
    // The store straddles nothing but one binding per device (size 4 MiB), so it is one piece.
    let at = at.min(size - data.len());
    htod(d, mapping.device_ptr() + at as u64, &data).unwrap();
    for m in &mem {
        let mut back = vec![0u8; data.len()];
        dtoh(d, &mut back, m.device_ptr() + at as u64).unwrap();
        assert!(back == data, "device memory differs at version {version}");
    }
    // A plain load through the multicast address reads a bound device's copy.
    let mut back = vec![0u8; data.len()];
    dtoh(d, &mut back, mapping.device_ptr() + at as u64).unwrap();
    assert!(back == data);
    drop((mapping, bindings, o, mem));
    assert_eq!(leftovers(e.sim.as_ref().unwrap()), Default::default());
}

#[test]
fn a_store_through_the_multicast_mapping_reaches_every_bound_device_at_13000() {
    store_reaches_every_device(13000, 2, false);
    store_reaches_every_device(13000, 4, true);
}

#[test]
fn a_store_through_the_multicast_mapping_reaches_every_bound_device_with_per_device_binds() {
    store_reaches_every_device(13010, 2, false);
    store_reaches_every_device(13010, 3, true);
    store_reaches_every_device(12010, 2, true);
}

#[test]
fn simulated_kernels_find_every_bound_device_behind_a_multicast_address() {
    let e = sim(SimConfig::new(2, 13010));
    let d = &e.driver;
    let o = full_object(d, 2, 2 * MIB);
    let mem = member_memory(d, 2, 2 * MIB, HandleTypes::NONE);
    let _b: Vec<_> = mem
        .iter()
        .zip(d.devices())
        .map(|(m, dev)| o.bind_mem(&dev, 0, m.allocation(), 0, 2 * MIB).unwrap())
        .collect();
    let map = o.map_whole(&d.devices()).unwrap();
    let t = cuda_multimem_sim::multicast::multicast_targets(map.device_ptr() as usize + 64, 16)
        .unwrap();
    assert_eq!(t.len(), 2);
    for (i, &addr) in t.iter().enumerate() {
        // SAFETY: the simulator says `addr` is 16 bytes of bound device memory (host memory).
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0x10 + i as u8, 16) };
    }
    for (i, m) in mem.iter().enumerate() {
        let mut back = [0u8; 16];
        dtoh(d, &mut back, m.device_ptr() + 64).unwrap();
        assert_eq!(back, [0x10 + i as u8; 16], "device {i}");
    }
    assert_eq!(
        cuda_multimem_sim::multicast::multicast_targets(mem[0].device_ptr() as usize, 16),
        Err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
        "a unicast address is not a multicast one"
    );
}

#[test]
fn bad_adds_are_rejected_before_the_driver() {
    let mut cfg = SimConfig::new(4, 13010);
    cfg.devices[2].clique = 1;
    cfg.devices[3].multicast = false;
    let e = sim(cfg);
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let o = MulticastObject::new(d, &MulticastSpec::new(2, 2 * MIB)).unwrap();
    o.add_device(&d.device(0).unwrap()).unwrap();
    let calls = s.calls("cuMulticastAddDevice");
    let twice = o.add_device(&d.device(0).unwrap()).unwrap_err();
    assert!(
        matches!(twice, Error::InvalidArgument { arg: "device", .. }),
        "{twice}"
    );
    assert!(twice.to_string().contains("already added"), "{twice}");
    let clique = o.add_device(&d.device(2).unwrap()).unwrap_err();
    assert!(clique.to_string().contains("clique"), "{clique}");
    let nomc = o.add_device(&d.device(3).unwrap()).unwrap_err();
    assert!(
        matches!(nomc, Error::DeviceUnsupported { device: 3, .. }),
        "{nomc}"
    );
    assert_eq!(s.calls("cuMulticastAddDevice"), calls, "no driver call");
    o.add_device(&d.device(1).unwrap()).unwrap();
    let full = o.add_device(&d.device(2).unwrap()).unwrap_err();
    assert!(full.to_string().contains("full"), "{full}");
    assert_eq!(s.calls("cuMulticastAddDevice"), calls + 1);
}

#[test]
fn bad_binds_are_rejected_before_the_driver() {
    let e = sim(SimConfig::new(3, 13010));
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let o = MulticastObject::new(d, &MulticastSpec::new(2, 4 * MIB)).unwrap();
    let mem = member_memory(d, 3, 4 * MIB, HandleTypes::NONE);
    let dev = d.devices();
    o.add_device(&dev[0]).unwrap();
    let calls = || s.calls("cuMulticastBindMem") + s.calls("cuMulticastBindAddr");
    let before = calls();
    let early = o
        .bind_mem(&dev[0], 0, mem[0].allocation(), 0, 2 * MIB)
        .unwrap_err();
    assert!(
        early.to_string().contains("every device was added"),
        "{early}"
    );
    o.add_device(&dev[1]).unwrap();
    let cases: Vec<(&str, Error)> = vec![
        (
            "offset",
            o.bind_mem(&dev[0], MIB, mem[0].allocation(), 0, 2 * MIB)
                .unwrap_err(),
        ),
        (
            "size",
            o.bind_mem(&dev[0], 0, mem[0].allocation(), 0, 3 * MIB)
                .unwrap_err(),
        ),
        (
            "size",
            o.bind_mem(&dev[0], 2 * MIB, mem[0].allocation(), 0, 4 * MIB)
                .unwrap_err(),
        ),
        (
            "size",
            o.bind_mem(&dev[0], 0, mem[0].allocation(), 4 * MIB, 2 * MIB)
                .unwrap_err(),
        ),
        (
            "device",
            o.bind_mem(&dev[2], 0, mem[2].allocation(), 0, 2 * MIB)
                .unwrap_err(),
        ),
        (
            "memory",
            o.bind_mem(&dev[0], 0, mem[1].allocation(), 0, 2 * MIB)
                .unwrap_err(),
        ),
        (
            "size",
            o.bind_mem(&dev[0], 0, mem[0].allocation(), 0, 0)
                .unwrap_err(),
        ),
    ];
    for (arg, err) in cases {
        assert!(
            matches!(&err, Error::InvalidArgument { arg: a, .. } if *a == arg),
            "expected a complaint about {arg}, got {err}"
        );
    }
    let b = o
        .bind_mem(&dev[0], 0, mem[0].allocation(), 0, 2 * MIB)
        .unwrap();
    let overlap = o
        .bind_mem(&dev[0], 0, mem[0].allocation(), 2 * MIB, 2 * MIB)
        .unwrap_err();
    assert!(overlap.to_string().contains("overlapping"), "{overlap}");
    assert_eq!(calls(), before + 1, "only the good bind reached the driver");
    let late = o.add_device(&dev[2]).unwrap_err();
    assert!(matches!(late, Error::InvalidArgument { .. }), "{late}");
    drop(b);
}

#[test]
fn the_simulator_follows_the_documented_rules_for_raw_calls() {
    let e = sim(SimConfig::new(2, 13010));
    let d = &e.driver;
    d.device(0).unwrap().bind().unwrap();
    let sys = d.sys();
    let create = sys.cuMulticastCreate().unwrap();
    let add = sys.cuMulticastAddDevice().unwrap();
    let bind = sys.cuMulticastBindMem().unwrap();
    let unbind = sys.cuMulticastUnbind().unwrap();
    let release = sys.cuMemRelease().unwrap();
    let map = sys.cuMemMap().unwrap();
    let unmap = sys.cuMemUnmap().unwrap();
    let mem = member_memory(d, 2, 2 * MIB, HandleTypes::NONE);
    let prop = CUmulticastObjectProp {
        numDevices: 2,
        size: 2 * MIB,
        handleTypes: 0,
        flags: 0,
    };
    let mut h = 0;
    // SAFETY (whole test): valid out-pointers and handles made here; the simulator checks the rest.
    unsafe {
        let bad = CUmulticastObjectProp {
            size: MIB + 1,
            ..prop
        };
        assert_eq!(
            create(&mut h, &bad),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "size not a granularity multiple"
        );
        assert_eq!(create(&mut h, &prop), CUresult::CUDA_SUCCESS);
        assert_eq!(add(h, 0), CUresult::CUDA_SUCCESS);
        assert_eq!(add(h, 0), CUresult::CUDA_ERROR_INVALID_VALUE, "added twice");
        assert_eq!(add(h, 7), CUresult::CUDA_ERROR_INVALID_DEVICE);
        // Bind blocks until every device was added: another thread adds device 1 once the
        // bind has reached the driver (the simulator counts a call when it enters it), so the
        // bind's success means it waited for the add.
        let binds = || e.sim.as_ref().unwrap().calls("cuMulticastBindMem");
        let before = binds();
        let added = std::thread::scope(|sc| {
            let adder = sc.spawn(|| {
                let t = Instant::now();
                while binds() == before {
                    assert!(t.elapsed() < Duration::from_secs(60), "the bind never came");
                    std::thread::sleep(Duration::from_micros(200));
                }
                add(h, 1)
            });
            let a0 = mem[0].allocation().raw();
            assert_eq!(bind(h, 0, 0, a0, 0, 2 * MIB, 0), CUresult::CUDA_SUCCESS);
            adder.join().unwrap()
        });
        assert_eq!(added, CUresult::CUDA_SUCCESS);
        assert_eq!(
            add(h, 1),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "no adding after binding"
        );
        let a1 = mem[1].allocation().raw();
        assert_eq!(
            bind(h, 0, 0, a1, 0, 2 * MIB, 0),
            CUresult::CUDA_ERROR_INVALID_DEVICE,
            "device 1's memory bound for device 0"
        );
        assert_eq!(
            bind(h, 1, 0, a1, 0, 4 * MIB, 0),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "past the end"
        );
        assert_eq!(bind(h, 1, 0, a1, 0, 2 * MIB, 0), CUresult::CUDA_SUCCESS);
        // Map, then try to unbind while mapped, and to release while bound.
        let r = cuda_multimem::vmm::Reservation::new(d, 2 * MIB).unwrap();
        assert_eq!(
            map(r.device_ptr(), 2 * MIB, 0, h, 0),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            unbind(h, 0, 0, 2 * MIB),
            CUresult::CUDA_ERROR_ILLEGAL_STATE,
            "unbind before unmap"
        );
        assert_eq!(unmap(r.device_ptr(), 2 * MIB), CUresult::CUDA_SUCCESS);
        assert_eq!(
            release(h),
            CUresult::CUDA_ERROR_ILLEGAL_STATE,
            "release while bound"
        );
        assert_eq!(
            unbind(h, 0, 0, MIB),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "unbind must match the bind"
        );
        assert_eq!(unbind(h, 0, 0, 2 * MIB), CUresult::CUDA_SUCCESS);
        assert_eq!(unbind(h, 1, 0, 2 * MIB), CUresult::CUDA_SUCCESS);
        assert_eq!(release(h), CUresult::CUDA_SUCCESS);
        assert_eq!(
            release(h),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "released twice"
        );
    }
}

#[test]
fn a_bind_with_a_device_never_added_fails_instead_of_hanging_on_the_simulator() {
    let e = sim(SimConfig::new(2, 13010));
    let d = &e.driver;
    d.device(0).unwrap().bind().unwrap();
    let mem = member_memory(d, 1, 2 * MIB, HandleTypes::NONE);
    let prop = CUmulticastObjectProp {
        numDevices: 2,
        size: 2 * MIB,
        handleTypes: 0,
        flags: 0,
    };
    let mut h = 0;
    // SAFETY: valid out-pointer and handles made here.
    unsafe {
        assert_eq!(
            d.sys().cuMulticastCreate().unwrap()(&mut h, &prop),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            d.sys().cuMulticastAddDevice().unwrap()(h, 0),
            CUresult::CUDA_SUCCESS
        );
        let t = Instant::now();
        let r = d.sys().cuMulticastBindMem().unwrap()(
            h,
            0,
            0,
            mem[0].allocation().raw(),
            0,
            2 * MIB,
            0,
        );
        assert_eq!(r, CUresult::CUDA_ERROR_ILLEGAL_STATE);
        assert!(t.elapsed() >= cuda_multimem_sim::multicast::BLOCK_LIMIT);
        assert_eq!(d.sys().cuMemRelease().unwrap()(h), CUresult::CUDA_SUCCESS);
    }
}

#[test]
fn bindings_dropped_while_mapped_are_unbound_after_the_unmap() {
    let e = sim(SimConfig::new(2, 13000));
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let o = full_object(d, 2, 2 * MIB);
    let mem = member_memory(d, 2, 2 * MIB, HandleTypes::NONE);
    let b0 = o
        .bind_mem(&d.device(0).unwrap(), 0, mem[0].allocation(), 0, 2 * MIB)
        .unwrap();
    let b1 = o
        .bind_mem(&d.device(1).unwrap(), 0, mem[1].allocation(), 0, 2 * MIB)
        .unwrap();
    let map = o.map_whole(&d.devices()).unwrap();
    drop(b0);
    let again = o
        .bind_mem(&d.device(0).unwrap(), 0, mem[0].allocation(), 0, 2 * MIB)
        .unwrap_err();
    assert!(
        again
            .to_string()
            .contains("stays bound until the mapping goes"),
        "{again}"
    );
    // Drop everything in the "wrong" order: object, bindings, memory, and only then the mapping.
    drop((o, b1, mem));
    assert_eq!(
        s.calls("cuMulticastUnbind"),
        0,
        "nothing unbound while mapped"
    );
    assert_eq!(s.live_resources().get("multicast bindings"), Some(&2));
    drop(map);
    assert_eq!(s.calls("cuMulticastUnbind"), 2);
    assert_eq!(leftovers(s), Default::default(), "all released in order");
}

#[test]
fn export_and_import_in_one_process_give_the_same_object() {
    for fabric in [false, true] {
        let e = sim(SimConfig::new(2, 13010));
        let d = &e.driver;
        let ht = if fabric {
            HandleTypes::FABRIC
        } else {
            HandleTypes::POSIX_FD
        };
        let spec = MulticastSpec::new(2, 2 * MIB).handle_types(ht);
        let a = MulticastObject::new(d, &spec).unwrap();
        let b = if fabric {
            let h = a.export_fabric().unwrap();
            MulticastObject::import_fabric(d, h.as_bytes(), a.spec()).unwrap()
        } else {
            let fd = a.export_posix_fd().unwrap();
            use std::os::fd::AsFd;
            MulticastObject::import_posix_fd(d, fd.as_fd(), a.spec()).unwrap()
        };
        assert!(b.is_imported() && a.is_shared());
        // Each "rank" adds its own device through its own handle.
        a.add_device(&d.device(0).unwrap()).unwrap();
        b.add_device(&d.device(1).unwrap()).unwrap();
        let unshareable = member_memory(d, 1, 2 * MIB, HandleTypes::NONE);
        let err = a
            .bind_mem(
                &d.device(0).unwrap(),
                0,
                unshareable[0].allocation(),
                0,
                2 * MIB,
            )
            .unwrap_err();
        assert!(err.to_string().contains("shareable"), "{err}");
        let mem = member_memory(d, 2, 2 * MIB, ht);
        let _b0 = a
            .bind_mem(&d.device(0).unwrap(), 0, mem[0].allocation(), 0, 2 * MIB)
            .unwrap();
        let _b1 = b
            .bind_mem(&d.device(1).unwrap(), 0, mem[1].allocation(), 0, 2 * MIB)
            .unwrap();
        let map = b.map_whole(&d.devices()).unwrap();
        let data = random(4096, 9);
        htod(d, map.device_ptr(), &data).unwrap();
        for m in &mem {
            let mut back = vec![0u8; 4096];
            dtoh(d, &mut back, m.device_ptr()).unwrap();
            assert!(back == data);
        }
    }
}

#[test]
fn a_device_of_another_driver_value_is_not_added_to_a_multicast_object() {
    let e = sim(SimConfig::new(2, 13010));
    let s = e.sim.as_ref().unwrap();
    let other = cuda_multimem_sim::driver_over(s).unwrap();
    let o = MulticastObject::new(&e.driver, &MulticastSpec::new(2, 2 * MIB)).unwrap();
    o.add_device(&e.driver.device(0).unwrap()).unwrap();
    let err = o.add_device(&other.device(1).unwrap()).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { arg: "device", ref reason }
            if reason.contains("another Driver value")),
        "{err}"
    );
    assert_eq!(s.calls("cuMulticastAddDevice"), 1);
}

#[test]
fn an_allocations_handle_does_not_import_as_a_multicast_object() {
    use std::os::fd::AsFd;
    let e = sim(SimConfig::new(2, 13010));
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let a = PhysicalAllocation::builder(d, Location::Device(0))
        .handle_types(HandleTypes {
            posix_fd: true,
            fabric: true,
        })
        .create(2 * MIB)
        .unwrap();
    let (fd, fab) = (a.export_posix_fd().unwrap(), a.export_fabric().unwrap());
    let spec = MulticastSpec::new(2, 2 * MIB).handle_types(HandleTypes {
        posix_fd: true,
        fabric: true,
    });
    let before = s.live_resources();
    let by_fd = MulticastObject::import_posix_fd(d, fd.as_fd(), &spec).unwrap_err();
    assert!(
        matches!(by_fd, Error::InvalidArgument { arg: "fd", ref reason } if reason.contains("physical allocation")),
        "{by_fd}"
    );
    let by_fabric = MulticastObject::import_fabric(d, fab.as_bytes(), &spec).unwrap_err();
    assert!(
        matches!(by_fabric, Error::InvalidArgument { arg: "bytes", ref reason } if reason.contains("physical allocation")),
        "{by_fabric}"
    );
    assert_eq!(
        s.live_resources(),
        before,
        "the imported handles were released"
    );
}

#[test]
fn a_multicast_objects_handle_does_not_import_as_an_allocation() {
    use std::os::fd::AsFd;
    let e = sim(SimConfig::new(2, 13010));
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let spec = MulticastSpec::new(2, 2 * MIB).handle_types(HandleTypes {
        posix_fd: true,
        fabric: true,
    });
    let o = MulticastObject::new(d, &spec).unwrap();
    let (fd, fab) = (o.export_posix_fd().unwrap(), o.export_fabric().unwrap());
    let before = s.live_resources();
    let by_fd = PhysicalAllocation::import_posix_fd(d, fd.as_fd(), 2 * MIB).unwrap_err();
    assert!(
        matches!(by_fd, Error::InvalidArgument { arg: "fd", ref reason } if reason.contains("CUDA_ERROR_INVALID_VALUE")),
        "{by_fd}"
    );
    let by_fabric = PhysicalAllocation::import_fabric(d, fab.as_bytes(), 2 * MIB).unwrap_err();
    assert!(
        matches!(by_fabric, Error::InvalidArgument { arg: "bytes", ref reason } if reason.contains("CUDA_ERROR_INVALID_VALUE")),
        "{by_fabric}"
    );
    assert_eq!(
        s.live_resources(),
        before,
        "the imported handles were released"
    );
}

#[test]
fn garbage_and_truncated_handles_are_rejected() {
    let e = sim(SimConfig::new(2, 13010));
    let d = &e.driver;
    let spec = MulticastSpec::new(2, 2 * MIB).handle_types(HandleTypes::FABRIC);
    let short = MulticastObject::import_fabric(d, &[1, 2, 3], &spec).unwrap_err();
    assert!(
        matches!(short, Error::InvalidArgument { arg: "bytes", .. }),
        "{short}"
    );
    let garbage = MulticastObject::import_fabric(d, &[0x5a; 64], &spec).unwrap_err();
    assert_eq!(
        garbage.code(),
        Some(CUresult::CUDA_ERROR_INVALID_VALUE),
        "{garbage}"
    );
    let o = MulticastObject::new(d, &MulticastSpec::new(2, 2 * MIB)).unwrap();
    assert!(o.export_fabric().is_err() && o.export_posix_fd().is_err());
    let bad_size =
        MulticastObject::import_fabric(d, &[0x5a; 64], &MulticastSpec::new(2, 12345)).unwrap_err();
    assert!(matches!(
        bad_size,
        Error::InvalidArgument {
            arg: "spec.size",
            ..
        }
    ));
    assert_eq!(
        e.sim
            .as_ref()
            .unwrap()
            .live_resources()
            .get("multicast objects"),
        Some(&1)
    );
}

#[test]
fn a_machine_without_multicast_says_so_before_creating() {
    let e = sim(SimConfig::new(2, 13010).with_all(|d| d.multicast = false));
    let err = MulticastObject::new(&e.driver, &MulticastSpec::new(2, 2 * MIB)).unwrap_err();
    assert!(matches!(err, Error::DeviceUnsupported { .. }), "{err}");
    assert_eq!(e.sim.as_ref().unwrap().calls("cuMulticastCreate"), 0);
}

#[test]
fn a_failure_at_any_step_of_bind_and_map_leaks_nothing() {
    let e = sim(SimConfig::new(2, 13010));
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    // Resolve every entry point first (a failed cuGetProcAddress is not what this is about).
    {
        let o = full_object(d, 2, 2 * MIB);
        let mem = member_memory(d, 2, 2 * MIB, HandleTypes::NONE);
        let b: Vec<_> = mem
            .iter()
            .zip(d.devices())
            .map(|(m, dev)| o.bind_mem(&dev, 0, m.allocation(), 0, 2 * MIB).unwrap())
            .collect();
        let _m = o.map_whole(&d.devices()).unwrap();
        drop(b);
    }
    let injected = fail_each_call(
        s,
        || -> Result<_, Error> {
            let o = MulticastObject::new(d, &MulticastSpec::new(2, 2 * MIB))?;
            for dev in d.devices() {
                o.add_device(&dev)?;
            }
            let mem: Vec<_> = (0..2)
                .map(|i| PhysicalAllocation::builder(d, Location::Device(i)).create(2 * MIB))
                .collect::<Result<_, _>>()?;
            let b: Vec<_> = mem
                .iter()
                .zip(d.devices())
                .map(|(m, dev)| o.bind_mem(&dev, 0, m, 0, 2 * MIB))
                .collect::<Result<_, _>>()?;
            let m = o.map_whole(&d.devices())?;
            Ok((m, b, o, mem))
        },
        |_| {},
    );
    assert!(
        injected >= 8,
        "create, adds, allocations, binds, reserve, map, access: {injected}"
    );
}
