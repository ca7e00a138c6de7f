//! A release that fails in a teardown (a `Drop`) is neither swallowed nor leaked: it is tried
//! again at once, and what still fails is reported and kept for later teardowns
//! (`Driver::unreleased`).

use cuda_multimem::vmm::Reservation;
use cuda_multimem_sim::{FailurePlan, SimConfig, Simulator};
use cuda_multimem_sys::CUresult;

fn live(sim: &Simulator, what: &str) -> i64 {
    sim.live_resources().get(what).copied().unwrap_or(0)
}

#[test]
fn a_reservation_whose_release_fails_once_is_released_by_the_retry() {
    let sim = Simulator::start(SimConfig::new(1, 13030)).unwrap();
    let driver = cuda_multimem_sim::driver_over(&sim).unwrap();
    let r = Reservation::new(&driver, 2 << 20).unwrap();
    assert_eq!(
        live(&sim, "vmm reservations"),
        1,
        "{:?}",
        sim.live_resources()
    );
    sim.inject_failure(FailurePlan {
        call: Some("cuMemAddressFree".into()),
        skip: 0,
        code: CUresult::CUDA_ERROR_UNKNOWN,
    });
    drop(r);
    // the injected failure fired on the first try, and the retry gave the range back
    assert_eq!(sim.clear_failure().as_deref(), Some("cuMemAddressFree"));
    assert_eq!(
        live(&sim, "vmm reservations"),
        0,
        "{:?}",
        sim.live_resources()
    );
    assert!(driver.unreleased().is_empty(), "{:?}", driver.unreleased());
}
