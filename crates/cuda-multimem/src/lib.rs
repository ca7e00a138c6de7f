//! Safe access to the CUDA driver's memory machinery on NVLink systems: devices, streams (owned
//! and borrowed), events and captured graphs, PTX modules and launches, typed device buffers,
//! virtual memory management (physical allocations, reservations, mappings, access, shareable
//! handles), managed memory (advice, prefetch, discard — one range or many), multicast objects,
//! CUDA 13.3 logical endpoints, and one team abstraction over the last two.
//!
//! Everything starts from a [`Driver`] you hold: [`Driver::load`] opens the real driver. This
//! crate does not depend on the simulator, so it cannot fall back to it: programs that link
//! `cuda-multimem-sim` get a simulated driver from `cuda_multimem_sim::simulated_driver` or
//! `cuda_multimem_sim::driver_from_env` (which honours `CUDA_MULTIMEM_DRIVER=sim:...`).
//!
//! Ownership decides teardown order: a mapping holds what it maps, a binding holds the object and
//! the memory it binds, so nothing can be released while something still uses it.

#![deny(missing_docs)]

mod device;
mod driver;
pub mod endpoint;
pub mod error;
mod graph;
pub mod managed;
mod memory;
mod module;
pub mod multicast;
mod stream;
pub mod team;
pub mod vmm;

pub use device::Device;
pub use driver::{Driver, DRIVER_ENV};
pub use error::{Error, Result};
pub use graph::{CaptureMode, Graph, GraphExec};
pub use memory::{DeviceBuffer, DeviceRepr, HostMappedBuffer};
pub use module::{Function, FunctionAttributes, LaunchConfig, Module, MAX_THREADS_PER_BLOCK};
pub use stream::{CallStream, Event, IntoStream, Stream, StreamRef};

/// The raw bindings and loader, for calls this crate does not wrap.
pub use cuda_multimem_sys as sys;
