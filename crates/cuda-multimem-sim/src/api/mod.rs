//! The simulated driver's entry points (`cu*`), one file per driver area, each a thin adapter:
//! it reads the caller's pointers, checks what the driver checks at the ABI (null pointers,
//! flags, the order of its checks), calls the model (`crate::model`) and writes the outputs.
//! Every entry point passes the gate (`gate.rs`: initialisation, call counts, failure injection,
//! sticky errors); `table.rs` collects every area's exports and answers `cuGetProcAddress` from
//! them. Imports run from here to the model, never back.

pub(crate) mod context;
pub(crate) mod device;
pub(crate) mod driver;
pub(crate) mod endpoint;
pub(crate) mod event;
pub(crate) mod gate;
pub(crate) mod graph;
pub(crate) mod launch;
pub(crate) mod managed;
pub(crate) mod memory;
pub(crate) mod module;
pub(crate) mod multicast;
pub(crate) mod stream;
pub(crate) mod table;
pub(crate) mod vmm;
