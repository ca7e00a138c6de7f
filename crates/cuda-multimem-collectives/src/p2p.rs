//! The peer-to-peer executor: signal pads, staging, landing areas and scratch in symmetric
//! memory, the choice of a kernel for a call's size and operands, and the launch.

use std::collections::HashMap;

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{Device, Error, LaunchConfig, Module, Result, StreamRef};

use crate::config::CommConfig;
use crate::kernels::{self, Kernel, MAX_BLOCKS, PAD_BYTES};
use crate::memory::{Sym, SymBuf};
use crate::operand::{Operand, Place};
use crate::ranks::{Local, Ranks};
use crate::types::{Algorithm, Choice, DType, Path, ReduceOp};

/// Load every peer-to-peer kernel on `device`.
pub(crate) fn load_kernels(
    device: &Device,
) -> Result<HashMap<(Kernel, DType, ReduceOp), cuda_multimem::Function>> {
    let mut functions = HashMap::new();
    for k in Kernel::ALL {
        let text = k
            .load_text()
            .map_err(|e| Error::os("read PTX from CUDA_MULTIMEM_PTX_DIR", e))?;
        let m = Module::load_ptx(device, &text)?;
        for dt in DType::ALL {
            for op in ReduceOp::ALL {
                functions.insert((k, dt, op), m.function(&k.entry(dt, op))?);
            }
        }
    }
    Ok(functions)
}

/// What one launch reads and writes, resolved for a rank.
struct Resolved {
    ptr: CUdeviceptr,
    /// The device table of the operand's symmetric buffer (0 for the caller's memory).
    table: CUdeviceptr,
    /// (buffer id, byte offset) for the call header: 0 for the caller's memory.
    id: u64,
    offset: u64,
}

/// A local copy of `bytes` bytes from `src` to `dst` (this rank's device memory) that the
/// write-only two-shot does beside its own work (its "prologue copy": see
/// docs/design/allreduce.md): the staged path folds the copy out of the previous chunk's scratch
/// region into the next chunk's kernel.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrologueCopy {
    pub(crate) src: CUdeviceptr,
    pub(crate) dst: CUdeviceptr,
    pub(crate) bytes: usize,
}

impl PrologueCopy {
    /// Whether the kernel can do it: 16-byte vectors only (both addresses 16-byte aligned, a
    /// whole number of vectors).
    pub(crate) fn fits(&self) -> bool {
        (self.src | self.dst | self.bytes as u64) % 16 == 0
    }
}

/// The executor's symmetric areas and launch shapes.
pub(crate) struct P2p {
    pub(crate) pads: Sym,
    _stages: Sym,
    _ll: Sym,
    lands: Sym,
    land_slot: usize,
    pub(crate) stage_half: usize,
    pub(crate) multiprocessors: u32,
    /// Scratch for the caller's own memory above the one-shot limit: three regions.
    pub(crate) scratch: Option<SymBuf>,
}

impl P2p {
    pub(crate) fn new(
        comm_id: u64,
        ranks: &Ranks,
        config: &CommConfig,
        multiprocessors: u32,
    ) -> Result<P2p> {
        let n = ranks.n;
        let stage_half = config.stage_slot_bytes(n);
        let pads = Sym::new(ranks, PAD_BYTES, true)?;
        let stages = Sym::new(ranks, 2 * n * stage_half, false)?;
        let ll_slot = config.ll_slot_bytes();
        let ll = Sym::new(ranks, 2 * n * ll_slot, true)?;
        let land_slot = config
            .ce_max_bytes
            .div_ceil(n)
            .max(4096)
            .next_multiple_of(4096);
        let lands = Sym::new(ranks, n * land_slot, false)?;
        let scratch = match config.scratch_total() {
            0 => None,
            b => Some(SymBuf::new(
                comm_id,
                u64::MAX,
                ranks,
                Sym::new(ranks, b, false)?,
            )?),
        };
        // Each local rank's pad: its rank, the team size, the staging half, every rank's pad
        // and staging area as mapped in this process.
        for l in &ranks.locals {
            let mut hdr = vec![0u8; 256];
            let mut put = |at: usize, v: &[u8]| hdr[at..at + v.len()].copy_from_slice(v);
            put(kernels::OFF_RANK, &(l.rank as u32).to_le_bytes());
            put(kernels::OFF_NRANKS, &(n as u32).to_le_bytes());
            put(kernels::OFF_STAGE_HALF, &(stage_half as u64).to_le_bytes());
            put(kernels::OFF_LL_SLOT, &(ll_slot as u64).to_le_bytes());
            put(kernels::OFF_LAND_SLOT, &(land_slot as u64).to_le_bytes());
            put(kernels::OFF_LAND, &lands.addrs[l.rank].to_le_bytes());
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
            _ll: ll,
            lands,
            land_slot,
            stage_half,
            multiprocessors,
            scratch,
        })
    }

    /// Bytes of one of the scratch's three regions, a multiple of 16 (0: no scratch).
    pub(crate) fn scratch_region(&self) -> usize {
        self.scratch.as_ref().map_or(0, |s| (s.sym.bytes / 3) & !15)
    }

    /// The launch shape of `algorithm` for `bytes`.
    pub(crate) fn shape(
        &self,
        n: usize,
        config: &CommConfig,
        bytes: usize,
        algorithm: Algorithm,
    ) -> Choice {
        let c = config;
        let push = matches!(algorithm, Algorithm::TwoShotPush | Algorithm::TwoShotCe);
        let max_blocks = if c.max_blocks != 0 {
            c.max_blocks
        } else if push {
            // one block per multiprocessor, a power of two of them: block ranges of
            // power-of-two messages stay whole lines and the rounds even
            1 << (self.multiprocessors.clamp(1, MAX_BLOCKS as u32).ilog2())
        } else {
            (2 * self.multiprocessors).min(MAX_BLOCKS as u32)
        } as u64;
        let max_threads = if push { c.push_threads } else { c.threads } as u64;
        let units = bytes.div_ceil(16) as u64;
        let per_rank = match algorithm {
            Algorithm::OneShot => units,
            Algorithm::OneShotLl => bytes.div_ceil(4) as u64,
            Algorithm::TwoShot | Algorithm::TwoShotPush | Algorithm::TwoShotCe => {
                units.div_ceil(n as u64)
            }
            // not allreduce algorithms (refused by CommConfig::validate; shapes: src/gather.rs)
            Algorithm::PushStaged
            | Algorithm::PushDirect
            | Algorithm::PushLl
            | Algorithm::CopyEngine => units,
        };
        let mut blocks = per_rank.div_ceil(max_threads).clamp(1, max_blocks);
        if algorithm == Algorithm::TwoShotPush {
            // every block owns at least 8 vectors (128 bytes) of each staging slot
            blocks = blocks.min(self.stage_half as u64 / 128).max(1);
        }
        // Small messages: fewer threads (cheaper block barriers), at least 64.
        let threads = per_rank
            .div_ceil(blocks)
            .next_multiple_of(32)
            .clamp(64, max_threads);
        Choice {
            path: Path::PeerToPeer,
            algorithm,
            blocks: blocks as u32,
            threads: threads as u32,
            staged_chunks: 0,
        }
    }

    /// The algorithm the size alone picks (or the forced one).
    pub(crate) fn preferred(&self, n: usize, config: &CommConfig, bytes: usize) -> Algorithm {
        let c = config;
        c.algorithm.unwrap_or(if bytes <= c.ll_max_bytes {
            Algorithm::OneShotLl
        } else if bytes <= c.one_shot_max(n) {
            Algorithm::OneShot
        } else if bytes <= c.ce_max_bytes && bytes >= c.ce_min_bytes {
            Algorithm::TwoShotCe
        } else {
            Algorithm::TwoShotPush
        })
    }

    /// The algorithm to run on operands `input`/`output` of `bytes` (which this executor can
    /// serve directly): the preferred one, or its fallback where alignment or operand kinds do
    /// not allow it. `None`: nothing runs these operands directly (they must be staged).
    pub(crate) fn direct(
        &self,
        n: usize,
        config: &CommConfig,
        input: &Operand<'_>,
        output: &Operand<'_>,
        bytes: usize,
    ) -> Result<Option<Algorithm>> {
        let ptr = |o: &Operand<'_>| match o.place {
            Place::Sym { buf, offset, .. } => {
                buf.sym.addrs.first().copied().unwrap_or(0) + offset as u64
            }
            Place::Local { ptr, .. } => ptr,
        };
        let addrs = ptr(input) | ptr(output);
        self.direct_for(n, config, addrs, input.is_sym(), output.is_sym(), bytes)
    }

    /// [`P2p::direct`] by what it reads of the operands: their addresses or-ed together (the
    /// alignments are powers of two), and whether each is symmetric. `Communicator::choice`
    /// asks it too, so that it reports what the call runs or refuses.
    pub(crate) fn direct_for(
        &self,
        n: usize,
        config: &CommConfig,
        addrs: u64,
        sym_in: bool,
        sym_out: bool,
        bytes: usize,
    ) -> Result<Option<Algorithm>> {
        let aligned = |a: u64| addrs % a == 0;
        let mut alg = self.preferred(n, config, bytes);
        if alg == Algorithm::OneShotLl
            && (!aligned(4) || bytes % 4 != 0 || bytes > config.ll_max_bytes)
        {
            // The low-latency protocol moves whole aligned 4-byte words.
            alg = if bytes <= self.stage_half {
                Algorithm::OneShot
            } else {
                Algorithm::TwoShot
            };
        }
        if matches!(alg, Algorithm::TwoShotPush | Algorithm::TwoShotCe) && !aligned(16) {
            // The write-only two-shots move 16-byte vectors only.
            alg = Algorithm::TwoShot;
        }
        if alg == Algorithm::OneShot && bytes > self.stage_half {
            if config.algorithm == Some(Algorithm::OneShot) && sym_in && sym_out {
                return Err(Error::invalid(
                    "count",
                    format!(
                        "{bytes} bytes with one-shot forced; its staging holds {} bytes (raise one_shot_max_bytes)",
                        self.stage_half
                    ),
                ));
            }
            return Ok(None);
        }
        if alg == Algorithm::TwoShotCe {
            let part = kernels::ce_part_units((bytes / 16) as u64, n as u64) as usize;
            if part * 16 > self.land_slot {
                return Err(Error::invalid(
                    "count",
                    format!(
                        "{bytes} bytes with the copy-engine two-shot; its landing slots hold {} bytes of a {}-byte part (raise ce_max_bytes)",
                        self.land_slot,
                        part * 16
                    ),
                ));
            }
        }
        // What each kernel touches: one-shot and low-latency only the local input and output;
        // the write-only two-shots the local input (all of it, when there is no scalar tail)
        // and every rank's output; the reading two-shot every rank's input and output.
        let ok = match alg {
            Algorithm::OneShot | Algorithm::OneShotLl => true,
            Algorithm::TwoShotPush | Algorithm::TwoShotCe => sym_out && (sym_in || bytes % 16 == 0),
            Algorithm::TwoShot => sym_in && sym_out,
            Algorithm::PushStaged
            | Algorithm::PushDirect
            | Algorithm::PushLl
            | Algorithm::CopyEngine => false,
        };
        Ok(ok.then_some(alg))
    }

    fn resolve(&self, rank: usize, o: &Operand<'_>) -> Result<Resolved> {
        Ok(match o.place {
            Place::Sym { buf, offset, .. } => Resolved {
                ptr: buf.sym.addrs[rank] + offset as u64,
                table: buf.table(rank)?,
                id: buf.id,
                offset: offset as u64,
            },
            Place::Local { ptr, .. } => Resolved {
                ptr,
                table: 0,
                id: 0,
                offset: 0,
            },
        })
    }

    /// Queue one kernel of `alg` on `stream` for rank `l`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch(
        &self,
        n: usize,
        config: &CommConfig,
        l: &Local,
        alg: Algorithm,
        dtype: DType,
        op: ReduceOp,
        input: &Operand<'_>,
        output: &Operand<'_>,
        stream: StreamRef<'_>,
    ) -> Result<Choice> {
        self.launch_with_copy(n, config, l, alg, dtype, op, input, output, None, stream)
    }

    /// [`P2p::launch`], with a prologue copy for the write-only two-shot to do (`None`: none;
    /// only [`Algorithm::TwoShotPush`] takes one, and only one that [`PrologueCopy::fits`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_with_copy(
        &self,
        n: usize,
        config: &CommConfig,
        l: &Local,
        alg: Algorithm,
        dtype: DType,
        op: ReduceOp,
        input: &Operand<'_>,
        output: &Operand<'_>,
        copy: Option<PrologueCopy>,
        stream: StreamRef<'_>,
    ) -> Result<Choice> {
        if let Some(cp) = copy {
            if alg != Algorithm::TwoShotPush || !cp.fits() {
                return Err(Error::invalid(
                    "copy",
                    format!(
                        "a prologue copy of {} bytes from {:#x} to {:#x} with {alg}; only the write-only two-shot takes one, 16-byte aligned",
                        cp.bytes, cp.src, cp.dst
                    ),
                ));
            }
        }
        let bytes = input.bytes;
        let choice = self.shape(n, config, bytes, alg);
        let count = (bytes / dtype.size()) as u64;
        let i = self.resolve(l.rank, input)?;
        let o = self.resolve(l.rank, output)?;
        // The caller's memory has no table: the kernels that take it read the table only for
        // symmetric operands (one-shot, low-latency: never; the write-only two-shots: the
        // input's only for a scalar tail, which staging rules out), so any readable table of
        // N addresses serves: the other operand's, the scratch's, else this rank's pad.
        let pad = self.pads.addrs[l.rank];
        let pick = |t: u64, other: u64| {
            if t != 0 {
                t
            } else if other != 0 {
                other
            } else {
                pad
            }
        };
        let (in_tab, out_tab) = (pick(i.table, o.table), pick(o.table, i.table));
        let kernel = match alg {
            Algorithm::OneShot => Kernel::P2pOneShot,
            Algorithm::OneShotLl => Kernel::P2pOneShotLl,
            Algorithm::TwoShot => Kernel::P2pTwoShot,
            Algorithm::TwoShotPush => Kernel::P2pTwoShotPush,
            Algorithm::TwoShotCe => Kernel::P2pTwoShotCe,
            Algorithm::PushStaged
            | Algorithm::PushDirect
            | Algorithm::PushLl
            | Algorithm::CopyEngine => {
                return Err(Error::invalid(
                    "config.algorithm",
                    format!("{alg} is not an allreduce algorithm"),
                ))
            }
        };
        let f = l.kernels.get(&(kernel, dtype, op)).ok_or_else(|| {
            Error::invalid("op", format!("no {kernel:?} kernel for {dtype} {op}"))
        })?;
        if kernel == Kernel::P2pTwoShotCe {
            // The first half of the two-shot, by the copy engines, on the caller's stream:
            // part k of my input into rank k's landing slot for me. The kernel queued next
            // starts only once they are complete, so its release covers them.
            let units = bytes / 16;
            let part = kernels::ce_part_units(units as u64, n as u64) as usize;
            for k in (0..n).filter(|&k| k != l.rank) {
                let s = (k * part).min(units);
                let e = (s + part).min(units);
                if e > s {
                    let dst = self.lands.addrs[k] + (l.rank * self.land_slot) as u64;
                    // SAFETY: the source lies in the input operand (checked by the caller), the
                    // destination in rank k's landing area as mapped for this device (its part
                    // fits the slot: checked by `direct`); the stream is of this device.
                    unsafe { stream.copy_dtod_async(dst, i.ptr + (s * 16) as u64, (e - s) * 16) }?;
                }
            }
        }
        // The call header every rank compares: what, how much, where.
        let sig = kernels::call_header(&[
            count,
            dtype.code(),
            op.code(),
            kernel as u64,
            i.id,
            i.offset,
            o.id,
            o.offset,
            choice.blocks as u64,
        ]);
        let mut args = vec![
            self.pads.addrs[l.rank],
            i.ptr,
            o.ptr,
            count,
            in_tab,
            out_tab,
            sig,
            config.timeout_ns(),
        ];
        if kernel == Kernel::P2pTwoShotPush {
            // the prologue copy: source, destination, bytes (0: none)
            let cp = copy.map_or([0; 3], |c| [c.src, c.dst, c.bytes as u64]);
            args.extend(cp);
        }
        // SAFETY: a function of this device's module whose entry takes these .u64 parameters
        // (pad, in, out, count, in_tab, out_tab, header, timeout, and for the write-only
        // two-shot copy_src, copy_dst, copy_bytes); the operands were checked to lie inside
        // their buffers for `bytes`, the tables hold N addresses, a prologue copy's ranges are
        // this device's memory (promised by the caller, `staged`); the stream is a live stream
        // of this device (checked by the caller).
        unsafe {
            f.launch_u64(
                &LaunchConfig::linear(choice.blocks, choice.threads),
                stream,
                &args,
            )
        }?;
        Ok(choice)
    }

    /// The error word of local rank `rank`.
    pub(crate) fn error_word(&self, rank: usize) -> Result<u32> {
        let mut w = [0u32];
        self.pads.read(rank, kernels::OFF_ERR, &mut w)?;
        Ok(w[0])
    }
}
