//! Physical allocations (`cuMemCreate`), their granularity, and their export as shareable
//! handles (imports are in `import.rs`).
// `usize::is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

use std::os::fd::OwnedFd;
use std::sync::Arc;

use cuda_multimem_sys::{
    CUmemAllocationGranularity_flags as G, CUmemAllocationHandleType as HT, CUmemAllocationProp,
    CUmemAllocationType, CUmemGenericAllocationHandle,
};

use super::share::FabricHandle;
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
    pub(super) driver: Driver,
    pub(super) handle: CUmemGenericAllocationHandle,
    pub(super) size: usize,
    pub(super) spec: AllocationSpec,
    /// Minimum granularity, asked once.
    pub(super) granularity: usize,
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
}

impl Drop for PhysicalAllocation {
    fn drop(&mut self) {
        // SAFETY: we own one reference to the handle; every mapping of it holds an Arc of us, so
        // none is left when this runs (the driver frees the memory now).
        let h = self.handle;
        self.driver.teardown(
            || format!("the physical allocation {h:#x} (cuMemRelease)"),
            // SAFETY: as above; a retry releases the same handle once.
            move |d| unsafe { cu!(d, cuMemRelease(h)) },
        );
    }
}
