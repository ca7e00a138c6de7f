//! f16 and bf16 conversions (round to nearest even, as `cvt.rn` does), for host references and
//! the simulator's kernel equivalents.

use crate::DType;

/// bf16 bits to f32 (exact).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 to bf16 bits, round to nearest even (NaN stays NaN).
pub fn f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    if f.is_nan() {
        return ((x >> 16) as u16) | 0x0040;
    }
    let round = 0x7fff + ((x >> 16) & 1);
    ((x + round) >> 16) as u16
}

/// f16 bits to f32 (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // subnormal: m * 2^-24
            let v = m as f32 * f32::from_bits(0x3380_0000); // 2^-24
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// f32 to f16 bits, round to nearest even (overflow to infinity, subnormals kept).
pub fn f32_to_f16(f: f32) -> u16 {
    let x = f.to_bits();
    let sign = ((x >> 16) & 0x8000) as u16;
    let exp = ((x >> 23) & 0xff) as i32;
    let man = x & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        // subnormal or zero in f16: value = (1.man) * 2^(exp-127); f16 unit = 2^-24
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000; // 24-bit significand
        let shift = (14 - e) as u32; // bits to drop so that the unit is 2^-24
        let q = m >> shift;
        let rem = m & ((1 << shift) - 1);
        let half = 1 << (shift - 1);
        let q = if rem > half || (rem == half && q & 1 == 1) {
            q + 1
        } else {
            q
        };
        return sign | q as u16;
    }
    let q = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    let q = if rem > 0x1000 || (rem == 0x1000 && q & 1 == 1) {
        q + 1
    } else {
        q
    };
    sign | q as u16
}

/// Element `i` of raw little-endian data of type `dtype`, as f32.
pub fn load(dtype: DType, data: &[u8], i: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes(data[4 * i..4 * i + 4].try_into().unwrap_or([0; 4])),
        DType::F16 => f16_to_f32(u16::from_le_bytes([data[2 * i], data[2 * i + 1]])),
        DType::Bf16 => bf16_to_f32(u16::from_le_bytes([data[2 * i], data[2 * i + 1]])),
    }
}

/// Append `v` rounded to `dtype` (little-endian).
pub fn store(dtype: DType, out: &mut Vec<u8>, v: f32) {
    match dtype {
        DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
        DType::F16 => out.extend_from_slice(&f32_to_f16(v).to_le_bytes()),
        DType::Bf16 => out.extend_from_slice(&f32_to_bf16(v).to_le_bytes()),
    }
}

/// `v` rounded to `dtype`, as raw bits in the low bytes of a u32.
pub fn encode(dtype: DType, v: f32) -> u32 {
    match dtype {
        DType::F32 => v.to_bits(),
        DType::F16 => f32_to_f16(v) as u32,
        DType::Bf16 => f32_to_bf16(v) as u32,
    }
}

/// Raw bits of one element of `dtype` as f32.
pub fn decode(dtype: DType, bits: u32) -> f32 {
    match dtype {
        DType::F32 => f32::from_bits(bits),
        DType::F16 => f16_to_f32(bits as u16),
        DType::Bf16 => bf16_to_f32(bits as u16),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_round_trips_every_finite_value() {
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if f.is_nan() {
                assert!(f16_to_f32(f32_to_f16(f)).is_nan());
                continue;
            }
            assert_eq!(f32_to_f16(f), h, "{h:#x} -> {f}");
        }
    }

    #[test]
    fn f16_rounds_to_nearest_even() {
        // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0)
        assert_eq!(f32_to_f16(1.0 + f32::powi(2.0, -11)), 0x3c00);
        // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9: ties to even (1 + 2^-9)
        assert_eq!(f32_to_f16(1.0 + 3.0 * f32::powi(2.0, -11)), 0x3c02);
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_f16(f32::powi(2.0, -25)), 0); // tie at the smallest subnormal: even
        assert_eq!(f32_to_f16(f32::powi(2.0, -25) * 1.5), 1);
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        for b in 0..=u16::MAX {
            let f = bf16_to_f32(b);
            if !f.is_nan() {
                assert_eq!(f32_to_bf16(f), b);
            }
        }
    }
}
