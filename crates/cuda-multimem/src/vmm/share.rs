//! The four raw shareable-handle calls, shared by physical allocations and multicast objects
//! (both are generic allocation handles to the driver), and the fabric handle they exchange. Callers check handle types, sizes and the
//! multicast guard; these only make the calls and own what comes back.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cuda_multimem_sys::{
    CUmemAllocationHandleType as HT, CUmemFabricHandle, CUmemGenericAllocationHandle,
};

use crate::error::cu;
use crate::{Driver, Error, Result};

/// `cuMemExportToShareableHandle` as a POSIX fd, owned by the caller.
pub(crate) fn export_posix_fd(driver: &Driver, h: CUmemGenericAllocationHandle) -> Result<OwnedFd> {
    let mut fd: libc::c_int = -1;
    // SAFETY: the driver writes one int (the fd) through the pointer; flags must be 0.
    unsafe {
        cu!(
            driver,
            cuMemExportToShareableHandle(
                (&mut fd as *mut libc::c_int).cast(),
                h,
                HT::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0
            )
        )
    }?;
    if fd < 0 {
        return Err(Error::invalid("fd", format!("the driver exported fd {fd}")));
    }
    // SAFETY: the driver gave us a new fd that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuMemExportToShareableHandle` as a fabric handle.
pub(crate) fn export_fabric(
    driver: &Driver,
    h: CUmemGenericAllocationHandle,
) -> Result<FabricHandle> {
    let mut raw = CUmemFabricHandle::default();
    // SAFETY: the driver writes one CUmemFabricHandle through the pointer; flags must be 0.
    unsafe {
        cu!(
            driver,
            cuMemExportToShareableHandle(
                (&mut raw as *mut CUmemFabricHandle).cast(),
                h,
                HT::CU_MEM_HANDLE_TYPE_FABRIC,
                0
            )
        )
    }?;
    Ok(FabricHandle(raw.data))
}

/// `cuMemImportFromShareableHandle` of a POSIX fd (which stays the caller's).
pub(crate) fn import_posix_fd(
    driver: &Driver,
    fd: BorrowedFd<'_>,
) -> Result<CUmemGenericAllocationHandle> {
    let mut h: CUmemGenericAllocationHandle = 0;
    // SAFETY: for POSIX fds the driver takes the fd number cast to a pointer and does not take
    // ownership of it; the out-pointer is valid.
    unsafe {
        cu!(
            driver,
            cuMemImportFromShareableHandle(
                &mut h,
                fd.as_raw_fd() as usize as *mut libc::c_void,
                HT::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            )
        )
    }?;
    Ok(h)
}

/// `cuMemImportFromShareableHandle` of a fabric handle.
pub(crate) fn import_fabric(
    driver: &Driver,
    handle: &FabricHandle,
) -> Result<CUmemGenericAllocationHandle> {
    let mut raw = CUmemFabricHandle { data: handle.0 };
    let mut h: CUmemGenericAllocationHandle = 0;
    // SAFETY: the driver reads one CUmemFabricHandle; the out-pointer is valid.
    unsafe {
        cu!(
            driver,
            cuMemImportFromShareableHandle(
                &mut h,
                (&mut raw as *mut CUmemFabricHandle).cast(),
                HT::CU_MEM_HANDLE_TYPE_FABRIC
            )
        )
    }?;
    Ok(h)
}

/// A fabric handle: 64 opaque bytes that a process on the same NVLink fabric imports with
/// [`PhysicalAllocation::import_fabric`](super::PhysicalAllocation::import_fabric).
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
