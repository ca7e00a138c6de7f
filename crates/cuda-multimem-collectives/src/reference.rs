//! Host references and test data: what the kernels compute, computed on the host.

use float8::F8E4M3;

use crate::types::{DType, Element, Fp8Scaling, ReduceOp, FP8_E4M3_MAX, FP8_GROUP};

/// The next value of the xorshift generator whose state is `state` (non-zero; it advances),
/// in [-1, 1): the one generator of the tests, examples and benchmarks.
pub fn next_random(state: &mut u64) -> f32 {
    crate::types::next_random(state)
}

/// `count` random elements from the generator whose state is `state`: floats in [-1, 1)
/// (rounded to the type), integers uniform over the type's whole range
/// ([`DType::random_bits`]).
pub fn random_input<T: Element>(count: usize, state: &mut u64) -> Vec<T> {
    (0..count)
        .map(|_| T::from_bits64(T::DTYPE.random_bits(state)))
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
        dtype.store_bits(&mut v, dtype.random_bits(state));
    }
    v
}

/// Reduce `inputs` (one slice per rank, equal lengths) in rank order, in the type's accumulator
/// (f32 for the floats of 32 bits and fewer, rounded once; f64; integers wrapping in their own
/// width: see [`DType`]), as the peer-to-peer kernels do: the host reference for tests and
/// examples.
/// The length is the first input's; longer inputs are read up to it.
///
/// # Panics
/// If an input is shorter than the first.
pub fn reference<T: Element>(op: ReduceOp, inputs: &[&[T]]) -> Vec<T> {
    let n = inputs.first().map_or(0, |i| i.len());
    (0..n)
        .map(|e| T::from_bits64(T::DTYPE.reduce_bits(op, inputs.iter().map(|x| x[e].to_bits64()))))
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
        let r = dtype.reduce_bits(op, inputs.iter().map(|x| dtype.load_bits(x, e)));
        dtype.store_bits(&mut out, r);
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
        DType::F16 => w.abs().max(6.1e-5) / 1024.0,
        DType::Bf16 => w.abs().max(1e-30) / 128.0,
        // f32 (the norm takes no other type)
        _ => 0.0,
    };
    (g - w).abs() <= step + w.abs() / 65536.0 + f32::MIN_POSITIVE
}

/// `amax` of `v` as the FP8 kernels take it: the largest bit pattern of the values with the
/// sign cleared, compared as `u32` — order-free (so every reduction tree gives the same bits),
/// and a NaN, larger than every number, wins (its row or group gets a NaN scale).
pub fn fp8_amax(v: &[f32]) -> f32 {
    f32::from_bits(
        v.iter()
            .map(|x| x.to_bits() & 0x7fff_ffff)
            .max()
            .unwrap_or(0),
    )
}

/// The dequantisation scale computed from `amax`: `amax / 448` (correctly rounded), 1 where
/// that is 0 (an all-zero row or group, or an amax so small the quotient underflows: every
/// element is then ±0 or rounds to it); with `ue8m0`, rounded up to a power of two (the
/// exponent of the f32 scale, plus one when its mantissa is not 0; a NaN or infinite scale
/// becomes NaN, UE8M0's 255).
pub fn fp8_scale(amax: f32, ue8m0: bool) -> f32 {
    let mut s = amax / FP8_E4M3_MAX;
    if s == 0.0 {
        s = 1.0;
    }
    if !ue8m0 {
        return s;
    }
    let byte = ue8m0_byte(s);
    if byte == 255 {
        f32::from_bits(0x7fff_ffff)
    } else {
        f32::from_bits((byte as u32) << 23)
    }
}

/// The UE8M0 byte (biased power-of-two exponent) of an f32 scale rounded up to a power of two:
/// `exponent + (mantissa != 0)`, at most 255 (NaN).
pub fn ue8m0_byte(scale: f32) -> u8 {
    let b = scale.to_bits();
    let e = (b >> 23) & 0xff;
    let m = b & 0x7f_ffff;
    (e + (m != 0) as u32).min(255) as u8
}

/// e4m3 of `v`, as `cvt.rn.satfinite.e4m3x2.f32` converts: round to nearest even, finite
/// values beyond ±448 (and ±∞) saturate to ±448, a NaN stays a NaN (0x7f, or 0xff: the sign of
/// a NaN is not specified).
pub fn fp8_e4m3(v: f32) -> F8E4M3 {
    F8E4M3::from_f32(v)
}

/// Quantise one normalised row `y` (values of `T` as f32) with `scaling` (`static_scale` for
/// [`Fp8Scaling::Static`]): the row's e4m3 values `e4m3(y / scale)` and its scales (none,
/// one per token, or one per group of [`FP8_GROUP`] — for UE8M0 the powers of two used).
pub fn fp8_quantise_row(
    y: &[f32],
    scaling: Fp8Scaling,
    static_scale: f32,
) -> (Vec<F8E4M3>, Vec<f32>) {
    match scaling {
        Fp8Scaling::Static => (
            y.iter().map(|&v| fp8_e4m3(v / static_scale)).collect(),
            vec![],
        ),
        Fp8Scaling::PerToken => {
            let s = fp8_scale(fp8_amax(y), false);
            (y.iter().map(|&v| fp8_e4m3(v / s)).collect(), vec![s])
        }
        Fp8Scaling::PerGroup | Fp8Scaling::PerGroupUe8m0 => {
            let ue = scaling == Fp8Scaling::PerGroupUe8m0;
            let mut q = Vec::with_capacity(y.len());
            let mut sc = Vec::new();
            for g in y.chunks(FP8_GROUP) {
                let s = fp8_scale(fp8_amax(g), ue);
                q.extend(g.iter().map(|&v| fp8_e4m3(v / s)));
                sc.push(s);
            }
            (q, sc)
        }
    }
}

/// Quantise the rows of a normalised output `out` (`tokens × hidden` of `T`): every row's e4m3
/// values and its scales as [`fp8_quantise_row`] gives them, the scales row by row
/// (`tokens × groups` for the grouped forms; pack them with [`ue8m0_pack`]).
pub fn fp8_quantise<T: Element>(
    out: &[T],
    hidden: usize,
    scaling: Fp8Scaling,
    static_scale: f32,
) -> (Vec<F8E4M3>, Vec<f32>) {
    let mut q = Vec::with_capacity(out.len());
    let mut sc = Vec::new();
    for row in out.chunks(hidden.max(1)) {
        let y: Vec<f32> = row.iter().map(|v| v.to_f32()).collect();
        let (rq, rs) = fp8_quantise_row(&y, scaling, static_scale);
        q.extend(rq);
        sc.extend(rs);
    }
    (q, sc)
}

/// Per-group power-of-two scales (`tokens × groups`, row by row, as [`fp8_quantise`] gives
/// them) in the layout [`Fp8Scaling::PerGroupUe8m0`] writes: the UE8M0 byte of group g of
/// token t in byte `g % 4` of the `u32` at `(g / 4) · align(tokens, 4) + t`; the bytes of
/// groups past the last 0. The words of the alignment's tokens are 0 here; the kernels do not
/// write them (compare only tokens `t < tokens`).
pub fn ue8m0_pack(scales: &[f32], tokens: usize, groups: usize) -> Vec<u32> {
    let stride = tokens.next_multiple_of(4);
    let mut packed = vec![0u32; groups.div_ceil(4) * stride];
    for t in 0..tokens {
        for g in 0..groups {
            let b = ue8m0_byte(scales[t * groups + g]) as u32;
            packed[(g / 4) * stride + t] |= b << (8 * (g % 4));
        }
    }
    packed
}

/// What [`add_rms_norm_fp8_reference`] computes.
#[derive(Debug, Clone)]
pub struct Fp8NormReference<T> {
    /// residual_out (bit-exact against the kernels).
    pub residual: Vec<T>,
    /// The normalised output rounded to `T` (what the unquantised norm writes).
    pub out: Vec<T>,
    /// Its e4m3 values.
    pub q: Vec<F8E4M3>,
    /// Its scales, row by row (none for [`Fp8Scaling::Static`]).
    pub scales: Vec<f32>,
}

/// [`add_rms_norm_reference`] followed by the FP8 quantisation of its `out`
/// ([`fp8_quantise`]): what `RankHandle::all_reduce_add_rms_norm_fp8` computes, rounding at
/// the same points (the sum of squares sequentially: see [`add_rms_norm_reference`]).
pub fn add_rms_norm_fp8_reference<T: Element>(
    inputs: &[&[T]],
    r: &[T],
    gamma: &[T],
    hidden: usize,
    eps: f32,
    scaling: Fp8Scaling,
    static_scale: f32,
) -> Fp8NormReference<T> {
    let (residual, out) = add_rms_norm_reference(inputs, r, gamma, hidden, eps);
    let (q, scales) = fp8_quantise(&out, hidden, scaling, static_scale);
    Fp8NormReference {
        residual,
        out,
        q,
        scales,
    }
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
    fn fp8_conversion_rounds_to_nearest_even_and_saturates() {
        let b = |v: f32| fp8_e4m3(v).to_bits();
        assert_eq!(b(448.0), 0x7e);
        assert_eq!(b(1e9), 0x7e);
        assert_eq!(b(f32::INFINITY), 0x7e);
        assert_eq!(b(-1e9), 0xfe);
        assert_eq!(b(464.0), 0x7e); // halfway to 480: to even (448)
        assert_eq!(b(1.0), 0x38);
        assert_eq!(b(1.0625), 0x38); // halfway between 1 and 1.125: even
        assert_eq!(b(1.0625 + 1e-6), 0x39);
        assert_eq!(b(2f32.powi(-9)), 0x01); // smallest subnormal
        assert_eq!(b(2f32.powi(-10)), 0x00); // its half: to even
        assert_eq!(b(f32::NAN) & 0x7f, 0x7f);
    }

    #[test]
    fn fp8_scales_of_zero_and_nan_and_powers_of_two() {
        assert_eq!(fp8_scale(0.0, false), 1.0);
        assert_eq!(fp8_scale(0.0, true), 1.0);
        assert_eq!(fp8_scale(448.0, false), 1.0);
        assert_eq!(fp8_scale(448.0, true), 1.0);
        assert_eq!(fp8_scale(449.0, true), 2.0);
        assert_eq!(fp8_scale(224.0, true), 0.5);
        assert!(fp8_scale(f32::NAN, true).is_nan());
        assert_eq!(ue8m0_byte(1.0), 127);
        assert_eq!(fp8_amax(&[-3.0, 2.0, -0.0]), 3.0);
        assert!(fp8_amax(&[1.0, f32::NAN]).is_nan());
        // a row of zeros: scale 1, every element 0
        let (q, s) = fp8_quantise_row(&[0.0; 4], Fp8Scaling::PerToken, 0.0);
        assert_eq!(s, vec![1.0]);
        assert!(q.iter().all(|q| q.to_bits() & 0x7f == 0));
        // the row's largest element becomes ±448
        let (q, s) = fp8_quantise_row(&[-2.0, 1.0], Fp8Scaling::PerToken, 0.0);
        assert_eq!(s, vec![2.0 / 448.0]);
        assert_eq!(q[0].to_bits(), 0xfe);
        // packing: two tokens, five groups: packs of 4 groups, stride align(2, 4) = 4
        let sc: Vec<f32> = (0..10).map(|i| 2f32.powi(i)).collect();
        let p = ue8m0_pack(&sc, 2, 5);
        assert_eq!(p.len(), 8);
        assert_eq!(p[0], u32::from_le_bytes([127, 128, 129, 130]));
        assert_eq!(p[1], u32::from_le_bytes([132, 133, 134, 135]));
        assert_eq!(p[4], 131);
        assert_eq!(p[5], 136);
        assert_eq!(p[2], 0);
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
