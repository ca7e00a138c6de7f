//! Operands of a collective: views of symmetric buffers, or the caller's own device memory
//! (a [`DeviceBuffer`], a cudarc slice, or — under `unsafe` — a raw pointer and length).

use std::marker::PhantomData;

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{Device, DeviceBuffer, DeviceRepr};

use crate::memory::{SymBuf, SymSlice, SymSliceMut, SymmetricBuffer};

/// Where an operand lives.
#[derive(Clone, Copy)]
pub(crate) enum Place<'a> {
    /// A symmetric buffer, from byte `offset`; `only`: the one rank whose calls may use it.
    Sym {
        buf: &'a SymBuf,
        offset: usize,
        only: Option<usize>,
    },
    /// The caller's memory at `ptr` (of `device`, when known).
    Local {
        ptr: CUdeviceptr,
        device: Option<&'a Device>,
    },
}

/// An operand: a place and a length in bytes.
#[derive(Clone, Copy)]
pub(crate) struct Operand<'a> {
    pub(crate) place: Place<'a>,
    pub(crate) bytes: usize,
}

impl Operand<'_> {
    pub(crate) fn is_sym(&self) -> bool {
        matches!(self.place, Place::Sym { .. })
    }

    /// The same operand from byte `at`, `bytes` long (callers keep `at + bytes` inside).
    pub(crate) fn sub(&self, at: usize, bytes: usize) -> Self {
        let place = match self.place {
            Place::Sym { buf, offset, only } => Place::Sym {
                buf,
                offset: offset + at,
                only,
            },
            Place::Local { ptr, device } => Place::Local {
                ptr: ptr + at as u64,
                device,
            },
        };
        Operand { place, bytes }
    }
}

fn sym<'a, T>(buf: &'a SymBuf, offset: usize, len: usize, only: Option<usize>) -> Operand<'a> {
    let es = std::mem::size_of::<T>();
    // Views are made in bounds of their buffer, whose byte size fits usize.
    Operand {
        place: Place::Sym {
            buf,
            offset: offset * es,
            only,
        },
        bytes: len * es,
    }
}

fn local<'a, T>(ptr: CUdeviceptr, len: usize, device: Option<&'a Device>) -> Operand<'a> {
    Operand {
        place: Place::Local { ptr, device },
        bytes: len * std::mem::size_of::<T>(),
    }
}

/// The input of a collective, read only. Made from a [`SymmetricBuffer`] (`&buf`), a
/// [`SymSlice`], a [`DeviceBuffer`] (`&buf`), or [`Src::from_raw`].
pub struct Src<'a, T> {
    pub(crate) op: Operand<'a>,
    pub(crate) len: usize,
    _t: PhantomData<&'a [T]>,
}

/// The output of a collective, written. Made from a [`SymmetricBuffer`] (`&mut buf`), a
/// [`SymSliceMut`], a [`DeviceBuffer`] (`&mut buf`), or [`Dst::from_raw`]. In-place calls take
/// one `Dst` as both operands.
pub struct Dst<'a, T> {
    pub(crate) op: Operand<'a>,
    pub(crate) len: usize,
    _t: PhantomData<&'a mut [T]>,
}

impl<T> std::fmt::Debug for Src<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Src({} elements)", self.len)
    }
}

impl<T> std::fmt::Debug for Dst<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Dst({} elements)", self.len)
    }
}

impl<T: DeviceRepr> Src<'_, T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` elements of the caller's device memory at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be device memory of the device of the rank it is passed to (or memory that
    /// device can read), valid for `len` elements of `T` until the work queued with it on the
    /// call's stream has completed, and not written by anything else meanwhile. The byte length
    /// and the alignment are still checked by the call.
    pub unsafe fn from_raw(ptr: CUdeviceptr, len: usize) -> Src<'static, T> {
        Src {
            op: Operand {
                place: Place::Local { ptr, device: None },
                bytes: len.saturating_mul(std::mem::size_of::<T>()),
            },
            len,
            _t: PhantomData,
        }
    }
}

impl<T: DeviceRepr> Dst<'_, T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` elements of the caller's device memory at `ptr`, written by the call.
    ///
    /// # Safety
    /// As [`Src::from_raw`], and nothing else may read or write the range until the work queued
    /// with it has completed.
    pub unsafe fn from_raw(ptr: CUdeviceptr, len: usize) -> Dst<'static, T> {
        Dst {
            op: Operand {
                place: Place::Local { ptr, device: None },
                bytes: len.saturating_mul(std::mem::size_of::<T>()),
            },
            len,
            _t: PhantomData,
        }
    }
}

impl<'a, T: DeviceRepr> From<&'a SymmetricBuffer<T>> for Src<'a, T> {
    fn from(b: &'a SymmetricBuffer<T>) -> Self {
        b.as_slice().into()
    }
}

impl<'a, T: DeviceRepr> From<SymSlice<'a, T>> for Src<'a, T> {
    fn from(s: SymSlice<'a, T>) -> Self {
        Src {
            op: sym::<T>(s.buf, s.offset, s.len, s.only),
            len: s.len,
            _t: PhantomData,
        }
    }
}

impl<'a, T: DeviceRepr> From<&'a SymSliceMut<'_, T>> for Src<'a, T> {
    fn from(s: &'a SymSliceMut<'_, T>) -> Self {
        Src {
            op: sym::<T>(s.buf, s.offset, s.len, s.only),
            len: s.len,
            _t: PhantomData,
        }
    }
}

impl<'a, T: DeviceRepr> From<&'a DeviceBuffer<T>> for Src<'a, T> {
    fn from(b: &'a DeviceBuffer<T>) -> Self {
        Src {
            op: local::<T>(b.device_ptr(), b.len(), Some(b.device())),
            len: b.len(),
            _t: PhantomData,
        }
    }
}

impl<'a, T: DeviceRepr> From<&'a mut SymmetricBuffer<T>> for Dst<'a, T> {
    fn from(b: &'a mut SymmetricBuffer<T>) -> Self {
        b.as_mut_slice().into()
    }
}

impl<'a, T: DeviceRepr> From<SymSliceMut<'a, T>> for Dst<'a, T> {
    fn from(s: SymSliceMut<'a, T>) -> Self {
        Dst {
            op: sym::<T>(s.buf, s.offset, s.len, s.only),
            len: s.len,
            _t: PhantomData,
        }
    }
}

impl<'a, 'b, T: DeviceRepr> From<&'a mut SymSliceMut<'b, T>> for Dst<'a, T> {
    fn from(s: &'a mut SymSliceMut<'b, T>) -> Self {
        Dst {
            op: sym::<T>(s.buf, s.offset, s.len, s.only),
            len: s.len,
            _t: PhantomData,
        }
    }
}

impl<'a, T: DeviceRepr> From<&'a mut DeviceBuffer<T>> for Dst<'a, T> {
    fn from(b: &'a mut DeviceBuffer<T>) -> Self {
        Dst {
            op: local::<T>(b.device_ptr(), b.len(), Some(b.device())),
            len: b.len(),
            _t: PhantomData,
        }
    }
}

/// cudarc operands (feature `cudarc`): the pointer of a cudarc slice is taken against the
/// call's cudarc stream, so cudarc's own event tracking orders our kernels after earlier writes.
#[cfg(feature = "cudarc")]
pub(crate) fn cudarc_src<'a, T>(ptr: CUdeviceptr, len: usize, device: &'a Device) -> Src<'a, T> {
    Src {
        op: local::<T>(ptr, len, Some(device)),
        len,
        _t: PhantomData,
    }
}

/// Refuse a cudarc slice (`arg`) that does not live in `device`'s primary context: its pointer
/// would reach another device's memory, or none, from this rank's kernels.
#[cfg(feature = "cudarc")]
pub(crate) fn check_cudarc<T, S: cudarc::driver::DeviceSlice<T> + ?Sized>(
    slice: &S,
    device: &Device,
    arg: &'static str,
) -> cuda_multimem::Result<()> {
    let ctx = slice.stream().context();
    let theirs = ctx.cu_ctx();
    let ours = device.primary_context()?;
    if ctx.ordinal() != device.ordinal() as usize
        || !std::ptr::eq(theirs.cast::<std::ffi::c_void>(), ours.cast())
    {
        return Err(cuda_multimem::Error::invalid(
            arg,
            format!(
                "a cudarc slice of device {} (context {theirs:p}); expected device {}'s primary context {ours:p}",
                ctx.ordinal(),
                device.ordinal()
            ),
        ));
    }
    Ok(())
}

#[cfg(feature = "cudarc")]
pub(crate) fn cudarc_dst<'a, T>(ptr: CUdeviceptr, len: usize, device: &'a Device) -> Dst<'a, T> {
    Dst {
        op: local::<T>(ptr, len, Some(device)),
        len,
        _t: PhantomData,
    }
}

/// A byte view of an operand the crate resolved itself (the hierarchical collectives hand
/// sub-ranges of their operands to the domain's communicator this way).
pub(crate) fn bytes_dst(op: Operand<'_>) -> Dst<'_, u8> {
    Dst {
        op,
        len: op.bytes,
        _t: PhantomData,
    }
}

/// A typed input view of an operand the crate resolved itself (`op.bytes` a whole number of
/// `T`: the hierarchical collectives hand blocks of their operands and of their scratch to the
/// domain's reduce-scatter and all-gather this way).
pub(crate) fn typed_src<T>(op: Operand<'_>) -> Src<'_, T> {
    Src {
        op,
        len: op.bytes / std::mem::size_of::<T>(),
        _t: PhantomData,
    }
}

/// A typed output view of an operand the crate resolved itself (as [`typed_src`]).
pub(crate) fn typed_dst<T>(op: Operand<'_>) -> Dst<'_, T> {
    Dst {
        op,
        len: op.bytes / std::mem::size_of::<T>(),
        _t: PhantomData,
    }
}

/// The argument names of an out-of-place call's operands (for errors), and of an in-place
/// call's one operand.
pub(crate) const OUT_OF_PLACE: [&str; 2] = ["input", "output"];
pub(crate) const IN_PLACE: [&str; 2] = ["buf", "buf"];
