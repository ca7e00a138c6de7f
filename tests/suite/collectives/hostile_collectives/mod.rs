//! Hostile use of the collectives' public API: arguments a careless or malicious caller passes
//! (lengths, offsets, views, roots, shapes, streams, configurations, drop orders) must give an
//! error value naming the argument, never a panic, a hang or memory corruption.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::time::Duration;

use cuda_multimem::{DeviceBuffer, Error, Stream};
use cuda_multimem_collectives::kernels::{MAX_BLOCKS, MAX_RANKS};
use cuda_multimem_collectives::{
    bf16, Algorithm, Bootstrap, CommConfig, Communicator, CrossDomain, DType, HierBuilder,
    HierCommunicator, HierLayout, MulticastPolicy, Operands, ReduceOp, UnixBootstrap,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::collectives::{self as table, Mem, Queued};
use cuda_multimem_tests::{sim, Rng};

use cuda_multimem_tests::{invalid_arg_of as arg_of, sim_team as team, sync_all as sync};

mod building;
mod calls;
mod configs;

fn rendezvous(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("cmm-hostile-{tag}-{}", std::process::id()))
}
