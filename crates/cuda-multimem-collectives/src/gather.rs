//! Reduce-scatter, all-gather and broadcast on a [`RankHandle`]: operand checks, the choice
//! between the multimem executor (where the communicator has a multicast team and the policy
//! wants it: `crate::mm`) and the peer-to-peer low-latency, staged and direct kernels, the
//! launch shape and the call header. Protocol and memory-ordering argument:
//! `docs/design/collectives.md`.

use std::collections::HashMap;

use cuda_multimem::{
    Device, Error, Event, Function, LaunchConfig, Module, Result, Stream, StreamRef,
};

use crate::comm::RankHandle;
use crate::kernels::gather::{ll_words, staged_max_blocks, Collective, COPY_ENTRY, MEET_ENTRY};
use crate::kernels::{call_header, MAX_BLOCKS};
use crate::operand::{Dst, Operand, Place, Src, IN_PLACE, OUT_OF_PLACE};
use crate::types::{Algorithm, Choice, DType, Element, Path, ReduceOp};

/// The kernels of one device: by collective, form (`true`: low-latency), type and operator
/// (all-gather and broadcast under [`ReduceOp::Sum`] only); and the copy-engine all-gather's
/// local copy.
pub(crate) struct Kernels {
    main: HashMap<(Collective, bool, DType, ReduceOp), Function>,
    copy: Function,
    meet: Function,
}

/// Load every reduce-scatter, all-gather and broadcast kernel on `device`.
pub(crate) fn load_kernels(device: &Device) -> Result<Kernels> {
    let mut functions = HashMap::new();
    let mut copy = None;
    let mut meet = None;
    for c in Collective::ALL {
        let text = c
            .load_text()
            .map_err(|e| Error::os("read PTX from CUDA_MULTIMEM_PTX_DIR", e))?;
        let m = Module::load_ptx(device, &text)?;
        for dt in DType::ALL {
            for &op in c.ops() {
                functions.insert((c, false, dt, op), m.function(&c.entry(dt, op))?);
                functions.insert((c, true, dt, op), m.function(&c.ll_entry(dt, op))?);
            }
        }
        if c == Collective::AllGather {
            copy = Some(m.function(COPY_ENTRY)?);
            meet = Some(m.function(MEET_ENTRY)?);
        }
    }
    Ok(Kernels {
        main: functions,
        copy: copy.expect("all-gather is one of Collective::ALL"),
        meet: meet.expect("all-gather is one of Collective::ALL"),
    })
}

/// A rank's second stream for the copy-engine all-gather ([`Algorithm::CopyEngine`]): an
/// out-of-place call's local copy (a kernel: a second copy-engine copy beside the peer copies
/// slowed them) runs there, forked from the caller's stream after the first barrier (`fork`)
/// and joined back before the second (`done`), beside the copies to the peers on the caller's
/// stream.
pub(crate) struct CeLane {
    stream: Stream,
    fork: Event,
    done: Event,
}

impl CeLane {
    pub(crate) fn new(device: &Device) -> Result<CeLane> {
        Ok(CeLane {
            stream: Stream::new(device)?,
            fork: Event::new(device, false)?,
            done: Event::new(device, false)?,
        })
    }
}

/// Where a copy-engine all-gather writes: every rank's symmetric output as mapped here.
struct CePlan {
    /// Rank k's address of the output (at the operand's offset).
    peers: Vec<u64>,
    /// The symmetric buffer's id and the operand's offset (for the call header).
    sym_id: u64,
    sym_off: u64,
}

/// `len` elements of `T` as bytes, checked against the operand's recorded byte length.
fn bytes_of<T>(len: usize, recorded: usize, arg: &'static str) -> Result<usize> {
    let size = std::mem::size_of::<T>();
    match len.checked_mul(size) {
        Some(b) if b == recorded => Ok(b),
        _ => Err(Error::invalid(
            arg,
            format!("{len} elements of {size} bytes: the byte length overflows"),
        )),
    }
}

/// `n` chunks of `chunk` bytes, checked.
fn times(n: usize, chunk: usize, arg: &'static str) -> Result<usize> {
    chunk
        .checked_mul(n)
        .ok_or_else(|| Error::invalid(arg, format!("{n} chunks of {chunk} bytes overflow usize")))
}

/// What a call asks for, before the checks.
struct Call<'o> {
    coll: Collective,
    dtype: DType,
    op: ReduceOp,
    input: Operand<'o>,
    output: Operand<'o>,
    root: usize,
    /// The arguments the input and the output came from (for errors).
    names: [&'static str; 2],
}

/// The call-header form code of the copy-engine forms (the kernels': 0 staged, 1 direct,
/// 2 low-latency).
const FORM_CE: u64 = 3;

impl Call<'_> {
    /// The header every rank of the call compares: what, how much (`count` elements per
    /// chunk), which form, which symmetric operand (its id and offset; (0, 0) for none), the
    /// launch's blocks.
    fn header(&self, count: u64, form: u64, (sym_id, sym_off): (u64, u64), blocks: u32) -> u64 {
        call_header(&[
            count,
            self.dtype.code(),
            if self.coll.reduces() {
                self.op.code()
            } else {
                0xff
            },
            self.coll.code(),
            form,
            self.root as u64,
            sym_id,
            sym_off,
            blocks as u64,
        ])
    }
}

impl<'a> RankHandle<'a> {
    /// Reduce-scatter: `input` holds N chunks of `count` elements (N the team size), `output`
    /// `count` elements; rank r's output becomes the reduction with `op` of chunk r of every
    /// rank's input, in rank order (16-bit types accumulated in f32, rounded once: the same bits
    /// as [`crate::reduce_scatter_reference`]). Operands: symmetric buffers and views or the
    /// caller's own memory, either way with no copies outside the kernel. Queued on `stream`, a
    /// stream of this rank's device; returns what ran.
    ///
    /// On the multimem path ([`crate::Path::Multimem`]: a multicast team, the policy's
    /// size rule, and a `multimem.ld_reduce` form of the type and operator — f32 only adds),
    /// the switch reduces in an order of its own: sums may differ from the reference in the
    /// last bits (min and max are exact), and the operands are copied through the team's
    /// regions ([`crate::Choice::staged_chunks`] windows). The same holds for all-gather and
    /// broadcast, which move bits on either path.
    pub fn reduce_scatter<'s, 'd, 'x, T: Element>(
        &self,
        input: impl Into<Src<'s, T>>,
        output: impl Into<Dst<'d, T>>,
        op: ReduceOp,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<Choice> {
        let (i, o) = (input.into(), output.into());
        let ib = bytes_of::<T>(i.len, i.op.bytes, "input")?;
        let ob = bytes_of::<T>(o.len, o.op.bytes, "output")?;
        let n = self.comm.inner.ranks.n;
        if times(n, ob, "output")? != ib {
            return Err(Error::invalid(
                "input",
                format!(
                    "{} elements; a reduce-scatter of {} elements per rank over {n} ranks takes {n} x {} = {} (N chunks of the output's length)",
                    i.len,
                    o.len,
                    o.len,
                    o.len.saturating_mul(n)
                ),
            ));
        }
        self.collective(
            Call {
                coll: Collective::ReduceScatter,
                dtype: T::DTYPE,
                op,
                input: Operand { bytes: ib, ..i.op },
                output: Operand { bytes: ob, ..o.op },
                root: 0,
                names: OUT_OF_PLACE,
            },
            stream.into(),
        )
    }

    /// Reduce-scatter in place: `buf` holds N chunks of `count` elements; the result lands in
    /// chunk r of rank r's `buf` (as NCCL's in-place form, recvbuff = sendbuff + rank·count);
    /// the other chunks keep this rank's input.
    pub fn reduce_scatter_in_place<'d, 'x, T: Element>(
        &self,
        buf: impl Into<Dst<'d, T>>,
        op: ReduceOp,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<Choice> {
        let b = buf.into();
        let bytes = bytes_of::<T>(b.len, b.op.bytes, "buf")?;
        let chunk = self.in_place_chunk(b.len, bytes, "buf")?;
        let all = Operand { bytes, ..b.op };
        self.collective(
            Call {
                coll: Collective::ReduceScatter,
                dtype: T::DTYPE,
                op,
                input: all,
                output: all.sub(self.local.rank * chunk, chunk),
                root: 0,
                names: IN_PLACE,
            },
            stream.into(),
        )
    }

    /// All-gather: `input` holds `count` elements, `output` N chunks of `count`; chunk k of
    /// every rank's output becomes rank k's input. Up to [`crate::CommConfig::gather_ll_max_bytes`] of
    /// output, every rank's words travel with the call's flag into its peers' low-latency slots
    /// and each copies them out as they arrive, with no barrier ([`Algorithm::PushLl`]). Above
    /// it, with a symmetric output above the one-shot limit, the ranks store straight into each
    /// other's outputs ([`Algorithm::PushDirect`]); otherwise (the caller's own output, or
    /// medium messages) every rank pushes its input into its peers' staging slots and each
    /// copies out locally ([`Algorithm::PushStaged`]: one extra local write and read of the
    /// message, no extra launches).
    pub fn all_gather<'s, 'd, 'x, T: Element>(
        &self,
        input: impl Into<Src<'s, T>>,
        output: impl Into<Dst<'d, T>>,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<Choice> {
        let (i, o) = (input.into(), output.into());
        let ib = bytes_of::<T>(i.len, i.op.bytes, "input")?;
        let ob = bytes_of::<T>(o.len, o.op.bytes, "output")?;
        let n = self.comm.inner.ranks.n;
        if times(n, ib, "input")? != ob {
            return Err(Error::invalid(
                "output",
                format!(
                    "{} elements; an all-gather of {} elements per rank over {n} ranks fills {n} x {} = {} (N chunks of the input's length)",
                    o.len,
                    i.len,
                    i.len,
                    i.len.saturating_mul(n)
                ),
            ));
        }
        self.collective(
            Call {
                coll: Collective::AllGather,
                dtype: T::DTYPE,
                op: ReduceOp::Sum,
                input: Operand { bytes: ib, ..i.op },
                output: Operand { bytes: ob, ..o.op },
                root: 0,
                names: OUT_OF_PLACE,
            },
            stream.into(),
        )
    }

    /// All-gather in place: `buf` holds N chunks of `count` elements, rank r's contribution
    /// already in its chunk r.
    pub fn all_gather_in_place<'d, 'x, T: Element>(
        &self,
        buf: impl Into<Dst<'d, T>>,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<Choice> {
        let b = buf.into();
        let bytes = bytes_of::<T>(b.len, b.op.bytes, "buf")?;
        let chunk = self.in_place_chunk(b.len, bytes, "buf")?;
        let all = Operand { bytes, ..b.op };
        self.collective(
            Call {
                coll: Collective::AllGather,
                dtype: T::DTYPE,
                op: ReduceOp::Sum,
                input: all.sub(self.local.rank * chunk, chunk),
                output: all,
                root: 0,
                names: IN_PLACE,
            },
            stream.into(),
        )
    }

    /// Broadcast: every rank's `output` becomes rank `root`'s `input` (the same length on
    /// every rank; read on the root only, but checked everywhere). Staged or direct as
    /// [`RankHandle::all_gather`].
    pub fn broadcast<'s, 'd, 'x, T: Element>(
        &self,
        input: impl Into<Src<'s, T>>,
        output: impl Into<Dst<'d, T>>,
        root: usize,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<Choice> {
        let (i, o) = (input.into(), output.into());
        let ib = bytes_of::<T>(i.len, i.op.bytes, "input")?;
        let ob = bytes_of::<T>(o.len, o.op.bytes, "output")?;
        if ib != ob {
            return Err(Error::invalid(
                "output",
                format!(
                    "{} elements; the input has {} (both operands have the same length)",
                    o.len, i.len
                ),
            ));
        }
        self.collective(
            Call {
                coll: Collective::Broadcast,
                dtype: T::DTYPE,
                op: ReduceOp::Sum,
                input: Operand { bytes: ib, ..i.op },
                output: Operand { bytes: ob, ..o.op },
                root,
                names: OUT_OF_PLACE,
            },
            stream.into(),
        )
    }

    /// Broadcast in place: every rank's `buf` becomes rank `root`'s.
    pub fn broadcast_in_place<'d, 'x, T: Element>(
        &self,
        buf: impl Into<Dst<'d, T>>,
        root: usize,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<Choice> {
        let b = buf.into();
        let bytes = bytes_of::<T>(b.len, b.op.bytes, "buf")?;
        let all = Operand { bytes, ..b.op };
        self.collective(
            Call {
                coll: Collective::Broadcast,
                dtype: T::DTYPE,
                op: ReduceOp::Sum,
                input: all,
                output: all,
                root,
                names: IN_PLACE,
            },
            stream.into(),
        )
    }

    /// Bytes of one chunk of an in-place buffer of `len` elements (`bytes` bytes): a whole
    /// number of elements per rank.
    fn in_place_chunk(&self, len: usize, bytes: usize, arg: &'static str) -> Result<usize> {
        let n = self.comm.inner.ranks.n;
        if len % n != 0 {
            return Err(Error::invalid(
                arg,
                format!("{len} elements; not a whole number of chunks for {n} ranks"),
            ));
        }
        Ok(bytes / n)
    }

    /// What `coll` runs for `chunk_bytes` per rank (reduce-scatter: the output; all-gather: the
    /// input; broadcast: the message) by `algorithm`: the launch shape, the same on every rank
    /// that makes the same call.
    fn gather_shape(&self, chunk_bytes: usize, algorithm: Algorithm) -> Choice {
        let inner = &*self.comm.inner;
        let c = &inner.config;
        let max_blocks = if c.max_blocks != 0 {
            c.max_blocks
        } else {
            // one block per multiprocessor, a power of two of them (as the push two-shot)
            1 << inner
                .p2p
                .multiprocessors
                .clamp(1, MAX_BLOCKS as u32)
                .ilog2()
        } as u64;
        // the low-latency form: one 4-byte word per thread, up to `threads` per block (as the
        // low-latency allreduce); the others: 16-byte units, up to `push_threads`
        let (units, max_threads) = match algorithm {
            Algorithm::PushLl => (ll_words(chunk_bytes as u64), c.threads as u64),
            _ => (chunk_bytes.div_ceil(16) as u64, c.push_threads as u64),
        };
        let mut blocks = units.div_ceil(max_threads).clamp(1, max_blocks);
        if algorithm == Algorithm::PushStaged {
            // every block owns at least 128 bytes of each staging sub-slot
            blocks = blocks.min(staged_max_blocks(inner.p2p.stage_half as u64));
        }
        let threads = units
            .div_ceil(blocks)
            .next_multiple_of(32)
            .clamp(64, max_threads.max(64));
        Choice {
            path: Path::PeerToPeer,
            algorithm,
            blocks: blocks as u32,
            threads: threads as u32,
            staged_chunks: 0,
        }
    }

    /// The copy-engine form's plan where it applies (see [`Algorithm::CopyEngine`]): an
    /// all-gather or a broadcast whose output is symmetric and whose whole buffer (the
    /// gathered output, the message) is at least `gather_ce_min_bytes` (broadcast:
    /// `broadcast_ce_min_bytes`). The rule reads nothing but the call and the output's kind, so
    /// every rank that makes the same call with an output of the same kind makes the same
    /// choice — in place on one rank and out of place on another included (the call header
    /// tells the others apart).
    fn ce_plan(&self, call: &Call<'_>, op_: u64, total: usize) -> Option<CePlan> {
        let inner = &*self.comm.inner;
        let (n, r) = (inner.ranks.n, self.local.rank);
        let min = match call.coll {
            Collective::AllGather => inner.config.gather_ce_min_bytes,
            Collective::Broadcast => inner.config.broadcast_ce_min_bytes,
            Collective::ReduceScatter => return None,
        };
        // an empty call queues nothing, whatever the form (as the kernels' forms)
        if total == 0 || total < min {
            return None;
        }
        let Place::Sym { buf, offset, .. } = call.output.place else {
            return None;
        };
        let peers: Vec<u64> = buf.sym.addrs.iter().map(|&a| a + offset as u64).collect();
        if peers.len() != n || peers[r] != op_ {
            return None;
        }
        Some(CePlan {
            peers,
            sym_id: buf.id,
            sym_off: offset as u64,
        })
    }

    /// Queue a copy-engine all-gather or broadcast (`plan` from [`Self::ce_plan`]): a barrier
    /// with the call header (every peer is in this call, done with what its stream did with its
    /// output before); my input (all-gather: every rank; broadcast: the root) into my chunk r
    /// (broadcast: the whole) of every peer's output by `cuMemcpyDtoDAsync` on the caller's
    /// stream and, out of place, into my own output on the rank's second stream (forked after
    /// the barrier, joined back after the peer copies); a barrier (every peer's copies into my
    /// output are complete). Memory-ordering argument: docs/design/collectives.md
    /// "Copy-engine all-gather and broadcast".
    #[allow(clippy::too_many_arguments)]
    fn run_ce(
        &self,
        call: &Call<'_>,
        plan: &CePlan,
        ip: u64,
        op_: u64,
        chunk: usize,
        in_place: bool,
        stream: StreamRef<'_>,
    ) -> Result<Choice> {
        let inner = &*self.comm.inner;
        let (c, l, n) = (&inner.config, self.local, inner.ranks.n);
        let (r, b) = (l.rank, chunk as u64);
        // where my data goes in every output (all-gather: chunk r; broadcast: the output), and
        // whether I send at all (a broadcast's non-roots only meet)
        let at = match call.coll {
            Collective::AllGather => r as u64 * b,
            _ => 0,
        };
        let sends = call.coll == Collective::AllGather || r == call.root;
        let choice = Choice {
            path: Path::PeerToPeer,
            algorithm: Algorithm::CopyEngine,
            blocks: 1,
            threads: 32,
            staged_chunks: 0,
        };
        let sig = call.header(
            (chunk / call.dtype.size()) as u64,
            FORM_CE,
            (plan.sym_id, plan.sym_off),
            choice.blocks,
        );
        let pad = inner.p2p.pads.addrs[r];
        // SAFETY: the barrier entry (three .u64 parameters: this rank's pad, the header, the
        // timeout; one block): a barrier and the counters, no data. A live stream of this
        // device.
        let barrier = || unsafe {
            l.gather.meet.launch_u64(
                &LaunchConfig::linear(1, 32),
                stream,
                &[pad, sig, c.timeout_ns()],
            )
        };
        let lane = l.ce.lock();
        inner.ranks.next_call(l);
        // Whether the second stream waits on the caller's and was not joined back yet.
        let forked = std::cell::Cell::new(false);
        let queue = || -> Result<()> {
            barrier()?;
            let lane = (sends && !in_place).then_some(&*lane);
            if let Some(lane) = lane {
                lane.fork.record(stream)?;
                lane.stream.wait(&lane.fork)?;
                forked.set(true);
                let blocks = (b / 16)
                    .div_ceil(512)
                    .clamp(1, 2 * inner.p2p.multiprocessors.max(1) as u64)
                    as u32;
                // SAFETY: the local-copy entry (three .u64 parameters: source, destination,
                // bytes): my input into chunk r of my output (broadcast: the output), both
                // checked; a live stream of this device.
                unsafe {
                    l.gather.copy.launch_u64(
                        &LaunchConfig::linear(blocks, 512),
                        &lane.stream,
                        &[ip, op_ + at, b],
                    )
                }?;
                lane.done.record(&lane.stream)?;
            }
            for k in (1..n).map(|j| (r + j) % n).filter(|_| sends) {
                // SAFETY: my input (checked) into chunk r (broadcast: all) of peer k's symmetric
                // output (same size and offset as mine, checked: it holds N chunks, or the
                // message).
                unsafe { stream.copy_dtod_async(plan.peers[k] + at, ip, chunk) }?;
            }
            if let Some(lane) = lane {
                stream.wait(&lane.done)?;
                forked.set(false);
            }
            barrier()
        };
        // Work queued after the first barrier and then failing leaves the peers in a call this
        // rank cannot finish: the team is not usable after that. A fork is joined back even
        // then: the second stream's work must not outlive the call behind the caller's back,
        // and in a capture an unjoined fork fails the capture's end.
        queue().map_err(|e| {
            if forked.get() {
                let _ = lane
                    .done
                    .record(&lane.stream)
                    .and_then(|()| stream.wait(&lane.done));
            }
            inner.ranks.break_with(e)
        })?;
        Ok(choice)
    }

    fn collective(&self, call: Call<'_>, stream: StreamRef<'_>) -> Result<Choice> {
        let inner = &*self.comm.inner;
        let (n, c, l) = (inner.ranks.n, &inner.config, self.local);
        if !stream.device().driver().same_as(l.device.driver()) || stream.device() != &l.device {
            self.check_stream(&stream)?;
        }
        inner.ranks.usable()?;
        let es = call.dtype.size();
        let ip = self.check_operand(&call.input, call.names[0], es)?;
        let op_ = self.check_operand(&call.output, call.names[1], es)?;
        if call.root >= n {
            return Err(Error::invalid(
                "root",
                format!("{}; the team has ranks 0 to {}", call.root, n - 1),
            ));
        }
        let (ib, ob) = (call.input.bytes as u64, call.output.bytes as u64);
        let overlap = ip < op_ + ob && op_ < ip + ib && ib > 0 && ob > 0;
        let rank = l.rank as u64;
        // the one overlap each collective allows: its in-place form
        let in_place = match call.coll {
            Collective::ReduceScatter => op_ == ip + rank * ob,
            Collective::AllGather => ip == op_ + rank * ib,
            Collective::Broadcast => ip == op_,
        };
        if overlap && !in_place {
            return Err(Error::invalid(
                "output",
                match call.coll {
                    Collective::ReduceScatter => "overlaps the input other than as its chunk of this rank (in place: reduce_scatter_in_place)",
                    Collective::AllGather => "overlaps the input other than with the input as this rank's chunk (in place: all_gather_in_place)",
                    Collective::Broadcast => "overlaps the input without being the same range (in place: broadcast_in_place)",
                },
            ));
        }
        let chunk = match call.coll {
            Collective::ReduceScatter => call.output.bytes,
            _ => call.input.bytes,
        };
        let count = (chunk / es) as u64;
        // The whole buffer: reduce-scatter's input, all-gather's output, broadcast's message.
        let total = call.output.bytes.max(call.input.bytes);
        // multimem: where the communicator has a multicast team and the policy wants it for
        // this size (the allreduce's rule), through the team's regions, any operand kind
        if let Some(mm) = inner.mm_for_gather(call.coll, call.dtype, call.op, total) {
            let _end = self.check_stream(&stream)?;
            if chunk == 0 {
                return Ok(mm.gather_shape(c, call.coll, 0));
            }
            inner.ranks.next_call(l);
            return mm.run_gather(
                c, l.rank, call.coll, call.dtype, call.op, call.root, ip, op_, chunk, stream,
            );
        }
        // low-latency: the whole buffer up to `gather_ll_max_bytes` (broadcast:
        // `broadcast_ll_max_bytes`), and a chunk that fits a low-latency slot as 8-byte (flag,
        // word) pairs. Size only: the kernel serves any alignment, so every rank making the
        // same call makes this choice.
        let ll_max = if call.coll == Collective::Broadcast {
            c.broadcast_ll_max_bytes
        } else {
            c.gather_ll_max_bytes
        };
        let ll =
            total <= ll_max && ll_words(chunk as u64).saturating_mul(8) <= c.ll_slot_bytes() as u64;
        // direct: the output is symmetric (every rank's mapped here) and the message is above
        // the one-shot limit, where saving the local copy beats saving a barrier
        let direct = !ll
            && call.coll != Collective::ReduceScatter
            && call.output.is_sym()
            && total > c.one_shot_max(n);
        // copy engines: large buffers whose symmetric operand lets them (`ce_plan`)
        if !ll {
            if let Some(plan) = self.ce_plan(&call, op_, total) {
                let _end = self.check_stream(&stream)?;
                return self.run_ce(&call, &plan, ip, op_, chunk, in_place, stream);
            }
        }
        let algorithm = if ll {
            Algorithm::PushLl
        } else if direct {
            Algorithm::PushDirect
        } else {
            Algorithm::PushStaged
        };
        let choice = self.gather_shape(chunk, algorithm);
        let _end = self.check_stream(&stream)?;
        if chunk == 0 {
            return Ok(choice);
        }
        inner.ranks.next_call(l);
        let f = l
            .gather
            .main
            .get(&(call.coll, ll, call.dtype, call.op))
            .ok_or_else(|| {
                Error::invalid(
                    "op",
                    format!(
                        "no {} kernel for {} {}",
                        call.coll.name(),
                        call.dtype,
                        call.op
                    ),
                )
            })?;
        let (out_tab, out_id, out_off) = match (direct, call.output.place) {
            (true, Place::Sym { buf, offset, .. }) => (buf.table(l.rank)?, buf.id, offset as u64),
            _ => (0, 0, 0),
        };
        // the form: 0 staged, 1 direct, 2 low-latency (whose flags fold this header)
        let form = if ll { 2 } else { direct as u64 };
        let sig = call.header(count, form, (out_id, out_off), choice.blocks);
        // SAFETY: a function of this device's module whose entry takes these eight .u64
        // parameters (pad, in, out, count, out_tab, root, header, timeout); the operands were
        // checked to lie inside their buffers (input and output lengths in the collective's
        // ratio), the table holds N addresses of a symmetric output (direct; else 0, unread),
        // the pad, staging and low-latency slots are the communicator's (a low-latency chunk
        // fits a slot as 8-byte pairs: checked above); the stream is a live stream of this
        // device (checked).
        unsafe {
            f.launch_u64(
                &LaunchConfig::linear(choice.blocks, choice.threads),
                stream,
                &[
                    inner.p2p.pads.addrs[l.rank],
                    ip,
                    op_,
                    count,
                    out_tab,
                    call.root as u64,
                    sig,
                    c.timeout_ns(),
                ],
            )
        }?;
        Ok(choice)
    }
}
