//! Hierarchical collectives: beyond one NVLink domain.
//!
//! The team (one rank per process, found through a [`crate::Bootstrap`]) is cut into NVLink domains of
//! equal size D (one host's GPUs, or an explicit grouping, e.g. the cliques of a multi-node
//! NVLink system); the M domains are joined by *rails*: rail l holds the rank of local index l
//! of every domain. An allreduce is
//!
//! 1. a reduce-scatter inside the domain ([`crate::Communicator`], NVLink): local rank l ends
//!    with shard l of the domain's sum;
//! 2. an allreduce of that shard across domains on rail l ([`CrossDomain`]: NCCL, whose unique
//!    id travels through our bootstrap), so shard l holds the whole team's sum;
//! 3. an all-gather inside the domain.
//!
//! Every step is enqueued on the caller's stream (NCCL calls included), so a whole call can be
//! captured into a CUDA graph. `docs/design/hierarchical.md` has the design and the expected
//! scaling.

mod builder;
mod comm;
mod cross;
#[cfg(feature = "sim")]
mod double;
mod layout;
mod sub_bootstrap;

pub use builder::HierBuilder;
pub use comm::HierCommunicator;
pub use cross::{CrossDomain, NcclCrossDomain, Rail};
#[cfg(feature = "sim")]
pub use double::HostCrossDomainDouble;
pub use layout::{HierLayout, RankOrder};
