//! The communicator: a team of ranks, its symmetric memory, its executors (peer-to-peer, and
//! multimem where multicast is on), and per rank a handle whose calls choose among them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cuda_multimem::{Device, DeviceRepr, Error, Result, StreamRef};
use parking_lot::Mutex;

use crate::bootstrap::Bootstrap;
use crate::config::CommConfig;
use crate::kernels::gather::Collective;
use crate::kernels::{ERR_MISMATCH, MAX_RANKS};
use crate::memory::{Sym, SymBuf, SymmetricBuffer};
use crate::mm::{multimem_pays_off, multimem_supports, Mm};
use crate::operand::{Dst, Operand, Place, Src};
use crate::p2p::{self, P2p, PrologueCopy};
use crate::ranks::{Local, Ranks};
use crate::types::{Algorithm, Choice, DType, Element, MulticastPolicy, Operands, Path, ReduceOp};

static NEXT_COMM: AtomicU64 = AtomicU64::new(1);

enum Members {
    Local(Vec<Device>),
    Process(Device, Box<dyn Bootstrap>),
}

/// Builds a [`Communicator`]: its members (devices of this process, or one device per process
/// with a [`Bootstrap`]), its configuration, and when it uses NVLink multicast.
pub struct CommunicatorBuilder {
    members: Members,
    config: CommConfig,
    multicast: MulticastPolicy,
}

impl std::fmt::Debug for CommunicatorBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommunicatorBuilder")
            .field("config", &self.config)
            .field("multicast", &self.multicast)
            .finish_non_exhaustive()
    }
}

impl CommunicatorBuilder {
    /// The configuration (default: [`CommConfig::default`]).
    pub fn config(mut self, config: CommConfig) -> Self {
        self.config = config;
        self
    }

    /// When to use NVLink multicast (default: [`MulticastPolicy::WhenItPaysOff`]).
    pub fn multicast(mut self, policy: MulticastPolicy) -> Self {
        self.multicast = policy;
        self
    }

    /// Build: check the members, allocate and map the symmetric areas, load the kernels, and
    /// (by the multicast policy) build the multicast team. Across processes every rank builds
    /// with the same configuration and policy, at the same point of its program.
    pub fn build(self) -> Result<Communicator> {
        self.config.validate()?;
        let id = NEXT_COMM.fetch_add(1, Ordering::Relaxed);
        match self.members {
            Members::Local(devices) => build_local(id, devices, self.config, self.multicast),
            Members::Process(device, bootstrap) => {
                build_process(id, device, bootstrap, self.config, self.multicast)
            }
        }
    }
}

fn check_devices(devices: &[Device]) -> Result<()> {
    for (i, d) in devices.iter().enumerate() {
        if !d.driver().same_as(devices[0].driver()) {
            return Err(Error::invalid(
                "devices",
                format!(
                    "device {} (position {i}) comes from another Driver value than device {}; every member must come from the same Driver",
                    d.ordinal(),
                    devices[0].ordinal()
                ),
            ));
        }
        if devices[..i].contains(d) {
            return Err(Error::invalid(
                "devices",
                format!("device {} appears twice", d.ordinal()),
            ));
        }
        if !d.supports_vmm()? {
            return Err(Error::DeviceUnsupported {
                device: d.ordinal(),
                what: "virtual memory management (symmetric buffers are VMM mappings)",
            });
        }
        for p in &devices[..i] {
            if !d.can_access_peer(p)? {
                return Err(Error::DeviceUnsupported {
                    device: d.ordinal(),
                    what: "peer access to another device of the team",
                });
            }
        }
    }
    Ok(())
}

/// Returned by [`RankHandle::check_stream`]; when the call that holds it returns, its work is
/// queued, and the rank's event is recorded behind it (outside a graph capture: captured work
/// runs when the graph does, and an event recorded in a capture says nothing until then).
/// It also holds the rank's stream lock for the whole call, so calls of one rank from several
/// threads queue their work one call after another, never interleaved (a call may be several
/// launches and copies through the rank's staging).
pub(crate) struct CallEnd<'s> {
    done: &'s cuda_multimem::Event,
    stream: StreamRef<'s>,
    _serial: parking_lot::MutexGuard<'s, Option<usize>>,
}

impl Drop for CallEnd<'_> {
    fn drop(&mut self) {
        if let Ok(false) = self.stream.is_capturing() {
            // A failed record leaves the event at an earlier call: the next check on another
            // stream may then let it through early, as the check did before it existed.
            let _ = self.done.record(self.stream);
        }
    }
}

fn local(rank: usize, device: &Device) -> Result<Local> {
    Ok(Local {
        rank,
        device: device.clone(),
        kernels: p2p::load_kernels(device)?,
        gather: crate::gather::load_kernels(device)?,
        last_stream: Mutex::new(None),
        done: cuda_multimem::Event::new(device, false)?,
        calls: AtomicU64::new(0),
        norm: crate::norm::load_kernels(device)?,
        ce: Mutex::new(crate::gather::CeLane::new(device)?),
    })
}

fn multiprocessors(d: &Device) -> Result<u32> {
    Ok(d.multiprocessor_count()?.max(1) as u32)
}

fn build_local(
    id: u64,
    devices: Vec<Device>,
    config: CommConfig,
    policy: MulticastPolicy,
) -> Result<Communicator> {
    let n = devices.len();
    if !(2..=MAX_RANKS).contains(&n) {
        return Err(Error::invalid(
            "devices",
            format!("{n} device(s); a team has 2 to {MAX_RANKS}"),
        ));
    }
    check_devices(&devices)?;
    let mut fewest = u32::MAX;
    let mut locals = Vec::new();
    for (rank, d) in devices.iter().enumerate() {
        fewest = fewest.min(multiprocessors(d)?);
        locals.push(local(rank, d)?);
    }
    let ranks = Ranks::new(n, locals, None);
    let p2p = P2p::new(id, &ranks, &config, fewest)?;
    let (mm, mm_status) = match policy {
        MulticastPolicy::Never => (None, Some("the multicast policy is Never".to_string())),
        MulticastPolicy::WhenItPaysOff if !multimem_pays_off(n) => (
            None,
            Some(format!(
                "a team of {n} moves fewer bytes peer-to-peer (multicast pays off above 3 ranks)"
            )),
        ),
        p => match Mm::new(&devices, &config, fewest) {
            Ok(mm) => (Some(mm), None),
            Err(e) if p == MulticastPolicy::Always => return Err(e),
            Err(e) => (None, Some(e.to_string())),
        },
    };
    Ok(Communicator {
        inner: Arc::new(Inner {
            id,
            ranks,
            config,
            policy,
            p2p,
            mm,
            mm_status,
            next_buffer: AtomicU64::new(1),
            alloc_lock: Mutex::new(()),
        }),
    })
}

fn build_process(
    id: u64,
    device: Device,
    bootstrap: Box<dyn Bootstrap>,
    config: CommConfig,
    policy: MulticastPolicy,
) -> Result<Communicator> {
    let (rank, n) = (bootstrap.rank(), bootstrap.size());
    if !(2..=MAX_RANKS).contains(&n) || rank >= n {
        return Err(Error::invalid(
            "bootstrap",
            format!("rank {rank} of {n}; a team has 2 to {MAX_RANKS} ranks"),
        ));
    }
    check_devices(std::slice::from_ref(&device))?;
    let ranks = Ranks::new(n, vec![local(rank, &device)?], Some(bootstrap));
    let mine = multiprocessors(&device)?;
    let all = ranks.exchange("multiprocessor counts", &mine.to_le_bytes(), Some(4))?;
    let fewest = all
        .iter()
        .map(|b| u32::from_le_bytes(b[..4].try_into().unwrap_or_default()))
        .min()
        .unwrap_or(mine)
        .max(1);
    let mut fp = config.fingerprint(n, fewest);
    fp.push(policy as u8);
    let all = ranks.exchange("configurations", &fp, Some(fp.len()))?;
    if let Some(r) = all.iter().position(|x| *x != fp) {
        return Err(Error::RanksDisagree {
            what: format!(
                "rank {r} passed another configuration or multicast policy than rank {rank}; every rank must pass the same"
            ),
        });
    }
    if policy == MulticastPolicy::Always {
        return Err(Error::invalid(
            "multicast",
            "Always: multicast teams across processes are not supported yet (use Never or WhenItPaysOff)",
        ));
    }
    let p2p = P2p::new(id, &ranks, &config, fewest)?;
    Ok(Communicator {
        inner: Arc::new(Inner {
            id,
            ranks,
            config,
            policy,
            p2p,
            mm: None,
            mm_status: Some("multicast teams across processes are not supported yet".into()),
            next_buffer: AtomicU64::new(1),
            alloc_lock: Mutex::new(()),
        }),
    })
}

pub(crate) struct Inner {
    pub(crate) id: u64,
    pub(crate) ranks: Ranks,
    pub(crate) config: CommConfig,
    pub(crate) policy: MulticastPolicy,
    pub(crate) p2p: P2p,
    pub(crate) mm: Option<Mm>,
    /// Why the multimem path is off (None: it is on).
    mm_status: Option<String>,
    next_buffer: AtomicU64,
    /// Collective allocations across processes happen one at a time, in call order.
    alloc_lock: Mutex<()>,
}

/// A team of NVLink-connected GPUs (2 to 8 ranks) and the collectives over it: all driven by
/// this process ([`Communicator::new`], [`Communicator::builder`]), or one device per process
/// ([`Communicator::builder_with_bootstrap`]).
///
/// Build it once (it allocates, maps and loads kernels), then make calls through each rank's
/// [`RankHandle`] ([`Communicator::rank`]) on that rank's stream, in the same order on every
/// rank. Each call chooses the path (multimem where multicast is on and pays off, else
/// peer-to-peer) and the algorithm by size and operands, and returns what it chose. Nothing is
/// reset between calls, so calls can be captured into a CUDA graph and replayed. Waits are
/// bounded by [`CommConfig::timeout`]; after a timeout or a disagreement ([`Communicator::check`])
/// the team is unusable: drop it and build a new one.
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

    /// A builder over `devices`, all driven by this process (rank i is `devices[i]`).
    pub fn builder(devices: &[Device]) -> CommunicatorBuilder {
        CommunicatorBuilder {
            members: Members::Local(devices.to_vec()),
            config: CommConfig::default(),
            multicast: MulticastPolicy::default(),
        }
    }

    /// A builder for one rank of a team that spans processes (one device per process):
    /// `device` is this process's device, `bootstrap` says which rank it is and carries the
    /// exchanges (POSIX file descriptors where it can, else fabric handles as bytes). Every rank
    /// builds, and later allocates, in the same order; a rank that does not arrive makes the
    /// others fail with the bootstrap's timeout.
    pub fn builder_with_bootstrap(
        device: &Device,
        bootstrap: Box<dyn Bootstrap>,
    ) -> CommunicatorBuilder {
        CommunicatorBuilder {
            members: Members::Process(device.clone(), bootstrap),
            config: CommConfig::default(),
            multicast: MulticastPolicy::default(),
        }
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
        let inner = &*self.inner;
        // `staged_chunks` is a u32: a count of more chunks cannot be reported (0 would say
        // "no copies").
        let chunks_of = |chunk: usize| {
            u32::try_from(bytes.div_ceil(chunk)).map_err(|_| {
                Error::invalid(
                    "count",
                    format!(
                        "{count} elements of {dtype}: more than {} chunks of {chunk} bytes",
                        u32::MAX
                    ),
                )
            })
        };
        if let Some(mm) = inner.mm_for(dtype, op, bytes) {
            let mut c = mm.shape(&inner.config, bytes.min(mm.region));
            c.staged_chunks = chunks_of(mm.region)?.max(1);
            return Ok(c);
        }
        let n = inner.ranks.n;
        let c = &inner.config;
        let p2p = &inner.p2p;
        // The call's own decisions (`P2p::direct`, then `RankHandle::staged` for its first
        // chunk) on 16-byte aligned operands, the caller's own on both sides for `Local`: the
        // fallbacks of the low-latency form (a whole number of 4-byte words) and the refusals
        // of a forced form included.
        let sym = operands == Operands::Symmetric;
        if let Some(alg) = p2p.direct_for(n, c, 0, sym, sym, bytes)? {
            return Ok(p2p.shape(n, c, bytes, alg));
        }
        let chunk = p2p.scratch_region();
        if chunk == 0 {
            return Err(no_scratch(bytes, c.one_shot_max(n)));
        }
        let staged_chunks = chunks_of(chunk)?;
        let len = bytes.min(chunk);
        let alg = match p2p.direct_for(n, c, 0, false, false, len)? {
            Some(a) => a,
            None => match p2p.direct_for(n, c, 0, false, true, len)? {
                Some(a) => a,
                None => p2p.direct_for(n, c, 0, true, true, len)?.ok_or_else(|| {
                    Error::invalid("count", format!("{len} bytes cannot be staged"))
                })?,
            },
        };
        Ok(Choice {
            staged_chunks,
            ..p2p.shape(n, c, len, alg)
        })
    }

    /// Report a timeout or a disagreement between ranks seen by earlier calls of the ranks this
    /// process drives (synchronise their streams first), naming the rank. After an error, the
    /// team refuses further calls ([`Error::Unusable`]).
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

fn no_scratch(bytes: usize, one_shot: usize) -> Error {
    Error::invalid(
        "count",
        format!(
            "{bytes} bytes of the caller's own memory: above the one-shot limit ({one_shot} bytes) such calls go through the communicator's scratch, and it has none (config.scratch_bytes = 0); use a SymmetricBuffer or give the scratch room"
        ),
    )
}

impl Inner {
    /// What the error words of local rank `l` say (a disagreement before a timeout).
    fn rank_error(&self, l: &Local) -> Result<Option<Error>> {
        let mut words = vec![(Path::PeerToPeer, self.p2p.error_word(l.rank)?)];
        if let Some(mm) = &self.mm {
            words.push((Path::Multimem, mm.error_word(l.rank)?));
        }
        let calls = l.calls.load(Ordering::Relaxed);
        let mut found = None;
        for (path, w) in words {
            if w == ERR_MISMATCH {
                return Ok(Some(Error::RanksDisagree {
                    what: format!(
                        "rank {} (device {}) met a peer whose call differs in size, type, operation, algorithm or operands ({path} path; {calls} call(s) queued on this rank)",
                        l.rank,
                        l.device.ordinal()
                    ),
                }));
            }
            if w != 0 && found.is_none() {
                found = Some(Error::Timeout {
                    what: format!(
                        "a {path} barrier of rank {} (device {}): a peer did not arrive (it died, hung, or called something else; {calls} call(s) queued on this rank)",
                        l.rank,
                        l.device.ordinal()
                    ),
                    after: self.config.timeout,
                });
            }
        }
        Ok(found)
    }

    /// Whether the multicast policy takes the multimem path for a message of `bytes`: `Always`,
    /// or `WhenItPaysOff` for teams where it pays off and messages of at least
    /// `multimem_min_bytes` (the executor exists only where multicast is on).
    fn mm_wanted(&self, bytes: usize) -> bool {
        match self.policy {
            MulticastPolicy::Never => false,
            MulticastPolicy::Always => true,
            MulticastPolicy::WhenItPaysOff => {
                multimem_pays_off(self.ranks.n) && bytes >= self.config.multimem_min_bytes
            }
        }
    }

    fn mm_for(&self, dtype: DType, op: ReduceOp, bytes: usize) -> Option<&Mm> {
        let mm = self.mm.as_ref()?;
        let wanted = self.mm_wanted(bytes);
        (wanted && self.config.algorithm.is_none() || self.policy == MulticastPolicy::Always)
            .then_some(mm)
            .filter(|_| multimem_supports(dtype, op))
    }

    /// The multimem executor for a reduce-scatter, all-gather or broadcast whose whole buffer
    /// (reduce-scatter's input, all-gather's output, broadcast's message) is `bytes`, when the
    /// policy wants it (the allreduce's rule; `config.algorithm` is an allreduce setting and
    /// plays no part) and the kernel exists (reduce-scatter: where `multimem.ld_reduce` has the
    /// type and operator). The same answer on every rank making the same call.
    pub(crate) fn mm_for_gather(
        &self,
        coll: Collective,
        dtype: DType,
        op: ReduceOp,
        bytes: usize,
    ) -> Option<&Mm> {
        let mm = self.mm.as_ref()?;
        (self.mm_wanted(bytes) && (!coll.reduces() || multimem_supports(dtype, op))).then_some(mm)
    }
}

/// One rank's view of a [`Communicator`]: the calls that rank makes, on a stream of its device.
/// Every rank makes the same calls (sizes, types, operators, symmetric offsets) in the same order.
///
/// A rank takes one stream at a time (a call on another stream while the last call has not
/// finished is refused naming `stream`), and its calls from several threads queue their work
/// one whole call after another (each call holds the rank's lock while it queues); which of two
/// concurrent calls goes first is up to the threads, and every rank must see the same order.
#[derive(Clone, Copy)]
pub struct RankHandle<'a> {
    pub(crate) comm: &'a Communicator,
    pub(crate) local: &'a Local,
}

impl std::fmt::Debug for RankHandle<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RankHandle(rank {} of {}, device {})",
            self.local.rank,
            self.comm.size(),
            self.local.device.ordinal()
        )
    }
}

impl<'a> RankHandle<'a> {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.local.rank
    }

    /// Its device.
    pub fn device(&self) -> &'a Device {
        &self.local.device
    }

    /// Report a timeout or a disagreement seen by this rank's earlier calls (synchronise its
    /// stream first), as [`Communicator::check`] does for every rank of this process: for a
    /// thread per rank. This rank's own failure comes first; without one, an earlier failure of
    /// the team is [`Error::Unusable`]. After an error the team refuses further calls.
    pub fn check(&self) -> Result<()> {
        let inner = &*self.comm.inner;
        match inner.rank_error(self.local)? {
            Some(e) => Err(inner.ranks.break_with(e)),
            None => inner.ranks.usable(),
        }
    }

    /// Allreduce `input` into `output` with `op`, queued on `stream` (a stream of this rank's
    /// device: our [`cuda_multimem::Stream`] as `&stream`, or any [`StreamRef`]). Operands:
    /// symmetric buffers and views (no extra copies), or the caller's own memory (one-shot
    /// directly up to the one-shot limit, above it through the scratch; see
    /// [`crate::Choice::staged_chunks`]). Returns what ran.
    pub fn all_reduce<'s, 'd, 'x, T: Element>(
        &self,
        input: impl Into<Src<'s, T>>,
        output: impl Into<Dst<'d, T>>,
        op: ReduceOp,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<Choice> {
        let (i, o) = (input.into(), output.into());
        let ib = typed_bytes::<T>(i.len, i.op.bytes, "input")?;
        let ob = typed_bytes::<T>(o.len, o.op.bytes, "output")?;
        self.run(
            T::DTYPE,
            Operand { bytes: ib, ..i.op },
            Operand { bytes: ob, ..o.op },
            op,
            stream.into(),
            crate::operand::OUT_OF_PLACE,
        )
    }

    /// Allreduce `buf` in place.
    pub fn all_reduce_in_place<'d, 'x, T: Element>(
        &self,
        buf: impl Into<Dst<'d, T>>,
        op: ReduceOp,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<Choice> {
        let b = buf.into();
        let bytes = typed_bytes::<T>(b.len, b.op.bytes, "buf")?;
        let o = Operand { bytes, ..b.op };
        self.run(T::DTYPE, o, o, op, stream.into(), crate::operand::IN_PLACE)
    }

    /// [`RankHandle::all_reduce`] for engines that know the element type only at run time:
    /// byte views (`SymmetricBuffer<u8>`, `DeviceBuffer<u8>`, ...) whose lengths must be a
    /// whole number of `dtype` elements and whose addresses must be aligned to it.
    pub fn all_reduce_dyn<'s, 'd, 'x>(
        &self,
        dtype: DType,
        input: impl Into<Src<'s, u8>>,
        output: impl Into<Dst<'d, u8>>,
        op: ReduceOp,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<Choice> {
        let (i, o) = (input.into(), output.into());
        for (len, arg) in [(i.len, "input"), (o.len, "output")] {
            if len % dtype.size() != 0 {
                return Err(Error::invalid(
                    arg,
                    format!(
                        "{len} bytes; not a whole number of {}-byte {dtype}",
                        dtype.size()
                    ),
                ));
            }
        }
        self.run(
            dtype,
            i.op,
            o.op,
            op,
            stream.into(),
            crate::operand::OUT_OF_PLACE,
        )
    }

    /// [`RankHandle::all_reduce_dyn`] in place.
    pub fn all_reduce_dyn_in_place<'d, 'x>(
        &self,
        dtype: DType,
        buf: impl Into<Dst<'d, u8>>,
        op: ReduceOp,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<Choice> {
        let b = buf.into();
        if b.len % dtype.size() != 0 {
            return Err(Error::invalid(
                "buf",
                format!(
                    "{} bytes; not a whole number of {}-byte {dtype}",
                    b.len,
                    dtype.size()
                ),
            ));
        }
        self.run(
            dtype,
            b.op,
            b.op,
            op,
            stream.into(),
            crate::operand::IN_PLACE,
        )
    }

    /// Allreduce cudarc device memory (feature `cudarc`): `input` and `output` are
    /// `CudaSlice`/`CudaView`/`CudaViewMut` of this rank's device, `stream` a cudarc stream of
    /// it; cudarc's event tracking orders the call after earlier writes of the operands. The
    /// caller's own memory: see [`RankHandle::all_reduce`] for what that costs.
    #[cfg(feature = "cudarc")]
    pub fn all_reduce_cudarc<T>(
        &self,
        input: &impl cudarc::driver::DevicePtr<T>,
        output: &mut impl cudarc::driver::DevicePtrMut<T>,
        op: ReduceOp,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<Choice>
    where
        T: Element + cudarc::driver::DeviceRepr,
    {
        let s = StreamRef::from_cudarc(&self.local.device, stream)?;
        crate::operand::check_cudarc(input, &self.local.device, "input")?;
        crate::operand::check_cudarc(output, &self.local.device, "output")?;
        let (ilen, olen) = (input.len(), output.len());
        let (ip, _ri) = input.device_ptr(stream);
        let (op_, _ro) = output.device_ptr_mut(stream);
        let i = crate::operand::cudarc_src::<T>(ip, ilen, &self.local.device);
        let o = crate::operand::cudarc_dst::<T>(op_, olen, &self.local.device);
        self.all_reduce(i, o, op, s)
    }

    /// [`RankHandle::all_reduce_cudarc`] in place.
    #[cfg(feature = "cudarc")]
    pub fn all_reduce_cudarc_in_place<T>(
        &self,
        buf: &mut impl cudarc::driver::DevicePtrMut<T>,
        op: ReduceOp,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<Choice>
    where
        T: Element + cudarc::driver::DeviceRepr,
    {
        let s = StreamRef::from_cudarc(&self.local.device, stream)?;
        crate::operand::check_cudarc(buf, &self.local.device, "buf")?;
        let len = buf.len();
        let (p, _r) = buf.device_ptr_mut(stream);
        let b = crate::operand::cudarc_dst::<T>(p, len, &self.local.device);
        self.all_reduce_in_place(b, op, s)
    }

    pub(crate) fn check_stream<'s>(&'s self, stream: &StreamRef<'s>) -> Result<CallEnd<'s>> {
        let d = &self.local.device;
        if !stream.device().driver().same_as(d.driver()) {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a stream from another Driver value; rank {} is device {} of the communicator's Driver",
                    self.local.rank,
                    d.ordinal()
                ),
            ));
        }
        if stream.device() != d {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a stream of device {}; rank {} is device {}",
                    stream.device().ordinal(),
                    self.local.rank,
                    d.ordinal()
                ),
            ));
        }
        // One stream per rank at a time: calls on two streams could run concurrently and
        // overtake each other's barriers. The previous stream is never queried itself (the
        // caller may have destroyed it since): the rank's own event, recorded at the end of its
        // last call outside a capture, says whether that call finished.
        let mut last = self.local.last_stream.lock();
        let raw = stream.raw() as usize;
        if last.is_some_and(|prev| prev != raw) && !self.local.done.is_complete()? {
            return Err(Error::invalid(
                "stream",
                format!(
                    "rank {} has collective work in flight on another stream; one team takes one stream per rank at a time (synchronise the other first)",
                    self.local.rank
                ),
            ));
        }
        *last = Some(raw);
        Ok(CallEnd {
            done: &self.local.done,
            stream: *stream,
            _serial: last,
        })
    }

    /// Check an operand for this rank: its communicator or device, its bounds and alignment.
    pub(crate) fn check_operand(
        &self,
        o: &Operand<'_>,
        arg: &'static str,
        es: usize,
    ) -> Result<u64> {
        let inner = &*self.comm.inner;
        match o.place {
            Place::Sym { buf, offset, only } => {
                if buf.comm_id != inner.id {
                    return Err(Error::invalid(arg, "a buffer of another communicator"));
                }
                if let Some(r) = only.filter(|&r| r != self.local.rank) {
                    return Err(Error::invalid(
                        arg,
                        format!(
                            "a view of rank {r}'s part; this is rank {}'s call",
                            self.local.rank
                        ),
                    ));
                }
                if offset
                    .checked_add(o.bytes)
                    .is_none_or(|e| e > buf.sym.bytes)
                {
                    return Err(Error::invalid(
                        arg,
                        format!(
                            "{} bytes at offset {offset} pass the end of the {}-byte buffer",
                            o.bytes, buf.sym.bytes
                        ),
                    ));
                }
                let ptr = buf.sym.addrs[self.local.rank] + offset as u64;
                // Byte views of a symmetric buffer (`all_reduce_dyn`) can start anywhere.
                if ptr % es as u64 != 0 {
                    return Err(Error::invalid(
                        arg,
                        format!("byte offset {offset} is not aligned to the {es}-byte element"),
                    ));
                }
                Ok(ptr)
            }
            Place::Local { ptr, device } => {
                if let Some(d) = device {
                    if d != &self.local.device {
                        return Err(Error::invalid(
                            arg,
                            format!(
                                "memory of device {}{}; rank {} is device {}",
                                d.ordinal(),
                                if d.driver().same_as(self.local.device.driver()) {
                                    ""
                                } else {
                                    " of another Driver value"
                                },
                                self.local.rank,
                                self.local.device.ordinal()
                            ),
                        ));
                    }
                }
                if ptr == 0 && o.bytes > 0 {
                    return Err(Error::invalid(arg, "a null device pointer"));
                }
                if ptr.checked_add(o.bytes as u64).is_none() {
                    return Err(Error::invalid(
                        arg,
                        format!("{} bytes at {ptr:#x} wrap the address space", o.bytes),
                    ));
                }
                if ptr % es as u64 != 0 {
                    return Err(Error::invalid(
                        arg,
                        format!("{ptr:#x} is not aligned to the {es}-byte element"),
                    ));
                }
                Ok(ptr)
            }
        }
    }

    fn run(
        &self,
        dtype: DType,
        input: Operand<'_>,
        output: Operand<'_>,
        op: ReduceOp,
        stream: StreamRef<'_>,
        names: [&'static str; 2],
    ) -> Result<Choice> {
        let inner = &*self.comm.inner;
        let (n, c) = (inner.ranks.n, &inner.config);
        let l = self.local;
        if !stream.device().driver().same_as(l.device.driver()) || stream.device() != &l.device {
            self.check_stream(&stream)?;
        }
        inner.ranks.usable()?;
        let es = dtype.size();
        // in place, both are the caller's `buf`
        let ip = self.check_operand(&input, names[0], es)?;
        let op_ = self.check_operand(&output, names[1], es)?;
        if input.bytes != output.bytes {
            return Err(Error::invalid(
                "output",
                format!(
                    "{} bytes; the input has {} (both operands have the same length)",
                    output.bytes, input.bytes
                ),
            ));
        }
        let bytes = input.bytes;
        if ip != op_ && ip < op_ + bytes as u64 && op_ < ip + bytes as u64 {
            return Err(Error::invalid(
                "output",
                "overlaps the input without being the same range (in place needs the same range)",
            ));
        }
        let _end = self.check_stream(&stream)?;
        if bytes == 0 {
            return Ok(inner.p2p.shape(n, c, 0, inner.p2p.preferred(n, c, 0)));
        }
        inner.ranks.next_call(l);
        if let Some(mm) = inner.mm_for(dtype, op, bytes) {
            return mm.run(c, l.rank, dtype, op, ip, op_, bytes, stream);
        }
        if let Some(alg) = inner.p2p.direct(n, c, &input, &output, bytes)? {
            return inner
                .p2p
                .launch(n, c, l, alg, dtype, op, &input, &output, stream);
        }
        self.staged(dtype, op, input, output, stream)
    }

    /// The caller's own memory above what one-shot serves: in chunks through the scratch. The
    /// scratch has three regions: an input region (where the kernel cannot read the input in
    /// place) and two output regions used in turn. Each chunk's result is copied out of its
    /// region by the next chunk's kernel (the write-only two-shot's prologue copy, beside its
    /// link traffic), or where that kernel cannot take it (another algorithm, an output not
    /// 16-byte aligned) by a plain copy before it; the last chunk's by a plain copy after the
    /// last kernel. Everything on the caller's stream (graph capture takes it as it is).
    fn staged(
        &self,
        dtype: DType,
        op: ReduceOp,
        input: Operand<'_>,
        output: Operand<'_>,
        stream: StreamRef<'_>,
    ) -> Result<Choice> {
        let inner = &*self.comm.inner;
        let (n, c, l) = (inner.ranks.n, &inner.config, self.local);
        let bytes = input.bytes;
        let scratch = inner
            .p2p
            .scratch
            .as_ref()
            .ok_or_else(|| no_scratch(bytes, c.one_shot_max(n)))?;
        let region = inner.p2p.scratch_region();
        let base = scratch.sym.addrs[l.rank];
        let ptr = |o: &Operand<'_>| match o.place {
            Place::Sym { buf, offset, .. } => buf.sym.addrs[l.rank] + offset as u64,
            Place::Local { ptr, .. } => ptr,
        };
        let region_of = |k: usize, len: usize| Operand {
            place: Place::Sym {
                buf: scratch,
                offset: k * region,
                only: None,
            },
            bytes: len,
        };
        // A plain copy on the caller's stream.
        let copy = |cp: PrologueCopy| {
            // SAFETY: a chunk's result in an output region of this rank's scratch (complete:
            // the chunk's kernel, before this on the stream, passed its final barrier, after
            // every peer finished pushing into it) into the chunk of the output (checked by
            // `run`), both of this rank's device; peers write that region again only in the
            // chunk after next, whose first barrier needs this rank's next kernel, queued after
            // this copy.
            unsafe { stream.copy_dtod_async(cp.dst, cp.src, cp.bytes) }
        };
        // The copy out of the previous chunk's output region, not done yet.
        let mut pending: Option<PrologueCopy> = None;
        let chunks = bytes.div_ceil(region);
        let mut first = None;
        for k in 0..chunks {
            let at = k * region;
            let len = region.min(bytes - at);
            let i = input.sub(at, len);
            let o = output.sub(at, len);
            if let Some(a) = inner.p2p.direct(n, c, &i, &o, len)? {
                // This chunk needs no scratch (e.g. a last chunk one-shot serves).
                if let Some(cp) = pending.take() {
                    copy(cp)?;
                }
                let ch = inner.p2p.launch(n, c, l, a, dtype, op, &i, &o, stream)?;
                first.get_or_insert(ch);
                continue;
            }
            // Results land in the output itself when it is symmetric, else in an output region.
            let slot = k % 2;
            let o_run = if o.is_sym() {
                o
            } else {
                region_of(1 + slot, len)
            };
            let (i_run, alg) = match inner.p2p.direct(n, c, &i, &o_run, len)? {
                Some(a) => (i, a),
                None => {
                    // The kernel's form first: a chunk no form takes is refused before its copy.
                    let s_in = region_of(0, len);
                    let a = inner.p2p.direct(n, c, &s_in, &o_run, len)?.ok_or_else(|| {
                        Error::invalid("count", format!("{len} bytes cannot be staged"))
                    })?;
                    // SAFETY: `len` bytes of the input (checked by `run`) into the input region
                    // (len <= region), both of this rank's device; the previous chunk's kernel,
                    // the last reader of the region, is before it on this stream.
                    unsafe { stream.copy_dtod_async(base, ptr(&i), len) }?;
                    (s_in, a)
                }
            };
            // The previous chunk's copy out goes with this kernel where it can take it: it
            // reads a region this kernel does not touch (it writes the other one), complete
            // since the previous kernel ended.
            let carried = match pending.take() {
                Some(cp) if alg == Algorithm::TwoShotPush && cp.fits() => Some(cp),
                Some(cp) => {
                    copy(cp)?;
                    None
                }
                None => None,
            };
            let ch = inner
                .p2p
                .launch_with_copy(n, c, l, alg, dtype, op, &i_run, &o_run, carried, stream)?;
            first.get_or_insert(ch);
            if !o.is_sym() {
                pending = Some(PrologueCopy {
                    src: base + ((1 + slot) * region) as u64,
                    dst: ptr(&o),
                    bytes: len,
                });
            }
        }
        if let Some(cp) = pending {
            copy(cp)?;
        }
        let mut choice = first.ok_or_else(|| Error::invalid("count", "nothing to stage"))?;
        choice.staged_chunks = chunks as u32;
        Ok(choice)
    }
}

/// The byte length of `len` elements of `T` (checked: a count whose byte size overflows is an
/// error naming the operand).
fn typed_bytes<T>(len: usize, recorded: usize, arg: &'static str) -> Result<usize> {
    let size = std::mem::size_of::<T>();
    match len.checked_mul(size) {
        Some(b) if b == recorded => Ok(b),
        _ => Err(Error::invalid(
            arg,
            format!("{len} elements of {size} bytes: the byte length overflows"),
        )),
    }
}
