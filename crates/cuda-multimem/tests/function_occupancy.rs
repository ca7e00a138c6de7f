//! `Function::attributes`, `max_active_blocks_per_multiprocessor` and `max_active_clusters` on
//! the simulated driver: the answers of the simulator's occupancy model (an H200-like device:
//! 132 multiprocessors of 2048 threads, 32 blocks, 64 Ki registers, 228 KiB shared memory), the
//! arguments refused before any driver call, and the driver's refusals passed on.

use cuda_multimem::{Error, Function, FunctionAttributes, LaunchConfig, Module};
use cuda_multimem_sim::{register_kernel_with, KernelAttrs, SimConfig};
use cuda_multimem_sys::CUresult;

const PTX: &str = r#"
.version 8.0
.target sm_90
.address_size 64

.visible .entry fo_wide()
{
    ret;
}

.visible .entry fo_narrow()
.maxntid 128, 1, 1
{
    ret;
}

.visible .entry fo_split()
.maxntid 1024, 1, 1
.reqnctapercluster 8, 1, 1
{
    ret;
}
"#;

/// The module on device 0 of a fresh simulated machine (kept alive by the functions).
fn functions() -> (Function, Function, Function) {
    let driver = cuda_multimem_sim::simulated_driver(SimConfig::new(1, 13030)).unwrap();
    let wide = KernelAttrs {
        regs_per_thread: 64,
        static_smem_bytes: 16 << 10,
        ..KernelAttrs::default()
    };
    register_kernel_with("fo_wide", wide, |_| Ok(())).unwrap();
    let m = Module::load_ptx(&driver.device(0).unwrap(), PTX).unwrap();
    (
        m.function("fo_wide").unwrap(),
        m.function("fo_narrow").unwrap(),
        m.function("fo_split").unwrap(),
    )
}

fn attrs(f: &Function) -> (u32, u32, u32) {
    let FunctionAttributes {
        num_regs,
        shared_size_bytes,
        max_threads_per_block,
        ..
    } = f.attributes().unwrap();
    (num_regs, shared_size_bytes, max_threads_per_block)
}

#[test]
fn attributes_are_what_the_driver_reports_for_the_kernel() {
    let (wide, narrow, _) = functions();
    assert_eq!(attrs(&wide), (64, 16 << 10, 1024));
    assert_eq!(
        attrs(&narrow),
        (32, 0, 128),
        "the defaults, and `.maxntid 128`"
    );
}

#[test]
fn blocks_per_multiprocessor_are_the_kernels_real_occupancy() {
    let (wide, narrow, _) = functions();
    // 64 registers: 2048 per warp, 32 warps of 64 Ki; 256 threads are 8 warps: 4 blocks
    assert_eq!(
        wide.max_active_blocks_per_multiprocessor(256, 0).unwrap(),
        4
    );
    // shared memory: 16 KiB static + 48 KiB dynamic + 1 KiB reserved = 65 KiB, 3 in 228 KiB
    assert_eq!(
        wide.max_active_blocks_per_multiprocessor(256, 48 << 10)
            .unwrap(),
        3
    );
    assert_eq!(
        narrow.max_active_blocks_per_multiprocessor(128, 0).unwrap(),
        16
    );
    // more threads than the kernel allows: no block fits (the driver's answer, not an error)
    assert_eq!(
        narrow.max_active_blocks_per_multiprocessor(256, 0).unwrap(),
        0
    );
}

#[test]
fn a_block_size_outside_1_to_1024_is_refused_before_the_driver_is_asked() {
    let (wide, _, _) = functions();
    for threads in [0, 1025, u32::MAX] {
        match wide.max_active_blocks_per_multiprocessor(threads, 0) {
            Err(Error::InvalidArgument { arg, reason }) => {
                assert_eq!(arg, "block_threads");
                assert!(reason.contains(&threads.to_string()), "{reason}");
            }
            other => panic!("{threads}: {other:?}"),
        }
    }
}

#[test]
fn clusters_come_from_the_compiled_shape_or_the_one_given() {
    let (wide, _, split) = functions();
    // 2 blocks of 1024 threads per multiprocessor; 8 GPCs of 16 or 17 hold 4 clusters of 8 each
    let c = LaunchConfig::linear(8, 1024);
    assert_eq!(split.max_active_clusters(&c, None).unwrap(), 32);
    assert_eq!(split.max_active_clusters(&c, Some([8, 1, 1])).unwrap(), 32);
    // 64 regs x 512 threads = 32 Ki: 2 per multiprocessor; a GPC of 17 (16) holds 17 (16)
    // clusters of 2
    let c = LaunchConfig::linear(8, 512);
    assert_eq!(wide.max_active_clusters(&c, Some([2, 1, 1])).unwrap(), 132);
}

#[test]
fn a_cluster_shape_the_driver_refuses_is_its_error() {
    let (wide, _, split) = functions();
    let c = LaunchConfig::linear(8, 256);
    let refused = |r: cuda_multimem::Result<u32>| match r {
        Err(Error::Driver { call, code }) => {
            assert_eq!(call, "cuOccupancyMaxActiveClusters");
            assert_eq!(code, CUresult::CUDA_ERROR_INVALID_CLUSTER_SIZE);
        }
        other => panic!("{other:?}"),
    };
    refused(wide.max_active_clusters(&c, None)); // no compiled shape, none given
    refused(split.max_active_clusters(&c, Some([4, 1, 1]))); // disagrees with the compiled one
    refused(wide.max_active_clusters(&LaunchConfig::linear(16, 256), Some([16, 1, 1])));
}

#[test]
fn a_zero_or_uneven_cluster_and_a_bad_launch_shape_are_refused_before_the_driver_is_asked() {
    let (wide, _, _) = functions();
    let c = LaunchConfig::linear(6, 256);
    let arg_of = |r: cuda_multimem::Result<u32>| match r {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        arg_of(wide.max_active_clusters(&c, Some([0, 1, 1]))),
        "cluster"
    );
    assert_eq!(
        arg_of(wide.max_active_clusters(&c, Some([4, 1, 1]))),
        "cluster"
    );
    assert_eq!(
        arg_of(wide.max_active_clusters(&LaunchConfig::linear(0, 256), Some([1, 1, 1]))),
        "config"
    );
    assert_eq!(
        arg_of(wide.max_active_clusters(&LaunchConfig::linear(8, 2048), Some([1, 1, 1]))),
        "config"
    );
}
