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
    /// An operating-system call failed (file descriptors, sockets).
    #[error("{call}: {message}")]
    Os {
        /// The call.
        call: &'static str,
        /// The system's message.
        message: String,
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

    /// Whether this says that the driver lacks a function.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Error::Unsupported { .. })
    }
}

/// `size` bytes at `offset` must end within the `total` bytes of `what`: otherwise (overflow
/// included) an [`Error::InvalidArgument`] on `size`, before any driver call.
pub(crate) fn check_within(size: u64, offset: u64, total: u64, what: &str) -> Result<()> {
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
pub(crate) fn check_multiple(arg: &'static str, v: u64, unit: u64, unit_name: &str) -> Result<()> {
    if v % unit != 0 {
        return Err(Error::invalid(
            arg,
            format!("{v} is not a multiple of the {unit_name} {unit}"),
        ));
    }
    Ok(())
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
