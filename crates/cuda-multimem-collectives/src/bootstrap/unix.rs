//! [`UnixBootstrap`]: one host, a Unix socket, file descriptors passed with `SCM_RIGHTS`.

use std::io::{IoSlice, IoSliceMut, Read, Write};
#[cfg(test)]
use std::os::fd::AsFd;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cuda_multimem::{Error, Result};

use super::Bootstrap;

const MAGIC: u32 = 0x434d_4d42; // "CMMB"

/// A one-host bootstrap over a Unix socket: rank 0 listens at `path`, the others connect (retrying
/// until the timeout), and rank 0 relays every exchange. File descriptors travel with
/// `SCM_RIGHTS`.
pub struct UnixBootstrap {
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Rank 0: one stream per peer (index rank-1). Others: one stream to rank 0.
    links: Vec<parking_lot::Mutex<UnixStream>>,
    path: Option<PathBuf>,
}

impl std::fmt::Debug for UnixBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UnixBootstrap(rank {} of {})", self.rank, self.size)
    }
}

fn io(call: &'static str, e: std::io::Error, timeout: Duration) -> Error {
    if matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    ) {
        Error::Timeout {
            what: format!("bootstrap {call} (a peer did not answer)"),
            after: timeout,
        }
    } else {
        Error::os(call, e)
    }
}

impl UnixBootstrap {
    /// Join the rendezvous at `path` as `rank` of `size`; waits up to `timeout` for every rank.
    /// Rank 0 creates the socket (replacing a stale one) and removes it when dropped.
    pub fn new(
        path: impl AsRef<Path>,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<Self> {
        if size == 0 || rank >= size {
            return Err(Error::invalid(
                "rank",
                format!("rank {rank} of a team of {size}"),
            ));
        }
        if size > u32::MAX as usize {
            return Err(Error::invalid(
                "size",
                format!(
                    "{size}; at most {} (the rendezvous sends it as 32 bits)",
                    u32::MAX
                ),
            ));
        }
        if timeout.is_zero() {
            return Err(Error::invalid(
                "timeout",
                "zero; expected a positive duration",
            ));
        }
        let deadline = Instant::now().checked_add(timeout).ok_or_else(|| {
            Error::invalid(
                "timeout",
                format!("{timeout:?}; past what the clock can hold as a deadline"),
            )
        })?;
        let path = path.as_ref().to_path_buf();
        let mut b = UnixBootstrap {
            rank,
            size,
            timeout,
            links: Vec::new(),
            path: None,
        };
        if rank == 0 {
            let _ = std::fs::remove_file(&path);
            let l = UnixListener::bind(&path).map_err(|e| io("bind", e, timeout))?;
            b.path = Some(path.clone());
            l.set_nonblocking(true)
                .map_err(|e| io("set_nonblocking", e, timeout))?;
            // by rank, as they join (nothing sized by `size` up front: a huge team times out)
            let mut peers = std::collections::BTreeMap::new();
            let mut joined = 0;
            while joined < size - 1 {
                match l.accept() {
                    Ok((s, _)) => {
                        s.set_nonblocking(false)
                            .map_err(|e| io("set_nonblocking", e, timeout))?;
                        b.arm(&s, deadline)?;
                        let mut hello = [0u8; 12];
                        (&s).read_exact(&mut hello)
                            .map_err(|e| io("read hello", e, timeout))?;
                        let magic = u32::from_le_bytes(hello[0..4].try_into().unwrap_or_default());
                        let r =
                            u32::from_le_bytes(hello[4..8].try_into().unwrap_or_default()) as usize;
                        let n = u32::from_le_bytes(hello[8..12].try_into().unwrap_or_default())
                            as usize;
                        if magic != MAGIC
                            || n != size
                            || r == 0
                            || r >= size
                            || peers.contains_key(&r)
                        {
                            return Err(Error::invalid(
                                "peer",
                                format!("a process joined as rank {r} of {n} (expected a new rank of {size})"),
                            ));
                        }
                        peers.insert(r, s);
                        joined += 1;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() >= deadline {
                            return Err(Error::Timeout {
                                what: format!(
                                    "rendezvous at {}: {joined} of {} peers joined",
                                    path.display(),
                                    size - 1
                                ),
                                after: timeout,
                            });
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(e) => return Err(io("accept", e, timeout)),
                }
            }
            b.links = peers.into_values().map(parking_lot::Mutex::new).collect();
        } else {
            let s = loop {
                match UnixStream::connect(&path) {
                    Ok(s) => break s,
                    Err(e) => {
                        if Instant::now() >= deadline {
                            return Err(Error::Timeout {
                                what: format!(
                                    "rendezvous at {}: rank 0 is not there ({e})",
                                    path.display()
                                ),
                                after: timeout,
                            });
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            };
            b.arm(&s, deadline)?;
            let mut hello = Vec::with_capacity(12);
            hello.extend_from_slice(&MAGIC.to_le_bytes());
            hello.extend_from_slice(&(rank as u32).to_le_bytes());
            hello.extend_from_slice(&(size as u32).to_le_bytes());
            (&s).write_all(&hello)
                .map_err(|e| io("write hello", e, timeout))?;
            b.links.push(parking_lot::Mutex::new(s));
        }
        Ok(b)
    }

    /// Socket timeouts: each read or write waits at most the bootstrap timeout.
    fn arm(&self, s: &UnixStream, _deadline: Instant) -> Result<()> {
        s.set_read_timeout(Some(self.timeout))
            .and_then(|_| s.set_write_timeout(Some(self.timeout)))
            .map_err(|e| io("set_timeout", e, self.timeout))
    }

    fn send(&self, s: &UnixStream, data: &[u8]) -> Result<()> {
        let mut w = s;
        w.write_all(&(data.len() as u64).to_le_bytes())
            .and_then(|_| w.write_all(data))
            .map_err(|e| io("send", e, self.timeout))
    }

    fn recv(&self, s: &UnixStream) -> Result<Vec<u8>> {
        let mut r = s;
        let mut len = [0u8; 8];
        r.read_exact(&mut len)
            .map_err(|e| io("recv", e, self.timeout))?;
        let len = u64::from_le_bytes(len);
        if len > 1 << 30 {
            return Err(Error::invalid(
                "peer",
                format!("a peer announced {len} bytes"),
            ));
        }
        let mut v = vec![0u8; len as usize];
        r.read_exact(&mut v)
            .map_err(|e| io("recv", e, self.timeout))?;
        Ok(v)
    }
}

impl Drop for UnixBootstrap {
    fn drop(&mut self) {
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Send `fds` (possibly none) with one marker byte.
fn send_fds(s: &UnixStream, fds: &[RawFd]) -> std::io::Result<()> {
    let byte = [fds.len() as u8];
    let iov = [IoSlice::new(&byte)];
    let space = unsafe_cmsg_space(fds.len());
    let mut cbuf = vec![0u8; space];
    // SAFETY: msghdr is plain data; every pointer set below outlives the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer has CMSG_SPACE(n * sizeof(int)) bytes, so the first header
        // and its data fit.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN((fds.len() * 4) as u32) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(c) as *mut RawFd,
                fds.len(),
            );
        }
    }
    // SAFETY: a connected socket and a message whose buffers are live.
    let r = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn unsafe_cmsg_space(n: usize) -> usize {
    // SAFETY: CMSG_SPACE is a pure computation.
    unsafe { libc::CMSG_SPACE((n.max(1) * 4) as u32) as usize }
}

/// Receive up to `max` fds sent with [`send_fds`].
fn recv_fds(s: &UnixStream, max: usize) -> std::io::Result<Vec<OwnedFd>> {
    let mut byte = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut byte)];
    let space = unsafe_cmsg_space(max);
    let mut cbuf = vec![0u8; space];
    // SAFETY: plain data; pointers set below outlive recvmsg.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    // SAFETY: a connected socket; buffers live.
    let r = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if r == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the peer closed the connection",
        ));
    }
    let mut out = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into our buffer.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let n = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..n {
                    out.push(OwnedFd::from_raw_fd(*data.add(i)));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::other("file descriptors were truncated"));
    }
    if out.len() != byte[0] as usize {
        return Err(std::io::Error::other(format!(
            "expected {} file descriptors, got {}",
            byte[0],
            out.len()
        )));
    }
    Ok(out)
}

impl Bootstrap for UnixBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        if self.rank == 0 {
            let mut all = vec![data.to_vec()];
            for l in &self.links {
                all.push(self.recv(&l.lock())?);
            }
            let mut packed = Vec::new();
            for a in &all {
                packed.extend_from_slice(&(a.len() as u64).to_le_bytes());
                packed.extend_from_slice(a);
            }
            for l in &self.links {
                self.send(&l.lock(), &packed)?;
            }
            Ok(all)
        } else {
            let l = self.links[0].lock();
            self.send(&l, data)?;
            let packed = self.recv(&l)?;
            let mut all = Vec::with_capacity(self.size);
            let mut p = &packed[..];
            for _ in 0..self.size {
                if p.len() < 8 {
                    return Err(Error::Peer {
                        rank: 0,
                        reason: "sent a truncated exchange".into(),
                    });
                }
                let n = u64::from_le_bytes(p[..8].try_into().unwrap_or_default());
                let rest = &p[8..];
                if (rest.len() as u64) < n {
                    return Err(Error::Peer {
                        rank: 0,
                        reason: "sent a truncated exchange".into(),
                    });
                }
                let (entry, tail) = rest.split_at(n as usize);
                all.push(entry.to_vec());
                p = tail;
            }
            Ok(all)
        }
    }

    fn all_gather_fds(&self, fds: &[BorrowedFd<'_>]) -> Result<Vec<Vec<OwnedFd>>> {
        if fds.len() > 200 {
            return Err(Error::invalid(
                "fds",
                format!("{} descriptors; at most 200", fds.len()),
            ));
        }
        let t = self.timeout;
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        if self.rank == 0 {
            let mut all: Vec<Vec<OwnedFd>> = Vec::with_capacity(self.size);
            all.push(
                fds.iter()
                    .map(|f| f.try_clone_to_owned())
                    .collect::<std::io::Result<_>>()
                    .map_err(|e| io("dup", e, t))?,
            );
            for l in &self.links {
                all.push(recv_fds(&l.lock(), fds.len()).map_err(|e| io("recvmsg", e, t))?);
            }
            for l in &self.links {
                let l = l.lock();
                for a in &all {
                    let r: Vec<RawFd> = a.iter().map(|f| f.as_raw_fd()).collect();
                    send_fds(&l, &r).map_err(|e| io("sendmsg", e, t))?;
                }
            }
            Ok(all)
        } else {
            let l = self.links[0].lock();
            send_fds(&l, &raw).map_err(|e| io("sendmsg", e, t))?;
            (0..self.size)
                .map(|_| recv_fds(&l, fds.len()).map_err(|e| io("recvmsg", e, t)))
                .collect()
        }
    }

    fn passes_fds(&self) -> bool {
        true
    }

    fn timeout(&self) -> Option<Duration> {
        Some(self.timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_ranks_exchange_bytes_and_fds() {
        let path = std::env::temp_dir().join(format!("cmm-boot-{}", std::process::id()));
        let t = Duration::from_secs(10);
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let p = path.clone();
                std::thread::spawn(move || {
                    let b = UnixBootstrap::new(&p, r, 3, t).unwrap();
                    let all = b.all_gather(&[r as u8; 3][..r + 1]).unwrap();
                    assert_eq!(all.len(), 3);
                    for (i, a) in all.iter().enumerate() {
                        assert_eq!(a, &vec![i as u8; i + 1]);
                    }
                    // each rank passes a pipe's read end; others read what it wrote
                    let mut p = [0 as libc::c_int; 2];
                    // SAFETY: two ints written by pipe(2); we own both ends afterwards.
                    assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
                    // SAFETY: fresh descriptors from pipe(2).
                    let (fd, wr) =
                        unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
                    let mut wr = std::fs::File::from(wr);
                    wr.write_all(&[100 + r as u8; 2]).unwrap(); // one byte per reader
                    let got = b.all_gather_fds(&[fd.as_fd()]).unwrap();
                    for (i, g) in got.into_iter().enumerate() {
                        assert_eq!(g.len(), 1);
                        if i != r {
                            let mut f = std::fs::File::from(g.into_iter().next().unwrap());
                            let mut x = [0u8];
                            f.read_exact(&mut x).unwrap();
                            assert_eq!(x[0], 100 + i as u8);
                        }
                    }
                    b.all_gather(b"done").unwrap();
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    }

    #[test]
    fn a_missing_peer_is_a_timeout() {
        let path = std::env::temp_dir().join(format!("cmm-boot-miss-{}", std::process::id()));
        let e = UnixBootstrap::new(&path, 0, 2, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        let e = UnixBootstrap::new(&path, 1, 2, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
    }
}
