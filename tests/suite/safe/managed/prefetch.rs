//! Prefetch of many ranges (by loop and by batch), discard and discard-and-prefetch, the CUDA
//! 12 ABIs, every call at each driver version, host NUMA, host-attached allocations.

use super::*;

#[test]
fn prefetching_many_ranges_by_loop_and_by_batch_places_them_alike() {
    let e = env();
    let d = device0(&e);
    if lacks_concurrent_access("managed::prefetch_many", &d) {
        return;
    }
    let s = Stream::new(&d).unwrap();
    let v = e.driver.version();
    for policy in [
        PrefetchPolicy::Loop,
        PrefetchPolicy::Batch,
        PrefetchPolicy::Auto,
    ] {
        let buf = ManagedBuffer::new(&d, 16 * MIB).unwrap();
        let rs = ranges(&buf, 8, 2 * MIB);
        let r = managed::prefetch_many_with(&rs, &[Location::Device(0)], &s, policy);
        if policy == PrefetchPolicy::Batch && v < 13000 {
            let err = r.unwrap_err();
            assert!(
                matches!(
                    &err,
                    Error::Unsupported {
                        symbol: "cuMemPrefetchBatchAsync",
                        needed: 13000,
                        ..
                    }
                ),
                "{err:?}"
            );
            continue;
        }
        r.unwrap();
        s.synchronize().unwrap();
        for r in &rs {
            assert_eq!(
                managed::last_prefetch_location(*r).unwrap(),
                Some(Location::Device(0)),
                "{policy:?}"
            );
        }
        if let Some(sim) = &e.sim {
            assert_eq!(
                sim.managed_residence(buf.as_ptr(), buf.len()),
                Some((CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, 0))
            );
        }
    }
}

#[test]
fn one_location_per_range_sends_each_range_to_its_own_location() {
    let e = env();
    let d = device0(&e);
    if lacks_concurrent_access("managed::prefetch_per_range", &d) {
        return;
    }
    let s = Stream::new(&d).unwrap();
    let buf = ManagedBuffer::new(&d, 12 * MIB).unwrap();
    let rs = ranges(&buf, 6, 2 * MIB);
    let locs = [
        Location::Device(0),
        Location::Device(0),
        Location::Host,
        Location::Device(0),
        Location::Host,
        Location::Host,
    ];
    managed::prefetch_many(&rs, &locs, &s).unwrap();
    s.synchronize().unwrap();
    for (r, l) in rs.iter().zip(locs) {
        let got = managed::last_prefetch_location(*r).unwrap();
        match l {
            Location::Host => assert!(host_like(got), "{got:?}"),
            l => assert_eq!(got, Some(l)),
        }
    }
}

#[test]
fn auto_policy_batches_large_ranges_and_loops_small_ones_on_cuda_13() {
    for v in VERSIONS {
        let e = sim(SimConfig::new(1, v));
        let sim = e.sim.as_ref().unwrap();
        let d = device0(&e);
        let s = Stream::new(&d).unwrap();
        let big = ManagedBuffer::new(&d, 8 * AUTO_BATCH_MIN_MEAN_RANGE).unwrap();
        let small = ManagedBuffer::new(&d, 64 * 64 * 1024).unwrap();
        let (b0, l0) = (
            sim.calls("cuMemPrefetchBatchAsync"),
            sim.calls("cuMemPrefetchAsync"),
        );
        managed::prefetch_many(&ranges(&big, 4, 2 * MIB), &[Location::Device(0)], &s).unwrap();
        let (b1, l1) = (
            sim.calls("cuMemPrefetchBatchAsync"),
            sim.calls("cuMemPrefetchAsync"),
        );
        if v >= 13000 {
            assert_eq!((b1 - b0, l1 - l0), (1, 0), "2 MiB ranges batch on {v}");
        } else {
            assert_eq!((b1 - b0, l1 - l0), (0, 4), "CUDA 12 ({v}) loops");
        }
        managed::prefetch_many(&ranges(&small, 64, 64 * 1024), &[Location::Device(0)], &s).unwrap();
        assert_eq!(
            sim.calls("cuMemPrefetchBatchAsync"),
            b1,
            "64 KiB ranges loop"
        );
        assert_eq!(sim.calls("cuMemPrefetchAsync"), l1 + 64);
        s.synchronize().unwrap();
    }
}

#[test]
fn bad_many_input_is_rejected_before_any_driver_call() {
    let e = sim(SimConfig::new(1, 13000));
    let sim = e.sim.as_ref().unwrap();
    let d = device0(&e);
    let s = Stream::new(&d).unwrap();
    let buf = ManagedBuffer::new(&d, 6 * MIB).unwrap();
    let rs = ranges(&buf, 3, 2 * MIB);
    let calls = || {
        [
            "cuMemPrefetchAsync",
            "cuMemPrefetchBatchAsync",
            "cuMemDiscardBatchAsync",
            "cuMemDiscardAndPrefetchBatchAsync",
        ]
        .map(|c| sim.calls(c))
    };
    let before = calls();
    let host = [Location::Host];
    let two = [Location::Host, Location::Device(0)];
    for policy in [
        PrefetchPolicy::Auto,
        PrefetchPolicy::Loop,
        PrefetchPolicy::Batch,
    ] {
        assert!(is_invalid(
            &managed::prefetch_many_with(&[], &host, &s, policy).unwrap_err(),
            "ranges"
        ));
        assert!(is_invalid(
            &managed::prefetch_many_with(&rs, &[], &s, policy).unwrap_err(),
            "locations"
        ));
        assert!(is_invalid(
            &managed::prefetch_many_with(&rs, &two, &s, policy).unwrap_err(),
            "locations"
        ));
    }
    assert!(is_invalid(
        &managed::discard_many(&[], &s).unwrap_err(),
        "ranges"
    ));
    assert!(is_invalid(
        &managed::discard_and_prefetch_many(&[], &host, &s).unwrap_err(),
        "ranges"
    ));
    assert!(is_invalid(
        &managed::discard_and_prefetch_many(&rs, &[], &s).unwrap_err(),
        "locations"
    ));
    assert!(is_invalid(
        &managed::discard_and_prefetch_many(&rs, &two, &s).unwrap_err(),
        "locations"
    ));
    assert_eq!(calls(), before, "nothing reached the driver");
}

#[test]
fn ranges_of_another_driver_are_rejected() {
    let e = sim(SimConfig::new(1, 13000));
    let d = device0(&e);
    let other = cuda_multimem_sim::driver_over(e.sim.as_ref().unwrap()).unwrap();
    let s = Stream::new(&other.device(0).unwrap()).unwrap();
    let buf = ManagedBuffer::new(&d, 2 * MIB).unwrap();
    assert!(is_invalid(
        &buf.prefetch(Location::Host, &s).unwrap_err(),
        "stream"
    ));
}

#[test]
fn discard_poisons_on_the_simulator_and_is_unsupported_on_cuda_12() {
    let e = env();
    let d = device0(&e);
    if lacks_concurrent_access("managed::discard", &d) {
        return;
    }
    let s = Stream::new(&d).unwrap();
    let mut buf = ManagedBuffer::new(&d, 4 * MIB).unwrap();
    let data = fill_random(&mut buf, 2);
    let part = buf.subrange(MIB, 2 * MIB).unwrap();
    let r = managed::discard(part, &s);
    if e.driver.version() < 13000 {
        let err = r.unwrap_err();
        assert!(
            matches!(
                &err,
                Error::Unsupported {
                    symbol: "cuMemDiscardBatchAsync",
                    needed: 13000,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(
            buf.host_slice().unwrap(),
            &data[..],
            "nothing was discarded"
        );
        return;
    }
    r.unwrap();
    s.synchronize().unwrap();
    let host = buf.host_slice().unwrap();
    assert_eq!(host[..MIB], data[..MIB], "before the range: intact");
    assert_eq!(host[3 * MIB..], data[3 * MIB..], "after the range: intact");
    if e.sim.is_some() {
        assert!(host[MIB..3 * MIB].iter().all(|&b| b == DISCARD_POISON));
    }
    // Writing after a discard makes the contents defined again.
    buf.host_slice_mut().unwrap()[MIB..3 * MIB].copy_from_slice(&data[MIB..3 * MIB]);
    assert_eq!(buf.host_slice().unwrap(), &data[..]);
}

#[test]
fn discard_and_prefetch_moves_pages_without_their_contents() {
    let e = env();
    let d = device0(&e);
    if lacks_concurrent_access("managed::discard_and_prefetch", &d) {
        return;
    }
    let s = Stream::new(&d).unwrap();
    let mut buf = ManagedBuffer::new(&d, 8 * MIB).unwrap();
    fill_random(&mut buf, 3);
    let rs = ranges(&buf, 4, 2 * MIB);
    let r = managed::discard_and_prefetch_many(&rs, &[Location::Device(0)], &s);
    if e.driver.version() < 13000 {
        let err = r.unwrap_err();
        assert!(
            matches!(
                &err,
                Error::Unsupported {
                    symbol: "cuMemDiscardAndPrefetchBatchAsync",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(buf
            .discard_and_prefetch(Location::Host, &s)
            .unwrap_err()
            .is_unsupported());
        return;
    }
    r.unwrap();
    s.synchronize().unwrap();
    for r in &rs {
        assert_eq!(
            managed::last_prefetch_location(*r).unwrap(),
            Some(Location::Device(0))
        );
    }
    if let Some(sim) = &e.sim {
        assert_eq!(
            sim.managed_residence(buf.as_ptr(), buf.len()),
            Some((CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, 0))
        );
        assert!(buf
            .host_slice()
            .unwrap()
            .iter()
            .all(|&b| b == DISCARD_POISON));
    }
    // New data written after the discard round-trips.
    let data = fill_random(&mut buf, 4);
    buf.discard_and_prefetch(Location::Host, &s).unwrap();
    s.synchronize().unwrap();
    assert!(host_like(buf.last_prefetch_location().unwrap()));
    let data2 = fill_random(&mut buf, 5);
    assert_ne!(data, data2);
    assert_eq!(buf.host_slice().unwrap(), &data2[..]);
}

#[test]
fn discarding_many_ranges_leaves_the_gaps_intact() {
    let e = env();
    let d = device0(&e);
    if lacks_concurrent_access("managed::discard_many", &d) {
        return;
    }
    if e.driver.version() < 13000 {
        return skip("managed::discard_many", "discard needs a CUDA 13.0 driver");
    }
    let s = Stream::new(&d).unwrap();
    let mut buf = ManagedBuffer::new(&d, 8 * MIB).unwrap();
    let data = fill_random(&mut buf, 6);
    let rs = [
        buf.subrange(0, 2 * MIB).unwrap(),
        buf.subrange(4 * MIB, 2 * MIB).unwrap(),
    ];
    managed::discard_many(&rs, &s).unwrap();
    s.synchronize().unwrap();
    let host = buf.host_slice().unwrap();
    assert_eq!(host[2 * MIB..4 * MIB], data[2 * MIB..4 * MIB]);
    assert_eq!(host[6 * MIB..], data[6 * MIB..]);
    if e.sim.is_some() {
        assert!(host[..2 * MIB].iter().all(|&b| b == DISCARD_POISON));
        assert!(host[4 * MIB..6 * MIB].iter().all(|&b| b == DISCARD_POISON));
    }
}

#[test]
fn cuda_12_0_uses_the_cudevice_abis_and_refuses_host_numa_without_calling() {
    let e = sim(SimConfig::new(2, 12000));
    let sim = e.sim.as_ref().unwrap();
    let d = device0(&e);
    let s = Stream::new(&d).unwrap();
    let buf = ManagedBuffer::new(&d, 2 * MIB).unwrap();
    buf.set_preferred_location(Location::Device(1)).unwrap();
    assert_eq!(buf.preferred_location().unwrap(), Some(Location::Device(1)));
    buf.set_preferred_location(Location::Host).unwrap();
    assert_eq!(buf.preferred_location().unwrap(), Some(Location::Host));
    buf.prefetch(Location::Device(1), &s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        buf.last_prefetch_location().unwrap(),
        Some(Location::Device(1))
    );
    let (advise, prefetch) = (sim.calls("cuMemAdvise"), sim.calls("cuMemPrefetchAsync"));
    for l in [Location::HostNuma(0), Location::HostNumaCurrent] {
        let err = buf.set_preferred_location(l).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::Unsupported {
                    needed: 12020,
                    driver: 12000,
                    ..
                }
            ),
            "{err:?}"
        );
        let err = buf.prefetch(l, &s).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::Unsupported {
                    symbol: "cuMemPrefetchAsync",
                    needed: 12020,
                    ..
                }
            ),
            "{err:?}"
        );
        let rs = ranges(&buf, 2, MIB);
        assert!(managed::prefetch_many(&rs, &[l], &s)
            .unwrap_err()
            .is_unsupported());
    }
    assert_eq!(
        (sim.calls("cuMemAdvise"), sim.calls("cuMemPrefetchAsync")),
        (advise, prefetch),
        "refused without a driver call"
    );
}

#[test]
fn every_managed_call_works_at_each_driver_version() {
    for v in VERSIONS {
        let e = sim(SimConfig::new(2, v));
        let sim = e.sim.as_ref().unwrap();
        let d = device0(&e);
        let s = Stream::new(&d).unwrap();
        let mut buf = ManagedBuffer::new(&d, 4 * MIB).unwrap();
        let data = fill_random(&mut buf, v as u64);
        buf.set_read_mostly(true).unwrap();
        assert!(buf.read_mostly().unwrap(), "{v}");
        buf.set_preferred_location(Location::Device(1)).unwrap();
        assert_eq!(
            buf.preferred_location().unwrap(),
            Some(Location::Device(1)),
            "{v}"
        );
        buf.set_accessed_by([Location::Device(0), Location::Host])
            .unwrap();
        assert_eq!(
            buf.accessed_by().unwrap(),
            BTreeSet::from([Location::Device(0), Location::Host]),
            "{v}"
        );
        let rs = ranges(&buf, 2, 2 * MIB);
        managed::prefetch_many(&rs, &[Location::Device(1), Location::Device(0)], &s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(
            managed::last_prefetch_location(rs[0]).unwrap(),
            Some(Location::Device(1))
        );
        assert_eq!(
            managed::last_prefetch_location(rs[1]).unwrap(),
            Some(Location::Device(0))
        );
        assert_eq!(
            buf.last_prefetch_location().unwrap(),
            None,
            "the halves disagree"
        );
        assert_eq!(
            buf.host_slice().unwrap(),
            &data[..],
            "{v}: prefetch keeps contents"
        );
        let numa = buf.set_preferred_location(Location::HostNuma(0));
        let discard = buf.discard(&s);
        let dp = buf.discard_and_prefetch(Location::Device(0), &s);
        if v >= 12020 {
            numa.unwrap();
            assert_eq!(
                buf.preferred_location().unwrap(),
                Some(Location::HostNuma(0))
            );
        } else {
            assert!(numa.unwrap_err().is_unsupported());
        }
        if v >= 13000 {
            discard.unwrap();
            dp.unwrap();
            s.synchronize().unwrap();
            assert_eq!(
                buf.last_prefetch_location().unwrap(),
                Some(Location::Device(0))
            );
            assert!(buf
                .host_slice()
                .unwrap()
                .iter()
                .all(|&b| b == DISCARD_POISON));
        } else {
            assert!(discard.unwrap_err().is_unsupported());
            assert!(dp.unwrap_err().is_unsupported());
            assert_eq!(sim.calls("cuMemDiscardBatchAsync"), 0);
        }
        buf.unset_preferred_location().unwrap();
        assert_eq!(buf.preferred_location().unwrap(), None);
        drop(buf);
        assert_eq!(sim.live_resources().get("managed allocations"), None, "{v}");
    }
}

#[test]
fn host_numa_current_prefetch_reads_back_as_requested() {
    let e = env();
    let d = device0(&e);
    if e.driver.version() < 12020 {
        return skip(
            "managed::numa_current_prefetch",
            "host NUMA locations need CUDA 12.2",
        );
    }
    let s = Stream::new(&d).unwrap();
    let buf = ManagedBuffer::new(&d, 2 * MIB).unwrap();
    buf.prefetch(Location::HostNumaCurrent, &s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        buf.last_prefetch_location().unwrap(),
        Some(Location::HostNumaCurrent),
        "the request is recorded as made (measured on a 13.0 driver)"
    );
    if let (Some(sim), Some(_)) = (&e.sim, d.host_numa_id().unwrap()) {
        // The simulated thread runs on host NUMA node 0.
        assert_eq!(
            sim.managed_residence(buf.as_ptr(), buf.len()),
            Some((CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA, 0)),
            "the pages went to a concrete node"
        );
    }
}

#[test]
fn host_attached_allocations_work_like_global_ones() {
    let e = env();
    let d = device0(&e);
    if lacks_concurrent_access("managed::attach_host", &d) {
        return;
    }
    let s = Stream::new(&d).unwrap();
    let mut buf = ManagedBuffer::with_attach(&d, 2 * MIB, managed::Attach::Host).unwrap();
    let data = fill_random(&mut buf, 7);
    buf.prefetch(Location::Device(0), &s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(buf.host_slice().unwrap(), &data[..]);
}
