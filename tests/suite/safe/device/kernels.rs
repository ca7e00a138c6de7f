//! Device buffers, stream-ordered memsets and copies, PTX modules and launches, bounded waits,
//! sticky kernel faults.

use super::*;

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
    // a kernel that runs until released on the simulator, for 2 s on a GPU: the bounded waits
    // must end at their 20 ms, long before it
    let bound = if e.sim.is_some() {
        Duration::from_secs(10)
    } else {
        Duration::from_secs(1)
    };
    let (ns, hold) = running_kernel(&e, 2_000_000_000);
    // SAFETY: one .u64 parameter; the kernel touches no memory.
    unsafe { spin.launch_u64(&LaunchConfig::linear(1, 1), r, &[ns]) }.unwrap();
    assert!(!s.is_idle().unwrap(), "the kernel is still running");
    times_out_after_20_ms(|t| s.wait_idle(t), bound);
    drop(hold);
    s.wait_idle(Duration::from_secs(60)).unwrap();
    assert!(s.is_idle().unwrap());
    // an event's wait is bounded the same way
    let ev = Event::new(&d, false).unwrap();
    let (ns, hold) = running_kernel(&e, 2_000_000_000);
    // SAFETY: as above.
    unsafe { spin.launch_u64(&LaunchConfig::linear(1, 1), r, &[ns]) }.unwrap();
    ev.record(&s).unwrap();
    times_out_after_20_ms(|t| ev.wait_complete(t), bound);
    drop(hold);
    ev.wait_complete(Duration::from_secs(60)).unwrap();
    assert!(ev.is_complete().unwrap() && s.is_idle().unwrap());
}

/// `wait` with a 20 ms timeout times out, saying so, after at least 20 ms and well before the
/// kernel it waits for ends (`bound`, generous: a loaded machine may be slow to wake it).
fn times_out_after_20_ms(wait: impl FnOnce(Duration) -> Result<(), Error>, bound: Duration) {
    let t = Instant::now();
    match wait(Duration::from_millis(20)) {
        Err(Error::Timeout { after, .. }) => assert_eq!(after, Duration::from_millis(20)),
        other => panic!("expected a timeout, got {other:?}"),
    }
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(20) && waited < bound,
        "bounded: {waited:?}"
    );
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
