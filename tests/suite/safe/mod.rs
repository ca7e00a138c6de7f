//! The safe layer (`cuda-multimem`) and the loader, one module per concept: the tests whose
//! behaviour depends on the driver version live here (or under `sim::`,
//! `collectives::multimem::` and `collectives::smoke::`).

mod device;
mod endpoint;
mod hostile;
mod loader;
mod managed;
mod multicast;
mod team;
mod vmm;
