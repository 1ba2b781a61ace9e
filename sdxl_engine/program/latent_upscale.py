"""Hires fix's latent upscalers: the first pass's latents resized to the second pass's size, on the devices.

AUTOMATIC1111's latent upscalers (``modules/shared.py`` ``latent_upscale_modes``) are torch's
``F.interpolate(latents, size=(H // f, W // f), mode=..., antialias=...)`` with ``align_corners`` unset
(False for the linear and cubic modes). Each is separable, so a resize is one (out, in) matrix per axis and
the upscale is ``rows @ x @ cols.T`` per image and channel (:func:`upscale_latents`). The matrices are made
on the host with torch's own index and weight rules (:func:`resize_matrix`) and passed as arrays, so every
upscaler runs on one compiled function per pair of sizes: changing the upscaler compiles nothing.

Why not ``jax.image.resize``: its ``linear`` is torch's bilinear (half-pixel centres; at the border JAX
renormalizes the weights over the pixels inside and torch clamps the index, which for a 2-tap linear kernel
gives the same value), but its ``cubic`` is Keys' a = -0.5 with renormalized borders where torch's bicubic
is a = -0.75 with clamped indices, and its ``nearest`` is torch's ``nearest-exact``, not ``nearest``.
tests/program/test_generate_hires.py checks every mode against torch's outputs stored in the hires fixture.
"""

from __future__ import annotations

import functools
import math

import numpy as np

# JAX is imported where it is used: engine/validation.py reads HIRES_UPSCALERS, and stays free of JAX.

# A1111's latent upscaler name -> (torch interpolate mode, antialias); "Latent" is its default.
HIRES_UPSCALERS = {
    "Latent": ("bilinear", False),
    "Latent (antialiased)": ("bilinear", True),
    "Latent (bicubic)": ("bicubic", False),
    "Latent (bicubic antialiased)": ("bicubic", True),
    "Latent (nearest)": ("nearest", False),
    "Latent (nearest-exact)": ("nearest-exact", False),
}
DEFAULT_UPSCALER = "Latent"

_CUBIC_A = -0.75  # torch's bicubic (upsample_bicubic2d); its antialiased bicubic uses -0.5 (PIL's), see _aa_filter


def _cubic_weights(t: float, a: float) -> tuple[float, float, float, float]:
    """torch's ``get_cubic_upsample_coefficients``: the weights of pixels floor(x) - 1 .. floor(x) + 2,
    t = x - floor(x)."""
    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _aa_filter(x: float, mode: str) -> float:
    """The kernel of torch's antialiased interpolate (``_upsample_bilinear2d_aa``, ``_upsample_bicubic2d_aa``)."""
    x = abs(x)
    if mode == "bilinear":
        return max(0.0, 1.0 - x)
    a = -0.5
    if x < 1:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a if x < 2 else 0.0


def resize_matrix(n_in: int, n_out: int, upscaler: str) -> np.ndarray:
    """(n_out, n_in) float32: row i holds the weights of the input pixels output pixel i reads, as torch's
    ``F.interpolate(..., size=n_out, mode, align_corners=False, antialias)`` of the A1111 ``upscaler``
    (:data:`HIRES_UPSCALERS`) computes them along one axis (scale = n_in / n_out, float32 as torch has it).

    Raises KeyError for an unknown upscaler name.
    """
    mode, antialias = HIRES_UPSCALERS[upscaler]
    scale = float(np.float32(n_in) / np.float32(n_out))  # torch: compute_scales_value, float for float inputs
    m = np.zeros((n_out, n_in), np.float64)
    for i in range(n_out):
        if antialias:  # torch's _compute_index_ranges_weights: a kernel support widened when downscaling only
            support = (2.0 if mode == "bilinear" else 4.0) * 0.5 * max(scale, 1.0)
            center, inv = scale * (i + 0.5), 1.0 / max(scale, 1.0)
            lo = max(int(center - support + 0.5), 0)
            hi = min(int(center + support + 0.5), n_in)
            w = np.array([_aa_filter((j - center + 0.5) * inv, mode) for j in range(lo, hi)])
            m[i, lo:hi] = w / w.sum() if w.sum() else w
        elif mode == "nearest":  # floor(i x scale) in float32
            m[i, min(int(math.floor(np.float32(i) * np.float32(scale))), n_in - 1)] = 1.0
        elif mode == "nearest-exact":  # floor((i + 0.5) x scale)
            m[i, min(int(math.floor((i + 0.5) * scale)), n_in - 1)] = 1.0
        elif mode == "bilinear":  # area_pixel_compute_source_index: half-pixel centres, clamped at 0
            x = max(scale * (i + 0.5) - 0.5, 0.0)
            i0 = min(int(x), n_in - 1)
            t = min(max(x - i0, 0.0), 1.0)
            m[i, i0] += 1.0 - t
            m[i, min(i0 + 1, n_in - 1)] += t
        else:  # bicubic: 4 taps around floor(x), indices clamped to the image
            x = scale * (i + 0.5) - 0.5
            i0 = math.floor(x)
            for k, w in enumerate(_cubic_weights(x - i0, _CUBIC_A)):
                m[i, min(max(i0 - 1 + k, 0), n_in - 1)] += w
    return m.astype(np.float32)


def upscale_latents(latents, rows, cols):
    """(b, C, h, w) float32 latents -> (b, C, H, W): ``rows`` (H, h) and ``cols`` (W, w) from :func:`resize_matrix`
    applied along height and width, float32 at full precision (no TF32 / bfloat16 passes on accelerators)."""
    import jax
    import jax.numpy as jnp

    return jnp.einsum("Hh,bchw,Ww->bcHW", rows, latents, cols, precision=jax.lax.Precision.HIGHEST)


@functools.cache
def sharded_upscale(mesh):
    """:func:`upscale_latents` jitted for ``mesh`` (a jax Mesh): latents split over ``data`` (as the first pass
    returns them and the second pass takes them), the matrices replicated; one compile per pair of sizes, none per
    upscaler."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sdxl_engine.program.sharding import DATA_AXIS

    data, whole = NamedSharding(mesh, P(DATA_AXIS)), NamedSharding(mesh, P())
    return jax.jit(upscale_latents, in_shardings=(data, whole, whole), out_shardings=data)
