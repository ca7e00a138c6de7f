//! The executors: a checked call with resolved addresses and its plan in, launches and copies
//! on the caller's stream out. Each owns its per-rank resources (loaded kernels, signal pads,
//! staging, the copy-engine lane): [`p2p`] (peer-to-peer kernels on symmetric memory) and
//! [`multimem`] (a multicast team's `multimem` kernels).

pub(crate) mod multimem;
pub(crate) mod p2p;
