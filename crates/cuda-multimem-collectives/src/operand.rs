//! Operands of a collective: views of symmetric buffers, or the caller's own device memory
//! (a [`DeviceBuffer`], a cudarc slice, an engine's own tensor type, or — under `unsafe` — a raw
//! pointer and length); [`IntoSrc`] and [`IntoDst`], what every collective takes, with what an
//! operand keeps alive for the call (cudarc's guards); and [`resolve`], the one place an operand
//! becomes a device address, with every check.

use std::marker::PhantomData;

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{CallStream, Device, DeviceBuffer, DeviceRepr, Error, Result};

use crate::buffer::{SymBuf, SymSlice, SymSliceMut, SymmetricBuffer};

#[cfg(feature = "cudarc")]
mod cudarc;

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

/// What an operand keeps alive until the call that takes it returns, then drops: nothing (our
/// own memory), the guard cudarc hands out with a slice's device pointer (dropped after the call
/// has queued its work, it records that use for cudarc's event tracking), or what an engine
/// attached with [`Src::hold`] / [`Dst::hold`].
// The variants' fields are never read: they are held to be dropped.
#[allow(dead_code)]
#[derive(Default)]
pub(crate) enum Keep<'a> {
    #[default]
    Nothing,
    #[cfg(feature = "cudarc")]
    Cudarc(::cudarc::driver::SyncOnDrop<'a>),
    Held(Box<dyn Held + Send + Sync + 'a>),
}

/// Anything, as a trait object that [`Keep`] drops.
pub(crate) trait Held {}
impl<G: ?Sized> Held for G {}

impl<'a> Keep<'a> {
    /// `self`, then `guard` too.
    fn and<G: Send + Sync + 'a>(self, guard: G) -> Keep<'a> {
        match self {
            Keep::Nothing => Keep::Held(Box::new(guard)),
            kept => Keep::Held(Box::new((kept, guard))),
        }
    }
}

/// The stream a bound operand was made for (its guard records the use there), as an address.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct BoundTo(usize);

impl BoundTo {
    pub(crate) fn of(on: &CallStream<'_>) -> BoundTo {
        BoundTo(on.stream().raw() as usize)
    }
}

/// Refuse an operand made for a call on another stream than `on` (`arg` names it).
fn check_bound(bound: Option<BoundTo>, on: &CallStream<'_>, arg: &'static str) -> Result<()> {
    match bound {
        Some(b) if b != BoundTo::of(on) => Err(Error::invalid(
            arg,
            format!(
                "an operand made for a call on stream {:#x}; this call queues on stream {:p} (cudarc records the use on the stream the operand was made for)",
                b.0,
                on.stream().raw()
            ),
        )),
        _ => Ok(()),
    }
}

/// The input of a collective, read only. Made from a [`SymmetricBuffer`] (`&buf`), a
/// [`SymSlice`], a [`DeviceBuffer`] (`&buf`), a cudarc slice or view ([`Src::from_cudarc`],
/// feature `cudarc`), or [`Src::from_raw`]; what it keeps alive for the call (cudarc's guard, an
/// engine's [`Src::hold`]) is dropped when the call that takes it returns. Collectives take any
/// [`IntoSrc`].
pub struct Src<'a, T> {
    op: Operand<'a>,
    keep: Keep<'a>,
    bound: Option<BoundTo>,
    _t: PhantomData<&'a [T]>,
}

/// The output of a collective, written. Made from a [`SymmetricBuffer`] (`&mut buf`), a
/// [`SymSliceMut`], a [`DeviceBuffer`] (`&mut buf`), a cudarc slice or view
/// ([`Dst::from_cudarc`], feature `cudarc`), or [`Dst::from_raw`]. In-place calls take one `Dst`
/// as both operands. Collectives take any [`IntoDst`].
pub struct Dst<'a, T> {
    op: Operand<'a>,
    keep: Keep<'a>,
    bound: Option<BoundTo>,
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
        Src::kept(op, Keep::Nothing, None)
    }

    pub(crate) fn kept(op: Operand<'a>, keep: Keep<'a>, bound: Option<BoundTo>) -> Self {
        Src {
            op,
            keep,
            bound,
            _t: PhantomData,
        }
    }

    /// The operand, for as long as this `Src` (and what it keeps alive) is borrowed: a call
    /// built from it cannot outlive the guards.
    pub(crate) fn operand(&self) -> Operand<'_> {
        self.op
    }

    /// This operand, keeping `guard` alive until the call that takes it returns (after the call
    /// queued its work), then dropping it: what an engine's tensor type attaches when it
    /// implements [`IntoSrc`] (a borrow, a use count, an event to record on the call's stream).
    pub fn hold<G: Send + Sync + 'a>(self, guard: G) -> Src<'a, T> {
        let Src {
            op, keep, bound, ..
        } = self;
        Src::kept(op, keep.and(guard), bound)
    }
}

impl<'a, T> Dst<'a, T> {
    pub(crate) fn new(op: Operand<'a>) -> Self {
        Dst::kept(op, Keep::Nothing, None)
    }

    pub(crate) fn kept(op: Operand<'a>, keep: Keep<'a>, bound: Option<BoundTo>) -> Self {
        Dst {
            op,
            keep,
            bound,
            _t: PhantomData,
        }
    }

    /// The operand, for as long as this `Dst` (and what it keeps alive) is borrowed.
    pub(crate) fn operand(&self) -> Operand<'_> {
        self.op
    }

    /// This operand, keeping `guard` alive until the call that takes it returns, then dropping
    /// it (see [`Src::hold`]).
    pub fn hold<G: Send + Sync + 'a>(self, guard: G) -> Dst<'a, T> {
        let Dst {
            op, keep, bound, ..
        } = self;
        Dst::kept(op, keep.and(guard), bound)
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
    /// still checked by the call. A pointer of a library that tracks its uses (cudarc's
    /// `device_ptr`) comes with a guard that must outlive the call: use [`Src::from_cudarc`], or
    /// [`Src::hold`] the guard.
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

/// What a collective takes as an input: anything that is a [`Src`] (symmetric buffers and
/// views, [`DeviceBuffer`]s), cudarc's `&CudaSlice`, `&CudaView`, `CudaView` and `&CudaViewMut`
/// (feature `cudarc`), and whatever an engine implements it for (its own tensor type).
///
/// The conversion runs inside the call, once the call's stream is known: a cudarc operand takes
/// its device pointer against that stream, and the guard cudarc hands out with it stays in the
/// returned [`Src`] until the call returns. An engine's tensor type implements it by making a
/// `Src` of what it holds — on a GPU its cudarc slice ([`Src::from_cudarc`]), on the simulator
/// a [`DeviceBuffer`] — so that its communication code is one generic code path, tested on the
/// simulator (`examples/cudarc_engine.rs`).
pub trait IntoSrc<'a, T> {
    /// This operand as the input named `arg` of a call queued on `on`.
    fn into_src<'g>(self, on: &CallStream<'g>, arg: &'static str) -> Result<Src<'g, T>>
    where
        'a: 'g;
}

/// What a collective takes as an output (or an in-place buffer): anything that is a [`Dst`]
/// (symmetric buffers and views, [`DeviceBuffer`]s), cudarc's `&mut CudaSlice`,
/// `&mut CudaViewMut` and `CudaViewMut` (feature `cudarc`), and whatever an engine implements it
/// for. As [`IntoSrc`].
pub trait IntoDst<'a, T> {
    /// This operand as the output named `arg` of a call queued on `on`.
    fn into_dst<'g>(self, on: &CallStream<'g>, arg: &'static str) -> Result<Dst<'g, T>>
    where
        'a: 'g;
}

impl<'a, T: 'a, X: Into<Src<'a, T>>> IntoSrc<'a, T> for X {
    fn into_src<'g>(self, on: &CallStream<'g>, arg: &'static str) -> Result<Src<'g, T>>
    where
        'a: 'g,
    {
        let s = self.into();
        check_bound(s.bound, on, arg)?;
        Ok(s)
    }
}

impl<'a, T: 'a, X: Into<Dst<'a, T>>> IntoDst<'a, T> for X {
    fn into_dst<'g>(self, on: &CallStream<'g>, arg: &'static str) -> Result<Dst<'g, T>>
    where
        'a: 'g,
    {
        let d = self.into();
        check_bound(d.bound, on, arg)?;
        Ok(d)
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
