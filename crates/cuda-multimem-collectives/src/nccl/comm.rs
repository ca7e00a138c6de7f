//! [`NcclComm`]: one rank's nonblocking NCCL communicator, every blocking step with a deadline.

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{Device, Error, Result, StreamRef};
use parking_lot::Mutex;

use super::ffi::*;
use super::library::unavailable;
use super::{Nccl, NcclUniqueId};
use crate::types::{DType, ReduceOp};

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
        let ty = nccl_type(dtype, self.nccl.version)?;
        let raw = *self.raw.lock();
        // SAFETY: as the caller promises; a live communicator and stream.
        let r = unsafe {
            (self.nccl.fns.all_reduce)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                ty,
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
        let ty = nccl_type(dtype, self.nccl.version)?;
        let raw = *self.raw.lock();
        // SAFETY: as the caller promises.
        let r = unsafe {
            (self.nccl.fns.reduce_scatter)(
                send as *const c_void,
                recv as *mut c_void,
                recv_count,
                ty,
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
        let ty = nccl_type(dtype, self.nccl.version)?;
        let raw = *self.raw.lock();
        // SAFETY: as the caller promises.
        let r = unsafe {
            (self.nccl.fns.all_gather)(
                send as *const c_void,
                recv as *mut c_void,
                send_count,
                ty,
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
