//! The multimem executor: `multimem` kernels on a multicast team's memory (a classic multicast
//! object: the kernels need a multicast *virtual address*, which logical endpoints do not have).
//!
//! Every member's memory holds a header (signal words, counters, call headers) and an input and
//! an output region. A call copies its input into the member's input region, runs the kernel,
//! and copies the output region to its output, on the caller's stream, in chunks of the region
//! size: any operand works, at the cost of two local copies (docs/design/allreduce.md). The
//! allreduce (`Mm::run`) and reduce-scatter, all-gather and broadcast (`Mm::run_gather`:
//! the regions hold N slots of a window of each rank's chunk; docs/design/collectives.md,
//! "Multimem forms").
//!
//! Only where NVLink multicast is allowed: never on machines that set `NCCL_NVLS_ENABLE=0` or
//! `CUDA_MULTIMEM_DISABLE_MULTICAST=1` (building the team refuses there, before any driver
//! call). Tested on the simulator only: the GPUs this project can use must never create a
//! multicast object.

use std::collections::HashMap;

use cuda_multimem::team::{Backend, Team};
use cuda_multimem::{Device, Error, Function, LaunchConfig, Module, Result, StreamRef};

use crate::config::CommConfig;
use crate::kernels::gather::Collective;
use crate::kernels::multimem::{self as mmk, MmKernel};
use crate::kernels::{call_header, MAX_BLOCKS};
use crate::types::{Algorithm, Choice, DType, Path, ReduceOp};

/// Whether the multimem path should beat peer-to-peer two-shot for large messages on a team of
/// `n`: by the anchors' bandwidth arithmetic (NCCL's NVLS choice), only for teams larger than 3.
pub fn multimem_pays_off(n: usize) -> bool {
    n > 3
}

/// Whether `multimem.ld_reduce` has this type and operator (f32 reduces only with add).
pub fn multimem_supports(dtype: DType, op: ReduceOp) -> bool {
    mmk::supported(dtype, op)
}

struct Member {
    device: Device,
    kernels: HashMap<(MmKernel, DType, ReduceOp), Function>,
}

/// The multicast team, its kernels, and the region size.
pub(crate) struct Mm {
    team: Team,
    members: Vec<Member>,
    pub(crate) region: usize,
    multiprocessors: u32,
}

/// Where a member's memory lies: its unicast base (the header), the team's multicast base,
/// and its input and output regions after the header.
struct Addrs {
    base: u64,
    mc: u64,
    in_region: u64,
    out_region: u64,
}

impl Mm {
    /// Member `rank`'s addresses.
    fn addrs(&self, rank: usize) -> Result<Addrs> {
        let base = self.team.member_ptr(rank)?;
        let mc = self
            .team
            .multicast_address()
            .ok_or_else(|| Error::invalid("team", "the team has no multicast address"))?;
        let in_region = base + mmk::MM_DATA as u64;
        Ok(Addrs {
            base,
            mc,
            in_region,
            out_region: in_region + self.region as u64,
        })
    }

    /// Build the team over `devices` (all driven by this process) with regions of
    /// `config.multimem_region()` bytes. Refused where multicast is disabled or unsupported.
    pub(crate) fn new(devices: &[Device], config: &CommConfig, multiprocessors: u32) -> Result<Mm> {
        let region = config.multimem_region();
        let team = Team::builder(devices)
            .size(mmk::MM_DATA + 2 * region)
            .backend(Backend::MulticastObject)
            .build()?;
        let n = devices.len();
        let mut members = Vec::new();
        for d in devices {
            let m = Module::load_ptx(d, mmk::PTX)?;
            let mut kernels = HashMap::new();
            for k in MmKernel::ALL {
                for dt in DType::ALL {
                    for op in ReduceOp::ALL {
                        if k.has(dt, op) {
                            kernels.insert((k, dt, op), m.function(&k.entry(dt, op))?);
                        }
                    }
                }
            }
            members.push(Member {
                device: d.clone(),
                kernels,
            });
        }
        let peers: Vec<u64> = (0..n).map(|i| team.member_ptr(i)).collect::<Result<_>>()?;
        for (i, m) in members.iter().enumerate() {
            let mut hdr = vec![0u8; mmk::MM_DATA];
            let mut put = |at: usize, v: &[u8]| hdr[at..at + v.len()].copy_from_slice(v);
            put(mmk::MM_OFF_RANK, &(i as u32).to_le_bytes());
            put(mmk::MM_OFF_NRANKS, &(n as u32).to_le_bytes());
            put(mmk::MM_OFF_CAP, &(region as u64).to_le_bytes());
            for (j, p) in peers.iter().enumerate() {
                put(mmk::MM_OFF_PEERS + 8 * j, &p.to_le_bytes());
            }
            m.device.bind()?;
            // SAFETY: the header region of member i's memory (mapped read-write for it); the
            // copy has landed when this returns.
            unsafe { m.device.copy_from_host_blocking(peers[i], &hdr) }?;
        }
        Ok(Mm {
            team,
            members,
            region,
            multiprocessors,
        })
    }

    /// The launch shape for one chunk of `bytes`.
    pub(crate) fn shape(&self, config: &CommConfig, bytes: usize) -> Choice {
        let c = config;
        let n = self.members.len();
        let one_shot_max = c.one_shot_max_bytes.unwrap_or(256 << 10);
        let algorithm = match c.algorithm {
            // the low-latency protocol is a peer-to-peer protocol; multimem runs one-shot
            Some(Algorithm::OneShotLl | Algorithm::OneShot) => Algorithm::OneShot,
            Some(_) => Algorithm::TwoShot,
            None if bytes <= one_shot_max => Algorithm::OneShot,
            None => Algorithm::TwoShot,
        };
        let max_blocks = if c.max_blocks == 0 {
            (2 * self.multiprocessors).min(MAX_BLOCKS as u32)
        } else {
            c.max_blocks
        } as u64;
        let units = bytes.div_ceil(16) as u64;
        let per_rank = match algorithm {
            Algorithm::OneShot => units,
            _ => units.div_ceil(n as u64),
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
            staged_chunks: 0,
        }
    }

    /// Queue rank `rank`'s share of an allreduce of `bytes` from `input` to `output` (device
    /// addresses of this rank's device, checked by the caller) on `stream`, in chunks of the
    /// region size.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        config: &CommConfig,
        rank: usize,
        dtype: DType,
        op: ReduceOp,
        input: u64,
        output: u64,
        bytes: usize,
        stream: StreamRef<'_>,
    ) -> Result<Choice> {
        let m = self.members.get(rank).ok_or_else(|| {
            Error::invalid(
                "rank",
                format!("{rank}; the multicast team has {}", self.members.len()),
            )
        })?;
        let Addrs {
            base,
            mc,
            in_region,
            out_region,
        } = self.addrs(rank)?;
        // Chunks of whole elements (and of 16 bytes, but for the last).
        let chunk = self.region - self.region % 16;
        let chunks = bytes.div_ceil(chunk).max(1);
        let mut first = None;
        for c in 0..chunks {
            let at = c * chunk;
            let len = chunk.min(bytes - at);
            let choice = self.shape(config, len);
            let k = match choice.algorithm {
                Algorithm::OneShot => MmKernel::OneShot,
                _ => MmKernel::TwoShot,
            };
            let f = m.kernels.get(&(k, dtype, op)).ok_or_else(|| {
                Error::invalid(
                    "op",
                    format!(
                        "{dtype} {op} has no multimem.ld_reduce form (f32 reduces only with add)"
                    ),
                )
            })?;
            let count = (len / dtype.size()) as u64;
            // SAFETY: `len` bytes of the caller's input (checked by the caller) into this
            // member's input region (len <= region); both of this stream's device.
            unsafe { stream.copy_dtod_async(in_region, input + at as u64, len) }?;
            let sig = call_header(&[
                count,
                dtype.code(),
                op.code(),
                k.code(),
                choice.blocks as u64,
            ]);
            // SAFETY: a function of this device's module whose entry takes these five .u64
            // parameters (unicast base, multicast base, count, timeout, header); count fits
            // the regions; a live stream of the device (checked by the caller).
            unsafe {
                f.launch_u64(
                    &LaunchConfig::linear(choice.blocks, choice.threads),
                    stream,
                    &[base, mc, count, config.timeout_ns(), sig],
                )
            }?;
            // SAFETY: the output region's first `len` bytes into the caller's output (checked).
            unsafe { stream.copy_dtod_async(output + at as u64, out_region, len) }?;
            first.get_or_insert(choice);
        }
        let mut choice = first.unwrap_or_else(|| self.shape(config, bytes));
        choice.staged_chunks = chunks as u32;
        Ok(choice)
    }

    /// The launch shape of a reduce-scatter, all-gather or broadcast kernel for one chunk of
    /// `bytes` per rank: every rank moves (or reduces) all of its chunk, so the shape of the
    /// one-shot allreduce over the same bytes.
    pub(crate) fn gather_shape(
        &self,
        config: &CommConfig,
        coll: Collective,
        bytes: usize,
    ) -> Choice {
        let c = config;
        let max_blocks = if c.max_blocks == 0 {
            (2 * self.multiprocessors).min(MAX_BLOCKS as u32)
        } else {
            c.max_blocks
        } as u64;
        let units = bytes.div_ceil(16) as u64;
        let blocks = units.div_ceil(c.threads as u64).clamp(1, max_blocks);
        let threads = units
            .div_ceil(blocks)
            .next_multiple_of(32)
            .clamp(64, c.threads as u64);
        Choice {
            path: Path::Multimem,
            // reduce-scatter: each rank reduces its chunk through the multicast address into its
            // own output (the one-shot allreduce's structure); all-gather and broadcast: every
            // sender stores into every rank's output between two barriers (the direct kernel's)
            algorithm: match coll {
                Collective::ReduceScatter => Algorithm::OneShot,
                _ => Algorithm::PushDirect,
            },
            blocks: blocks as u32,
            threads: threads as u32,
            staged_chunks: 0,
        }
    }

    /// Bytes of one rank's chunk that one launch moves: the regions hold N slots of it
    /// (reduce-scatter's input, all-gather's output; broadcast: one), 16-byte multiples.
    fn gather_window(&self, coll: Collective) -> usize {
        let slots = match coll {
            Collective::Broadcast => 1,
            _ => self.members.len(),
        };
        (self.region / slots) & !15
    }

    /// Queue rank `rank`'s share of a reduce-scatter, all-gather or broadcast on `stream`:
    /// `chunk` bytes per rank (reduce-scatter: the output; all-gather: the input; broadcast:
    /// the message), `input` and `output` device addresses of this rank's device checked by the
    /// caller (lengths in the collective's ratio, the in-place overlap only). In windows of
    /// [`Mm::gather_window`] bytes: copy the input's pieces into the input region's slots, run
    /// the kernel, copy the output region's slots out, all on the caller's stream.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_gather(
        &self,
        config: &CommConfig,
        rank: usize,
        coll: Collective,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        input: u64,
        output: u64,
        chunk: usize,
        stream: StreamRef<'_>,
    ) -> Result<Choice> {
        let n = self.members.len();
        let m = self
            .members
            .get(rank)
            .ok_or_else(|| Error::invalid("rank", format!("{rank}; the multicast team has {n}")))?;
        let k = match coll {
            Collective::ReduceScatter => MmKernel::ReduceScatter,
            Collective::AllGather => MmKernel::AllGather,
            Collective::Broadcast => MmKernel::Broadcast,
        };
        let kop = if k.reduces() { op } else { ReduceOp::Sum };
        let f = m.kernels.get(&(k, dtype, kop)).ok_or_else(|| {
            Error::invalid(
                "op",
                format!("{dtype} {op} has no multimem.ld_reduce form (f32 reduces only with add)"),
            )
        })?;
        let Addrs {
            base,
            mc,
            in_region,
            out_region,
        } = self.addrs(rank)?;
        let window = self.gather_window(coll);
        if window < dtype.size() {
            return Err(Error::invalid(
                "config.multimem_capacity",
                format!(
                    "{} bytes per region cannot hold {n} slots of one {dtype} element each",
                    self.region
                ),
            ));
        }
        let (chunk64, rank64) = (chunk as u64, rank as u64);
        // in place, the output piece this rank would copy out already holds its data
        let in_place = match coll {
            Collective::AllGather => input == output + rank64 * chunk64,
            Collective::Broadcast => input == output && rank == root,
            Collective::ReduceScatter => false,
        };
        let copy = |dst: u64, src: u64, len: usize| {
            // SAFETY: callers pass `len` bytes inside the caller's operands (checked by the
            // caller: lengths in the collective's ratio) and inside this member's regions
            // (a window's slots: n × slot_bytes(len) <= region), all of this stream's device.
            unsafe { stream.copy_dtod_async(dst, src, len) }
        };
        let windows = chunk.div_ceil(window).max(1);
        let mut first = None;
        for w in 0..windows {
            let at = w * window;
            let len = window.min(chunk - at);
            let (at64, len64) = (at as u64, len as u64);
            let slot = mmk::slot_bytes(len64);
            // copy in: reduce-scatter every chunk's window into its slot; all-gather my
            // window; broadcast the root's window
            match coll {
                Collective::ReduceScatter => {
                    for j in 0..n as u64 {
                        copy(in_region + j * slot, input + j * chunk64 + at64, len)?;
                    }
                }
                Collective::AllGather => copy(in_region, input + at64, len)?,
                Collective::Broadcast if rank == root => copy(in_region, input + at64, len)?,
                Collective::Broadcast => {}
            }
            let choice = self.gather_shape(config, coll, len);
            let count = (len / dtype.size()) as u64;
            let sig = call_header(&[
                count,
                dtype.code(),
                if k.reduces() { op.code() } else { 0xff },
                k.code(),
                root as u64,
                choice.blocks as u64,
            ]);
            // SAFETY: a function of this device's module whose entry takes these six .u64
            // parameters (unicast base, multicast base, count, timeout, header, root); the
            // window's slots fit the regions (checked above); a live stream of the device
            // (checked by the caller).
            unsafe {
                f.launch_u64(
                    &LaunchConfig::linear(choice.blocks, choice.threads),
                    stream,
                    &[base, mc, count, config.timeout_ns(), sig, root as u64],
                )
            }?;
            // copy out: reduce-scatter my result; all-gather every slot into its chunk's
            // window; broadcast the message's window
            match coll {
                Collective::AllGather => {
                    for j in 0..n as u64 {
                        if !(in_place && j == rank64) {
                            copy(output + j * chunk64 + at64, out_region + j * slot, len)?;
                        }
                    }
                }
                _ if in_place => {}
                _ => copy(output + at64, out_region, len)?,
            }
            first.get_or_insert(choice);
        }
        let mut choice = first.unwrap_or_else(|| self.gather_shape(config, coll, chunk));
        choice.staged_chunks = windows as u32;
        Ok(choice)
    }

    /// The error word of member `rank`.
    pub(crate) fn error_word(&self, rank: usize) -> Result<u32> {
        let m = &self.members[rank];
        let mut w = [0u8; 4];
        m.device.bind()?;
        // SAFETY: four bytes of member `rank`'s header, mapped for its device.
        unsafe {
            m.device
                .copy_to_host(self.team.member_ptr(rank)? + mmk::MM_OFF_ERR as u64, &mut w)
        }?;
        Ok(u32::from_le_bytes(w))
    }
}
