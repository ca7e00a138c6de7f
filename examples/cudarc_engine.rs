//! An engine's communication code written once, generic over its tensor type: tested on the
//! simulator through our types, run on the GPUs through cudarc's.
//!
//! cudarc talks to libcuda only (it panics without it), so code typed on `CudaSlice` cannot
//! run on the simulator. An engine on cudarc (as candle and mistral.rs are) tests its
//! communication code without a GPU this way:
//! - the code that calls the collectives is generic over a [`Backend`]: its storage type and its
//!   stream type, and the few things it does with them (upload, download, synchronise, capture);
//! - the engine's tensor type ([`Tensor`]) implements [`IntoSrc`] and [`IntoDst`] by handing its
//!   storage to ours: on a GPU its cudarc slice ([`Src::from_cudarc`], which keeps cudarc's guard
//!   until the call returns), on the simulator a [`DeviceBuffer`];
//! - the stream is whatever the backend has ([`IntoStream`]: our [`Stream`], or cudarc's
//!   `Arc<CudaStream>`).
//!
//! The same [`Engine`] then runs every collective of a rank (in place and out of place, the
//! fused and the local norm, a run-time element type) and a captured graph on both backends,
//! each result against the host reference. The simulator half always runs (a simulated machine
//! of two GPUs, or the one `CUDA_MULTIMEM_DRIVER=sim:...` names); the cudarc half runs where two
//! GPUs reach each other, and says why not elsewhere. Exits non-zero if any result differs.
//!
//! `cargo run --example cudarc_engine`

use std::process::ExitCode;
use std::sync::Arc;

use cuda_multimem::{CaptureMode, Device, DeviceBuffer, Driver, GraphExec, Stream};
use cuda_multimem_collectives::testing::{
    add_rms_norm_reference, all_gather_reference, broadcast_reference, random_bytes, random_input,
    reduce_scatter_reference, reference, reference_bytes, rms_norm_within_tolerance,
};
use cuda_multimem_collectives::{
    bf16, CallStream, Communicator, DType, Dst, IntoDst, IntoSrc, IntoStream, MulticastPolicy,
    ReduceOp, Src,
};
use cuda_multimem_examples::Res;
use cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream};

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("cudarc_engine: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The element types the engine keeps in tensors: what both backends can hold.
trait Elem:
    cuda_multimem::DeviceRepr
    + cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
    + Copy
    + Default
    + PartialEq
    + std::fmt::Debug
{
}
impl Elem for bf16 {}
impl Elem for u8 {}

/// What the engine needs of a device backend: its storage of one rank, its stream, and the
/// few things the engine does with them.
trait Backend {
    type Storage<T: Elem>;
    type Stream;
    type Graph;

    /// What it is, for the output.
    fn name(&self) -> String;
    /// Our devices (what the communicator is built on), one per rank.
    fn devices(&self) -> &[Device];
    fn stream(&self, rank: usize) -> &Self::Stream;
    fn upload<T: Elem>(&self, rank: usize, data: &[T]) -> Res<Self::Storage<T>>;
    fn download<T: Elem>(&self, rank: usize, s: &Self::Storage<T>) -> Res<Vec<T>>;
    fn synchronize(&self, rank: usize) -> Res<()>;
    /// A graph of what `f` queues on `rank`'s stream.
    fn capture(
        &self,
        rank: usize,
        f: &mut dyn FnMut() -> cuda_multimem::Result<()>,
    ) -> Res<Self::Graph>;
    fn replay(&self, rank: usize, g: &Self::Graph) -> Res<()>;
    /// A storage as an operand of a call on `on` (what [`Tensor`]'s [`IntoSrc`] hands on).
    fn src<'g, T: Elem>(
        s: &'g Self::Storage<T>,
        on: &CallStream<'g>,
        arg: &'static str,
    ) -> cuda_multimem::Result<Src<'g, T>>;
    fn dst<'g, T: Elem>(
        s: &'g mut Self::Storage<T>,
        on: &CallStream<'g>,
        arg: &'static str,
    ) -> cuda_multimem::Result<Dst<'g, T>>;
}

/// The engine's tensor: one rank's storage (as a candle tensor wraps a backend's storage).
struct Tensor<B: Backend, T: Elem> {
    storage: B::Storage<T>,
}

impl<'a, B: Backend, T: Elem> IntoSrc<'a, T> for &'a Tensor<B, T> {
    fn into_src<'g>(
        self,
        on: &CallStream<'g>,
        arg: &'static str,
    ) -> cuda_multimem::Result<Src<'g, T>>
    where
        'a: 'g,
    {
        B::src(&self.storage, on, arg)
    }
}

impl<'a, B: Backend, T: Elem> IntoDst<'a, T> for &'a mut Tensor<B, T> {
    fn into_dst<'g>(
        self,
        on: &CallStream<'g>,
        arg: &'static str,
    ) -> cuda_multimem::Result<Dst<'g, T>>
    where
        'a: 'g,
    {
        B::dst(&mut self.storage, on, arg)
    }
}

/// The simulator's backend: our [`DeviceBuffer`]s and [`Stream`]s.
struct Ours {
    devices: Vec<Device>,
    streams: Vec<Stream>,
}

impl Backend for Ours {
    type Storage<T: Elem> = DeviceBuffer<T>;
    type Stream = Stream;
    type Graph = GraphExec;

    fn name(&self) -> String {
        format!(
            "DeviceBuffer on {} simulated GPUs (driver {})",
            self.devices.len(),
            self.devices[0].driver().version()
        )
    }
    fn devices(&self) -> &[Device] {
        &self.devices
    }
    fn stream(&self, rank: usize) -> &Stream {
        &self.streams[rank]
    }
    fn upload<T: Elem>(&self, rank: usize, data: &[T]) -> Res<DeviceBuffer<T>> {
        Ok(DeviceBuffer::from_host(&self.devices[rank], data)?)
    }
    fn download<T: Elem>(&self, _rank: usize, s: &DeviceBuffer<T>) -> Res<Vec<T>> {
        Ok(s.to_vec()?)
    }
    fn synchronize(&self, rank: usize) -> Res<()> {
        Ok(self.streams[rank].synchronize()?)
    }
    fn capture(
        &self,
        rank: usize,
        f: &mut dyn FnMut() -> cuda_multimem::Result<()>,
    ) -> Res<GraphExec> {
        let s = self.streams[rank].as_stream_ref();
        s.begin_capture(CaptureMode::ThreadLocal)?;
        let queued = f();
        let graph = s.end_capture();
        queued?;
        // SAFETY: the engine keeps the communicator and the tensors the capture used until
        // after the last replay, and nothing moves them.
        Ok(unsafe { graph?.instantiate() }?)
    }
    fn replay(&self, rank: usize, g: &GraphExec) -> Res<()> {
        Ok(g.launch(&self.streams[rank])?)
    }
    fn src<'g, T: Elem>(
        s: &'g DeviceBuffer<T>,
        on: &CallStream<'g>,
        arg: &'static str,
    ) -> cuda_multimem::Result<Src<'g, T>> {
        s.into_src(on, arg)
    }
    fn dst<'g, T: Elem>(
        s: &'g mut DeviceBuffer<T>,
        on: &CallStream<'g>,
        arg: &'static str,
    ) -> cuda_multimem::Result<Dst<'g, T>> {
        s.into_dst(on, arg)
    }
}

/// The GPUs' backend: cudarc's `CudaSlice`s and `CudaStream`s (cudarc's event tracking on:
/// each call waits for its operands' earlier uses and records its own, through the guards the
/// operands hold until the call returns).
struct Cudarc {
    devices: Vec<Device>,
    contexts: Vec<Arc<CudaContext>>,
    streams: Vec<Arc<CudaStream>>,
}

fn cu<T>(r: Result<T, cudarc::driver::DriverError>) -> Res<T> {
    r.map_err(|e| format!("cudarc: {e:?}").into())
}

impl Backend for Cudarc {
    type Storage<T: Elem> = CudaSlice<T>;
    type Stream = Arc<CudaStream>;
    type Graph = CudaGraph;

    fn name(&self) -> String {
        let name = self.devices[0].name().unwrap_or_default();
        format!("cudarc CudaSlice on {} x {name}", self.devices.len())
    }
    fn devices(&self) -> &[Device] {
        &self.devices
    }
    fn stream(&self, rank: usize) -> &Arc<CudaStream> {
        &self.streams[rank]
    }
    fn upload<T: Elem>(&self, rank: usize, data: &[T]) -> Res<CudaSlice<T>> {
        cu(self.streams[rank].clone_htod(data))
    }
    fn download<T: Elem>(&self, rank: usize, s: &CudaSlice<T>) -> Res<Vec<T>> {
        cu(self.streams[rank].clone_dtoh(s))
    }
    fn synchronize(&self, rank: usize) -> Res<()> {
        cu(self.streams[rank].synchronize())
    }
    fn capture(
        &self,
        rank: usize,
        f: &mut dyn FnMut() -> cuda_multimem::Result<()>,
    ) -> Res<CudaGraph> {
        let (ctx, s) = (&self.contexts[rank], &self.streams[rank]);
        cu(s.synchronize())?;
        // A capture cannot wait on events recorded outside it: event tracking off while
        // capturing. SAFETY: every earlier use has completed (synchronised above), and the
        // captured work is all on this one stream.
        unsafe { ctx.disable_event_tracking() };
        let begun = cu(s.begin_capture(
            cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        ));
        let queued = begun.and_then(|()| Ok(f()?));
        let graph = cu(s.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0)));
        // SAFETY: no slice was made while tracking was off.
        unsafe { ctx.enable_event_tracking() };
        queued?;
        graph?.ok_or_else(|| "the capture recorded nothing".into())
    }
    fn replay(&self, _rank: usize, g: &CudaGraph) -> Res<()> {
        cu(g.launch())
    }
    fn src<'g, T: Elem>(
        s: &'g CudaSlice<T>,
        on: &CallStream<'g>,
        arg: &'static str,
    ) -> cuda_multimem::Result<Src<'g, T>> {
        Src::from_cudarc(s, on, arg)
    }
    fn dst<'g, T: Elem>(
        s: &'g mut CudaSlice<T>,
        on: &CallStream<'g>,
        arg: &'static str,
    ) -> cuda_multimem::Result<Dst<'g, T>> {
        Dst::from_cudarc(s, on, arg)
    }
}

/// The engine: a communicator over the backend's devices. Its communication code below is
/// written once, on [`Tensor`]s and the backend's streams.
struct Engine<B: Backend> {
    backend: B,
    comm: Communicator,
    seed: u64,
    failures: Vec<String>,
}

/// Elements per rank's chunk; the norm's row length.
const CHUNK: usize = 1024;
const HIDDEN: usize = 256;

impl<B: Backend> Engine<B>
where
    for<'x> &'x B::Stream: IntoStream<'x>,
{
    fn new(backend: B) -> Res<Self> {
        // Exact comparisons: the peer-to-peer path reduces in rank order, as the reference.
        let comm = Communicator::builder(backend.devices())
            .multicast(MulticastPolicy::Never)
            .build()?;
        Ok(Engine {
            backend,
            comm,
            seed: 2024,
            failures: Vec::new(),
        })
    }

    fn n(&self) -> usize {
        self.comm.size()
    }

    fn inputs(&mut self, len: usize) -> Vec<Vec<bf16>> {
        (0..self.n())
            .map(|_| random_input(len, &mut self.seed))
            .collect()
    }

    fn upload<T: Elem>(&self, data: &[Vec<T>]) -> Res<Vec<Tensor<B, T>>> {
        data.iter()
            .enumerate()
            .map(|(r, d)| {
                Ok(Tensor {
                    storage: self.backend.upload(r, d)?,
                })
            })
            .collect()
    }

    fn zeros<T: Elem>(&self, len: usize) -> Res<Vec<Tensor<B, T>>> {
        self.upload(&vec![vec![T::default(); len]; self.n()])
    }

    /// Wait for every rank, check the team, and download `ts`.
    fn finish<T: Elem>(&self, ts: &[Tensor<B, T>]) -> Res<Vec<Vec<T>>> {
        for r in 0..self.n() {
            self.backend.synchronize(r)?;
        }
        self.comm.check()?;
        ts.iter()
            .enumerate()
            .map(|(r, t)| self.backend.download(r, &t.storage))
            .collect()
    }

    fn expect<T: Elem>(&mut self, what: &str, got: &[Vec<T>], want: &[Vec<T>]) {
        let bad: Vec<usize> = (0..got.len()).filter(|&r| got[r] != want[r]).collect();
        println!(
            "  {what:<44} {}",
            if bad.is_empty() { "ok" } else { "DIFFERS" }
        );
        if !bad.is_empty() {
            self.failures
                .push(format!("{what}: ranks {bad:?} differ from the reference"));
        }
    }

    /// Every collective of a rank, each against the host reference.
    // Each rank's loop indexes several per-rank tensors by the rank it also passes on.
    #[allow(clippy::needless_range_loop)]
    fn every_collective(&mut self) -> Res<()> {
        let n = self.n();
        let every = |v: Vec<bf16>| vec![v; n];

        // allreduce, out of place and in place
        let x = self.inputs(CHUNK);
        let refs: Vec<&[bf16]> = x.iter().map(|v| &v[..]).collect();
        let want_sum = reference(ReduceOp::Sum, &refs);
        let want_max = reference(ReduceOp::Max, &refs);
        let mut xt = self.upload(&x)?;
        let mut yt = self.zeros::<bf16>(CHUNK)?;
        for r in 0..n {
            let h = self.comm.rank(r)?;
            let s = self.backend.stream(r);
            h.all_reduce(&xt[r], &mut yt[r], ReduceOp::Sum, s)?;
        }
        let got = self.finish(&yt)?;
        self.expect("all_reduce (sum)", &got, &every(want_sum));
        for r in 0..n {
            let h = self.comm.rank(r)?;
            h.all_reduce_in_place(&mut xt[r], ReduceOp::Max, self.backend.stream(r))?;
        }
        let got = self.finish(&xt)?;
        self.expect("all_reduce_in_place (max)", &got, &every(want_max));

        // reduce-scatter, out of place and in place
        let big = self.inputs(n * CHUNK);
        let refs: Vec<&[bf16]> = big.iter().map(|v| &v[..]).collect();
        let want = reduce_scatter_reference(ReduceOp::Sum, &refs);
        let mut bt = self.upload(&big)?;
        let mut ct = self.zeros::<bf16>(CHUNK)?;
        for r in 0..n {
            let h = self.comm.rank(r)?;
            h.reduce_scatter(&bt[r], &mut ct[r], ReduceOp::Sum, self.backend.stream(r))?;
        }
        let got = self.finish(&ct)?;
        self.expect("reduce_scatter", &got, &want);
        for r in 0..n {
            let h = self.comm.rank(r)?;
            h.reduce_scatter_in_place(&mut bt[r], ReduceOp::Sum, self.backend.stream(r))?;
        }
        let got: Vec<Vec<bf16>> = self
            .finish(&bt)?
            .into_iter()
            .enumerate()
            .map(|(r, v)| v[r * CHUNK..(r + 1) * CHUNK].to_vec())
            .collect();
        self.expect("reduce_scatter_in_place (chunk r)", &got, &want);

        // all-gather, out of place and in place
        let parts = self.inputs(CHUNK);
        let refs: Vec<&[bf16]> = parts.iter().map(|v| &v[..]).collect();
        let want = all_gather_reference(&refs);
        let pt = self.upload(&parts)?;
        let mut gt = self.zeros::<bf16>(n * CHUNK)?;
        for r in 0..n {
            let h = self.comm.rank(r)?;
            h.all_gather(&pt[r], &mut gt[r], self.backend.stream(r))?;
        }
        let got = self.finish(&gt)?;
        self.expect("all_gather", &got, &every(want.clone()));
        let placed: Vec<Vec<bf16>> = (0..n)
            .map(|r| {
                let mut v = vec![bf16::ZERO; n * CHUNK];
                v[r * CHUNK..(r + 1) * CHUNK].copy_from_slice(&parts[r]);
                v
            })
            .collect();
        let mut gt = self.upload(&placed)?;
        for r in 0..n {
            let h = self.comm.rank(r)?;
            h.all_gather_in_place(&mut gt[r], self.backend.stream(r))?;
        }
        let got = self.finish(&gt)?;
        self.expect("all_gather_in_place", &got, &every(want));

        // broadcast, out of place (root 1) and in place (root 0)
        let x = self.inputs(CHUNK);
        let refs: Vec<&[bf16]> = x.iter().map(|v| &v[..]).collect();
        let mut xt = self.upload(&x)?;
        let mut yt = self.zeros::<bf16>(CHUNK)?;
        let root = n - 1;
        for r in 0..n {
            let h = self.comm.rank(r)?;
            h.broadcast(&xt[r], &mut yt[r], root, self.backend.stream(r))?;
        }
        let got = self.finish(&yt)?;
        self.expect("broadcast", &got, &every(broadcast_reference(&refs, root)));
        for r in 0..n {
            let h = self.comm.rank(r)?;
            h.broadcast_in_place(&mut xt[r], 0, self.backend.stream(r))?;
        }
        let got = self.finish(&xt)?;
        self.expect(
            "broadcast_in_place",
            &got,
            &every(broadcast_reference(&refs, 0)),
        );

        // the fused allreduce + residual + RMSNorm, and the local norm
        let x = self.inputs(CHUNK);
        let resid: Vec<bf16> = random_input(CHUNK, &mut self.seed);
        let gamma: Vec<bf16> = random_input(HIDDEN, &mut self.seed);
        let refs: Vec<&[bf16]> = x.iter().map(|v| &v[..]).collect();
        let (want_res, want_out) = add_rms_norm_reference(&refs, &resid, &gamma, HIDDEN, 1e-6);
        let xt = self.upload(&x)?;
        let mut rt = self.upload(&every(resid.clone()))?;
        let wt = self.upload(&every(gamma.clone()))?;
        let mut ot = self.zeros::<bf16>(CHUNK)?;
        for r in 0..n {
            let h = self.comm.rank(r)?;
            let s = self.backend.stream(r);
            h.all_reduce_add_rms_norm(&xt[r], &mut rt[r], &wt[r], &mut ot[r], HIDDEN, 1e-6, s)?;
        }
        let got_res = self.finish(&rt)?;
        self.expect(
            "all_reduce_add_rms_norm (residual)",
            &got_res,
            &every(want_res),
        );
        let got_out = self.finish(&ot)?;
        self.expect_norm("all_reduce_add_rms_norm (out)", &got_out, &want_out);
        let (want_res, want_out) = add_rms_norm_reference(&[&x[0]], &resid, &gamma, HIDDEN, 1e-6);
        let mut rt = self.upload(&every(resid))?;
        let h = self.comm.rank(0)?;
        h.add_rms_norm(
            &xt[0],
            &mut rt[0],
            &wt[0],
            &mut ot[0],
            HIDDEN,
            1e-6,
            self.backend.stream(0),
        )?;
        let got_res = self.finish(&rt[..1])?;
        self.expect("add_rms_norm (residual, rank 0)", &got_res, &[want_res]);
        let got_out = self.finish(&ot[..1])?;
        self.expect_norm("add_rms_norm (out, rank 0)", &got_out, &want_out);

        // a run-time element type: byte tensors
        let bytes: Vec<Vec<u8>> = (0..n)
            .map(|_| random_bytes(DType::Bf16, CHUNK, &mut self.seed))
            .collect();
        let refs: Vec<&[u8]> = bytes.iter().map(|v| &v[..]).collect();
        let want = reference_bytes(DType::Bf16, ReduceOp::Sum, &refs);
        let it = self.upload(&bytes)?;
        let mut ot = self.zeros::<u8>(2 * CHUNK)?;
        for r in 0..n {
            let h = self.comm.rank(r)?;
            let s = self.backend.stream(r);
            h.all_reduce_dyn(DType::Bf16, &it[r], &mut ot[r], ReduceOp::Sum, s)?;
        }
        let got = self.finish(&ot)?;
        self.expect("all_reduce_dyn (bf16 bytes)", &got, &vec![want; n]);
        Ok(())
    }

    fn expect_norm(&mut self, what: &str, got: &[Vec<bf16>], want: &[bf16]) {
        let ok = got.iter().all(|g| {
            g.iter()
                .zip(want)
                .all(|(&a, &b)| rms_norm_within_tolerance(a, b))
        });
        println!("  {what:<44} {}", if ok { "ok" } else { "DIFFERS" });
        if !ok {
            self.failures
                .push(format!("{what}: outside the norm's tolerance"));
        }
    }

    /// An allreduce captured into a graph on every rank, replayed twice: the sum of the sums.
    fn graph(&mut self) -> Res<()> {
        let n = self.n();
        let x = self.inputs(CHUNK);
        let refs: Vec<&[bf16]> = x.iter().map(|v| &v[..]).collect();
        let once = reference(ReduceOp::Sum, &refs);
        let twice = reference(ReduceOp::Sum, &vec![&once[..]; n]);
        let mut xt = self.upload(&x)?;
        // one eager call of the same shape first: whatever the call sets up is set up outside
        // the capture
        let mut warm = self.zeros::<bf16>(CHUNK)?;
        for (r, w) in warm.iter_mut().enumerate() {
            let h = self.comm.rank(r)?;
            h.all_reduce_in_place(w, ReduceOp::Sum, self.backend.stream(r))?;
        }
        self.finish(&warm)?;
        let mut graphs = Vec::new();
        for (r, t) in xt.iter_mut().enumerate() {
            let h = self.comm.rank(r)?;
            let s = self.backend.stream(r);
            let g = self.backend.capture(r, &mut || {
                h.all_reduce_in_place(&mut *t, ReduceOp::Sum, s).map(drop)
            })?;
            graphs.push(g);
        }
        for _ in 0..2 {
            for (r, g) in graphs.iter().enumerate() {
                self.backend.replay(r, g)?;
            }
        }
        let got = self.finish(&xt)?;
        self.expect(
            "captured all_reduce_in_place, replayed 2x",
            &got,
            &vec![twice; n],
        );
        Ok(())
    }

    /// Both, and what failed.
    fn run(mut self) -> Res<Vec<String>> {
        println!("{}:", self.backend.name());
        self.every_collective()?;
        self.graph()?;
        Ok(self.failures)
    }
}

/// The simulator's machine: the one `CUDA_MULTIMEM_DRIVER=sim:...` names, else two GPUs.
fn simulated() -> Res<Driver> {
    match std::env::var(cuda_multimem::DRIVER_ENV) {
        Ok(v) if v.trim().starts_with("sim") => {
            cuda_multimem_collectives::sim::install();
            Ok(cuda_multimem_sim::driver_from_selection(&v)?)
        }
        _ => cuda_multimem_examples::simulated(2, 13030),
    }
}

/// Two real GPUs that reach each other, or why not.
fn real_gpus() -> Result<Vec<Device>, String> {
    if std::env::var(cuda_multimem::DRIVER_ENV).is_ok_and(|v| v.trim().starts_with("sim")) {
        return Err(format!(
            "{} selects the simulator",
            cuda_multimem::DRIVER_ENV
        ));
    }
    let d = Driver::load().map_err(|e| format!("no usable CUDA driver ({e})"))?;
    let devs = d.devices();
    if devs.len() < 2 {
        return Err(format!("{} GPU(s); two are needed", devs.len()));
    }
    if !devs[0].can_access_peer(&devs[1]).unwrap_or(false) {
        return Err("the first two GPUs cannot reach each other".into());
    }
    Ok(devs[..2].to_vec())
}

fn run() -> Res<bool> {
    let mut failures = Vec::new();
    {
        let driver = simulated()?;
        let devices = driver.devices();
        let streams = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
        let engine = Engine::new(Ours { devices, streams })?;
        failures.extend(engine.run()?);
    }
    match real_gpus() {
        Ok(devices) => {
            let contexts = (0..devices.len())
                .map(|r| cu(CudaContext::new(devices[r].ordinal() as usize)))
                .collect::<Res<Vec<_>>>()?;
            let streams = contexts
                .iter()
                .map(|c| cu(c.new_stream()))
                .collect::<Res<Vec<_>>>()?;
            let engine = Engine::new(Cudarc {
                devices,
                contexts,
                streams,
            })?;
            failures.extend(engine.run()?);
        }
        Err(why) => println!("cudarc on GPUs: not run: {why} (cudarc needs libcuda and GPUs)"),
    }
    for f in &failures {
        println!("FAILED: {f}");
    }
    Ok(failures.is_empty())
}
