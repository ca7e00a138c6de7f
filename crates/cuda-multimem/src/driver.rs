//! The driver value a program holds: loaded from libcuda, or made by `cuda-multimem-sim` over a
//! simulated machine ([`Driver::from_sys`]). Its devices (`Driver::device`, `Driver::devices`)
//! are made in `device.rs`, which depends on this file and not the other way round.

use std::sync::{Arc, OnceLock};

use cuda_multimem_sys as sys;
use sys::{CUcontext, CUdevice};

use crate::error::{cu, Error, Result};

/// The environment variable that selects the driver: unset or `cuda` for the real driver,
/// `sim` or `sim:<options>` for the simulated one (e.g. `sim:devices=8,version=13030`), which
/// only programs that link `cuda-multimem-sim` can select (`cuda_multimem_sim::driver_from_env`).
pub const DRIVER_ENV: &str = "CUDA_MULTIMEM_DRIVER";

/// A loaded CUDA driver (or an explicitly chosen simulated one). Cheap to clone; every object
/// made from it keeps it alive, so it outlives them all. Primary contexts retained through it
/// are released when the last clone goes.
#[derive(Clone)]
pub struct Driver {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    sys: sys::Driver,
    simulated: bool,
    device_count: i32,
    contexts: Box<[OnceLock<CUcontext>]>,
    /// Releases that failed during a teardown (a `Drop` cannot return the error): tried again
    /// before every later teardown and when the driver goes ([`Driver::unreleased`]).
    unreleased: parking_lot::Mutex<Vec<Unreleased>>,
}

/// The driver call that gives a resource back.
type Release = Box<dyn FnMut(&Inner) -> Result<()> + Send>;

/// A release that failed: what it was, and the call that gives the resource back.
struct Unreleased {
    what: String,
    retry: Release,
}

// SAFETY: CUcontext handles are process-wide driver handles, usable from any thread; the table
// is only written once per device through OnceLock.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

impl Inner {
    pub(crate) fn sys(&self) -> &sys::Driver {
        &self.sys
    }

    /// Make device `ordinal`'s primary context current (a teardown's retry: the context was
    /// retained when the resource was made).
    pub(crate) fn bind(&self, ordinal: CUdevice) -> Result<()> {
        let ctx = self
            .contexts
            .get(ordinal as usize)
            .and_then(|c| c.get())
            .copied()
            .ok_or_else(|| Error::invalid("device", format!("{ordinal}: no retained context")))?;
        // SAFETY: a live primary context retained by this driver.
        unsafe { cu!(self, cuCtxSetCurrent(ctx)) }
    }
}

impl Inner {
    /// Try the releases that failed before, once each; keep those that fail again.
    fn retry_unreleased(&self) {
        let pending = std::mem::take(&mut *self.unreleased.lock());
        let mut kept = Vec::new();
        for mut u in pending {
            if (u.retry)(self).is_err() {
                kept.push(u);
            }
        }
        self.unreleased.lock().extend(kept);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.retry_unreleased();
        for u in self.unreleased.get_mut().iter() {
            eprintln!(
                "cuda-multimem: {} could not be given back to the driver (the process ends with it held)",
                u.what
            );
        }
        for (ordinal, c) in self.contexts.iter().enumerate() {
            if c.get().is_some() {
                if let Ok(release) = self.sys.cuDevicePrimaryCtxRelease_v11000() {
                    // SAFETY: this driver retained the primary context of `ordinal` exactly once.
                    unsafe { release(ordinal as CUdevice) };
                }
            }
        }
    }
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("origin", self.inner.sys.origin())
            .field("version", &self.version())
            .field("devices", &self.inner.device_count)
            .finish()
    }
}

impl Driver {
    /// Load the real driver (`CUDA_MULTIMEM_LIBCUDA`, else `libcuda.so.1`, else `libcuda.so`) and
    /// initialise it. Never falls back to the simulator.
    pub fn load() -> Result<Driver> {
        Driver::from_sys(sys::Driver::load()?, false)
    }

    /// The driver `CUDA_MULTIMEM_DRIVER` selects: the real one when unset or `cuda`. This
    /// library does not link the simulator, so `sim[:options]` is an [`Error::Config`] pointing
    /// to `cuda_multimem_sim::driver_from_env()`, which programs (tests, examples) that link it
    /// call instead. Anything else is an error too.
    pub fn from_env() -> Result<Driver> {
        match std::env::var(DRIVER_ENV) {
            Err(std::env::VarError::NotPresent) => Driver::load(),
            Err(std::env::VarError::NotUnicode(v)) => {
                Err(Error::Config(format!("{DRIVER_ENV}={v:?} is not UTF-8")))
            }
            Ok(v) => Driver::from_selection(&v),
        }
    }

    /// Interpret a `CUDA_MULTIMEM_DRIVER` value: empty or `cuda` loads the real driver; `sim` or
    /// `sim:<options>` is an [`Error::Config`] (see [`Driver::from_env`]); anything else is an
    /// [`Error::Config`] saying what is expected.
    pub fn from_selection(value: &str) -> Result<Driver> {
        let v = value.trim();
        if v.is_empty() || v == "cuda" {
            return Driver::load();
        }
        if v == "sim" || v.starts_with("sim:") {
            return Err(Error::Config(format!(
                "{DRIVER_ENV}={value} selects the simulated driver, which this program does not \
                 link: the library never uses the simulator; a program that links \
                 cuda-multimem-sim selects it with cuda_multimem_sim::driver_from_env()"
            )));
        }
        Err(Error::Config(format!(
            "{DRIVER_ENV}={value}: expected `cuda` or `sim[:key=value,...]`"
        )))
    }

    /// Wrap a loaded `cuda_multimem_sys::Driver` and call `cuInit`. `simulated` is reported by
    /// [`Driver::is_simulated`] (`cuda_multimem_sim::driver_over` passes `true`).
    pub fn from_sys(sys: sys::Driver, simulated: bool) -> Result<Driver> {
        let mut inner = Inner {
            sys,
            simulated,
            device_count: 0,
            contexts: Box::new([]),
            unreleased: parking_lot::Mutex::new(Vec::new()),
        };
        // SAFETY: cuInit takes a flags word, which must be 0.
        unsafe { cu!(inner, cuInit(0)) }?;
        let mut n = 0;
        // SAFETY: one int written through a valid pointer.
        unsafe { cu!(inner, cuDeviceGetCount(&mut n)) }?;
        inner.device_count = n;
        inner.contexts = (0..n).map(|_| OnceLock::new()).collect();
        Ok(Driver {
            inner: Arc::new(inner),
        })
    }

    /// Give a resource back in a teardown (a `Drop`): `release` is the driver call; `what`
    /// names the resource. A failed release is tried once more at once; if it fails again it
    /// is reported on stderr with the error and kept: tried again before every later teardown
    /// of this driver and when the driver goes, and listed by [`Driver::unreleased`] — never
    /// silently dropped.
    pub(crate) fn teardown(
        &self,
        what: impl FnOnce() -> String,
        mut release: impl FnMut(&Inner) -> Result<()> + Send + 'static,
    ) {
        self.inner.retry_unreleased();
        if release(&self.inner).is_ok() {
            return;
        }
        match release(&self.inner) {
            Ok(()) => {}
            Err(e) => {
                let what = what();
                eprintln!(
                    "cuda-multimem: {what} failed during a teardown ({e}); it is tried again at the next teardown and when the driver goes"
                );
                self.inner.unreleased.lock().push(Unreleased {
                    what,
                    retry: Box::new(release),
                });
            }
        }
    }

    /// The resources whose release failed during a teardown and is still pending (each was
    /// reported on stderr; each is tried again before every later teardown and when the last
    /// clone of this driver goes). Empty in a healthy program.
    pub fn unreleased(&self) -> Vec<String> {
        self.inner.retry_unreleased();
        self.inner
            .unreleased
            .lock()
            .iter()
            .map(|u| u.what.clone())
            .collect()
    }

    /// Whether `other` is this same driver value (a clone of it), not merely a driver over the
    /// same library: handles made through one are refused by the other's checks.
    pub fn same_as(&self, other: &Driver) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The raw loader, for calls this crate does not wrap.
    pub fn sys(&self) -> &sys::Driver {
        &self.inner.sys
    }

    /// The driver's version (13000 for CUDA 13.0).
    pub fn version(&self) -> i32 {
        self.inner.sys.version()
    }

    /// Whether this is the simulated driver.
    pub fn is_simulated(&self) -> bool {
        self.inner.simulated
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.inner.device_count as usize
    }

    /// The primary context of `ordinal`, retained on first use.
    pub(crate) fn primary_context(&self, ordinal: CUdevice) -> Result<CUcontext> {
        let slot = &self.inner.contexts[ordinal as usize];
        if let Some(c) = slot.get() {
            return Ok(*c);
        }
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer valid; ordinal checked by construction of Device.
        unsafe { cu!(self, cuDevicePrimaryCtxRetain(&mut ctx, ordinal)) }?;
        if slot.set(ctx).is_err() {
            // Another thread won the race: give our extra reference back.
            // SAFETY: we retained once above.
            unsafe { cu!(self, cuDevicePrimaryCtxRelease_v11000(ordinal)) }?;
        }
        Ok(*slot.get().unwrap_or(&ctx))
    }
}

/// A `Send`/`Sync` wrapper for raw driver handles owned by safe types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Raw<T>(pub T);
// SAFETY: CUDA driver handles are usable from any thread of the process.
unsafe impl<T> Send for Raw<T> {}
// SAFETY: as above; the owning types serialise what the driver requires.
unsafe impl<T> Sync for Raw<T> {}
