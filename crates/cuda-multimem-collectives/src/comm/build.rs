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

impl Communicator {
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
        locals.push(Local::new(rank, rank, d)?);
    }
    let ranks = Ranks::new(n, locals, None);
    let p2p = P2p::new(id, &ranks, &config)?;
    let (mm, mm_status) = match policy {
        MulticastPolicy::Never => (None, Some("the multicast policy is Never".to_string())),
        MulticastPolicy::WhenItPaysOff if !multimem_pays_off(n) => (
            None,
            Some(format!(
                "a team of {n} moves fewer bytes peer-to-peer (multicast pays off above 3 ranks)"
            )),
        ),
        p => match Mm::new(&devices, &config) {
            Ok(mm) => (Some(mm), None),
            Err(e) if p == MulticastPolicy::Always => return Err(e),
            Err(e) => (None, Some(e.to_string())),
        },
    };
    Ok(communicator(Inner::new(
        id, ranks, config, policy, p2p, mm, mm_status, fewest,
    )))
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
    let p2p = P2p::new(id, &ranks, &config)?;
    Ok(communicator(Inner::new(
        id,
        ranks,
        config,
        policy,
        p2p,
        None,
        Some("multicast teams across processes are not supported yet".into()),
        fewest,
    )))
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
        };
        Inner {
            id,
            ranks,
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
