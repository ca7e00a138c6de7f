//! [`RankHandle`]: every public collective of a rank, each a conversion of its borrowed views
//! into one [`Call`] handed to the funnel (`super::funnel`).

use cuda_multimem::{CallStream, Device, DeviceRepr, Error, IntoStream, Result};

use super::Communicator;
use crate::call::{A2aCounts, Arg, Call, Kind, NormArgs, QuantArgs};
use crate::fp8::{Fp8Out, Fp8Scales};
use crate::operand::{Dst, IntoDst, IntoSrc, Src};
use crate::team::Local;
use crate::types::{Choice, DType, Element, ReduceOp};

/// One rank's view of a [`Communicator`]: the calls that rank makes, on a stream of its device.
/// Every rank makes the same calls (sizes, types, operators, symmetric offsets) in the same order.
///
/// A rank's calls may take any stream of its device: a call on another stream than the rank's
/// previous call waits on the GPU for that call to finish (as NCCL orders a communicator's
/// work), so an engine can alternate a communication stream and its compute stream without
/// blocking the host; inside a graph capture the graph's order holds. Its calls from several
/// threads queue their work one whole call after another (each call holds the rank's lock while
/// it queues); which of two concurrent calls goes first is up to the threads, and every rank
/// must see the same order.
#[derive(Clone, Copy)]
pub struct RankHandle<'a> {
    pub(crate) comm: &'a Communicator,
    pub(crate) local: &'a Local,
}

impl std::fmt::Debug for RankHandle<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RankHandle(rank {} of {}, device {})",
            self.local.rank,
            self.comm.size(),
            self.local.device.ordinal()
        )
    }
}

/// A byte view's length must be a whole number of `dtype` elements (the `_dyn` calls).
fn whole<T>(len: usize, dtype: DType, arg: &'static str) -> Result<()> {
    if std::mem::size_of::<T>() == 1 && len % dtype.size() != 0 {
        return Err(Error::invalid(
            arg,
            format!(
                "{len} bytes; not a whole number of {}-byte {dtype}",
                dtype.size()
            ),
        ));
    }
    Ok(())
}

/// The kernel type an all-gather or broadcast moves `T` as ([`DType::carrier_of`]).
fn carrier<T>() -> Result<DType> {
    DType::carrier_of::<T>().ok_or_else(|| {
        Error::invalid(
            "T",
            format!(
                "{} is zero-sized: nothing to move",
                std::any::type_name::<T>()
            ),
        )
    })
}

impl<'a> RankHandle<'a> {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.local.rank
    }

    /// Its device.
    pub fn device(&self) -> &'a Device {
        &self.local.device
    }

    /// Report a timeout or a disagreement seen by this rank's earlier calls (synchronise its
    /// stream first), as [`Communicator::check`] does for every rank of this process: for a
    /// thread per rank. This rank's own failure comes first; without one, an earlier failure of
    /// the team is [`Error::Unusable`]. After an error the team refuses further calls.
    pub fn check(&self) -> Result<()> {
        let inner = &*self.comm.inner;
        match inner.rank_error(self.local)? {
            Some(e) => Err(inner.ranks.break_with(e)),
            None => inner.ranks.usable(),
        }
    }

    /// Allreduce `input` into `output` with `op`, queued on `stream` (a stream of this rank's
    /// device: our [`cuda_multimem::Stream`] as `&stream`, any [`cuda_multimem::StreamRef`], or
    /// a cudarc `&CudaStream` with the feature `cudarc`). Operands: symmetric buffers and
    /// views, or the caller's own memory (one-shot directly up to the one-shot limit, above it
    /// through the scratch; see [`crate::Choice::staged_chunks`]) — a [`cuda_multimem::DeviceBuffer`],
    /// a cudarc slice or view, or an engine's tensor type ([`IntoSrc`], [`IntoDst`]). What an
    /// operand keeps alive for the call (cudarc's guards) is dropped when the call returns,
    /// after its work is queued. Returns what ran.
    pub fn all_reduce<'s, 'd, 'x, T: Element>(
        &self,
        input: impl IntoSrc<'s, T>,
        output: impl IntoDst<'d, T>,
        op: ReduceOp,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let (i, o) = (
            input.into_src(&on, "input")?,
            output.into_dst(&on, "output")?,
        );
        self.run(
            Call::collective(
                Kind::AllReduce,
                T::DTYPE,
                op,
                0,
                Some(i.operand()),
                o.operand(),
            ),
            on.stream(),
        )
    }

    /// Allreduce `buf` in place.
    pub fn all_reduce_in_place<'d, 'x, T: Element>(
        &self,
        buf: impl IntoDst<'d, T>,
        op: ReduceOp,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let b = buf.into_dst(&on, "buf")?;
        self.run(
            Call::collective(Kind::AllReduce, T::DTYPE, op, 0, None, b.operand()),
            on.stream(),
        )
    }

    /// [`RankHandle::all_reduce`] for engines that know the element type only at run time:
    /// byte views (`SymmetricBuffer<u8>`, `DeviceBuffer<u8>`, ...) whose lengths must be a
    /// whole number of `dtype` elements and whose addresses must be aligned to it.
    pub fn all_reduce_dyn<'s, 'd, 'x>(
        &self,
        dtype: DType,
        input: impl IntoSrc<'s, u8>,
        output: impl IntoDst<'d, u8>,
        op: ReduceOp,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let (i, o) = (
            input.into_src(&on, "input")?,
            output.into_dst(&on, "output")?,
        );
        whole::<u8>(i.operand().len, dtype, "input")?;
        whole::<u8>(o.operand().len, dtype, "output")?;
        self.run(
            Call::collective(
                Kind::AllReduce,
                dtype,
                op,
                0,
                Some(i.operand()),
                o.operand(),
            ),
            on.stream(),
        )
    }

    /// [`RankHandle::all_reduce_dyn`] in place.
    pub fn all_reduce_dyn_in_place<'d, 'x>(
        &self,
        dtype: DType,
        buf: impl IntoDst<'d, u8>,
        op: ReduceOp,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let b = buf.into_dst(&on, "buf")?;
        whole::<u8>(b.operand().len, dtype, "buf")?;
        self.run(
            Call::collective(Kind::AllReduce, dtype, op, 0, None, b.operand()),
            on.stream(),
        )
    }

    /// Reduce-scatter: `input` holds N chunks of `count` elements (N the team size), `output`
    /// `count` elements; rank r's output becomes the reduction with `op` of chunk r of every
    /// rank's input, in rank order (16-bit types accumulated in f32, rounded once: the same bits
    /// as [`crate::testing::reduce_scatter_reference`]). Operands: symmetric buffers and views or the
    /// caller's own memory, either way with no copies outside the kernel. Queued on `stream`, a
    /// stream of this rank's device; returns what ran.
    ///
    /// On the multimem path ([`crate::Path::Multimem`]: a multicast team, the policy's
    /// size rule, and a `multimem.ld_reduce` form of the type and operator — f32 only adds),
    /// the switch reduces in an order of its own: sums may differ from the reference in the
    /// last bits (min and max are exact), and the operands are copied through the team's
    /// regions ([`crate::Choice::staged_chunks`] windows). The same holds for all-gather and
    /// broadcast, which move bits on either path.
    pub fn reduce_scatter<'s, 'd, 'x, T: Element>(
        &self,
        input: impl IntoSrc<'s, T>,
        output: impl IntoDst<'d, T>,
        op: ReduceOp,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let (i, o) = (
            input.into_src(&on, "input")?,
            output.into_dst(&on, "output")?,
        );
        self.run(
            Call::collective(
                Kind::ReduceScatter,
                T::DTYPE,
                op,
                0,
                Some(i.operand()),
                o.operand(),
            ),
            on.stream(),
        )
    }

    /// Reduce-scatter in place: `buf` holds N chunks of `count` elements; the result lands in
    /// chunk r of rank r's `buf` (as NCCL's in-place form, recvbuff = sendbuff + rank·count);
    /// the other chunks keep this rank's input.
    pub fn reduce_scatter_in_place<'d, 'x, T: Element>(
        &self,
        buf: impl IntoDst<'d, T>,
        op: ReduceOp,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let b = buf.into_dst(&on, "buf")?;
        self.run(
            Call::collective(Kind::ReduceScatter, T::DTYPE, op, 0, None, b.operand()),
            on.stream(),
        )
    }

    /// All-gather: `input` holds `count` elements, `output` N chunks of `count`; chunk k of
    /// every rank's output becomes rank k's input. Up to [`crate::CommConfig::gather_ll_max_bytes`] of
    /// output, every rank's words travel with the call's flag into its peers' low-latency slots
    /// and each copies them out as they arrive, with no barrier ([`crate::Algorithm::PushLl`]).
    /// Above it, with a symmetric output above the one-shot limit, the ranks store straight
    /// into each other's outputs ([`crate::Algorithm::PushDirect`]); otherwise (the caller's own
    /// output, or medium messages) every rank pushes its input into its peers' staging slots
    /// and each copies out locally ([`crate::Algorithm::PushStaged`]: one extra local write and
    /// read of the message, no extra launches).
    ///
    /// Any [`DeviceRepr`] element type (token ids, `u8`, FP8, an engine's own records): the
    /// call moves bits, as words of the element's carrier ([`DType::carrier`]: 4-byte words
    /// for `i32`/`i64`/`f64`/..., 2-byte for 2-aligned types, bytes for the rest), through
    /// the same forms and choices as any type of that word size. A zero-sized `T` is refused.
    pub fn all_gather<'s, 'd, 'x, T: DeviceRepr>(
        &self,
        input: impl IntoSrc<'s, T>,
        output: impl IntoDst<'d, T>,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let (i, o) = (
            input.into_src(&on, "input")?,
            output.into_dst(&on, "output")?,
        );
        self.run(
            Call::collective(
                Kind::AllGather,
                carrier::<T>()?,
                ReduceOp::Sum,
                0,
                Some(i.operand()),
                o.operand(),
            ),
            on.stream(),
        )
    }

    /// All-gather in place: `buf` holds N chunks of `count` elements, rank r's contribution
    /// already in its chunk r.
    pub fn all_gather_in_place<'d, 'x, T: DeviceRepr>(
        &self,
        buf: impl IntoDst<'d, T>,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let b = buf.into_dst(&on, "buf")?;
        self.run(
            Call::collective(
                Kind::AllGather,
                carrier::<T>()?,
                ReduceOp::Sum,
                0,
                None,
                b.operand(),
            ),
            on.stream(),
        )
    }

    /// Broadcast: every rank's `output` becomes rank `root`'s `input` (the same length on
    /// every rank; read on the root only, but checked everywhere). Staged or direct as
    /// [`RankHandle::all_gather`], for any [`DeviceRepr`] element type as it.
    pub fn broadcast<'s, 'd, 'x, T: DeviceRepr>(
        &self,
        input: impl IntoSrc<'s, T>,
        output: impl IntoDst<'d, T>,
        root: usize,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let (i, o) = (
            input.into_src(&on, "input")?,
            output.into_dst(&on, "output")?,
        );
        self.run(
            Call::collective(
                Kind::Broadcast,
                carrier::<T>()?,
                ReduceOp::Sum,
                root,
                Some(i.operand()),
                o.operand(),
            ),
            on.stream(),
        )
    }

    /// Broadcast in place: every rank's `buf` becomes rank `root`'s.
    pub fn broadcast_in_place<'d, 'x, T: DeviceRepr>(
        &self,
        buf: impl IntoDst<'d, T>,
        root: usize,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let b = buf.into_dst(&on, "buf")?;
        self.run(
            Call::collective(
                Kind::Broadcast,
                carrier::<T>()?,
                ReduceOp::Sum,
                root,
                None,
                b.operand(),
            ),
            on.stream(),
        )
    }

    /// All-to-all of equal parts, queued on `stream`: `input` holds N parts of `len / N`
    /// elements, and part k of rank r's input becomes part r of rank k's output (`output` as
    /// long as `input`). Any element type (the kernels move bytes: `u8`, `i32`, `f32`, bf16,
    /// FP8 as `u8`, …). Operands: symmetric buffers or the caller's own memory; small calls run
    /// the low-latency form ([`crate::Algorithm::AllToAllLl`]), larger ones store straight into
    /// a symmetric output, or land in the communicator's scratch and are copied out
    /// ([`crate::Algorithm::AllToAllDirect`]). Every rank passes the same lengths. Returns what
    /// ran. Protocol: `docs/design/alltoall.md`.
    pub fn all_to_all<'s, 'd, 'x, T: DeviceRepr>(
        &self,
        input: impl IntoSrc<'s, T>,
        output: impl IntoDst<'d, T>,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let (i, o) = (
            input.into_src(&on, "input")?,
            output.into_dst(&on, "output")?,
        );
        self.run(
            Call::all_to_all(
                std::mem::size_of::<T>(),
                A2aCounts::Equal,
                Some(i.operand()),
                o.operand(),
            ),
            on.stream(),
        )
    }

    /// All-to-all of equal parts in place: part k of rank r's `buf` becomes part r of rank k's
    /// `buf` (above the low-latency limit through the communicator's scratch).
    pub fn all_to_all_in_place<'d, 'x, T: DeviceRepr>(
        &self,
        buf: impl IntoDst<'d, T>,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let b = buf.into_dst(&on, "buf")?;
        self.run(
            Call::all_to_all(
                std::mem::size_of::<T>(),
                A2aCounts::Equal,
                None,
                b.operand(),
            ),
            on.stream(),
        )
    }

    /// All-to-all with counts and offsets per peer given on the host (in elements; MPI's
    /// `Alltoallv`): `send_counts[k]` elements from `input[send_offsets[k]..]` go to rank k,
    /// where they land at `output[recv_offsets[r]..]` of rank k, which expects
    /// `recv_counts[r]` of them. Each slice has one entry per rank. Checked before launch: the
    /// slices' lengths, every part inside its buffer, the received parts apart, input and
    /// output apart. Each rank's counts must match what its peers expect: a mismatch is found
    /// on the device (the receiver's error word: [`RankHandle::check`] reports it, and the
    /// part is not written). Every rank passes the same buffer lengths. Out of place only.
    /// The counts travel with the kernels' parameters (graph capture takes them by value).
    #[allow(clippy::too_many_arguments)]
    pub fn all_to_all_v<'s, 'd, 'x, T: DeviceRepr>(
        &self,
        input: impl IntoSrc<'s, T>,
        output: impl IntoDst<'d, T>,
        send_counts: &[usize],
        send_offsets: &[usize],
        recv_counts: &[usize],
        recv_offsets: &[usize],
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let (i, o) = (
            input.into_src(&on, "input")?,
            output.into_dst(&on, "output")?,
        );
        self.run(
            Call::all_to_all(
                std::mem::size_of::<T>(),
                A2aCounts::Host {
                    send_counts,
                    send_offsets,
                    recv_counts,
                    recv_offsets,
                },
                Some(i.operand()),
                o.operand(),
            ),
            on.stream(),
        )
    }

    /// All-to-all with the send counts in device memory (so that a captured graph needs no
    /// host synchronisation): `send_counts` (`u64[N]`, elements) says how many elements go to
    /// each rank, taken from `input` packed in rank order; the kernel writes how many arrived
    /// from each rank into `recv_counts` (`u64[N]`) and where they start in `output` into
    /// `recv_offsets` (`u64[N]`: packed in sender order). Counts the device finds out of range
    /// (a part past the end of the input, the received parts past the end of the output) are
    /// not moved: their receive count reads 0 and the error word says so
    /// ([`RankHandle::check`], [`crate::Communicator::check`]); nothing is written outside the
    /// buffers. Every rank passes the same buffer lengths. Out of place only.
    pub fn all_to_all_v_dev<'s, 'd, 'c, 'r, 'f, 'x, T: DeviceRepr>(
        &self,
        input: impl IntoSrc<'s, T>,
        output: impl IntoDst<'d, T>,
        send_counts: impl IntoSrc<'c, u64>,
        recv_counts: impl IntoDst<'r, u64>,
        recv_offsets: impl IntoDst<'f, u64>,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let (i, o) = (
            input.into_src(&on, "input")?,
            output.into_dst(&on, "output")?,
        );
        let sc = send_counts.into_src(&on, "send_counts")?;
        let rc = recv_counts.into_dst(&on, "recv_counts")?;
        let ro = recv_offsets.into_dst(&on, "recv_offsets")?;
        self.run(
            Call::all_to_all(
                std::mem::size_of::<T>(),
                A2aCounts::Device {
                    send_counts: Arg::new(sc.operand(), "send_counts"),
                    recv_counts: Arg::new(rc.operand(), "recv_counts"),
                    recv_offsets: Arg::new(ro.operand(), "recv_offsets"),
                },
                Some(i.operand()),
                o.operand(),
            ),
            on.stream(),
        )
    }

    /// Fused allreduce + residual add + RMSNorm, queued on `stream`: with `x` this rank's
    /// partial sums (`tokens × hidden`), `residual` holding r on entry, per row
    ///
    /// `residual_out = allreduce_sum(x) + r` (written into `residual`), and
    /// `out = residual_out / sqrt(mean(residual_out²) + eps) · weight`.
    ///
    /// The sum is accumulated in f32 in rank order, r added in f32, residual_out rounded once
    /// to `T`; the norm reads the rounded residual_out ([`crate::testing::add_rms_norm_reference`] rounds
    /// at the same points: residual_out is bit-exact, `out` within the sum-of-squares order).
    /// Every rank passes the same r and weight (replicated, as in tensor parallelism).
    /// Operands: symmetric buffers or the caller's own memory alike, used in place (the data
    /// travel through the communicator's staging). `out` may be `x` itself (the same range);
    /// no other operands may overlap. Checked before any launch: lengths (`x`, `residual`,
    /// `out` of `tokens × hidden`, `weight` of `hidden`), `hidden` > 0, `eps` finite and ≥ 0,
    /// element alignment, devices, the stream. Returns the form and launch shape.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_add_rms_norm<'s, 'r, 'w, 'o, 'x, T: Element>(
        &self,
        x: impl IntoSrc<'s, T>,
        residual: impl IntoDst<'r, T>,
        weight: impl IntoSrc<'w, T>,
        out: impl IntoDst<'o, T>,
        hidden: usize,
        eps: f32,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let ops = NormOperands::new(x, residual, weight, out, &on)?;
        self.run(ops.call(Kind::Norm, hidden, eps), on.stream())
    }

    /// The unfused baseline: residual add + RMSNorm of an already reduced `x` (what an engine
    /// runs after a plain allreduce), on this rank's device only (any stream of it), with the
    /// rounding points and checks of [`RankHandle::all_reduce_add_rms_norm`]. One block per row.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm<'s, 'r, 'w, 'o, 'x, T: Element>(
        &self,
        x: impl IntoSrc<'s, T>,
        residual: impl IntoDst<'r, T>,
        weight: impl IntoSrc<'w, T>,
        out: impl IntoDst<'o, T>,
        hidden: usize,
        eps: f32,
        stream: impl IntoStream<'x>,
    ) -> Result<()> {
        let on = stream.into_stream(self.device())?;
        let ops = NormOperands::new(x, residual, weight, out, &on)?;
        self.run(ops.call(Kind::LocalNorm, hidden, eps), on.stream())
            .map(drop)
    }

    /// [`RankHandle::all_reduce_add_rms_norm`] writing the normalised rows as FP8 e4m3 for the
    /// next FP8 GEMM: `out` says where the e4m3 rows go (`tokens × hidden`), how they are
    /// scaled — a static per-tensor scale, dynamic per-token scales (`amax / 448`), or
    /// per-group-of-128 scales as f32 or packed UE8M0 (DeepGEMM's layout) — and, with
    /// [`Fp8Out::with_unquantised`], the `T` rows beside them. residual is written as by the
    /// plain norm. Every quantised element is `e4m3(y / scale)`, `y` the plain norm's `T`
    /// output (so the FP8 rows are what a separate quantisation of that output gives, bit for
    /// bit): `docs/design/rmsnorm.md` ("FP8 outputs") says where it rounds and what NaN, ±∞
    /// and all-zero rows give ([`crate::testing::add_rms_norm_fp8_reference`] computes it on the host).
    ///
    /// Checked besides the plain norm's checks, before any launch: `out` of `tokens × hidden`,
    /// `scales` of [`crate::Fp8Scaling::scales_len`] elements, `unquantised` of `tokens × hidden`,
    /// a static `scale` finite and > 0, `hidden` a multiple of 128 (at most 65536) for the
    /// grouped scales, `x`, `residual`, `weight` and `unquantised` 4-byte aligned, no overlaps
    /// (but `unquantised` may be `x` itself). The form is chosen as for the plain norm among the
    /// one-shots, split or not (the two-shot's FP8 entries are not written yet: the barrier
    /// one-shot runs there): [`Communicator::add_rms_norm_fp8_choice`] reports it.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_add_rms_norm_fp8<'s, 'r, 'w, 'o, 'x, T: Element>(
        &self,
        x: impl IntoSrc<'s, T>,
        residual: impl IntoDst<'r, T>,
        weight: impl IntoSrc<'w, T>,
        out: Fp8Out<'o, T>,
        hidden: usize,
        eps: f32,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let ops = NormOperands::new(x, residual, weight, out.out, &on)?;
        let q = Fp8Operands::new(out.scales, out.unquantised, &on)?;
        self.run(q.call(ops.call(Kind::Norm, hidden, eps)), on.stream())
    }

    /// The local (unfused) [`RankHandle::add_rms_norm`] with the FP8 output of
    /// [`RankHandle::all_reduce_add_rms_norm_fp8`]: the same rounding points, scales and
    /// checks, on this rank's device only.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm_fp8<'s, 'r, 'w, 'o, 'x, T: Element>(
        &self,
        x: impl IntoSrc<'s, T>,
        residual: impl IntoDst<'r, T>,
        weight: impl IntoSrc<'w, T>,
        out: Fp8Out<'o, T>,
        hidden: usize,
        eps: f32,
        stream: impl IntoStream<'x>,
    ) -> Result<()> {
        let on = stream.into_stream(self.device())?;
        let ops = NormOperands::new(x, residual, weight, out.out, &on)?;
        let q = Fp8Operands::new(out.scales, out.unquantised, &on)?;
        self.run(q.call(ops.call(Kind::LocalNorm, hidden, eps)), on.stream())
            .map(drop)
    }

    /// The standalone FP8 quantisation, on this rank's device only (any stream of it): the
    /// rows of `x` (`tokens × hidden` elements of `T`) written as e4m3 into `out` with its
    /// scales, exactly as the FP8 norms quantise their normalised rows (the same amax, scale
    /// and rounding: `docs/design/rmsnorm.md`, "FP8 outputs"; [`crate::testing::fp8_quantise`] is the
    /// host reference, bit for bit). What an engine runs after a bf16 norm when its norm does
    /// not quantise (the unfused baseline of [`RankHandle::all_reduce_add_rms_norm_fp8`]). One
    /// block per row. Checked before launch as the FP8 norms' outputs are (lengths, the scales'
    /// length and type, hidden a multiple of the group for the grouped scalings, a finite
    /// static scale > 0, 4-byte aligned operands, no overlap); `out` must not ask for the
    /// unquantised rows (they are `x`).
    pub fn quantize_fp8<'s, 'o, 'x, T: Element>(
        &self,
        x: impl IntoSrc<'s, T>,
        out: Fp8Out<'o, T>,
        hidden: usize,
        stream: impl IntoStream<'x>,
    ) -> Result<()> {
        if out.unquantised.is_some() {
            return Err(Error::invalid(
                "out",
                "quantize_fp8 writes no unquantised rows (they are x itself): drop with_unquantised",
            ));
        }
        let on = stream.into_stream(self.device())?;
        let x = x.into_src(&on, "x")?;
        let q = out.out.into_dst(&on, "out")?;
        let fp8 = Fp8Operands::<T>::new(out.scales, None, &on)?;
        let call = Call {
            kind: Kind::LocalNorm,
            dtype: T::DTYPE,
            op: ReduceOp::Sum,
            root: 0,
            input: Some(Arg::new(x.operand(), "x")),
            output: Arg::new(q.operand(), "out"),
            residual: None,
            weight: None,
            norm: Some(NormArgs { hidden, eps: 0.0 }),
            a2a: None,
            quant: None,
            moe: None,
        };
        self.run(fp8.call(call), on.stream()).map(drop)
    }
}

/// An FP8 norm call's own operands, converted for the call's stream.
struct Fp8Operands<'g, T> {
    scaling: crate::types::Fp8Scaling,
    scale: f32,
    scales: Option<ScalesDst<'g>>,
    unquantised: Option<Dst<'g, T>>,
}

/// The scales buffer: f32 or UE8M0 packs.
enum ScalesDst<'g> {
    F32(Dst<'g, f32>),
    U32(Dst<'g, u32>),
}

impl<'g, T: Element> Fp8Operands<'g, T> {
    fn new<'o>(
        scales: Fp8Scales<'o>,
        unquantised: Option<Dst<'o, T>>,
        on: &CallStream<'g>,
    ) -> Result<Self>
    where
        'o: 'g,
    {
        let scaling = scales.scaling();
        let (scale, scales) = match scales {
            Fp8Scales::Static(v) => (v, None),
            Fp8Scales::PerToken(d) | Fp8Scales::PerGroup(d) => {
                (0.0, Some(ScalesDst::F32(d.into_dst(on, "scales")?)))
            }
            Fp8Scales::PerGroupUe8m0(d) => (0.0, Some(ScalesDst::U32(d.into_dst(on, "scales")?))),
        };
        Ok(Fp8Operands {
            scaling,
            scale,
            scales,
            unquantised: unquantised
                .map(|u| u.into_dst(on, "unquantised"))
                .transpose()?,
        })
    }

    /// `call` with this FP8 output.
    fn call<'c>(&'c self, mut call: Call<'c>) -> Call<'c> {
        call.quant = Some(QuantArgs {
            scaling: self.scaling,
            scale: self.scale,
            scales: self.scales.as_ref().map(|s| {
                Arg::new(
                    match s {
                        ScalesDst::F32(d) => d.operand(),
                        ScalesDst::U32(d) => d.operand(),
                    },
                    "scales",
                )
            }),
            unquantised: self
                .unquantised
                .as_ref()
                .map(|u| Arg::new(u.operand(), "unquantised")),
        });
        call
    }
}

/// A norm call's four operands, converted for the call's stream (held until it returns).
struct NormOperands<'g, T, O = T> {
    x: Src<'g, T>,
    residual: Dst<'g, T>,
    weight: Src<'g, T>,
    out: Dst<'g, O>,
}

impl<'g, T: Element, O> NormOperands<'g, T, O> {
    fn new<'s, 'r, 'w, 'o>(
        x: impl IntoSrc<'s, T>,
        residual: impl IntoDst<'r, T>,
        weight: impl IntoSrc<'w, T>,
        out: impl IntoDst<'o, O>,
        on: &CallStream<'g>,
    ) -> Result<Self>
    where
        's: 'g,
        'r: 'g,
        'w: 'g,
        'o: 'g,
    {
        Ok(NormOperands {
            x: x.into_src(on, "x")?,
            residual: residual.into_dst(on, "residual")?,
            weight: weight.into_src(on, "weight")?,
            out: out.into_dst(on, "out")?,
        })
    }

    /// The call's description, borrowing the operands (and what they keep alive).
    fn call(&self, kind: Kind, hidden: usize, eps: f32) -> Call<'_> {
        Call {
            kind,
            dtype: T::DTYPE,
            op: ReduceOp::Sum,
            root: 0,
            input: Some(Arg::new(self.x.operand(), "x")),
            output: Arg::new(self.out.operand(), "out"),
            residual: Some(Arg::new(self.residual.operand(), "residual")),
            weight: Some(Arg::new(self.weight.operand(), "weight")),
            norm: Some(NormArgs { hidden, eps }),
            a2a: None,
            quant: None,
            moe: None,
        }
    }
}
