//! Virtual address reservations (`cuMemAddressReserve`).
// `usize::is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

use std::sync::Arc;

use cuda_multimem_sys::CUdeviceptr;

use super::{ensure_context, page_size};
use crate::error::cu;
use crate::{Driver, Error, Result};

/// Builds a [`Reservation`]: size, alignment, address hint.
#[derive(Debug, Clone)]
pub struct ReservationBuilder {
    driver: Driver,
    size: usize,
    alignment: usize,
    hint: CUdeviceptr,
}

impl ReservationBuilder {
    /// Alignment of the start (a power of two; 0 lets the driver choose).
    pub fn alignment(mut self, a: usize) -> Self {
        self.alignment = a;
        self
    }

    /// Where the range should start, if that is free (the driver treats it as a hint).
    pub fn address_hint(mut self, addr: CUdeviceptr) -> Self {
        self.hint = addr;
        self
    }

    /// Reserve the range.
    pub fn reserve(&self) -> Result<Arc<Reservation>> {
        let page = page_size();
        if self.size == 0 || self.size % page != 0 {
            return Err(Error::invalid(
                "size",
                format!(
                    "{} bytes; expected a non-zero multiple of the page size {page}",
                    self.size
                ),
            ));
        }
        if self.alignment != 0 && !self.alignment.is_power_of_two() {
            return Err(Error::invalid(
                "alignment",
                format!(
                    "{} is not a power of two (or 0 for the default)",
                    self.alignment
                ),
            ));
        }
        if self.hint as usize % page != 0 {
            return Err(Error::invalid(
                "address_hint",
                format!("{:#x} is not a multiple of the page size {page}", self.hint),
            ));
        }
        ensure_context(&self.driver, 0)?;
        let mut p: CUdeviceptr = 0;
        // SAFETY: valid out-pointer; flags must be 0.
        unsafe {
            cu!(
                self.driver,
                cuMemAddressReserve(&mut p, self.size, self.alignment, self.hint, 0)
            )
        }?;
        Ok(Arc::new(Reservation {
            driver: self.driver.clone(),
            ptr: p,
            size: self.size,
        }))
    }
}

/// A reserved virtual address range; freed (`cuMemAddressFree`) when dropped. Mappings into it
/// hold an `Arc` of it, so it outlives them.
pub struct Reservation {
    driver: Driver,
    ptr: CUdeviceptr,
    size: usize,
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reservation({:#x}, {} bytes)", self.ptr, self.size)
    }
}

impl Reservation {
    /// A builder for `size` bytes.
    pub fn builder(driver: &Driver, size: usize) -> ReservationBuilder {
        ReservationBuilder {
            driver: driver.clone(),
            size,
            alignment: 0,
            hint: 0,
        }
    }

    /// Reserve `size` bytes anywhere, default alignment.
    pub fn new(driver: &Driver, size: usize) -> Result<Arc<Reservation>> {
        Reservation::builder(driver, size).reserve()
    }

    /// The start address.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The driver.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: we reserved exactly this range; every mapping in it holds an Arc of us, so none
        // is left when this runs.
        let (ptr, size) = (self.ptr, self.size);
        self.driver.teardown(
            || format!("the address range {ptr:#x} of {size} bytes (cuMemAddressFree)"),
            // SAFETY: as above; a retry frees the same range, which nothing else can hold.
            move |d| unsafe { cu!(d, cuMemAddressFree(ptr, size)) },
        );
    }
}
