//! [`Nccl`]: the library, opened at run time, and its entry points resolved at once.

use std::ffi::c_int;
use std::path::Path;
use std::sync::Arc;

use cuda_multimem::{Error, Result};

use super::ffi::*;
use super::{NCCL_CANDIDATES, NCCL_ENV, NCCL_MIN_VERSION};

/// The NCCL library, opened at run time: its version and entry points. Hold it in an `Arc`;
/// every [`super::NcclComm`] keeps its library alive.
pub struct Nccl {
    pub(super) fns: Fns,
    pub(super) version: i32,
    pub(super) path: String,
    // Dropped last: the function pointers above point into it.
    pub(super) _library: libloading::Library,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("path", &self.path)
            .field("version", &self.version_string())
            .finish_non_exhaustive()
    }
}

pub(super) fn unavailable(tried: &[(String, String)], reason: impl Into<String>) -> Error {
    Error::NcclUnavailable {
        tried: tried
            .iter()
            .map(|(p, e)| {
                if e.is_empty() {
                    p.clone()
                } else {
                    format!("{p} ({e})")
                }
            })
            .collect::<Vec<_>>()
            .join("; "),
        reason: reason.into(),
    }
}

impl Nccl {
    /// Open NCCL: the path in `CUDA_MULTIMEM_NCCL` if set, else `libnccl.so.2`, then
    /// `libnccl.so`, through the system's dynamic loader.
    pub fn load() -> Result<Arc<Nccl>> {
        if let Some(p) = std::env::var_os(NCCL_ENV).filter(|p| !p.is_empty()) {
            return Nccl::load_from(Path::new(&p));
        }
        let mut tried = Vec::new();
        for name in NCCL_CANDIDATES {
            match Nccl::load_from(Path::new(name)) {
                Ok(n) => return Ok(n),
                Err(Error::NcclUnavailable { tried: t, reason })
                    if reason.starts_with("no library") =>
                {
                    tried.push((t, String::new()))
                }
                Err(e) => return Err(e),
            }
        }
        Err(unavailable(&tried, "no library could be opened"))
    }

    /// Open NCCL from `path` (a file path, or a library name the dynamic loader resolves).
    pub fn load_from(path: &Path) -> Result<Arc<Nccl>> {
        let shown = path.display().to_string();
        // SAFETY: opening a shared library runs its initialisers; NCCL's are benign, and a
        // path the caller names is theirs to vouch for.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| {
            unavailable(
                &[(shown.clone(), e.to_string())],
                "no library could be opened",
            )
        })?;
        macro_rules! sym {
            ($name:literal, $t:ty) => {{
                // SAFETY: the symbol's C signature is `$t` in NCCL 2.14 through 2.28 (nccl.h).
                match unsafe { lib.get::<$t>(concat!($name, "\0").as_bytes()) } {
                    Ok(s) => Ok(*s),
                    Err(e) => Err(unavailable(
                        &[(shown.clone(), String::new())],
                        format!(
                            "the library lacks `{}` ({e}); is it NCCL 2.14 or newer?",
                            $name
                        ),
                    )),
                }
            }};
        }
        macro_rules! opt {
            ($name:literal, $t:ty) => {{
                // SAFETY: as above.
                unsafe { lib.get::<$t>(concat!($name, "\0").as_bytes()) }
                    .ok()
                    .map(|s| *s)
            }};
        }
        let fns = Fns {
            get_version: sym!("ncclGetVersion", GetVersionFn)?,
            get_unique_id: sym!("ncclGetUniqueId", GetUniqueIdFn)?,
            init_rank_config: sym!("ncclCommInitRankConfig", InitRankConfigFn)?,
            get_async_error: sym!("ncclCommGetAsyncError", GetAsyncErrorFn)?,
            finalize: sym!("ncclCommFinalize", CommFn)?,
            destroy: sym!("ncclCommDestroy", CommFn)?,
            abort: sym!("ncclCommAbort", CommFn)?,
            count: sym!("ncclCommCount", CommIntFn)?,
            user_rank: sym!("ncclCommUserRank", CommIntFn)?,
            error_string: sym!("ncclGetErrorString", ErrorStringFn)?,
            all_reduce: sym!("ncclAllReduce", AllReduceFn)?,
            reduce_scatter: sym!("ncclReduceScatter", ReduceScatterFn)?,
            all_gather: sym!("ncclAllGather", AllGatherFn)?,
            split: opt!("ncclCommSplit", SplitFn),
            last_error: opt!("ncclGetLastError", LastErrorFn),
        };
        let mut version = 0;
        // SAFETY: one int written through a valid pointer.
        let r = unsafe { (fns.get_version)(&mut version) };
        if r != NCCL_SUCCESS || version < NCCL_MIN_VERSION {
            return Err(unavailable(
                &[(shown, String::new())],
                format!("ncclGetVersion says {version} (status {r}); NCCL 2.14 or newer is needed"),
            ));
        }
        Ok(Arc::new(Nccl {
            fns,
            version,
            path: shown,
            _library: lib,
        }))
    }

    /// `NCCL_VERSION_CODE` of the library (22809 for 2.28.9).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// The version as `major.minor.patch`.
    pub fn version_string(&self) -> String {
        let v = self.version;
        if v >= 20900 {
            format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
        } else {
            format!("{}.{}.{}", v / 1000, (v / 100) % 10, v % 100)
        }
    }

    /// The path (or name) it was opened from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// A fresh `ncclUniqueId` (one rank makes it; every rank of the new communicator uses it).
    pub fn unique_id(&self) -> Result<NcclUniqueId> {
        let mut id = NcclUniqueId { internal: [0; 128] };
        // SAFETY: 128 bytes written through a valid pointer.
        let r = unsafe { (self.fns.get_unique_id)(&mut id) };
        self.status("ncclGetUniqueId", r, std::ptr::null_mut())?;
        Ok(id)
    }

    pub(super) fn message(&self, code: c_int, comm: RawComm) -> String {
        // SAFETY: NCCL returns a static NUL-terminated string for any code.
        let mut m = unsafe { cstr((self.fns.error_string)(code)) };
        if let (Some(last), false) = (self.fns.last_error, comm.is_null()) {
            // SAFETY: a live communicator; NCCL returns a NUL-terminated string it owns.
            let l = unsafe { cstr(last(comm)) };
            if !l.is_empty() {
                m = format!("{m}: {l}");
            }
        }
        m
    }

    fn status(&self, call: &'static str, code: c_int, comm: RawComm) -> Result<()> {
        if code == NCCL_SUCCESS {
            return Ok(());
        }
        Err(Error::Nccl {
            call,
            code,
            message: self.message(code, comm),
        })
    }
}
