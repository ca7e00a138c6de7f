//! The examples of `docs/simulator.md`, as tests (`cargo xtask test` runs them): how another
//! project tests its multi-GPU code on the simulated driver. Keep the two in step.

use cuda_multimem::vmm::{Access, Location, Mapping, PhysicalAllocation};
use cuda_multimem::{Driver, Error};
use cuda_multimem_sim::{FailurePlan, SimConfig, Simulator};
use cuda_multimem_sys::CUresult;

/// The code under test: put `data` in a fresh VMM mapping on `device` and read it back. A real
/// program's function would be here, taking a `Driver` it does not know to be simulated.
fn round_trip(driver: &Driver, device: i32, data: &[u32]) -> cuda_multimem::Result<Vec<u32>> {
    let bytes = std::mem::size_of_val(data);
    let allocation = PhysicalAllocation::builder(driver, Location::Device(device)).create(bytes)?;
    let mapping = Mapping::map_whole(
        &allocation,
        &[(Location::Device(device), Access::ReadWrite)],
    )?;
    mapping.write(0, data)?;
    let mut back = vec![0u32; data.len()];
    mapping.read(0, &mut back)?;
    Ok(back)
}

// ANCHOR: select
#[test]
fn a_simulated_machine_is_a_driver_like_any_other() {
    // Eight H200-like devices on a CUDA 13.3 driver, as CUDA_MULTIMEM_DRIVER=sim:devices=8,version=13030
    // would select them.
    let driver = cuda_multimem_sim::driver_from_selection("sim:devices=8,version=13030").unwrap();
    assert!(driver.is_simulated());
    assert_eq!((driver.device_count(), driver.version()), (8, 13030));
    assert_eq!(round_trip(&driver, 3, &[1, 2, 3]).unwrap(), [1, 2, 3]);
}
// ANCHOR_END: select

// ANCHOR: configure
#[test]
fn devices_and_driver_version_are_configured() {
    // Two NVLink cliques of two devices; no multicast; a 12.8 driver, which predates logical
    // endpoints (their attributes are INVALID_VALUE there, as on a real 12.8 driver).
    let mut config = SimConfig::new(4, 12080).with_all(|d| d.multicast = false);
    for (i, d) in config.devices.iter_mut().enumerate() {
        d.clique = i as u32 / 2;
    }
    let driver = cuda_multimem_sim::simulated_driver(config).unwrap();
    let dev = driver.devices();
    assert!(!dev[0].supports_multicast().unwrap());
    assert_eq!(dev[0].logical_endpoint_unicast().unwrap(), None);
    assert!(dev[0].can_access_peer(&dev[1]).unwrap());
    assert!(!dev[1].can_access_peer(&dev[2]).unwrap());
}
// ANCHOR_END: configure

// ANCHOR: failures
#[test]
fn an_injected_failure_is_reported_and_nothing_leaks() {
    // Start the simulator yourself to keep a handle on it: failure injection, call counts and
    // the live-resource ledger live there.
    let sim = Simulator::start(SimConfig::new(2, 13030)).unwrap();
    let driver = cuda_multimem_sim::driver_over(&sim).unwrap();
    round_trip(&driver, 0, &[7; 1024]).unwrap(); // resolve every entry point once
    let before = sim.live_resources();

    // The first cuMemMap from now on returns CUDA_ERROR_OUT_OF_MEMORY instead of running.
    sim.inject_failure(FailurePlan {
        call: Some("cuMemMap".into()),
        skip: 0,
        code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
    });
    let err = round_trip(&driver, 0, &[7; 1024]).unwrap_err();
    assert_eq!(sim.clear_failure().as_deref(), Some("cuMemMap"));
    assert!(matches!(err, Error::Driver { .. }), "{err}");
    assert!(err.to_string().contains("cuMemMap"), "{err}");

    // The code under test gave back what it had made before the failure.
    assert_eq!(sim.live_resources(), before);
    assert!(sim.calls("cuMemMap") >= 2);
}
// ANCHOR_END: failures
