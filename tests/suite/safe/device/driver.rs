//! Driver selection, the simulated driver's report, attributes, peer access, events,
//! contexts, the legacy stream's order and captures that fork.

use super::*;

#[test]
fn a_malformed_driver_selection_is_an_error_naming_what_was_wrong() {
    for (value, needle) in [
        ("bogus", "expected `cuda` or `sim"),
        ("simulator", "expected `cuda` or `sim"),
        ("sim:devices", "not of the form key=value"),
        ("sim:devices=0", "devices"),
        ("sim:devices=73", "devices"),
        ("sim:version=11080", "version"),
        ("sim:version=13055", "version"),
        ("sim:version=abc", "abc"),
        ("sim:colour=blue", "unknown simulator option `colour`"),
        ("sim:multicast=maybe", "multicast"),
    ] {
        match cuda_multimem_sim::driver_from_selection(value) {
            Err(Error::Config(msg)) => assert!(msg.contains(needle), "{value}: {msg}"),
            other => panic!("{value}: expected a configuration error, got {other:?}"),
        }
    }
}

/// The library does not link the simulator: selecting it through `cuda_multimem::Driver` is a
/// configuration error that says where the simulated driver is selected.
#[test]
fn the_library_refuses_to_select_the_simulator_and_says_where_it_is_selected() {
    for value in ["sim", "sim:devices=2", " sim:version=13000 "] {
        match Driver::from_selection(value) {
            Err(Error::Config(msg)) => assert!(
                msg.contains("cuda_multimem_sim::driver_from_env()"),
                "{value}: {msg}"
            ),
            other => panic!("{value}: expected a configuration error, got {other:?}"),
        }
    }
    for value in ["bogus", "simulator"] {
        match Driver::from_selection(value) {
            Err(Error::Config(msg)) => assert!(msg.contains("expected `cuda`"), "{value}: {msg}"),
            other => panic!("{value}: expected a configuration error, got {other:?}"),
        }
    }
    let d = cuda_multimem_sim::driver_from_selection("sim:devices=3,version=12080").unwrap();
    assert!(d.is_simulated() && d.device_count() == 3 && d.version() == 12080);
}

#[test]
fn a_path_to_a_library_that_is_not_a_cuda_driver_is_a_clear_error() {
    let e = cuda_multimem_sys::Driver::load_from("libm.so.6").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("libm.so.6") && msg.contains("not a usable CUDA driver"),
        "{msg}"
    );
}

#[test]
fn the_simulated_driver_reports_its_configuration() {
    let e = sim(SimConfig::parse("devices=3,version=12080,cliques=2,numa=-1").unwrap());
    let d = &e.driver;
    assert!(d.is_simulated());
    assert_eq!(d.version(), 12080);
    assert_eq!(d.device_count(), 3);
    let devs = d.devices();
    assert!(devs[0].can_access_peer(&devs[1]).unwrap());
    assert!(
        !devs[0].can_access_peer(&devs[2]).unwrap(),
        "devices of different cliques are not peers"
    );
    assert_eq!(devs[0].host_numa_id().unwrap(), None);
    assert_eq!(
        devs[0].logical_endpoint_unicast().unwrap(),
        None,
        "12.8 predates attribute 153"
    );
    assert!(d.device(3).is_err());
}

#[test]
fn device_attributes_are_consistent() {
    let e = env();
    for dev in e.driver.devices() {
        let (major, _) = dev.compute_capability().unwrap();
        assert!(major >= 7, "compute capability {major}");
        assert!(dev.multiprocessor_count().unwrap() > 0);
        assert!(!dev.name().unwrap().is_empty());
        let (free, total) = dev.memory_info().unwrap();
        assert!(free <= total && total == dev.total_memory().unwrap());
        // Logical-endpoint attributes exist exactly from 13.3.
        assert_eq!(
            dev.logical_endpoint_unicast().unwrap().is_some(),
            e.driver.version() >= 13030
        );
    }
}

#[test]
fn peer_access_for_ordinary_allocations_goes_through_the_context() {
    let e = env();
    let d = &e.driver;
    if d.device_count() < 2 {
        return skip(
            "peer_access_for_ordinary_allocations_goes_through_the_context",
            "needs two devices",
        );
    }
    let (a, b) = (d.device(0).unwrap(), d.device(1).unwrap());
    if !a.can_access_peer(&b).unwrap() {
        return skip(
            "peer_access_for_ordinary_allocations_goes_through_the_context",
            "devices 0 and 1 are not peers",
        );
    }
    assert!(matches!(
        a.enable_peer_access(&a),
        Err(Error::InvalidArgument { arg: "peer", .. })
    ));
    a.enable_peer_access(&b).unwrap();
    a.enable_peer_access(&b).unwrap(); // already enabled is not an error
                                       // Copy device 1 -> device 0 with cuMemcpyPeer and check the bytes.
    let sys = d.sys();
    let n = 1 << 20;
    let mut data = vec![0u8; n];
    Rng::new(7).fill(&mut data);
    let (mut pa, mut pb) = (0u64, 0u64);
    b.bind().unwrap();
    // SAFETY: out-pointer valid; device 1's context is current; the source buffer holds n bytes.
    unsafe {
        assert_eq!(
            sys.cuMemAlloc_v3020().unwrap()(&mut pb, n),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            sys.cuMemcpyHtoD_v3020().unwrap()(pb, data.as_ptr().cast(), n),
            CUresult::CUDA_SUCCESS
        );
    }
    a.bind().unwrap();
    let mut back = vec![0u8; n];
    // SAFETY: as above, on device 0; both allocations hold n bytes.
    unsafe {
        assert_eq!(
            sys.cuMemAlloc_v3020().unwrap()(&mut pa, n),
            CUresult::CUDA_SUCCESS
        );
        let rc = sys.cuMemcpyPeer().unwrap()(
            pa,
            a.primary_context().unwrap(),
            pb,
            b.primary_context().unwrap(),
            n,
        );
        assert_eq!(rc, CUresult::CUDA_SUCCESS);
        assert_eq!(
            sys.cuMemcpyDtoH_v3020().unwrap()(back.as_mut_ptr().cast(), pa, n),
            CUresult::CUDA_SUCCESS
        );
        sys.cuMemFree_v3020().unwrap()(pa);
        b.bind().unwrap();
        sys.cuMemFree_v3020().unwrap()(pb);
    }
    assert_eq!(back, data);
}

#[test]
fn events_time_stream_work_and_report_completion() {
    let e = env();
    let dev = e.driver.device(0).unwrap();
    let s = Stream::new(&dev).unwrap();
    let (a, b) = (
        Event::new(&dev, true).unwrap(),
        Event::new(&dev, true).unwrap(),
    );
    a.record(&s).unwrap();
    b.record(&s).unwrap();
    b.synchronize().unwrap();
    assert!(a.is_complete().unwrap() && b.is_complete().unwrap());
    let t = b.elapsed_since(&a).unwrap();
    // two records back to back: a sane, small time (generous: a loaded machine may keep the
    // stream's worker from the second record for a while)
    assert!(t.as_secs_f64() < 10.0, "{t:?}");
    s.synchronize().unwrap();
    let untimed = Event::new(&dev, false).unwrap();
    untimed.record(&s).unwrap();
    untimed.synchronize().unwrap();
    assert!(
        b.elapsed_since(&untimed).is_err(),
        "an event without timing cannot be timed"
    );
    if e.driver.device_count() > 1 {
        let other = Stream::new(&e.driver.device(1).unwrap()).unwrap();
        assert!(matches!(
            a.record(&other),
            Err(Error::InvalidArgument { arg: "stream", .. })
        ));
    }
}

#[test]
fn an_event_timed_against_itself_is_zero_and_returns() {
    let e = env();
    let dev = e.driver.device(0).unwrap();
    let s = Stream::new(&dev).unwrap();
    let ev = Event::new(&dev, true).unwrap();
    ev.record(&s).unwrap();
    ev.synchronize().unwrap();
    // On a thread, so that a deadlock fails the test instead of hanging the suite.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = ev.elapsed_since(&ev).map_err(|e| e.to_string());
        let _ = tx.send(r);
        drop(ev);
    });
    let t = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("elapsed_since(self) returned within 10 s")
        .unwrap();
    assert_eq!(t, std::time::Duration::ZERO);
}

#[test]
fn primary_contexts_are_released_when_the_last_driver_clone_goes() {
    let e = sim(SimConfig::new(2, 13000));
    let s = e.sim.clone().unwrap();
    let d2 = e.driver.clone();
    d2.device(0).unwrap().bind().unwrap();
    d2.device(1).unwrap().bind().unwrap();
    assert_eq!(s.live_resources().get("primary contexts"), Some(&2));
    drop(d2);
    assert_eq!(
        s.live_resources().get("primary contexts"),
        Some(&2),
        "a clone still holds them"
    );
    drop(e.driver);
    assert_eq!(s.live_resources().get("primary contexts"), None);
}

/// The simulator keeps the real driver's copy semantics: a synchronous `cuMemcpyHtoD` from
/// pageable memory returns before all of its bytes reached the device (here: past the first
/// MiB), and a non-blocking stream does not wait for the legacy stream — the race the two-process
/// allreduce test hit on H200s. A blocking stream does wait; so does anyone who synchronises the
/// legacy stream. Simulator only (on a GPU the window is microseconds, not a test).
#[test]
fn pageable_copies_land_in_the_legacy_streams_order_and_non_blocking_streams_do_not_wait() {
    let e = sim(SimConfig::new(1, 13000));
    let d = e.driver.device(0).unwrap();
    d.bind().unwrap();
    let sys = e.driver.sys();
    let n = 3 << 20;
    let mut a = 0;
    let mut b = 0;
    // SAFETY: out-pointers valid, context current.
    unsafe {
        assert_eq!(
            sys.cuMemAlloc_v3020().unwrap()(&mut a, n),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            sys.cuMemAlloc_v3020().unwrap()(&mut b, n),
            CUresult::CUDA_SUCCESS
        );
    }
    let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8 + 1).collect();
    let copy_and_read = |flags: u32, sync_legacy: bool| -> Vec<u8> {
        // SAFETY: both ranges are n bytes of live allocations; the stream is created, used and
        // destroyed here; `back` holds n bytes.
        unsafe {
            assert_eq!(
                sys.cuMemsetD8_v3020().unwrap()(a, 0, n),
                CUresult::CUDA_SUCCESS
            );
            assert_eq!(
                sys.cuMemsetD8_v3020().unwrap()(b, 0, n),
                CUresult::CUDA_SUCCESS
            );
            assert_eq!(
                sys.cuStreamSynchronize().unwrap()(std::ptr::null_mut()),
                CUresult::CUDA_SUCCESS
            );
            let mut s = std::ptr::null_mut();
            assert_eq!(
                sys.cuStreamCreate().unwrap()(&mut s, flags),
                CUresult::CUDA_SUCCESS
            );
            assert_eq!(
                sys.cuMemcpyHtoD_v3020().unwrap()(a, data.as_ptr().cast(), n),
                CUresult::CUDA_SUCCESS
            );
            if sync_legacy {
                assert_eq!(
                    sys.cuStreamSynchronize().unwrap()(std::ptr::null_mut()),
                    CUresult::CUDA_SUCCESS
                );
            }
            // a's bytes as the stream sees them, copied to b in its order
            assert_eq!(
                sys.cuMemcpyDtoDAsync_v3020().unwrap()(b, a, n, s),
                CUresult::CUDA_SUCCESS
            );
            assert_eq!(
                sys.cuStreamSynchronize().unwrap()(s),
                CUresult::CUDA_SUCCESS
            );
            assert_eq!(
                sys.cuStreamDestroy_v4000().unwrap()(s),
                CUresult::CUDA_SUCCESS
            );
            let mut back = vec![0u8; n];
            assert_eq!(
                sys.cuMemcpyDtoH_v3020().unwrap()(back.as_mut_ptr().cast(), b, n),
                CUresult::CUDA_SUCCESS
            );
            back
        }
    };
    let non_blocking = cuda_multimem::sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING.0;
    // non-blocking stream, nobody waited: the first MiB is there, the rest is not yet
    let got = copy_and_read(non_blocking, false);
    assert!(got[..1 << 20] == data[..1 << 20]);
    assert!(
        got[1 << 20..].iter().all(|&x| x == 0),
        "the staged part landed early"
    );
    // the same after synchronising the legacy stream: all of it
    assert!(copy_and_read(non_blocking, true) == data);
    // a blocking stream waits for the legacy stream by itself
    assert!(copy_and_read(0, false) == data);
    // SAFETY: our allocations, no work pending on them.
    unsafe {
        sys.cuMemFree_v3020().unwrap()(a);
        sys.cuMemFree_v3020().unwrap()(b);
    }
}

/// Fork and join inside a stream capture, the usual multi-stream graph pattern: a second stream
/// joins the capture by waiting on an event recorded in it, its work becomes part of the graph,
/// and the capture must wait on it again before it ends (else CUDA_ERROR_STREAM_CAPTURE_UNJOINED).
/// Runs on the simulator and on the real driver alike.
#[test]
fn a_capture_forks_into_a_second_stream_and_must_join_it_back() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    d.bind().unwrap();
    let sys = e.driver.sys();
    let n = 1 << 20; // 4-byte words
    let (mut a, mut b) = (0, 0);
    // SAFETY: out-pointers valid, context current; the allocations are freed at the end.
    unsafe {
        assert_eq!(
            sys.cuMemAlloc_v3020().unwrap()(&mut a, 4 * n),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            sys.cuMemAlloc_v3020().unwrap()(&mut b, 4 * n),
            CUresult::CUDA_SUCCESS
        );
    }
    let origin = Stream::new(&d).unwrap();
    let fork = Stream::new(&d).unwrap();
    let (fork_ev, join_ev) = (
        Event::new(&d, false).unwrap(),
        Event::new(&d, false).unwrap(),
    );
    let begin = sys.cuStreamBeginCapture_v10010().unwrap();
    let end = sys.cuStreamEndCapture().unwrap();
    let wait = sys.cuStreamWaitEvent().unwrap();
    let is_capturing = |s: &Stream| {
        let mut st = cuda_multimem::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream, a valid out-pointer.
        unsafe { sys.cuStreamIsCapturing().unwrap()(s.raw(), &mut st) };
        st == cuda_multimem::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
    };
    let global = cuda_multimem::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    for round in 0..2u32 {
        let joined = round == 0;
        // SAFETY: live streams, events and allocations of device 0; every call checked.
        unsafe {
            assert_eq!(begin(origin.raw(), global), CUresult::CUDA_SUCCESS);
            fork_ev.record(&origin).unwrap();
            assert_eq!(wait(fork.raw(), fork_ev.raw(), 0), CUresult::CUDA_SUCCESS);
            assert!(is_capturing(&fork), "the fork joined the capture");
            // the fork fills a, the origin (after joining the fork back) copies a to b
            assert_eq!(
                sys.cuMemsetD32Async_v3020().unwrap()(a, 7 + round, n, fork.raw()),
                CUresult::CUDA_SUCCESS
            );
            if joined {
                join_ev.record(&fork).unwrap();
                assert_eq!(wait(origin.raw(), join_ev.raw(), 0), CUresult::CUDA_SUCCESS);
                assert_eq!(
                    sys.cuMemcpyDtoDAsync_v3020().unwrap()(b, a, 4 * n, origin.raw()),
                    CUresult::CUDA_SUCCESS
                );
            }
            let mut graph = std::ptr::null_mut();
            let rc = end(origin.raw(), &mut graph);
            assert!(!is_capturing(&fork), "the capture's end releases the fork");
            if !joined {
                assert_eq!(rc, CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
                continue;
            }
            assert_eq!(rc, CUresult::CUDA_SUCCESS);
            let mut exec = std::ptr::null_mut();
            assert_eq!(
                sys.cuGraphInstantiateWithFlags().unwrap()(&mut exec, graph, 0),
                CUresult::CUDA_SUCCESS
            );
            sys.cuGraphDestroy().unwrap()(graph);
            assert_eq!(
                sys.cuGraphLaunch().unwrap()(exec, origin.raw()),
                CUresult::CUDA_SUCCESS
            );
            origin.synchronize().unwrap();
            let mut back = vec![0u32; n];
            assert_eq!(
                sys.cuMemcpyDtoH_v3020().unwrap()(back.as_mut_ptr().cast(), b, 4 * n),
                CUresult::CUDA_SUCCESS
            );
            assert!(
                back.iter().all(|&x| x == 7),
                "the graph ran the fork's memset before the copy"
            );
            sys.cuGraphExecDestroy().unwrap()(exec);
        }
    }
    // SAFETY: our allocations, nothing pending on them.
    unsafe {
        sys.cuMemFree_v3020().unwrap()(a);
        sys.cuMemFree_v3020().unwrap()(b);
    }
}
