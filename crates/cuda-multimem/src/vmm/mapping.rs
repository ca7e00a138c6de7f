//! Mappings of physical allocations into reservations, and access per location.
// `usize::is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

use std::sync::Arc;

use cuda_multimem_sys::{CUdeviceptr, CUmemAccessDesc, CUmemAccess_flags};

use super::{Location, PhysicalAllocation, Reservation};
use crate::error::cu;
use crate::{Device, DeviceRepr, Error, Result};

/// Access a location has to a mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// No access.
    None,
    /// Loads only.
    ReadOnly,
    /// Loads and stores.
    ReadWrite,
}

impl Access {
    fn raw(self) -> CUmemAccess_flags {
        match self {
            Access::None => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
            Access::ReadOnly => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
            Access::ReadWrite => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }
}

/// A physical allocation (or part of it) mapped into a reservation; unmapped (`cuMemUnmap`) when
/// dropped. It holds `Arc`s of both, so the allocation cannot be released nor the range freed
/// while it exists. A new mapping has no access: call [`Mapping::set_access`].
pub struct Mapping {
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    /// Unmapped already by [`Mapping::unmap`] (then `Drop` has nothing to do).
    unmapped: bool,
    // Dropped after the unmap in `Drop::drop` (fields drop after the body).
    allocation: Arc<PhysicalAllocation>,
    reservation: Arc<Reservation>,
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Mapping({:#x}, {} bytes of {:?} at offset {})",
            self.ptr, self.size, self.allocation, self.offset
        )
    }
}

impl Mapping {
    /// Map `size` bytes of `allocation` from `allocation_offset` at `reservation_offset` of
    /// `reservation` (`cuMemMap`). Offsets and size are multiples of the allocation's minimum
    /// granularity and lie inside both.
    pub fn new(
        reservation: &Arc<Reservation>,
        reservation_offset: usize,
        allocation: &Arc<PhysicalAllocation>,
        allocation_offset: usize,
        size: usize,
    ) -> Result<Mapping> {
        if size == 0 {
            return Err(Error::invalid(
                "size",
                "0 bytes; expected at least one granule",
            ));
        }
        let g = allocation.granularity();
        for (arg, v) in [
            ("size", size),
            ("reservation_offset", reservation_offset),
            ("allocation_offset", allocation_offset),
        ] {
            crate::error::check_multiple(arg, v, g, "allocation granularity")?;
        }
        crate::error::check_within(size, reservation_offset, reservation.size(), "reservation")?;
        crate::error::check_within(size, allocation_offset, allocation.size(), "allocation")?;
        let ptr = reservation.device_ptr() + reservation_offset as CUdeviceptr;
        // SAFETY: the range lies in a live reservation and the allocation handle is live; both
        // are kept alive by the Arcs stored below. Flags must be 0.
        unsafe {
            cu!(
                allocation.driver(),
                cuMemMap(ptr, size, allocation_offset, allocation.raw(), 0)
            )
        }?;
        Ok(Mapping {
            ptr,
            size,
            offset: allocation_offset,
            unmapped: false,
            allocation: allocation.clone(),
            reservation: reservation.clone(),
        })
    }

    /// Reserve a range of the allocation's size, map all of it, and grant `access` — the common
    /// case in one call. Undoes every step on failure.
    pub fn map_whole(
        allocation: &Arc<PhysicalAllocation>,
        access: &[(Location, Access)],
    ) -> Result<Mapping> {
        let r = Reservation::new(allocation.driver(), allocation.size())?;
        let m = Mapping::new(&r, 0, allocation, 0, allocation.size())?;
        if !access.is_empty() {
            m.set_access(access)?;
        }
        Ok(m)
    }

    /// Set the access of each location to this mapping (`cuMemSetAccess`); locations not named
    /// keep theirs. A device other than the memory's own is a peer: it needs peer capability.
    pub fn set_access(&self, access: &[(Location, Access)]) -> Result<()> {
        set_access_range(&self.allocation, self.ptr, self.size, access)
    }

    /// The access `location` has (`cuMemGetAccess`).
    pub fn access(&self, location: Location) -> Result<Access> {
        location.validate(self.allocation.driver(), "location")?;
        let l = location.raw();
        let mut f: std::ffi::c_ulonglong = 0;
        // SAFETY: valid out-pointer and location; the address is mapped while self lives.
        unsafe {
            cu!(
                self.allocation.driver(),
                cuMemGetAccess(&mut f, &l, self.ptr)
            )
        }?;
        Ok(match f as u32 {
            x if x == CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE.0 => Access::ReadWrite,
            x if x == CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ.0 => Access::ReadOnly,
            _ => Access::None,
        })
    }

    /// Copy `data` to the mapping at `offset_bytes` and return once it is in memory (visible to
    /// kernels on any stream; see [`crate::Device::copy_from_host_blocking`]). The copy goes
    /// through a device with read-write access to the mapping (the allocation's own device
    /// first). The range is checked, overflow included, and `offset_bytes` must be a multiple
    /// of `T`'s alignment; an empty `data` is a no-op.
    pub fn write<T: DeviceRepr>(&self, offset_bytes: usize, data: &[T]) -> Result<()> {
        self.check_typed::<T>("data", offset_bytes, std::mem::size_of_val(data))?;
        if data.is_empty() {
            return Ok(());
        }
        let device = self.device_with(true)?;
        // SAFETY: the range lies in this live mapping (checked), which `device` may write.
        unsafe {
            device.copy_from_host_blocking(
                self.ptr + offset_bytes as CUdeviceptr,
                crate::memory::as_bytes(data),
            )
        }
    }

    /// Copy `out.len()` values from the mapping at `offset_bytes` into `out`, through a device
    /// with access to the mapping (the allocation's own device first). The same checks as
    /// [`Mapping::write`]. Kernels on non-blocking streams are not waited for.
    pub fn read<T: DeviceRepr>(&self, offset_bytes: usize, out: &mut [T]) -> Result<()> {
        self.check_typed::<T>("out", offset_bytes, std::mem::size_of_val(out))?;
        if out.is_empty() {
            return Ok(());
        }
        let device = self.device_with(false)?;
        // SAFETY: the range lies in this live mapping (checked), which `device` may read.
        unsafe {
            device.copy_to_host(
                self.ptr + offset_bytes as CUdeviceptr,
                crate::memory::as_bytes_mut(out),
            )
        }
    }

    fn check_typed<T: DeviceRepr>(
        &self,
        arg: &'static str,
        offset_bytes: usize,
        bytes: usize,
    ) -> Result<()> {
        crate::error::check_multiple(
            "offset_bytes",
            offset_bytes,
            std::mem::align_of::<T>(),
            "alignment of the element type",
        )?;
        crate::error::check_within(bytes, offset_bytes, self.size, "mapping").map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => Error::invalid(arg, reason),
            e => e,
        })
    }

    /// A device through which to copy: the allocation's own device if it has the access, else
    /// the first device that has.
    fn device_with(&self, write: bool) -> Result<Device> {
        let driver = self.allocation.driver();
        let own = match self.allocation.spec().location {
            Location::Device(o) => Some(o),
            _ => None,
        };
        let others = (0..driver.device_count() as i32).filter(|&o| Some(o) != own);
        for o in own.into_iter().chain(others) {
            let a = self.access(Location::Device(o))?;
            if a == Access::ReadWrite || (!write && a == Access::ReadOnly) {
                return driver.device(o as usize);
            }
        }
        Err(Error::invalid(
            if write { "data" } else { "out" },
            format!(
                "no device has {} access to the mapping at {:#x}; grant it with set_access",
                if write { "read-write" } else { "read" },
                self.ptr
            ),
        ))
    }

    /// Unmap now (`cuMemUnmap`) and say whether it worked — what `drop` does, without losing
    /// the error. On failure the error is returned and the drop that follows tries the unmap
    /// once more before the allocation and reservation are released.
    pub fn unmap(mut self) -> Result<()> {
        // SAFETY: we mapped exactly this range and nothing was unmapped yet.
        let r = unsafe { cu!(self.allocation.driver(), cuMemUnmap(self.ptr, self.size)) };
        self.unmapped = r.is_ok();
        r
    }

    /// The mapped address.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Offset into the allocation.
    pub fn allocation_offset(&self) -> usize {
        self.offset
    }

    /// The allocation mapped.
    pub fn allocation(&self) -> &Arc<PhysicalAllocation> {
        &self.allocation
    }

    /// The reservation it lies in.
    pub fn reservation(&self) -> &Arc<Reservation> {
        &self.reservation
    }
}

/// `cuMemSetAccess` over `[ptr, ptr+size)`, after checking the locations.
pub(crate) fn set_access_range(
    allocation: &PhysicalAllocation,
    ptr: CUdeviceptr,
    size: usize,
    access: &[(Location, Access)],
) -> Result<()> {
    if access.is_empty() {
        return Err(Error::invalid(
            "access",
            "no locations; expected at least one",
        ));
    }
    let driver = allocation.driver();
    let mut descs = Vec::with_capacity(access.len());
    for (l, a) in access {
        l.validate(driver, "access")?;
        if let Location::HostNuma(_) = l {
            if !matches!(allocation.spec().location, Location::HostNuma(_)) {
                return Err(Error::invalid(
                    "access",
                    "a host-NUMA access location applies only to host-NUMA allocations; use Location::Host",
                ));
            }
        }
        descs.push(CUmemAccessDesc {
            location: l.raw(),
            flags: a.raw(),
        });
    }
    // SAFETY: `descs` is valid for `descs.len()` reads; the range is mapped while the caller's
    // mappings live.
    unsafe {
        cu!(
            driver,
            cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len())
        )
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.unmapped {
            return;
        }
        // SAFETY: we mapped exactly this range; after this the Arcs (allocation, reservation)
        // are dropped, in that order, with nothing mapped any more.
        let (ptr, size) = (self.ptr, self.size);
        self.allocation.driver().teardown(
            || format!("the mapping {ptr:#x} of {size} bytes (cuMemUnmap)"),
            // SAFETY: as above; a retry unmaps the same range, still reserved (the reservation
            // frees it only after this, and retries of its own come after this one's).
            move |d| unsafe { cu!(d, cuMemUnmap(ptr, size)) },
        );
    }
}
