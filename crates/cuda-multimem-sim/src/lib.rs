//! A simulated CUDA driver with the real driver's function table, so multi-GPU code — this
//! workspace's and yours — runs and is tested on machines without a GPU.
//!
//! The simulator is a driver from the loader's point of view: [`Simulator::entry`] gives the
//! `cuGetProcAddress` and `cuDriverGetVersion` that `cuda_multimem_sys::Driver::from_entry` takes
//! instead of libcuda's, and everything above the loader runs unchanged. `cuGetProcAddress`
//! answers as a real driver of the configured version does (a version newer than the driver is
//! `CUDA_ERROR_INVALID_VALUE`; a symbol the driver predates is "symbol not found"; a known symbol
//! asked at too old an ABI is "version not sufficient").
//!
//! Device memory is real host memory: allocations are memfds mapped into reserved address ranges,
//! so a device pointer can be dereferenced by the simulated kernels, POSIX-fd handles are real
//! file descriptors that another process can import, and streams are worker threads, one per
//! stream, so several simulated devices run concurrently.
//!
//! ```
//! use cuda_multimem_sim::{SimConfig, Simulator};
//! let sim = Simulator::start(SimConfig::new(2, 13030))?;
//! let driver = sim.driver()?;
//! assert_eq!(driver.version(), 13030);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A program that uses the safe layer takes a `cuda_multimem::Driver` from [`simulated_driver`],
//! [`driver_over`] or [`driver_from_env`] (`CUDA_MULTIMEM_DRIVER=sim:...`): `cuda-multimem`
//! does not depend on this crate, so only a program that links it can select the simulator.
//!
//! Only one simulated machine is live per process at a time; a second [`Simulator::start`] from
//! another thread waits for the first to be dropped.

#![deny(missing_docs)]

mod config;
mod device;
mod dispatch;
pub mod endpoint;
mod kernel;
mod managed;
mod memory;
pub mod multicast;
mod select;
mod shared;
mod state;
mod stream;
mod vmm;

pub use config::{ConfigError, SimConfig, SimDeviceConfig, VERSION_RANGE};
pub use dispatch::implemented;
pub use kernel::{kernel_registered, register_kernel, KernelError, KernelFn, LaunchArgs};
pub use managed::DISCARD_POISON;
pub use select::{driver_from_env, driver_from_selection, driver_over, simulated_driver};
pub use state::{FailurePlan, Simulator, StartError};

/// Every simulated area's exports.
pub(crate) fn all_exports() -> Vec<dispatch::Export> {
    [
        dispatch::exports(),
        device::exports(),
        stream::exports(),
        memory::exports(),
        vmm::exports(),
        managed::exports(),
        kernel::exports(),
        endpoint::exports(),
        multicast::exports(),
    ]
    .concat()
}

/// End of a session: stop the stream workers, then free what is still allocated.
pub(crate) fn teardown(st: &state::State) {
    stream::shutdown_all(st);
    vmm::teardown(st);
    endpoint::teardown(st);
    multicast::teardown(st);
    memory::teardown(st);
}
