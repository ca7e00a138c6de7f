//! How a communicator chooses and runs its kernels, and how much memory it sets aside.

use std::time::Duration;

use cuda_multimem::{Error, Result};

use crate::kernels::MAX_BLOCKS;
use crate::types::Algorithm;

/// The largest byte size any size field accepts (1 TiB): every product and sum the communicator
/// forms from these fields stays far from `usize::MAX`.
const MAX_FIELD_BYTES: usize = 1 << 40;

/// How the communicator chooses and runs a collective. Every field can be changed; the
/// defaults follow measurements on 2 x H200 (docs/perf.md). Every rank of a team must pass the
/// same configuration (checked when the team is built).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommConfig {
    /// Messages up to this many bytes use one-shot (when not forced); `None`: by team size
    /// (8 MiB for 2 ranks, 2 MiB for 3, 512 KiB for more: one-shot moves (N-1) times the
    /// message per rank, two-shot 2(N-1)/N times). A staging slot is at least this large
    /// (see `stage_bytes`). At most 1 GiB.
    pub one_shot_max_bytes: Option<usize>,
    /// Force an algorithm (`None`: choose by size and operands).
    pub algorithm: Option<Algorithm>,
    /// A barrier that waits longer than this sets the rank's error word and gives up.
    pub timeout: Duration,
    /// The same bound for each rank's first call after the build (and after
    /// [`crate::Communicator::recover`]): ranks that start unevenly — weight loading, JIT and
    /// library warm-up before the first collective — meet there. `None`: the longer of
    /// `timeout` and [`CommConfig::FIRST_CALL_TIMEOUT`]; else at least `timeout`, at most 24
    /// hours. Make the first call a warm-up where the start is uneven (any call serves).
    pub first_call_timeout: Option<Duration>,
    /// Most threads per block (small messages use fewer).
    pub threads: u32,
    /// Most blocks per launch (at most [`MAX_BLOCKS`]); 0: two per multiprocessor.
    pub max_blocks: u32,
    /// Allreduces up to this many bytes use the low-latency one-shot (when not forced); also
    /// sizes the low-latency staging (2 x N slots of 2 x the largest of this, half of
    /// `gather_ll_max_bytes`, `broadcast_ll_max_bytes` and `norm_ll_max_bytes` per rank). 0
    /// turns it off. At most 16 MiB.
    pub ll_max_bytes: usize,
    /// Reduce-scatters and all-gathers whose whole buffer (the scattered input, the gathered
    /// output) is at most this many bytes use their low-latency forms ([`Algorithm::PushLl`])
    /// when the rank's part fits a low-latency slot (always, from 2 ranks). Default 2 MiB: on
    /// 2 x H200 the low-latency forms took 3.2 to 3.8 µs from 64 to 256 KiB where the staged
    /// kernel's one round took about 7 µs, behind NCCL's 6.1 at 128 KiB (docs/perf.md, session
    /// 4), and at 2 MiB 9.1 against 10.0 µs (all-gather) and 9.5 against 9.7 (reduce-scatter),
    /// at 4 MiB 16.1 against 13.4 and 17.3 against 13.0 (session 7). 0 turns them off. At most
    /// 16 MiB.
    pub gather_ll_max_bytes: usize,
    /// Broadcasts of at most this many bytes use their low-latency form (the root sends the
    /// whole message, as two stored bytes per byte, to every peer). Default 1 MiB: on 2 x H200
    /// the low-latency broadcast took 7.5 against 7.5 µs at 1 MiB and 13.3 against 12.1 at
    /// 2 MiB (docs/perf.md, session 7). 0 turns it off. At most 16 MiB.
    pub broadcast_ll_max_bytes: usize,
    /// All-gathers into a symmetric output move their data through the copy engines
    /// ([`Algorithm::CopyEngine`]) when the gathered output is at least this many bytes (the
    /// low-latency forms take precedence up to `gather_ll_max_bytes`). The copy engines move
    /// about 7 % more over NVLink than kernel stores (2 x H200: 392 against 365 GB/s each way
    /// with both directions busy) but cost more per call (two barrier launches around the
    /// copies; out of place, the local copy beside them). Default 256 MiB, from where they won
    /// on 2 x H200 in place and out of place (360.8 against 357.6 GB/s busbw out of place at
    /// 256 MiB, 368.1 in place; 376.3 at 512 MiB; docs/perf.md). One rule for in place and out
    /// of place, so ranks that differ in that still choose alike. `usize::MAX` turns it off.
    pub gather_ce_min_bytes: usize,
    /// Broadcasts into a symmetric output move their data through the copy engines when the
    /// message is at least this many bytes: only the root sends, so the copy engines' one-way
    /// rate counts (2 x H200: 372 against 364 GB/s at 128 MiB, 384 against 367 at 256 MiB, 394
    /// against 369 at 1 GiB; 354 against 357 at 64 MiB; docs/perf.md). Default 128 MiB;
    /// `usize::MAX` turns it off.
    pub broadcast_ce_min_bytes: usize,
    /// Fused allreduce + residual add + RMSNorm calls of up to this many bytes (tokens ×
    /// hidden × element size) use its low-latency one-shot (when not forced and the operands
    /// allow it; docs/design/rmsnorm.md); the low-latency slots are sized for it too (see
    /// `ll_max_bytes`). Default 256 KiB: 16 tokens of hidden 8192 in bf16. 0 turns it
    /// off. At most 16 MiB.
    pub norm_ll_max_bytes: usize,
    /// Threads per block of the write-only two-shot ([`Algorithm::TwoShotPush`]), which runs
    /// one block per multiprocessor (a power of two of them, unless `max_blocks` says
    /// otherwise): 1024 and 128 blocks on 2 x H200 moved 362 GB/s at 256 MiB where 512 x 256
    /// moved 357 (docs/perf.md).
    pub push_threads: u32,
    /// Messages from `ce_min_bytes` up to this many bytes use the copy-engine two-shot
    /// ([`Algorithm::TwoShotCe`]); it also sizes the landing area, about this many bytes per
    /// rank, which is why it is off (0) by default. At most 64 GiB.
    pub ce_max_bytes: usize,
    /// Smallest message for the copy-engine two-shot (when `ce_max_bytes` allows it): below
    /// 256 MiB it was slower than the write-only two-shot on 2 x H200.
    pub ce_min_bytes: usize,
    /// Bytes of one staging slot (there are 2 x N per rank); `None`: the larger of the one-shot
    /// limit and 64 MiB / N. Rounded up to 4 KiB; at least 4 KiB, at most 1 GiB.
    pub stage_bytes: Option<usize>,
    /// Bytes of the scratch (per rank, symmetric) through which calls on the caller's own
    /// memory larger than the one-shot limit are staged, in chunks of a third of it (an input
    /// region and two output regions used in turn; docs/design/allreduce.md). 0: no scratch;
    /// such calls are refused. Rounded up to 12 KiB; at most 16 GiB.
    pub scratch_bytes: usize,
    /// Smallest message the multimem path takes under [`crate::MulticastPolicy::WhenItPaysOff`].
    pub multimem_min_bytes: usize,
    /// Bytes of the multimem path's input and output regions (each), per rank: larger messages
    /// go through them in chunks. Rounded up to 2 MiB; at least 2 MiB, at most 16 GiB.
    pub multimem_capacity: usize,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            ll_max_bytes: 64 << 10,
            gather_ll_max_bytes: 2 << 20,
            broadcast_ll_max_bytes: 1 << 20,
            gather_ce_min_bytes: 256 << 20,
            broadcast_ce_min_bytes: 128 << 20,
            norm_ll_max_bytes: 256 << 10,
            stage_bytes: None,
            push_threads: 1024,
            ce_max_bytes: 0,
            ce_min_bytes: 256 << 20,
            one_shot_max_bytes: None,
            algorithm: None,
            timeout: Duration::from_secs(5),
            first_call_timeout: None,
            threads: 512,
            max_blocks: 0,
            scratch_bytes: 96 << 20,
            multimem_min_bytes: 1 << 20,
            multimem_capacity: 64 << 20,
        }
    }
}

fn at_most(arg: &'static str, v: usize, max: usize, unit: &str) -> Result<()> {
    if v > max {
        return Err(Error::invalid(arg, format!("{v}; at most {unit}")));
    }
    Ok(())
}

impl CommConfig {
    pub(crate) fn one_shot_max(&self, n: usize) -> usize {
        self.one_shot_max_bytes.unwrap_or(match n {
            2 => 8 << 20,
            3 => 2 << 20,
            _ => 512 << 10,
        })
    }

    /// Bytes of one staging slot: as configured, else the larger of the one-shot limit and
    /// 64 MiB / N (a push round then covers 64 MiB of the message); never smaller than the
    /// one-shot limit. Valid configurations keep every term below 1 GiB + 4 KiB.
    pub(crate) fn stage_slot_bytes(&self, n: usize) -> usize {
        self.stage_bytes
            .unwrap_or((64 << 20) / n.max(1))
            .max(self.one_shot_max(n))
            .max(4096)
            .next_multiple_of(4096)
    }

    /// Bytes of one low-latency staging slot: two stored bytes per data byte of the largest
    /// part a rank sends a peer under the low-latency limits: the whole message of an
    /// allreduce, a broadcast or a norm, half the whole buffer of a reduce-scatter or an
    /// all-gather (a rank's part, from 2 ranks; a call whose part does not fit a slot runs
    /// another form).
    pub(crate) fn ll_slot_bytes(&self) -> usize {
        (2 * self
            .ll_max_bytes
            .max(self.gather_ll_max_bytes.div_ceil(2))
            .max(self.broadcast_ll_max_bytes)
            .max(self.norm_ll_max_bytes))
        .max(4096)
        .next_multiple_of(4096)
    }

    /// Bytes of the scratch: three regions of whole 4 KiB pages (0: none).
    pub(crate) fn scratch_total(&self) -> usize {
        self.scratch_bytes.next_multiple_of(3 * 4096)
    }

    /// Bytes of each multimem region.
    pub(crate) fn multimem_region(&self) -> usize {
        self.multimem_capacity
            .max(2 << 20)
            .next_multiple_of(2 << 20)
    }

    /// Check every field; the error names the field and the value.
    pub fn validate(&self) -> Result<()> {
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
        at_most("config.ll_max_bytes", self.ll_max_bytes, 16 << 20, "16 MiB")?;
        at_most(
            "config.gather_ll_max_bytes",
            self.gather_ll_max_bytes,
            16 << 20,
            "16 MiB",
        )?;
        at_most(
            "config.broadcast_ll_max_bytes",
            self.broadcast_ll_max_bytes,
            16 << 20,
            "16 MiB",
        )?;
        at_most(
            "config.norm_ll_max_bytes",
            self.norm_ll_max_bytes,
            16 << 20,
            "16 MiB",
        )?;
        if let Some(b) = self.one_shot_max_bytes {
            at_most("config.one_shot_max_bytes", b, 1 << 30, "1 GiB")?;
        }
        if let Some(b) = self.stage_bytes {
            if !(4096..=1 << 30).contains(&b) {
                return Err(Error::invalid(
                    "config.stage_bytes",
                    format!("{b}; expected 4 KiB to 1 GiB"),
                ));
            }
        }
        at_most("config.ce_max_bytes", self.ce_max_bytes, 64 << 30, "64 GiB")?;
        at_most(
            "config.ce_min_bytes",
            self.ce_min_bytes,
            MAX_FIELD_BYTES,
            "1 TiB",
        )?;
        at_most(
            "config.scratch_bytes",
            self.scratch_bytes,
            16 << 30,
            "16 GiB",
        )?;
        at_most(
            "config.multimem_capacity",
            self.multimem_capacity,
            16 << 30,
            "16 GiB",
        )?;
        at_most(
            "config.multimem_min_bytes",
            self.multimem_min_bytes,
            MAX_FIELD_BYTES,
            "1 TiB",
        )?;
        if let Some(
            a @ (Algorithm::PushStaged
            | Algorithm::PushDirect
            | Algorithm::PushLl
            | Algorithm::CopyEngine),
        ) = self.algorithm
        {
            return Err(Error::invalid(
                "config.algorithm",
                format!("{a}: not an allreduce algorithm (reduce-scatter, all-gather and broadcast choose their own)"),
            ));
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid(
                "config.timeout",
                "zero; expected a positive duration",
            ));
        }
        if self.timeout > Duration::from_secs(24 * 3600) {
            return Err(Error::invalid(
                "config.timeout",
                format!("{:?}; at most 24 hours", self.timeout),
            ));
        }
        if let Some(f) = self.first_call_timeout {
            if f < self.timeout || f > Duration::from_secs(24 * 3600) {
                return Err(Error::invalid(
                    "config.first_call_timeout",
                    format!(
                        "{f:?}; expected at least config.timeout ({:?}) and at most 24 hours",
                        self.timeout
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The default of [`CommConfig::first_call_timeout`] (where `timeout` is shorter).
    pub const FIRST_CALL_TIMEOUT: Duration = Duration::from_secs(120);

    /// The longest bound a wait may have (24 hours).
    pub(crate) const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

    /// The bound of a rank's first call.
    pub(crate) fn first_call(&self) -> Duration {
        self.first_call_timeout
            .unwrap_or(self.timeout.max(Self::FIRST_CALL_TIMEOUT))
    }

    /// The barrier deadline in nanoseconds, as the kernels take it.
    pub(crate) fn timeout_ns(&self) -> u64 {
        self.timeout.as_nanos().min(u64::MAX as u128) as u64
    }

    /// What every rank must agree on, as bytes.
    pub(crate) fn fingerprint(&self, n: usize, multiprocessors: u32) -> Vec<u8> {
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
            self.scratch_bytes as u64,
            self.multimem_min_bytes as u64,
            self.multimem_capacity as u64,
            self.norm_ll_max_bytes as u64,
            self.gather_ll_max_bytes as u64,
            self.broadcast_ll_max_bytes as u64,
            self.gather_ce_min_bytes as u64,
            self.broadcast_ce_min_bytes as u64,
            self.timeout_ns(),
            self.first_call().as_nanos().min(u64::MAX as u128) as u64,
            multiprocessors as u64,
        ] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_sizes_are_refused_naming_the_field() {
        for (c, field) in [
            (
                CommConfig {
                    one_shot_max_bytes: Some(usize::MAX),
                    ..Default::default()
                },
                "config.one_shot_max_bytes",
            ),
            (
                CommConfig {
                    ce_max_bytes: usize::MAX,
                    ..Default::default()
                },
                "config.ce_max_bytes",
            ),
            (
                CommConfig {
                    gather_ll_max_bytes: usize::MAX,
                    ..Default::default()
                },
                "config.gather_ll_max_bytes",
            ),
            (
                CommConfig {
                    broadcast_ll_max_bytes: usize::MAX,
                    ..Default::default()
                },
                "config.broadcast_ll_max_bytes",
            ),
            (
                CommConfig {
                    scratch_bytes: usize::MAX,
                    ..Default::default()
                },
                "config.scratch_bytes",
            ),
            (
                CommConfig {
                    multimem_capacity: usize::MAX,
                    ..Default::default()
                },
                "config.multimem_capacity",
            ),
            (
                CommConfig {
                    timeout: Duration::MAX,
                    ..Default::default()
                },
                "config.timeout",
            ),
        ] {
            match c.validate() {
                Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_largest_valid_sizes_do_not_overflow_the_sizing() {
        let c = CommConfig {
            one_shot_max_bytes: Some(1 << 30),
            stage_bytes: Some(1 << 30),
            ce_max_bytes: 64 << 30,
            scratch_bytes: 16 << 30,
            multimem_capacity: 16 << 30,
            ll_max_bytes: 16 << 20,
            gather_ll_max_bytes: 16 << 20,
            broadcast_ll_max_bytes: 16 << 20,
            norm_ll_max_bytes: 16 << 20,
            ..Default::default()
        };
        c.validate().unwrap();
        // the defaults' low-latency slot: 2 MiB (a 1 MiB broadcast, a 2 MiB all-gather's part)
        assert_eq!(CommConfig::default().ll_slot_bytes(), 2 << 20);
        for n in 2..=8 {
            assert!(c.stage_slot_bytes(n) <= (1 << 30) + 4096);
            assert!(2 * n * c.stage_slot_bytes(n) < usize::MAX / 4);
        }
        assert_eq!(
            c.scratch_total(),
            (16usize << 30).next_multiple_of(3 * 4096)
        );
    }
}
