//! The one error type of the safe layer.

use std::time::Duration;

use cuda_multimem_sys::{CUresult, LoadError, MissReason};

/// Everything that can go wrong, with what a person needs to act on it.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A driver call returned an error status.
    #[error("{call} failed: {code}")]
    Driver {
        /// The driver function (with its ABI suffix where one was chosen explicitly).
        call: &'static str,
        /// Its status, printed with its name.
        code: CUresult,
    },
    /// The driver could not load a module: its status and the JIT compiler's log.
    #[error("cuModuleLoadData failed: {code}; JIT log:\n{log}")]
    ModuleLoad {
        /// The status of the load.
        code: CUresult,
        /// The compiler's error (and info) log.
        log: String,
    },
    /// The driver lacks a function (too old, or the platform does not support it).
    #[error("`{symbol}` needs CUDA driver {needed} or newer; this driver is {driver} ({reason})")]
    Unsupported {
        /// The driver function.
        symbol: &'static str,
        /// The version its ABI needs.
        needed: i32,
        /// The driver's version.
        driver: i32,
        /// Why it is missing.
        reason: String,
    },
    /// The driver library could not be loaded.
    #[error(transparent)]
    Load(LoadError),
    /// An argument was rejected before any driver call.
    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument {
        /// The argument's name.
        arg: &'static str,
        /// What was wrong, with the value and what was expected.
        reason: String,
    },
    /// A device lacks a capability the operation needs.
    #[error("device {device} does not support {what}")]
    DeviceUnsupported {
        /// The device ordinal.
        device: i32,
        /// The capability.
        what: &'static str,
    },
    /// A device or its driver is older than what kernels need (their PTX target and ISA).
    #[error("device {device} ({has}) cannot run {what}: it needs {needs}")]
    HardwareTooOld {
        /// The device ordinal.
        device: i32,
        /// What it is: compute capability and driver version.
        has: String,
        /// The kernels that cannot run.
        what: String,
        /// What they need.
        needs: String,
    },
    /// A feature is switched off by the site's policy (environment variables).
    #[error("{feature} is disabled: {reason}")]
    Disabled {
        /// The feature.
        feature: &'static str,
        /// Which setting disabled it.
        reason: String,
    },
    /// The driver selection (`CUDA_MULTIMEM_DRIVER`) or simulator options are malformed.
    #[error("driver selection: {0}")]
    Config(String),
    /// Something did not complete in time.
    #[error("{what} did not complete within {after:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        after: Duration,
    },
    /// An operating-system call failed (file descriptors, sockets); the `io::Error` is the source.
    #[error("{call}: {source}")]
    Os {
        /// The call.
        call: &'static str,
        /// What the system said.
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },
    /// The ranks of a team made different calls (size, type, operation, operands, or an
    /// argument one of them refused): the collective did not run as asked on any of them.
    #[error("the ranks disagree: {what}")]
    RanksDisagree {
        /// What differed, naming the ranks where known.
        what: String,
    },
    /// A peer of a team sent something malformed or nothing at all through the bootstrap.
    #[error("rank {rank}: {reason}")]
    Peer {
        /// The peer's rank.
        rank: usize,
        /// What was wrong with what it sent.
        reason: String,
    },
    /// NCCL (loaded at run time, for the collectives across NVLink domains) could not be
    /// loaded: no library at the paths tried, or a library that lacks an entry point.
    #[error("NCCL is not available: {reason}; tried {tried}. Install NCCL or set CUDA_MULTIMEM_NCCL=/path/libnccl.so.2")]
    NcclUnavailable {
        /// The paths or library names tried, each with what the dynamic loader said.
        tried: String,
        /// What was missing (the library, or a symbol of it).
        reason: String,
    },
    /// An NCCL call failed (or its communicator reported an asynchronous error); the NCCL
    /// communicator was aborted.
    #[error("{call} failed: NCCL error {code} ({message})")]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// Its `ncclResult_t`.
        code: i32,
        /// `ncclGetErrorString`, and `ncclGetLastError` where NCCL has one.
        message: String,
    },
    /// An earlier failure (a timeout, a disagreement, a broken exchange) left the team
    /// unusable; this says what it was. Drop the team and build a new one.
    #[error("the team is unusable since an earlier failure: {cause}")]
    Unusable {
        /// The failure that broke the team.
        cause: String,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<LoadError> for Error {
    fn from(e: LoadError) -> Self {
        match e {
            LoadError::Unsupported {
                symbol,
                needed,
                driver,
                reason,
            } => Error::Unsupported {
                symbol,
                needed,
                driver,
                reason: match reason {
                    MissReason::DriverTooOld => "the driver predates it".to_string(),
                    r => r.to_string(),
                },
            },
            e => Error::Load(e),
        }
    }
}

impl Error {
    /// An [`Error::InvalidArgument`].
    pub fn invalid(arg: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            arg,
            reason: reason.into(),
        }
    }

    /// The driver status, if this is a failed driver call.
    pub fn code(&self) -> Option<CUresult> {
        match self {
            Error::Driver { code, .. } | Error::ModuleLoad { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// An [`Error::Os`] from an `io::Error` of `call`.
    pub fn os(call: &'static str, source: std::io::Error) -> Self {
        Error::Os {
            call,
            source: std::sync::Arc::new(source),
        }
    }

    /// Whether this says that the driver lacks a function.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Error::Unsupported { .. })
    }
}

/// `size` bytes at `offset` must end within the `total` bytes of `what`: otherwise (overflow
/// included) an [`Error::InvalidArgument`] on `size`, before any driver call.
pub(crate) fn check_within(size: usize, offset: usize, total: usize, what: &str) -> Result<()> {
    if offset.checked_add(size).is_none_or(|e| e > total) {
        return Err(Error::invalid(
            "size",
            format!("{size} bytes at offset {offset} pass the end of the {total}-byte {what}"),
        ));
    }
    Ok(())
}

/// `v` must be a multiple of `unit` (the `unit_name`, e.g. "allocation granularity"):
/// otherwise an [`Error::InvalidArgument`] on `arg`, before any driver call.
// `is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#[allow(clippy::manual_is_multiple_of)]
pub(crate) fn check_multiple(
    arg: &'static str,
    v: usize,
    unit: usize,
    unit_name: &str,
) -> Result<()> {
    if v % unit != 0 {
        return Err(Error::invalid(
            arg,
            format!("{v} is not a multiple of the {unit_name} {unit}"),
        ));
    }
    Ok(())
}

// Sizes and offsets are `usize` in the public API and `u64` in some driver calls: widening is
// lossless on every target this crate builds for.
const _: () = assert!(usize::BITS <= u64::BITS);

/// A size or offset as the driver's `u64` (lossless: see the assertion above).
pub(crate) fn to_driver_u64(v: usize) -> u64 {
    v as u64
}

/// A size the driver reported as `u64`, as `usize`: checked (an answer that does not fit this
/// process's address space is an error naming the call, not a truncated value).
pub(crate) fn from_driver_u64(call: &'static str, what: &str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| {
        Error::invalid(
            "driver answer",
            format!("{call} reported {what} = {v}, which does not fit a usize on this target"),
        )
    })
}

/// Turn a status into a result naming the call.
#[inline]
pub(crate) fn check(call: &'static str, code: CUresult) -> Result<()> {
    if code == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver { call, code })
    }
}

/// Call a driver entry point through the loader: resolves it (a missing function is
/// [`Error::Unsupported`]), calls it, and checks the status. Expands to a call through a raw
/// function pointer, so it must sit in an `unsafe` block whose `// SAFETY:` line says why the
/// arguments satisfy the call's contract.
macro_rules! cu {
    ($driver:expr, $f:ident ( $($a:expr),* $(,)? )) => {
        match $driver.sys().$f() {
            Ok(f) => $crate::error::check(stringify!($f), f($($a),*)),
            Err(e) => Err($crate::Error::from(e)),
        }
    };
}
pub(crate) use cu;
