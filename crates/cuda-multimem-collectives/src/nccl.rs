//! NCCL, loaded at run time: the few types and functions the collectives across NVLink domains
//! need, declared by hand against NCCL 2.28's `nccl.h`, and a communicator whose every blocking
//! step (initialisation, completion of a call, teardown) waits with a deadline.
//!
//! Nothing links against NCCL. [`Nccl::load`] opens the library named by `CUDA_MULTIMEM_NCCL`
//! ([`NCCL_ENV`]), else `libnccl.so.2`, then `libnccl.so`, and resolves every function it uses
//! at once: a missing library or a library without one of them (a path to something that is
//! not NCCL) is [`Error::NcclUnavailable`], naming the paths tried and the fix; never a panic.
//!
//! Communicators are nonblocking (`ncclConfig_t.blocking = 0`): NCCL returns `ncclInProgress`
//! and this module polls `ncclCommGetAsyncError` until the call is done or the deadline passes;
//! then, and on any NCCL error, the communicator is aborted (`ncclCommAbort`) and the error is
//! ours ([`Error::Timeout`], [`Error::Nccl`]). Collectives are enqueued on the caller's stream
//! and are captured by CUDA graphs like any other stream work.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_multimem::sys::{CUdeviceptr, CUstream};
use cuda_multimem::{Device, Error, Result, StreamRef};
use parking_lot::Mutex;

use crate::types::{DType, ReduceOp};

/// The environment variable naming an explicit NCCL library path.
pub const NCCL_ENV: &str = "CUDA_MULTIMEM_NCCL";

/// Library names tried, in order, when [`NCCL_ENV`] is unset.
pub const NCCL_CANDIDATES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// The oldest NCCL this module drives: nonblocking communicators, `ncclCommInitRankConfig` and
/// `ncclCommFinalize` appeared in 2.14.
pub const NCCL_MIN_VERSION: i32 = 21400;

// ncclResult_t
const NCCL_SUCCESS: c_int = 0;
const NCCL_IN_PROGRESS: c_int = 7;
// ncclConfig_t
const NCCL_API_MAGIC: u32 = 0xcafe_beef;
const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;

type RawComm = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes made by one rank ([`Nccl::unique_id`]) and handed to every
/// rank of the communicator to be (through a [`crate::Bootstrap`], say).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId {
    internal: [u8; 128],
}

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclUniqueId(..)")
    }
}

impl NcclUniqueId {
    /// Bytes in an id.
    pub const BYTES: usize = 128;

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.internal
    }

    /// An id from bytes another rank made (exactly 128).
    pub fn from_bytes(bytes: &[u8]) -> Result<NcclUniqueId> {
        let internal: [u8; 128] = bytes.try_into().map_err(|_| {
            Error::invalid(
                "bytes",
                format!("{} bytes; an ncclUniqueId has 128", bytes.len()),
            )
        })?;
        Ok(NcclUniqueId { internal })
    }
}

/// The prefix of `ncclConfig_t` that NCCL has read since 2.17 (`size`, `magic`, `version`,
/// `blocking`, `cgaClusterSize`, `minCTAs`, `maxCTAs`, `netName`). NCCL copies `size` bytes of
/// the caller's struct over its own defaults and resets the fields newer than `version`, so this
/// prefix is read the same by NCCL 2.17 to 2.28 and later.
#[repr(C)]
struct ConfigV21700 {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

impl ConfigV21700 {
    fn nonblocking() -> ConfigV21700 {
        ConfigV21700 {
            size: std::mem::size_of::<ConfigV21700>(),
            magic: NCCL_API_MAGIC,
            version: 21700,
            blocking: 0,
            cga_cluster_size: NCCL_CONFIG_UNDEF_INT,
            min_ctas: NCCL_CONFIG_UNDEF_INT,
            max_ctas: NCCL_CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
        }
    }
}

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueIdFn = unsafe extern "C" fn(*mut NcclUniqueId) -> c_int;
type InitRankConfigFn =
    unsafe extern "C" fn(*mut RawComm, c_int, NcclUniqueId, c_int, *mut ConfigV21700) -> c_int;
type CommFn = unsafe extern "C" fn(RawComm) -> c_int;
type GetAsyncErrorFn = unsafe extern "C" fn(RawComm, *mut c_int) -> c_int;
type CommIntFn = unsafe extern "C" fn(RawComm, *mut c_int) -> c_int;
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type LastErrorFn = unsafe extern "C" fn(RawComm) -> *const c_char;
type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    CUstream,
) -> c_int;
type ReduceScatterFn = AllReduceFn;
type AllGatherFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, CUstream) -> c_int;
type SplitFn =
    unsafe extern "C" fn(RawComm, c_int, c_int, *mut RawComm, *mut ConfigV21700) -> c_int;

/// Every entry point used, resolved when the library is opened.
struct Fns {
    get_version: GetVersionFn,
    get_unique_id: GetUniqueIdFn,
    init_rank_config: InitRankConfigFn,
    get_async_error: GetAsyncErrorFn,
    finalize: CommFn,
    destroy: CommFn,
    abort: CommFn,
    count: CommIntFn,
    user_rank: CommIntFn,
    error_string: ErrorStringFn,
    all_reduce: AllReduceFn,
    reduce_scatter: ReduceScatterFn,
    all_gather: AllGatherFn,
    /// 2.18 and later.
    split: Option<SplitFn>,
    /// 2.15 and later.
    last_error: Option<LastErrorFn>,
}

/// The NCCL library, opened at run time: its version and entry points. Hold it in an `Arc`;
/// every [`NcclComm`] keeps its library alive.
pub struct Nccl {
    fns: Fns,
    version: i32,
    path: String,
    // Dropped last: the function pointers above point into it.
    _library: libloading::Library,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("path", &self.path)
            .field("version", &self.version_string())
            .finish_non_exhaustive()
    }
}

fn unavailable(tried: &[(String, String)], reason: impl Into<String>) -> Error {
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

    fn message(&self, code: c_int, comm: RawComm) -> String {
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

/// # Safety
/// `p` is null or a NUL-terminated string.
unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: as the caller promises.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `ncclDataType_t` of an element type.
fn nccl_type(d: DType) -> c_int {
    match d {
        DType::F16 => 6,
        DType::F32 => 7,
        DType::Bf16 => 9,
    }
}

/// `ncclRedOp_t` of an operator.
fn nccl_op(o: ReduceOp) -> c_int {
    match o {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}

/// A timeout the polls can hold as a deadline (`Instant + Duration` panics past the clock).
fn check_timeout(timeout: Duration) -> Result<()> {
    if timeout.is_zero() || Instant::now().checked_add(timeout).is_none() {
        return Err(Error::invalid(
            "timeout",
            format!("{timeout:?}; expected a positive duration the clock can hold as a deadline"),
        ));
    }
    Ok(())
}

/// An NCCL communicator of one rank (nonblocking, with deadlines): made from a unique id
/// ([`NcclComm::init_rank`]) or split from an engine's own communicator
/// ([`NcclComm::split_from_raw`]). Dropping it finalises and destroys it within its timeout,
/// else aborts it.
pub struct NcclComm {
    nccl: Arc<Nccl>,
    device: Device,
    /// The handle; calls on it are made one at a time.
    raw: Mutex<RawComm>,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Why it was aborted (after which every call answers [`Error::Unusable`]).
    broken: Mutex<Option<String>>,
}

// SAFETY: the NCCL handle is used under the mutex, one call at a time; NCCL communicators may be
// used from any thread as long as calls on one are not concurrent.
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclComm(rank {} of {}, device {}, NCCL {})",
            self.rank,
            self.size,
            self.device.ordinal(),
            self.nccl.version_string()
        )
    }
}

impl NcclComm {
    /// Rank `rank` of a new `size`-rank communicator on `device`, every rank passing the same
    /// `id`: returns once every rank joined, or fails with [`Error::Timeout`] after `timeout`
    /// (the half-made communicator aborted).
    pub fn init_rank(
        nccl: &Arc<Nccl>,
        device: &Device,
        id: &NcclUniqueId,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<NcclComm> {
        if size == 0 || rank >= size || size > c_int::MAX as usize {
            return Err(Error::invalid("rank", format!("rank {rank} of {size}")));
        }
        check_timeout(timeout)?;
        device.bind()?;
        let mut cfg = ConfigV21700::nonblocking();
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: out-pointer and config valid for the call; the id is passed by value as the
        // C signature says; the device's context is current.
        let r = unsafe {
            (nccl.fns.init_rank_config)(&mut raw, size as c_int, *id, rank as c_int, &mut cfg)
        };
        let comm = NcclComm {
            nccl: nccl.clone(),
            device: device.clone(),
            raw: Mutex::new(raw),
            rank,
            size,
            timeout,
            broken: Mutex::new(None),
        };
        comm.settle(
            "ncclCommInitRankConfig",
            r,
            "initialisation (a peer did not join)",
        )?;
        Ok(comm)
    }

    /// A communicator split from an engine's own NCCL communicator `parent` (`ncclCommSplit`:
    /// ranks passing the same `color` form one, ordered by `key`); waits up to `timeout`.
    ///
    /// # Safety
    /// `parent` is a live `ncclComm_t` of the same NCCL library, on `device`, not used
    /// concurrently by anything else during this call; every rank of it makes this call.
    pub unsafe fn split_from_raw(
        nccl: &Arc<Nccl>,
        device: &Device,
        parent: *mut c_void,
        color: u32,
        key: u32,
        timeout: Duration,
    ) -> Result<NcclComm> {
        let split = nccl.fns.split.ok_or_else(|| {
            unavailable(
                &[(nccl.path.clone(), String::new())],
                format!(
                    "NCCL {} lacks `ncclCommSplit` (2.18 or newer)",
                    nccl.version_string()
                ),
            )
        })?;
        if parent.is_null() {
            return Err(Error::invalid("parent", "a null ncclComm_t"));
        }
        check_timeout(timeout)?;
        device.bind()?;
        let mut cfg = ConfigV21700::nonblocking();
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: the caller promises the parent; out-pointer and config live for the call.
        let r = unsafe {
            split(
                parent,
                (color & 0x7fff_ffff) as c_int,
                (key & 0x7fff_ffff) as c_int,
                &mut raw,
                &mut cfg,
            )
        };
        let mut comm = NcclComm {
            nccl: nccl.clone(),
            device: device.clone(),
            raw: Mutex::new(raw),
            rank: 0,
            size: 0,
            timeout,
            broken: Mutex::new(None),
        };
        comm.settle("ncclCommSplit", r, "the split (a peer did not join)")?;
        let (mut n, mut me) = (0, 0);
        // SAFETY: a live communicator; ints written through valid pointers.
        let r = unsafe { (nccl.fns.count)(raw, &mut n) };
        comm.settle("ncclCommCount", r, "ncclCommCount")?;
        // SAFETY: as above.
        let r = unsafe { (nccl.fns.user_rank)(raw, &mut me) };
        comm.settle("ncclCommUserRank", r, "ncclCommUserRank")?;
        comm.size = n.max(0) as usize;
        comm.rank = me.max(0) as usize;
        Ok(comm)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The library.
    pub fn nccl(&self) -> &Arc<Nccl> {
        &self.nccl
    }

    /// The raw `ncclComm_t` (for calls this crate does not wrap; keep it alive through `self`).
    pub fn as_raw(&self) -> *mut c_void {
        *self.raw.lock()
    }

    /// Check for an asynchronous error (a failed or timed-out collective, a dead peer): an
    /// error aborts the communicator and is returned.
    pub fn check(&self) -> Result<()> {
        self.usable()?;
        let raw = *self.raw.lock();
        let mut st = NCCL_SUCCESS;
        // SAFETY: a live communicator; one int written through a valid pointer.
        let r = unsafe { (self.nccl.fns.get_async_error)(raw, &mut st) };
        if r != NCCL_SUCCESS {
            return Err(self.abort_with("ncclCommGetAsyncError", r));
        }
        if st != NCCL_SUCCESS && st != NCCL_IN_PROGRESS {
            return Err(self.abort_with("ncclCommGetAsyncError", st));
        }
        Ok(())
    }

    fn usable(&self) -> Result<()> {
        match &*self.broken.lock() {
            Some(cause) => Err(Error::Unusable {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// After a call that returned `code`: done on success, polled to completion (bounded by
    /// the timeout) on `ncclInProgress`, aborted on anything else.
    fn settle(&self, call: &'static str, code: c_int, what: &str) -> Result<()> {
        match code {
            NCCL_SUCCESS => Ok(()),
            NCCL_IN_PROGRESS => self.poll(call, what),
            c => Err(self.abort_with(call, c)),
        }
    }

    fn poll(&self, call: &'static str, what: &str) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let raw = *self.raw.lock();
        loop {
            let mut st = NCCL_IN_PROGRESS;
            // SAFETY: a live (possibly still initialising) communicator; one int written.
            let r = unsafe { (self.nccl.fns.get_async_error)(raw, &mut st) };
            if r != NCCL_SUCCESS {
                return Err(self.abort_with("ncclCommGetAsyncError", r));
            }
            match st {
                NCCL_SUCCESS => return Ok(()),
                NCCL_IN_PROGRESS => {
                    if Instant::now() >= deadline {
                        let e = Error::Timeout {
                            what: format!(
                                "NCCL {call}: {what} (rank {} of {}; the NCCL communicator was aborted)",
                                self.rank, self.size
                            ),
                            after: self.timeout,
                        };
                        self.abort(&e.to_string());
                        return Err(e);
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
                c => return Err(self.abort_with(call, c)),
            }
        }
    }

    fn abort_with(&self, call: &'static str, code: c_int) -> Error {
        let raw = *self.raw.lock();
        let e = Error::Nccl {
            call,
            code,
            message: self.nccl.message(code, raw),
        };
        self.abort(&e.to_string());
        e
    }

    /// Abort the communicator (once); later calls answer [`Error::Unusable`].
    fn abort(&self, cause: &str) {
        let mut b = self.broken.lock();
        if b.is_some() {
            return;
        }
        *b = Some(cause.to_string());
        let mut raw = self.raw.lock();
        if !raw.is_null() {
            // SAFETY: a communicator of this library, aborted once and never used again.
            unsafe { (self.nccl.fns.abort)(*raw) };
            *raw = std::ptr::null_mut();
        }
    }

    fn check_stream(&self, stream: &StreamRef<'_>) -> Result<()> {
        if stream.device() != &self.device {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a stream of device {}; this NCCL communicator is on device {}",
                    stream.device().ordinal(),
                    self.device.ordinal()
                ),
            ));
        }
        self.usable()?;
        self.device.bind()
    }

    /// `ncclAllReduce` of `count` elements from `send` into `recv` (the same address: in
    /// place), enqueued on `stream`.
    ///
    /// # Safety
    /// `send` and `recv` are device memory of this communicator's device, valid for `count`
    /// elements of `dtype` until the enqueued work has run; every rank makes the same call.
    pub unsafe fn all_reduce_raw(
        &self,
        dtype: DType,
        op: ReduceOp,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let raw = *self.raw.lock();
        // SAFETY: as the caller promises; a live communicator and stream.
        let r = unsafe {
            (self.nccl.fns.all_reduce)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                nccl_type(dtype),
                nccl_op(op),
                raw,
                stream.raw(),
            )
        };
        self.settle("ncclAllReduce", r, "enqueueing an allreduce")
    }

    /// `ncclReduceScatter`: `send` holds `size · recv_count` elements, `recv` gets this rank's
    /// `recv_count`.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_raw`], for those lengths.
    pub unsafe fn reduce_scatter_raw(
        &self,
        dtype: DType,
        op: ReduceOp,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        recv_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let raw = *self.raw.lock();
        // SAFETY: as the caller promises.
        let r = unsafe {
            (self.nccl.fns.reduce_scatter)(
                send as *const c_void,
                recv as *mut c_void,
                recv_count,
                nccl_type(dtype),
                nccl_op(op),
                raw,
                stream.raw(),
            )
        };
        self.settle("ncclReduceScatter", r, "enqueueing a reduce-scatter")
    }

    /// `ncclAllGather`: `send` holds `send_count` elements, `recv` gets `size · send_count`.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_raw`], for those lengths.
    pub unsafe fn all_gather_raw(
        &self,
        dtype: DType,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        send_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let raw = *self.raw.lock();
        // SAFETY: as the caller promises.
        let r = unsafe {
            (self.nccl.fns.all_gather)(
                send as *const c_void,
                recv as *mut c_void,
                send_count,
                nccl_type(dtype),
                raw,
                stream.raw(),
            )
        };
        self.settle("ncclAllGather", r, "enqueueing an all-gather")
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let raw = *self.raw.lock();
        if raw.is_null() || self.broken.lock().is_some() {
            return;
        }
        let _ = self.device.bind();
        // Finalize flushes outstanding work; poll it with the deadline, then destroy (local,
        // non-blocking once finalised). A finalize that does not finish is aborted instead.
        // SAFETY: a live communicator, used by no one else from here on.
        let r = unsafe { (self.nccl.fns.finalize)(raw) };
        let done = match r {
            NCCL_SUCCESS => true,
            NCCL_IN_PROGRESS => self.poll("ncclCommFinalize", "teardown").is_ok(),
            _ => false,
        };
        if done {
            // SAFETY: finalised; destroyed once.
            unsafe { (self.nccl.fns.destroy)(raw) };
        } else {
            self.abort("teardown did not complete");
        }
    }
}
