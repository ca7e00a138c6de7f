//! The MoE dispatch / combine kernels (peer-to-peer, one-sided pushes into the receivers'
//! symmetric slots; the bulk form: an entry and a closing bounded barrier around each phase's
//! pushes, the local steps after them): their file and entry names, parameters, and the layout
//! of a plan's buffers (the layout table, `L_*` words, that every kernel reads). Text generated
//! by `cuda-multimem-ptxgen` (`cargo xtask ptx`); protocol and memory order:
//! `docs/design/alltoall.md` ("MoE dispatch and combine").
//!
//! # Entries and parameters (`.u64` each)
//! | entry | grid | parameters |
//! | --- | --- | --- |
//! | [`DISPATCH_ENTRY`] | G blocks | `p_ctx, p_layout, p_tokens, p_ids, p_wts, p_scales, p_t, p_sig, p_timeout` |
//! | [`GROUP_ENTRY`] | G blocks | `p_ctx, p_layout` |
//! | [`GATHER_ENTRY`] | G blocks | `p_ctx, p_layout` |
//! | [`COMBINE_ENTRY`] | G blocks | `p_ctx, p_layout, p_y, p_sig, p_timeout` |
//! | [`REDUCE_ENTRY`] | G blocks | `p_ctx, p_layout, p_out, p_t, p_mode` |
//!
//! `p_ctx` is the rank's signal pad, `p_layout` the plan's layout table on this device
//! (`u64[LAYOUT_WORDS]`, the `L_*` words), `p_t` the call's tokens, `p_mode` the combine's
//! element codes ([`mode_word`]).
//!
//! # A plan's symmetric buffer (per rank, offsets from the layout table)
//! | at | content |
//! | --- | --- |
//! | 0 | receive rows `[n][Tmax]`, [`L_ROW_STRIDE`] bytes each: the payload (`L_ROW` bytes), then at `round16(L_ROW)` the token's `L_SCALES` f32 scales; row `[s][t]` is token t of source rank s |
//! | [`L_META_OFF`] | receive meta `[n][Tmax]` of `k + 1` `u32`: the dispatch's stamp, then per top-k slot the local expert on this rank or −1 |
//! | [`L_COMB_OFF`] | combine rows `[Tmax][k]`, [`L_YSTRIDE`] bytes each: the expert output of this rank's token t, slot j |
//! | [`L_STAMP_OFF`] | combine stamps `[Tmax][k]` `u32`: the combine's stamp where row `[t][j]` arrived |
//!
//! A stamp is the call's barrier counter plus one (`c + 1`: the same on every rank, never 0,
//! distinct from every earlier call since the plan's creation), so rows of earlier calls are
//! never taken for this one's.
//!
//! # The plan's local buffers (this rank only)
//! expert-grouped tokens `[R][L_ROW]` ([`L_XOUT`]) and their scales `[R][L_SCALES]` f32
//! ([`L_SOUT`]); per local expert the counts `u32[L]` ([`L_COUNTS`]) and offsets `u32[L + 1]`
//! ([`L_OFFSETS`]: row of expert e's first token, the last entry the rows in all); the map
//! `u32[R]` ([`L_MAP`]: row i came from `(s · Tmax + t) · k + j`, source rank s, token t, slot
//! j); the placement `u32[2E]` ([`L_PLACE`]: rank of expert e at e, its local index at E + e);
//! the weights `f32[Tmax][k]` ([`L_WCOPY`]: this rank's last dispatch's, for its combine).
//! Rows of expert e come in source-rank, token, slot order.

/// The kernel file.
pub const FILE: &str = "p2p_moe.ptx";

/// Largest team a MoE plan takes: the dispatch keeps each token's destination ranks as one
/// `u32` mask (bit j: rank j receives the token), so a plan stops at 32 ranks (below the
/// communicator's [`super::MAX_RANKS`]); wider masks are the way past it.
pub const MOE_MAX_RANKS: usize = 32;

/// The committed PTX text.
pub const PTX: &str = include_str!("p2p_moe.ptx");

/// Dispatch, step 1: every token pushed once to every rank hosting one of its experts (row and
/// meta), the weights kept for the combine, ids validated; one barrier.
pub const DISPATCH_ENTRY: &str = "cmm_moe_dispatch";

/// Dispatch, step 2: per local expert the counts, offsets and the map (local; no barrier).
pub const GROUP_ENTRY: &str = "cmm_moe_group";

/// Dispatch, step 3: the received rows copied into the expert-grouped layout (local).
pub const GATHER_ENTRY: &str = "cmm_moe_gather";

/// Combine, step 1: every expert output row pushed back to its token's rank into slot
/// `[t][j]` with the call's stamp, between an entry barrier and a closing one.
pub const COMBINE_ENTRY: &str = "cmm_moe_combine";

/// Combine, step 2 (local; after step 1 ended on this rank, every peer's every block has
/// pushed): every token's weighted sum in top-k order (f32), rounded once to the output type.
pub const REDUCE_ENTRY: &str = "cmm_moe_reduce";

/// Layout table words.
pub const L_TMAX: usize = 0;
/// Top-k.
pub const L_K: usize = 1;
/// Experts in all.
pub const L_EXPERTS: usize = 2;
/// Experts on this rank.
pub const L_LOCAL: usize = 3;
/// Payload bytes of one token (a multiple of 16).
pub const L_ROW: usize = 4;
/// f32 scales of one token (0: none).
pub const L_SCALES: usize = 5;
/// Bytes of one receive row (payload and scales, each rounded up to 16).
pub const L_ROW_STRIDE: usize = 6;
/// Offset of the receive meta in the symmetric buffer.
pub const L_META_OFF: usize = 7;
/// Offset of the combine rows.
pub const L_COMB_OFF: usize = 8;
/// Offset of the combine stamps.
pub const L_STAMP_OFF: usize = 9;
/// Bytes of one expert output row (hidden × its element; a multiple of 16).
pub const L_YROW: usize = 10;
/// Bytes of one combine row (= [`L_YROW`]).
pub const L_YSTRIDE: usize = 11;
/// Rows of the expert-grouped layout (R).
pub const L_ROWS: usize = 12;
/// Hidden (elements).
pub const L_HIDDEN: usize = 13;
/// The placement table.
pub const L_PLACE: usize = 14;
/// The weights kept for the combine.
pub const L_WCOPY: usize = 15;
/// The expert-grouped tokens.
pub const L_XOUT: usize = 16;
/// Their scales.
pub const L_SOUT: usize = 17;
/// Per-expert counts.
pub const L_COUNTS: usize = 18;
/// Per-expert offsets.
pub const L_OFFSETS: usize = 19;
/// The map.
pub const L_MAP: usize = 20;
/// Every rank's symmetric buffer, as mapped on this rank (`u64[n]`).
pub const L_TAB: usize = 21;
/// This rank's symmetric buffer.
pub const L_SYM: usize = 22;
/// Words of the layout table.
pub const LAYOUT_WORDS: usize = 24;

/// Most experts on one rank (the group kernel counts them in shared memory).
pub const MAX_LOCAL_EXPERTS: usize = 1024;
/// Most experts in all.
pub const MAX_EXPERTS: usize = 1 << 16;
/// Most top-k.
pub const MAX_TOP_K: usize = 32;

/// The element codes of the combine's mode word: f32, bf16, f16.
pub const CODE_F32: u64 = 0;
/// bf16.
pub const CODE_BF16: u64 = 1;
/// f16.
pub const CODE_F16: u64 = 2;

/// The combine's mode word: the expert outputs' code (bits 0–7), the output's (bits 8–15).
pub fn mode_word(y: u64, out: u64) -> u64 {
    y | out << 8
}

/// `x` rounded up to 16.
pub fn round16(x: u64) -> u64 {
    x.div_ceil(16) * 16
}

/// The error word's code for an expert id out of range or more rows than the plan holds (the
/// token's slot is not sent, or the row is not stored).
pub use super::ERR_BOUNDS;

/// The sizes every rank's plan shares, from the shape's numbers (all in bytes but the counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    /// Ranks.
    pub n: u64,
    /// Most tokens per rank.
    pub tmax: u64,
    /// Top-k.
    pub k: u64,
    /// Payload bytes per token.
    pub row: u64,
    /// f32 scales per token.
    pub scales: u64,
    /// Bytes of one expert output row.
    pub yrow: u64,
    /// Rows of the expert-grouped layout.
    pub rows: u64,
}

impl Sizes {
    /// Bytes of one receive row.
    pub fn row_stride(&self) -> u64 {
        round16(self.row) + round16(4 * self.scales)
    }
    /// Offset of the meta.
    pub fn meta_off(&self) -> u64 {
        self.n * self.tmax * self.row_stride()
    }
    /// Offset of the combine rows.
    pub fn comb_off(&self) -> u64 {
        round16(self.meta_off() + self.n * self.tmax * 4 * (self.k + 1))
    }
    /// Offset of the combine stamps.
    pub fn stamp_off(&self) -> u64 {
        self.comb_off() + self.tmax * self.k * self.yrow
    }
    /// Bytes of the symmetric buffer (at least 16).
    pub fn symmetric(&self) -> u64 {
        round16(self.stamp_off() + self.tmax * self.k * 4).max(16)
    }
}
