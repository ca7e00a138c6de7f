//! A bootstrap for a subset of a parent's ranks (a domain, a rail).

use std::sync::Arc;

use cuda_multimem::{Error, Result};

use crate::bootstrap::Bootstrap;

/// A bootstrap for a subset of a parent's ranks (a domain, a rail). Every exchange is an
/// exchange of the whole parent team, of which each member keeps its subset's entries: so
/// every rank of the parent makes the same exchanges in the same order (the hierarchical
/// communicator's calls are collective over the whole team, which guarantees it).
pub(crate) struct SubBootstrap {
    parent: Arc<dyn Bootstrap>,
    /// Parent ranks, in the order of the subset's ranks.
    members: Vec<usize>,
    rank: usize,
}

impl SubBootstrap {
    pub(crate) fn new(parent: Arc<dyn Bootstrap>, members: Vec<usize>) -> Result<SubBootstrap> {
        let me = parent.rank();
        let rank = members.iter().position(|&m| m == me).ok_or_else(|| {
            Error::invalid(
                "members",
                format!("{members:?} does not hold this rank ({me})"),
            )
        })?;
        Ok(SubBootstrap {
            parent,
            members,
            rank,
        })
    }

    fn check_len(&self, got: usize, what: &str) -> Result<()> {
        if got != self.parent.size() {
            return Err(Error::Peer {
                rank: got.min(self.parent.size()),
                reason: format!(
                    "the bootstrap returned {got} {what}; the team has {}",
                    self.parent.size()
                ),
            });
        }
        Ok(())
    }
}

impl Bootstrap for SubBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut all = self.parent.all_gather(data)?;
        self.check_len(all.len(), "entries")?;
        Ok(self
            .members
            .iter()
            .map(|&m| std::mem::take(&mut all[m]))
            .collect())
    }

    fn all_gather_fds(
        &self,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Vec<Vec<std::os::fd::OwnedFd>>> {
        let mut all = self.parent.all_gather_fds(fds)?;
        self.check_len(all.len(), "descriptor sets")?;
        // Descriptors of ranks outside the subset are dropped (closed) here.
        Ok(self
            .members
            .iter()
            .map(|&m| std::mem::take(&mut all[m]))
            .collect())
    }

    fn passes_fds(&self) -> bool {
        self.parent.passes_fds()
    }
}
