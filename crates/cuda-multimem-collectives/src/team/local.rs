//! A rank this process drives: its device, the order of its calls, the event that says
//! whether its last call has finished, and its error mirror.

use std::sync::atomic::AtomicU64;

use cuda_multimem::{Device, Error, Event, HostMappedBuffer, Result, StreamRef};
use parking_lot::{Mutex, MutexGuard};

/// A rank driven by this process.
pub(crate) struct Local {
    pub(crate) rank: usize,
    /// Its position among the ranks this process drives (the executors' per-rank resources
    /// are in this order).
    pub(crate) slot: usize,
    pub(crate) device: Device,
    /// The stream of the last call (as an integer handle, compared, never used as a handle:
    /// the caller may have destroyed it). Locked for the whole of a call ([`CallEnd`]): one
    /// call of this rank queues its work at a time.
    last_stream: Mutex<Option<usize>>,
    /// Recorded on the caller's stream at the end of every call queued outside a graph capture:
    /// a call on another stream waits for it.
    done: Event,
    /// Calls queued by this rank so far.
    pub(crate) calls: AtomicU64,
    /// The rank's error mirror: page-locked host memory mapped for its device, word
    /// [`Local::MIRROR_P2P`] for the peer-to-peer kernels (its device address in the pad at
    /// `kernels::OFF_MIRROR`), word [`Local::MIRROR_MM`] for the multimem kernels
    /// (`MM_OFF_MIRROR`). Every kernel that fails or finds its error word set stores the word
    /// there; every call reads it first, a host load (no driver call).
    pub(crate) mirror: HostMappedBuffer<u32>,
}

/// Returned by [`Local::begin`]; when the call that holds it returns, its work is queued, and
/// the rank's event is recorded behind it (outside a graph capture: captured work runs when the
/// graph does, and an event recorded in a capture says nothing until then). It also holds the
/// rank's stream lock for the whole call, so calls of one rank from several threads queue their
/// work one call after another, never interleaved (a call may be several launches and copies
/// through the rank's staging).
pub(crate) struct CallEnd<'s> {
    done: &'s Event,
    stream: StreamRef<'s>,
    _serial: MutexGuard<'s, Option<usize>>,
}

impl Drop for CallEnd<'_> {
    fn drop(&mut self) {
        if let Ok(false) = self.stream.is_capturing() {
            // A failed record leaves the event at an earlier call: the next check on another
            // stream may then let it through early, as the check did before it existed.
            let _ = self.done.record(self.stream);
        }
    }
}

impl Local {
    /// The mirror's word of the peer-to-peer error word.
    pub(crate) const MIRROR_P2P: usize = 0;
    /// The mirror's word of the multimem error word.
    pub(crate) const MIRROR_MM: usize = 1;

    pub(crate) fn new(rank: usize, slot: usize, device: &Device) -> Result<Local> {
        Ok(Local {
            rank,
            slot,
            device: device.clone(),
            last_stream: Mutex::new(None),
            done: Event::new(device, false)?,
            calls: AtomicU64::new(0),
            mirror: HostMappedBuffer::zeroed(device, 2)?,
        })
    }

    /// The device address of mirror word `word` ([`Local::MIRROR_P2P`], [`Local::MIRROR_MM`]).
    pub(crate) fn mirror_ptr(&self, word: usize) -> u64 {
        self.mirror.device_ptr() + 4 * word as u64
    }

    /// The mirror's words as the host sees them now (0: no failure seen there).
    pub(crate) fn mirrored(&self) -> [u32; 2] {
        [Self::MIRROR_P2P, Self::MIRROR_MM].map(|w| self.mirror.load(w).unwrap_or(0))
    }

    /// Clear the mirror (the recovery, once no kernel of the rank runs).
    pub(crate) fn clear_mirror(&self) {
        for w in [Self::MIRROR_P2P, Self::MIRROR_MM] {
            self.mirror.store(w, 0);
        }
    }

    /// `stream` must be a stream of this rank's device, of the communicator's driver.
    pub(crate) fn check_stream(&self, stream: &StreamRef<'_>) -> Result<()> {
        let d = &self.device;
        if !stream.device().driver().same_as(d.driver()) {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a stream from another Driver value; rank {} is device {} of the communicator's Driver",
                    self.rank,
                    d.ordinal()
                ),
            ));
        }
        if stream.device() != d {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a stream of device {}; rank {} is device {}",
                    stream.device().ordinal(),
                    self.rank,
                    d.ordinal()
                ),
            ));
        }
        Ok(())
    }

    /// Begin a call on `stream` (checked by [`Local::check_stream`]): take the rank's call lock
    /// for the whole call, and order the call after this rank's previous one on the GPU when
    /// that ran on another stream (the stream waits for the rank's event, recorded behind every
    /// call queued outside a capture; the previous stream is never touched itself — the caller
    /// may have destroyed it since). Calls of one rank may so take any stream, as NCCL's do; in
    /// a graph capture the graph's own order holds (nothing is waited for or recorded there).
    pub(crate) fn begin<'s>(&'s self, stream: &StreamRef<'s>) -> Result<CallEnd<'s>> {
        let mut last = self.last_stream.lock();
        let raw = stream.raw() as usize;
        if last.is_some_and(|prev| prev != raw) && !stream.is_capturing()? {
            stream.wait(&self.done)?;
        }
        *last = Some(raw);
        Ok(CallEnd {
            done: &self.done,
            stream: *stream,
            _serial: last,
        })
    }
}
