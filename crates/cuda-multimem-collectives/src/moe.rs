//! MoE dispatch / combine as a plan built once per shape: [`MoeShape`] (what the layer looks
//! like, and how much memory a plan of it takes: [`MoeShape::symmetric_bytes`],
//! [`MoeShape::local_bytes`]), [`MoePlan`] (its buffers, allocated once; the calls
//! [`crate::RankHandle::moe_dispatch`] and [`crate::RankHandle::moe_combine`] allocate
//! nothing). Layout of what a dispatch leaves on every rank: [`MoePlan`]; protocol:
//! `docs/design/alltoall.md` ("MoE dispatch and combine").

use cuda_multimem::{DeviceBuffer, Error, Result};

use crate::buffer::SymmetricBuffer;
use crate::kernels::moe::{
    Sizes, LAYOUT_WORDS, LL_MAX_TOKENS, L_CELL_OFF, L_COMB_OFF, L_COUNTS, L_DONE_OFF, L_ECNT,
    L_EXPERTS, L_FORM, L_HIDDEN, L_K, L_LOCAL, L_MAP, L_META_OFF, L_OFFSETS, L_PLACE, L_POS,
    L_REGION, L_ROW, L_ROWS, L_ROW_STRIDE, L_SCALES, L_SOUT, L_STAMP_OFF, L_SYM, L_SYNC, L_TAB,
    L_TMAX, L_WCOPY, L_XOUT, L_YROW, L_YSTRIDE, MAX_CELLS, MAX_EXPERTS, MAX_LOCAL_EXPERTS,
    MAX_TOP_K,
};
use crate::types::DType;

/// Scales travelling with every token (f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeScales {
    /// None.
    None,
    /// One per token.
    PerToken,
    /// One per group of this many elements along hidden (hidden a multiple of it).
    PerGroup(usize),
}

/// How a plan's kernels keep calls apart (`docs/design/alltoall.md`, "MoE dispatch and
/// combine"). Both forms are one launch per phase with no host synchronisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoeProtocol {
    /// [`MoeProtocol::LowLatency`] up to `kernels::moe::LL_MAX_TOKENS` (256) tokens per rank
    /// (decode batches), else [`MoeProtocol::Bulk`].
    #[default]
    Auto,
    /// No barrier: the symmetric buffer holds two regions that alternate call by call (twice the
    /// receive and combine rows of the bulk form), so a call's pushes never meet rows a slow peer
    /// still reads; each phase waits only for its senders' cells.
    LowLatency,
    /// One region and an entry barrier per phase (every peer done reading what the call
    /// overwrites): half the memory, one network round trip more per phase (prefill batches).
    Bulk,
}

/// The shape of an expert-parallel MoE layer, the same on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeShape {
    /// Most tokens a rank dispatches in one call (T ≤ this).
    pub max_tokens_per_rank: usize,
    /// Elements of one token (a multiple of 16).
    pub hidden: usize,
    /// Bytes of one payload element: 2 for bf16, 1 for FP8 e4m3, any size (the kernels move
    /// bits).
    pub payload_bytes: usize,
    /// Experts per token (1 to 32).
    pub top_k: usize,
    /// Experts in all (1 to 65536).
    pub num_experts: usize,
    /// The rank hosting each expert (`num_experts` entries; an expert's local index is its
    /// place among its rank's experts in id order). `None`: contiguous blocks,
    /// `num_experts / n` per rank (`num_experts` a multiple of the team size).
    pub placement: Option<Vec<usize>>,
    /// Scales travelling with every token.
    pub scales: MoeScales,
    /// The type of the experts' outputs the combine takes (f32, bf16 or f16).
    pub expert_out: DType,
    /// Rows of every rank's expert-grouped layout. `None`: `n × max_tokens_per_rank × top_k`,
    /// which no routing overflows; fewer save memory, and a routing that sends a rank more
    /// rows than this has the extra rows dropped and the bounds word set (never a silent drop).
    pub max_recv_rows: Option<usize>,
    /// The form of the plan's kernels.
    pub protocol: MoeProtocol,
}

impl MoeShape {
    /// A shape with contiguous placement, no scales, bf16 expert outputs and the full rows.
    pub fn new(
        max_tokens_per_rank: usize,
        hidden: usize,
        payload_bytes: usize,
        top_k: usize,
        num_experts: usize,
    ) -> MoeShape {
        MoeShape {
            max_tokens_per_rank,
            hidden,
            payload_bytes,
            top_k,
            num_experts,
            placement: None,
            scales: MoeScales::None,
            expert_out: DType::Bf16,
            max_recv_rows: None,
            protocol: MoeProtocol::Auto,
        }
    }

    /// Whether a plan of this shape runs the low-latency form.
    pub fn low_latency(&self) -> bool {
        match self.protocol {
            MoeProtocol::Auto => self.max_tokens_per_rank <= LL_MAX_TOKENS,
            MoeProtocol::LowLatency => true,
            MoeProtocol::Bulk => false,
        }
    }

    /// f32 scales per token: 0, 1 or hidden / group.
    pub fn scales_per_token(&self) -> usize {
        match self.scales {
            MoeScales::None => 0,
            MoeScales::PerToken => 1,
            MoeScales::PerGroup(g) => self.hidden / g.max(1),
        }
    }

    /// The rank of every expert on a team of `n` (checked).
    pub fn placement_over(&self, n: usize) -> Result<Vec<usize>> {
        match &self.placement {
            Some(p) => {
                if p.len() != self.num_experts {
                    return Err(Error::invalid(
                        "placement",
                        format!(
                            "{} entries; expected one per expert ({})",
                            p.len(),
                            self.num_experts
                        ),
                    ));
                }
                if let Some((e, r)) = p.iter().enumerate().find(|(_, &r)| r >= n) {
                    return Err(Error::invalid(
                        "placement",
                        format!("expert {e} on rank {r}; the team has ranks 0 to {}", n - 1),
                    ));
                }
                Ok(p.clone())
            }
            None => {
                if self.num_experts % n != 0 {
                    return Err(Error::invalid(
                        "num_experts",
                        format!(
                            "{}; contiguous placement needs a multiple of the team size ({n}) (or give placement)",
                            self.num_experts
                        ),
                    ));
                }
                let per = self.num_experts / n;
                Ok((0..self.num_experts).map(|e| e / per).collect())
            }
        }
    }

    /// Check the shape for a team of `n`: the sizes the kernels and the plan use.
    pub(crate) fn sizes(&self, n: usize) -> Result<Sizes> {
        let bad = |arg: &'static str, why: String| Err(Error::invalid(arg, why));
        if n == 0 || n > crate::kernels::moe::MOE_MAX_RANKS {
            return bad(
                "n",
                format!(
                    "{n} ranks; a MoE plan takes teams of 1 to {} (each token's destinations are one 32-bit mask)",
                    crate::kernels::moe::MOE_MAX_RANKS
                ),
            );
        }
        if self.max_tokens_per_rank == 0 || self.max_tokens_per_rank > 1 << 20 {
            return bad(
                "max_tokens_per_rank",
                format!("{}; expected 1 to {}", self.max_tokens_per_rank, 1 << 20),
            );
        }
        if self.hidden == 0 || self.hidden % 16 != 0 || self.hidden > 1 << 20 {
            return bad(
                "hidden",
                format!(
                    "{}; expected a multiple of 16 up to {}",
                    self.hidden,
                    1 << 20
                ),
            );
        }
        if self.payload_bytes == 0 || self.payload_bytes > 16 {
            return bad(
                "payload_bytes",
                format!("{}; expected 1 to 16", self.payload_bytes),
            );
        }
        if self.top_k == 0 || self.top_k > MAX_TOP_K {
            return bad(
                "top_k",
                format!("{}; expected 1 to {MAX_TOP_K}", self.top_k),
            );
        }
        if self.num_experts == 0 || self.num_experts > MAX_EXPERTS {
            return bad(
                "num_experts",
                format!("{}; expected 1 to {MAX_EXPERTS}", self.num_experts),
            );
        }
        if let MoeScales::PerGroup(g) = self.scales {
            if g == 0 || self.hidden % g != 0 {
                return bad(
                    "scales",
                    format!(
                        "groups of {g}; expected a divisor of hidden ({})",
                        self.hidden
                    ),
                );
            }
        }
        if !matches!(self.expert_out, DType::F32 | DType::Bf16 | DType::F16) {
            return bad(
                "expert_out",
                format!("{:?}; expected f32, bf16 or f16", self.expert_out),
            );
        }
        let place = self.placement_over(n)?;
        let mut lmax = 0;
        for r in 0..n {
            let l = place.iter().filter(|&&p| p == r).count();
            if l > MAX_LOCAL_EXPERTS {
                return bad(
                    "placement",
                    format!("{l} experts on rank {r}; at most {MAX_LOCAL_EXPERTS}"),
                );
            }
            lmax = lmax.max(l);
        }
        // every rank counts its senders' cells (local experts × ranks) in shared memory
        if lmax * n > MAX_CELLS {
            return bad(
                if self.placement.is_some() {
                    "placement"
                } else {
                    "num_experts"
                },
                format!(
                    "{lmax} experts on one rank of {n}: {} count cells; a plan takes at most {MAX_CELLS} (the most experts on a rank × the team size)",
                    lmax * n
                ),
            );
        }
        let full = n * self.max_tokens_per_rank * self.top_k;
        let rows = self.max_recv_rows.unwrap_or(full);
        if rows == 0 || rows > full {
            return bad(
                "max_recv_rows",
                format!("{rows}; expected 1 to {full} (n × max_tokens_per_rank × top_k)"),
            );
        }
        let s = Sizes {
            n: n as u64,
            tmax: self.max_tokens_per_rank as u64,
            k: self.top_k as u64,
            row: (self.hidden * self.payload_bytes) as u64,
            scales: self.scales_per_token() as u64,
            yrow: (self.hidden * self.expert_out.size()) as u64,
            rows: rows as u64,
            lmax: lmax as u64,
            regions: if self.low_latency() { 2 } else { 1 },
        };
        if s.symmetric() > crate::kernels::alltoall::MAX_BYTES.min(1 << 40) * 16 {
            return bad(
                "max_tokens_per_rank",
                format!("{} bytes of symmetric memory per rank", s.symmetric()),
            );
        }
        Ok(s)
    }

    /// Bytes of symmetric memory per rank a plan of this shape allocates on a team of `n`:
    /// the receive rows (`n × max_tokens_per_rank` rows of payload and scales), their meta,
    /// the count cells, and the combine's rows and stamps (`max_tokens_per_rank × top_k` expert
    /// output rows) — twice in the low-latency form ([`MoeShape::low_latency`]).
    pub fn symmetric_bytes(&self, n: usize) -> Result<usize> {
        Ok(self.sizes(n)?.symmetric() as usize)
    }

    /// Bytes of ordinary device memory per rank a plan of this shape allocates besides (the
    /// expert-grouped rows, their scales, counts, offsets, the map, the weights and placement,
    /// the routing's positions and counts, the layout table).
    pub fn local_bytes(&self, n: usize) -> Result<usize> {
        let s = self.sizes(n)?;
        let e = self.num_experts as u64;
        Ok((s.rows * s.row
            + 4 * s.rows * s.scales
            + 4 * s.rows
            + 4 * (2 * e + 1)
            + 8 * s.tmax * s.k
            + 8 * (LAYOUT_WORDS as u64 + s.n)
            + 12 * e
            + 16) as usize)
    }
}

/// One local rank's buffers of a plan.
pub(crate) struct RankPart {
    pub(crate) rank: usize,
    pub(crate) layout: DeviceBuffer<u64>,
    pub(crate) local: usize,
    _place: DeviceBuffer<u32>,
    _wcopy: DeviceBuffer<f32>,
    _pos: DeviceBuffer<u32>,
    _ecnt: DeviceBuffer<u32>,
    _sync: DeviceBuffer<u64>,
    xout: DeviceBuffer<u8>,
    sout: DeviceBuffer<f32>,
    counts: DeviceBuffer<u32>,
    offsets: DeviceBuffer<u32>,
    map: DeviceBuffer<u32>,
}

/// A MoE dispatch / combine plan: the shape, checked for the team, and its buffers (symmetric
/// memory of [`MoeShape::symmetric_bytes`], device memory of [`MoeShape::local_bytes`] on every
/// rank this process drives), allocated once by [`MoePlan::new`] (a collective call across
/// processes, as [`crate::Communicator::alloc`]).
///
/// # What a dispatch leaves on rank r (its plan's buffers, read on the device)
/// - [`MoePlan::expert_tokens`]: the received tokens grouped by local expert, `rows` rows of
///   `hidden × payload_bytes` bytes: expert e's tokens are rows `offsets[e]` to
///   `offsets[e] + counts[e]`, in (source rank, source token, top-k slot) order. A token
///   routed to two experts of r crossed the link once and is in both experts' rows.
/// - [`MoePlan::expert_scales`]: their scales, `rows × scales_per_token` f32, row for row.
/// - [`MoePlan::expert_counts`] (`u32[L]`) and [`MoePlan::expert_offsets`] (`u32[L + 1]`,
///   the last the rows in all), L = the experts on r, indexed by local expert (the experts of r
///   in id order): a grouped GEMM runs on them directly.
/// - [`MoePlan::dispatch_map`] (`u32[rows]`): row i came from `(s · Tmax + t) · k + j`
///   (source rank s, its token t, slot j): what the combine sends back where.
///
/// The combine takes the experts' outputs in the same row order (`rows × hidden` of
/// [`MoeShape::expert_out`]). Dispatch and combine of one plan alternate in the order the
/// ranks share (as every collective's calls do). After [`crate::Communicator::recover`] build the plan
/// again (its buffers tell calls apart by the team's call counters, which a recovery resets).
pub struct MoePlan {
    pub(crate) shape: MoeShape,
    pub(crate) sizes: Sizes,
    pub(crate) comm_id: u64,
    pub(crate) sym: SymmetricBuffer<u8>,
    pub(crate) parts: Vec<RankPart>,
}

impl std::fmt::Debug for MoePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoePlan")
            .field("shape", &self.shape)
            .field("symmetric_bytes", &self.sizes.symmetric())
            .finish()
    }
}

impl MoePlan {
    /// The plan of `shape` (checked for a team of `n`: `sizes`) over the symmetric buffer
    /// `sym` of communicator `comm_id`, with the buffers of the local ranks `locals` (rank,
    /// device) allocated (`MoePlan::new`, in the front, allocates `sym` first).
    pub(crate) fn build(
        shape: MoeShape,
        sizes: Sizes,
        n: usize,
        comm_id: u64,
        sym: SymmetricBuffer<u8>,
        locals: &[(usize, &cuda_multimem::Device)],
    ) -> Result<MoePlan> {
        let place = shape.placement_over(n)?;
        let e = shape.num_experts;
        // local index of every expert: its place among its rank's experts in id order
        let mut table = vec![0u32; 2 * e];
        let mut seen = vec![0u32; n];
        for (x, &r) in place.iter().enumerate() {
            table[x] = r as u32;
            table[e + x] = seen[r];
            seen[r] += 1;
        }
        let mut parts = Vec::new();
        for &(rank, dev) in locals {
            let local = seen[rank] as usize;
            let rows = sizes.rows as usize;
            let place_b = DeviceBuffer::from_host(dev, &table)?;
            let wcopy = DeviceBuffer::zeroed(dev, (sizes.tmax * sizes.k) as usize)?;
            let xout = DeviceBuffer::zeroed(dev, rows * sizes.row as usize)?;
            let sout = DeviceBuffer::zeroed(dev, (rows * sizes.scales as usize).max(1))?;
            let counts = DeviceBuffer::zeroed(dev, local.max(1))?;
            let offsets = DeviceBuffer::zeroed(dev, local + 1)?;
            let map = DeviceBuffer::zeroed(dev, rows)?;
            let pos = DeviceBuffer::zeroed(dev, (sizes.tmax * sizes.k) as usize)?;
            let ecnt = DeviceBuffer::zeroed(dev, e.max(1))?;
            let sync = DeviceBuffer::zeroed(dev, 2)?;
            let mut l = [0u64; LAYOUT_WORDS];
            l[L_TMAX] = sizes.tmax;
            l[L_K] = sizes.k;
            l[L_EXPERTS] = e as u64;
            l[L_LOCAL] = local as u64;
            l[L_ROW] = sizes.row;
            l[L_SCALES] = sizes.scales;
            l[L_ROW_STRIDE] = sizes.row_stride();
            l[L_META_OFF] = sizes.meta_off();
            l[L_COMB_OFF] = sizes.comb_off();
            l[L_STAMP_OFF] = sizes.stamp_off();
            l[L_YROW] = sizes.yrow;
            l[L_YSTRIDE] = sizes.yrow;
            l[L_ROWS] = sizes.rows;
            l[L_HIDDEN] = shape.hidden as u64;
            l[L_PLACE] = place_b.device_ptr();
            l[L_WCOPY] = wcopy.device_ptr();
            l[L_XOUT] = xout.device_ptr();
            l[L_SOUT] = sout.device_ptr();
            l[L_COUNTS] = counts.device_ptr();
            l[L_OFFSETS] = offsets.device_ptr();
            l[L_MAP] = map.device_ptr();
            l[L_TAB] = sym.inner.table(rank)?;
            l[L_SYM] = sym.device_ptr(rank)?;
            l[L_FORM] = u64::from(sizes.regions == 2);
            l[L_REGION] = sizes.region();
            l[L_CELL_OFF] = sizes.cell_off();
            l[L_DONE_OFF] = sizes.done_off();
            l[L_POS] = pos.device_ptr();
            l[L_ECNT] = ecnt.device_ptr();
            l[L_SYNC] = sync.device_ptr();
            parts.push(RankPart {
                rank,
                layout: DeviceBuffer::from_host(dev, &l)?,
                local,
                _place: place_b,
                _wcopy: wcopy,
                _pos: pos,
                _ecnt: ecnt,
                _sync: sync,
                xout,
                sout,
                counts,
                offsets,
                map,
            });
        }
        Ok(MoePlan {
            shape,
            sizes,
            comm_id,
            sym,
            parts,
        })
    }

    /// The shape.
    pub fn shape(&self) -> &MoeShape {
        &self.shape
    }

    /// Rows of every rank's expert-grouped layout.
    pub fn rows(&self) -> usize {
        self.sizes.rows as usize
    }

    /// Experts on `rank` (a rank this process drives).
    pub fn local_experts(&self, rank: usize) -> Result<usize> {
        Ok(self.part(rank)?.local)
    }

    pub(crate) fn part(&self, rank: usize) -> Result<&RankPart> {
        self.parts
            .iter()
            .find(|p| p.rank == rank)
            .ok_or_else(|| Error::invalid("rank", format!("{rank}; not driven by this process")))
    }

    /// Rank `rank`'s expert-grouped tokens (`rows × hidden × payload_bytes` bytes).
    pub fn expert_tokens(&self, rank: usize) -> Result<&DeviceBuffer<u8>> {
        Ok(&self.part(rank)?.xout)
    }

    /// Their scales (`rows × scales_per_token` f32; one unused element without scales).
    pub fn expert_scales(&self, rank: usize) -> Result<&DeviceBuffer<f32>> {
        Ok(&self.part(rank)?.sout)
    }

    /// Tokens per local expert (`u32[L]`; one unused element on a rank without experts).
    pub fn expert_counts(&self, rank: usize) -> Result<&DeviceBuffer<u32>> {
        Ok(&self.part(rank)?.counts)
    }

    /// First row per local expert (`u32[L + 1]`).
    pub fn expert_offsets(&self, rank: usize) -> Result<&DeviceBuffer<u32>> {
        Ok(&self.part(rank)?.offsets)
    }

    /// Where every row came from (`u32[rows]`, `(s · Tmax + t) · k + j`).
    pub fn dispatch_map(&self, rank: usize) -> Result<&DeviceBuffer<u32>> {
        Ok(&self.part(rank)?.map)
    }
}
