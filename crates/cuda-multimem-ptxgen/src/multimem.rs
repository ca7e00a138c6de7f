//! The multimem kernels' generator: reduction through a multicast address
//! (`multimem.ld_reduce`), results stored through it (`multimem.st`), barriers by
//! `multimem.red.release` on a signal word of every member and acquire loads of one's own copy.
//! The member layout: `cuda_multimem_collectives::kernels::multimem`.

pub use cuda_multimem_collectives::kernels::multimem::*;
use cuda_multimem_collectives::kernels::{ERR_MISMATCH, MAX_BLOCKS, MAX_RANKS};
use cuda_multimem_collectives::{DType, ReduceOp as Op};

use super::{Flavor, HEADER};

fn ld_reduce(f: &Flavor, addr: &str) -> String {
    let (op, acc) = match f.op {
        Op::Sum => (
            "add",
            if f.dtype == DType::F32 {
                ""
            } else {
                ".acc::f32"
            },
        ),
        Op::Min => ("min", ""),
        Op::Max => ("max", ""),
        o => panic!("multimem.ld_reduce has no {o}"),
    };
    let ty = match f.dtype {
        DType::F32 => "f32",
        DType::F16 => "f16x2",
        DType::Bf16 => "bf16x2",
        d => panic!("no multimem kernel for {d}"),
    };
    format!("\tmultimem.ld_reduce.relaxed.sys.global.{op}{acc}.v4.{ty} {{%r30, %r31, %r32, %r33}}, [{addr}];\n")
}

fn mm_store(f: &Flavor, addr: &str) -> String {
    let ty = match f.dtype {
        DType::F32 => "f32",
        DType::F16 => "f16x2",
        DType::Bf16 => "bf16x2",
        d => panic!("no multimem kernel for {d}"),
    };
    format!("\tmultimem.st.relaxed.sys.global.v4.{ty} [{addr}], {{%r30, %r31, %r32, %r33}};\n")
}

/// The barrier of block b at `val`. Thread 0 arrives (adds 1 on every member) only while this
/// rank's error word is clear: a rank whose barrier failed must not complete anyone's later
/// barrier (docs/design/allreduce.md). With `check_header`, thread 0 first stores the call header
/// (%rd7) into slot `[parity %r8][b][rank]` of every member through the unicast addresses, and
/// after arriving compares every member's slot of its own memory with its own header.
fn barrier(label: &str, val: &str, check_header: bool) -> String {
    let (hdr_store, hdr_check) = if check_header {
        (
            format!(
                r#"	// call header into [member k + HDR + 8*((parity*MAXB + b)*MAX_RANKS + rank)] for every k
	mad.lo.u32 %r41, %r8, {mb}, %r2;
	mad.lo.u32 %r41, %r41, {MAX_RANKS}, %r5;
	mul.wide.u32 %rd43, %r41, 8;
	mov.u32 %r34, 0;
$L_{label}_h:
	setp.ge.u32 %p14, %r34, %r6;
	@%p14 bra $L_{label}_hend;
	mul.wide.u32 %rd27, %r34, 8;
	add.u64 %rd27, %rd1, %rd27;
	ld.global.u64 %rd26, [%rd27+{peers}];
	add.u64 %rd26, %rd26, %rd43;
	st.relaxed.sys.global.u64 [%rd26+{hdr}], %rd7;
	add.u32 %r34, %r34, 1;
	bra.uni $L_{label}_h;
$L_{label}_hend:
"#,
                mb = MAX_BLOCKS,
                peers = MM_OFF_PEERS,
                hdr = MM_OFF_HDR,
            ),
            format!(
                r#"	// every member's header of this call, as stored in my memory, equals mine
	mad.lo.u32 %r41, %r8, {mb}, %r2;
	mul.lo.u32 %r41, %r41, {MAX_RANKS};
	mov.u32 %r34, 0;
$L_{label}_c:
	setp.ge.u32 %p14, %r34, %r6;
	@%p14 bra $L_{label}_cend;
	add.u32 %r45, %r41, %r34;
	mul.wide.u32 %rd48, %r45, 8;
	add.u64 %rd48, %rd1, %rd48;
	ld.relaxed.sys.global.u64 %rd49, [%rd48+{hdr}];
	add.u32 %r34, %r34, 1;
	setp.eq.u64 %p15, %rd49, %rd7;
	@%p15 bra $L_{label}_c;
{fail}$L_{label}_cend:
"#,
                mb = MAX_BLOCKS,
                hdr = MM_OFF_HDR,
                fail = super::err_set(MM_OFF_ERR, ERR_MISMATCH, None, "%p15"),
            ),
        )
    } else {
        (String::new(), String::new())
    };
    format!(
        r#"	// ---- barrier {label}: every member's arrival word of block b reaches nranks * {val}
	bar.sync 0;
	setp.ne.u32 %p10, %r1, 0;
	@%p10 bra $L_{label}_done;
	// arrive only while my error word is clear: after a failed barrier my arrivals would
	// complete a slower member's barrier without the member that never came
	ld.relaxed.gpu.global.u32 %r44, [%rd1+{err}];
	setp.ne.u32 %p12, %r44, 0;
	@%p12 bra $L_{label}_done;
{hdr_store}	mul.wide.u32 %rd40, %r2, 4;
	add.u64 %rd41, %rd2, %rd40;
	add.u64 %rd42, %rd1, %rd40;
	fence.proxy.alias;
	multimem.red.release.sys.global.add.u32 [%rd41+{sig}], 1;
	mul.lo.u32 %r40, %r6, {val};
{spin}	fence.proxy.alias;
{hdr_check}$L_{label}_done:
	bar.sync 0;
"#,
        sig = MM_OFF_SIG,
        err = MM_OFF_ERR,
        spin = super::sig_spin(label, "%rd42", MM_OFF_SIG, "%r40", MM_OFF_ERR, None),
    )
}

/// Scalar tail over unicast views: elements [%rd16, count) reduced from every member's input,
/// stored to this member's output (one-shot) or every member's output (two-shot).
fn tail(f: &Flavor, all: bool) -> String {
    let es = f.es_log2();
    let mut body = String::new();
    // rank 0's element first, then the others, in rank order
    body += &format!("\tld.global.u64 %rd26, [%rd1+{MM_OFF_PEERS}];\n\tadd.u64 %rd26, %rd26, %rd21;\n\tadd.u64 %rd26, %rd26, {MM_DATA};\n");
    body += &f.sc_load("%rd26", true, ".cg");
    body += &format!("\tmov.u32 %r34, 1;\n$L_tk:\n\tsetp.ge.u32 %p16, %r34, %r6;\n\t@%p16 bra $L_tkend;\n\tmul.wide.u32 %rd27, %r34, 8;\n\tadd.u64 %rd27, %rd1, %rd27;\n\tld.global.u64 %rd26, [%rd27+{MM_OFF_PEERS}];\n\tadd.u64 %rd26, %rd26, %rd21;\n\tadd.u64 %rd26, %rd26, {MM_DATA};\n");
    body += &f.sc_load("%rd26", false, ".cg");
    body += "\tadd.u32 %r34, %r34, 1;\n\tbra.uni $L_tk;\n$L_tkend:\n";
    if f.half() {
        body += &format!("\t{} %h1, %f1;\n", f.cvt_out());
    }
    let st = if f.half() {
        "\tst.global.b16 [%rd26], %h1;\n"
    } else {
        "\tst.global.f32 [%rd26], %f1;\n"
    };
    // output of member k: its unicast base + 4096 + capacity + offset
    let dst_k = format!("\tld.global.u64 %rd26, [%rd27+{MM_OFF_PEERS}];\n\tadd.u64 %rd26, %rd26, %rd21;\n\tadd.u64 %rd26, %rd26, %rd9;\n");
    if all {
        body += &format!("\tmov.u32 %r34, 0;\n$L_ts:\n\tsetp.ge.u32 %p16, %r34, %r6;\n\t@%p16 bra $L_tsend;\n\tmul.wide.u32 %rd27, %r34, 8;\n\tadd.u64 %rd27, %rd1, %rd27;\n{dst_k}{st}\tadd.u32 %r34, %r34, 1;\n\tbra.uni $L_ts;\n$L_tsend:\n");
    } else {
        body += &format!("\tadd.u64 %rd26, %rd1, %rd21;\n\tadd.u64 %rd26, %rd26, %rd9;\n{st}");
    }
    super::strided("tail", "%rd16", "%rd4", es, &body)
}

/// The gather kernels' extra registers: %rd50 the root (broadcast), %rd51 the slot stride (the
/// chunk's bytes rounded up to 16: [`slot_bytes`]), %rd52 this rank's slot (reduce-scatter's
/// input, all-gather's output: rank × stride; broadcast: 0).
fn slot_of(k: MmKernel, f: &Flavor) -> String {
    let mut s = format!(
        r#"	ld.param.u64 %rd50, [p_root];
	// slot stride: the chunk's bytes rounded up to 16 (every slot 16-byte aligned)
	shl.b64 %rd51, %rd4, {es};
	add.u64 %rd51, %rd51, 15;
	and.b64 %rd51, %rd51, -16;
"#,
        es = f.es_log2()
    );
    s += if k == MmKernel::Broadcast {
        "\tmov.u64 %rd52, 0;\n"
    } else {
        "\tcvt.u64.u32 %rd52, %r5;\n\tmul.lo.u64 %rd52, %rd52, %rd51;\n"
    };
    s
}

/// Reduce-scatter's scalar tail over unicast views: elements [%rd16, count) of slot %rd52 of
/// every member's input region, reduced in rank order, stored to this member's output region.
fn rs_tail(f: &Flavor) -> String {
    let es = f.es_log2();
    let member = |first: bool| {
        let base = if first {
            format!("\tld.global.u64 %rd26, [%rd1+{MM_OFF_PEERS}];\n")
        } else {
            format!("\tmul.wide.u32 %rd27, %r34, 8;\n\tadd.u64 %rd27, %rd1, %rd27;\n\tld.global.u64 %rd26, [%rd27+{MM_OFF_PEERS}];\n")
        };
        format!("{base}\tadd.u64 %rd26, %rd26, %rd21;\n\tadd.u64 %rd26, %rd26, %rd52;\n\tadd.u64 %rd26, %rd26, {MM_DATA};\n")
    };
    let mut body = member(true);
    body += &f.sc_load("%rd26", true, ".cg");
    body += "\tmov.u32 %r34, 1;\n$L_rk:\n\tsetp.ge.u32 %p16, %r34, %r6;\n\t@%p16 bra $L_rkend;\n";
    body += &member(false);
    body += &f.sc_load("%rd26", false, ".cg");
    body += "\tadd.u32 %r34, %r34, 1;\n\tbra.uni $L_rk;\n$L_rkend:\n";
    body += "\tadd.u64 %rd26, %rd1, %rd21;\n\tadd.u64 %rd26, %rd26, %rd9;\n";
    body += &f.sc_store("%rd26");
    super::strided("tail", "%rd16", "%rd4", es, &body)
}

/// All-gather's and broadcast's scalar tail: elements [%rd16, count) of my input region, bit
/// for bit, into slot %rd52 of every member's output region through the unicast addresses.
fn store_tail(f: &Flavor) -> String {
    let es = f.es_log2();
    let (ld, st) = if f.half() {
        ("ld.global.b16 %h1", "st.global.b16 [%rd26], %h1;")
    } else {
        ("ld.global.b32 %r30", "st.global.b32 [%rd26], %r30;")
    };
    let body = format!(
        r#"	add.u64 %rd24, %rd1, %rd21;
	add.u64 %rd24, %rd24, {MM_DATA};
	{ld}, [%rd24];
	mov.u32 %r34, 0;
$L_sk:
	setp.ge.u32 %p16, %r34, %r6;
	@%p16 bra $L_skend;
	mul.wide.u32 %rd27, %r34, 8;
	add.u64 %rd27, %rd1, %rd27;
	ld.global.u64 %rd26, [%rd27+{MM_OFF_PEERS}];
	add.u64 %rd26, %rd26, %rd21;
	add.u64 %rd26, %rd26, %rd52;
	add.u64 %rd26, %rd26, %rd9;
	{st}
	add.u32 %r34, %r34, 1;
	bra.uni $L_sk;
$L_skend:
"#
    );
    super::strided("tail", "%rd16", "%rd4", es, &body)
}

/// The entry's parameters and prologue, up to `%r12` = c + 1 (the first barrier's value):
/// registers %rd1 unicast base, %rd2 multicast base, %rd4 count, %rd7 call header, %rd8
/// deadline, %rd9 offset of the output region, %r5 rank, %r6 team size, %r7 counter c, %r8
/// header parity, %rd10 vector units, [%rd11, %rd12) the block's units, %rd16 the first element
/// of the scalar tail, %p17 the last block. `extra`: more parameter declarations (each after
/// ",\n").
fn prologue(name: &str, f: &Flavor, extra: &str) -> String {
    let vl = f.v_log2();
    format!(
        r#"
.visible .entry {name}(
	.param .u64 p_uc,
	.param .u64 p_mc,
	.param .u64 p_count,
	.param .u64 p_timeout,
	.param .u64 p_sig{extra}
)
{{
{regs}
	ld.param.u64 %rd1, [p_uc];
	ld.param.u64 %rd2, [p_mc];
	ld.param.u64 %rd4, [p_count];
	ld.param.u64 %rd8, [p_timeout];
	ld.param.u64 %rd7, [p_sig];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ctaid.x;
	mov.u32 %r3, %ntid.x;
	mov.u32 %r4, %nctaid.x;
	ld.global.u32 %r5, [%rd1+{rank}];
	ld.global.u32 %r6, [%rd1+{nr}];
	// %rd9: offset of the output region (4096 + capacity)
	ld.global.u64 %rd9, [%rd1+{cap}];
	add.u64 %rd9, %rd9, {data};
	mul.wide.u32 %rd10, %r2, 4;
	add.u64 %rd10, %rd1, %rd10;
	ld.global.u32 %r7, [%rd10+{ctr}];
	// header parity (c >> 1) & 1
	shr.u32 %r8, %r7, 1;
	and.b32 %r8, %r8, 1;
	// units: 16-byte vectors
	shr.u64 %rd10, %rd4, {vl};
{block_range}	shl.b64 %rd16, %rd10, {vl};
	sub.u32 %r11, %r4, 1;
	setp.eq.u32 %p17, %r2, %r11;
	add.u32 %r12, %r7, 1;
"#,
        rank = MM_OFF_RANK,
        nr = MM_OFF_NRANKS,
        cap = MM_OFF_CAP,
        data = MM_DATA,
        ctr = MM_OFF_CTR,
        regs = super::REGS,
        block_range = super::BLOCK_RANGE,
    )
}

fn kernel(k: MmKernel, f: &Flavor) -> String {
    let gathers = !matches!(k, MmKernel::OneShot | MmKernel::TwoShot);
    let extra = if gathers {
        ",\n\t.param .u64 p_root"
    } else {
        ""
    };
    let mut s = prologue(&k.entry(f.dtype, f.op), f, extra);
    if gathers {
        s += &slot_of(k, f);
    }
    s += &barrier("b1", "%r12", true);
    match k {
        MmKernel::OneShot => {
            // every unit of the block: ld_reduce through the multicast input, store locally
            let mut body =
                format!("\tadd.u64 %rd24, %rd2, %rd21;\n\tadd.u64 %rd24, %rd24, {MM_DATA};\n");
            body += &ld_reduce(f, "%rd24");
            body += "\tadd.u64 %rd25, %rd1, %rd21;\n\tadd.u64 %rd25, %rd25, %rd9;\n\tst.global.v4.b32 [%rd25], {%r30, %r31, %r32, %r33};\n";
            s += &super::strided("red", "%rd11", "%rd12", 4, &body);
            s += "\t@!%p17 bra $L_tail_done;\n";
            s += &tail(f, false);
        }
        MmKernel::TwoShot => {
            // my part of the block's units
            s += r#"	sub.u64 %rd35, %rd12, %rd11;
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
	sub.u32 %r13, %r6, 1;
	setp.eq.and.u32 %p17, %r5, %r13, %p17;
"#;
            let mut body =
                format!("\tadd.u64 %rd24, %rd2, %rd21;\n\tadd.u64 %rd24, %rd24, {MM_DATA};\n");
            body += &ld_reduce(f, "%rd24");
            body += "\tadd.u64 %rd25, %rd2, %rd21;\n\tadd.u64 %rd25, %rd25, %rd9;\n";
            body += &mm_store(f, "%rd25");
            s += &super::strided("red", "%rd37", "%rd38", 4, &body);
            s += "\t@!%p17 bra $L_tail_done;\n";
            s += &tail(f, true);
        }
        MmKernel::ReduceScatter => {
            // every unit of the block: ld_reduce slot `rank` of the input region (chunk `rank`
            // of every member's input) through the multicast address, store into my own output
            let mut body = format!(
                "\tadd.u64 %rd24, %rd2, %rd21;\n\tadd.u64 %rd24, %rd24, %rd52;\n\tadd.u64 %rd24, %rd24, {MM_DATA};\n"
            );
            body += &ld_reduce(f, "%rd24");
            body += "\tadd.u64 %rd25, %rd1, %rd21;\n\tadd.u64 %rd25, %rd25, %rd9;\n\tst.global.v4.b32 [%rd25], {%r30, %r31, %r32, %r33};\n";
            s += &super::strided("red", "%rd11", "%rd12", 4, &body);
            s += "\t@!%p17 bra $L_tail_done;\n";
            s += &rs_tail(f);
        }
        MmKernel::AllGather | MmKernel::Broadcast => {
            if k == MmKernel::Broadcast {
                // only the root stores; the others meet it at the two barriers
                s += "\tcvt.u64.u32 %rd53, %r5;\n\tsetp.ne.u64 %p18, %rd53, %rd50;\n\t@%p18 bra $L_tail_done;\n";
            }
            // every unit of the block: my input region, stored through the multicast address
            // into my slot of every member's output region
            let mut body = format!(
                "\tadd.u64 %rd24, %rd1, %rd21;\n\tadd.u64 %rd24, %rd24, {MM_DATA};\n\tld.global.v4.b32 {{%r30, %r31, %r32, %r33}}, [%rd24];\n"
            );
            body += "\tadd.u64 %rd25, %rd2, %rd21;\n\tadd.u64 %rd25, %rd25, %rd52;\n\tadd.u64 %rd25, %rd25, %rd9;\n";
            body += &mm_store(f, "%rd25");
            s += &super::strided("st", "%rd11", "%rd12", 4, &body);
            s += "\t@!%p17 bra $L_tail_done;\n";
            s += &store_tail(f);
        }
    }
    s += "$L_tail_done:\n\tadd.u32 %r14, %r7, 2;\n";
    s += &barrier("b2", "%r14", false);
    s += &epilogue();
    s
}

/// Counters c + 2 into slots b + i*G (as the peer-to-peer epilogue), and for the slots of
/// blocks that did not run (j != b) this rank's two arrivals, added to every member's arrival
/// word: additive words stay in step with the counters whatever the grid. Like the barriers, it
/// adds nothing once this rank's error word is set.
fn epilogue() -> String {
    format!(
        r#"	// ---- counters and absent blocks' arrivals (only while my error word is clear, as at
	// the barriers)
	ld.relaxed.gpu.global.u32 %r44, [%rd1+{err}];
	setp.ne.u32 %p4, %r44, 0;
	add.u32 %r9, %r7, 2;
	mad.lo.u32 %r10, %r1, %r4, %r2;
	mul.lo.u32 %r11, %r3, %r4;
$L_ctr_loop:
	setp.ge.u32 %p2, %r10, {mb};
	@%p2 bra $L_exit;
	mul.wide.u32 %rd9, %r10, 4;
	add.u64 %rd10, %rd1, %rd9;
	st.global.u32 [%rd10+{ctr}], %r9;
	setp.eq.or.u32 %p3, %r10, %r2, %p4;
	@%p3 bra $L_ctr_next;
	add.u64 %rd10, %rd2, %rd9;
	multimem.red.relaxed.sys.global.add.u32 [%rd10+{sig}], 2;
$L_ctr_next:
	add.u32 %r10, %r10, %r11;
	bra.uni $L_ctr_loop;
$L_exit:
	ret;
}}
"#,
        mb = MAX_BLOCKS,
        ctr = MM_OFF_CTR,
        sig = MM_OFF_SIG,
        err = MM_OFF_ERR,
    )
}

/// The PTX text of the multimem kernels, as the generator writes it.
pub fn generate() -> String {
    // `.acc::f32` (16-bit sums accumulated in f32) needs PTX ISA 8.2 (ptxas says so).
    let mut s = HEADER
        .replace("PTX ISA 8.1", "PTX ISA 8.2")
        .replace(".version 8.1", ".version 8.2");
    for k in MmKernel::ALL {
        for dtype in DType::ALL {
            for op in Op::ALL {
                if k.has(dtype, op) {
                    s += &kernel(k, &Flavor { dtype, op });
                }
            }
        }
    }
    s
}
