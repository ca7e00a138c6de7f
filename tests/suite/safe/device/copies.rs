//! Overlapped copies (`cuMemcpyBatchAsync` from 12.8, the fallbacks before), batch copies
//! on the simulator, and frees that wait for the copies reading them.

use super::*;

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
        // (the copies wait behind a kernel that runs until the source has changed: held on the
        // simulator, 1 s on a GPU)
        let spin = add_kernel(&e).function("cmm_test_spin").unwrap();
        let (ns, hold) = running_kernel(&e, 1_000_000_000);
        // SAFETY: one .u64 parameter; the kernel touches no memory.
        unsafe { spin.launch_u64(&LaunchConfig::linear(1, 1), &s, &[ns]) }.unwrap();
        let during = attr(O::CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL, 0);
        assert_eq!(
            call([n, n], &mut [during, stream_order]),
            (CUresult::CUDA_SUCCESS, usize::MAX)
        );
        src.copy_from_host(0, &[2; 256]).unwrap();
        drop(hold);
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

/// Page-locked host memory mapped for the device: zeroed, its device address written by a copy
/// on a stream is what a plain host load reads, host stores are what the device reads back; a
/// zero length is refused naming it, an index past the end loads nothing.
#[test]
fn host_mapped_memory_is_written_through_its_device_address_and_read_by_host_loads() {
    let e = env();
    let d = e.driver.device(0).unwrap();
    let m = cuda_multimem::HostMappedBuffer::<u32>::zeroed(&d, 64).unwrap();
    assert_eq!(m.len(), 64);
    assert!(m.device_ptr() != 0);
    assert!((0..64).all(|i| m.load(i) == Some(0)));
    assert_eq!(m.load(64), None);
    let data: Vec<u32> = (0..64)
        .map(|i| 0x9e37_79b9u32.wrapping_mul(i + 1))
        .collect();
    let src = DeviceBuffer::from_host(&d, &data).unwrap();
    let s = Stream::new(&d).unwrap();
    // SAFETY: 256 bytes of a live device buffer into the 256 bytes of the mapped allocation
    // through its device address; the stream is synchronised before either is read or goes.
    unsafe {
        s.as_stream_ref()
            .copy_dtod_async(m.device_ptr(), src.device_ptr(), 256)
            .unwrap();
    }
    s.synchronize().unwrap();
    let got: Vec<u32> = (0..64).map(|i| m.load(i).unwrap()).collect();
    assert_eq!(got, data);
    // host stores, read by the device through the same address
    for (i, x) in data.iter().enumerate() {
        assert!(m.store(i, !x));
    }
    assert!(!m.store(64, 1));
    let back = DeviceBuffer::<u32>::zeroed(&d, 64).unwrap();
    // SAFETY: as above, the other way.
    unsafe {
        s.as_stream_ref()
            .copy_dtod_async(back.device_ptr(), m.device_ptr(), 256)
            .unwrap();
    }
    s.synchronize().unwrap();
    let want: Vec<u32> = data.iter().map(|x| !x).collect();
    assert_eq!(back.to_vec().unwrap(), want);
    match cuda_multimem::HostMappedBuffer::<u32>::zeroed(&d, 0) {
        Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, "len"),
        other => panic!("expected len refused, got {other:?}"),
    }
}
