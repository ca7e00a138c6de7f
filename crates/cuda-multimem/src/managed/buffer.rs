//! A typed owner of managed memory whose methods delegate to the free functions.

use std::collections::BTreeSet;

use cuda_multimem_sys::{CUdeviceptr, CUmemAttach_flags};

use super::{Location, ManagedRange};
use crate::error::{cu, Error, Result};
use crate::{Device, Stream};

/// How a new managed allocation is attached (`cuMemAllocManaged`'s flags).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Attach {
    /// Accessible from any stream on any device (`CU_MEM_ATTACH_GLOBAL`).
    #[default]
    Global,
    /// Not to be accessed by devices without concurrent managed access until attached to a
    /// stream (`CU_MEM_ATTACH_HOST`).
    Host,
}

/// Managed memory of `len` bytes: a `cuMemAllocManaged` allocation it owns (freed on drop), or
/// managed memory allocated elsewhere that it wraps without owning
/// ([`ManagedBuffer::from_raw_parts`]).
///
/// Its methods are thin: each delegates to the free function of the same name in
/// [`managed`](super) with [`ManagedBuffer::range`]. Use [`ManagedBuffer::subrange`] to operate
/// on a part.
pub struct ManagedBuffer {
    device: Device,
    ptr: CUdeviceptr,
    len: usize,
    owned: bool,
}

impl std::fmt::Debug for ManagedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManagedBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("owned", &self.owned)
            .finish()
    }
}

impl ManagedBuffer {
    /// Allocate `len` bytes of managed memory, attached globally, in `device`'s context.
    pub fn new(device: &Device, len: usize) -> Result<ManagedBuffer> {
        ManagedBuffer::with_attach(device, len, Attach::Global)
    }

    /// Allocate `len` bytes of managed memory with the given attachment. The contents are not
    /// cleared.
    pub fn with_attach(device: &Device, len: usize, attach: Attach) -> Result<ManagedBuffer> {
        if len == 0 {
            return Err(Error::invalid(
                "len",
                "a managed allocation of 0 bytes; expected at least 1 byte",
            ));
        }
        let flags = match attach {
            Attach::Global => CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL,
            Attach::Host => CUmemAttach_flags::CU_MEM_ATTACH_HOST,
        };
        device.bind()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: one pointer written through a valid out-pointer; flags are one of the two
        // documented values; a context is current.
        unsafe { cu!(device.driver(), cuMemAllocManaged(&mut ptr, len, flags.0)) }?;
        Ok(ManagedBuffer {
            device: device.clone(),
            ptr,
            len,
            owned: true,
        })
    }

    /// Wrap `[ptr, ptr + len)` of managed memory allocated elsewhere, without owning it (it is
    /// not freed on drop). The range is validated as [`ManagedRange::from_raw`] does.
    ///
    /// # Safety
    /// The memory must stay allocated while the buffer lives, and nothing else may write it
    /// while a slice from [`ManagedBuffer::host_slice_mut`] or [`ManagedBuffer::host_slice`] is
    /// alive.
    pub unsafe fn from_raw_parts(device: &Device, ptr: u64, len: usize) -> Result<ManagedBuffer> {
        // SAFETY: the caller's promise covers the borrow made here.
        unsafe { ManagedRange::from_raw(device, ptr, len) }?;
        Ok(ManagedBuffer {
            device: device.clone(),
            ptr,
            len,
            owned: false,
        })
    }

    /// The start address (valid on the host and on every device).
    pub fn as_ptr(&self) -> u64 {
        self.ptr
    }

    /// The length in bytes (never 0).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: a managed buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether dropping the buffer frees the memory.
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    /// The device in whose context it was allocated (or wrapped).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The whole buffer as a range for the free functions.
    pub fn range(&self) -> ManagedRange<'_> {
        // The buffer's own pointer and length, checked (non-zero, no overflow) when it was made.
        ManagedRange::trusted(&self.device, self.ptr, self.len)
    }

    /// The part `[offset, offset + len)`; empty parts and parts past the end are
    /// [`Error::InvalidArgument`].
    pub fn subrange(&self, offset: usize, len: usize) -> Result<ManagedRange<'_>> {
        self.range().subrange(offset, len)
    }

    /// See [`super::read_mostly`].
    pub fn read_mostly(&self) -> Result<bool> {
        super::read_mostly(self.range())
    }
    /// See [`super::set_read_mostly`].
    pub fn set_read_mostly(&self, on: bool) -> Result<()> {
        super::set_read_mostly(self.range(), on)
    }
    /// See [`super::preferred_location`].
    pub fn preferred_location(&self) -> Result<Option<Location>> {
        super::preferred_location(self.range())
    }
    /// See [`super::set_preferred_location`].
    pub fn set_preferred_location(&self, location: Location) -> Result<()> {
        super::set_preferred_location(self.range(), location)
    }
    /// See [`super::unset_preferred_location`].
    pub fn unset_preferred_location(&self) -> Result<()> {
        super::unset_preferred_location(self.range())
    }
    /// See [`super::last_prefetch_location`].
    pub fn last_prefetch_location(&self) -> Result<Option<Location>> {
        super::last_prefetch_location(self.range())
    }
    /// See [`super::accessed_by`].
    pub fn accessed_by(&self) -> Result<BTreeSet<Location>> {
        super::accessed_by(self.range())
    }
    /// See [`super::add_accessed_by`].
    pub fn add_accessed_by(&self, location: Location) -> Result<()> {
        super::add_accessed_by(self.range(), location)
    }
    /// See [`super::remove_accessed_by`].
    pub fn remove_accessed_by(&self, location: Location) -> Result<()> {
        super::remove_accessed_by(self.range(), location)
    }
    /// See [`super::set_accessed_by`].
    pub fn set_accessed_by(&self, locations: impl IntoIterator<Item = Location>) -> Result<()> {
        super::set_accessed_by(self.range(), locations)
    }
    /// See [`super::prefetch`].
    pub fn prefetch(&self, location: Location, stream: &Stream) -> Result<()> {
        super::prefetch(self.range(), location, stream)
    }
    /// See [`super::discard`].
    pub fn discard(&self, stream: &Stream) -> Result<()> {
        super::discard(self.range(), stream)
    }
    /// See [`super::discard_and_prefetch`].
    pub fn discard_and_prefetch(&self, location: Location, stream: &Stream) -> Result<()> {
        super::discard_and_prefetch(self.range(), location, stream)
    }

    /// Wait for all work queued on every device of the driver whose primary context is active
    /// (work can be queued nowhere else), so no range operation or copy is still pending on
    /// this memory. Devices without an active context are left alone (no context is created).
    fn quiesce(&self) -> Result<()> {
        for d in self.device.driver().devices() {
            let (mut flags, mut active) = (0u32, 0i32);
            // SAFETY: two plain values written through valid pointers.
            unsafe {
                cu!(
                    d.driver(),
                    cuDevicePrimaryCtxGetState(d.ordinal(), &mut flags, &mut active)
                )
            }?;
            if active == 0 {
                continue;
            }
            d.bind()?;
            // SAFETY: a context is current; the call only waits.
            unsafe { cu!(d.driver(), cuCtxSynchronize_v2000()) }?;
        }
        self.device.bind()
    }

    fn check_host_access(&self) -> Result<()> {
        if !self.device.concurrent_managed_access()? {
            return Err(Error::DeviceUnsupported {
                device: self.device.ordinal(),
                what: "concurrent managed access (host access to managed memory)",
            });
        }
        Ok(())
    }

    /// The contents, read on the host. Needs a device with concurrent managed access
    /// ([`Error::DeviceUnsupported`] otherwise); waits first for all queued work of the driver's
    /// devices, and borrows the buffer exclusively so no range operation can be queued on it
    /// while the slice lives. Reading migrates pages to the host on demand.
    pub fn host_slice(&mut self) -> Result<&[u8]> {
        self.check_host_access()?;
        self.quiesce()?;
        // SAFETY: `ptr..ptr+len` is a live managed allocation, host-accessible on a device with
        // concurrent managed access; queued work has finished and `&mut self` keeps this
        // buffer's ranges from queuing more while the slice lives.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) })
    }

    /// The contents, writable on the host; as [`ManagedBuffer::host_slice`].
    pub fn host_slice_mut(&mut self) -> Result<&mut [u8]> {
        self.check_host_access()?;
        self.quiesce()?;
        // SAFETY: as in `host_slice`, and the borrow is exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) })
    }

    /// The part a copy of `len` bytes at `offset` touches: `None` for a zero-length copy, an Ok
    /// no-op whose offset is still checked (at most the buffer's length).
    fn copy_range(
        &self,
        offset: usize,
        len: usize,
        len_arg: &'static str,
    ) -> Result<Option<ManagedRange<'_>>> {
        if len == 0 {
            if offset > self.len {
                return Err(Error::invalid(
                    "offset",
                    format!("{offset} is past the end of a {}-byte buffer", self.len),
                ));
            }
            return Ok(None);
        }
        // the host slice's length is the caller's `src` or `dst`
        self.subrange(offset, len).map(Some).map_err(|e| match e {
            Error::InvalidArgument { arg: "len", reason } => Error::InvalidArgument {
                arg: len_arg,
                reason,
            },
            e => e,
        })
    }

    /// Copy `src` into the buffer at `offset` (`cuMemcpyHtoD`; works on every device). A
    /// zero-length copy is an Ok no-op (the offset is still checked).
    pub fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        let Some(dst) = self.copy_range(offset, src.len(), "src")? else {
            return Ok(());
        };
        self.device.bind()?;
        // SAFETY: `dst` lies inside this buffer; `src` is valid for `src.len()` bytes.
        unsafe {
            cu!(
                self.device.driver(),
                cuMemcpyHtoD(dst.ptr(), src.as_ptr().cast(), src.len())
            )
        }
    }

    /// Copy `dst.len()` bytes from the buffer at `offset` into `dst` (`cuMemcpyDtoH`). A
    /// zero-length copy is an Ok no-op (the offset is still checked).
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let Some(src) = self.copy_range(offset, dst.len(), "dst")? else {
            return Ok(());
        };
        self.device.bind()?;
        // SAFETY: `src` lies inside this buffer; `dst` is valid for `dst.len()` writable bytes.
        unsafe {
            cu!(
                self.device.driver(),
                cuMemcpyDtoH(dst.as_mut_ptr().cast(), src.ptr(), dst.len())
            )
        }
    }
}

impl Drop for ManagedBuffer {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let (ptr, ordinal) = (self.ptr, self.device.ordinal());
        self.device.driver().teardown(
            || format!("the managed memory {ptr:#x} (cuMemFree)"),
            move |d| {
                d.bind(ordinal)?;
                // SAFETY: we own the allocation; no borrow of it outlives `self`.
                unsafe { cu!(d, cuMemFree(ptr)) }
            },
        );
    }
}
