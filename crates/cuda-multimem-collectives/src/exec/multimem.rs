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
use cuda_multimem::{Device, Error, Function, LaunchConfig, Result, StreamRef};

use crate::call::Checked;
use crate::config::CommConfig;
use crate::engine::{MmPlan, TeamFacts};
use crate::kernels::gather::Collective;
use crate::kernels::multimem::{self as mmk, MmKernel};
use crate::kernels::{call_header, check_device, load_module};
use crate::types::{DType, ReduceOp};

struct Member {
    device: Device,
    kernels: HashMap<(MmKernel, DType, ReduceOp), Function>,
}

/// The multicast team, its kernels, and the region size.
pub(crate) struct Mm {
    team: Team,
    members: Vec<Member>,
    region: usize,
    /// Every member's error mirror (device addresses, by member; `MM_OFF_MIRROR`).
    mirrors: Vec<u64>,
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
    /// `config.multimem_region()` bytes, member i's error mirror at device address `mirrors[i]`.
    /// Refused where multicast is disabled or unsupported.
    pub(crate) fn new(devices: &[Device], mirrors: Vec<u64>, config: &CommConfig) -> Result<Mm> {
        let region = config.multimem_region();
        for d in devices {
            check_device(d, &[(mmk::FILE, mmk::PTX)])?;
        }
        let team = Team::builder(devices)
            .size(mmk::MM_DATA + 2 * region)
            .backend(Backend::MulticastObject)
            .build()?;

        let mut members = Vec::new();
        for d in devices {
            let m = load_module(d, mmk::FILE, mmk::PTX)?;
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
        let mm = Mm {
            team,
            members,
            region,
            mirrors,
        };
        mm.write_headers()?;
        Ok(mm)
    }

    /// Every member's header as a fresh team has it: zeros (error word, counters, signal
    /// slots, call headers), then its rank, the team size, the region size and every member's
    /// address. Written by the build and by [`Mm::reset`].
    fn write_headers(&self) -> Result<()> {
        let (team, members, region, n) =
            (&self.team, &self.members, self.region, self.members.len());
        let peers: Vec<u64> = (0..n).map(|i| team.member_ptr(i)).collect::<Result<_>>()?;
        for (i, m) in members.iter().enumerate() {
            let mut hdr = vec![0u8; mmk::MM_DATA];
            let mut put = |at: usize, v: &[u8]| hdr[at..at + v.len()].copy_from_slice(v);
            put(mmk::MM_OFF_RANK, &(i as u32).to_le_bytes());
            put(mmk::MM_OFF_NRANKS, &(n as u32).to_le_bytes());
            put(mmk::MM_OFF_CAP, &(region as u64).to_le_bytes());
            put(
                mmk::MM_OFF_MIRROR,
                &self.mirrors.get(i).copied().unwrap_or(0).to_le_bytes(),
            );
            for (j, p) in peers.iter().enumerate() {
                put(mmk::MM_OFF_PEERS + 8 * j, &p.to_le_bytes());
            }
            m.device.bind()?;
            // SAFETY: the header region of member i's memory (mapped read-write for it); the
            // copy has landed when this returns.
            unsafe { m.device.copy_from_host_blocking(peers[i], &hdr) }?;
        }
        Ok(())
    }

    /// Back to a fresh team's protocol state (`Communicator::recover`: every member's device
    /// has finished its work).
    pub(crate) fn reset(&self) -> Result<()> {
        self.write_headers()
    }

    fn member(&self, rank: usize) -> Result<&Member> {
        self.members.get(rank).ok_or_else(|| {
            Error::invalid(
                "rank",
                format!("{rank}; the multicast team has {}", self.members.len()),
            )
        })
    }

    fn function(&self, rank: usize, k: MmKernel, dtype: DType, op: ReduceOp) -> Result<&Function> {
        let kop = if k.reduces() { op } else { ReduceOp::Sum };
        self.member(rank)?
            .kernels
            .get(&(k, dtype, kop))
            .ok_or_else(|| {
                Error::invalid(
                    "op",
                    format!(
                        "{dtype} {op} has no multimem.ld_reduce form (f32 reduces only with add)"
                    ),
                )
            })
    }

    /// Queue rank `rank`'s share of an allreduce of `call` on `stream`, one planned step per
    /// chunk of the region size: copy the chunk into the member's input region, run the
    /// kernel, copy the output region to the output.
    pub(crate) fn run(
        &self,
        config: &CommConfig,
        rank: usize,
        t: &TeamFacts,
        call: &Checked<'_>,
        plan: &MmPlan,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let Addrs {
            base,
            mc,
            in_region,
            out_region,
        } = self.addrs(rank)?;
        let (dtype, op) = (call.dtype, call.op);
        for k in 0..plan.pieces.count {
            let s = plan.step(t, config, k);
            let f = self.function(rank, s.kernel, dtype, op)?;
            let (at, len) = (s.at as u64, s.len);
            let count = (len / dtype.size()) as u64;
            // SAFETY: `len` bytes of the caller's input (checked) into this member's input
            // region (len <= region: planned); both of this stream's device.
            unsafe { stream.copy_dtod_async(in_region, call.input.ptr + at, len) }?;
            let sig = call_header(&[
                count,
                dtype.code(),
                op.code(),
                s.kernel.code(),
                s.shape.blocks as u64,
            ]);
            // SAFETY: a function of this device's module whose entry takes these five .u64
            // parameters (unicast base, multicast base, count, timeout, header); count fits
            // the regions; a live stream of the device (checked).
            unsafe {
                f.launch_u64(
                    &LaunchConfig::linear(s.shape.blocks, s.shape.threads),
                    stream,
                    &[base, mc, count, config.timeout_ns(), sig],
                )
            }?;
            // SAFETY: the output region's first `len` bytes into the caller's output (checked).
            unsafe { stream.copy_dtod_async(call.output.ptr + at, out_region, len) }?;
        }
        Ok(())
    }

    /// Queue rank `rank`'s share of a reduce-scatter, all-gather or broadcast of `call` on
    /// `stream`, one planned step per window of each rank's chunk: copy the input's pieces into
    /// the input region's slots, run the kernel, copy the output region's slots out.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_gather(
        &self,
        config: &CommConfig,
        rank: usize,
        call: &Checked<'_>,
        t: &TeamFacts,
        coll: Collective,
        plan: &MmPlan,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let n = self.members.len();
        let (dtype, op, root) = (call.dtype, call.op, call.root);
        let (input, output) = (call.input.ptr, call.output.ptr);
        let chunk = match coll {
            Collective::ReduceScatter => call.output.bytes,
            _ => call.input.bytes,
        };
        let Addrs {
            base,
            mc,
            in_region,
            out_region,
        } = self.addrs(rank)?;
        let (chunk64, rank64) = (chunk as u64, rank as u64);
        // in place, the output piece this rank would copy out already holds its data
        let in_place = match coll {
            Collective::AllGather => input == output + rank64 * chunk64,
            Collective::Broadcast => input == output && rank == root,
            Collective::ReduceScatter => false,
        };
        let copy = |dst: u64, src: u64, len: usize| {
            // SAFETY: callers pass `len` bytes inside the caller's operands (checked: lengths
            // in the collective's ratio) and inside this member's regions (a window's slots:
            // n × slot_bytes(len) <= region, planned), all of this stream's device.
            unsafe { stream.copy_dtod_async(dst, src, len) }
        };
        for k in 0..plan.pieces.count {
            let s = plan.step(t, config, k);
            let f = self.function(rank, s.kernel, dtype, op)?;
            let (at64, len) = (s.at as u64, s.len);
            let slot = mmk::slot_bytes(len as u64);
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
            let count = (len / dtype.size()) as u64;
            let sig = call_header(&[
                count,
                dtype.code(),
                if s.kernel.reduces() { op.code() } else { 0xff },
                s.kernel.code(),
                root as u64,
                s.shape.blocks as u64,
            ]);
            // SAFETY: a function of this device's module whose entry takes these six .u64
            // parameters (unicast base, multicast base, count, timeout, header, root); the
            // window's slots fit the regions (planned); a live stream of the device (checked).
            unsafe {
                f.launch_u64(
                    &LaunchConfig::linear(s.shape.blocks, s.shape.threads),
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
        }
        Ok(())
    }

    /// The region's bytes (for the planner).
    pub(crate) fn region(&self) -> usize {
        self.region
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
