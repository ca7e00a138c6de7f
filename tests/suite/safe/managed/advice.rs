//! Advice with read-back, locations, checked ranges, wrapped and dropped buffers.

use super::*;

#[test]
fn data_written_on_the_host_survives_prefetch_to_the_device_and_back() {
    let e = env();
    let d = device0(&e);
    if lacks_concurrent_access("managed::round_trip", &d) {
        return;
    }
    let s = Stream::new(&d).unwrap();
    let mut buf = ManagedBuffer::new(&d, 8 * MIB).unwrap();
    let data = fill_random(&mut buf, 1);
    buf.prefetch(Location::device(&d), &s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        buf.last_prefetch_location().unwrap(),
        Some(Location::Device(0))
    );
    if let Some(sim) = &e.sim {
        assert_eq!(
            sim.managed_residence(buf.as_ptr(), buf.len()),
            Some((CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, 0))
        );
    }
    buf.prefetch(Location::Host, &s).unwrap();
    s.synchronize().unwrap();
    assert!(host_like(buf.last_prefetch_location().unwrap()));
    assert_eq!(buf.host_slice().unwrap(), &data[..]);
    let mut back = vec![0u8; 4096];
    buf.copy_to_host(4096, &mut back).unwrap();
    assert_eq!(back, data[4096..8192]);
}

#[test]
fn read_mostly_reads_back_what_was_advised() {
    let e = env();
    let d = device0(&e);
    let buf = ManagedBuffer::new(&d, 4 * MIB).unwrap();
    assert!(!buf.read_mostly().unwrap());
    buf.set_read_mostly(true).unwrap();
    assert!(buf.read_mostly().unwrap());
    buf.set_read_mostly(false).unwrap();
    assert!(!buf.read_mostly().unwrap());
}

#[test]
fn advice_on_a_subrange_covers_only_that_part() {
    let e = env();
    let d = device0(&e);
    let buf = ManagedBuffer::new(&d, 4 * MIB).unwrap();
    let first = buf.subrange(0, 2 * MIB).unwrap();
    let second = buf.subrange(2 * MIB, 2 * MIB).unwrap();
    managed::set_read_mostly(first, true).unwrap();
    assert!(managed::read_mostly(first).unwrap());
    assert!(!managed::read_mostly(second).unwrap());
    assert!(!buf.read_mostly().unwrap(), "not every page is read-mostly");
}

#[test]
fn preferred_location_reads_back_device_host_and_unset() {
    let e = env();
    let d = device0(&e);
    if lacks_concurrent_access("managed::preferred_location", &d) {
        return;
    }
    let buf = ManagedBuffer::new(&d, 4 * MIB).unwrap();
    assert_eq!(buf.preferred_location().unwrap(), None);
    buf.set_preferred_location(Location::Device(0)).unwrap();
    assert_eq!(buf.preferred_location().unwrap(), Some(Location::Device(0)));
    buf.set_preferred_location(Location::Host).unwrap();
    assert_eq!(buf.preferred_location().unwrap(), Some(Location::Host));
    buf.unset_preferred_location().unwrap();
    assert_eq!(buf.preferred_location().unwrap(), None);
}

#[test]
fn host_numa_preferred_location_reads_back_from_cuda_12_2_and_is_unsupported_before() {
    let e = env();
    let d = device0(&e);
    let buf = ManagedBuffer::new(&d, 4 * MIB).unwrap();
    if e.driver.version() < 12020 {
        let err = buf
            .set_preferred_location(Location::HostNuma(0))
            .unwrap_err();
        match &err {
            Error::Unsupported { symbol, needed, .. } => {
                assert_eq!((*symbol, *needed), ("cuMemAdvise", 12020));
            }
            e => panic!("expected Unsupported, got {e:?}"),
        }
        assert!(err.to_string().contains("NUMA"), "{err}");
        assert!(buf
            .set_preferred_location(Location::HostNumaCurrent)
            .unwrap_err()
            .is_unsupported());
        return;
    }
    if lacks_concurrent_access("managed::host_numa_preferred", &d) {
        return;
    }
    let Some(node) = d.host_numa_id().unwrap() else {
        return skip(
            "managed::host_numa_preferred",
            "the device reports no host NUMA node",
        );
    };
    // Documented: the preference becomes the node. Measured on a 13.0 driver (H200, one NUMA
    // node): the advice succeeds but leaves the preferred location as it was. On real hardware
    // either is accepted; never any other location.
    let real = e.sim.is_none();
    buf.set_preferred_location(Location::Device(0)).unwrap();
    buf.set_preferred_location(Location::HostNuma(node))
        .unwrap();
    let got = buf.preferred_location().unwrap();
    assert!(
        got == Some(Location::HostNuma(node)) || (real && got == Some(Location::Device(0))),
        "{got:?}"
    );
    buf.set_preferred_location(Location::Host).unwrap();
    buf.set_preferred_location(Location::HostNumaCurrent)
        .unwrap();
    let got = buf.preferred_location().unwrap();
    assert!(
        matches!(got, Some(Location::HostNuma(n)) if n >= 0)
            || (real && got == Some(Location::Host)),
        "{got:?}"
    );
}

#[test]
fn accessed_by_add_and_remove_read_back_on_device_0() {
    let e = env();
    let d = device0(&e);
    if lacks_concurrent_access("managed::accessed_by", &d) {
        return;
    }
    let buf = ManagedBuffer::new(&d, 4 * MIB).unwrap();
    assert!(buf.accessed_by().unwrap().is_empty());
    buf.add_accessed_by(Location::Device(0)).unwrap();
    assert_eq!(
        buf.accessed_by().unwrap(),
        BTreeSet::from([Location::Device(0)])
    );
    buf.add_accessed_by(Location::Device(0)).unwrap();
    assert_eq!(buf.accessed_by().unwrap().len(), 1);
    buf.remove_accessed_by(Location::Device(0)).unwrap();
    assert!(buf.accessed_by().unwrap().is_empty());
    buf.set_accessed_by([Location::Device(0)]).unwrap();
    assert_eq!(
        buf.accessed_by().unwrap(),
        BTreeSet::from([Location::Device(0)])
    );
    buf.set_accessed_by([]).unwrap();
    assert!(buf.accessed_by().unwrap().is_empty());
}

#[test]
fn accessed_by_replace_advises_only_the_difference() {
    for v in VERSIONS {
        let e = sim(SimConfig::new(3, v));
        let sim = e.sim.as_ref().unwrap();
        let d = device0(&e);
        let buf = ManagedBuffer::new(&d, 2 * MIB).unwrap();
        buf.set_accessed_by([Location::Device(0), Location::Device(1)])
            .unwrap();
        let before = sim.calls("cuMemAdvise");
        buf.add_accessed_by(Location::Device(1)).unwrap();
        assert_eq!(sim.calls("cuMemAdvise"), before, "already in the set");
        buf.set_accessed_by([Location::Device(1), Location::Device(2), Location::Host])
            .unwrap();
        assert_eq!(
            sim.calls("cuMemAdvise"),
            before + 3,
            "unset device 0, set device 2 and the host; device 1 untouched (driver {v})"
        );
        assert_eq!(
            buf.accessed_by().unwrap(),
            BTreeSet::from([Location::Device(1), Location::Device(2), Location::Host])
        );
        buf.remove_accessed_by(Location::Device(0)).unwrap();
        assert_eq!(sim.calls("cuMemAdvise"), before + 3, "not in the set");
    }
}

#[test]
fn accessed_by_takes_only_devices_and_the_host() {
    let e = env();
    let d = device0(&e);
    let buf = ManagedBuffer::new(&d, 2 * MIB).unwrap();
    let calls = e.sim.as_ref().map(|s| s.calls("cuMemAdvise"));
    for l in [Location::HostNuma(0), Location::HostNumaCurrent] {
        assert!(is_invalid(&buf.add_accessed_by(l).unwrap_err(), "location"));
        assert!(is_invalid(
            &buf.remove_accessed_by(l).unwrap_err(),
            "location"
        ));
        assert!(is_invalid(
            &buf.set_accessed_by([Location::Host, l]).unwrap_err(),
            "locations"
        ));
    }
    if let Some(sim) = &e.sim {
        assert_eq!(
            Some(sim.calls("cuMemAdvise")),
            calls,
            "rejected before the driver"
        );
    }
}

#[test]
fn locations_the_machine_lacks_are_rejected() {
    let e = env();
    let d = device0(&e);
    let s = Stream::new(&d).unwrap();
    let buf = ManagedBuffer::new(&d, 2 * MIB).unwrap();
    let n = e.driver.device_count() as i32;
    for bad in [Location::Device(n), Location::Device(-1)] {
        assert!(is_invalid(
            &buf.set_preferred_location(bad).unwrap_err(),
            "location"
        ));
        assert!(is_invalid(
            &buf.add_accessed_by(bad).unwrap_err(),
            "location"
        ));
        assert!(is_invalid(&buf.prefetch(bad, &s).unwrap_err(), "location"));
    }
    assert!(is_invalid(
        &buf.set_preferred_location(Location::HostNuma(-3))
            .unwrap_err(),
        "location"
    ));
    // A NUMA id the host lacks: the driver refuses it (from 12.2; before, the ABI cannot say it).
    let err = buf
        .set_preferred_location(Location::HostNuma(1 << 20))
        .unwrap_err();
    assert!(
        err.is_unsupported() || err.code().is_some(),
        "expected the driver's refusal, got {err:?}"
    );
}

#[test]
fn a_numa_id_the_simulated_host_lacks_is_the_drivers_invalid_value() {
    let e = sim(SimConfig::parse("devices=1,version=13000,numa_nodes=2").unwrap());
    let d = device0(&e);
    let s = Stream::new(&d).unwrap();
    let buf = ManagedBuffer::new(&d, 2 * MIB).unwrap();
    buf.set_preferred_location(Location::HostNuma(1)).unwrap();
    assert_eq!(
        buf.preferred_location().unwrap(),
        Some(Location::HostNuma(1))
    );
    let err = buf
        .set_preferred_location(Location::HostNuma(2))
        .unwrap_err();
    assert!(
        is_driver(&err, CUresult::CUDA_ERROR_INVALID_VALUE),
        "{err:?}"
    );
    let err = buf.prefetch(Location::HostNuma(2), &s).unwrap_err();
    assert!(
        is_driver(&err, CUresult::CUDA_ERROR_INVALID_VALUE),
        "{err:?}"
    );
    let err = buf
        .discard_and_prefetch(Location::HostNuma(2), &s)
        .unwrap_err();
    assert!(
        is_driver(&err, CUresult::CUDA_ERROR_INVALID_VALUE),
        "{err:?}"
    );
    buf.prefetch(Location::HostNuma(1), &s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        buf.last_prefetch_location().unwrap(),
        Some(Location::HostNuma(1))
    );
}

#[test]
fn devices_without_concurrent_managed_access_are_refused() {
    let e = sim(SimConfig::parse("devices=1,version=13000,managed=0").unwrap());
    let d = device0(&e);
    let s = Stream::new(&d).unwrap();
    let mut buf = ManagedBuffer::new(&d, 2 * MIB).unwrap();
    let err = buf.set_preferred_location(Location::Device(0)).unwrap_err();
    assert!(
        is_driver(&err, CUresult::CUDA_ERROR_INVALID_DEVICE),
        "{err:?}"
    );
    let err = buf.add_accessed_by(Location::Device(0)).unwrap_err();
    assert!(
        is_driver(&err, CUresult::CUDA_ERROR_INVALID_DEVICE),
        "{err:?}"
    );
    let err = buf.prefetch(Location::Device(0), &s).unwrap_err();
    assert!(
        is_driver(&err, CUresult::CUDA_ERROR_INVALID_DEVICE),
        "{err:?}"
    );
    let err = buf.discard(&s).unwrap_err();
    assert!(
        is_driver(&err, CUresult::CUDA_ERROR_NOT_SUPPORTED),
        "{err:?}"
    );
    assert!(matches!(
        buf.host_slice().unwrap_err(),
        Error::DeviceUnsupported { device: 0, .. }
    ));
    // Host-side advice and copies still work.
    buf.set_preferred_location(Location::Host).unwrap();
    buf.copy_from_host(0, &[7u8; 64]).unwrap();
    let mut back = [0u8; 64];
    buf.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, [7u8; 64]);
}

#[test]
fn zero_sizes_and_ranges_outside_the_buffer_are_rejected() {
    let e = env();
    let d = device0(&e);
    let calls = e.sim.as_ref().map(|s| s.calls("cuMemAllocManaged"));
    assert!(is_invalid(&ManagedBuffer::new(&d, 0).unwrap_err(), "len"));
    if let Some(sim) = &e.sim {
        assert_eq!(Some(sim.calls("cuMemAllocManaged")), calls);
    }
    let buf = ManagedBuffer::new(&d, 2 * MIB).unwrap();
    assert!(is_invalid(&buf.subrange(0, 0).unwrap_err(), "len"));
    assert!(is_invalid(&buf.subrange(2 * MIB, 1).unwrap_err(), "offset"));
    assert!(is_invalid(&buf.subrange(MIB, MIB + 1).unwrap_err(), "len"));
    assert!(is_invalid(
        &buf.subrange(usize::MAX, 2).unwrap_err(),
        "offset"
    ));
    assert!(buf.subrange(MIB, MIB).is_ok());
    let mut x = [0u8; 8];
    assert!(is_invalid(
        &buf.copy_to_host(2 * MIB - 4, &mut x).unwrap_err(),
        "dst"
    ));
    assert!(is_invalid(
        &buf.copy_to_host(2 * MIB + 1, &mut x).unwrap_err(),
        "offset"
    ));
}

#[test]
fn raw_ranges_are_checked_with_the_driver() {
    let e = env();
    let d = device0(&e);
    let buf = ManagedBuffer::new(&d, 2 * MIB).unwrap();
    let host = vec![0u8; 4096];
    // SAFETY: each range is only validated (and refused); nothing is queued on it.
    unsafe {
        assert!(is_invalid(
            &ManagedRange::from_raw(&d, host.as_ptr() as u64, host.len()).unwrap_err(),
            "ptr"
        ));
        assert!(is_invalid(
            &ManagedRange::from_raw(&d, buf.as_ptr(), 0).unwrap_err(),
            "len"
        ));
        assert!(is_invalid(
            &ManagedRange::from_raw(&d, u64::MAX - 8, 64).unwrap_err(),
            "len"
        ));
    }
    // SAFETY: the range lies in `buf`, alive for the rest of the test.
    let r = unsafe { ManagedRange::from_raw(&d, buf.as_ptr() + 4096, 8192) }.unwrap();
    assert_eq!((r.ptr(), r.len()), (buf.as_ptr() + 4096, 8192));
    managed::set_read_mostly(r, true).unwrap();
    assert!(managed::read_mostly(r).unwrap());
}

#[test]
fn a_range_running_past_its_allocation_is_rejected_by_the_simulated_driver() {
    let e = sim(SimConfig::new(1, 13000));
    let d = device0(&e);
    let buf = ManagedBuffer::new(&d, 2 * MIB).unwrap();
    // SAFETY: only validated (and refused).
    let err = unsafe { ManagedRange::from_raw(&d, buf.as_ptr() + 4096, 2 * MIB) }.unwrap_err();
    assert!(is_invalid(&err, "ptr"), "{err:?}");
}

#[test]
fn wrapping_an_external_allocation_does_not_free_it() {
    let e = env();
    let d = device0(&e);
    let owner = ManagedBuffer::new(&d, 2 * MIB).unwrap();
    // SAFETY: `owner` outlives the wrapper.
    let wrapped =
        unsafe { ManagedBuffer::from_raw_parts(&d, owner.as_ptr(), owner.len()) }.unwrap();
    assert!(!wrapped.is_owned() && owner.is_owned());
    wrapped.set_read_mostly(true).unwrap();
    drop(wrapped);
    assert!(
        owner.read_mostly().unwrap(),
        "still allocated, advice intact"
    );
}

#[test]
fn dropping_a_managed_buffer_frees_it() {
    let e = sim(SimConfig::new(1, 13000));
    let s = e.sim.as_ref().unwrap();
    let d = device0(&e);
    d.bind().unwrap();
    let before = s.live_resources();
    let buf = ManagedBuffer::new(&d, 4 * MIB).unwrap();
    assert_eq!(s.live_resources().get("managed allocations"), Some(&1));
    let ptr = buf.as_ptr();
    drop(buf);
    assert_eq!(s.live_resources(), before);
    // SAFETY: only validated (and refused): the memory is gone.
    assert!(unsafe { ManagedRange::from_raw(&d, ptr, 4096) }.is_err());
}

#[test]
fn a_failed_allocation_leaks_nothing() {
    let e = sim(SimConfig::new(1, 13000));
    let s = e.sim.as_ref().unwrap();
    let d = device0(&e);
    // Resolve every entry point first: the loader caches a failed resolution, so a failure
    // injected into cuGetProcAddress would stick (a loader property, not this test's subject).
    drop(ManagedBuffer::new(&d, 2 * MIB).unwrap());
    let injected = fail_each_call(s, || ManagedBuffer::new(&d, 2 * MIB), |_| {});
    assert!(injected >= 1, "{injected}");
}
