//! The FP8 (e4m3) output of the fused norm ([`crate::RankHandle::all_reduce_add_rms_norm_fp8`])
//! and of the local one ([`crate::RankHandle::add_rms_norm_fp8`]): where the quantised rows go,
//! how they are scaled, and whether the unquantised rows are written beside them. Where each
//! variant rounds: `docs/design/rmsnorm.md` ("FP8 outputs").

use float8::F8E4M3;

use crate::operand::Dst;
use crate::types::Fp8Scaling;

/// The scales of an FP8 output: given (one for the tensor) or written by the call.
#[derive(Debug)]
pub enum Fp8Scales<'a> {
    /// One dequantisation scale for the whole tensor (finite and > 0): `q = e4m3(y / scale)`.
    Static(f32),
    /// One scale per token, `amax(row) / 448`, written to these `tokens` f32.
    PerToken(Dst<'a, f32>),
    /// One scale per group of 128 elements of a row (`hidden` a multiple of 128), written
    /// row-major to these `tokens × hidden / 128` f32.
    PerGroup(Dst<'a, f32>),
    /// One power-of-two scale per group of 128 elements, written as UE8M0 bytes packed as
    /// DeepGEMM reads them ([`Fp8Scaling::PerGroupUe8m0`]) into these
    /// `ceil(hidden / 512) · align(tokens, 4)` words ([`Fp8Scaling::scales_len`]).
    PerGroupUe8m0(Dst<'a, u32>),
}

impl Fp8Scales<'_> {
    /// Which scaling this is.
    pub fn scaling(&self) -> Fp8Scaling {
        match self {
            Fp8Scales::Static(_) => Fp8Scaling::Static,
            Fp8Scales::PerToken(_) => Fp8Scaling::PerToken,
            Fp8Scales::PerGroup(_) => Fp8Scaling::PerGroup,
            Fp8Scales::PerGroupUe8m0(_) => Fp8Scaling::PerGroupUe8m0,
        }
    }
}

/// What an FP8 norm writes besides residual_out: the quantised rows (`tokens × hidden` e4m3
/// values), their scales, and — when asked with [`Fp8Out::with_unquantised`] — the normalised
/// rows in `T` as the plain norm writes them (the values that were quantised).
///
/// ```ignore
/// let spec = Fp8Out::per_token(&mut q, &mut scales).with_unquantised(&mut out_bf16);
/// rank.all_reduce_add_rms_norm_fp8(&x, &mut residual, &weight, spec, hidden, 1e-6, &stream)?;
/// ```
#[derive(Debug)]
pub struct Fp8Out<'a, T> {
    pub(crate) out: Dst<'a, F8E4M3>,
    pub(crate) scales: Fp8Scales<'a>,
    pub(crate) unquantised: Option<Dst<'a, T>>,
}

impl<'a, T> Fp8Out<'a, T> {
    /// The quantised rows into `out`, scaled as `scales` says.
    pub fn new(out: impl Into<Dst<'a, F8E4M3>>, scales: Fp8Scales<'a>) -> Self {
        Fp8Out {
            out: out.into(),
            scales,
            unquantised: None,
        }
    }

    /// Static per-tensor scale `scale` (the dequantisation scale: `q = e4m3(y / scale)`).
    pub fn static_scale(out: impl Into<Dst<'a, F8E4M3>>, scale: f32) -> Self {
        Fp8Out::new(out, Fp8Scales::Static(scale))
    }

    /// Dynamic per-token scales (`amax(row) / 448`) written to `scales` (`tokens` f32).
    pub fn per_token(out: impl Into<Dst<'a, F8E4M3>>, scales: impl Into<Dst<'a, f32>>) -> Self {
        Fp8Out::new(out, Fp8Scales::PerToken(scales.into()))
    }

    /// Per-token-group scales (groups of 128) written to `scales` (`tokens × hidden / 128` f32,
    /// row-major).
    pub fn per_group(out: impl Into<Dst<'a, F8E4M3>>, scales: impl Into<Dst<'a, f32>>) -> Self {
        Fp8Out::new(out, Fp8Scales::PerGroup(scales.into()))
    }

    /// Per-token-group power-of-two scales written as packed UE8M0 bytes (DeepGEMM's layout:
    /// [`Fp8Scaling::PerGroupUe8m0`]).
    pub fn per_group_ue8m0(
        out: impl Into<Dst<'a, F8E4M3>>,
        scales: impl Into<Dst<'a, u32>>,
    ) -> Self {
        Fp8Out::new(out, Fp8Scales::PerGroupUe8m0(scales.into()))
    }

    /// Also write the normalised rows in `T` (`tokens × hidden`) into `out`: the "both outputs"
    /// form (the values written are exactly the ones quantised). It may be `x` itself.
    pub fn with_unquantised(mut self, out: impl Into<Dst<'a, T>>) -> Self {
        self.unquantised = Some(out.into());
        self
    }

    /// Which scaling this output has.
    pub fn scaling(&self) -> Fp8Scaling {
        self.scales.scaling()
    }
}
