//! [`HierCommunicator`]: the hierarchical collectives, every step on the caller's stream.

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{
    Device, DeviceBuffer, DeviceRepr, Error, IntoStream, Result, Stream, StreamRef,
};
use parking_lot::Mutex;

use super::cross::CrossDomain;
use super::layout::{HierLayout, RankOrder};
use crate::buffer::SymmetricBuffer;
use crate::comm::{Communicator, RankHandle};
use crate::operand::{resolve, Dst, IntoDst, IntoSrc, Operand, Owner, Place, Src};
use crate::types::{DType, Element, ReduceOp};

// ---- the intra-domain steps ----
//
// An allreduce inside the domain is its reduce-scatter then its all-gather (RankHandle's staged
// and direct push kernels, docs/design/collectives.md), with the cross-domain step between them
// on a shard of 1/D of the message. Why no fence is needed around the cross-domain step: the
// staged reduce-scatter never lets a peer read or write this rank's buffer (peers push into its
// staging; only this rank writes its output), and its first barrier proves that every peer has
// finished its earlier stream work; the all-gather after it either touches only this rank's
// buffer (staged) or stores into it only after a barrier that this rank passes once its
// cross-domain step is done (direct). The tail of an allreduce (count mod D elements) goes
// through the domain's allreduce before the reduce-scatter, whose barrier then fences it; with
// no reduce-scatter (count < D) the explicit fence does. `docs/design/hierarchical.md`.

/// Zero every chunk of `buf` (`total` bytes at `ptr`, chunks of `chunk` bytes) but chunk
/// `mine`, on `stream`: what the all-gather of layouts of
/// [`RankOrder::Other`] sums (x + 0 = x exactly, but a -0.0 comes
/// back as +0.0).
fn zero_others(
    stream: &StreamRef<'_>,
    (ptr, total): (CUdeviceptr, usize),
    chunk: usize,
    mine: usize,
) -> Result<()> {
    let at = mine * chunk;
    // SAFETY: both ranges lie inside the operand (checked by the caller), this rank's memory;
    // no peer reads it now (the caller fenced).
    unsafe {
        stream.memset_d8_async(ptr, 0, at)?;
        stream.memset_d8_async(
            ptr + (at + chunk) as u64,
            0,
            total - (at + chunk).min(total),
        )
    }
}

/// The hierarchical communicator's scratch: the buffer in use, and those it outgrew (kept
/// until the communicator drops: a captured graph may still point into them).
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) current: Option<DeviceBuffer<u8>>,
    pub(super) retired: Vec<DeviceBuffer<u8>>,
}

/// A team across NVLink domains: reduce-scatter inside each domain (our NVLink kernels),
/// allreduce of the shards across domains on rails ([`CrossDomain`], NCCL by default), and
/// all-gather inside the domain. One rank per process, found through a [`crate::Bootstrap`]
/// ([`crate::UnixBootstrap`] on one host, `MpiBootstrap` across nodes).
///
/// Every rank makes the same calls in the same order ([`HierCommunicator::alloc`] included):
/// the domain's and the rail's exchanges go through the one bootstrap of the whole team.
/// Operands: [`SymmetricBuffer`]s of [`HierCommunicator::alloc`] (domains of 2 or more), or
/// the caller's own device memory; the domain's reduce-scatter and all-gather take either with
/// no copies outside their kernels. One call at a time per communicator (its scratch and its
/// NCCL communicators are shared by its calls): queue them on one stream, as with NCCL.
pub struct HierCommunicator {
    pub(super) layout: HierLayout,
    pub(super) device: Device,
    /// Declared before `domain`: dropped first.
    pub(super) fence: Option<SymmetricBuffer<f32>>,
    /// Device memory of this rank for the steps that need it (see
    /// [`HierCommunicator::reserve_scratch`]).
    pub(super) scratch: Mutex<Scratch>,
    pub(super) domain: Option<Communicator>,
    pub(super) cross: Option<Box<dyn CrossDomain>>,
    /// Held for the whole of a collective call (re-entrant: a call made of others takes it
    /// again), so calls from several threads queue their steps one call after another.
    pub(super) calls: parking_lot::ReentrantMutex<()>,
}

impl std::fmt::Debug for HierCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HierCommunicator")
            .field("layout", &self.layout)
            .field("cross", &self.cross.as_ref().map(|c| c.name()))
            .finish_non_exhaustive()
    }
}

impl HierCommunicator {
    /// The domains and rails.
    pub fn layout(&self) -> &HierLayout {
        &self.layout
    }

    /// This rank's device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The domain's communicator (`None` for domains of one GPU).
    pub fn domain(&self) -> Option<&Communicator> {
        self.domain.as_ref()
    }

    /// The cross-domain step (`None` with a single domain).
    pub fn cross_domain(&self) -> Option<&dyn CrossDomain> {
        self.cross.as_deref()
    }

    /// Whether a whole call can be captured into a CUDA graph (the cross-domain step can).
    pub fn graph_capturable(&self) -> bool {
        self.cross.as_ref().is_none_or(|c| c.graph_capturable())
    }

    /// A symmetric buffer of the domain (collective over the team). Its parts are numbered
    /// by rank within the domain ([`HierLayout::local_index`]), as the domain's communicator
    /// numbers them. Domains of one GPU have none: use a [`cuda_multimem::DeviceBuffer`].
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<SymmetricBuffer<T>> {
        match &self.domain {
            Some(c) => c.alloc(len),
            None => Err(Error::invalid(
                "alloc",
                "domains of one GPU have no symmetric memory; pass a DeviceBuffer",
            )),
        }
    }

    /// Report a failure of earlier calls (synchronise the stream first): the domain's
    /// timeouts and disagreements, and NCCL's asynchronous errors (which abort its
    /// communicator).
    pub fn check(&self) -> Result<()> {
        if let Some(d) = &self.domain {
            d.check()?;
        }
        if let Some(c) = &self.cross {
            c.check()?;
        }
        Ok(())
    }

    fn handle(&self) -> Result<Option<RankHandle<'_>>> {
        self.domain
            .as_ref()
            .map(|c| c.rank(self.layout.local_index()))
            .transpose()
    }

    /// What this rank's operands are checked against: the domain's communicator (whose
    /// symmetric buffers it takes; domains of one GPU have none), its rank in the domain, and
    /// the device.
    fn owner(&self) -> Owner<'_> {
        Owner {
            comm: self.domain.as_ref().map(|c| c.inner.id),
            rank: self.layout.local_index(),
            device: &self.device,
        }
    }

    /// An operand of this rank, checked by the one resolution every collective's operands go
    /// through (byte length without overflow, communicator or device, bounds, address wrap,
    /// alignment): as a byte view of the checked length, and its address.
    fn view<'o>(
        &self,
        o: &Operand<'o>,
        arg: &'static str,
        es: usize,
    ) -> Result<(Operand<'o>, CUdeviceptr)> {
        let r = resolve(o, &self.owner(), arg, es)?;
        Ok((Operand::bytes_at(o.place, r.bytes), r.ptr))
    }

    fn check_stream(&self, s: &StreamRef<'_>) -> Result<()> {
        if s.device() != &self.device {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a stream of device {}; this rank is device {}",
                    s.device().ordinal(),
                    self.device.ordinal()
                ),
            ));
        }
        Ok(())
    }

    /// Allreduce `buf` in place across the whole team, on `stream`.
    pub fn all_reduce_in_place<'d, 'x, T: Element>(
        &self,
        buf: impl IntoDst<'d, T>,
        op: ReduceOp,
        stream: impl IntoStream<'x>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let on = stream.into_stream(&self.device)?;
        let b = buf.into_dst(&on, "buf")?;
        self.all_reduce_op(T::DTYPE, b.operand(), op, on.stream())
    }

    /// Allreduce `input` into `output` (same length): the input is copied into the output on
    /// `stream`, then reduced there in place.
    pub fn all_reduce<'s, 'd, 'x, T: Element>(
        &self,
        input: impl IntoSrc<'s, T>,
        output: impl IntoDst<'d, T>,
        op: ReduceOp,
        stream: impl IntoStream<'x>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let on = stream.into_stream(&self.device)?;
        let (i, o, s) = (
            input.into_src(&on, "input")?,
            output.into_dst(&on, "output")?,
            on.stream(),
        );
        let es = T::DTYPE.size();
        let (i, _) = self.view(&i.operand(), "input", es)?;
        let (o, _) = self.view(&o.operand(), "output", es)?;
        // byte views: `len` is bytes
        if i.len != o.len {
            return Err(Error::invalid(
                "output",
                format!(
                    "{} bytes; the input has {} (both operands have the same length)",
                    o.len, i.len
                ),
            ));
        }
        self.copy_into(T::DTYPE, &i, &o, 0, &s)?;
        self.all_reduce_op(T::DTYPE, o, op, s)
    }

    /// [`HierCommunicator::all_reduce_in_place`] for a run-time element type, on a byte view.
    pub fn all_reduce_dyn_in_place<'d, 'x>(
        &self,
        dtype: DType,
        buf: impl IntoDst<'d, u8>,
        op: ReduceOp,
        stream: impl IntoStream<'x>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let on = stream.into_stream(&self.device)?;
        let b = buf.into_dst(&on, "buf")?;
        // a u8 view: `len` is bytes
        if b.operand().len % dtype.size() != 0 {
            return Err(Error::invalid(
                "buf",
                format!("{} bytes; not a whole number of {dtype}", b.operand().len),
            ));
        }
        self.all_reduce_op(dtype, b.operand(), op, on.stream())
    }

    /// Copy `i` into `o` at byte `at` (checked: lengths, devices, no partial overlap).
    fn copy_into(
        &self,
        dtype: DType,
        i: &Operand<'_>,
        o: &Operand<'_>,
        at: usize,
        s: &StreamRef<'_>,
    ) -> Result<()> {
        self.check_stream(s)?;
        let es = dtype.size();
        let (i, ip) = self.view(i, "input", es)?;
        let (o, op) = self.view(o, "output", es)?;
        // byte views: `len` is bytes
        if at.checked_add(i.len).is_none_or(|e| e > o.len) {
            return Err(Error::invalid(
                "output",
                format!(
                    "{} bytes; the input's {} bytes at byte {at} do not fit",
                    o.len, i.len
                ),
            ));
        }
        let dst = op + at as u64;
        if ip == dst {
            return Ok(());
        }
        if ip < op + o.len as u64 && op < ip + i.len as u64 {
            return Err(Error::invalid(
                "output",
                "overlaps the input without being the in-place position",
            ));
        }
        // SAFETY: both ranges checked against their operands; this rank's device.
        unsafe { s.copy_dtod_async(dst, ip, i.len) }
    }

    fn all_reduce_op(
        &self,
        dtype: DType,
        o: Operand<'_>,
        op: ReduceOp,
        s: StreamRef<'_>,
    ) -> Result<()> {
        self.check_stream(&s)?;
        no_avg(op)?;
        let es = dtype.size();
        let (o, p) = self.view(&o, "buf", es)?;
        // a byte view: `len` is bytes
        let count = o.len / es;
        if count == 0 {
            return Ok(());
        }
        let Some(h) = self.handle()? else {
            if let Some(x) = &self.cross {
                // SAFETY: `count` elements at `p`, checked above.
                unsafe { x.all_reduce(dtype, op, p, p, count, &s) }?;
            }
            return Ok(());
        };
        let Some(x) = &self.cross else {
            // One domain: its own allreduce (which picks its algorithm per size).
            h.all_reduce_dyn_in_place(dtype, Dst::<u8>::new(o), op, s)?;
            return Ok(());
        };
        let (d, l) = (self.layout.domain_size(), self.layout.local_index());
        let q = count / d;
        let main = q * d;
        // 1. The tail (count mod D elements): the domain's allreduce, before the reduce-scatter,
        //    whose first barrier then proves that no domain peer reads this rank's tail any more.
        if main < count {
            h.all_reduce_dyn_in_place(
                dtype,
                Dst::<u8>::new(o.sub(main * es, (count - main) * es)),
                op,
                s,
            )?;
            if q == 0 {
                // No reduce-scatter follows: fence instead.
                self.fence(&h, s)?;
            }
        }
        // 2. Reduce-scatter of the main region inside the domain: local rank l ends with shard l
        //    of the domain's result. Staged: peers write only into this rank's staging, never
        //    into its buffer, so the cross-domain step may write shard l as soon as it ends.
        if q > 0 {
            rs_in_place_dyn(&h, dtype, o.sub(0, main * es), op, s)?;
            let shard = p + (l * q * es) as u64;
            // 3. Across domains, on rail l: shard l.
            // SAFETY: shard l of the checked operand.
            unsafe { x.all_reduce(dtype, op, shard, shard, q, &s) }?;
        }
        if main < count {
            // 3'. The tail, on every rail.
            let t = p + (main * es) as u64;
            // SAFETY: the checked operand's last count - main elements.
            unsafe { x.all_reduce(dtype, op, t, t, count - main, &s) }?;
        }
        // 4. All-gather of the shards inside the domain.
        if q > 0 {
            ag_in_place_dyn(&h, dtype, o.sub(0, main * es), s)?;
        }
        Ok(())
    }

    /// A domain allreduce of a few bytes: once it completes on this rank, every domain peer has
    /// started it, so their earlier calls (which may read this rank's buffers) are complete.
    fn fence(&self, h: &RankHandle<'_>, s: StreamRef<'_>) -> Result<()> {
        let Some(f) = &self.fence else { return Ok(()) };
        let o = Operand::bytes_at(
            Place::Sym {
                buf: &f.inner,
                offset: 0,
                only: None,
            },
            4,
        );
        h.all_reduce_dyn_in_place(DType::F32, Dst::<u8>::new(o), ReduceOp::Max, s)?;
        Ok(())
    }

    /// At least `bytes` of this rank's scratch (device memory no peer sees), on `s`'s device:
    /// grown outside graph capture only; a buffer it outgrows stays allocated until the
    /// communicator drops (a captured graph may still use it).
    fn scratch(&self, bytes: usize, s: &StreamRef<'_>) -> Result<CUdeviceptr> {
        let mut sc = self.scratch.lock();
        if let Some(b) = sc.current.as_ref().filter(|b| b.bytes() >= bytes) {
            return Ok(b.device_ptr());
        }
        if s.is_capturing()? {
            return Err(Error::invalid(
                "stream",
                format!(
                    "capturing, and this call needs {bytes} bytes of the hierarchical scratch ({} allocated); call HierCommunicator::reserve_scratch({bytes}) (or make one eager call of this size) before capturing",
                    sc.current.as_ref().map_or(0, |b| b.bytes())
                ),
            ));
        }
        let size = bytes.checked_next_power_of_two().ok_or_else(|| {
            Error::invalid(
                "bytes",
                format!("{bytes}; its power-of-two rounding overflows usize"),
            )
        })?;
        let b = DeviceBuffer::<u8>::zeroed(&self.device, size)?;
        let ptr = b.device_ptr();
        if let Some(old) = sc.current.replace(b) {
            sc.retired.push(old);
        }
        Ok(ptr)
    }

    /// Allocate the scratch that reduce-scatters and all-gathers of `bytes` (the whole buffer of
    /// N chunks) need, so that they can be captured into a graph: teams whose ranks are
    /// domain-major ([`RankOrder::DomainMajor`]) use M chunks of it, out-of-place reduce-scatters
    /// M chunks, and layouts of [`RankOrder::Other`] the whole buffer. The allreduce needs none.
    pub fn reserve_scratch(&self, bytes: usize) -> Result<()> {
        // not between two steps of another thread's call
        let _serial = self.calls.lock();
        let s = Stream::new(&self.device)?;
        self.scratch(bytes, &s.as_stream_ref()).map(drop)
    }

    fn local_op(&self, ptr: CUdeviceptr, bytes: usize) -> Operand<'_> {
        Operand::local_bytes(ptr, bytes, &self.device)
    }

    fn chunk(&self, o: &Operand<'_>, es: usize, arg: &'static str) -> Result<usize> {
        let n = self.layout.size();
        // a byte view: `len` is bytes
        if o.len % (n * es) != 0 {
            return Err(Error::invalid(
                arg,
                format!(
                    "{} bytes; expected a whole number of {n} chunks of {es}-byte elements (one per rank)",
                    o.len
                ),
            ));
        }
        Ok(o.len / n)
    }

    /// The domain reduce-scatters of a domain-major team into M chunks of scratch (chunk k: the
    /// domain's result for chunk local-index of block k, block k = domain k's ranks' chunks),
    /// then the rail's reduce-scatter of the scratch into `recv` (this rank's chunk).
    fn rs_domain_major<T: Element>(
        &self,
        (h, x): (&RankHandle<'_>, &dyn CrossDomain),
        input: Operand<'_>,
        recv: CUdeviceptr,
        (c, op): (usize, ReduceOp),
        s: StreamRef<'_>,
    ) -> Result<()> {
        let (m, d) = (self.layout.domain_count(), self.layout.domain_size());
        let scratch = self.scratch(m * c, &s)?;
        for k in 0..m {
            let out = self.local_op(scratch + (k * c) as u64, c);
            h.reduce_scatter(
                Src::<T>::new(input.sub(k * d * c, d * c)),
                Dst::<T>::new(out),
                op,
                s,
            )?;
        }
        // SAFETY: M chunks of c bytes of this rank's scratch; `recv` one chunk of the caller's
        // checked operand.
        unsafe { x.reduce_scatter(T::DTYPE, op, scratch, recv, c / T::DTYPE.size(), &s) }
    }

    /// Reduce-scatter in place: `buf` holds N chunks (N = team size); chunk r of rank r gets the
    /// team's result for that chunk (other chunks are left with partial results or inputs).
    /// Every 16-bit result is rounded twice: once inside the domain, once across.
    ///
    /// - domains of one GPU: one cross-domain reduce-scatter;
    /// - one domain: the domain's reduce-scatter;
    /// - rail-major ranks ([`RankOrder::RailMajor`]): the domain's reduce-scatter of the whole
    ///   buffer (local rank l gets rail l's M chunks), then the rail's, both in place;
    /// - domain-major ranks: M domain reduce-scatters (one per domain's block of D chunks) into
    ///   M chunks of scratch, then the rail's reduce-scatter of the scratch into chunk r;
    /// - [`RankOrder::Other`]: the hierarchical allreduce of the whole buffer.
    pub fn reduce_scatter_in_place<'d, 'x, T: Element>(
        &self,
        buf: impl IntoDst<'d, T>,
        op: ReduceOp,
        stream: impl IntoStream<'x>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let on = stream.into_stream(&self.device)?;
        let (b, s) = (buf.into_dst(&on, "buf")?, on.stream());
        no_avg(op)?;
        let es = T::DTYPE.size();
        let (bv, p) = self.view(&b.operand(), "buf", es)?;
        let c = self.chunk(&bv, es, "buf")?;
        self.check_stream(&s)?;
        let (r, l, m) = (
            self.layout.rank(),
            self.layout.local_index(),
            self.layout.domain_count(),
        );
        if c == 0 {
            return Ok(());
        }
        let h = self.handle()?;
        match (&h, self.cross.as_deref()) {
            (None, Some(x)) => {
                // SAFETY: N chunks at p (checked); NCCL's in-place position.
                unsafe { x.reduce_scatter(T::DTYPE, op, p, p + (r * c) as u64, c / es, &s) }
            }
            (None, None) => Ok(()),
            (Some(h), None) => h.reduce_scatter_in_place(b, op, s).map(drop),
            (Some(h), Some(x)) => match self.layout.rank_order() {
                RankOrder::RailMajor => {
                    h.reduce_scatter_in_place(Dst::<T>::new(bv), op, s)?;
                    let send = p + (l * m * c) as u64;
                    // SAFETY: rail l's M chunks of the checked operand; chunk r = l·M + domain
                    // is NCCL's in-place position in them.
                    unsafe { x.reduce_scatter(T::DTYPE, op, send, p + (r * c) as u64, c / es, &s) }
                }
                RankOrder::DomainMajor => {
                    self.rs_domain_major::<T>((h, x), bv, p + (r * c) as u64, (c, op), s)
                }
                RankOrder::Other => self.all_reduce_op(T::DTYPE, bv, op, s),
            },
        }
    }

    /// Reduce-scatter `input` (N chunks) into `output` (one chunk): this rank's chunk of the
    /// team's result; the input is only read. As
    /// [`HierCommunicator::reduce_scatter_in_place`], with the domain's step out of place into
    /// scratch (M chunks; [`RankOrder::Other`]: a copy of the whole input, allreduced).
    pub fn reduce_scatter<'s, 'd, 'x, T: Element>(
        &self,
        input: impl IntoSrc<'s, T>,
        output: impl IntoDst<'d, T>,
        op: ReduceOp,
        stream: impl IntoStream<'x>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let on = stream.into_stream(&self.device)?;
        let (i, o, s) = (
            input.into_src(&on, "input")?,
            output.into_dst(&on, "output")?,
            on.stream(),
        );
        no_avg(op)?;
        let es = T::DTYPE.size();
        let (iv, ip) = self.view(&i.operand(), "input", es)?;
        let (ov, op_) = self.view(&o.operand(), "output", es)?;
        let c = self.chunk(&iv, es, "input")?;
        // byte views: `len` is bytes
        if ov.len != c {
            return Err(Error::invalid(
                "output",
                format!("{} bytes; one chunk of the input is {c}", ov.len),
            ));
        }
        self.check_stream(&s)?;
        if ip < op_ + c as u64 && op_ < ip + iv.len as u64 && c > 0 {
            return Err(Error::invalid(
                "output",
                "overlaps the input (in place: reduce_scatter_in_place)",
            ));
        }
        if c == 0 {
            return Ok(());
        }
        let m = self.layout.domain_count();
        let h = self.handle()?;
        match (&h, self.cross.as_deref()) {
            // SAFETY: both operands checked for these lengths.
            (None, Some(x)) => unsafe { x.reduce_scatter(T::DTYPE, op, ip, op_, c / es, &s) },
            (None, None) => self.copy_into(T::DTYPE, &iv, &ov, 0, &s),
            (Some(h), None) => h.reduce_scatter(i, o, op, s).map(drop),
            (Some(h), Some(x)) => match self.layout.rank_order() {
                RankOrder::RailMajor => {
                    let scratch = self.scratch(m * c, &s)?;
                    h.reduce_scatter(i, Dst::<T>::new(self.local_op(scratch, m * c)), op, s)?;
                    // SAFETY: M chunks of this rank's scratch; the checked output.
                    unsafe { x.reduce_scatter(T::DTYPE, op, scratch, op_, c / es, &s) }
                }
                RankOrder::DomainMajor => self.rs_domain_major::<T>((h, x), iv, op_, (c, op), s),
                RankOrder::Other => {
                    let n = self.layout.size();
                    let scratch = self.scratch(n * c, &s)?;
                    let all = self.local_op(scratch, n * c);
                    self.copy_into(T::DTYPE, &iv, &all, 0, &s)?;
                    self.all_reduce_op(T::DTYPE, all, op, s)?;
                    let r = self.layout.rank();
                    let mine = self.local_op(scratch + (r * c) as u64, c);
                    self.copy_into(T::DTYPE, &mine, &ov, 0, &s)
                }
            },
        }
    }

    /// All-gather in place: `buf` holds N chunks; rank r's chunk r goes to every rank.
    ///
    /// - domains of one GPU: one cross-domain all-gather; one domain: the domain's;
    /// - rail-major ranks: the rail's all-gather into rail l's M chunks (in place), then the
    ///   domain's all-gather of the whole buffer;
    /// - domain-major ranks: the rail's all-gather of chunk r into M chunks of scratch, then M
    ///   domain all-gathers from the scratch into the domains' blocks;
    /// - [`RankOrder::Other`]: every chunk but this rank's zeroed, then the hierarchical
    ///   allreduce (sum) of the whole buffer (a -0.0 comes back as +0.0).
    pub fn all_gather_in_place<'d, 'x, T: Element>(
        &self,
        buf: impl IntoDst<'d, T>,
        stream: impl IntoStream<'x>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let on = stream.into_stream(&self.device)?;
        let (b, s) = (buf.into_dst(&on, "buf")?, on.stream());
        let es = T::DTYPE.size();
        let (bv, p) = self.view(&b.operand(), "buf", es)?;
        let c = self.chunk(&bv, es, "buf")?;
        self.check_stream(&s)?;
        let (r, l) = (self.layout.rank(), self.layout.local_index());
        let (m, d) = (self.layout.domain_count(), self.layout.domain_size());
        if c == 0 {
            return Ok(());
        }
        let h = self.handle()?;
        match (&h, self.cross.as_deref()) {
            (None, Some(x)) => {
                // SAFETY: N chunks at p (checked); NCCL's in-place position.
                unsafe { x.all_gather(T::DTYPE, p + (r * c) as u64, p, c / es, &s) }
            }
            (None, None) => Ok(()),
            (Some(h), None) => h.all_gather_in_place(b, s).map(drop),
            (Some(h), Some(x)) => match self.layout.rank_order() {
                RankOrder::RailMajor => {
                    if bv.is_sym() {
                        // The rail writes this rank's symmetric buffer first: a domain call
                        // made before this one (an allreduce) may still read it.
                        self.fence(h, s)?;
                    }
                    let recv = p + (l * m * c) as u64;
                    // SAFETY: rail l's M chunks of the checked operand; chunk r = l·M + domain
                    // is NCCL's in-place position in them.
                    unsafe { x.all_gather(T::DTYPE, p + (r * c) as u64, recv, c / es, &s) }?;
                    h.all_gather_in_place(Dst::<T>::new(bv), s).map(drop)
                }
                RankOrder::DomainMajor => {
                    let scratch = self.scratch(m * c, &s)?;
                    // SAFETY: chunk r of the checked operand; M chunks of this rank's scratch.
                    unsafe { x.all_gather(T::DTYPE, p + (r * c) as u64, scratch, c / es, &s) }?;
                    for k in 0..m {
                        h.all_gather(
                            Src::<T>::new(self.local_op(scratch + (k * c) as u64, c)),
                            Dst::<T>::new(bv.sub(k * d * c, d * c)),
                            s,
                        )?;
                    }
                    Ok(())
                }
                RankOrder::Other => {
                    // Zero every chunk but this rank's (after a fence: earlier calls of the
                    // domain peers may read this buffer), then sum across the team.
                    self.fence(h, s)?;
                    zero_others(&s, (p, bv.len), c, r)?;
                    self.all_reduce_op(T::DTYPE, bv, ReduceOp::Sum, s)
                }
            },
        }
    }

    /// All-gather `input` (one chunk) into `output` (N chunks): the input lands in chunk r of
    /// the output, then [`HierCommunicator::all_gather_in_place`].
    pub fn all_gather<'s, 'd, 'x, T: Element>(
        &self,
        input: impl IntoSrc<'s, T>,
        output: impl IntoDst<'d, T>,
        stream: impl IntoStream<'x>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let on = stream.into_stream(&self.device)?;
        let (i, o, s) = (
            input.into_src(&on, "input")?,
            output.into_dst(&on, "output")?,
            on.stream(),
        );
        let es = T::DTYPE.size();
        let (iv, _) = self.view(&i.operand(), "input", es)?;
        let (ov, _) = self.view(&o.operand(), "output", es)?;
        let c = self.chunk(&ov, es, "output")?;
        // byte views: `len` is bytes
        if iv.len != c {
            return Err(Error::invalid(
                "input",
                format!("{} bytes; one chunk of the output is {c}", iv.len),
            ));
        }
        self.copy_into(T::DTYPE, &iv, &ov, self.layout.rank() * c, &s)?;
        self.all_gather_in_place(o, s)
    }
}

/// The hierarchical reductions compose a domain's reduction with the cross-domain one: an
/// average of averages is not the team's average in rank order, so it is refused.
fn no_avg(op: ReduceOp) -> Result<()> {
    if op == ReduceOp::Avg {
        return Err(Error::invalid(
            "op",
            "avg is not taken by the hierarchical communicator (sum, then divide by the team size)",
        ));
    }
    Ok(())
}

/// The domain's reduce-scatter in place, for a run-time element type.
fn rs_in_place_dyn(
    h: &RankHandle<'_>,
    dtype: DType,
    o: Operand<'_>,
    op: ReduceOp,
    s: StreamRef<'_>,
) -> Result<()> {
    match dtype {
        DType::F32 => h.reduce_scatter_in_place(Dst::<f32>::new(o), op, s),
        DType::F16 => h.reduce_scatter_in_place(Dst::<half::f16>::new(o), op, s),
        DType::Bf16 => h.reduce_scatter_in_place(Dst::<half::bf16>::new(o), op, s),
        DType::F64 => h.reduce_scatter_in_place(Dst::<f64>::new(o), op, s),
        DType::I32 => h.reduce_scatter_in_place(Dst::<i32>::new(o), op, s),
        DType::U32 => h.reduce_scatter_in_place(Dst::<u32>::new(o), op, s),
        DType::I64 => h.reduce_scatter_in_place(Dst::<i64>::new(o), op, s),
        DType::U64 => h.reduce_scatter_in_place(Dst::<u64>::new(o), op, s),
        DType::I8 => h.reduce_scatter_in_place(Dst::<i8>::new(o), op, s),
        DType::U8 => h.reduce_scatter_in_place(Dst::<u8>::new(o), op, s),
        DType::F8E4M3 => h.reduce_scatter_in_place(Dst::<float8::F8E4M3>::new(o), op, s),
        DType::F8E5M2 => h.reduce_scatter_in_place(Dst::<float8::F8E5M2>::new(o), op, s),
    }
    .map(drop)
}

/// The domain's all-gather in place, for a run-time element type.
fn ag_in_place_dyn(
    h: &RankHandle<'_>,
    dtype: DType,
    o: Operand<'_>,
    s: StreamRef<'_>,
) -> Result<()> {
    match dtype {
        DType::F32 => h.all_gather_in_place(Dst::<f32>::new(o), s),
        DType::F16 => h.all_gather_in_place(Dst::<half::f16>::new(o), s),
        DType::Bf16 => h.all_gather_in_place(Dst::<half::bf16>::new(o), s),
        // every other type moves as bits: as words of its size
        d => match d.size() {
            8 => h.all_gather_in_place(Dst::<u64>::new(o), s),
            4 => h.all_gather_in_place(Dst::<u32>::new(o), s),
            _ => h.all_gather_in_place(Dst::<u8>::new(o), s),
        },
    }
    .map(drop)
}
