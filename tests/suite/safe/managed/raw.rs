//! The simulator's batch calls and range attributes at the raw ABI, a second device, host
//! access and zero-length copies.

use super::*;

/// A raw `CUmemLocation`.
fn raw_location(t: CUmemLocationType, id: i32) -> cuda_multimem::sys::CUmemLocation {
    let mut l = cuda_multimem::sys::CUmemLocation {
        type_: t,
        ..Default::default()
    };
    l.__bindgen_anon_1.id = id;
    l
}

#[test]
fn simulated_batch_calls_check_their_arrays_as_documented() {
    let e = sim(SimConfig::new(1, 13000));
    let d = device0(&e);
    let s = Stream::new(&d).unwrap();
    let buf = ManagedBuffer::new(&d, 4 * MIB).unwrap();
    let sys = e.driver.sys();
    let prefetch = sys.cuMemPrefetchBatchAsync().unwrap();
    let discard = sys.cuMemDiscardBatchAsync().unwrap();
    let dev = raw_location(CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, 0);
    let host = raw_location(CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, 0);
    let mut ptrs = [buf.as_ptr(), buf.as_ptr() + 2 * MIB as u64];
    let mut sizes = [2 * MIB, 2 * MIB];
    let call = |locs: &mut [cuda_multimem::sys::CUmemLocation],
                idxs: &mut [usize],
                n: usize,
                flags: u64,
                stream: cuda_multimem::sys::CUstream,
                ptrs: &mut [u64],
                sizes: &mut [usize]| {
        // SAFETY: every array is as long as the count passed with it, or the call is expected to
        // refuse it before reading (n is never larger than the arrays).
        unsafe {
            prefetch(
                ptrs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                ptrs.len(),
                locs.as_mut_ptr(),
                idxs.as_mut_ptr(),
                n,
                flags,
                stream,
            )
        }
    };
    let st = s.raw();
    let inv = CUresult::CUDA_ERROR_INVALID_VALUE;
    d.bind().unwrap();
    let numa9 = raw_location(CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA, 9);
    let null = std::ptr::null_mut();
    // (locations, their first-range indices, count, flags, stream, answer, what it checks)
    let cases = [
        (
            vec![dev, host],
            vec![0, 1],
            2,
            0,
            st,
            CUresult::CUDA_SUCCESS,
            "a valid call",
        ),
        (
            vec![dev, host],
            vec![1, 1],
            2,
            0,
            st,
            inv,
            "first index must be 0",
        ),
        (
            vec![dev, host],
            vec![0, 0],
            2,
            0,
            st,
            inv,
            "indices must increase",
        ),
        (
            vec![dev, host],
            vec![0, 2],
            2,
            0,
            st,
            inv,
            "indices below count",
        ),
        (
            vec![dev, host, dev],
            vec![0, 1, 2],
            3,
            0,
            st,
            inv,
            "no more locations than ranges",
        ),
        (vec![dev], vec![0], 0, 0, st, inv, "at least one location"),
        (vec![dev], vec![0], 1, 1, st, inv, "flags must be 0"),
        (
            vec![dev],
            vec![0],
            1,
            0,
            null,
            inv,
            "not the legacy NULL stream",
        ),
        (
            vec![numa9],
            vec![0],
            1,
            0,
            st,
            inv,
            "a NUMA node the host lacks",
        ),
    ];
    for (mut locs, mut idxs, n, flags, stream, want, what) in cases {
        assert_eq!(
            call(&mut locs, &mut idxs, n, flags, stream, &mut ptrs, &mut sizes),
            want,
            "{what}"
        );
    }
    let mut outside = [buf.as_ptr(), buf.as_ptr() + 3 * MIB as u64];
    assert_eq!(
        call(&mut [dev], &mut [0], 1, 0, st, &mut outside, &mut sizes),
        inv,
        "a range past the allocation"
    );
    let mut zero = [2 * MIB, 0];
    assert_eq!(
        call(&mut [dev], &mut [0], 1, 0, st, &mut ptrs, &mut zero),
        inv,
        "a zero size"
    );
    // SAFETY: two valid ranges; count 0 and a null stream are refused before anything is read.
    unsafe {
        assert_eq!(
            discard(ptrs.as_mut_ptr(), sizes.as_mut_ptr(), 0, 0, st),
            inv
        );
        assert_eq!(
            discard(
                ptrs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                2,
                0,
                std::ptr::null_mut()
            ),
            inv
        );
        assert_eq!(
            discard(ptrs.as_mut_ptr(), sizes.as_mut_ptr(), 2, 0, st),
            CUresult::CUDA_SUCCESS
        );
    }
    s.synchronize().unwrap();
}

#[test]
fn simulated_range_attributes_check_sizes_and_versions_as_documented() {
    use cuda_multimem::sys::CUmem_range_attribute as R;
    for v in [12000, 12020] {
        let e = sim(SimConfig::new(1, v));
        let d = device0(&e);
        let buf = ManagedBuffer::new(&d, 2 * MIB).unwrap();
        let get = e.driver.sys().cuMemRangeGetAttribute().unwrap();
        let mut out = [0i32; 4];
        d.bind().unwrap();
        let q = |attr: R, size: usize, out: &mut [i32; 4]| {
            // SAFETY: `out` has 16 writable bytes; sizes passed are at most 16.
            unsafe { get(out.as_mut_ptr().cast(), size, attr, buf.as_ptr(), buf.len()) }
        };
        let inv = CUresult::CUDA_ERROR_INVALID_VALUE;
        assert_eq!(
            q(R::CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, 4, &mut out),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(q(R::CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, 8, &mut out), inv);
        assert_eq!(q(R::CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY, 6, &mut out), inv);
        assert_eq!(
            q(R::CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY, 16, &mut out),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            out, [-2; 4],
            "no accessed-by advice: CU_DEVICE_INVALID in every slot"
        );
        assert_eq!(
            q(R::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION, 4, &mut out),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(out[0], -2, "no preferred location: CU_DEVICE_INVALID");
        let typed = q(
            R::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE,
            4,
            &mut out,
        );
        if v < 12020 {
            assert_eq!(typed, inv, "the _TYPE attributes arrive with 12.2");
        } else {
            assert_eq!(typed, CUresult::CUDA_SUCCESS);
            assert_eq!(out[0], 0, "CU_MEM_LOCATION_TYPE_INVALID");
        }
    }
}

#[test]
fn a_second_device_takes_prefetches_and_advice() {
    let e = env();
    if e.driver.device_count() < 2 {
        return skip("managed::second_device", "needs two devices");
    }
    let d0 = device0(&e);
    let d1 = e.driver.device(1).unwrap();
    if lacks_concurrent_access("managed::second_device", &d0)
        || lacks_concurrent_access("managed::second_device", &d1)
    {
        return;
    }
    let s1 = Stream::new(&d1).unwrap();
    let mut buf = ManagedBuffer::new(&d0, 8 * MIB).unwrap();
    let data = fill_random(&mut buf, 8);
    buf.set_preferred_location(Location::device(&d1)).unwrap();
    assert_eq!(buf.preferred_location().unwrap(), Some(Location::Device(1)));
    buf.set_accessed_by([Location::Device(0), Location::Device(1)])
        .unwrap();
    assert_eq!(
        buf.accessed_by().unwrap(),
        BTreeSet::from([Location::Device(0), Location::Device(1)])
    );
    let rs = ranges(&buf, 4, 2 * MIB);
    managed::prefetch_many_with(&rs, &[Location::Device(1)], &s1, PrefetchPolicy::Auto).unwrap();
    s1.synchronize().unwrap();
    assert_eq!(
        buf.last_prefetch_location().unwrap(),
        Some(Location::Device(1))
    );
    buf.set_accessed_by([Location::Device(1)]).unwrap();
    assert_eq!(
        buf.accessed_by().unwrap(),
        BTreeSet::from([Location::Device(1)])
    );
    buf.prefetch(Location::Host, &s1).unwrap();
    s1.synchronize().unwrap();
    assert_eq!(buf.host_slice().unwrap(), &data[..]);
}

#[test]
fn host_access_waits_for_queued_work_without_waking_idle_devices() {
    let e = sim(SimConfig::new(2, 13000));
    let sim = e.sim.as_ref().unwrap();
    let d = device0(&e);
    let s = Stream::new(&d).unwrap();
    let mut buf = ManagedBuffer::new(&d, 32 * MIB).unwrap();
    buf.host_slice_mut().unwrap().fill(1);
    let rs = ranges(&buf, 16, 2 * MIB);
    managed::discard_many(&rs, &s).unwrap();
    // No synchronize: host access itself waits for the queued discard.
    assert!(buf
        .host_slice()
        .unwrap()
        .iter()
        .all(|&b| b == DISCARD_POISON));
    assert_eq!(
        sim.live_resources().get("primary contexts"),
        Some(&1),
        "device 1 was never used and gets no context"
    );
}

#[test]
fn a_zero_length_copy_of_a_managed_buffer_is_a_no_op_with_its_offset_checked() {
    let e = env();
    let d = device0(&e);
    let mut buf = ManagedBuffer::new(&d, 4096).unwrap();
    buf.copy_from_host(0, &[7u8; 4096]).unwrap();
    buf.copy_from_host(4096, &[]).unwrap();
    buf.copy_to_host(17, &mut []).unwrap();
    let mut back = vec![0u8; 4096];
    buf.copy_to_host(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 7), "nothing was written");
    assert!(is_invalid(
        &buf.copy_from_host(4097, &[]).unwrap_err(),
        "offset"
    ));
    assert!(is_invalid(
        &buf.copy_to_host(4097, &mut []).unwrap_err(),
        "offset"
    ));
}
