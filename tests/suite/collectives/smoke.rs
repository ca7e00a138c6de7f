//! Every collective of the table once — both operand kinds (symmetric buffers and the
//! caller's own `DeviceBuffer`s), in place and out of place, one element type, small sizes, a
//! team of 2 on the driver `CUDA_MULTIMEM_DRIVER` selects: cheap enough for `cargo xtask test`
//! to run at every simulated driver version (and `test-hw` on real GPUs).

use cuda_multimem_collectives::float8::{F8E4M3, F8E5M2};
use cuda_multimem_collectives::{CommConfig, MulticastPolicy, ReduceOp};
use cuda_multimem_tests::collectives::{once, params_for, table, Call, Mem};
use cuda_multimem_tests::{env, skip, team_on, Rng};

#[test]
fn every_collective_in_every_form_gives_the_host_reference() {
    let e = env();
    if let Some(why) = cuda_multimem_tests::collectives_unsupported(&e.driver) {
        return skip("collectives::smoke", why);
    }
    let devices = e.driver.devices();
    if devices.len() < 2 {
        return skip(
            "collectives::smoke",
            format!("needs 2 devices, the machine has {}", devices.len()),
        );
    }
    if !devices[0].can_access_peer(&devices[1]).unwrap_or(false) {
        return skip(
            "collectives::smoke",
            "devices 0 and 1 cannot access each other",
        );
    }
    let (comm, s) = team_on(&devices[..2], CommConfig::default(), MulticastPolicy::Never);
    let mut rng = Rng::new(1);
    let mut ran = 0;
    for c in table::<f32>() {
        // one set of parameters each: the last (max for the reducing ones, the last rank as
        // the root)
        let params = *params_for(&c, 2).last().unwrap();
        let call = Call {
            name: c.name,
            params,
        };
        for count in [7, 1000] {
            for mem in Mem::KINDS {
                for in_place in [false, true] {
                    once::<f32>(&comm, &s, call, count, mem, in_place, &mut rng);
                    ran += 1;
                }
            }
        }
    }
    assert_eq!(ran, table::<f32>().len() * 8);
}

/// The allreduce and reduce-scatter sums of every type beyond f32 (f16, bf16, f64, the
/// integers, FP8) once each, both operand kinds, in place and not.
#[test]
fn every_type_reduces_to_the_host_reference() {
    let e = env();
    if let Some(why) = cuda_multimem_tests::collectives_unsupported(&e.driver) {
        return skip("collectives::smoke::every_type", why);
    }
    let devices = e.driver.devices();
    if devices.len() < 2 || !devices[0].can_access_peer(&devices[1]).unwrap_or(false) {
        return skip(
            "collectives::smoke::every_type",
            "needs 2 devices that can access each other",
        );
    }
    let (comm, s) = team_on(&devices[..2], CommConfig::default(), MulticastPolicy::Never);
    let mut rng = Rng::new(2);
    fn sweep<T: cuda_multimem_tests::collectives::Elem>(
        comm: &cuda_multimem_collectives::Communicator,
        s: &[cuda_multimem::Stream],
        rng: &mut Rng,
    ) {
        for name in ["all_reduce", "reduce_scatter"] {
            let call = Call {
                name,
                params: cuda_multimem_tests::collectives::Params::op(ReduceOp::Sum),
            };
            for mem in Mem::KINDS {
                for in_place in [false, true] {
                    once::<T>(comm, s, call, 1000, mem, in_place, rng);
                }
            }
        }
    }
    sweep::<f64>(&comm, &s, &mut rng);
    sweep::<i32>(&comm, &s, &mut rng);
    sweep::<u32>(&comm, &s, &mut rng);
    sweep::<i64>(&comm, &s, &mut rng);
    sweep::<u64>(&comm, &s, &mut rng);
    sweep::<i8>(&comm, &s, &mut rng);
    sweep::<u8>(&comm, &s, &mut rng);
    sweep::<F8E4M3>(&comm, &s, &mut rng);
    sweep::<F8E5M2>(&comm, &s, &mut rng);
}
