//! Building a [`Communicator`]: its members (devices of this process, or one device per process
//! with a [`Bootstrap`]), the checks of the devices, the executors, and what every rank must
//! agree on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cuda_multimem::{Device, Error, Result};
use parking_lot::Mutex;

use super::{Communicator, Inner};
use crate::bootstrap::Bootstrap;
use crate::config::CommConfig;
use crate::engine::TeamFacts;
use crate::exec::multimem::Mm;
use crate::exec::p2p::P2p;
use crate::kernels::MAX_RANKS;
use crate::team::placement::{busiest, context_key, device_key};
use crate::team::{Local, Ranks};
use crate::types::{multimem_pays_off, MulticastPolicy};

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
    shared: bool,
}

impl std::fmt::Debug for CommunicatorBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommunicatorBuilder")
            .field("config", &self.config)
            .field("multicast", &self.multicast)
            .field("shared_devices", &self.shared)
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

    /// Let several ranks of the team use one device (default: refused, naming the device):
    /// in one process a device list with repeats, across processes several processes on one
    /// GPU (ranks of one process on one GPU that each come through a bootstrap of their own,
    /// e.g. threads, are refused: build one communicator over a device list for them). The real kernels then run at any team size on any GPU — a tensor-parallel engine
    /// of 8 ranks tested on one GPU — with each rank's grid capped to its share of the device
    /// (the kernels' occupancy, `cuOccupancyMaxActiveBlocksPerMultiprocessor`, over the ranks
    /// on the busiest device), so that every rank's spin-waiting blocks are resident at once.
    /// The multimem path is off (multicast needs a device per rank), and within one process so
    /// are the copy-engine all-gather and broadcast (they fork each rank onto a second stream):
    /// there every rank's stream needs a hardware queue of its own: the driver gives a context
    /// `CUDA_DEVICE_MAX_CONNECTIONS` queues (8 unless set before the process's first CUDA call,
    /// at most 32) and deals them to streams in the order they are created, so create the
    /// ranks' streams one after the other; a team with more ranks of this process on one device
    /// than queues is refused, naming the variable. Timings of such teams say nothing about a
    /// team of distinct GPUs. Every rank of a team across processes passes the same setting.
    pub fn allow_shared_devices(mut self, allow: bool) -> Self {
        self.shared = allow;
        self
    }

    /// Build: check the members, allocate and map the symmetric areas, load the kernels, and
    /// (by the multicast policy) build the multicast team. Across processes every rank builds
    /// with the same configuration and policy, at the same point of its program.
    pub fn build(self) -> Result<Communicator> {
        self.config.validate()?;
        let id = NEXT_COMM.fetch_add(1, Ordering::Relaxed);
        match self.members {
            Members::Local(devices) => {
                build_local(id, devices, self.config, self.multicast, self.shared)
            }
            Members::Process(device, bootstrap) => build_process(
                id,
                device,
                bootstrap,
                self.config,
                self.multicast,
                self.shared,
            ),
        }
    }
}

fn check_devices(devices: &[Device], shared: bool) -> Result<()> {
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
            if shared {
                // checked once, where it first appears
                continue;
            }
            return Err(Error::invalid(
                "devices",
                format!(
                    "device {} appears twice (several ranks on one device: CommunicatorBuilder::allow_shared_devices(true))",
                    d.ordinal()
                ),
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

impl Communicator {
    /// A builder over `devices`, all driven by this process (rank i is `devices[i]`).
    pub fn builder(devices: &[Device]) -> CommunicatorBuilder {
        CommunicatorBuilder {
            members: Members::Local(devices.to_vec()),
            config: CommConfig::default(),
            multicast: MulticastPolicy::default(),
            shared: false,
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
            shared: false,
        }
    }
}

fn multiprocessors(d: &Device) -> Result<u32> {
    Ok(d.multiprocessor_count()?.max(1) as u32)
}

fn build_local(
    id: u64,
    devices: Vec<Device>,
    config: CommConfig,
    policy: MulticastPolicy,
    shared: bool,
) -> Result<Communicator> {
    let n = devices.len();
    if !(1..=MAX_RANKS).contains(&n) {
        return Err(Error::invalid(
            "devices",
            format!("{n} device(s); a team has 1 to {MAX_RANKS} ranks (one NVL72 domain)"),
        ));
    }
    check_devices(&devices, shared)?;
    let keys: Vec<u64> = devices.iter().map(|d| d.ordinal() as u64).collect();
    let (per_device, _) = busiest(&keys);
    check_queues(per_device, hardware_queues())?;
    let mut fewest = u32::MAX;
    let mut locals = Vec::new();
    for (rank, d) in devices.iter().enumerate() {
        fewest = fewest.min(multiprocessors(d)?);
        locals.push(Local::new(rank, rank, d)?);
    }
    let ranks = Ranks::new(n, locals, None);
    let p2p = P2p::new(id, &ranks, &config)?;
    let mut caps = co_residency(&p2p, &config, per_device, fewest, None)?;
    caps.one_stream = per_device > 1;
    let (mm, mm_status) = match policy {
        _ if per_device > 1 && policy == MulticastPolicy::Always => {
            return Err(Error::invalid(
                "multicast",
                "Always: ranks share devices, and multicast needs one device per rank",
            ))
        }
        _ if per_device > 1 => (
            None,
            Some(format!(
                "{per_device} ranks share a device (multicast needs one device per rank)"
            )),
        ),
        MulticastPolicy::Never => (None, Some("the multicast policy is Never".to_string())),
        MulticastPolicy::WhenItPaysOff if n == 1 => {
            (None, Some("a team of one has no peer".to_string()))
        }
        MulticastPolicy::WhenItPaysOff if !multimem_pays_off(n) => (
            None,
            Some(format!(
                "a team of {n} moves fewer bytes peer-to-peer (multicast pays off above 3 ranks)"
            )),
        ),
        p => match Mm::new(
            &devices,
            ranks
                .locals
                .iter()
                .map(|l| l.mirror_ptr(Local::MIRROR_MM))
                .collect(),
            &config,
        ) {
            Ok(mm) => (Some(mm), None),
            Err(e) if p == MulticastPolicy::Always => return Err(e),
            Err(e) => (None, Some(e.to_string())),
        },
    };
    Ok(communicator(Inner::new(
        id, ranks, config, policy, p2p, mm, mm_status, fewest, caps,
    )))
}

fn build_process(
    id: u64,
    device: Device,
    bootstrap: Box<dyn Bootstrap>,
    config: CommConfig,
    policy: MulticastPolicy,
    shared: bool,
) -> Result<Communicator> {
    let (rank, n) = (bootstrap.rank(), bootstrap.size());
    if !(1..=MAX_RANKS).contains(&n) || rank >= n {
        return Err(Error::invalid(
            "bootstrap",
            format!("rank {rank} of {n}; a team has 1 to {MAX_RANKS} ranks (one NVL72 domain)"),
        ));
    }
    check_devices(std::slice::from_ref(&device), shared)?;
    let ranks = Ranks::new(n, vec![Local::new(rank, 0, &device)?], Some(bootstrap));
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
    fp.push(shared as u8);
    let all = ranks.exchange("configurations", &fp, Some(fp.len()))?;
    if let Some(r) = all.iter().position(|x| *x != fp) {
        return Err(Error::RanksDisagree {
            what: format!(
                "rank {r} passed another configuration, multicast policy or shared-device setting than rank {rank}; every rank must pass the same"
            ),
        });
    }
    // which ranks share a GPU, and which of them also share a process (its context's hardware
    // queues): every rank sees every key, so all refuse or accept alike
    let mut mine = device_key(&device).to_le_bytes().to_vec();
    mine.extend_from_slice(&context_key(&device).to_le_bytes());
    let all = ranks.exchange("device keys", &mine, Some(16))?;
    let key =
        |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default());
    let keys: Vec<u64> = all.iter().map(|b| key(b, 0)).collect();
    let contexts: Vec<u64> = all.iter().map(|b| key(b, 8)).collect();
    let (per_device, pair) = busiest(&keys);
    let (_, same_context) = busiest(&contexts);
    if let Some((a, b)) = same_context {
        // Several ranks of one process on one GPU, each through a bootstrap of its own (threads):
        // on the simulator such teams ran calls out of step (timeouts, and wrong results in a
        // hierarchical team); refused until that is understood. One Communicator over a device
        // list with repeats serves ranks of one process sharing a GPU.
        return Err(Error::invalid(
            "device",
            format!(
                "ranks {a} and {b} are in one process on the same GPU, each with a bootstrap of its own: not supported; for ranks of one process sharing a GPU build one Communicator over a device list with repeats (Communicator::builder(&devices).allow_shared_devices(true))"
            ),
        ));
    }
    if let (Some((a, b)), false) = (pair, shared) {
        return Err(Error::invalid(
            "device",
            format!(
                "ranks {a} and {b} use the same GPU; several ranks on one device need CommunicatorBuilder::allow_shared_devices(true) on every rank"
            ),
        ));
    }
    if policy == MulticastPolicy::Always {
        return Err(Error::invalid(
            "multicast",
            "Always: multicast teams across processes are not supported yet (use Never or WhenItPaysOff)",
        ));
    }
    // (one rank per process and device from here: each keeps its queues, `one_stream` stays off)
    let p2p = P2p::new(id, &ranks, &config)?;
    let caps = co_residency(&p2p, &config, per_device, fewest, Some(&ranks))?;
    Ok(communicator(Inner::new(
        id,
        ranks,
        config,
        policy,
        p2p,
        None,
        Some("multicast teams across processes are not supported yet".into()),
        fewest,
        caps,
    )))
}

/// The hardware work queues the driver gives each context, which its streams share in the
/// order they are created: `CUDA_DEVICE_MAX_CONNECTIONS` (read by the driver when it creates the
/// context; 8 unless set, clamped to the driver's 1 to 32). Two ranks whose streams share a queue
/// run one after the other even when one's kernel waits for the other's, so ranks sharing a device
/// within one process need a queue each (and use one stream each: no copy-engine lane, see the
/// planner).
pub(crate) fn hardware_queues() -> usize {
    std::env::var("CUDA_DEVICE_MAX_CONNECTIONS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map_or(8, |v| v.clamp(1, 32))
}

/// Ranks of this process on one device, `per_device`, need a hardware queue each.
fn check_queues(per_device: usize, queues: usize) -> Result<()> {
    if per_device <= queues {
        return Ok(());
    }
    Err(Error::invalid(
        "devices",
        format!(
            "{per_device} ranks of this process on one device, more than its {queues} hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 unless set, at most 32): ranks whose streams share a queue would wait for each other's kernels forever; set CUDA_DEVICE_MAX_CONNECTIONS before the process's first CUDA call, or place fewer ranks on the device"
        ),
    ))
}

fn communicator(inner: Inner) -> Communicator {
    Communicator {
        inner: Arc::new(inner),
    }
}

impl Inner {
    #[allow(clippy::too_many_arguments)]
    fn new(
        id: u64,
        ranks: Ranks,
        config: CommConfig,
        policy: MulticastPolicy,
        p2p: P2p,
        mm: Option<Mm>,
        mm_status: Option<String>,
        multiprocessors: u32,
        caps: Caps,
    ) -> Inner {
        let facts = TeamFacts {
            n: ranks.n,
            multiprocessors,
            stage_half: p2p.stage_half,
            ll_slot: p2p.ll_slot,
            land_slot: p2p.land_slot,
            scratch_region: p2p.scratch_region(),
            mm_region: mm.as_ref().map(Mm::region),
            policy,
            block_cap: caps.blocks,
            cluster_cap: caps.clusters,
            shared: caps.one_stream,
        };
        // the first call's bound: as configured, else the longer of the timeout, the default
        // first-call bound and what the bootstrap waits for the slowest rank
        let first_call = config.first_call_timeout.unwrap_or_else(|| {
            let boot = ranks.bootstrap.as_ref().and_then(|b| b.timeout());
            config
                .first_call()
                .max(boot.unwrap_or_default().min(CommConfig::MAX_TIMEOUT))
        });
        Inner {
            id,
            ranks,
            first_call,
            config,
            policy,
            p2p,
            mm,
            facts,
            mm_status,
            next_buffer: AtomicU64::new(1),
            alloc_lock: Mutex::new(()),
        }
    }
}

/// What each rank's launches may take of its device when ranks share devices.
#[derive(Debug, Clone, Copy)]
struct Caps {
    /// Blocks per launch.
    blocks: u32,
    /// Thread-block clusters per launch (the fused norm's split forms).
    clusters: u32,
    /// Ranks of one process share a device, so each keeps to one stream (one hardware queue
    /// each; processes sharing a GPU have queues of their own).
    one_stream: bool,
}

/// Each rank's share of the busiest device, `per_device` ranks on it: the fewest blocks of any
/// of our kernels one multiprocessor holds (their real occupancy at the block sizes they
/// launch), times the fewest multiprocessors, over the ranks on it; the same for the split
/// norm's clusters. Across processes (`ranks`), the fewest of every rank's. No cap when every
/// rank has its own device.
fn co_residency(
    p2p: &P2p,
    config: &CommConfig,
    per_device: usize,
    fewest: u32,
    ranks: Option<&Ranks>,
) -> Result<Caps> {
    if per_device <= 1 {
        return Ok(Caps {
            blocks: u32::MAX,
            clusters: u32::MAX,
            one_stream: false,
        });
    }
    let (mut blocks, mut clusters) = p2p.occupancy(config)?;
    if let Some(ranks) = ranks {
        let mut mine = blocks.to_le_bytes().to_vec();
        mine.extend_from_slice(&clusters.to_le_bytes());
        let all = ranks.exchange("kernel occupancy", &mine, Some(8))?;
        for b in all {
            blocks = blocks.min(u32::from_le_bytes(b[..4].try_into().unwrap_or_default()));
            clusters = clusters.min(u32::from_le_bytes(b[4..8].try_into().unwrap_or_default()));
        }
    }
    let per = per_device as u64;
    let block_cap = (blocks as u64 * fewest as u64 / per) as u32;
    if block_cap == 0 {
        return Err(Error::invalid(
            "devices",
            format!(
                "{per_device} ranks on one device: its {fewest} multiprocessors hold {blocks} block(s) of our kernels each, fewer than one block per rank at once"
            ),
        ));
    }
    Ok(Caps {
        blocks: block_cap,
        clusters: (clusters as u64 / per) as u32,
        one_stream: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_on_one_device_need_a_hardware_queue_each() {
        assert!(check_queues(1, 1).is_ok());
        assert!(check_queues(8, 8).is_ok());
        match check_queues(9, 8) {
            Err(Error::InvalidArgument { arg, reason }) => {
                assert_eq!(arg, "devices");
                assert!(reason.contains("CUDA_DEVICE_MAX_CONNECTIONS"), "{reason}");
                assert!(reason.contains("9 ranks"), "{reason}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}
