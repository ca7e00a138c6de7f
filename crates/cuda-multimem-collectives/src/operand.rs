//! Operands of a collective: views of symmetric buffers, or the caller's own device memory
//! (a [`DeviceBuffer`], a cudarc slice, or — under `unsafe` — a raw pointer and length); and
//! [`resolve`], the one place an operand becomes a device address, with every check.

use std::marker::PhantomData;

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{Device, DeviceBuffer, DeviceRepr, Error, Result};

use crate::buffer::{SymBuf, SymSlice, SymSliceMut, SymmetricBuffer};

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

/// An operand: a place and a length of `len` elements of `elem` bytes. The byte length is
/// computed, overflow-checked, by [`resolve`] only.
#[derive(Clone, Copy)]
pub(crate) struct Operand<'a> {
    pub(crate) place: Place<'a>,
    pub(crate) len: usize,
    pub(crate) elem: usize,
}

impl<'a> Operand<'a> {
    /// A byte view (`bytes` bytes at `place`): what the crate makes of operands it resolved
    /// itself (the hierarchical steps hand sub-ranges of checked operands on this way).
    pub(crate) fn bytes_at(place: Place<'a>, bytes: usize) -> Self {
        Operand {
            place,
            len: bytes,
            elem: 1,
        }
    }

    /// The caller's memory of this process's `device` at `ptr`, `bytes` long.
    pub(crate) fn local_bytes(ptr: CUdeviceptr, bytes: usize, device: &'a Device) -> Self {
        Operand::bytes_at(
            Place::Local {
                ptr,
                device: Some(device),
            },
            bytes,
        )
    }

    /// Whether it is a view of a symmetric buffer.
    pub(crate) fn is_sym(&self) -> bool {
        matches!(self.place, Place::Sym { .. })
    }

    /// The byte length, if it fits `usize`.
    pub(crate) fn bytes(&self) -> Option<usize> {
        self.len.checked_mul(self.elem)
    }

    /// The bytes `[at, at + bytes)` of this operand as a byte view (callers keep the range
    /// inside an operand they resolved: the sum cannot overflow then).
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
        Operand::bytes_at(place, bytes)
    }

    fn of<T>(place: Place<'a>, len: usize) -> Self {
        Operand {
            place,
            len,
            elem: std::mem::size_of::<T>(),
        }
    }

    fn sym<T>(buf: &'a SymBuf, offset: usize, len: usize, only: Option<usize>) -> Self {
        // Views are made in bounds of their buffer, whose byte size fits usize.
        Operand::of::<T>(
            Place::Sym {
                buf,
                offset: offset * std::mem::size_of::<T>(),
                only,
            },
            len,
        )
    }

    fn local<T>(ptr: CUdeviceptr, len: usize, device: Option<&'a Device>) -> Self {
        Operand::of::<T>(Place::Local { ptr, device }, len)
    }
}

/// Who an operand is checked against: the communicator whose symmetric buffers are accepted
/// (`None`: none are), the rank making the call, and its device.
#[derive(Clone, Copy)]
pub(crate) struct Owner<'a> {
    pub(crate) comm: Option<u64>,
    pub(crate) rank: usize,
    pub(crate) device: &'a Device,
}

/// An operand resolved for one rank: its address on that rank's device, its byte length, and
/// its symmetric buffer and byte offset when it is one.
#[derive(Clone, Copy)]
pub(crate) struct Resolved<'a> {
    pub(crate) ptr: CUdeviceptr,
    pub(crate) bytes: usize,
    pub(crate) sym: Option<(&'a SymBuf, usize)>,
}

impl<'a> Resolved<'a> {
    /// Whether it is a view of a symmetric buffer.
    pub(crate) fn is_sym(&self) -> bool {
        self.sym.is_some()
    }

    /// The bytes `[at, at + bytes)` (callers keep them inside).
    pub(crate) fn sub(&self, at: usize, bytes: usize) -> Self {
        Resolved {
            ptr: self.ptr + at as u64,
            bytes,
            sym: self.sym.map(|(b, off)| (b, off + at)),
        }
    }

    /// Whether the byte ranges of `self` and `other` overlap (empty ranges overlap nothing).
    pub(crate) fn overlaps(&self, other: &Resolved<'_>) -> bool {
        let (a, b) = (self.ptr as u128, other.ptr as u128);
        self.bytes > 0
            && other.bytes > 0
            && a < b + other.bytes as u128
            && b < a + self.bytes as u128
    }
}

/// Resolve `o` (the argument `arg`) for `owner`, in elements of `es` bytes: its byte length
/// (overflow-checked, a whole number of elements), its communicator or device, the rank a
/// part's view belongs to, its bounds, that it does not wrap the address space, and its
/// alignment to the element. Every operand of every collective, and of the hierarchical
/// communicator's steps, becomes an address here and nowhere else.
pub(crate) fn resolve<'a>(
    o: &Operand<'a>,
    owner: &Owner<'_>,
    arg: &'static str,
    es: usize,
) -> Result<Resolved<'a>> {
    let bytes = o.bytes().ok_or_else(|| {
        Error::invalid(
            arg,
            format!(
                "{} elements of {} bytes: the byte length overflows",
                o.len, o.elem
            ),
        )
    })?;
    if bytes % es != 0 {
        return Err(Error::invalid(
            arg,
            format!("{bytes} bytes; not a whole number of {es}-byte elements"),
        ));
    }
    match o.place {
        Place::Sym { buf, offset, only } => {
            if owner.comm != Some(buf.comm_id) {
                return Err(Error::invalid(arg, "a buffer of another communicator"));
            }
            if let Some(r) = only.filter(|&r| r != owner.rank) {
                return Err(Error::invalid(
                    arg,
                    format!(
                        "a view of rank {r}'s part; this is rank {}'s call",
                        owner.rank
                    ),
                ));
            }
            if offset.checked_add(bytes).is_none_or(|e| e > buf.sym.bytes) {
                return Err(Error::invalid(
                    arg,
                    format!(
                        "{bytes} bytes at offset {offset} pass the end of the {}-byte buffer",
                        buf.sym.bytes
                    ),
                ));
            }
            let ptr = buf.sym.addrs[owner.rank] + offset as u64;
            // Byte views of a symmetric buffer (the `_dyn` calls) can start anywhere.
            if ptr % es as u64 != 0 {
                return Err(Error::invalid(
                    arg,
                    format!("byte offset {offset} is not aligned to the {es}-byte element"),
                ));
            }
            Ok(Resolved {
                ptr,
                bytes,
                sym: Some((buf, offset)),
            })
        }
        Place::Local { ptr, device } => {
            if let Some(d) = device {
                if d != owner.device {
                    return Err(Error::invalid(
                        arg,
                        format!(
                            "memory of device {}{}; rank {} is device {}",
                            d.ordinal(),
                            if d.driver().same_as(owner.device.driver()) {
                                ""
                            } else {
                                " of another Driver value"
                            },
                            owner.rank,
                            owner.device.ordinal()
                        ),
                    ));
                }
            }
            if ptr == 0 && bytes > 0 {
                return Err(Error::invalid(arg, "a null device pointer"));
            }
            if ptr.checked_add(bytes as u64).is_none() {
                return Err(Error::invalid(
                    arg,
                    format!("{bytes} bytes at {ptr:#x} wrap the address space"),
                ));
            }
            if ptr % es as u64 != 0 {
                return Err(Error::invalid(
                    arg,
                    format!("{ptr:#x} is not aligned to the {es}-byte element"),
                ));
            }
            Ok(Resolved {
                ptr,
                bytes,
                sym: None,
            })
        }
    }
}

/// The input of a collective, read only. Made from a [`SymmetricBuffer`] (`&buf`), a
/// [`SymSlice`], a [`DeviceBuffer`] (`&buf`), or [`Src::from_raw`].
pub struct Src<'a, T> {
    pub(crate) op: Operand<'a>,
    _t: PhantomData<&'a [T]>,
}

/// The output of a collective, written. Made from a [`SymmetricBuffer`] (`&mut buf`), a
/// [`SymSliceMut`], a [`DeviceBuffer`] (`&mut buf`), or [`Dst::from_raw`]. In-place calls take
/// one `Dst` as both operands.
pub struct Dst<'a, T> {
    pub(crate) op: Operand<'a>,
    _t: PhantomData<&'a mut [T]>,
}

impl<T> std::fmt::Debug for Src<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Src({} elements)", self.op.len)
    }
}

impl<T> std::fmt::Debug for Dst<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Dst({} elements)", self.op.len)
    }
}

impl<'a, T> Src<'a, T> {
    pub(crate) fn new(op: Operand<'a>) -> Self {
        Src {
            op,
            _t: PhantomData,
        }
    }
}

impl<'a, T> Dst<'a, T> {
    pub(crate) fn new(op: Operand<'a>) -> Self {
        Dst {
            op,
            _t: PhantomData,
        }
    }
}

impl<T: DeviceRepr> Src<'_, T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.op.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.op.len == 0
    }

    /// `len` elements of the caller's device memory at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be device memory of the device of the rank it is passed to (or memory that
    /// device can read), valid for `len` elements of `T` until the work queued with it on the
    /// call's stream has completed, and not written by anything else meanwhile. The byte length
    /// (overflow included), the address range (that it does not wrap) and the alignment are
    /// still checked by the call.
    pub unsafe fn from_raw(ptr: CUdeviceptr, len: usize) -> Src<'static, T> {
        Src::new(Operand::local::<T>(ptr, len, None))
    }
}

impl<T: DeviceRepr> Dst<'_, T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.op.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.op.len == 0
    }

    /// `len` elements of the caller's device memory at `ptr`, written by the call.
    ///
    /// # Safety
    /// As [`Src::from_raw`], and nothing else may read or write the range until the work queued
    /// with it has completed.
    pub unsafe fn from_raw(ptr: CUdeviceptr, len: usize) -> Dst<'static, T> {
        Dst::new(Operand::local::<T>(ptr, len, None))
    }
}

impl<'a, T: DeviceRepr> From<&'a SymmetricBuffer<T>> for Src<'a, T> {
    fn from(b: &'a SymmetricBuffer<T>) -> Self {
        b.as_slice().into()
    }
}

impl<'a, T: DeviceRepr> From<SymSlice<'a, T>> for Src<'a, T> {
    fn from(s: SymSlice<'a, T>) -> Self {
        Src::new(Operand::sym::<T>(s.buf, s.offset, s.len, s.only))
    }
}

impl<'a, T: DeviceRepr> From<&'a SymSliceMut<'_, T>> for Src<'a, T> {
    fn from(s: &'a SymSliceMut<'_, T>) -> Self {
        Src::new(Operand::sym::<T>(s.buf, s.offset, s.len, s.only))
    }
}

impl<'a, T: DeviceRepr> From<&'a DeviceBuffer<T>> for Src<'a, T> {
    fn from(b: &'a DeviceBuffer<T>) -> Self {
        Src::new(Operand::local::<T>(
            b.device_ptr(),
            b.len(),
            Some(b.device()),
        ))
    }
}

impl<'a, T: DeviceRepr> From<&'a mut SymmetricBuffer<T>> for Dst<'a, T> {
    fn from(b: &'a mut SymmetricBuffer<T>) -> Self {
        b.as_mut_slice().into()
    }
}

impl<'a, T: DeviceRepr> From<SymSliceMut<'a, T>> for Dst<'a, T> {
    fn from(s: SymSliceMut<'a, T>) -> Self {
        Dst::new(Operand::sym::<T>(s.buf, s.offset, s.len, s.only))
    }
}

impl<'a, 'b, T: DeviceRepr> From<&'a mut SymSliceMut<'b, T>> for Dst<'a, T> {
    fn from(s: &'a mut SymSliceMut<'b, T>) -> Self {
        Dst::new(Operand::sym::<T>(s.buf, s.offset, s.len, s.only))
    }
}

impl<'a, T: DeviceRepr> From<&'a mut DeviceBuffer<T>> for Dst<'a, T> {
    fn from(b: &'a mut DeviceBuffer<T>) -> Self {
        Dst::new(Operand::local::<T>(
            b.device_ptr(),
            b.len(),
            Some(b.device()),
        ))
    }
}

/// cudarc operands (feature `cudarc`): `len` elements of `T` at `ptr` of `device`. The pointer
/// of a cudarc slice is taken against the call's cudarc stream, so cudarc's own event tracking
/// orders our kernels after earlier writes.
#[cfg(feature = "cudarc")]
pub(crate) fn cudarc_operand<'a, T>(
    ptr: CUdeviceptr,
    len: usize,
    device: &'a Device,
) -> Operand<'a> {
    Operand::local::<T>(ptr, len, Some(device))
}

/// Refuse a cudarc slice (`arg`) that does not live in `device`'s primary context: its pointer
/// would reach another device's memory, or none, from this rank's kernels.
#[cfg(feature = "cudarc")]
pub(crate) fn check_cudarc<T, S: cudarc::driver::DeviceSlice<T> + ?Sized>(
    slice: &S,
    device: &Device,
    arg: &'static str,
) -> Result<()> {
    let ctx = slice.stream().context();
    let theirs = ctx.cu_ctx();
    let ours = device.primary_context()?;
    if ctx.ordinal() != device.ordinal() as usize
        || !std::ptr::eq(theirs.cast::<std::ffi::c_void>(), ours.cast())
    {
        return Err(Error::invalid(
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
