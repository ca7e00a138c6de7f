//! Graph management: instantiating, launching and destroying captured graphs.

use cuda_multimem_sys::*;

use super::gate::{out, sim_api};
use crate::model::stream;

sim_api! {
    cuGraphInstantiateWithFlags @ 11040 as PFN_cuGraphInstantiateWithFlags_v11040 => fn graph_instantiate(st, exec: *mut CUgraphExec, graph: CUgraph, flags: u64) {
        let e = stream::instantiate(st, graph)?;
        out(exec, e as CUgraphExec)
    }
    cuGraphLaunch @ 10000 as PFN_cuGraphLaunch_v10000 => fn graph_launch(st, exec: CUgraphExec, h: CUstream) {
        stream::launch_graph(st, exec, h)
    }
    cuGraphDestroy @ 10000 as PFN_cuGraphDestroy_v10000 => fn graph_destroy(st, graph: CUgraph) {
        stream::destroy_graph(st, graph)
    }
    cuGraphExecDestroy @ 10000 as PFN_cuGraphExecDestroy_v10000 => fn graph_exec_destroy(st, exec: CUgraphExec) {
        stream::destroy_graph_exec(st, exec)
    }
}
