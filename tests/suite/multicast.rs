//! Multicast objects: granularity, create, add device, binds (12.1 and per-device 13.1 ABIs),
//! mapping, stores reaching every bound device, teardown order, export/import, the guard.
//!
//! Everything that creates a multicast object runs on an explicit simulator (`sim(...)`), never
//! on `env()`: the GPU machines must never create one. On the real driver only the guard and the
//! capability report run.
#![allow(clippy::manual_is_multiple_of)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_multimem::multicast::{
    disable_multicast_on_this_thread, multicast_allowed, multicast_allowed_for, policy_from,
    MulticastObject, MulticastSpec, DISABLE_MULTICAST_ENV, NVLS_ENABLE_ENV,
    NVSHMEM_DISABLE_NVLS_ENV, TORCH_SYMM_MEM_DISABLE_MULTICAST_ENV,
};
use cuda_multimem::sys::{CUdeviceptr, CUmulticastObjectProp, CUresult};
use cuda_multimem::vmm::{Access, Granularity, HandleTypes, Location, Mapping, PhysicalAllocation};
use cuda_multimem::{Driver, Error};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{env, fail_each_call, random_bytes as random, sim, skip};

const MIB: usize = 1 << 20;

/// Copy host bytes to device memory with device 0's context current, and wait until they are
/// there: a pageable `cuMemcpyHtoD` returns before its DMA has finished, so another context, a
/// peer device or another process could read the old bytes (the simulator models that).
pub(crate) fn htod(d: &Driver, dst: CUdeviceptr, src: &[u8]) -> Result<(), Error> {
    // SAFETY: the driver checks the device range; `src` is live for the call.
    unsafe { d.device(0)?.copy_from_host_blocking(dst, src) }
}

pub(crate) fn dtoh(d: &Driver, dst: &mut [u8], src: CUdeviceptr) -> Result<(), Error> {
    d.device(0)?.bind()?;
    let f = d.sys().cuMemcpyDtoH()?;
    // SAFETY: `dst` is valid for its length; the driver checks the device range.
    match unsafe { f(dst.as_mut_ptr().cast(), src, dst.len()) } {
        CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(Error::Driver {
            call: "cuMemcpyDtoH",
            code,
        }),
    }
}

/// Live simulated resources other than primary contexts (which the driver value retains).
pub(crate) fn leftovers(
    s: &cuda_multimem_sim::Simulator,
) -> std::collections::BTreeMap<String, i64> {
    let mut l = s.live_resources();
    l.remove("primary contexts");
    l
}

/// Each device's memory, mapped read-write for all `n` devices.
fn member_memory(d: &Driver, n: usize, size: usize, ht: HandleTypes) -> Vec<Arc<Mapping>> {
    let access: Vec<_> = (0..n as i32)
        .map(|i| (Location::Device(i), Access::ReadWrite))
        .collect();
    (0..n as i32)
        .map(|i| {
            let a = PhysicalAllocation::builder(d, Location::Device(i))
                .handle_types(ht)
                .create(size)
                .unwrap();
            Arc::new(Mapping::map_whole(&a, &access).unwrap())
        })
        .collect()
}

fn full_object(d: &Driver, n: u32, size: usize) -> MulticastObject {
    let o = MulticastObject::new(d, &MulticastSpec::new(n, size)).unwrap();
    for i in 0..n as usize {
        o.add_device(&d.device(i).unwrap()).unwrap();
    }
    o
}

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
        // Bind blocks until every device was added: another thread adds device 1.
        let adder = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            add(h, 1)
        });
        let t = Instant::now();
        let a0 = mem[0].allocation().raw();
        assert_eq!(bind(h, 0, 0, a0, 0, 2 * MIB, 0), CUresult::CUDA_SUCCESS);
        assert!(t.elapsed() >= Duration::from_millis(90), "the bind waited");
        assert_eq!(adder.join().unwrap(), CUresult::CUDA_SUCCESS);
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

#[test]
fn the_guard_refuses_multicast_before_any_driver_call() {
    // Runs on the real driver too: the refusal comes before anything is created.
    let e = env();
    let _off = disable_multicast_on_this_thread();
    let before = e.sim.as_ref().map(|s| {
        (
            s.calls("cuMulticastCreate"),
            s.calls("cuMulticastGetGranularity"),
        )
    });
    let err = MulticastObject::new(&e.driver, &MulticastSpec::new(2, 2 * MIB)).unwrap_err();
    assert!(matches!(err, Error::Disabled { .. }), "{err}");
    assert!(multicast_allowed().is_err() && multicast_allowed_for(&e.driver).is_err());
    let spec = MulticastSpec::new(2, 2 * MIB).handle_types(HandleTypes::FABRIC);
    let imp = MulticastObject::import_fabric(&e.driver, &[0; 64], &spec).unwrap_err();
    assert!(matches!(imp, Error::Disabled { .. }), "{imp}");
    if let Some(s) = &e.sim {
        assert_eq!(
            Some((
                s.calls("cuMulticastCreate"),
                s.calls("cuMulticastGetGranularity")
            )),
            before
        );
    }
}

#[test]
fn the_guard_holds_on_the_real_driver_when_the_site_sets_the_variables() {
    let e = env();
    if e.driver.is_simulated() {
        // The variables are for real GPUs; on the simulator check the same decision through the
        // pure policy function instead.
        assert!(policy_from(|k| (k == NVLS_ENABLE_ENV).then(|| "0".into())).is_err());
        return;
    }
    match multicast_allowed() {
        Err(reason) => {
            let err = MulticastObject::new(&e.driver, &MulticastSpec::new(2, 2 * MIB)).unwrap_err();
            assert!(matches!(err, Error::Disabled { .. }), "{err}");
            assert!(err.to_string().contains(&reason), "{err}");
        }
        Ok(()) => skip(
            "the_guard_holds_on_the_real_driver_when_the_site_sets_the_variables",
            "neither NCCL_NVLS_ENABLE=0 nor CUDA_MULTIMEM_DISABLE_MULTICAST=1 is set here, and this test never creates a multicast object on real GPUs",
        ),
    }
}

#[test]
fn the_policy_reads_both_variables_and_fails_safe() {
    let with = |k: &'static str, v: &'static str| move |q: &str| (q == k).then(|| v.to_string());
    assert!(policy_from(|_| None).is_ok());
    let e = policy_from(with(NVLS_ENABLE_ENV, "0")).unwrap_err();
    assert!(e.contains(NVLS_ENABLE_ENV), "{e}");
    assert!(policy_from(with(NVLS_ENABLE_ENV, " 0 ")).is_err());
    assert!(policy_from(with(NVLS_ENABLE_ENV, "1")).is_ok());
    assert!(policy_from(with(NVLS_ENABLE_ENV, "2")).is_ok());
    let e = policy_from(with(DISABLE_MULTICAST_ENV, "1")).unwrap_err();
    assert!(e.contains(DISABLE_MULTICAST_ENV), "{e}");
    assert!(policy_from(with(DISABLE_MULTICAST_ENV, "yes")).is_err());
    assert!(
        policy_from(with(DISABLE_MULTICAST_ENV, "garbage")).is_err(),
        "fails safe"
    );
    assert!(policy_from(with(DISABLE_MULTICAST_ENV, "0")).is_ok());
    assert!(policy_from(with(DISABLE_MULTICAST_ENV, "")).is_ok());
    let e = policy_from(with(TORCH_SYMM_MEM_DISABLE_MULTICAST_ENV, "1")).unwrap_err();
    assert!(e.contains(TORCH_SYMM_MEM_DISABLE_MULTICAST_ENV), "{e}");
    let e = policy_from(with(NVSHMEM_DISABLE_NVLS_ENV, "1")).unwrap_err();
    assert!(e.contains(NVSHMEM_DISABLE_NVLS_ENV), "{e}");
}

/// Child mode of the next test: the environment it was started with must give this answer.
const CHILD_EXPECT: &str = "CUDA_MULTIMEM_GUARD_CHILD_EXPECT";

#[test]
fn the_environment_variables_disable_multicast_in_a_fresh_process() {
    if let Ok(expect) = std::env::var(CHILD_EXPECT) {
        let got = multicast_allowed();
        match expect.as_str() {
            "allowed" => assert_eq!(got, Ok(())),
            var => {
                let reason = got.unwrap_err();
                assert!(reason.contains(var), "{reason}");
            }
        }
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let name = "multicast::the_environment_variables_disable_multicast_in_a_fresh_process";
    for (vars, expect) in [
        (vec![(NVLS_ENABLE_ENV, "0")], NVLS_ENABLE_ENV),
        (vec![(DISABLE_MULTICAST_ENV, "1")], DISABLE_MULTICAST_ENV),
        (
            vec![(NVLS_ENABLE_ENV, "1"), (DISABLE_MULTICAST_ENV, "0")],
            "allowed",
        ),
    ] {
        let out = std::process::Command::new(&exe)
            .args(["--exact", name, "--test-threads=1"])
            .env_remove(NVLS_ENABLE_ENV)
            .env_remove(DISABLE_MULTICAST_ENV)
            .env_remove(TORCH_SYMM_MEM_DISABLE_MULTICAST_ENV)
            .env_remove(NVSHMEM_DISABLE_NVLS_ENV)
            .envs(vars.iter().copied())
            .env(CHILD_EXPECT, expect)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "child with {vars:?}: {text}");
        assert!(text.contains("1 passed"), "the child ran the check: {text}");
    }
}

#[test]
fn the_simulator_is_exempt_from_the_variables_but_not_from_the_thread_override() {
    let e = sim(SimConfig::new(2, 13010));
    assert!(multicast_allowed_for(&e.driver).is_ok());
    let off = disable_multicast_on_this_thread();
    assert!(multicast_allowed_for(&e.driver).is_err());
    drop(off);
    assert!(multicast_allowed_for(&e.driver).is_ok());
    // Other threads are not affected by this thread's override.
    let _off = disable_multicast_on_this_thread();
    let d = e.driver.clone();
    std::thread::spawn(move || assert!(multicast_allowed_for(&d).is_ok()))
        .join()
        .unwrap();
}

#[test]
fn the_capability_report_matches_the_driver_version() {
    let e = env();
    let d0 = e.driver.device(0).unwrap();
    let mc = d0.supports_multicast().unwrap();
    if e.driver.version() < 12010 {
        assert!(!mc, "no multicast attribute before 12.1");
    }
    let le = d0.logical_endpoint_multicast().unwrap();
    assert_eq!(le.is_some(), e.driver.version() >= 13030, "{le:?}");
}

/// Child mode of the next tests: `fd:<descriptor>` or `fabric:<hex bytes>` of the exported object.
const CHILD_FD: &str = "CUDA_MULTIMEM_MC_CHILD_HANDLE";

/// The importing process: add device 1, bind its memory, map, then follow the parent's script.
fn multicast_child(handle: &str) {
    use std::io::{BufRead, Write};
    let e = sim(SimConfig::new(2, 13010));
    let d = &e.driver;
    let spec = MulticastSpec::new(2, 2 * MIB).handle_types(HandleTypes::POSIX_FD);
    let o = match handle.split_once(':') {
        Some(("fd", n)) => {
            // SAFETY: the parent passed this descriptor to us, open and not close-on-exec.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(n.parse().unwrap()) };
            MulticastObject::import_posix_fd(d, fd, &spec).unwrap()
        }
        Some(("fabric", hex)) => {
            let bytes: Vec<u8> = (0..hex.len() / 2)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
                .collect();
            let spec = spec.handle_types(HandleTypes::FABRIC);
            MulticastObject::import_fabric(d, &bytes, &spec).unwrap()
        }
        _ => panic!("bad child handle {handle}"),
    };
    let dev1 = d.device(1).unwrap();
    o.add_device(&dev1).unwrap();
    let mem = PhysicalAllocation::builder(d, Location::Device(1))
        .handle_types(HandleTypes::POSIX_FD)
        .create(2 * MIB)
        .unwrap();
    let own = Mapping::map_whole(&mem, &[(Location::Device(1), Access::ReadWrite)]).unwrap();
    let b = o.bind_mem(&dev1, 0, &mem, 0, 2 * MIB).unwrap();
    let map = o.map_whole(std::slice::from_ref(&dev1)).unwrap();
    let mut lines = std::io::stdin().lock().lines();
    let say = |s: &str| {
        println!("@@{s}");
        std::io::stdout().flush().unwrap();
    };
    say("BOUND");
    assert_eq!(lines.next().unwrap().unwrap(), "CHECK");
    let mut back = vec![0u8; 4096];
    dtoh(d, &mut back, own.device_ptr()).unwrap();
    say(if back == random(4096, 77) {
        "SAW-OK"
    } else {
        "SAW-BAD"
    });
    htod(d, map.device_ptr() + 8192, &random(4096, 78)).unwrap();
    say("STORED");
    assert_eq!(lines.next().unwrap().unwrap(), "DONE");
    drop((map, b, o, own, mem));
}

#[test]
fn a_multicast_object_exported_as_a_posix_fd_works_in_another_process() {
    if let Ok(h) = std::env::var(CHILD_FD) {
        return multicast_child(&h);
    }
    across_processes(false);
}

#[test]
fn a_multicast_object_exported_as_a_fabric_handle_works_in_another_process() {
    if let Ok(h) = std::env::var(CHILD_FD) {
        return multicast_child(&h);
    }
    across_processes(true);
}

/// The exporting process: create, export, add device 0, start the importer, bind, map; each
/// side's store through its own multicast mapping reaches the other's memory.
fn across_processes(fabric: bool) {
    use std::io::{BufRead, BufReader, Write};
    use std::os::fd::AsRawFd;
    let e = sim(SimConfig::new(2, 13010));
    let d = &e.driver;
    let ht = HandleTypes {
        posix_fd: true,
        fabric,
    };
    let spec = MulticastSpec::new(2, 2 * MIB).handle_types(ht);
    let o = MulticastObject::new(d, &spec).unwrap();
    let exported = o.export_posix_fd().unwrap();
    // A copy without close-on-exec for the child.
    // SAFETY: dup of a descriptor we own; the new one is closed below.
    let inherited = unsafe { libc::dup(exported.as_raw_fd()) };
    assert!(inherited >= 0);
    let (name, handle) = if fabric {
        let h = o.export_fabric().unwrap();
        let hex: String = h.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
        (
            "a_multicast_object_exported_as_a_fabric_handle_works_in_another_process",
            format!("fabric:{hex}"),
        )
    } else {
        (
            "a_multicast_object_exported_as_a_posix_fd_works_in_another_process",
            format!("fd:{inherited}"),
        )
    };
    let dev0 = d.device(0).unwrap();
    o.add_device(&dev0).unwrap();
    let mut child = cuda_multimem_tests::child_test(&format!("multicast::{name}"))
        .env(CHILD_FD, handle)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // SAFETY: our copy; the child has its own.
    unsafe { libc::close(inherited) };
    let mut to_child = child.stdin.take().unwrap();
    let mut from_child = BufReader::new(child.stdout.take().unwrap()).lines();
    // libtest prints "test <name> ... " before the child's own lines: look for the marker.
    let mut expect = |what: &str| loop {
        let l = from_child.next().expect("child output").unwrap();
        if let Some(i) = l.find("@@") {
            let got = l[i + 2..].trim().to_string();
            if got.starts_with("SAW-") || got == what {
                return got;
            }
        }
    };
    let mem = PhysicalAllocation::builder(d, Location::Device(0))
        .handle_types(ht)
        .create(2 * MIB)
        .unwrap();
    let own = Mapping::map_whole(&mem, &[(Location::Device(0), Access::ReadWrite)]).unwrap();
    // Waits (the driver's blocking, simulated by polling the shared table) for the child's device.
    let b = o.bind_mem(&dev0, 0, &mem, 0, 2 * MIB).unwrap();
    let map = o.map_whole(std::slice::from_ref(&dev0)).unwrap();
    assert_eq!(expect("BOUND"), "BOUND");
    let data = random(4096, 77);
    htod(d, map.device_ptr(), &data).unwrap();
    let mut back = vec![0u8; 4096];
    dtoh(d, &mut back, own.device_ptr()).unwrap();
    assert!(back == data, "the parent's own memory");
    writeln!(to_child, "CHECK").unwrap();
    assert_eq!(
        expect("SAW-OK"),
        "SAW-OK",
        "the child's memory got the parent's store"
    );
    assert_eq!(expect("STORED"), "STORED");
    dtoh(d, &mut back, own.device_ptr() + 8192).unwrap();
    assert!(
        back == random(4096, 78),
        "the child's store reached the parent's memory"
    );
    writeln!(to_child, "DONE").unwrap();
    drop(to_child);
    assert!(child.wait().unwrap().success());
    drop((map, b, o, own, mem, exported));
    assert_eq!(leftovers(e.sim.as_ref().unwrap()), Default::default());
}

#[test]
fn host_numa_memory_binds_for_its_nearest_device_only_with_the_per_device_bind() {
    for v in [13000, 13010] {
        let e = sim(SimConfig::new(2, v));
        let d = &e.driver;
        let o = full_object(d, 2, 2 * MIB);
        let numa = d
            .device(0)
            .unwrap()
            .host_numa_id()
            .unwrap()
            .expect("node 0");
        let host = PhysicalAllocation::builder(d, Location::HostNuma(numa))
            .create(2 * MIB)
            .unwrap();
        let r = o.bind_mem(&d.device(0).unwrap(), 0, &host, 0, 2 * MIB);
        if v >= 13010 {
            let b = r.unwrap();
            assert_eq!(b.device(), 0);
        } else {
            let err = r.unwrap_err();
            assert!(
                matches!(err, Error::InvalidArgument { arg: "memory", .. }),
                "{err}"
            );
        }
    }
}

#[test]
fn a_team_may_be_larger_than_this_machine_but_binds_wait_for_every_member() {
    let e = sim(SimConfig::new(2, 13010));
    let d = &e.driver;
    // 4 members: two here, two in another process or node.
    let o = MulticastObject::new(d, &MulticastSpec::new(4, 2 * MIB)).unwrap();
    o.add_device(&d.device(0).unwrap()).unwrap();
    o.add_device(&d.device(1).unwrap()).unwrap();
    let mem = member_memory(d, 1, 2 * MIB, HandleTypes::NONE);
    let err = o
        .bind_mem(&d.device(0).unwrap(), 0, mem[0].allocation(), 0, 2 * MIB)
        .unwrap_err();
    assert!(err.to_string().contains("2 of 4"), "{err}");
    let none = MulticastObject::new(d, &MulticastSpec::new(0, 2 * MIB)).unwrap_err();
    assert!(
        matches!(
            none,
            Error::InvalidArgument {
                arg: "spec.devices",
                ..
            }
        ),
        "{none}"
    );
}
