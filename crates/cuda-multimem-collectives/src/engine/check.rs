//! Every argument check of every collective, in one order for every kind: the stream, the
//! team's health, the operands (bounds, overflow-safe byte lengths, devices, alignment: one
//! address resolution, [`crate::operand::resolve`]), the length ratios, the overlap and
//! in-place rule, the root, the norm's epsilon. Nothing is queued before all of them pass.

use cuda_multimem::{Error, Result, StreamRef};

use crate::call::{A2aChecked, A2aCounts, Arg, Call, Checked, Kind, NormShape, QuantChecked};
use crate::kernels::alltoall::{MAX_BYTES, TABLE_WORDS};
use crate::kernels::norm::MAX_FP8_GROUPS;
use crate::kernels::MAX_RANKS;
use crate::operand::{resolve, Owner, Resolved};
use crate::team::{Local, Ranks};
use crate::types::{Fp8Scaling, FP8_GROUP};

/// Largest `hidden` of a norm (the row length is converted to f32 exactly by the kernels).
pub const MAX_HIDDEN: usize = 1 << 24;

/// What a call is checked against: the team, and the rank making it.
pub(crate) struct Ctx<'a> {
    pub(crate) comm: Option<u64>,
    pub(crate) ranks: &'a Ranks,
    pub(crate) local: &'a Local,
}

impl Ctx<'_> {
    fn owner(&self) -> Owner<'_> {
        Owner {
            comm: self.comm,
            rank: self.local.rank,
            device: &self.local.device,
        }
    }
}

/// Check `call`, on `stream`, for the rank of `ctx`.
pub(crate) fn check<'o>(
    call: &Call<'o>,
    ctx: &Ctx<'_>,
    stream: &StreamRef<'_>,
) -> Result<Checked<'o>> {
    let (n, rank) = (ctx.ranks.n, ctx.local.rank);
    // 1. the stream: of this rank's device and driver
    ctx.local.check_stream(stream)?;
    // 2. the team: usable (a local norm involves no peer)
    if call.kind != Kind::LocalNorm {
        ctx.ranks.usable()?;
    }
    // 3. every operand, in argument order
    let es = call.elem_size();
    let owner = ctx.owner();
    let res = |a: &Arg<'o>| resolve(&a.op, &owner, a.name, es);
    let input = call.input.as_ref().map(res).transpose()?;
    let residual = call.residual.as_ref().map(res).transpose()?;
    let weight = call.weight.as_ref().map(res).transpose()?;
    // an FP8 norm's output is e4m3 bytes; its scales f32 or u32 words
    let output = match call.quant {
        Some(_) => resolve(&call.output.op, &owner, call.output.name, 1)?,
        None => res(&call.output)?,
    };
    let quant = match &call.quant {
        Some(q) => Some(QuantChecked {
            scaling: q.scaling,
            scale: q.scale,
            scales: q
                .scales
                .as_ref()
                .map(|a| resolve(&a.op, &owner, a.name, 4))
                .transpose()?,
            unquantised: q.unquantised.as_ref().map(res).transpose()?,
        }),
        None => None,
    };
    let names = [
        call.input.as_ref().map_or(call.output.name, |a| a.name),
        call.output.name,
    ];
    // the caller's element: a bit-moving call's `T` travels as words of the kernel type
    // (`DType::carrier`), a whole number of them per element; `_dyn` byte views count in
    // elements of the type
    let unit = call.output.op.elem.max(es);
    let elems = |b: usize| b / unit;
    // 4. the length ratios (an in-place call's input or output is its buffer's chunk)
    let (input, output, norm) = match call.kind {
        Kind::AllReduce | Kind::Broadcast => {
            let i = input.unwrap_or(output);
            if i.bytes != output.bytes {
                return Err(Error::invalid(
                    "output",
                    format!(
                        "{} elements; the input has {} (both operands have the same length)",
                        elems(output.bytes),
                        elems(i.bytes)
                    ),
                ));
            }
            (i, output, None)
        }
        Kind::ReduceScatter => match input {
            Some(i) => {
                if output.bytes.checked_mul(n) != Some(i.bytes) {
                    let o = elems(output.bytes);
                    return Err(Error::invalid(
                        "input",
                        format!(
                            "{} elements; a reduce-scatter of {o} elements per rank over {n} ranks takes {n} x {o} = {} (N chunks of the output's length)",
                            elems(i.bytes),
                            o.saturating_mul(n)
                        ),
                    ));
                }
                (i, output, None)
            }
            None => {
                let c = in_place_chunk(&output, n, unit, call.output.name)?;
                (output, output.sub(rank * c, c), None)
            }
        },
        Kind::AllGather => match input {
            Some(i) => {
                if i.bytes.checked_mul(n) != Some(output.bytes) {
                    let c = elems(i.bytes);
                    return Err(Error::invalid(
                        "output",
                        format!(
                            "{} elements; an all-gather of {c} elements per rank over {n} ranks fills {n} x {c} = {} (N chunks of the input's length)",
                            elems(output.bytes),
                            c.saturating_mul(n)
                        ),
                    ));
                }
                (i, output, None)
            }
            None => {
                let c = in_place_chunk(&output, n, unit, call.output.name)?;
                (output.sub(rank * c, c), output, None)
            }
        },
        Kind::Norm | Kind::LocalNorm => {
            if !call.dtype.norms() {
                return Err(Error::invalid(
                    "dtype",
                    format!(
                        "{}: the fused norm takes f32, f16 and bf16 (the reductions take every type)",
                        call.dtype
                    ),
                ));
            }
            let args = call
                .norm
                .ok_or_else(|| Error::invalid("hidden", "a norm call without its shape"))?;
            let hidden = args.hidden;
            if hidden == 0 || hidden > MAX_HIDDEN {
                return Err(Error::invalid(
                    "hidden",
                    format!("{hidden}; expected 1 to {MAX_HIDDEN} elements per row"),
                ));
            }
            let x = input.ok_or_else(|| Error::invalid("x", "a norm call without x"))?;
            // the standalone FP8 quantisation (`quantize_fp8`): a local FP8 call without residual
            // and weight; its rows are x (no residual or weight to check)
            let quant_only = call.kind == Kind::LocalNorm
                && quant.is_some()
                && residual.is_none()
                && weight.is_none();
            let (r, w) = match (residual, weight) {
                (Some(r), Some(w)) => (r, w),
                _ if quant_only => (x, x),
                _ => return Err(Error::invalid("residual", "a norm call without residual")),
            };
            // hidden <= 2^24 and es <= 8: no overflow
            let row_bytes = hidden * es;
            let xl = elems(x.bytes);
            if x.bytes % row_bytes != 0 {
                return Err(Error::invalid(
                    "x",
                    format!("{xl} elements; not a whole number of rows of hidden = {hidden}"),
                ));
            }
            let tokens = x.bytes / row_bytes;
            // an FP8 output holds one byte per element
            let out_want = if quant.is_some() {
                x.bytes / es
            } else {
                x.bytes
            };
            let out_es = if quant.is_some() { 1 } else { es };
            for (arg, got, want) in [
                ("residual", r.bytes, x.bytes),
                ("out", output.bytes, out_want),
                ("weight", w.bytes, row_bytes),
            ] {
                if got != want && !(quant_only && arg != "out") {
                    let elems = |b: usize| if arg == "out" { b / out_es } else { b / es };
                    return Err(Error::invalid(
                        arg,
                        format!(
                            "{} elements; expected {} ({tokens} tokens × hidden {hidden} for residual and out, hidden for weight)",
                            elems(got),
                            elems(want)
                        ),
                    ));
                }
            }
            if let Some(q) = &quant {
                check_quant(q, [&x, &r, &w], tokens, hidden, es)?;
            }
            let shape = NormShape {
                tokens,
                hidden,
                row_bytes,
                eps: args.eps,
            };
            (x, output, Some(shape))
        }
        Kind::AllToAll => {
            let i = input.unwrap_or(output);
            for (arg, r) in [(names[0], &i), (call.output.name, &output)] {
                if r.bytes as u64 > MAX_BYTES {
                    return Err(Error::invalid(
                        arg,
                        format!("{} bytes; an all-to-all addresses at most {MAX_BYTES} bytes per buffer", r.bytes),
                    ));
                }
            }
            if matches!(call.a2a.map(|a| a.counts), Some(A2aCounts::Equal)) {
                if i.bytes % (n * es) != 0 {
                    return Err(Error::invalid(
                        names[0],
                        format!(
                            "{} elements; not a whole number of parts for {n} ranks (an all-to-all's input holds N equal parts)",
                            elems(i.bytes)
                        ),
                    ));
                }
                if i.bytes != output.bytes {
                    return Err(Error::invalid(
                        "output",
                        format!(
                            "{} elements; the input has {} (an all-to-all's output holds N parts of the input's)",
                            elems(output.bytes),
                            elems(i.bytes)
                        ),
                    ));
                }
            }
            (i, output, None)
        }
        Kind::MoeDispatch | Kind::MoeCombine => (input.unwrap_or(output), output, None),
    };
    // 5. overlap: the one overlap each collective allows is its in-place form
    let in_place = match call.kind {
        Kind::AllReduce | Kind::Broadcast => {
            let same = input.ptr == output.ptr;
            if !same && input.overlaps(&output) {
                return Err(Error::invalid(
                    "output",
                    match call.kind {
                        Kind::AllReduce => "overlaps the input without being the same range (in place needs the same range)",
                        _ => "overlaps the input without being the same range (in place: broadcast_in_place)",
                    },
                ));
            }
            same
        }
        Kind::ReduceScatter | Kind::AllGather => {
            let (big, small) = match call.kind {
                Kind::ReduceScatter => (&input, &output),
                _ => (&output, &input),
            };
            let same = small.ptr as u128 == big.ptr as u128 + (rank * small.bytes) as u128;
            if input.overlaps(&output) && !same {
                return Err(Error::invalid(
                    "output",
                    match call.kind {
                        Kind::ReduceScatter => "overlaps the input other than as its chunk of this rank (in place: reduce_scatter_in_place)",
                        _ => "overlaps the input other than with the input as this rank's chunk (in place: all_gather_in_place)",
                    },
                ));
            }
            same && input.bytes > 0
        }
        Kind::Norm | Kind::LocalNorm if quant.is_some() => {
            let q = quant.as_ref().expect("an FP8 norm");
            // read: x, weight; written: residual, out, scales, unquantised. Only unquantised
            // == x may coincide (as out == x for the plain norm). The standalone quantisation
            // has no residual and no weight.
            let mut ops: Vec<(&str, &Resolved<'_>)> = vec![("x", &input)];
            if let Some(r) = &residual {
                ops.push(("residual", r));
            }
            if let Some(w) = &weight {
                ops.push(("weight", w));
            }
            ops.push(("out", &output));
            if let Some(s) = &q.scales {
                ops.push(("scales", s));
            }
            if let Some(u) = &q.unquantised {
                ops.push(("unquantised", u));
            }
            for a in 1..ops.len() {
                for b in 0..a {
                    let ((na, ra), (nb, rb)) = (ops[a], ops[b]);
                    let reads_only = matches!((na, nb), ("weight", "x"));
                    let same_x = na == "unquantised" && nb == "x" && ra.ptr == rb.ptr;
                    if !reads_only && !same_x && ra.overlaps(rb) {
                        return Err(Error::invalid(
                            na,
                            format!(
                                "overlaps {nb}{}",
                                if na == "unquantised" && nb == "x" {
                                    " without being the same range (unquantised may be x itself)"
                                } else {
                                    ""
                                }
                            ),
                        ));
                    }
                }
            }
            false
        }
        Kind::Norm | Kind::LocalNorm => {
            let (r, w) = (residual.unwrap_or(output), weight.unwrap_or(output));
            // written: residual, out; read: x, weight. Only out == x may coincide.
            let ops: [(&str, &Resolved<'_>); 4] = [
                ("x", &input),
                ("residual", &r),
                ("weight", &w),
                ("out", &output),
            ];
            for (a, b) in [(1, 0), (1, 2), (1, 3), (3, 2), (3, 0)] {
                let (na, ra) = ops[a];
                let (nb, rb) = ops[b];
                if ra.overlaps(rb) && !((a, b) == (3, 0) && ra.ptr == rb.ptr) {
                    return Err(Error::invalid(
                        na,
                        format!(
                            "overlaps {nb}{}",
                            if b == 0 && a == 3 {
                                " without being the same range (out may be x itself)"
                            } else {
                                ""
                            }
                        ),
                    ));
                }
            }
            output.ptr == input.ptr
        }
        Kind::AllToAll => {
            let same = call.input.is_none() || input.ptr == output.ptr;
            if input.overlaps(&output) && !(same && input.bytes == output.bytes) {
                return Err(Error::invalid(
                    "output",
                    "overlaps the input without being the same range (in place: all_to_all_in_place)",
                ));
            }
            let equal = matches!(call.a2a.map(|a| a.counts), Some(A2aCounts::Equal));
            if same && input.bytes > 0 && !equal {
                return Err(Error::invalid(
                    "output",
                    "is the input: a variable all-to-all runs out of place only",
                ));
            }
            same && input.bytes > 0
        }
        // checked with the MoE arguments (step 9)
        Kind::MoeDispatch | Kind::MoeCombine => false,
    };
    // 6. the root
    if call.root >= n {
        return Err(Error::invalid(
            "root",
            format!("{}; the team has ranks 0 to {}", call.root, n - 1),
        ));
    }
    // 7. the norm's epsilon
    if let Some(s) = norm {
        if !s.eps.is_finite() || s.eps < 0.0 {
            return Err(Error::invalid(
                "eps",
                format!("{}; expected a finite value >= 0", s.eps),
            ));
        }
    }
    // 8. an all-to-all's counts and offsets
    let a2a = match call.a2a {
        None => None,
        Some(a) if a.elem == 0 || a.elem > 255 => {
            return Err(Error::invalid(
                "T",
                format!(
                    "elements of {} bytes; an all-to-all moves elements of 1 to 255 bytes",
                    a.elem
                ),
            ))
        }
        Some(a) => Some((a.elem, a2a_counts(&a.counts, n, es, &input, &output, &res)?)),
    };
    // 9. a MoE call's shape, routing operands and overlaps
    let moe = match &call.moe {
        None => None,
        Some(m) => Some(super::check_moe::check(
            m, call.kind, &input, &output, &res, n, rank,
        )?),
    };
    Ok(Checked {
        kind: call.kind,
        dtype: call.dtype,
        op: call.op,
        root: call.root,
        input,
        output,
        residual,
        weight,
        in_place,
        norm,
        quant,
        names,
        a2a,
        moe,
    })
}

/// An all-to-all's counts: the host's (every slice N long, every part inside its buffer, the
/// received parts apart) as the fill kernel's table, or the device tables resolved (`u64[N]`
/// each, apart from each other and from the operands).
fn a2a_counts<'o>(
    counts: &A2aCounts<'o>,
    n: usize,
    es: usize,
    input: &Resolved<'o>,
    output: &Resolved<'o>,
    res: &dyn Fn(&Arg<'o>) -> Result<Resolved<'o>>,
) -> Result<A2aChecked<'o>> {
    match *counts {
        A2aCounts::Equal => Ok(A2aChecked::Equal),
        A2aCounts::Host {
            send_counts,
            send_offsets,
            recv_counts,
            recv_offsets,
        } => {
            let (ie, oe) = (input.bytes / es, output.bytes / es);
            let mut table = [0u64; TABLE_WORDS];
            let lists = [
                ("send_counts", send_counts),
                ("send_offsets", send_offsets),
                ("recv_counts", recv_counts),
                ("recv_offsets", recv_offsets),
            ];
            for (row, (arg, v)) in lists.iter().enumerate() {
                if v.len() != n {
                    return Err(Error::invalid(
                        arg,
                        format!("{} entries; expected one per rank ({n})", v.len()),
                    ));
                }
                for (j, x) in v.iter().enumerate() {
                    table[row * MAX_RANKS + j] = *x as u64;
                }
            }
            let mut parts = Vec::with_capacity(n);
            for j in 0..n {
                for (cnt, off, len, cn, on, buf) in [
                    (
                        send_counts[j],
                        send_offsets[j],
                        ie,
                        "send_counts",
                        "send_offsets",
                        "input",
                    ),
                    (
                        recv_counts[j],
                        recv_offsets[j],
                        oe,
                        "recv_counts",
                        "recv_offsets",
                        "output",
                    ),
                ] {
                    if cnt > len {
                        return Err(Error::invalid(
                            cn,
                            format!("{cnt} elements for rank {j}; the {buf} has {len}"),
                        ));
                    }
                    if off.checked_add(cnt).is_none_or(|e| e > len) {
                        return Err(Error::invalid(
                            on,
                            format!("{off} for rank {j}: {cnt} elements from there pass the end of the {len}-element {buf}"),
                        ));
                    }
                }
                if recv_counts[j] > 0 {
                    parts.push((recv_offsets[j], recv_counts[j], j));
                }
            }
            parts.sort();
            for w in parts.windows(2) {
                if w[0].0 + w[0].1 > w[1].0 {
                    return Err(Error::invalid(
                        "recv_offsets",
                        format!(
                            "the parts of ranks {} and {} overlap in the output",
                            w[0].2, w[1].2
                        ),
                    ));
                }
            }
            Ok(A2aChecked::Host(table))
        }
        A2aCounts::Device {
            send_counts,
            recv_counts,
            recv_offsets,
        } => {
            let mut got: Vec<(&'static str, Resolved<'o>)> = Vec::new();
            for a in [send_counts, recv_counts, recv_offsets] {
                let r = res(&a)?;
                if r.bytes != 8 * n {
                    return Err(Error::invalid(
                        a.name,
                        format!(
                            "{} bytes; expected one u64 per rank ({} bytes)",
                            r.bytes,
                            8 * n
                        ),
                    ));
                }
                if r.ptr % 8 != 0 {
                    return Err(Error::invalid(a.name, "not 8-byte aligned"));
                }
                got.push((a.name, r));
            }
            // written: the output, recv_counts, recv_offsets; read: the input, send_counts
            // (which may share memory with the input)
            for (i, (na, ra)) in got.iter().enumerate() {
                let others = got[..i].iter().map(|(nb, rb)| (*nb, *rb));
                let ops = [("output", *output), ("input", *input)];
                for (nb, rb) in
                    others.chain(ops.into_iter().filter(|(nb, _)| i > 0 || *nb == "output"))
                {
                    if ra.overlaps(&rb) {
                        return Err(Error::invalid(na, format!("overlaps {nb}")));
                    }
                }
            }
            Ok(A2aChecked::Device {
                send_counts: got[0].1,
                recv_counts: got[1].1,
                recv_offsets: got[2].1,
            })
        }
    }
}

/// An FP8 norm's own arguments: the static scale, the group, the scales' length, the
/// unquantised rows' length, and 4-byte aligned `T` operands (the low-latency form moves
/// words, and an FP8 call does not stage misaligned operands through the scratch).
fn check_quant(
    q: &QuantChecked<'_>,
    [x, r, w]: [&Resolved<'_>; 3],
    tokens: usize,
    hidden: usize,
    es: usize,
) -> Result<()> {
    if q.scaling == Fp8Scaling::Static && !(q.scale.is_finite() && q.scale > 0.0) {
        return Err(Error::invalid(
            "scale",
            format!("{}; a static FP8 scale must be finite and > 0", q.scale),
        ));
    }
    if q.scaling.grouped() {
        if hidden % FP8_GROUP != 0 {
            return Err(Error::invalid(
                "hidden",
                format!(
                    "{hidden}; per-group FP8 scales need a multiple of the group of {FP8_GROUP}"
                ),
            ));
        }
        if hidden / FP8_GROUP > MAX_FP8_GROUPS {
            return Err(Error::invalid(
                "hidden",
                format!(
                    "{hidden}; per-group FP8 scales take at most {} elements per row ({MAX_FP8_GROUPS} groups)",
                    MAX_FP8_GROUPS * FP8_GROUP
                ),
            ));
        }
    }
    let want = q.scaling.scales_len(tokens, hidden);
    match &q.scales {
        Some(s) if s.bytes / 4 != want => {
            return Err(Error::invalid(
                "scales",
                format!(
                    "{} elements; {:?} scales of {tokens} tokens × hidden {hidden} take {want}",
                    s.bytes / 4,
                    q.scaling
                ),
            ))
        }
        None if q.scaling != Fp8Scaling::Static => {
            return Err(Error::invalid(
                "scales",
                "dynamic FP8 scales without a buffer",
            ))
        }
        _ => {}
    }
    if let Some(u) = &q.unquantised {
        if u.bytes != x.bytes {
            return Err(Error::invalid(
                "unquantised",
                format!(
                    "{} elements; expected {} ({tokens} tokens × hidden {hidden})",
                    u.bytes / es,
                    x.bytes / es
                ),
            ));
        }
    }
    let u = q.unquantised.as_ref().map_or(0, |u| u.ptr);
    for (arg, p) in [
        ("x", x.ptr),
        ("residual", r.ptr),
        ("weight", w.ptr),
        ("unquantised", u),
    ] {
        if p % 4 != 0 {
            return Err(Error::invalid(
                arg,
                format!("address {p:#x}; the FP8 norm needs 4-byte aligned operands"),
            ));
        }
    }
    Ok(())
}

/// Bytes of one chunk of an in-place buffer: a whole number of elements per rank.
fn in_place_chunk(buf: &Resolved<'_>, n: usize, es: usize, arg: &'static str) -> Result<usize> {
    if buf.bytes % (n * es) != 0 {
        return Err(Error::invalid(
            arg,
            format!(
                "{} elements; not a whole number of chunks for {n} ranks",
                buf.bytes / es
            ),
        ));
    }
    Ok(buf.bytes / n)
}
