//! The public front: [`Communicator`] (a team, its symmetric memory and executors) and its
//! builder, and per rank a [`RankHandle`] whose every collective turns its borrowed views into
//! one call description and hands it to the funnel (check, plan, execute).

mod build;
#[cfg(feature = "cudarc")]
mod cudarc;
mod funnel;
mod moe;
mod rank;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cuda_multimem::{Device, DeviceRepr, Error, Result};
use parking_lot::Mutex;

pub use build::CommunicatorBuilder;
pub use rank::RankHandle;

use crate::buffer::{SymBuf, SymmetricBuffer};
use crate::call::{A2aFacts, Facts, Kind, NormShape};
use crate::config::CommConfig;
use crate::engine::{plan, TeamFacts, MAX_HIDDEN};
use crate::exec::multimem::Mm;
use crate::exec::p2p::P2p;
use crate::kernels::{err_word, ERR_BOUNDS, ERR_MISMATCH};
use crate::team::{Local, Ranks, Sym};
use crate::types::{Choice, DType, MulticastPolicy, Operands, Path, ReduceOp};

pub(crate) struct Inner {
    pub(crate) id: u64,
    pub(crate) ranks: Ranks,
    /// The bound of each rank's first call after the build or a recovery: `config`'s
    /// first-call timeout, by default at least the bootstrap's timeout.
    pub(crate) first_call: std::time::Duration,
    pub(crate) config: CommConfig,
    pub(crate) policy: MulticastPolicy,
    pub(crate) p2p: P2p,
    pub(crate) mm: Option<Mm>,
    /// What the planner knows of the team (the same on every rank).
    pub(crate) facts: TeamFacts,
    /// Why the multimem path is off (None: it is on).
    pub(crate) mm_status: Option<String>,
    pub(crate) next_buffer: AtomicU64,
    /// Collective allocations across processes happen one at a time, in call order.
    pub(crate) alloc_lock: Mutex<()>,
}

/// A team of NVLink-connected GPUs (1 to [`crate::kernels::MAX_RANKS`] = 72 ranks, one NVL72
/// domain; a team of one runs every collective as a
/// local copy, through the same API) and the collectives over it: all driven by
/// this process ([`Communicator::new`], [`Communicator::builder`]), or one device per process
/// ([`Communicator::builder_with_bootstrap`]).
///
/// Build it once (it allocates, maps and loads kernels), then make calls through each rank's
/// [`RankHandle`] ([`Communicator::rank`]) on that rank's stream, in the same order on every
/// rank. Each call chooses the path (multimem where multicast is on and pays off, else
/// peer-to-peer) and the algorithm by size and operands, and returns what it chose. Nothing is
/// reset between calls, so calls can be captured into a CUDA graph and replayed. Waits are
/// bounded by [`CommConfig::timeout`] (each rank's first call by
/// [`Communicator::first_call_timeout`]). A timeout or a disagreement is reported by the rank's
/// next call (and by [`Communicator::check`]); the team is then unusable until every rank calls
/// [`Communicator::recover`], or is dropped and built anew.
#[derive(Clone)]
pub struct Communicator {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("ranks", &self.inner.ranks.n)
            .field("local", &self.local_ranks())
            .field("multimem", &self.inner.mm.is_some())
            .field("config", &self.inner.config)
            .finish()
    }
}

impl Communicator {
    /// A communicator over `devices` (rank i is `devices[i]`) with the default configuration
    /// and multicast policy.
    pub fn new(devices: &[Device]) -> Result<Communicator> {
        Communicator::builder(devices).build()
    }

    /// Team size.
    pub fn size(&self) -> usize {
        self.inner.ranks.n
    }

    /// The ranks this process drives.
    pub fn local_ranks(&self) -> Vec<usize> {
        self.inner.ranks.locals.iter().map(|l| l.rank).collect()
    }

    /// The device of `rank` (a rank this process drives).
    pub fn device(&self, rank: usize) -> Result<&Device> {
        Ok(&self.inner.ranks.local(rank)?.device)
    }

    /// The configuration.
    pub fn config(&self) -> &CommConfig {
        &self.inner.config
    }

    /// How long each rank's first call after the build (and after [`Communicator::recover`])
    /// waits for its peers: [`CommConfig::first_call_timeout`] where set, else the longest of
    /// [`CommConfig::timeout`], [`CommConfig::FIRST_CALL_TIMEOUT`] and the bootstrap's own
    /// timeout ([`crate::Bootstrap::timeout`]: as long as the bootstrap let the build wait for
    /// the slowest rank). Ranks that start unevenly — weight loading, JIT and library warm-up
    /// before their first collective — meet there; make the first call a warm-up where that
    /// happens.
    pub fn first_call_timeout(&self) -> std::time::Duration {
        self.inner.first_call
    }

    /// The multicast policy it was built with.
    pub fn multicast_policy(&self) -> MulticastPolicy {
        self.inner.policy
    }

    /// Whether the multimem path is available (multicast allowed, supported, and built).
    pub fn multimem_active(&self) -> bool {
        self.inner.mm.is_some()
    }

    /// Why the multimem path is off (`None` when it is on).
    pub fn multimem_unavailable_reason(&self) -> Option<&str> {
        self.inner.mm_status.as_deref()
    }

    /// The handle through which rank `rank` (driven by this process) makes its calls.
    pub fn rank(&self, rank: usize) -> Result<RankHandle<'_>> {
        Ok(RankHandle {
            comm: self,
            local: self.inner.ranks.local(rank)?,
        })
    }

    /// A symmetric buffer of `len` elements on every rank, zeroed, each rank's part mapped on
    /// every peer. Across processes this is a collective call: every rank makes it, with the
    /// same length and type, in the same order (a rank that refuses its arguments makes every
    /// rank fail the same way).
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<SymmetricBuffer<T>> {
        let _g = self.inner.alloc_lock.lock();
        let ranks = &self.inner.ranks;
        ranks.usable()?;
        let size = std::mem::size_of::<T>();
        let bytes = len.checked_mul(size);
        let refusal = match bytes {
            _ if len == 0 => Some(Error::invalid("len", "0; expected at least one element")),
            Some(0) => Some(Error::invalid(
                "len",
                format!("{len} elements of a zero-sized type: no bytes to allocate"),
            )),
            None => Some(Error::invalid(
                "len",
                format!("{len} elements of {size} bytes overflow usize"),
            )),
            Some(b) if b > 1 << 40 => Some(Error::invalid(
                "len",
                format!("{b} bytes per rank; at most 1 TiB"),
            )),
            _ => None,
        };
        ranks.agree(
            "a symmetric allocation",
            bytes.unwrap_or(u64::MAX as usize) as u64,
            refusal,
        )?;
        let bytes = bytes.unwrap_or_default();
        let sym = Sym::new(ranks, bytes, true).map_err(|e| {
            if ranks.bootstrap.is_some() {
                // A rank that failed half-way leaves its peers in another state.
                ranks.break_with(e)
            } else {
                e
            }
        })?;
        let id = self.inner.next_buffer.fetch_add(1, Ordering::Relaxed);
        Ok(SymmetricBuffer::new(
            SymBuf::new(self.inner.id, id, ranks, sym)?,
            len,
        ))
    }

    /// What an allreduce of `count` elements of `dtype` with `op` runs when its operands are
    /// `operands` (16-byte aligned): path, algorithm, launch shape, chunks through the scratch.
    /// It asks the planner the call itself asks.
    pub fn choice(
        &self,
        dtype: DType,
        op: ReduceOp,
        count: usize,
        operands: Operands,
    ) -> Result<Choice> {
        let bytes = count.checked_mul(dtype.size()).ok_or_else(|| {
            Error::invalid(
                "count",
                format!("{count} elements of {dtype} overflow usize"),
            )
        })?;
        let sym = operands == Operands::Symmetric;
        let facts = Facts {
            kind: Kind::AllReduce,
            dtype,
            op,
            root: 0,
            bytes,
            chunk: bytes,
            sym_in: sym,
            sym_out: sym,
            sym_addrs: 0,
            norm: None,
            quant: None,
            a2a: None,
            moe_ll: false,
        };
        Ok(plan(&self.inner.facts, &self.inner.config, &facts)?.choice)
    }

    /// What an all-to-all runs for an input of `input_bytes` and an output of `output_bytes`
    /// whose kind is `output` (where its parts land), with counts (`all_to_all_v`,
    /// `all_to_all_v_dev`: `counts` true) or equal parts, in place or not: the form (the
    /// low-latency form for small parts; else direct into a symmetric output, or through the
    /// scratch, `staged_chunks` 1) and the launch shape. It asks the planner the call itself
    /// asks; an output the scratch cannot hold is the call's error.
    pub fn all_to_all_choice(
        &self,
        input_bytes: usize,
        output_bytes: usize,
        counts: bool,
        output: Operands,
        in_place: bool,
    ) -> Result<Choice> {
        let sym = output == Operands::Symmetric;
        let facts = Facts {
            kind: Kind::AllToAll,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            root: 0,
            bytes: input_bytes,
            chunk: input_bytes,
            sym_in: sym,
            sym_out: sym,
            sym_addrs: 0,
            norm: None,
            quant: None,
            a2a: Some(A2aFacts {
                mode: if counts {
                    crate::kernels::alltoall::MODE_HOST
                } else {
                    crate::kernels::alltoall::MODE_EQUAL
                },
                elem: 1,
                out_bytes: output_bytes,
                in_place: in_place && !counts,
            }),
            moe_ll: false,
        };
        Ok(plan(&self.inner.facts, &self.inner.config, &facts)?.choice)
    }

    /// What [`RankHandle::all_reduce_add_rms_norm`] runs for `tokens` rows of `hidden`
    /// elements of `dtype`: the form (the low-latency one-shot up to `norm_ll_max_bytes` when a
    /// row is whole 4-byte words; else one-shot for teams of up to 3, and up to the one-shot
    /// limit for larger teams; else two-shot — docs/design/rmsnorm.md says why) and the launch
    /// shape of its first launch. `staged_chunks` is 0: the operands are used in place. It asks
    /// the planner the call itself asks.
    pub fn add_rms_norm_choice(
        &self,
        dtype: DType,
        tokens: usize,
        hidden: usize,
    ) -> Result<Choice> {
        self.norm_choice(dtype, tokens, hidden, None)
    }

    /// What [`RankHandle::all_reduce_add_rms_norm_fp8`] runs for `tokens` rows of `hidden`
    /// elements of `dtype` with an FP8 output of `scaling`: the form chosen as for the plain norm
    /// among the one-shots, split where the plain norm splits (the barrier one-shot, split or
    /// not, where the plain norm would run the two-shot), and the launch shape of its first
    /// launch. It asks the planner the call asks.
    pub fn add_rms_norm_fp8_choice(
        &self,
        dtype: DType,
        tokens: usize,
        hidden: usize,
        scaling: crate::types::Fp8Scaling,
    ) -> Result<Choice> {
        self.norm_choice(dtype, tokens, hidden, Some(scaling))
    }

    fn norm_choice(
        &self,
        dtype: DType,
        tokens: usize,
        hidden: usize,
        quant: Option<crate::types::Fp8Scaling>,
    ) -> Result<Choice> {
        let row_bytes = hidden
            .checked_mul(dtype.size())
            .filter(|_| hidden > 0 && hidden <= MAX_HIDDEN)
            .ok_or_else(|| {
                Error::invalid("hidden", format!("{hidden}; expected 1 to {MAX_HIDDEN}"))
            })?;
        let bytes = tokens.saturating_mul(row_bytes);
        let facts = Facts {
            kind: Kind::Norm,
            dtype,
            op: ReduceOp::Sum,
            root: 0,
            bytes,
            chunk: bytes,
            sym_in: false,
            sym_out: false,
            sym_addrs: 0,
            norm: Some(NormShape {
                tokens,
                hidden,
                row_bytes,
                eps: 0.0,
            }),
            a2a: None,
            quant,
            moe_ll: false,
        };
        Ok(plan(&self.inner.facts, &self.inner.config, &facts)?.choice)
    }

    /// Report a timeout or a disagreement between ranks seen by earlier calls of the ranks this
    /// process drives (synchronise their streams first), naming the rank (and the peer it
    /// concerns, where the kernel knew it), read from the device. Every call reports the same
    /// by itself before it launches, from the rank's error mirror (a host load) — `check` is
    /// for a point where no further call comes, and it also reports the all-to-all's counts out
    /// of range. After an error, the team refuses further calls ([`Error::Unusable`]) until
    /// [`Communicator::recover`].
    pub fn check(&self) -> Result<()> {
        let inner = &*self.inner;
        inner.ranks.usable()?;
        let mut worst: Option<Error> = None;
        for l in &inner.ranks.locals {
            if let Some(e) = inner.rank_error(l)? {
                if worst.is_none() || matches!(e, Error::RanksDisagree { .. }) {
                    worst = Some(e);
                }
            }
        }
        match worst {
            Some(e) => Err(inner.ranks.break_with(e)),
            None => Ok(()),
        }
    }
}

impl Communicator {
    /// Make a team that reported a timeout or a disagreement usable again without rebuilding
    /// it, when every rank agrees: every rank (every process of a team across processes) calls
    /// `recover` at the same point, after its last collective call. It waits for the work on
    /// this process's devices (every collective kernel ends by its timeout), meets the other
    /// processes through the bootstrap (so no peer's kernel writes into this rank's memory any
    /// more), puts every rank's protocol state back to a fresh team's (error words, counters,
    /// signals, call headers, low-latency flags; the multicast team's headers), meets them again,
    /// clears the error mirrors and the failure; the next call of each rank has the first-call
    /// bound again ([`Communicator::first_call_timeout`]). Symmetric buffers and their contents
    /// stay. Calls made after a failure and before `recover` have left their outputs undefined.
    /// An error here (a peer process that is gone, so the bootstrap's meeting fails or times
    /// out; a device whose context a kernel fault killed) is [`Error::Unusable`] naming the
    /// cause and saying to rebuild: the team stays unusable; drop it and build a new one. A team of one process (no bootstrap) recovers without meeting anyone.
    pub fn recover(&self) -> Result<()> {
        self.try_recover().map_err(|e| {
            self.inner.ranks.break_with(Error::Unusable {
                cause: format!(
                    "the recovery failed ({e}); this team cannot go on: drop it and build a new one"
                ),
            })
        })
    }

    fn try_recover(&self) -> Result<()> {
        let inner = &*self.inner;
        let ranks = &inner.ranks;
        let mut devices: Vec<&Device> = Vec::new();
        for l in &ranks.locals {
            if !devices.contains(&&l.device) {
                devices.push(&l.device);
            }
        }
        for d in &devices {
            d.synchronize()?;
        }
        if ranks.bootstrap.is_some() {
            ranks.meet("recovery: every rank's work has finished")?;
        }
        inner.p2p.reset(ranks)?;
        if let Some(mm) = &inner.mm {
            mm.reset()?;
        }
        if ranks.bootstrap.is_some() {
            ranks.meet("recovery: every rank's state is reset")?;
        }
        for l in &ranks.locals {
            l.calls.store(0, Ordering::Relaxed);
            l.clear_mirror();
        }
        ranks.restore();
        Ok(())
    }
}

impl Inner {
    /// What the error words of local rank `l` say (a disagreement before a timeout), read from
    /// the device ([`Communicator::check`]; the bounds word too).
    pub(crate) fn rank_error(&self, l: &Local) -> Result<Option<Error>> {
        let mut words = vec![(Path::PeerToPeer, self.p2p.error_word(l.rank)?)];
        if let Some(mm) = &self.mm {
            words.push((Path::Multimem, mm.error_word(l.rank)?));
        }
        Ok(self.word_error(l, &words))
    }

    /// What the error mirror of local rank `l` says: the error words its kernels copied to the
    /// host when they failed or found a failure (a plain load, no driver call: every call looks
    /// before it launches). `None`: no failure has reached the host.
    pub(crate) fn mirrored_error(&self, l: &Local) -> Option<Error> {
        let [p2p, mm] = l.mirrored();
        if p2p == 0 && mm == 0 {
            return None;
        }
        self.word_error(l, &[(Path::PeerToPeer, p2p), (Path::Multimem, mm)])
    }

    /// The error that error words `words` (by path) of local rank `l` make: a disagreement
    /// before a bounds error before a timeout; `None` where all are 0.
    fn word_error(&self, l: &Local, words: &[(Path, u32)]) -> Option<Error> {
        let calls = l.calls.load(Ordering::Relaxed);
        let (rank, dev) = (l.rank, l.device.ordinal());
        let way_back =
            "every rank calls Communicator::recover to go on with this team, or it is rebuilt";
        let mut found = None;
        for &(path, w) in words {
            let (code, peer) = err_word(w);
            if code == ERR_MISMATCH {
                let whose = peer.map_or("a peer".to_string(), |p| format!("rank {p}"));
                return Some(Error::RanksDisagree {
                    what: format!(
                        "rank {rank} (device {dev}) met {whose}, whose call differs in size, type, operation, algorithm or operands ({path} path; {calls} call(s) queued on this rank; {way_back})"
                    ),
                });
            }
            if code == ERR_BOUNDS && found.is_none() {
                found = Some(Error::invalid(
                    "counts",
                    format!(
                        "rank {rank} (device {dev}): a count, offset or expert id read on the device was out of range, or a peer's count did not match what this rank expects; what it concerned was not moved ({path} path; {calls} call(s) queued on this rank)"
                    ),
                ));
                continue;
            }
            if code != 0 && found.is_none() {
                let whom = peer.map_or("a peer".to_string(), |p| format!("rank {p}"));
                found = Some(Error::Timeout {
                    what: format!(
                        "a {path} barrier of rank {rank} (device {dev}): {whom} did not arrive (it died, hung, or called something else; {calls} call(s) queued on this rank; {way_back})"
                    ),
                    after: self.config.timeout,
                });
            }
        }
        found
    }
}
