//! The communicator: a team of devices driven by this process, their signal pads, staging areas,
//! loaded kernels, and the symmetric buffers an allreduce reads and writes.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cuda_multimem::{Device, Driver, Error, Result, Stream};
use cuda_multimem_sys::{
    CUcontext, CUdevice_attribute, CUdeviceptr, CUfunction, CUmodule, CUresult, CUstream,
};
use parking_lot::Mutex;

use crate::kernels::{self, Kernel, MAX_BLOCKS, MAX_RANKS, PAD_BYTES};
use crate::{Algorithm, DType, Op, Path};

/// Call a driver function through `driver.sys()`, turning a failure into [`Error::Driver`].
macro_rules! cu {
    ($driver:expr, $f:ident ( $($a:expr),* $(,)? )) => {
        match $driver.sys().$f() {
            Ok(f) => {
                let code = f($($a),*);
                if code == CUresult::CUDA_SUCCESS {
                    Ok(())
                } else {
                    Err(Error::Driver { call: stringify!($f), code })
                }
            }
            Err(e) => Err(Error::from(e)),
        }
    };
}

/// A raw driver handle owned by this crate's types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Raw<T>(T);
// SAFETY: driver handles are process-wide and usable from any thread.
unsafe impl<T> Send for Raw<T> {}
// SAFETY: as above; the owning types serialise what the driver requires.
unsafe impl<T> Sync for Raw<T> {}

/// Device memory from `cuMemAlloc`, freed on drop.
struct DevMem {
    device: Device,
    ptr: CUdeviceptr,
    len: usize,
}

impl DevMem {
    fn new(device: &Device, len: usize) -> Result<DevMem> {
        device.bind()?;
        let mut p: CUdeviceptr = 0;
        // SAFETY: out-pointer valid; the device's context is current; len > 0.
        unsafe { cu!(device.driver(), cuMemAlloc_v3020(&mut p, len)) }?;
        let m = DevMem {
            device: device.clone(),
            ptr: p,
            len,
        };
        // SAFETY: the whole allocation, just made.
        unsafe { cu!(device.driver(), cuMemsetD8_v3020(p, 0, len)) }?;
        Ok(m)
    }

    fn write(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        if offset + bytes.len() > self.len {
            return Err(Error::invalid(
                "data",
                format!(
                    "{} bytes at offset {offset} do not fit in {} bytes",
                    bytes.len(),
                    self.len
                ),
            ));
        }
        self.device.bind()?;
        // SAFETY: destination range inside the allocation (checked), source a live slice.
        unsafe {
            cu!(
                self.device.driver(),
                cuMemcpyHtoD_v3020(
                    self.ptr + offset as u64,
                    bytes.as_ptr() as *const c_void,
                    bytes.len()
                )
            )
        }
    }

    fn read(&self, offset: usize, bytes: &mut [u8]) -> Result<()> {
        if offset + bytes.len() > self.len {
            return Err(Error::invalid(
                "data",
                format!(
                    "{} bytes at offset {offset} exceed {} bytes",
                    bytes.len(),
                    self.len
                ),
            ));
        }
        self.device.bind()?;
        // SAFETY: source range inside the allocation (checked), destination a live slice.
        unsafe {
            cu!(
                self.device.driver(),
                cuMemcpyDtoH_v3020(
                    bytes.as_mut_ptr() as *mut c_void,
                    self.ptr + offset as u64,
                    bytes.len()
                )
            )
        }
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: we own the allocation; the team's kernels that use it are complete
            // (buffers and the communicator are dropped after their streams are synchronised;
            // the driver's cuMemFree waits for the device as well).
            let _ = unsafe { cu!(self.device.driver(), cuMemFree_v3020(self.ptr)) };
        }
    }
}

/// A module loaded on one device, unloaded on drop.
struct Module {
    device: Device,
    raw: Raw<CUmodule>,
}

impl Module {
    fn load(device: &Device, ptx: &str) -> Result<Module> {
        device.bind()?;
        let mut text = ptx.as_bytes().to_vec();
        text.push(0);
        let mut m: CUmodule = std::ptr::null_mut();
        // SAFETY: NUL-terminated PTX text; out-pointer valid; context current.
        unsafe {
            cu!(
                device.driver(),
                cuModuleLoadData(&mut m, text.as_ptr() as *const c_void)
            )
        }?;
        Ok(Module {
            device: device.clone(),
            raw: Raw(m),
        })
    }

    fn function(&self, name: &str) -> Result<CUfunction> {
        let c = std::ffi::CString::new(name)
            .map_err(|_| Error::invalid("name", format!("{name:?} contains NUL")))?;
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: live module, NUL-terminated name, valid out-pointer.
        unsafe {
            cu!(
                self.device.driver(),
                cuModuleGetFunction(&mut f, self.raw.0, c.as_ptr())
            )
        }?;
        Ok(f)
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: we own the module; its functions are not used after the communicator goes.
            let _ = unsafe { cu!(self.device.driver(), cuModuleUnload(self.raw.0)) };
        }
    }
}

/// Peer access this communicator enabled (from device, to context), disabled on drop.
struct PeerAccess {
    enabled: Vec<(Device, Raw<CUcontext>)>,
}

impl PeerAccess {
    fn enable(devices: &[Device]) -> Result<PeerAccess> {
        let mut pa = PeerAccess {
            enabled: Vec::new(),
        };
        for a in devices {
            for b in devices {
                if a == b {
                    continue;
                }
                let mut can = 0;
                // SAFETY: out-pointer valid; ordinals of this driver.
                unsafe {
                    cu!(
                        a.driver(),
                        cuDeviceCanAccessPeer(&mut can, a.ordinal(), b.ordinal())
                    )
                }?;
                if can == 0 {
                    return Err(Error::DeviceUnsupported {
                        device: a.ordinal(),
                        what: "peer access to another device of the team",
                    });
                }
                let ctx = b.primary_context()?;
                a.bind()?;
                // SAFETY: a's context is current; ctx is b's live primary context.
                match unsafe { cu!(a.driver(), cuCtxEnablePeerAccess(ctx, 0)) } {
                    Ok(()) => pa.enabled.push((a.clone(), Raw(ctx))),
                    Err(e)
                        if e.code() == Some(CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(pa)
    }
}

impl Drop for PeerAccess {
    fn drop(&mut self) {
        for (d, ctx) in self.enabled.drain(..) {
            if d.bind().is_ok() {
                // SAFETY: we enabled this access; the team's memory is freed already.
                let _ = unsafe { cu!(d.driver(), cuCtxDisablePeerAccess(ctx.0)) };
            }
        }
    }
}

/// How the communicator chooses and runs an allreduce. Every field can be changed; the
/// defaults follow the anchors' measurements (one-shot for small messages, two-shot above).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllReduceConfig {
    /// Messages up to this many bytes use one-shot (when not forced).
    pub one_shot_max_bytes: usize,
    /// Force an algorithm (`None`: choose by size).
    pub algorithm: Option<Algorithm>,
    /// A barrier that waits longer than this sets the team's error word and gives up.
    pub timeout: Duration,
    /// Threads per block.
    pub threads: u32,
    /// Most blocks per launch (at most [`MAX_BLOCKS`]); 0: two per multiprocessor.
    pub max_blocks: u32,
}

impl Default for AllReduceConfig {
    fn default() -> Self {
        AllReduceConfig {
            one_shot_max_bytes: 256 << 10,
            algorithm: None,
            timeout: Duration::from_secs(5),
            threads: 512,
            max_blocks: 0,
        }
    }
}

/// What an allreduce of a given size runs: path, algorithm and launch shape.
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
}

struct Rank {
    device: Device,
    pad: DevMem,
    stage: DevMem,
    functions: HashMap<(Kernel, DType, Op), Raw<CUfunction>>,
    _modules: Vec<Module>,
    last_stream: Mutex<Option<Raw<CUstream>>>,
}

struct Registered {
    rank: usize,
    start: CUdeviceptr,
    len: usize,
    table: CUdeviceptr,
}

struct Inner {
    config: AllReduceConfig,
    ranks: Vec<Rank>,
    multiprocessors: u32,
    stage_half: usize,
    buffers: Mutex<HashMap<u64, Vec<Registered>>>,
    next_buffer: AtomicU64,
    poisoned: AtomicU32,
    // Dropped last: peer access outlives every mapping made through it.
    _peers: PeerAccess,
}

/// An allreduce communicator over a team of devices driven by this process.
///
/// Build it once (it allocates, maps and loads kernels), then call [`Communicator::all_reduce`]
/// once per rank per collective, each on that rank's stream, in the same order on every rank.
/// Nothing is reset between calls, so calls can be captured into a CUDA graph and replayed.
/// After a timeout or a mismatch ([`Communicator::check`]) the team is unusable: drop it and
/// build a new one.
#[derive(Clone)]
pub struct Communicator {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("ranks", &self.inner.ranks.len())
            .field("config", &self.inner.config)
            .finish()
    }
}

fn multiprocessors(d: &Device) -> Result<u32> {
    let mut v = 0;
    // SAFETY: out-pointer valid; a device of this driver.
    unsafe {
        cu!(
            d.driver(),
            cuDeviceGetAttribute(
                &mut v,
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                d.ordinal()
            )
        )
    }?;
    Ok(v.max(1) as u32)
}

impl Communicator {
    /// A communicator over `devices` (rank i is `devices[i]`) with the default configuration.
    pub fn new(devices: &[Device]) -> Result<Communicator> {
        Communicator::with_config(devices, AllReduceConfig::default())
    }

    /// A communicator over `devices` with `config`.
    pub fn with_config(devices: &[Device], config: AllReduceConfig) -> Result<Communicator> {
        if devices.len() < 2 || devices.len() > MAX_RANKS {
            return Err(Error::invalid(
                "devices",
                format!("{} device(s); a team has 2 to {MAX_RANKS}", devices.len()),
            ));
        }
        let driver: &Driver = devices[0].driver();
        let _ = driver;
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].contains(d) {
                return Err(Error::invalid(
                    "devices",
                    format!("device {} appears twice", d.ordinal()),
                ));
            }
        }
        if config.threads == 0 || config.threads > 1024 || config.threads % 32 != 0 {
            return Err(Error::invalid(
                "config.threads",
                format!(
                    "{}; expected a multiple of 32 from 32 to 1024",
                    config.threads
                ),
            ));
        }
        if config.max_blocks as usize > MAX_BLOCKS {
            return Err(Error::invalid(
                "config.max_blocks",
                format!("{}; at most {MAX_BLOCKS}", config.max_blocks),
            ));
        }
        if config.timeout.is_zero() {
            return Err(Error::invalid(
                "config.timeout",
                "zero; expected a positive duration",
            ));
        }
        #[cfg(feature = "sim")]
        if driver.is_simulated() {
            crate::sim::register();
        }
        let peers = PeerAccess::enable(devices)?;
        let stage_half = config.one_shot_max_bytes.max(4096).next_multiple_of(4096);
        let mut ranks = Vec::with_capacity(devices.len());
        for d in devices {
            let pad = DevMem::new(d, PAD_BYTES)?;
            let stage = DevMem::new(d, 2 * stage_half)?;
            let mut modules = Vec::new();
            let mut functions = HashMap::new();
            for k in Kernel::ALL {
                let m = Module::load(d, k.ptx())?;
                for dt in DType::ALL {
                    for op in Op::ALL {
                        functions.insert((k, dt, op), Raw(m.function(&k.entry(dt, op))?));
                    }
                }
                modules.push(m);
            }
            ranks.push(Rank {
                device: d.clone(),
                pad,
                stage,
                functions,
                _modules: modules,
                last_stream: Mutex::new(None),
            });
        }
        // Each rank's pad: its rank, the team size, the staging half, every peer's pad and
        // staging area (the same addresses: one process, peer access by unified addressing).
        let n = ranks.len();
        for (i, r) in ranks.iter().enumerate() {
            let mut hdr = vec![0u8; 256];
            hdr[0..4].copy_from_slice(&(i as u32).to_le_bytes());
            hdr[4..8].copy_from_slice(&(n as u32).to_le_bytes());
            hdr[16..24].copy_from_slice(&(stage_half as u64).to_le_bytes());
            for (j, p) in ranks.iter().enumerate() {
                let o = kernels::OFF_PADS + 8 * j;
                hdr[o..o + 8].copy_from_slice(&p.pad.ptr.to_le_bytes());
                let o = kernels::OFF_STAGES + 8 * j;
                hdr[o..o + 8].copy_from_slice(&p.stage.ptr.to_le_bytes());
            }
            r.pad.write(0, &hdr)?;
        }
        let multiprocessors = multiprocessors(&devices[0])?;
        Ok(Communicator {
            inner: Arc::new(Inner {
                config,
                ranks,
                multiprocessors,
                stage_half,
                buffers: Mutex::new(HashMap::new()),
                next_buffer: AtomicU64::new(1),
                poisoned: AtomicU32::new(0),
                _peers: peers,
            }),
        })
    }

    /// Team size.
    pub fn size(&self) -> usize {
        self.inner.ranks.len()
    }

    /// The device of `rank`.
    pub fn device(&self, rank: usize) -> Option<&Device> {
        self.inner.ranks.get(rank).map(|r| &r.device)
    }

    /// The configuration.
    pub fn config(&self) -> &AllReduceConfig {
        &self.inner.config
    }

    /// A symmetric buffer of `bytes` bytes on every rank, zeroed, each rank's part mapped on
    /// every peer. Allreduce operands live in such buffers.
    pub fn alloc(&self, bytes: usize) -> Result<SymmetricBuffer> {
        if bytes == 0 {
            return Err(Error::invalid("bytes", "0; expected at least one byte"));
        }
        let parts = self
            .inner
            .ranks
            .iter()
            .map(|r| DevMem::new(&r.device, bytes))
            .collect::<Result<Vec<_>>>()?;
        let mut table = Vec::with_capacity(8 * MAX_RANKS);
        for p in &parts {
            table.extend_from_slice(&p.ptr.to_le_bytes());
        }
        let tables = self
            .inner
            .ranks
            .iter()
            .map(|r| {
                let t = DevMem::new(&r.device, 8 * MAX_RANKS)?;
                t.write(0, &table)?;
                Ok(t)
            })
            .collect::<Result<Vec<_>>>()?;
        let id = self.inner.next_buffer.fetch_add(1, Ordering::Relaxed);
        self.inner.buffers.lock().insert(
            id,
            parts
                .iter()
                .zip(&tables)
                .enumerate()
                .map(|(rank, (p, t))| Registered {
                    rank,
                    start: p.ptr,
                    len: bytes,
                    table: t.ptr,
                })
                .collect(),
        );
        Ok(SymmetricBuffer {
            comm: self.clone(),
            id,
            bytes,
            parts,
            _tables: tables,
        })
    }

    /// What an allreduce of `count` elements of `dtype` runs (path, algorithm, launch shape).
    pub fn choice(&self, count: usize, dtype: DType) -> Choice {
        let c = &self.inner.config;
        let bytes = count * dtype.size();
        let algorithm = c.algorithm.unwrap_or(if bytes <= c.one_shot_max_bytes {
            Algorithm::OneShot
        } else {
            Algorithm::TwoShot
        });
        let max_blocks = if c.max_blocks == 0 {
            (2 * self.inner.multiprocessors).min(MAX_BLOCKS as u32)
        } else {
            c.max_blocks
        };
        let units = bytes.div_ceil(16) as u64;
        let per_block = c.threads as u64
            * match algorithm {
                Algorithm::OneShot => 1,
                Algorithm::TwoShot => self.size() as u64,
            };
        let blocks = units.div_ceil(per_block).clamp(1, max_blocks as u64) as u32;
        Choice {
            path: Path::PeerToPeer,
            algorithm,
            blocks,
            threads: c.threads,
        }
    }

    /// Allreduce `count` elements of `dtype` with `op`: rank `rank`'s share of the collective,
    /// queued on `stream` (a stream of that rank's device). Reads `input` from element
    /// `in_offset`, writes `output` from element `out_offset` (the same buffer and offsets:
    /// in place). Every rank must make the same call (count, type, op, offsets), in the same
    /// order; a disagreement is detected by the kernels and reported by [`Communicator::check`].
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce(
        &self,
        rank: usize,
        input: &SymmetricBuffer,
        in_offset: usize,
        output: &SymmetricBuffer,
        out_offset: usize,
        count: usize,
        dtype: DType,
        op: Op,
        stream: &Stream,
    ) -> Result<Choice> {
        for (b, name) in [(input, "input"), (output, "output")] {
            if !Arc::ptr_eq(&b.comm.inner, &self.inner) {
                return Err(Error::invalid(
                    if name == "input" { "input" } else { "output" },
                    "a buffer of another communicator",
                ));
            }
        }
        let es = dtype.size();
        let (ib, ob) = (in_offset * es, out_offset * es);
        let rank_ok = self.rank(rank)?;
        let in_ptr = input.ptr(rank).unwrap_or(0) + ib as u64;
        let out_ptr = output.ptr(rank).unwrap_or(0) + ob as u64;
        if stream.device() != &rank_ok.device {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a stream of device {}; rank {rank} is device {}",
                    stream.device().ordinal(),
                    rank_ok.device.ordinal()
                ),
            ));
        }
        // SAFETY: the pointers lie in buffers registered with this team (checked again in
        // `all_reduce_raw`), and the stream is a live stream of the rank's device.
        unsafe { self.all_reduce_raw(rank, in_ptr, out_ptr, count * es, dtype, op, stream.raw()) }
    }

    fn rank(&self, rank: usize) -> Result<&Rank> {
        self.inner.ranks.get(rank).ok_or_else(|| {
            Error::invalid(
                "rank",
                format!("{rank}; the team has {} ranks", self.inner.ranks.len()),
            )
        })
    }

    fn lookup(
        &self,
        rank: usize,
        ptr: CUdeviceptr,
        bytes: usize,
        arg: &'static str,
    ) -> Result<(u64, CUdeviceptr, CUdeviceptr)> {
        let g = self.inner.buffers.lock();
        for (id, parts) in g.iter() {
            let r = &parts[rank];
            if ptr >= r.start && ptr < r.start + r.len as u64 {
                if ptr + bytes as u64 > r.start + r.len as u64 {
                    return Err(Error::invalid(
                        arg,
                        format!(
                            "{bytes} bytes at {ptr:#x} run past the end of its buffer ({} bytes at {:#x})",
                            r.len, r.start
                        ),
                    ));
                }
                debug_assert_eq!(r.rank, rank);
                return Ok((*id, r.table, ptr - r.start));
            }
        }
        Err(Error::invalid(
            arg,
            format!(
                "{ptr:#x} is not in a buffer registered with this team for rank {rank} (allocate operands with Communicator::alloc)"
            ),
        ))
    }

    /// [`Communicator::all_reduce`] on raw device pointers: `input` and `output` point into
    /// buffers of this team ([`SymmetricBuffer::ptr`] plus an offset) for `rank`, `bytes` is the
    /// message length in bytes (a multiple of the element size), `stream` a stream of the rank's
    /// device.
    ///
    /// # Safety
    /// `stream` must be a live stream of rank `rank`'s device; the pointers are checked against
    /// the team's buffers, the stream is not.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_reduce_raw(
        &self,
        rank: usize,
        input: CUdeviceptr,
        output: CUdeviceptr,
        bytes: usize,
        dtype: DType,
        op: Op,
        stream: CUstream,
    ) -> Result<Choice> {
        let r = self.rank(rank)?;
        let es = dtype.size();
        if bytes % es != 0 {
            return Err(Error::invalid(
                "bytes",
                format!(
                    "{bytes}; not a multiple of the {}-byte {}",
                    es,
                    dtype.name()
                ),
            ));
        }
        for (p, name) in [(input, "input"), (output, "output")] {
            if p % es as u64 != 0 {
                return Err(Error::invalid(
                    if name == "input" { "input" } else { "output" },
                    format!("{p:#x} is not aligned to the {es}-byte {}", dtype.name()),
                ));
            }
        }
        let (in_id, in_tab, in_off) = self.lookup(rank, input, bytes, "input")?;
        let (out_id, out_tab, out_off) = self.lookup(rank, output, bytes, "output")?;
        if let e @ 1.. = self.inner.poisoned.load(Ordering::Relaxed) {
            return Err(poison_error(e));
        }
        let count = bytes / es;
        let choice = self.choice(count, dtype);
        if count == 0 {
            return Ok(choice);
        }
        if choice.algorithm == Algorithm::OneShot && bytes > self.inner.stage_half {
            return Err(Error::invalid(
                "bytes",
                format!(
                    "{bytes} bytes with one-shot forced; its staging holds {} bytes (raise one_shot_max_bytes)",
                    self.inner.stage_half
                ),
            ));
        }
        if in_id == out_id
            && in_off != out_off
            && in_off < out_off + bytes as u64
            && out_off < in_off + bytes as u64
        {
            return Err(Error::invalid(
                "output",
                "overlaps the input without being the same range (in place needs the same offset)",
            ));
        }
        // One stream per rank at a time.
        {
            let mut last = r.last_stream.lock();
            if let Some(prev) = *last {
                if prev.0 != stream {
                    r.device.bind()?;
                    // SAFETY: the previous stream handle; a destroyed one answers an error.
                    let q = unsafe { cu!(r.device.driver(), cuStreamQuery(prev.0)) };
                    match q {
                        Ok(()) => {}
                        Err(e)
                            if matches!(
                                e.code(),
                                Some(CUresult::CUDA_ERROR_INVALID_HANDLE)
                                    | Some(CUresult::CUDA_ERROR_INVALID_CONTEXT)
                            ) => {}
                        Err(_) => {
                            return Err(Error::invalid(
                                "stream",
                                format!("rank {rank} has allreduce work in flight on another stream; one team takes one stream per rank at a time (synchronise the other first)"),
                            ))
                        }
                    }
                }
            }
            *last = Some(Raw(stream));
        }
        let kernel = match choice.algorithm {
            Algorithm::OneShot => Kernel::P2pOneShot,
            Algorithm::TwoShot => Kernel::P2pTwoShot,
        };
        let f = r.functions[&(kernel, dtype, op)].0;
        // The call header every rank compares: what, how much, where.
        let mut sig = 0xcbf2_9ce4_8422_2325u64;
        for x in [
            count as u64,
            dtype.code(),
            op.code(),
            kernel as u64,
            in_off,
            out_off,
            choice.blocks as u64,
        ] {
            sig = (sig ^ x).wrapping_mul(0x0000_0100_0000_01b3);
        }
        sig |= 1 << 63;
        let mut a_ctx = r.pad.ptr;
        let mut a_in = input;
        let mut a_out = output;
        let mut a_count = count as u64;
        let mut a_in_tab = in_tab;
        let mut a_out_tab = out_tab;
        let mut a_sig = sig;
        let mut a_timeout = self.inner.config.timeout.as_nanos().min(u64::MAX as u128) as u64;
        let mut params: [*mut c_void; 8] = [
            &mut a_ctx as *mut _ as *mut c_void,
            &mut a_in as *mut _ as *mut c_void,
            &mut a_out as *mut _ as *mut c_void,
            &mut a_count as *mut _ as *mut c_void,
            &mut a_in_tab as *mut _ as *mut c_void,
            &mut a_out_tab as *mut _ as *mut c_void,
            &mut a_sig as *mut _ as *mut c_void,
            &mut a_timeout as *mut _ as *mut c_void,
        ];
        r.device.bind()?;
        // SAFETY: a function of this device's module; eight parameters as the PTX declares
        // (all .u64), each pointing at a live local; the caller promises the stream.
        unsafe {
            cu!(
                r.device.driver(),
                cuLaunchKernel(
                    f,
                    choice.blocks,
                    1,
                    1,
                    choice.threads,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut()
                )
            )
        }?;
        Ok(choice)
    }

    /// Report a timeout or a disagreement between ranks seen by earlier calls. Call it after
    /// synchronising every rank's stream. After an error, the team refuses further calls.
    pub fn check(&self) -> Result<()> {
        let mut worst = 0;
        for r in &self.inner.ranks {
            let mut w = [0u8; 4];
            r.pad.read(kernels::OFF_ERR, &mut w)?;
            let e = u32::from_le_bytes(w);
            if e != 0 && worst != kernels::ERR_MISMATCH {
                worst = e;
            }
        }
        if worst != 0 {
            self.inner.poisoned.store(worst, Ordering::Relaxed);
            return Err(poison_error(worst));
        }
        Ok(())
    }
}

fn poison_error(code: u32) -> Error {
    match code {
        kernels::ERR_MISMATCH => Error::invalid(
            "ranks",
            "the ranks called allreduce with different sizes, types, operations or offsets; the team is unusable now",
        ),
        _ => Error::Timeout {
            what: "an allreduce barrier (a peer did not arrive: it died, hung, or called something else); the team is unusable now".into(),
            after: Duration::ZERO,
        },
    }
}

/// One buffer per rank, of the same size, each mapped on every peer: allreduce operands.
pub struct SymmetricBuffer {
    comm: Communicator,
    id: u64,
    bytes: usize,
    parts: Vec<DevMem>,
    _tables: Vec<DevMem>,
}

impl std::fmt::Debug for SymmetricBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SymmetricBuffer({} bytes x {} ranks)",
            self.bytes,
            self.parts.len()
        )
    }
}

impl SymmetricBuffer {
    /// Bytes per rank.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Always false (buffers have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Rank `rank`'s part as a raw device pointer (valid while the buffer lives).
    pub fn ptr(&self, rank: usize) -> Option<CUdeviceptr> {
        self.parts.get(rank).map(|p| p.ptr)
    }

    fn part(&self, rank: usize) -> Result<&DevMem> {
        self.parts.get(rank).ok_or_else(|| {
            Error::invalid(
                "rank",
                format!("{rank}; the team has {} ranks", self.parts.len()),
            )
        })
    }

    /// Copy `data` into rank `rank`'s part at offset 0 (synchronous).
    pub fn copy_from_host(&self, rank: usize, data: &[u8]) -> Result<()> {
        self.part(rank)?.write(0, data)
    }

    /// Copy rank `rank`'s part from offset 0 into `out` (synchronous; synchronise the rank's
    /// stream first).
    pub fn copy_to_host(&self, rank: usize, out: &mut [u8]) -> Result<()> {
        self.part(rank)?.read(0, out)
    }
}

impl Drop for SymmetricBuffer {
    fn drop(&mut self) {
        self.comm.inner.buffers.lock().remove(&self.id);
    }
}
