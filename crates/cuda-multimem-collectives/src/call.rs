//! One description of a call (what NCCL's `ncclInfo` is): which collective, its element type,
//! operator, root, norm shape and operands with the argument names errors use. Every public
//! method of a rank turns its borrowed views into a [`Call`]; the engine checks it into a
//! [`Checked`] call (resolved addresses) and plans it from the [`Facts`] every rank shares.

use crate::kernels::gather::Collective;
use crate::operand::{Operand, Resolved};
use crate::types::{DType, Fp8Scaling, ReduceOp};

/// Which collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    /// Allreduce: every rank's output is the reduction of every rank's input.
    AllReduce,
    /// Reduce-scatter: the input holds N chunks, rank r's output the reduction of chunk r.
    ReduceScatter,
    /// All-gather: chunk k of every output is rank k's input.
    AllGather,
    /// Broadcast: every output is the root's input.
    Broadcast,
    /// Allreduce fused with residual add + RMSNorm.
    Norm,
    /// Residual add + RMSNorm of an already reduced input, on this rank only.
    LocalNorm,
    /// All-to-all: part k of every rank's input becomes part r of rank k's output (equal
    /// parts, or counts and offsets per peer: [`A2aCounts`]).
    AllToAll,
    /// MoE dispatch: every token to the ranks hosting its top-k experts, grouped there by
    /// local expert ([`crate::MoePlan`]).
    MoeDispatch,
    /// MoE combine: the experts' outputs back to their tokens' ranks, weighted and summed.
    MoeCombine,
}

impl Kind {
    /// The kernels' name of a reduce-scatter, all-gather or broadcast.
    pub(crate) fn gather(self) -> Option<Collective> {
        match self {
            Kind::ReduceScatter => Some(Collective::ReduceScatter),
            Kind::AllGather => Some(Collective::AllGather),
            Kind::Broadcast => Some(Collective::Broadcast),
            _ => None,
        }
    }
}

/// An operand and the name of the argument it came from.
#[derive(Clone, Copy)]
pub(crate) struct Arg<'o> {
    pub(crate) op: Operand<'o>,
    pub(crate) name: &'static str,
}

impl<'o> Arg<'o> {
    pub(crate) fn new(op: Operand<'o>, name: &'static str) -> Self {
        Arg { op, name }
    }
}

/// The norm's arguments: row length and epsilon.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct NormArgs {
    pub(crate) hidden: usize,
    pub(crate) eps: f32,
}

/// Counts and offsets of an all-to-all, in elements.
#[derive(Clone, Copy)]
pub(crate) enum A2aCounts<'o> {
    /// Equal parts: the input and the output hold N parts each.
    Equal,
    /// Per peer, given on the host (every slice N long).
    Host {
        send_counts: &'o [usize],
        send_offsets: &'o [usize],
        recv_counts: &'o [usize],
        recv_offsets: &'o [usize],
    },
    /// Send counts read from device memory (`u64[N]`, the input packed in rank order); the
    /// receive counts and offsets (`u64[N]`, packed in sender order) written there.
    Device {
        send_counts: Arg<'o>,
        recv_counts: Arg<'o>,
        recv_offsets: Arg<'o>,
    },
}

/// An all-to-all's arguments beside its operands.
#[derive(Clone, Copy)]
pub(crate) struct A2aArgs<'o> {
    /// Bytes of one element (any type: the kernels move bytes).
    pub(crate) elem: usize,
    pub(crate) counts: A2aCounts<'o>,
}

/// A checked all-to-all's counts: the host table the fill kernel stores (`u64[4][MAX_RANKS]`:
/// send counts, send offsets, receive counts, receive offsets), or the resolved device tables.
// The host table is 4 × MAX_RANKS u64 (2304 bytes at 72 ranks): one per call on the stack,
// copied once into the fill's parameters; boxing it would cost an allocation per call.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy)]
pub(crate) enum A2aChecked<'o> {
    Equal,
    Host([u64; crate::kernels::alltoall::TABLE_WORDS]),
    Device {
        send_counts: Resolved<'o>,
        recv_counts: Resolved<'o>,
        recv_offsets: Resolved<'o>,
    },
}

/// What a call asks for, before the checks.
pub(crate) struct Call<'o> {
    pub(crate) kind: Kind,
    pub(crate) dtype: DType,
    /// The operator (for collectives that do not reduce: [`ReduceOp::Sum`], unused).
    pub(crate) op: ReduceOp,
    /// The root of a broadcast (0 for the others).
    pub(crate) root: usize,
    /// The input (`x` of a norm); `None` for an in-place call, whose one buffer is `output`.
    pub(crate) input: Option<Arg<'o>>,
    /// The output (`out` of a norm), or the buffer of an in-place call.
    pub(crate) output: Arg<'o>,
    /// A norm's residual (read, and written with the sum) and weight.
    pub(crate) residual: Option<Arg<'o>>,
    pub(crate) weight: Option<Arg<'o>>,
    pub(crate) norm: Option<NormArgs>,
    /// An all-to-all's element size and counts.
    pub(crate) a2a: Option<A2aArgs<'o>>,
    /// A norm's FP8 output (then `output` is the e4m3 rows, named "out").
    pub(crate) quant: Option<QuantArgs<'o>>,
    /// A MoE call's plan and routing operands.
    pub(crate) moe: Option<MoeArgs<'o>>,
}

/// A MoE call's arguments beside its operands (dispatch: `input` the tokens, `output` the
/// plan's expert-grouped rows; combine: `input` the experts' outputs, `output` the tokens).
#[derive(Clone, Copy)]
pub(crate) struct MoeArgs<'o> {
    pub(crate) plan: &'o crate::moe::MoePlan,
    /// Dispatch: `topk_ids` (i32), `topk_weights` (f32), the scales (f32).
    pub(crate) ids: Option<Arg<'o>>,
    pub(crate) weights: Option<Arg<'o>>,
    pub(crate) scales: Option<Arg<'o>>,
    /// Combine: the output's type.
    pub(crate) out: DType,
}

/// [`MoeArgs`] checked: tokens of the call and the resolved operands.
#[derive(Clone, Copy)]
pub(crate) struct MoeChecked<'o> {
    pub(crate) plan: &'o crate::moe::MoePlan,
    pub(crate) tokens: usize,
    pub(crate) ids: Option<Resolved<'o>>,
    pub(crate) weights: Option<Resolved<'o>>,
    pub(crate) scales: Option<Resolved<'o>>,
    pub(crate) out: DType,
}

/// The FP8 output of a norm call besides its e4m3 rows: the scaling, the static scale, the
/// scales buffer and the unquantised rows.
#[derive(Clone, Copy)]
pub(crate) struct QuantArgs<'o> {
    pub(crate) scaling: Fp8Scaling,
    /// The static scale ([`Fp8Scaling::Static`]; 0 otherwise).
    pub(crate) scale: f32,
    pub(crate) scales: Option<Arg<'o>>,
    pub(crate) unquantised: Option<Arg<'o>>,
}

/// [`QuantArgs`] checked: the operands resolved on the calling rank.
#[derive(Clone, Copy)]
pub(crate) struct QuantChecked<'o> {
    pub(crate) scaling: Fp8Scaling,
    pub(crate) scale: f32,
    pub(crate) scales: Option<Resolved<'o>>,
    pub(crate) unquantised: Option<Resolved<'o>>,
}

impl<'o> Call<'o> {
    /// An all-to-all of `elem`-byte elements, out of place (`input` given) or in place.
    pub(crate) fn all_to_all(
        elem: usize,
        counts: A2aCounts<'o>,
        input: Option<Operand<'o>>,
        output: Operand<'o>,
    ) -> Self {
        let mut c = Call::collective(Kind::AllToAll, DType::F32, ReduceOp::Sum, 0, input, output);
        c.a2a = Some(A2aArgs { elem, counts });
        c
    }

    /// Bytes of one element: the all-to-all's own, a MoE call's bytes (its checks count
    /// elements themselves), else the type's.
    pub(crate) fn elem_size(&self) -> usize {
        if self.moe.is_some() {
            return 1;
        }
        self.a2a.map_or(self.dtype.size(), |a| a.elem)
    }

    /// A reduce-scatter, all-gather, broadcast or allreduce, out of place (`input` given) or in
    /// place.
    pub(crate) fn collective(
        kind: Kind,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        input: Option<Operand<'o>>,
        output: Operand<'o>,
    ) -> Self {
        let (i, o) = if input.is_some() {
            ("input", "output")
        } else {
            ("buf", "buf")
        };
        Call {
            kind,
            dtype,
            op,
            root,
            input: input.map(|op| Arg::new(op, i)),
            output: Arg::new(output, o),
            residual: None,
            weight: None,
            norm: None,
            a2a: None,
            quant: None,
            moe: None,
        }
    }
}

/// The checked shape of a norm call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct NormShape {
    pub(crate) tokens: usize,
    pub(crate) hidden: usize,
    pub(crate) row_bytes: usize,
    pub(crate) eps: f32,
}

/// A call whose every argument was checked, its operands resolved on the calling rank.
pub(crate) struct Checked<'o> {
    pub(crate) kind: Kind,
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
    pub(crate) root: usize,
    pub(crate) input: Resolved<'o>,
    pub(crate) output: Resolved<'o>,
    pub(crate) residual: Option<Resolved<'o>>,
    pub(crate) weight: Option<Resolved<'o>>,
    /// The operands coincide as the collective's in-place form on this rank (a per-rank fact:
    /// it never decides what the team runs, only what this rank may skip).
    pub(crate) in_place: bool,
    pub(crate) norm: Option<NormShape>,
    pub(crate) quant: Option<QuantChecked<'o>>,
    /// The argument names of the input and the output (for errors found while executing).
    pub(crate) names: [&'static str; 2],
    /// An all-to-all's element size and checked counts.
    pub(crate) a2a: Option<(usize, A2aChecked<'o>)>,
    /// A MoE call's checked arguments.
    pub(crate) moe: Option<MoeChecked<'o>>,
}

/// What every rank making the same call shares: the facts the planner decides from, so that
/// every rank decides the same. Per-rank facts (addresses of the caller's own memory, whether
/// this rank's operands coincide) are not here: executors deal with them locally.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Facts {
    pub(crate) kind: Kind,
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
    pub(crate) root: usize,
    /// The whole buffer: an allreduce's or a broadcast's message, a reduce-scatter's input, an
    /// all-gather's output, a norm's `x`.
    pub(crate) bytes: usize,
    /// One rank's part: a reduce-scatter's output, an all-gather's input; else `bytes`.
    pub(crate) chunk: usize,
    /// Whether the input and the output are symmetric buffers (every rank passes the same
    /// kinds: a call of mixed kinds across ranks is a disagreement).
    pub(crate) sym_in: bool,
    pub(crate) sym_out: bool,
    /// The addresses of the symmetric operands or-ed together (their alignment is the same on
    /// every rank: the same offsets into mappings aligned to the allocation granularity); the
    /// caller's own memory counts as aligned (its executor stages a rank's misaligned operand
    /// locally, without changing what the team runs).
    pub(crate) sym_addrs: u64,
    pub(crate) norm: Option<NormShape>,
    /// A norm's FP8 scaling (every rank asks for the same: the kernels' call header says it).
    pub(crate) quant: Option<Fp8Scaling>,
    /// An all-to-all: the mode (`kernels::alltoall::MODE_*`), the output's bytes and whether
    /// the call is in place (in place is a shared fact of the call: every rank makes it).
    pub(crate) a2a: Option<A2aFacts>,
    /// A MoE call: whether its plan runs the low-latency form (a property of the plan's shape,
    /// the same on every rank).
    pub(crate) moe_ll: bool,
}

/// What every rank of an all-to-all shares beside the lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct A2aFacts {
    pub(crate) mode: u64,
    pub(crate) elem: usize,
    pub(crate) out_bytes: usize,
    pub(crate) in_place: bool,
}

impl Checked<'_> {
    /// The facts every rank shares.
    pub(crate) fn facts(&self) -> Facts {
        let addr = |r: &Resolved<'_>| if r.is_sym() { r.ptr } else { 0 };
        let (bytes, chunk) = match self.kind {
            Kind::ReduceScatter => (self.input.bytes, self.output.bytes),
            Kind::AllGather => (self.output.bytes, self.input.bytes),
            _ => (self.input.bytes, self.input.bytes),
        };
        Facts {
            kind: self.kind,
            dtype: self.dtype,
            op: self.op,
            root: self.root,
            bytes,
            chunk,
            sym_in: self.input.is_sym(),
            sym_out: self.output.is_sym(),
            sym_addrs: addr(&self.input) | addr(&self.output),
            norm: self.norm,
            a2a: self.a2a.map(|(elem, c)| A2aFacts {
                mode: match c {
                    A2aChecked::Equal => crate::kernels::alltoall::MODE_EQUAL,
                    A2aChecked::Host(_) => crate::kernels::alltoall::MODE_HOST,
                    A2aChecked::Device { .. } => crate::kernels::alltoall::MODE_DEVICE,
                },
                elem,
                out_bytes: self.output.bytes,
                in_place: self.in_place,
            }),
            quant: self.quant.map(|q| q.scaling),
            moe_ll: self.moe.as_ref().is_some_and(|m| m.plan.sizes.regions == 2),
        }
    }
}
