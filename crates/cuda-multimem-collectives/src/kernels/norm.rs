//! The fused allreduce + residual add + RMSNorm kernels (`RankHandle::all_reduce_add_rms_norm`):
//! their families, entry and file names, committed PTX and parameter contract. The protocol:
//! `docs/design/rmsnorm.md`.
//!
//! Every entry takes ten `.u64` parameters, in this order: the rank's signal pad, `x` (this
//! rank's partial sums, `rows × hidden`), `residual` (read as r, written as residual_out), the
//! weight γ (`hidden`), `out`, rows of this launch, `hidden`, the call header, the timeout in
//! nanoseconds, and ε as the bits of an f32 in the low 32 bits.

use crate::types::{DType, Fp8Scaling};

/// The kernel file of this family.
pub const FILE: &str = "norm.ptx";

/// The committed PTX text of every norm kernel.
pub const PTX: &str = include_str!("norm.ptx");

/// Parameters of every norm entry.
pub const PARAMS: usize = 10;

/// Code of the norm collectives in the call header (allreduce headers carry a [`super::Kernel`]
/// code below 16 there, so the two never compare equal).
pub const HEADER_KIND: u64 = 0x4e4f_524d_0000;

/// The fused allreduce + residual add + RMSNorm forms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NormKernel {
    /// Push this launch's rows of x into slot `[parity][rank]` of every rank's staging, one
    /// barrier, then every rank reduces every row locally (rank order), adds r, normalises and
    /// writes residual and out: all local memory.
    OneShot,
    /// Rank k owns the k-th N-th of the rows. Push every row of x into its owner's staging
    /// (`[parity][rank]`), barrier; the owner reduces its rows, adds r, normalises, writes them
    /// locally and pushes residual_out and out rows into every rank's staging (`[1 - parity]
    /// [owner]`), barrier; every rank copies the other owners' rows into its own residual and
    /// out, barrier. Counters + 6 (the header parity flips, as after every call).
    TwoShot,
    /// Low-latency one-shot (small calls): every 4-byte word of this launch's rows of x travels
    /// as one 8-byte `(flag << 32) | word` store into slot `[parity][rank]` of every rank's
    /// low-latency staging (row j at `j · 2 · row bytes`), flag = (c + 1) xor the call header
    /// folded to 32 bits; each rank polls its own N slots for its rows, then reduces, adds r
    /// and normalises as [`NormKernel::OneShot`] does (the same threads, units and order, so
    /// the same bits). No barrier. Needs 4-byte aligned operands and whole words per row.
    /// Counters + 2.
    OneShotLl,
    /// [`NormKernel::OneShotLl`] with each row cut into [`SPLIT`] slices, one per block of a
    /// thread-block cluster of [`SPLIT`] (`.reqnctapercluster`, so the launch's grid is
    /// `rows × SPLIT`): each block sends, polls, reduces and writes its slice, the blocks of a
    /// cluster add their partial sums of squares through distributed shared memory in slice
    /// order, and each normalises its slice. For rows of at least [`SPLIT_MIN_ROW_BYTES`]: one
    /// block per row moves a whole row through one multiprocessor. Counters + 2.
    OneShotLlSplit,
    /// [`NormKernel::OneShot`] with rows cut over clusters of [`SPLIT`] blocks as
    /// [`NormKernel::OneShotLlSplit`] cuts them (slices by bytes, the same on every rank, so
    /// block b of every rank pushes and reads the same bytes around its barrier). Counters + 2.
    OneShotSplit,
}

/// Blocks (slices) per row of [`NormKernel::OneShotLlSplit`]: its cluster size (a power of two,
/// at most 8, the portable cluster size).
pub const SPLIT: usize = 8;
const _: () = assert!(SPLIT.is_power_of_two() && SPLIT <= 8);

/// Rows of at least this many bytes run [`NormKernel::OneShotLlSplit`] where the low-latency
/// form runs (and `rows × SPLIT` blocks fit the grid).
pub const SPLIT_MIN_ROW_BYTES: usize = 4096;

/// 16-byte units per slice of a row of `units` 16-byte units in the split forms: a SPLIT-th
/// rounded up to 8 (slices start on 128-byte lines); slice s is the row's bytes
/// `[s · 16 · split_units(u), (s + 1) · 16 · split_units(u))`, whatever a rank's unit mode.
pub fn split_units(units: u64) -> u64 {
    units.div_ceil(SPLIT as u64).next_multiple_of(8)
}

impl NormKernel {
    /// Every form.
    pub const ALL: [NormKernel; 5] = [
        NormKernel::OneShot,
        NormKernel::TwoShot,
        NormKernel::OneShotLl,
        NormKernel::OneShotLlSplit,
        NormKernel::OneShotSplit,
    ];

    fn tag(self) -> &'static str {
        match self {
            NormKernel::OneShot => "oneshot",
            NormKernel::TwoShot => "twoshot",
            NormKernel::OneShotLl => "oneshot_ll",
            NormKernel::OneShotLlSplit => "oneshot_ll_split",
            NormKernel::OneShotSplit => "oneshot_split",
        }
    }

    /// The entry name for `dtype`.
    pub fn entry(self, dtype: DType) -> String {
        format!("cmm_norm_{}_{}", self.tag(), dtype.name())
    }

    /// What the counters of every block advance by in one launch.
    pub fn counter_step(self) -> u32 {
        match self {
            NormKernel::OneShot
            | NormKernel::OneShotLl
            | NormKernel::OneShotLlSplit
            | NormKernel::OneShotSplit => 2,
            NormKernel::TwoShot => 6,
        }
    }

    /// The code of this form in the call header.
    pub fn header_code(self) -> u64 {
        HEADER_KIND | self as u64
    }
}

/// The unfused baseline (`RankHandle::add_rms_norm`): residual add + RMSNorm of an already
/// reduced `x`, what an engine runs after a plain allreduce. One block per row, the same
/// rounding points and reduction tree as the fused kernels. Seven `.u64` parameters: x,
/// residual, weight, out, rows, hidden, ε bits.
pub fn unfused_entry(dtype: DType) -> String {
    format!("cmm_add_rms_norm_{}", dtype.name())
}

/// Bytes of a row in the low-latency staging: every 4 data bytes travel with a 4-byte flag.
pub fn ll_row_bytes(row_bytes: u64) -> u64 {
    2 * row_bytes
}

/// Rows `[rank * P, ...)` of a two-shot launch of `rows`: P = ceil(rows / n).
pub fn part_rows(rows: u64, n: u64) -> u64 {
    rows.div_ceil(n)
}

/// The forms that have an FP8 output entry ([`NormKernel::fp8_entry`]): the one-shots, split
/// and unsplit. An FP8 call runs the barrier one-shot where the plain norm would run the
/// two-shot (`docs/design/rmsnorm.md`, "FP8 outputs").
pub const FP8_KERNELS: [NormKernel; 4] = [
    NormKernel::OneShot,
    NormKernel::OneShotLl,
    NormKernel::OneShotLlSplit,
    NormKernel::OneShotSplit,
];

/// The split FP8 entries exchange only the first and last group of each slice (one 16-byte
/// packet per block and row): that needs every slice of a split row to be at least one group
/// long, so that no group lies in more than two slices (f32 groups: 512 bytes).
const _: () = assert!(SPLIT_MIN_ROW_BYTES / SPLIT >= crate::types::FP8_GROUP * 4);

/// Most groups of 128 elements per row of the per-group FP8 outputs (their amax slots live in
/// shared memory): rows of at most `MAX_FP8_GROUPS × 128` elements.
pub const MAX_FP8_GROUPS: usize = 512;

/// Parameters of every fused FP8 entry: the ten of the plain entry (with `out` the unquantised
/// rows of `T`, 0 for none), then the e4m3 rows, the scales (0 for a static scale), the mode
/// word ([`fp8_mode`]) and the UE8M0 packs' stride in words (`align(tokens, 4)` of the call).
pub const FP8_PARAMS: usize = 14;

/// Parameters of the local FP8 entry ([`fp8_unfused_entry`]): the plain local entry's seven
/// (out: the unquantised rows or 0), then the four FP8 parameters of the fused entries.
pub const FP8_UNFUSED_PARAMS: usize = 11;

impl NormKernel {
    /// The FP8 output entry of this form for `dtype` (forms of [`FP8_KERNELS`]).
    pub fn fp8_entry(self, dtype: DType) -> String {
        format!("cmm_norm_fp8_{}_{}", self.tag(), dtype.name())
    }

    /// The code of this form with an FP8 output of `scaling` in the call header: ranks that
    /// ask for different outputs are reported as disagreeing.
    pub fn fp8_header_code(self, scaling: Fp8Scaling) -> u64 {
        self.header_code() | ((1 + scaling.code()) << 8)
    }
}

/// The local add + RMSNorm with an FP8 output.
pub fn fp8_unfused_entry(dtype: DType) -> String {
    format!("cmm_add_rms_norm_fp8_{}", dtype.name())
}

/// The standalone FP8 quantisation (`RankHandle::quantize_fp8`): rows of `T` to e4m3 with the
/// scales and rounding of the FP8 norm outputs, no norm (the unfused baseline's second kernel).
/// The parameters of [`fp8_unfused_entry`] ([`FP8_UNFUSED_PARAMS`]) with x in both the x and the
/// residual slots (the rows quantised are read there), the weight slot unused (x again), no
/// unquantised rows (0) and ε unused.
pub fn fp8_quant_entry(dtype: DType) -> String {
    format!("cmm_quantize_fp8_{}", dtype.name())
}

/// The FP8 mode parameter: the scaling's code in the low byte, the static scale's f32 bits in
/// the high 32 bits.
pub fn fp8_mode(scaling: Fp8Scaling, scale: f32) -> u64 {
    scaling.code() | ((scale.to_bits() as u64) << 32)
}
