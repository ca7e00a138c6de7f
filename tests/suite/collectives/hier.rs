//! Hierarchical collectives: a team cut into NVLink domains joined by rails. On the simulator
//! (one thread per rank, a Unix-socket bootstrap, explicit domain ids) at 2x2, 2x4 and 4x2
//! ranks, with the host test double for the cross-domain step: results equal the host
//! reference reduced the way the hierarchy reduces (inside each domain in rank order, then
//! across domains in domain order). NCCL's loader: its failures are values. On real GPUs: two
//! processes as two domains of one GPU, with NCCL really running the cross-domain step.

use std::sync::Arc;
use std::time::Duration;

use cuda_multimem::{CaptureMode, DeviceBuffer, Error, Stream};
use cuda_multimem_collectives::testing::{random_input, reference};
use cuda_multimem_collectives::{
    bf16, CommConfig, DType, Element, HierCommunicator, HierLayout, MulticastPolicy, Nccl,
    ReduceOp, UnixBootstrap,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{sim, sim_version, skip};

fn rendezvous(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("cmm-hier-{tag}-{}", std::process::id()))
}

/// Rank r's input for call `call` (any process can compute every rank's).
fn input<T: Element>(call: u64, rank: usize, count: usize) -> Vec<T> {
    let mut state = (call * 7919 + rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    random_input(count, &mut state)
}

/// What the hierarchy computes: each domain's members reduced in rank order (rounded to T),
/// then the domains' results reduced in domain order.
fn hier_reference<T: Element>(layout: &HierLayout, op: ReduceOp, inputs: &[Vec<T>]) -> Vec<T> {
    let per_domain: Vec<Vec<T>> = (0..layout.domain_count())
        .map(|d| {
            let refs: Vec<&[T]> = layout
                .domain_members(d)
                .iter()
                .map(|&r| inputs[r].as_slice())
                .collect();
            reference(op, &refs)
        })
        .collect();
    let refs: Vec<&[T]> = per_domain.iter().map(|v| v.as_slice()).collect();
    reference(op, &refs)
}

fn first_difference<T: Element>(got: &[T], want: &[T]) -> Option<String> {
    (0..want.len())
        .find(|&i| got[i].to_bits64() != want[i].to_bits64())
        .map(|i| {
            format!(
                "element {i}: got {} want {}",
                got[i].to_f32(),
                want[i].to_f32()
            )
        })
}

/// A team of `domains` x `per_domain` ranks on one simulated machine, one thread per rank;
/// `domain_of(rank)` is the explicit domain id. Each rank runs `body`.
///
/// Each team runs in a process of its own (this test binary, re-run for the one test), so every
/// team starts from a fresh simulator.
fn sim_team(
    tag: &str,
    domains: usize,
    per_domain: usize,
    domain_of: fn(usize, usize, usize) -> u64,
    body: fn(&HierCommunicator, &Stream) -> Result<(), String>,
) {
    sim_team_with(tag, domains, per_domain, domain_of, None, body)
}

/// [`sim_team`] with the domains' `one_shot_max_bytes` set (a small one makes the domain's
/// all-gather store directly into symmetric outputs at test sizes).
fn sim_team_with(
    tag: &str,
    domains: usize,
    per_domain: usize,
    domain_of: fn(usize, usize, usize) -> u64,
    one_shot_max: Option<usize>,
    body: fn(&HierCommunicator, &Stream) -> Result<(), String>,
) {
    if std::env::var_os(ISOLATED).is_none() {
        let test = std::thread::current()
            .name()
            .unwrap_or_default()
            .to_string();
        let mut cmd = cuda_multimem_tests::child_test(&test);
        cmd.env(ISOLATED, "1");
        cuda_multimem_tests::assert_child_passes(cmd, &format!("{test} in its own process"));
        return;
    }
    let n = domains * per_domain;
    let e = sim(SimConfig::new(n, sim_version()));
    let path = rendezvous(tag);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let driver = e.driver.clone();
            let path = path.clone();
            std::thread::spawn(move || -> Result<(), String> {
                let device = driver.device(rank).map_err(|x| x.to_string())?;
                let boot = UnixBootstrap::new(&path, rank, n, Duration::from_secs(60))
                    .map_err(|x| format!("rank {rank}: bootstrap: {x}"))?;
                let hier = HierCommunicator::builder(&device, Box::new(boot))
                    .domain_id(domain_of(rank, domains, per_domain))
                    .multicast(MulticastPolicy::Never)
                    .config(CommConfig {
                        timeout: Duration::from_secs(30),
                        one_shot_max_bytes: one_shot_max,
                        ..Default::default()
                    })
                    .cross_domain_test_double()
                    .build()
                    .map_err(|x| format!("rank {rank}: build: {x}"))?;
                let l = hier.layout();
                if l.domain_count() != domains || l.domain_size() != per_domain {
                    return Err(format!("rank {rank}: layout {l:?}"));
                }
                let stream = Stream::new(&device).map_err(|x| x.to_string())?;
                body(&hier, &stream).map_err(|x| format!("rank {rank}: {x}"))
            })
        })
        .collect();
    let errors: Vec<String> = handles
        .into_iter()
        .filter_map(|h| match h.join() {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some("a rank panicked".into()),
        })
        .collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// Ranks 0..D-1 in domain 0, D..2D-1 in domain 1, ...
fn contiguous(rank: usize, _domains: usize, per_domain: usize) -> u64 {
    (rank / per_domain) as u64
}

/// Rank r in domain r mod M (domains that are not blocks of ranks; each rail's ranks are).
fn interleaved(rank: usize, domains: usize, _per_domain: usize) -> u64 {
    (rank % domains) as u64
}

/// Two domains of two, {0, 3} and {1, 2}: neither domains nor rails are blocks of ranks.
fn scattered(rank: usize, _domains: usize, _per_domain: usize) -> u64 {
    (rank.div_ceil(2) % 2) as u64
}

/// Allreduce calls on a symmetric buffer and on the caller's own memory, several sizes (a
/// whole number of shards and not), types and operators; every result checked.
fn allreduce_calls(hier: &HierCommunicator, s: &Stream) -> Result<(), String> {
    let l = hier.layout();
    let (rank, n) = (l.rank(), l.size());
    let err = |x: Error| x.to_string();
    // A whole number of shards; a tail of count mod D elements; fewer elements than ranks in
    // a domain (no reduce-scatter, the tail alone).
    for (call, (count, op)) in [
        (4096usize, ReduceOp::Sum),
        (1003, ReduceOp::Max),
        (5, ReduceOp::Sum),
        (1, ReduceOp::Sum),
    ]
    .into_iter()
    .enumerate()
    {
        let inputs: Vec<Vec<bf16>> = (0..n).map(|r| input(call as u64, r, count)).collect();
        let want = hier_reference(l, op, &inputs);
        let mut buf = hier.alloc::<bf16>(count).map_err(err)?;
        // The domain's symmetric buffer counts ranks within the domain.
        buf.write(l.local_index(), 0, &inputs[rank]).map_err(err)?;
        hier.all_reduce_in_place(&mut buf, op, s).map_err(err)?;
        s.synchronize().map_err(err)?;
        hier.check().map_err(err)?;
        let got = buf.to_vec(l.local_index()).map_err(err)?;
        if let Some(d) = first_difference(&got, &want) {
            return Err(format!("symmetric, {count} x bf16 {op}: {d}"));
        }
    }
    // The caller's own memory, out of place, f32.
    let count = 777;
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(50, r, count)).collect();
    let want = hier_reference(l, ReduceOp::Min, &inputs);
    let src = DeviceBuffer::from_host(hier.device(), &inputs[rank]).map_err(err)?;
    let mut dst = DeviceBuffer::<f32>::zeroed(hier.device(), count).map_err(err)?;
    hier.all_reduce(&src, &mut dst, ReduceOp::Min, s)
        .map_err(err)?;
    s.synchronize().map_err(err)?;
    hier.check().map_err(err)?;
    if let Some(d) = first_difference(&dst.to_vec().map_err(err)?, &want) {
        return Err(format!("own memory, {count} x f32 min: {d}"));
    }
    // An average of domain averages is not the team's: refused naming `op`, on every rank
    match hier.all_reduce(&src, &mut dst, ReduceOp::Avg, s) {
        Err(Error::InvalidArgument { arg: "op", .. }) => {}
        other => return Err(format!("avg: expected a refusal naming op, got {other:?}")),
    }
    hier.check().map_err(err)?;
    Ok(())
}

/// One allreduce of `T` with `op` (4099 elements: shards and a tail) on a symmetric buffer.
fn one_type<T: Element + Default + Clone>(
    hier: &HierCommunicator,
    s: &Stream,
    call: u64,
    op: ReduceOp,
) -> Result<(), String> {
    let l = hier.layout();
    let (rank, n) = (l.rank(), l.size());
    let err = |x: Error| x.to_string();
    let count = 4099;
    let inputs: Vec<Vec<T>> = (0..n).map(|r| input(call, r, count)).collect();
    let want = hier_reference(l, op, &inputs);
    let mut buf = hier.alloc::<T>(count).map_err(err)?;
    buf.write(l.local_index(), 0, &inputs[rank]).map_err(err)?;
    hier.all_reduce_in_place(&mut buf, op, s).map_err(err)?;
    s.synchronize().map_err(err)?;
    hier.check().map_err(err)?;
    let got = buf.to_vec(l.local_index()).map_err(err)?;
    match first_difference(&got, &want) {
        Some(d) => Err(format!("{count} x {} {op}: {d}", T::DTYPE)),
        None => Ok(()),
    }
}

/// The types beyond f32, f16 and bf16 through the domains and the cross-domain step (the
/// NCCL double reduces as the reference): wrapping integers, f64, FP8.
fn new_type_calls(hier: &HierCommunicator, s: &Stream) -> Result<(), String> {
    one_type::<i64>(hier, s, 60, ReduceOp::Sum)?;
    one_type::<u64>(hier, s, 61, ReduceOp::Prod)?;
    one_type::<i32>(hier, s, 62, ReduceOp::Min)?;
    one_type::<u32>(hier, s, 63, ReduceOp::Max)?;
    one_type::<i8>(hier, s, 64, ReduceOp::Sum)?;
    one_type::<u8>(hier, s, 65, ReduceOp::Max)?;
    one_type::<f64>(hier, s, 66, ReduceOp::Sum)?;
    one_type::<cuda_multimem_collectives::float8::F8E4M3>(hier, s, 67, ReduceOp::Sum)?;
    one_type::<cuda_multimem_collectives::float8::F8E5M2>(hier, s, 68, ReduceOp::Max)?;
    Ok(())
}

#[test]
fn hierarchical_allreduce_of_every_new_type_equals_the_host_reference_at_2_domains_of_2() {
    sim_team("types2x2", 2, 2, contiguous, new_type_calls);
}

#[test]
fn hierarchical_allreduce_equals_the_host_reference_at_2_domains_of_2() {
    sim_team("2x2", 2, 2, contiguous, allreduce_calls);
}

#[test]
fn hierarchical_allreduce_equals_the_host_reference_at_2_domains_of_4() {
    sim_team("2x4", 2, 4, contiguous, allreduce_calls);
}

#[test]
fn hierarchical_allreduce_equals_the_host_reference_at_4_domains_of_2_interleaved() {
    sim_team("4x2", 4, 2, interleaved, allreduce_calls);
}

/// Reduce-scatter and all-gather, in place and out of place, on the caller's own memory and (for
/// domains of several GPUs) on symmetric buffers; bf16 sums checked bit for bit against the
/// hierarchy's rounding (inside each domain, then across).
fn scatter_gather_calls(hier: &HierCommunicator, s: &Stream) -> Result<(), String> {
    let l = hier.layout();
    let (rank, n) = (l.rank(), l.size());
    let err = |x: Error| x.to_string();
    let chunk = 300;
    let inputs: Vec<Vec<bf16>> = (0..n).map(|r| input(70, r, n * chunk)).collect();
    let want = hier_reference(l, ReduceOp::Sum, &inputs);
    let mine = rank * chunk..(rank + 1) * chunk;
    // reduce-scatter in place: chunk r of rank r
    let mut buf = DeviceBuffer::from_host(hier.device(), &inputs[rank]).map_err(err)?;
    hier.reduce_scatter_in_place(&mut buf, ReduceOp::Sum, s)
        .map_err(err)?;
    s.synchronize().map_err(err)?;
    hier.check().map_err(err)?;
    let got = buf.to_vec().map_err(err)?;
    if let Some(d) = first_difference(&got[mine.clone()], &want[mine.clone()]) {
        return Err(format!("reduce-scatter in place: {d}"));
    }
    // reduce-scatter out of place; the input is left as it was
    let mut one = DeviceBuffer::<bf16>::zeroed(hier.device(), chunk).map_err(err)?;
    let src = DeviceBuffer::from_host(hier.device(), &inputs[rank]).map_err(err)?;
    hier.reduce_scatter(&src, &mut one, ReduceOp::Sum, s)
        .map_err(err)?;
    s.synchronize().map_err(err)?;
    hier.check().map_err(err)?;
    if let Some(d) = first_difference(&one.to_vec().map_err(err)?, &want[mine.clone()]) {
        return Err(format!("reduce-scatter: {d}"));
    }
    if let Some(d) = first_difference(&src.to_vec().map_err(err)?, &inputs[rank]) {
        return Err(format!("reduce-scatter wrote its input: {d}"));
    }
    // all-gather out of place: every rank's chunk (its own data) everywhere
    let parts: Vec<Vec<bf16>> = (0..n).map(|r| input(80, r, chunk)).collect();
    let src = DeviceBuffer::from_host(hier.device(), &parts[rank]).map_err(err)?;
    let mut out = DeviceBuffer::<bf16>::zeroed(hier.device(), n * chunk).map_err(err)?;
    hier.all_gather(&src, &mut out, s).map_err(err)?;
    s.synchronize().map_err(err)?;
    hier.check().map_err(err)?;
    if let Some(d) = first_difference(&out.to_vec().map_err(err)?, &parts.concat()) {
        return Err(format!("all-gather: {d}"));
    }
    if l.domain_size() > 1 {
        // symmetric buffers, in place: reduce-scatter, then all-gather of the results
        let mut sym = hier.alloc::<bf16>(n * chunk).map_err(err)?;
        sym.write(l.local_index(), 0, &inputs[rank]).map_err(err)?;
        hier.reduce_scatter_in_place(&mut sym, ReduceOp::Sum, s)
            .map_err(err)?;
        hier.all_gather_in_place(&mut sym, s).map_err(err)?;
        s.synchronize().map_err(err)?;
        hier.check().map_err(err)?;
        if let Some(d) = first_difference(&sym.to_vec(l.local_index()).map_err(err)?, &want) {
            return Err(format!("symmetric reduce-scatter then all-gather: {d}"));
        }
    }
    Ok(())
}

#[test]
fn reduce_scatter_and_all_gather_equal_the_host_reference_at_2_domains_of_2() {
    sim_team("rs2x2", 2, 2, contiguous, scatter_gather_calls);
}

#[test]
fn reduce_scatter_and_all_gather_equal_the_host_reference_at_2_domains_of_4() {
    sim_team("rs2x4", 2, 4, contiguous, scatter_gather_calls);
}

#[test]
fn reduce_scatter_and_all_gather_equal_the_host_reference_at_4_domains_of_2_rail_major() {
    sim_team("rs4x2", 4, 2, interleaved, scatter_gather_calls);
}

#[test]
fn reduce_scatter_and_all_gather_equal_the_host_reference_with_scattered_domains() {
    sim_team("rsodd", 2, 2, scattered, scatter_gather_calls);
}

#[test]
fn domain_all_gathers_storing_directly_into_symmetric_outputs_equal_the_host_reference() {
    // a one-shot limit below the test's sizes: the domain's all-gathers store into the peers'
    // symmetric buffers
    sim_team_with("dir2x2", 2, 2, contiguous, Some(256), scatter_gather_calls);
}

#[test]
fn domain_all_gathers_storing_directly_equal_the_host_reference_with_rail_major_ranks() {
    sim_team_with(
        "dir2x2i",
        2,
        2,
        interleaved,
        Some(256),
        scatter_gather_calls,
    );
}

#[test]
fn domains_of_one_gpu_reduce_scatter_and_all_gather_through_the_cross_domain_step_alone() {
    sim_team("rs4x1", 4, 1, interleaved, scatter_gather_calls);
}

#[test]
fn a_single_domain_reduce_scatters_and_all_gathers_with_its_own_collectives() {
    sim_team("rs1x4", 1, 4, contiguous, scatter_gather_calls);
}

#[test]
fn hierarchical_allreduce_equals_the_host_reference_with_scattered_domains() {
    sim_team("arodd", 2, 2, scattered, allreduce_calls);
}

#[test]
fn rank_order_says_whether_domains_or_rails_are_blocks_of_ranks() {
    use cuda_multimem_collectives::hier::RankOrder;
    let order = |keys: &[u64]| HierLayout::from_keys(0, keys).unwrap().rank_order();
    assert_eq!(order(&[0, 0, 1, 1]), RankOrder::DomainMajor);
    assert_eq!(order(&[0, 1, 0, 1]), RankOrder::RailMajor);
    assert_eq!(order(&[0, 1, 1, 0]), RankOrder::Other);
    assert_eq!(order(&[0, 1, 2]), RankOrder::DomainMajor);
    assert_eq!(order(&[5, 5, 5]), RankOrder::DomainMajor);
}

#[test]
fn domains_of_one_gpu_allreduce_through_the_cross_domain_step_alone() {
    sim_team("ar2x1", 2, 1, interleaved, |hier, s| {
        if hier.domain().is_some() || hier.cross_domain().is_none() {
            return Err("expected no domain communicator and a rail".into());
        }
        if hier.alloc::<f32>(16).is_ok() {
            return Err("a one-GPU domain has no symmetric memory".into());
        }
        let l = hier.layout();
        let inputs: Vec<Vec<f32>> = (0..2).map(|r| input(90, r, 1000)).collect();
        let want = hier_reference(l, ReduceOp::Sum, &inputs);
        let mut b =
            DeviceBuffer::from_host(hier.device(), &inputs[l.rank()]).map_err(|x| x.to_string())?;
        hier.all_reduce_in_place(&mut b, ReduceOp::Sum, s)
            .map_err(|x| x.to_string())?;
        s.synchronize().map_err(|x| x.to_string())?;
        match first_difference(&b.to_vec().map_err(|x| x.to_string())?, &want) {
            Some(d) => Err(d),
            None => Ok(()),
        }
    });
}

#[test]
fn ranks_of_one_host_whose_devices_reach_each_other_are_discovered_as_one_domain() {
    let n = 4;
    let e = sim(SimConfig::new(n, sim_version()));
    let path = rendezvous("disc");
    let hs: Vec<_> = (0..n)
        .map(|rank| {
            let (driver, path) = (e.driver.clone(), path.clone());
            std::thread::spawn(move || {
                let device = driver.device(rank).unwrap();
                let boot = UnixBootstrap::new(&path, rank, n, Duration::from_secs(60)).unwrap();
                let hier = HierCommunicator::builder(&device, Box::new(boot))
                    .multicast(MulticastPolicy::Never)
                    .cross_domain_test_double()
                    .build()
                    .unwrap();
                let l = hier.layout().clone();
                assert_eq!((l.domain_count(), l.domain_size()), (1, 4));
                assert!(hier.cross_domain().is_none());
                assert_eq!(l.local_index(), rank);
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn domains_of_unequal_size_are_refused_with_the_grouping() {
    let e = HierLayout::from_keys(0, &[7, 7, 9]).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument { arg: "domains", reason } if reason.contains("[[0, 1], [2]]")),
        "{e}"
    );
    let l = HierLayout::from_keys(3, &[5, 6, 5, 6]).unwrap();
    assert_eq!((l.domain_index(), l.local_index()), (1, 1));
    assert_eq!(l.rail_members(0), [0, 1]);
    assert_eq!(l.domain_members(1), [1, 3]);
}

// ---- NCCL's loader ----

#[test]
fn a_missing_nccl_library_is_an_error_naming_the_path_and_the_fix() {
    let e = Nccl::load_from(std::path::Path::new("/nonexistent/libnccl.so.2")).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::NcclUnavailable { .. }), "{e:?}");
    assert!(msg.contains("/nonexistent/libnccl.so.2"), "{msg}");
    assert!(msg.contains("CUDA_MULTIMEM_NCCL="), "{msg}");
}

#[test]
fn a_library_that_is_not_nccl_is_an_error_naming_the_missing_symbol() {
    let e = Nccl::load_from(std::path::Path::new("libc.so.6")).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::NcclUnavailable { .. }), "{e:?}");
    assert!(
        msg.contains("ncclGetVersion") && msg.contains("libc.so.6"),
        "{msg}"
    );
}

#[test]
fn building_with_a_missing_nccl_fails_on_every_rank_without_hanging() {
    // Two one-GPU domains whose rails would need NCCL, with a library path that does not exist:
    // every rank reports it (rank 0 its own error, the other the disagreement), within the
    // bootstrap's timeout.
    let e = sim(SimConfig::new(2, sim_version()));
    let path = rendezvous("nonccl");
    let hs: Vec<_> = (0..2)
        .map(|rank| {
            let (driver, path) = (e.driver.clone(), path.clone());
            std::thread::spawn(move || {
                let device = driver.device(rank).unwrap();
                let boot = UnixBootstrap::new(&path, rank, 2, Duration::from_secs(30)).unwrap();
                let lib = Nccl::load_from(std::path::Path::new("/nonexistent/libnccl.so.2"));
                let b = HierCommunicator::builder(&device, Box::new(boot)).domain_id(rank as u64);
                match lib {
                    Ok(l) => b.nccl(l).build().map(|_| ()),
                    // what `build` does when the default library is missing, forced here
                    Err(e) => b.cross_domain_with(move |_| Err(e)).build().map(|_| ()),
                }
            })
        })
        .collect();
    for h in hs {
        let r = h.join().unwrap();
        assert!(matches!(r, Err(Error::NcclUnavailable { .. })), "{r:?}");
    }
}

// ---- real GPUs: two processes, two one-GPU domains, NCCL across ----

/// Set in the process a team test re-runs itself in.
const ISOLATED: &str = "CMM_TEST_HIER_ISOLATED";

const HW_RANK: &str = "CMM_TEST_HIER_RANK";
const HW_PATH: &str = "CMM_TEST_HIER_PATH";

/// NCCL: `CUDA_MULTIMEM_NCCL`, the default names, else the library of the `nvidia-nccl` wheel
/// of the machine's Python (where torch installs it).
fn locate_nccl() -> Result<Arc<Nccl>, String> {
    let first = match Nccl::load() {
        Ok(n) => return Ok(n),
        Err(e) => e.to_string(),
    };
    if std::env::var_os(cuda_multimem_collectives::nccl::NCCL_ENV).is_some() {
        return Err(first);
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import nvidia.nccl,os; print(list(nvidia.nccl.__path__)[0])",
        ])
        .output()
        .map_err(|e| format!("{first}; python3: {e}"))?;
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || dir.is_empty() {
        return Err(format!("{first}; python3 has no nvidia.nccl"));
    }
    Nccl::load_from(&std::path::Path::new(&dir).join("lib/libnccl.so.2")).map_err(|e| e.to_string())
}

fn on_real_gpus(name: &str) -> Option<(cuda_multimem_tests::Env, Arc<Nccl>)> {
    if std::env::var(cuda_multimem::DRIVER_ENV).as_deref() != Ok("cuda") {
        skip(
            name,
            "needs the real driver (NCCL cannot run on the simulator)",
        );
        return None;
    }
    let e = cuda_multimem_tests::env();
    if e.driver.devices().len() < 2 {
        skip(name, "needs 2 GPUs");
        return None;
    }
    match locate_nccl() {
        Ok(n) => Some((e, n)),
        Err(why) => {
            skip(name, format!("no NCCL found: {why}"));
            None
        }
    }
}

/// One rank of the two-process team: eager calls at several sizes, then a captured graph of the
/// hierarchical allreduce replayed with fresh inputs; every result checked.
fn hw_rank(rank: usize, path: &std::path::Path, nccl: Arc<Nccl>) -> Result<(), String> {
    let err = |x: Error| format!("rank {rank}: {x}");
    let e = cuda_multimem_tests::env();
    let device = e.driver.device(rank).map_err(err)?;
    let boot = UnixBootstrap::new(path, rank, 2, Duration::from_secs(60)).map_err(err)?;
    let hier = HierCommunicator::builder(&device, Box::new(boot))
        .domain_id(rank as u64)
        .nccl(nccl)
        .nccl_timeout(Duration::from_secs(60))
        .build()
        .map_err(err)?;
    let l = hier.layout().clone();
    if (l.domain_count(), l.domain_size()) != (2, 1) {
        return Err(format!("rank {rank}: layout {l:?}"));
    }
    let s = Stream::new(&device).map_err(err)?;
    for (call, count) in [1usize, 1000, 65_537, 4 << 20].into_iter().enumerate() {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let inputs: Vec<Vec<bf16>> = (0..2).map(|r| input(call as u64, r, count)).collect();
            let want = hier_reference(&l, op, &inputs);
            let mut b = DeviceBuffer::from_host(&device, &inputs[rank]).map_err(err)?;
            hier.all_reduce_in_place(&mut b, op, &s).map_err(err)?;
            s.synchronize().map_err(err)?;
            hier.check().map_err(err)?;
            if let Some(d) = first_difference(&b.to_vec().map_err(err)?, &want) {
                return Err(format!("rank {rank}, {count} x bf16 {op}: {d}"));
            }
        }
    }
    // Graph capture of the whole call, replayed with new inputs.
    let count = 1 << 16;
    let mut b = DeviceBuffer::<f32>::zeroed(&device, count).map_err(err)?;
    let sr = s.as_stream_ref();
    sr.begin_capture(CaptureMode::ThreadLocal).map_err(err)?;
    let captured = hier.all_reduce_in_place(&mut b, ReduceOp::Sum, &s);
    let graph = sr.end_capture().map_err(err)?;
    captured.map_err(err)?;
    // SAFETY: `hier`, `b` and `s` outlive `exec` (declared after them, dropped first).
    let exec = unsafe { graph.instantiate() }.map_err(err)?;
    for replay in 0..3u64 {
        let inputs: Vec<Vec<f32>> = (0..2).map(|r| input(100 + replay, r, count)).collect();
        b.copy_from_host(0, &inputs[rank]).map_err(err)?;
        exec.launch(&s).map_err(err)?;
        s.synchronize().map_err(err)?;
        hier.check().map_err(err)?;
        let want = hier_reference(&l, ReduceOp::Sum, &inputs);
        if let Some(d) = first_difference(&b.to_vec().map_err(err)?, &want) {
            return Err(format!("rank {rank}, graph replay {replay}: {d}"));
        }
    }
    hw_rank_cudarc(rank, &hier, &l)?;
    println!("HIER-RANK-OK {rank}");
    Ok(())
}

/// Every hierarchical collective on cudarc slices and views and a cudarc stream (feature
/// `cudarc`), in place and not, against the host reference.
fn hw_rank_cudarc(rank: usize, hier: &HierCommunicator, l: &HierLayout) -> Result<(), String> {
    let err = |x: Error| format!("rank {rank}, cudarc: {x}");
    let cu = |x: cudarc::driver::DriverError| format!("rank {rank}, cudarc: {x:?}");
    let s = cudarc::driver::CudaContext::new(rank)
        .and_then(|c| c.new_stream())
        .map_err(cu)?;
    let n = l.size();
    let check = |what: &str, got: &[f32], want: &[f32]| match first_difference(got, want) {
        Some(d) => Err(format!("rank {rank}, cudarc {what}: {d}")),
        None => Ok(()),
    };
    let count = 4096;
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(200, r, count)).collect();
    let sum = hier_reference(l, ReduceOp::Sum, &inputs);
    // allreduce out of place (a view in), then in place
    let x = s.clone_htod(&inputs[rank]).map_err(cu)?;
    let mut y = s.alloc_zeros::<f32>(count).map_err(cu)?;
    hier.all_reduce(x.slice(..), &mut y, ReduceOp::Sum, &s)
        .map_err(err)?;
    let mut z = s.clone_htod(&inputs[rank]).map_err(cu)?;
    hier.all_reduce_in_place(&mut z, ReduceOp::Sum, &s)
        .map_err(err)?;
    s.synchronize().map_err(cu)?;
    hier.check().map_err(err)?;
    check("all_reduce", &s.clone_dtoh(&y).map_err(cu)?, &sum)?;
    check("all_reduce_in_place", &s.clone_dtoh(&z).map_err(cu)?, &sum)?;
    // reduce-scatter of N chunks, out of place and in place (chunk r)
    let chunk = count / n;
    let mine = &sum[rank * chunk..(rank + 1) * chunk];
    let mut out = s.alloc_zeros::<f32>(chunk).map_err(cu)?;
    hier.reduce_scatter(&x, &mut out, ReduceOp::Sum, &s)
        .map_err(err)?;
    let mut b = s.clone_htod(&inputs[rank]).map_err(cu)?;
    hier.reduce_scatter_in_place(&mut b, ReduceOp::Sum, &s)
        .map_err(err)?;
    s.synchronize().map_err(cu)?;
    hier.check().map_err(err)?;
    check("reduce_scatter", &s.clone_dtoh(&out).map_err(cu)?, mine)?;
    let got = s.clone_dtoh(&b).map_err(cu)?;
    check(
        "reduce_scatter_in_place",
        &got[rank * chunk..(rank + 1) * chunk],
        mine,
    )?;
    // all-gather of every rank's chunk, out of place (a view in) and in place (a view)
    let parts: Vec<Vec<f32>> = (0..n).map(|r| input(201, r, chunk)).collect();
    let all: Vec<f32> = parts.concat();
    let p = s.clone_htod(&parts[rank]).map_err(cu)?;
    let mut g = s.alloc_zeros::<f32>(n * chunk).map_err(cu)?;
    hier.all_gather(p.slice(..), &mut g, &s).map_err(err)?;
    let mut placed = vec![0.0f32; n * chunk];
    placed[rank * chunk..(rank + 1) * chunk].copy_from_slice(&parts[rank]);
    let mut gi = s.clone_htod(&placed).map_err(cu)?;
    hier.all_gather_in_place(gi.slice_mut(..), &s)
        .map_err(err)?;
    s.synchronize().map_err(cu)?;
    hier.check().map_err(err)?;
    check("all_gather", &s.clone_dtoh(&g).map_err(cu)?, &all)?;
    check("all_gather_in_place", &s.clone_dtoh(&gi).map_err(cu)?, &all)?;
    // a run-time element type: the inputs' bytes
    let bytes: Vec<u8> = inputs[rank].iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut d = s.clone_htod(&bytes).map_err(cu)?;
    hier.all_reduce_dyn_in_place(DType::F32, &mut d, ReduceOp::Sum, &s)
        .map_err(err)?;
    s.synchronize().map_err(cu)?;
    hier.check().map_err(err)?;
    let got: Vec<f32> = s
        .clone_dtoh(&d)
        .map_err(cu)?
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    check("all_reduce_dyn_in_place", &got, &sum)?;
    Ok(())
}

#[test]
#[ignore = "runs only as the child process of the two-process NCCL test"]
fn hier_child_rank() {
    let (Ok(rank), Ok(path)) = (std::env::var(HW_RANK), std::env::var(HW_PATH)) else {
        return skip("hier_child_rank", "only runs as a child of the NCCL test");
    };
    let nccl = locate_nccl().unwrap();
    if let Err(e) = hw_rank(rank.parse().unwrap(), std::path::Path::new(&path), nccl) {
        panic!("{e}");
    }
}

#[test]
fn two_processes_as_two_domains_allreduce_through_nccl() {
    let name = "two_processes_as_two_domains_allreduce_through_nccl";
    let Some((_e, nccl)) = on_real_gpus(name) else {
        return;
    };
    println!("NCCL {} from {}", nccl.version_string(), nccl.path());
    let path = rendezvous("nccl");
    let child = cuda_multimem_tests::child_test("collectives::hier::hier_child_rank")
        .env(HW_RANK, "1")
        .env(HW_PATH, &path)
        .env(cuda_multimem_collectives::nccl::NCCL_ENV, nccl.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mine = hw_rank(0, &path, nccl);
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("HIER-RANK-OK 1"),
        "child rank failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    mine.unwrap();
}

/// Four ranks as threads of one process over one simulator, each with its own bootstrap: every
/// rank exports its symmetric memory and imports its peers' while faster peers already run their
/// kernels. (Used to time out: the simulator's unmap of an import's size-check mapping waited
/// for the owner device's kernel, which waited for the importing rank.)
#[test]
fn a_bootstrap_communicator_of_4_threads_on_one_simulator_allreduces() {
    use cuda_multimem_collectives::Communicator;
    let n = 4;
    let e = sim(SimConfig::new(n, sim_version()));
    let path = rendezvous("plain4");
    let hs: Vec<_> = (0..n)
        .map(|rank| {
            let (driver, path) = (e.driver.clone(), path.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let err = |x: Error| format!("rank {rank}: {x}");
                let device = driver.device(rank).unwrap();
                let boot = UnixBootstrap::new(&path, rank, n, Duration::from_secs(60)).unwrap();
                let c = Communicator::builder_with_bootstrap(&device, Box::new(boot))
                    .multicast(MulticastPolicy::Never)
                    .config(CommConfig {
                        timeout: Duration::from_secs(10),
                        ..Default::default()
                    })
                    .build()
                    .map_err(err)?;
                let s = Stream::new(&device).unwrap();
                for call in 0..3u64 {
                    let count = 4096;
                    let inputs: Vec<Vec<bf16>> = (0..n).map(|r| input(call, r, count)).collect();
                    let refs: Vec<&[bf16]> = inputs.iter().map(|v| v.as_slice()).collect();
                    let want = reference(ReduceOp::Sum, &refs);
                    let mut buf = c.alloc::<bf16>(count).map_err(err)?;
                    buf.write(rank, 0, &inputs[rank]).map_err(err)?;
                    c.rank(rank)
                        .unwrap()
                        .all_reduce_in_place(&mut buf, ReduceOp::Sum, &s)
                        .map_err(err)?;
                    s.synchronize().map_err(err)?;
                    c.check().map_err(err)?;
                    if let Some(d) = first_difference(&buf.to_vec(rank).map_err(err)?, &want) {
                        return Err(format!("rank {rank} call {call}: {d}"));
                    }
                }
                Ok(())
            })
        })
        .collect();
    let errs: Vec<String> = hs
        .into_iter()
        .filter_map(|h| h.join().unwrap().err())
        .collect();
    assert!(errs.is_empty(), "{}", errs.join("\n"));
}

/// Two threads of each rank call its hierarchical allreduce at once on the rank's one stream:
/// every call (copies, the domain's steps, the cross-domain step) reaches the stream whole.
/// All calls are the same in-place sum of small integers, so 2K calls per rank leave exactly
/// N^(2K-1) times the sum of the inputs whatever the order.
fn concurrent_calls(hier: &HierCommunicator, s: &Stream) -> Result<(), String> {
    let l = hier.layout();
    let (rank, n) = (l.rank(), l.size());
    let err = |x: Error| x.to_string();
    let (len, k) = (3000usize, 3i32);
    let x = |r: usize| -> Vec<f32> { (0..len).map(|i| ((i * 7 + r * 3) % 4) as f32).collect() };
    let buf = DeviceBuffer::from_host(hier.device(), &x(rank)).map_err(err)?;
    let p = buf.device_ptr();
    std::thread::scope(|scope| -> Result<(), String> {
        let calls: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(move || -> Result<(), String> {
                    for _ in 0..k {
                        // SAFETY: `buf` outlives the scope and the synchronisation below; the
                        // calls on it are ordered by the one stream.
                        let b = unsafe { cuda_multimem_collectives::Dst::<f32>::from_raw(p, len) };
                        hier.all_reduce_in_place(b, ReduceOp::Sum, s)
                            .map_err(|x| x.to_string())?;
                    }
                    Ok(())
                })
            })
            .collect();
        calls
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| "a caller panicked".to_string())?)
    })?;
    s.synchronize().map_err(err)?;
    hier.check().map_err(err)?;
    let scale = (n as f32).powi(2 * k - 1);
    let want: Vec<f32> = (0..len)
        .map(|i| scale * (0..n).map(|r| x(r)[i]).sum::<f32>())
        .collect();
    let got = buf.to_vec().map_err(err)?;
    match (0..len).find(|&i| got[i] != want[i]) {
        Some(i) => Err(format!("element {i}: got {} want {}", got[i], want[i])),
        None => Ok(()),
    }
}

#[test]
fn two_threads_calling_one_hierarchical_rank_queue_whole_calls() {
    sim_team("threads", 2, 2, contiguous, concurrent_calls);
}
