//! [`MpiBootstrap`]: teams whose processes an MPI launcher started (feature `mpi`).

use cuda_multimem::{Error, Result};

use super::Bootstrap;

/// A bootstrap over an MPI communicator (feature `mpi`), for teams whose processes an MPI
/// launcher started (`mpirun`, `srun`): exchanges go through `MPI_Allgather(v)`, memory handles
/// travel as fabric-handle bytes. Make every call from the thread that initialised MPI, and keep
/// the MPI universe alive while the communicator lives.
pub struct MpiBootstrap {
    comm: parking_lot::Mutex<mpi::topology::SimpleCommunicator>,
    rank: usize,
    size: usize,
}

// SAFETY: the MPI communicator is only used under the mutex, one call at a time; MPI itself is
// initialised by the caller with the thread level their use needs (documented above).
unsafe impl Send for MpiBootstrap {}
// SAFETY: as above.
unsafe impl Sync for MpiBootstrap {}

impl MpiBootstrap {
    /// A bootstrap over `comm` (e.g. `universe.world()`); its ranks are the team's ranks.
    pub fn new(comm: mpi::topology::SimpleCommunicator) -> MpiBootstrap {
        use mpi::traits::Communicator as _;
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        MpiBootstrap {
            comm: parking_lot::Mutex::new(comm),
            rank,
            size,
        }
    }
}

impl std::fmt::Debug for MpiBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiBootstrap(rank {} of {})", self.rank, self.size)
    }
}

impl Bootstrap for MpiBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        use mpi::datatype::PartitionMut;
        use mpi::traits::CommunicatorCollectives as _;
        let c = self.comm.lock();
        let len = i32::try_from(data.len())
            .map_err(|_| Error::invalid("data", format!("{} bytes; at most 2 GiB", data.len())))?;
        let mut lens = vec![0i32; self.size];
        c.all_gather_into(&len, &mut lens[..]);
        let mut displs = Vec::with_capacity(self.size);
        let mut at = 0i32;
        for l in &lens {
            if *l < 0 {
                return Err(Error::invalid("peer", "a rank announced a negative length"));
            }
            displs.push(at);
            at = at
                .checked_add(*l)
                .ok_or_else(|| Error::invalid("peer", "the exchange exceeds 2 GiB"))?;
        }
        // An empty Rust slice points at address 1, which Open MPI reads as MPI_IN_PLACE
        // ((void *) 1) and refuses (MPI_ERR_ARG, seen on the H200 machine): send and receive
        // through buffers that always have a real address.
        let mut buf = Vec::with_capacity(at as usize + 1);
        buf.resize(at as usize, 0u8);
        let mut send = Vec::with_capacity(data.len() + 1);
        send.extend_from_slice(data);
        {
            let mut part = PartitionMut::new(&mut buf[..], &lens[..], &displs[..]);
            c.all_gather_varcount_into(&send[..], &mut part);
        }
        Ok(lens
            .iter()
            .zip(&displs)
            .map(|(l, d)| buf[*d as usize..(*d + *l) as usize].to_vec())
            .collect())
    }
}
