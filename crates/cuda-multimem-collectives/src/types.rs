//! The vocabulary of the collectives: element types, reduction operators, paths, algorithms and
//! the choice a call reports.

use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};

/// Element types, for engines that know theirs only at run time ([`crate::RankHandle::all_reduce_dyn`]).
///
/// What takes which type, and how each reduction accumulates and rounds (every path, every
/// form; the multimem path only for the types and operators it has, see below):
///
/// | collective | types | operators |
/// | --- | --- | --- |
/// | allreduce, reduce-scatter (and `_dyn`) | f32, f16, bf16, FP8 e4m3 and e5m2: converted to f32 (exactly), accumulated in f32 in rank order, rounded once to the type (nearest even; FP8 saturating to its finite range) | every [`ReduceOp`] |
/// | | f64: accumulated in f64 in rank order (bit-identical on every rank and to the reference) | every [`ReduceOp`] |
/// | | i8, u8, i32, u32, i64, u64: in their own width; sum and product wrap (two's complement, as NCCL); min and max signed or unsigned by the type; average: the wrapped sum divided by the team size, truncated toward zero (as NCCL for integers) | every [`ReduceOp`] |
/// | fused norm | f32, f16, bf16 (other types refused naming `dtype`) | — |
/// | multimem (`multimem.ld_reduce`) | f32 (sum), f16 and bf16 (sum, min, max); the other types run peer-to-peer | — |
/// | all-gather, broadcast | any [`cuda_multimem::DeviceRepr`] type (integers, f64, FP8, records), moved as bits in words of its [`DType::carrier`] | — |
///
/// FP8 NaN and infinity: a NaN input makes a NaN result of a sum, product and average (its bits
/// are the type's NaN, `0x7f` on the host and simulator, the sign not specified on a GPU); min
/// and max drop a NaN operand (as `min.f32`: the other operand wins). An e5m2 infinity input
/// converts to an f32 infinity and the result, out of the finite range, saturates to ±57344
/// (`cvt.rn.satfinite`): no result is ever an FP8 infinity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half (accumulated in f32).
    F16,
    /// bfloat16 (accumulated in f32).
    Bf16,
    /// 8-bit unsigned integer: reduced in 8 bits (wrapping), and the carrier all-gather and
    /// broadcast move every element type whose size or alignment is odd as (see
    /// [`DType::carrier`]).
    U8,
    /// 64-bit float (accumulated in f64).
    F64,
    /// 32-bit signed integer (wrapping).
    I32,
    /// 32-bit unsigned integer (wrapping).
    U32,
    /// 64-bit signed integer (wrapping).
    I64,
    /// 64-bit unsigned integer (wrapping).
    U64,
    /// 8-bit signed integer (wrapping).
    I8,
    /// FP8 e4m3 ([`float8::F8E4M3`], accumulated in f32, saturating to ±448).
    F8E4M3,
    /// FP8 e5m2 ([`float8::F8E5M2`], accumulated in f32, saturating to ±57344).
    F8E5M2,
}

/// A value in a reduction's accumulator (the host's model of the kernels' registers): f32 for
/// the floats of 32 bits and fewer, f64, or the integer in its own width (sign- or
/// zero-extended to 64 bits).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Acc {
    /// f32, f16, bf16, e4m3, e5m2.
    F32(f32),
    /// f64.
    F64(f64),
    /// A signed integer, wrapped to its type's width and sign-extended.
    Int(i64),
    /// An unsigned integer, wrapped to its type's width.
    UInt(u64),
}

impl DType {
    /// The types every collective takes, the reductions and the fused norm included: f32,
    /// f16 and bf16 (also the types with multimem kernels). The reductions take more:
    /// [`DType::REDUCED`].
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

    /// Every type the reductions (allreduce, reduce-scatter, their `_dyn` forms, the
    /// hierarchical communicator) take: every [`DType`].
    pub const REDUCED: [DType; 12] = [
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::F64,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
        DType::I8,
        DType::U8,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// The kernel types the bit-moving collectives (all-gather, broadcast) run any element
    /// type as ([`DType::carrier`]): 4-byte, 2-byte and 1-byte words.
    pub const CARRIERS: [DType; 3] = [DType::F32, DType::F16, DType::U8];

    /// The type an all-gather or broadcast of elements of `size` bytes aligned to `align`
    /// moves them as: words of the largest of 4, 2 and 1 bytes that divides both (f32 for
    /// 4-byte words, f16 for 2-byte ones: those kernels move bits, never convert them; u8
    /// for the rest), so any [`cuda_multimem::DeviceRepr`] type travels as whole words of
    /// itself. `None` for a zero-sized type.
    pub fn carrier(size: usize, align: usize) -> Option<DType> {
        if size == 0 {
            return None;
        }
        let g = size | align.max(1);
        Some(if g % 4 == 0 {
            DType::F32
        } else if g % 2 == 0 {
            DType::F16
        } else {
            DType::U8
        })
    }

    /// [`DType::carrier`] of `T` (`None`: zero-sized).
    pub fn carrier_of<T>() -> Option<DType> {
        DType::carrier(std::mem::size_of::<T>(), std::mem::align_of::<T>())
    }

    /// Whether the reductions (allreduce, reduce-scatter) take this type: every type
    /// ([`DType::REDUCED`]).
    pub fn reduces(self) -> bool {
        DType::REDUCED.contains(&self)
    }

    /// Whether the fused norm takes this type (f32, f16, bf16: [`DType::ALL`]).
    pub fn norms(self) -> bool {
        DType::ALL.contains(&self)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }

    /// Short name (`f32`, `f16`, `bf16`, `f64`, `i32`, `u32`, `i64`, `u64`, `i8`, `u8`,
    /// `e4m3`, `e5m2`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::U8 => "u8",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
            DType::I8 => "i8",
            DType::F8E4M3 => "e4m3",
            DType::F8E5M2 => "e5m2",
        }
    }

    /// Whether this is an integer type.
    pub fn is_integer(self) -> bool {
        matches!(
            self,
            DType::I8 | DType::U8 | DType::I32 | DType::U32 | DType::I64 | DType::U64
        )
    }

    /// The value of `bits` (the element's little-endian bits in the low bytes) as f32 — exact
    /// for the floats of 32 bits and fewer, rounded for f64 and the integers above 24 bits
    /// (reductions compute with [`DType::acc`] instead, in the type's own accumulator). The
    /// 64-bit types take their value from the 32 low bits only: use [`DType::acc`].
    pub fn decode(self, bits: u32) -> f32 {
        self.acc(bits as u64).to_f32()
    }

    /// `v` rounded to this type (round to nearest even, as `cvt.rn`; FP8 saturating to its
    /// finite range; integers truncated toward zero and saturated, NaN 0), as bits (the low 32
    /// bits of a 64-bit type's).
    pub fn encode(self, v: f32) -> u32 {
        self.convert_f64(v as f64) as u32
    }

    /// The bits of `v` (f64) converted to this type as [`DType::encode`] does (f64 exact;
    /// the 32-bit-and-smaller floats through f32).
    fn convert_f64(self, v: f64) -> u64 {
        match self {
            DType::F64 => v.to_bits(),
            DType::I8 => v as i8 as u8 as u64,
            DType::U8 => v as u8 as u64,
            DType::I32 => v as i32 as u32 as u64,
            DType::U32 => v as u32 as u64,
            DType::I64 => v as i64 as u64,
            DType::U64 => v as u64,
            _ => self.round(Acc::F32(v as f32)),
        }
    }

    /// The accumulator value of one element's `bits` (little-endian, in the low bytes): what
    /// the kernels widen an element to before they reduce (FP8 and 16-bit floats exactly to
    /// f32; integers sign- or zero-extended).
    pub fn acc(self, bits: u64) -> Acc {
        match self {
            DType::F32 => Acc::F32(f32::from_bits(bits as u32)),
            DType::F16 => Acc::F32(f16::from_bits(bits as u16).to_f32()),
            DType::Bf16 => Acc::F32(bf16::from_bits(bits as u16).to_f32()),
            // the inherent conversions (exact), not `Element::to_f32` (which comes here)
            DType::F8E4M3 => Acc::F32(F8E4M3::to_f32(&F8E4M3::from_bits(bits as u8))),
            DType::F8E5M2 => Acc::F32(F8E5M2::to_f32(&F8E5M2::from_bits(bits as u8))),
            DType::F64 => Acc::F64(f64::from_bits(bits)),
            DType::I8 => Acc::Int(bits as u8 as i8 as i64),
            DType::I32 => Acc::Int(bits as u32 as i32 as i64),
            DType::I64 => Acc::Int(bits as i64),
            DType::U8 => Acc::UInt(bits as u8 as u64),
            DType::U32 => Acc::UInt(bits as u32 as u64),
            DType::U64 => Acc::UInt(bits),
        }
    }

    /// An accumulator rounded (floats: once, to nearest even; FP8 saturating to the finite
    /// range, a NaN to `0x7f`) or wrapped (integers) to this type, as bits. An accumulator of
    /// another class is converted first (as `as` converts).
    pub fn round(self, a: Acc) -> u64 {
        match self {
            DType::F32 => (a.to_f32()).to_bits() as u64,
            DType::F16 => f16::from_f32(a.to_f32()).to_bits() as u64,
            DType::Bf16 => bf16::from_f32(a.to_f32()).to_bits() as u64,
            DType::F8E4M3 => fp8_bits(F8E4M3::from_f32(a.to_f32()).to_bits(), a.to_f32()),
            DType::F8E5M2 => fp8_bits(F8E5M2::from_f32(a.to_f32()).to_bits(), a.to_f32()),
            DType::F64 => match a {
                Acc::F64(v) => v.to_bits(),
                _ => (a.to_f32() as f64).to_bits(),
            },
            _ => {
                let v = match a {
                    Acc::Int(v) => v as u64,
                    Acc::UInt(v) => v,
                    Acc::F32(v) => return self.convert_f64(v as f64),
                    Acc::F64(v) => return self.convert_f64(v),
                };
                v & self.mask()
            }
        }
    }

    /// The bits of one element, all ones.
    fn mask(self) -> u64 {
        match self.size() {
            8 => u64::MAX,
            s => (1u64 << (8 * s)) - 1,
        }
    }

    /// An integer accumulator value `v` (any 64-bit value) wrapped to this type's width
    /// (two's complement), in the accumulator's form; floats as they are.
    fn wrap(self, a: Acc) -> Acc {
        match a {
            Acc::Int(v) => self.acc(v as u64 & self.mask()),
            Acc::UInt(v) => self.acc(v & self.mask()),
            f => f,
        }
    }

    /// Element `i` of raw little-endian `data`, as its bits (in the low bytes).
    ///
    /// # Panics
    /// If `data` holds fewer than `i + 1` elements.
    pub fn load_bits(self, data: &[u8], i: usize) -> u64 {
        let s = self.size();
        let mut b = [0u8; 8];
        b[..s].copy_from_slice(&data[i * s..i * s + s]);
        u64::from_le_bytes(b)
    }

    /// Append one element's `bits` (the low bytes) to raw little-endian `out`.
    pub fn store_bits(self, out: &mut Vec<u8>, bits: u64) {
        out.extend_from_slice(&bits.to_le_bytes()[..self.size()]);
    }

    /// Element `i` of raw little-endian `data`, as f32 (lossy for f64 and the integers above
    /// 24 bits: [`DType::load_bits`] and [`DType::acc`] are exact).
    ///
    /// # Panics
    /// If `data` holds fewer than `i + 1` elements.
    pub fn load(self, data: &[u8], i: usize) -> f32 {
        self.acc(self.load_bits(data, i)).to_f32()
    }

    /// Append `v`, rounded to this type (as [`DType::encode`]), to raw little-endian `out`.
    pub fn store(self, out: &mut Vec<u8>, v: f32) {
        self.store_bits(out, self.convert_f64(v as f64));
    }

    /// One random element from the tests' generator whose state is `state` (it advances), as
    /// bits: floats in [-1, 1) ([`crate::testing::next_random`], rounded to the type; f64
    /// with 53 random bits), integers uniform over the type's whole range (so sums and products
    /// wrap).
    pub fn random_bits(self, state: &mut u64) -> u64 {
        match self {
            DType::F64 => {
                next_random(state);
                let m = (*state >> 11) as f64 / (1u64 << 53) as f64;
                (m * 2.0 - 1.0).to_bits()
            }
            d if d.is_integer() => {
                next_random(state);
                state.wrapping_mul(0x2545_f491_4f6c_dd1d) & d.mask()
            }
            d => d.convert_f64(next_random(state) as f64),
        }
    }

    /// `a` combined with `b` by `op` in this type's accumulator, exactly as the kernels do:
    /// floats as [`ReduceOp::apply`] (f64 likewise, in f64); integers with wrapping sum and
    /// product in the type's width and signed or unsigned min and max (an average sums).
    pub fn combine(self, op: ReduceOp, a: Acc, b: Acc) -> Acc {
        match (a, b) {
            (Acc::F32(a), Acc::F32(b)) => Acc::F32(op.apply(a, b)),
            (Acc::F64(a), Acc::F64(b)) => Acc::F64(match op {
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Prod => a * b,
                ReduceOp::Min => fmin(a, b),
                ReduceOp::Max => -fmin(-a, -b),
            }),
            (Acc::Int(a), Acc::Int(b)) => self.wrap(Acc::Int(match op {
                ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                ReduceOp::Prod => a.wrapping_mul(b),
                ReduceOp::Min => a.min(b),
                ReduceOp::Max => a.max(b),
            })),
            (Acc::UInt(a), Acc::UInt(b)) => self.wrap(Acc::UInt(match op {
                ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                ReduceOp::Prod => a.wrapping_mul(b),
                ReduceOp::Min => a.min(b),
                ReduceOp::Max => a.max(b),
            })),
            // accumulators of two classes: not made by one type
            (a, _) => a,
        }
    }

    /// The combined accumulator of a team of `n` before it is rounded to the type: an average
    /// divides (f32: `div.rn.f32`; f64: `div.rn.f64`; integers: the wrapped sum divided by `n`,
    /// truncated toward zero, as `div.s`/`div.u`); the other operators leave it.
    pub fn finish(self, op: ReduceOp, a: Acc, n: usize) -> Acc {
        if op != ReduceOp::Avg {
            return a;
        }
        match a {
            Acc::F32(v) => Acc::F32(op.finish(v, n)),
            Acc::F64(v) => Acc::F64(v / n as f64),
            Acc::Int(v) => Acc::Int(v / n as i64),
            Acc::UInt(v) => Acc::UInt(v / n as u64),
        }
    }

    /// One element of a reduction over `bits` (every rank's element, rank order) by `op`: the
    /// element's bits, as every peer-to-peer kernel computes it.
    pub fn reduce_bits(self, op: ReduceOp, bits: impl IntoIterator<Item = u64>) -> u64 {
        let mut n = 0;
        let mut acc = None;
        for b in bits {
            let x = self.acc(b);
            acc = Some(match acc {
                None => x,
                Some(a) => self.combine(op, a, x),
            });
            n += 1;
        }
        acc.map_or(0, |a| self.round(self.finish(op, a, n)))
    }

    pub(crate) fn code(self) -> u64 {
        self as u64
    }
}

/// `min.f64`: a NaN operand yields the other; -0 is below +0.
fn fmin(a: f64, b: f64) -> f64 {
    if a.is_nan() {
        b
    } else if b.is_nan() || a < b || (a == b && a.is_sign_negative()) {
        a
    } else {
        b
    }
}

/// The tests' xorshift generator (`reference::next_random`, which random elements of every type
/// come from): the next value in [-1, 1); the state advances.
pub(crate) fn next_random(state: &mut u64) -> f32 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// An FP8 conversion's bits with a NaN made the type's NaN `0x7f` (the float8 crate keeps the
/// sign and, for e5m2, the mantissa of a NaN; the kernels' sign is not specified).
fn fp8_bits(bits: u8, v: f32) -> u64 {
    if v.is_nan() {
        0x7f
    } else {
        bits as u64
    }
}

impl Acc {
    /// The value as f32 (rounded for f64 and the wide integers).
    pub fn to_f32(self) -> f32 {
        match self {
            Acc::F32(v) => v,
            Acc::F64(v) => v as f32,
            Acc::Int(v) => v as f32,
            Acc::UInt(v) => v as f32,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for f64 {}
    impl Sealed for i32 {}
    impl Sealed for u32 {}
    impl Sealed for i64 {}
    impl Sealed for u64 {}
    impl Sealed for i8 {}
    impl Sealed for u8 {}
    impl Sealed for float8::F8E4M3 {}
    impl Sealed for float8::F8E5M2 {}
}

/// An element type the collectives reduce: `f32`, [`half::f16`], [`half::bf16`], `f64`,
/// `i32`, `u32`, `i64`, `u64`, `i8`, `u8`, [`float8::F8E4M3`], [`float8::F8E5M2`] (how each
/// accumulates and rounds: [`DType`]). The fused norm takes f32, f16 and bf16 only.
pub trait Element:
    cuda_multimem::DeviceRepr + sealed::Sealed + PartialEq + std::fmt::Debug
{
    /// The run-time type.
    const DTYPE: DType;
    /// The value as f32 (exact for the floats of 32 bits and fewer; rounded for f64 and the
    /// integers above 24 bits).
    fn to_f32(self) -> f32;
    /// `v` rounded to this type (round to nearest even; FP8 saturating; integers truncated
    /// toward zero and saturated, NaN 0).
    fn from_f32(v: f32) -> Self;
    /// The element's bits (little-endian value in the low bytes).
    fn to_bits64(self) -> u64;
    /// The element of `bits` (the low bytes).
    fn from_bits64(bits: u64) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr, |$x:ident| $to:expr, |$b:ident| $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn to_f32(self) -> f32 {
                $d.acc(self.to_bits64()).to_f32()
            }
            fn from_f32(v: f32) -> Self {
                Self::from_bits64($d.convert_f64(v as f64))
            }
            fn to_bits64(self) -> u64 {
                let $x = self;
                $to
            }
            fn from_bits64($b: u64) -> Self {
                $from
            }
        }
    };
}

element!(f32, DType::F32, |x| x.to_bits() as u64, |b| f32::from_bits(
    b as u32
));
element!(f16, DType::F16, |x| x.to_bits() as u64, |b| f16::from_bits(
    b as u16
));
element!(bf16, DType::Bf16, |x| x.to_bits() as u64, |b| {
    bf16::from_bits(b as u16)
});
element!(f64, DType::F64, |x| x.to_bits(), |b| f64::from_bits(b));
element!(i32, DType::I32, |x| x as u32 as u64, |b| b as u32 as i32);
element!(u32, DType::U32, |x| x as u64, |b| b as u32);
element!(i64, DType::I64, |x| x as u64, |b| b as i64);
element!(u64, DType::U64, |x| x, |b| b);
element!(i8, DType::I8, |x| x as u8 as u64, |b| b as u8 as i8);
element!(u8, DType::U8, |x| x as u64, |b| b as u8);
element!(F8E4M3, DType::F8E4M3, |x| x.to_bits() as u64, |b| {
    F8E4M3::from_bits(b as u8)
});
element!(F8E5M2, DType::F8E5M2, |x| x.to_bits() as u64, |b| {
    F8E5M2::from_bits(b as u8)
});

/// Reduction operators.
///
/// What each path guarantees for [`ReduceOp::Sum`] (floating-point addition is not associative):
/// the peer-to-peer path adds in rank order 0, 1, ..., N-1 on every rank, so every rank gets
/// bit-identical results, run to run, equal to [`crate::testing::reference`]. The multimem path lets the
/// NVLink switch add, in an order it chooses: the result may differ from the rank-order
/// reference in the last bits (the simulator adds in a shuffled order so code that assumes
/// otherwise fails there too); its one-shot form reduces on every rank separately, so ranks may
/// differ from each other in the last bits; its two-shot form reduces each part once and stores
/// it to every rank, so ranks agree. [`ReduceOp::Min`] and [`ReduceOp::Max`] are exact everywhere.
/// [`ReduceOp::Prod`] and [`ReduceOp::Avg`] run peer-to-peer only (`multimem.ld_reduce` has
/// neither), in rank order as the sum: bit-identical on every rank and equal to the reference.
/// Their allreduce has no write-only two-shot forms: above the one-shot limit it runs
/// [`Algorithm::TwoShot`] (the caller's own memory staged through the scratch), reported in
/// the [`Choice`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (see the type's documentation for the order).
    Sum,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Product (`mul.rn.f32` in rank order, as [`ReduceOp::Sum`] adds; f64: `mul.rn.f64`;
    /// integers: wrapping, `mul.lo`).
    Prod,
    /// Average: the sum in rank order (as [`ReduceOp::Sum`], accumulated in f32), divided by
    /// the team size in f32 (`div.rn.f32`, correctly rounded), then rounded once to the type
    /// (f64: in f64; integers: the wrapped sum divided by the team size, truncated toward
    /// zero, as NCCL).
    Avg,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Prod,
        ReduceOp::Avg,
    ];

    /// Short name (`sum`, `min`, `max`, `prod`, `avg`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Prod => "prod",
            ReduceOp::Avg => "avg",
        }
    }

    /// The value after combining every rank's (`acc`, in f32) on a team of `n`, before it is
    /// rounded to the type: `acc / n` for [`ReduceOp::Avg`] (`div.rn.f32`), `acc` otherwise.
    pub fn finish(self, acc: f32, n: usize) -> f32 {
        match self {
            ReduceOp::Avg => acc / n as f32,
            _ => acc,
        }
    }

    /// Apply to two f32 values, exactly as the kernels do (`add.rn.f32` for sum and average,
    /// `mul.rn.f32`, `min.f32`, `max.f32`: a NaN operand yields the other one; -0 is below +0);
    /// an average is then [`ReduceOp::finish`]ed.
    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Min => {
                if a.is_nan() {
                    b
                } else if b.is_nan() || a < b || (a == b && a.is_sign_negative()) {
                    a
                } else {
                    b
                }
            }
            ReduceOp::Max => {
                if a.is_nan() {
                    b
                } else if b.is_nan() || a > b || (a == b && b.is_sign_negative()) {
                    a
                } else {
                    b
                }
            }
        }
    }

    pub(crate) fn code(self) -> u64 {
        self as u64
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How the data travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// Loads and stores through peer mappings (NVLink P2P).
    PeerToPeer,
    /// `multimem` loads, stores and reductions through a multicast address (NVLink SHARP).
    Multimem,
    /// Nothing travels: a team of one rank (a local copy, or nothing in place).
    Local,
}

impl std::fmt::Display for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Path::PeerToPeer => "peer-to-peer",
            Path::Multimem => "multimem",
            Path::Local => "local",
        })
    }
}

/// Which algorithm: each belongs to one family of collectives ([`Algorithm::collectives`]), so
/// a reported choice names what ran. [`crate::CommConfig::algorithm`] forces an allreduce form
/// (and maps onto the fused norm's: docs/design/rmsnorm.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Each rank reduces the whole message (small messages; one barrier). Reads only the local
    /// input and writes only the local output, so it serves the caller's own memory as it is.
    OneShot,
    /// Each rank reduces 1/N of the message, reading every rank's input, and stores it on every
    /// rank (symmetric operands only; the fallback for operands not 16-byte aligned).
    TwoShot,
    /// One-shot with the low-latency protocol (small messages): data travel with a flag in
    /// 8-byte stores, receivers poll the data, no barrier. Needs 4-byte aligned operands and a
    /// whole number of 4-byte words; otherwise the call runs [`Algorithm::OneShot`].
    OneShotLl,
    /// Two-shot whose remote traffic is only posted writes: each rank pushes the parts of its
    /// input to their owners' staging, owners reduce locally and push the results, in rounds
    /// through fixed-size staging slots ([`crate::CommConfig::stage_bytes`]). The default above
    /// the one-shot limit. Needs 16-byte aligned operands; otherwise [`Algorithm::TwoShot`].
    TwoShotPush,
    /// Two-shot whose first half goes through the copy engines (`cuMemcpyDtoDAsync` into the
    /// peers' landing areas), then a kernel that reduces its part and pushes the result. Used
    /// from [`crate::CommConfig::ce_min_bytes`] up to [`crate::CommConfig::ce_max_bytes`] (off by
    /// default). Needs 16-byte aligned operands; otherwise [`Algorithm::TwoShot`].
    TwoShotCe,
    /// Reduce-scatter, all-gather and broadcast (not allreduce): each sender pushes its data
    /// into the receivers' staging slots (posted writes only), one barrier per round through
    /// the fixed-size slots, then every receiver reduces or copies from its own memory into its
    /// output. Serves every operand kind with no copies outside the kernel. See
    /// `docs/design/collectives.md`.
    PushStaged,
    /// All-gather and broadcast into a symmetric output: barrier, every sender stores straight
    /// into every rank's output, barrier. Chosen above the one-shot limit
    /// ([`crate::CommConfig::one_shot_max_bytes`]) when the output is symmetric.
    PushDirect,
    /// Reduce-scatter, all-gather and broadcast with the low-latency protocol (small messages,
    /// up to [`crate::CommConfig::gather_ll_max_bytes`] of the whole gathered or scattered
    /// buffer, [`crate::CommConfig::broadcast_ll_max_bytes`] of a broadcast): the data travel with the call's flag in 8-byte stores into the receivers'
    /// low-latency slots, the receivers poll the data, no barrier. Serves every operand kind
    /// and alignment with no copies outside the kernel. See `docs/design/collectives.md`.
    PushLl,
    /// All-gather and broadcast of large buffers (from
    /// [`crate::CommConfig::gather_ce_min_bytes`] and
    /// [`crate::CommConfig::broadcast_ce_min_bytes`]) into a symmetric output, through the copy
    /// engines: a barrier launch, every sender's input copied into its place in every peer's
    /// output by `cuMemcpyDtoDAsync` (the local copy, out of place, by a kernel on a second
    /// stream of the rank), a barrier launch. See `docs/design/collectives.md`.
    CopyEngine,
    /// Reduce-scatter on the multimem path: each rank reduces its chunk of every rank's input
    /// through the multicast address (`multimem.ld_reduce`) into its own output.
    LoadReduce,
    /// The fused allreduce + residual add + RMSNorm, one-shot: every rank pushes its rows of
    /// `x` into every peer's staging, one barrier, every rank sums, adds and normalises every
    /// row (a block per row). See `docs/design/rmsnorm.md`.
    NormOneShot,
    /// [`Algorithm::NormOneShot`] with each row cut over a thread-block cluster (long rows, few
    /// tokens: more blocks on the link).
    NormOneShotSplit,
    /// The fused norm with the low-latency protocol: `x`'s words travel with the call's flag,
    /// no barrier (small calls).
    NormOneShotLl,
    /// [`Algorithm::NormOneShotLl`] with each row cut over a thread-block cluster.
    NormOneShotLlSplit,
    /// A team of one rank ([`Path::Local`]): the output is a copy of the input (nothing in
    /// place); the fused norm runs its local add + RMSNorm kernel.
    Local,
    /// The fused norm, two-shot: each rank sums its rows' share, normalises it and pushes the
    /// residual and the output to every rank (large calls, teams above 3 ranks).
    NormTwoShot,
    /// All-to-all with the low-latency protocol (small parts, up to
    /// [`crate::CommConfig::gather_ll_max_bytes`] of input and what a low-latency slot holds per
    /// part): every rank's counts and offsets, then its parts, travel with the call's flag in
    /// 8-byte cells into the receivers' low-latency slots; receivers poll, no barrier. Any
    /// operand kind and alignment. See `docs/design/alltoall.md`.
    AllToAllLl,
    /// All-to-all, bulk: after the exchange of counts (as in [`Algorithm::AllToAllLl`]), every
    /// sender stores its parts straight into the receivers' symmetric output, then one barrier.
    /// An output of the caller's own memory (or an in-place call) lands in the communicator's
    /// scratch and is copied out by the same kernel ([`crate::Choice::staged_chunks`] 1).
    AllToAllDirect,
    /// MoE dispatch / combine, bulk ([`crate::MoeProtocol::Bulk`]): one launch per phase, an
    /// entry barrier, one-sided pushes of every token once per destination rank (of every
    /// expert output row back to its token's rank) into the plan's symmetric slots, count cells
    /// awaited; the grouping by local expert and the weighted sum in the same launch. See
    /// `docs/design/alltoall.md` ("MoE dispatch and combine").
    MoeBulk,
    /// MoE dispatch / combine, low-latency ([`crate::MoeProtocol::LowLatency`]): as
    /// [`Algorithm::MoeBulk`] without the barrier, the plan's two regions alternating call by
    /// call.
    MoeLl,
}

impl Algorithm {
    /// The collectives that report this algorithm.
    pub fn collectives(self) -> &'static [&'static str] {
        match self {
            Algorithm::OneShot
            | Algorithm::TwoShot
            | Algorithm::OneShotLl
            | Algorithm::TwoShotPush
            | Algorithm::TwoShotCe => &["all_reduce"],
            Algorithm::PushStaged | Algorithm::PushLl => {
                &["reduce_scatter", "all_gather", "broadcast"]
            }
            Algorithm::PushDirect | Algorithm::CopyEngine => &["all_gather", "broadcast"],
            Algorithm::LoadReduce => &["reduce_scatter"],
            Algorithm::Local => &[
                "all_reduce",
                "reduce_scatter",
                "all_gather",
                "broadcast",
                "all_reduce_add_rms_norm",
            ],
            Algorithm::NormOneShot
            | Algorithm::NormOneShotSplit
            | Algorithm::NormOneShotLl
            | Algorithm::NormOneShotLlSplit
            | Algorithm::NormTwoShot => &["all_reduce_add_rms_norm"],
            Algorithm::AllToAllLl | Algorithm::AllToAllDirect => &["all_to_all", "all_to_all_v"],
            Algorithm::MoeBulk | Algorithm::MoeLl => &["moe_dispatch", "moe_combine"],
        }
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Algorithm::OneShot => "one-shot",
            Algorithm::TwoShot => "two-shot",
            Algorithm::OneShotLl => "one-shot-ll",
            Algorithm::TwoShotPush => "two-shot-push",
            Algorithm::TwoShotCe => "two-shot-ce",
            Algorithm::PushStaged => "push-staged",
            Algorithm::PushDirect => "push-direct",
            Algorithm::PushLl => "push-ll",
            Algorithm::CopyEngine => "copy-engine",
            Algorithm::LoadReduce => "load-reduce",
            Algorithm::NormOneShot => "norm-one-shot",
            Algorithm::NormOneShotSplit => "norm-one-shot-split",
            Algorithm::NormOneShotLl => "norm-one-shot-ll",
            Algorithm::NormOneShotLlSplit => "norm-one-shot-ll-split",
            Algorithm::Local => "local",
            Algorithm::NormTwoShot => "norm-two-shot",
            Algorithm::AllToAllLl => "all-to-all-ll",
            Algorithm::AllToAllDirect => "all-to-all-direct",
            Algorithm::MoeBulk => "moe-bulk",
            Algorithm::MoeLl => "moe-ll",
        })
    }
}

/// Where a call's operands live, which decides what can run without copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operands {
    /// Input and output in symmetric buffers of the communicator ([`crate::SymmetricBuffer`]).
    Symmetric,
    /// At least one operand is the caller's own device memory (a [`cuda_multimem::DeviceBuffer`],
    /// a cudarc slice, a raw pointer).
    Local,
}

/// What a call ran (or would run): path, algorithm, launch shape, and how the caller's own
/// memory was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// How data travels.
    pub path: Path,
    /// Which algorithm.
    pub algorithm: Algorithm,
    /// Blocks per launch.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
    /// Pieces the message went through the communicator's scratch in (0: the operands were used
    /// in place, with no extra copies; k ≥ 1: k chunks, each copied in and/or out of the scratch
    /// on the caller's stream — see docs/design/allreduce.md).
    pub staged_chunks: u32,
}

impl std::fmt::Display for Choice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path == Path::Local && self.algorithm == Algorithm::Local {
            return f.write_str("local (a team of one: a copy, or nothing in place)");
        }
        write!(
            f,
            "{} {} ({} x {})",
            self.path, self.algorithm, self.blocks, self.threads
        )?;
        if self.staged_chunks > 0 {
            write!(f, " staged in {} chunk(s)", self.staged_chunks)?;
        }
        Ok(())
    }
}

/// When the communicator uses NVLink multicast (`multimem` kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MulticastPolicy {
    /// Never: peer-to-peer kernels only.
    Never,
    /// Where multicast is allowed (the site's policy variables, see
    /// [`cuda_multimem::multicast::multicast_allowed`]) and supported by every device, for teams
    /// large enough that it moves fewer bytes than peer-to-peer (more than 3 ranks), for the
    /// sizes and operations it serves. The default.
    #[default]
    WhenItPaysOff,
    /// For every call it can serve; building fails where multicast is not available.
    Always,
}

/// Whether the multimem path should beat peer-to-peer two-shot for large messages on a team of
/// `n`: by the anchors' bandwidth arithmetic (NCCL's NVLS choice), only for teams larger than 3.
pub fn multimem_pays_off(n: usize) -> bool {
    n > 3
}

/// How the FP8 (e4m3) output of [`crate::RankHandle::all_reduce_add_rms_norm_fp8`] is scaled:
/// every quantised element is `e4m3(y / scale)` with `y` the normalised value rounded to the
/// call's `T` (what the unquantised norm writes), the division correctly rounded in f32 and the
/// conversion round-to-nearest-even saturating to ±448 (`cvt.rn.satfinite.e4m3x2.f32`);
/// `scale` is the dequantisation scale (`y ≈ q · scale`). Where a scale is computed, it is
/// `amax / 448` over its elements (`amax` of 0 gives a scale of 1, so every element is ±0):
/// see `docs/design/rmsnorm.md` ("FP8 outputs").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Scaling {
    /// One scale for the whole tensor, given by the caller (finite, > 0).
    Static,
    /// One scale per token (row), written as f32.
    PerToken,
    /// One scale per group of [`FP8_GROUP`] consecutive elements of a row, written as f32,
    /// row-major (`tokens × hidden / 128`).
    PerGroup,
    /// One power-of-two scale per group of [`FP8_GROUP`] elements (the f32 scale rounded up to
    /// a power of two), written as UE8M0 exponent bytes packed four groups to a `u32` in the
    /// layout DeepGEMM reads (`u32` at `pack · align(tokens, 4) + token`, group `4 · pack + i`
    /// in byte i; missing groups of the last pack 0; the words of the alignment's tokens,
    /// `tokens ≤ t < align(tokens, 4)`, are not written).
    PerGroupUe8m0,
}

/// Elements per scale group of [`Fp8Scaling::PerGroup`] and [`Fp8Scaling::PerGroupUe8m0`].
pub const FP8_GROUP: usize = 128;

/// The largest finite e4m3 value: outputs saturate to ±448, and computed scales are
/// `amax / 448`.
pub const FP8_E4M3_MAX: f32 = 448.0;

impl Fp8Scaling {
    /// Every scaling.
    pub const ALL: [Fp8Scaling; 4] = [
        Fp8Scaling::Static,
        Fp8Scaling::PerToken,
        Fp8Scaling::PerGroup,
        Fp8Scaling::PerGroupUe8m0,
    ];

    /// The code the kernels take (low byte of their mode parameter).
    pub fn code(self) -> u64 {
        match self {
            Fp8Scaling::Static => 0,
            Fp8Scaling::PerToken => 1,
            Fp8Scaling::PerGroup => 2,
            Fp8Scaling::PerGroupUe8m0 => 3,
        }
    }

    /// Whether scales are per group of [`FP8_GROUP`] elements.
    pub fn grouped(self) -> bool {
        matches!(self, Fp8Scaling::PerGroup | Fp8Scaling::PerGroupUe8m0)
    }

    /// Elements of the scales buffer for `tokens` rows of `hidden` (hidden a multiple of
    /// [`FP8_GROUP`] for the grouped forms): 0 (static), `tokens`, `tokens · hidden / 128`
    /// (f32), or `ceil(hidden / 128 / 4) · align(tokens, 4)` (`u32` packs).
    pub fn scales_len(self, tokens: usize, hidden: usize) -> usize {
        let groups = hidden / FP8_GROUP;
        match self {
            Fp8Scaling::Static => 0,
            Fp8Scaling::PerToken => tokens,
            Fp8Scaling::PerGroup => tokens.saturating_mul(groups),
            Fp8Scaling::PerGroupUe8m0 => groups
                .div_ceil(4)
                .saturating_mul(tokens.next_multiple_of(4)),
        }
    }
}
