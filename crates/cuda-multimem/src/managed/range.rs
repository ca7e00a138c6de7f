//! A view of managed memory that the range operations take.

use cuda_multimem_sys::{CUdeviceptr, CUmem_range_attribute};

use crate::error::{cu, Error, Result};
use crate::Device;

/// A range of managed memory: a start pointer and a non-zero length inside one managed
/// allocation, borrowed for `'a` (from a [`ManagedBuffer`](super::ManagedBuffer), or from managed
/// memory allocated elsewhere through [`ManagedRange::from_raw`]). The free functions of
/// [`managed`](super) take it; it is `Copy`, so pass it by value.
///
/// The device it names is the one whose context the advice and attribute calls run in (any
/// device of the driver serves; managed memory is visible to all).
#[derive(Clone, Copy)]
pub struct ManagedRange<'a> {
    device: &'a Device,
    ptr: CUdeviceptr,
    len: usize,
}

impl std::fmt::Debug for ManagedRange<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ManagedRange({:#x}, {} bytes)", self.ptr, self.len)
    }
}

impl<'a> ManagedRange<'a> {
    /// Borrow `[ptr, ptr + len)` of managed memory allocated elsewhere (a `cuMemAllocManaged`
    /// allocation, a `__managed__` variable). The range is checked: `len` must be non-zero, the
    /// end must not overflow, and the driver must accept it as managed memory (asked through
    /// `cuMemRangeGetAttribute`); anything else is [`Error::InvalidArgument`].
    ///
    /// # Safety
    /// The memory must stay allocated for `'a`, and while a Rust reference to any of its bytes
    /// is alive no discard (which makes the contents indeterminate) may be queued on it through
    /// this range.
    pub unsafe fn from_raw(device: &'a Device, ptr: u64, len: usize) -> Result<Self> {
        let r = ManagedRange::checked(device, ptr, len)?;
        r.check_managed()?;
        Ok(r)
    }

    /// A range with its arithmetic checked but not asked of the driver (for buffers that know
    /// their allocation).
    pub(crate) fn checked(device: &'a Device, ptr: u64, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid(
                "len",
                "a managed range of 0 bytes; expected at least 1 byte",
            ));
        }
        if ptr == 0 {
            return Err(Error::invalid(
                "ptr",
                "a null pointer is not managed memory",
            ));
        }
        if ptr.checked_add(len as u64).is_none() {
            return Err(Error::invalid(
                "len",
                format!("{ptr:#x} + {len} bytes overflows the address space"),
            ));
        }
        Ok(ManagedRange { device, ptr, len })
    }

    /// A range its owner knows to be valid (a buffer's own pointer and non-zero length).
    pub(crate) fn trusted(device: &'a Device, ptr: u64, len: usize) -> Self {
        ManagedRange { device, ptr, len }
    }

    /// Ask the driver whether the whole range is managed memory.
    fn check_managed(&self) -> Result<()> {
        self.device.bind()?;
        let mut v = 0i32;
        // SAFETY: one 4-byte int written through a valid pointer; the range is only queried.
        let r = unsafe {
            cu!(
                self.device.driver(),
                cuMemRangeGetAttribute(
                    (&mut v as *mut i32).cast(),
                    4,
                    CUmem_range_attribute::CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY,
                    self.ptr,
                    self.len
                )
            )
        };
        match r {
            Ok(()) => Ok(()),
            Err(Error::Driver { code, .. })
                if code == cuda_multimem_sys::CUresult::CUDA_ERROR_INVALID_VALUE =>
            {
                Err(Error::invalid(
                    "ptr",
                    format!(
                        "[{:#x}, +{} bytes) is not inside one managed allocation",
                        self.ptr, self.len
                    ),
                ))
            }
            Err(e) => Err(e),
        }
    }

    /// The start address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The length in bytes (never 0).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: a managed range has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The device whose context the range's calls use.
    pub fn device(&self) -> &'a Device {
        self.device
    }

    /// The part `[offset, offset + len)` of this range; a part that is empty or reaches past
    /// the end is [`Error::InvalidArgument`].
    pub fn subrange(&self, offset: usize, len: usize) -> Result<ManagedRange<'a>> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len && len > 0 => Ok(ManagedRange {
                device: self.device,
                ptr: self.ptr + offset as u64,
                len,
            }),
            _ if len == 0 => Err(Error::invalid(
                "len",
                "a managed range of 0 bytes; expected at least 1 byte",
            )),
            // the offset alone past the end names it; else the length reaches too far
            _ => Err(Error::invalid(
                if offset >= self.len { "offset" } else { "len" },
                format!(
                    "[{offset}, {offset} + {len}) reaches past the end of a {}-byte range",
                    self.len
                ),
            )),
        }
    }
}
