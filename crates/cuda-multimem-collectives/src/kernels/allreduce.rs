//! The allreduce kernel families (peer-to-peer).

use crate::types::{DType, ReduceOp as Op};

/// The algorithm a kernel implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Peer-to-peer one-shot: copy in to staging, one barrier, every rank reduces everything.
    P2pOneShot,
    /// Peer-to-peer two-shot: barrier, each rank reduces its part and stores it on every rank,
    /// barrier.
    P2pTwoShot,
    /// Peer-to-peer one-shot, low-latency protocol: every 4 data bytes travel with a 4-byte flag
    /// (the call's counter) in one 8-byte store; receivers poll the data itself. No barrier, no
    /// fence.
    P2pOneShotLl,
    /// Peer-to-peer two-shot whose remote traffic is only posted writes: each rank pushes part k
    /// of its input into owner k's staging, barrier, the owner reduces locally and pushes the
    /// result to every rank's output, barrier — in rounds through fixed-size staging slots.
    /// Needs 16-byte aligned operands; the default above the one-shot limit. Three more
    /// parameters than the other families (`copy_src`, `copy_dst`, `copy_bytes`): a local copy
    /// of 16-byte vectors that warps 1.. do during each round's first barrier (0 bytes: none;
    /// staged calls carry the previous chunk's copy out of the scratch in it).
    P2pTwoShotPush,
    /// Two-shot whose first half is done by the copy engines before the kernel starts: each
    /// rank's part k of the input (rank-major: part k is the k-th N-th of the message) is copied
    /// by `cuMemcpyDtoDAsync` into rank k's landing slot of this rank, on the caller's stream;
    /// the kernel then meets its peers, reduces its part from its input and its landing slots
    /// and pushes the result into every output. 16-byte aligned operands only.
    P2pTwoShotCe,
}

impl Kernel {
    /// Every kernel family.
    pub const ALL: [Kernel; 5] = [
        Kernel::P2pOneShot,
        Kernel::P2pTwoShot,
        Kernel::P2pOneShotLl,
        Kernel::P2pTwoShotPush,
        Kernel::P2pTwoShotCe,
    ];

    /// File name of the family's PTX.
    pub fn file(self) -> &'static str {
        match self {
            Kernel::P2pOneShot => "p2p_oneshot.ptx",
            Kernel::P2pTwoShot => "p2p_twoshot.ptx",
            Kernel::P2pOneShotLl => "p2p_oneshot_ll.ptx",
            Kernel::P2pTwoShotPush => "p2p_twoshot_push.ptx",
            Kernel::P2pTwoShotCe => "p2p_twoshot_ce.ptx",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Kernel::P2pOneShot => "p2p_oneshot",
            Kernel::P2pTwoShot => "p2p_twoshot",
            Kernel::P2pOneShotLl => "p2p_oneshot_ll",
            Kernel::P2pTwoShotPush => "p2p_twoshot_push",
            Kernel::P2pTwoShotCe => "p2p_twoshot_ce",
        }
    }

    /// The committed PTX text of this family.
    pub fn ptx(self) -> &'static str {
        match self {
            Kernel::P2pOneShot => include_str!("p2p_oneshot.ptx"),
            Kernel::P2pTwoShot => include_str!("p2p_twoshot.ptx"),
            Kernel::P2pOneShotLl => include_str!("p2p_oneshot_ll.ptx"),
            Kernel::P2pTwoShotPush => include_str!("p2p_twoshot_push.ptx"),
            Kernel::P2pTwoShotCe => include_str!("p2p_twoshot_ce.ptx"),
        }
    }

    /// The PTX this process loads: the committed text. With the non-default feature
    /// `ptx-override` (kernel tuning on a GPU machine without rebuilding; the A/B scripts in
    /// `bench/`), the file of the same name in the folder named by `CUDA_MULTIMEM_PTX_DIR`
    /// instead, when that variable is set (it must declare the same entries and parameters).
    pub fn load_text(self) -> std::io::Result<std::borrow::Cow<'static, str>> {
        super::ptx_text(self.file(), self.ptx())
    }

    /// Whether the family has entries for `op`: every form has sum, min and max; product and
    /// average only the one-shot, low-latency one-shot and reading two-shot forms (the planner
    /// falls back from the write-only two-shots to [`Kernel::P2pTwoShot`] for them), which
    /// keeps the committed PTX smaller.
    pub fn has(self, op: Op) -> bool {
        matches!(op, Op::Sum | Op::Min | Op::Max)
            || matches!(
                self,
                Kernel::P2pOneShot | Kernel::P2pOneShotLl | Kernel::P2pTwoShot
            )
    }

    /// Whether the family has entries for `dtype`: every family every type
    /// ([`DType::REDUCED`]) but the low-latency one-shot, whose 4-byte words carry elements of
    /// up to 4 bytes (the planner runs 8-byte types one-shot instead).
    pub fn has_type(self, dtype: DType) -> bool {
        self != Kernel::P2pOneShotLl || dtype.size() <= 4
    }

    /// The entry name of one variant.
    pub fn entry(self, dtype: DType, op: Op) -> String {
        format!("cmm_{}_{}_{}", self.tag(), dtype.name(), op.name())
    }
}

/// Vectors of one rank's part in the copy-engine two-shot: ceil(units / n) rounded up to 8 (the
/// host copies part k = [k * P, min((k + 1) * P, units)) of every input to rank k).
pub fn ce_part_units(units: u64, n: u64) -> u64 {
    units.div_ceil(n).next_multiple_of(8)
}
