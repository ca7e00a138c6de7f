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
pub fn random_bytes(dtype: DType, count: usize, state: &mut u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        dtype.store(&mut v, next_random(state));
    }
    v
}

/// Reduce `inputs` (one slice per rank, equal lengths) in rank order, accumulating in f32 and
/// rounding once, as the peer-to-peer kernels do: the host reference for tests and examples.
pub fn reference<T: Element>(op: ReduceOp, inputs: &[&[T]]) -> Vec<T> {
    let n = inputs.first().map_or(0, |i| i.len());
    (0..n)
        .map(|e| {
            let acc = inputs[1..]
                .iter()
                .fold(inputs[0][e].to_f32(), |acc, x| op.apply(acc, x[e].to_f32()));
            T::from_f32(acc)
        })
        .collect()
}

/// Reduce-scatter on the host: `inputs[k]` is rank k's input of N chunks (N = `inputs.len()`,
/// equal lengths, a multiple of N); element r of the result is what rank r's output holds: the
/// reduction of chunk r of every input, in rank order, as [`reference()`].
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
pub fn broadcast_reference<T: Clone>(inputs: &[&[T]], root: usize) -> Vec<T> {
    inputs[root].to_vec()
}

/// [`reference()`] on raw little-endian bytes of `dtype`.
pub fn reference_bytes(dtype: DType, op: ReduceOp, inputs: &[&[u8]]) -> Vec<u8> {
    let n = inputs.first().map_or(0, |i| i.len() / dtype.size());
    let mut out = Vec::with_capacity(n * dtype.size());
    for e in 0..n {
        let acc = inputs[1..].iter().fold(dtype.load(inputs[0], e), |acc, x| {
            op.apply(acc, dtype.load(x, e))
        });
        dtype.store(&mut out, acc);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

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
}
