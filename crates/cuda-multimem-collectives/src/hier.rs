//! Hierarchical collectives: beyond one NVLink domain.
//!
//! The team (one rank per process, found through a [`Bootstrap`]) is cut into NVLink domains of
//! equal size D (one host's GPUs, or an explicit grouping, e.g. the cliques of a multi-node
//! NVLink system); the M domains are joined by *rails*: rail l holds the rank of local index l
//! of every domain. An allreduce is
//!
//! 1. a reduce-scatter inside the domain ([`crate::Communicator`], NVLink): local rank l ends
//!    with shard l of the domain's sum;
//! 2. an allreduce of that shard across domains on rail l ([`CrossDomain`]: NCCL, whose unique
//!    id travels through our bootstrap), so shard l holds the whole team's sum;
//! 3. an all-gather inside the domain.
//!
//! Every step is enqueued on the caller's stream (NCCL calls included), so a whole call can be
//! captured into a CUDA graph. `docs/design/hierarchical.md` has the design and the expected
//! scaling.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{Device, DeviceBuffer, DeviceRepr, Error, Result, Stream, StreamRef};
use parking_lot::Mutex;

use crate::bootstrap::Bootstrap;
use crate::comm::{Communicator, RankHandle};
use crate::config::CommConfig;
use crate::memory::SymmetricBuffer;
use crate::nccl::{Nccl, NcclComm, NcclUniqueId};
use crate::operand::{bytes_dst, typed_dst, typed_src, Dst, Operand, Place, Src};
use crate::reference::reference_bytes;
use crate::types::{DType, Element, MulticastPolicy, ReduceOp};

// ---- sub-teams of a bootstrap ----

/// A bootstrap for a subset of a parent's ranks (a domain, a rail). Every exchange is an
/// exchange of the whole parent team, of which each member keeps its subset's entries: so
/// every rank of the parent makes the same exchanges in the same order (the hierarchical
/// communicator's calls are collective over the whole team, which guarantees it).
pub(crate) struct SubBootstrap {
    parent: Arc<dyn Bootstrap>,
    /// Parent ranks, in the order of the subset's ranks.
    members: Vec<usize>,
    rank: usize,
}

impl SubBootstrap {
    pub(crate) fn new(parent: Arc<dyn Bootstrap>, members: Vec<usize>) -> Result<SubBootstrap> {
        let me = parent.rank();
        let rank = members.iter().position(|&m| m == me).ok_or_else(|| {
            Error::invalid(
                "members",
                format!("{members:?} does not hold this rank ({me})"),
            )
        })?;
        Ok(SubBootstrap {
            parent,
            members,
            rank,
        })
    }

    fn check_len(&self, got: usize, what: &str) -> Result<()> {
        if got != self.parent.size() {
            return Err(Error::Peer {
                rank: got.min(self.parent.size()),
                reason: format!(
                    "the bootstrap returned {got} {what}; the team has {}",
                    self.parent.size()
                ),
            });
        }
        Ok(())
    }
}

impl Bootstrap for SubBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut all = self.parent.all_gather(data)?;
        self.check_len(all.len(), "entries")?;
        Ok(self
            .members
            .iter()
            .map(|&m| std::mem::take(&mut all[m]))
            .collect())
    }

    fn all_gather_fds(
        &self,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Vec<Vec<std::os::fd::OwnedFd>>> {
        let mut all = self.parent.all_gather_fds(fds)?;
        self.check_len(all.len(), "descriptor sets")?;
        // Descriptors of ranks outside the subset are dropped (closed) here.
        Ok(self
            .members
            .iter()
            .map(|&m| std::mem::take(&mut all[m]))
            .collect())
    }

    fn passes_fds(&self) -> bool {
        self.parent.passes_fds()
    }
}

// ---- layout ----

/// How the team is cut into NVLink domains and rails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HierLayout {
    rank: usize,
    /// Team ranks of each domain, ascending; domains ordered by their lowest rank.
    domains: Vec<Vec<usize>>,
    domain: usize,
    local: usize,
}

impl HierLayout {
    /// The layout of rank `rank` given each rank's domain key (ranks with equal keys share a
    /// domain). Every domain must have the same number of ranks.
    pub fn from_keys(rank: usize, keys: &[u64]) -> Result<HierLayout> {
        let mut domains: Vec<(u64, Vec<usize>)> = Vec::new();
        for (r, k) in keys.iter().enumerate() {
            match domains.iter_mut().find(|(kk, _)| kk == k) {
                Some((_, v)) => v.push(r),
                None => domains.push((*k, vec![r])),
            }
        }
        let domains: Vec<Vec<usize>> = domains.into_iter().map(|(_, v)| v).collect();
        if domains.iter().any(|d| d.len() != domains[0].len()) {
            return Err(Error::invalid(
                "domains",
                format!(
                    "ranks by domain {domains:?}; every domain needs the same number of ranks (a rail takes one rank of each)"
                ),
            ));
        }
        let domain = domains
            .iter()
            .position(|d| d.contains(&rank))
            .ok_or_else(|| Error::invalid("rank", format!("{rank} is in no domain")))?;
        let local = domains[domain].iter().position(|&r| r == rank).unwrap_or(0);
        Ok(HierLayout {
            rank,
            domains,
            domain,
            local,
        })
    }

    /// This rank in the team.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the team.
    pub fn size(&self) -> usize {
        self.domains.len() * self.domain_size()
    }

    /// Number of domains (M).
    pub fn domain_count(&self) -> usize {
        self.domains.len()
    }

    /// Ranks per domain (D).
    pub fn domain_size(&self) -> usize {
        self.domains[0].len()
    }

    /// This rank's domain (its position among the domains, ordered by their lowest rank);
    /// also its rank on its rail.
    pub fn domain_index(&self) -> usize {
        self.domain
    }

    /// This rank's position in its domain; also the index of its rail.
    pub fn local_index(&self) -> usize {
        self.local
    }

    /// Team ranks of domain `d`, ascending (none for `d` past the last domain).
    pub fn domain_members(&self, d: usize) -> &[usize] {
        self.domains.get(d).map_or(&[], |v| v.as_slice())
    }

    /// Team ranks of rail `l` (local index l of every domain), by domain (none for `l` past
    /// the last rail).
    pub fn rail_members(&self, l: usize) -> Vec<usize> {
        self.domains
            .iter()
            .filter_map(|d| d.get(l).copied())
            .collect()
    }

    /// How team ranks follow the domains, which decides how a reduce-scatter or all-gather
    /// (whose chunks are in team-rank order) is cut into its intra- and cross-domain steps.
    pub fn rank_order(&self) -> RankOrder {
        let (m, d) = (self.domain_count(), self.domain_size());
        let all = |f: &dyn Fn(usize, usize) -> usize| {
            (0..m).all(|k| (0..d).all(|l| self.domains[k][l] == f(k, l)))
        };
        if all(&|k, l| k * d + l) {
            RankOrder::DomainMajor
        } else if all(&|k, l| l * m + k) {
            RankOrder::RailMajor
        } else {
            RankOrder::Other
        }
    }
}

/// How a team's ranks follow its domains ([`HierLayout::rank_order`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankOrder {
    /// Rank = domain · D + local index: each domain's ranks are consecutive (one process per
    /// GPU, hosts filled in turn: `mpirun`'s default). A single domain, and domains of one
    /// GPU, count as this.
    DomainMajor,
    /// Rank = local index · M + domain: each rail's ranks are consecutive.
    RailMajor,
    /// Neither (explicit domain ids that scatter the ranks): reduce-scatter and all-gather fall
    /// back to the hierarchical allreduce of the whole buffer.
    Other,
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into a buffer of that size.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return String::from("?");
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn pci_id(d: &Device) -> Option<[i32; 3]> {
    use cuda_multimem::sys::CUdevice_attribute as A;
    let get = |a| d.attribute(a).ok();
    Some([
        get(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
        get(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
        get(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?,
    ])
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Every rank's domain key, through the bootstrap: the explicit ids where given (every rank
/// must give one, or none), else discovered: ranks on one host whose devices reach each other
/// (peer access, checked both ways where a process sees the other's device by PCI id; a device
/// it cannot see counts as reachable, the domain's communicator checks when it maps memory).
fn domain_keys(boot: &dyn Bootstrap, device: &Device, explicit: Option<u64>) -> Result<Vec<u64>> {
    let n = boot.size();
    let host = hostname();
    let pci = pci_id(device);
    let mut msg = vec![u8::from(explicit.is_some())];
    msg.extend_from_slice(&explicit.unwrap_or(0).to_le_bytes());
    msg.extend_from_slice(&fnv(host.as_bytes()).to_le_bytes());
    for v in pci.unwrap_or([-1; 3]) {
        msg.extend_from_slice(&v.to_le_bytes());
    }
    let all = boot.all_gather(&msg)?;
    if all.len() != n {
        return Err(Error::Peer {
            rank: all.len().min(n),
            reason: format!("the bootstrap returned {} entries; expected {n}", all.len()),
        });
    }
    if let Some((r, _)) = all.iter().enumerate().find(|(_, m)| m.len() != msg.len()) {
        return Err(Error::Peer {
            rank: r,
            reason: "sent a malformed domain description".into(),
        });
    }
    let u64_at =
        |m: &[u8], at: usize| u64::from_le_bytes(m[at..at + 8].try_into().unwrap_or_default());
    let i32_at =
        |m: &[u8], at: usize| i32::from_le_bytes(m[at..at + 4].try_into().unwrap_or_default());
    let modes: Vec<u8> = all.iter().map(|m| m[0]).collect();
    if modes.iter().any(|&m| m != modes[0]) {
        return Err(Error::RanksDisagree {
            what: format!(
                "domain ids: rank {} passed one and rank {} did not; pass explicit domain ids on every rank or on none",
                modes.iter().position(|&m| m == 1).unwrap_or(0),
                modes.iter().position(|&m| m == 0).unwrap_or(0)
            ),
        });
    }
    if modes[0] == 1 {
        return Ok(all.iter().map(|m| u64_at(m, 1)).collect());
    }
    // Discovered: same host, and devices that reach each other.
    let hosts: Vec<u64> = all.iter().map(|m| u64_at(m, 9)).collect();
    let pcis: Vec<[i32; 3]> = all
        .iter()
        .map(|m| [i32_at(m, 17), i32_at(m, 21), i32_at(m, 25)])
        .collect();
    let visible: Vec<(Device, Option<[i32; 3]>)> = device
        .driver()
        .devices()
        .into_iter()
        .map(|d| {
            let p = pci_id(&d);
            (d, p)
        })
        .collect();
    let me = boot.rank();
    let reach: Vec<u8> = (0..n)
        .map(|j| {
            if hosts[j] != hosts[me] {
                return 0;
            }
            if j == me || pcis[j] == [-1; 3] || pci.is_none() {
                return 1;
            }
            match visible.iter().find(|(_, p)| *p == Some(pcis[j])) {
                Some((d, _)) if d == device => 1,
                Some((d, _)) => u8::from(device.can_access_peer(d).unwrap_or(false)),
                None => 1,
            }
        })
        .collect();
    let masks = boot.all_gather(&reach)?;
    if let Some((r, _)) = masks.iter().enumerate().find(|(_, m)| m.len() != n) {
        return Err(Error::Peer {
            rank: r,
            reason: "sent a malformed reachability mask".into(),
        });
    }
    // Connected components of mutual reachability; a component's key is its lowest rank.
    let mut key: Vec<usize> = (0..n).collect();
    let find = |key: &Vec<usize>, mut x: usize| {
        while key[x] != x {
            x = key[x];
        }
        x
    };
    for (i, mi) in masks.iter().enumerate() {
        for (j, mj) in masks.iter().enumerate().skip(i + 1) {
            if mi[j] == 1 && mj[i] == 1 {
                let (a, b) = (find(&key, i), find(&key, j));
                key[a.max(b)] = a.min(b);
            }
        }
    }
    Ok((0..n).map(|i| find(&key, i) as u64).collect())
}

// ---- the cross-domain step ----

/// The step across domains, on one rail (one rank of each domain): NCCL in production
/// ([`NcclCrossDomain`]), a host-side stand-in in tests ([`HostCrossDomainDouble`]), or an
/// engine's own. Calls are enqueued on `stream` where the implementation can (NCCL), and every
/// rank of the rail makes the same calls in the same order.
pub trait CrossDomain: Send + Sync {
    /// What it is, for messages (`"nccl 2.28.9"`).
    fn name(&self) -> String;
    /// This rank's position on the rail (its domain index).
    fn rail_rank(&self) -> usize;
    /// Ranks on the rail (the number of domains).
    fn rail_size(&self) -> usize;
    /// Whether its calls can be captured into a CUDA graph.
    fn graph_capturable(&self) -> bool;

    /// Allreduce `count` elements from `send` into `recv` (equal: in place).
    ///
    /// # Safety
    /// `send` and `recv` are device memory of the rank's device valid for `count` elements of
    /// `dtype` until the work queued on `stream` has run.
    unsafe fn all_reduce(
        &self,
        dtype: DType,
        op: ReduceOp,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()>;

    /// Reduce-scatter: `send` holds `rail_size · recv_count` elements, `recv` (which may be
    /// `send + rail_rank · recv_count`: in place) gets this rank's `recv_count`.
    ///
    /// # Safety
    /// As [`CrossDomain::all_reduce`], for those lengths.
    unsafe fn reduce_scatter(
        &self,
        dtype: DType,
        op: ReduceOp,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        recv_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()>;

    /// All-gather: `send` holds `send_count` elements (it may be `recv + rail_rank ·
    /// send_count`: in place), `recv` gets `rail_size · send_count`.
    ///
    /// # Safety
    /// As [`CrossDomain::all_reduce`], for those lengths.
    unsafe fn all_gather(
        &self,
        dtype: DType,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        send_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()>;

    /// Report an asynchronous failure of earlier calls (synchronise the stream first).
    fn check(&self) -> Result<()>;
}

/// The cross-domain step over an NCCL communicator of the rail.
#[derive(Debug)]
pub struct NcclCrossDomain {
    comm: NcclComm,
}

impl NcclCrossDomain {
    /// Over an existing rail communicator (its ranks are the rail's, by domain).
    pub fn new(comm: NcclComm) -> NcclCrossDomain {
        NcclCrossDomain { comm }
    }

    /// The NCCL communicator.
    pub fn comm(&self) -> &NcclComm {
        &self.comm
    }
}

impl CrossDomain for NcclCrossDomain {
    fn name(&self) -> String {
        format!("nccl {}", self.comm.nccl().version_string())
    }
    fn rail_rank(&self) -> usize {
        self.comm.rank()
    }
    fn rail_size(&self) -> usize {
        self.comm.size()
    }
    fn graph_capturable(&self) -> bool {
        true
    }
    unsafe fn all_reduce(
        &self,
        dtype: DType,
        op: ReduceOp,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.comm
                .all_reduce_raw(dtype, op, send, recv, count, stream)
        }
    }
    unsafe fn reduce_scatter(
        &self,
        dtype: DType,
        op: ReduceOp,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        recv_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.comm
                .reduce_scatter_raw(dtype, op, send, recv, recv_count, stream)
        }
    }
    unsafe fn all_gather(
        &self,
        dtype: DType,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        send_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.comm
                .all_gather_raw(dtype, send, recv, send_count, stream)
        }
    }
    fn check(&self) -> Result<()> {
        self.comm.check()
    }
}

/// A **test double** for the cross-domain step: it synchronises the stream, copies the operand
/// to the host, exchanges it with the rail through the bootstrap, reduces on the host (in rail
/// order, accumulating in f32 and rounding once, as [`crate::reference_bytes`]) and copies the
/// result back. It makes the hierarchy testable where NCCL cannot run (the simulated driver);
/// it is slow and cannot be captured into a graph. Never use it for real work.
pub struct HostCrossDomainDouble {
    rail: Box<dyn Bootstrap>,
    device: Device,
}

impl std::fmt::Debug for HostCrossDomainDouble {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HostCrossDomainDouble(rail rank {} of {})",
            self.rail.rank(),
            self.rail.size()
        )
    }
}

impl HostCrossDomainDouble {
    /// Over the rail's bootstrap, for `device`.
    pub fn new(rail: Box<dyn Bootstrap>, device: &Device) -> HostCrossDomainDouble {
        HostCrossDomainDouble {
            rail,
            device: device.clone(),
        }
    }

    /// Every rail rank's `bytes` at `ptr` (after the stream's work).
    fn gather(
        &self,
        ptr: CUdeviceptr,
        bytes: usize,
        stream: &StreamRef<'_>,
    ) -> Result<Vec<Vec<u8>>> {
        stream.synchronize()?;
        let mut mine = vec![0u8; bytes];
        // SAFETY: the caller of the trait method promised `bytes` readable at `ptr`.
        unsafe { self.device.copy_to_host(ptr, &mut mine) }?;
        let all = self.rail.all_gather(&mine)?;
        if let Some((r, _)) = all.iter().enumerate().find(|(_, a)| a.len() != bytes) {
            return Err(Error::Peer {
                rank: r,
                reason: format!("sent a different length on the rail; expected {bytes} bytes"),
            });
        }
        Ok(all)
    }
}

impl CrossDomain for HostCrossDomainDouble {
    fn name(&self) -> String {
        "host test double".into()
    }
    fn rail_rank(&self) -> usize {
        self.rail.rank()
    }
    fn rail_size(&self) -> usize {
        self.rail.size()
    }
    fn graph_capturable(&self) -> bool {
        false
    }
    unsafe fn all_reduce(
        &self,
        dtype: DType,
        op: ReduceOp,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        let all = self.gather(send, count * dtype.size(), stream)?;
        let refs: Vec<&[u8]> = all.iter().map(|a| a.as_slice()).collect();
        let out = reference_bytes(dtype, op, &refs);
        // SAFETY: the caller promised `recv`.
        unsafe { self.device.copy_from_host_blocking(recv, &out) }
    }
    unsafe fn reduce_scatter(
        &self,
        dtype: DType,
        op: ReduceOp,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        recv_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        let (es, m) = (dtype.size(), self.rail.size());
        let all = self.gather(send, m * recv_count * es, stream)?;
        let r = self.rail.rank();
        let refs: Vec<&[u8]> = all
            .iter()
            .map(|a| &a[r * recv_count * es..(r + 1) * recv_count * es])
            .collect();
        let out = reference_bytes(dtype, op, &refs);
        // SAFETY: the caller promised `recv`.
        unsafe { self.device.copy_from_host_blocking(recv, &out) }
    }
    unsafe fn all_gather(
        &self,
        dtype: DType,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        send_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        let all = self.gather(send, send_count * dtype.size(), stream)?;
        let out: Vec<u8> = all.concat();
        // SAFETY: the caller promised `recv`.
        unsafe { self.device.copy_from_host_blocking(recv, &out) }
    }
    fn check(&self) -> Result<()> {
        Ok(())
    }
}

// ---- the intra-domain steps ----
//
// An allreduce inside the domain is its reduce-scatter then its all-gather (RankHandle's staged
// and direct push kernels, docs/design/collectives.md), with the cross-domain step between them
// on a shard of 1/D of the message. Why no fence is needed around the cross-domain step: the
// staged reduce-scatter never lets a peer read or write this rank's buffer (peers push into its
// staging; only this rank writes its output), and its first barrier proves that every peer has
// finished its earlier stream work; the all-gather after it either touches only this rank's
// buffer (staged) or stores into it only after a barrier that this rank passes once its
// cross-domain step is done (direct). The tail of an allreduce (count mod D elements) goes
// through the domain's allreduce before the reduce-scatter, whose barrier then fences it; with
// no reduce-scatter (count < D) the explicit fence does. `docs/design/hierarchical.md`.

/// Zero every chunk of `buf` (`total` bytes at `ptr`, chunks of `chunk` bytes) but chunk
/// `mine`, on `stream`: what the all-gather of layouts of
/// [`RankOrder::Other`] sums (x + 0 = x exactly, but a -0.0 comes
/// back as +0.0).
fn zero_others(
    stream: &StreamRef<'_>,
    (ptr, total): (CUdeviceptr, usize),
    chunk: usize,
    mine: usize,
) -> Result<()> {
    let at = mine * chunk;
    // SAFETY: both ranges lie inside the operand (checked by the caller), this rank's memory;
    // no peer reads it now (the caller fenced).
    unsafe {
        stream.memset_d8_async(ptr, 0, at)?;
        stream.memset_d8_async(
            ptr + (at + chunk) as u64,
            0,
            total - (at + chunk).min(total),
        )
    }
}

// ---- the communicator ----

/// A rail, as the builder hands it to a custom cross-domain factory
/// ([`HierBuilder::cross_domain_with`]).
pub struct Rail {
    /// This rank's position on the rail (its domain index).
    pub rank: usize,
    /// Ranks on the rail (domains).
    pub size: usize,
    /// Index of the rail (the local index of its ranks in their domains).
    pub index: usize,
    /// A bootstrap over the rail's ranks (every exchange involves the whole team, see
    /// [`HierCommunicator`]).
    pub bootstrap: Box<dyn Bootstrap>,
    /// This rank's device.
    pub device: Device,
}

impl std::fmt::Debug for Rail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Rail({} of {}, rail {})",
            self.rank, self.size, self.index
        )
    }
}

type Factory = Box<dyn FnOnce(Rail) -> Result<Box<dyn CrossDomain>> + Send>;

enum Cross {
    /// NCCL (the library given, else [`Nccl::load`]), rail communicators made from unique
    /// ids exchanged through the bootstrap.
    Nccl(Option<Arc<Nccl>>),
    /// `ncclCommSplit` of an engine's communicator.
    NcclSplit(Arc<Nccl>, SendPtr),
    Custom(Factory),
}

struct SendPtr(*mut std::ffi::c_void);
// SAFETY: the pointer is only handed to ncclCommSplit by the builder, under the contract of
// `HierBuilder::nccl_split_from`.
unsafe impl Send for SendPtr {}

/// Builds a [`HierCommunicator`] (every rank of the team, with the same settings).
pub struct HierBuilder {
    device: Device,
    bootstrap: Arc<dyn Bootstrap>,
    domain_id: Option<u64>,
    config: CommConfig,
    multicast: MulticastPolicy,
    cross: Cross,
    nccl_timeout: Duration,
}

impl std::fmt::Debug for HierBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HierBuilder")
            .field("device", &self.device)
            .field("domain_id", &self.domain_id)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl HierBuilder {
    /// This rank's domain id: ranks with equal ids form a domain (every rank passes one, or
    /// none: then domains are discovered — ranks of one host whose devices reach each other).
    /// Needed for multi-node NVLink (pass the NVLink clique/fabric cluster), and to treat GPUs
    /// of one host as separate domains.
    pub fn domain_id(mut self, id: u64) -> Self {
        self.domain_id = Some(id);
        self
    }

    /// The configuration of the domain's communicator.
    pub fn config(mut self, config: CommConfig) -> Self {
        self.config = config;
        self
    }

    /// The multicast policy of the domain's communicator.
    pub fn multicast(mut self, policy: MulticastPolicy) -> Self {
        self.multicast = policy;
        self
    }

    /// Use this NCCL library for the rails (default: [`Nccl::load`]).
    pub fn nccl(mut self, nccl: Arc<Nccl>) -> Self {
        self.cross = Cross::Nccl(Some(nccl));
        self
    }

    /// Make the rail communicators by splitting an engine's existing NCCL communicator (whose
    /// ranks must be this team's ranks): `ncclCommSplit(parent, color = rail, key = domain)`.
    ///
    /// # Safety
    /// `parent` is a live `ncclComm_t` of `nccl`'s library, on this rank's device, whose rank
    /// is this team's rank; nothing else uses it while [`HierBuilder::build`] runs.
    pub unsafe fn nccl_split_from(
        mut self,
        nccl: Arc<Nccl>,
        parent: *mut std::ffi::c_void,
    ) -> Self {
        self.cross = Cross::NcclSplit(nccl, SendPtr(parent));
        self
    }

    /// How long NCCL may take to set up or tear down a rail communicator (default 120 s).
    pub fn nccl_timeout(mut self, timeout: Duration) -> Self {
        self.nccl_timeout = timeout;
        self
    }

    /// A cross-domain step of the caller's making, per rail (an engine's own, or
    /// [`HostCrossDomainDouble`] in tests).
    pub fn cross_domain_with(
        mut self,
        f: impl FnOnce(Rail) -> Result<Box<dyn CrossDomain>> + Send + 'static,
    ) -> Self {
        self.cross = Cross::Custom(Box::new(f));
        self
    }

    /// The host test double for the cross-domain step ([`HostCrossDomainDouble`]).
    pub fn cross_domain_test_double(self) -> Self {
        self.cross_domain_with(|rail| {
            Ok(Box::new(HostCrossDomainDouble::new(rail.bootstrap, &rail.device)) as _)
        })
    }

    /// Build: find the domains, build the domain's communicator (domains of 2 or more), and
    /// the rail's cross-domain step (2 or more domains). Collective over the whole team.
    pub fn build(self) -> Result<HierCommunicator> {
        // Checked whatever the layout (domains of one GPU build no domain communicator, whose
        // build would check the configuration) and before any exchange.
        self.config.validate()?;
        if self.nccl_timeout.is_zero() || Instant::now().checked_add(self.nccl_timeout).is_none() {
            return Err(Error::invalid(
                "nccl_timeout",
                format!(
                    "{:?}; expected a positive duration the clock can hold as a deadline",
                    self.nccl_timeout
                ),
            ));
        }
        let boot = self.bootstrap;
        let keys = domain_keys(&*boot, &self.device, self.domain_id)?;
        let layout = HierLayout::from_keys(boot.rank(), &keys)?;
        let domain = if layout.domain_size() >= 2 {
            let sub = SubBootstrap::new(
                boot.clone(),
                layout.domain_members(layout.domain_index()).to_vec(),
            )?;
            Some(
                Communicator::builder_with_bootstrap(&self.device, Box::new(sub))
                    .config(self.config)
                    .multicast(self.multicast)
                    .build()?,
            )
        } else {
            None
        };
        let cross: Option<Box<dyn CrossDomain>> = if layout.domain_count() >= 2 {
            let rail_members = layout.rail_members(layout.local_index());
            let rail_boot = SubBootstrap::new(boot.clone(), rail_members)?;
            let (rank, size) = (layout.domain_index(), layout.domain_count());
            Some(match self.cross {
                Cross::Nccl(lib) => {
                    // The library must load on every rank, or all fail alike.
                    let lib = lib.map_or_else(Nccl::load, Ok);
                    let id = match (&lib, rank) {
                        (Ok(l), 0) => l.unique_id().map(|i| i.as_bytes().to_vec()),
                        (Ok(_), _) => Ok(vec![0u8; NcclUniqueId::BYTES]),
                        (Err(e), _) => Err(e.clone()),
                    };
                    let mut msg = vec![u8::from(id.is_ok())];
                    msg.extend_from_slice(id.as_deref().unwrap_or(&[0u8; 128]));
                    let all = rail_boot.all_gather(&msg)?;
                    let lib = lib?;
                    id?;
                    if let Some(r) = all.iter().position(|m| m.len() != 129 || m[0] == 0) {
                        return Err(Error::RanksDisagree {
                            what: format!(
                                "rank {r} of rail {} could not load NCCL or make its id (its own error says why)",
                                layout.local_index()
                            ),
                        });
                    }
                    let uid = NcclUniqueId::from_bytes(&all[0][1..])?;
                    let comm = NcclComm::init_rank(
                        &lib,
                        &self.device,
                        &uid,
                        rank,
                        size,
                        self.nccl_timeout,
                    )?;
                    Box::new(NcclCrossDomain::new(comm))
                }
                Cross::NcclSplit(lib, parent) => {
                    // SAFETY: the caller of `nccl_split_from` promised the parent.
                    let comm = unsafe {
                        NcclComm::split_from_raw(
                            &lib,
                            &self.device,
                            parent.0,
                            layout.local_index() as u32,
                            rank as u32,
                            self.nccl_timeout,
                        )
                    }?;
                    if comm.rank() != rank || comm.size() != size {
                        return Err(Error::invalid(
                            "parent",
                            format!(
                                "the split gave rank {} of {}; the rail expects rank {rank} of {size} (the parent's ranks must be this team's)",
                                comm.rank(),
                                comm.size()
                            ),
                        ));
                    }
                    Box::new(NcclCrossDomain::new(comm))
                }
                Cross::Custom(f) => {
                    let x = f(Rail {
                        rank,
                        size,
                        index: layout.local_index(),
                        bootstrap: Box::new(rail_boot),
                        device: self.device.clone(),
                    })?;
                    // The calls' lengths are the rail's (M chunks of the scratch, rail rank r's
                    // chunk): a step that counts otherwise would read and write past them.
                    if x.rail_rank() != rank || x.rail_size() != size {
                        return Err(Error::invalid(
                            "cross_domain",
                            format!(
                                "{} says rank {} of {}; the rail is rank {rank} of {size}",
                                x.name(),
                                x.rail_rank(),
                                x.rail_size()
                            ),
                        ));
                    }
                    x
                }
            })
        } else {
            None
        };
        let fence = domain.as_ref().map(|c| c.alloc::<f32>(4)).transpose()?;
        Ok(HierCommunicator {
            layout,
            device: self.device,
            fence,
            scratch: Mutex::new(Scratch::default()),
            domain,
            cross,
            calls: parking_lot::ReentrantMutex::new(()),
        })
    }
}

/// The hierarchical communicator's scratch: the buffer in use, and those it outgrew (kept
/// until the communicator drops: a captured graph may still point into them).
#[derive(Default)]
struct Scratch {
    current: Option<DeviceBuffer<u8>>,
    retired: Vec<DeviceBuffer<u8>>,
}

/// A team across NVLink domains: reduce-scatter inside each domain (our NVLink kernels),
/// allreduce of the shards across domains on rails ([`CrossDomain`], NCCL by default), and
/// all-gather inside the domain. One rank per process, found through a [`Bootstrap`]
/// ([`crate::UnixBootstrap`] on one host, `MpiBootstrap` across nodes).
///
/// Every rank makes the same calls in the same order ([`HierCommunicator::alloc`] included):
/// the domain's and the rail's exchanges go through the one bootstrap of the whole team.
/// Operands: [`SymmetricBuffer`]s of [`HierCommunicator::alloc`] (domains of 2 or more), or
/// the caller's own device memory; the domain's reduce-scatter and all-gather take either with
/// no copies outside their kernels. One call at a time per communicator (its scratch and its
/// NCCL communicators are shared by its calls): queue them on one stream, as with NCCL.
pub struct HierCommunicator {
    layout: HierLayout,
    device: Device,
    /// Declared before `domain`: dropped first.
    fence: Option<SymmetricBuffer<f32>>,
    /// Device memory of this rank for the steps that need it (see
    /// [`HierCommunicator::reserve_scratch`]).
    scratch: Mutex<Scratch>,
    domain: Option<Communicator>,
    cross: Option<Box<dyn CrossDomain>>,
    /// Held for the whole of a collective call (re-entrant: a call made of others takes it
    /// again), so calls from several threads queue their steps one call after another.
    calls: parking_lot::ReentrantMutex<()>,
}

impl std::fmt::Debug for HierCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HierCommunicator")
            .field("layout", &self.layout)
            .field("cross", &self.cross.as_ref().map(|c| c.name()))
            .finish_non_exhaustive()
    }
}

impl HierCommunicator {
    /// A builder for this process's rank: its device and the team's bootstrap.
    pub fn builder(device: &Device, bootstrap: Box<dyn Bootstrap>) -> HierBuilder {
        HierBuilder {
            device: device.clone(),
            bootstrap: Arc::from(bootstrap),
            domain_id: None,
            config: CommConfig::default(),
            multicast: MulticastPolicy::default(),
            cross: Cross::Nccl(None),
            nccl_timeout: Duration::from_secs(120),
        }
    }

    /// The domains and rails.
    pub fn layout(&self) -> &HierLayout {
        &self.layout
    }

    /// This rank's device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The domain's communicator (`None` for domains of one GPU).
    pub fn domain(&self) -> Option<&Communicator> {
        self.domain.as_ref()
    }

    /// The cross-domain step (`None` with a single domain).
    pub fn cross_domain(&self) -> Option<&dyn CrossDomain> {
        self.cross.as_deref()
    }

    /// Whether a whole call can be captured into a CUDA graph (the cross-domain step can).
    pub fn graph_capturable(&self) -> bool {
        self.cross.as_ref().is_none_or(|c| c.graph_capturable())
    }

    /// A symmetric buffer of the domain (collective over the team). Its parts are numbered
    /// by rank within the domain ([`HierLayout::local_index`]), as the domain's communicator
    /// numbers them. Domains of one GPU have none: use a [`cuda_multimem::DeviceBuffer`].
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<SymmetricBuffer<T>> {
        match &self.domain {
            Some(c) => c.alloc(len),
            None => Err(Error::invalid(
                "alloc",
                "domains of one GPU have no symmetric memory; pass a DeviceBuffer",
            )),
        }
    }

    /// Report a failure of earlier calls (synchronise the stream first): the domain's
    /// timeouts and disagreements, and NCCL's asynchronous errors (which abort its
    /// communicator).
    pub fn check(&self) -> Result<()> {
        if let Some(d) = &self.domain {
            d.check()?;
        }
        if let Some(c) = &self.cross {
            c.check()?;
        }
        Ok(())
    }

    fn handle(&self) -> Result<Option<RankHandle<'_>>> {
        self.domain
            .as_ref()
            .map(|c| c.rank(self.layout.local_index()))
            .transpose()
    }

    /// The device address of an operand on this rank, checked.
    fn ptr(&self, o: &Operand<'_>, arg: &'static str, es: usize) -> Result<CUdeviceptr> {
        if let Some(h) = self.handle()? {
            return h.check_operand(o, arg, es);
        }
        match o.place {
            Place::Sym { .. } => Err(Error::invalid(arg, "a buffer of another communicator")),
            Place::Local { ptr, device } => {
                if let Some(d) = device {
                    if d != &self.device {
                        return Err(Error::invalid(
                            arg,
                            format!(
                                "memory of device {}; this rank is device {}",
                                d.ordinal(),
                                self.device.ordinal()
                            ),
                        ));
                    }
                }
                if ptr == 0 && o.bytes > 0 {
                    return Err(Error::invalid(arg, "a null device pointer"));
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

    fn check_stream(&self, s: &StreamRef<'_>) -> Result<()> {
        if s.device() != &self.device {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a stream of device {}; this rank is device {}",
                    s.device().ordinal(),
                    self.device.ordinal()
                ),
            ));
        }
        Ok(())
    }

    /// Allreduce `buf` in place across the whole team, on `stream`.
    pub fn all_reduce_in_place<'d, 'x, T: Element>(
        &self,
        buf: impl Into<Dst<'d, T>>,
        op: ReduceOp,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let b = buf.into();
        self.all_reduce_op(T::DTYPE, b.op, op, stream.into())
    }

    /// Allreduce `input` into `output` (same length): the input is copied into the output on
    /// `stream`, then reduced there in place.
    pub fn all_reduce<'s, 'd, 'x, T: Element>(
        &self,
        input: impl Into<Src<'s, T>>,
        output: impl Into<Dst<'d, T>>,
        op: ReduceOp,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let (i, o, s) = (input.into(), output.into(), stream.into());
        if i.op.bytes != o.op.bytes {
            return Err(Error::invalid(
                "output",
                format!(
                    "{} bytes; the input has {} (both operands have the same length)",
                    o.op.bytes, i.op.bytes
                ),
            ));
        }
        self.copy_into(T::DTYPE, &i.op, &o.op, 0, &s)?;
        self.all_reduce_op(T::DTYPE, o.op, op, s)
    }

    /// [`HierCommunicator::all_reduce_in_place`] for a run-time element type, on a byte view.
    pub fn all_reduce_dyn_in_place<'d, 'x>(
        &self,
        dtype: DType,
        buf: impl Into<Dst<'d, u8>>,
        op: ReduceOp,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let b = buf.into();
        if b.op.bytes % dtype.size() != 0 {
            return Err(Error::invalid(
                "buf",
                format!("{} bytes; not a whole number of {dtype}", b.op.bytes),
            ));
        }
        self.all_reduce_op(dtype, b.op, op, stream.into())
    }

    /// Copy `i` into `o` at byte `at` (checked: lengths, devices, no partial overlap).
    fn copy_into(
        &self,
        dtype: DType,
        i: &Operand<'_>,
        o: &Operand<'_>,
        at: usize,
        s: &StreamRef<'_>,
    ) -> Result<()> {
        self.check_stream(s)?;
        let es = dtype.size();
        let ip = self.ptr(i, "input", es)?;
        let op = self.ptr(o, "output", es)?;
        if at.checked_add(i.bytes).is_none_or(|e| e > o.bytes) {
            return Err(Error::invalid(
                "output",
                format!(
                    "{} bytes; the input's {} bytes at byte {at} do not fit",
                    o.bytes, i.bytes
                ),
            ));
        }
        let dst = op + at as u64;
        if ip == dst {
            return Ok(());
        }
        if ip < op + o.bytes as u64 && op < ip + i.bytes as u64 {
            return Err(Error::invalid(
                "output",
                "overlaps the input without being the in-place position",
            ));
        }
        // SAFETY: both ranges checked against their operands; this rank's device.
        unsafe { s.copy_dtod_async(dst, ip, i.bytes) }
    }

    fn all_reduce_op(
        &self,
        dtype: DType,
        o: Operand<'_>,
        op: ReduceOp,
        s: StreamRef<'_>,
    ) -> Result<()> {
        self.check_stream(&s)?;
        let es = dtype.size();
        let p = self.ptr(&o, "buf", es)?;
        let count = o.bytes / es;
        if count == 0 {
            return Ok(());
        }
        let Some(h) = self.handle()? else {
            if let Some(x) = &self.cross {
                // SAFETY: `count` elements at `p`, checked above.
                unsafe { x.all_reduce(dtype, op, p, p, count, &s) }?;
            }
            return Ok(());
        };
        let Some(x) = &self.cross else {
            // One domain: its own allreduce (which picks its algorithm per size).
            h.all_reduce_dyn_in_place(dtype, bytes_dst(o), op, s)?;
            return Ok(());
        };
        let (d, l) = (self.layout.domain_size(), self.layout.local_index());
        let q = count / d;
        let main = q * d;
        // 1. The tail (count mod D elements): the domain's allreduce, before the reduce-scatter,
        //    whose first barrier then proves that no domain peer reads this rank's tail any more.
        if main < count {
            h.all_reduce_dyn_in_place(
                dtype,
                bytes_dst(o.sub(main * es, (count - main) * es)),
                op,
                s,
            )?;
            if q == 0 {
                // No reduce-scatter follows: fence instead.
                self.fence(&h, s)?;
            }
        }
        // 2. Reduce-scatter of the main region inside the domain: local rank l ends with shard l
        //    of the domain's result. Staged: peers write only into this rank's staging, never
        //    into its buffer, so the cross-domain step may write shard l as soon as it ends.
        if q > 0 {
            rs_in_place_dyn(&h, dtype, o.sub(0, main * es), op, s)?;
            let shard = p + (l * q * es) as u64;
            // 3. Across domains, on rail l: shard l.
            // SAFETY: shard l of the checked operand.
            unsafe { x.all_reduce(dtype, op, shard, shard, q, &s) }?;
        }
        if main < count {
            // 3'. The tail, on every rail.
            let t = p + (main * es) as u64;
            // SAFETY: the checked operand's last count - main elements.
            unsafe { x.all_reduce(dtype, op, t, t, count - main, &s) }?;
        }
        // 4. All-gather of the shards inside the domain.
        if q > 0 {
            ag_in_place_dyn(&h, dtype, o.sub(0, main * es), s)?;
        }
        Ok(())
    }

    /// A domain allreduce of a few bytes: once it completes on this rank, every domain peer has
    /// started it, so their earlier calls (which may read this rank's buffers) are complete.
    fn fence(&self, h: &RankHandle<'_>, s: StreamRef<'_>) -> Result<()> {
        let Some(f) = &self.fence else { return Ok(()) };
        let o = Operand {
            place: Place::Sym {
                buf: &f.inner,
                offset: 0,
                only: None,
            },
            bytes: 4,
        };
        h.all_reduce_dyn_in_place(DType::F32, bytes_dst(o), ReduceOp::Max, s)?;
        Ok(())
    }

    /// At least `bytes` of this rank's scratch (device memory no peer sees), on `s`'s device:
    /// grown outside graph capture only; a buffer it outgrows stays allocated until the
    /// communicator drops (a captured graph may still use it).
    fn scratch(&self, bytes: usize, s: &StreamRef<'_>) -> Result<CUdeviceptr> {
        let mut sc = self.scratch.lock();
        if let Some(b) = sc.current.as_ref().filter(|b| b.bytes() >= bytes) {
            return Ok(b.device_ptr());
        }
        if s.is_capturing()? {
            return Err(Error::invalid(
                "stream",
                format!(
                    "capturing, and this call needs {bytes} bytes of the hierarchical scratch ({} allocated); call HierCommunicator::reserve_scratch({bytes}) (or make one eager call of this size) before capturing",
                    sc.current.as_ref().map_or(0, |b| b.bytes())
                ),
            ));
        }
        let size = bytes.checked_next_power_of_two().ok_or_else(|| {
            Error::invalid(
                "bytes",
                format!("{bytes}; its power-of-two rounding overflows usize"),
            )
        })?;
        let b = DeviceBuffer::<u8>::zeroed(&self.device, size)?;
        let ptr = b.device_ptr();
        if let Some(old) = sc.current.replace(b) {
            sc.retired.push(old);
        }
        Ok(ptr)
    }

    /// Allocate the scratch that reduce-scatters and all-gathers of `bytes` (the whole buffer of
    /// N chunks) need, so that they can be captured into a graph: teams whose ranks are
    /// domain-major ([`RankOrder::DomainMajor`]) use M chunks of it, out-of-place reduce-scatters
    /// M chunks, and layouts of [`RankOrder::Other`] the whole buffer. The allreduce needs none.
    pub fn reserve_scratch(&self, bytes: usize) -> Result<()> {
        // not between two steps of another thread's call
        let _serial = self.calls.lock();
        let s = Stream::new(&self.device)?;
        self.scratch(bytes, &s.as_stream_ref()).map(drop)
    }

    fn local_op(&self, ptr: CUdeviceptr, bytes: usize) -> Operand<'_> {
        Operand {
            place: Place::Local {
                ptr,
                device: Some(&self.device),
            },
            bytes,
        }
    }

    fn chunk(&self, o: &Operand<'_>, es: usize, arg: &'static str) -> Result<usize> {
        let n = self.layout.size();
        if o.bytes % (n * es) != 0 {
            return Err(Error::invalid(
                arg,
                format!(
                    "{} bytes; expected a whole number of {n} chunks of {es}-byte elements (one per rank)",
                    o.bytes
                ),
            ));
        }
        Ok(o.bytes / n)
    }

    /// The domain reduce-scatters of a domain-major team into M chunks of scratch (chunk k: the
    /// domain's result for chunk local-index of block k, block k = domain k's ranks' chunks),
    /// then the rail's reduce-scatter of the scratch into `recv` (this rank's chunk).
    fn rs_domain_major<T: Element>(
        &self,
        (h, x): (&RankHandle<'_>, &dyn CrossDomain),
        input: Operand<'_>,
        recv: CUdeviceptr,
        (c, op): (usize, ReduceOp),
        s: StreamRef<'_>,
    ) -> Result<()> {
        let (m, d) = (self.layout.domain_count(), self.layout.domain_size());
        let scratch = self.scratch(m * c, &s)?;
        for k in 0..m {
            let out = self.local_op(scratch + (k * c) as u64, c);
            h.reduce_scatter(
                typed_src::<T>(input.sub(k * d * c, d * c)),
                typed_dst::<T>(out),
                op,
                s,
            )?;
        }
        // SAFETY: M chunks of c bytes of this rank's scratch; `recv` one chunk of the caller's
        // checked operand.
        unsafe { x.reduce_scatter(T::DTYPE, op, scratch, recv, c / T::DTYPE.size(), &s) }
    }

    /// Reduce-scatter in place: `buf` holds N chunks (N = team size); chunk r of rank r gets the
    /// team's result for that chunk (other chunks are left with partial results or inputs).
    /// Every 16-bit result is rounded twice: once inside the domain, once across.
    ///
    /// - domains of one GPU: one cross-domain reduce-scatter;
    /// - one domain: the domain's reduce-scatter;
    /// - rail-major ranks ([`RankOrder::RailMajor`]): the domain's reduce-scatter of the whole
    ///   buffer (local rank l gets rail l's M chunks), then the rail's, both in place;
    /// - domain-major ranks: M domain reduce-scatters (one per domain's block of D chunks) into
    ///   M chunks of scratch, then the rail's reduce-scatter of the scratch into chunk r;
    /// - [`RankOrder::Other`]: the hierarchical allreduce of the whole buffer.
    pub fn reduce_scatter_in_place<'d, 'x, T: Element>(
        &self,
        buf: impl Into<Dst<'d, T>>,
        op: ReduceOp,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let (b, s) = (buf.into(), stream.into());
        let es = T::DTYPE.size();
        let c = self.chunk(&b.op, es, "buf")?;
        self.check_stream(&s)?;
        let p = self.ptr(&b.op, "buf", es)?;
        let (r, l, m) = (
            self.layout.rank(),
            self.layout.local_index(),
            self.layout.domain_count(),
        );
        if c == 0 {
            return Ok(());
        }
        let h = self.handle()?;
        match (&h, self.cross.as_deref()) {
            (None, Some(x)) => {
                // SAFETY: N chunks at p (checked); NCCL's in-place position.
                unsafe { x.reduce_scatter(T::DTYPE, op, p, p + (r * c) as u64, c / es, &s) }
            }
            (None, None) => Ok(()),
            (Some(h), None) => h.reduce_scatter_in_place(b, op, s).map(drop),
            (Some(h), Some(x)) => match self.layout.rank_order() {
                RankOrder::RailMajor => {
                    h.reduce_scatter_in_place(typed_dst::<T>(b.op), op, s)?;
                    let send = p + (l * m * c) as u64;
                    // SAFETY: rail l's M chunks of the checked operand; chunk r = l·M + domain
                    // is NCCL's in-place position in them.
                    unsafe { x.reduce_scatter(T::DTYPE, op, send, p + (r * c) as u64, c / es, &s) }
                }
                RankOrder::DomainMajor => {
                    self.rs_domain_major::<T>((h, x), b.op, p + (r * c) as u64, (c, op), s)
                }
                RankOrder::Other => self.all_reduce_op(T::DTYPE, b.op, op, s),
            },
        }
    }

    /// Reduce-scatter `input` (N chunks) into `output` (one chunk): this rank's chunk of the
    /// team's result; the input is only read. As
    /// [`HierCommunicator::reduce_scatter_in_place`], with the domain's step out of place into
    /// scratch (M chunks; [`RankOrder::Other`]: a copy of the whole input, allreduced).
    pub fn reduce_scatter<'s, 'd, 'x, T: Element>(
        &self,
        input: impl Into<Src<'s, T>>,
        output: impl Into<Dst<'d, T>>,
        op: ReduceOp,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let (i, o, s) = (input.into(), output.into(), stream.into());
        let es = T::DTYPE.size();
        let c = self.chunk(&i.op, es, "input")?;
        if o.op.bytes != c {
            return Err(Error::invalid(
                "output",
                format!("{} bytes; one chunk of the input is {c}", o.op.bytes),
            ));
        }
        self.check_stream(&s)?;
        let ip = self.ptr(&i.op, "input", es)?;
        let op_ = self.ptr(&o.op, "output", es)?;
        if ip < op_ + c as u64 && op_ < ip + i.op.bytes as u64 && c > 0 {
            return Err(Error::invalid(
                "output",
                "overlaps the input (in place: reduce_scatter_in_place)",
            ));
        }
        if c == 0 {
            return Ok(());
        }
        let m = self.layout.domain_count();
        let h = self.handle()?;
        match (&h, self.cross.as_deref()) {
            // SAFETY: both operands checked for these lengths.
            (None, Some(x)) => unsafe { x.reduce_scatter(T::DTYPE, op, ip, op_, c / es, &s) },
            (None, None) => self.copy_into(T::DTYPE, &i.op, &o.op, 0, &s),
            (Some(h), None) => h.reduce_scatter(i, o, op, s).map(drop),
            (Some(h), Some(x)) => match self.layout.rank_order() {
                RankOrder::RailMajor => {
                    let scratch = self.scratch(m * c, &s)?;
                    h.reduce_scatter(i, typed_dst::<T>(self.local_op(scratch, m * c)), op, s)?;
                    // SAFETY: M chunks of this rank's scratch; the checked output.
                    unsafe { x.reduce_scatter(T::DTYPE, op, scratch, op_, c / es, &s) }
                }
                RankOrder::DomainMajor => self.rs_domain_major::<T>((h, x), i.op, op_, (c, op), s),
                RankOrder::Other => {
                    let n = self.layout.size();
                    let scratch = self.scratch(n * c, &s)?;
                    let all = self.local_op(scratch, n * c);
                    self.copy_into(T::DTYPE, &i.op, &all, 0, &s)?;
                    self.all_reduce_op(T::DTYPE, all, op, s)?;
                    let r = self.layout.rank();
                    let mine = self.local_op(scratch + (r * c) as u64, c);
                    self.copy_into(T::DTYPE, &mine, &o.op, 0, &s)
                }
            },
        }
    }

    /// All-gather in place: `buf` holds N chunks; rank r's chunk r goes to every rank.
    ///
    /// - domains of one GPU: one cross-domain all-gather; one domain: the domain's;
    /// - rail-major ranks: the rail's all-gather into rail l's M chunks (in place), then the
    ///   domain's all-gather of the whole buffer;
    /// - domain-major ranks: the rail's all-gather of chunk r into M chunks of scratch, then M
    ///   domain all-gathers from the scratch into the domains' blocks;
    /// - [`RankOrder::Other`]: every chunk but this rank's zeroed, then the hierarchical
    ///   allreduce (sum) of the whole buffer (a -0.0 comes back as +0.0).
    pub fn all_gather_in_place<'d, 'x, T: Element>(
        &self,
        buf: impl Into<Dst<'d, T>>,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let (b, s) = (buf.into(), stream.into());
        let es = T::DTYPE.size();
        let c = self.chunk(&b.op, es, "buf")?;
        self.check_stream(&s)?;
        let p = self.ptr(&b.op, "buf", es)?;
        let (r, l) = (self.layout.rank(), self.layout.local_index());
        let (m, d) = (self.layout.domain_count(), self.layout.domain_size());
        if c == 0 {
            return Ok(());
        }
        let h = self.handle()?;
        match (&h, self.cross.as_deref()) {
            (None, Some(x)) => {
                // SAFETY: N chunks at p (checked); NCCL's in-place position.
                unsafe { x.all_gather(T::DTYPE, p + (r * c) as u64, p, c / es, &s) }
            }
            (None, None) => Ok(()),
            (Some(h), None) => h.all_gather_in_place(b, s).map(drop),
            (Some(h), Some(x)) => match self.layout.rank_order() {
                RankOrder::RailMajor => {
                    if b.op.is_sym() {
                        // The rail writes this rank's symmetric buffer first: a domain call
                        // made before this one (an allreduce) may still read it.
                        self.fence(h, s)?;
                    }
                    let recv = p + (l * m * c) as u64;
                    // SAFETY: rail l's M chunks of the checked operand; chunk r = l·M + domain
                    // is NCCL's in-place position in them.
                    unsafe { x.all_gather(T::DTYPE, p + (r * c) as u64, recv, c / es, &s) }?;
                    h.all_gather_in_place(typed_dst::<T>(b.op), s).map(drop)
                }
                RankOrder::DomainMajor => {
                    let scratch = self.scratch(m * c, &s)?;
                    // SAFETY: chunk r of the checked operand; M chunks of this rank's scratch.
                    unsafe { x.all_gather(T::DTYPE, p + (r * c) as u64, scratch, c / es, &s) }?;
                    for k in 0..m {
                        h.all_gather(
                            typed_src::<T>(self.local_op(scratch + (k * c) as u64, c)),
                            typed_dst::<T>(b.op.sub(k * d * c, d * c)),
                            s,
                        )?;
                    }
                    Ok(())
                }
                RankOrder::Other => {
                    // Zero every chunk but this rank's (after a fence: earlier calls of the
                    // domain peers may read this buffer), then sum across the team.
                    self.fence(h, s)?;
                    zero_others(&s, (p, b.op.bytes), c, r)?;
                    self.all_reduce_op(T::DTYPE, b.op, ReduceOp::Sum, s)
                }
            },
        }
    }

    /// All-gather `input` (one chunk) into `output` (N chunks): the input lands in chunk r of
    /// the output, then [`HierCommunicator::all_gather_in_place`].
    pub fn all_gather<'s, 'd, 'x, T: Element>(
        &self,
        input: impl Into<Src<'s, T>>,
        output: impl Into<Dst<'d, T>>,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<()> {
        let _serial = self.calls.lock();
        let (i, o, s) = (input.into(), output.into(), stream.into());
        let es = T::DTYPE.size();
        let c = self.chunk(&o.op, es, "output")?;
        if i.op.bytes != c {
            return Err(Error::invalid(
                "input",
                format!("{} bytes; one chunk of the output is {c}", i.op.bytes),
            ));
        }
        self.copy_into(T::DTYPE, &i.op, &o.op, self.layout.rank() * c, &s)?;
        self.all_gather_in_place(o, s)
    }
}

/// The domain's reduce-scatter in place, for a run-time element type.
fn rs_in_place_dyn(
    h: &RankHandle<'_>,
    dtype: DType,
    o: Operand<'_>,
    op: ReduceOp,
    s: StreamRef<'_>,
) -> Result<()> {
    match dtype {
        DType::F32 => h.reduce_scatter_in_place(typed_dst::<f32>(o), op, s),
        DType::F16 => h.reduce_scatter_in_place(typed_dst::<half::f16>(o), op, s),
        DType::Bf16 => h.reduce_scatter_in_place(typed_dst::<half::bf16>(o), op, s),
    }
    .map(drop)
}

/// The domain's all-gather in place, for a run-time element type.
fn ag_in_place_dyn(
    h: &RankHandle<'_>,
    dtype: DType,
    o: Operand<'_>,
    s: StreamRef<'_>,
) -> Result<()> {
    match dtype {
        DType::F32 => h.all_gather_in_place(typed_dst::<f32>(o), s),
        DType::F16 => h.all_gather_in_place(typed_dst::<half::f16>(o), s),
        DType::Bf16 => h.all_gather_in_place(typed_dst::<half::bf16>(o), s),
    }
    .map(drop)
}
