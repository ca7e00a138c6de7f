//! [`HierBuilder`]: find the domains, build the domain's communicator and the rails.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_multimem::{Device, Error, Result};
use parking_lot::Mutex;

use super::comm::Scratch;
use super::cross::{CrossDomain, NcclCrossDomain, Rail};
#[cfg(feature = "sim")]
use super::double::HostCrossDomainDouble;
use super::layout::{domain_keys, HierLayout};
use super::sub_bootstrap::SubBootstrap;
use super::HierCommunicator;
use crate::bootstrap::Bootstrap;
use crate::comm::Communicator;
use crate::config::CommConfig;
use crate::nccl::{Nccl, NcclComm, NcclUniqueId};
use crate::types::MulticastPolicy;

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
    /// `HostCrossDomainDouble` (feature `sim`) in tests).
    pub fn cross_domain_with(
        mut self,
        f: impl FnOnce(Rail) -> Result<Box<dyn CrossDomain>> + Send + 'static,
    ) -> Self {
        self.cross = Cross::Custom(Box::new(f));
        self
    }

    /// The host test double for the cross-domain step (`HostCrossDomainDouble` (feature `sim`); feature `sim`).
    #[cfg(feature = "sim")]
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
}
