//! The peer-to-peer allreduce: one kernel per planned step, on the operands themselves or
//! through the scratch (docs/design/allreduce.md), all on the caller's stream.
//!
//! What this rank decides alone never changes what the team runs: where its own (not
//! symmetric) operand is not aligned as the planned form needs (the low-latency one-shot moves
//! aligned 4-byte words; the one-shot splits its work in 16-byte vectors when its operands
//! allow, else in elements; the write-only two-shots read 16-byte vectors), it copies that
//! operand through its scratch and runs the same kernel with the same header as its peers.

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{Error, LaunchConfig, Result, StreamRef};

use super::P2p;
use crate::call::{Checked, Facts};
use crate::config::CommConfig;
use crate::engine::{ar_header, ArPlan, ArStep, Out, TeamFacts};
use crate::kernels::{self, Kernel};
use crate::operand::Resolved;
use crate::team::Local;
use crate::types::Algorithm;

/// A local copy of `bytes` bytes from `src` to `dst` (this rank's device memory) that the
/// write-only two-shot does beside its own work (its "prologue copy": see
/// docs/design/allreduce.md): a staged call folds the copy out of the previous chunk's scratch
/// region into the next chunk's kernel.
#[derive(Debug, Clone, Copy)]
struct PrologueCopy {
    src: CUdeviceptr,
    dst: CUdeviceptr,
    bytes: usize,
}

impl PrologueCopy {
    /// Whether the kernel can do it: 16-byte vectors only (both addresses 16-byte aligned, a
    /// whole number of vectors).
    fn fits(&self) -> bool {
        (self.src | self.dst | self.bytes as u64) % 16 == 0
    }
}

/// The kernel family of an allreduce form.
fn kernel_of(alg: Algorithm) -> Result<Kernel> {
    Ok(match alg {
        Algorithm::OneShot => Kernel::P2pOneShot,
        Algorithm::OneShotLl => Kernel::P2pOneShotLl,
        Algorithm::TwoShot => Kernel::P2pTwoShot,
        Algorithm::TwoShotPush => Kernel::P2pTwoShotPush,
        Algorithm::TwoShotCe => Kernel::P2pTwoShotCe,
        _ => {
            return Err(Error::invalid(
                "config.algorithm",
                format!("{alg} is not an allreduce algorithm"),
            ))
        }
    })
}

/// The alignment form `alg` needs of this rank's own input and output, where the shared
/// alignment of the symmetric operands (`sym_addrs`) does not already send every rank to the
/// same unaligned path.
fn own_alignment(alg: Algorithm, sym_addrs: u64) -> (u64, u64) {
    match alg {
        Algorithm::OneShotLl => (4, 4),
        // the one-shot runs 16-byte vectors when its operands are all 16-byte aligned: where a
        // symmetric operand is not, every rank runs elements whatever its own operands are
        Algorithm::OneShot if sym_addrs % 16 == 0 => (16, 16),
        Algorithm::TwoShotPush | Algorithm::TwoShotCe => (16, 1),
        _ => (1, 1),
    }
}

/// Queue the steps of a peer-to-peer allreduce of `call` on `stream`. Returns whether this
/// rank staged an operand of its own through its scratch for alignment.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    p: &P2p,
    c: &CommConfig,
    l: &Local,
    call: &Checked<'_>,
    f: &Facts,
    t: &TeamFacts,
    plan: &ArPlan,
    stream: StreamRef<'_>,
) -> Result<bool> {
    let region = p.scratch_region();
    let scratch = |why: &str, arg: &'static str| p.scratch(l, arg, why);
    // A plain copy on the caller's stream.
    let copy = |cp: PrologueCopy| {
        // SAFETY: a chunk's result in an output region of this rank's scratch (complete: the
        // chunk's kernel, before this on the stream, passed its final barrier, after every
        // peer finished pushing into it) into the chunk of the output (checked), both of this
        // rank's device; peers write that region again only in the chunk after next, whose
        // first barrier needs this rank's next kernel, queued after this copy.
        unsafe { stream.copy_dtod_async(cp.dst, cp.src, cp.bytes) }
    };
    // The copy out of the previous step's output region, not done yet.
    let mut pending: Option<PrologueCopy> = None;
    let mut staged_locally = false;
    for k in 0..plan.pieces.count {
        let step = &plan.step(t, c, k)?;
        let (at, len) = (step.at, step.len);
        let i = call.input.sub(at, len);
        let o = call.output.sub(at, len);
        let (need_in, need_out) = own_alignment(step.algorithm, f.sym_addrs);
        let slot = |s: usize| -> Result<Resolved<'_>> {
            let (base, buf) = scratch("a staged chunk", call.names[1])?;
            let off = (1 + s) * region;
            Ok(Resolved {
                ptr: base + off as u64,
                bytes: len,
                sym: Some((buf, off)),
            })
        };
        // where the kernel writes: the output, or an output region (planned, or because this
        // rank's own output is not aligned as the form needs)
        let (o_run, out_copy) = match step.out {
            Out::Slot(s) => (slot(s)?, true),
            Out::Output if !o.is_sym() && o.ptr % need_out != 0 => {
                staged_locally = true;
                (slot(k % 2)?, true)
            }
            Out::Output => (o, false),
        };
        // where the kernel reads: the input, or the input region
        let stage_in = step.stage_in || (!i.is_sym() && i.ptr % need_in != 0);
        let i_run = if stage_in {
            staged_locally |= !step.stage_in;
            let (base, buf) = scratch("an input that is not aligned", call.names[0])?;
            // SAFETY: `len` bytes of the input (checked) into the input region (len <=
            // region: the planner cuts the caller's own memory into steps of at most a region),
            // both of this rank's device; the previous step's kernel, the last reader of the
            // region, is before it on this stream.
            unsafe { stream.copy_dtod_async(base, i.ptr, len) }?;
            Resolved {
                ptr: base,
                bytes: len,
                sym: Some((buf, 0)),
            }
        } else {
            i
        };
        // The previous step's copy out goes with this kernel where it can take it: it reads a
        // region this kernel does not touch (it writes the other one), complete since the
        // previous kernel ended.
        let carried = match pending.take() {
            Some(cp) if step.algorithm == Algorithm::TwoShotPush && cp.fits() => Some(cp),
            Some(cp) => {
                copy(cp)?;
                None
            }
            None => None,
        };
        launch(p, c, t.n, l, call, f, step, &i_run, &o_run, carried, stream)?;
        if out_copy {
            pending = Some(PrologueCopy {
                src: o_run.ptr,
                dst: o.ptr,
                bytes: len,
            });
        }
    }
    if let Some(cp) = pending {
        copy(cp)?;
    }
    Ok(staged_locally)
}

/// Queue one kernel of `step` on `stream`, on `input` and `output` as resolved for this rank,
/// with a prologue copy for the write-only two-shot to do (only [`Algorithm::TwoShotPush`]
/// takes one, and only one that [`PrologueCopy::fits`]).
#[allow(clippy::too_many_arguments)]
fn launch(
    p: &P2p,
    c: &CommConfig,
    n: usize,
    l: &Local,
    call: &Checked<'_>,
    f: &Facts,
    step: &ArStep,
    input: &Resolved<'_>,
    output: &Resolved<'_>,
    copy: Option<PrologueCopy>,
    stream: StreamRef<'_>,
) -> Result<()> {
    let kernel = kernel_of(step.algorithm)?;
    let (dtype, op) = (call.dtype, call.op);
    let bytes = step.len;
    let count = (bytes / dtype.size()) as u64;
    let table = |r: &Resolved<'_>| -> Result<u64> {
        match r.sym {
            Some((buf, _)) => buf.table(l.rank),
            None => Ok(0),
        }
    };
    let id = |r: &Resolved<'_>| r.sym.map_or((0, 0), |(b, off)| (b.id, off as u64));
    // The caller's memory has no table: the kernels that take it read the table only for
    // symmetric operands (one-shot, low-latency: never; the write-only two-shots: the input's
    // only for a scalar tail, which staging rules out), so any readable table of N addresses
    // serves: the other operand's, else this rank's pad.
    let pad = p.pad(l);
    let (ti, to) = (table(input)?, table(output)?);
    let pick = |t: u64, other: u64| {
        if t != 0 {
            t
        } else if other != 0 {
            other
        } else {
            pad
        }
    };
    let (in_tab, out_tab) = (pick(ti, to), pick(to, ti));
    let f_ = p
        .kernels(l)
        .allreduce
        .get(&(kernel, dtype, op))
        .ok_or_else(|| Error::invalid("op", format!("no {kernel:?} kernel for {dtype} {op}")))?;
    if kernel == Kernel::P2pTwoShotCe {
        // The first half of the two-shot, by the copy engines, on the caller's stream: part k
        // of my input into rank k's landing slot for me. The kernel queued next starts only
        // once they are complete, so its release covers them.
        let units = bytes / 16;
        let part = kernels::ce_part_units(units as u64, n as u64) as usize;
        for k in (0..n).filter(|&k| k != l.rank) {
            let s = (k * part).min(units);
            let e = (s + part).min(units);
            if e > s {
                let dst = p.lands.addrs[k] + (l.rank * p.land_slot) as u64;
                // SAFETY: the source lies in the input operand (checked), the destination in
                // rank k's landing area as mapped for this device (its part fits the slot:
                // checked by the planner); the stream is of this device.
                unsafe { stream.copy_dtod_async(dst, input.ptr + (s * 16) as u64, (e - s) * 16) }?;
            }
        }
    }
    let sig = ar_header(f, step, kernel, id(input), id(output));
    let mut args = vec![
        pad,
        input.ptr,
        output.ptr,
        count,
        in_tab,
        out_tab,
        sig,
        c.timeout_ns(),
    ];
    if kernel == Kernel::P2pTwoShotPush {
        // the prologue copy: source, destination, bytes (0: none)
        let cp = copy.map_or([0; 3], |c| [c.src, c.dst, c.bytes as u64]);
        args.extend(cp);
    }
    // SAFETY: a function of this device's module whose entry takes these .u64 parameters
    // (pad, in, out, count, in_tab, out_tab, header, timeout, and for the write-only two-shot
    // copy_src, copy_dst, copy_bytes); the operands lie inside their buffers for `bytes`
    // (checked, or a region of this rank's scratch), the tables hold N addresses, a prologue
    // copy's ranges are this device's memory (a scratch region and the checked output); the
    // stream is a live stream of this device (checked).
    unsafe {
        f_.launch_u64(
            &LaunchConfig::linear(step.shape.blocks, step.shape.threads),
            stream,
            &args,
        )
    }
}
