//! The vocabulary of the collectives: element types, reduction operators, paths, algorithms and
//! the choice a call reports.

use half::{bf16, f16};

/// Element types, for engines that know theirs only at run time ([`crate::RankHandle::all_reduce_dyn`]).
///
/// What takes which type:
///
/// | collective | types | operators |
/// | --- | --- | --- |
/// | allreduce, reduce-scatter (and `_dyn`) | f32, f16, bf16 (accumulated in f32 in rank order, rounded once to nearest even) | every [`ReduceOp`] |
/// | fused norm | f32, f16, bf16 | — |
/// | all-gather, broadcast | any [`cuda_multimem::DeviceRepr`] type (integers, f64, FP8, records), moved as bits in words of its [`DType::carrier`] | — |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half (accumulated in f32).
    F16,
    /// bfloat16 (accumulated in f32).
    Bf16,
    /// 8-bit unsigned integer. Moved by all-gather and broadcast (it carries every element
    /// type whose size or alignment is odd: see [`DType::carrier`]); not reduced.
    U8,
}

impl DType {
    /// The types every collective takes, the reductions and the fused norm included: f32,
    /// f16 and bf16. ([`DType::U8`] is moved by all-gather and broadcast only.)
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

    /// The kernel types the bit-moving collectives (all-gather, broadcast) run any element
    /// type as ([`DType::carrier`]): 4-byte, 2-byte and 1-byte words.
    pub const CARRIERS: [DType; 3] = [DType::F32, DType::F16, DType::U8];

    /// The type an all-gather or broadcast of elements of `size` bytes aligned to `align`
    /// moves them as: words of the largest of 4, 2 and 1 bytes that divides both (f32 for
    /// 4-byte words, f16 for 2-byte ones: those kernels move bits, never convert them; u8
    /// for the rest), so any [`cuda_multimem::DeviceRepr`] type travels as whole words of
    /// itself. `None` for a zero-sized type.
    pub fn carrier(size: usize, align: usize) -> Option<DType> {
        if size == 0 {
            return None;
        }
        let g = size | align.max(1);
        Some(if g % 4 == 0 {
            DType::F32
        } else if g % 2 == 0 {
            DType::F16
        } else {
            DType::U8
        })
    }

    /// [`DType::carrier`] of `T` (`None`: zero-sized).
    pub fn carrier_of<T>() -> Option<DType> {
        DType::carrier(std::mem::size_of::<T>(), std::mem::align_of::<T>())
    }

    /// Whether the reductions (allreduce, reduce-scatter) and the fused norm take this type.
    pub fn reduces(self) -> bool {
        DType::ALL.contains(&self)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::U8 => 1,
        }
    }

    /// Short name (`f32`, `f16`, `bf16`, `u8`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::U8 => "u8",
        }
    }

    /// The value of `bits` (the element's little-endian bits in the low bytes) as f32.
    pub fn decode(self, bits: u32) -> f32 {
        match self {
            DType::F32 => f32::from_bits(bits),
            DType::F16 => f16::from_bits(bits as u16).to_f32(),
            DType::Bf16 => bf16::from_bits(bits as u16).to_f32(),
            DType::U8 => (bits as u8) as f32,
        }
    }

    /// `v` rounded to this type (round to nearest even, as `cvt.rn`; u8: truncated toward zero
    /// and saturated, NaN 0), as bits.
    pub fn encode(self, v: f32) -> u32 {
        match self {
            DType::F32 => v.to_bits(),
            DType::F16 => f16::from_f32(v).to_bits() as u32,
            DType::Bf16 => bf16::from_f32(v).to_bits() as u32,
            DType::U8 => v as u8 as u32,
        }
    }

    /// Element `i` of raw little-endian `data`, as f32.
    ///
    /// # Panics
    /// If `data` holds fewer than `i + 1` elements.
    pub fn load(self, data: &[u8], i: usize) -> f32 {
        let s = self.size();
        let mut b = [0u8; 4];
        b[..s].copy_from_slice(&data[i * s..i * s + s]);
        self.decode(u32::from_le_bytes(b))
    }

    /// Append `v`, rounded to this type, to raw little-endian `out`.
    pub fn store(self, out: &mut Vec<u8>, v: f32) {
        out.extend_from_slice(&self.encode(v).to_le_bytes()[..self.size()]);
    }

    pub(crate) fn code(self) -> u64 {
        self as u64
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An element type the collectives reduce: `f32`, [`half::f16`] or [`half::bf16`] (16-bit types
/// are converted to f32, reduced, and rounded once to nearest even).
pub trait Element:
    cuda_multimem::DeviceRepr + sealed::Sealed + PartialEq + std::fmt::Debug
{
    /// The run-time type.
    const DTYPE: DType;
    /// The value as f32.
    fn to_f32(self) -> f32;
    /// `v` rounded to this type (round to nearest even).
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// Reduction operators.
///
/// What each path guarantees for [`ReduceOp::Sum`] (floating-point addition is not associative):
/// the peer-to-peer path adds in rank order 0, 1, ..., N-1 on every rank, so every rank gets
/// bit-identical results, run to run, equal to [`crate::reference`]. The multimem path lets the
/// NVLink switch add, in an order it chooses: the result may differ from the rank-order
/// reference in the last bits (the simulator adds in a shuffled order so code that assumes
/// otherwise fails there too); its one-shot form reduces on every rank separately, so ranks may
/// differ from each other in the last bits; its two-shot form reduces each part once and stores
/// it to every rank, so ranks agree. [`ReduceOp::Min`] and [`ReduceOp::Max`] are exact everywhere.
/// [`ReduceOp::Prod`] and [`ReduceOp::Avg`] run peer-to-peer only (`multimem.ld_reduce` has
/// neither), in rank order as the sum: bit-identical on every rank and equal to the reference.
/// Their allreduce has no write-only two-shot forms: above the one-shot limit it runs
/// [`Algorithm::TwoShot`] (the caller's own memory staged through the scratch), reported in
/// the [`Choice`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (see the type's documentation for the order).
    Sum,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Product (`mul.rn.f32` in rank order, as [`ReduceOp::Sum`] adds).
    Prod,
    /// Average: the sum in rank order (as [`ReduceOp::Sum`], accumulated in f32), divided by
    /// the team size in f32 (`div.rn.f32`, correctly rounded), then rounded once to the type.
    Avg,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Prod,
        ReduceOp::Avg,
    ];

    /// Short name (`sum`, `min`, `max`, `prod`, `avg`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Prod => "prod",
            ReduceOp::Avg => "avg",
        }
    }

    /// The value after combining every rank's (`acc`, in f32) on a team of `n`, before it is
    /// rounded to the type: `acc / n` for [`ReduceOp::Avg`] (`div.rn.f32`), `acc` otherwise.
    pub fn finish(self, acc: f32, n: usize) -> f32 {
        match self {
            ReduceOp::Avg => acc / n as f32,
            _ => acc,
        }
    }

    /// Apply to two f32 values, exactly as the kernels do (`add.rn.f32` for sum and average,
    /// `mul.rn.f32`, `min.f32`, `max.f32`: a NaN operand yields the other one; -0 is below +0);
    /// an average is then [`ReduceOp::finish`]ed.
    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Min => {
                if a.is_nan() {
                    b
                } else if b.is_nan() || a < b || (a == b && a.is_sign_negative()) {
                    a
                } else {
                    b
                }
            }
            ReduceOp::Max => {
                if a.is_nan() {
                    b
                } else if b.is_nan() || a > b || (a == b && b.is_sign_negative()) {
                    a
                } else {
                    b
                }
            }
        }
    }

    pub(crate) fn code(self) -> u64 {
        self as u64
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How the data travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// Loads and stores through peer mappings (NVLink P2P).
    PeerToPeer,
    /// `multimem` loads, stores and reductions through a multicast address (NVLink SHARP).
    Multimem,
    /// Nothing travels: a team of one rank (a local copy, or nothing in place).
    Local,
}

impl std::fmt::Display for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Path::PeerToPeer => "peer-to-peer",
            Path::Multimem => "multimem",
            Path::Local => "local",
        })
    }
}

/// Which algorithm: each belongs to one family of collectives ([`Algorithm::collectives`]), so
/// a reported choice names what ran. [`crate::CommConfig::algorithm`] forces an allreduce form
/// (and maps onto the fused norm's: docs/design/rmsnorm.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Each rank reduces the whole message (small messages; one barrier). Reads only the local
    /// input and writes only the local output, so it serves the caller's own memory as it is.
    OneShot,
    /// Each rank reduces 1/N of the message, reading every rank's input, and stores it on every
    /// rank (symmetric operands only; the fallback for operands not 16-byte aligned).
    TwoShot,
    /// One-shot with the low-latency protocol (small messages): data travel with a flag in
    /// 8-byte stores, receivers poll the data, no barrier. Needs 4-byte aligned operands and a
    /// whole number of 4-byte words; otherwise the call runs [`Algorithm::OneShot`].
    OneShotLl,
    /// Two-shot whose remote traffic is only posted writes: each rank pushes the parts of its
    /// input to their owners' staging, owners reduce locally and push the results, in rounds
    /// through fixed-size staging slots ([`crate::CommConfig::stage_bytes`]). The default above
    /// the one-shot limit. Needs 16-byte aligned operands; otherwise [`Algorithm::TwoShot`].
    TwoShotPush,
    /// Two-shot whose first half goes through the copy engines (`cuMemcpyDtoDAsync` into the
    /// peers' landing areas), then a kernel that reduces its part and pushes the result. Used
    /// from [`crate::CommConfig::ce_min_bytes`] up to [`crate::CommConfig::ce_max_bytes`] (off by
    /// default). Needs 16-byte aligned operands; otherwise [`Algorithm::TwoShot`].
    TwoShotCe,
    /// Reduce-scatter, all-gather and broadcast (not allreduce): each sender pushes its data
    /// into the receivers' staging slots (posted writes only), one barrier per round through
    /// the fixed-size slots, then every receiver reduces or copies from its own memory into its
    /// output. Serves every operand kind with no copies outside the kernel. See
    /// `docs/design/collectives.md`.
    PushStaged,
    /// All-gather and broadcast into a symmetric output: barrier, every sender stores straight
    /// into every rank's output, barrier. Chosen above the one-shot limit
    /// ([`crate::CommConfig::one_shot_max_bytes`]) when the output is symmetric.
    PushDirect,
    /// Reduce-scatter, all-gather and broadcast with the low-latency protocol (small messages,
    /// up to [`crate::CommConfig::gather_ll_max_bytes`] of the whole gathered or scattered
    /// buffer, [`crate::CommConfig::broadcast_ll_max_bytes`] of a broadcast): the data travel with the call's flag in 8-byte stores into the receivers'
    /// low-latency slots, the receivers poll the data, no barrier. Serves every operand kind
    /// and alignment with no copies outside the kernel. See `docs/design/collectives.md`.
    PushLl,
    /// All-gather and broadcast of large buffers (from
    /// [`crate::CommConfig::gather_ce_min_bytes`] and
    /// [`crate::CommConfig::broadcast_ce_min_bytes`]) into a symmetric output, through the copy
    /// engines: a barrier launch, every sender's input copied into its place in every peer's
    /// output by `cuMemcpyDtoDAsync` (the local copy, out of place, by a kernel on a second
    /// stream of the rank), a barrier launch. See `docs/design/collectives.md`.
    CopyEngine,
    /// Reduce-scatter on the multimem path: each rank reduces its chunk of every rank's input
    /// through the multicast address (`multimem.ld_reduce`) into its own output.
    LoadReduce,
    /// The fused allreduce + residual add + RMSNorm, one-shot: every rank pushes its rows of
    /// `x` into every peer's staging, one barrier, every rank sums, adds and normalises every
    /// row (a block per row). See `docs/design/rmsnorm.md`.
    NormOneShot,
    /// [`Algorithm::NormOneShot`] with each row cut over a thread-block cluster (long rows, few
    /// tokens: more blocks on the link).
    NormOneShotSplit,
    /// The fused norm with the low-latency protocol: `x`'s words travel with the call's flag,
    /// no barrier (small calls).
    NormOneShotLl,
    /// [`Algorithm::NormOneShotLl`] with each row cut over a thread-block cluster.
    NormOneShotLlSplit,
    /// A team of one rank ([`Path::Local`]): the output is a copy of the input (nothing in
    /// place); the fused norm runs its local add + RMSNorm kernel.
    Local,
    /// The fused norm, two-shot: each rank sums its rows' share, normalises it and pushes the
    /// residual and the output to every rank (large calls, teams above 3 ranks).
    NormTwoShot,
    /// All-to-all with the low-latency protocol (small parts, up to
    /// [`crate::CommConfig::gather_ll_max_bytes`] of input and what a low-latency slot holds per
    /// part): every rank's counts and offsets, then its parts, travel with the call's flag in
    /// 8-byte cells into the receivers' low-latency slots; receivers poll, no barrier. Any
    /// operand kind and alignment. See `docs/design/alltoall.md`.
    AllToAllLl,
    /// All-to-all, bulk: after the exchange of counts (as in [`Algorithm::AllToAllLl`]), every
    /// sender stores its parts straight into the receivers' symmetric output, then one barrier.
    /// An output of the caller's own memory (or an in-place call) lands in the communicator's
    /// scratch and is copied out by the same kernel ([`crate::Choice::staged_chunks`] 1).
    AllToAllDirect,
    /// MoE dispatch / combine, bulk: one-sided pushes of every token once per destination rank
    /// (of every expert output row back to its token's rank) into the plan's symmetric slots,
    /// bounded barriers; the grouping by local expert and the weighted sum local. See
    /// `docs/design/alltoall.md` ("MoE dispatch and combine").
    MoeBulk,
}

impl Algorithm {
    /// The collectives that report this algorithm.
    pub fn collectives(self) -> &'static [&'static str] {
        match self {
            Algorithm::OneShot
            | Algorithm::TwoShot
            | Algorithm::OneShotLl
            | Algorithm::TwoShotPush
            | Algorithm::TwoShotCe => &["all_reduce"],
            Algorithm::PushStaged | Algorithm::PushLl => {
                &["reduce_scatter", "all_gather", "broadcast"]
            }
            Algorithm::PushDirect | Algorithm::CopyEngine => &["all_gather", "broadcast"],
            Algorithm::LoadReduce => &["reduce_scatter"],
            Algorithm::Local => &[
                "all_reduce",
                "reduce_scatter",
                "all_gather",
                "broadcast",
                "all_reduce_add_rms_norm",
            ],
            Algorithm::NormOneShot
            | Algorithm::NormOneShotSplit
            | Algorithm::NormOneShotLl
            | Algorithm::NormOneShotLlSplit
            | Algorithm::NormTwoShot => &["all_reduce_add_rms_norm"],
            Algorithm::AllToAllLl | Algorithm::AllToAllDirect => &["all_to_all", "all_to_all_v"],
            Algorithm::MoeBulk => &["moe_dispatch", "moe_combine"],
        }
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Algorithm::OneShot => "one-shot",
            Algorithm::TwoShot => "two-shot",
            Algorithm::OneShotLl => "one-shot-ll",
            Algorithm::TwoShotPush => "two-shot-push",
            Algorithm::TwoShotCe => "two-shot-ce",
            Algorithm::PushStaged => "push-staged",
            Algorithm::PushDirect => "push-direct",
            Algorithm::PushLl => "push-ll",
            Algorithm::CopyEngine => "copy-engine",
            Algorithm::LoadReduce => "load-reduce",
            Algorithm::NormOneShot => "norm-one-shot",
            Algorithm::NormOneShotSplit => "norm-one-shot-split",
            Algorithm::NormOneShotLl => "norm-one-shot-ll",
            Algorithm::NormOneShotLlSplit => "norm-one-shot-ll-split",
            Algorithm::Local => "local",
            Algorithm::NormTwoShot => "norm-two-shot",
            Algorithm::AllToAllLl => "all-to-all-ll",
            Algorithm::AllToAllDirect => "all-to-all-direct",
            Algorithm::MoeBulk => "moe-bulk",
        })
    }
}

/// Where a call's operands live, which decides what can run without copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operands {
    /// Input and output in symmetric buffers of the communicator ([`crate::SymmetricBuffer`]).
    Symmetric,
    /// At least one operand is the caller's own device memory (a [`cuda_multimem::DeviceBuffer`],
    /// a cudarc slice, a raw pointer).
    Local,
}

/// What a call ran (or would run): path, algorithm, launch shape, and how the caller's own
/// memory was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// How data travels.
    pub path: Path,
    /// Which algorithm.
    pub algorithm: Algorithm,
    /// Blocks per launch.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
    /// Pieces the message went through the communicator's scratch in (0: the operands were used
    /// in place, with no extra copies; k ≥ 1: k chunks, each copied in and/or out of the scratch
    /// on the caller's stream — see docs/design/allreduce.md).
    pub staged_chunks: u32,
}

impl std::fmt::Display for Choice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path == Path::Local && self.algorithm == Algorithm::Local {
            return f.write_str("local (a team of one: a copy, or nothing in place)");
        }
        write!(
            f,
            "{} {} ({} x {})",
            self.path, self.algorithm, self.blocks, self.threads
        )?;
        if self.staged_chunks > 0 {
            write!(f, " staged in {} chunk(s)", self.staged_chunks)?;
        }
        Ok(())
    }
}

/// When the communicator uses NVLink multicast (`multimem` kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MulticastPolicy {
    /// Never: peer-to-peer kernels only.
    Never,
    /// Where multicast is allowed (the site's policy variables, see
    /// [`cuda_multimem::multicast::multicast_allowed`]) and supported by every device, for teams
    /// large enough that it moves fewer bytes than peer-to-peer (more than 3 ranks), for the
    /// sizes and operations it serves. The default.
    #[default]
    WhenItPaysOff,
    /// For every call it can serve; building fails where multicast is not available.
    Always,
}

/// Whether the multimem path should beat peer-to-peer two-shot for large messages on a team of
/// `n`: by the anchors' bandwidth arithmetic (NCCL's NVLS choice), only for teams larger than 3.
pub fn multimem_pays_off(n: usize) -> bool {
    n > 3
}

/// How the FP8 (e4m3) output of [`crate::RankHandle::all_reduce_add_rms_norm_fp8`] is scaled:
/// every quantised element is `e4m3(y / scale)` with `y` the normalised value rounded to the
/// call's `T` (what the unquantised norm writes), the division correctly rounded in f32 and the
/// conversion round-to-nearest-even saturating to ±448 (`cvt.rn.satfinite.e4m3x2.f32`);
/// `scale` is the dequantisation scale (`y ≈ q · scale`). Where a scale is computed, it is
/// `amax / 448` over its elements (`amax` of 0 gives a scale of 1, so every element is ±0):
/// see `docs/design/rmsnorm.md` ("FP8 outputs").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Scaling {
    /// One scale for the whole tensor, given by the caller (finite, > 0).
    Static,
    /// One scale per token (row), written as f32.
    PerToken,
    /// One scale per group of [`FP8_GROUP`] consecutive elements of a row, written as f32,
    /// row-major (`tokens × hidden / 128`).
    PerGroup,
    /// One power-of-two scale per group of [`FP8_GROUP`] elements (the f32 scale rounded up to
    /// a power of two), written as UE8M0 exponent bytes packed four groups to a `u32` in the
    /// layout DeepGEMM reads (`u32` at `pack · align(tokens, 4) + token`, group `4 · pack + i`
    /// in byte i; missing groups of the last pack 0; the words of the alignment's tokens,
    /// `tokens ≤ t < align(tokens, 4)`, are not written).
    PerGroupUe8m0,
}

/// Elements per scale group of [`Fp8Scaling::PerGroup`] and [`Fp8Scaling::PerGroupUe8m0`].
pub const FP8_GROUP: usize = 128;

/// The largest finite e4m3 value: outputs saturate to ±448, and computed scales are
/// `amax / 448`.
pub const FP8_E4M3_MAX: f32 = 448.0;

impl Fp8Scaling {
    /// Every scaling.
    pub const ALL: [Fp8Scaling; 4] = [
        Fp8Scaling::Static,
        Fp8Scaling::PerToken,
        Fp8Scaling::PerGroup,
        Fp8Scaling::PerGroupUe8m0,
    ];

    /// The code the kernels take (low byte of their mode parameter).
    pub fn code(self) -> u64 {
        match self {
            Fp8Scaling::Static => 0,
            Fp8Scaling::PerToken => 1,
            Fp8Scaling::PerGroup => 2,
            Fp8Scaling::PerGroupUe8m0 => 3,
        }
    }

    /// Whether scales are per group of [`FP8_GROUP`] elements.
    pub fn grouped(self) -> bool {
        matches!(self, Fp8Scaling::PerGroup | Fp8Scaling::PerGroupUe8m0)
    }

    /// Elements of the scales buffer for `tokens` rows of `hidden` (hidden a multiple of
    /// [`FP8_GROUP`] for the grouped forms): 0 (static), `tokens`, `tokens · hidden / 128`
    /// (f32), or `ceil(hidden / 128 / 4) · align(tokens, 4)` (`u32` packs).
    pub fn scales_len(self, tokens: usize, hidden: usize) -> usize {
        let groups = hidden / FP8_GROUP;
        match self {
            Fp8Scaling::Static => 0,
            Fp8Scaling::PerToken => tokens,
            Fp8Scaling::PerGroup => tokens.saturating_mul(groups),
            Fp8Scaling::PerGroupUe8m0 => groups
                .div_ceil(4)
                .saturating_mul(tokens.next_multiple_of(4)),
        }
    }
}
