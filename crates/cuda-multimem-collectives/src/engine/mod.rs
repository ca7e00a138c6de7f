//! The funnel every collective goes through: [`check`] (every argument, in one order for every
//! kind, one address resolution) turns a [`crate::call::Call`] into a checked call; [`plan`]
//! (the one selector: path, form, fallbacks, launch shapes, chunk schedule) decides what runs
//! from the facts every rank shares; the executors (`crate::exec`) queue it.

mod check;
mod check_moe;
mod plan;
mod shape;

pub(crate) use check::{check, Ctx, MAX_HIDDEN};
pub(crate) use plan::{ar_header, plan, ArPlan, ArStep, Exec, MmPlan, NormPlan, Out};
pub(crate) use shape::{copy_engine_local, Shape};

use crate::types::MulticastPolicy;

/// What the planner knows of a team: the same on every rank (sizes of the executors' areas,
/// the fewest multiprocessors of any rank's device, whether a multicast executor exists).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TeamFacts {
    /// Team size.
    pub(crate) n: usize,
    /// The fewest multiprocessors of the team's devices.
    pub(crate) multiprocessors: u32,
    /// Bytes of one half of a rank's staging slot for one peer.
    pub(crate) stage_half: usize,
    /// Bytes of one low-latency slot.
    pub(crate) ll_slot: usize,
    /// Bytes of one landing slot (the copy-engine two-shot).
    pub(crate) land_slot: usize,
    /// Bytes of one of the scratch's three regions (0: no scratch).
    pub(crate) scratch_region: usize,
    /// Bytes of a multimem region, where the team has a multicast executor.
    pub(crate) mm_region: Option<usize>,
    /// The multicast policy.
    pub(crate) policy: MulticastPolicy,
    /// Most blocks of one launch, where ranks share devices (each rank's share of the busiest
    /// device, so that every rank's blocks are resident at once); `u32::MAX` otherwise.
    pub(crate) block_cap: u32,
    /// Most thread-block clusters of one launch (the fused norm's split forms), likewise.
    pub(crate) cluster_cap: u32,
    /// Ranks of one process share a device: every rank keeps to one stream (the copy-engine
    /// forms, which fork each rank onto a second stream, are not chosen), since they share the
    /// context's hardware queues. Processes sharing a GPU have contexts and queues of their own.
    pub(crate) shared: bool,
}
