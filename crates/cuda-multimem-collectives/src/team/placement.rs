//! Where ranks run: a key per device that is equal exactly when two ranks (of one process or
//! of several on one host) use the same GPU, and how many ranks share the busiest device.

use cuda_multimem::Device;

/// This host's name (`?` when it has none).
pub(crate) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into a buffer of that size.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return String::from("?");
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// The device's PCI domain, bus and device ids, where the driver reports them.
pub(crate) fn pci_id(d: &Device) -> Option<[i32; 3]> {
    use cuda_multimem::sys::CUdevice_attribute as A;
    let get = |a| d.attribute(a).ok();
    Some([
        get(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
        get(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
        get(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?,
    ])
}

/// FNV-1a of `bytes`.
pub(crate) fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// A key of `d` equal for every process of this host that uses the same GPU: the host name and
/// the PCI location (the ordinal where the driver reports none: processes see the same devices
/// then, e.g. on the simulator).
pub(crate) fn device_key(d: &Device) -> u64 {
    let mut b = hostname().into_bytes();
    match pci_id(d) {
        Some(p) => p.iter().for_each(|x| b.extend_from_slice(&x.to_le_bytes())),
        None => b.extend_from_slice(&(d.ordinal() as i64).to_le_bytes()),
    }
    fnv(&b)
}

/// A key of `d` in this process: equal exactly for ranks of one process on the same GPU (they
/// share the device's context and its hardware queues; ranks of several processes on one GPU
/// have contexts of their own).
pub(crate) fn context_key(d: &Device) -> u64 {
    let mut b = device_key(d).to_le_bytes().to_vec();
    b.extend_from_slice(&std::process::id().to_le_bytes());
    fnv(&b)
}

/// How many of `keys` the most frequent one has (1 when every rank has its own device), and two
/// positions with equal keys where there are any.
pub(crate) fn busiest(keys: &[u64]) -> (usize, Option<(usize, usize)>) {
    let mut most = 1;
    let mut pair = None;
    for (i, k) in keys.iter().enumerate() {
        let same: Vec<usize> = (0..keys.len()).filter(|&j| keys[j] == *k).collect();
        most = most.max(same.len());
        if pair.is_none() && same.len() > 1 {
            pair = Some((same[0], same[1]));
        }
        let _ = i;
    }
    (most, pair)
}
