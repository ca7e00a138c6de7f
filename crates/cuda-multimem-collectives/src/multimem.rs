//! Allreduce through a multicast address: PTX `multimem` kernels on a multicast team's memory.
//!
//! Only where NVLink multicast is allowed (never on machines that set `NCCL_NVLS_ENABLE=0` or
//! `CUDA_MULTIMEM_DISABLE_MULTICAST=1`: building the team refuses there), and worth it for
//! large messages only on teams of more than 3 GPUs ([`multimem_pays_off`]). Tested on the
//! simulator only: the GPUs this project can use must never create a multicast object.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cuda_multimem::team::{Backend, Team};
use cuda_multimem::{Device, Error, Result, Stream};
use cuda_multimem_sys::{CUdeviceptr, CUfunction};

use crate::comm::{cu, fewest_multiprocessors, Module, Raw};
use crate::kernels::multimem::{self as mm, MmKernel};
use crate::kernels::{ERR_MISMATCH, ERR_TIMEOUT, MAX_BLOCKS, MAX_RANKS};
use crate::{Algorithm, AllReduceConfig, Choice, DType, Op, Path};

/// Whether the multimem path should beat peer-to-peer two-shot for large messages on a team of
/// `n`: by the anchors' bandwidth arithmetic (NCCL's NVLS choice), only for teams larger than 3.
pub fn multimem_pays_off(n: usize) -> bool {
    n > 3
}

struct Rank {
    device: Device,
    functions: std::collections::HashMap<(MmKernel, DType, Op), Raw<CUfunction>>,
    _module: Module,
}

/// An allreduce over a multicast team of devices driven by this process. Operands live in the
/// team's memory: rank r writes its input with [`MultimemAllReduce::copy_in`] (or at
/// [`MultimemAllReduce::input_ptr`]), every rank reads the result at
/// [`MultimemAllReduce::output_ptr`]. Graph-safe like the peer-to-peer path: per-block counters
/// that only grow, arrival words that only grow.
pub struct MultimemAllReduce {
    ranks: Vec<Rank>,
    team: Team,
    capacity: usize,
    config: AllReduceConfig,
    multiprocessors: u32,
    poisoned: AtomicU32,
}

impl std::fmt::Debug for MultimemAllReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MultimemAllReduce({} ranks, {} bytes)",
            self.ranks.len(),
            self.capacity
        )
    }
}

impl MultimemAllReduce {
    /// A multicast team over `devices` with room for messages of `capacity` bytes (input and
    /// output regions of that size on every member). Refused where multicast is disabled.
    pub fn new(
        devices: &[Device],
        capacity: usize,
        config: AllReduceConfig,
    ) -> Result<MultimemAllReduce> {
        if devices.len() < 2 || devices.len() > MAX_RANKS {
            return Err(Error::invalid(
                "devices",
                format!("{} device(s); a team has 2 to {MAX_RANKS}", devices.len()),
            ));
        }
        if capacity == 0 {
            return Err(Error::invalid("capacity", "0; expected at least one byte"));
        }
        config.validate()?;
        let capacity = capacity.next_multiple_of(16);
        let team = Team::builder(devices)
            .size(mm::MM_DATA + 2 * capacity)
            .backend(Backend::MulticastObject)
            .build()?;
        let mut ranks = Vec::new();
        for d in devices {
            let m = Module::load(d, mm::PTX)?;
            let mut functions = std::collections::HashMap::new();
            for k in MmKernel::ALL {
                for dt in DType::ALL {
                    for op in Op::ALL {
                        if mm::supported(dt, op) {
                            functions.insert((k, dt, op), Raw(m.function(&k.entry(dt, op))?));
                        }
                    }
                }
            }
            ranks.push(Rank {
                device: d.clone(),
                functions,
                _module: m,
            });
        }
        let n = devices.len();
        let peers: Vec<CUdeviceptr> = (0..n).map(|i| team.member_ptr(i)).collect::<Result<_>>()?;
        for (i, r) in ranks.iter().enumerate() {
            let mut hdr = vec![0u8; mm::MM_DATA];
            hdr[mm::MM_OFF_RANK..mm::MM_OFF_RANK + 4].copy_from_slice(&(i as u32).to_le_bytes());
            hdr[mm::MM_OFF_NRANKS..mm::MM_OFF_NRANKS + 4]
                .copy_from_slice(&(n as u32).to_le_bytes());
            hdr[mm::MM_OFF_CAP..mm::MM_OFF_CAP + 8]
                .copy_from_slice(&(capacity as u64).to_le_bytes());
            for (j, p) in peers.iter().enumerate() {
                let o = mm::MM_OFF_PEERS + 8 * j;
                hdr[o..o + 8].copy_from_slice(&p.to_le_bytes());
            }
            // SAFETY: the header region of member i's memory (mapped read-write for it).
            unsafe { r.device.copy_from_host_blocking(peers[i], &hdr) }?;
        }
        let multiprocessors = fewest_multiprocessors(devices)?;
        Ok(MultimemAllReduce {
            ranks,
            team,
            capacity,
            config,
            multiprocessors,
            poisoned: AtomicU32::new(0),
        })
    }

    /// Team size.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Bytes of the input (and of the output) region.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Rank `rank`'s input region (unicast address).
    pub fn input_ptr(&self, rank: usize) -> Result<CUdeviceptr> {
        Ok(self.team.member_ptr(rank)? + mm::MM_DATA as u64)
    }

    /// Rank `rank`'s output region (unicast address).
    pub fn output_ptr(&self, rank: usize) -> Result<CUdeviceptr> {
        Ok(self.input_ptr(rank)? + self.capacity as u64)
    }

    fn rank(&self, rank: usize) -> Result<&Rank> {
        self.ranks.get(rank).ok_or_else(|| {
            Error::invalid(
                "rank",
                format!("{rank}; the team has {} ranks", self.ranks.len()),
            )
        })
    }

    fn copy(
        &self,
        rank: usize,
        at: CUdeviceptr,
        len: usize,
        to_device: Option<&[u8]>,
        out: Option<&mut [u8]>,
    ) -> Result<()> {
        let r = self.rank(rank)?;
        if len > self.capacity {
            return Err(Error::invalid(
                "data",
                format!("{len} bytes; the regions hold {}", self.capacity),
            ));
        }
        r.device.bind()?;
        match (to_device, out) {
            // SAFETY: inside rank's region (checked), mapped for its device; the slice is live.
            (Some(d), _) => unsafe { r.device.copy_from_host_blocking(at, &d[..len]) },
            // SAFETY: as above.
            (None, Some(o)) => unsafe {
                cu!(
                    r.device.driver(),
                    cuMemcpyDtoH_v3020(o.as_mut_ptr() as *mut c_void, at, len)
                )
            },
            _ => Ok(()),
        }
    }

    /// Copy `data` into rank `rank`'s input region (synchronous).
    pub fn copy_in(&self, rank: usize, data: &[u8]) -> Result<()> {
        self.copy(rank, self.input_ptr(rank)?, data.len(), Some(data), None)
    }

    /// Copy rank `rank`'s output region into `out` (synchronous; synchronise its stream first).
    pub fn copy_out(&self, rank: usize, out: &mut [u8]) -> Result<()> {
        let at = self.output_ptr(rank)?;
        let len = out.len();
        self.copy(rank, at, len, None, Some(out))
    }

    /// What an allreduce of `count` elements of `dtype` runs.
    pub fn choice(&self, count: usize, dtype: DType) -> Choice {
        let c = &self.config;
        let n = self.ranks.len();
        let bytes = count * dtype.size();
        let one_shot_max = c.one_shot_max_bytes.unwrap_or(256 << 10);
        let algorithm = match c.algorithm {
            // the low-latency protocol is a peer-to-peer protocol; multimem runs one-shot
            Some(Algorithm::OneShotLl) => Some(Algorithm::OneShot),
            Some(Algorithm::TwoShotPush | Algorithm::TwoShotCe) => Some(Algorithm::TwoShot),
            a => a,
        };
        let algorithm = algorithm.unwrap_or(if bytes <= one_shot_max {
            Algorithm::OneShot
        } else {
            Algorithm::TwoShot
        });
        let max_blocks = if c.max_blocks == 0 {
            (2 * self.multiprocessors).min(MAX_BLOCKS as u32)
        } else {
            c.max_blocks
        } as u64;
        let units = bytes.div_ceil(16) as u64;
        let per_rank = match algorithm {
            Algorithm::OneShot | Algorithm::OneShotLl => units,
            Algorithm::TwoShot | Algorithm::TwoShotPush | Algorithm::TwoShotCe => {
                units.div_ceil(n as u64)
            }
        };
        let blocks = per_rank.div_ceil(c.threads as u64).clamp(1, max_blocks);
        let threads = per_rank
            .div_ceil(blocks)
            .next_multiple_of(32)
            .clamp(64, c.threads as u64);
        Choice {
            path: Path::Multimem,
            algorithm,
            blocks: blocks as u32,
            threads: threads as u32,
        }
    }

    /// Rank `rank`'s share of an allreduce of the first `count` elements of the input regions
    /// into the output regions, on `stream` (a stream of the rank's device). Every rank makes
    /// the same call in the same order.
    pub fn all_reduce(
        &self,
        rank: usize,
        count: usize,
        dtype: DType,
        op: Op,
        stream: &Stream,
    ) -> Result<Choice> {
        let r = self.rank(rank)?;
        if !mm::supported(dtype, op) {
            return Err(Error::invalid(
                "op",
                format!(
                    "{} {} has no multimem.ld_reduce form (f32 reduces only with add); use the peer-to-peer Communicator",
                    dtype.name(),
                    op.name()
                ),
            ));
        }
        if count * dtype.size() > self.capacity {
            return Err(Error::invalid(
                "count",
                format!(
                    "{count} x {} = {} bytes; the regions hold {}",
                    dtype.name(),
                    count * dtype.size(),
                    self.capacity
                ),
            ));
        }
        if stream.device() != &r.device {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a stream of device {}; rank {rank} is device {}",
                    stream.device().ordinal(),
                    r.device.ordinal()
                ),
            ));
        }
        if let e @ 1.. = self.poisoned.load(Ordering::Relaxed) {
            return Err(poison_error(e));
        }
        let choice = self.choice(count, dtype);
        if count == 0 {
            return Ok(choice);
        }
        let k = match choice.algorithm {
            Algorithm::OneShot | Algorithm::OneShotLl => MmKernel::OneShot,
            Algorithm::TwoShot | Algorithm::TwoShotPush | Algorithm::TwoShotCe => MmKernel::TwoShot,
        };
        let f = r.functions[&(k, dtype, op)].0;
        let mc = self
            .team
            .multicast_address()
            .ok_or_else(|| Error::invalid("team", "the team has no multicast address"))?;
        // The call header every member compares at the first barrier: what and how much.
        let sig = crate::kernels::call_header(&[
            count as u64,
            dtype.code(),
            op.code(),
            k as u64,
            choice.blocks as u64,
        ]);
        // SAFETY: a function of this device's module whose entry takes these five .u64
        // parameters (unicast base, multicast base, count, timeout, header); a live stream of
        // the device.
        unsafe {
            crate::kernels::launch(
                &r.device,
                f,
                choice.blocks,
                choice.threads,
                stream.raw(),
                &[
                    self.team.member_ptr(rank)?,
                    mc,
                    count as u64,
                    self.config.timeout_ns(),
                    sig,
                ],
            )
        }?;
        Ok(choice)
    }

    /// Report a timeout or a disagreement between ranks (size, type, operation, algorithm)
    /// seen by earlier calls (after synchronising the streams); the team then refuses further
    /// calls.
    pub fn check(&self) -> Result<()> {
        let mut worst = 0;
        for (i, r) in self.ranks.iter().enumerate() {
            let mut w = [0u8; 4];
            r.device.bind()?;
            let at = self.team.member_ptr(i)? + mm::MM_OFF_ERR as u64;
            // SAFETY: four bytes of member i's header, mapped for its device.
            unsafe {
                cu!(
                    r.device.driver(),
                    cuMemcpyDtoH_v3020(w.as_mut_ptr() as *mut c_void, at, 4)
                )
            }?;
            match u32::from_le_bytes(w) {
                0 => {}
                ERR_MISMATCH => worst = ERR_MISMATCH,
                _ if worst == 0 => worst = ERR_TIMEOUT,
                _ => {}
            }
        }
        if worst != 0 {
            self.poisoned.store(worst, Ordering::Relaxed);
            return Err(poison_error(worst));
        }
        Ok(())
    }
}

fn poison_error(code: u32) -> Error {
    match code {
        ERR_MISMATCH => Error::invalid(
            "ranks",
            "the ranks called the multimem allreduce with different sizes, types, operations or algorithms; the team is unusable now",
        ),
        _ => Error::Timeout {
            what: "a multimem allreduce barrier (a peer did not arrive); the team is unusable now"
                .into(),
            after: Duration::ZERO,
        },
    }
}
