//! Virtual memory management: physical allocations, address reservations, mappings, access per
//! device, shareable handles (POSIX fds and fabric handles), and a growable buffer.
//!
//! The pieces follow the driver's model (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`,
//! `cuMemSetAccess`), and ownership enforces its teardown order: a [`Mapping`] holds an `Arc` of
//! the [`PhysicalAllocation`] and of the [`Reservation`] it joins, so neither can be released
//! while it is mapped. When the last owner of each goes, `cuMemUnmap`, `cuMemAddressFree` and
//! `cuMemRelease` run, and the device memory is free again (`cuMemGetInfo` shows it).
//!
//! ```
//! use cuda_multimem::vmm::{
//!     Access, HandleTypes, Location, Mapping, PhysicalAllocation, Reservation, VmmBuffer,
//! };
//! use cuda_multimem::Driver;
//!
//! let driver = cuda_multimem_sim::driver_from_selection("sim:devices=2,version=13000")?; // or Driver::load()
//! // Physical memory on device 0, exportable to other processes as a POSIX fd.
//! let alloc = PhysicalAllocation::builder(&driver, Location::Device(0))
//!     .handle_types(HandleTypes::POSIX_FD)
//!     .create(3 << 20)?; // rounded up to the granularity (2 MiB here): 4 MiB
//! assert_eq!(alloc.size(), 4 << 20);
//! // Reserve, map, grant access: device 0 reads and writes, device 1 (a peer) reads.
//! let range = Reservation::new(&driver, alloc.size())?;
//! let mapping = Mapping::new(&range, 0, &alloc, 0, alloc.size())?;
//! mapping.set_access(&[
//!     (Location::Device(0), Access::ReadWrite),
//!     (Location::Device(1), Access::ReadOnly),
//! ])?;
//! let fd = alloc.export_posix_fd()?; // send it to another process (SCM_RIGHTS)
//! drop((alloc, range)); // the mapping keeps both alive ...
//! assert_eq!(mapping.access(Location::Device(1))?, Access::ReadOnly);
//! drop(mapping); // ... until now: unmap, free the range, release the memory
//! # drop(fd);
//!
//! // A buffer that grows and keeps its contents.
//! let builder = PhysicalAllocation::builder(&driver, Location::Device(0));
//! let mut buf = VmmBuffer::new(builder, 2 << 20, &[])?;
//! let stayed = buf.grow(8 << 20)?;
//! println!("{:#x}, {} bytes, same address: {stayed}", buf.device_ptr(), buf.size());
//! # Ok::<(), cuda_multimem::Error>(())
//! ```
//!
//! Rules the types check before any driver call: sizes and offsets are multiples of the
//! allocation's minimum granularity ([`PhysicalAllocation::granularity`]) and lie inside the
//! allocation and the reservation; devices exist; host allocations have no shareable handle
//! types; imported handles and their claimed sizes are untrusted (see
//! [`PhysicalAllocation::import_posix_fd`]). Everything else the driver checks, and its status
//! comes back as [`Error::Driver`] naming the call.

// `usize::is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

mod allocation;
mod buffer;
mod import;
mod mapping;
mod reservation;
pub(crate) mod share;

pub use allocation::{
    AllocationBuilder, AllocationSpec, Granularity, HandleTypes, PhysicalAllocation, Rounding,
};
pub use buffer::VmmBuffer;
pub use mapping::{Access, Mapping};
pub use reservation::{Reservation, ReservationBuilder};
pub use share::FabricHandle;

use cuda_multimem_sys::{CUmemLocation, CUmemLocationType};

use crate::{Driver, Error, Result};

/// Where physical memory lives, or who accesses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Location {
    /// A device, by ordinal.
    Device(i32),
    /// Host memory (any NUMA node); drivers from 12.6 with host VMM support.
    Host,
    /// Host memory on a NUMA node, by id.
    HostNuma(i32),
}

impl Location {
    /// The driver's location struct.
    pub fn raw(self) -> CUmemLocation {
        let mut l = CUmemLocation::default();
        let (t, id) = match self {
            Location::Device(d) => (CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, d),
            Location::Host => (CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, 0),
            Location::HostNuma(n) => (CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA, n),
        };
        l.type_ = t;
        l.__bindgen_anon_1.id = id;
        l
    }

    /// From the driver's location struct (`None` for types other than device, host, host NUMA).
    pub fn from_raw(l: &CUmemLocation) -> Option<Location> {
        // SAFETY: `id` is the union member for device, host and host-NUMA locations; reading an
        // int is valid for any bit pattern.
        let id = unsafe { l.__bindgen_anon_1.id };
        match l.type_ {
            CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE => Some(Location::Device(id)),
            CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST => Some(Location::Host),
            CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA => Some(Location::HostNuma(id)),
            _ => None,
        }
    }

    /// Check a location against the driver: devices must exist, NUMA ids be non-negative.
    pub(crate) fn validate(self, driver: &Driver, arg: &'static str) -> Result<()> {
        match self {
            Location::Device(d) if d < 0 || d as usize >= driver.device_count() => {
                Err(Error::invalid(
                    arg,
                    format!(
                        "device {d} does not exist; this machine has {} device(s)",
                        driver.device_count()
                    ),
                ))
            }
            Location::HostNuma(n) if n < 0 => Err(Error::invalid(
                arg,
                format!("host NUMA node {n} is negative; expected a node id >= 0"),
            )),
            _ => Ok(()),
        }
    }
}

/// Make sure some context is current on this thread (the VMM calls need an initialised driver
/// and, on some drivers, a context): keeps the caller's current context if there is one, else
/// makes device `dev`'s primary context current.
pub(crate) fn ensure_context(driver: &Driver, dev: i32) -> Result<()> {
    let mut ctx: cuda_multimem_sys::CUcontext = std::ptr::null_mut();
    // SAFETY: one pointer written through a valid out-pointer.
    unsafe { crate::error::cu!(driver, cuCtxGetCurrent(&mut ctx)) }?;
    if ctx.is_null() {
        driver.device(dev.max(0) as usize)?.bind()?;
    }
    Ok(())
}

/// The host's page size.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

// Other layers (multicast, endpoints, teams, the allreduce) share these across threads.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<PhysicalAllocation>();
    send_sync::<Reservation>();
    send_sync::<Mapping>();
    send_sync::<VmmBuffer>();
    send_sync::<AllocationBuilder>();
};
