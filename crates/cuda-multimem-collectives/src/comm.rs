//! The communicator: a team of devices driven by this process, their signal pads, staging areas,
//! loaded kernels, and the symmetric buffers an allreduce reads and writes.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cuda_multimem::vmm::{Access, HandleTypes, Location, Mapping, PhysicalAllocation};
use cuda_multimem::{Device, Error, Result, Stream};
use cuda_multimem_sys::{CUdeviceptr, CUfunction, CUmodule, CUresult, CUstream};
use parking_lot::Mutex;

use crate::bootstrap::Bootstrap;
use crate::kernels::{self, Kernel, MAX_BLOCKS, MAX_RANKS, PAD_BYTES};
use crate::{Algorithm, DType, Op, Path};

/// Call a driver function through `driver.sys()`, turning a failure into [`Error::Driver`].
macro_rules! cu {
    ($driver:expr, $f:ident ( $($a:expr),* $(,)? )) => {
        match $driver.sys().$f() {
            Ok(f) => {
                let code = f($($a),*);
                if code == ::cuda_multimem_sys::CUresult::CUDA_SUCCESS {
                    Ok(())
                } else {
                    Err(Error::Driver { call: stringify!($f), code })
                }
            }
            Err(e) => Err(Error::from(e)),
        }
    };
}

pub(crate) use cu;

/// A raw driver handle owned by this crate's types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Raw<T>(pub(crate) T);
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
        unsafe { device.memset_blocking(p, 0, len) }?;
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
        // SAFETY: destination range inside the allocation (checked).
        unsafe {
            self.device
                .copy_from_host_blocking(self.ptr + offset as u64, bytes)
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
pub(crate) struct Module {
    device: Device,
    raw: Raw<CUmodule>,
}

impl Module {
    pub(crate) fn load(device: &Device, ptx: &str) -> Result<Module> {
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

    pub(crate) fn function(&self, name: &str) -> Result<CUfunction> {
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

/// Memory of every rank, as mapped in this process: rank r's part at `addrs[r]`. In one process
/// each part is one VMM allocation of its device mapped once with access for every device of
/// the team; across processes the local part is exported (POSIX fd or fabric handle), every
/// peer's part imported and mapped with access for the local device.
struct Sym {
    addrs: Vec<CUdeviceptr>,
    _maps: Vec<Mapping>,
}

impl Sym {
    /// `zero`: clear the local parts (pads, low-latency staging and user buffers; the staging of
    /// one-shot and the write-only two-shot is always written before it is read, so it is not).
    fn new(team: &Team, bytes: usize, zero: bool) -> Result<Sym> {
        let mut addrs = vec![0; team.n];
        let mut maps = Vec::new();
        match &team.bootstrap {
            None => {
                let access: Vec<(Location, Access)> = team
                    .locals
                    .iter()
                    .map(|l| (Location::Device(l.device.ordinal()), Access::ReadWrite))
                    .collect();
                for l in &team.locals {
                    let a = PhysicalAllocation::builder(
                        l.device.driver(),
                        Location::Device(l.device.ordinal()),
                    )
                    .create(bytes)?;
                    let m = Mapping::map_whole(&a, &access)?;
                    addrs[l.rank] = m.device_ptr();
                    maps.push(m);
                }
            }
            Some(b) => {
                let l = &team.locals[0];
                let d = l.device.driver();
                let here = [(Location::Device(l.device.ordinal()), Access::ReadWrite)];
                let fds = b.passes_fds();
                let a = PhysicalAllocation::builder(d, Location::Device(l.device.ordinal()))
                    .handle_types(if fds {
                        HandleTypes::POSIX_FD
                    } else {
                        HandleTypes::FABRIC
                    })
                    .create(bytes)?;
                let m = Mapping::map_whole(&a, &here)?;
                addrs[l.rank] = m.device_ptr();
                maps.push(m);
                let sizes = b.all_gather(&(a.size() as u64).to_le_bytes())?;
                let size_of = |r: usize| -> Result<usize> {
                    let v: [u8; 8] = sizes[r].as_slice().try_into().map_err(|_| {
                        Error::invalid("peer", format!("rank {r} sent a malformed size"))
                    })?;
                    Ok(u64::from_le_bytes(v) as usize)
                };
                let imported: Vec<Arc<PhysicalAllocation>> = if fds {
                    let fd = a.export_posix_fd()?;
                    let all = b.all_gather_fds(&[std::os::fd::AsFd::as_fd(&fd)])?;
                    let mut v = Vec::new();
                    for (r, f) in all.iter().enumerate() {
                        if r == l.rank {
                            continue;
                        }
                        let f = f.first().ok_or_else(|| {
                            Error::invalid("peer", format!("rank {r} sent no handle"))
                        })?;
                        v.push(PhysicalAllocation::import_posix_fd(
                            d,
                            std::os::fd::AsFd::as_fd(f),
                            size_of(r)?,
                        )?);
                    }
                    v
                } else {
                    let h = a.export_fabric()?;
                    let all = b.all_gather(h.as_bytes())?;
                    let mut v = Vec::new();
                    for (r, h) in all.iter().enumerate() {
                        if r != l.rank {
                            v.push(PhysicalAllocation::import_fabric(d, h, size_of(r)?)?);
                        }
                    }
                    v
                };
                let peers = (0..team.n).filter(|&r| r != l.rank);
                for (r, p) in peers.zip(imported) {
                    let m = Mapping::map_whole(&p, &here)?;
                    addrs[r] = m.device_ptr();
                    maps.push(m);
                }
            }
        }
        for l in team.locals.iter().filter(|_| zero) {
            l.device.bind()?;
            // SAFETY: the whole local part, just mapped read-write for this device.
            unsafe { l.device.memset_blocking(addrs[l.rank], 0, bytes) }?;
        }
        Ok(Sym { addrs, _maps: maps })
    }

    fn write(&self, device: &Device, rank: usize, offset: usize, bytes: &[u8]) -> Result<()> {
        // SAFETY: callers keep offset + len inside the part (checked by SymmetricBuffer); the
        // copy has reached the device when this returns (kernels on any stream see it).
        unsafe { device.copy_from_host_blocking(self.addrs[rank] + offset as u64, bytes) }
    }

    fn read(&self, device: &Device, rank: usize, offset: usize, out: &mut [u8]) -> Result<()> {
        device.bind()?;
        // SAFETY: as `write`.
        unsafe {
            cu!(
                device.driver(),
                cuMemcpyDtoH_v3020(
                    out.as_mut_ptr() as *mut c_void,
                    self.addrs[rank] + offset as u64,
                    out.len()
                )
            )
        }
    }
}

/// How the communicator chooses and runs an allreduce. Every field can be changed; the
/// defaults follow measurements on 2 x H200 (one-shot for small and medium messages, two-shot
/// above).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllReduceConfig {
    /// Messages up to this many bytes use one-shot (when not forced); `None`: by team size
    /// (8 MiB for 2 ranks, 2 MiB for 3, 512 KiB for more: one-shot moves (N-1) times the
    /// message per rank, two-shot 2(N-1)/N times). A staging slot is at least this large
    /// (see `stage_bytes`).
    pub one_shot_max_bytes: Option<usize>,
    /// Force an algorithm (`None`: choose by size).
    pub algorithm: Option<Algorithm>,
    /// A barrier that waits longer than this sets the team's error word and gives up.
    pub timeout: Duration,
    /// Most threads per block (small messages use fewer).
    pub threads: u32,
    /// Most blocks per launch (at most [`MAX_BLOCKS`]); 0: two per multiprocessor.
    pub max_blocks: u32,
    /// Messages up to this many bytes use the low-latency one-shot (when not forced); also
    /// sizes its staging (2 x N x 2 x this per rank). 0 turns it off.
    pub ll_max_bytes: usize,
    /// Threads per block of the write-only two-shot ([`Algorithm::TwoShotPush`]), which runs
    /// one block per multiprocessor (a power of two of them, unless `max_blocks` says
    /// otherwise): 1024 and 128 blocks on 2 x H200 moved 362 GB/s at 256 MiB where 512 x 256
    /// moved 357 (docs/perf.md).
    pub push_threads: u32,
    /// Messages from `ce_min_bytes` up to this many bytes use the copy-engine two-shot
    /// ([`Algorithm::TwoShotCe`]); it also sizes the landing area, about this many bytes per
    /// rank, which is why it is off (0) by default. On 2 x H200 it moved 362 GB/s at 256 MiB,
    /// 369 at 512 MiB and 373 at 1 GiB where the write-only two-shot moved 360, 363 and 365
    /// (docs/perf.md).
    pub ce_max_bytes: usize,
    /// Smallest message for the copy-engine two-shot (when `ce_max_bytes` allows it): below
    /// 256 MiB it was slower than the write-only two-shot on 2 x H200 (241 against 309 GB/s at
    /// 16 MiB, 352 against 356 at 128 MiB).
    pub ce_min_bytes: usize,
    /// Bytes of one staging slot (there are 2 x N per rank); `None`: the larger of the one-shot
    /// limit and 64 MiB / N. One-shot messages must fit a slot; the write-only two-shot
    /// ([`Algorithm::TwoShotPush`], the default above the one-shot limit) goes through the
    /// slots in rounds of N x this many bytes, so larger slots mean fewer rounds (barriers).
    /// Rounded up to 4 KiB; at least 4 KiB, at most 1 GiB.
    pub stage_bytes: Option<usize>,
}

impl Default for AllReduceConfig {
    fn default() -> Self {
        AllReduceConfig {
            ll_max_bytes: 64 << 10,
            stage_bytes: None,
            push_threads: 1024,
            ce_max_bytes: 0,
            ce_min_bytes: 256 << 20,
            one_shot_max_bytes: None,
            algorithm: None,
            timeout: Duration::from_secs(5),
            threads: 512,
            max_blocks: 0,
        }
    }
}

impl AllReduceConfig {
    fn one_shot_max(&self, n: usize) -> usize {
        self.one_shot_max_bytes.unwrap_or(match n {
            2 => 8 << 20,
            3 => 2 << 20,
            _ => 512 << 10,
        })
    }

    /// Bytes of one staging slot: as configured, else the larger of the one-shot limit and
    /// 64 MiB / N (a push round then covers 64 MiB of the message: 32 MiB slots moved 362 GB/s
    /// at 256 MiB on 2 x H200, 8 MiB slots 357); never smaller than the one-shot limit.
    fn stage_slot_bytes(&self, n: usize) -> usize {
        self.stage_bytes
            .unwrap_or((64 << 20) / n.max(1))
            .max(self.one_shot_max(n))
            .max(4096)
            .next_multiple_of(4096)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        for (t, name) in [
            (self.threads, "config.threads"),
            (self.push_threads, "config.push_threads"),
        ] {
            if !(64..=1024).contains(&t) || t % 32 != 0 {
                return Err(Error::invalid(
                    name,
                    format!("{t}; expected a multiple of 32 from 64 to 1024"),
                ));
            }
        }
        if self.max_blocks as usize > MAX_BLOCKS {
            return Err(Error::invalid(
                "config.max_blocks",
                format!("{}; at most {MAX_BLOCKS}", self.max_blocks),
            ));
        }
        if self.ll_max_bytes > 16 << 20 {
            return Err(Error::invalid(
                "config.ll_max_bytes",
                format!("{}; at most 16 MiB", self.ll_max_bytes),
            ));
        }
        if let Some(b) = self.stage_bytes {
            if !(4096..=1 << 30).contains(&b) {
                return Err(Error::invalid(
                    "config.stage_bytes",
                    format!("{b}; expected 4 KiB to 1 GiB"),
                ));
            }
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid(
                "config.timeout",
                "zero; expected a positive duration",
            ));
        }
        Ok(())
    }

    /// The barrier deadline in nanoseconds, as the kernels take it.
    pub(crate) fn timeout_ns(&self) -> u64 {
        self.timeout.as_nanos().min(u64::MAX as u128) as u64
    }

    /// What every rank must agree on, as bytes.
    fn fingerprint(&self, n: usize, multiprocessors: u32) -> Vec<u8> {
        let mut v = Vec::new();
        for x in [
            self.one_shot_max(n) as u64,
            self.algorithm.map_or(0, |a| a as u64 + 1),
            self.threads as u64,
            self.max_blocks as u64,
            self.ll_max_bytes as u64,
            self.stage_bytes.unwrap_or(0) as u64,
            self.push_threads as u64,
            self.ce_max_bytes as u64,
            self.ce_min_bytes as u64,
            multiprocessors as u64,
        ] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v
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

/// A rank driven by this process.
struct Local {
    rank: usize,
    device: Device,
    functions: Functions,
    _modules: Vec<Module>,
    last_stream: Mutex<Option<Raw<CUstream>>>,
}

/// The team: its size, the ranks this process drives, how it reaches the others.
struct Team {
    n: usize,
    config: AllReduceConfig,
    stage_half: usize,
    multiprocessors: u32,
    locals: Vec<Local>,
    bootstrap: Option<Box<dyn Bootstrap>>,
}

struct TeamMemory {
    team: Team,
    pads: Sym,
    _stages: Sym,
    _ll: Sym,
    /// Landing areas of the copy-engine two-shot: rank r's holds n slots of `land_slot` bytes,
    /// slot s receiving sender s's copy of r's part.
    lands: Sym,
    land_slot: usize,
}

struct Registered {
    table: CUdeviceptr,
    start: CUdeviceptr,
    len: usize,
}

struct Inner {
    team: TeamMemory,
    /// buffer id -> local rank -> its part and table
    buffers: Mutex<HashMap<u64, HashMap<usize, Registered>>>,
    next_buffer: AtomicU64,
    poisoned: AtomicU32,
    /// Collective allocations across processes happen one at a time, in call order.
    alloc_lock: Mutex<()>,
}

impl std::ops::Deref for TeamMemory {
    type Target = Team;
    fn deref(&self) -> &Team {
        &self.team
    }
}

/// An allreduce communicator over a team of devices: all driven by this process
/// ([`Communicator::new`]), or one per process ([`Communicator::with_bootstrap`]).
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
            .field("ranks", &self.inner.team.n)
            .field(
                "local",
                &self
                    .inner
                    .team
                    .locals
                    .iter()
                    .map(|l| l.rank)
                    .collect::<Vec<_>>(),
            )
            .field("config", &self.inner.team.config)
            .finish()
    }
}

/// A device's multiprocessors (at least 1).
pub(crate) fn multiprocessors(d: &Device) -> Result<u32> {
    Ok(d.multiprocessor_count()?.max(1) as u32)
}

/// The fewest multiprocessors of `devices` (launch shapes must be the same on every rank).
pub(crate) fn fewest_multiprocessors(devices: &[Device]) -> Result<u32> {
    Ok(devices
        .iter()
        .map(multiprocessors)
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .min()
        .unwrap_or(1))
}

/// The kernels of one device, by algorithm, type and operator.
type Functions = HashMap<(Kernel, DType, Op), Raw<CUfunction>>;

fn load_kernels(d: &Device) -> Result<(Vec<Module>, Functions)> {
    let mut modules = Vec::new();
    let mut functions = HashMap::new();
    for k in Kernel::ALL {
        let text = k.load_text().map_err(|e| Error::Os {
            call: "read PTX from CUDA_MULTIMEM_PTX_DIR",
            message: e.to_string(),
        })?;
        let m = Module::load(d, &text)?;
        for dt in DType::ALL {
            for op in Op::ALL {
                functions.insert((k, dt, op), Raw(m.function(&k.entry(dt, op))?));
            }
        }
        modules.push(m);
    }
    Ok((modules, functions))
}

fn check_devices(devices: &[Device]) -> Result<()> {
    for (i, d) in devices.iter().enumerate() {
        if devices[..i].contains(d) {
            return Err(Error::invalid(
                "devices",
                format!("device {} appears twice", d.ordinal()),
            ));
        }
        if !d.supports_vmm()? {
            return Err(Error::DeviceUnsupported {
                device: d.ordinal(),
                what: "virtual memory management (symmetric buffers are VMM mappings)",
            });
        }
        for p in &devices[..i] {
            if !d.can_access_peer(p)? {
                return Err(Error::DeviceUnsupported {
                    device: d.ordinal(),
                    what: "peer access to another device of the team",
                });
            }
        }
    }
    Ok(())
}

impl Communicator {
    /// A communicator over `devices` (rank i is `devices[i]`) with the default configuration.
    pub fn new(devices: &[Device]) -> Result<Communicator> {
        Communicator::with_config(devices, AllReduceConfig::default())
    }

    /// A communicator over `devices`, all driven by this process, with `config`.
    pub fn with_config(devices: &[Device], config: AllReduceConfig) -> Result<Communicator> {
        if devices.len() < 2 || devices.len() > MAX_RANKS {
            return Err(Error::invalid(
                "devices",
                format!("{} device(s); a team has 2 to {MAX_RANKS}", devices.len()),
            ));
        }
        config.validate()?;
        check_devices(devices)?;
        let mut locals = Vec::new();
        for (rank, d) in devices.iter().enumerate() {
            locals.push(Local::new(rank, d)?);
        }
        let multiprocessors = fewest_multiprocessors(devices)?;
        Communicator::build(Team {
            n: devices.len(),
            stage_half: config.stage_slot_bytes(devices.len()),
            config,
            multiprocessors,
            locals,
            bootstrap: None,
        })
    }

    /// One rank of a team that spans processes (one device per process): `device` is this
    /// process's device, `bootstrap` says which rank it is and carries the exchanges (POSIX
    /// file descriptors where it can, else fabric handles as bytes). Every rank calls this, and
    /// later [`Communicator::alloc`], in the same order; a rank that does not arrive makes the
    /// others fail with the bootstrap's timeout. Every rank must pass the same `config`.
    pub fn with_bootstrap(
        device: &Device,
        bootstrap: Box<dyn Bootstrap>,
        config: AllReduceConfig,
    ) -> Result<Communicator> {
        let (rank, n) = (bootstrap.rank(), bootstrap.size());
        if !(2..=MAX_RANKS).contains(&n) || rank >= n {
            return Err(Error::invalid(
                "bootstrap",
                format!("rank {rank} of {n}; a team has 2 to {MAX_RANKS} ranks"),
            ));
        }
        config.validate()?;
        check_devices(std::slice::from_ref(device))?;
        let mine = multiprocessors(device)?;
        let all = bootstrap.all_gather(&mine.to_le_bytes())?;
        let mut multiprocessors = mine;
        for (r, b) in all.iter().enumerate() {
            let v: [u8; 4] = b.as_slice().try_into().map_err(|_| {
                Error::invalid(
                    "peer",
                    format!("rank {r} sent a malformed multiprocessor count"),
                )
            })?;
            multiprocessors = multiprocessors.min(u32::from_le_bytes(v));
        }
        let fp = config.fingerprint(n, multiprocessors);
        let all = bootstrap.all_gather(&fp)?;
        if let Some(r) = all.iter().position(|x| *x != fp) {
            return Err(Error::invalid(
                "config",
                format!("rank {r} uses another allreduce configuration than rank {rank}; every rank must pass the same"),
            ));
        }
        let locals = vec![Local::new(rank, device)?];
        Communicator::build(Team {
            n,
            stage_half: config.stage_slot_bytes(n),
            config,
            multiprocessors,
            locals,
            bootstrap: Some(bootstrap),
        })
    }

    fn build(team: Team) -> Result<Communicator> {
        let pads = Sym::new(&team, PAD_BYTES, true)?;
        let stages = Sym::new(&team, 2 * team.n * team.stage_half, false)?;
        let ll_slot = (2 * team.config.ll_max_bytes)
            .max(4096)
            .next_multiple_of(4096);
        let ll = Sym::new(&team, 2 * team.n * ll_slot, true)?;
        let land_slot = team
            .config
            .ce_max_bytes
            .div_ceil(team.n)
            .max(4096)
            .next_multiple_of(4096);
        let lands = Sym::new(&team, team.n * land_slot, false)?;
        // Each local rank's pad: its rank, the team size, the staging half, every rank's pad
        // and staging area as mapped in this process.
        for l in &team.locals {
            let mut hdr = vec![0u8; 256];
            hdr[kernels::OFF_RANK..kernels::OFF_RANK + 4]
                .copy_from_slice(&(l.rank as u32).to_le_bytes());
            hdr[kernels::OFF_NRANKS..kernels::OFF_NRANKS + 4]
                .copy_from_slice(&(team.n as u32).to_le_bytes());
            hdr[kernels::OFF_STAGE_HALF..kernels::OFF_STAGE_HALF + 8]
                .copy_from_slice(&(team.stage_half as u64).to_le_bytes());
            hdr[kernels::OFF_LL_SLOT..kernels::OFF_LL_SLOT + 8]
                .copy_from_slice(&(ll_slot as u64).to_le_bytes());
            hdr[kernels::OFF_LAND_SLOT..kernels::OFF_LAND_SLOT + 8]
                .copy_from_slice(&(land_slot as u64).to_le_bytes());
            hdr[kernels::OFF_LAND..kernels::OFF_LAND + 8]
                .copy_from_slice(&lands.addrs[l.rank].to_le_bytes());
            for j in 0..team.n {
                let o = kernels::OFF_PADS + 8 * j;
                hdr[o..o + 8].copy_from_slice(&pads.addrs[j].to_le_bytes());
                let o = kernels::OFF_STAGES + 8 * j;
                hdr[o..o + 8].copy_from_slice(&stages.addrs[j].to_le_bytes());
                let o = kernels::OFF_LL_STAGES + 8 * j;
                hdr[o..o + 8].copy_from_slice(&ll.addrs[j].to_le_bytes());
            }
            pads.write(&l.device, l.rank, 0, &hdr)?;
        }
        // Every rank's pad must be initialised before any kernel signals into it.
        if let Some(b) = &team.bootstrap {
            b.all_gather(b"pads ready")?;
        }
        Ok(Communicator {
            inner: Arc::new(Inner {
                team: TeamMemory {
                    team,
                    pads,
                    _stages: stages,
                    _ll: ll,
                    lands,
                    land_slot,
                },
                buffers: Mutex::new(HashMap::new()),
                next_buffer: AtomicU64::new(1),
                poisoned: AtomicU32::new(0),
                alloc_lock: Mutex::new(()),
            }),
        })
    }

    /// Team size.
    pub fn size(&self) -> usize {
        self.inner.team.n
    }

    /// The ranks this process drives.
    pub fn local_ranks(&self) -> Vec<usize> {
        self.inner.team.locals.iter().map(|l| l.rank).collect()
    }

    /// The device of `rank`, if this process drives it.
    pub fn device(&self, rank: usize) -> Option<&Device> {
        self.inner
            .team
            .locals
            .iter()
            .find(|l| l.rank == rank)
            .map(|l| &l.device)
    }

    /// The configuration.
    pub fn config(&self) -> &AllReduceConfig {
        &self.inner.team.config
    }

    /// A symmetric buffer of `bytes` bytes on every rank, zeroed, each rank's part mapped on
    /// every peer. Allreduce operands live in such buffers. Across processes this is a
    /// collective call: every rank makes it, with the same size, in the same order.
    pub fn alloc(&self, bytes: usize) -> Result<SymmetricBuffer> {
        if bytes == 0 {
            return Err(Error::invalid("bytes", "0; expected at least one byte"));
        }
        let _g = self.inner.alloc_lock.lock();
        let team = &self.inner.team;
        if let Some(b) = &team.bootstrap {
            let mine = (bytes as u64).to_le_bytes();
            let all = b.all_gather(&mine)?;
            if let Some(r) = all.iter().position(|x| x.as_slice() != mine) {
                return Err(Error::invalid(
                    "bytes",
                    format!("rank {r} allocates another size than {bytes}; a symmetric buffer has one size"),
                ));
            }
        }
        let sym = Sym::new(team, bytes, true)?;
        let mut table = Vec::with_capacity(8 * MAX_RANKS);
        for a in &sym.addrs {
            table.extend_from_slice(&a.to_le_bytes());
        }
        let tables = team
            .locals
            .iter()
            .map(|l| {
                let t = DevMem::new(&l.device, 8 * MAX_RANKS)?;
                t.write(0, &table)?;
                Ok((l.rank, t))
            })
            .collect::<Result<Vec<_>>>()?;
        let id = self.inner.next_buffer.fetch_add(1, Ordering::Relaxed);
        self.inner.buffers.lock().insert(
            id,
            tables
                .iter()
                .map(|(r, t)| {
                    (
                        *r,
                        Registered {
                            table: t.ptr,
                            start: sym.addrs[*r],
                            len: bytes,
                        },
                    )
                })
                .collect(),
        );
        Ok(SymmetricBuffer {
            comm: self.clone(),
            id,
            bytes,
            sym,
            _tables: tables.into_iter().map(|(_, t)| t).collect(),
        })
    }

    /// What an allreduce of `count` elements of `dtype` runs (path, algorithm, launch shape).
    pub fn choice(&self, count: usize, dtype: DType) -> Choice {
        self.choice_with(count, dtype, self.inner.team.config.algorithm)
    }

    fn choice_with(&self, count: usize, dtype: DType, forced: Option<Algorithm>) -> Choice {
        let team = &self.inner.team;
        let c = &team.config;
        let bytes = count * dtype.size();
        let algorithm = forced.unwrap_or(if bytes <= c.ll_max_bytes {
            Algorithm::OneShotLl
        } else if bytes <= c.one_shot_max(team.n) {
            Algorithm::OneShot
        } else if bytes <= c.ce_max_bytes && bytes >= c.ce_min_bytes {
            Algorithm::TwoShotCe
        } else {
            Algorithm::TwoShotPush
        });
        let push = matches!(algorithm, Algorithm::TwoShotPush | Algorithm::TwoShotCe);
        let max_blocks = if c.max_blocks != 0 {
            c.max_blocks
        } else if push {
            // one block per multiprocessor, a power of two of them: block ranges of
            // power-of-two messages stay whole lines and the rounds even
            1 << (team.multiprocessors.clamp(1, MAX_BLOCKS as u32).ilog2())
        } else {
            (2 * team.multiprocessors).min(MAX_BLOCKS as u32)
        } as u64;
        let max_threads = if push { c.push_threads } else { c.threads } as u64;
        let units = bytes.div_ceil(16) as u64;
        let per_rank = match algorithm {
            Algorithm::OneShot => units,
            Algorithm::OneShotLl => bytes.div_ceil(4) as u64,
            Algorithm::TwoShot | Algorithm::TwoShotPush | Algorithm::TwoShotCe => {
                units.div_ceil(team.n as u64)
            }
        };
        let mut blocks = per_rank.div_ceil(max_threads).clamp(1, max_blocks);
        if algorithm == Algorithm::TwoShotPush {
            // every block owns at least 8 vectors (128 bytes) of each staging slot
            blocks = blocks.min(team.stage_half as u64 / 128).max(1);
        }
        // Small messages: fewer threads (cheaper block barriers), at least 64.
        let threads = per_rank
            .div_ceil(blocks)
            .next_multiple_of(32)
            .clamp(64, max_threads);
        Choice {
            path: Path::PeerToPeer,
            algorithm,
            blocks: blocks as u32,
            threads: threads as u32,
        }
    }

    /// Allreduce `count` elements of `dtype` with `op`: rank `rank`'s share of the collective
    /// (a rank this process drives), queued on `stream` (a stream of that rank's device). Reads
    /// `input` from element `in_offset`, writes `output` from element `out_offset` (the same
    /// buffer and offsets: in place). Every rank must make the same call (count, type, op,
    /// offsets), in the same order; a disagreement is detected by the kernels and reported by
    /// [`Communicator::check`].
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
        let l = self.local(rank)?;
        if stream.device() != &l.device {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a stream of device {}; rank {rank} is device {}",
                    stream.device().ordinal(),
                    l.device.ordinal()
                ),
            ));
        }
        let es = dtype.size();
        let (in_ptr, out_ptr) = self.operands(rank, input, in_offset, output, out_offset, dtype)?;
        // SAFETY: the stream is a live stream of the rank's device (a borrowed `Stream`); the
        // pointers are checked against the team's buffers by `all_reduce_raw`.
        unsafe { self.all_reduce_raw(rank, in_ptr, out_ptr, count * es, dtype, op, stream.raw()) }
    }

    /// [`Communicator::all_reduce`] on a stream of the `cudarc` crate (feature `cudarc`): the
    /// same call, queued on `stream`, which must belong to rank `rank`'s device. Both libraries
    /// must drive the same (real) CUDA driver; cudarc cannot talk to the simulator.
    ///
    /// ```no_run
    /// # fn f(comm: &cuda_multimem_collectives::Communicator,
    /// #      buf: &cuda_multimem_collectives::SymmetricBuffer) -> Result<(), Box<dyn std::error::Error>> {
    /// use cuda_multimem_collectives::{DType, Op};
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let stream = ctx.new_stream()?;
    /// comm.all_reduce_on_cudarc_stream(0, buf, 0, buf, 0, 1024, DType::Bf16, Op::Sum, &stream)?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "cudarc")]
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_on_cudarc_stream(
        &self,
        rank: usize,
        input: &SymmetricBuffer,
        in_offset: usize,
        output: &SymmetricBuffer,
        out_offset: usize,
        count: usize,
        dtype: DType,
        op: Op,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<Choice> {
        let l = self.local(rank)?;
        let ordinal = stream.context().ordinal();
        if ordinal as i32 != l.device.ordinal() {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a cudarc stream of device {ordinal}; rank {rank} is device {}",
                    l.device.ordinal()
                ),
            ));
        }
        let (i, o) = self.operands(rank, input, in_offset, output, out_offset, dtype)?;
        // SAFETY: a live cudarc stream (borrowed) of the rank's device, in the same process and
        // driver; cudarc's CUstream is the driver's opaque stream pointer like ours.
        unsafe {
            self.all_reduce_raw(
                rank,
                i,
                o,
                count * dtype.size(),
                dtype,
                op,
                stream.cu_stream() as CUstream,
            )
        }
    }

    fn operands(
        &self,
        rank: usize,
        input: &SymmetricBuffer,
        in_offset: usize,
        output: &SymmetricBuffer,
        out_offset: usize,
        dtype: DType,
    ) -> Result<(CUdeviceptr, CUdeviceptr)> {
        for (b, name) in [(input, "input"), (output, "output")] {
            if !Arc::ptr_eq(&b.comm.inner, &self.inner) {
                return Err(Error::invalid(
                    if name == "input" { "input" } else { "output" },
                    "a buffer of another communicator",
                ));
            }
        }
        self.local(rank)?;
        let es = dtype.size();
        Ok((
            input.sym.addrs[rank] + (in_offset * es) as u64,
            output.sym.addrs[rank] + (out_offset * es) as u64,
        ))
    }

    fn local(&self, rank: usize) -> Result<&Local> {
        self.inner
            .team
            .locals
            .iter()
            .find(|l| l.rank == rank)
            .ok_or_else(|| {
                Error::invalid(
                    "rank",
                    format!(
                        "{rank}; this process drives rank(s) {:?} of a team of {}",
                        self.local_ranks(),
                        self.inner.team.n
                    ),
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
            let Some(r) = parts.get(&rank) else { continue };
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
        let r = self.local(rank)?;
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
        let mut choice = self.choice(count, dtype);
        if count == 0 {
            return Ok(choice);
        }
        if choice.algorithm == Algorithm::OneShotLl
            && (input % 4 != 0
                || output % 4 != 0
                || bytes % 4 != 0
                || bytes > self.inner.team.config.ll_max_bytes)
        {
            // The low-latency protocol moves whole aligned 4-byte words: run one-shot instead.
            let fallback = if bytes <= self.inner.team.stage_half {
                Algorithm::OneShot
            } else {
                Algorithm::TwoShot
            };
            choice = self.choice_with(count, dtype, Some(fallback));
        }
        if matches!(
            choice.algorithm,
            Algorithm::TwoShotPush | Algorithm::TwoShotCe
        ) && (input % 16 != 0 || output % 16 != 0)
        {
            // The write-only two-shot moves 16-byte vectors only: run the reading two-shot.
            choice = self.choice_with(count, dtype, Some(Algorithm::TwoShot));
        }
        let ce_part =
            kernels::ce_part_units((bytes / 16) as u64, self.inner.team.n as u64) as usize;
        if choice.algorithm == Algorithm::TwoShotCe && ce_part * 16 > self.inner.team.land_slot {
            return Err(Error::invalid(
                "bytes",
                format!(
                    "{bytes} bytes with the copy-engine two-shot; its landing slots hold {} bytes of a {}-byte part (raise ce_max_bytes)",
                    self.inner.team.land_slot,
                    ce_part * 16
                ),
            ));
        }
        if choice.algorithm == Algorithm::OneShot && bytes > self.inner.team.stage_half {
            return Err(Error::invalid(
                "bytes",
                format!(
                    "{bytes} bytes with one-shot forced; its staging holds {} bytes (raise one_shot_max_bytes)",
                    self.inner.team.stage_half
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
            Algorithm::OneShotLl => Kernel::P2pOneShotLl,
            Algorithm::TwoShot => Kernel::P2pTwoShot,
            Algorithm::TwoShotPush => Kernel::P2pTwoShotPush,
            Algorithm::TwoShotCe => Kernel::P2pTwoShotCe,
        };
        let f = r.functions[&(kernel, dtype, op)].0;
        if kernel == Kernel::P2pTwoShotCe {
            // The first half of the two-shot, by the copy engines, on the caller's stream:
            // part k of my input into rank k's landing slot for me. The kernel queued next
            // starts only once they are complete, so its release covers them.
            let team = &self.inner.team;
            let units = bytes / 16;
            r.device.bind()?;
            for k in (0..team.n).filter(|&k| k != rank) {
                let s = (k * ce_part).min(units);
                let e = (s + ce_part).min(units);
                if e > s {
                    let dst = team.lands.addrs[k] + (rank * team.land_slot) as u64;
                    // SAFETY: the source lies in the caller's registered input (checked above),
                    // the destination in rank k's landing area as mapped for this device; the
                    // caller promises the stream.
                    unsafe {
                        cu!(
                            r.device.driver(),
                            cuMemcpyDtoDAsync_v3020(
                                dst,
                                input + (s * 16) as u64,
                                (e - s) * 16,
                                stream
                            )
                        )
                    }?;
                }
            }
        }
        // The call header every rank compares: what, how much, where.
        let sig = kernels::call_header(&[
            count as u64,
            dtype.code(),
            op.code(),
            kernel as u64,
            in_off,
            out_off,
            choice.blocks as u64,
        ]);
        // SAFETY: a function of this device's module whose entry takes these eight .u64
        // parameters (ctx, in, out, count, in_tab, out_tab, header, timeout); the caller
        // promises the stream.
        unsafe {
            kernels::launch(
                &r.device,
                f,
                choice.blocks,
                choice.threads,
                stream,
                &[
                    self.inner.team.pads.addrs[rank],
                    input,
                    output,
                    count as u64,
                    in_tab,
                    out_tab,
                    sig,
                    self.inner.team.config.timeout_ns(),
                ],
            )
        }?;
        Ok(choice)
    }

    /// Report a timeout or a disagreement between ranks seen by earlier calls of the ranks this
    /// process drives. Call it after synchronising their streams. After an error, the team
    /// refuses further calls.
    pub fn check(&self) -> Result<()> {
        let mut worst = 0;
        for l in &self.inner.team.locals {
            let mut w = [0u8; 4];
            self.inner
                .team
                .pads
                .read(&l.device, l.rank, kernels::OFF_ERR, &mut w)?;
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

impl Local {
    fn new(rank: usize, device: &Device) -> Result<Local> {
        let (modules, functions) = load_kernels(device)?;
        Ok(Local {
            rank,
            device: device.clone(),
            functions,
            _modules: modules,
            last_stream: Mutex::new(None),
        })
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

/// One part per rank, of the same size, each mapped on every peer: allreduce operands.
pub struct SymmetricBuffer {
    comm: Communicator,
    id: u64,
    bytes: usize,
    sym: Sym,
    _tables: Vec<DevMem>,
}

impl std::fmt::Debug for SymmetricBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SymmetricBuffer({} bytes x {} ranks)",
            self.bytes,
            self.sym.addrs.len()
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

    /// Rank `rank`'s part as a raw device pointer in this process (valid while the buffer
    /// lives; peers' parts are reachable from this process's devices).
    pub fn ptr(&self, rank: usize) -> Option<CUdeviceptr> {
        self.sym.addrs.get(rank).copied()
    }

    fn via(&self, rank: usize, len: usize) -> Result<&Device> {
        if rank >= self.sym.addrs.len() {
            return Err(Error::invalid(
                "rank",
                format!("{rank}; the team has {} ranks", self.sym.addrs.len()),
            ));
        }
        if len > self.bytes {
            return Err(Error::invalid(
                "data",
                format!("{len} bytes; the buffer has {} per rank", self.bytes),
            ));
        }
        let locals = &self.comm.inner.team.locals;
        Ok(&locals
            .iter()
            .find(|l| l.rank == rank)
            .unwrap_or(&locals[0])
            .device)
    }

    /// Copy `data` into rank `rank`'s part at offset 0 (synchronous).
    pub fn copy_from_host(&self, rank: usize, data: &[u8]) -> Result<()> {
        let d = self.via(rank, data.len())?;
        self.sym.write(d, rank, 0, data)
    }

    /// Copy rank `rank`'s part from offset 0 into `out` (synchronous; synchronise the rank's
    /// stream first).
    pub fn copy_to_host(&self, rank: usize, out: &mut [u8]) -> Result<()> {
        let d = self.via(rank, out.len())?;
        self.sym.read(d, rank, 0, out)
    }
}

impl Drop for SymmetricBuffer {
    fn drop(&mut self) {
        self.comm.inner.buffers.lock().remove(&self.id);
    }
}
