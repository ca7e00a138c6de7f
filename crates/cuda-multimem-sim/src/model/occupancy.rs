//! The occupancy model: how many blocks of a kernel fit on one simulated multiprocessor, and
//! how many thread-block clusters fit on a device. The multiprocessor is an H100/H200-like SM
//! (compute capability 9.0); the device has the configured number of them, grouped into GPCs.
//! `docs/simulator.md` ("Occupancy and co-residency") describes the model and its limits.

/// Threads resident on one multiprocessor at most (64 warps).
pub(crate) const SM_THREADS: u32 = 2048;
/// Blocks resident on one multiprocessor at most.
pub(crate) const SM_BLOCKS: u32 = 32;
/// 32-bit registers of one multiprocessor.
pub(crate) const SM_REGISTERS: u32 = 64 * 1024;
/// Shared memory of one multiprocessor, in bytes.
pub(crate) const SM_SHARED_BYTES: u32 = 228 * 1024;
/// Shared memory the system reserves for each resident block, in bytes.
pub(crate) const BLOCK_RESERVED_SHARED_BYTES: u32 = 1024;
/// Shared memory one block may use (static plus dynamic), in bytes.
pub(crate) const BLOCK_SHARED_BYTES: u32 = SM_SHARED_BYTES - BLOCK_RESERVED_SHARED_BYTES;
/// Static shared memory a kernel may declare, in bytes (more needs dynamic shared memory).
pub(crate) const STATIC_SHARED_BYTES: u32 = 48 * 1024;
/// Shared memory is given to a block in units of this many bytes.
pub(crate) const SHARED_UNIT: u32 = 128;
/// Registers are given to a warp in units of this many (8 per thread).
pub(crate) const REGISTER_UNIT: u32 = 256;
/// Registers one thread may use.
pub(crate) const THREAD_REGISTERS: u32 = 255;
/// Threads one block may have.
pub(crate) const BLOCK_THREADS: u32 = 1024;
const WARP: u32 = 32;
/// Multiprocessors of one GPC at most; a device's multiprocessors are split into
/// `ceil(count / 18)` GPCs as evenly as possible (132 → 8 GPCs: four of 17, four of 16).
pub(crate) const GPC_SMS: u32 = 18;
/// Blocks of one cluster at most (the portable cluster size; non-portable sizes are not
/// modelled).
pub(crate) const CLUSTER_BLOCKS: u32 = 8;

/// What one block of a launch needs of a multiprocessor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockNeeds {
    /// Threads per block.
    pub threads: u32,
    /// Registers per thread.
    pub regs_per_thread: u32,
    /// Static plus dynamic shared memory per block, in bytes.
    pub shared_bytes: u64,
    /// The most threads per block the kernel allows.
    pub max_threads: u32,
}

/// How many blocks of `b` one multiprocessor holds at once: the least of the block, warp,
/// register and shared-memory limits; 0 when a single block cannot run (more threads than the
/// kernel allows, more registers than a multiprocessor has, more shared memory than a block may
/// use).
pub(crate) fn blocks_per_sm(b: BlockNeeds) -> u32 {
    if b.threads == 0 || b.threads > b.max_threads.min(BLOCK_THREADS) {
        return 0;
    }
    if b.regs_per_thread > THREAD_REGISTERS || b.shared_bytes > BLOCK_SHARED_BYTES as u64 {
        return 0;
    }
    let warps = b.threads.div_ceil(WARP);
    let by_warps = (SM_THREADS / WARP) / warps;
    let regs_per_warp = (b.regs_per_thread.max(1) * WARP).next_multiple_of(REGISTER_UNIT);
    let by_regs = (SM_REGISTERS / regs_per_warp) / warps;
    let shared =
        (b.shared_bytes as u32).next_multiple_of(SHARED_UNIT) + BLOCK_RESERVED_SHARED_BYTES;
    let by_shared = SM_SHARED_BYTES / shared;
    SM_BLOCKS.min(by_warps).min(by_regs).min(by_shared)
}

/// The multiprocessors of each GPC of a device with `sms` of them.
pub(crate) fn gpcs(sms: u32) -> Vec<u32> {
    if sms == 0 {
        return Vec::new();
    }
    let n = sms.div_ceil(GPC_SMS);
    (0..n).map(|i| sms / n + u32::from(i < sms % n)).collect()
}

/// How many clusters of `cluster_blocks` blocks fit on a device of `sms` multiprocessors at
/// once, when each multiprocessor holds `per_sm` blocks: a cluster's blocks run in one GPC, so
/// each GPC holds `floor(its multiprocessors × per_sm / cluster_blocks)` clusters.
pub(crate) fn clusters(sms: u32, per_sm: u32, cluster_blocks: u32) -> u32 {
    if cluster_blocks == 0 {
        return 0;
    }
    gpcs(sms)
        .into_iter()
        .map(|g| g * per_sm / cluster_blocks)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn needs(threads: u32, regs: u32, shared: u64) -> BlockNeeds {
        BlockNeeds {
            threads,
            regs_per_thread: regs,
            shared_bytes: shared,
            max_threads: 1024,
        }
    }

    #[test]
    fn each_limit_decides_when_it_is_the_tightest() {
        // warps: 1024 threads = 32 warps, 64 per SM
        assert_eq!(blocks_per_sm(needs(1024, 32, 0)), 2);
        // blocks: 32 threads = 1 warp, but at most 32 blocks
        assert_eq!(blocks_per_sm(needs(32, 32, 0)), 32);
        // registers: 128 regs x 256 threads = 32 Ki per block, 64 Ki per SM
        assert_eq!(blocks_per_sm(needs(256, 128, 0)), 2);
        // registers round up to 8 per thread: 33 -> 40, 40 x 32 x 32 warps > 64 Ki: 1 block
        assert_eq!(blocks_per_sm(needs(1024, 33, 0)), 1);
        // shared memory: 100 KiB + 1 KiB reserved per block, 228 KiB per SM
        assert_eq!(blocks_per_sm(needs(128, 32, 100 << 10)), 2);
        // shared memory rounds up to 128 bytes: 227 KiB is one block, 227 KiB + 1 none
        assert_eq!(blocks_per_sm(needs(128, 32, 227 << 10)), 1);
        assert_eq!(blocks_per_sm(needs(128, 32, (227 << 10) + 1)), 0);
    }

    #[test]
    fn a_block_the_kernel_cannot_run_fits_nowhere() {
        let mut n = needs(512, 32, 0);
        n.max_threads = 256;
        assert_eq!(blocks_per_sm(n), 0);
        assert_eq!(
            blocks_per_sm(needs(1024, 255, 0)),
            0,
            "255 x 1024 > 64 Ki registers"
        );
        assert_eq!(blocks_per_sm(needs(0, 32, 0)), 0);
    }

    #[test]
    fn an_h200_has_eight_gpcs_and_clusters_stay_inside_them() {
        assert_eq!(gpcs(132), vec![17, 17, 17, 17, 16, 16, 16, 16]);
        assert_eq!(gpcs(18), vec![18]);
        assert_eq!(gpcs(19), vec![10, 9]);
        // 1 block per SM, clusters of 8: two in each GPC of 16 or 17
        assert_eq!(clusters(132, 1, 8), 16);
        // 2 per SM: 34 or 32 slots per GPC, four clusters each
        assert_eq!(clusters(132, 2, 8), 32);
        // clusters of 2 use every slot of an even GPC, all but one of an odd one
        assert_eq!(clusters(132, 1, 2), 64);
        assert_eq!(
            clusters(4, 1, 8),
            0,
            "a cluster larger than the device fits nowhere"
        );
    }
}
