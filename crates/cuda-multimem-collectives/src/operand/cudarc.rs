//! cudarc operands (feature `cudarc`): a `CudaSlice`, `CudaView` or `CudaViewMut` becomes a
//! [`Src`] or [`Dst`] of the caller's own memory. Its device pointer is taken against the call's
//! cudarc stream (cudarc then makes that stream wait for the slice's earlier writes, or reads
//! and writes), and the guard cudarc hands out with it stays in the `Src`/`Dst`, which the call
//! holds until it has queued its work: dropping it then records the call's use for cudarc's
//! event tracking. Only device pointers, streams and contexts are taken from cudarc.

use cuda_multimem::{CallStream, Device, Error, Result};
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice,
};

use super::{BoundTo, Dst, IntoDst, IntoSrc, Keep, Operand, Src};

/// The call's cudarc stream: a cudarc operand needs one.
fn cudarc_stream<'a>(on: &CallStream<'a>, arg: &'static str) -> Result<&'a CudaStream> {
    on.cudarc().ok_or_else(|| {
        Error::invalid(
            arg,
            "a cudarc slice, but the call's stream is not a cudarc stream (cudarc's event tracking records a use on the stream it is queued on): pass the CudaStream as the call's stream",
        )
    })
}

/// Refuse a cudarc slice (`arg`) that does not live in `device`'s primary context: its pointer
/// would reach another device's memory, or none, from this rank's kernels.
fn check_cudarc<T, S: DeviceSlice<T>>(slice: &S, device: &Device, arg: &'static str) -> Result<()> {
    let ctx = slice.stream().context();
    let theirs = ctx.cu_ctx();
    let ours = device.primary_context()?;
    if ctx.ordinal() != device.ordinal() as usize
        || !std::ptr::eq(theirs.cast::<std::ffi::c_void>(), ours.cast())
    {
        return Err(Error::invalid(
            arg,
            format!(
                "a cudarc slice of device {} (context {theirs:p}); expected device {}'s primary context {ours:p}",
                ctx.ordinal(),
                device.ordinal()
            ),
        ));
    }
    Ok(())
}

impl<'a, T> Src<'a, T> {
    /// A cudarc slice or view (anything cudarc reads through [`DevicePtr`]) as the input named
    /// `arg` of a call queued on `on`, a cudarc stream of the call's device (feature `cudarc`):
    /// what an engine's [`IntoSrc`] for its own tensor type returns. Refused, naming `arg`, when
    /// `on` is not a cudarc stream or the slice is not in the device's primary context.
    ///
    /// The returned `Src` holds cudarc's guard, and through it borrows the slice and the
    /// stream, until the call that takes it returns:
    ///
    /// ```no_run
    /// use cuda_multimem_collectives::{CallStream, IntoSrc, IntoStream, RankHandle, ReduceOp, Src};
    /// use cudarc::driver::{CudaSlice, CudaStream};
    ///
    /// /// An engine's tensor: a cudarc slice and a shape.
    /// struct Tensor {
    ///     data: CudaSlice<f32>,
    ///     shape: Vec<usize>,
    /// }
    ///
    /// impl<'a> IntoSrc<'a, f32> for &'a Tensor {
    ///     fn into_src<'g>(
    ///         self,
    ///         on: &CallStream<'g>,
    ///         arg: &'static str,
    ///     ) -> cuda_multimem::Result<Src<'g, f32>>
    ///     where
    ///         'a: 'g,
    ///     {
    ///         Src::from_cudarc(&self.data, on, arg)
    ///     }
    /// }
    ///
    /// fn layer(
    ///     h: RankHandle<'_>,
    ///     x: &Tensor,
    ///     out: &mut CudaSlice<f32>,
    ///     stream: &CudaStream,
    /// ) -> cuda_multimem::Result<()> {
    ///     h.all_reduce(x, out, ReduceOp::Sum, stream)?;
    ///     Ok(())
    /// }
    ///
    /// /// An operand made before the call holds the guard until the call returns.
    /// fn late(
    ///     h: RankHandle<'_>,
    ///     y: CudaSlice<f32>,
    ///     out: &mut CudaSlice<f32>,
    ///     stream: &CudaStream,
    /// ) -> cuda_multimem::Result<()> {
    ///     let on = stream.into_stream(h.device())?;
    ///     let input = Src::from_cudarc(&y, &on, "input")?;
    ///     h.all_reduce(input, out, ReduceOp::Max, stream)?;
    ///     drop(y);
    ///     Ok(())
    /// }
    /// ```
    ///
    /// The slice cannot go while the operand (and cudarc's guard) lives (`late` with the
    /// `drop` one line earlier; the error code is checked on nightly only):
    ///
    /// ```compile_fail,E0505
    /// # use cuda_multimem_collectives::{IntoStream, RankHandle, ReduceOp, Src};
    /// # use cudarc::driver::{CudaSlice, CudaStream};
    /// fn early(
    ///     h: RankHandle<'_>,
    ///     y: CudaSlice<f32>,
    ///     out: &mut CudaSlice<f32>,
    ///     stream: &CudaStream,
    /// ) -> cuda_multimem::Result<()> {
    ///     let on = stream.into_stream(h.device())?;
    ///     let input = Src::from_cudarc(&y, &on, "input")?;
    ///     drop(y); // cannot move out of `y` because it is borrowed
    ///     h.all_reduce(input, out, ReduceOp::Max, stream)?;
    ///     Ok(())
    /// }
    /// ```
    pub fn from_cudarc<P: DevicePtr<T>>(
        slice: &'a P,
        on: &CallStream<'a>,
        arg: &'static str,
    ) -> Result<Src<'a, T>> {
        let stream = cudarc_stream(on, arg)?;
        check_cudarc(slice, on.device(), arg)?;
        let len = slice.len();
        let (ptr, guard) = slice.device_ptr(stream);
        let op = Operand::local::<T>(ptr, len, Some(on.device()));
        Ok(Src::kept(op, Keep::Cudarc(guard), Some(BoundTo::of(on))))
    }

    /// [`Src::from_cudarc`] for a view taken by value (`slice.slice(a..b)`: the guard borrows
    /// what the view borrows).
    pub fn from_cudarc_view(
        view: CudaView<'a, T>,
        on: &CallStream<'a>,
        arg: &'static str,
    ) -> Result<Src<'a, T>> {
        let stream = cudarc_stream(on, arg)?;
        check_cudarc(&view, on.device(), arg)?;
        let len = view.len();
        let (ptr, guard) = view.view_ptr(stream);
        let op = Operand::local::<T>(ptr, len, Some(on.device()));
        Ok(Src::kept(op, Keep::Cudarc(guard), Some(BoundTo::of(on))))
    }
}

impl<'a, T> Dst<'a, T> {
    /// A cudarc slice or view (anything cudarc writes through [`DevicePtrMut`]) as the output
    /// named `arg` of a call queued on `on` (feature `cudarc`). As [`Src::from_cudarc`]; the
    /// slice is borrowed mutably until the call returns, so nothing reads what the call is
    /// still to write (`read_after` below with the read one line earlier):
    ///
    /// ```compile_fail,E0502
    /// # use cuda_multimem_collectives::{Dst, IntoStream, RankHandle, ReduceOp};
    /// # use std::sync::Arc;
    /// # use cudarc::driver::{CudaSlice, CudaStream};
    /// fn read_too_soon(
    ///     h: RankHandle<'_>,
    ///     x: &CudaSlice<f32>,
    ///     mut out: CudaSlice<f32>,
    ///     stream: &Arc<CudaStream>,
    /// ) -> cuda_multimem::Result<()> {
    ///     let on = stream.into_stream(h.device())?;
    ///     let output = Dst::from_cudarc(&mut out, &on, "output")?;
    ///     let _host = stream.clone_dtoh(&out); // `out` is borrowed mutably by `output`
    ///     h.all_reduce(x, output, ReduceOp::Sum, stream)?;
    ///     Ok(())
    /// }
    /// ```
    ///
    /// ```no_run
    /// # use cuda_multimem_collectives::{Dst, IntoStream, RankHandle, ReduceOp};
    /// # use std::sync::Arc;
    /// # use cudarc::driver::{CudaSlice, CudaStream};
    /// fn read_after(
    ///     h: RankHandle<'_>,
    ///     x: &CudaSlice<f32>,
    ///     mut out: CudaSlice<f32>,
    ///     stream: &Arc<CudaStream>,
    /// ) -> cuda_multimem::Result<()> {
    ///     let on = stream.into_stream(h.device())?;
    ///     let output = Dst::from_cudarc(&mut out, &on, "output")?;
    ///     h.all_reduce(x, output, ReduceOp::Sum, stream)?;
    ///     let _host = stream.clone_dtoh(&out);
    ///     Ok(())
    /// }
    /// ```
    pub fn from_cudarc<P: DevicePtrMut<T>>(
        slice: &'a mut P,
        on: &CallStream<'a>,
        arg: &'static str,
    ) -> Result<Dst<'a, T>> {
        let stream = cudarc_stream(on, arg)?;
        check_cudarc(&*slice, on.device(), arg)?;
        let len = slice.len();
        let (ptr, guard) = slice.device_ptr_mut(stream);
        let op = Operand::local::<T>(ptr, len, Some(on.device()));
        Ok(Dst::kept(op, Keep::Cudarc(guard), Some(BoundTo::of(on))))
    }

    /// [`Dst::from_cudarc`] for a mutable view taken by value (`slice.slice_mut(a..b)`).
    pub fn from_cudarc_view(
        view: CudaViewMut<'a, T>,
        on: &CallStream<'a>,
        arg: &'static str,
    ) -> Result<Dst<'a, T>> {
        let stream = cudarc_stream(on, arg)?;
        check_cudarc(&view, on.device(), arg)?;
        let len = view.len();
        let (ptr, guard) = view.view_ptr_mut(stream);
        let op = Operand::local::<T>(ptr, len, Some(on.device()));
        Ok(Dst::kept(op, Keep::Cudarc(guard), Some(BoundTo::of(on))))
    }
}

impl<'a, T> IntoSrc<'a, T> for &'a CudaSlice<T> {
    fn into_src<'g>(self, on: &CallStream<'g>, arg: &'static str) -> Result<Src<'g, T>>
    where
        'a: 'g,
    {
        Src::from_cudarc(self, on, arg)
    }
}

impl<'a, 'v, T> IntoSrc<'a, T> for &'a CudaView<'v, T> {
    fn into_src<'g>(self, on: &CallStream<'g>, arg: &'static str) -> Result<Src<'g, T>>
    where
        'a: 'g,
    {
        Src::from_cudarc(self, on, arg)
    }
}

impl<'a, T> IntoSrc<'a, T> for CudaView<'a, T> {
    fn into_src<'g>(self, on: &CallStream<'g>, arg: &'static str) -> Result<Src<'g, T>>
    where
        'a: 'g,
    {
        Src::from_cudarc_view(self, on, arg)
    }
}

impl<'a, 'v, T> IntoSrc<'a, T> for &'a CudaViewMut<'v, T> {
    fn into_src<'g>(self, on: &CallStream<'g>, arg: &'static str) -> Result<Src<'g, T>>
    where
        'a: 'g,
    {
        Src::from_cudarc(self, on, arg)
    }
}

impl<'a, T> IntoDst<'a, T> for &'a mut CudaSlice<T> {
    fn into_dst<'g>(self, on: &CallStream<'g>, arg: &'static str) -> Result<Dst<'g, T>>
    where
        'a: 'g,
    {
        Dst::from_cudarc(self, on, arg)
    }
}

impl<'a, 'v, T> IntoDst<'a, T> for &'a mut CudaViewMut<'v, T> {
    fn into_dst<'g>(self, on: &CallStream<'g>, arg: &'static str) -> Result<Dst<'g, T>>
    where
        'a: 'g,
    {
        Dst::from_cudarc(self, on, arg)
    }
}

impl<'a, T> IntoDst<'a, T> for CudaViewMut<'a, T> {
    fn into_dst<'g>(self, on: &CallStream<'g>, arg: &'static str) -> Result<Dst<'g, T>>
    where
        'a: 'g,
    {
        Dst::from_cudarc_view(self, on, arg)
    }
}
