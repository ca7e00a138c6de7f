//! Host-side equivalents of the multimem kernels (`kernels/multimem.ptx`): the allreduce's
//! one-shot and two-shot, and reduce-scatter, all-gather and broadcast. One launch context
//! ([`MmCtx`]) holds what every entry reads from the member's header and runs the protocol the
//! PTX shares: the barrier (this rank's arrival added to every member's arrival word with
//! `Release`, an `Acquire` spin on its own, bounded by the deadline, the call header stored
//! into every member and compared at the first barrier, no arrival once the error word is set)
//! and the epilogue (counters c + 2 on every replica, absent blocks' arrivals). `ld_reduce`
//! reads every bound member's copy and reduces them in an order that is neither rank nor device
//! order ([`switch_order`]); `multimem.st` writes every copy. Registered by [`super::install`].

use super::*;
use crate::kernels::multimem::*;

/// Register every multimem entry.
pub(super) fn register() {
    for k in MmKernel::ALL {
        for d in DType::ALL {
            for o in Op::ALL {
                if k.has(d, o) {
                    register_kernel(&k.entry(d, o), move |a| match k {
                        MmKernel::OneShot | MmKernel::TwoShot => run_allreduce(k, d, o, a),
                        _ => run_gather(k, d, o, a),
                    });
                }
            }
        }
    }
}

/// One launch: this member's header as the kernel reads it, and the protocol's steps.
struct MmCtx<'a> {
    a: &'a LaunchArgs,
    /// This member's unicast base, and the multicast base.
    uc: usize,
    mc: usize,
    rank: usize,
    n: usize,
    /// Every member's unicast base.
    peers: Vec<usize>,
    /// Offset of the output region (after the header and the input region).
    out_off: usize,
    timeout: Duration,
    /// The call header.
    sig: u64,
    /// This member's error mirror (0: none).
    mirror: usize,
}

impl<'a> MmCtx<'a> {
    fn new(
        a: &'a LaunchArgs,
        uc: usize,
        mc: usize,
        timeout: Duration,
        sig: u64,
    ) -> Result<Self, KernelError> {
        a.check(uc, MM_DATA, true)?;
        let rank = u32_at(uc + MM_OFF_RANK).load(Ordering::Relaxed) as usize;
        let n = u32_at(uc + MM_OFF_NRANKS).load(Ordering::Relaxed) as usize;
        let cap = u64_at(uc + MM_OFF_CAP).load(Ordering::Relaxed) as usize;
        if n == 0 || n > MAX_RANKS || rank >= n {
            return Err(KernelError::Failed(format!(
                "bad header: rank {rank} of {n}"
            )));
        }
        let peers: Vec<usize> = (0..n)
            .map(|t| u64_at(uc + MM_OFF_PEERS + 8 * t).load(Ordering::Relaxed) as usize)
            .collect();
        for &p in &peers {
            a.check(p, MM_DATA, true)?;
        }
        if a.grid.0 as usize > MAX_BLOCKS {
            return Err(KernelError::Failed(format!("grid of {} blocks", a.grid.0)));
        }
        Ok(MmCtx {
            a,
            uc,
            mc,
            rank,
            n,
            peers,
            out_off: MM_DATA + cap,
            timeout,
            sig,
            mirror: super::mirror_at(a, uc, MM_OFF_MIRROR)?,
        })
    }

    fn err(&self) -> &'static AtomicU32 {
        u32_at(self.uc + MM_OFF_ERR)
    }

    /// Block b's counter c.
    fn counter(&self, b: usize) -> u32 {
        u32_at(self.uc + MM_OFF_CTR + 4 * b).load(Ordering::Relaxed)
    }

    /// The addresses of `[addr, addr + len)` of a multicast range in every bound member.
    fn targets(&self, addr: usize, len: usize) -> Result<Vec<usize>, KernelError> {
        self.a
            .multicast_targets(addr, len)?
            .ok_or(KernelError::IllegalAddress { addr, len })
    }

    /// [`MmCtx::targets`] of a `.v4` multimem access: 16-byte aligned, as the hardware requires.
    fn vector_targets(&self, addr: usize, len: usize) -> Result<Vec<usize>, KernelError> {
        if addr % 16 != 0 {
            return Err(KernelError::Failed(format!(
                "multimem .v4 access at {addr:#x}: not 16-byte aligned"
            )));
        }
        self.targets(addr, len)
    }

    /// The barrier of block `b` at `val` (see the PTX `barrier`). With `parity`: store the call
    /// header into every member's slot [parity][b][rank] first, and compare every member's slot
    /// in my memory with mine after arriving.
    fn barrier(&self, b: usize, val: u32, parity: Option<u32>) -> Result<(), KernelError> {
        self.a.jitter();
        let err = self.err();
        // arrive only while my error word is clear (as the PTX): after a failed barrier my
        // arrivals would complete a slower member's barrier without the member that never came
        if err.load(Ordering::Relaxed) != 0 {
            return Ok(());
        }
        let hdr = |p: u32, s: usize| MM_OFF_HDR + hdr_slot(p as usize, b, s);
        if let Some(p) = parity {
            for &m in &self.peers {
                u64_at(m + hdr(p, self.rank)).store(self.sig, Ordering::Relaxed);
            }
        }
        let arrived = || {
            if let Some(p) = parity {
                if (0..self.n)
                    .any(|s| u64_at(self.uc + hdr(p, s)).load(Ordering::Relaxed) != self.sig)
                {
                    super::fail(err, self.mirror, ERR_MISMATCH, None);
                }
            }
        };
        for t in self.targets(self.mc + MM_OFF_SIG + 4 * b, 4)? {
            u32_at(t).fetch_add(1, Ordering::Release);
        }
        let mine = u32_at(self.uc + MM_OFF_SIG + 4 * b);
        let want = val.wrapping_mul(self.n as u32);
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if mine.load(Ordering::Acquire).wrapping_sub(want) as i32 >= 0 {
                arrived();
                return Ok(());
            }
            if err.load(Ordering::Relaxed) != 0 {
                super::mirror_word(err, self.mirror);
                return Ok(());
            }
            if start.elapsed() >= self.timeout {
                super::fail(err, self.mirror, ERR_TIMEOUT, None);
                return Ok(());
            }
            spins += 1;
            if spins < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Block `b` of `g` ends a call that started at counter `c`: counters c + 2 in its replicas,
    /// and the absent blocks' arrival words too (additive: this rank's two arrivals on every
    /// member; none once my error word is set, as at the barriers).
    fn epilogue(&self, b: usize, g: usize, c: u32) -> Result<(), KernelError> {
        let failed = self.err().load(Ordering::Relaxed) != 0;
        let mut j = b;
        while j < MAX_BLOCKS {
            u32_at(self.uc + MM_OFF_CTR + 4 * j).store(c.wrapping_add(2), Ordering::Relaxed);
            if j != b && !failed {
                for t in self.targets(self.mc + MM_OFF_SIG + 4 * j, 4)? {
                    u32_at(t).fetch_add(2, Ordering::Relaxed);
                }
            }
            j += g;
        }
        Ok(())
    }

    /// `multimem.ld_reduce` of `elems` elements from the members' copies `srcs` (from
    /// [`MmCtx::targets`]), stored to every address of `dsts` (multicast targets, or unicast
    /// memory the caller checked). The switch reduces the copies in an order of its own: never rank
    /// (or device) order here, a different one per call (`c`), 16-byte unit (counted from
    /// `first_unit`) and reducing rank, so code that assumes rank-order sums on this path fails
    /// on the simulator.
    #[allow(clippy::too_many_arguments)]
    fn ld_reduce(
        &self,
        d: DType,
        op: Op,
        srcs: &[usize],
        dsts: &[usize],
        elems: u64,
        c: u32,
        first_unit: u64,
    ) -> Result<(), KernelError> {
        let v = 16 / d.size() as u64;
        let mut order: Vec<usize> = (0..srcs.len()).collect();
        for i in 0..elems {
            if i % v == 0 {
                switch_order(&mut order, c, first_unit + i / v, self.rank);
            }
            let mut acc = ld(d, srcs[order[0]], i);
            for &s in &order[1..] {
                acc = op.apply(acc, ld(d, srcs[s], i));
            }
            for t in dsts {
                st(d, *t, i, acc);
            }
        }
        Ok(())
    }

    /// A scalar tail through the unicast addresses: `elems` elements at `src_off` from every
    /// member's base, reduced in rank order, stored to every address of `dsts`.
    fn unicast_reduce(
        &self,
        d: DType,
        op: Op,
        src_off: usize,
        dsts: &[usize],
        elems: u64,
    ) -> Result<(), KernelError> {
        let len = (elems * d.size() as u64) as usize;
        for p in &self.peers {
            self.a.check(p + src_off, len, false)?;
        }
        for &o in dsts {
            self.a.check(o, len, true)?;
        }
        for i in 0..elems {
            let mut acc = ld(d, self.peers[0] + src_off, i);
            for p in &self.peers[1..] {
                acc = op.apply(acc, ld(d, p + src_off, i));
            }
            for o in dsts {
                st(d, *o, i, acc);
            }
        }
        Ok(())
    }
}

/// The allreduce's multimem one-shot and two-shot (see the PTX): the scalar tails go through
/// unicast loads in rank order, as in the PTX.
fn run_allreduce(k: MmKernel, d: DType, op: Op, a: &LaunchArgs) -> Result<(), KernelError> {
    let (uc, mc, count) = (a.u64(0)? as usize, a.u64(1)? as usize, a.u64(2)?);
    let cx = MmCtx::new(a, uc, mc, Duration::from_nanos(a.u64(3)?), a.u64(4)?)?;
    let (rank, n) = (cx.rank, cx.n);
    let g = a.grid.0 as u64;
    let es = d.size() as u64;
    let v = 16 / es;
    let units = count / v;
    let per = units.div_ceil(g).next_multiple_of(8);
    let tail_start = units * v;
    for b in 0..g {
        let c = cx.counter(b as usize);
        let bs = (b * per).min(units);
        let be = (bs + per).min(units);
        cx.barrier(b as usize, c.wrapping_add(1), Some((c >> 1) & 1))?;
        let last_block = b == g - 1;
        let (lo, hi, tail) = match k {
            MmKernel::TwoShot => {
                let pp = (be - bs).div_ceil(n as u64).next_multiple_of(8);
                let ps = (bs + rank as u64 * pp).min(be);
                (ps, (ps + pp).min(be), last_block && rank == n - 1)
            }
            _ => (bs, be, last_block),
        };
        if hi > lo {
            let (e0, e1) = (lo * v, hi * v);
            let len = ((e1 - e0) * es) as usize;
            let off = (e0 * es) as usize;
            let srcs = cx.vector_targets(mc + MM_DATA + off, len)?;
            let dsts = match k {
                MmKernel::TwoShot => cx.vector_targets(mc + cx.out_off + off, len)?,
                _ => {
                    a.check(uc + cx.out_off + off, len, true)?;
                    vec![uc + cx.out_off + off]
                }
            };
            cx.ld_reduce(d, op, &srcs, &dsts, e1 - e0, c, lo)?;
        }
        if tail && count > tail_start {
            let off = (tail_start * es) as usize;
            let outs: Vec<usize> = match k {
                MmKernel::TwoShot => cx.peers.iter().map(|p| p + cx.out_off + off).collect(),
                _ => vec![uc + cx.out_off + off],
            };
            cx.unicast_reduce(d, op, MM_DATA + off, &outs, count - tail_start)?;
        }
        cx.barrier(b as usize, c.wrapping_add(2), None)?;
        cx.epilogue(b as usize, g as usize, c)?;
    }
    Ok(())
}

/// Reduce-scatter, all-gather and broadcast (see the PTX): barrier(c + 1) with the call header
/// → reduce-scatter: `ld_reduce` of slot `rank` of the input region into my output region;
/// all-gather: my input region `multimem.st`ored into slot `rank` of every output region;
/// broadcast: the root's input region into every output region → barrier(c + 2) → counters
/// c + 2. Scalar tails through the unicast addresses, on the last block.
fn run_gather(k: MmKernel, d: DType, op: Op, a: &LaunchArgs) -> Result<(), KernelError> {
    let (uc, mc, count) = (a.u64(0)? as usize, a.u64(1)? as usize, a.u64(2)?);
    let cx = MmCtx::new(a, uc, mc, Duration::from_nanos(a.u64(3)?), a.u64(4)?)?;
    let root = a.u64(5)?;
    let (rank, n) = (cx.rank, cx.n);
    if root >= n as u64 {
        return Err(KernelError::Failed(format!("root {root} of a team of {n}")));
    }
    let g = a.grid.0 as u64;
    let es = d.size() as u64;
    let v = 16 / es;
    let units = count / v;
    let per = units.div_ceil(g).next_multiple_of(8);
    let tail_start = units * v;
    let slot = slot_bytes(count * es) as usize;
    // this rank's slot: reduce-scatter's input, all-gather's output; broadcast: slot 0
    let mine = match k {
        MmKernel::Broadcast => 0,
        _ => rank * slot,
    };
    if k == MmKernel::ReduceScatter || k == MmKernel::AllGather {
        // n slots must fit a region (the host's windows make it so)
        let cap = cx.out_off - MM_DATA;
        if n * slot > cap {
            return Err(KernelError::Failed(format!(
                "{n} slots of {slot} bytes do not fit a {cap}-byte region"
            )));
        }
    }
    let stores = k == MmKernel::AllGather || (k == MmKernel::Broadcast && rank as u64 == root);
    for b in 0..g {
        let c = cx.counter(b as usize);
        let bs = (b * per).min(units);
        let be = (bs + per).min(units);
        cx.barrier(b as usize, c.wrapping_add(1), Some((c >> 1) & 1))?;
        let last_block = b == g - 1;
        let (e0, e1) = (bs * v, be * v);
        let len = ((e1 - e0) * es) as usize;
        let off = (e0 * es) as usize;
        let t_off = (tail_start * es) as usize;
        let t_len = ((count - tail_start) * es) as usize;
        match k {
            MmKernel::ReduceScatter => {
                if be > bs {
                    let srcs = cx.vector_targets(mc + MM_DATA + mine + off, len)?;
                    a.check(uc + cx.out_off + off, len, true)?;
                    cx.ld_reduce(d, op, &srcs, &[uc + cx.out_off + off], e1 - e0, c, bs)?;
                }
                if last_block && count > tail_start {
                    cx.unicast_reduce(
                        d,
                        op,
                        MM_DATA + mine + t_off,
                        &[uc + cx.out_off + t_off],
                        count - tail_start,
                    )?;
                }
            }
            _ if stores => {
                if be > bs {
                    // multimem.st of every 16-byte unit: every member's copy
                    a.check(uc + MM_DATA + off, len, false)?;
                    for t in cx.vector_targets(mc + cx.out_off + mine + off, len)? {
                        store_bytes(uc + MM_DATA + off, t, len);
                    }
                }
                if last_block && count > tail_start {
                    for p in &cx.peers {
                        gather::copy(
                            a,
                            uc + MM_DATA + t_off,
                            p + cx.out_off + mine + t_off,
                            t_len,
                        )?;
                    }
                }
            }
            // a broadcast's receivers only meet the root at the barriers
            _ => {}
        }
        cx.barrier(b as usize, c.wrapping_add(2), None)?;
        cx.epilogue(b as usize, g as usize, c)?;
    }
    Ok(())
}

/// `multimem.st`: `len` bytes from `src` (checked by the caller) into `dst`, one member's copy
/// of a multicast range (from [`MmCtx::vector_targets`]).
fn store_bytes(src: usize, dst: usize, len: usize) {
    for i in 0..len {
        // SAFETY: `src` was checked readable; `dst` lies in a member's memory bound to the
        // multicast range (the simulator resolved it); volatile, as `ld`/`st` (other devices'
        // threads read device memory concurrently, ordered by the barrier's release/acquire).
        unsafe {
            std::ptr::write_volatile(
                (dst + i) as *mut u8,
                std::ptr::read_volatile((src + i) as *const u8),
            )
        };
    }
}

/// The order in which the simulated switch reduces the members' copies of one 16-byte unit
/// (`multimem.ld_reduce`): a rotation or a reversal of the members, never the identity (for two
/// or more members), drawn deterministically from the block's call counter `c`, the unit and the
/// reducing rank. Real NVSwitch hardware promises no order at all.
fn switch_order(order: &mut [usize], c: u32, unit: u64, rank: usize) {
    let n = order.len();
    let mut z = (c as u64) ^ unit.rotate_left(21) ^ ((rank as u64) << 56);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    if n < 2 {
        return;
    }
    if z & 1 == 0 {
        // forward from member k != 0
        let k = 1 + (z >> 1) as usize % (n - 1);
        for (i, o) in order.iter_mut().enumerate() {
            *o = (k + i) % n;
        }
    } else {
        // backward from any member
        let k = (z >> 1) as usize % n;
        for (i, o) in order.iter_mut().enumerate() {
            *o = (k + n - i) % n;
        }
    }
}
