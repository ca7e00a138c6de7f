//! Physical allocations, mappings and access, sizes checked before the driver, every call at
//! every simulated driver version, failures at every step, growable buffers.

use super::*;

#[test]
fn granularity_is_a_power_of_two_and_recommended_is_a_multiple_of_minimum() {
    let e = env();
    let spec = AllocationSpec::device(0);
    let min = spec.granularity(&e.driver, Granularity::Minimum).unwrap();
    let rec = spec
        .granularity(&e.driver, Granularity::Recommended)
        .unwrap();
    assert!(min.is_power_of_two(), "{min}");
    assert!(rec >= min && rec % min == 0, "{rec} vs {min}");
}

#[test]
fn data_written_through_a_mapping_reads_back() {
    let e = env();
    let g = gran(&e.driver);
    let a = PhysicalAllocation::builder(&e.driver, Location::Device(0))
        .create(2 * g)
        .unwrap();
    assert_eq!(a.size(), 2 * g);
    let m = Mapping::map_whole(&a, &rw0()).unwrap();
    assert_eq!(m.access(Location::Device(0)).unwrap(), Access::ReadWrite);
    let data = random(2 * g, 1);
    m.write(0, &data).unwrap();
    let mut back = vec![0u8; 2 * g];
    m.read(0, &mut back).unwrap();
    assert!(back == data, "data read back differs");
}

#[test]
fn two_mappings_of_one_allocation_see_the_same_bytes() {
    let e = env();
    let g = gran(&e.driver);
    let a = PhysicalAllocation::builder(&e.driver, Location::Device(0))
        .create(g)
        .unwrap();
    let m1 = Mapping::map_whole(&a, &rw0()).unwrap();
    let m2 = Mapping::map_whole(&a, &rw0()).unwrap();
    assert_ne!(m1.device_ptr(), m2.device_ptr());
    let data = random(g, 2);
    m1.write(0, &data).unwrap();
    let mut back = vec![0u8; g];
    m2.read(0, &mut back).unwrap();
    assert!(back == data);
}

#[test]
fn a_new_mapping_has_no_access_until_set_and_read_only_refuses_writes() {
    let e = env();
    let g = gran(&e.driver);
    let a = PhysicalAllocation::builder(&e.driver, Location::Device(0))
        .create(g)
        .unwrap();
    let r = Reservation::new(&e.driver, g).unwrap();
    let m = Mapping::new(&r, 0, &a, 0, g).unwrap();
    assert_eq!(m.access(Location::Device(0)).unwrap(), Access::None);
    m.set_access(&rw0()).unwrap();
    let data = random(g, 3);
    m.write(0, &data).unwrap();
    m.set_access(&[(Location::Device(0), Access::ReadOnly)])
        .unwrap();
    assert_eq!(m.access(Location::Device(0)).unwrap(), Access::ReadOnly);
    let mut back = vec![0u8; g];
    m.read(0, &mut back).unwrap();
    assert!(back == data);
    if e.sim.is_some() {
        // On the real driver a host-to-device copy into read-only memory may go through a
        // copy engine that does not check the mapping's protection; the simulator does.
        assert!(htod(&e.driver, m.device_ptr(), &data).is_err());
    }
}

#[test]
fn memory_comes_back_after_twenty_big_allocations() {
    let e = env();
    let dev = e.driver.device(0).unwrap();
    let size = 1 << 30;
    // Warm up (contexts, driver pools), then measure.
    drop(
        VmmBuffer::new(
            PhysicalAllocation::builder(&e.driver, Location::Device(0)),
            size,
            &[],
        )
        .unwrap(),
    );
    let (free0, _) = dev.memory_info().unwrap();
    for _ in 0..20 {
        let b = VmmBuffer::new(
            PhysicalAllocation::builder(&e.driver, Location::Device(0)),
            size,
            &[],
        )
        .unwrap();
        let (free, _) = dev.memory_info().unwrap();
        assert!(
            free + size <= free0 + 64 * MIB,
            "allocation not charged: {free} vs {free0}"
        );
        drop(b);
    }
    let (free1, _) = dev.memory_info().unwrap();
    // Other processes may use the GPU too: allow 64 MiB of noise, far less than 20 × 1 GiB.
    assert!(
        free1 + 64 * MIB >= free0,
        "memory did not come back: free {free0} before, {free1} after"
    );
    if let Some(s) = &e.sim {
        assert_eq!(free1, free0);
        assert!(
            s.live_resources().keys().all(|k| !k.starts_with("vmm")),
            "{:?}",
            s.live_resources()
        );
    }
}

#[test]
fn the_allocation_outlives_its_last_handle_while_mapped() {
    let e = env();
    let g = gran(&e.driver);
    let a = PhysicalAllocation::builder(&e.driver, Location::Device(0))
        .create(g)
        .unwrap();
    let m = Mapping::map_whole(&a, &rw0()).unwrap();
    drop(a); // the mapping keeps it
    let data = random(g, 4);
    m.write(0, &data).unwrap();
    let mut back = vec![0u8; g];
    m.read(0, &mut back).unwrap();
    assert!(back == data);
    if let Some(s) = &e.sim {
        assert_eq!(s.live_resources().get("vmm allocations"), Some(&1));
        drop(m);
        assert_eq!(s.live_resources().get("vmm allocations"), None);
        assert_eq!(s.live_resources().get("vmm reservations"), None);
    }
}

#[test]
fn bad_sizes_offsets_and_devices_are_rejected_before_the_driver() {
    let e = env();
    let d = &e.driver;
    let g = gran(d);
    let b = PhysicalAllocation::builder(d, Location::Device(0));
    assert!(matches!(
        b.create(0),
        Err(Error::InvalidArgument { arg: "size", .. })
    ));
    let exact = b.clone().rounding(Rounding::Exact);
    assert!(matches!(
        exact.create(g + 1),
        Err(Error::InvalidArgument { arg: "size", .. })
    ));
    assert_eq!(
        b.create(g + 1).unwrap().size(),
        2 * g,
        "rounds up by default"
    );
    let n = d.device_count() as i32;
    for bad in [-1, n, 1000] {
        let r = PhysicalAllocation::builder(d, Location::Device(bad)).create(g);
        assert!(
            matches!(
                r,
                Err(Error::InvalidArgument {
                    arg: "location",
                    ..
                })
            ),
            "{bad}: {r:?}"
        );
    }
    assert!(matches!(
        Reservation::new(d, 0),
        Err(Error::InvalidArgument { arg: "size", .. })
    ));
    assert!(matches!(
        Reservation::new(d, 4097),
        Err(Error::InvalidArgument { arg: "size", .. })
    ));
    assert!(matches!(
        Reservation::builder(d, g).alignment(3 * 4096).reserve(),
        Err(Error::InvalidArgument {
            arg: "alignment",
            ..
        })
    ));
    let a = b.create(2 * g).unwrap();
    let r = Reservation::new(d, 2 * g).unwrap();
    for (ro, ao, size, arg) in [
        (0, 0, 0, "size"),
        (0, 0, g + 4096, "size"),
        (4096, 0, g, "reservation_offset"),
        (0, 4096, g, "allocation_offset"),
        (g, 0, 2 * g, "size"),
        (0, g, 2 * g, "size"),
    ] {
        let m = Mapping::new(&r, ro, &a, ao, size);
        assert!(
            matches!(m, Err(Error::InvalidArgument { arg: a, .. }) if a == arg),
            "({ro}, {ao}, {size}): {m:?}"
        );
    }
    // A mapping covers a whole allocation: cuda.h says the offset "currently must be zero",
    // and a 13.0 H200 answers CUDA_ERROR_NOT_SUPPORTED for 2 MiB of a 4 MiB allocation.
    let r2 = Reservation::new(d, 2 * g).unwrap();
    let part = Mapping::new(&r2, 0, &a, 0, g);
    assert!(
        matches!(part, Err(Error::Driver { code, .. }) if code == cuda_multimem_sys::CUresult::CUDA_ERROR_NOT_SUPPORTED),
        "partial map: {part:?}"
    );
    let _m = Mapping::new(&r, 0, &a, 0, 2 * g).unwrap();
    let twice = Mapping::new(&r, 0, &a, 0, 2 * g);
    assert!(
        matches!(twice, Err(Error::Driver { .. })),
        "double map: {twice:?}"
    );
}

#[test]
fn access_for_a_device_out_of_range_is_rejected() {
    let e = env();
    let g = gran(&e.driver);
    let a = PhysicalAllocation::builder(&e.driver, Location::Device(0))
        .create(g)
        .unwrap();
    let m = Mapping::map_whole(&a, &rw0()).unwrap();
    let n = e.driver.device_count() as i32;
    let r = m.set_access(&[(Location::Device(n), Access::ReadWrite)]);
    assert!(
        matches!(r, Err(Error::InvalidArgument { arg: "access", .. })),
        "{r:?}"
    );
    assert!(matches!(
        m.set_access(&[]),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(m.access(Location::Device(0)).unwrap(), Access::ReadWrite);
}

#[test]
fn handle_types_are_fixed_at_creation() {
    let e = env();
    let g = gran(&e.driver);
    let a = PhysicalAllocation::builder(&e.driver, Location::Device(0))
        .create(g)
        .unwrap();
    assert!(matches!(
        a.export_posix_fd(),
        Err(Error::InvalidArgument {
            arg: "handle_types",
            ..
        })
    ));
    assert!(matches!(
        a.export_fabric(),
        Err(Error::InvalidArgument {
            arg: "handle_types",
            ..
        })
    ));
}

#[test]
fn every_vmm_call_works_at_every_simulated_driver_version() {
    for v in [12000, 12080, 13000, 13030, 13050] {
        let e = sim(SimConfig::new(2, v));
        let s = e.sim.as_ref().unwrap();
        e.driver.device(0).unwrap().bind().unwrap();
        let before = s.live_resources();
        {
            let a = PhysicalAllocation::builder(&e.driver, Location::Device(0))
                .handle_types(HandleTypes::POSIX_FD)
                .create(4 * MIB)
                .unwrap();
            let mut b = VmmBuffer::new(
                PhysicalAllocation::builder(&e.driver, Location::Device(0)),
                2 * MIB,
                &[],
            )
            .unwrap();
            let data = random(2 * MIB, v as u64);
            htod(&e.driver, b.device_ptr(), &data).unwrap();
            b.grow(6 * MIB).unwrap();
            let mut back = vec![0u8; 2 * MIB];
            dtoh(&e.driver, &mut back, b.device_ptr()).unwrap();
            assert!(back == data, "driver {v}: contents lost in grow");
            let fd = a.export_posix_fd().unwrap();
            let imported = PhysicalAllocation::import_posix_fd(
                &e.driver,
                std::os::fd::AsFd::as_fd(&fd),
                4 * MIB,
            )
            .unwrap();
            let m = Mapping::map_whole(&imported, &rw0()).unwrap();
            assert_eq!(m.access(Location::Device(0)).unwrap(), Access::ReadWrite);
        }
        assert_eq!(s.live_resources(), before, "driver {v}: leaked");
    }
}

/// The driver calls a VMM construction makes (teardown calls are not construction steps: a
/// failure there is reported by the driver, not undone).
const CONSTRUCTION_CALLS: &[&str] = &[
    "cuCtxGetCurrent",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemAddressReserve",
    "cuMemMap",
    "cuMemSetAccess",
];

/// For every construction call and every occurrence of it in `attempt`, inject a failure there.
/// Each round starts from a fresh `setup()` (not under injection); after a failure,
/// `live_resources()` must be what it was after `setup`, and `after_failure` checks the state;
/// after the round (success or failure) everything is dropped and nothing may be left over.
/// Returns how many failures were injected.
fn inject_at_every_step<S, T>(
    s: &cuda_multimem_sim::Simulator,
    mut setup: impl FnMut() -> S,
    mut attempt: impl FnMut(&mut S) -> Result<T, Error>,
    mut after_failure: impl FnMut(&S),
) -> usize {
    let initial = s.live_resources();
    let mut injected = 0;
    for call in CONSTRUCTION_CALLS {
        for skip in 0.. {
            let mut state = setup();
            let before = s.live_resources();
            s.inject_failure(FailurePlan {
                call: Some(call.to_string()),
                skip,
                code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            });
            let r = attempt(&mut state);
            let fired = s.clear_failure();
            let done = match (r, fired) {
                (Ok(v), None) => {
                    drop(v);
                    true
                }
                (Err(err), Some(f)) => {
                    injected += 1;
                    assert_eq!(s.live_resources(), before, "after failing {f} ({err})");
                    after_failure(&state);
                    false
                }
                (Ok(_), Some(f)) => panic!("succeeded although {f} failed"),
                (Err(err), None) => panic!("failed without an injected failure: {err}"),
            };
            drop(state);
            assert_eq!(
                s.live_resources(),
                initial,
                "left over after a round ({call}, skip {skip})"
            );
            if done {
                break;
            }
        }
    }
    injected
}

#[test]
fn a_failure_at_any_step_of_map_whole_leaks_nothing() {
    let e = sim(SimConfig::new(2, 13030));
    let s = e.sim.as_ref().unwrap();
    warm_up(&e.driver);
    let a = PhysicalAllocation::builder(&e.driver, Location::Device(0))
        .create(2 * MIB)
        .unwrap();
    let n = inject_at_every_step(s, || (), |_| Mapping::map_whole(&a, &rw0()), |_| {});
    assert!(n >= 3, "at least reserve, map, set access: {n}");
}

#[test]
fn a_failure_at_any_step_of_creating_a_buffer_or_importing_leaks_nothing() {
    let e = sim(SimConfig::new(2, 13030));
    let s = e.sim.as_ref().unwrap();
    warm_up(&e.driver);
    let n = inject_at_every_step(
        s,
        || (),
        |_| {
            VmmBuffer::new(
                PhysicalAllocation::builder(&e.driver, Location::Device(0)),
                3 * MIB,
                &[],
            )
        },
        |_| {},
    );
    assert!(n >= 5, "{n}");
    let a = PhysicalAllocation::builder(&e.driver, Location::Device(0))
        .handle_types(HandleTypes {
            posix_fd: true,
            fabric: true,
        })
        .create(2 * MIB)
        .unwrap();
    let fd = a.export_posix_fd().unwrap();
    let fab = a.export_fabric().unwrap();
    let n = inject_at_every_step(
        s,
        || (),
        |_| PhysicalAllocation::import_posix_fd(&e.driver, std::os::fd::AsFd::as_fd(&fd), 2 * MIB),
        |_| {},
    );
    assert!(n >= 3, "{n}");
    let n = inject_at_every_step(
        s,
        || (),
        |_| PhysicalAllocation::import_fabric(&e.driver, fab.as_bytes(), 2 * MIB),
        |_| {},
    );
    assert!(n >= 3, "{n}");
}

#[test]
fn a_failed_unmap_of_an_imports_size_check_is_returned_and_leaks_nothing() {
    let e = sim(SimConfig::new(2, 13030));
    let s = e.sim.as_ref().unwrap();
    warm_up(&e.driver);
    let a = PhysicalAllocation::builder(&e.driver, Location::Device(0))
        .handle_types(HandleTypes {
            posix_fd: true,
            fabric: true,
        })
        .create(2 * MIB)
        .unwrap();
    let fd = a.export_posix_fd().unwrap();
    let fab = a.export_fabric().unwrap();
    let imports: [&dyn Fn() -> Result<Arc<PhysicalAllocation>, Error>; 2] = [
        &|| PhysicalAllocation::import_posix_fd(&e.driver, std::os::fd::AsFd::as_fd(&fd), 2 * MIB),
        &|| PhysicalAllocation::import_fabric(&e.driver, fab.as_bytes(), 2 * MIB),
    ];
    for import in imports {
        drop(import().unwrap());
        let before = s.live_resources();
        s.inject_failure(FailurePlan {
            call: Some("cuMemUnmap".into()),
            skip: 0,
            code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        });
        let r = import();
        assert_eq!(s.clear_failure().as_deref(), Some("cuMemUnmap"));
        match r {
            Err(Error::Driver { call, code }) => {
                assert_eq!(
                    (call, code),
                    ("cuMemUnmap", CUresult::CUDA_ERROR_OUT_OF_MEMORY)
                )
            }
            other => panic!("expected the unmap's error, got {other:?}"),
        }
        assert_eq!(
            s.live_resources(),
            before,
            "the import released what it made"
        );
    }
}

#[test]
fn a_failure_at_any_step_of_growing_leaves_the_buffer_intact_and_leaks_nothing() {
    let e = sim(SimConfig::new(2, 13030));
    let s = e.sim.as_ref().unwrap();
    warm_up(&e.driver);
    let d = &e.driver;
    for in_place in [true, false] {
        let data = random(2 * MIB, 7);
        let setup = || {
            let b = VmmBuffer::new(
                PhysicalAllocation::builder(d, Location::Device(0)),
                2 * MIB,
                &[],
            )
            .unwrap();
            htod(d, b.device_ptr(), &data).unwrap();
            // Block the range right after the buffer to force the remap path.
            let blocker = (!in_place).then(|| {
                let r = Reservation::builder(d, 2 * MIB)
                    .address_hint(b.device_ptr() + b.size() as u64)
                    .reserve()
                    .unwrap();
                assert_eq!(r.device_ptr(), b.device_ptr() + b.size() as u64);
                r
            });
            let was = (b.device_ptr(), b.size());
            (b, blocker, was)
        };
        let n = inject_at_every_step(
            s,
            setup,
            |(b, _, _)| {
                let stayed = b.grow(5 * MIB)?;
                assert_eq!(stayed, in_place);
                assert_eq!(b.size(), 6 * MIB);
                let mut back = vec![0u8; 2 * MIB];
                dtoh(d, &mut back, b.device_ptr()).unwrap();
                assert!(back == data, "contents kept (in place: {in_place})");
                htod(d, b.device_ptr() + 2 * MIB as u64, &random(4 * MIB, 8)).unwrap();
                Ok(())
            },
            |(b, _, was)| {
                assert_eq!(
                    (b.device_ptr(), b.size()),
                    *was,
                    "unchanged after a failure"
                );
                let mut back = vec![0u8; 2 * MIB];
                dtoh(d, &mut back, b.device_ptr()).unwrap();
                assert!(back == data, "contents kept after a failed grow");
            },
        );
        assert!(n >= 3, "{n}");
    }
    assert!(s.live_resources().keys().all(|k| !k.starts_with("vmm")));
}

#[test]
fn a_growing_buffer_keeps_its_contents_in_place_or_remapped() {
    let e = env();
    let g = gran(&e.driver);
    let mut b = VmmBuffer::new(
        PhysicalAllocation::builder(&e.driver, Location::Device(0)),
        g,
        &[],
    )
    .unwrap();
    let data = random(g, 9);
    htod(&e.driver, b.device_ptr(), &data).unwrap();
    let before = b.device_ptr();
    let stayed = b.grow(3 * g).unwrap();
    assert_eq!(b.size(), 3 * g);
    assert_eq!(stayed, b.device_ptr() == before);
    let mut back = vec![0u8; g];
    dtoh(&e.driver, &mut back, b.device_ptr()).unwrap();
    assert!(back == data);
    let all = random(3 * g, 10);
    htod(&e.driver, b.device_ptr(), &all).unwrap();
    let mut back = vec![0u8; 3 * g];
    dtoh(&e.driver, &mut back, b.device_ptr()).unwrap();
    assert!(back == all);
    assert!(matches!(
        b.grow(g),
        Err(Error::InvalidArgument {
            arg: "new_size",
            ..
        })
    ));
}
