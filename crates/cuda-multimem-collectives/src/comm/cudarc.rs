//! The cudarc-named allreduce (feature `cudarc`), kept for code written before every
//! collective took cudarc operands: each is [`RankHandle::all_reduce`] /
//! [`RankHandle::all_reduce_in_place`] on a [`Src::from_cudarc`] / [`Dst::from_cudarc`] of any
//! `DevicePtr` (the operands hold cudarc's guards until the call returns).

use cuda_multimem::{IntoStream, Result};

use super::RankHandle;
use crate::operand::{Dst, Src};
use crate::types::{Choice, Element, ReduceOp};

impl RankHandle<'_> {
    /// Allreduce cudarc device memory (feature `cudarc`): `input` and `output` are anything
    /// cudarc reads and writes through `DevicePtr`/`DevicePtrMut` (`CudaSlice`, `CudaView`,
    /// `CudaViewMut`) of this rank's device, `stream` a cudarc stream of it. The same as
    /// [`RankHandle::all_reduce`], which takes cudarc slices, views and streams directly.
    pub fn all_reduce_cudarc<T: Element>(
        &self,
        input: &impl cudarc::driver::DevicePtr<T>,
        output: &mut impl cudarc::driver::DevicePtrMut<T>,
        op: ReduceOp,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let i = Src::from_cudarc(input, &on, "input")?;
        let o = Dst::from_cudarc(output, &on, "output")?;
        self.all_reduce(i, o, op, on.stream())
    }

    /// [`RankHandle::all_reduce_cudarc`] in place: the same as
    /// [`RankHandle::all_reduce_in_place`].
    pub fn all_reduce_cudarc_in_place<T: Element>(
        &self,
        buf: &mut impl cudarc::driver::DevicePtrMut<T>,
        op: ReduceOp,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<Choice> {
        let on = stream.into_stream(self.device())?;
        let b = Dst::from_cudarc(buf, &on, "buf")?;
        self.all_reduce_in_place(b, op, on.stream())
    }
}
