//! Safe access to the CUDA driver's memory machinery on NVLink systems: devices and streams,
//! virtual memory management (physical allocations, reservations, mappings, access, shareable
//! handles), managed memory (advice, prefetch, discard — one range or many), multicast objects,
//! CUDA 13.3 logical endpoints, and one team abstraction over the last two.
//!
//! Everything starts from a [`Driver`] you hold: [`Driver::load`] opens the real driver;
//! [`Driver::from_env`] also honours `CUDA_MULTIMEM_DRIVER=sim:...`, the simulated driver of
//! `cuda-multimem-sim`. The library never falls back to the simulator on its own.
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
pub use memory::{DeviceBuffer, DeviceRepr};
pub use module::{Function, LaunchConfig, Module, MAX_THREADS_PER_BLOCK};
pub use stream::{Event, Stream, StreamRef};

/// The raw bindings and loader, for calls this crate does not wrap.
pub use cuda_multimem_sys as sys;
