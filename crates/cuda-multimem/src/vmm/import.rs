//! Importing a physical allocation from a shareable handle. The exporter's size claim is
//! untrusted, so an import checks it by reserving and mapping the allocation once: this file
//! sits above `allocation.rs`, `reservation.rs` and `mapping.rs` (a mapping holds an
//! allocation), which is why it is not part of `allocation.rs`.
// `usize::is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use cuda_multimem_sys::{CUmemAllocationProp, CUmemGenericAllocationHandle, CUresult};

use super::allocation::{AllocationSpec, Granularity, HandleTypes, PhysicalAllocation};
use super::mapping::Mapping;
use super::reservation::Reservation;
use super::share::{self, FabricHandle};
use super::{ensure_context, Location};
use crate::driver::Driver;
use crate::error::{cu, Error, Result};

impl PhysicalAllocation {
    /// Import an allocation exported as a POSIX fd by this or another process. `size` is what
    /// the exporter said it is: untrusted, so it is checked (non-zero, a granularity multiple,
    /// and no larger than the allocation — by mapping it once). The fd stays the caller's.
    pub fn import_posix_fd(
        driver: &Driver,
        fd: BorrowedFd<'_>,
        size: usize,
    ) -> Result<Arc<PhysicalAllocation>> {
        let raw = fd.as_raw_fd();
        if raw < 0 {
            return Err(Error::invalid(
                "fd",
                format!("{raw} is not a file descriptor"),
            ));
        }
        check_import_size(size)?;
        ensure_context(driver, 0)?;
        let h = share::import_posix_fd(driver, fd)?;
        PhysicalAllocation::adopt_imported(driver, h, size, HandleTypes::POSIX_FD)
    }

    /// Import an allocation exported as a fabric handle. `bytes` and `size` are untrusted: the
    /// bytes must be exactly 64, the size is checked as in [`PhysicalAllocation::import_posix_fd`].
    pub fn import_fabric(
        driver: &Driver,
        bytes: &[u8],
        size: usize,
    ) -> Result<Arc<PhysicalAllocation>> {
        let handle = FabricHandle::from_bytes(bytes)?;
        check_import_size(size)?;
        ensure_context(driver, 0)?;
        let h = share::import_fabric(driver, &handle)?;
        PhysicalAllocation::adopt_imported(driver, h, size, HandleTypes::FABRIC)
    }

    /// Own an imported handle: read its properties, check the claimed size by mapping it once.
    /// `via` is the handle type it arrived as: a real 13.0 driver reports no requested handle
    /// types for an imported allocation, but it evidently is shareable that way.
    fn adopt_imported(
        driver: &Driver,
        h: CUmemGenericAllocationHandle,
        size: usize,
        via: HandleTypes,
    ) -> Result<Arc<PhysicalAllocation>> {
        // Owned from here: released on any error below.
        let mut a = PhysicalAllocation {
            driver: driver.clone(),
            handle: h,
            size,
            spec: AllocationSpec::device(0),
            granularity: 0,
        };
        let mut prop = CUmemAllocationProp::default();
        // SAFETY: valid out-pointer and a live handle.
        match unsafe { cu!(driver, cuMemGetAllocationPropertiesFromHandle(&mut prop, h)) } {
            Ok(()) => {}
            // Allocations and multicast objects share the shareable-handle calls; the driver
            // describes only an allocation's handle.
            Err(Error::Driver { call, code })
                if code == CUresult::CUDA_ERROR_INVALID_VALUE
                    || code == CUresult::CUDA_ERROR_INVALID_HANDLE =>
            {
                return Err(Error::invalid(
                    if via.fabric { "bytes" } else { "fd" },
                    format!(
                        "the imported handle is not a physical allocation's ({call}: {code}); \
                         a multicast object's handle is imported with \
                         MulticastObject::import_posix_fd or import_fabric"
                    ),
                ));
            }
            Err(e) => return Err(e),
        }
        a.spec = AllocationSpec {
            location: Location::from_raw(&prop.location).ok_or_else(|| {
                Error::invalid("handle", "the imported allocation has an unknown location")
            })?,
            handle_types: {
                let t = HandleTypes::from_raw(prop.requestedHandleTypes);
                HandleTypes {
                    posix_fd: t.posix_fd || via.posix_fd,
                    fabric: t.fabric || via.fabric,
                }
            },
            gpu_direct_rdma: prop.allocFlags.gpuDirectRDMACapable != 0,
        };
        // The exporter's device ordinal may not exist here (another node of the fabric): then
        // the granularity of this process's device 0 stands in.
        let g = match a.spec.location {
            Location::Device(dev) if dev < 0 || dev as usize >= driver.device_count() => {
                AllocationSpec::device(0).granularity(driver, Granularity::Minimum)?
            }
            _ => a.spec.granularity(driver, Granularity::Minimum)?,
        };
        a.granularity = g;
        if size % g != 0 {
            return Err(Error::invalid(
                "size",
                format!(
                    "{size} bytes is not a multiple of the imported allocation's granularity {g}"
                ),
            ));
        }
        let a = Arc::new(a);
        // Mapping all of `size` fails when the allocation is smaller; a claim too large to
        // reserve at all is as wrong.
        let r = Reservation::new(driver, size).map_err(|e| match e {
            Error::Driver { .. } => Error::invalid(
                "size",
                format!("{size} bytes cannot be reserved to check the claim ({e})"),
            ),
            e => e,
        })?;
        let m = Mapping::new(&r, 0, &a, 0, size).map_err(|e| match e {
            Error::Driver { .. } => Error::invalid(
                "size",
                format!("{size} bytes does not fit the imported allocation ({e})"),
            ),
            e => e,
        })?;
        // The check's mapping goes now; a failed unmap is the caller's error too (the mapping,
        // reservation and handle are released on the way out, as far as the driver lets them).
        m.unmap()?;
        Ok(a)
    }
}

fn check_import_size(size: usize) -> Result<()> {
    if size == 0 {
        return Err(Error::invalid(
            "size",
            "0 bytes; expected the exported allocation's size",
        ));
    }
    Ok(())
}
