//! Bootstrap: how the processes of a team find each other and exchange handles.
//!
//! A team that spans processes needs each rank's memory handles in every other process. The
//! exchange goes through the [`Bootstrap`] trait, so an existing launcher can carry it:
//! [`UnixBootstrap`] is the one-host implementation (a Unix socket at a path both sides know,
//! POSIX file descriptors passed with `SCM_RIGHTS`), with timeouts everywhere so a peer that dies
//! during rendezvous is an error, never a hang.

use std::os::fd::{BorrowedFd, OwnedFd};

use cuda_multimem::{Error, Result};

#[cfg(feature = "mpi")]
mod mpi;
mod unix;

#[cfg(feature = "mpi")]
pub use self::mpi::MpiBootstrap;
pub use unix::UnixBootstrap;

/// Exchange of bytes (and, where the transport can, file descriptors) among the ranks of a team.
/// Every rank calls the same methods in the same order.
pub trait Bootstrap: Send + Sync {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Every rank's `data`, by rank.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Every rank's file descriptors, by rank (each rank passes the same count). Transports that
    /// cannot carry descriptors answer [`Error::Unsupported`]-like errors; the team then uses
    /// fabric handles as bytes.
    fn all_gather_fds(&self, fds: &[BorrowedFd<'_>]) -> Result<Vec<Vec<OwnedFd>>> {
        let _ = fds;
        Err(Error::invalid(
            "bootstrap",
            "this bootstrap cannot pass file descriptors",
        ))
    }
    /// Whether [`Bootstrap::all_gather_fds`] works.
    fn passes_fds(&self) -> bool {
        false
    }
    /// How long one exchange may wait for the slowest rank, where the transport bounds it
    /// (`None`: no bound, or none it knows). A communicator built through this bootstrap waits
    /// at least this long in each rank's first call ([`crate::CommConfig::first_call_timeout`]),
    /// so ranks that start unevenly after the build meet there as they met at the build.
    fn timeout(&self) -> Option<std::time::Duration> {
        None
    }
}
