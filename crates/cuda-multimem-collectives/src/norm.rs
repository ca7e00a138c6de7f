//! Fused allreduce + residual add + RMSNorm (`RankHandle::all_reduce_add_rms_norm`), the
//! transformer decode step that follows every tensor-parallel layer, and its unfused baseline
//! (`RankHandle::add_rms_norm`). The protocol, where it rounds, and what each operand kind
//! costs: `docs/design/rmsnorm.md`.

use std::collections::HashMap;

use cuda_multimem::{Device, Error, Function, LaunchConfig, Module, Result, StreamRef};

use crate::comm::{Communicator, RankHandle};
use crate::kernels::norm::{self as nk, NormKernel};
use crate::kernels::{self, MAX_BLOCKS};
use crate::operand::{Dst, Operand, Src};
use crate::types::{Algorithm, Choice, DType, Element, Path};

/// The norm kernels of one device (loaded with the communicator, so that a first call inside a
/// graph capture loads nothing).
pub(crate) struct NormKernels {
    fused: HashMap<(NormKernel, DType), Function>,
    unfused: HashMap<DType, Function>,
    multiprocessors: u32,
}

/// Load the norm kernels on `device`.
pub(crate) fn load_kernels(device: &Device) -> Result<NormKernels> {
    let m = Module::load_ptx(device, nk::PTX)?;
    let mut fused = HashMap::new();
    let mut unfused = HashMap::new();
    for dt in DType::ALL {
        for k in NormKernel::ALL {
            fused.insert((k, dt), m.function(&k.entry(dt))?);
        }
        unfused.insert(dt, m.function(&nk::unfused_entry(dt))?);
    }
    Ok(NormKernels {
        fused,
        unfused,
        multiprocessors: device.multiprocessor_count()?.max(1) as u32,
    })
}

/// Largest `hidden` (the row length is converted to f32 exactly by the kernels).
pub const MAX_HIDDEN: usize = 1 << 24;

/// The checked shape of a call: rows, row bytes.
struct Shape {
    tokens: usize,
    row_bytes: usize,
}

fn form_name(k: NormKernel) -> Algorithm {
    match k {
        NormKernel::OneShot => Algorithm::OneShot,
        NormKernel::TwoShot => Algorithm::TwoShotPush,
        NormKernel::OneShotLl | NormKernel::OneShotLlSplit => Algorithm::OneShotLl,
        NormKernel::OneShotSplit => Algorithm::OneShot,
    }
}

/// Threads per block: one per unit of a row (16-byte vectors, or elements when a row or an
/// operand is not 16-byte aligned), a multiple of 32 from 64 to 1024.
fn threads_for(row_bytes: usize, es: usize) -> u32 {
    let units = if row_bytes % 16 == 0 {
        row_bytes / 16
    } else {
        row_bytes / es
    };
    units.next_multiple_of(32).clamp(64, 1024) as u32
}

impl Communicator {
    /// What [`RankHandle::all_reduce_add_rms_norm`] runs for `tokens` rows of `hidden`
    /// elements of `dtype` on 4-byte aligned operands: the form (the low-latency one-shot up
    /// to `norm_ll_max_bytes` when a row is whole 4-byte words; else one-shot for teams of up
    /// to 3, and up to the one-shot limit for larger teams; else two-shot —
    /// docs/design/rmsnorm.md says why) and the launch shape of its first launch.
    /// `staged_chunks` is 0: the operands are always used in place.
    pub fn add_rms_norm_choice(
        &self,
        dtype: DType,
        tokens: usize,
        hidden: usize,
    ) -> Result<Choice> {
        let row_bytes = hidden
            .checked_mul(dtype.size())
            .filter(|_| hidden > 0 && hidden <= MAX_HIDDEN)
            .ok_or_else(|| {
                Error::invalid("hidden", format!("{hidden}; expected 1 to {MAX_HIDDEN}"))
            })?;
        let bytes = tokens.saturating_mul(row_bytes);
        let mp = self.inner.ranks.locals[0].norm.multiprocessors;
        let k = self.norm_form(bytes, self.norm_ll_fits(bytes, row_bytes, 0));
        let k = self.norm_split(k, tokens, row_bytes, mp);
        let (rows, _) = self.norm_launch_rows(k, tokens, row_bytes)?;
        Ok(self.norm_shape(k, rows, row_bytes, dtype.size(), mp))
    }

    /// Whether the low-latency one-shot can run a call of `bytes` in rows of `row_bytes`
    /// whose operand addresses, or-ed together, are `addrs`: whole aligned 4-byte words, and
    /// at most `norm_ll_max_bytes` and what a low-latency slot holds (two bytes per data byte).
    fn norm_ll_fits(&self, bytes: usize, row_bytes: usize, addrs: u64) -> bool {
        let c = &self.inner.config;
        let limit = c.norm_ll_max_bytes.min(c.ll_slot_bytes() / 2);
        row_bytes % 4 == 0 && addrs % 4 == 0 && bytes <= limit
    }

    /// The form for a call of `bytes`; `ll`: the low-latency one-shot can run it.
    fn norm_form(&self, bytes: usize, ll: bool) -> NormKernel {
        let c = &self.inner.config;
        let n = self.inner.ranks.n;
        match c.algorithm {
            Some(Algorithm::OneShotLl) if ll => NormKernel::OneShotLl,
            Some(Algorithm::OneShot | Algorithm::OneShotLl) => NormKernel::OneShot,
            Some(_) => NormKernel::TwoShot,
            None => {
                // One-shot moves (N-1)·M bytes out of every rank, the two-shot 3(N-1)/N·M (x to
                // the owners, then residual_out and out back): one-shot moves no more up to 3
                // ranks, and has one barrier instead of three. The low-latency one-shot (twice
                // the bytes, no barrier) below its own limit, inside the one-shot's.
                let limit = match c.one_shot_max_bytes {
                    Some(b) => b,
                    None if n <= 3 => usize::MAX,
                    None => c.one_shot_max(n),
                };
                if bytes > limit {
                    NormKernel::TwoShot
                } else if ll {
                    NormKernel::OneShotLl
                } else {
                    NormKernel::OneShot
                }
            }
        }
    }

    /// Most blocks of a norm launch: `config.max_blocks`, else two per multiprocessor (at most
    /// `MAX_BLOCKS`).
    fn norm_max_blocks(&self, mp: u32) -> usize {
        match self.inner.config.max_blocks {
            0 => (2 * mp).min(MAX_BLOCKS as u32) as usize,
            b => b as usize,
        }
    }

    /// The one-shot forms with rows cut over clusters of `SPLIT` blocks, where they run and
    /// rows are at least `SPLIT_MIN_ROW_BYTES` long and `tokens × SPLIT` blocks fit the
    /// grid (the same on every rank: sizes and configuration only); else `k`. No rows, no
    /// clusters: a launch shape of `0 × SPLIT` blocks is none.
    fn norm_split(&self, k: NormKernel, tokens: usize, row_bytes: usize, mp: u32) -> NormKernel {
        let max_blocks = self.norm_max_blocks(mp);
        let fits = tokens
            .checked_mul(nk::SPLIT)
            .is_some_and(|b| b > 0 && b <= max_blocks);
        match k {
            NormKernel::OneShotLl if row_bytes >= nk::SPLIT_MIN_ROW_BYTES && fits => {
                NormKernel::OneShotLlSplit
            }
            NormKernel::OneShot if row_bytes >= nk::SPLIT_MIN_ROW_BYTES && fits => {
                NormKernel::OneShotSplit
            }
            _ => k,
        }
    }

    /// Rows per launch of form `k` (the staging holds one launch) and the first launch's rows.
    fn norm_launch_rows(
        &self,
        k: NormKernel,
        tokens: usize,
        row_bytes: usize,
    ) -> Result<(usize, usize)> {
        let half = self.inner.p2p.stage_half;
        let n = self.inner.ranks.n;
        if !matches!(k, NormKernel::OneShotLl | NormKernel::OneShotLlSplit) && 2 * row_bytes > half
        {
            return Err(Error::invalid(
                "hidden",
                format!(
                    "rows of {row_bytes} bytes; the staging slots hold {half} bytes and a row must fit twice (raise config.stage_bytes)"
                ),
            ));
        }
        let cap = match k {
            NormKernel::OneShot | NormKernel::OneShotSplit => half / row_bytes,
            NormKernel::TwoShot => n * (half / (2 * row_bytes)),
            // one launch: the call fits a low-latency slot (norm_ll_fits), and for the split
            // form its rows × SPLIT blocks fit the grid (norm_split)
            NormKernel::OneShotLl | NormKernel::OneShotLlSplit => tokens.max(1),
        };
        Ok((tokens.min(cap), cap))
    }

    fn norm_shape(
        &self,
        k: NormKernel,
        rows: usize,
        row_bytes: usize,
        es: usize,
        mp: u32,
    ) -> Choice {
        let n = self.inner.ranks.n;
        let max_blocks = self.norm_max_blocks(mp);
        if matches!(k, NormKernel::OneShotLlSplit | NormKernel::OneShotSplit) {
            // a slice's units: 16-byte vectors, or its elements when rows are not 16-byte
            // multiples
            let per16 = nk::split_units(row_bytes.div_ceil(16) as u64) as usize;
            let slice = if row_bytes % 16 == 0 {
                per16
            } else {
                per16 * 16 / es
            };
            return Choice {
                path: Path::PeerToPeer,
                algorithm: form_name(k),
                blocks: (rows * nk::SPLIT) as u32,
                threads: slice.next_multiple_of(32).clamp(64, 1024) as u32,
                staged_chunks: 0,
            };
        }
        let per_block = match k {
            NormKernel::OneShot
            | NormKernel::OneShotLl
            | NormKernel::OneShotLlSplit
            | NormKernel::OneShotSplit => rows,
            NormKernel::TwoShot => nk::part_rows(rows as u64, n as u64) as usize,
        };
        Choice {
            path: Path::PeerToPeer,
            algorithm: form_name(k),
            blocks: per_block.clamp(1, max_blocks) as u32,
            threads: threads_for(row_bytes, es),
            staged_chunks: 0,
        }
    }
}

impl<'a> RankHandle<'a> {
    /// Fused allreduce + residual add + RMSNorm, queued on `stream`: with `x` this rank's
    /// partial sums (`tokens × hidden`), `residual` holding r on entry, per row
    ///
    /// `residual_out = allreduce_sum(x) + r` (written into `residual`), and
    /// `out = residual_out / sqrt(mean(residual_out²) + eps) · weight`.
    ///
    /// The sum is accumulated in f32 in rank order, r added in f32, residual_out rounded once
    /// to `T`; the norm reads the rounded residual_out ([`crate::add_rms_norm_reference`] rounds
    /// at the same points: residual_out is bit-exact, `out` within the sum-of-squares order).
    /// Every rank passes the same r and weight (replicated, as in tensor parallelism).
    /// Operands: symmetric buffers or the caller's own memory alike, used in place (the data
    /// travel through the communicator's staging). `out` may be `x` itself (the same range);
    /// no other operands may overlap. Checked before any launch: lengths (`x`, `residual`,
    /// `out` of `tokens × hidden`, `weight` of `hidden`), `hidden` > 0, `eps` finite and ≥ 0,
    /// element alignment, devices, the stream. Returns the form and launch shape.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_add_rms_norm<'s, 'r, 'w, 'o, 'x, T: Element>(
        &self,
        x: impl Into<Src<'s, T>>,
        residual: impl Into<Dst<'r, T>>,
        weight: impl Into<Src<'w, T>>,
        out: impl Into<Dst<'o, T>>,
        hidden: usize,
        eps: f32,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<Choice> {
        let (x, r, w, o) = (x.into(), residual.into(), weight.into(), out.into());
        let stream = stream.into();
        let inner = &*self.comm.inner;
        let (shape, ptrs) = self.check_norm::<T>(
            &x.op, x.len, &r.op, r.len, &w.op, w.len, &o.op, o.len, hidden, eps,
        )?;
        let _end = self.check_stream(&stream)?;
        inner.ranks.usable()?;
        let es = T::DTYPE.size();
        let n = inner.ranks.n;
        let rb = shape.row_bytes;
        let bytes = shape.tokens * rb;
        let addrs = ptrs.iter().fold(0, |a, p| a | p);
        let nkk = &self.local.norm;
        let k = self
            .comm
            .norm_form(bytes, self.comm.norm_ll_fits(bytes, rb, addrs));
        let k = self
            .comm
            .norm_split(k, shape.tokens, rb, nkk.multiprocessors);
        let (first_rows, cap) = self.comm.norm_launch_rows(k, shape.tokens, rb)?;
        let first = self
            .comm
            .norm_shape(k, first_rows, rb, es, nkk.multiprocessors);
        if shape.tokens == 0 {
            return Ok(first);
        }
        inner.ranks.next_call(self.local);
        let f = nkk.fused.get(&(k, T::DTYPE)).ok_or_else(|| {
            Error::invalid("dtype", format!("no {k:?} norm kernel for {}", T::DTYPE))
        })?;
        let pad = inner.p2p.pads.addrs[self.local.rank];
        let [xp, rp, wp, op] = ptrs;
        let mut row0 = 0;
        while row0 < shape.tokens {
            let rows = cap.min(shape.tokens - row0);
            let ch = self.comm.norm_shape(k, rows, rb, es, nkk.multiprocessors);
            let at = (row0 * rb) as u64;
            let sig = kernels::call_header(&[
                k.header_code(),
                rows as u64,
                hidden as u64,
                T::DTYPE.code(),
                eps.to_bits() as u64,
                ch.blocks as u64,
                ch.threads as u64,
                n as u64,
            ]);
            // SAFETY: a function of this device's norm module whose entry takes these ten .u64
            // parameters (docs in kernels::norm); x, residual and out hold `tokens × hidden`
            // elements and weight `hidden` (checked), this launch touches rows [row0, row0 +
            // rows) of them; the pad and the staging it names are this communicator's, and a
            // launch's rows fit the staging (norm_launch_rows); the stream is a live stream of
            // this rank's device (checked).
            unsafe {
                f.launch_u64(
                    &LaunchConfig::linear(ch.blocks, ch.threads),
                    stream,
                    &[
                        pad,
                        xp + at,
                        rp + at,
                        wp,
                        op + at,
                        rows as u64,
                        hidden as u64,
                        sig,
                        inner.config.timeout_ns(),
                        eps.to_bits() as u64,
                    ],
                )
            }?;
            row0 += rows;
        }
        Ok(first)
    }

    /// The unfused baseline: residual add + RMSNorm of an already reduced `x` (what an engine
    /// runs after a plain allreduce), on this rank's device only, with the rounding points and
    /// checks of [`RankHandle::all_reduce_add_rms_norm`]. One block per row.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm<'s, 'r, 'w, 'o, 'x, T: Element>(
        &self,
        x: impl Into<Src<'s, T>>,
        residual: impl Into<Dst<'r, T>>,
        weight: impl Into<Src<'w, T>>,
        out: impl Into<Dst<'o, T>>,
        hidden: usize,
        eps: f32,
        stream: impl Into<StreamRef<'x>>,
    ) -> Result<()> {
        let (x, r, w, o) = (x.into(), residual.into(), weight.into(), out.into());
        let stream = stream.into();
        let (shape, [xp, rp, wp, op]) = self.check_norm::<T>(
            &x.op, x.len, &r.op, r.len, &w.op, w.len, &o.op, o.len, hidden, eps,
        )?;
        stream_of_device(self, &stream)?;
        if shape.tokens == 0 {
            return Ok(());
        }
        let nkk = &self.local.norm;
        let f = nkk.unfused.get(&T::DTYPE).ok_or_else(|| {
            Error::invalid("dtype", format!("no add_rms_norm kernel for {}", T::DTYPE))
        })?;
        let blocks = shape.tokens.min(65535) as u32;
        let threads = threads_for(shape.row_bytes, T::DTYPE.size());
        // SAFETY: a function of this device's norm module taking these seven .u64 parameters;
        // the operands hold `tokens × hidden` (weight `hidden`) elements (checked); a live
        // stream of this device (checked).
        unsafe {
            f.launch_u64(
                &LaunchConfig::linear(blocks, threads),
                stream,
                &[
                    xp,
                    rp,
                    wp,
                    op,
                    shape.tokens as u64,
                    hidden as u64,
                    eps.to_bits() as u64,
                ],
            )
        }
    }

    /// Check the four operands of a norm call; their addresses on this rank.
    #[allow(clippy::too_many_arguments)]
    fn check_norm<T: Element>(
        &self,
        x: &Operand<'_>,
        xl: usize,
        r: &Operand<'_>,
        rl: usize,
        w: &Operand<'_>,
        wl: usize,
        o: &Operand<'_>,
        ol: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<(Shape, [u64; 4])> {
        if hidden == 0 || hidden > MAX_HIDDEN {
            return Err(Error::invalid(
                "hidden",
                format!("{hidden}; expected 1 to {MAX_HIDDEN} elements per row"),
            ));
        }
        if !eps.is_finite() || eps < 0.0 {
            return Err(Error::invalid(
                "eps",
                format!("{eps}; expected a finite value >= 0"),
            ));
        }
        let es = T::DTYPE.size();
        if xl % hidden != 0 {
            return Err(Error::invalid(
                "x",
                format!("{xl} elements; not a whole number of rows of hidden = {hidden}"),
            ));
        }
        let tokens = xl / hidden;
        for (arg, len, want) in [
            ("residual", rl, xl),
            ("out", ol, xl),
            ("weight", wl, hidden),
        ] {
            if len != want {
                return Err(Error::invalid(
                    arg,
                    format!("{len} elements; expected {want} ({tokens} tokens × hidden {hidden} for residual and out, hidden for weight)"),
                ));
            }
        }
        let mut bytes = [0usize; 4];
        for (i, (arg, len)) in [("x", xl), ("residual", rl), ("weight", wl), ("out", ol)]
            .into_iter()
            .enumerate()
        {
            bytes[i] = len.checked_mul(es).ok_or_else(|| {
                Error::invalid(
                    arg,
                    format!("{len} elements of {es} bytes: the byte length overflows"),
                )
            })?;
        }
        let ops = [x, r, w, o];
        let names = ["x", "residual", "weight", "out"];
        let mut ptrs = [0u64; 4];
        for i in 0..4 {
            let op = Operand {
                bytes: bytes[i],
                ..*ops[i]
            };
            ptrs[i] = self.check_operand(&op, names[i], es)?;
        }
        // written: residual (1), out (3); read: x (0), weight (2). Only out == x may coincide.
        let overlap = |a: usize, b: usize| {
            let (pa, pb) = (ptrs[a], ptrs[b]);
            bytes[a] > 0 && bytes[b] > 0 && pa < pb + bytes[b] as u64 && pb < pa + bytes[a] as u64
        };
        for (a, b) in [(1, 0), (1, 2), (1, 3), (3, 2), (3, 0)] {
            if overlap(a, b) && !((a, b) == (3, 0) && ptrs[3] == ptrs[0]) {
                return Err(Error::invalid(
                    names[a],
                    format!(
                        "overlaps {}{}",
                        names[b],
                        if b == 0 && a == 3 {
                            " without being the same range (out may be x itself)"
                        } else {
                            ""
                        }
                    ),
                ));
            }
        }
        Ok((
            Shape {
                tokens,
                row_bytes: hidden * es,
            },
            ptrs,
        ))
    }
}

/// The stream must be of this rank's device (the unfused kernel is local: any stream of it).
fn stream_of_device(h: &RankHandle<'_>, stream: &StreamRef<'_>) -> Result<()> {
    let d = h.device();
    if !stream.device().driver().same_as(d.driver()) || stream.device() != d {
        return Err(Error::invalid(
            "stream",
            format!(
                "a stream of device {}; rank {} is device {}",
                stream.device().ordinal(),
                h.rank(),
                d.ordinal()
            ),
        ));
    }
    Ok(())
}
