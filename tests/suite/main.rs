//! The workspace suite: one test binary (small to carry to a GPU machine) whose modules follow
//! the concepts: loader, device, vmm, managed, multicast, endpoint, team, allreduce, multimem.

mod allreduce;
mod cudarc_ops;
mod device;
mod endpoint;
mod failures;
mod gather;
mod hier;
mod hostile_buffers;
mod hostile_collectives;
mod hostile_safe;
mod hostile_sim;
mod loader;
mod managed;
mod multicast;
mod multimem;
mod norm;
mod team;
mod vmm;
