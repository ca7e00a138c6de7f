//! Symmetric buffers: typed buffers of every rank's symmetric memory, and the views of them that
//! collectives take as operands.

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{DeviceBuffer, DeviceRepr, Error, Result};

use crate::team::{Ranks, Sym};

/// A symmetric buffer as the kernels see it: every rank's part, and per local rank a device
/// table of every part's address in this process.
pub(crate) struct SymBuf {
    /// The communicator it belongs to.
    pub(crate) comm_id: u64,
    /// Its number in the communicator (the same on every rank: allocations are collective).
    pub(crate) id: u64,
    pub(crate) sym: Sym,
    /// (local rank, table of N addresses).
    tables: Vec<(usize, DeviceBuffer<u64>)>,
    /// The ranks this process drives.
    pub(crate) locals: Vec<usize>,
}

impl SymBuf {
    pub(crate) fn new(comm_id: u64, id: u64, ranks: &Ranks, sym: Sym) -> Result<SymBuf> {
        let tables = ranks
            .locals
            .iter()
            .map(|l| Ok((l.rank, DeviceBuffer::from_host(&l.device, &sym.addrs)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(SymBuf {
            comm_id,
            id,
            sym,
            tables,
            locals: ranks.locals.iter().map(|l| l.rank).collect(),
        })
    }

    /// The device table of `rank` (a local rank).
    pub(crate) fn table(&self, rank: usize) -> Result<CUdeviceptr> {
        self.tables
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, t)| t.device_ptr())
            .ok_or_else(|| Error::invalid("rank", format!("{rank}; not driven by this process")))
    }

    fn check_local(&self, rank: usize) -> Result<()> {
        if self.locals.contains(&rank) {
            Ok(())
        } else {
            Err(Error::invalid(
                "rank",
                format!(
                    "{rank}; this process drives rank(s) {:?} of a team of {}",
                    self.locals,
                    self.sym.addrs.len()
                ),
            ))
        }
    }
}

/// `range` of a `len`-element sequence as (start, end), checked without overflow.
pub(crate) fn resolve(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s
            .checked_add(1)
            .ok_or_else(|| Error::invalid("range", "starts after usize::MAX"))?,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e
            .checked_add(1)
            .ok_or_else(|| Error::invalid("range", "ends after usize::MAX"))?,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    if start > end || end > len {
        return Err(Error::invalid(
            "range",
            format!("{start}..{end} of {len} elements"),
        ));
    }
    Ok((start, end))
}

/// A typed buffer of `len` elements on every rank of a communicator, each rank's part mapped on
/// every peer ([`crate::Communicator::alloc`]). Collectives on symmetric buffers run with no
/// extra copies. Views ([`SymmetricBuffer::slice`], [`SymmetricBuffer::slice_mut`]) select the
/// same element range on every rank; a shared and a mutable view of one buffer cannot coexist,
/// so an output that partly overlaps its input cannot be written (in place is its own call).
pub struct SymmetricBuffer<T> {
    pub(crate) inner: Arc<SymBuf>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T> std::fmt::Debug for SymmetricBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SymmetricBuffer<{}>({} elements x {} ranks)",
            std::any::type_name::<T>(),
            self.len,
            self.inner.sym.addrs.len()
        )
    }
}

impl<T: DeviceRepr> SymmetricBuffer<T> {
    pub(crate) fn new(inner: SymBuf, len: usize) -> Self {
        SymmetricBuffer {
            inner: Arc::new(inner),
            len,
            _t: PhantomData,
        }
    }

    /// Elements per rank.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements (never: allocations have at least one).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Team size.
    pub fn ranks(&self) -> usize {
        self.inner.sym.addrs.len()
    }

    /// Rank `rank`'s part as a device address in this process (peers' parts are reachable from
    /// every device of this process's ranks).
    pub fn device_ptr(&self, rank: usize) -> Result<CUdeviceptr> {
        self.inner.sym.addrs.get(rank).copied().ok_or_else(|| {
            Error::invalid(
                "rank",
                format!("{rank}; the team has {} ranks", self.ranks()),
            )
        })
    }

    fn check_span(&self, offset: usize, n: usize, arg: &'static str) -> Result<usize> {
        span::<T>(offset, n, self.len, arg)
    }

    /// Copy `data` into rank `rank`'s part from element `offset` (synchronous: landed when this
    /// returns; `rank` must be driven by this process). An empty `data` is a no-op.
    pub fn write(&self, rank: usize, offset: usize, data: &[T]) -> Result<()> {
        self.inner.check_local(rank)?;
        let at = self.check_span(offset, data.len(), "data")?;
        if data.is_empty() {
            return Ok(());
        }
        self.inner.sym.write(rank, at, data)
    }

    /// Copy rank `rank`'s part from element `offset` into `out` (synchronous; synchronise the
    /// rank's stream first). An empty `out` is a no-op.
    pub fn read(&self, rank: usize, offset: usize, out: &mut [T]) -> Result<()> {
        self.inner.check_local(rank)?;
        let at = self.check_span(offset, out.len(), "out")?;
        if out.is_empty() {
            return Ok(());
        }
        self.inner.sym.read(rank, at, out)
    }

    /// Rank `rank`'s whole part.
    pub fn to_vec(&self, rank: usize) -> Result<Vec<T>>
    where
        T: Default,
    {
        let mut v = vec![T::default(); self.len];
        self.read(rank, 0, &mut v)?;
        Ok(v)
    }

    /// A shared view of `range` (elements, the same range on every rank).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<SymSlice<'_, T>> {
        let (s, e) = resolve(range, self.len)?;
        Ok(SymSlice {
            buf: &self.inner,
            offset: s,
            len: e - s,
            only: None,
            _t: PhantomData,
        })
    }

    /// A mutable view of `range`.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<SymSliceMut<'_, T>> {
        let (s, e) = resolve(range, self.len)?;
        Ok(SymSliceMut {
            buf: &self.inner,
            offset: s,
            len: e - s,
            only: None,
            _t: PhantomData,
        })
    }

    /// The whole buffer as a shared view.
    pub fn as_slice(&self) -> SymSlice<'_, T> {
        SymSlice {
            buf: &self.inner,
            offset: 0,
            len: self.len,
            only: None,
            _t: PhantomData,
        }
    }

    /// The whole buffer as a mutable view.
    pub fn as_mut_slice(&mut self) -> SymSliceMut<'_, T> {
        SymSliceMut {
            buf: &self.inner,
            offset: 0,
            len: self.len,
            only: None,
            _t: PhantomData,
        }
    }
}

impl<T: DeviceRepr> SymmetricBuffer<T> {
    /// One exclusive handle per rank this process drives, for a thread per rank: each makes
    /// views that only its rank's calls accept.
    pub fn parts_mut(&mut self) -> Vec<SymPartMut<'_, T>> {
        let (buf, len) = (&*self.inner, self.len);
        buf.locals
            .iter()
            .map(|&rank| SymPartMut {
                buf,
                rank,
                len,
                _t: PhantomData,
            })
            .collect()
    }
}

/// One rank's exclusive share of a [`SymmetricBuffer`] ([`SymmetricBuffer::parts_mut`]): its
/// views are accepted by that rank's calls only, so one thread per rank can each hold one.
pub struct SymPartMut<'a, T> {
    buf: &'a SymBuf,
    rank: usize,
    len: usize,
    _t: PhantomData<&'a mut [T]>,
}

impl<T> std::fmt::Debug for SymPartMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SymPartMut(rank {}, {} elements)", self.rank, self.len)
    }
}

impl<T: DeviceRepr> SymPartMut<'_, T> {
    /// The rank whose part this is.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A mutable view of `range` for this rank's calls.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<SymSliceMut<'_, T>> {
        let (s, e) = resolve(range, self.len)?;
        Ok(SymSliceMut {
            buf: self.buf,
            offset: s,
            len: e - s,
            only: Some(self.rank),
            _t: PhantomData,
        })
    }

    /// The whole part as a mutable view for this rank's calls.
    pub fn as_mut_slice(&mut self) -> SymSliceMut<'_, T> {
        SymSliceMut {
            buf: self.buf,
            offset: 0,
            len: self.len,
            only: Some(self.rank),
            _t: PhantomData,
        }
    }

    /// Copy `data` into this rank's part from element `offset` (synchronous).
    pub fn write(&mut self, offset: usize, data: &[T]) -> Result<()> {
        let at = span::<T>(offset, data.len(), self.len, "data")?;
        if data.is_empty() {
            return Ok(());
        }
        self.buf.sym.write(self.rank, at, data)
    }

    /// Copy this rank's part from element `offset` into `out` (synchronous).
    pub fn read(&self, offset: usize, out: &mut [T]) -> Result<()> {
        let at = span::<T>(offset, out.len(), self.len, "out")?;
        if out.is_empty() {
            return Ok(());
        }
        self.buf.sym.read(self.rank, at, out)
    }
}

/// The byte offset of `n` elements at `offset` of a `len`-element part, checked.
fn span<T>(offset: usize, n: usize, len: usize, arg: &'static str) -> Result<usize> {
    match offset.checked_add(n) {
        Some(end) if end <= len => Ok(offset * std::mem::size_of::<T>()),
        _ => Err(Error::invalid(
            arg,
            format!("{n} elements at offset {offset} pass the end of the {len}-element buffer"),
        )),
    }
}

/// A shared view of a range of a [`SymmetricBuffer`] (the same range on every rank): an input.
pub struct SymSlice<'a, T> {
    pub(crate) buf: &'a SymBuf,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    /// The one rank whose calls may use it (a view of a [`SymPartMut`]), if restricted.
    pub(crate) only: Option<usize>,
    _t: PhantomData<&'a [T]>,
}

impl<T> Clone for SymSlice<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SymSlice<'_, T> {}

impl<T> std::fmt::Debug for SymSlice<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SymSlice({}..{})", self.offset, self.offset + self.len)
    }
}

impl<'a, T> SymSlice<'a, T> {
    /// Elements in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Element offset of the view in its buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// A narrower view (`range` relative to this one).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<SymSlice<'a, T>> {
        let (s, e) = resolve(range, self.len)?;
        Ok(SymSlice {
            buf: self.buf,
            offset: self.offset + s,
            len: e - s,
            only: self.only,
            _t: PhantomData,
        })
    }
}

/// A mutable view of a range of a [`SymmetricBuffer`] (the same range on every rank): an output,
/// or both operands of an in-place call.
pub struct SymSliceMut<'a, T> {
    pub(crate) buf: &'a SymBuf,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    /// The one rank whose calls may use it (a view of a [`SymPartMut`]), if restricted.
    pub(crate) only: Option<usize>,
    _t: PhantomData<&'a mut [T]>,
}

impl<T> std::fmt::Debug for SymSliceMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SymSliceMut({}..{})",
            self.offset,
            self.offset + self.len
        )
    }
}

impl<'a, T> SymSliceMut<'a, T> {
    /// Elements in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Element offset of the view in its buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// A narrower mutable view (`range` relative to this one), borrowing this one.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<SymSliceMut<'_, T>> {
        let (s, e) = resolve(range, self.len)?;
        Ok(SymSliceMut {
            buf: self.buf,
            offset: self.offset + s,
            len: e - s,
            only: self.only,
            _t: PhantomData,
        })
    }

    /// Two disjoint views: `[0, mid)` and `[mid, len)` (e.g. input and output of one buffer).
    pub fn split_at_mut(self, mid: usize) -> Result<(SymSliceMut<'a, T>, SymSliceMut<'a, T>)> {
        if mid > self.len {
            return Err(Error::invalid(
                "mid",
                format!("{mid}; the view has {} elements", self.len),
            ));
        }
        Ok((
            SymSliceMut {
                buf: self.buf,
                offset: self.offset,
                len: mid,
                only: self.only,
                _t: PhantomData,
            },
            SymSliceMut {
                buf: self.buf,
                offset: self.offset + mid,
                len: self.len - mid,
                only: self.only,
                _t: PhantomData,
            },
        ))
    }

    /// This view as a shared one (for an input).
    pub fn as_slice(&self) -> SymSlice<'_, T> {
        SymSlice {
            buf: self.buf,
            offset: self.offset,
            len: self.len,
            only: self.only,
            _t: PhantomData,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::resolve;

    #[test]
    #[allow(clippy::reversed_empty_ranges)] // a reversed range is what is being refused
    fn ranges_are_checked_without_overflow() {
        assert_eq!(resolve(.., 10).unwrap(), (0, 10));
        assert_eq!(resolve(2..=3, 10).unwrap(), (2, 4));
        assert!(resolve(0..=usize::MAX, 10).is_err());
        assert!(resolve(usize::MAX.., 10).is_err());
        assert!(resolve(5..4, 10).is_err());
        assert!(resolve(0..11, 10).is_err());
        assert_eq!(resolve(10..10, 10).unwrap(), (10, 10));
    }
}
