//! The peer-to-peer MoE dispatch and combine of a [`crate::MoePlan`], one launch each (the
//! low-latency and the bulk form are the same kernels, the form a word of the plan's layout;
//! protocol and memory order: `docs/design/alltoall.md`, "MoE dispatch and combine").

use cuda_multimem::{Device, Error, Function, LaunchConfig, Result, StreamRef};

use super::P2p;
use crate::call::{Checked, Kind};
use crate::config::CommConfig;
use crate::engine::Shape;
use crate::kernels::moe::{
    mode_word, CODE_BF16, CODE_F16, CODE_F32, COMBINE_ENTRY, DISPATCH_ENTRY, FILE, PTX,
};
use crate::kernels::{call_header, load_module};
use crate::team::Local;
use crate::types::DType;

/// The call-header code of a MoE call (apart from every other family's).
const CODE: u64 = 40;

/// The MoE kernels of one device.
pub(crate) struct Kernels {
    dispatch: Function,
    combine: Function,
}

impl Kernels {
    /// Every function.
    pub(super) fn all(&self) -> impl Iterator<Item = &Function> {
        [&self.dispatch, &self.combine].into_iter()
    }

    /// Load them on `device`.
    pub(super) fn load(device: &Device) -> Result<Kernels> {
        let m = load_module(device, FILE, PTX)?;
        Ok(Kernels {
            dispatch: m.function(DISPATCH_ENTRY)?,
            combine: m.function(COMBINE_ENTRY)?,
        })
    }
}

fn code(d: DType) -> Result<u64> {
    match d {
        DType::F32 => Ok(CODE_F32),
        DType::Bf16 => Ok(CODE_BF16),
        DType::F16 => Ok(CODE_F16),
        _ => Err(Error::invalid(
            "out",
            format!("{d:?}; expected f32, bf16 or f16"),
        )),
    }
}

/// Queue the MoE call `call` on `stream` with launch shape `shape`.
pub(crate) fn run(
    p: &P2p,
    c: &CommConfig,
    l: &Local,
    call: &Checked<'_>,
    shape: Shape,
    stream: StreamRef<'_>,
) -> Result<()> {
    let m = call
        .moe
        .ok_or_else(|| Error::invalid("kind", "a MoE call without its plan"))?;
    let plan = m.plan;
    let part = plan.part(l.rank)?;
    let k = &p.kernels(l).moe;
    let s = &plan.sizes;
    let cfg = LaunchConfig::linear(shape.blocks, shape.threads);
    let layout = part.layout.device_ptr();
    let pad = p.pad(l);
    let sh = &plan.shape;
    // what every rank of the call shares (T differs per rank: not in the header)
    let header = |kind: u64| {
        call_header(&[
            CODE,
            kind,
            s.tmax,
            s.k,
            sh.num_experts as u64,
            s.row,
            s.scales,
            s.yrow,
            s.rows,
            s.regions,
            plan.sym.inner.id,
            shape.blocks as u64,
        ])
    };
    match call.kind {
        Kind::MoeDispatch => {
            let (ids, w) = (
                m.ids.ok_or_else(|| Error::invalid("topk_ids", "missing"))?,
                m.weights
                    .ok_or_else(|| Error::invalid("topk_weights", "missing"))?,
            );
            let scales = m.scales.map_or(0, |r| r.ptr);
            // SAFETY: an entry of this device's module with these .u64 parameters: the pad, the
            // plan's layout table on this device (its buffers allocated by the plan for this
            // rank, the symmetric buffer mapped on every rank), tokens of T rows, ids and
            // weights of T × k, scales of T × S (checked; T ≤ the plan's maximum, checked);
            // every expert id, position and count the kernel reads is checked on the device
            // against the plan's sizes; the stream is a live stream of this device (checked).
            unsafe {
                k.dispatch.launch_u64(
                    &cfg,
                    stream,
                    &[
                        pad,
                        layout,
                        call.input.ptr,
                        ids.ptr,
                        w.ptr,
                        scales,
                        m.tokens as u64,
                        header(0),
                        c.timeout_ns(),
                    ],
                )?;
            }
        }
        _ => {
            let mode = mode_word(code(sh.expert_out)?, code(m.out)?);
            // SAFETY: as above: the expert outputs hold the plan's rows × hidden of
            // expert_out (checked), `out` T rows of hidden elements of the output type
            // (checked); the map the kernel follows was written by this rank's dispatch within
            // the plan's rows, and its entries are checked on the device.
            unsafe {
                k.combine.launch_u64(
                    &cfg,
                    stream,
                    &[
                        pad,
                        layout,
                        call.input.ptr,
                        call.output.ptr,
                        m.tokens as u64,
                        mode,
                        header(1),
                        c.timeout_ns(),
                    ],
                )?;
            }
        }
    }
    Ok(())
}
