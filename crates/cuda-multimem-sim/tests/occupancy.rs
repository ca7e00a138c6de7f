//! The simulated occupancy queries (`cuOccupancyMaxActiveBlocksPerMultiprocessor`,
//! `cuOccupancyMaxActiveClusters`) and function attributes (`cuFuncGetAttribute`) answer from the
//! documented model of an H100/H200-like multiprocessor and the attributes a kernel was
//! registered with. Raw driver calls, so the driver's own error codes show (the safe layer's
//! checks come before them; `crates/cuda-multimem/tests/function_occupancy.rs` tests those).

use std::ffi::c_int;

use cuda_multimem::{Driver, Function, Module};
use cuda_multimem_sim::{register_kernel_with, KernelAttrs, SimConfig, Simulator};
use cuda_multimem_sys::{
    CUfunction_attribute as FA, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchConfig, CUresult,
};

const PTX: &str = r#"
.version 8.0
.target sm_90
.address_size 64

.visible .entry occ_plain()
{
    ret;
}

.visible .entry occ_heavy()
{
    ret;
}

.visible .entry occ_limited()
.maxntid 256, 1, 1
{
    ret;
}

.visible .entry occ_cluster()
.maxntid 1024, 1, 1
.reqnctapercluster 8, 1, 1
{
    ret;
}
"#;

/// A simulated H200-like machine (132 multiprocessors) with the test module loaded on device 0.
fn machine() -> (Simulator, Driver, Module) {
    let sim = Simulator::start(SimConfig::new(1, 13030)).unwrap();
    let driver = cuda_multimem_sim::driver_over(&sim).unwrap();
    let module = Module::load_ptx(&driver.device(0).unwrap(), PTX).unwrap();
    // 128 registers per thread and 4 KiB of static shared memory, registered after the load:
    // the answers come from the registry when they are asked.
    let heavy = KernelAttrs {
        regs_per_thread: 128,
        static_smem_bytes: 4096,
        ..KernelAttrs::default()
    };
    register_kernel_with("occ_heavy", heavy, |_| Ok(())).unwrap();
    (sim, driver, module)
}

fn blocks(
    driver: &Driver,
    f: &Function,
    threads: c_int,
    dynamic_smem: usize,
) -> Result<c_int, CUresult> {
    let call = driver
        .sys()
        .cuOccupancyMaxActiveBlocksPerMultiprocessor()
        .unwrap();
    let mut n: c_int = -1;
    // SAFETY: a live function; one int written through a valid pointer.
    match unsafe { call(&mut n, f.raw(), threads, dynamic_smem) } {
        CUresult::CUDA_SUCCESS => Ok(n),
        e => Err(e),
    }
}

fn clusters(
    driver: &Driver,
    f: &Function,
    grid: u32,
    threads: u32,
    smem: u32,
    cluster: Option<(u32, u32, u32)>,
) -> Result<c_int, CUresult> {
    let call = driver.sys().cuOccupancyMaxActiveClusters().unwrap();
    let mut attr = CUlaunchAttribute {
        id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
        ..Default::default()
    };
    if let Some((x, y, z)) = cluster {
        attr.value.clusterDim.x = x;
        attr.value.clusterDim.y = y;
        attr.value.clusterDim.z = z;
    }
    let cfg = CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: std::ptr::null_mut(),
        attrs: if cluster.is_some() {
            &mut attr
        } else {
            std::ptr::null_mut()
        },
        numAttrs: cluster.is_some() as u32,
    };
    let mut n: c_int = -1;
    // SAFETY: a live function; the config and its attribute live across the call.
    match unsafe { call(&mut n, f.raw(), &cfg) } {
        CUresult::CUDA_SUCCESS => Ok(n),
        e => Err(e),
    }
}

fn attribute(driver: &Driver, f: &Function, a: FA) -> c_int {
    let call = driver.sys().cuFuncGetAttribute().unwrap();
    let mut v: c_int = -1;
    // SAFETY: a live function; one int written through a valid pointer.
    assert_eq!(unsafe { call(&mut v, a, f.raw()) }, CUresult::CUDA_SUCCESS);
    v
}

#[test]
fn blocks_per_multiprocessor_follow_the_warp_register_block_and_shared_memory_limits() {
    let (_sim, driver, module) = machine();
    let plain = module.function("occ_plain").unwrap();
    let heavy = module.function("occ_heavy").unwrap();
    // 32 registers by default: 1024 threads are 32 warps of 64 per multiprocessor.
    assert_eq!(blocks(&driver, &plain, 1024, 0), Ok(2));
    assert_eq!(blocks(&driver, &plain, 256, 0), Ok(8));
    // one warp per block: the 32-block limit decides
    assert_eq!(blocks(&driver, &plain, 32, 0), Ok(32));
    // 100 KiB of dynamic shared memory (+1 KiB reserved) of 228 KiB
    assert_eq!(blocks(&driver, &plain, 128, 100 << 10), Ok(2));
    // more than a block may have: no block fits
    assert_eq!(blocks(&driver, &plain, 128, 228 << 10), Ok(0));
    // 128 registers x 256 threads = 32 Ki of 64 Ki registers
    assert_eq!(blocks(&driver, &heavy, 256, 0), Ok(2));
    // 128 x 1024 > 64 Ki: the kernel cannot run with such blocks
    assert_eq!(blocks(&driver, &heavy, 1024, 0), Ok(0));
    // static (4 KiB) and dynamic shared memory add up: 4 + 110 + 1 KiB twice is 230 > 228
    assert_eq!(blocks(&driver, &heavy, 64, 110 << 10), Ok(1));
    // the `WithFlags` form answers the same
    let with_flags = driver
        .sys()
        .cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags()
        .unwrap();
    let mut n = -1;
    // SAFETY: a live function; one int written through a valid pointer.
    let r = unsafe { with_flags(&mut n, plain.raw(), 256, 0, 0) };
    assert_eq!((r, n), (CUresult::CUDA_SUCCESS, 8));
}

#[test]
fn a_block_size_the_kernel_does_not_allow_gets_no_blocks_and_a_non_positive_one_is_refused() {
    let (_sim, driver, module) = machine();
    let limited = module.function("occ_limited").unwrap();
    assert_eq!(blocks(&driver, &limited, 256, 0), Ok(8));
    assert_eq!(blocks(&driver, &limited, 512, 0), Ok(0), ".maxntid 256");
    assert_eq!(
        blocks(&driver, &limited, 0, 0),
        Err(CUresult::CUDA_ERROR_INVALID_VALUE)
    );
    assert_eq!(
        blocks(&driver, &limited, -32, 0),
        Err(CUresult::CUDA_ERROR_INVALID_VALUE)
    );
}

#[test]
fn function_attributes_are_the_registered_ones_and_the_ptx_directives() {
    let (_sim, driver, module) = machine();
    let heavy = module.function("occ_heavy").unwrap();
    assert_eq!(
        attribute(&driver, &heavy, FA::CU_FUNC_ATTRIBUTE_NUM_REGS),
        128
    );
    assert_eq!(
        attribute(&driver, &heavy, FA::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
        4096
    );
    assert_eq!(
        attribute(&driver, &heavy, FA::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
        1024
    );
    // not registered: the defaults, lowered by `.maxntid`
    let limited = module.function("occ_limited").unwrap();
    assert_eq!(
        attribute(&driver, &limited, FA::CU_FUNC_ATTRIBUTE_NUM_REGS),
        32
    );
    assert_eq!(
        attribute(&driver, &limited, FA::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
        0
    );
    assert_eq!(
        attribute(
            &driver,
            &limited,
            FA::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
        ),
        256
    );
    // `.reqnctapercluster 8, 1, 1`
    let cluster = module.function("occ_cluster").unwrap();
    let required = [
        FA::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH,
        FA::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT,
        FA::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH,
        FA::CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET,
    ];
    let got: Vec<_> = required
        .iter()
        .map(|&a| attribute(&driver, &cluster, a))
        .collect();
    assert_eq!(got, [8, 1, 1, 1]);
    let plain = module.function("occ_plain").unwrap();
    assert_eq!(
        attribute(
            &driver,
            &plain,
            FA::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH
        ),
        0
    );
}

#[test]
fn clusters_are_counted_inside_gpcs() {
    let (_sim, driver, module) = machine();
    let cluster = module.function("occ_cluster").unwrap();
    // 2 blocks of 1024 threads per multiprocessor; 132 multiprocessors in 8 GPCs (17 or 16):
    // four clusters of 8 in each, 32 in all (33 by the block count alone)
    assert_eq!(clusters(&driver, &cluster, 8, 1024, 0, None), Ok(32));
    // the shape it was compiled with may be given again
    assert_eq!(
        clusters(&driver, &cluster, 16, 1024, 0, Some((8, 1, 1))),
        Ok(32)
    );
    // 1 block per multiprocessor (150 KiB of shared memory): two clusters per GPC
    assert_eq!(
        clusters(&driver, &cluster, 8, 1024, 150 << 10, None),
        Ok(16)
    );
    let plain = module.function("occ_plain").unwrap();
    // clusters of 4 of 2 blocks per multiprocessor: 8 per GPC
    assert_eq!(
        clusters(&driver, &plain, 8, 1024, 0, Some((4, 1, 1))),
        Ok(64)
    );
    assert_eq!(
        clusters(&driver, &plain, 8, 1024, 0, Some((2, 2, 1))).map(|_| ()),
        Err(CUresult::CUDA_ERROR_INVALID_CLUSTER_SIZE),
        "grid 8x1x1 is not whole 2x2 clusters"
    );
}

#[test]
fn a_cluster_shape_that_is_missing_disagrees_or_is_too_large_is_refused() {
    let (_sim, driver, module) = machine();
    let bad = Err(CUresult::CUDA_ERROR_INVALID_CLUSTER_SIZE);
    let plain = module.function("occ_plain").unwrap();
    assert_eq!(
        clusters(&driver, &plain, 8, 256, 0, None),
        bad,
        "no shape at all"
    );
    assert_eq!(
        clusters(&driver, &plain, 16, 256, 0, Some((16, 1, 1))),
        bad,
        "more than 8 blocks"
    );
    assert_eq!(
        clusters(&driver, &plain, 8, 256, 0, Some((0, 1, 1))),
        bad,
        "a zero dimension"
    );
    assert_eq!(
        clusters(&driver, &plain, 6, 256, 0, Some((4, 1, 1))),
        bad,
        "grid not whole clusters"
    );
    let cluster = module.function("occ_cluster").unwrap();
    assert_eq!(
        clusters(&driver, &cluster, 8, 256, 0, Some((4, 1, 1))),
        bad,
        "disagrees with .reqnctapercluster"
    );
    assert_eq!(
        clusters(&driver, &cluster, 8, 0, 0, None),
        Err(CUresult::CUDA_ERROR_INVALID_VALUE),
        "a zero block"
    );
}

#[test]
fn out_of_range_kernel_attributes_are_refused_and_nothing_is_registered() {
    for (attrs, key) in [
        (
            KernelAttrs {
                regs_per_thread: 0,
                ..KernelAttrs::default()
            },
            "KernelAttrs::regs_per_thread",
        ),
        (
            KernelAttrs {
                regs_per_thread: 256,
                ..KernelAttrs::default()
            },
            "KernelAttrs::regs_per_thread",
        ),
        (
            KernelAttrs {
                static_smem_bytes: (48 << 10) + 1,
                ..KernelAttrs::default()
            },
            "KernelAttrs::static_smem_bytes",
        ),
        (
            KernelAttrs {
                max_threads_per_block: 1025,
                ..KernelAttrs::default()
            },
            "KernelAttrs::max_threads_per_block",
        ),
    ] {
        let name = format!("occ_refused_{key}_{}", attrs.regs_per_thread);
        match register_kernel_with(&name, attrs, |_| Ok(())) {
            Err(cuda_multimem_sim::ConfigError::InvalidValue { key: k, .. }) => assert_eq!(k, key),
            other => panic!("{attrs:?}: {other:?}"),
        }
        assert!(!cuda_multimem_sim::kernel_registered(&name));
    }
}
