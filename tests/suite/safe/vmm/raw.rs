//! The driver's rules at the raw calls (as the simulator enforces them), devices without VMM,
//! host allocations, imported allocations' reports, typed mapping reads and writes.

use super::*;

/// Call a raw driver entry point and return its status.
macro_rules! raw {
    ($d:expr, $f:ident ( $($a:expr),* $(,)? )) => {{
        let f = $d.sys().$f().unwrap();
        // SAFETY: every pointer argument points at a live local of the right type.
        unsafe { f($($a),*) }
    }};
}

#[test]
fn the_driver_rules_hold_at_the_raw_calls() {
    use cuda_multimem::sys::{
        CUmemAccessDesc, CUmemAccess_flags, CUmemAllocationHandleType, CUmemAllocationProp,
        CUmemGenericAllocationHandle,
    };
    let e = env();
    let d = &e.driver;
    d.device(0).unwrap().bind().unwrap();
    let g = gran(d);
    let spec = AllocationSpec {
        handle_types: HandleTypes::POSIX_FD,
        ..AllocationSpec::device(0)
    };
    let prop = spec.raw();
    let mut h: CUmemGenericAllocationHandle = 0;
    let ok = CUresult::CUDA_SUCCESS;
    let invalid = CUresult::CUDA_ERROR_INVALID_VALUE;
    assert_eq!(
        raw!(d, cuMemCreate(&mut h, g + 4096, &prop, 0)),
        invalid,
        "unaligned size"
    );
    assert_eq!(
        raw!(d, cuMemCreate(&mut h, 0, &prop, 0)),
        invalid,
        "zero size"
    );
    let mut bad_dev = prop;
    bad_dev.location.__bindgen_anon_1.id = d.device_count() as i32;
    assert_eq!(
        raw!(d, cuMemCreate(&mut h, g, &bad_dev, 0)),
        CUresult::CUDA_ERROR_INVALID_DEVICE
    );
    assert_eq!(raw!(d, cuMemCreate(&mut h, g, &prop, 0)), ok);

    // Properties come back as created.
    let mut got = CUmemAllocationProp::default();
    assert_eq!(
        raw!(d, cuMemGetAllocationPropertiesFromHandle(&mut got, h)),
        ok
    );
    assert_eq!(got.requestedHandleTypes, prop.requestedHandleTypes);
    assert_eq!(Location::from_raw(&got.location), Some(Location::Device(0)));

    let mut va: CUdeviceptr = 0;
    assert_eq!(raw!(d, cuMemAddressReserve(&mut va, 2 * g, 0, 0, 0)), ok);
    assert_eq!(raw!(d, cuMemMap(va, g, 0, h, 0)), ok);
    assert_eq!(raw!(d, cuMemMap(va, g, 0, h, 0)), invalid, "double map");
    assert_ne!(
        raw!(d, cuMemMap(va + g as u64, 2 * g, 0, h, 0)),
        ok,
        "past the reservation and the allocation"
    );
    let rw = CUmemAccessDesc {
        location: Location::Device(0).raw(),
        flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    assert_eq!(
        raw!(d, cuMemSetAccess(va, g / 2, &rw, 1)),
        invalid,
        "part of a mapping"
    );
    assert_eq!(
        raw!(d, cuMemSetAccess(va, 2 * g, &rw, 1)),
        invalid,
        "past the mapped range"
    );
    assert_eq!(raw!(d, cuMemSetAccess(va, g, &rw, 1)), ok);
    let mut flags = 0u64;
    let l0 = Location::Device(0).raw();
    assert_eq!(raw!(d, cuMemGetAccess(&mut flags, &l0, va)), ok);
    assert_eq!(
        flags,
        CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE.0 as u64
    );
    assert_eq!(
        raw!(d, cuMemGetAccess(&mut flags, &l0, va + g as u64)),
        invalid,
        "unmapped address"
    );

    // Retain gives a handle to the same allocation, which needs its own release.
    let mut h2: CUmemGenericAllocationHandle = 0;
    assert_eq!(
        raw!(
            d,
            cuMemRetainAllocationHandle(&mut h2, va as usize as *mut std::ffi::c_void)
        ),
        ok
    );
    assert_eq!(
        raw!(d, cuMemGetAllocationPropertiesFromHandle(&mut got, h2)),
        ok
    );
    assert_eq!(got.requestedHandleTypes, prop.requestedHandleTypes);
    assert_eq!(raw!(d, cuMemRelease(h2)), ok);

    // An export of a type not chosen at creation fails; the chosen one works.
    let mut fab = cuda_multimem::sys::CUmemFabricHandle::default();
    assert_eq!(
        raw!(
            d,
            cuMemExportToShareableHandle(
                (&mut fab as *mut cuda_multimem::sys::CUmemFabricHandle).cast(),
                h,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
                0
            )
        ),
        invalid
    );
    let mut fd: i32 = -1;
    assert_eq!(
        raw!(
            d,
            cuMemExportToShareableHandle(
                (&mut fd as *mut i32).cast(),
                h,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0
            )
        ),
        ok
    );
    assert!(fd >= 0);
    // SAFETY: the driver gave us this fd.
    drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });

    // Garbage shareable handles: an fd number that is not open, a fabric handle of zeros.
    let mut imported: CUmemGenericAllocationHandle = 0;
    let not_open = 1_000_000usize as *mut std::ffi::c_void;
    assert_ne!(
        raw!(
            d,
            cuMemImportFromShareableHandle(
                &mut imported,
                not_open,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            )
        ),
        ok
    );
    let mut zeros = cuda_multimem::sys::CUmemFabricHandle::default();
    assert_ne!(
        raw!(
            d,
            cuMemImportFromShareableHandle(
                &mut imported,
                (&mut zeros as *mut cuda_multimem::sys::CUmemFabricHandle).cast(),
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC
            )
        ),
        ok
    );
    // The handle may go while mapped; the reservation may not be freed while mapped.
    assert_eq!(raw!(d, cuMemRelease(h)), ok);
    assert_eq!(raw!(d, cuMemRelease(h)), invalid, "released twice");
    assert_eq!(
        raw!(d, cuMemAddressFree(va, 2 * g)),
        invalid,
        "freed while mapped"
    );
    assert_eq!(raw!(d, cuMemUnmap(va, g / 2)), invalid, "part of a mapping");
    assert_eq!(raw!(d, cuMemUnmap(va, g)), ok);
    assert_eq!(raw!(d, cuMemAddressFree(va, g)), invalid, "wrong size");
    assert_eq!(raw!(d, cuMemAddressFree(va, 2 * g)), ok);
    if let Some(s) = &e.sim {
        assert!(
            s.live_resources().keys().all(|k| !k.starts_with("vmm")),
            "{:?}",
            s.live_resources()
        );
    }
}

#[test]
fn a_device_without_vmm_refuses_physical_allocations() {
    let e = sim(SimConfig::new(1, 13000).with_all(|d| d.vmm = false));
    let r = PhysicalAllocation::builder(&e.driver, Location::Device(0)).create(2 * MIB);
    assert!(
        matches!(
            r,
            Err(Error::Driver {
                code: CUresult::CUDA_ERROR_NOT_SUPPORTED,
                ..
            })
        ),
        "{r:?}"
    );
    assert!(!e.driver.device(0).unwrap().supports_vmm().unwrap());
}

#[test]
fn host_allocations_are_mapped_for_a_device_and_cannot_be_exported() {
    const NAME: &str = "host_allocations_are_mapped_for_a_device_and_cannot_be_exported";
    let e = env();
    let d = &e.driver;
    let host_vmm = d
        .device(0)
        .unwrap()
        .attribute_opt(cuda_multimem::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
        .unwrap()
        .unwrap_or(0)
        != 0;
    let r = PhysicalAllocation::builder(d, Location::Host).create(2 * MIB);
    if !host_vmm {
        assert!(r.is_err(), "host VMM unsupported but created");
        return skip(NAME, "the driver has no host VMM allocations");
    }
    let a = r.unwrap();
    assert_eq!(a.spec().location, Location::Host);
    let m = Mapping::map_whole(&a, &rw0()).unwrap();
    let data = random(a.size(), 15);
    m.write(0, &data).unwrap();
    let mut back = vec![0u8; a.size()];
    m.read(0, &mut back).unwrap();
    assert!(back == data);
    assert!(matches!(
        PhysicalAllocation::builder(d, Location::Host)
            .handle_types(HandleTypes::FABRIC)
            .create(2 * MIB),
        Err(Error::InvalidArgument {
            arg: "handle_types",
            ..
        })
    ));
}

#[test]
fn an_imported_allocation_reports_what_the_exporter_created() {
    let e = sim(SimConfig::new(2, 13030));
    let d = &e.driver;
    let a = PhysicalAllocation::builder(d, Location::Device(1))
        .handle_types(HandleTypes {
            posix_fd: true,
            fabric: true,
        })
        .gpu_direct_rdma(true)
        .create(2 * MIB)
        .unwrap();
    let fd = a.export_posix_fd().unwrap();
    let b = PhysicalAllocation::import_posix_fd(d, std::os::fd::AsFd::as_fd(&fd), 2 * MIB).unwrap();
    assert_eq!(b.spec(), a.spec());
    assert_eq!(b.size(), 2 * MIB);
    assert_eq!(b.granularity(), a.granularity());
    let c = PhysicalAllocation::import_fabric(d, a.export_fabric().unwrap().as_bytes(), 2 * MIB)
        .unwrap();
    assert_eq!(c.spec(), a.spec());
}

#[test]
fn typed_mapping_reads_and_writes_check_range_and_alignment_and_empty_ones_succeed() {
    let e = env();
    let d = &e.driver;
    let g = gran(d);
    let a = PhysicalAllocation::builder(d, Location::Device(0))
        .create(g)
        .unwrap();
    let m = Mapping::map_whole(&a, &rw0()).unwrap();
    let words: Vec<u64> = (0..16).map(|i| i * 0x0101_0101_0101).collect();
    m.write(8, &words).unwrap();
    let mut back = vec![0u64; 16];
    m.read(8, &mut back).unwrap();
    assert_eq!(back, words);
    let mut bytes = [0u8; 8];
    m.read(16, &mut bytes).unwrap();
    assert_eq!(bytes, words[1].to_le_bytes());
    for (r, arg) in [
        (m.write(4, &[1u64]), "offset_bytes"),
        (m.write(g - 8, &[1u64, 2]), "data"),
        (m.write(usize::MAX - 7, &[1u64]), "data"),
        (m.read(g + 1, &mut [0u8; 0]), "out"),
        (m.read(usize::MAX, &mut [0u8; 1]), "out"),
    ] {
        assert!(
            matches!(r, Err(Error::InvalidArgument { arg: a, .. }) if a == arg),
            "{arg}: {r:?}"
        );
    }
    m.write::<u32>(g, &[]).unwrap();
    m.read::<u32>(0, &mut []).unwrap();
    let none = Mapping::map_whole(&a, &[]).unwrap();
    assert!(matches!(
        none.write(0, &[1u8]),
        Err(Error::InvalidArgument { arg: "data", .. })
    ));
}
