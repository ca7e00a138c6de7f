//! The collectives as a table (nccl-tests' pattern): one [`Collective`] per collective says,
//! for a team of `n` and a `count`, how many elements its input and output hold, where the
//! in-place form reads and writes, which further operands it takes, what the library's host
//! reference says every rank must hold afterwards, its bus bandwidth factor, and how it is
//! called through `RankHandle` — in place or not, on symmetric buffers or the caller's own
//! memory. [`Queued`] runs one case of an entry on a team: it allocates the operands, fills them
//! with random data from the harness's one generator ([`crate::Rng`]), calls every rank, and
//! checks every rank against the reference.
//!
//! Adding a collective is one more entry (a function in `entries.rs` returning its
//! [`Collective`], and its line in [`table`]); an element type is one instantiation
//! (`table::<T>()`, and a line in [`for_each_elem`](crate::for_each_elem) for the sweeps); the
//! team size and the devices are the caller's ([`crate::team_on`] takes the device list, so
//! ranks may share a device where the library allows it; today it takes 2 to 8 distinct ones).
//! A collective whose output type differs from its input's (an FP8 norm output) needs a second
//! type parameter here.

// Ranks index their buffers: `for r in 0..n` reads as the protocol does.
#![allow(clippy::needless_range_loop)]

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{CaptureMode, DeviceBuffer, Stream};
use cuda_multimem_collectives::testing::rms_norm_within_tolerance;
use cuda_multimem_collectives::{
    Choice, Communicator, DType, Dst, Element, RankHandle, ReduceOp, Src, SymmetricBuffer,
};

use crate::Rng;

/// The element types the table is instantiated at.
pub trait Elem: Element + Default + Copy + Send + Sync + std::fmt::Debug + 'static {}
impl<T: Element + Default + Copy + Send + Sync + std::fmt::Debug + 'static> Elem for T {}

/// What one call takes beside its operands: the operator (reducing collectives), the root
/// (broadcast), the row length and epsilon (the fused norm; `hidden` 0: the whole count is one
/// row).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params {
    /// The reduction.
    pub op: ReduceOp,
    /// The broadcast's root.
    pub root: usize,
    /// The norm's row length (0: one row of the whole count).
    pub hidden: usize,
    /// The norm's epsilon.
    pub eps: f32,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            op: ReduceOp::Sum,
            root: 0,
            hidden: 0,
            eps: 1e-6,
        }
    }
}

impl Params {
    /// A sum (the default).
    pub fn sum() -> Params {
        Params::default()
    }

    /// Reducing with `op`.
    pub fn op(op: ReduceOp) -> Params {
        Params {
            op,
            ..Params::default()
        }
    }

    /// Broadcasting from `root`.
    pub fn root(root: usize) -> Params {
        Params {
            root,
            ..Params::default()
        }
    }

    /// Norm rows of `hidden` elements.
    pub fn rows_of(hidden: usize) -> Params {
        Params {
            hidden,
            ..Params::default()
        }
    }

    /// The norm's row length for `count` elements.
    pub fn row(&self, count: usize) -> usize {
        if self.hidden == 0 {
            count.max(1)
        } else {
            self.hidden
        }
    }
}

/// Where rank r's in-place form reads its input and writes its output, in elements of its one
/// buffer of `len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InPlace {
    /// The buffer's length.
    pub len: usize,
    /// Where the input starts.
    pub input: usize,
    /// Where the output starts.
    pub output: usize,
}

/// A further operand of a call (the norm's residual and weight): its argument name, its
/// length, and whether the call writes it. Its data is the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Side {
    /// The argument's name, as the call's errors name it.
    pub name: &'static str,
    /// Elements.
    pub len: usize,
    /// Whether the call writes it (then it is checked against the reference too).
    pub written: bool,
}

/// How a result is compared with the reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compare {
    /// Bit for bit.
    Exact,
    /// Within the fused norm's documented tolerance ([`rms_norm_within_tolerance`]).
    RmsNorm,
}

/// A further operand as the call takes it.
pub enum SideArg<'a, T> {
    /// Read only.
    Read(Src<'a, T>),
    /// Written.
    Write(Dst<'a, T>),
}

impl<'a, T> SideArg<'a, T> {
    /// The read-only operand (panics on a written one: a table entry's mistake).
    pub fn src(self) -> Src<'a, T> {
        match self {
            SideArg::Read(s) => s,
            SideArg::Write(_) => panic!("a written side operand where a read-only one belongs"),
        }
    }

    /// The written operand (panics on a read-only one).
    pub fn dst(self) -> Dst<'a, T> {
        match self {
            SideArg::Write(d) => d,
            SideArg::Read(_) => panic!("a read-only side operand where a written one belongs"),
        }
    }
}

/// One rank's operands.
pub struct Args<'a, T> {
    /// The input; `None` in place (the call takes `output` as its one buffer).
    pub input: Option<Src<'a, T>>,
    /// The output, or in place the one buffer.
    pub output: Dst<'a, T>,
    /// The address and length of `output`, for calls whose in-place form passes that one range
    /// as two operands (the norm's `out = x`): valid as long as the [`Queued`] case lives.
    pub raw: (CUdeviceptr, usize),
    /// The further operands, in the order the entry's `sides` lists them.
    pub side: Vec<SideArg<'a, T>>,
}

impl<'a, T> Args<'a, T> {
    /// Every operand keeping what `guard(argument name)` gives alive until the call that takes
    /// it returns (`Src::hold` / `Dst::hold`), as an engine's tensor type attaches its guards.
    pub fn hold<G: Send + Sync + 'a>(
        self,
        names: &[&'static str],
        mut guard: impl FnMut(&'static str) -> G,
    ) -> Self {
        let (i, o) = if self.input.is_some() {
            ("input", "output")
        } else {
            ("buf", "buf")
        };
        Args {
            input: self.input.map(|s| s.hold(guard(i))),
            output: self.output.hold(guard(o)),
            raw: self.raw,
            side: self
                .side
                .into_iter()
                .zip(names)
                .map(|(a, &name)| match a {
                    SideArg::Read(s) => SideArg::Read(s.hold(guard(name))),
                    SideArg::Write(d) => SideArg::Write(d.hold(guard(name))),
                })
                .collect(),
        }
    }
}

/// What every rank must hold after a call: by rank, its results (the output, then every
/// further operand the call writes); from every rank's input and the further operands' data.
pub type ExpectedFn<T> = fn(p: &Params, inputs: &[Vec<T>], sides: &[Vec<T>]) -> Results<T>;

/// By rank, by result: elements.
pub type Results<T> = Vec<Vec<Vec<T>>>;

/// How a table entry calls its collective for one rank.
pub type CallFn<T> = for<'a, 'h, 's> fn(
    &RankHandle<'h>,
    &Params,
    Args<'a, T>,
    &'s Stream,
) -> cuda_multimem::Result<Choice>;

/// One collective, described (see the module's documentation).
pub struct Collective<T> {
    /// Its name (also how [`collective`] finds it).
    pub name: &'static str,
    /// Whether [`Params::op`] matters.
    pub reduces: bool,
    /// Whether [`Params::root`] matters.
    pub rooted: bool,
    /// (input, output) elements per rank for a team of `n` and `count`.
    pub counts: fn(n: usize, count: usize) -> (usize, usize),
    /// The in-place form for rank `rank` of a team of `n` and `count`.
    pub in_place: fn(n: usize, rank: usize, count: usize) -> InPlace,
    /// The further operands for `count` elements.
    pub sides: fn(count: usize, p: &Params) -> Vec<Side>,
    /// The bus bandwidth factor for a team of `n` (nccl-tests' busbw = algbw × factor).
    pub bus_factor: fn(n: usize) -> f64,
    /// Per rank, what it must hold afterwards: its output, then every further operand the call
    /// writes; from every rank's input (`inputs[r]`) and the further operands' data (`sides[k]`,
    /// the same on every rank).
    pub expected: ExpectedFn<T>,
    /// How each result of [`Collective::expected`] is compared, by position.
    pub compare: &'static [Compare],
    /// The call.
    pub call: CallFn<T>,
}

impl<T> Clone for Collective<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Collective<T> {}

impl<T> std::fmt::Debug for Collective<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

mod entries;

pub use entries::{
    all_gather, all_reduce, all_reduce_add_rms_norm, broadcast, collective, reduce_scatter, table,
};

/// The parameters the table's iterations use for `c` on a team of `n`: every operator of a
/// reducing collective, the first and the last rank as a broadcast's root, one sum otherwise.
pub fn params_for<T>(c: &Collective<T>, n: usize) -> Vec<Params> {
    if c.reduces {
        ReduceOp::ALL.iter().map(|&op| Params::op(op)).collect()
    } else if c.rooted {
        let mut v = vec![Params::root(0)];
        if n > 1 {
            v.push(Params::root(n - 1));
        }
        v
    } else {
        vec![Params::sum()]
    }
}

/// A collective and its parameters, whatever the element type: what the sweeps iterate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Call {
    /// The table entry's name.
    pub name: &'static str,
    /// The parameters.
    pub params: Params,
}

impl Call {
    /// Allreduce with `op`.
    pub fn all_reduce(op: ReduceOp) -> Call {
        Call {
            name: "all_reduce",
            params: Params::op(op),
        }
    }

    /// Reduce-scatter with `op`.
    pub fn reduce_scatter(op: ReduceOp) -> Call {
        Call {
            name: "reduce_scatter",
            params: Params::op(op),
        }
    }

    /// All-gather.
    pub fn all_gather() -> Call {
        Call {
            name: "all_gather",
            params: Params::sum(),
        }
    }

    /// Broadcast from `root`.
    pub fn broadcast(root: usize) -> Call {
        Call {
            name: "broadcast",
            params: Params::root(root),
        }
    }

    /// The fused norm in rows of `hidden` (0: one row).
    pub fn norm(hidden: usize) -> Call {
        Call {
            name: "all_reduce_add_rms_norm",
            params: Params::rows_of(hidden),
        }
    }

    /// The entry at `T`.
    pub fn at<T: Elem>(&self) -> Collective<T> {
        collective(self.name)
    }

    /// (input, output) elements per rank for a team of `n` and `count`.
    pub fn counts(&self, n: usize, count: usize) -> (usize, usize) {
        (self.at::<f32>().counts)(n, count)
    }
}

/// Every call the table's sweeps make on a team of `n`: each entry with each of its
/// [`params_for`].
pub fn calls(n: usize) -> Vec<Call> {
    table::<f32>()
        .iter()
        .flat_map(|c| {
            params_for(c, n).into_iter().map(|params| Call {
                name: c.name,
                params,
            })
        })
        .collect()
}

/// Which memory an operand is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A symmetric buffer (`Communicator::alloc`) or a view of one.
    Sym,
    /// The caller's own memory (a `DeviceBuffer`; a raw view into one where not whole).
    Own,
}

/// Where a case's operands live: the input's and the output's kind, and at which element of
/// their buffers they start. In place, the one buffer is the output's: of its kind, its view
/// from `output_at`. Further operands are whole buffers, of the input's kind where the call
/// reads them and of the output's where it writes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mem {
    /// The input's kind.
    pub input: Kind,
    /// The output's kind.
    pub output: Kind,
    /// The input's first element in its buffer.
    pub input_at: usize,
    /// The output's first element in its buffer.
    pub output_at: usize,
}

impl Mem {
    /// Whole symmetric buffers (16-byte aligned).
    pub const SYM: Mem = Mem::sym_at(0, 0);
    /// Views of symmetric buffers from element 1 (not 16-byte aligned).
    pub const SYM_ODD: Mem = Mem::sym_at(1, 1);
    /// Whole `DeviceBuffer`s of the caller.
    pub const OWN: Mem = Mem::own_at(0, 0);
    /// The caller's own input, a symmetric output.
    pub const OWN_TO_SYM: Mem = Mem {
        input: Kind::Own,
        output: Kind::Sym,
        input_at: 0,
        output_at: 0,
    };
    /// The three the sweeps take.
    pub const ALL: [Mem; 3] = [Mem::SYM, Mem::SYM_ODD, Mem::OWN];
    /// The two operand kinds, whole buffers.
    pub const KINDS: [Mem; 2] = [Mem::SYM, Mem::OWN];

    /// Symmetric views from elements `input_at` and `output_at`.
    pub const fn sym_at(input_at: usize, output_at: usize) -> Mem {
        Mem {
            input: Kind::Sym,
            output: Kind::Sym,
            input_at,
            output_at,
        }
    }

    /// The caller's memory from elements `input_at` and `output_at` of its buffers.
    pub const fn own_at(input_at: usize, output_at: usize) -> Mem {
        Mem {
            input: Kind::Own,
            output: Kind::Own,
            input_at,
            output_at,
        }
    }

    fn short(&self) -> String {
        let k = |k: Kind| match k {
            Kind::Sym => "symmetric",
            Kind::Own => "own memory",
        };
        let kinds = if self.input == self.output {
            k(self.input).to_string()
        } else {
            format!("{} to {}", k(self.input), k(self.output))
        };
        if (self.input_at, self.output_at) == (0, 0) {
            kinds
        } else {
            format!("{kinds} at {}/{}", self.input_at, self.output_at)
        }
    }
}

/// One operand's memory on every rank.
enum Buf<T: Elem> {
    Sym(SymmetricBuffer<T>),
    /// By rank.
    Own(Vec<DeviceBuffer<T>>),
}

impl<T: Elem> Buf<T> {
    /// `len` elements (at least one: neither kind has empty buffers) on every rank.
    fn alloc(comm: &Communicator, kind: Kind, len: usize) -> Buf<T> {
        let len = len.max(1);
        match kind {
            Kind::Sym => Buf::Sym(comm.alloc::<T>(len).unwrap()),
            Kind::Own => Buf::Own(
                (0..comm.size())
                    .map(|r| DeviceBuffer::zeroed(comm.device(r).unwrap(), len).unwrap())
                    .collect(),
            ),
        }
    }

    fn write(&mut self, r: usize, at: usize, data: &[T]) {
        if data.is_empty() {
            return;
        }
        match self {
            Buf::Sym(b) => b.write(r, at, data).unwrap(),
            Buf::Own(b) => b[r].copy_from_host(at, data).unwrap(),
        }
    }

    fn read(&self, r: usize, at: usize, len: usize) -> Vec<T> {
        let mut v = vec![T::default(); len];
        if len > 0 {
            match self {
                Buf::Sym(b) => b.read(r, at, &mut v).unwrap(),
                Buf::Own(b) => b[r].copy_to_host(at, &mut v).unwrap(),
            }
        }
        v
    }

    /// Rank `r`'s address of element `at`.
    fn addr(&self, r: usize, at: usize) -> CUdeviceptr {
        let base = match self {
            Buf::Sym(b) => b.device_ptr(r).unwrap(),
            Buf::Own(b) => b[r].device_ptr(),
        };
        base + (at * std::mem::size_of::<T>()) as u64
    }

    /// Rank `r`'s view of `len` elements from `at`, read only: a symmetric view, the whole
    /// `DeviceBuffer` as itself, else a raw view into it.
    fn src(&self, r: usize, at: usize, len: usize) -> Src<'_, T> {
        match self {
            Buf::Sym(b) => b.slice(at..at + len).unwrap().into(),
            Buf::Own(b) if at == 0 && len == b[r].len() => (&b[r]).into(),
            Buf::Own(b) => {
                assert!(at + len <= b[r].len());
                // SAFETY: inside rank r's buffer, which lives as long as the case.
                unsafe { Src::from_raw(self.addr(r, at), len) }
            }
        }
    }

    /// [`Buf::src`], written.
    fn dst(&mut self, r: usize, at: usize, len: usize) -> Dst<'_, T> {
        let addr = self.addr(r, at);
        match self {
            Buf::Sym(b) => b.slice_mut(at..at + len).unwrap().into(),
            Buf::Own(b) => {
                let b = &mut b[r];
                if at == 0 && len == b.len() {
                    b.into()
                } else {
                    assert!(at + len <= b.len());
                    // SAFETY: inside rank r's buffer, which lives as long as the case.
                    unsafe { Dst::from_raw(addr, len) }
                }
            }
        }
    }
}

/// One case's operands on every rank of a team (alive until the case is dropped), the data
/// they were given, and what every rank must hold after the call.
pub struct Queued<T: Elem> {
    /// The entry.
    pub coll: Collective<T>,
    /// Ranks.
    pub n: usize,
    /// The count.
    pub count: usize,
    /// The call's parameters.
    pub params: Params,
    /// Where the operands live.
    pub mem: Mem,
    /// Whether the in-place form runs.
    pub in_place: bool,
    /// What each rank's call returned, in the order they were called.
    pub choices: Vec<Choice>,
    /// Compare sums within the rounding of a reduction in another order (the multimem path's
    /// switch adds in its own order) rather than bit for bit.
    pub switch_order: bool,
    inputs: Vec<Vec<T>>,
    side_data: Vec<Vec<T>>,
    /// Per rank, per result: what it must hold (the first result: the output, or in place the
    /// whole buffer).
    want: Vec<Vec<Vec<T>>>,
    sides: Vec<Side>,
    /// `None` in place.
    input: Option<Buf<T>>,
    output: Buf<T>,
    side_bufs: Vec<Buf<T>>,
}

impl<T: Elem> Queued<T> {
    /// Allocate the operands of `coll` at `count` on every rank of `comm` (nothing written yet:
    /// [`Queued::fill`] gives them data).
    pub fn new(
        comm: &Communicator,
        coll: Collective<T>,
        count: usize,
        params: Params,
        mem: Mem,
        in_place: bool,
    ) -> Queued<T> {
        let n = comm.size();
        let (il, ol) = (coll.counts)(n, count);
        let sides = (coll.sides)(count, &params);
        let (input, output) = if in_place {
            let len = (coll.in_place)(n, 0, count).len;
            (None, Buf::alloc(comm, mem.output, len + mem.output_at))
        } else {
            (
                Some(Buf::alloc(comm, mem.input, il + mem.input_at)),
                Buf::alloc(comm, mem.output, ol + mem.output_at),
            )
        };
        let side_bufs = sides
            .iter()
            .map(|s| {
                let kind = if s.written { mem.output } else { mem.input };
                Buf::alloc(comm, kind, s.len)
            })
            .collect();
        Queued {
            coll,
            n,
            count,
            params,
            mem,
            in_place,
            choices: Vec::new(),
            switch_order: false,
            inputs: Vec::new(),
            side_data: Vec::new(),
            want: Vec::new(),
            sides,
            input,
            output,
            side_bufs,
        }
    }

    /// A description for messages.
    pub fn what(&self) -> String {
        format!(
            "{} of {} x {} on {} ranks ({:?}), {}{}",
            self.coll.name,
            self.count,
            T::DTYPE,
            self.n,
            self.params,
            self.mem.short(),
            if self.in_place { ", in place" } else { "" }
        )
    }

    /// Give every operand new random data from `rng` (the in-place buffer random around the
    /// input too) and work out what every rank must hold after the call.
    pub fn fill(&mut self, rng: &mut Rng) {
        let (n, count) = (self.n, self.count);
        let (il, _) = (self.coll.counts)(n, count);
        self.inputs = (0..n).map(|_| rng.input::<T>(il)).collect();
        self.side_data = self.sides.iter().map(|s| rng.input::<T>(s.len)).collect();
        let want = (self.coll.expected)(&self.params, &self.inputs, &self.side_data);
        let results = 1 + self.sides.iter().filter(|s| s.written).count();
        self.want = Vec::with_capacity(n);
        for (r, mut w) in want.into_iter().enumerate() {
            assert_eq!(w.len(), results, "{}: results", self.coll.name);
            if self.in_place {
                let ip = (self.coll.in_place)(n, r, count);
                let mut b = rng.input::<T>(ip.len);
                b[ip.input..ip.input + il].copy_from_slice(&self.inputs[r]);
                self.output.write(r, self.mem.output_at, &b);
                b[ip.output..ip.output + w[0].len()].copy_from_slice(&w[0]);
                w[0] = b;
            } else {
                let at = self.mem.input_at;
                self.input.as_mut().unwrap().write(r, at, &self.inputs[r]);
            }
            self.want.push(w);
        }
        for (b, data) in self.side_bufs.iter_mut().zip(&self.side_data) {
            for r in 0..n {
                b.write(r, 0, data);
            }
        }
    }

    /// Rank `r`'s input as [`Queued::fill`] wrote it (in place: the input part of the buffer).
    pub fn input(&self, r: usize) -> &[T] {
        &self.inputs[r]
    }

    /// The data of further operand `k` (the same on every rank) as [`Queued::fill`] wrote it.
    pub fn side_data(&self, k: usize) -> &[T] {
        &self.side_data[k]
    }

    /// Rank `r`'s call, queued on `stream` (recorded in [`Queued::choices`] when it succeeds).
    pub fn call(
        &mut self,
        comm: &Communicator,
        r: usize,
        stream: &Stream,
    ) -> cuda_multimem::Result<Choice> {
        self.call_holding(comm, r, stream, |_| ())
    }

    /// [`Queued::call`] with every operand holding `guard(argument name)` for the call
    /// ([`Args::hold`]).
    pub fn call_holding<G: Send + Sync>(
        &mut self,
        comm: &Communicator,
        r: usize,
        stream: &Stream,
        guard: impl FnMut(&'static str) -> G,
    ) -> cuda_multimem::Result<Choice> {
        let h = comm.rank(r)?;
        let (n, count) = (self.n, self.count);
        let (il, ol) = (self.coll.counts)(n, count);
        let (ia, oa) = (self.mem.input_at, self.mem.output_at);
        let side = self
            .side_bufs
            .iter_mut()
            .zip(&self.sides)
            .map(|(b, s)| {
                if s.written {
                    SideArg::Write(b.dst(r, 0, s.len))
                } else {
                    SideArg::Read(b.src(r, 0, s.len))
                }
            })
            .collect();
        let len = if self.in_place {
            (self.coll.in_place)(n, r, count).len
        } else {
            ol
        };
        let args = Args {
            input: self.input.as_ref().map(|b| b.src(r, ia, il)),
            raw: (self.output.addr(r, oa), len),
            output: self.output.dst(r, oa, len),
            side,
        };
        let names: Vec<&'static str> = self.sides.iter().map(|s| s.name).collect();
        let args = args.hold(&names, guard);
        let c = (self.coll.call)(&h, &self.params, args, stream)?;
        self.choices.push(c);
        Ok(c)
    }

    /// Every rank's call, in rank order, each on its stream (panics on an error).
    pub fn call_all(&mut self, comm: &Communicator, streams: &[Stream]) {
        for (r, st) in streams.iter().enumerate() {
            self.call(comm, r, st)
                .unwrap_or_else(|e| panic!("{}: rank {r}: {e}", self.what()));
        }
    }

    /// What rank `r` holds now: its output (in place: the whole buffer), then every further
    /// operand the call writes.
    pub fn results(&self, r: usize) -> Vec<Vec<T>> {
        let (n, count) = (self.n, self.count);
        let len = if self.in_place {
            (self.coll.in_place)(n, r, count).len
        } else {
            (self.coll.counts)(n, count).1
        };
        let mut out = vec![self.output.read(r, self.mem.output_at, len)];
        for (b, s) in self.side_bufs.iter().zip(&self.sides) {
            if s.written {
                out.push(b.read(r, 0, s.len));
            }
        }
        out
    }

    /// Every rank's results against the reference; the first difference, described.
    pub fn verify(&self) -> Result<(), String> {
        let tol = self.tolerances();
        for r in 0..self.n {
            let got = self.results(r);
            for (k, (g, w)) in got.iter().zip(&self.want[r]).enumerate() {
                let cmp = self.coll.compare[k];
                let bad = (0..w.len()).find(|&i| match (cmp, &tol) {
                    (Compare::RmsNorm, _) => !rms_norm_within_tolerance(g[i], w[i]),
                    (Compare::Exact, Some(t)) if k == 0 && t[r][i] > 0.0 => {
                        (g[i].to_f32() - w[i].to_f32()).abs() > t[r][i]
                    }
                    (Compare::Exact, _) => g[i].to_bits64() != w[i].to_bits64(),
                });
                if let Some(i) = bad {
                    let name = if k == 0 {
                        "output"
                    } else {
                        self.sides
                            .iter()
                            .filter(|s| s.written)
                            .nth(k - 1)
                            .unwrap()
                            .name
                    };
                    return Err(format!(
                        "{} ({}): rank {r}, {name} element {i} of {}: got {:?}, want {:?}{}",
                        self.what(),
                        self.choices
                            .get(r)
                            .map_or("not called".into(), |c| c.to_string()),
                        w.len(),
                        g[i],
                        w[i],
                        match &tol {
                            Some(t) if k == 0 => format!(" (tolerance {})", t[r][i]),
                            _ => String::new(),
                        }
                    ));
                }
            }
        }
        Ok(())
    }

    /// [`Queued::verify`], panicking with the difference.
    pub fn check(&self) {
        if let Err(m) = self.verify() {
            panic!("{m}");
        }
    }

    /// Under [`Queued::switch_order`], for sums: per rank, per element of the first result,
    /// how far it may be from the rank-order reference (0: bit for bit) — the rounding of n
    /// additions of the inputs' magnitudes, in the stored type.
    fn tolerances(&self) -> Option<Vec<Vec<f32>>> {
        if !self.switch_order || !self.coll.reduces || self.params.op != ReduceOp::Sum {
            return None;
        }
        let eps = match T::DTYPE {
            DType::F32 => f32::EPSILON,
            DType::F16 => 1.0 / 1024.0,
            DType::Bf16 => 1.0 / 128.0,
            _ => 0.0,
        };
        // the same collective over the inputs' magnitudes, in f32, rank order
        let f = collective::<f32>(self.coll.name);
        let abs: Vec<Vec<f32>> = self
            .inputs
            .iter()
            .map(|x| x.iter().map(|v| v.to_f32().abs()).collect())
            .collect();
        let sides: Vec<Vec<f32>> = self
            .side_data
            .iter()
            .map(|x| x.iter().map(|v| v.to_f32().abs()).collect())
            .collect();
        let mags = (f.expected)(&self.params, &abs, &sides);
        Some(
            (0..self.n)
                .map(|r| {
                    let t: Vec<f32> = mags[r][0]
                        .iter()
                        .map(|m| eps * m.max(1.0) * self.n as f32)
                        .collect();
                    if self.in_place {
                        let ip = (self.coll.in_place)(self.n, r, self.count);
                        let mut all = vec![0.0; ip.len];
                        all[ip.output..ip.output + t.len()].copy_from_slice(&t);
                        all
                    } else {
                        t
                    }
                })
                .collect(),
        )
    }
}

/// A case of any element type: to be checked once everything has run, or filled and called
/// again (graph replays).
pub trait Pending {
    /// [`Queued::verify`].
    fn verify(&self) -> Result<(), String>;
    /// [`Queued::check`].
    fn check(&self) {
        if let Err(m) = self.verify() {
            panic!("{m}");
        }
    }
    /// [`Queued::choices`].
    fn choices(&self) -> &[Choice];
    /// [`Queued::what`].
    fn what(&self) -> String;
    /// [`Queued::fill`].
    fn fill(&mut self, rng: &mut Rng);
    /// [`Queued::call`].
    fn call(
        &mut self,
        comm: &Communicator,
        r: usize,
        stream: &Stream,
    ) -> cuda_multimem::Result<Choice>;
}

impl<T: Elem> Pending for Queued<T> {
    fn verify(&self) -> Result<(), String> {
        Queued::verify(self)
    }
    fn choices(&self) -> &[Choice] {
        &self.choices
    }
    fn what(&self) -> String {
        Queued::what(self)
    }
    fn fill(&mut self, rng: &mut Rng) {
        Queued::fill(self, rng)
    }
    fn call(
        &mut self,
        comm: &Communicator,
        r: usize,
        stream: &Stream,
    ) -> cuda_multimem::Result<Choice> {
        Queued::call(self, comm, r, stream)
    }
}

/// Capture every rank's calls of `cases`, in order, into one graph per rank (on its stream, in
/// `mode`), then replay the graphs `replays` times, every case with new data each time, every
/// replay checked on every rank: nothing may need a reset from the host between replays.
/// Returns, per case, what its captured calls chose (by rank).
pub fn capture_and_replay(
    comm: &Communicator,
    streams: &[Stream],
    cases: &mut [&mut dyn Pending],
    mode: CaptureMode,
    replays: usize,
    rng: &mut Rng,
) -> Vec<Vec<Choice>> {
    let mut execs = Vec::new();
    for (r, st) in streams.iter().enumerate() {
        let sr = st.as_stream_ref();
        sr.begin_capture(mode).unwrap();
        for c in cases.iter_mut() {
            c.call(comm, r, st)
                .unwrap_or_else(|e| panic!("{}: captured call of rank {r}: {e}", c.what()));
        }
        let graph = sr.end_capture().unwrap();
        // SAFETY: the team, the cases' buffers and the streams outlive `execs`, dropped at the
        // end of this function after the streams are synchronised.
        execs.push(unsafe { graph.instantiate() }.unwrap());
    }
    for replay in 0..replays {
        for c in cases.iter_mut() {
            c.fill(rng);
        }
        for (x, st) in execs.iter().zip(streams) {
            x.launch(st).unwrap();
        }
        crate::sync_all(streams);
        comm.check()
            .unwrap_or_else(|e| panic!("replay {replay}: {e}"));
        for c in cases.iter() {
            if let Err(m) = c.verify() {
                panic!("replay {replay}: {m}");
            }
        }
    }
    crate::sync_all(streams);
    drop(execs);
    cases.iter().map(|c| c.choices().to_vec()).collect()
}

/// One case on every rank of `comm`: allocated, filled from `rng`, called by every rank in
/// rank order on its stream of `streams` (nothing synchronised).
#[allow(clippy::too_many_arguments)]
pub fn queue<T: Elem>(
    comm: &Communicator,
    streams: &[Stream],
    call: Call,
    count: usize,
    mem: Mem,
    in_place: bool,
    rng: &mut Rng,
) -> Queued<T> {
    let mut q = Queued::new(comm, call.at(), count, call.params, mem, in_place);
    q.fill(rng);
    q.call_all(comm, streams);
    q
}

/// [`queue`], then wait for the streams, `check` the team and every rank's results; the case.
#[allow(clippy::too_many_arguments)]
pub fn once<T: Elem>(
    comm: &Communicator,
    streams: &[Stream],
    call: Call,
    count: usize,
    mem: Mem,
    in_place: bool,
    rng: &mut Rng,
) -> Queued<T> {
    let q = queue(comm, streams, call, count, mem, in_place, rng);
    crate::sync_all(streams);
    comm.check().unwrap_or_else(|e| panic!("{}: {e}", q.what()));
    q.check();
    q
}

/// Apply `$f::<T>(args)` for every element type the table runs at.
#[macro_export]
macro_rules! for_each_elem {
    ($f:ident ( $($arg:expr),* $(,)? )) => {{
        $f::<f32>($($arg),*);
        $f::<$crate::collectives::f16>($($arg),*);
        $f::<$crate::collectives::bf16>($($arg),*);
    }};
}

pub use cuda_multimem_collectives::{bf16, f16};
