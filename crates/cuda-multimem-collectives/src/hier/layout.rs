//! The layout: which ranks form a domain, found per host (or given), and the rails across domains.

use cuda_multimem::{Device, Error, Result};

use crate::bootstrap::Bootstrap;
use crate::kernels::MAX_RANKS;
use crate::team::placement::{fnv, hostname, pci_id};

/// How the team is cut into NVLink domains and rails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HierLayout {
    rank: usize,
    /// Team ranks of each domain, ascending; domains ordered by their lowest rank.
    domains: Vec<Vec<usize>>,
    domain: usize,
    local: usize,
}

impl HierLayout {
    /// The layout of rank `rank` given each rank's domain key (ranks with equal keys share a
    /// domain). Every domain must have the same number of ranks.
    pub fn from_keys(rank: usize, keys: &[u64]) -> Result<HierLayout> {
        let mut domains: Vec<(u64, Vec<usize>)> = Vec::new();
        for (r, k) in keys.iter().enumerate() {
            match domains.iter_mut().find(|(kk, _)| kk == k) {
                Some((_, v)) => v.push(r),
                None => domains.push((*k, vec![r])),
            }
        }
        let domains: Vec<Vec<usize>> = domains.into_iter().map(|(_, v)| v).collect();
        if domains.iter().any(|d| d.len() != domains[0].len()) {
            return Err(Error::invalid(
                "domains",
                format!(
                    "ranks by domain {domains:?}; every domain needs the same number of ranks (a rail takes one rank of each)"
                ),
            ));
        }
        // every rank sees every domain, so all refuse a domain too large alike (none waits)
        if let Some(d) = domains.first().filter(|d| d.len() > MAX_RANKS) {
            return Err(Error::invalid(
                "domains",
                format!(
                    "domains of {} ranks; a domain's team has 1 to {MAX_RANKS} ranks (one NVL72 domain)",
                    d.len()
                ),
            ));
        }
        let domain = domains
            .iter()
            .position(|d| d.contains(&rank))
            .ok_or_else(|| Error::invalid("rank", format!("{rank} is in no domain")))?;
        let local = domains[domain].iter().position(|&r| r == rank).unwrap_or(0);
        Ok(HierLayout {
            rank,
            domains,
            domain,
            local,
        })
    }

    /// This rank in the team.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the team.
    pub fn size(&self) -> usize {
        self.domains.len() * self.domain_size()
    }

    /// Number of domains (M).
    pub fn domain_count(&self) -> usize {
        self.domains.len()
    }

    /// Ranks per domain (D).
    pub fn domain_size(&self) -> usize {
        self.domains[0].len()
    }

    /// This rank's domain (its position among the domains, ordered by their lowest rank);
    /// also its rank on its rail.
    pub fn domain_index(&self) -> usize {
        self.domain
    }

    /// This rank's position in its domain; also the index of its rail.
    pub fn local_index(&self) -> usize {
        self.local
    }

    /// Team ranks of domain `d`, ascending (none for `d` past the last domain).
    pub fn domain_members(&self, d: usize) -> &[usize] {
        self.domains.get(d).map_or(&[], |v| v.as_slice())
    }

    /// Team ranks of rail `l` (local index l of every domain), by domain (none for `l` past
    /// the last rail).
    pub fn rail_members(&self, l: usize) -> Vec<usize> {
        self.domains
            .iter()
            .filter_map(|d| d.get(l).copied())
            .collect()
    }

    /// How team ranks follow the domains, which decides how a reduce-scatter or all-gather
    /// (whose chunks are in team-rank order) is cut into its intra- and cross-domain steps.
    pub fn rank_order(&self) -> RankOrder {
        let (m, d) = (self.domain_count(), self.domain_size());
        let all = |f: &dyn Fn(usize, usize) -> usize| {
            (0..m).all(|k| (0..d).all(|l| self.domains[k][l] == f(k, l)))
        };
        if all(&|k, l| k * d + l) {
            RankOrder::DomainMajor
        } else if all(&|k, l| l * m + k) {
            RankOrder::RailMajor
        } else {
            RankOrder::Other
        }
    }
}

/// How a team's ranks follow its domains ([`HierLayout::rank_order`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankOrder {
    /// Rank = domain · D + local index: each domain's ranks are consecutive (one process per
    /// GPU, hosts filled in turn: `mpirun`'s default). A single domain, and domains of one
    /// GPU, count as this.
    DomainMajor,
    /// Rank = local index · M + domain: each rail's ranks are consecutive.
    RailMajor,
    /// Neither (explicit domain ids that scatter the ranks): reduce-scatter and all-gather fall
    /// back to the hierarchical allreduce of the whole buffer.
    Other,
}

/// Every rank's domain key, through the bootstrap: the explicit ids where given (every rank
/// must give one, or none), else discovered: ranks on one host whose devices reach each other
/// (peer access, checked both ways where a process sees the other's device by PCI id; a device
/// it cannot see counts as reachable, the domain's communicator checks when it maps memory).
pub(super) fn domain_keys(
    boot: &dyn Bootstrap,
    device: &Device,
    explicit: Option<u64>,
) -> Result<Vec<u64>> {
    let n = boot.size();
    let host = hostname();
    let pci = pci_id(device);
    let mut msg = vec![u8::from(explicit.is_some())];
    msg.extend_from_slice(&explicit.unwrap_or(0).to_le_bytes());
    msg.extend_from_slice(&fnv(host.as_bytes()).to_le_bytes());
    for v in pci.unwrap_or([-1; 3]) {
        msg.extend_from_slice(&v.to_le_bytes());
    }
    let all = boot.all_gather(&msg)?;
    if all.len() != n {
        return Err(Error::Peer {
            rank: all.len().min(n),
            reason: format!("the bootstrap returned {} entries; expected {n}", all.len()),
        });
    }
    if let Some((r, _)) = all.iter().enumerate().find(|(_, m)| m.len() != msg.len()) {
        return Err(Error::Peer {
            rank: r,
            reason: "sent a malformed domain description".into(),
        });
    }
    let u64_at =
        |m: &[u8], at: usize| u64::from_le_bytes(m[at..at + 8].try_into().unwrap_or_default());
    let i32_at =
        |m: &[u8], at: usize| i32::from_le_bytes(m[at..at + 4].try_into().unwrap_or_default());
    let modes: Vec<u8> = all.iter().map(|m| m[0]).collect();
    if modes.iter().any(|&m| m != modes[0]) {
        return Err(Error::RanksDisagree {
            what: format!(
                "domain ids: rank {} passed one and rank {} did not; pass explicit domain ids on every rank or on none",
                modes.iter().position(|&m| m == 1).unwrap_or(0),
                modes.iter().position(|&m| m == 0).unwrap_or(0)
            ),
        });
    }
    if modes[0] == 1 {
        return Ok(all.iter().map(|m| u64_at(m, 1)).collect());
    }
    // Discovered: same host, and devices that reach each other.
    let hosts: Vec<u64> = all.iter().map(|m| u64_at(m, 9)).collect();
    let pcis: Vec<[i32; 3]> = all
        .iter()
        .map(|m| [i32_at(m, 17), i32_at(m, 21), i32_at(m, 25)])
        .collect();
    let visible: Vec<(Device, Option<[i32; 3]>)> = device
        .driver()
        .devices()
        .into_iter()
        .map(|d| {
            let p = pci_id(&d);
            (d, p)
        })
        .collect();
    let me = boot.rank();
    let reach: Vec<u8> = (0..n)
        .map(|j| {
            if hosts[j] != hosts[me] {
                return 0;
            }
            if j == me || pcis[j] == [-1; 3] || pci.is_none() {
                return 1;
            }
            match visible.iter().find(|(_, p)| *p == Some(pcis[j])) {
                Some((d, _)) if d == device => 1,
                Some((d, _)) => u8::from(device.can_access_peer(d).unwrap_or(false)),
                None => 1,
            }
        })
        .collect();
    let masks = boot.all_gather(&reach)?;
    if let Some((r, _)) = masks.iter().enumerate().find(|(_, m)| m.len() != n) {
        return Err(Error::Peer {
            rank: r,
            reason: "sent a malformed reachability mask".into(),
        });
    }
    // Connected components of mutual reachability; a component's key is its lowest rank.
    let mut key: Vec<usize> = (0..n).collect();
    let find = |key: &Vec<usize>, mut x: usize| {
        while key[x] != x {
            x = key[x];
        }
        x
    };
    for (i, mi) in masks.iter().enumerate() {
        for (j, mj) in masks.iter().enumerate().skip(i + 1) {
            if mi[j] == 1 && mj[i] == 1 {
                let (a, b) = (find(&key, i), find(&key, j));
                key[a.max(b)] = a.min(b);
            }
        }
    }
    Ok((0..n).map(|i| find(&key, i) as u64).collect())
}
