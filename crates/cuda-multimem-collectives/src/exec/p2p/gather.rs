//! The peer-to-peer reduce-scatter, all-gather and broadcast kernels: low-latency, staged and
//! direct forms (protocol and memory-ordering argument: `docs/design/collectives.md`).

use std::collections::HashMap;

use cuda_multimem::{Device, Error, Function, LaunchConfig, Result, StreamRef};

use super::P2p;
use crate::call::Checked;
use crate::config::CommConfig;
use crate::engine::Shape;
use crate::kernels::gather::{Collective, COPY_ENTRY, MEET_ENTRY};
use crate::kernels::{call_header, load_module};
use crate::team::Local;
use crate::types::{Algorithm, DType, ReduceOp};

/// The kernels of one device: by collective, form (`true`: low-latency), type and operator
/// (all-gather and broadcast under [`ReduceOp::Sum`] only); and the copy-engine form's local
/// copy and barrier.
pub(crate) struct Kernels {
    main: HashMap<(Collective, bool, DType, ReduceOp), Function>,
    pub(super) copy: Function,
    pub(super) meet: Function,
}

impl Kernels {
    /// Every function.
    pub(super) fn all(&self) -> impl Iterator<Item = &Function> {
        self.main.values().chain([&self.copy, &self.meet])
    }

    /// Load every reduce-scatter, all-gather and broadcast kernel on `device`.
    pub(super) fn load(device: &Device) -> Result<Kernels> {
        let mut main = HashMap::new();
        let mut copy = None;
        let mut meet = None;
        for c in Collective::ALL {
            let m = load_module(device, c.file(), c.ptx())?;
            for &dt in c.dtypes() {
                for &op in c.ops() {
                    main.insert((c, false, dt, op), m.function(&c.entry(dt, op))?);
                    if c.has_ll(dt) {
                        main.insert((c, true, dt, op), m.function(&c.ll_entry(dt, op))?);
                    }
                }
            }
            if c == Collective::AllGather {
                copy = Some(m.function(COPY_ENTRY)?);
                meet = Some(m.function(MEET_ENTRY)?);
            }
        }
        match (copy, meet) {
            (Some(copy), Some(meet)) => Ok(Kernels { main, copy, meet }),
            _ => Err(Error::invalid(
                "kernels",
                "the all-gather module has no copy-engine entries",
            )),
        }
    }
}

/// The header every rank of a gather-family call compares: what, how much (`count` elements
/// per chunk), which form (the kernels': 0 staged, 1 direct, 2 low-latency; 3 the copy
/// engines), which symmetric output peers write into (its id and offset; (0, 0) for none), the
/// launch's blocks.
pub(super) fn header(
    call: &Checked<'_>,
    coll: Collective,
    count: u64,
    form: u64,
    (sym_id, sym_off): (u64, u64),
    blocks: u32,
) -> u64 {
    call_header(&[
        count,
        call.dtype.code(),
        if coll.reduces() { call.op.code() } else { 0xff },
        coll.code(),
        form,
        call.root as u64,
        sym_id,
        sym_off,
        blocks as u64,
    ])
}

/// One rank's part of a gather-family call (reduce-scatter: the output; all-gather: the input;
/// broadcast: the message).
pub(super) fn chunk_of(call: &Checked<'_>, coll: Collective) -> usize {
    match coll {
        Collective::ReduceScatter => call.output.bytes,
        _ => call.input.bytes,
    }
}

/// Queue a low-latency, staged or direct kernel of `coll` for `call` on `stream`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    p: &P2p,
    c: &CommConfig,
    l: &Local,
    call: &Checked<'_>,
    coll: Collective,
    algorithm: Algorithm,
    shape: Shape,
    stream: StreamRef<'_>,
) -> Result<()> {
    let ll = algorithm == Algorithm::PushLl;
    let direct = algorithm == Algorithm::PushDirect;
    let chunk = chunk_of(call, coll);
    let count = (chunk / call.dtype.size()) as u64;
    let f = p
        .kernels(l)
        .gather
        .main
        .get(&(coll, ll, call.dtype, call.op))
        .ok_or_else(|| {
            Error::invalid(
                "op",
                format!("no {} kernel for {} {}", coll.name(), call.dtype, call.op),
            )
        })?;
    let (out_tab, out_id, out_off) = match (direct, call.output.sym) {
        (true, Some((buf, offset))) => (buf.table(l.rank)?, buf.id, offset as u64),
        _ => (0, 0, 0),
    };
    // the form: 0 staged, 1 direct, 2 low-latency (whose flags fold this header)
    let form = if ll { 2 } else { direct as u64 };
    let sig = header(call, coll, count, form, (out_id, out_off), shape.blocks);
    // SAFETY: a function of this device's module whose entry takes these eight .u64
    // parameters (pad, in, out, count, out_tab, root, header, timeout); the operands were
    // checked to lie inside their buffers (input and output lengths in the collective's
    // ratio), the table holds N addresses of a symmetric output (direct; else 0, unread), the
    // pad, staging and low-latency slots are the communicator's (a low-latency chunk fits a
    // slot as 8-byte pairs: planned); the stream is a live stream of this device (checked).
    unsafe {
        f.launch_u64(
            &LaunchConfig::linear(shape.blocks, shape.threads),
            stream,
            &[
                p.pad(l),
                call.input.ptr,
                call.output.ptr,
                count,
                out_tab,
                call.root as u64,
                sig,
                c.timeout_ns(),
            ],
        )
    }
}
