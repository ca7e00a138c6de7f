//! Modules of PTX text loaded on one device, their functions (attributes and occupancy), and
//! kernel launches.

use std::ffi::{c_int, c_uint, c_void, CString};
use std::sync::Arc;

use cuda_multimem_sys::{
    CUfunction, CUfunction_attribute as FA, CUjit_option, CUlaunchAttribute, CUlaunchAttributeID,
    CUlaunchConfig, CUmodule,
};

use crate::driver::Raw;
use crate::error::{cu, Error, Result};
use crate::{Device, StreamRef};

/// The most threads one block may have on every device this library supports.
pub const MAX_THREADS_PER_BLOCK: u32 = 1024;

/// A module loaded on one device from PTX text (`cuModuleLoadData`); unloaded when it and every
/// [`Function`] of it are dropped.
#[derive(Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
}

struct ModuleInner {
    device: Device,
    raw: Raw<CUmodule>,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Module(device {}, {:p})",
            self.inner.device.ordinal(),
            self.inner.raw.0
        )
    }
}

/// Bytes of each JIT log buffer asked for when a load fails.
const LOG_BYTES: usize = 8 << 10;

impl Module {
    /// Load PTX text on `device`. The driver compiles it for the device (JIT); when that fails
    /// and the driver offers `cuModuleLoadDataEx`, the error carries the compiler's log.
    pub fn load_ptx(device: &Device, ptx: &str) -> Result<Module> {
        let text = CString::new(ptx).map_err(|e| {
            Error::invalid(
                "ptx",
                format!(
                    "PTX text contains a NUL byte at offset {} of {}",
                    e.nul_position(),
                    ptx.len()
                ),
            )
        })?;
        device.bind()?;
        let mut m: CUmodule = std::ptr::null_mut();
        // SAFETY: NUL-terminated PTX text; out-pointer valid; the device's context is current.
        let loaded = unsafe {
            cu!(
                device.driver(),
                cuModuleLoadData(&mut m, text.as_ptr() as *const c_void)
            )
        };
        match loaded {
            Ok(()) => Ok(Module {
                inner: Arc::new(ModuleInner {
                    device: device.clone(),
                    raw: Raw(m),
                }),
            }),
            Err(Error::Driver { code, .. }) => Err(match jit_log(device, &text) {
                Some(log) => Error::ModuleLoad { code, log },
                None => Error::Driver {
                    call: "cuModuleLoadData",
                    code,
                },
            }),
            Err(e) => Err(e),
        }
    }

    /// The device it is loaded on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> CUmodule {
        self.inner.raw.0
    }

    /// The kernel `name` (a PTX `.entry`) of this module (`cuModuleGetFunction`).
    pub fn function(&self, name: &str) -> Result<Function> {
        let c = CString::new(name)
            .map_err(|_| Error::invalid("name", format!("{name:?} contains a NUL byte")))?;
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: live module, NUL-terminated name, valid out-pointer.
        unsafe {
            cu!(
                self.inner.device.driver(),
                cuModuleGetFunction(&mut f, self.inner.raw.0, c.as_ptr())
            )
        }?;
        Ok(Function {
            module: self.clone(),
            raw: Raw(f),
            name: name.into(),
        })
    }
}

/// Load `text` again through `cuModuleLoadDataEx` to collect the JIT compiler's log; `None` when
/// the driver lacks the call, the second load succeeds, or the log is empty.
fn jit_log(device: &Device, text: &CString) -> Option<String> {
    let mut error_log = vec![0u8; LOG_BYTES];
    let mut info_log = vec![0u8; LOG_BYTES];
    let mut options = [
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        CUjit_option::CU_JIT_INFO_LOG_BUFFER,
        CUjit_option::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
    ];
    // The size options are passed by value in the pointer slot, as the driver documents.
    let mut values: [*mut c_void; 4] = [
        error_log.as_mut_ptr().cast(),
        LOG_BYTES as *mut c_void,
        info_log.as_mut_ptr().cast(),
        LOG_BYTES as *mut c_void,
    ];
    let mut m: CUmodule = std::ptr::null_mut();
    // SAFETY: NUL-terminated text; 4 options with their values (buffers valid for LOG_BYTES
    // writes, sizes by value); the device's context is current (bound by the caller).
    let r = unsafe {
        cu!(
            device.driver(),
            cuModuleLoadDataEx(
                &mut m,
                text.as_ptr() as *const c_void,
                options.len() as c_uint,
                options.as_mut_ptr(),
                values.as_mut_ptr()
            )
        )
    };
    if r.is_ok() {
        // SAFETY: the module just loaded; nothing else knows it.
        let _ = unsafe { cu!(device.driver(), cuModuleUnload(m)) };
        return None;
    }
    let text_of = |b: &[u8]| {
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        String::from_utf8_lossy(&b[..end]).trim().to_string()
    };
    let log = [text_of(&error_log), text_of(&info_log)]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    (!log.is_empty()).then_some(log)
}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        let (m, ordinal) = (self.raw, self.device.ordinal());
        self.device.driver().teardown(
            || format!("the module {:p} of device {ordinal} (cuModuleUnload)", m.0),
            move |d| {
                let m = m; // the whole Send wrapper, not its raw field
                d.bind(ordinal)?;
                // SAFETY: we own the module and no Function of it is left (they hold the Arc).
                unsafe { cu!(d, cuModuleUnload(m.0)) }
            },
        );
    }
}

/// A kernel of a loaded [`Module`]; keeps the module loaded. Cheap to clone.
#[derive(Clone)]
pub struct Function {
    module: Module,
    raw: Raw<CUfunction>,
    name: Arc<str>,
}

impl std::fmt::Debug for Function {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Function({}, device {})",
            self.name,
            self.module.device().ordinal()
        )
    }
}

/// The shape of a launch: grid and block dimensions and dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z (at most 1024 in all).
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A one-dimensional grid of `blocks` blocks of `threads` threads, no dynamic shared memory.
    pub fn linear(blocks: u32, threads: u32) -> LaunchConfig {
        LaunchConfig {
            grid: [blocks, 1, 1],
            block: [threads, 1, 1],
            shared_mem_bytes: 0,
        }
    }

    fn validate(&self) -> Result<()> {
        if self.grid.contains(&0) {
            return Err(Error::invalid(
                "config",
                format!("grid {:?} has a zero dimension", self.grid),
            ));
        }
        if self.block.contains(&0) {
            return Err(Error::invalid(
                "config",
                format!("block {:?} has a zero dimension", self.block),
            ));
        }
        let threads = self.block.iter().map(|&b| b as u64).product::<u64>();
        if threads > MAX_THREADS_PER_BLOCK as u64 {
            return Err(Error::invalid(
                "config",
                format!(
                    "block {:?} has {threads} threads; at most {MAX_THREADS_PER_BLOCK}",
                    self.block
                ),
            ));
        }
        Ok(())
    }
}

/// What a kernel needs of a multiprocessor, as the driver reports it for the compiled code
/// (`cuFuncGetAttribute`); with a launch's block size and dynamic shared memory it decides how
/// many blocks fit on a multiprocessor ([`Function::max_active_blocks_per_multiprocessor`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct FunctionAttributes {
    /// Registers per thread (`CU_FUNC_ATTRIBUTE_NUM_REGS`).
    pub num_regs: u32,
    /// Static shared memory per block, in bytes (`CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES`); a
    /// launch's dynamic shared memory comes on top.
    pub shared_size_bytes: u32,
    /// The most threads a block of this kernel may have
    /// (`CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK`): at most [`MAX_THREADS_PER_BLOCK`], less
    /// when the kernel uses many registers or its PTX says `.maxntid`.
    pub max_threads_per_block: u32,
}

/// A count the driver reported as a C `int`: negative is an error naming the call.
fn count(call: &'static str, what: &str, v: c_int) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        Error::invalid(
            "driver answer",
            format!("{call} reported {what} = {v}; expected a count, 0 or more"),
        )
    })
}

impl Function {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device its module is loaded on.
    pub fn device(&self) -> &Device {
        self.module.device()
    }

    /// The module.
    pub fn module(&self) -> &Module {
        &self.module
    }

    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> CUfunction {
        self.raw.0
    }

    /// One attribute of the compiled kernel (`cuFuncGetAttribute`).
    fn attribute(&self, attr: FA, what: &str) -> Result<u32> {
        let d = self.device();
        d.bind()?;
        let mut v: c_int = 0;
        // SAFETY: a live function of the current context; one int written through a valid
        // pointer.
        unsafe { cu!(d.driver(), cuFuncGetAttribute(&mut v, attr, self.raw.0)) }?;
        count("cuFuncGetAttribute", what, v)
    }

    /// Registers per thread, static shared memory and the block limit of the compiled kernel
    /// (three `cuFuncGetAttribute` calls).
    pub fn attributes(&self) -> Result<FunctionAttributes> {
        Ok(FunctionAttributes {
            num_regs: self.attribute(FA::CU_FUNC_ATTRIBUTE_NUM_REGS, "NUM_REGS")?,
            shared_size_bytes: self
                .attribute(FA::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, "SHARED_SIZE_BYTES")?,
            max_threads_per_block: self.attribute(
                FA::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                "MAX_THREADS_PER_BLOCK",
            )?,
        })
    }

    /// How many blocks of `block_threads` threads, each with `dynamic_smem_bytes` of dynamic
    /// shared memory, one multiprocessor of the function's device holds at once
    /// (`cuOccupancyMaxActiveBlocksPerMultiprocessor`): the kernel's real occupancy, from its
    /// registers, shared memory and block limit. Times the device's
    /// [`multiprocessor_count`](Device::multiprocessor_count), it is how many blocks of one
    /// launch can be resident together — what a grid whose blocks wait for each other must not
    /// exceed. 0 when such a block cannot run at all. `block_threads` must be 1 to
    /// [`MAX_THREADS_PER_BLOCK`] (checked before the call); drivers before 6.5 lack the call
    /// ([`Error::Unsupported`]).
    pub fn max_active_blocks_per_multiprocessor(
        &self,
        block_threads: u32,
        dynamic_smem_bytes: usize,
    ) -> Result<u32> {
        if !(1..=MAX_THREADS_PER_BLOCK).contains(&block_threads) {
            return Err(Error::invalid(
                "block_threads",
                format!("{block_threads} threads; expected 1 to {MAX_THREADS_PER_BLOCK}"),
            ));
        }
        let d = self.device();
        d.bind()?;
        let mut n: c_int = 0;
        // SAFETY: a live function of the current context; one int written through a valid
        // pointer; the block size fits a C int (at most 1024).
        unsafe {
            cu!(
                d.driver(),
                cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    &mut n,
                    self.raw.0,
                    block_threads as c_int,
                    dynamic_smem_bytes
                )
            )
        }?;
        count(
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            "numBlocks",
            n,
        )
    }

    /// How many thread-block clusters of the launch `config` the function's device holds at
    /// once (`cuOccupancyMaxActiveClusters`, drivers from 11.7, [`Error::Unsupported`] before).
    /// `cluster` is the cluster's shape in blocks; `None` takes the shape the kernel was
    /// compiled with (PTX `.reqnctapercluster`, as the fused norm's split forms are — a kernel
    /// without one then fails with `CUDA_ERROR_INVALID_CLUSTER_SIZE`), and a shape given for
    /// such a kernel must equal it. The grid must be whole clusters; each dimension of
    /// `cluster` is at least 1 (both checked before the call). The driver counts clusters
    /// where they can run (inside one GPC), so the answer times the cluster size can be less
    /// than [`max_active_blocks_per_multiprocessor`](Function::max_active_blocks_per_multiprocessor)
    /// times the multiprocessors.
    pub fn max_active_clusters(
        &self,
        config: &LaunchConfig,
        cluster: Option<[u32; 3]>,
    ) -> Result<u32> {
        config.validate()?;
        if let Some(c) = cluster {
            if c.contains(&0) {
                return Err(Error::invalid(
                    "cluster",
                    format!("cluster {c:?} has a zero dimension"),
                ));
            }
            if config.grid.iter().zip(c).any(|(g, c)| g % c != 0) {
                return Err(Error::invalid(
                    "cluster",
                    format!(
                        "grid {:?} is not whole clusters of {c:?} (each grid dimension must be a multiple)",
                        config.grid
                    ),
                ));
            }
        }
        let d = self.device();
        d.bind()?;
        let mut attr = CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
            ..Default::default()
        };
        if let Some([x, y, z]) = cluster {
            attr.value.clusterDim.x = x;
            attr.value.clusterDim.y = y;
            attr.value.clusterDim.z = z;
        }
        let [gx, gy, gz] = config.grid;
        let [bx, by, bz] = config.block;
        let cfg = CUlaunchConfig {
            gridDimX: gx,
            gridDimY: gy,
            gridDimZ: gz,
            blockDimX: bx,
            blockDimY: by,
            blockDimZ: bz,
            sharedMemBytes: config.shared_mem_bytes,
            hStream: std::ptr::null_mut(),
            attrs: if cluster.is_some() {
                &mut attr
            } else {
                std::ptr::null_mut()
            },
            numAttrs: cluster.is_some() as c_uint,
        };
        let mut n: c_int = 0;
        // SAFETY: a live function of the current context; `cfg` and the attribute it points to
        // (when `numAttrs` is 1) live across the call, which only reads them; one int written
        // through a valid pointer.
        unsafe {
            cu!(
                d.driver(),
                cuOccupancyMaxActiveClusters(&mut n, self.raw.0, &cfg)
            )
        }?;
        count("cuOccupancyMaxActiveClusters", "numClusters", n)
    }

    /// Queue the kernel on `stream` (`cuLaunchKernel`). Checked first: the stream is of the
    /// function's device and driver value, no dimension is zero, a block has at most 1024
    /// threads.
    ///
    /// # Safety
    /// `params` has one pointer per parameter of the kernel's PTX entry, each to a value of that
    /// parameter's size (read before this returns); what the kernel does with them (memory it
    /// reads and writes) is valid for the device when it runs, and that memory stays allocated
    /// until it has run.
    pub unsafe fn launch<'s>(
        &self,
        config: &LaunchConfig,
        stream: impl Into<StreamRef<'s>>,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let stream = stream.into();
        stream.check_device("stream", self.device(), "the function is loaded on")?;
        config.validate()?;
        let d = self.device();
        d.bind()?;
        let [gx, gy, gz] = config.grid;
        let [bx, by, bz] = config.block;
        let p = if params.is_empty() {
            std::ptr::null_mut()
        } else {
            params.as_mut_ptr()
        };
        // SAFETY: a live function and a live stream of its device (checked); the parameters as
        // the caller promises; `extra` is null.
        unsafe {
            cu!(
                d.driver(),
                cuLaunchKernel(
                    self.raw.0,
                    gx,
                    gy,
                    gz,
                    bx,
                    by,
                    bz,
                    config.shared_mem_bytes,
                    stream.raw(),
                    p,
                    std::ptr::null_mut()
                )
            )
        }
    }

    /// [`Function::launch`] for kernels whose parameters are all `.u64` (device pointers and
    /// counts): `args` are their values, in order.
    ///
    /// # Safety
    /// The kernel's PTX entry declares exactly `args.len()` parameters, all 8 bytes; what it
    /// does with them is valid for the device when it runs, and the memory it uses stays
    /// allocated until it has run.
    pub unsafe fn launch_u64<'s>(
        &self,
        config: &LaunchConfig,
        stream: impl Into<StreamRef<'s>>,
        args: &[u64],
    ) -> Result<()> {
        // cuLaunchKernel reads each parameter through a pointer to it before it returns.
        let mut values = args.to_vec();
        let mut params: Vec<*mut c_void> = values
            .iter_mut()
            .map(|v| v as *mut u64 as *mut c_void)
            .collect();
        // SAFETY: as the caller promises; `values` outlives the call.
        unsafe { self.launch(config, stream, &mut params) }
    }
}
