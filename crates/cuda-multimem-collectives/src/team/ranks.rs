//! The ranks of a communicator: its size, the ranks this process drives, how it reaches the
//! others (a bootstrap, whose every exchange is validated here, in one place), and whether an
//! earlier failure left the team unusable.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering;

use cuda_multimem::{Error, Result};
use parking_lot::Mutex;

use super::Local;
use crate::bootstrap::Bootstrap;

/// Size, local ranks, bootstrap, and the team's health.
pub(crate) struct Ranks {
    pub(crate) n: usize,
    pub(crate) locals: Vec<Local>,
    pub(crate) bootstrap: Option<Box<dyn Bootstrap>>,
    /// The first failure that made the team unusable.
    broken: Mutex<Option<String>>,
}

impl Ranks {
    pub(crate) fn new(n: usize, locals: Vec<Local>, bootstrap: Option<Box<dyn Bootstrap>>) -> Self {
        Ranks {
            n,
            locals,
            bootstrap,
            broken: Mutex::new(None),
        }
    }

    /// The local rank `rank`, or an error naming the ranks this process drives.
    pub(crate) fn local(&self, rank: usize) -> Result<&Local> {
        self.locals.iter().find(|l| l.rank == rank).ok_or_else(|| {
            Error::invalid(
                "rank",
                format!(
                    "{rank}; this process drives rank(s) {:?} of a team of {}",
                    self.locals.iter().map(|l| l.rank).collect::<Vec<_>>(),
                    self.n
                ),
            )
        })
    }

    /// `Err(Unusable)` once the team broke.
    pub(crate) fn usable(&self) -> Result<()> {
        match &*self.broken.lock() {
            Some(cause) => Err(Error::Unusable {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Mark the team unusable because of `e` (the first cause wins) and give `e` back.
    pub(crate) fn break_with(&self, e: Error) -> Error {
        let mut b = self.broken.lock();
        if b.is_none() {
            *b = Some(e.to_string());
        }
        e
    }

    /// Make the team usable again after [`Ranks::break_with`] (its recovery).
    pub(crate) fn restore(&self) {
        *self.broken.lock() = None;
    }

    /// Meet every other rank through the bootstrap, past a failure of the team (the recovery's
    /// exchanges): a failed meeting leaves the team unusable.
    pub(crate) fn meet(&self, what: &str) -> Result<()> {
        let b = self
            .bootstrap
            .as_deref()
            .ok_or_else(|| Error::invalid("bootstrap", "this team has no bootstrap"))?;
        let all = b
            .all_gather(what.as_bytes())
            .map_err(|e| self.break_with(with_context(e, what)))?;
        self.check_count(what, all.len())?;
        if let Some(r) = all.iter().position(|x| x.as_slice() != what.as_bytes()) {
            return Err(self.break_with(Error::RanksDisagree {
                what: format!("rank {r} was not in the same step of the recovery ({what})"),
            }));
        }
        Ok(())
    }

    /// Every rank's `data` through the bootstrap, checked: one entry per rank, each of
    /// `expect_len` bytes when given. A failed or malformed exchange breaks the team: the ranks
    /// no longer agree on what comes next.
    pub(crate) fn exchange(
        &self,
        what: &str,
        data: &[u8],
        expect_len: Option<usize>,
    ) -> Result<Vec<Vec<u8>>> {
        let b = self.bootstrap()?;
        let all = b
            .all_gather(data)
            .map_err(|e| self.break_with(with_context(e, what)))?;
        self.check_count(what, all.len())?;
        if let Some(len) = expect_len {
            if let Some((r, x)) = all.iter().enumerate().find(|(_, x)| x.len() != len) {
                return Err(self.break_with(Error::Peer {
                    rank: r,
                    reason: format!("sent {} bytes for {what}; expected {len}", x.len()),
                }));
            }
        }
        Ok(all)
    }

    /// Every rank's file descriptors, checked like [`Ranks::exchange`]: `count` from each rank.
    pub(crate) fn exchange_fds(
        &self,
        what: &str,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Vec<Vec<OwnedFd>>> {
        let b = self.bootstrap()?;
        let all = b
            .all_gather_fds(fds)
            .map_err(|e| self.break_with(with_context(e, what)))?;
        self.check_count(what, all.len())?;
        if let Some((r, x)) = all.iter().enumerate().find(|(_, x)| x.len() != fds.len()) {
            return Err(self.break_with(Error::Peer {
                rank: r,
                reason: format!(
                    "sent {} descriptor(s) for {what}; expected {}",
                    x.len(),
                    fds.len()
                ),
            }));
        }
        Ok(all)
    }

    /// A collective agreement on a local decision: every rank says whether it accepts (and
    /// what it asks for, as 8 bytes); all get the same answer. A rank that refused makes every
    /// rank fail the same way instead of leaving its peers to time out; ranks asking for
    /// different values are a disagreement. `refusal` is this rank's own error, if any.
    pub(crate) fn agree(&self, what: &str, value: u64, refusal: Option<Error>) -> Result<()> {
        if self.bootstrap.is_none() {
            return refusal.map_or(Ok(()), Err);
        }
        let mut msg = vec![u8::from(refusal.is_none())];
        msg.extend_from_slice(&value.to_le_bytes());
        let all = self.exchange(what, &msg, Some(9))?;
        if let Some(e) = refusal {
            return Err(e);
        }
        if let Some(r) = all.iter().position(|x| x[0] == 0) {
            return Err(Error::RanksDisagree {
                what: format!("rank {r} refused {what} (its own error says why)"),
            });
        }
        if let Some(r) = all.iter().position(|x| x[1..] != msg[1..]) {
            let theirs = u64::from_le_bytes(all[r][1..9].try_into().unwrap_or_default());
            return Err(Error::RanksDisagree {
                what: format!("{what}: rank {r} asked for {theirs}, this rank for {value}"),
            });
        }
        Ok(())
    }

    fn bootstrap(&self) -> Result<&dyn Bootstrap> {
        self.usable()?;
        self.bootstrap
            .as_deref()
            .ok_or_else(|| Error::invalid("bootstrap", "this team has no bootstrap"))
    }

    fn check_count(&self, what: &str, got: usize) -> Result<()> {
        if got != self.n {
            return Err(self.break_with(Error::Peer {
                rank: got.min(self.n),
                reason: format!(
                    "the bootstrap returned {got} entries for {what}; the team has {} ranks",
                    self.n
                ),
            }));
        }
        Ok(())
    }

    /// The next call number of `local` (for error messages).
    pub(crate) fn next_call(&self, local: &Local) -> u64 {
        local.calls.fetch_add(1, Ordering::Relaxed) + 1
    }
}

fn with_context(e: Error, what: &str) -> Error {
    match e {
        Error::Timeout { what: w, after } => Error::Timeout {
            what: format!("{w} during the exchange of {what}"),
            after,
        },
        e => e,
    }
}
