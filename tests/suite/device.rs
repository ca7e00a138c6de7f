//! Driver selection, devices, attributes, peer access for ordinary allocations, streams and
//! events — the foundation every other module stands on.

use std::time::{Duration, Instant};

use cuda_multimem::sys::{CUfunction, CUmodule, CUresult};
use cuda_multimem::{
    CaptureMode, Device, DeviceBuffer, Driver, Error, Event, LaunchConfig, Module, Stream,
    StreamRef,
};
use cuda_multimem_sim::{KernelError, LaunchArgs, SimConfig};
use cuda_multimem_tests::{env, sim, skip, Env, Rng};

#[test]
fn a_malformed_driver_selection_is_an_error_naming_what_was_wrong() {
    for (value, needle) in [
        ("bogus", "expected `cuda` or `sim"),
        ("simulator", "expected `cuda` or `sim"),
        ("sim:devices", "not of the form key=value"),
        ("sim:devices=0", "devices"),
        ("sim:devices=65", "devices"),
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
    assert!(t.as_secs_f64() < 1.0, "{t:?}");
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

/// A second driver value over the same driver (or simulator) as `e`'s.
fn another_driver_value(e: &Env) -> Driver {
    match &e.sim {
        Some(s) => cuda_multimem_sim::driver_over(s).unwrap(),
        None => Driver::load().unwrap(),
    }
}

fn is_invalid(r: Result<(), Error>, arg: &str) -> String {
    match r {
        Err(Error::InvalidArgument { arg: a, reason }) if a == arg => reason,
        other => panic!("expected an invalid `{arg}`, got {other:?}"),
    }
}

#[test]
fn a_device_buffer_round_trips_random_data_at_every_offset() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    let mut rng = Rng::new(41);
    let data: Vec<u32> = (0..4099).map(|_| rng.next_u64() as u32).collect();
    let mut b = DeviceBuffer::from_host(&d, &data).unwrap();
    assert_eq!((b.len(), b.is_empty(), b.device()), (4099, false, &d));
    assert_eq!(b.to_vec().unwrap(), data);
    let patch: Vec<u32> = (0..100).map(|_| rng.next_u64() as u32).collect();
    b.copy_from_host(3999, &patch).unwrap();
    let mut want = data.clone();
    want[3999..].copy_from_slice(&patch);
    assert_eq!(b.to_vec().unwrap(), want);
    let mut part = vec![0u32; 7];
    b.copy_to_host(3995, &mut part).unwrap();
    assert_eq!(part, want[3995..4002]);
    let z = DeviceBuffer::<f64>::zeroed(&d, 513).unwrap();
    assert!(z.to_vec().unwrap().iter().all(|v| v.to_bits() == 0));
}

#[test]
fn device_buffer_ranges_are_checked_before_any_driver_call_and_empty_copies_succeed() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    assert!(is_invalid(DeviceBuffer::<u8>::zeroed(&d, 0).map(drop), "len").contains("0 elements"));
    assert!(
        is_invalid(DeviceBuffer::<u64>::zeroed(&d, usize::MAX).map(drop), "len")
            .contains("overflow")
    );
    assert!(matches!(
        DeviceBuffer::<f32>::from_host(&d, &[]),
        Err(Error::InvalidArgument { arg: "data", .. })
    ));
    let mut b = DeviceBuffer::<u16>::zeroed(&d, 10).unwrap();
    let mut out = [0u16; 4];
    is_invalid(b.copy_from_host(7, &[1, 2, 3, 4]), "src");
    is_invalid(b.copy_to_host(7, &mut out), "dst");
    is_invalid(b.copy_from_host(11, &[]), "offset");
    is_invalid(b.copy_to_host(usize::MAX, &mut out), "offset");
    is_invalid(b.copy_from_host(usize::MAX, &[1]), "offset");
    // Zero-length copies are no-ops, at any offset up to the end.
    b.copy_from_host(10, &[]).unwrap();
    b.copy_to_host(10, &mut []).unwrap();
    b.copy_from_host(0, &[]).unwrap();
    assert_eq!(b.to_vec().unwrap(), [0; 10]);
    let src = DeviceBuffer::<u16>::from_host(&d, &[5; 10]).unwrap();
    let s = Stream::new(&d).unwrap();
    is_invalid(b.copy_from_async(0, &src, 8, 3, &s), "len");
    is_invalid(b.copy_from_async(0, &src, usize::MAX, 1, &s), "src_offset");
    is_invalid(b.copy_from_async(9, &src, 0, usize::MAX, &s), "len");
    b.copy_from_async(10, &src, 10, 0, &s).unwrap();
    b.copy_from_async(2, &src, 4, 6, &s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(b.to_vec().unwrap(), [0, 0, 5, 5, 5, 5, 5, 5, 0, 0]);
}

#[test]
fn stream_ordered_memsets_and_copies_run_in_order() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    let a = DeviceBuffer::<u8>::zeroed(&d, 1 << 16).unwrap();
    let b = DeviceBuffer::<u8>::zeroed(&d, 1 << 16).unwrap();
    let s = Stream::new(&d).unwrap();
    let r = StreamRef::from(&s);
    // SAFETY: both ranges lie in live buffers of this device, synchronised before they go.
    unsafe {
        r.memset_d8_async(a.device_ptr(), 0xab, 1 << 16).unwrap();
        r.copy_dtod_async(b.device_ptr() + 8, a.device_ptr(), 100)
            .unwrap();
        r.memset_d8_async(a.device_ptr(), 0, 0).unwrap();
    }
    r.synchronize().unwrap();
    let got = b.to_vec().unwrap();
    assert!(got[..8].iter().all(|&v| v == 0));
    assert!(got[8..108].iter().all(|&v| v == 0xab));
    assert!(got[108..].iter().all(|&v| v == 0));
}

const ADD_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry cmm_test_add_u32(
	.param .u64 p_ptr,
	.param .u64 p_value,
	.param .u64 p_n
)
{
	.reg .pred %p;
	.reg .b32 %r<7>;
	.reg .b64 %rd<8>;
	ld.param.u64 %rd1, [p_ptr];
	ld.param.u64 %rd2, [p_value];
	ld.param.u64 %rd3, [p_n];
	mov.u32 %r1, %ctaid.x;
	mov.u32 %r2, %ntid.x;
	mov.u32 %r3, %tid.x;
	mad.lo.u32 %r4, %r1, %r2, %r3;
	cvt.u64.u32 %rd4, %r4;
	setp.ge.u64 %p, %rd4, %rd3;
	@%p bra DONE;
	cvta.to.global.u64 %rd5, %rd1;
	shl.b64 %rd6, %rd4, 2;
	add.u64 %rd7, %rd5, %rd6;
	ld.global.u32 %r5, [%rd7];
	cvt.u32.u64 %r6, %rd2;
	add.u32 %r5, %r5, %r6;
	st.global.u32 [%rd7], %r5;
DONE:
	ret;
}

.visible .entry cmm_test_spin(
	.param .u64 p_ns
)
{
	.reg .pred %p;
	.reg .b64 %rd<5>;
	ld.param.u64 %rd1, [p_ns];
	mov.u64 %rd2, %globaltimer;
SPIN:
	mov.u64 %rd3, %globaltimer;
	sub.u64 %rd4, %rd3, %rd2;
	setp.lt.u64 %p, %rd4, %rd1;
	@%p bra SPIN;
	ret;
}
"#;

/// The simulator's equivalent of `cmm_test_add_u32`: every element below n (and below the
/// grid's thread count) gets value added.
fn add_u32_on_the_host(a: &LaunchArgs) -> Result<(), KernelError> {
    let (ptr, value, n) = (a.u64(0)? as usize, a.u64(1)? as u32, a.u64(2)? as usize);
    let threads = (a.grid.0 * a.block.0) as usize;
    let n = n.min(threads);
    a.check(ptr, 4 * n, true)?;
    for i in 0..n {
        let p = (ptr + 4 * i) as *mut u32;
        // SAFETY: checked above: device memory (host memory in the simulator) the kernel may
        // write, aligned as the launch's caller promised.
        unsafe { p.write(p.read().wrapping_add(value)) };
    }
    Ok(())
}

fn add_kernel(e: &Env) -> Module {
    add_kernel_on(e, 0)
}

/// [`add_kernel`]'s module loaded on device `ordinal`.
fn add_kernel_on(e: &Env, ordinal: usize) -> Module {
    if e.sim.is_some() {
        cuda_multimem_sim::register_kernel("cmm_test_add_u32", add_u32_on_the_host);
        cuda_multimem_sim::register_kernel("cmm_test_spin", |a| {
            std::thread::sleep(Duration::from_nanos(a.u64(0)?));
            Ok(())
        });
    }
    Module::load_ptx(&e.driver.device(ordinal).unwrap(), ADD_PTX).unwrap()
}

#[test]
fn handles_of_the_safe_layer_can_be_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Module>();
    send_sync::<cuda_multimem::Function>();
    send_sync::<DeviceBuffer<f32>>();
    send_sync::<StreamRef<'static>>();
    send_sync::<cuda_multimem::Graph>();
    send_sync::<cuda_multimem::GraphExec>();
}

#[test]
fn a_ptx_kernel_is_loaded_and_launched_on_a_stream() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    let f = add_kernel(&e).function("cmm_test_add_u32").unwrap();
    assert_eq!((f.name(), f.device()), ("cmm_test_add_u32", &d));
    let n = 1000usize;
    let data: Vec<u32> = (0..n as u32).collect();
    let b = DeviceBuffer::from_host(&d, &data).unwrap();
    let s = Stream::new(&d).unwrap();
    let f2 = f.clone();
    std::thread::spawn(move || drop(f2)).join().unwrap();
    // SAFETY: three .u64 parameters; the kernel writes the n elements of `b`, which outlives
    // the synchronisation below.
    unsafe {
        f.launch_u64(
            &LaunchConfig::linear(4, 256),
            &s,
            &[b.device_ptr(), 7, n as u64],
        )
        .unwrap()
    };
    s.synchronize().unwrap();
    let want: Vec<u32> = data.iter().map(|v| v + 7).collect();
    assert_eq!(b.to_vec().unwrap(), want);
}

#[test]
fn launches_are_checked_before_the_driver_sees_them() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    let module = add_kernel(&e);
    assert!(matches!(
        module.function("cmm_test_add_u32\0x"),
        Err(Error::InvalidArgument { arg: "name", .. })
    ));
    assert!(module.function("no_such_kernel").is_err());
    assert!(matches!(
        Module::load_ptx(&d, "bad\0ptx"),
        Err(Error::InvalidArgument { arg: "ptx", .. })
    ));
    assert!(Module::load_ptx(&d, "this is not PTX").is_err());
    let f = module.function("cmm_test_add_u32").unwrap();
    let s = Stream::new(&d).unwrap();
    let launch = |c: LaunchConfig, s: StreamRef<'_>| {
        // SAFETY: every one of these is refused before the driver call.
        unsafe { f.launch_u64(&c, s, &[0, 0, 0]) }
    };
    for (c, needle) in [
        (LaunchConfig::linear(0, 32), "grid"),
        (LaunchConfig::linear(1, 0), "block"),
        (LaunchConfig::linear(1, 1025), "1025 threads"),
        (
            LaunchConfig {
                grid: [1, 1, 1],
                block: [64, 32, 2],
                shared_mem_bytes: 0,
            },
            "4096 threads",
        ),
    ] {
        let why = is_invalid(launch(c, s.as_stream_ref()), "config");
        assert!(why.contains(needle), "{why}");
    }
    let other = another_driver_value(&e);
    let d_other = other.device(0).unwrap();
    let s_other = Stream::new(&d_other).unwrap();
    let why = is_invalid(
        launch(LaunchConfig::linear(1, 1), (&s_other).into()),
        "stream",
    );
    assert!(why.contains("another Driver value"), "{why}");
    let ev = Event::new(&d, false).unwrap();
    let why = is_invalid(ev.record(&s_other), "stream");
    assert!(why.contains("another Driver value"), "{why}");
    assert!(d.driver().same_as(&e.driver) && !other.same_as(&e.driver));
    if e.driver.device_count() > 1 {
        let s1 = Stream::new(&e.driver.device(1).unwrap()).unwrap();
        let why = is_invalid(launch(LaunchConfig::linear(1, 1), (&s1).into()), "stream");
        assert!(
            why.contains("a stream of device 1; the function is loaded on device 0"),
            "{why}"
        );
        let why = is_invalid(ev.record(&s1), "stream");
        assert!(why.contains("a stream of device 1"), "{why}");
    }
}

#[test]
fn a_captured_memset_and_copy_replay_from_the_graph() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    let n = 4096;
    let a = DeviceBuffer::<u8>::zeroed(&d, n).unwrap();
    let mut b = DeviceBuffer::<u8>::zeroed(&d, n).unwrap();
    let s = Stream::new(&d).unwrap();
    let r = s.as_stream_ref();
    assert!(!r.is_capturing().unwrap());
    r.begin_capture(CaptureMode::Global).unwrap();
    assert!(r.is_capturing().unwrap());
    // SAFETY: ranges inside live buffers that outlive every replay (synchronised below).
    unsafe {
        r.memset_d8_async(a.device_ptr(), 0x5a, n).unwrap();
        r.copy_dtod_async(b.device_ptr(), a.device_ptr(), n / 2)
            .unwrap();
    }
    let g = r.end_capture().unwrap();
    assert!(!r.is_capturing().unwrap());
    assert!(
        b.to_vec().unwrap().iter().all(|&v| v == 0),
        "captured work does not run"
    );
    // SAFETY: the buffers and streams the capture used outlive `exec` (declared before it).
    let exec = unsafe { g.instantiate() }.unwrap();
    drop(g);
    for round in 0..3 {
        b.copy_from_host(0, &vec![round; n]).unwrap();
        exec.launch(&s).unwrap();
        s.synchronize().unwrap();
        let got = b.to_vec().unwrap();
        assert!(got[..n / 2].iter().all(|&v| v == 0x5a), "round {round}");
        assert!(got[n / 2..].iter().all(|&v| v == round), "round {round}");
    }
    let other = another_driver_value(&e);
    let s_other = Stream::new(&other.device(0).unwrap()).unwrap();
    assert!(matches!(
        exec.launch(&s_other),
        Err(Error::InvalidArgument { arg: "stream", .. })
    ));
    // SAFETY: the legacy default stream of device 0.
    let legacy = unsafe { StreamRef::from_raw(&d, std::ptr::null_mut()) };
    assert!(matches!(
        legacy.begin_capture(CaptureMode::Relaxed),
        Err(Error::InvalidArgument { arg: "stream", .. })
    ));
}

#[test]
fn a_stream_reports_idle_and_a_bounded_wait_times_out_on_a_running_kernel() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    let s = Stream::new(&d).unwrap();
    assert!(s.is_idle().unwrap());
    s.wait_idle(Duration::from_millis(10)).unwrap();
    let r: StreamRef<'_> = (&s).into();
    assert_eq!(r.device(), &d);
    assert_eq!(r.raw(), s.raw());
    let spin = add_kernel(&e).function("cmm_test_spin").unwrap();
    // SAFETY: one .u64 parameter; the kernel touches no memory.
    unsafe { spin.launch_u64(&LaunchConfig::linear(1, 1), r, &[400_000_000]) }.unwrap();
    assert!(!s.is_idle().unwrap(), "a 400 ms kernel is still running");
    times_out_after_20_ms(|t| s.wait_idle(t));
    s.wait_idle(Duration::from_secs(60)).unwrap();
    assert!(s.is_idle().unwrap());
    // an event's wait is bounded the same way
    let ev = Event::new(&d, false).unwrap();
    // SAFETY: as above.
    unsafe { spin.launch_u64(&LaunchConfig::linear(1, 1), r, &[400_000_000]) }.unwrap();
    ev.record(&s).unwrap();
    times_out_after_20_ms(|t| ev.wait_complete(t));
    ev.wait_complete(Duration::from_secs(60)).unwrap();
    assert!(ev.is_complete().unwrap() && s.is_idle().unwrap());
}

/// `wait(20 ms)` on work that runs longer answers `Error::Timeout` after 20 ms, not much later.
fn times_out_after_20_ms(wait: impl FnOnce(Duration) -> Result<(), Error>) {
    let t = Instant::now();
    match wait(Duration::from_millis(20)) {
        Err(Error::Timeout { after, .. }) => assert_eq!(after, Duration::from_millis(20)),
        other => panic!("expected a timeout, got {other:?}"),
    }
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(20) && waited < Duration::from_millis(300),
        "bounded: {waited:?}"
    );
}

/// A PTX module loaded on `device` (raw driver calls: the safe layer has no module type yet),
/// and its kernel `name`; unloaded on drop.
pub(crate) struct RawKernel {
    driver: Driver,
    device: Device,
    module: CUmodule,
    /// The kernel.
    pub function: CUfunction,
}

impl RawKernel {
    /// Load `ptx` (without its NUL) on `device` and look up `name`.
    pub(crate) fn load(device: &Device, ptx: &str, name: &str) -> Result<RawKernel, CUresult> {
        let driver = device.driver().clone();
        device.bind().expect("the device's context");
        let text = std::ffi::CString::new(ptx).expect("PTX without NUL");
        let cname = std::ffi::CString::new(name).expect("a name without NUL");
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image and a valid out-pointer; the context is current.
        let rc =
            unsafe { driver.sys().cuModuleLoadData().unwrap()(&mut module, text.as_ptr().cast()) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(rc);
        }
        let mut k = RawKernel {
            driver,
            device: device.clone(),
            module,
            function: std::ptr::null_mut(),
        };
        // SAFETY: a live module, a NUL-terminated name, a valid out-pointer.
        let rc = unsafe {
            k.driver.sys().cuModuleGetFunction().unwrap()(&mut k.function, module, cname.as_ptr())
        };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(rc);
        }
        Ok(k)
    }

    /// Launch with one block of one thread on `stream` with these parameters (pointers to each
    /// parameter's value, as `cuLaunchKernel` takes them).
    pub(crate) fn launch(&self, stream: &Stream, params: &mut [*mut std::ffi::c_void]) -> CUresult {
        self.device.bind().expect("the device's context");
        let p = if params.is_empty() {
            std::ptr::null_mut()
        } else {
            params.as_mut_ptr()
        };
        // SAFETY: a live kernel of this device's module; `params` points at one value per kernel
        // parameter, read during the call (the driver copies them).
        unsafe {
            self.driver.sys().cuLaunchKernel().unwrap()(
                self.function,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream.raw(),
                p,
                std::ptr::null_mut(),
            )
        }
    }
}

impl Drop for RawKernel {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: we loaded this module; its kernels are not used after this.
        unsafe { self.driver.sys().cuModuleUnload().unwrap()(self.module) };
    }
}

/// PTX of a kernel `name` without parameters that returns at once (the simulator runs the host
/// equivalent registered under the same name).
fn empty_ptx(name: &str) -> String {
    format!(
        ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry {name}()\n{{\n\tret;\n}}\n"
    )
}

#[test]
fn a_kernel_fault_is_sticky_for_its_context_and_other_devices_stay_healthy() {
    // Simulator only: on a GPU, this would kill device 0's context under every parallel test.
    let e = sim(SimConfig::new(2, 13030));
    let d = &e.driver;
    cuda_multimem_sim::register_kernel("sticky_fault_probe", |_| {
        Err(KernelError::IllegalAddress { addr: 0, len: 4 })
    });
    let (d0, d1) = (d.device(0).unwrap(), d.device(1).unwrap());
    let k = RawKernel::load(&d0, &empty_ptx("sticky_fault_probe"), "sticky_fault_probe").unwrap();
    let s0 = Stream::new(&d0).unwrap();
    let s1 = Stream::new(&d1).unwrap();
    assert_eq!(k.launch(&s0, &mut []), CUresult::CUDA_SUCCESS);
    let code = |r: Result<(), Error>| r.err().and_then(|e| e.code());
    let dead = CUresult::CUDA_ERROR_ILLEGAL_ADDRESS;
    assert_eq!(code(s0.synchronize()), Some(dead), "the fault");
    assert_eq!(
        code(s0.synchronize()),
        Some(dead),
        "again: the context is dead"
    );
    let sys = d.sys();
    d0.bind().unwrap();
    let mut p = 0u64;
    // SAFETY: valid out-pointers; device 0's context is current; nothing is written on failure.
    unsafe {
        assert_eq!(sys.cuCtxSynchronize_v2000().unwrap()(), dead);
        assert_eq!(
            sys.cuMemAlloc_v3020().unwrap()(&mut p, 4096),
            dead,
            "allocation"
        );
        let byte = 0u8;
        assert_eq!(
            sys.cuMemcpyHtoD_v3020().unwrap()(0x1000, (&byte as *const u8).cast(), 1),
            dead,
            "copy"
        );
    }
    assert_eq!(k.launch(&s0, &mut []), dead, "launch");
    assert_eq!(
        RawKernel::load(&d0, &empty_ptx("sticky_fault_probe"), "sticky_fault_probe").err(),
        Some(dead),
        "module load"
    );
    // Device 1 is another context: healthy.
    s1.synchronize().unwrap();
    d1.bind().unwrap();
    // SAFETY: valid out-pointer; device 1's context is current; freed below.
    unsafe {
        assert_eq!(
            sys.cuMemAlloc_v3020().unwrap()(&mut p, 4096),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(sys.cuMemFree_v3020().unwrap()(p), CUresult::CUDA_SUCCESS);
    }
}

#[test]
fn a_zero_length_blocking_copy_or_memset_is_a_no_op() {
    let e = env();
    let dev = e.driver.device(0).unwrap();
    // SAFETY: zero bytes at any address: nothing is written.
    unsafe {
        dev.copy_from_host_blocking(0, &[]).unwrap();
        dev.memset_blocking(0, 0xff, 0).unwrap();
    }
}

/// Which call an overlapped copy on a stream of `e`'s driver takes: `cuMemcpyBatchAsync` from
/// 12.8 on, `cuMemcpyDtoDAsync` before.
fn batch_copies_available(e: &Env) -> bool {
    e.driver.version() >= 12080
}

/// How often the simulator behind `e` saw `symbol` (0 on the real driver).
fn sim_calls(e: &Env, symbol: &str) -> u64 {
    e.sim.as_ref().map_or(0, |s| s.calls(symbol))
}

#[test]
fn an_overlapped_copy_copies_random_data_exactly_at_any_size_and_offset() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    let n = (1 << 20) + 64;
    let src_data = cuda_multimem_tests::random_bytes(n, 71);
    let src = DeviceBuffer::from_host(&d, &src_data).unwrap();
    let mut dst = DeviceBuffer::<u8>::zeroed(&d, n).unwrap();
    let s = Stream::new(&d).unwrap();
    let batches = sim_calls(&e, "cuMemcpyBatchAsync");
    let mut copies = 0;
    for (bytes, src_off, dst_off) in [
        (1, 0, 0),
        (3, 1, 7),
        (4096, 13, 0),
        (65_537, 0, 5),
        (1 << 20, 63, 17),
        ((1 << 20) + 13, 7, 1),
    ] {
        let fill = cuda_multimem_tests::random_bytes(n, bytes as u64);
        dst.copy_from_host(0, &fill).unwrap();
        // SAFETY: both ranges lie inside live buffers of device 0 (offset + bytes <= n), the
        // buffers are distinct, and the stream is synchronised before they are read or go.
        unsafe {
            s.as_stream_ref().copy_dtod_async_overlapped(
                dst.device_ptr() + dst_off as u64,
                src.device_ptr() + src_off as u64,
                bytes,
            )
        }
        .unwrap();
        copies += 1;
        s.synchronize().unwrap();
        let mut want = fill;
        want[dst_off..dst_off + bytes].copy_from_slice(&src_data[src_off..src_off + bytes]);
        assert!(
            dst.to_vec().unwrap() == want,
            "{bytes} bytes from offset {src_off} to offset {dst_off}: only that range changed, to the source's bytes"
        );
    }
    if e.sim.is_some() && batch_copies_available(&e) {
        assert_eq!(
            sim_calls(&e, "cuMemcpyBatchAsync") - batches,
            copies,
            "one batch copy per call from 12.8 on"
        );
    }
}

#[test]
fn an_overlapped_copy_of_zero_bytes_is_a_no_op() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    let dst = DeviceBuffer::<u8>::from_host(&d, &[9; 64]).unwrap();
    let src = DeviceBuffer::<u8>::zeroed(&d, 64).unwrap();
    let s = Stream::new(&d).unwrap();
    let (batches, dtods) = (
        sim_calls(&e, "cuMemcpyBatchAsync"),
        sim_calls(&e, "cuMemcpyDtoDAsync"),
    );
    // SAFETY: zero bytes: nothing is read or written, whatever the addresses.
    unsafe {
        let r = s.as_stream_ref();
        r.copy_dtod_async_overlapped(dst.device_ptr(), src.device_ptr(), 0)
            .unwrap();
        r.copy_dtod_async_overlapped(0, 0, 0).unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(dst.to_vec().unwrap(), [9; 64]);
    assert_eq!(
        (
            sim_calls(&e, "cuMemcpyBatchAsync"),
            sim_calls(&e, "cuMemcpyDtoDAsync")
        ),
        (batches, dtods),
        "no driver copy at all"
    );
}

/// Inside a capture the overlapped copy becomes an ordinary memcpy node (the batch call is not
/// documented as capturable), in a capture of its own stream and in a fork that joined one.
#[test]
fn an_overlapped_copy_is_captured_into_a_graph_and_replays() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    let n = 1 << 16;
    let a = DeviceBuffer::<u8>::zeroed(&d, n).unwrap();
    let mut b = DeviceBuffer::<u8>::zeroed(&d, n).unwrap();
    let mut c = DeviceBuffer::<u8>::zeroed(&d, n).unwrap();
    let (s, fork) = (Stream::new(&d).unwrap(), Stream::new(&d).unwrap());
    let (forked, joined) = (
        Event::new(&d, false).unwrap(),
        Event::new(&d, false).unwrap(),
    );
    let batches = sim_calls(&e, "cuMemcpyBatchAsync");
    let r = s.as_stream_ref();
    r.begin_capture(CaptureMode::Global).unwrap();
    // SAFETY: ranges inside live buffers that outlive every replay (synchronised below).
    unsafe {
        r.memset_d8_async(a.device_ptr(), 0x3c, n).unwrap();
        r.copy_dtod_async_overlapped(b.device_ptr() + 1, a.device_ptr(), n - 1)
            .unwrap();
        forked.record(&s).unwrap();
        fork.wait(&forked).unwrap();
        assert!(fork.as_stream_ref().is_capturing().unwrap());
        fork.as_stream_ref()
            .copy_dtod_async_overlapped(c.device_ptr(), b.device_ptr(), n)
            .unwrap();
        joined.record(&fork).unwrap();
        s.wait(&joined).unwrap();
    }
    let g = r.end_capture().unwrap();
    assert_eq!(
        sim_calls(&e, "cuMemcpyBatchAsync"),
        batches,
        "a capturing stream takes cuMemcpyDtoDAsync"
    );
    assert!(
        b.to_vec().unwrap().iter().all(|&v| v == 0),
        "captured work does not run"
    );
    // SAFETY: the buffers and streams the capture used outlive `exec` (declared before it).
    let exec = unsafe { g.instantiate() }.unwrap();
    drop(g);
    for round in 1..=3u8 {
        b.copy_from_host(0, &vec![round; n]).unwrap();
        c.copy_from_host(0, &vec![0; n]).unwrap();
        exec.launch(&s).unwrap();
        s.synchronize().unwrap();
        let got = b.to_vec().unwrap();
        assert_eq!(got[0], round, "round {round}: byte 0 is not copied");
        assert!(got[1..].iter().all(|&v| v == 0x3c), "round {round}");
        assert_eq!(c.to_vec().unwrap(), got, "round {round}: the fork's copy");
    }
}

/// The legacy default stream, which `cuMemcpyBatchAsync` refuses, gets `cuMemcpyDtoDAsync`.
#[test]
fn an_overlapped_copy_on_the_legacy_default_stream_falls_back_and_is_correct() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    let data = cuda_multimem_tests::random_bytes(4099, 5);
    let src = DeviceBuffer::from_host(&d, &data).unwrap();
    let dst = DeviceBuffer::<u8>::zeroed(&d, data.len()).unwrap();
    let batches = sim_calls(&e, "cuMemcpyBatchAsync");
    // SAFETY: the legacy default stream of device 0.
    let legacy = unsafe { StreamRef::from_raw(&d, std::ptr::null_mut()) };
    // SAFETY: whole live buffers, synchronised before they are read or go.
    unsafe { legacy.copy_dtod_async_overlapped(dst.device_ptr(), src.device_ptr(), data.len()) }
        .unwrap();
    legacy.synchronize().unwrap();
    assert_eq!(dst.to_vec().unwrap(), data);
    assert_eq!(sim_calls(&e, "cuMemcpyBatchAsync"), batches);
}

/// A driver before 12.8 has no `cuMemcpyBatchAsync`: the overlapped copy is a plain
/// `cuMemcpyDtoDAsync`, just as correct.
#[test]
fn an_overlapped_copy_on_a_driver_before_12_8_falls_back_and_is_correct() {
    let e = sim(SimConfig::new(1, 12000));
    let d = e.driver.device(0).unwrap();
    assert!(e.driver.sys().cuMemcpyBatchAsync_v12080().is_err());
    assert!(e.driver.sys().cuMemcpyBatchAsync_v13000().is_err());
    let data = cuda_multimem_tests::random_bytes((1 << 20) + 3, 12000);
    let src = DeviceBuffer::from_host(&d, &data).unwrap();
    let dst = DeviceBuffer::<u8>::zeroed(&d, data.len() + 1).unwrap();
    let s = Stream::new(&d).unwrap();
    // SAFETY: inside live buffers (dst has one byte more), synchronised before they are read.
    unsafe {
        s.as_stream_ref().copy_dtod_async_overlapped(
            dst.device_ptr() + 1,
            src.device_ptr(),
            data.len(),
        )
    }
    .unwrap();
    s.synchronize().unwrap();
    assert_eq!(dst.to_vec().unwrap()[1..], data[..]);
    assert_eq!(sim_calls(&e, "cuMemcpyBatchAsync"), 0);
    assert_eq!(sim_calls(&e, "cuMemcpyDtoDAsync"), 1);
}

/// `cuMemcpyBatchAsync` at the newest ABI `sys` offers, in the 13000 signature (the 12080
/// form's `failIdx` is discarded).
///
/// # Safety
/// As `cuMemcpyBatchAsync` requires: each non-null array valid for `count` (copies) or
/// `num_attrs` (attribute sets) elements.
#[allow(clippy::too_many_arguments)]
unsafe fn batch_copy(
    sys: &cuda_multimem::sys::Driver,
    dsts: *mut cuda_multimem::sys::CUdeviceptr,
    srcs: *mut cuda_multimem::sys::CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    attrs: *mut cuda_multimem::sys::CUmemcpyAttributes,
    idxs: *mut usize,
    num_attrs: usize,
    stream: cuda_multimem::sys::CUstream,
) -> CUresult {
    let mut fail = usize::MAX;
    // SAFETY: as the caller promises; `fail` is valid for one write.
    unsafe {
        match sys.cuMemcpyBatchAsync_v13000() {
            Ok(f) => f(dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream),
            Err(_) => sys.cuMemcpyBatchAsync_v12080().expect("a driver from 12.8")(
                dsts, srcs, sizes, count, attrs, idxs, num_attrs, &mut fail, stream,
            ),
        }
    }
}

/// `cuMemcpyBatchAsync` refuses what its documentation (cuda.h) rules out, with
/// `CUDA_ERROR_INVALID_VALUE` and without copying: an empty batch, a missing array, attribute
/// indices that do not start at 0, do not increase or reach past the batch, more attribute sets
/// than copies, an invalid source access order, and the legacy default stream. Checked on
/// whichever driver runs the suite from 12.8 on; before 12.8 the driver has no such call.
#[test]
fn a_batch_copy_refuses_what_its_documentation_rules_out() {
    use cuda_multimem::sys::{
        CUmemcpyAttributes, CUmemcpyFlags_enum as F, CUmemcpySrcAccessOrder_enum as O,
    };
    let e = env();
    let sys = e.driver.sys();
    if !batch_copies_available(&e) {
        assert!(
            sys.cuMemcpyBatchAsync_v12080().is_err() && sys.cuMemcpyBatchAsync_v13000().is_err()
        );
        return skip(
            "a_batch_copy_refuses_what_its_documentation_rules_out",
            format!("driver {} predates cuMemcpyBatchAsync", e.driver.version()),
        );
    }
    let d = e.driver.device(0).unwrap();
    d.bind().unwrap();
    let n = 4096;
    let src = DeviceBuffer::<u8>::from_host(&d, &[7; 4096]).unwrap();
    let dst = DeviceBuffer::<u8>::zeroed(&d, 2 * n).unwrap();
    let s = Stream::new(&d).unwrap();
    let attr = |order: O, flags: u32| CUmemcpyAttributes {
        srcAccessOrder: order,
        flags,
        ..CUmemcpyAttributes::default()
    };
    let stream_order = attr(O::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, 0);
    // Each case: (what, count, attributes, their indices, null array, legacy stream).
    type Case = (
        &'static str,
        usize,
        Vec<CUmemcpyAttributes>,
        Vec<usize>,
        bool,
        bool,
    );
    let cases: Vec<Case> = vec![
        ("count 0", 0, vec![stream_order], vec![0], false, false),
        ("null dsts", 2, vec![stream_order], vec![0], true, false),
        ("no attributes", 2, vec![], vec![], false, false),
        (
            "first index 1",
            2,
            vec![stream_order],
            vec![1],
            false,
            false,
        ),
        (
            "indices not increasing",
            2,
            vec![stream_order; 2],
            vec![0, 0],
            false,
            false,
        ),
        (
            "index past the batch",
            2,
            vec![stream_order; 2],
            vec![0, 2],
            false,
            false,
        ),
        (
            "more attributes than copies",
            1,
            vec![stream_order; 2],
            vec![0, 1],
            false,
            false,
        ),
        (
            "invalid source access order",
            2,
            vec![attr(O::CU_MEMCPY_SRC_ACCESS_ORDER_INVALID, 0)],
            vec![0],
            false,
            false,
        ),
        (
            "legacy default stream",
            2,
            vec![stream_order],
            vec![0],
            false,
            true,
        ),
    ];
    for (what, count, mut attrs, mut idxs, null, legacy) in cases {
        let mut dsts = [dst.device_ptr(), dst.device_ptr() + n as u64];
        let mut srcs = [src.device_ptr(); 2];
        let mut sizes = [n; 2];
        let stream = if legacy {
            std::ptr::null_mut()
        } else {
            s.raw()
        };
        // SAFETY: every array holds at least `count` (copies) or `attrs.len()` (attribute
        // sets) elements, or is null where the case says so; the ranges are live buffers of
        // device 0, so a call the driver did not refuse would copy valid memory.
        let rc = unsafe {
            batch_copy(
                sys,
                if null {
                    std::ptr::null_mut()
                } else {
                    dsts.as_mut_ptr()
                },
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                count,
                if attrs.is_empty() {
                    std::ptr::null_mut()
                } else {
                    attrs.as_mut_ptr()
                },
                if idxs.is_empty() {
                    std::ptr::null_mut()
                } else {
                    idxs.as_mut_ptr()
                },
                attrs.len(),
                stream,
            )
        };
        if legacy && e.sim.is_none() {
            // documented ("must not be legacy NULL stream"), its status is not
            assert_ne!(rc, CUresult::CUDA_SUCCESS, "{what}");
        } else {
            assert_eq!(rc, CUresult::CUDA_ERROR_INVALID_VALUE, "{what}");
        }
    }
    s.synchronize().unwrap();
    assert!(
        dst.to_vec().unwrap().iter().all(|&v| v == 0),
        "a refused batch copies nothing"
    );
    // And a valid batch of two copies with two attribute sets (the second with the overlap
    // flag) copies both.
    let mut dsts = [dst.device_ptr(), dst.device_ptr() + n as u64];
    let mut srcs = [src.device_ptr(); 2];
    let mut sizes = [n, n - 1];
    let mut attrs = [
        stream_order,
        attr(
            O::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            F::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE.0,
        ),
    ];
    let mut idxs = [0, 1];
    // SAFETY: two copies inside live buffers, two attribute sets, a live stream.
    let rc = unsafe {
        batch_copy(
            sys,
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            2,
            attrs.as_mut_ptr(),
            idxs.as_mut_ptr(),
            2,
            s.raw(),
        )
    };
    assert_eq!(rc, CUresult::CUDA_SUCCESS);
    s.synchronize().unwrap();
    let got = dst.to_vec().unwrap();
    assert!(got[..2 * n - 1].iter().all(|&v| v == 7) && got[2 * n - 1] == 0);
}

/// The simulator's `cuMemcpyBatchAsync` at ABI 12080 reports where a batch failed through
/// `failIdx` (`usize::MAX` for the batch as a whole), refuses unknown flags, reads a source
/// with `DURING_API_CALL` order before it returns, and exists only from 12.8 on.
#[test]
fn the_simulated_batch_copy_reports_the_failing_copy_and_reads_during_call_sources_at_once() {
    use cuda_multimem::sys::{CUmemcpyAttributes, CUmemcpySrcAccessOrder_enum as O};
    for version in [12000, 12080, 13000] {
        let e = sim(SimConfig::new(1, version));
        let sys = e.driver.sys();
        assert_eq!(sys.cuMemcpyBatchAsync_v12080().is_ok(), version >= 12080);
        assert_eq!(sys.cuMemcpyBatchAsync_v13000().is_ok(), version >= 13000);
        let Ok(batch) = sys.cuMemcpyBatchAsync_v12080() else {
            continue;
        };
        let d = e.driver.device(0).unwrap();
        d.bind().unwrap();
        let n = 256;
        let mut src = DeviceBuffer::<u8>::from_host(&d, &[1; 256]).unwrap();
        let dst = DeviceBuffer::<u8>::zeroed(&d, 2 * n).unwrap();
        let s = Stream::new(&d).unwrap();
        let attr = |order: O, flags: u32| CUmemcpyAttributes {
            srcAccessOrder: order,
            flags,
            ..CUmemcpyAttributes::default()
        };
        let call = |sizes: [usize; 2], attrs: &mut [CUmemcpyAttributes]| {
            let mut dsts = [dst.device_ptr(), dst.device_ptr() + n as u64];
            let mut srcs = [src.device_ptr(); 2];
            let mut sizes = sizes;
            let mut idxs: Vec<usize> = (0..attrs.len()).collect();
            let mut fail = 42usize;
            // SAFETY: two copies, `attrs.len()` attribute sets and indices, a live stream.
            let rc = unsafe {
                batch(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    2,
                    attrs.as_mut_ptr(),
                    idxs.as_mut_ptr(),
                    attrs.len(),
                    &mut fail,
                    s.raw(),
                )
            };
            (rc, fail)
        };
        let stream_order = attr(O::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, 0);
        assert_eq!(
            call([n, n], &mut [attr(O::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, 2)]),
            (CUresult::CUDA_ERROR_INVALID_VALUE, usize::MAX),
            "unknown flag"
        );
        assert_eq!(
            call([n, n + 1], &mut [stream_order]),
            (CUresult::CUDA_ERROR_INVALID_VALUE, 1),
            "the second copy reads past the source"
        );
        // DURING_API_CALL: the source as it was during the call, even if it changes before
        // the copy runs in stream order.
        let spin = add_kernel(&e).function("cmm_test_spin").unwrap();
        // SAFETY: one .u64 parameter; the kernel touches no memory.
        unsafe { spin.launch_u64(&LaunchConfig::linear(1, 1), &s, &[50_000_000]) }.unwrap();
        let during = attr(O::CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL, 0);
        assert_eq!(
            call([n, n], &mut [during, stream_order]),
            (CUresult::CUDA_SUCCESS, usize::MAX)
        );
        src.copy_from_host(0, &[2; 256]).unwrap();
        s.synchronize().unwrap();
        let got = dst.to_vec().unwrap();
        assert!(got[..n].iter().all(|&v| v == 1), "read during the call");
        assert!(got[n..].iter().all(|&v| v == 2), "read in stream order");
    }
}

/// `DeviceBuffer`'s drop frees with `cuMemFree`, and the safe copies rely on it waiting for the
/// work queued that reads the buffer. Checked for a copy queued on a non-blocking stream of the
/// buffer's own device and on a stream of another device (a peer copy), each held behind a
/// 300 ms kernel so it cannot have run when the buffer goes. 2 x H200: the drop took 300 ms
/// both ways, the stream idle after it (and 0.1 ms with unrelated work queued on the other
/// device); the simulator waited only for the legacy and blocking streams before and crashed
/// under the copy.
#[test]
fn freeing_a_buffer_waits_for_the_queued_copies_that_read_it() {
    let e = env();
    let n = e.driver.device_count();
    for (src_dev, stream_dev) in [(0, 0), (0, 1)] {
        if stream_dev >= n {
            return skip(
                "freeing_a_buffer_waits_for_the_queued_copies_that_read_it (the peer copy)",
                format!("{n} device(s); the peer case needs 2"),
            );
        }
        let ds = e.driver.device(src_dev).unwrap();
        let dd = e.driver.device(stream_dev).unwrap();
        let len = 16 << 20;
        let src = DeviceBuffer::<u32>::from_host(&ds, &vec![0x5a5a_5a5a; len]).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(&dd, len).unwrap();
        let s = Stream::new(&dd).unwrap();
        let module = add_kernel_on(&e, stream_dev);
        let spin = module.function("cmm_test_spin").unwrap();
        // SAFETY: one .u64 parameter; the kernel touches no memory.
        unsafe { spin.launch_u64(&LaunchConfig::linear(1, 1), &s, &[300_000_000]) }.unwrap();
        dst.copy_from_async(0, &src, 0, len, &s).unwrap();
        let t = Instant::now();
        drop(src);
        let took = t.elapsed();
        let idle = s.is_idle().unwrap();
        println!(
            "FREE-WAIT source on device {src_dev}, stream on device {stream_dev}: drop took {took:?}, stream idle after it: {idle}"
        );
        s.wait_idle(Duration::from_secs(60)).unwrap();
        assert!(
            idle,
            "the source (device {src_dev}) was freed while a copy on device {stream_dev} still had to read it ({took:?})"
        );
        assert!(dst.to_vec().unwrap().iter().all(|&v| v == 0x5a5a_5a5a));
    }
}
