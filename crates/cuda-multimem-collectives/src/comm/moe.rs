//! The MoE calls of a [`RankHandle`]: [`RankHandle::moe_dispatch`] (with scales:
//! [`RankHandle::moe_dispatch_scaled`]) and [`RankHandle::moe_combine`], each a conversion into
//! a [`Call`] of the plan ([`crate::MoePlan`]).

use cuda_multimem::{DeviceRepr, Error, IntoStream, Result};

use super::{Communicator, RankHandle};
use crate::call::{Arg, Call, Kind, MoeArgs};
use crate::moe::{MoePlan, MoeShape};
use crate::operand::{IntoDst, IntoSrc, Operand};
use crate::types::{Choice, DType, Element, ReduceOp};

impl MoePlan {
    /// Check `shape` for `comm`'s team and allocate the plan's buffers: its symmetric buffer
    /// ([`MoeShape::symmetric_bytes`], a collective call across processes, as
    /// [`Communicator::alloc`]) and every local rank's device memory
    /// ([`MoeShape::local_bytes`]).
    pub fn new(comm: &Communicator, shape: MoeShape) -> Result<MoePlan> {
        let n = comm.size();
        let sizes = shape.sizes(n)?;
        let sym = comm.alloc::<u8>(sizes.symmetric() as usize)?;
        let locals = comm
            .local_ranks()
            .into_iter()
            .map(|r| Ok((r, comm.device(r)?)))
            .collect::<Result<Vec<_>>>()?;
        MoePlan::build(shape, sizes, n, comm.inner.id, sym, &locals)
    }
}

impl Communicator {
    /// [`MoePlan::new`] of `shape` on this team.
    pub fn moe_plan(&self, shape: MoeShape) -> Result<MoePlan> {
        MoePlan::new(self, shape)
    }
}

impl RankHandle<'_> {
    /// MoE dispatch of this rank's `tokens` (`[T, hidden]` of the plan's payload type `P`, any
    /// type that moves bits, e.g. bf16 or FP8 e4m3; T ≤ `max_tokens_per_rank`), routed by
    /// `topk_ids` (`[T, top_k]` i32 on the device; −1: no expert) with `topk_weights`
    /// (`[T, top_k]` f32, kept for this rank's combine), queued on `stream`: every token
    /// crosses the link once per rank that hosts one of its experts (not once per expert), and
    /// on every rank the tokens it received land grouped by local expert, with per-expert
    /// counts and offsets on the device ([`MoePlan`] says the layout and where to read them).
    /// No host synchronisation: graph-capturable, counts never come back to the host.
    ///
    /// Checked before any launch (an error naming the argument): the plan belongs to this
    /// team, `tokens` a whole number of rows of the plan's payload (of `payload_bytes`-byte
    /// elements), 16-byte aligned, at most `max_tokens_per_rank` rows; `topk_ids` and
    /// `topk_weights` of T × top_k; no scales where the shape has them (use
    /// [`RankHandle::moe_dispatch_scaled`]); no overlaps. Checked on the device: an expert id
    /// neither −1 nor in `[0, num_experts)` is not sent and sets the bounds word
    /// ([`RankHandle::check`]); rows beyond the plan's `max_recv_rows` likewise. Nothing is
    /// written outside the plan's buffers. Every rank of the team makes the call (T may differ).
    pub fn moe_dispatch<'s, 'i, 'w, 'x, P: DeviceRepr>(
        &self,
        plan: &MoePlan,
        tokens: impl IntoSrc<'s, P>,
        topk_ids: impl IntoSrc<'i, i32>,
        topk_weights: impl IntoSrc<'w, f32>,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        self.dispatch_with(
            plan,
            tokens,
            topk_ids,
            topk_weights,
            None::<&cuda_multimem::DeviceBuffer<f32>>,
            stream,
        )
    }

    /// [`RankHandle::moe_dispatch`] with the tokens' f32 `scales` (`[T, scales_per_token]`:
    /// one per token, or one per group along hidden, as the plan's shape says), which travel
    /// with their tokens and land beside them ([`MoePlan::expert_scales`]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_dispatch_scaled<'s, 'i, 'w, 'c, 'x, P: DeviceRepr>(
        &self,
        plan: &MoePlan,
        tokens: impl IntoSrc<'s, P>,
        topk_ids: impl IntoSrc<'i, i32>,
        topk_weights: impl IntoSrc<'w, f32>,
        scales: impl IntoSrc<'c, f32>,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        self.dispatch_with(plan, tokens, topk_ids, topk_weights, Some(scales), stream)
    }

    fn dispatch_with<'s, 'i, 'w, 'c, 'x, P: DeviceRepr>(
        &self,
        plan: &MoePlan,
        tokens: impl IntoSrc<'s, P>,
        topk_ids: impl IntoSrc<'i, i32>,
        topk_weights: impl IntoSrc<'w, f32>,
        scales: Option<impl IntoSrc<'c, f32>>,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        self.plan_of(plan)?;
        if std::mem::size_of::<P>() != plan.shape.payload_bytes {
            return Err(Error::invalid(
                "tokens",
                format!(
                    "elements of {} bytes; the plan's payload has {} (MoeShape::payload_bytes)",
                    std::mem::size_of::<P>(),
                    plan.shape.payload_bytes
                ),
            ));
        }
        let on = stream.into_stream(self.device())?;
        let x = tokens.into_src(&on, "tokens")?;
        let ids = topk_ids.into_src(&on, "topk_ids")?;
        let w = topk_weights.into_src(&on, "topk_weights")?;
        let sc = scales.map(|s| s.into_src(&on, "scales")).transpose()?;
        let xout = plan.expert_tokens(self.rank())?;
        let out = Operand::local_bytes(xout.device_ptr(), xout.len(), self.device());
        let mut call = Call::collective(
            Kind::MoeDispatch,
            DType::U8,
            ReduceOp::Sum,
            0,
            Some(x.operand()),
            out,
        );
        call.input = call.input.map(|a| Arg::new(a.op, "tokens"));
        call.output = Arg::new(out, "expert_tokens");
        call.moe = Some(MoeArgs {
            plan,
            ids: Some(Arg::new(ids.operand(), "topk_ids")),
            weights: Some(Arg::new(w.operand(), "topk_weights")),
            scales: sc.as_ref().map(|s| Arg::new(s.operand(), "scales")),
            out: DType::U8,
        });
        self.run(call, on.stream())
    }

    /// MoE combine: `expert_out` (the experts' outputs for this rank's received rows, in the
    /// dispatch's expert-grouped row order: the plan's `rows × hidden` of
    /// [`crate::MoeShape::expert_out`]; rows past the counts are not read) → `out` (`[T,
    /// hidden]` f32, bf16 or f16 on this rank; T the tokens of this rank's dispatch), queued on
    /// `stream`: every output row travels back to its token's rank, where
    /// `out[t] = Σ_j w[t][j] · y[t][j]` over the top-k slots j in order, in f32 (products
    /// rounded, then added: no fused multiply-add), rounded once to the output type; a slot
    /// with id −1 (or one the device refused) adds nothing; a token without experts is 0. Bit
    /// for bit the same run to run and as [`crate::testing::moe_combine_reference`]. NaN weights (or
    /// outputs) propagate into their tokens. Checked before any launch: `expert_out`'s length
    /// and type, `out` a whole number of rows of at most `max_tokens_per_rank`, alignment, no
    /// overlap. Every rank makes the call, after its dispatch.
    pub fn moe_combine<'y, 'o, 'x, Y: Element, O: Element>(
        &self,
        plan: &MoePlan,
        expert_out: impl IntoSrc<'y, Y>,
        out: impl IntoDst<'o, O>,
        stream: impl IntoStream<'x>,
    ) -> Result<Choice> {
        self.plan_of(plan)?;
        if Y::DTYPE != plan.shape.expert_out {
            return Err(Error::invalid(
                "expert_out",
                format!(
                    "{:?} elements; the plan's shape says {:?} (MoeShape::expert_out)",
                    Y::DTYPE,
                    plan.shape.expert_out
                ),
            ));
        }
        let on = stream.into_stream(self.device())?;
        let y = expert_out.into_src(&on, "expert_out")?;
        let o = out.into_dst(&on, "out")?;
        let mut call = Call::collective(
            Kind::MoeCombine,
            O::DTYPE,
            ReduceOp::Sum,
            0,
            Some(y.operand()),
            o.operand(),
        );
        call.input = call.input.map(|a| Arg::new(a.op, "expert_out"));
        call.output = Arg::new(o.operand(), "out");
        call.moe = Some(MoeArgs {
            plan,
            ids: None,
            weights: None,
            scales: None,
            out: O::DTYPE,
        });
        self.run(call, on.stream())
    }

    /// `plan` is one of this communicator's.
    fn plan_of(&self, plan: &MoePlan) -> Result<()> {
        if plan.comm_id != self.comm.inner.id {
            return Err(Error::invalid(
                "plan",
                "built for another communicator (MoePlan::new with this one)",
            ));
        }
        Ok(())
    }
}
