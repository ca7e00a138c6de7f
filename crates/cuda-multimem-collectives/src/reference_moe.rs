//! The host oracle of MoE dispatch and combine ([`crate::RankHandle::moe_dispatch`],
//! [`crate::RankHandle::moe_combine`]): what every rank's plan holds after a dispatch, and what
//! every rank's combine output is, computed in the kernels' order (bit for bit).

use cuda_multimem::Result;

use crate::moe::MoeShape;
use crate::types::Element;

/// What one rank's plan holds after a dispatch ([`crate::MoePlan`]'s layout).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeDispatched {
    /// Tokens per local expert.
    pub counts: Vec<u32>,
    /// First row per local expert, then the rows in all.
    pub offsets: Vec<u32>,
    /// Where every row came from: `(s · Tmax + t) · k + j`.
    pub map: Vec<u32>,
    /// The rows' payload bytes (`offsets[L]` rows).
    pub tokens: Vec<u8>,
    /// Their scales (`offsets[L]` rows of the shape's scales per token).
    pub scales: Vec<f32>,
    /// Whether the rank's bounds word is set: an id out of range among the tokens sent to it
    /// is not seen here (the sender's bounds word), rows past `max_recv_rows` are.
    pub bounds: bool,
}

/// Whether rank `r`'s dispatch of `topk_ids` has an id neither −1 nor in range (its bounds word).
pub fn moe_ids_out_of_range(shape: &MoeShape, topk_ids: &[i32]) -> bool {
    topk_ids
        .iter()
        .any(|&e| e != -1 && (e < 0 || e as usize >= shape.num_experts))
}

/// The dispatch of every rank's `tokens` (payload bytes, `[T_r, hidden]`), `topk_ids`
/// (`[T_r, k]`) and `scales` (`[T_r, scales per token]`, empty without) on a team of `n`:
/// per rank what its plan holds.
pub fn moe_dispatch_reference(
    shape: &MoeShape,
    n: usize,
    tokens: &[&[u8]],
    topk_ids: &[&[i32]],
    scales: &[&[f32]],
) -> Result<Vec<MoeDispatched>> {
    let s = shape.sizes(n)?;
    let place = shape.placement_over(n)?;
    let mut local = vec![0u32; shape.num_experts];
    let mut per = vec![0u32; n];
    for (e, &r) in place.iter().enumerate() {
        local[e] = per[r];
        per[r] += 1;
    }
    let (k, tmax, row, sp) = (
        shape.top_k,
        shape.max_tokens_per_rank,
        s.row as usize,
        s.scales as usize,
    );
    let rows = s.rows as usize;
    let mut out = Vec::new();
    for (d, &l) in per.iter().enumerate() {
        let l = l as usize;
        // entries in (source, token, slot) order, per local expert
        let mut by: Vec<Vec<(usize, usize, usize)>> = vec![Vec::new(); l];
        for (src, ids) in topk_ids.iter().enumerate() {
            for t in 0..ids.len() / k {
                for j in 0..k {
                    let e = ids[t * k + j];
                    if e < 0 || e as usize >= shape.num_experts || place[e as usize] != d {
                        continue;
                    }
                    by[local[e as usize] as usize].push((src, t, j));
                }
            }
        }
        let mut r = MoeDispatched {
            counts: vec![0; l],
            offsets: vec![0; l + 1],
            map: Vec::new(),
            tokens: Vec::new(),
            scales: Vec::new(),
            bounds: false,
        };
        let mut at = 0usize;
        for (e, list) in by.iter().enumerate() {
            let lo = at.min(rows);
            at += list.len();
            let hi = at.min(rows);
            r.offsets[e] = lo as u32;
            r.counts[e] = (hi - lo) as u32;
            for &(src, t, j) in &list[..hi - lo] {
                r.map.push(((src * tmax + t) * k + j) as u32);
                r.tokens
                    .extend_from_slice(&tokens[src][t * row..(t + 1) * row]);
                if sp > 0 {
                    r.scales
                        .extend_from_slice(&scales[src][t * sp..(t + 1) * sp]);
                }
            }
        }
        r.offsets[l] = at.min(rows) as u32;
        r.bounds = at > rows;
        out.push(r);
    }
    Ok(out)
}

/// The combine on a team of `n`: every rank's output `[T_r, hidden]` from every rank's
/// dispatch (`dispatched`, as [`moe_dispatch_reference`] gives), its experts' outputs
/// (`expert_out[d]`, row for row with its dispatch's rows) and every rank's `topk_weights`
/// (`[T_r, k]`): `out[t] = Σ_j w[t][j] · y[t][j]` over the slots j in order that reached an
/// expert, in f32 (product rounded, then the sum), rounded once to `O`.
pub fn moe_combine_reference<Y: Element, O: Element>(
    shape: &MoeShape,
    dispatched: &[MoeDispatched],
    expert_out: &[&[Y]],
    topk_weights: &[&[f32]],
) -> Vec<Vec<O>> {
    let (k, tmax, h) = (shape.top_k, shape.max_tokens_per_rank, shape.hidden);
    // (s, t, j) -> (rank d, row i)
    let mut at = std::collections::HashMap::new();
    for (d, r) in dispatched.iter().enumerate() {
        for (i, &x) in r.map.iter().enumerate() {
            at.insert(x as usize, (d, i));
        }
    }
    topk_weights
        .iter()
        .enumerate()
        .map(|(s, w)| {
            let t_n = w.len() / k;
            let mut o = Vec::with_capacity(t_n * h);
            for t in 0..t_n {
                for c in 0..h {
                    let mut acc = 0f32;
                    for j in 0..k {
                        if let Some(&(d, i)) = at.get(&((s * tmax + t) * k + j)) {
                            acc += w[t * k + j] * expert_out[d][i * h + c].to_f32();
                        }
                    }
                    o.push(O::from_f32(acc));
                }
            }
            o
        })
        .collect()
}
