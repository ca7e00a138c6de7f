//! What the simulated GPU is: devices and their contexts, streams (worker threads) with events
//! and graphs, the memory map and copies, plain, managed and VMM memory, multicast objects,
//! logical endpoints and the cross-process tables they share, modules and kernel launches.
//! Model functions speak Rust (addresses, handles, slices, `SimResult`); they never call an
//! entry point and never see an out-pointer — `api/` turns the driver's ABI into these calls.
//!
//! Imports run one way, from the later to the earlier of: `device` (what a device is),
//! `context`, `delay`, `occupancy` (the multiprocessor model), `residency` (the slots launches
//! take), `stream`, `memory`, `shared`, `managed`, `vmm`, `multicast`, `endpoint`, `kernel`.

pub(crate) mod context;
pub(crate) mod delay;
pub(crate) mod device;
pub(crate) mod endpoint;
pub(crate) mod kernel;
pub(crate) mod managed;
pub(crate) mod memory;
pub(crate) mod multicast;
pub(crate) mod occupancy;
pub(crate) mod residency;
pub(crate) mod shared;
pub(crate) mod stream;
pub(crate) mod vmm;
