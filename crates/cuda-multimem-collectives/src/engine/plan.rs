//! The one selector: for a call's shared [`Facts`], the path (multicast policy), the form per
//! family, its fallbacks, every launch's shape and the chunk schedule. A pure function of what
//! every rank shares, so every rank making the same call plans the same; `Communicator::choice`
//! and `Communicator::add_rms_norm_choice` call it too, so what they report cannot drift from
//! what the call runs.

use cuda_multimem::{Error, Result};

use crate::call::{Facts, Kind};
use crate::config::CommConfig;
use crate::kernels::alltoall as a2k;
use crate::kernels::gather::{ll_words, Collective};
use crate::kernels::multimem::{self as mmk, MmKernel};
use crate::kernels::norm::{self as nk, NormKernel};
use crate::kernels::{self, ce_part_units};
use crate::types::{Algorithm, Choice, DType, MulticastPolicy, Path, ReduceOp};

use super::shape::{self, Shape};
use super::TeamFacts;

/// What a call runs: what it reports, and what the executor queues.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Plan {
    pub(crate) choice: Choice,
    pub(crate) exec: Exec,
}

/// The executor's part of a plan.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Exec {
    /// Nothing to move (an empty call): nothing is queued.
    Nothing,
    /// Peer-to-peer allreduce kernels, one per step ([`ArPlan::step`]).
    AllReduce(ArPlan),
    /// The multimem allreduce, one kernel per piece of the region size through the team's
    /// regions ([`MmPlan::step`]).
    MmAllReduce(MmPlan),
    /// A peer-to-peer reduce-scatter, all-gather or broadcast kernel.
    Gather {
        coll: Collective,
        algorithm: Algorithm,
        shape: Shape,
    },
    /// An all-gather or broadcast into a symmetric output through the copy engines.
    CopyEngine { coll: Collective },
    /// A multimem reduce-scatter, all-gather or broadcast in windows of each rank's chunk.
    MmGather { coll: Collective, plan: MmPlan },
    /// Fused norm launches ([`NormPlan::launch`]).
    Norm(NormPlan),
    /// The local (unfused) add + RMSNorm kernel.
    LocalNorm { shape: Shape },
    /// A team of one: the output becomes a copy of the input (nothing in place).
    LocalCopy,
    /// An all-to-all kernel (`scratch`: the direct form lands in the scratch and copies out).
    AllToAll {
        algorithm: Algorithm,
        shape: Shape,
        scratch: bool,
    },
    /// A MoE dispatch (three launches) or combine (one).
    Moe { shape: Shape },
}

/// `total` bytes in pieces of `piece` bytes (the last one shorter): `count` of them, at least
/// one (an empty total is one empty piece).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pieces {
    pub(crate) total: usize,
    pub(crate) piece: usize,
    pub(crate) count: usize,
}

impl Pieces {
    fn new(total: usize, piece: usize) -> Pieces {
        Pieces {
            total,
            piece,
            count: total.div_ceil(piece.max(1)).max(1),
        }
    }

    /// Piece `k`: its first byte and its length.
    pub(crate) fn at(&self, k: usize) -> (usize, usize) {
        let at = (k * self.piece).min(self.total);
        (at, self.piece.min(self.total - at))
    }
}

/// Where a step of the allreduce writes its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Out {
    /// Into the output itself.
    Output,
    /// Into output region `1 + slot` of the scratch (the caller's own output, staged: the copy
    /// out follows).
    Slot(usize),
}

/// One kernel of a peer-to-peer allreduce: bytes `[at, at + len)` of the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ArStep {
    pub(crate) at: usize,
    pub(crate) len: usize,
    pub(crate) algorithm: Algorithm,
    pub(crate) shape: Shape,
    /// The input is copied into the scratch's input region first (the form cannot read it
    /// where it is).
    pub(crate) stage_in: bool,
    pub(crate) out: Out,
}

/// A peer-to-peer allreduce: the message in pieces (one piece: directly on the operands), the
/// operands' kinds and the symmetric ones' alignment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ArPlan {
    pub(crate) pieces: Pieces,
    /// Through the scratch (each piece a region at most).
    staged: bool,
    sym_in: bool,
    sym_out: bool,
    sym_addrs: u64,
    /// The operator (the forms that have it).
    op: ReduceOp,
    /// The element type (the low-latency form takes elements of up to 4 bytes).
    dtype: DType,
}

impl ArPlan {
    /// Step `k` (every step is decided by the planner's rules from shared facts; the first
    /// and the last were checked when planning, and the others are like the first).
    pub(crate) fn step(&self, t: &TeamFacts, c: &CommConfig, k: usize) -> Result<ArStep> {
        let (at, len) = self.pieces.at(k);
        let step = |algorithm, stage_in, out| ArStep {
            at,
            len,
            algorithm,
            shape: shape::all_reduce(t, c, len, algorithm),
            stage_in,
            out,
        };
        let (sym_in, sym_out, addrs) = (self.sym_in, self.sym_out, self.sym_addrs);
        let op = (self.op, self.dtype);
        let cannot = || Error::invalid("count", format!("{len} bytes cannot be staged"));
        // A piece a form serves directly (unstaged: the whole call; staged: e.g. a last chunk
        // one-shot serves) needs no scratch.
        if let Some(a) = direct(t, c, op, addrs, sym_in, sym_out, len)? {
            return Ok(step(a, false, Out::Output));
        }
        if !self.staged {
            return Err(cannot());
        }
        // Results land in the output itself when it is symmetric, else in an output region.
        let out = if sym_out {
            Out::Output
        } else {
            Out::Slot(k % 2)
        };
        let out_addrs = if sym_out { addrs } else { 0 };
        // The kernel reads the input where it is, or from the input region.
        Ok(match direct(t, c, op, addrs, sym_in, true, len)? {
            Some(a) => step(a, false, out),
            None => step(
                direct(t, c, op, out_addrs, true, true, len)?.ok_or_else(cannot)?,
                true,
                out,
            ),
        })
    }
}

/// One multimem kernel over bytes `[at, at + len)` (of the message, or of each rank's chunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MmStep {
    pub(crate) at: usize,
    pub(crate) len: usize,
    pub(crate) kernel: MmKernel,
    pub(crate) shape: Shape,
}

/// A multimem call in pieces of what the team's regions hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct MmPlan {
    pub(crate) pieces: Pieces,
    /// `None`: the allreduce; else the gather-family collective.
    coll: Option<Collective>,
}

impl MmPlan {
    /// Piece `k`'s kernel and shape.
    pub(crate) fn step(&self, t: &TeamFacts, c: &CommConfig, k: usize) -> MmStep {
        let (at, len) = self.pieces.at(k);
        let (kernel, shape) = match self.coll {
            None => {
                let (alg, shape) = shape::mm_all_reduce(t, c, len);
                let k = match alg {
                    Algorithm::OneShot => MmKernel::OneShot,
                    _ => MmKernel::TwoShot,
                };
                (k, shape)
            }
            Some(coll) => {
                let k = match coll {
                    Collective::ReduceScatter => MmKernel::ReduceScatter,
                    Collective::AllGather => MmKernel::AllGather,
                    Collective::Broadcast => MmKernel::Broadcast,
                };
                (k, shape::mm_gather(t, c, coll, len).1)
            }
        };
        MmStep {
            at,
            len,
            kernel,
            shape,
        }
    }
}

/// One fused norm launch: rows `[row0, row0 + rows)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NormLaunch {
    pub(crate) row0: usize,
    pub(crate) rows: usize,
    pub(crate) shape: Shape,
}

/// The fused norm: form `kernel`, the rows in launches of what the staging holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct NormPlan {
    pub(crate) kernel: NormKernel,
    /// The FP8 output's scaling, for an FP8 call (its entries: [`NormKernel::fp8_entry`]).
    pub(crate) quant: Option<crate::types::Fp8Scaling>,
    rows: Pieces,
    row_bytes: usize,
    es: usize,
}

impl NormPlan {
    /// Launches.
    pub(crate) fn count(&self) -> usize {
        self.rows.count
    }

    /// Launch `k`.
    pub(crate) fn launch(&self, t: &TeamFacts, c: &CommConfig, k: usize) -> NormLaunch {
        let (row0, rows) = self.rows.at(k);
        NormLaunch {
            row0,
            rows,
            shape: shape::norm(t, c, self.kernel, rows, self.row_bytes, self.es),
        }
    }
}

/// Plan a call.
pub(crate) fn plan(t: &TeamFacts, c: &CommConfig, f: &Facts) -> Result<Plan> {
    if t.n == 1
        && !matches!(
            f.kind,
            Kind::AllToAll | Kind::MoeDispatch | Kind::MoeCombine
        )
    {
        return alone(f);
    }
    match f.kind {
        Kind::AllReduce => all_reduce(t, c, f),
        Kind::ReduceScatter | Kind::AllGather | Kind::Broadcast => gather(t, c, f),
        Kind::Norm => norm(t, c, f),
        Kind::LocalNorm => local_norm(f),
        Kind::AllToAll => all_to_all(t, c, f),
        Kind::MoeDispatch | Kind::MoeCombine => Ok(moe(t, c, f)),
    }
}

/// A MoE dispatch or combine: the plan's form ([`Algorithm::MoeLl`] or [`Algorithm::MoeBulk`],
/// from its shape: `MoeShape::low_latency`); a team of one runs the same kernels, its own
/// tokens never leaving the device.
fn moe(t: &TeamFacts, c: &CommConfig, f: &Facts) -> Plan {
    let shape = shape::moe(t, c);
    let path = if t.n == 1 {
        Path::Local
    } else {
        Path::PeerToPeer
    };
    Plan {
        choice: shape.choice(
            path,
            if f.moe_ll {
                Algorithm::MoeLl
            } else {
                Algorithm::MoeBulk
            },
            0,
        ),
        exec: Exec::Moe { shape },
    }
}

/// An all-to-all: the low-latency form where the input is at most `gather_ll_max_bytes` and
/// the largest part a rank may send (equal parts: one part; counts: the whole input) fits a
/// low-latency slot; else the direct form into a symmetric output, or through the scratch
/// (the caller's own output, or in place) where the output fits a scratch region. A team of
/// one runs the low-latency kernel (its own part never travels through a slot).
fn all_to_all(t: &TeamFacts, c: &CommConfig, f: &Facts) -> Result<Plan> {
    let a = f
        .a2a
        .ok_or_else(|| Error::invalid("kind", "an all-to-all call without its counts"))?;
    let part = if a.mode == a2k::MODE_EQUAL {
        f.bytes / t.n
    } else {
        f.bytes
    };
    let ll = t.n == 1
        || (f.bytes <= c.gather_ll_max_bytes && part as u64 <= a2k::ll_capacity(t.ll_slot as u64));
    let (algorithm, scratch) = if ll {
        (Algorithm::AllToAllLl, false)
    } else if f.sym_out && !a.in_place {
        (Algorithm::AllToAllDirect, false)
    } else if a.out_bytes <= t.scratch_region {
        (Algorithm::AllToAllDirect, true)
    } else {
        return Err(Error::invalid(
            "output",
            format!(
                "{} bytes{}: above the low-latency limit such outputs land in the communicator's scratch, whose regions hold {} bytes (use a SymmetricBuffer output out of place, or raise config.scratch_bytes)",
                a.out_bytes,
                if a.in_place { " in place" } else { " of the caller's own memory" },
                t.scratch_region
            ),
        ));
    };
    let shape = shape::all_to_all(t, c, part, algorithm);
    let path = if t.n == 1 {
        Path::Local
    } else {
        Path::PeerToPeer
    };
    Ok(Plan {
        choice: shape.choice(path, algorithm, scratch as u32),
        exec: if a.mode == a2k::MODE_EQUAL && f.bytes == 0 {
            Exec::Nothing
        } else {
            Exec::AllToAll {
                algorithm,
                shape,
                scratch,
            }
        },
    })
}

/// Whether multimem `ld_reduce` has this type and operator.
fn mm_supports(dtype: DType, op: ReduceOp) -> bool {
    mmk::supported(dtype, op)
}

/// Whether the multicast policy takes the multimem path for a message of `bytes`: `Always`,
/// or `WhenItPaysOff` for teams where it pays off and messages of at least
/// `multimem_min_bytes` (the executor exists only where multicast is on).
fn mm_wanted(t: &TeamFacts, c: &CommConfig, bytes: usize) -> bool {
    match t.policy {
        MulticastPolicy::Never => false,
        MulticastPolicy::Always => true,
        MulticastPolicy::WhenItPaysOff => {
            crate::types::multimem_pays_off(t.n) && bytes >= c.multimem_min_bytes
        }
    }
}

/// `chunks` as the `u32` a choice reports (a count of more cannot be reported: 0 would say
/// "no copies").
fn chunk_count(chunks: usize, f: &Facts, chunk: usize) -> Result<u32> {
    u32::try_from(chunks).map_err(|_| {
        Error::invalid(
            "count",
            format!(
                "{} elements of {}: more than {} chunks of {chunk} bytes",
                f.bytes / f.dtype.size(),
                f.dtype,
                u32::MAX
            ),
        )
    })
}

fn no_scratch(bytes: usize, one_shot: usize) -> Error {
    Error::invalid(
        "count",
        format!(
            "{bytes} bytes of the caller's own memory: above the one-shot limit ({one_shot} bytes) such calls go through the communicator's scratch, and it has none (config.scratch_bytes = 0); use a SymmetricBuffer or give the scratch room"
        ),
    )
}

fn all_reduce(t: &TeamFacts, c: &CommConfig, f: &Facts) -> Result<Plan> {
    let bytes = f.bytes;
    let p2p = |alg| shape::all_reduce(t, c, bytes, alg);
    if bytes == 0 {
        let alg = preferred(t, c, 0);
        return Ok(Plan {
            choice: p2p(alg).choice(Path::PeerToPeer, alg, 0),
            exec: Exec::Nothing,
        });
    }
    // multimem: where the team has a multicast executor, the policy wants it and ld_reduce
    // has the type and operator; through the team's regions, chunk by chunk
    if let Some(region) = t.mm_region.filter(|_| {
        ((mm_wanted(t, c, bytes) && c.algorithm.is_none()) || t.policy == MulticastPolicy::Always)
            && mm_supports(f.dtype, f.op)
    }) {
        let mm = MmPlan {
            pieces: Pieces::new(bytes, region - region % 16),
            coll: None,
        };
        let (alg, first) = shape::mm_all_reduce(t, c, mm.pieces.at(0).1);
        return Ok(Plan {
            choice: first.choice(
                Path::Multimem,
                alg,
                chunk_count(mm.pieces.count, f, mm.pieces.piece)?,
            ),
            exec: Exec::MmAllReduce(mm),
        });
    }
    let region = t.scratch_region;
    let own = !(f.sym_in && f.sym_out);
    // Directly on the operands where a form serves them as they are — for the caller's own
    // memory in steps of at most a scratch region, so that a rank whose own operand is not
    // aligned as the form needs stages it through its scratch without changing what runs.
    let single = ArPlan {
        pieces: Pieces::new(bytes, bytes),
        staged: false,
        sym_in: f.sym_in,
        sym_out: f.sym_out,
        sym_addrs: f.sym_addrs,
        op: f.op,
        dtype: f.dtype,
    };
    if let Some(alg) = direct(
        t,
        c,
        (f.op, f.dtype),
        f.sym_addrs,
        f.sym_in,
        f.sym_out,
        bytes,
    )? {
        if !own || region == 0 || bytes <= region {
            return Ok(Plan {
                choice: p2p(alg).choice(Path::PeerToPeer, alg, 0),
                exec: Exec::AllReduce(single),
            });
        }
    }
    // The caller's own memory above what the direct forms serve: in chunks through the
    // scratch. The scratch has three regions: an input region (where the kernel cannot read
    // the input in place) and two output regions used in turn (docs/design/allreduce.md).
    if region == 0 {
        return Err(no_scratch(bytes, c.one_shot_max(t.n)));
    }
    let staged = ArPlan {
        pieces: Pieces::new(bytes, region),
        staged: true,
        ..single
    };
    let chunks = chunk_count(staged.pieces.count, f, region)?;
    // The first and the last chunk decide every form the call runs (the others are like the
    // first): a chunk no form takes is refused before anything is queued.
    let first = staged.step(t, c, 0)?;
    staged.step(t, c, staged.pieces.count - 1)?;
    Ok(Plan {
        choice: first
            .shape
            .choice(Path::PeerToPeer, first.algorithm, chunks),
        exec: Exec::AllReduce(staged),
    })
}

/// The allreduce form the size alone picks (or the forced one).
fn preferred(t: &TeamFacts, c: &CommConfig, bytes: usize) -> Algorithm {
    c.algorithm.unwrap_or(if bytes <= c.ll_max_bytes {
        Algorithm::OneShotLl
    } else if bytes <= c.one_shot_max(t.n) {
        Algorithm::OneShot
    } else if bytes <= c.ce_max_bytes && bytes >= c.ce_min_bytes {
        Algorithm::TwoShotCe
    } else {
        Algorithm::TwoShotPush
    })
}

/// The allreduce form to run directly on operands of `bytes` whose symmetric addresses, or-ed
/// together, are `addrs` (the alignments are powers of two; the caller's own memory counts as
/// aligned), and which are symmetric or not: the preferred one, or its fallback where the
/// alignment or the operand kinds do not allow it. `None`: nothing runs these operands
/// directly (they must be staged). `op` is the operator and the element type.
fn direct(
    t: &TeamFacts,
    c: &CommConfig,
    (op, dtype): (ReduceOp, DType),
    addrs: u64,
    sym_in: bool,
    sym_out: bool,
    bytes: usize,
) -> Result<Option<Algorithm>> {
    let aligned = |a: u64| addrs % a == 0;
    let mut alg = preferred(t, c, bytes);
    if alg == Algorithm::OneShotLl
        && (!aligned(4)
            || bytes % 4 != 0
            || bytes > c.ll_max_bytes
            || !kernels::Kernel::P2pOneShotLl.has_type(dtype))
    {
        // The low-latency protocol moves whole aligned 4-byte words, of elements of up to 4
        // bytes (8-byte types run the one-shot).
        alg = if bytes <= t.stage_half {
            Algorithm::OneShot
        } else {
            Algorithm::TwoShot
        };
    }
    if matches!(alg, Algorithm::TwoShotPush | Algorithm::TwoShotCe)
        && (!aligned(16) || !kernels::Kernel::P2pTwoShotPush.has(op))
    {
        // The write-only two-shots move 16-byte vectors only, and have sum, min and max only
        // (product and average: the reading two-shot).
        alg = Algorithm::TwoShot;
    }
    if alg == Algorithm::OneShot && bytes > t.stage_half {
        if c.algorithm == Some(Algorithm::OneShot) && sym_in && sym_out {
            return Err(Error::invalid(
                "count",
                format!(
                    "{bytes} bytes with one-shot forced; its staging holds {} bytes (raise one_shot_max_bytes)",
                    t.stage_half
                ),
            ));
        }
        return Ok(None);
    }
    if alg == Algorithm::TwoShotCe {
        let part = ce_part_units((bytes / 16) as u64, t.n as u64) as usize;
        if part * 16 > t.land_slot {
            return Err(Error::invalid(
                "count",
                format!(
                    "{bytes} bytes with the copy-engine two-shot; its landing slots hold {} bytes of a {}-byte part (raise ce_max_bytes)",
                    t.land_slot,
                    part * 16
                ),
            ));
        }
    }
    // What each kernel touches: one-shot and low-latency only the local input and output;
    // the write-only two-shots the local input (all of it, when there is no scalar tail)
    // and every rank's output; the reading two-shot every rank's input and output.
    let ok = match alg {
        Algorithm::OneShot | Algorithm::OneShotLl => true,
        Algorithm::TwoShotPush | Algorithm::TwoShotCe => sym_out && (sym_in || bytes % 16 == 0),
        Algorithm::TwoShot => sym_in && sym_out,
        _ => false,
    };
    Ok(ok.then_some(alg))
}

fn gather(t: &TeamFacts, c: &CommConfig, f: &Facts) -> Result<Plan> {
    let coll = f
        .kind
        .gather()
        .ok_or_else(|| Error::invalid("kind", "not a reduce-scatter, all-gather or broadcast"))?;
    let (total, chunk) = (f.bytes, f.chunk);
    // multimem: where the team has a multicast executor and the policy wants it for this size
    // (the allreduce's rule; `config.algorithm` is an allreduce setting and plays no part), and
    // the kernel exists (reduce-scatter: where ld_reduce has the type and operator); through
    // the team's regions in windows of each rank's chunk, any operand kind
    if let Some(region) = t.mm_region.filter(|_| {
        mm_wanted(t, c, total)
            && if coll.reduces() {
                mm_supports(f.dtype, f.op)
            } else {
                mmk::moves(f.dtype)
            }
    }) {
        if chunk == 0 {
            let (alg, shape) = shape::mm_gather(t, c, coll, 0);
            return Ok(Plan {
                choice: shape.choice(Path::Multimem, alg, 0),
                exec: Exec::Nothing,
            });
        }
        // the regions hold N slots of a window (broadcast: one), 16-byte multiples
        let slots = if coll == Collective::Broadcast {
            1
        } else {
            t.n
        };
        let window = (region / slots) & !15;
        if window < f.dtype.size() {
            return Err(Error::invalid(
                "config.multimem_capacity",
                format!(
                    "{region} bytes per region cannot hold {} slots of one {} element each",
                    t.n, f.dtype
                ),
            ));
        }
        let plan = MmPlan {
            pieces: Pieces::new(chunk, window),
            coll: Some(coll),
        };
        let (alg, first) = shape::mm_gather(t, c, coll, plan.pieces.at(0).1);
        return Ok(Plan {
            choice: first.choice(
                Path::Multimem,
                alg,
                chunk_count(plan.pieces.count, f, window)?,
            ),
            exec: Exec::MmGather { coll, plan },
        });
    }
    // low-latency: the whole buffer up to `gather_ll_max_bytes` (broadcast:
    // `broadcast_ll_max_bytes`), and a chunk that fits a low-latency slot as 8-byte (flag,
    // word) pairs. The kernel serves any alignment.
    let ll_max = if coll == Collective::Broadcast {
        c.broadcast_ll_max_bytes
    } else {
        c.gather_ll_max_bytes
    };
    let ll = total <= ll_max
        && ll_words(chunk as u64).saturating_mul(8) <= t.ll_slot as u64
        && (!coll.reduces() || crate::kernels::gather::ll_reduces(f.dtype));
    // copy engines: all-gathers and broadcasts of large buffers into a symmetric output (an
    // empty call queues nothing, whatever the form); not where ranks of this process share devices,
    // since the form forks each rank onto a second stream, and ranks sharing a context need a
    // hardware queue per stream (on one device the kernel forms move the same bytes anyway)
    let ce_min = match coll {
        Collective::AllGather => Some(c.gather_ce_min_bytes),
        Collective::Broadcast => Some(c.broadcast_ce_min_bytes),
        Collective::ReduceScatter => None,
    };
    if !ll && !t.shared && f.sym_out && total > 0 && ce_min.is_some_and(|m| total >= m) {
        return Ok(Plan {
            choice: shape::COPY_ENGINE.choice(Path::PeerToPeer, Algorithm::CopyEngine, 0),
            exec: Exec::CopyEngine { coll },
        });
    }
    // direct: the output is symmetric (every rank's mapped here) and the message is above
    // the one-shot limit, where saving the local copy beats saving a barrier
    let direct =
        !ll && coll != Collective::ReduceScatter && f.sym_out && total > c.one_shot_max(t.n);
    let algorithm = if ll {
        Algorithm::PushLl
    } else if direct {
        Algorithm::PushDirect
    } else {
        Algorithm::PushStaged
    };
    let shape = shape::gather(t, c, chunk, algorithm);
    Ok(Plan {
        choice: shape.choice(Path::PeerToPeer, algorithm, 0),
        exec: if chunk == 0 {
            Exec::Nothing
        } else {
            Exec::Gather {
                coll,
                algorithm,
                shape,
            }
        },
    })
}

/// The norm's label of a form.
fn norm_algorithm(k: NormKernel) -> Algorithm {
    match k {
        NormKernel::OneShot => Algorithm::NormOneShot,
        NormKernel::OneShotSplit => Algorithm::NormOneShotSplit,
        NormKernel::OneShotLl => Algorithm::NormOneShotLl,
        NormKernel::OneShotLlSplit => Algorithm::NormOneShotLlSplit,
        NormKernel::TwoShot => Algorithm::NormTwoShot,
    }
}

fn norm(t: &TeamFacts, c: &CommConfig, f: &Facts) -> Result<Plan> {
    let s = f
        .norm
        .ok_or_else(|| Error::invalid("hidden", "a norm call without its shape"))?;
    let (rb, es) = (s.row_bytes, f.dtype.size());
    let bytes = s.tokens.saturating_mul(rb);
    // The low-latency one-shot: rows of whole 4-byte words, at most `norm_ll_max_bytes` and
    // what a low-latency slot holds (two bytes per data byte). The caller's own memory counts
    // as 4-byte aligned: a rank whose operands are not stages them locally.
    let ll = rb % 4 == 0 && bytes <= c.norm_ll_max_bytes.min(t.ll_slot / 2);
    let k = norm_form(t, c, bytes, ll);
    // an FP8 output has the one-shots, split or not (nk::FP8_KERNELS): the barrier one-shot
    // where the plain norm would run the two-shot, then the same split choice
    let k = match f.quant {
        Some(_) if k == NormKernel::TwoShot => NormKernel::OneShot,
        _ => k,
    };
    let k = norm_split(t, c, k, s.tokens, rb);
    let cap = norm_rows_per_launch(t, k, s.tokens, rb)?;
    let plan = NormPlan {
        kernel: k,
        quant: f.quant,
        rows: Pieces::new(s.tokens, cap),
        row_bytes: rb,
        es,
    };
    let first = plan.launch(t, c, 0);
    Ok(Plan {
        choice: first.shape.choice(Path::PeerToPeer, norm_algorithm(k), 0),
        exec: if s.tokens == 0 {
            Exec::Nothing
        } else {
            Exec::Norm(plan)
        },
    })
}

/// The norm's form for a call of `bytes`; `ll`: the low-latency one-shot can run it.
fn norm_form(t: &TeamFacts, c: &CommConfig, bytes: usize, ll: bool) -> NormKernel {
    match c.algorithm {
        Some(Algorithm::OneShotLl) if ll => NormKernel::OneShotLl,
        Some(Algorithm::OneShot | Algorithm::OneShotLl) => NormKernel::OneShot,
        Some(_) => NormKernel::TwoShot,
        None => {
            // One-shot moves (N-1)·M bytes out of every rank, the two-shot 3(N-1)/N·M (x to
            // the owners, then residual_out and out back): one-shot moves no more up to 3
            // ranks, and has one barrier instead of three. The low-latency one-shot (twice
            // the bytes, no barrier) below its own limit, inside the one-shot's.
            let limit = match c.one_shot_max_bytes {
                Some(b) => b,
                None if t.n <= 3 => usize::MAX,
                None => c.one_shot_max(t.n),
            };
            if bytes > limit {
                NormKernel::TwoShot
            } else if ll {
                NormKernel::OneShotLl
            } else {
                NormKernel::OneShot
            }
        }
    }
}

/// The one-shot forms with rows cut over clusters of `SPLIT` blocks, where they run and rows
/// are at least `SPLIT_MIN_ROW_BYTES` long and `tokens × SPLIT` blocks fit the grid; else `k`.
/// No rows, no clusters: a launch shape of `0 × SPLIT` blocks is none.
fn norm_split(
    t: &TeamFacts,
    c: &CommConfig,
    k: NormKernel,
    tokens: usize,
    row_bytes: usize,
) -> NormKernel {
    let max_blocks = shape::norm_max_blocks(t, c);
    // every cluster of the launch resident at once, where ranks share devices
    let fits = tokens
        .checked_mul(nk::SPLIT)
        .is_some_and(|b| b > 0 && b <= max_blocks)
        && tokens <= t.cluster_cap as usize;
    match k {
        NormKernel::OneShotLl if row_bytes >= nk::SPLIT_MIN_ROW_BYTES && fits => {
            NormKernel::OneShotLlSplit
        }
        NormKernel::OneShot if row_bytes >= nk::SPLIT_MIN_ROW_BYTES && fits => {
            NormKernel::OneShotSplit
        }
        _ => k,
    }
}

/// Rows per launch of form `k` (the staging holds one launch).
fn norm_rows_per_launch(
    t: &TeamFacts,
    k: NormKernel,
    tokens: usize,
    row_bytes: usize,
) -> Result<usize> {
    let half = t.stage_half;
    if !matches!(k, NormKernel::OneShotLl | NormKernel::OneShotLlSplit) && 2 * row_bytes > half {
        return Err(Error::invalid(
            "hidden",
            format!(
                "rows of {row_bytes} bytes; the staging slots hold {half} bytes and a row must fit twice (raise config.stage_bytes)"
            ),
        ));
    }
    Ok(match k {
        NormKernel::OneShot | NormKernel::OneShotSplit => half / row_bytes,
        NormKernel::TwoShot => t.n * (half / (2 * row_bytes)),
        // one launch: the call fits a low-latency slot, and for the split form its rows ×
        // SPLIT blocks fit the grid (norm_split)
        NormKernel::OneShotLl | NormKernel::OneShotLlSplit => tokens.max(1),
    })
}

/// A team of one rank: every collective is a local copy (or nothing, in place or empty); the
/// fused norm is the local add + RMSNorm of its input.
fn alone(f: &Facts) -> Result<Plan> {
    if matches!(f.kind, Kind::Norm | Kind::LocalNorm) {
        let mut p = local_norm(f)?;
        if f.kind == Kind::Norm {
            p.choice.path = Path::Local;
            p.choice.algorithm = Algorithm::Local;
        }
        return Ok(p);
    }
    let shape = Shape {
        blocks: 0,
        threads: 0,
    };
    Ok(Plan {
        choice: shape.choice(Path::Local, Algorithm::Local, 0),
        exec: if f.bytes == 0 {
            Exec::Nothing
        } else {
            Exec::LocalCopy
        },
    })
}

fn local_norm(f: &Facts) -> Result<Plan> {
    let s = f
        .norm
        .ok_or_else(|| Error::invalid("hidden", "a norm call without its shape"))?;
    let shape = Shape {
        blocks: s.tokens.clamp(1, 65535) as u32,
        threads: shape::norm_threads(s.row_bytes, f.dtype.size()),
    };
    Ok(Plan {
        choice: shape.choice(Path::PeerToPeer, Algorithm::NormOneShot, 0),
        exec: if s.tokens == 0 {
            Exec::Nothing
        } else {
            Exec::LocalNorm { shape }
        },
    })
}

/// The call header the ranks of a peer-to-peer allreduce kernel compare: what, how much,
/// which form, the grid, and the symmetric operands the kernel reaches on peers (by buffer id
/// and offset; the caller's own memory, and operands only this rank touches, as (0, 0)).
pub(crate) fn ar_header(
    f: &Facts,
    step: &ArStep,
    kernel: kernels::Kernel,
    input: (u64, u64),
    output: (u64, u64),
) -> u64 {
    // the reading two-shot reads every rank's input; the write-only two-shots only for a
    // scalar tail; every two-shot writes every rank's output; the one-shots touch only their
    // own operands
    let reads_peers_input = match step.algorithm {
        Algorithm::TwoShot => true,
        Algorithm::TwoShotPush | Algorithm::TwoShotCe => step.len % 16 != 0,
        _ => false,
    };
    let writes_peers_output = matches!(
        step.algorithm,
        Algorithm::TwoShot | Algorithm::TwoShotPush | Algorithm::TwoShotCe
    );
    let (i_id, i_off) = if reads_peers_input { input } else { (0, 0) };
    let (o_id, o_off) = if writes_peers_output { output } else { (0, 0) };
    kernels::call_header(&[
        (step.len / f.dtype.size()) as u64,
        f.dtype.code(),
        f.op.code(),
        kernel as u64,
        i_id,
        i_off,
        o_id,
        o_off,
        step.shape.blocks as u64,
    ])
}
