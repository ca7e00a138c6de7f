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
//! Kernels have an occupancy ([`register_kernel_with`] and [`KernelAttrs`]): the occupancy
//! queries answer from an H100/H200-like multiprocessor model, and launches of one device are
//! co-resident only as far as they fit (`docs/simulator.md`, "Occupancy and co-residency").
//!
//! Only one simulated machine is live per process at a time; a second [`Simulator::start`] from
//! another thread waits for the first to be dropped.
//!
//! # Layout
//!
//! Imports run one way, from the top of this list to the bottom:
//! - `select.rs` — choosing a `cuda_multimem::Driver` (the simulator or the real driver);
//! - `session.rs` — [`Simulator`]: starting a machine, its loader entry, failure plans, call
//!   counts and live resources, and the teardown order at its end;
//! - `api/` — the `cu*` entry points, one file per driver area (devices, contexts, streams,
//!   events, graphs, memory, VMM, managed memory, multicast, logical endpoints, modules,
//!   launches), each a thin adapter from the driver's ABI (pointers in and out, the order of its
//!   checks) to the model; `gate.rs`, which every call passes (initialisation, call count,
//!   failure injection, sticky errors); and `table.rs`, the function table `cuGetProcAddress`
//!   answers from;
//! - `model/` — what the simulated GPU is: devices, contexts, streams, the memory map and copies,
//!   plain, managed and VMM memory, multicast objects, logical endpoints, the tables processes
//!   share, modules and launches, the occupancy of a multiprocessor and the resident-block slots
//!   launches take; it never calls an entry point;
//! - `state.rs` — the session's shared state (per-area tables, handle tags, counters, the
//!   pending failure) and which session is current; `config.rs` — the machine's description.
//!
//! [`endpoint`] and [`multicast`] are the public faces of two model areas (the helpers that
//! simulated kernels call).

#![deny(missing_docs)]

mod api;
mod config;
pub mod endpoint;
mod model;
pub mod multicast;
mod select;
mod session;
mod state;

pub use api::table::implemented;
pub use config::{ConfigError, SimConfig, SimDeviceConfig, MAX_DEVICES, VERSION_RANGE};
pub use model::kernel::{
    kernel_registered, missing_kernel_message, register_kernel, register_kernel_with, KernelAttrs,
    KernelError, KernelFn, LaunchArgs,
};
pub use model::managed::DISCARD_POISON;
pub use model::residency::DEFAULT_LIMIT as RESIDENCY_LIMIT;
pub use select::{driver_from_env, driver_from_selection, driver_over, simulated_driver};
pub use session::{Simulator, StartError};
pub use state::FailurePlan;
