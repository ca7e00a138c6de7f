//! The peer-to-peer executor: signal pads, staging, low-latency slots, landing areas and
//! scratch in symmetric memory, and per local rank the kernels it loaded; the allreduce
//! ([`allreduce`]), reduce-scatter / all-gather / broadcast ([`gather`], [`copy_engine`]) and
//! fused norm ([`norm`]) and all-to-all ([`alltoall`]) executions.

pub(crate) mod allreduce;
pub(crate) mod alltoall;
pub(crate) mod copy_engine;
pub(crate) mod gather;
pub(crate) mod moe;
pub(crate) mod norm;

use std::collections::HashMap;

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{Device, Error, Function, Result};
use parking_lot::Mutex;

use crate::buffer::SymBuf;
use crate::config::CommConfig;
use crate::kernels::{self, check_device, load_module, Kernel, PAD_BYTES};
use crate::team::{Local, Ranks, Sym};
use crate::types::{DType, ReduceOp};

/// The kernels of one device and its copy-engine lane, loaded with the communicator (so that
/// a first call inside a graph capture loads nothing).
pub(crate) struct RankKernels {
    /// The allreduce kernels, by family, type and operator.
    allreduce: HashMap<(Kernel, DType, ReduceOp), Function>,
    gather: gather::Kernels,
    norm: norm::Kernels,
    alltoall: alltoall::Kernels,
    moe: moe::Kernels,
    ce: Mutex<copy_engine::CeLane>,
}

impl RankKernels {
    /// Every function with the most threads a launch of it takes under `config`.
    fn functions<'k>(&'k self, config: &CommConfig) -> Vec<(&'k Function, u32)> {
        let most = config.threads.max(config.push_threads);
        let mut v: Vec<(&Function, u32)> = Vec::new();
        for ((k, _, _), f) in &self.allreduce {
            let t = match k {
                Kernel::P2pTwoShotPush | Kernel::P2pTwoShotCe => config.push_threads,
                _ => config.threads,
            };
            v.push((f, t));
        }
        v.extend(self.gather.all().map(|f| (f, most)));
        v.extend(self.norm.all().map(|(f, _)| (f, 1024)));
        v.extend(self.alltoall.all().map(|f| (f, most)));
        v.extend(self.moe.all().map(|f| (f, config.push_threads)));
        v
    }

    /// Every kernel file this executor loads: (file name, committed text).
    fn files() -> Vec<(&'static str, &'static str)> {
        Kernel::ALL
            .iter()
            .map(|k| (k.file(), k.ptx()))
            .chain(
                crate::kernels::gather::Collective::ALL
                    .iter()
                    .map(|c| (c.file(), c.ptx())),
            )
            .chain([(crate::kernels::norm::FILE, crate::kernels::norm::PTX)])
            .chain([(
                crate::kernels::alltoall::FILE,
                crate::kernels::alltoall::PTX,
            )])
            .chain([(crate::kernels::moe::FILE, crate::kernels::moe::PTX)])
            .collect()
    }

    fn load(device: &Device) -> Result<RankKernels> {
        // what the kernels need, before the first module load (a JIT log is no answer)
        check_device(device, &RankKernels::files())?;
        let mut allreduce = HashMap::new();
        for k in Kernel::ALL {
            let m = load_module(device, k.file(), k.ptx())?;
            for dt in DType::REDUCED {
                for op in ReduceOp::ALL
                    .into_iter()
                    .filter(|&op| k.has(op) && k.has_type(dt))
                {
                    allreduce.insert((k, dt, op), m.function(&k.entry(dt, op))?);
                }
            }
        }
        Ok(RankKernels {
            allreduce,
            gather: gather::Kernels::load(device)?,
            norm: norm::Kernels::load(device)?,
            alltoall: alltoall::Kernels::load(device)?,
            moe: moe::Kernels::load(device)?,
            ce: Mutex::new(copy_engine::CeLane::new(device)?),
        })
    }
}

/// The executor's symmetric areas, and per local rank (in the order of [`Ranks::locals`]) its
/// kernels.
pub(crate) struct P2p {
    pub(crate) pads: Sym,
    _stages: Sym,
    ll: Sym,
    lands: Sym,
    pub(crate) land_slot: usize,
    pub(crate) stage_half: usize,
    pub(crate) ll_slot: usize,
    /// Scratch for the caller's own memory: three regions.
    scratch: Option<SymBuf>,
    ranks: Vec<RankKernels>,
}

impl P2p {
    pub(crate) fn new(comm_id: u64, ranks: &Ranks, config: &CommConfig) -> Result<P2p> {
        let n = ranks.n;
        let kernels = ranks
            .locals
            .iter()
            .map(|l| RankKernels::load(&l.device))
            .collect::<Result<Vec<_>>>()?;
        // a team of one moves nothing between ranks (its calls are local copies and the local
        // norm): areas of one page
        let alone = n == 1;
        let stage_half = if alone {
            4096
        } else {
            config.stage_slot_bytes(n)
        };
        let pads = Sym::new(ranks, PAD_BYTES, true)?;
        let stages = Sym::new(ranks, 2 * n * stage_half, false)?;
        let ll_slot = if alone { 4096 } else { config.ll_slot_bytes() };
        let ll = Sym::new(ranks, 2 * n * ll_slot, true)?;
        let land_slot = config
            .ce_max_bytes
            .div_ceil(n)
            .max(4096)
            .next_multiple_of(4096);
        let land_slot = if alone { 4096 } else { land_slot };
        let lands = Sym::new(ranks, n * land_slot, false)?;
        let scratch = match config.scratch_total() {
            _ if alone => None,
            0 => None,
            b => Some(SymBuf::new(
                comm_id,
                u64::MAX,
                ranks,
                Sym::new(ranks, b, false)?,
            )?),
        };
        // Each local rank's pad: its rank, the team size, the staging half, every rank's pad
        // and staging area as mapped in this process (everything before the counters).
        for l in &ranks.locals {
            let mut hdr = vec![0u8; kernels::OFF_CTR];
            let mut put = |at: usize, v: &[u8]| hdr[at..at + v.len()].copy_from_slice(v);
            put(kernels::OFF_RANK, &(l.rank as u32).to_le_bytes());
            put(kernels::OFF_NRANKS, &(n as u32).to_le_bytes());
            put(kernels::OFF_STAGE_HALF, &(stage_half as u64).to_le_bytes());
            put(kernels::OFF_LL_SLOT, &(ll_slot as u64).to_le_bytes());
            put(kernels::OFF_LAND_SLOT, &(land_slot as u64).to_le_bytes());
            put(kernels::OFF_LAND, &lands.addrs[l.rank].to_le_bytes());
            put(
                kernels::OFF_MIRROR,
                &l.mirror_ptr(Local::MIRROR_P2P).to_le_bytes(),
            );
            for j in 0..n {
                put(kernels::OFF_PADS + 8 * j, &pads.addrs[j].to_le_bytes());
                put(kernels::OFF_STAGES + 8 * j, &stages.addrs[j].to_le_bytes());
                put(kernels::OFF_LL_STAGES + 8 * j, &ll.addrs[j].to_le_bytes());
            }
            pads.write(l.rank, 0, &hdr)?;
        }
        // Every rank's pad must be initialised before any kernel signals into it.
        if ranks.bootstrap.is_some() {
            ranks.exchange("pad readiness", b"pads ready", Some(10))?;
        }
        Ok(P2p {
            pads,
            _stages: stages,
            ll,
            lands,
            land_slot,
            stage_half,
            ll_slot,
            scratch,
            ranks: kernels,
        })
    }

    /// Bytes of one of the scratch's three regions, a multiple of 16 (0: no scratch).
    pub(crate) fn scratch_region(&self) -> usize {
        self.scratch.as_ref().map_or(0, |s| (s.sym.bytes / 3) & !15)
    }

    /// Local rank `l`'s kernels.
    fn kernels(&self, l: &Local) -> &RankKernels {
        &self.ranks[l.slot]
    }

    /// Local rank `l`'s pad.
    fn pad(&self, l: &Local) -> CUdeviceptr {
        self.pads.addrs[l.rank]
    }

    /// Local rank `l`'s scratch: its base address and the symmetric buffer (for call headers
    /// and device tables), or an error naming `arg` (the operand that needed it).
    fn scratch(&self, l: &Local, arg: &'static str, why: &str) -> Result<(CUdeviceptr, &SymBuf)> {
        let s = self.scratch.as_ref().ok_or_else(|| {
            Error::invalid(
                arg,
                format!(
                    "{why}: such operands go through the communicator's scratch, and it has none (config.scratch_bytes = 0)"
                ),
            )
        })?;
        Ok((s.sym.addrs[l.rank], s))
    }

    /// How many blocks of the least resident of this executor's kernels one multiprocessor of
    /// every local rank's device holds (`cuOccupancyMaxActiveBlocksPerMultiprocessor` at the
    /// most threads a launch of it takes), and how many thread-block clusters of the fused
    /// norm's split forms the device holds (`cuOccupancyMaxActiveClusters`, 1024 threads).
    pub(crate) fn occupancy(&self, config: &CommConfig) -> Result<(u32, u32)> {
        let (mut blocks, mut clusters) = (u32::MAX, u32::MAX);
        for k in &self.ranks {
            for (f, threads) in k.functions(config) {
                blocks = blocks.min(f.max_active_blocks_per_multiprocessor(threads.max(1), 0)?);
            }
            for (f, split) in k.norm.all() {
                if split {
                    let cfg = cuda_multimem::LaunchConfig::linear(
                        crate::kernels::norm::SPLIT as u32,
                        1024,
                    );
                    clusters = clusters.min(f.max_active_clusters(&cfg, None)?);
                }
            }
        }
        Ok((blocks, clusters))
    }

    /// Back to a fresh team's protocol state for the ranks this process drives (`Communicator::
    /// recover`: no kernel of the team runs any more): the error and bounds words, the
    /// per-block counters, signal slots and call headers of every local pad, and the
    /// low-latency slots (whose flags follow the counters) zeroed, as a new team has them (the
    /// error mirror is the caller's).
    pub(crate) fn reset(&self, ranks: &Ranks) -> Result<()> {
        for l in &ranks.locals {
            self.pads.zero(l.rank, kernels::OFF_ERR, 8)?;
            self.pads
                .zero(l.rank, kernels::OFF_CTR, PAD_BYTES - kernels::OFF_CTR)?;
            self.ll.zero(l.rank, 0, self.ll.bytes)?;
        }
        Ok(())
    }

    /// The error word of local rank `rank`; where it is 0, its bounds word (a count the
    /// all-to-all kernels found out of range on the device).
    pub(crate) fn error_word(&self, rank: usize) -> Result<u32> {
        let mut w = [0u32; 2];
        self.pads.read(rank, kernels::OFF_ERR, &mut w)?;
        Ok(if w[0] != 0 { w[0] } else { w[1] })
    }
}
