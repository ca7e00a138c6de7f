//! The fused allreduce + residual add + RMSNorm launches and the local (unfused) add + RMSNorm
//! (protocol, where it rounds, what each operand kind costs: `docs/design/rmsnorm.md`).

use std::collections::HashMap;

use cuda_multimem::{Device, Error, Function, LaunchConfig, Result, StreamRef};

use super::P2p;
use crate::call::Checked;
use crate::config::CommConfig;
use crate::engine::{NormPlan, Shape, TeamFacts};
use crate::kernels::norm::{self as nk, NormKernel};
use crate::kernels::{call_header, load_module};
use crate::operand::Resolved;
use crate::team::Local;
use crate::types::DType;

/// The norm kernels of one device.
pub(crate) struct Kernels {
    fused: HashMap<(NormKernel, DType), Function>,
    unfused: HashMap<DType, Function>,
    /// The FP8 output entries of the forms of `nk::FP8_KERNELS`, and the local one.
    fp8: HashMap<(NormKernel, DType), Function>,
    fp8_unfused: HashMap<DType, Function>,
    /// The standalone FP8 quantisation (`nk::fp8_quant_entry`).
    quant: HashMap<DType, Function>,
}

impl Kernels {
    /// Every function, and whether it is a split form (launched in clusters).
    pub(super) fn all(&self) -> impl Iterator<Item = (&Function, bool)> {
        self.fused
            .iter()
            .map(|((k, _), f)| {
                (
                    f,
                    matches!(k, NormKernel::OneShotSplit | NormKernel::OneShotLlSplit),
                )
            })
            .chain(self.unfused.values().map(|f| (f, false)))
            .chain(self.fp8.values().map(|f| (f, false)))
            .chain(self.fp8_unfused.values().map(|f| (f, false)))
            .chain(self.quant.values().map(|f| (f, false)))
    }

    pub(super) fn load(device: &Device) -> Result<Kernels> {
        let m = load_module(device, nk::FILE, nk::PTX)?;
        let mut fused = HashMap::new();
        let mut unfused = HashMap::new();
        let mut fp8 = HashMap::new();
        let mut fp8_unfused = HashMap::new();
        let mut quant = HashMap::new();
        for dt in DType::ALL {
            for k in NormKernel::ALL {
                fused.insert((k, dt), m.function(&k.entry(dt))?);
            }
            for k in nk::FP8_KERNELS {
                fp8.insert((k, dt), m.function(&k.fp8_entry(dt))?);
            }
            unfused.insert(dt, m.function(&nk::unfused_entry(dt))?);
            fp8_unfused.insert(dt, m.function(&nk::fp8_unfused_entry(dt))?);
            quant.insert(dt, m.function(&nk::fp8_quant_entry(dt))?);
        }
        Ok(Kernels {
            fused,
            unfused,
            fp8,
            fp8_unfused,
            quant,
        })
    }
}

/// The norm operands as this rank's kernels see them: x, residual, weight, out.
struct Operands {
    x: u64,
    r: u64,
    w: u64,
    o: u64,
}

/// Queue the fused norm's launches of form `kernel` for `call` on `stream`. The low-latency
/// forms move aligned 4-byte words: where this rank's operands are not 4-byte aligned, it
/// copies them through its scratch and runs the same launches as its peers (the choice of the
/// form never depends on one rank's addresses). Returns whether it staged.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    p: &P2p,
    c: &CommConfig,
    t: &TeamFacts,
    l: &Local,
    call: &Checked<'_>,
    plan: &NormPlan,
    stream: StreamRef<'_>,
) -> Result<bool> {
    let kernel = plan.kernel;
    let s = call
        .norm
        .ok_or_else(|| Error::invalid("hidden", "a norm call without its shape"))?;
    let (x, out) = (call.input, call.output);
    let (r, w) = match (call.residual, call.weight) {
        (Some(r), Some(w)) => (r, w),
        _ => return Err(Error::invalid("residual", "a norm call without residual")),
    };
    let ll = matches!(kernel, NormKernel::OneShotLl | NormKernel::OneShotLlSplit);
    if let (Some(scaling), Some(q)) = (plan.quant, call.quant) {
        return run_fp8(p, c, t, l, call, plan, scaling, &q, stream).map(|()| false);
    }
    let aligned = (x.ptr | r.ptr | w.ptr | out.ptr) % 4 == 0;
    let f = p
        .kernels(l)
        .norm
        .fused
        .get(&(kernel, call.dtype))
        .ok_or_else(|| {
            Error::invalid(
                "dtype",
                format!("no {kernel:?} norm kernel for {}", call.dtype),
            )
        })?;
    let staged = ll && !aligned;
    let ops = if staged {
        stage_in(p, l, [&x, &r, &w, &out], stream)?
    } else {
        Operands {
            x: x.ptr,
            r: r.ptr,
            w: w.ptr,
            o: out.ptr,
        }
    };
    let pad = p.pad(l);
    let rb = s.row_bytes;
    for k in 0..plan.count() {
        let launch = plan.launch(t, c, k);
        let at = (launch.row0 * rb) as u64;
        let sh = launch.shape;
        let sig = call_header(&[
            kernel.header_code(),
            launch.rows as u64,
            s.hidden as u64,
            call.dtype.code(),
            s.eps.to_bits() as u64,
            sh.blocks as u64,
            sh.threads as u64,
            t.n as u64,
        ]);
        // SAFETY: a function of this device's norm module whose entry takes these ten .u64
        // parameters (docs in kernels::norm); x, residual and out hold `tokens × hidden`
        // elements and weight `hidden` (checked, or their copies in this rank's scratch), this
        // launch touches rows [row0, row0 + rows) of them; the pad and the staging it names
        // are this communicator's, and a launch's rows fit the staging (planned); the stream
        // is a live stream of this rank's device (checked).
        unsafe {
            f.launch_u64(
                &LaunchConfig::linear(sh.blocks, sh.threads),
                stream,
                &[
                    pad,
                    ops.x + at,
                    ops.r + at,
                    ops.w,
                    ops.o + at,
                    launch.rows as u64,
                    s.hidden as u64,
                    sig,
                    c.timeout_ns(),
                    s.eps.to_bits() as u64,
                ],
            )
        }?;
    }
    if staged {
        // SAFETY: the results in this rank's scratch (complete: the launches are before these
        // copies on the stream) into the checked residual and out.
        unsafe {
            stream.copy_dtod_async(r.ptr, ops.r, r.bytes)?;
            stream.copy_dtod_async(out.ptr, ops.o, out.bytes)?;
        }
    }
    Ok(staged)
}

/// The FP8 output launches of [`run`]: the same rows per launch, header and parameters as the
/// plain entries (out: the unquantised rows or 0), then the e4m3 rows, the scales, the mode word
/// and the UE8M0 stride (kernels::norm::FP8_PARAMS). The operands are 4-byte aligned (checked):
/// nothing is staged.
#[allow(clippy::too_many_arguments)]
fn run_fp8(
    p: &P2p,
    c: &CommConfig,
    t: &TeamFacts,
    l: &Local,
    call: &Checked<'_>,
    plan: &NormPlan,
    scaling: crate::types::Fp8Scaling,
    q: &crate::call::QuantChecked<'_>,
    stream: StreamRef<'_>,
) -> Result<()> {
    let kernel = plan.kernel;
    let s = call
        .norm
        .ok_or_else(|| Error::invalid("hidden", "a norm call without its shape"))?;
    let (x, out) = (call.input, call.output);
    let (r, w) = match (call.residual, call.weight) {
        (Some(r), Some(w)) => (r, w),
        _ => return Err(Error::invalid("residual", "a norm call without residual")),
    };
    let f = p
        .kernels(l)
        .norm
        .fp8
        .get(&(kernel, call.dtype))
        .ok_or_else(|| {
            Error::invalid(
                "dtype",
                format!("no {kernel:?} FP8 norm kernel for {}", call.dtype),
            )
        })?;
    let pad = p.pad(l);
    let rb = s.row_bytes;
    let unq = q.unquantised.map_or(0, |u| u.ptr);
    let sc = q.scales.map_or(0, |s| s.ptr);
    let stride = s.tokens.next_multiple_of(4) as u64;
    for k in 0..plan.count() {
        let launch = plan.launch(t, c, k);
        let row0 = launch.row0;
        let at = (row0 * rb) as u64;
        let sh = launch.shape;
        let sig = call_header(&[
            kernel.fp8_header_code(scaling),
            launch.rows as u64,
            s.hidden as u64,
            call.dtype.code(),
            s.eps.to_bits() as u64,
            sh.blocks as u64,
            sh.threads as u64,
            t.n as u64,
        ]);
        let sc_at = sc + fp8_scales_offset(scaling, row0, s.hidden) as u64;
        // SAFETY: a function of this device's norm module whose entry takes these fourteen
        // .u64 parameters (kernels::norm::FP8_PARAMS); x, residual, the unquantised rows (or
        // 0) hold `tokens × hidden` elements, out `tokens × hidden` bytes, the scales what the
        // scaling writes for every token (checked); this launch touches rows [row0, row0 +
        // rows) of them (its scales from sc_at); pad and staging as for the plain entries.
        unsafe {
            f.launch_u64(
                &LaunchConfig::linear(sh.blocks, sh.threads),
                stream,
                &[
                    pad,
                    x.ptr + at,
                    r.ptr + at,
                    w.ptr,
                    if unq == 0 { 0 } else { unq + at },
                    launch.rows as u64,
                    s.hidden as u64,
                    sig,
                    c.timeout_ns(),
                    s.eps.to_bits() as u64,
                    out.ptr + (row0 * s.hidden) as u64,
                    if sc == 0 { 0 } else { sc_at },
                    nk::fp8_mode(scaling, q.scale),
                    stride,
                ],
            )
        }?;
    }
    Ok(())
}

/// Byte offset of row `row0`'s scales: f32 per token, f32 per group row-major, or the token's
/// column of the UE8M0 packs.
fn fp8_scales_offset(scaling: crate::types::Fp8Scaling, row0: usize, hidden: usize) -> usize {
    use crate::types::{Fp8Scaling, FP8_GROUP};
    match scaling {
        Fp8Scaling::Static => 0,
        Fp8Scaling::PerToken | Fp8Scaling::PerGroupUe8m0 => 4 * row0,
        Fp8Scaling::PerGroup => 4 * row0 * (hidden / FP8_GROUP),
    }
}

/// Copy x, residual and weight into this rank's scratch (16-byte aligned places, out after
/// them), for a low-latency launch on operands that are not 4-byte aligned.
fn stage_in(
    p: &P2p,
    l: &Local,
    [x, r, w, out]: [&Resolved<'_>; 4],
    stream: StreamRef<'_>,
) -> Result<Operands> {
    let up = |b: usize| b.next_multiple_of(16);
    let need = 3 * up(x.bytes) + up(w.bytes);
    let region = p.scratch_region();
    let (base, _) = p.scratch(
        l,
        "x",
        "operands that are not 4-byte aligned, for the low-latency norm",
    )?;
    if need > 3 * region {
        return Err(Error::invalid(
            "x",
            format!(
                "operands that are not 4-byte aligned need {need} bytes of the communicator's scratch to run the low-latency norm; it has {} (raise config.scratch_bytes)",
                3 * region
            ),
        ));
    }
    let xs = base;
    let rs = xs + up(x.bytes) as u64;
    let ws = rs + up(r.bytes) as u64;
    // out may be x itself: then it is x's copy
    let os = if out.ptr == x.ptr {
        xs
    } else {
        ws + up(w.bytes) as u64
    };
    // SAFETY: the checked operands into this rank's scratch (disjoint 16-byte aligned places
    // inside its three regions: sized above); the previous call's work on the scratch is
    // before these copies on the stream, and no peer touches a rank's scratch outside a staged
    // allreduce chunk of its own.
    unsafe {
        stream.copy_dtod_async(xs, x.ptr, x.bytes)?;
        stream.copy_dtod_async(rs, r.ptr, r.bytes)?;
        stream.copy_dtod_async(ws, w.ptr, w.bytes)?;
    }
    Ok(Operands {
        x: xs,
        r: rs,
        w: ws,
        o: os,
    })
}

/// Queue the local add + RMSNorm kernel for `call` on `stream` (one block per row).
pub(crate) fn run_local(
    p: &P2p,
    l: &Local,
    call: &Checked<'_>,
    shape: Shape,
    stream: StreamRef<'_>,
) -> Result<()> {
    let s = call
        .norm
        .ok_or_else(|| Error::invalid("hidden", "a norm call without its shape"))?;
    if let (None, None, Some(q)) = (call.residual, call.weight, call.quant) {
        // the standalone quantisation: no residual, no weight
        let f = p.kernels(l).norm.quant.get(&call.dtype).ok_or_else(|| {
            Error::invalid(
                "dtype",
                format!("no FP8 quantisation kernel for {}", call.dtype),
            )
        })?;
        let x = call.input.ptr;
        // SAFETY: a function of this device's norm module taking the eleven .u64 parameters
        // of the local FP8 entry (kernels::norm::FP8_UNFUSED_PARAMS), x in the x, residual and
        // weight slots (read only), no unquantised rows; the operands hold what the call's
        // shape needs (checked: x of tokens × hidden, out of as many e4m3, the scales of the
        // scaling's length); a live stream of this device (checked).
        return unsafe {
            f.launch_u64(
                &LaunchConfig::linear(shape.blocks, shape.threads),
                stream,
                &[
                    x,
                    x,
                    x,
                    0,
                    s.tokens as u64,
                    s.hidden as u64,
                    0,
                    call.output.ptr,
                    q.scales.map_or(0, |s| s.ptr),
                    nk::fp8_mode(q.scaling, q.scale),
                    s.tokens.next_multiple_of(4) as u64,
                ],
            )
        };
    }
    let (r, w) = match (call.residual, call.weight) {
        (Some(r), Some(w)) => (r, w),
        _ => return Err(Error::invalid("residual", "a norm call without residual")),
    };
    if let Some(q) = call.quant {
        let f = p
            .kernels(l)
            .norm
            .fp8_unfused
            .get(&call.dtype)
            .ok_or_else(|| {
                Error::invalid(
                    "dtype",
                    format!("no FP8 add_rms_norm kernel for {}", call.dtype),
                )
            })?;
        // SAFETY: a function of this device's norm module taking these eleven .u64 parameters
        // (kernels::norm::FP8_UNFUSED_PARAMS); the operands hold what the call's shape needs
        // (checked, as for run_fp8); a live stream of this device (checked).
        return unsafe {
            f.launch_u64(
                &LaunchConfig::linear(shape.blocks, shape.threads),
                stream,
                &[
                    call.input.ptr,
                    r.ptr,
                    w.ptr,
                    q.unquantised.map_or(0, |u| u.ptr),
                    s.tokens as u64,
                    s.hidden as u64,
                    s.eps.to_bits() as u64,
                    call.output.ptr,
                    q.scales.map_or(0, |s| s.ptr),
                    nk::fp8_mode(q.scaling, q.scale),
                    s.tokens.next_multiple_of(4) as u64,
                ],
            )
        };
    }
    let f = p.kernels(l).norm.unfused.get(&call.dtype).ok_or_else(|| {
        Error::invalid(
            "dtype",
            format!("no add_rms_norm kernel for {}", call.dtype),
        )
    })?;
    // SAFETY: a function of this device's norm module taking these seven .u64 parameters; the
    // operands hold `tokens × hidden` (weight `hidden`) elements (checked); a live stream of
    // this device (checked).
    unsafe {
        f.launch_u64(
            &LaunchConfig::linear(shape.blocks, shape.threads),
            stream,
            &[
                call.input.ptr,
                r.ptr,
                w.ptr,
                call.output.ptr,
                s.tokens as u64,
                s.hidden as u64,
                s.eps.to_bits() as u64,
            ],
        )
    }
}
