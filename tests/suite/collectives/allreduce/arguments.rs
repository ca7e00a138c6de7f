//! Bad input refused before any launch, naming the argument: run-time dtype lengths and
//! alignment, views past the end, overflowing and wrapping raw ranges, lengths, overlaps,
//! foreign buffers, devices, streams and drivers, ranks, team sizes, allocations, configurations.

use super::*;

#[test]
fn all_reduce_dyn_refuses_a_length_that_is_not_a_whole_number_of_elements() {
    let e = ar_env();
    let Some(comm) = team(&e, "dyn_length") else {
        return;
    };
    let s = streams(&comm);
    let mut buf = comm.alloc::<u8>(4096).unwrap();
    let before = launches(&e);
    let h = comm.rank(0).unwrap();
    let err = h
        .all_reduce_dyn_in_place(
            DType::F32,
            buf.slice_mut(..6).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "buf");
    let mut out = comm.alloc::<u8>(4096).unwrap();
    let err = h
        .all_reduce_dyn(
            DType::Bf16,
            buf.slice(..7).unwrap(),
            out.slice_mut(..7).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "input");
    assert_eq!(launches(&e), before);
}

#[test]
fn all_reduce_dyn_refuses_a_view_misaligned_for_its_dtype() {
    let e = ar_env();
    let Some(comm) = team(&e, "dyn_misaligned") else {
        return;
    };
    let s = streams(&comm);
    let buf = comm.alloc::<u8>(4096).unwrap();
    let mut out = comm.alloc::<u8>(4096).unwrap();
    let before = launches(&e);
    let h = comm.rank(0).unwrap();
    let err = h
        .all_reduce_dyn(
            DType::F32,
            buf.slice(2..66).unwrap(),
            out.slice_mut(..64).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "input");
    let err = h
        .all_reduce_dyn(
            DType::F16,
            buf.slice(..64).unwrap(),
            out.slice_mut(1..65).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "output");
    // the caller's own bytes, one byte in
    let d = comm.device(0).unwrap();
    let own = DeviceBuffer::<u8>::zeroed(d, 4096).unwrap();
    // SAFETY: 64 bytes inside `own`, which outlives the (refused) call.
    let src = unsafe { Src::<u8>::from_raw(own.device_ptr() + 1, 64) };
    let err = h
        .all_reduce_dyn(
            DType::F32,
            src,
            out.slice_mut(..64).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "input");
    assert_eq!(launches(&e), before);
}

// ---- bounds and foreign operands: refused before any launch ----

#[test]
fn views_past_the_end_are_refused_naming_the_range() {
    let e = ar_env();
    let Some(comm) = team(&e, "views_past_the_end") else {
        return;
    };
    let mut buf = comm.alloc::<f32>(1000).unwrap();
    let n = buf.len();
    for r in [
        buf.slice(..n + 1).map(|_| ()),
        buf.slice(usize::MAX..).map(|_| ()),
        buf.slice(0..=usize::MAX).map(|_| ()),
        buf.slice(n / 2..n / 4).map(|_| ()),
        buf.slice(..).unwrap().slice(1..=n).map(|_| ()),
    ] {
        assert_eq!(invalid_arg(r.unwrap_err()), "range");
    }
    for r in [
        buf.slice_mut(..n + 1).map(|_| ()),
        buf.slice_mut(usize::MAX..).map(|_| ()),
        buf.slice_mut(0..=usize::MAX).map(|_| ()),
    ] {
        assert_eq!(invalid_arg(r.unwrap_err()), "range");
    }
    let mut v = buf.slice_mut(10..20).unwrap();
    assert_eq!(invalid_arg(v.slice_mut(..11).unwrap_err()), "range");
    assert_eq!(invalid_arg(v.split_at_mut(11).unwrap_err()), "mid");
    assert_eq!(buf.slice(n..).unwrap().len(), 0);
    // host copies too
    assert_eq!(
        invalid_arg(buf.write(0, n - 1, &[1.0, 2.0]).unwrap_err()),
        "data"
    );
    assert_eq!(
        invalid_arg(buf.write(0, usize::MAX, &[1.0]).unwrap_err()),
        "data"
    );
    let mut out = [0f32; 2];
    assert_eq!(
        invalid_arg(buf.read(0, n - 1, &mut out).unwrap_err()),
        "out"
    );
}

#[test]
fn a_raw_count_whose_byte_size_overflows_is_refused_naming_the_operand() {
    let e = ar_env();
    let Some(comm) = team(&e, "raw_count_overflow") else {
        return;
    };
    let s = streams(&comm);
    let mut buf = comm.alloc::<f32>(1024).unwrap();
    let p = buf.device_ptr(0).unwrap();
    let before = launches(&e);
    let h = comm.rank(0).unwrap();
    // SAFETY (each): refused before anything reads the range.
    let err = h
        .all_reduce(
            unsafe { Src::<f32>::from_raw(p, usize::MAX) },
            &mut buf,
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "input");
    let err = h
        .all_reduce(
            &buf,
            unsafe { Dst::<f32>::from_raw(p, usize::MAX / 2) },
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "output");
    let err = h
        .all_reduce_in_place(
            unsafe { Dst::<bf16>::from_raw(p, usize::MAX) },
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "buf");
    assert_eq!(launches(&e), before);
}

#[test]
fn a_raw_pointer_range_that_wraps_the_address_space_is_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "raw_wrap") else {
        return;
    };
    let s = streams(&comm);
    let before = launches(&e);
    let top: u64 = !15;
    // SAFETY: refused before anything reads the range.
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce_in_place(
            unsafe { Dst::<f32>::from_raw(top, 8) },
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert!(err.to_string().contains("wrap"), "{err}");
    assert_eq!(invalid_arg(err), "buf");
    assert_eq!(launches(&e), before);
}

#[test]
fn operands_of_different_lengths_are_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "different_lengths") else {
        return;
    };
    let s = streams(&comm);
    let buf = comm.alloc::<f32>(1024).unwrap();
    let mut out = comm.alloc::<f32>(1024).unwrap();
    let before = launches(&e);
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce(
            buf.slice(..100).unwrap(),
            out.slice_mut(..101).unwrap(),
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "output");
    assert_eq!(launches(&e), before);
}

#[test]
fn an_output_that_partly_overlaps_the_input_is_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "partial_overlap") else {
        return;
    };
    let s = streams(&comm);
    let d = comm.device(0).unwrap();
    let own = DeviceBuffer::<f32>::zeroed(d, 1024).unwrap();
    let p = own.device_ptr();
    let before = launches(&e);
    // SAFETY: both ranges inside `own`; refused before anything touches them.
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce(
            unsafe { Src::<f32>::from_raw(p, 64) },
            unsafe { Dst::<f32>::from_raw(p + 16, 64) },
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "output");
    assert_eq!(launches(&e), before);
    assert!(own.to_vec().unwrap().iter().all(|&x| x == 0.0));
}

#[test]
fn a_misaligned_raw_pointer_is_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "misaligned_raw") else {
        return;
    };
    let s = streams(&comm);
    let d = comm.device(0).unwrap();
    let own = DeviceBuffer::<f32>::zeroed(d, 1024).unwrap();
    let mut out = DeviceBuffer::<f32>::zeroed(d, 64).unwrap();
    let before = launches(&e);
    // SAFETY: inside `own`; refused before anything reads it.
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce(
            unsafe { Src::<f32>::from_raw(own.device_ptr() + 2, 64) },
            &mut out,
            ReduceOp::Sum,
            &s[0],
        )
        .unwrap_err();
    assert_eq!(invalid_arg(err), "input");
    assert_eq!(launches(&e), before);
}

#[test]
fn a_buffer_of_another_communicator_is_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "foreign_buffer") else {
        return;
    };
    let other = team(&e, "foreign_buffer").unwrap();
    let s = streams(&comm);
    let foreign = other.alloc::<f32>(1024).unwrap();
    let mut buf = comm.alloc::<f32>(1024).unwrap();
    let before = launches(&e);
    let h = comm.rank(0).unwrap();
    let err = h
        .all_reduce(&foreign, &mut buf, ReduceOp::Sum, &s[0])
        .unwrap_err();
    assert_eq!(invalid_arg(err), "input");
    let mut foreign = foreign;
    let err = h
        .all_reduce(&buf, &mut foreign, ReduceOp::Sum, &s[0])
        .unwrap_err();
    assert_eq!(invalid_arg(err), "output");
    assert_eq!(launches(&e), before);
}

#[test]
fn a_device_buffer_of_another_device_is_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "foreign_device_buffer") else {
        return;
    };
    let s = streams(&comm);
    let on_1 = DeviceBuffer::<f32>::zeroed(comm.device(1).unwrap(), 64).unwrap();
    let mut on_0 = DeviceBuffer::<f32>::zeroed(comm.device(0).unwrap(), 64).unwrap();
    let before = launches(&e);
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce(&on_1, &mut on_0, ReduceOp::Sum, &s[0])
        .unwrap_err();
    assert!(err.to_string().contains("memory of device 1"), "{err}");
    assert_eq!(invalid_arg(err), "input");
    assert_eq!(launches(&e), before);
}

#[test]
fn a_stream_of_another_device_is_refused_saying_so() {
    let e = ar_env();
    let Some(comm) = team(&e, "foreign_stream_device") else {
        return;
    };
    let s = streams(&comm);
    let mut buf = comm.alloc::<f32>(64).unwrap();
    let before = launches(&e);
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1])
        .unwrap_err();
    assert!(err.to_string().contains("a stream of device 1"), "{err}");
    assert_eq!(invalid_arg(err), "stream");
    assert_eq!(launches(&e), before);
}

#[test]
fn a_stream_from_another_driver_value_is_refused_saying_so() {
    let e = ar_env();
    let Some(comm) = team(&e, "foreign_stream_driver") else {
        return;
    };
    let other = match &e.sim {
        Some(s) => cuda_multimem_sim::driver_over(s).unwrap(),
        None => Driver::from_env().unwrap(),
    };
    assert!(!other.same_as(&e.driver));
    let foreign = Stream::new(&other.device(0).unwrap()).unwrap();
    let mut buf = comm.alloc::<f32>(64).unwrap();
    let before = launches(&e);
    let err = comm
        .rank(0)
        .unwrap()
        .all_reduce_in_place(&mut buf, ReduceOp::Sum, &foreign)
        .unwrap_err();
    assert!(err.to_string().contains("another Driver value"), "{err}");
    assert_eq!(invalid_arg(err), "stream");
    assert_eq!(launches(&e), before);
}

#[test]
fn a_rank_the_process_does_not_drive_is_refused() {
    let e = ar_env();
    let Some(comm) = team(&e, "unknown_rank") else {
        return;
    };
    assert_eq!(invalid_arg(comm.rank(2).unwrap_err()), "rank");
    let buf = comm.alloc::<f32>(64).unwrap();
    assert_eq!(invalid_arg(buf.write(2, 0, &[1.0]).unwrap_err()), "rank");
}

/// A team of one device runs an allreduce as a local copy (nothing in place), reported as
/// `Path::Local`; a device listed twice is refused unless ranks may share devices.
#[test]
fn a_team_of_one_device_copies_and_a_repeated_device_needs_the_opt_in() {
    let e = ar_env();
    let d = e.driver.devices();
    let comm = Communicator::new(&d[..1]).unwrap();
    assert_eq!(comm.size(), 1);
    let s = Stream::new(&d[0]).unwrap();
    let input: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let i = DeviceBuffer::from_host(&d[0], &input).unwrap();
    let mut o = DeviceBuffer::<f32>::zeroed(&d[0], input.len()).unwrap();
    let c = comm
        .rank(0)
        .unwrap()
        .all_reduce(&i, &mut o, ReduceOp::Sum, &s)
        .unwrap();
    assert_eq!(
        (c.path, c.algorithm),
        (cuda_multimem_collectives::Path::Local, Algorithm::Local),
        "{c}"
    );
    let mut buf = comm.alloc::<f32>(input.len()).unwrap();
    buf.write(0, 0, &input).unwrap();
    let c = comm
        .rank(0)
        .unwrap()
        .all_reduce_in_place(&mut buf, ReduceOp::Max, &s)
        .unwrap();
    assert_eq!(c.path, cuda_multimem_collectives::Path::Local);
    s.synchronize().unwrap();
    comm.check().unwrap();
    assert_eq!(o.to_vec().unwrap(), input);
    assert_eq!(buf.to_vec(0).unwrap(), input);
    if d.len() >= 2 {
        let err = Communicator::new(&[d[0].clone(), d[0].clone()]).unwrap_err();
        assert_eq!(invalid_arg(err), "devices");
        Communicator::builder(&[d[0].clone(), d[0].clone()])
            .allow_shared_devices(true)
            .build()
            .unwrap();
    }
}

#[test]
fn alloc_refuses_zero_and_overflowing_lengths() {
    let e = ar_env();
    let Some(comm) = team(&e, "alloc_lengths") else {
        return;
    };
    assert_eq!(invalid_arg(comm.alloc::<f32>(0).unwrap_err()), "len");
    assert_eq!(
        invalid_arg(comm.alloc::<f32>(usize::MAX).unwrap_err()),
        "len"
    );
    assert_eq!(
        invalid_arg(comm.alloc::<f32>(usize::MAX / 4).unwrap_err()),
        "len"
    );
    // the communicator is still usable: it allocates, and computes
    drop(comm.alloc::<f32>(100).unwrap());
    let mut seed = Rng::new(3);
    let s = streams(&comm);
    check_sym::<f32>(&comm, &s, &mut seed, (0, 0), 100, ReduceOp::Max, true);
}

#[test]
fn config_fields_at_usize_max_are_refused_naming_the_field() {
    let e = ar_env();
    let Some(devices) = two_devices(&e, "config_fields") else {
        return;
    };
    let d = CommConfig::default;
    for (config, field) in [
        (
            CommConfig {
                one_shot_max_bytes: Some(usize::MAX),
                ..d()
            },
            "config.one_shot_max_bytes",
        ),
        (
            CommConfig {
                ll_max_bytes: usize::MAX,
                ..d()
            },
            "config.ll_max_bytes",
        ),
        (
            CommConfig {
                ce_max_bytes: usize::MAX,
                ..d()
            },
            "config.ce_max_bytes",
        ),
        (
            CommConfig {
                ce_min_bytes: usize::MAX,
                ..d()
            },
            "config.ce_min_bytes",
        ),
        (
            CommConfig {
                stage_bytes: Some(usize::MAX),
                ..d()
            },
            "config.stage_bytes",
        ),
        (
            CommConfig {
                scratch_bytes: usize::MAX,
                ..d()
            },
            "config.scratch_bytes",
        ),
        (
            CommConfig {
                multimem_min_bytes: usize::MAX,
                ..d()
            },
            "config.multimem_min_bytes",
        ),
        (
            CommConfig {
                multimem_capacity: usize::MAX,
                ..d()
            },
            "config.multimem_capacity",
        ),
        (
            CommConfig {
                threads: u32::MAX,
                ..d()
            },
            "config.threads",
        ),
        (
            CommConfig {
                max_blocks: u32::MAX,
                ..d()
            },
            "config.max_blocks",
        ),
        (
            CommConfig {
                timeout: Duration::MAX,
                ..d()
            },
            "config.timeout",
        ),
    ] {
        let err = Communicator::builder(&devices)
            .config(config)
            .build()
            .unwrap_err();
        assert_eq!(invalid_arg(err), field);
    }
}
