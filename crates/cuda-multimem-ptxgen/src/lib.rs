//! The generator of `cuda-multimem-collectives`' PTX kernels: a build tool, never part of a
//! user's binary. `cargo xtask ptx` writes its output into
//! `crates/cuda-multimem-collectives/src/kernels/*.ptx` (committed text that the library
//! `include_str!`s and loads with `cuModuleLoadData`); `cargo xtask ptx --check` regenerates in
//! memory and fails naming every committed file that differs; the tests of this crate check the
//! same and assemble nothing (`cargo xtask ptx-check` runs ptxas where it exists).
//!
//! One template per algorithm: the control flow (work split, barrier, timeout) is shared, only
//! the element conversions and the reduction operator differ per entry. The layout constants,
//! the kernel families and their entry and file names come from the library
//! (`cuda_multimem_collectives::kernels`), so host and kernels cannot drift apart.

use cuda_multimem_collectives::kernels::*;
use cuda_multimem_collectives::{DType, ReduceOp as Op};

pub mod alltoall;
pub mod gather;
pub mod moe;
pub mod multimem;
pub mod norm;

/// Every committed kernel file: (file name under `crates/cuda-multimem-collectives/src/kernels`,
/// the text the generator writes).
pub fn files() -> Vec<(&'static str, String)> {
    Kernel::ALL
        .iter()
        .map(|k| (k.file(), generate(*k)))
        .chain([(multimem::FILE, multimem::generate())])
        .chain(gather::files())
        .chain([(norm::FILE, norm::generate())])
        .chain([(alltoall::FILE, alltoall::generate())])
        .chain([(moe::FILE, moe::generate())])
        .collect()
}

/// The committed text of a kernel file named by [`files`] (what the library loads).
pub fn committed(file: &str) -> Option<&'static str> {
    Kernel::ALL
        .iter()
        .find(|k| k.file() == file)
        .map(|k| k.ptx())
        .or((file == multimem::FILE).then_some(multimem::PTX))
        .or(gather::Collective::ALL
            .iter()
            .find(|c| c.file() == file)
            .map(|c| c.ptx()))
        .or((file == norm::FILE).then_some(norm::PTX))
        .or((file == alltoall::FILE).then_some(alltoall::PTX))
        .or((file == moe::FILE).then_some(moe::PTX))
}

/// Per-dtype/op PTX snippets. f32, f16 and bf16 keep the registers they always had (%f
/// accumulators, %h halves); the other types accumulate in registers of their class, declared
/// by [`Flavor::regs`]: f32 for FP8 (%f, 16 per vector), f64 (%fd), 32-bit integers for i32,
/// u32, i8 and u8 (%ia, 16 per vector for the bytes), 64-bit integers (%la); %xw, %xh and %xq
/// are their scratch words.
struct Flavor {
    dtype: DType,
    op: Op,
}

/// The register class a type accumulates in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    F32,
    F64,
    I32,
    I64,
}

impl Flavor {
    fn class(&self) -> Class {
        match self.dtype {
            DType::F64 => Class::F64,
            DType::I64 | DType::U64 => Class::I64,
            DType::I32 | DType::U32 | DType::I8 | DType::U8 => Class::I32,
            _ => Class::F32,
        }
    }
    /// f32, f16, bf16: the code these kernels always had.
    fn legacy(&self) -> bool {
        DType::ALL.contains(&self.dtype)
    }
    /// The FP8 format's PTX name.
    fn fp8(&self) -> Option<&'static str> {
        match self.dtype {
            DType::F8E4M3 => Some("e4m3"),
            DType::F8E5M2 => Some("e5m2"),
            _ => None,
        }
    }
    fn signed(&self) -> bool {
        matches!(self.dtype, DType::I8 | DType::I32 | DType::I64)
    }
    /// The extra register declarations of the types beyond f32, f16 and bf16.
    fn regs(&self) -> &'static str {
        if self.legacy() {
            return "";
        }
        match self.class() {
            Class::F32 => "\t.reg .b32 %xw<4>;\n\t.reg .b16 %xh<4>;\n\t.reg .b64 %xq<2>;\n",
            Class::F64 => {
                "\t.reg .b32 %xw<4>;\n\t.reg .b16 %xh<4>;\n\t.reg .b64 %xq<2>;\n\t.reg .f64 %fd<6>;\n"
            }
            Class::I32 => {
                "\t.reg .b32 %xw<4>;\n\t.reg .b16 %xh<4>;\n\t.reg .b64 %xq<2>;\n\t.reg .b32 %ia<20>;\n"
            }
            Class::I64 => {
                "\t.reg .b32 %xw<4>;\n\t.reg .b16 %xh<4>;\n\t.reg .b64 %xq<2>;\n\t.reg .b64 %la<6>;\n"
            }
        }
    }
    /// Accumulator register `i` (1-based).
    fn acc(&self, i: usize) -> String {
        match self.class() {
            Class::F32 => format!("%f{i}"),
            Class::F64 => format!("%fd{i}"),
            Class::I32 => format!("%ia{i}"),
            Class::I64 => format!("%la{i}"),
        }
    }
    /// The scratch registers an element is loaded into before it is combined (two: FP8 comes
    /// in pairs).
    fn tmp(&self, j: usize) -> String {
        match self.class() {
            Class::F32 => format!("%f{}", 17 + j),
            Class::F64 => format!("%fd{}", 3 + j),
            Class::I32 => format!("%ia{}", 17 + j),
            Class::I64 => format!("%la{}", 3 + j),
        }
    }
    /// The integer type of the integer classes' instructions.
    fn ity(&self) -> &'static str {
        match (self.class(), self.signed()) {
            (Class::I64, true) => "s64",
            (Class::I64, false) => "u64",
            (_, true) => "s32",
            _ => "u32",
        }
    }
    fn opi(&self) -> String {
        match self.class() {
            Class::F32 => match self.op {
                Op::Sum | Op::Avg => "add.rn.f32",
                Op::Min => "min.f32",
                Op::Max => "max.f32",
                Op::Prod => "mul.rn.f32",
            }
            .to_string(),
            Class::F64 => match self.op {
                Op::Sum | Op::Avg => "add.rn.f64",
                Op::Min => "min.f64",
                Op::Max => "max.f64",
                Op::Prod => "mul.rn.f64",
            }
            .to_string(),
            // two's complement: add and mul.lo wrap in the register; bytes are sign- or
            // zero-extended, so min and max compare their values and the store keeps the low
            // byte of a sum or product (the wrapped one)
            _ => {
                let t = self.ity();
                match self.op {
                    Op::Sum | Op::Avg => format!("add.{t}"),
                    Op::Min => format!("min.{t}"),
                    Op::Max => format!("max.{t}"),
                    Op::Prod => format!("mul.lo.{t}"),
                }
            }
        }
    }
    /// What turns the combined accumulators (registers `regs`) into the result before it is
    /// rounded to the type: an average divides them by the team size (%r6): f32 in f32
    /// (`div.rn.f32`, the size in %f23), f64 in f64, integers the sum wrapped to the type's
    /// width divided truncating toward zero (`div.s`/`div.u`); nothing for the other
    /// operators.
    fn finish(&self, regs: &[usize]) -> String {
        if self.op != Op::Avg {
            return String::new();
        }
        let mut s = match self.class() {
            Class::F32 => "	// average: the sum divided by the team size
	cvt.rn.f32.u32 %f23, %r6;
"
            .to_string(),
            Class::F64 => "\t// average: the sum divided by the team size, in f64\n\tcvt.rn.f64.u32 %fd5, %r6;\n".to_string(),
            Class::I64 => "\t// average: the wrapped sum divided by the team size, toward zero\n\tcvt.u64.u32 %la5, %r6;\n".to_string(),
            Class::I32 => "\t// average: the wrapped sum divided by the team size, toward zero\n".to_string(),
        };
        for &r in regs {
            let a = self.acc(r);
            s += &match self.class() {
                Class::F32 => format!(
                    "	div.rn.f32 %f{r}, %f{r}, %f23;
"
                ),
                Class::F64 => format!("\tdiv.rn.f64 {a}, {a}, %fd5;\n"),
                Class::I64 => format!("\tdiv.{} {a}, {a}, %la5;\n", self.ity()),
                Class::I32 => {
                    let wrap = match self.dtype {
                        DType::I8 => format!("\tbfe.s32 {a}, {a}, 0, 8;\n"),
                        DType::U8 => format!("\tand.b32 {a}, {a}, 255;\n"),
                        _ => String::new(),
                    };
                    format!("{wrap}\tdiv.{} {a}, {a}, %r6;\n", self.ity())
                }
            };
        }
        s
    }
    /// [`Flavor::finish`] of the scalar accumulators (%f1, and %f2 for a 16-bit pair when
    /// `pair`).
    fn finish_scalar(&self, pair: bool) -> String {
        self.finish(if pair { &[1, 2] } else { &[1] })
    }
    fn half(&self) -> bool {
        self.dtype != DType::F32
    }
    fn cvt_in(&self) -> &'static str {
        match self.dtype {
            DType::F16 => "cvt.f32.f16",
            DType::Bf16 => "cvt.f32.bf16",
            _ => "",
        }
    }
    fn cvt_out(&self) -> &'static str {
        match self.dtype {
            DType::F16 => "cvt.rn.f16.f32",
            DType::Bf16 => "cvt.rn.bf16.f32",
            _ => "",
        }
    }
    /// The elements of the words `words` (u32 registers, in order) into the accumulators
    /// 1.. (`first`) or combined into them with the operator (the types beyond f32, f16 and
    /// bf16).
    fn elems_in(&self, words: &[String], first: bool) -> String {
        let mut s = String::new();
        let es = self.es() as usize;
        let n = words.len() * 4 / es;
        let op = self.opi();
        let combine = |s: &mut String, e: usize, j: usize| {
            if !first {
                *s += &format!(
                    "\t{op} {a}, {a}, {t};\n",
                    a = self.acc(e + 1),
                    t = self.tmp(j)
                );
            }
        };
        let dst = |e: usize, j: usize| if first { self.acc(e + 1) } else { self.tmp(j) };
        if let Some(f8) = self.fp8() {
            // pairs of bytes: e4m3x2/e5m2x2 -> f16x2 (exact), each f16 -> f32 (exact)
            for p in 0..n / 2 {
                let (w, h) = (p / 2, p % 2);
                s += &format!(
                    "\tmov.b32 {{%xh0, %xh1}}, {};\n\tcvt.rn.f16x2.{f8}x2 %xw0, %xh{h};\n\tmov.b32 {{%xh2, %xh3}}, %xw0;\n\tcvt.f32.f16 {}, %xh2;\n\tcvt.f32.f16 {}, %xh3;\n",
                    words[w],
                    dst(2 * p, 0),
                    dst(2 * p + 1, 1)
                );
                combine(&mut s, 2 * p, 0);
                combine(&mut s, 2 * p + 1, 1);
            }
            return s;
        }
        for e in 0..n {
            s += &match es {
                8 => format!(
                    "\tmov.b64 {}, {{{}, {}}};\n",
                    dst(e, 0),
                    words[2 * e],
                    words[2 * e + 1]
                ),
                4 => format!("\tmov.b32 {}, {};\n", dst(e, 0), words[e]),
                _ => format!(
                    "\tbfe.{} {}, {}, {}, 8;\n",
                    if self.signed() { "s32" } else { "u32" },
                    dst(e, 0),
                    words[e / 4],
                    8 * (e % 4)
                ),
            };
            combine(&mut s, e, 0);
        }
        s
    }
    /// The finished accumulators 1.. rounded (FP8: `cvt.rn.satfinite`, nearest even, to the
    /// finite range) or wrapped (integers: their low bytes) into the words `words`.
    fn elems_out(&self, words: &[String]) -> String {
        let es = self.es() as usize;
        let n = words.len() * 4 / es;
        let regs: Vec<usize> = (1..=n).collect();
        let mut s = self.finish(&regs);
        for (w, word) in words.iter().enumerate() {
            s += &if let Some(f8) = self.fp8() {
                format!(
                    "\tcvt.rn.satfinite.{f8}x2.f32 %xh0, {}, {};\n\tcvt.rn.satfinite.{f8}x2.f32 %xh1, {}, {};\n\tmov.b32 {word}, {{%xh0, %xh1}};\n",
                    self.acc(4 * w + 2),
                    self.acc(4 * w + 1),
                    self.acc(4 * w + 4),
                    self.acc(4 * w + 3)
                )
            } else {
                match es {
                    8 if w % 2 == 0 => format!(
                        "\tmov.b64 {{{word}, {}}}, {};\n",
                        words[w + 1],
                        self.acc(w / 2 + 1)
                    ),
                    8 => String::new(),
                    4 => format!("\tmov.b32 {word}, {};\n", self.acc(w + 1)),
                    _ => {
                        let mut b = format!("\tmov.b32 {word}, {};\n", self.acc(4 * w + 1));
                        for j in 1..4 {
                            b += &format!(
                                "\tbfi.b32 {word}, {}, {word}, {}, 8;\n",
                                self.acc(4 * w + j + 1),
                                8 * j
                            );
                        }
                        b
                    }
                }
            };
        }
        s
    }
    /// The words of a 16-byte vector.
    fn vec_words() -> Vec<String> {
        (30..34).map(|r| format!("%r{r}")).collect()
    }
    /// Words %r30..%r33 -> accumulators %f1.. (first = true) or combined into them.
    fn vec_in(&self, first: bool) -> String {
        if !self.legacy() {
            return self.elems_in(&Flavor::vec_words(), first);
        }
        let mut s = String::new();
        let dst = |i: usize| if first { i + 1 } else { i + 11 };
        if self.half() {
            for w in 0..4 {
                s += &format!("\tmov.b32 {{%h1, %h2}}, %r{};\n", 30 + w);
                s += &format!("\t{} %f{}, %h1;\n", self.cvt_in(), dst(2 * w));
                s += &format!("\t{} %f{}, %h2;\n", self.cvt_in(), dst(2 * w + 1));
            }
            if !first {
                for i in 0..8 {
                    s += &format!("\t{} %f{}, %f{}, %f{};\n", self.opi(), i + 1, i + 1, i + 11);
                }
            }
        } else {
            for w in 0..4 {
                s += &format!("\tmov.b32 %f{}, %r{};\n", dst(w), 30 + w);
            }
            if !first {
                for i in 0..4 {
                    s += &format!("\t{} %f{}, %f{}, %f{};\n", self.opi(), i + 1, i + 1, i + 11);
                }
            }
        }
        s
    }
    /// Accumulators -> words %r30..%r33.
    fn vec_out(&self) -> String {
        if !self.legacy() {
            return self.elems_out(&Flavor::vec_words());
        }
        let regs: Vec<usize> = (1..=if self.half() { 8 } else { 4 }).collect();
        let mut s = self.finish(&regs);
        for w in 0..4 {
            if self.half() {
                s += &format!("\t{} %h1, %f{};\n", self.cvt_out(), 2 * w + 1);
                s += &format!("\t{} %h2, %f{};\n", self.cvt_out(), 2 * w + 2);
                s += &format!("\tmov.b32 %r{}, {{%h1, %h2}};\n", 30 + w);
            } else {
                s += &format!("\tmov.b32 %r{}, %f{};\n", 30 + w, w + 1);
            }
        }
        s
    }
    /// The elements of one 4-byte word `word` (a u32 register; types of up to 4 bytes) into
    /// the accumulators (`first`) or combined into them — the low-latency forms' unit (the
    /// types beyond f32, f16 and bf16).
    fn word_in(&self, word: &str, first: bool) -> String {
        self.elems_in(&[word.to_string()], first)
    }
    /// The finished accumulators of [`Flavor::word_in`] into `word`.
    fn word_out(&self, word: &str) -> String {
        self.elems_out(&[word.to_string()])
    }
    /// Scalar load from [addr] into %f1 (first) or combined into it.
    fn sc_load(&self, addr: &str, first: bool, cache: &str) -> String {
        if !self.legacy() {
            let d = if first { self.acc(1) } else { self.tmp(0) };
            let mut s = match (self.class(), self.fp8()) {
                (_, Some(f8)) => format!(
                    "\tld.global{cache}.u8 %xw1, [{addr}];\n\tcvt.u16.u32 %xh0, %xw1;\n\tcvt.rn.f16x2.{f8}x2 %xw0, %xh0;\n\tmov.b32 {{%xh2, %xh3}}, %xw0;\n\tcvt.f32.f16 {d}, %xh2;\n"
                ),
                (Class::F64, _) => format!("\tld.global{cache}.f64 {d}, [{addr}];\n"),
                (Class::I64, _) => format!("\tld.global{cache}.b64 {d}, [{addr}];\n"),
                _ if self.es() == 4 => format!("\tld.global{cache}.b32 {d}, [{addr}];\n"),
                _ => format!(
                    "\tld.global{cache}.{} {d}, [{addr}];\n",
                    if self.signed() { "s8" } else { "u8" }
                ),
            };
            if !first {
                s += &format!("\t{} {a}, {a}, {d};\n", self.opi(), a = self.acc(1));
            }
            return s;
        }
        let d = if first { 1 } else { 11 };
        let mut s = if self.half() {
            format!(
                "\tld.global{cache}.b16 %h1, [{addr}];\n\t{} %f{d}, %h1;\n",
                self.cvt_in()
            )
        } else {
            format!("\tld.global{cache}.f32 %f{d}, [{addr}];\n")
        };
        if !first {
            s += &format!("\t{} %f1, %f1, %f11;\n", self.opi());
        }
        s
    }
    /// Scalar store of %f1 to [addr].
    fn sc_store(&self, addr: &str) -> String {
        self.finish_scalar(false) + &self.sc_store_raw(addr)
    }
    /// [`Flavor::sc_store`] of an already finished %f1.
    fn sc_store_raw(&self, addr: &str) -> String {
        let (pre, st) = self.sc_out(addr);
        pre + &st
    }
    /// The finished scalar accumulator rounded into a store register (`.0`), and its store to
    /// [addr] (`.1`): the store can repeat for every rank.
    fn sc_out(&self, addr: &str) -> (String, String) {
        if self.legacy() {
            return if self.half() {
                (
                    format!("\t{} %h1, %f1;\n", self.cvt_out()),
                    format!("\tst.global.b16 [{addr}], %h1;\n"),
                )
            } else {
                (String::new(), format!("\tst.global.f32 [{addr}], %f1;\n"))
            };
        }
        let a = self.acc(1);
        match (self.class(), self.fp8()) {
            (_, Some(f8)) => (
                format!(
                    "\tcvt.rn.satfinite.{f8}x2.f32 %xh0, {a}, {a};\n\tcvt.u32.u16 %xw1, %xh0;\n"
                ),
                format!("\tst.global.u8 [{addr}], %xw1;\n"),
            ),
            (Class::F64, _) => (String::new(), format!("\tst.global.f64 [{addr}], {a};\n")),
            (Class::I64, _) => (String::new(), format!("\tst.global.b64 [{addr}], {a};\n")),
            _ if self.es() == 4 => (String::new(), format!("\tst.global.b32 [{addr}], {a};\n")),
            _ => (String::new(), format!("\tst.global.u8 [{addr}], {a};\n")),
        }
    }
    /// One element's bits loaded from [%rd24] and stored to [%rd26] (copies, no conversion):
    /// (load, store).
    fn sc_bits(&self) -> (&'static str, &'static str) {
        match self.es() {
            8 => (
                "\tadd.u64 %rd24, %rd2, %rd21;\n\tld.global.b64 %xq1, [%rd24];\n",
                "\tst.global.b64 [%rd26], %xq1;\n",
            ),
            4 => (
                "\tadd.u64 %rd24, %rd2, %rd21;\n\tld.global.b32 %r30, [%rd24];\n",
                "\tst.global.b32 [%rd26], %r30;\n",
            ),
            2 => (
                "\tadd.u64 %rd24, %rd2, %rd21;\n\tld.global.b16 %h1, [%rd24];\n",
                "\tst.global.b16 [%rd26], %h1;\n",
            ),
            _ => (
                "\tadd.u64 %rd24, %rd2, %rd21;\n\tld.global.u8 %r30, [%rd24];\n",
                "\tst.global.u8 [%rd26], %r30;\n",
            ),
        }
    }
    fn es(&self) -> u32 {
        self.dtype.size() as u32
    }
    fn es_log2(&self) -> u32 {
        self.es().trailing_zeros()
    }
    /// Elements per 16-byte vector, log2.
    fn v_log2(&self) -> u32 {
        4 - self.es_log2()
    }
}

const HEADER: &str = "//
// Generated by cuda-multimem-collectives (src/kernels/mod.rs): do not edit by hand.
// PTX ISA 8.1, sm_90. See docs/design/allreduce.md for the protocol.
//
.version 8.1
.target sm_90
.address_size 64
";

/// Shared prologue: parameters into registers, rank, team size, block counter.
/// Registers: rd1 ctx, rd2 in, rd3 out, rd4 count, rd5 in_tab, rd6 out_tab, rd7 sig,
/// rd8 timeout, r1 tid, r2 block, r3 ntid, r4 nblocks, r5 rank, r6 nranks, r7 counter c,
/// p9 aligned, rd10 units, rd11 block's first unit, rd12 block's end unit.
fn prologue(name: &str, f: &Flavor) -> String {
    prologue_with(name, f, "\n)")
}

/// [`prologue`] with `tail` after the `p_timeout` declaration, up to the opening brace: more
/// parameters (each after ",\n"), the closing parenthesis, performance directives.
fn prologue_with(name: &str, f: &Flavor, tail: &str) -> String {
    format!(
        r#"
.visible .entry {name}(
	.param .u64 p_ctx,
	.param .u64 p_in,
	.param .u64 p_out,
	.param .u64 p_count,
	.param .u64 p_in_tab,
	.param .u64 p_out_tab,
	.param .u64 p_sig,
	.param .u64 p_timeout{tail}
{{
{REGS}{xregs}	ld.param.u64 %rd1, [p_ctx];
	ld.param.u64 %rd2, [p_in];
	ld.param.u64 %rd3, [p_out];
	ld.param.u64 %rd4, [p_count];
	ld.param.u64 %rd5, [p_in_tab];
	ld.param.u64 %rd6, [p_out_tab];
	ld.param.u64 %rd7, [p_sig];
	ld.param.u64 %rd8, [p_timeout];
{IDS}	// 16-byte vectors when in and out are 16-byte aligned, else scalars
	or.b64 %rd9, %rd2, %rd3;
	and.b64 %rd9, %rd9, 15;
	setp.eq.u64 %p9, %rd9, 0;
	// units: vectors of {v} elements (aligned) or elements
	shr.u64 %rd10, %rd4, {vl};
	selp.b64 %rd10, %rd10, %rd4, %p9;
{BLOCK_RANGE}"#,
        v = 1u32 << f.v_log2(),
        vl = f.v_log2(),
        xregs = f.regs(),
    )
}

/// Register declarations of every kernel here (and the multimem ones); %r79 is the barrier's
/// peer index ([`barrier_with`]).
pub(crate) const REGS: &str = "\t.reg .pred %p<26>;
\t.reg .b16 %h<4>;
\t.reg .b32 %r<80>;
\t.reg .b64 %rd<92>;
\t.reg .f32 %f<24>;
";

/// Thread, block and grid ids (r1–r4), this rank and the team size from the pad in %rd1 (r5,
/// r6), and this block's barrier counter c (r7), as every kernel with barriers starts.
pub(crate) const IDS: &str = concat!(
    "\tmov.u32 %r1, %tid.x;\n",
    "\tmov.u32 %r2, %ctaid.x;\n",
    "\tmov.u32 %r3, %ntid.x;\n",
    "\tmov.u32 %r4, %nctaid.x;\n",
    "\tld.global.u32 %r5, [%rd1+0];\n",
    "\tld.global.u32 %r6, [%rd1+4];\n",
    "\t// this block's barrier counter c (only this block writes it, after its last barrier)\n",
    "\tmul.wide.u32 %rd9, %r2, 4;\n",
    "\tadd.u64 %rd9, %rd1, %rd9;\n",
    "\tld.global.u32 %r7, [%rd9+2048];\n",
);
const _: () = assert!(OFF_RANK == 0 && OFF_NRANKS == 4 && OFF_CTR == 2048);

/// This block's units [rd11, rd12) of rd10 units: per = ceil(units / nblocks) rounded up to 8
/// (rd14; with 16-byte vectors every block starts on a 128-byte line); rd13 = nblocks, rd15 =
/// this block.
pub(crate) const BLOCK_RANGE: &str =
    "\t// this block's units [rd11, rd12): per = ceil(units / nblocks)
\tcvt.u64.u32 %rd13, %r4;
\tadd.u64 %rd14, %rd10, %rd13;
\tsub.u64 %rd14, %rd14, 1;
\tdiv.u64 %rd14, %rd14, %rd13;
\t// rounded up to 8 units: with 16-byte vectors every block starts on a 128-byte line
\tadd.u64 %rd14, %rd14, 7;
\tand.b64 %rd14, %rd14, -8;
\tcvt.u64.u32 %rd15, %r2;
\tmul.lo.u64 %rd11, %rd15, %rd14;
\tmin.u64 %rd11, %rd11, %rd10;
\tadd.u64 %rd12, %rd11, %rd14;
\tmin.u64 %rd12, %rd12, %rd10;
";

/// The barrier of block b with every peer, at value `val_reg` (a u32 register), checking the
/// call header when `check_header` (header parity from register %r8).
fn barrier(label: &str, val_reg: &str, check_header: bool) -> String {
    barrier_with(label, val_reg, check_header, "")
}

/// [`barrier`] during which the threads of warps 1.. (never signalling: warp 0's lane t meets
/// peers t, t + 32, t + 64, up to `MAX_RANKS`) run `side` (code that falls through at its end and
/// may branch to `$L_{label}_done`) while warp 0 signals and waits; empty `side`: exactly
/// [`barrier`]. The peer index runs in %r79.
fn barrier_with(label: &str, val_reg: &str, check_header: bool, side: &str) -> String {
    let (to_side, side) = if side.is_empty() {
        (String::new(), String::new())
    } else {
        (
            format!(
                "\t// warps 1.. do their side work while warp 0 meets the peers\n\tsetp.ge.u32 %p10, %r1, 32;\n\t@%p10 bra $L_{label}_side;\n"
            ),
            format!("$L_{label}_side:\n{side}"),
        )
    };
    let hdr_store = if check_header {
        format!(
            r#"	// header: [peer pad + HDR + 8*((parity*MAXB + b)*MAX_RANKS + rank)]
	mad.lo.u32 %r41, %r8, {mb}, %r2;
	mad.lo.u32 %r41, %r41, {MAX_RANKS}, %r5;
	mul.wide.u32 %rd42, %r41, 8;
	add.u64 %rd42, %rd41, %rd42;
	st.relaxed.sys.global.u64 [%rd42+{OFF_HDR}], %rd7;
"#,
            mb = MAX_BLOCKS
        )
    } else {
        String::new()
    };
    let hdr_check = if check_header {
        format!(
            r#"	mad.lo.u32 %r45, %r8, {mb}, %r2;
	mad.lo.u32 %r45, %r45, {MAX_RANKS}, %r79;
	mul.wide.u32 %rd48, %r45, 8;
	add.u64 %rd48, %rd1, %rd48;
	ld.relaxed.sys.global.u64 %rd49, [%rd48+{OFF_HDR}];
	setp.eq.u64 %p14, %rd49, %rd7;
	@%p14 bra $L_{label}_wn;
{fail}"#,
            mb = MAX_BLOCKS,
            fail = err_set(OFF_ERR, ERR_MISMATCH, Some("%r79"), "%p14"),
        )
    } else {
        String::new()
    };
    format!(
        r#"	// ---- barrier {label}: block b meets block b of every peer at value {val_reg}
	bar.sync 0;
{to_side}	setp.ge.u32 %p10, %r1, 32;
	@%p10 bra $L_{label}_done;
	// lane t signals peers p = t, t + 32, ... < n, p != rank:
	// [pad_p + SIG + 4*(b*MAX_RANKS + rank)] = val (release, system scope)
	mov.u32 %r79, %r1;
$L_{label}_sl:
	setp.ge.u32 %p10, %r79, %r6;
	@%p10 bra $L_{label}_sd;
	setp.eq.u32 %p10, %r79, %r5;
	@%p10 bra $L_{label}_sn;
	mul.wide.u32 %rd40, %r79, 8;
	add.u64 %rd40, %rd1, %rd40;
	ld.global.u64 %rd41, [%rd40+{OFF_PADS}];
{hdr_store}	mad.lo.u32 %r40, %r2, {MAX_RANKS}, %r5;
	mul.wide.u32 %rd43, %r40, 4;
	add.u64 %rd43, %rd41, %rd43;
	st.release.sys.global.u32 [%rd43+{OFF_SIG}], {val_reg};
$L_{label}_sn:
	add.u32 %r79, %r79, 32;
	bra.uni $L_{label}_sl;
$L_{label}_sd:
	// and waits for the same peers: [my pad + SIG + 4*(b*MAX_RANKS + p)] >= val (acquire),
	// bounded by the timeout
	mov.u32 %r79, %r1;
$L_{label}_wl:
	setp.ge.u32 %p10, %r79, %r6;
	@%p10 bra $L_{label}_done;
	setp.eq.u32 %p10, %r79, %r5;
	@%p10 bra $L_{label}_wn;
	mad.lo.u32 %r42, %r2, {MAX_RANKS}, %r79;
	mul.wide.u32 %rd44, %r42, 4;
	add.u64 %rd44, %rd1, %rd44;
{spin}{hdr_check}$L_{label}_wn:
	add.u32 %r79, %r79, 32;
	bra.uni $L_{label}_wl;
{side}$L_{label}_done:
	bar.sync 0;
"#,
        spin = sig_spin(label, "%rd44", OFF_SIG, val_reg, OFF_ERR, Some("%r79"))
    )
}

/// Spin until the `u32` signal at [`addr` + `off`] minus `val` is at least 0 (acquire, system
/// scope), bounded by the timeout in %rd8 (then `ERR_TIMEOUT`, naming the rank in register
/// `peer` where given, into the error word at [%rd1 + `err`]: [`err_set`]) or until that error
/// word is set (then mirrored: [`err_mirror`]): on arrival it falls through at
/// `$L_{label}_arrived`, else it branches to `$L_{label}_done`. Scratch: r43, r44, r46, rd45,
/// rd46, rd90, p11–p13.
pub(crate) fn sig_spin(
    label: &str,
    addr: &str,
    off: usize,
    val: &str,
    err: usize,
    peer: Option<&str>,
) -> String {
    format!(
        r#"	mov.u64 %rd45, %globaltimer;
$L_{label}_spin:
	ld.acquire.sys.global.u32 %r43, [{addr}+{off}];
	sub.u32 %r43, %r43, {val};
	setp.ge.s32 %p11, %r43, 0;
	@%p11 bra $L_{label}_arrived;
	ld.relaxed.gpu.global.u32 %r44, [%rd1+{err}];
	setp.ne.u32 %p12, %r44, 0;
	@%p12 bra $L_{label}_seen;
	mov.u64 %rd46, %globaltimer;
	sub.u64 %rd46, %rd46, %rd45;
	setp.lt.u64 %p13, %rd46, %rd8;
	@%p13 bra $L_{label}_spin;
{timeout}	bra.uni $L_{label}_done;
$L_{label}_seen:
{seen}	bra.uni $L_{label}_done;
$L_{label}_arrived:
"#,
        timeout = err_set(err, ERR_TIMEOUT, peer, "%p12"),
        seen = err_mirror(err, "%p12"),
    )
}

/// The one way a kernel fails: the error word at [%rd1 + `err`] (the peer-to-peer pad's
/// `OFF_ERR` or the multicast member's `MM_OFF_ERR`) becomes `code`, with the rank in register
/// `peer` (+ 1) in bits 31..8 where given (`kernels::err_word`), unless it was set already (the
/// first failure stays); then the word is mirrored to the host ([`err_mirror`]). Uses %r46,
/// %rd90; `p` scratch.
pub(crate) fn err_set(err: usize, code: u32, peer: Option<&str>, p: &str) -> String {
    let word = match peer {
        Some(r) => format!(
            "\tadd.u32 %r46, {r}, 1;\n\tshl.b32 %r46, %r46, 8;\n\tor.b32 %r46, %r46, {code};\n"
        ),
        None => format!("\tmov.u32 %r46, {code};\n"),
    };
    format!(
        "\t// fail: the error word (first failure stays), mirrored to the host\n{word}\tatom.global.cas.b32 %r46, [%rd1+{err}], 0, %r46;\n{}",
        err_mirror(err, p)
    )
}

/// The error word at [%rd1 + `err`], found set, into this rank's error mirror: the `u32` of
/// host-mapped memory whose device address is at [%rd1 + `OFF_MIRROR`] (`MM_OFF_MIRROR` for
/// the multicast member; nothing where it is 0), a system-scope store, so the host sees the
/// failure before its next call with a plain load (every store carries the same word: it never
/// changes once set). Uses %r46, %rd90; `p` scratch.
pub(crate) fn err_mirror(err: usize, p: &str) -> String {
    let mirror = match err {
        OFF_ERR => OFF_MIRROR,
        multimem::MM_OFF_ERR => multimem::MM_OFF_MIRROR,
        _ => panic!("no error mirror beside the word at {err}"),
    };
    format!(
        "\tld.relaxed.gpu.global.u32 %r46, [%rd1+{err}];
\tld.global.u64 %rd90, [%rd1+{mirror}];
\tsetp.ne.u64 {p}, %rd90, 0;
\t@{p} st.relaxed.sys.global.u32 [%rd90], %r46;
"
    )
}

/// Epilogue: this block's counter and its replicas b, b+G, b+2G, ... < MAX_BLOCKS become c + 2,
/// spread over the threads (thread i writes slots b + i*G, b + (i+T)*G, ...).
fn epilogue() -> String {
    "\tadd.u32 %r9, %r7, 2;\n".to_string() + &epilogue_to("%r9")
}

/// Epilogue writing the value in register `val` (see [`epilogue`]).
fn epilogue_to(val: &str) -> String {
    format!(
        r#"	// ---- counters: the call's final value into slots b + i*G (thread i), i.e. b, b + G, ...
	mov.u32 %r9, {val};
	mad.lo.u32 %r10, %r1, %r4, %r2;
	mul.lo.u32 %r11, %r3, %r4;
$L_ctr_loop:
	setp.ge.u32 %p2, %r10, {mb};
	@%p2 bra $L_exit;
	mul.wide.u32 %rd9, %r10, 4;
	add.u64 %rd9, %rd1, %rd9;
	st.global.u32 [%rd9+{OFF_CTR}], %r9;
	add.u32 %r10, %r10, %r11;
	bra.uni $L_ctr_loop;
$L_exit:
	ret;
}}
"#,
        mb = MAX_BLOCKS
    )
}

/// A strided loop over units [`lo`, `hi`) (u64 registers) of this thread: unit index in %rd20,
/// byte offset in %rd21 (`shift` = log2 of the unit's bytes). `body` runs once per unit.
fn strided(label: &str, lo: &str, hi: &str, shift: u32, body: &str) -> String {
    strided_by(label, lo, hi, shift, body, ("%r1", "%r3"))
}

/// [`strided`] over a subset of the block's threads: this thread's index `tid` among `ntid`
/// (u32 registers).
fn strided_by(
    label: &str,
    lo: &str,
    hi: &str,
    shift: u32,
    body: &str,
    (tid, ntid): (&str, &str),
) -> String {
    format!(
        r#"	cvt.u64.u32 %rd22, {tid};
	add.u64 %rd20, {lo}, %rd22;
	cvt.u64.u32 %rd23, {ntid};
$L_{label}_loop:
	setp.ge.u64 %p15, %rd20, {hi};
	@%p15 bra $L_{label}_end;
	shl.b64 %rd21, %rd20, {shift};
{body}	add.u64 %rd20, %rd20, %rd23;
	bra.uni $L_{label}_loop;
$L_{label}_end:
"#
    )
}

/// Where rank k's copy of the current unit lives (k in %r34, the unit's byte offset in %rd21;
/// the address goes to %rd26).
#[derive(Clone, Copy)]
enum Addr<'a> {
    /// `[table + 8k] + delta` (u64 registers): a peer-address table in device memory.
    Table(&'a str, &'a str),
    /// `base + k * stride` (u64 registers): slots of one local area.
    Stride(&'a str, &'a str),
}

impl Addr<'_> {
    fn of_rank(self) -> String {
        match self {
            Addr::Table(tab, delta) => format!(
                "\tmul.wide.u32 %rd27, %r34, 8;\n\tadd.u64 %rd27, {tab}, %rd27;\n\tld.global.nc.u64 %rd26, [%rd27];\n\tadd.u64 %rd26, %rd26, {delta};\n\tadd.u64 %rd26, %rd26, %rd21;\n"
            ),
            Addr::Stride(base, stride) => format!(
                "\tcvt.u64.u32 %rd27, %r34;\n\tmul.lo.u64 %rd27, %rd27, {stride};\n\tadd.u64 %rd26, {base}, %rd27;\n\tadd.u64 %rd26, %rd26, %rd21;\n"
            ),
        }
    }
}

/// Reduce one unit over every rank: the address of rank k's unit is `[table + 8k] + delta +
/// %rd21` (table in `tab`, delta in `delta`, both u64 registers); result in the accumulators.
fn reduce_over_ranks(label: &str, f: &Flavor, at: Addr, vector: bool) -> String {
    let (first, rest) = if vector {
        (
            format!(
                "\tld.global.cg.v4.b32 {{%r30, %r31, %r32, %r33}}, [%rd26];\n{}",
                f.vec_in(true)
            ),
            format!(
                "\tld.global.cg.v4.b32 {{%r30, %r31, %r32, %r33}}, [%rd26];\n{}",
                f.vec_in(false)
            ),
        )
    } else {
        (
            f.sc_load("%rd26", true, ".cg"),
            f.sc_load("%rd26", false, ".cg"),
        )
    };
    let addr = at.of_rank();
    format!(
        r#"	// rank 0 first, then 1.. in order: every rank sums in the same order (bit-identical)
	mov.u32 %r34, 0;
{addr}{first}	mov.u32 %r34, 1;
$L_{label}_k:
	setp.ge.u32 %p16, %r34, %r6;
	@%p16 bra $L_{label}_kend;
{addr}{rest}	add.u32 %r34, %r34, 1;
	bra.uni $L_{label}_k;
$L_{label}_kend:
"#
    )
}

/// Store the accumulators to `[table + 8k] + delta + %rd21` for every rank k.
fn store_to_ranks(label: &str, f: &Flavor, at: Addr, vector: bool) -> String {
    let (pre, st) = if vector {
        (
            f.vec_out(),
            "\tst.global.v4.b32 [%rd26], {%r30, %r31, %r32, %r33};\n".to_string(),
        )
    } else {
        let (pre, st) = f.sc_out("%rd26");
        (f.finish_scalar(false) + &pre, st)
    };
    format!("{pre}{}", store_loop(label, at, &st))
}

/// Store (with `st`, reading %rd26 as the address) to the same unit of every rank k.
fn store_loop(label: &str, at: Addr, st: &str) -> String {
    let addr = at.of_rank();
    format!(
        r#"	mov.u32 %r34, 0;
$L_{label}_s:
	setp.ge.u32 %p16, %r34, %r6;
	@%p16 bra $L_{label}_send;
{addr}{st}	add.u32 %r34, %r34, 1;
	bra.uni $L_{label}_s;
$L_{label}_send:
"#
    )
}

/// The one-shot kernels' staging of this call: parity %r8 = (c >> 1) & 1, slot bytes %rd30 (the
/// `u64` at pad offset `slot_off`), push delta %rd31 = (parity * n + rank) * slot into every
/// rank's area (the table at pad offset `areas_off`, in %rd34), and my slots of this parity
/// %rd33 = my area + parity * n * slot.
fn parity_slots(slot_off: usize, areas_off: usize) -> String {
    format!(
        r#"	// staging: [parity][sender][slot]; parity = (c >> 1) & 1
	shr.u32 %r8, %r7, 1;
	and.b32 %r8, %r8, 1;
	ld.global.u64 %rd30, [%rd1+{slot_off}];
	// push delta: (parity * nranks + rank) * slot, into every rank's staging
	mad.lo.u32 %r15, %r8, %r6, %r5;
	cvt.u64.u32 %rd31, %r15;
	mul.lo.u64 %rd31, %rd31, %rd30;
	add.u64 %rd34, %rd1, {areas_off};
	// my slots of this parity: my staging + parity * nranks * slot
	mul.wide.u32 %rd32, %r5, 8;
	add.u64 %rd32, %rd1, %rd32;
	ld.global.u64 %rd33, [%rd32+{areas_off}];
	mul.lo.u32 %r16, %r8, %r6;
	cvt.u64.u32 %rd35, %r16;
	mul.lo.u64 %rd35, %rd35, %rd30;
	add.u64 %rd33, %rd33, %rd35;
"#
    )
}

/// The two-shot family's setup after the prologue: header parity %r8 = (c >> 1) & 1, and the
/// deltas of this call's operands from the start of this rank's registered buffers, %rd31 (in)
/// and %rd32 (out) — the same offsets on every rank.
const PARITY_AND_DELTAS: &str = "\t// header parity = (c >> 1) & 1
\tshr.u32 %r8, %r7, 1;
\tand.b32 %r8, %r8, 1;
\t// deltas: in - in_tab[rank], out - out_tab[rank] (the same offsets on every rank)
\tmul.wide.u32 %rd30, %r5, 8;
\tadd.u64 %rd31, %rd5, %rd30;
\tld.global.nc.u64 %rd31, [%rd31];
\tsub.u64 %rd31, %rd2, %rd31;
\tadd.u64 %rd32, %rd6, %rd30;
\tld.global.nc.u64 %rd32, [%rd32];
\tsub.u64 %rd32, %rd3, %rd32;
";

/// [`tail_range`], and %p17: this block is the last block of the last rank (which reduces the
/// scalar tail in the two-shot family).
fn last_rank_tail(f: &Flavor) -> String {
    tail_range(f)
        + "\tsub.u32 %r11, %r4, 1;\n\tsetp.eq.u32 %p17, %r2, %r11;\n\tsub.u32 %r13, %r6, 1;\n\tsetp.eq.and.u32 %p17, %r5, %r13, %p17;\n"
}

/// The two-shot family's scalar tail, on the block chosen by %p17: elements [rd16, count) read
/// from every rank's input, reduced in rank order, stored to every rank's output.
fn scalar_tail_to_all(f: &Flavor) -> String {
    let mut body = reduce_over_ranks("rt", f, Addr::Table("%rd5", "%rd31"), false);
    body += &store_to_ranks("st", f, Addr::Table("%rd6", "%rd32"), false);
    format!(
        "\t@!%p17 bra $L_red_done;\n{}$L_red_done:\n",
        strided("red_t", "%rd16", "%rd4", f.es_log2(), &body)
    )
}

/// The leftover elements (count not a multiple of the vector width, aligned case): elements
/// [units*V, count) as scalars, with %rd20 the element index and %rd21 its byte offset.
fn tail_range(f: &Flavor) -> String {
    format!(
        "\tshl.b64 %rd16, %rd10, {vl};\n\tselp.b64 %rd16, %rd16, %rd4, %p9;\n",
        vl = f.v_log2()
    )
}

fn one_shot(f: &Flavor) -> String {
    let name = Kernel::P2pOneShot.entry(f.dtype, f.op);
    let es = f.es_log2();
    let mut s = prologue(&name, f);
    s += &format!(
        r#"{slots}	// tail: elements [rd16, count) by the last block
	{tail}	sub.u32 %r11, %r4, 1;
	setp.eq.u32 %p17, %r2, %r11;
	@!%p9 bra $L_cin_sc;
"#,
        tail = tail_range(f).trim_start(),
        slots = parity_slots(OFF_STAGE_HALF, OFF_STAGES),
    );
    // push my input into my slot of every rank's staging
    let push = Addr::Table("%rd34", "%rd31");
    let mut body =
        "\tadd.u64 %rd24, %rd2, %rd21;\n\tld.global.v4.b32 {%r30, %r31, %r32, %r33}, [%rd24];\n"
            .to_string();
    body += &store_loop(
        "pv",
        push,
        "\tst.global.v4.b32 [%rd26], {%r30, %r31, %r32, %r33};\n",
    );
    s += &strided("cin_v", "%rd11", "%rd12", 4, &body);
    s += "\tbra.uni $L_cin_tail;\n$L_cin_sc:\n";
    let (ld, st) = f.sc_bits();
    s += &strided(
        "cin_s",
        "%rd11",
        "%rd12",
        es,
        &format!("{ld}{}", store_loop("ps", push, st)),
    );
    s += "$L_cin_tail:\n\t@!%p17 bra $L_cin_done;\n";
    s += &strided(
        "cin_t",
        "%rd16",
        "%rd4",
        es,
        &format!("{ld}{}", store_loop("pt", push, st)),
    );
    s += "$L_cin_done:\n";
    s += "\tadd.u32 %r12, %r7, 1;\n";
    s += &barrier("b1", "%r12", true);
    // reduce my local slots
    let mine = Addr::Stride("%rd33", "%rd30");
    s += "\t@!%p9 bra $L_red_sc;\n";
    let mut body = reduce_over_ranks("rv", f, mine, true);
    body += &f.vec_out();
    body +=
        "\tadd.u64 %rd24, %rd3, %rd21;\n\tst.global.v4.b32 [%rd24], {%r30, %r31, %r32, %r33};\n";
    s += &strided("red_v", "%rd11", "%rd12", 4, &body);
    s += "\tbra.uni $L_red_tail;\n$L_red_sc:\n";
    let mut body = reduce_over_ranks("rs", f, mine, false);
    body += "\tadd.u64 %rd24, %rd3, %rd21;\n";
    body += &f.sc_store("%rd24");
    s += &strided("red_s", "%rd11", "%rd12", es, &body);
    s += "$L_red_tail:\n\t@!%p17 bra $L_red_done;\n";
    let mut body = reduce_over_ranks("rt", f, mine, false);
    body += "\tadd.u64 %rd24, %rd3, %rd21;\n";
    body += &f.sc_store("%rd24");
    s += &strided("red_t", "%rd16", "%rd4", es, &body);
    s += "$L_red_done:\n";
    s += &epilogue();
    s
}

fn two_shot(f: &Flavor) -> String {
    let name = Kernel::P2pTwoShot.entry(f.dtype, f.op);
    let es = f.es_log2();
    let mut s = prologue(&name, f);
    s += &format!(
        r#"{PARITY_AND_DELTAS}	// my part of the block's units: pp = ceil((end - start) / nranks), rounded up to 8 units
	sub.u64 %rd35, %rd12, %rd11;
	cvt.u64.u32 %rd36, %r6;
	add.u64 %rd35, %rd35, %rd36;
	sub.u64 %rd35, %rd35, 1;
	div.u64 %rd35, %rd35, %rd36;
	add.u64 %rd35, %rd35, 7;
	and.b64 %rd35, %rd35, -8;
	cvt.u64.u32 %rd37, %r5;
	mul.lo.u64 %rd37, %rd37, %rd35;
	add.u64 %rd37, %rd37, %rd11;
	min.u64 %rd37, %rd37, %rd12;
	add.u64 %rd38, %rd37, %rd35;
	min.u64 %rd38, %rd38, %rd12;
	// tail: elements [rd16, count) by the last block of the last rank
	{tail}	add.u32 %r12, %r7, 1;
"#,
        tail = last_rank_tail(f).trim_start()
    );
    s += &barrier("b1", "%r12", true);
    s += "\t@!%p9 bra $L_red_sc;\n";
    let mut body = reduce_over_ranks("rv", f, Addr::Table("%rd5", "%rd31"), true);
    body += &store_to_ranks("sv", f, Addr::Table("%rd6", "%rd32"), true);
    s += &strided("red_v", "%rd37", "%rd38", 4, &body);
    s += "\tbra.uni $L_red_tail;\n$L_red_sc:\n";
    let mut body = reduce_over_ranks("rs", f, Addr::Table("%rd5", "%rd31"), false);
    body += &store_to_ranks("ss", f, Addr::Table("%rd6", "%rd32"), false);
    s += &strided("red_s", "%rd37", "%rd38", es, &body);
    s += "$L_red_tail:\n";
    s += &scalar_tail_to_all(f);
    s += "\tadd.u32 %r14, %r7, 2;\n";
    s += &barrier("b2", "%r14", false);
    s += &epilogue();
    s
}

/// The low-latency flag of this call into the high word of `dst` (64-bit): bits 31..16 of the
/// flag this call's counter, `0x8000 | ((c + 1) & 0x7fff)` (never 0: a cell nobody wrote is 0),
/// bits 15..0 the call header (%rd7) folded to 16 bits — as `kernels::ll_flag` on the host.
/// Uses %r12, %r17, %r18, %rd18.
pub(crate) fn ll_flag(dst: &str) -> String {
    format!(
        "\t// flag: this call's counter (bits 31..16) and its header folded to 16 bits (15..0)
\tadd.u32 %r12, %r7, 1;
\tand.b32 %r12, %r12, 32767;
\tor.b32 %r12, %r12, 32768;
\tshl.b32 %r12, %r12, 16;
\tcvt.u32.u64 %r17, %rd7;
\tshr.b64 %rd18, %rd7, 32;
\tcvt.u32.u64 %r18, %rd18;
\txor.b32 %r17, %r17, %r18;
\tshr.b32 %r18, %r17, 16;
\txor.b32 %r17, %r17, %r18;
\tand.b32 %r17, %r17, 65535;
\tor.b32 %r12, %r12, %r17;
\tcvt.u64.u32 {dst}, %r12;
\tshl.b64 {dst}, {dst}, 32;
"
    )
}

/// A polled low-latency cell (`cell`, 64-bit, its flag in the high word) that is not this
/// call's (`flag`, high word) but carries this call's counter: its sender called with another
/// shape (size, type, operator, collective, root, norm shape, operands) — to `{l}_mm`
/// ([`ll_report`]). As `kernels::ll_disagrees` on the host. Uses %rd90; `pa`, `pb` scratch.
pub(crate) fn ll_mismatch(l: &str, cell: &str, flag: &str, pa: &str, pb: &str) -> String {
    format!(
        "\tand.b64 %rd90, {cell}, -4294967296;
\txor.b64 %rd90, %rd90, {flag};
\tsetp.ne.u64 {pa}, %rd90, 0;
\tshr.u64 %rd90, %rd90, 48;
\tsetp.eq.and.u64 {pb}, %rd90, 0, {pa};
\t@{pb} bra {l}_mm;
"
    )
}

/// A low-latency poll that has waited `elapsed` (u64 ns) past `LL_PEEK_NS`: a peer whose
/// block 0 signalled this rank's first barrier slot at this call's first barrier value (c + 1)
/// is in a barrier kernel at this call — it called another collective or size — to `{l}_mm`
/// ([`ll_report`]). As the simulator's `ll_poll`. Uses %r44, %r45, %r46, %rd90; `pa`, `pb`
/// scratch.
pub(crate) fn ll_barrier_peek(l: &str, elapsed: &str, pa: &str, pb: &str) -> String {
    format!(
        "\tsetp.lt.u64 {pa}, {elapsed}, {LL_PEEK_NS};
\t@{pa} bra {l}_nopeek;
\tadd.u32 %r46, %r7, 1;
\tmov.u32 %r44, 0;
{l}_peek:
\tmul.wide.u32 %rd90, %r44, 4;
\tadd.u64 %rd90, %rd1, %rd90;
\tld.relaxed.sys.global.u32 %r45, [%rd90+{OFF_SIG}];
\tsetp.eq.u32 {pb}, %r45, %r46;
\t@{pb} bra {l}_mm;
\tadd.u32 %r44, %r44, 1;
\tsetp.lt.u32 {pa}, %r44, %r6;
\t@{pa} bra {l}_peek;
{l}_nopeek:
"
    )
}

/// The end of a low-latency poll's wait (placed where its deadline passed, before `got`): the
/// timeout ([`err_set`], naming the rank in register `peer` where given); a poll that found a
/// disagreement (`{l}_mm`) sets `ERR_MISMATCH` in the error word of every rank (its own and its
/// peers', which end their waits at it, so every rank reports the disagreement and none waits
/// for the timeout); a poll that found the error word set goes to `{l}_seen`. Each mirrors
/// this rank's word to the host ([`err_mirror`]) and ends at `got`. Uses %r44, %r46, %rd90;
/// `pa` scratch.
pub(crate) fn ll_report(l: &str, got: &str, peer: Option<&str>, pa: &str) -> String {
    format!(
        "{timeout}\tbra.uni {got};
{l}_mm:
\tmov.u32 %r44, 0;
{l}_mmk:
\tmul.wide.u32 %rd90, %r44, 8;
\tadd.u64 %rd90, %rd1, %rd90;
\tld.global.u64 %rd90, [%rd90+{OFF_PADS}];
\tatom.relaxed.sys.global.cas.b32 %r46, [%rd90+{OFF_ERR}], 0, {ERR_MISMATCH};
\tadd.u32 %r44, %r44, 1;
\tsetp.lt.u32 {pa}, %r44, %r6;
\t@{pa} bra {l}_mmk;
{l}_seen:
{seen}",
        timeout = err_set(OFF_ERR, ERR_TIMEOUT, peer, pa),
        seen = err_mirror(OFF_ERR, pa),
    )
}

/// Low-latency one-shot. Needs 4-byte aligned input and output and a message of whole 4-byte
/// words (the host checks). Word w of rank s's input travels as `(flag << 32) | word` to slot
/// `[parity][s]` of every rank's low-latency staging, the flag this call's counter and shape
/// ([`ll_flag`]); each rank polls its own slots until every word carries this call's flag,
/// reduces and stores. A rank that called with another shape writes flags of the same counter
/// and another shape: the others take none of its data and report the disagreement
/// ([`ll_mismatch`]) at once.
fn one_shot_ll(f: &Flavor) -> String {
    let name = Kernel::P2pOneShotLl.entry(f.dtype, f.op);
    let mut s = prologue(&name, f);
    // words = count * es / 4; this block's words [rd11, rd12)
    s += &format!(
        r#"	shl.b64 %rd10, %rd4, {es};
	shr.u64 %rd10, %rd10, 2;
	add.u64 %rd14, %rd10, %rd13;
	sub.u64 %rd14, %rd14, 1;
	div.u64 %rd14, %rd14, %rd13;
	mul.lo.u64 %rd11, %rd15, %rd14;
	min.u64 %rd11, %rd11, %rd10;
	add.u64 %rd12, %rd11, %rd14;
	min.u64 %rd12, %rd12, %rd10;
{flag}{slots}"#,
        es = f.es_log2(),
        flag = ll_flag("%rd17"),
        slots = parity_slots(OFF_LL_SLOT, OFF_LL_STAGES),
    );
    // send: word w -> 8-byte (flag, word) at offset 8w of my slot on every rank
    let mut body = "	shl.b64 %rd24, %rd20, 2;
	add.u64 %rd24, %rd2, %rd24;
	ld.global.b32 %r30, [%rd24];
	cvt.u64.u32 %rd25, %r30;
	or.b64 %rd25, %rd25, %rd17;
"
    .to_string();
    body += &store_loop(
        "ls",
        Addr::Table("%rd34", "%rd31"),
        "	st.relaxed.sys.global.u64 [%rd26], %rd25;
",
    );
    s += &strided("snd", "%rd11", "%rd12", 3, &body);
    // receive: poll every rank's word, reduce in rank order, store
    let combine = |first: bool| -> String {
        if !f.legacy() {
            return f.word_in("%r31", first);
        }
        let (d1, d2) = if first { (1, 2) } else { (11, 12) };
        let mut c = if f.half() {
            format!(
                "	mov.b32 {{%h1, %h2}}, %r31;
	{cvt} %f{d1}, %h1;
	{cvt} %f{d2}, %h2;
",
                cvt = f.cvt_in()
            )
        } else {
            format!(
                "	mov.b32 %f{d1}, %r31;
"
            )
        };
        if !first {
            c += &format!(
                "	{} %f1, %f1, %f11;
",
                f.opi()
            );
            if f.half() {
                c += &format!(
                    "	{} %f2, %f2, %f12;
",
                    f.opi()
                );
            }
        }
        c
    };
    let poll = |label: &str| -> String {
        format!(
            r#"	mov.u64 %rd45, %globaltimer;
$L_{label}_spin:
	ld.relaxed.sys.global.u64 %rd46, [%rd26];
	and.b64 %rd47, %rd46, -4294967296;
	setp.eq.u64 %p11, %rd47, %rd17;
	@%p11 bra $L_{label}_got;
{mismatch}	ld.relaxed.gpu.global.u32 %r44, [%rd1+{OFF_ERR}];
	setp.ne.u32 %p12, %r44, 0;
	@%p12 bra $L_{label}_seen;
	mov.u64 %rd48, %globaltimer;
	sub.u64 %rd48, %rd48, %rd45;
{peek}	setp.lt.u64 %p13, %rd48, %rd8;
	@%p13 bra $L_{label}_spin;
{report}$L_{label}_got:
	cvt.u32.u64 %r31, %rd46;
"#,
            mismatch = ll_mismatch(&format!("$L_{label}"), "%rd46", "%rd17", "%p24", "%p25"),
            peek = ll_barrier_peek(&format!("$L_{label}"), "%rd48", "%p24", "%p25"),
            report = ll_report(
                &format!("$L_{label}"),
                &format!("$L_{label}_got"),
                Some("%r34"),
                "%p24"
            )
        )
    };
    let mine = Addr::Stride("%rd33", "%rd30");
    let mut body = "	shl.b64 %rd21, %rd20, 3;
	mov.u32 %r34, 0;
"
    .to_string();
    body += &mine.of_rank();
    body += &poll("p0");
    body += &combine(true);
    body += "	mov.u32 %r34, 1;
$L_rk:
	setp.ge.u32 %p16, %r34, %r6;
	@%p16 bra $L_rkend;
";
    body += &mine.of_rank();
    body += &poll("pk");
    body += &combine(false);
    body += "	add.u32 %r34, %r34, 1;
	bra.uni $L_rk;
$L_rkend:
";
    if !f.legacy() {
        body += &f.word_out("%r31");
    } else if f.half() {
        body += &f.finish_scalar(true);
        body += &format!(
            "	{c} %h1, %f1;
	{c} %h2, %f2;
	mov.b32 %r31, {{%h1, %h2}};
",
            c = f.cvt_out()
        );
    } else {
        body += &f.finish_scalar(false);
        body += "	mov.b32 %r31, %f1;
";
    }
    body += "	shl.b64 %rd24, %rd20, 2;
	add.u64 %rd24, %rd3, %rd24;
	st.global.b32 [%rd24], %r31;
";
    s += &strided("rcv", "%rd11", "%rd12", 3, &body);
    // Every warp has read the block's counter (at its start) before thread 0 overwrites it: no
    // barrier orders them otherwise, and a late warp would take c + 2 for its c.
    s += "\tbar.sync 0;\n";
    s += &epilogue();
    s
}

/// Write-only two-shot in rounds (see [`Kernel::P2pTwoShotPush`]). Vector units only (the host
/// sends misaligned calls to the reading two-shot); the scalar tail goes as in the two-shot.
///
/// Block b's range is cut into rounds of `C = n * bsz` units, `bsz = (slot bytes / 16) / G`
/// rounded down to 8:
/// each block owns `bsz` units of every staging slot, at `b * bsz * 16`. Round j: push part k
/// of the round's chunk into k's slot `[q][rank]` (q = (header parity + j) & 1) at the part's
/// offset in the chunk → barrier(c+1+j) → reduce my part from my input and my slots, push the
/// result into every rank's output. After R rounds (the same R on every block and rank) the
/// tail, barrier(c+R+1) and counters c + 2M (M odd, 2M ≥ R+1: the header parity still flips).
fn two_shot_push(f: &Flavor) -> String {
    let name = Kernel::P2pTwoShotPush.entry(f.dtype, f.op);
    // the prologue copy's parameters; at most 1024 threads (the host's push shapes), so ptxas
    // keeps to 64 registers, what one 1024-thread block per multiprocessor needs
    let mut s = prologue_with(
        &name,
        f,
        ",\n\t.param .u64 p_copy_src,\n\t.param .u64 p_copy_dst,\n\t.param .u64 p_copy_bytes\n)\n.maxntid 1024, 1, 1",
    );
    s += &format!(
        r#"{PARITY_AND_DELTAS}	// slot bytes rd39; this block's share of a slot: bsz = (slot / 16) / G units rounded down
	// to 8 (the host keeps G <= slot / 128) (rd50), at byte offset b * bsz * 16 (rd52); units
	// per round C = n * bsz (rd51)
	ld.global.u64 %rd39, [%rd1+{OFF_STAGE_HALF}];
	shr.u64 %rd50, %rd39, 4;
	div.u64 %rd50, %rd50, %rd13;
	and.b64 %rd50, %rd50, -8;
	mul.lo.u64 %rd52, %rd15, %rd50;
	shl.b64 %rd52, %rd52, 4;
	cvt.u64.u32 %rd36, %r6;
	mul.lo.u64 %rd51, %rd50, %rd36;
	// rounds R = max(1, ceil(per / C)) (r20): the same on every block and rank
	add.u64 %rd53, %rd14, %rd51;
	sub.u64 %rd53, %rd53, 1;
	div.u64 %rd53, %rd53, %rd51;
	max.u64 %rd53, %rd53, 1;
	cvt.u32.u64 %r20, %rd53;
	// counters after the call: c + 2M, M = ceil((R + 1) / 2) made odd (r21)
	add.u32 %r21, %r20, 2;
	shr.u32 %r21, %r21, 1;
	or.b32 %r21, %r21, 1;
	shl.b32 %r21, %r21, 1;
	add.u32 %r21, %r7, %r21;
	// every rank's staging (table rd34), mine (rd54)
	add.u64 %rd34, %rd1, {OFF_STAGES};
	mul.wide.u32 %rd41, %r5, 8;
	add.u64 %rd41, %rd1, %rd41;
	ld.global.u64 %rd54, [%rd41+{OFF_STAGES}];
	{tail}	// ---- rounds: j in r37, the round's first unit in rd55
	mov.u32 %r37, 0;
	mov.u64 %rd55, %rd11;
$L_round:
	setp.ge.u32 %p20, %r37, %r20;
	@%p20 bra $L_rounds_done;
	// chunk [lo, hi) = [min(rd55, end), min(lo + C, end)); part size pp = ceil((hi - lo) / n)
	// rounded up to 8 units (at most bsz, a multiple of 8)
	min.u64 %rd55, %rd55, %rd12;
	add.u64 %rd56, %rd55, %rd51;
	min.u64 %rd56, %rd56, %rd12;
	sub.u64 %rd35, %rd56, %rd55;
	add.u64 %rd35, %rd35, %rd36;
	sub.u64 %rd35, %rd35, 1;
	div.u64 %rd35, %rd35, %rd36;
	add.u64 %rd35, %rd35, 7;
	and.b64 %rd35, %rd35, -8;
	// slot parity q = (parity + j) & 1: push delta (q*n + rank)*slot + block offset (rd57),
	// my slots of parity q: mine + q*n*slot + block offset (rd58)
	add.u32 %r22, %r8, %r37;
	and.b32 %r22, %r22, 1;
	mad.lo.u32 %r15, %r22, %r6, %r5;
	cvt.u64.u32 %rd57, %r15;
	mul.lo.u64 %rd57, %rd57, %rd39;
	add.u64 %rd57, %rd57, %rd52;
	mul.lo.u32 %r16, %r22, %r6;
	cvt.u64.u32 %rd58, %r16;
	mul.lo.u64 %rd58, %rd58, %rd39;
	add.u64 %rd58, %rd58, %rd54;
	add.u64 %rd58, %rd58, %rd52;
	// phase A: for every other rank k, part k of the chunk into k's slot [q][rank], at
	// (unit - part start) * 16
	mov.u32 %r36, 0;
$L_pk_loop:
	setp.ge.u32 %p18, %r36, %r6;
	@%p18 bra $L_pk_done;
	setp.eq.u32 %p19, %r36, %r5;
	@%p19 bra $L_pk_next;
{part_k}	mul.wide.u32 %rd43, %r36, 8;
	add.u64 %rd43, %rd34, %rd43;
	ld.global.nc.u64 %rd59, [%rd43];
	add.u64 %rd59, %rd59, %rd57;
	shl.b64 %rd43, %rd37, 4;
	sub.u64 %rd59, %rd59, %rd43;
"#,
        tail = last_rank_tail(f).trim_start(),
        part_k = part_of_chunk("%r36"),
    );
    s += &strided(
        "pa",
        "%rd37",
        "%rd38",
        4,
        "\tadd.u64 %rd24, %rd2, %rd21;\n\tld.global.v4.b32 {%r30, %r31, %r32, %r33}, [%rd24];\n\tadd.u64 %rd25, %rd59, %rd21;\n\tst.global.v4.b32 [%rd25], {%r30, %r31, %r32, %r33};\n",
    );
    s += "$L_pk_next:\n\tadd.u32 %r36, %r36, 1;\n\tbra.uni $L_pk_loop;\n$L_pk_done:\n";
    s += "\tadd.u32 %r12, %r7, 1;\n\tadd.u32 %r12, %r12, %r37;\n";
    s += &barrier_with("b1", "%r12", true, &prologue_copy_slice("b1"));
    // phase B: my part; rank k's copy is my input (k == rank) or my slot k (local memory)
    s += &part_of_chunk("%r5");
    s += "\tshl.b64 %rd43, %rd37, 4;\n\tsub.u64 %rd60, %rd58, %rd43;\n";
    let addr_k = "\tsetp.eq.u32 %p19, %r34, %r5;\n\tcvt.u64.u32 %rd27, %r34;\n\tmul.lo.u64 %rd27, %rd27, %rd39;\n\tadd.u64 %rd26, %rd60, %rd27;\n\tselp.b64 %rd26, %rd2, %rd26, %p19;\n\tadd.u64 %rd26, %rd26, %rd21;\n";
    let mut body = format!(
        "\tmov.u32 %r34, 0;\n{addr_k}\tld.global.cg.v4.b32 {{%r30, %r31, %r32, %r33}}, [%rd26];\n{}\tmov.u32 %r34, 1;\n$L_pb_k:\n\tsetp.ge.u32 %p16, %r34, %r6;\n\t@%p16 bra $L_pb_kend;\n{addr_k}\tld.global.cg.v4.b32 {{%r30, %r31, %r32, %r33}}, [%rd26];\n{}\tadd.u32 %r34, %r34, 1;\n\tbra.uni $L_pb_k;\n$L_pb_kend:\n",
        f.vec_in(true),
        f.vec_in(false)
    );
    body += &store_to_ranks("sv", f, Addr::Table("%rd6", "%rd32"), true);
    s += &strided("pb", "%rd37", "%rd38", 4, &body);
    s += "\tadd.u32 %r37, %r37, 1;\n\tadd.u64 %rd55, %rd55, %rd51;\n\tbra.uni $L_round;\n$L_rounds_done:\n";
    // tail as in the two-shot: remote reads of the inputs, stores to every output
    s += &scalar_tail_to_all(f);
    s += "\tadd.u32 %r14, %r7, %r20;\n\tadd.u32 %r14, %r14, 1;\n";
    s += &barrier("b2", "%r14", false);
    s += &epilogue_to("%r21");
    s
}

/// The push kernel's prologue copy, round j's slice, run by the threads of warps 1.. of block b
/// inside barrier `label` of round j (while warp 0 signals and waits): the `p_copy_bytes`
/// bytes at `p_copy_src` to `p_copy_dst` in 16-byte vectors (the host passes 16-byte aligned
/// addresses and a multiple of 16 bytes; 0 bytes: nothing). Block b owns units
/// `[b * per, (b + 1) * per)`, per = ceil(units / G) rounded up to 8; slice j of its range is
/// `[j * S, (j + 1) * S)`, S = ceil(per / R) rounded up to 8 (R = rounds, in %r20; j in %r37).
/// Registers: rd61..rd68, rd20..rd25, r30..r33, r47, p15, p21, all dead after the barrier; it
/// reads r1..r4, r20 and r37, live through the rounds anyway.
fn prologue_copy_slice(label: &str) -> String {
    format!(
        r#"	// ---- prologue copy: this round's slice of this block's share, by warps 1..
	ld.param.u64 %rd63, [p_copy_bytes];
	shr.u64 %rd63, %rd63, 4;
	setp.eq.u64 %p21, %rd63, 0;
	@%p21 bra $L_{label}_done;
	// block share [rd65, rd66): per = ceil(units / G) rounded up to 8 (rd64); G and b from
	// %r4 and %r2 (live all kernel long), not the prologue's rd13 and rd15 (dead by now)
	cvt.u64.u32 %rd67, %r4;
	add.u64 %rd64, %rd63, %rd67;
	sub.u64 %rd64, %rd64, 1;
	div.u64 %rd64, %rd64, %rd67;
	add.u64 %rd64, %rd64, 7;
	and.b64 %rd64, %rd64, -8;
	cvt.u64.u32 %rd67, %r2;
	mul.lo.u64 %rd65, %rd67, %rd64;
	min.u64 %rd65, %rd65, %rd63;
	add.u64 %rd66, %rd65, %rd64;
	min.u64 %rd66, %rd66, %rd63;
	// slice S = ceil(per / R) rounded up to 8 (rd68); round j: [lo + j*S, lo + (j+1)*S) clamped
	cvt.u64.u32 %rd67, %r20;
	add.u64 %rd68, %rd64, %rd67;
	sub.u64 %rd68, %rd68, 1;
	div.u64 %rd68, %rd68, %rd67;
	add.u64 %rd68, %rd68, 7;
	and.b64 %rd68, %rd68, -8;
	cvt.u64.u32 %rd67, %r37;
	mad.lo.u64 %rd65, %rd67, %rd68, %rd65;
	min.u64 %rd65, %rd65, %rd66;
	add.u64 %rd68, %rd65, %rd68;
	min.u64 %rd66, %rd68, %rd66;
	ld.param.u64 %rd61, [p_copy_src];
	ld.param.u64 %rd62, [p_copy_dst];
	// thread t >= 32 copies units lo + (t - 32), + (ntid - 32), ...
	sub.u32 %r47, %r1, 32;
	cvt.u64.u32 %rd20, %r47;
	add.u64 %rd20, %rd20, %rd65;
	sub.u32 %r47, %r3, 32;
	cvt.u64.u32 %rd23, %r47;
$L_{label}_cp:
	setp.ge.u64 %p15, %rd20, %rd66;
	@%p15 bra $L_{label}_done;
	shl.b64 %rd21, %rd20, 4;
	add.u64 %rd24, %rd61, %rd21;
	ld.global.cs.v4.b32 {{%r30, %r31, %r32, %r33}}, [%rd24];
	add.u64 %rd25, %rd62, %rd21;
	st.global.cs.v4.b32 [%rd25], {{%r30, %r31, %r32, %r33}};
	add.u64 %rd20, %rd20, %rd23;
	bra.uni $L_{label}_cp;
"#
    )
}

/// The copy-engine two-shot (see [`Kernel::P2pTwoShotCe`]). Rank r's part is the r-th N-th of
/// the message, [r * P, (r + 1) * P) vectors; the blocks split it (ranges rounded to 8 vectors).
/// Sender k's copy of my part lies in my landing slot k, indexed from my part's start. The
/// copies are complete before the kernel starts (stream order on the sender), so the sender's
/// release at barrier(c+1) covers them. Scalar tail as in the two-shot; counters + 2.
fn two_shot_ce(f: &Flavor) -> String {
    let name = Kernel::P2pTwoShotCe.entry(f.dtype, f.op);
    let mut s = prologue(&name, f);
    s += &format!(
        r#"{PARITY_AND_DELTAS}	// part size P = ceil(units / n) rounded up to 8 (rd50); my part [rd51, rd52)
	cvt.u64.u32 %rd36, %r6;
	add.u64 %rd50, %rd10, %rd36;
	sub.u64 %rd50, %rd50, 1;
	div.u64 %rd50, %rd50, %rd36;
	add.u64 %rd50, %rd50, 7;
	and.b64 %rd50, %rd50, -8;
	cvt.u64.u32 %rd37, %r5;
	mul.lo.u64 %rd51, %rd37, %rd50;
	min.u64 %rd51, %rd51, %rd10;
	add.u64 %rd52, %rd51, %rd50;
	min.u64 %rd52, %rd52, %rd10;
	// this block's share of my part, rounded up to 8: [rd11, rd12)
	sub.u64 %rd53, %rd52, %rd51;
	add.u64 %rd53, %rd53, %rd13;
	sub.u64 %rd53, %rd53, 1;
	div.u64 %rd53, %rd53, %rd13;
	add.u64 %rd53, %rd53, 7;
	and.b64 %rd53, %rd53, -8;
	mul.lo.u64 %rd11, %rd15, %rd53;
	add.u64 %rd11, %rd11, %rd51;
	min.u64 %rd11, %rd11, %rd52;
	add.u64 %rd12, %rd11, %rd53;
	min.u64 %rd12, %rd12, %rd52;
	// landing slots: slot bytes rd39, sender k's copy of unit i at rd60 + k * slot + i * 16
	ld.global.u64 %rd39, [%rd1+{OFF_LAND_SLOT}];
	ld.global.u64 %rd54, [%rd1+{OFF_LAND}];
	shl.b64 %rd43, %rd51, 4;
	sub.u64 %rd60, %rd54, %rd43;
	{tail}	add.u32 %r12, %r7, 1;
"#,
        tail = last_rank_tail(f).trim_start()
    );
    s += &barrier("b1", "%r12", true);
    let addr_k = "\tsetp.eq.u32 %p19, %r34, %r5;\n\tcvt.u64.u32 %rd27, %r34;\n\tmul.lo.u64 %rd27, %rd27, %rd39;\n\tadd.u64 %rd26, %rd60, %rd27;\n\tselp.b64 %rd26, %rd2, %rd26, %p19;\n\tadd.u64 %rd26, %rd26, %rd21;\n";
    let mut body = format!(
        "\tmov.u32 %r34, 0;\n{addr_k}\tld.global.cg.v4.b32 {{%r30, %r31, %r32, %r33}}, [%rd26];\n{}\tmov.u32 %r34, 1;\n$L_cb_k:\n\tsetp.ge.u32 %p16, %r34, %r6;\n\t@%p16 bra $L_cb_kend;\n{addr_k}\tld.global.cg.v4.b32 {{%r30, %r31, %r32, %r33}}, [%rd26];\n{}\tadd.u32 %r34, %r34, 1;\n\tbra.uni $L_cb_k;\n$L_cb_kend:\n",
        f.vec_in(true),
        f.vec_in(false)
    );
    body += &store_to_ranks("sv", f, Addr::Table("%rd6", "%rd32"), true);
    s += &strided("cb", "%rd11", "%rd12", 4, &body);
    s += &scalar_tail_to_all(f);
    s += "\tadd.u32 %r14, %r7, 2;\n";
    s += &barrier("b2", "%r14", false);
    s += &epilogue();
    s
}

/// Part k (u32 register `k`) of the push kernel's current chunk [rd55, rd56) with part size rd35:
/// [rd37, rd38), both clamped to the chunk.
fn part_of_chunk(k: &str) -> String {
    format!(
        "\tcvt.u64.u32 %rd37, {k};\n\tmul.lo.u64 %rd37, %rd37, %rd35;\n\tadd.u64 %rd37, %rd37, %rd55;\n\tmin.u64 %rd37, %rd37, %rd56;\n\tadd.u64 %rd38, %rd37, %rd35;\n\tmin.u64 %rd38, %rd38, %rd56;\n"
    )
}

/// The PTX text of one kernel family, as the generator writes it.
pub fn generate(kernel: Kernel) -> String {
    let mut s = HEADER.to_string();
    for dtype in DType::REDUCED {
        for op in Op::ALL
            .into_iter()
            .filter(|&op| kernel.has(op) && kernel.has_type(dtype))
        {
            let f = Flavor { dtype, op };
            s += &match kernel {
                Kernel::P2pOneShot => one_shot(&f),
                Kernel::P2pTwoShot => two_shot(&f),
                Kernel::P2pOneShotLl => one_shot_ll(&f),
                Kernel::P2pTwoShotPush => two_shot_push(&f),
                Kernel::P2pTwoShotCe => two_shot_ce(&f),
            };
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_ptx_matches_the_generator() {
        for (file, text) in files() {
            assert!(
                committed(file) == Some(text.as_str()),
                "{file} is stale: run `cargo xtask ptx`"
            );
        }
    }

    /// ptxas rejects any non-ASCII character, even in a comment (a Greek letter in a comment
    /// once failed every module load on the H200).
    #[test]
    fn every_file_is_ascii() {
        for (file, text) in files() {
            if let Some((i, l)) = text.lines().enumerate().find(|(_, l)| !l.is_ascii()) {
                panic!("{file}:{}: non-ASCII: {l}", i + 1);
            }
        }
    }

    /// ptxas rejects a label defined twice in one function; check every generated entry, and
    /// that every branch target exists.
    #[test]
    fn no_label_is_defined_twice_in_an_entry() {
        for (file, text) in files() {
            for entry in text.split(".visible .entry ").skip(1) {
                let name = entry.split('(').next().unwrap_or_default();
                let mut seen = std::collections::HashSet::new();
                for line in entry.lines() {
                    let l = line.trim();
                    if l.starts_with('$') && l.ends_with(':') {
                        assert!(
                            seen.insert(l.to_string()),
                            "{file}: {name}: label {l} defined twice"
                        );
                    }
                }
                for line in entry.lines() {
                    if let Some(t) = line.trim().split("bra").nth(1) {
                        let t = t.trim_start_matches(".uni").trim().trim_end_matches(';');
                        if t.starts_with('$') {
                            assert!(
                                seen.contains(&format!("{t}:")),
                                "{file}: {name}: branch to undefined {t}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_entry_is_declared() {
        for k in Kernel::ALL {
            for d in DType::REDUCED {
                for o in Op::ALL.into_iter().filter(|&o| k.has(o) && k.has_type(d)) {
                    let e = format!(".entry {}(", k.entry(d, o));
                    assert!(k.ptx().contains(&e), "{}: {e} missing", k.file());
                }
            }
        }
        for c in gather::Collective::ALL {
            for &d in c.dtypes() {
                for &o in c.ops() {
                    let e = format!(".entry {}(", c.entry(d, o));
                    assert!(c.ptx().contains(&e), "{}: {e} missing", c.file());
                }
            }
        }
        for k in multimem::MmKernel::ALL {
            for d in DType::ALL {
                for o in Op::ALL {
                    let e = format!(".entry {}(", k.entry(d, o));
                    if k.has(d, o) {
                        assert!(multimem::PTX.contains(&e), "{}: {e}", multimem::FILE);
                    } else if k.reduces() {
                        // no ld_reduce form: no entry
                        assert!(!multimem::PTX.contains(&e), "{}: {e}", multimem::FILE);
                    }
                }
            }
        }
    }
}
