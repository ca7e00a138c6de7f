//! Modules and kernel launches. A module is PTX text (`cuModuleLoadData`); its `.entry`
//! declarations name the kernels and give their parameter layout, and the directives after
//! them (`.maxntid`, `.reqntid`, `.reqnctapercluster`) their block limit and cluster shape. A
//! kernel runs on the simulator when a host-side equivalent is registered under the same name
//! ([`register_kernel`], or [`register_kernel_with`] and the registers and static shared memory
//! a compiler would report for it; a launch without one fails with `CUDA_ERROR_NOT_FOUND` and
//! says so on stderr, naming the entry: see [`missing_kernel_message`]): a launch copies the
//! parameters (as the driver does), queues the equivalent on the stream's worker thread and
//! runs it there with the grid and block dimensions once its blocks are resident
//! (`residency.rs`), so kernels of different devices run concurrently and captured graphs
//! replay them. The occupancy queries answer from the same numbers (`occupancy.rs`).

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::Arc;

use cuda_multimem_sys::*;
use parking_lot::{Mutex, RwLock};

use super::delay::delay;
use super::memory::Memory;
use super::occupancy::{self, BlockNeeds};
use super::{residency, stream};
use crate::config::ConfigError;
use crate::state::{is_kind, new_handle, Kind, SimResult, State};

/// Why a simulated kernel failed; the launch's stream reports it as the driver would (the next
/// synchronisation returns the status).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// The kernel touched memory that is not (accessible) device memory:
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`.
    #[error("illegal address {addr:#x} (+{len} bytes)")]
    IllegalAddress {
        /// The first address of the access.
        addr: usize,
        /// Its length.
        len: usize,
    },
    /// A parameter is missing or has the wrong size: `CUDA_ERROR_INVALID_VALUE`.
    #[error("kernel parameter {index}: {what}")]
    Parameter {
        /// The parameter's position.
        index: usize,
        /// What was wrong.
        what: String,
    },
    /// Any other failure of the kernel: `CUDA_ERROR_LAUNCH_FAILED`.
    #[error("launch failed: {0}")]
    Failed(String),
}

impl KernelError {
    pub(crate) fn code(&self) -> CUresult {
        match self {
            KernelError::IllegalAddress { .. } => CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
            KernelError::Parameter { .. } => CUresult::CUDA_ERROR_INVALID_VALUE,
            KernelError::Failed(_) => CUresult::CUDA_ERROR_LAUNCH_FAILED,
        }
    }
}

/// A host-side kernel equivalent.
pub type KernelFn = Arc<dyn Fn(&LaunchArgs) -> Result<(), KernelError> + Send + Sync>;

/// What a kernel needs of a multiprocessor, as a compiler reports it (`ptxas -v`), for the
/// simulator's occupancy model: `cuFuncGetAttribute` answers with these, and
/// `cuOccupancyMaxActiveBlocksPerMultiprocessor`, `cuOccupancyMaxActiveClusters` and the
/// co-residency of launches count with them (see `docs/simulator.md`). The default, which
/// [`register_kernel`] uses, is 32 registers per thread, no static shared memory and 1024
/// threads per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelAttrs {
    /// Registers per thread (`CU_FUNC_ATTRIBUTE_NUM_REGS`), 1 to 255.
    pub regs_per_thread: u32,
    /// Static shared memory per block in bytes (`CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES`), at most
    /// 48 KiB; a launch's dynamic shared memory comes on top.
    pub static_smem_bytes: u32,
    /// The most threads a block may have (`CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK`), 1 to 1024;
    /// a `.maxntid` or `.reqntid` of the PTX entry lowers it further.
    pub max_threads_per_block: u32,
}

impl Default for KernelAttrs {
    fn default() -> Self {
        KernelAttrs {
            regs_per_thread: 32,
            static_smem_bytes: 0,
            max_threads_per_block: occupancy::BLOCK_THREADS,
        }
    }
}

impl KernelAttrs {
    /// Check the attributes against what a compute capability 9.0 compiler can produce.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, value: u32, expected| {
            Err(ConfigError::InvalidValue {
                key: format!("KernelAttrs::{key}"),
                value: value.to_string(),
                expected,
            })
        };
        if !(1..=occupancy::THREAD_REGISTERS).contains(&self.regs_per_thread) {
            return bad(
                "regs_per_thread",
                self.regs_per_thread,
                "1 to 255 registers per thread",
            );
        }
        if self.static_smem_bytes > occupancy::STATIC_SHARED_BYTES {
            return bad(
                "static_smem_bytes",
                self.static_smem_bytes,
                "at most 49152 bytes (48 KiB) of static shared memory",
            );
        }
        if !(1..=occupancy::BLOCK_THREADS).contains(&self.max_threads_per_block) {
            return bad(
                "max_threads_per_block",
                self.max_threads_per_block,
                "1 to 1024 threads per block",
            );
        }
        Ok(())
    }
}

struct Registered {
    f: KernelFn,
    attrs: KernelAttrs,
}

static KERNELS: RwLock<Option<HashMap<String, Registered>>> = RwLock::new(None);

/// Register (or replace) the host-side equivalent of the PTX kernel `name`, process-wide, with
/// the default [`KernelAttrs`]. A module's `.entry name` can be launched on the simulator only
/// once one is registered.
pub fn register_kernel(
    name: &str,
    f: impl Fn(&LaunchArgs) -> Result<(), KernelError> + Send + Sync + 'static,
) {
    insert(name, KernelAttrs::default(), Arc::new(f));
}

/// [`register_kernel`] with the registers per thread, static shared memory and block limit a
/// compiler reports for the kernel, which the occupancy queries and the co-residency of
/// launches use; refused (nothing registered) when `attrs` is out of range.
///
/// ```
/// use cuda_multimem_sim::{register_kernel_with, KernelAttrs};
/// let attrs = KernelAttrs { regs_per_thread: 64, ..KernelAttrs::default() };
/// register_kernel_with("my_doc_kernel", attrs, |_| Ok(()))?;
/// # Ok::<(), cuda_multimem_sim::ConfigError>(())
/// ```
pub fn register_kernel_with(
    name: &str,
    attrs: KernelAttrs,
    f: impl Fn(&LaunchArgs) -> Result<(), KernelError> + Send + Sync + 'static,
) -> Result<(), ConfigError> {
    attrs.validate()?;
    insert(name, attrs, Arc::new(f));
    Ok(())
}

fn insert(name: &str, attrs: KernelAttrs, f: KernelFn) {
    KERNELS
        .write()
        .get_or_insert_with(HashMap::new)
        .insert(name.to_string(), Registered { f, attrs });
}

/// Whether a host-side equivalent of `name` is registered.
pub fn kernel_registered(name: &str) -> bool {
    KERNELS
        .read()
        .as_ref()
        .is_some_and(|m| m.contains_key(name))
}

fn registered(name: &str) -> Option<KernelFn> {
    KERNELS.read().as_ref()?.get(name).map(|r| r.f.clone())
}

/// The attributes registered for `name` (the default when none is registered yet).
fn registered_attrs(name: &str) -> KernelAttrs {
    KERNELS
        .read()
        .as_ref()
        .and_then(|m| m.get(name).map(|r| r.attrs))
        .unwrap_or_default()
}

/// What a launch of an entry without a registered equivalent says (on stderr, once per entry:
/// a launch status cannot carry text) before it fails with `CUDA_ERROR_NOT_FOUND`.
pub fn missing_kernel_message(name: &str) -> String {
    format!(
        "cuda-multimem-sim: cannot launch `{name}`: no host-side equivalent of this PTX entry is registered with the simulator. Register one with cuda_multimem_sim::register_kernel before launching; for the kernels of cuda-multimem-collectives call cuda_multimem_collectives::sim::install() (feature `sim`)"
    )
}

/// The equivalent registered for `name`, or the launch's failure, said once per entry.
pub(crate) fn registered_for_launch(name: &str) -> SimResult<KernelFn> {
    if let Some(k) = registered(name) {
        return Ok(k);
    }
    static SAID: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut said = SAID.lock();
    if !said.iter().any(|n| n == name) {
        said.push(name.to_string());
        eprintln!("{}", missing_kernel_message(name));
    }
    Err(CUresult::CUDA_ERROR_NOT_FOUND)
}

/// One launch as a host-side equivalent sees it.
pub struct LaunchArgs {
    /// The kernel's name.
    pub name: String,
    /// The device the kernel runs on.
    pub device: i32,
    /// Grid dimensions (blocks).
    pub grid: (u32, u32, u32),
    /// Block dimensions (threads).
    pub block: (u32, u32, u32),
    /// Dynamic shared memory in bytes.
    pub shared_mem: u32,
    params: Vec<Vec<u8>>,
    state: Arc<State>,
}

impl std::fmt::Debug for LaunchArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchArgs")
            .field("name", &self.name)
            .field("device", &self.device)
            .field("grid", &self.grid)
            .field("block", &self.block)
            .finish()
    }
}

impl LaunchArgs {
    /// Number of parameters.
    pub fn param_count(&self) -> usize {
        self.params.len()
    }

    /// The raw bytes of parameter `i`.
    pub fn param(&self, i: usize) -> Result<&[u8], KernelError> {
        self.params
            .get(i)
            .map(|v| v.as_slice())
            .ok_or_else(|| KernelError::Parameter {
                index: i,
                what: format!("the kernel has {} parameters", self.params.len()),
            })
    }

    fn fixed<const N: usize>(&self, i: usize) -> Result<[u8; N], KernelError> {
        let p = self.param(i)?;
        p.try_into().map_err(|_| KernelError::Parameter {
            index: i,
            what: format!("{} bytes, read as {N}", p.len()),
        })
    }

    /// Parameter `i` as a `u64` (also device pointers).
    pub fn u64(&self, i: usize) -> Result<u64, KernelError> {
        Ok(u64::from_le_bytes(self.fixed::<8>(i)?))
    }

    /// Parameter `i` as a `u32`.
    pub fn u32(&self, i: usize) -> Result<u32, KernelError> {
        Ok(u32::from_le_bytes(self.fixed::<4>(i)?))
    }

    /// Check that `[addr, addr+len)` is device memory the kernel may read (or write).
    pub fn check(&self, addr: usize, len: usize, write: bool) -> Result<(), KernelError> {
        if len == 0 {
            return Ok(());
        }
        self.state
            .ext::<Memory>()
            .check(addr, len, write)
            .map(|_| ())
            .map_err(|_| KernelError::IllegalAddress { addr, len })
    }

    /// For an address inside a multicast mapping: the addresses of the same bytes in every bound
    /// device's memory (what `multimem` instructions read and write). `None` for ordinary memory.
    pub fn multicast_targets(
        &self,
        addr: usize,
        len: usize,
    ) -> Result<Option<Vec<usize>>, KernelError> {
        let pieces = self
            .state
            .ext::<Memory>()
            .check(addr, len, false)
            .map_err(|_| KernelError::IllegalAddress { addr, len })?;
        match pieces.as_slice() {
            [(_, n, Some((offset, r)))] if *n == len => r
                .targets(*offset, len)
                .map(Some)
                .map_err(|_| KernelError::IllegalAddress { addr, len }),
            [(_, _, None)] => Ok(None),
            _ => Err(KernelError::IllegalAddress { addr, len }),
        }
    }

    /// Sleep a random time if the session injects delays ([`crate::Simulator::set_kernel_delays`]);
    /// host equivalents call this between protocol steps so that devices drift apart.
    pub fn jitter(&self) {
        delay(&self.state);
    }
}

/// A parsed `.entry`: its parameter sizes and the performance directives that matter here.
#[derive(Debug, Clone, Default)]
struct Entry {
    params: Vec<usize>,
    /// Threads per block at most, by `.maxntid` / `.reqntid` (their product).
    max_threads: Option<u32>,
    /// The cluster shape `.reqnctapercluster` requires.
    cluster: Option<(u32, u32, u32)>,
}

struct Module {
    device: i32,
    entries: HashMap<String, Entry>,
}

/// A kernel of a loaded module (`cuModuleGetFunction`).
pub(crate) struct Function {
    module: u64,
    /// The device of the module's context.
    pub device: i32,
    /// The `.entry` name.
    pub name: String,
    entry: Entry,
    attrs: Mutex<HashMap<i32, c_int>>,
}

impl Function {
    /// The sizes of its parameters, in order.
    pub fn param_sizes(&self) -> &[usize] {
        &self.entry.params
    }
}

#[derive(Default)]
pub(crate) struct Kernels {
    modules: Mutex<HashMap<u64, Module>>,
    functions: Mutex<HashMap<u64, Arc<Function>>>,
}

fn type_size(t: &str) -> Option<usize> {
    Some(match t {
        ".u64" | ".s64" | ".b64" | ".f64" => 8,
        ".u32" | ".s32" | ".b32" | ".f32" => 4,
        ".u16" | ".s16" | ".b16" | ".f16" => 2,
        ".u8" | ".s8" | ".b8" => 1,
        _ => return None,
    })
}

/// One parameter declaration (`.param .u64 name`, `.param .align 8 .b8 name[24]`,
/// `.param .u64 .ptr.global.align 16 name`): its size in bytes.
fn param_size(decl: &str) -> Option<usize> {
    let words: Vec<&str> = decl.split_whitespace().collect();
    if words.first() != Some(&".param") {
        return None;
    }
    let size = words.iter().find_map(|w| type_size(w))?;
    let name = words.last()?;
    let count = match (name.find('['), name.find(']')) {
        (Some(a), Some(b)) if b > a + 1 => name[a + 1..b].trim().parse::<usize>().ok()?,
        (None, None) => 1,
        _ => return None,
    };
    Some(size * count)
}

/// The dimensions of directive `name` (`.maxntid 256, 1, 1`; missing ones are 1) among the
/// directives `text` between an entry's parameter list and its body; `None` when absent or
/// malformed (then the simulator ignores it, as it ignores the directives it does not model).
fn directive(text: &str, name: &str) -> Option<(u32, u32, u32)> {
    let at = text
        .match_indices(name)
        .map(|(i, _)| i + name.len())
        .find(|&e| text[e..].starts_with(char::is_whitespace))?;
    let rest = &text[at..];
    let end = rest.find('.').unwrap_or(rest.len());
    let mut d = rest[..end].split(',').map(|v| v.trim().parse::<u32>().ok());
    let x = d.next()??;
    let y = d.next().unwrap_or(Some(1))?;
    let z = d.next().unwrap_or(Some(1))?;
    (d.next().is_none() && x > 0 && y > 0 && z > 0).then_some((x, y, z))
}

/// The `.entry` declarations of PTX text: name and parameter sizes. `None` if the text is not PTX
/// or a declaration is malformed.
fn parse_ptx(text: &str) -> Option<HashMap<String, Entry>> {
    if !text.contains(".version") || !text.contains(".target") {
        return None;
    }
    let mut entries = HashMap::new();
    let mut rest = text;
    while let Some(i) = rest.find(".entry") {
        let after = &rest[i + ".entry".len()..];
        if !after.starts_with(char::is_whitespace) {
            rest = after;
            continue;
        }
        let open = after.find('(')?;
        let name = after[..open].trim();
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_alphanumeric() || "_$.".contains(c))
        {
            return None;
        }
        let close = open + after[open..].find(')')?;
        let list = after[open + 1..close].trim();
        let params = if list.is_empty() {
            Vec::new()
        } else {
            list.split(',')
                .map(param_size)
                .collect::<Option<Vec<_>>>()?
        };
        let body = after[close..]
            .find(['{', ';'])
            .map_or(&after[close + 1..], |e| &after[close + 1..close + e]);
        let dims = |d: &str| directive(body, d);
        let max_threads = [dims(".maxntid"), dims(".reqntid")]
            .into_iter()
            .flatten()
            .map(|(x, y, z)| x.saturating_mul(y).saturating_mul(z))
            .min();
        entries.insert(
            name.to_string(),
            Entry {
                params,
                max_threads,
                cluster: dims(".reqnctapercluster"),
            },
        );
        rest = &after[close..];
    }
    Some(entries)
}

pub(crate) fn function(st: &State, f: CUfunction) -> SimResult<Arc<Function>> {
    let h = f as u64;
    if !is_kind(h, Kind::Function) {
        return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    st.ext::<Kernels>()
        .functions
        .lock()
        .get(&h)
        .cloned()
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
}

/// Load PTX `text` as a module of device `dev`; the module's handle.
pub(crate) fn load_ptx(st: &State, dev: i32, text: &str) -> SimResult<u64> {
    let entries = parse_ptx(text).ok_or(CUresult::CUDA_ERROR_INVALID_PTX)?;
    let h = new_handle(Kind::Module);
    st.ext::<Kernels>().modules.lock().insert(
        h,
        Module {
            device: dev,
            entries,
        },
    );
    st.live_add("modules", 1);
    Ok(h)
}

/// `cuModuleUnload`: the module and its functions go.
pub(crate) fn unload(st: &State, module: CUmodule) -> SimResult {
    let h = module as u64;
    if !is_kind(h, Kind::Module) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let k = st.ext::<Kernels>();
    k.modules
        .lock()
        .remove(&h)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    k.functions.lock().retain(|_, f| f.module != h);
    st.live_add("modules", -1);
    Ok(())
}

/// `cuModuleGetFunction`: the handle of entry `name` of `module` (the same handle each time).
pub(crate) fn get_function(st: &State, module: CUmodule, name: String) -> SimResult<u64> {
    let h = module as u64;
    let k = st.ext::<Kernels>();
    let (device, entry) = {
        let m = k.modules.lock();
        let m = m.get(&h).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        (
            m.device,
            m.entries
                .get(&name)
                .cloned()
                .ok_or(CUresult::CUDA_ERROR_NOT_FOUND)?,
        )
    };
    let mut fs = k.functions.lock();
    // The same name in the same module is the same function handle.
    if let Some((fh, _)) = fs.iter().find(|(_, f)| f.module == h && f.name == name) {
        return Ok(*fh);
    }
    let fh = new_handle(Kind::Function);
    fs.insert(
        fh,
        Arc::new(Function {
            module: h,
            device,
            name,
            entry,
            attrs: Mutex::new(HashMap::new()),
        }),
    );
    Ok(fh)
}

/// `cuFuncSetAttribute`.
pub(crate) fn set_attribute(f: &Function, attrib: CUfunction_attribute, value: c_int) -> SimResult {
    use CUfunction_attribute as A;
    match attrib {
        A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES if (0..=227 * 1024).contains(&value) => {
        }
        A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT if (-1..=100).contains(&value) => {}
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
    f.attrs.lock().insert(attrib.0 as i32, value);
    Ok(())
}

impl Function {
    /// The kernel's attributes: those registered for its name (the default until one is), the
    /// block limit lowered by the entry's `.maxntid` / `.reqntid`.
    pub fn attrs(&self) -> KernelAttrs {
        let mut a = registered_attrs(&self.name);
        if let Some(m) = self.entry.max_threads {
            a.max_threads_per_block = a.max_threads_per_block.min(m);
        }
        a
    }

    /// The cluster shape its entry requires (`.reqnctapercluster`).
    pub fn required_cluster(&self) -> Option<(u32, u32, u32)> {
        self.entry.cluster
    }

    /// What one block of `threads` threads with `dynamic_smem` bytes of dynamic shared memory
    /// needs of a multiprocessor.
    fn needs(&self, threads: u32, dynamic_smem: u64) -> BlockNeeds {
        let a = self.attrs();
        BlockNeeds {
            threads,
            regs_per_thread: a.regs_per_thread,
            shared_bytes: a.static_smem_bytes as u64 + dynamic_smem,
            max_threads: a.max_threads_per_block,
        }
    }
}

/// `cuFuncGetAttribute`.
pub(crate) fn attribute(f: &Function, attrib: CUfunction_attribute) -> SimResult<c_int> {
    use CUfunction_attribute as A;
    let a = f.attrs();
    let cluster = f.required_cluster();
    Ok(match attrib {
        A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK => a.max_threads_per_block as c_int,
        A::CU_FUNC_ATTRIBUTE_NUM_REGS => a.regs_per_thread as c_int,
        A::CU_FUNC_ATTRIBUTE_PTX_VERSION | A::CU_FUNC_ATTRIBUTE_BINARY_VERSION => 90,
        A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES => a.static_smem_bytes as c_int,
        A::CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES | A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES => 0,
        A::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH => cluster.map_or(0, |c| c.0 as c_int),
        A::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT => cluster.map_or(0, |c| c.1 as c_int),
        A::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH => cluster.map_or(0, |c| c.2 as c_int),
        A::CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET => cluster.is_some() as c_int,
        a => match f.attrs.lock().get(&(a.0 as i32)) {
            Some(v) => *v,
            None if a.0 < A::CU_FUNC_ATTRIBUTE_MAX.0 => 0,
            None => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
        },
    })
}

/// The multiprocessor count of device `dev`.
fn sms(st: &State, dev: i32) -> SimResult<u32> {
    Ok(st.device(dev)?.multiprocessors.max(0) as u32)
}

/// `cuOccupancyMaxActiveBlocksPerMultiprocessor`: blocks of `block_threads` threads and
/// `dynamic_smem` bytes of dynamic shared memory that one multiprocessor holds at once (0 when
/// such a block cannot run at all).
pub(crate) fn max_active_blocks(
    f: &Function,
    block_threads: c_int,
    dynamic_smem: usize,
) -> SimResult<c_int> {
    if block_threads <= 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let n = occupancy::blocks_per_sm(f.needs(block_threads as u32, dynamic_smem as u64));
    Ok(n as c_int)
}

/// `cuOccupancyMaxActiveClusters`: clusters of the launch `shape` that the function's device
/// holds at once. `cluster` is the launch's cluster dimension attribute, if it has one; the
/// function's required shape stands in otherwise (and must agree with it).
pub(crate) fn max_active_clusters(
    st: &State,
    f: &Function,
    shape: Shape,
    cluster: Option<(u32, u32, u32)>,
) -> SimResult<c_int> {
    let (g, b) = (shape.grid, shape.block);
    if [g.0, g.1, g.2, b.0, b.1, b.2].contains(&0) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let threads = (b.0 as u64) * (b.1 as u64) * (b.2 as u64);
    if threads > occupancy::BLOCK_THREADS as u64 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let c = cluster_shape(f, shape, cluster)?;
    let per_sm = occupancy::blocks_per_sm(f.needs(threads as u32, shape.shared_mem as u64));
    Ok(occupancy::clusters(sms(st, f.device)?, per_sm, c.0 * c.1 * c.2) as c_int)
}

/// The cluster shape of a launch: the attribute's, else the kernel's required one; both must
/// be non-zero, agree where both are given, hold at most 8 blocks and divide the grid
/// (`CUDA_ERROR_INVALID_CLUSTER_SIZE` otherwise, also when neither is given).
// `is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#[allow(clippy::manual_is_multiple_of)]
fn cluster_shape(
    f: &Function,
    shape: Shape,
    given: Option<(u32, u32, u32)>,
) -> SimResult<(u32, u32, u32)> {
    let bad = Err(CUresult::CUDA_ERROR_INVALID_CLUSTER_SIZE);
    let c = match (given, f.required_cluster()) {
        (Some(a), Some(r)) if a != r => return bad,
        (Some(a), _) => a,
        (None, Some(r)) => r,
        (None, None) => return bad,
    };
    let blocks = (c.0 as u64) * (c.1 as u64) * (c.2 as u64);
    let g = shape.grid;
    if blocks == 0
        || blocks > occupancy::CLUSTER_BLOCKS as u64
        || g.0 % c.0 != 0
        || g.1 % c.1 != 0
        || g.2 % c.2 != 0
    {
        return bad;
    }
    Ok(c)
}

/// A launch's shape: grid and block dimensions, dynamic shared memory per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem: u32,
}

/// Queue a launch of `f` (its host equivalent `kernel`) on stream `s`, the launch checked and
/// its parameters copied by the caller. A block the kernel cannot run is refused now: more
/// threads than it allows or more shared memory than a block may have
/// (`CUDA_ERROR_INVALID_VALUE`), more registers than a multiprocessor has
/// (`CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`). When the stream reaches the launch, it waits for its
/// resident-block slots (`residency.rs`), runs, and gives them back.
pub(crate) fn launch(
    st: &Arc<State>,
    f: &Function,
    kernel: KernelFn,
    shape: Shape,
    s: &Arc<stream::Stream>,
    params: Vec<Vec<u8>>,
) -> SimResult {
    let b = shape.block;
    let threads = b.0 * b.1 * b.2;
    let needs = f.needs(threads, shape.shared_mem as u64);
    let per_sm = occupancy::blocks_per_sm(needs);
    if per_sm == 0 {
        return Err(
            if threads > needs.max_threads
                || needs.shared_bytes > occupancy::BLOCK_SHARED_BYTES as u64
            {
                CUresult::CUDA_ERROR_INVALID_VALUE
            } else {
                CUresult::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
            },
        );
    }
    let sms = sms(st, f.device)?;
    let g = shape.grid;
    let grid = g.0 as u64 * g.1 as u64 * g.2 as u64;
    let capacity = match f.required_cluster() {
        Some(c) => {
            let size = c.0 * c.1 * c.2;
            occupancy::clusters(sms, per_sm, size) as u64 * size as u64
        }
        None => sms as u64 * per_sm as u64,
    };
    // A cluster larger than any GPC holds: the launch takes the whole device (the simulator
    // does not refuse such a launch; its host equivalent decides what happens).
    let units = if capacity == 0 {
        sms as u64 * residency::UNITS_PER_SM
    } else {
        residency::units_for(grid, per_sm, capacity)
    };
    let args = Arc::new(LaunchArgs {
        name: f.name.clone(),
        device: f.device,
        grid: shape.grid,
        block: shape.block,
        shared_mem: shape.shared_mem,
        params,
        state: st.clone(),
    });
    stream::implicit_order(st, s)?;
    let dev = f.device;
    s.enqueue(Arc::new(move || {
        let pool = residency::of(&args.state);
        let _resident = pool.acquire(dev, sms, units, &format!("the launch of `{}`", args.name))?;
        args.jitter();
        kernel(&args).map_err(|e| e.code())
    }))
}
