//! cudarc operands and streams (feature `cudarc`): the pointer of a cudarc slice is taken
//! against the call's cudarc stream, so cudarc's own event tracking orders our kernels after
//! earlier writes; its guards are held for the whole call.

use cuda_multimem::{Result, StreamRef};

use super::RankHandle;
use crate::call::{Call, Kind};
use crate::operand::{check_cudarc, cudarc_operand};
use crate::types::{Choice, Element, ReduceOp};

impl RankHandle<'_> {
    /// Allreduce cudarc device memory (feature `cudarc`): `input` and `output` are
    /// `CudaSlice`/`CudaView`/`CudaViewMut` of this rank's device, `stream` a cudarc stream of
    /// it; cudarc's event tracking orders the call after earlier writes of the operands. The
    /// caller's own memory: see [`RankHandle::all_reduce`] for what that costs.
    pub fn all_reduce_cudarc<T>(
        &self,
        input: &impl cudarc::driver::DevicePtr<T>,
        output: &mut impl cudarc::driver::DevicePtrMut<T>,
        op: ReduceOp,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<Choice>
    where
        T: Element + cudarc::driver::DeviceRepr,
    {
        let d = &self.local.device;
        let s = StreamRef::from_cudarc(d, stream)?;
        check_cudarc(input, d, "input")?;
        check_cudarc(output, d, "output")?;
        let (ilen, olen) = (input.len(), output.len());
        let (ip, _ri) = input.device_ptr(stream);
        let (op_, _ro) = output.device_ptr_mut(stream);
        let i = cudarc_operand::<T>(ip, ilen, d);
        let o = cudarc_operand::<T>(op_, olen, d);
        self.run(
            Call::collective(Kind::AllReduce, T::DTYPE, op, 0, Some(i), o),
            s,
        )
    }

    /// [`RankHandle::all_reduce_cudarc`] in place.
    pub fn all_reduce_cudarc_in_place<T>(
        &self,
        buf: &mut impl cudarc::driver::DevicePtrMut<T>,
        op: ReduceOp,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<Choice>
    where
        T: Element + cudarc::driver::DeviceRepr,
    {
        let d = &self.local.device;
        let s = StreamRef::from_cudarc(d, stream)?;
        check_cudarc(buf, d, "buf")?;
        let len = buf.len();
        let (p, _r) = buf.device_ptr_mut(stream);
        let b = cudarc_operand::<T>(p, len, d);
        self.run(
            Call::collective(Kind::AllReduce, T::DTYPE, op, 0, None, b),
            s,
        )
    }
}
