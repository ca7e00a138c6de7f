//! The peer-to-peer all-to-all: the low-latency and direct kernels, and for counts given on
//! the host the table fill before them (protocol and memory-ordering argument:
//! `docs/design/alltoall.md`).

use cuda_multimem::{Device, DeviceBuffer, Error, Function, LaunchConfig, Result, StreamRef};

use super::P2p;
use crate::call::{A2aChecked, Checked};
use crate::config::CommConfig;
use crate::engine::{Shape, TeamFacts};
use crate::kernels::alltoall::{
    mode_word, DIRECT_ENTRY, FILE, FILL_ENTRY, LL_ENTRY, MODE_DEVICE, MODE_EQUAL, MODE_HOST, PTX,
    TABLE_WORDS,
};
use crate::kernels::{call_header, load_module};
use crate::team::Local;
use crate::types::Algorithm;

/// The call-header code of an all-to-all (apart from every other family's).
const CODE: u64 = 32;

/// The all-to-all kernels of one device, and the rank's count table (what the fill kernel
/// writes for counts given on the host; one per local rank, read by the rank's next kernel on
/// the same stream only).
pub(crate) struct Kernels {
    ll: Function,
    direct: Function,
    fill: Function,
    table: DeviceBuffer<u64>,
}

impl Kernels {
    /// Every function.
    pub(super) fn all(&self) -> impl Iterator<Item = &Function> {
        [&self.ll, &self.direct, &self.fill].into_iter()
    }

    /// Load them on `device`, with the rank's table.
    pub(super) fn load(device: &Device) -> Result<Kernels> {
        let m = load_module(device, FILE, PTX)?;
        Ok(Kernels {
            ll: m.function(LL_ENTRY)?,
            direct: m.function(DIRECT_ENTRY)?,
            fill: m.function(FILL_ENTRY)?,
            table: DeviceBuffer::zeroed(device, TABLE_WORDS)?,
        })
    }
}

/// Queue an all-to-all of `algorithm` for `call` on `stream` (`scratch`: the direct form lands
/// in the scratch and the kernel copies this rank's parts out into the output).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    p: &P2p,
    c: &CommConfig,
    t: &TeamFacts,
    l: &Local,
    call: &Checked<'_>,
    algorithm: Algorithm,
    shape: Shape,
    scratch: bool,
    stream: StreamRef<'_>,
) -> Result<()> {
    let (elem, counts) = call
        .a2a
        .ok_or_else(|| Error::invalid("kind", "an all-to-all call without its counts"))?;
    let k = &p.kernels(l).alltoall;
    let (inp, out) = (call.input, call.output);
    let (mode, tab_a, tab_b, tab_c, count) = match counts {
        A2aChecked::Equal => (MODE_EQUAL, 0, 0, 0, (inp.bytes / t.n / elem) as u64),
        A2aChecked::Host(table) => {
            let mut args = vec![k.table.device_ptr()];
            args.extend_from_slice(&table);
            // SAFETY: the fill entry takes 1 + TABLE_WORDS .u64 parameters (the destination,
            // then the values) and one thread stores TABLE_WORDS u64 at the destination: this
            // rank's table of that many, on this device; the stream is this device's (checked).
            unsafe {
                k.fill
                    .launch_u64(&LaunchConfig::linear(1, 32), stream, &args)?
            };
            (MODE_HOST, k.table.device_ptr(), 0, 0, 0)
        }
        A2aChecked::Device {
            send_counts,
            recv_counts,
            recv_offsets,
        } => (
            MODE_DEVICE,
            send_counts.ptr,
            recv_counts.ptr,
            recv_offsets.ptr,
            0,
        ),
    };
    let direct = algorithm == Algorithm::AllToAllDirect;
    // where peers' parts land: the output itself (low-latency: only this rank writes it; direct:
    // a symmetric output), or the scratch (its first region; the kernel copies out)
    let (land, land_bytes, tab, fin, sym) = if !direct {
        (out.ptr, out.bytes, 0, 0, (0, 0))
    } else if scratch {
        let (base, s) = p.scratch(
            l,
            "output",
            "an all-to-all into the caller's own memory or in place above the low-latency limit",
        )?;
        (base, out.bytes, s.table(l.rank)?, out.ptr, (s.id, 0))
    } else {
        let (buf, off) = out.sym.ok_or_else(|| {
            Error::invalid("output", "the direct all-to-all needs a symmetric output")
        })?;
        (
            out.ptr,
            out.bytes,
            buf.table(l.rank)?,
            0,
            (buf.id, off as u64),
        )
    };
    let sig = call_header(&[
        CODE,
        mode,
        elem as u64,
        count,
        inp.bytes as u64,
        out.bytes as u64,
        direct as u64,
        scratch as u64,
        sym.0,
        sym.1,
        shape.blocks as u64,
    ]);
    let f = if direct { &k.direct } else { &k.ll };
    // SAFETY: an entry of this device's module taking these fourteen .u64 parameters (pad, in,
    // out, out_tab, count, tab_a, tab_b, tab_c, mode, in_bytes, out_bytes, final, sig,
    // timeout): the operands were checked to lie inside their buffers with the byte lengths
    // given (in_bytes, out_bytes; the scratch region holds out_bytes: planned), the device
    // tables hold n u64 each (checked) or the rank's table TABLE_WORDS (filled just before on
    // this stream), the output table (direct) N addresses of the buffer `land` is in; every
    // count and offset the kernels read is checked against those lengths on the device; the
    // stream is a live stream of this device (checked).
    unsafe {
        f.launch_u64(
            &LaunchConfig::linear(shape.blocks, shape.threads),
            stream,
            &[
                p.pad(l),
                inp.ptr,
                land,
                tab,
                count,
                tab_a,
                tab_b,
                tab_c,
                mode_word(elem, mode),
                inp.bytes as u64,
                land_bytes as u64,
                fin,
                sig,
                c.timeout_ns(),
            ],
        )
    }
}
