//! Driver selection, devices, attributes, peer access for ordinary allocations, streams and
//! events — the foundation every other module stands on.

use std::time::{Duration, Instant};

use cuda_multimem::sys::{CUfunction, CUmodule, CUresult};
use cuda_multimem::{
    CaptureMode, Device, DeviceBuffer, Driver, Error, Event, LaunchConfig, Module, Stream,
    StreamRef,
};
use cuda_multimem_sim::{KernelError, LaunchArgs, SimConfig};
use cuda_multimem_tests::{env, sim, skip, Env, Hold, Rng};

mod copies;
mod driver;
mod kernels;

/// A second driver value over the same driver (or simulator) as `e`'s.
fn another_driver_value(e: &Env) -> Driver {
    match &e.sim {
        Some(s) => cuda_multimem_sim::driver_over(s).unwrap(),
        None => Driver::load().unwrap(),
    }
}

fn is_invalid(r: Result<(), Error>, arg: &str) -> String {
    match r {
        Err(Error::InvalidArgument { arg: a, reason }) if a == arg => reason,
        other => panic!("expected an invalid `{arg}`, got {other:?}"),
    }
}

const ADD_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry cmm_test_add_u32(
	.param .u64 p_ptr,
	.param .u64 p_value,
	.param .u64 p_n
)
{
	.reg .pred %p;
	.reg .b32 %r<7>;
	.reg .b64 %rd<8>;
	ld.param.u64 %rd1, [p_ptr];
	ld.param.u64 %rd2, [p_value];
	ld.param.u64 %rd3, [p_n];
	mov.u32 %r1, %ctaid.x;
	mov.u32 %r2, %ntid.x;
	mov.u32 %r3, %tid.x;
	mad.lo.u32 %r4, %r1, %r2, %r3;
	cvt.u64.u32 %rd4, %r4;
	setp.ge.u64 %p, %rd4, %rd3;
	@%p bra DONE;
	cvta.to.global.u64 %rd5, %rd1;
	shl.b64 %rd6, %rd4, 2;
	add.u64 %rd7, %rd5, %rd6;
	ld.global.u32 %r5, [%rd7];
	cvt.u32.u64 %r6, %rd2;
	add.u32 %r5, %r5, %r6;
	st.global.u32 [%rd7], %r5;
DONE:
	ret;
}

.visible .entry cmm_test_spin(
	.param .u64 p_ns
)
{
	.reg .pred %p;
	.reg .b64 %rd<5>;
	ld.param.u64 %rd1, [p_ns];
	mov.u64 %rd2, %globaltimer;
SPIN:
	mov.u64 %rd3, %globaltimer;
	sub.u64 %rd4, %rd3, %rd2;
	setp.lt.u64 %p, %rd4, %rd1;
	@%p bra SPIN;
	ret;
}
"#;

/// The simulator's equivalent of `cmm_test_add_u32`: every element below n (and below the
/// grid's thread count) gets value added.
fn add_u32_on_the_host(a: &LaunchArgs) -> Result<(), KernelError> {
    let (ptr, value, n) = (a.u64(0)? as usize, a.u64(1)? as u32, a.u64(2)? as usize);
    let threads = (a.grid.0 * a.block.0) as usize;
    let n = n.min(threads);
    a.check(ptr, 4 * n, true)?;
    for i in 0..n {
        let p = (ptr + 4 * i) as *mut u32;
        // SAFETY: checked above: device memory (host memory in the simulator) the kernel may
        // write, aligned as the launch's caller promised.
        unsafe { p.write(p.read().wrapping_add(value)) };
    }
    Ok(())
}

/// The parameter of `cmm_test_spin` for a kernel that must still be running when the host
/// gets to its next steps: on the simulator a [`Hold`] (the kernel ends when the hold is
/// released or dropped, however slow the host was meanwhile), on a GPU `ns` nanoseconds of
/// spinning.
fn running_kernel(e: &Env, ns: u64) -> (u64, Option<Hold>) {
    if e.sim.is_some() {
        let h = Hold::new();
        (h.param(), Some(h))
    } else {
        (ns, None)
    }
}

fn add_kernel(e: &Env) -> Module {
    add_kernel_on(e, 0)
}

/// [`add_kernel`]'s module loaded on device `ordinal`.
fn add_kernel_on(e: &Env, ordinal: usize) -> Module {
    if e.sim.is_some() {
        cuda_multimem_sim::register_kernel("cmm_test_add_u32", add_u32_on_the_host);
        cuda_multimem_sim::register_kernel("cmm_test_spin", |a| {
            cuda_multimem_tests::sleep_or_hold(a.u64(0)?);
            Ok(())
        });
    }
    Module::load_ptx(&e.driver.device(ordinal).unwrap(), ADD_PTX).unwrap()
}

/// A PTX module loaded on `device` (raw driver calls: the safe layer has no module type yet),
/// and its kernel `name`; unloaded on drop.
pub(crate) struct RawKernel {
    driver: Driver,
    device: Device,
    module: CUmodule,
    /// The kernel.
    pub function: CUfunction,
}

impl RawKernel {
    /// Load `ptx` (without its NUL) on `device` and look up `name`.
    pub(crate) fn load(device: &Device, ptx: &str, name: &str) -> Result<RawKernel, CUresult> {
        let driver = device.driver().clone();
        device.bind().expect("the device's context");
        let text = std::ffi::CString::new(ptx).expect("PTX without NUL");
        let cname = std::ffi::CString::new(name).expect("a name without NUL");
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image and a valid out-pointer; the context is current.
        let rc =
            unsafe { driver.sys().cuModuleLoadData().unwrap()(&mut module, text.as_ptr().cast()) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(rc);
        }
        let mut k = RawKernel {
            driver,
            device: device.clone(),
            module,
            function: std::ptr::null_mut(),
        };
        // SAFETY: a live module, a NUL-terminated name, a valid out-pointer.
        let rc = unsafe {
            k.driver.sys().cuModuleGetFunction().unwrap()(&mut k.function, module, cname.as_ptr())
        };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(rc);
        }
        Ok(k)
    }

    /// Launch with one block of one thread on `stream` with these parameters (pointers to each
    /// parameter's value, as `cuLaunchKernel` takes them).
    pub(crate) fn launch(&self, stream: &Stream, params: &mut [*mut std::ffi::c_void]) -> CUresult {
        self.device.bind().expect("the device's context");
        let p = if params.is_empty() {
            std::ptr::null_mut()
        } else {
            params.as_mut_ptr()
        };
        // SAFETY: a live kernel of this device's module; `params` points at one value per kernel
        // parameter, read during the call (the driver copies them).
        unsafe {
            self.driver.sys().cuLaunchKernel().unwrap()(
                self.function,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream.raw(),
                p,
                std::ptr::null_mut(),
            )
        }
    }
}

impl Drop for RawKernel {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: we loaded this module; its kernels are not used after this.
        unsafe { self.driver.sys().cuModuleUnload().unwrap()(self.module) };
    }
}

/// Which call an overlapped copy on a stream of `e`'s driver takes: `cuMemcpyBatchAsync` from
/// 12.8 on, `cuMemcpyDtoDAsync` before.
fn batch_copies_available(e: &Env) -> bool {
    e.driver.version() >= 12080
}

/// How often the simulator behind `e` saw `symbol` (0 on the real driver).
fn sim_calls(e: &Env, symbol: &str) -> u64 {
    e.sim.as_ref().map_or(0, |s| s.calls(symbol))
}
