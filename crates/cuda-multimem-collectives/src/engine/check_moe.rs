//! The checks of a MoE call beside the common ones of [`super::check`] (step 9): the plan
//! belongs to the team and drives this rank, the tokens fit the plan (T ≤ max tokens per rank),
//! `topk_ids` and `topk_weights` hold T × k, the scales T × scales per token (and none where the
//! shape has none), the expert outputs the plan's rows, the output type and alignment, no
//! operand overlapping another. Values only the device sees (expert ids) are the kernels' to
//! check (the bounds word).

use cuda_multimem::{Error, Result};

use crate::call::{Arg, Kind, MoeArgs, MoeChecked};
use crate::operand::Resolved;
use crate::types::DType;

/// Check MoE call `m` of `kind` with its resolved `input` and `output` (bytes).
pub(crate) fn check<'o>(
    m: &MoeArgs<'o>,
    kind: Kind,
    input: &Resolved<'o>,
    output: &Resolved<'o>,
    res: &dyn Fn(&Arg<'o>) -> Result<Resolved<'o>>,
    n: usize,
    rank: usize,
) -> Result<MoeChecked<'o>> {
    let plan = m.plan;
    let (s, sh) = (&plan.sizes, &plan.shape);
    if s.n as usize != n {
        return Err(Error::invalid(
            "plan",
            format!("built for {} ranks; this team has {n}", s.n),
        ));
    }
    plan.part(rank)
        .map_err(|_| Error::invalid("plan", format!("holds no buffers of rank {rank}")))?;
    let k = sh.top_k;
    let aligned = |r: &Resolved<'_>, arg: &'static str, a: u64| {
        if r.ptr % a != 0 {
            Err(Error::invalid(
                arg,
                format!("at {:#x}; the MoE kernels need {a}-byte alignment", r.ptr),
            ))
        } else {
            Ok(())
        }
    };
    let len = |r: &Resolved<'_>, arg: &'static str, es: usize, want: usize, what: &str| {
        if r.bytes != want * es {
            Err(Error::invalid(
                arg,
                format!("{} elements; expected {want} ({what})", r.bytes / es),
            ))
        } else {
            Ok(())
        }
    };
    let tokens_of = |r: &Resolved<'_>, arg: &'static str, row: usize| -> Result<usize> {
        if r.bytes % row != 0 {
            return Err(Error::invalid(
                arg,
                format!(
                    "{} bytes; not a whole number of rows of hidden = {} ({row} bytes)",
                    r.bytes, sh.hidden
                ),
            ));
        }
        let t = r.bytes / row;
        if t > sh.max_tokens_per_rank {
            return Err(Error::invalid(
                arg,
                format!(
                    "{t} tokens; the plan takes at most max_tokens_per_rank = {}",
                    sh.max_tokens_per_rank
                ),
            ));
        }
        Ok(t)
    };
    match kind {
        Kind::MoeDispatch => {
            let t = tokens_of(input, "tokens", s.row as usize)?;
            aligned(input, "tokens", 16)?;
            let ids = res(m
                .ids
                .as_ref()
                .ok_or_else(|| Error::invalid("topk_ids", "missing"))?)?;
            let w = res(m
                .weights
                .as_ref()
                .ok_or_else(|| Error::invalid("topk_weights", "missing"))?)?;
            len(
                &ids,
                "topk_ids",
                4,
                t * k,
                &format!("{t} tokens × top_k {k}"),
            )?;
            len(
                &w,
                "topk_weights",
                4,
                t * k,
                &format!("{t} tokens × top_k {k}"),
            )?;
            aligned(&ids, "topk_ids", 4)?;
            aligned(&w, "topk_weights", 4)?;
            let sc = m.scales.as_ref().map(res).transpose()?;
            let per = s.scales as usize;
            match (&sc, per) {
                (None, 0) => {}
                (Some(_), 0) => {
                    return Err(Error::invalid(
                        "scales",
                        "given, but the plan's shape has no scales (MoeScales::None)",
                    ))
                }
                (None, _) => {
                    return Err(Error::invalid(
                        "scales",
                        format!("missing; the plan's shape has {per} per token"),
                    ))
                }
                (Some(r), _) => {
                    len(
                        r,
                        "scales",
                        4,
                        t * per,
                        &format!("{t} tokens × {per} scales per token"),
                    )?;
                    aligned(r, "scales", 4)?;
                }
            }
            let mut ops = vec![("tokens", *input), ("topk_ids", ids), ("topk_weights", w)];
            if let Some(r) = sc {
                ops.push(("scales", r));
            }
            apart(&ops)?;
            Ok(MoeChecked {
                plan,
                tokens: t,
                ids: Some(ids),
                weights: Some(w),
                scales: sc,
                out: DType::U8,
            })
        }
        _ => {
            if !matches!(m.out, DType::F32 | DType::Bf16 | DType::F16) {
                return Err(Error::invalid(
                    "out",
                    format!("{:?} elements; the combine writes f32, bf16 or f16", m.out),
                ));
            }
            let t = tokens_of(output, "out", sh.hidden * m.out.size())?;
            len(
                input,
                "expert_out",
                sh.expert_out.size(),
                s.rows as usize * sh.hidden,
                &format!(
                    "the plan's {} rows × hidden {} of {:?} (MoeShape::expert_out)",
                    s.rows, sh.hidden, sh.expert_out
                ),
            )?;
            aligned(input, "expert_out", 16)?;
            aligned(output, "out", m.out.size() as u64)?;
            apart(&[("expert_out", *input), ("out", *output)])?;
            Ok(MoeChecked {
                plan,
                tokens: t,
                ids: None,
                weights: None,
                scales: None,
                out: m.out,
            })
        }
    }
}

/// No two of `ops` overlap (the later one named).
fn apart(ops: &[(&'static str, Resolved<'_>)]) -> Result<()> {
    for a in 1..ops.len() {
        for b in 0..a {
            if ops[a].1.overlaps(&ops[b].1) {
                return Err(Error::invalid(ops[a].0, format!("overlaps {}", ops[b].0)));
            }
        }
    }
    Ok(())
}
