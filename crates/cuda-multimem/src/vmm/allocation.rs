//! Physical allocations (`cuMemCreate`), their granularity, and shareable handles.
// `usize::is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use cuda_multimem_sys::{
    CUmemAllocationGranularity_flags as G, CUmemAllocationHandleType as HT, CUmemAllocationProp,
    CUmemAllocationType, CUmemGenericAllocationHandle, CUresult,
};

use super::{ensure_context, Location};
use crate::error::cu;
use crate::{Driver, Error, Result};

/// Which granularity: the smallest the driver accepts, or the one it recommends for speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Granularity {
    /// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
    #[default]
    Minimum,
    /// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`.
    Recommended,
}

/// How [`AllocationBuilder::create`] treats a size that is not a granularity multiple.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rounding {
    /// Reject it with [`Error::InvalidArgument`].
    Exact,
    /// Round up to the minimum granularity.
    #[default]
    UpToMinimum,
    /// Round up to the recommended granularity.
    UpToRecommended,
}

/// Shareable handle types an allocation can be exported as. They are fixed when the allocation
/// is created (the driver cannot add one later), so choose them up front.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct HandleTypes {
    /// Exportable as a POSIX file descriptor (shared between processes of one host).
    pub posix_fd: bool,
    /// Exportable as a fabric handle (64 opaque bytes; across hosts of an NVLink fabric).
    pub fabric: bool,
}

impl HandleTypes {
    /// Not exportable.
    pub const NONE: HandleTypes = HandleTypes {
        posix_fd: false,
        fabric: false,
    };
    /// POSIX file descriptors only.
    pub const POSIX_FD: HandleTypes = HandleTypes {
        posix_fd: true,
        fabric: false,
    };
    /// Fabric handles only.
    pub const FABRIC: HandleTypes = HandleTypes {
        posix_fd: false,
        fabric: true,
    };

    /// The driver's bit mask.
    pub fn raw(self) -> HT {
        let mut v = 0;
        if self.posix_fd {
            v |= HT::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
        }
        if self.fabric {
            v |= HT::CU_MEM_HANDLE_TYPE_FABRIC.0;
        }
        HT(v)
    }

    /// From the driver's bit mask (unknown bits ignored).
    pub fn from_raw(v: HT) -> HandleTypes {
        HandleTypes {
            posix_fd: v.0 & HT::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0 != 0,
            fabric: v.0 & HT::CU_MEM_HANDLE_TYPE_FABRIC.0 != 0,
        }
    }
}

/// What a physical allocation is: location, exportable handle types, GPUDirect RDMA flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AllocationSpec {
    /// Where the memory lives.
    pub location: Location,
    /// Handle types it can be exported as.
    pub handle_types: HandleTypes,
    /// Request GPUDirect-RDMA-capable memory.
    pub gpu_direct_rdma: bool,
}

impl AllocationSpec {
    /// Device memory of `device`, not exportable.
    pub fn device(device: i32) -> Self {
        AllocationSpec {
            location: Location::Device(device),
            handle_types: HandleTypes::NONE,
            gpu_direct_rdma: false,
        }
    }

    /// The driver's property block.
    pub fn raw(&self) -> CUmemAllocationProp {
        let mut p = CUmemAllocationProp {
            type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: self.handle_types.raw(),
            location: self.location.raw(),
            ..Default::default()
        };
        p.allocFlags.gpuDirectRDMACapable = self.gpu_direct_rdma as u8;
        p
    }

    fn check(&self, driver: &Driver) -> Result<()> {
        self.location.validate(driver, "location")?;
        if !matches!(self.location, Location::Device(_))
            && (self.handle_types.posix_fd || self.handle_types.fabric)
        {
            return Err(Error::invalid(
                "handle_types",
                format!(
                    "{:?}: host allocations cannot be exported; expected no handle types",
                    self.handle_types
                ),
            ));
        }
        Ok(())
    }

    fn context_device(&self) -> i32 {
        match self.location {
            Location::Device(d) => d,
            _ => 0,
        }
    }

    /// The allocation granularity for this spec (`cuMemGetAllocationGranularity`).
    pub fn granularity(&self, driver: &Driver, which: Granularity) -> Result<usize> {
        self.check(driver)?;
        ensure_context(driver, self.context_device())?;
        let prop = self.raw();
        let flag = match which {
            Granularity::Minimum => G::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            Granularity::Recommended => G::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        };
        let mut g = 0usize;
        // SAFETY: valid out-pointer and property block.
        unsafe { cu!(driver, cuMemGetAllocationGranularity(&mut g, &prop, flag)) }?;
        if g == 0 {
            return Err(Error::invalid(
                "spec",
                "the driver reported a granularity of 0 for this spec",
            ));
        }
        Ok(g)
    }
}

/// Builds a [`PhysicalAllocation`]: location, handle types, RDMA flag and a rounding policy.
#[derive(Debug, Clone)]
pub struct AllocationBuilder {
    driver: Driver,
    spec: AllocationSpec,
    rounding: Rounding,
}

impl AllocationBuilder {
    /// Shareable handle types (fixed for the allocation's life).
    pub fn handle_types(mut self, t: HandleTypes) -> Self {
        self.spec.handle_types = t;
        self
    }

    /// Request GPUDirect-RDMA-capable memory.
    pub fn gpu_direct_rdma(mut self, on: bool) -> Self {
        self.spec.gpu_direct_rdma = on;
        self
    }

    /// How sizes that are not granularity multiples are treated (default: round up to the
    /// minimum granularity).
    pub fn rounding(mut self, r: Rounding) -> Self {
        self.rounding = r;
        self
    }

    /// The spec so far.
    pub fn spec(&self) -> &AllocationSpec {
        &self.spec
    }

    /// The size `create(size)` would allocate.
    pub fn rounded_size(&self, size: usize) -> Result<usize> {
        Ok(self.rounded(size)?.0)
    }

    /// The rounded size and the minimum granularity.
    fn rounded(&self, size: usize) -> Result<(usize, usize)> {
        if size == 0 {
            return Err(Error::invalid("size", "0 bytes; expected at least 1"));
        }
        let (which, round) = match self.rounding {
            Rounding::Exact => (Granularity::Minimum, false),
            Rounding::UpToMinimum => (Granularity::Minimum, true),
            Rounding::UpToRecommended => (Granularity::Recommended, true),
        };
        let g = self.spec.granularity(&self.driver, which)?;
        let min = match which {
            Granularity::Minimum => g,
            Granularity::Recommended => {
                self.spec.granularity(&self.driver, Granularity::Minimum)?
            }
        };
        if size % g == 0 {
            return Ok((size, min));
        }
        if !round {
            return Err(Error::invalid(
                "size",
                format!("{size} bytes is not a multiple of the allocation granularity {g}"),
            ));
        }
        size.checked_next_multiple_of(g)
            .map(|s| (s, min))
            .ok_or_else(|| {
                Error::invalid(
                    "size",
                    format!("{size} bytes overflows when rounded to {g}"),
                )
            })
    }

    /// Allocate `size` bytes (`cuMemCreate`), rounded as the policy says.
    pub fn create(&self, size: usize) -> Result<Arc<PhysicalAllocation>> {
        let (size, granularity) = self.rounded(size)?;
        let prop = self.spec.raw();
        let mut h: CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and property block; flags must be 0.
        unsafe { cu!(self.driver, cuMemCreate(&mut h, size, &prop, 0)) }?;
        Ok(Arc::new(PhysicalAllocation {
            driver: self.driver.clone(),
            handle: h,
            size,
            spec: self.spec,
            granularity,
        }))
    }
}

/// A physical memory allocation (a `CUmemGenericAllocationHandle`). Released with `cuMemRelease`
/// when dropped; the memory itself goes when its last [`super::Mapping`] goes too (mappings hold
/// an `Arc` of it). Created with [`PhysicalAllocation::builder`] or imported from a shareable
/// handle.
pub struct PhysicalAllocation {
    driver: Driver,
    handle: CUmemGenericAllocationHandle,
    size: usize,
    spec: AllocationSpec,
    /// Minimum granularity, asked once.
    granularity: usize,
}

impl std::fmt::Debug for PhysicalAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PhysicalAllocation")
            .field("handle", &format_args!("{:#x}", self.handle))
            .field("size", &self.size)
            .field("spec", &self.spec)
            .finish()
    }
}

impl PhysicalAllocation {
    /// A builder for memory at `location`.
    pub fn builder(driver: &Driver, location: Location) -> AllocationBuilder {
        AllocationBuilder {
            driver: driver.clone(),
            spec: AllocationSpec {
                location,
                handle_types: HandleTypes::NONE,
                gpu_direct_rdma: false,
            },
            rounding: Rounding::default(),
        }
    }

    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> CUmemGenericAllocationHandle {
        self.handle
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// What it was created with (for an imported allocation: what the driver reports).
    pub fn spec(&self) -> &AllocationSpec {
        &self.spec
    }

    /// The driver.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    /// The minimum granularity of this allocation: offsets and sizes of mappings are multiples
    /// of it (asked of the driver once, when the allocation was made or imported).
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// Export as a POSIX file descriptor (needs [`HandleTypes::posix_fd`] at creation). Another
    /// process imports it with [`PhysicalAllocation::import_posix_fd`].
    pub fn export_posix_fd(&self) -> Result<OwnedFd> {
        if !self.spec.handle_types.posix_fd {
            return Err(Error::invalid(
                "handle_types",
                "the allocation was created without the POSIX-fd handle type; choose it at creation",
            ));
        }
        super::share::export_posix_fd(&self.driver, self.handle)
    }

    /// Export as a fabric handle (needs [`HandleTypes::fabric`] at creation).
    pub fn export_fabric(&self) -> Result<FabricHandle> {
        if !self.spec.handle_types.fabric {
            return Err(Error::invalid(
                "handle_types",
                "the allocation was created without the fabric handle type; choose it at creation",
            ));
        }
        super::share::export_fabric(&self.driver, self.handle)
    }

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
        let h = super::share::import_posix_fd(driver, fd)?;
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
        let h = super::share::import_fabric(driver, &handle)?;
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
        let r = super::Reservation::new(driver, size).map_err(|e| match e {
            Error::Driver { .. } => Error::invalid(
                "size",
                format!("{size} bytes cannot be reserved to check the claim ({e})"),
            ),
            e => e,
        })?;
        let m = super::Mapping::new(&r, 0, &a, 0, size).map_err(|e| match e {
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

impl Drop for PhysicalAllocation {
    fn drop(&mut self) {
        // SAFETY: we own one reference to the handle; every mapping of it holds an Arc of us, so
        // none is left when this runs (the driver frees the memory now).
        let _ = unsafe { cu!(self.driver, cuMemRelease(self.handle)) };
    }
}

/// A fabric handle: 64 opaque bytes that a process on the same NVLink fabric imports with
/// [`PhysicalAllocation::import_fabric`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FabricHandle(pub [u8; 64]);

impl std::fmt::Debug for FabricHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FabricHandle(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

impl FabricHandle {
    /// The bytes to send to the importer.
    pub fn as_bytes(&self) -> &[u8; 64] {
        &self.0
    }

    /// From received bytes: exactly 64 of them.
    pub fn from_bytes(bytes: &[u8]) -> Result<FabricHandle> {
        let a: [u8; 64] = bytes.try_into().map_err(|_| {
            Error::invalid(
                "bytes",
                format!("{} bytes; a fabric handle is exactly 64", bytes.len()),
            )
        })?;
        Ok(FabricHandle(a))
    }
}
