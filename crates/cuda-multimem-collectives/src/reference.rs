//! Host references and test data: what the kernels compute, computed on the host.

use crate::types::{DType, Element, ReduceOp};

/// The next value of the xorshift generator whose state is `state` (non-zero; it advances),
/// in [-1, 1): the one generator of the tests, examples and benchmarks.
pub fn next_random(state: &mut u64) -> f32 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// `count` random elements in [-1, 1) from the generator whose state is `state`.
pub fn random_input<T: Element>(count: usize, state: &mut u64) -> Vec<T> {
    (0..count)
        .map(|_| T::from_f32(next_random(state)))
        .collect()
}

/// `count` random elements of `dtype` as raw little-endian bytes (the same values as
/// [`random_input`] with the same state).
///
/// # Panics
/// If `count` elements of `dtype` overflow `usize` or cannot be allocated (as
/// [`Vec::with_capacity`]).
pub fn random_bytes(dtype: DType, count: usize, state: &mut u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(count.saturating_mul(dtype.size()));
    for _ in 0..count {
        dtype.store(&mut v, next_random(state));
    }
    v
}

/// Reduce `inputs` (one slice per rank, equal lengths) in rank order, accumulating in f32 and
/// rounding once, as the peer-to-peer kernels do: the host reference for tests and examples.
/// The length is the first input's; longer inputs are read up to it.
///
/// # Panics
/// If an input is shorter than the first.
pub fn reference<T: Element>(op: ReduceOp, inputs: &[&[T]]) -> Vec<T> {
    let n = inputs.first().map_or(0, |i| i.len());
    (0..n)
        .map(|e| {
            let acc = inputs[1..]
                .iter()
                .fold(inputs[0][e].to_f32(), |acc, x| op.apply(acc, x[e].to_f32()));
            T::from_f32(op.finish(acc, inputs.len()))
        })
        .collect()
}

/// Reduce-scatter on the host: `inputs[k]` is rank k's input of N chunks (N = `inputs.len()`,
/// equal lengths, a multiple of N); element r of the result is what rank r's output holds: the
/// reduction of chunk r of every input, in rank order, as [`reference()`]. The chunk is the
/// first input's length divided by N (rounded down).
///
/// # Panics
/// If an input is shorter than the first's whole chunks.
pub fn reduce_scatter_reference<T: Element>(op: ReduceOp, inputs: &[&[T]]) -> Vec<Vec<T>> {
    let n = inputs.len();
    let chunk = inputs.first().map_or(0, |i| i.len() / n.max(1));
    (0..n)
        .map(|r| {
            let parts: Vec<&[T]> = inputs
                .iter()
                .map(|x| &x[r * chunk..(r + 1) * chunk])
                .collect();
            reference(op, &parts)
        })
        .collect()
}

/// All-gather on the host: every rank's output is the inputs one after another, in rank order.
pub fn all_gather_reference<T: Clone>(inputs: &[&[T]]) -> Vec<T> {
    inputs.iter().flat_map(|x| x.iter().cloned()).collect()
}

/// Broadcast on the host: every rank's output is the root's input.
///
/// # Panics
/// If `root` is not an index of `inputs` (`root >= inputs.len()`).
pub fn broadcast_reference<T: Clone>(inputs: &[&[T]], root: usize) -> Vec<T> {
    inputs[root].to_vec()
}

/// [`reference()`] on raw little-endian bytes of `dtype` (whole elements of the first input).
///
/// # Panics
/// If an input is shorter than the first's whole elements.
pub fn reference_bytes(dtype: DType, op: ReduceOp, inputs: &[&[u8]]) -> Vec<u8> {
    let n = inputs.first().map_or(0, |i| i.len() / dtype.size());
    let mut out = Vec::with_capacity(n * dtype.size());
    for e in 0..n {
        let acc = inputs[1..].iter().fold(dtype.load(inputs[0], e), |acc, x| {
            op.apply(acc, dtype.load(x, e))
        });
        dtype.store(&mut out, op.finish(acc, inputs.len()));
    }
    out
}

/// The host reference of [`crate::RankHandle::all_reduce_add_rms_norm`]: `inputs` (one slice of
/// `tokens × hidden` per rank), the residual `r`, the weight `gamma` (`hidden`); returns
/// `(residual_out, out)`. It rounds where the kernels do (docs/design/rmsnorm.md):
///
/// * `s = x_0 + x_1 + ... + x_{N-1}` in f32, in rank order (16-bit inputs widened exactly);
/// * `residual_out = T(s + r)`: the reduced value is never rounded to `T` on its own; the sum
///   with r (in f32) is rounded once;
/// * the norm reads the *rounded* residual_out (what a separate kernel reading residual_out
///   would see): `ms = Σ v² / hidden` in f32, `rstd = 1 / sqrt(ms + eps)` (both correctly
///   rounded), `out = T((v · rstd) · γ)` (two f32 products, one rounding to `T`).
///
/// residual_out is exact against the kernels. The kernels add the squares in another order (per
/// thread, then a warp butterfly, then across warps), so `out` may differ from this reference
/// by the f32 rounding of that sum (relative ~hidden·2⁻²⁴ at worst, in practice a few ulps of
/// f32) — at most one step of `T` for 16-bit types: compare `out` with
/// [`rms_norm_within_tolerance`]. The rows are the whole rows of `r` (none when `hidden` is 0).
///
/// # Panics
/// If there is at least one row and `inputs` is empty, an input is shorter than `r`'s whole
/// rows, or `gamma` is shorter than `hidden`.
pub fn add_rms_norm_reference<T: Element>(
    inputs: &[&[T]],
    r: &[T],
    gamma: &[T],
    hidden: usize,
    eps: f32,
) -> (Vec<T>, Vec<T>) {
    let len = r.len();
    let mut res = Vec::with_capacity(len);
    let mut out = Vec::with_capacity(len);
    for row in 0..len / hidden.max(1) {
        let at = row * hidden;
        let mut ss = 0f32;
        for j in 0..hidden {
            let s = inputs[1..]
                .iter()
                .fold(inputs[0][at + j].to_f32(), |acc, x| {
                    acc + x[at + j].to_f32()
                });
            let v = T::from_f32(s + r[at + j].to_f32());
            let f = v.to_f32();
            ss += f * f;
            res.push(v);
        }
        let rstd = rms_scale(ss, hidden, eps);
        for j in 0..hidden {
            out.push(T::from_f32(res[at + j].to_f32() * rstd * gamma[j].to_f32()));
        }
    }
    (res, out)
}

/// `1 / sqrt(sum_of_squares / hidden + eps)`, correctly rounded at each step as the kernels
/// compute it (`div.rn`, `add.rn`, `sqrt.rn`, `rcp.rn`).
pub fn rms_scale(sum_of_squares: f32, hidden: usize, eps: f32) -> f32 {
    1.0 / (sum_of_squares / hidden as f32 + eps).sqrt()
}

/// Whether `got` is within the documented tolerance of the reference `want` for an `out`
/// element of [`add_rms_norm_reference`]: one step of `T` at `want`'s magnitude plus a relative
/// 2⁻¹⁶ (the sum-of-squares order moves rstd by far less).
pub fn rms_norm_within_tolerance<T: Element>(got: T, want: T) -> bool {
    let (g, w) = (got.to_f32(), want.to_f32());
    if g.is_nan() || w.is_nan() {
        return g.is_nan() && w.is_nan();
    }
    let step = match T::DTYPE {
        DType::F32 | DType::U8 => 0.0,
        DType::F16 => w.abs().max(6.1e-5) / 1024.0,
        DType::Bf16 => w.abs().max(1e-30) / 128.0,
    };
    (g - w).abs() <= step + w.abs() / 65536.0 + f32::MIN_POSITIVE
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn add_rms_norm_reference_rounds_residual_out_once_and_normalises_it() {
        // two ranks, one row of hidden 2, f32: s = [1, 2] + [2, 2] = [3, 4], + r = [1, 0]
        let (a, b) = ([1f32, 2.0], [2f32, 2.0]);
        let (res, out) = add_rms_norm_reference(&[&a, &b], &[1.0, 0.0], &[1.0, 0.5], 2, 0.0);
        assert_eq!(res, vec![4.0, 4.0]);
        // rms of [4, 4] is 4: out = [1, 0.5]
        assert_eq!(out, vec![1.0, 0.5]);
        // bf16: the reduced 1 + 2^-8 (a tie that bf16 would round down to 1) is kept in f32,
        // so adding r = 2^-8 gives 1 + 2^-7, not 1
        let t = |v: f32| bf16::from_f32(v);
        let (a, b) = ([t(1.0)], [t(1.0 / 256.0)]);
        let (res, _) = add_rms_norm_reference(&[&a, &b], &[t(1.0 / 256.0)], &[t(1.0)], 1, 0.0);
        assert_eq!(res[0].to_f32(), 1.0078125);
        assert!(rms_norm_within_tolerance(t(1.0), t(1.0)));
        assert!(!rms_norm_within_tolerance(t(1.0), t(1.03125)));
    }

    #[test]
    fn typed_and_byte_references_agree() {
        let mut s = 7;
        let a: Vec<bf16> = random_input(100, &mut s);
        let b: Vec<bf16> = random_input(100, &mut s);
        let r = reference(ReduceOp::Sum, &[&a, &b]);
        let bytes = |v: &[bf16]| {
            v.iter()
                .flat_map(|x| x.to_bits().to_le_bytes())
                .collect::<Vec<u8>>()
        };
        let rb = reference_bytes(DType::Bf16, ReduceOp::Sum, &[&bytes(&a), &bytes(&b)]);
        assert_eq!(bytes(&r), rb);
    }

    #[test]
    fn random_bytes_match_random_input() {
        let (mut s1, mut s2) = (3, 3);
        let t: Vec<f16> = random_input(50, &mut s1);
        let b = random_bytes(DType::F16, 50, &mut s2);
        for (i, x) in t.iter().enumerate() {
            assert_eq!(x.to_bits().to_le_bytes(), b[2 * i..2 * i + 2]);
        }
    }

    #[test]
    fn sixteen_bit_rounding_is_to_nearest_even() {
        // 1 + 2^-8 lies halfway between two bf16 values; nearest even is 1.0
        assert_eq!(bf16::from_f32(1.0 + 1.0 / 256.0).to_f32(), 1.0);
        assert_eq!(
            DType::Bf16.decode(DType::Bf16.encode(1.0 + 3.0 / 256.0)),
            1.015625
        );
        // f16: 1 + 2^-11 is halfway; nearest even is 1.0
        assert_eq!(f16::from_f32(1.0 + 1.0 / 2048.0).to_f32(), 1.0);
    }

    #[test]
    fn product_and_average_round_at_the_kernels_points() {
        let (a, b, c) = ([3.0f32, -0.5], [0.25f32, 4.0], [2.0f32, 1.5]);
        assert_eq!(reference(ReduceOp::Prod, &[&a, &b, &c]), [1.5, -3.0]);
        // (1 + 2 + 4) / 3 in f32, correctly rounded once
        let avg = reference(ReduceOp::Avg, &[&[1.0f32][..], &[2.0], &[4.0]]);
        assert_eq!(avg[0].to_bits(), (7.0f32 / 3.0).to_bits());
        // bf16: (1 + 2^-8) / 2 in f32, rounded once to bf16 (the sum itself is not rounded)
        let x = [bf16::from_f32(1.0), bf16::from_f32(1.0 / 256.0)];
        let y = [bf16::from_f32(1.0 / 256.0), bf16::from_f32(0.0)];
        let r = reference(ReduceOp::Avg, &[&x, &y]);
        assert_eq!(
            r[0].to_f32(),
            bf16::from_f32((1.0 + 1.0 / 256.0) / 2.0).to_f32()
        );
        assert_eq!(r[1].to_f32(), 1.0 / 512.0);
        let bytes: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let zeros = vec![0u8; 8];
        let rb = reference_bytes(DType::F32, ReduceOp::Avg, &[&bytes, &zeros]);
        assert_eq!(
            rb,
            [0.5f32, 1.0]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>()
        );
    }
}
