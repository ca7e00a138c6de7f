//! Modules and kernel launches. A module is PTX text (`cuModuleLoadData`); its `.entry`
//! declarations name the kernels and give their parameter layout. A kernel runs on the simulator
//! when a host-side equivalent is registered under the same name ([`register_kernel`]; a launch
//! without one fails with `CUDA_ERROR_NOT_FOUND` and says so on stderr, naming the entry: see
//! [`missing_kernel_message`]): a launch copies the parameters (as the driver does), queues the equivalent on the stream's worker thread
//! and runs it there with the grid and block dimensions, so kernels of different devices run
//! concurrently and captured graphs replay them.

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::Arc;

use cuda_multimem_sys::*;
use parking_lot::{Mutex, RwLock};

use super::delay::delay;
use super::memory::Memory;
use super::stream;
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

static KERNELS: RwLock<Option<HashMap<String, KernelFn>>> = RwLock::new(None);

/// Register (or replace) the host-side equivalent of the PTX kernel `name`, process-wide. A
/// module's `.entry name` can be launched on the simulator only once one is registered.
pub fn register_kernel(
    name: &str,
    f: impl Fn(&LaunchArgs) -> Result<(), KernelError> + Send + Sync + 'static,
) {
    KERNELS
        .write()
        .get_or_insert_with(HashMap::new)
        .insert(name.to_string(), Arc::new(f));
}

/// Whether a host-side equivalent of `name` is registered.
pub fn kernel_registered(name: &str) -> bool {
    KERNELS
        .read()
        .as_ref()
        .is_some_and(|m| m.contains_key(name))
}

fn registered(name: &str) -> Option<KernelFn> {
    KERNELS.read().as_ref()?.get(name).cloned()
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

/// A parsed `.entry`: its parameter sizes.
#[derive(Debug, Clone)]
struct Entry {
    params: Vec<usize>,
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
        entries.insert(name.to_string(), Entry { params });
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

/// `cuFuncGetAttribute`.
pub(crate) fn attribute(f: &Function, attrib: CUfunction_attribute) -> SimResult<c_int> {
    use CUfunction_attribute as A;
    Ok(match attrib {
        A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK => 1024,
        A::CU_FUNC_ATTRIBUTE_NUM_REGS => 32,
        A::CU_FUNC_ATTRIBUTE_PTX_VERSION | A::CU_FUNC_ATTRIBUTE_BINARY_VERSION => 90,
        A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
        | A::CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES
        | A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES => 0,
        a => match f.attrs.lock().get(&(a.0 as i32)) {
            Some(v) => *v,
            None if a.0 < A::CU_FUNC_ATTRIBUTE_MAX.0 => 0,
            None => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
        },
    })
}

/// A launch's shape: grid and block dimensions, dynamic shared memory per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem: u32,
}

/// Queue a launch of `f` (its host equivalent `kernel`) on stream `s`, the launch checked and
/// its parameters copied by the caller.
pub(crate) fn launch(
    st: &Arc<State>,
    f: &Function,
    kernel: KernelFn,
    shape: Shape,
    s: &Arc<stream::Stream>,
    params: Vec<Vec<u8>>,
) -> SimResult {
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
    s.enqueue(Arc::new(move || {
        args.jitter();
        kernel(&args).map_err(|e| e.code())
    }))
}
