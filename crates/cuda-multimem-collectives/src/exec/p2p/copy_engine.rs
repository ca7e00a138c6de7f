//! All-gather and broadcast of large buffers into a symmetric output through the copy engines
//! ([`Algorithm::CopyEngine`](crate::Algorithm::CopyEngine)); memory-ordering argument:
//! docs/design/collectives.md "Copy-engine all-gather and broadcast".

use cuda_multimem::{Device, Error, Event, LaunchConfig, Result, Stream, StreamRef};

use super::gather::{chunk_of, header};
use super::P2p;
use crate::call::Checked;
use crate::config::CommConfig;
use crate::engine::{copy_engine_local, TeamFacts};
use crate::kernels::gather::Collective;
use crate::team::{Local, Ranks};

/// The call-header form code of the copy-engine forms (the kernels': 0 staged, 1 direct,
/// 2 low-latency).
const FORM_CE: u64 = 3;

/// A rank's second stream for the copy-engine form: an out-of-place call's local copy (a
/// kernel: a second copy-engine copy beside the peer copies slowed them) runs there, forked
/// from the caller's stream after the first barrier (`fork`) and joined back before the second
/// (`done`), beside the copies to the peers on the caller's stream. Made with the rank, not on
/// first use: a first use inside a graph capture would create a stream there.
pub(crate) struct CeLane {
    stream: Stream,
    fork: Event,
    done: Event,
}

impl CeLane {
    pub(super) fn new(device: &Device) -> Result<CeLane> {
        Ok(CeLane {
            stream: Stream::new(device)?,
            fork: Event::new(device, false)?,
            done: Event::new(device, false)?,
        })
    }
}

/// Queue a copy-engine all-gather or broadcast: a barrier with the call header (every peer is
/// in this call, done with what its stream did with its output before); my input (all-gather:
/// every rank; broadcast: the root) into my chunk r (broadcast: the whole) of every peer's
/// output by `cuMemcpyDtoDAsync` on the caller's stream and, out of place, into my own output
/// on the rank's second stream (forked after the barrier, joined back after the peer copies); a
/// barrier (every peer's copies into my output are complete).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    p: &P2p,
    t: &TeamFacts,
    c: &CommConfig,
    ranks: &Ranks,
    l: &Local,
    call: &Checked<'_>,
    coll: Collective,
    stream: StreamRef<'_>,
) -> Result<()> {
    let n = t.n;
    let (buf, offset) = call.output.sym.ok_or_else(|| {
        Error::invalid(
            call.names[1],
            "the copy-engine form needs a symmetric output",
        )
    })?;
    let peers: Vec<u64> = buf.sym.addrs.iter().map(|&a| a + offset as u64).collect();
    let chunk = chunk_of(call, coll);
    let (ip, op_) = (call.input.ptr, call.output.ptr);
    let (r, b) = (l.rank, chunk as u64);
    // where my data goes in every output (all-gather: chunk r; broadcast: the output), and
    // whether I send at all (a broadcast's non-roots only meet)
    let at = match coll {
        Collective::AllGather => r as u64 * b,
        _ => 0,
    };
    let sends = coll == Collective::AllGather || r == call.root;
    let blocks = 1;
    let sig = header(
        call,
        coll,
        (chunk / call.dtype.size()) as u64,
        FORM_CE,
        (buf.id, offset as u64),
        blocks,
    );
    let pad = p.pad(l);
    let k = p.kernels(l);
    // SAFETY: the barrier entry (three .u64 parameters: this rank's pad, the header, the
    // timeout; one block): a barrier and the counters, no data. A live stream of this device.
    let barrier = || unsafe {
        k.gather.meet.launch_u64(
            &LaunchConfig::linear(blocks, 32),
            stream,
            &[pad, sig, c.timeout_ns()],
        )
    };
    let lane = k.ce.lock();
    // Whether the second stream waits on the caller's and was not joined back yet.
    let forked = std::cell::Cell::new(false);
    let queue = || -> Result<()> {
        barrier()?;
        let lane = (sends && !call.in_place).then_some(&*lane);
        if let Some(lane) = lane {
            lane.fork.record(stream)?;
            lane.stream.wait(&lane.fork)?;
            forked.set(true);
            let s = copy_engine_local(t, chunk);
            // SAFETY: the local-copy entry (three .u64 parameters: source, destination,
            // bytes): my input into chunk r of my output (broadcast: the output), both checked;
            // a live stream of this device.
            unsafe {
                k.gather.copy.launch_u64(
                    &LaunchConfig::linear(s.blocks, s.threads),
                    &lane.stream,
                    &[ip, op_ + at, b],
                )
            }?;
            lane.done.record(&lane.stream)?;
        }
        for j in (1..n).map(|j| (r + j) % n).filter(|_| sends) {
            // SAFETY: my input (checked) into chunk r (broadcast: all) of peer j's symmetric
            // output (same size and offset as mine, checked: it holds N chunks, or the
            // message).
            unsafe { stream.copy_dtod_async(peers[j] + at, ip, chunk) }?;
        }
        if let Some(lane) = lane {
            stream.wait(&lane.done)?;
            forked.set(false);
        }
        barrier()
    };
    // Work queued after the first barrier and then failing leaves the peers in a call this
    // rank cannot finish: the team is not usable after that. A fork is joined back even then:
    // the second stream's work must not outlive the call behind the caller's back, and in a
    // capture an unjoined fork fails the capture's end.
    queue().map_err(|e| {
        if forked.get() {
            let _ = lane
                .done
                .record(&lane.stream)
                .and_then(|()| stream.wait(&lane.done));
        }
        ranks.break_with(e)
    })
}
