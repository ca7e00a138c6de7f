//! The table's entries: one function per collective, each returning its [`Collective`]
//! description; [`table`] lists them. Adding a collective is one more function here and one
//! more line in [`table`].

use cuda_multimem_collectives::testing::{
    add_rms_norm_reference, all_gather_reference, broadcast_reference, reduce_scatter_reference,
    reference,
};
use cuda_multimem_collectives::{Dst, Src};

use super::{Collective, Compare, Elem, InPlace, Params, Side};

fn refs<T>(v: &[Vec<T>]) -> Vec<&[T]> {
    v.iter().map(|x| x.as_slice()).collect()
}

fn same_for_every_rank<T: Clone>(n: usize, v: Vec<T>) -> Vec<Vec<Vec<T>>> {
    vec![vec![v]; n]
}

fn no_sides(_: usize, _: &Params) -> Vec<Side> {
    Vec::new()
}

/// Allreduce: every rank's output is the reduction of every rank's input.
pub fn all_reduce<T: Elem>() -> Collective<T> {
    Collective {
        name: "all_reduce",
        reduces: true,
        rooted: false,
        counts: |_, count| (count, count),
        in_place: |_, _, count| InPlace {
            len: count,
            input: 0,
            output: 0,
        },
        sides: no_sides,
        bus_factor: |n| 2.0 * (n as f64 - 1.0) / n as f64,
        expected: |p, inputs, _| same_for_every_rank(inputs.len(), reference(p.op, &refs(inputs))),
        compare: &[Compare::Exact],
        call: |h, p, a, s| match a.input {
            Some(i) => h.all_reduce(i, a.output, p.op, s),
            None => h.all_reduce_in_place(a.output, p.op, s),
        },
    }
}

/// Reduce-scatter: rank r's output is chunk r of the reduction (in place: the buffer holds the
/// whole input and the result lands in its chunk r).
pub fn reduce_scatter<T: Elem>() -> Collective<T> {
    Collective {
        name: "reduce_scatter",
        reduces: true,
        rooted: false,
        counts: |n, count| (n * count, count),
        in_place: |n, r, count| InPlace {
            len: n * count,
            input: 0,
            output: r * count,
        },
        sides: no_sides,
        bus_factor: |n| (n as f64 - 1.0) / n as f64,
        expected: |p, inputs, _| {
            reduce_scatter_reference(p.op, &refs(inputs))
                .into_iter()
                .map(|w| vec![w])
                .collect()
        },
        compare: &[Compare::Exact],
        call: |h, p, a, s| match a.input {
            Some(i) => h.reduce_scatter(i, a.output, p.op, s),
            None => h.reduce_scatter_in_place(a.output, p.op, s),
        },
    }
}

/// All-gather: every rank's output is the inputs in rank order (in place: rank r's input is
/// chunk r of its buffer).
pub fn all_gather<T: Elem>() -> Collective<T> {
    Collective {
        name: "all_gather",
        reduces: false,
        rooted: false,
        counts: |n, count| (count, n * count),
        in_place: |n, r, count| InPlace {
            len: n * count,
            input: r * count,
            output: 0,
        },
        sides: no_sides,
        bus_factor: |n| (n as f64 - 1.0) / n as f64,
        expected: |_, inputs, _| {
            same_for_every_rank(inputs.len(), all_gather_reference(&refs(inputs)))
        },
        compare: &[Compare::Exact],
        call: |h, _, a, s| match a.input {
            Some(i) => h.all_gather(i, a.output, s),
            None => h.all_gather_in_place(a.output, s),
        },
    }
}

/// Broadcast: every rank's output is the root's input.
pub fn broadcast<T: Elem>() -> Collective<T> {
    Collective {
        name: "broadcast",
        reduces: false,
        rooted: true,
        counts: |_, count| (count, count),
        in_place: |_, _, count| InPlace {
            len: count,
            input: 0,
            output: 0,
        },
        sides: no_sides,
        bus_factor: |_| 1.0,
        expected: |p, inputs, _| {
            same_for_every_rank(inputs.len(), broadcast_reference(&refs(inputs), p.root))
        },
        compare: &[Compare::Exact],
        call: |h, p, a, s| match a.input {
            Some(i) => h.broadcast(i, a.output, p.root, s),
            None => h.broadcast_in_place(a.output, p.root, s),
        },
    }
}

/// The fused allreduce + residual add + RMSNorm: `count` elements of x per rank in rows of
/// [`Params::row`]; further operands the residual (read and written) and the weight; results
/// `out` (within the documented tolerance) and residual_out (bit for bit). In place: `out` is
/// `x` itself.
pub fn all_reduce_add_rms_norm<T: Elem>() -> Collective<T> {
    Collective {
        name: "all_reduce_add_rms_norm",
        reduces: false,
        rooted: false,
        counts: |_, count| (count, count),
        in_place: |_, _, count| InPlace {
            len: count,
            input: 0,
            output: 0,
        },
        sides: |count, p| {
            vec![
                Side {
                    name: "residual",
                    len: count,
                    written: true,
                },
                Side {
                    name: "weight",
                    len: p.row(count),
                    written: false,
                },
            ]
        },
        bus_factor: |n| 2.0 * (n as f64 - 1.0) / n as f64,
        expected: |p, inputs, sides| {
            let count = inputs[0].len();
            let (res, out) =
                add_rms_norm_reference(&refs(inputs), &sides[0], &sides[1], p.row(count), p.eps);
            vec![vec![out, res]; inputs.len()]
        },
        compare: &[Compare::RmsNorm, Compare::Exact],
        call: |h, p, a, s| {
            let mut side = a.side.into_iter();
            let (residual, weight) = (side.next().unwrap().dst(), side.next().unwrap().src());
            let hidden = p.row(a.raw.1);
            match a.input {
                Some(x) => {
                    h.all_reduce_add_rms_norm(x, residual, weight, a.output, hidden, p.eps, s)
                }
                None => {
                    // SAFETY: the case's own buffer (`Args::raw`), alive until the case is
                    // dropped after its streams are synchronised; x and out are the one range.
                    let (x, out) = unsafe {
                        (
                            Src::<T>::from_raw(a.raw.0, a.raw.1),
                            Dst::<T>::from_raw(a.raw.0, a.raw.1),
                        )
                    };
                    h.all_reduce_add_rms_norm(x, residual, weight, out, hidden, p.eps, s)
                }
            }
        },
    }
}

/// Every collective of the table, at `T`.
pub fn table<T: Elem>() -> Vec<Collective<T>> {
    vec![
        all_reduce(),
        reduce_scatter(),
        all_gather(),
        broadcast(),
        all_reduce_add_rms_norm(),
    ]
}

/// The entry named `name`, at `T`.
pub fn collective<T: Elem>(name: &str) -> Collective<T> {
    table::<T>()
        .into_iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no collective {name} in the table"))
}
