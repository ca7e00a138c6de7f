//! The funnel every collective of a [`RankHandle`] goes through: check ([`crate::engine`]'s one
//! check) → the rank's call order → plan (the one selector) → the executor the plan names.
//!
//! It lives in the front, not in the engine, because the executors take the engine's plan
//! types (the executors depend on the engine): the engine calling them would close a circle.

use cuda_multimem::{Result, StreamRef};

use super::RankHandle;
use crate::call::{Call, Kind};
use crate::config::CommConfig;
use crate::engine::{check, plan, Ctx, Exec};
use crate::exec::p2p::{allreduce, alltoall, copy_engine, gather, moe, norm};
use crate::types::Choice;

impl RankHandle<'_> {
    /// Check, plan and queue `call` on `stream`; what ran.
    pub(crate) fn run(&self, call: Call<'_>, stream: StreamRef<'_>) -> Result<Choice> {
        let inner = &*self.comm.inner;
        let l = self.local;
        let ctx = Ctx {
            comm: Some(inner.id),
            ranks: &inner.ranks,
            local: l,
        };
        // a failure that a kernel of this rank mirrored to the host (a plain load, no driver
        // call): reported by this call, before it launches into a broken team (a team that
        // broke already is `Unusable`, naming the first failure)
        if call.kind != Kind::LocalNorm {
            inner.ranks.usable()?;
            if let Some(e) = inner.mirrored_error(l) {
                return Err(inner.ranks.break_with(e));
            }
        }
        let checked = check(&call, &ctx, &stream)?;
        // A collective holds the rank's call lock while it queues (one call at a time, one
        // stream at a time); the local norm involves no peer and takes any stream of the device.
        let _end = match call.kind {
            Kind::LocalNorm => None,
            _ => Some(l.begin(&stream)?),
        };
        let facts = checked.facts();
        let t = &inner.facts;
        // a rank's first call (after the build or a recovery) waits as long as the start of an
        // uneven team may take
        let first;
        let c = if l.calls.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            first = CommConfig {
                timeout: inner.first_call,
                ..inner.config.clone()
            };
            &first
        } else {
            &inner.config
        };
        let plan = plan(t, c, &facts)?;
        let mut choice = plan.choice;
        if plan.exec == Exec::Nothing {
            return Ok(choice);
        }
        if call.kind != Kind::LocalNorm {
            inner.ranks.next_call(l);
        }
        let mm = || {
            inner.mm.as_ref().ok_or_else(|| {
                cuda_multimem::Error::invalid("multicast", "the team has no multicast executor")
            })
        };
        match &plan.exec {
            Exec::Nothing => {}
            Exec::AllReduce(p) => {
                let staged = allreduce::run(&inner.p2p, c, l, &checked, &facts, t, p, stream)?;
                if staged && choice.staged_chunks == 0 {
                    choice.staged_chunks = p.pieces.count as u32;
                }
            }
            Exec::MmAllReduce(p) => mm()?.run(c, l.rank, t, &checked, p, stream)?,
            Exec::Gather {
                coll,
                algorithm,
                shape,
            } => gather::run(
                &inner.p2p, c, l, &checked, *coll, *algorithm, *shape, stream,
            )?,
            Exec::CopyEngine { coll } => {
                copy_engine::run(&inner.p2p, t, c, &inner.ranks, l, &checked, *coll, stream)?
            }
            Exec::MmGather { coll, plan } => {
                mm()?.run_gather(c, l.rank, &checked, t, *coll, plan, stream)?
            }
            Exec::Norm(p) => {
                if norm::run(&inner.p2p, c, t, l, &checked, p, stream)? {
                    choice.staged_chunks = 1;
                }
            }
            Exec::AllToAll {
                algorithm,
                shape,
                scratch,
            } => alltoall::run(
                &inner.p2p, c, t, l, &checked, *algorithm, *shape, *scratch, stream,
            )?,
            Exec::Moe { shape } => moe::run(&inner.p2p, c, l, &checked, *shape, stream)?,
            Exec::LocalNorm { shape } => norm::run_local(&inner.p2p, l, &checked, *shape, stream)?,
            Exec::LocalCopy => {
                if !checked.in_place && checked.input.ptr != checked.output.ptr {
                    let (o, i) = (checked.output, checked.input);
                    // SAFETY: both operands checked (the same length: a team of one), this
                    // rank's device, disjoint or the same (the in-place rule).
                    unsafe { stream.copy_dtod_async(o.ptr, i.ptr, o.bytes.min(i.bytes)) }?;
                }
            }
        }
        Ok(choice)
    }
}
