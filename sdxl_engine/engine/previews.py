"""Live previews: the current x0 estimate, mapped from latents to RGB by one linear map.

A preview is ``rgb = x0ᵀ F + bias`` per latent pixel (F: (C, 3), bias: (3,)), in [-1, 1] like the
VAE's output, then to uint8 as :func:`sdxl_engine.program.generate.decode` does: no VAE, so it
costs a (C x 3) product per latent pixel on the host, at latent resolution (H/f x W/f).

The factors:

* SDXL-family models (4 latent channels, no file of their own): SDXL's published factors,
  ComfyUI ``comfy/latent_formats.py`` class ``SDXL`` (``latent_rgb_factors`` and
  ``latent_rgb_factors_bias``; applied in ``comfy/latent_preview.py``'s ``Latent2RGBPreviewer`` to
  the x0 in the UNet's latent space, scaling factor applied, as here).
* A model folder may ship its own, :data:`FACTORS_FILE` (``{"factors": [[r, g, b] x C], "bias":
  [r, g, b]}``): tiny-shapes does, fitted by least squares to its own VAE's decodes
  (``python -m tools.fit_preview``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

FACTORS_FILE = "latent_rgb.json"

# ComfyUI comfy/latent_formats.py, class SDXL: rows are latent channels 0..3, columns R, G, B.
SDXL_FACTORS = ((0.3651, 0.4232, 0.4341),
                (-0.2533, -0.0042, 0.1068),
                (0.1076, 0.1111, -0.0362),
                (-0.3165, -0.2492, -0.2188))
SDXL_BIAS = (0.1084, -0.0175, -0.0011)


@dataclasses.dataclass(frozen=True)
class LatentRGB:
    """A latents -> RGB linear map: ``factors`` (C, 3) float32, ``bias`` (3,) float32; ``source`` says where from."""

    factors: np.ndarray
    bias: np.ndarray
    source: str

    def __call__(self, x0: np.ndarray) -> np.ndarray:
        """(b, C, h, w) float32 latents (the UNet's space) -> (b, h, w, 3) uint8 RGB, 0..255."""
        rgb = np.einsum("bchw,cr->bhwr", np.asarray(x0, np.float32), self.factors) + self.bias  # [-1, 1]
        return np.round(np.clip(rgb / 2 + 0.5, 0.0, 1.0) * 255).astype(np.uint8)


def latent_rgb_for(folder: str, latent_channels: int) -> LatentRGB | None:
    """The preview map of a model: its folder's :data:`FACTORS_FILE`, else SDXL's factors for 4
    latent channels, else None (no previews).

    Raises ValueError naming the file when it exists but does not hold (C, 3) factors and (3,) bias.
    """
    path = Path(folder) / FACTORS_FILE if folder else None
    if path is not None and path.is_file():
        data = json.loads(path.read_text())
        factors, bias = np.asarray(data.get("factors"), np.float32), np.asarray(data.get("bias"), np.float32)
        if factors.shape != (latent_channels, 3) or bias.shape != (3,):
            raise ValueError(f"{path}: expected factors ({latent_channels}, 3) and bias (3,), "
                             f"got {factors.shape} and {bias.shape}")
        return LatentRGB(factors, bias, str(path))
    if latent_channels == 4:
        return LatentRGB(np.asarray(SDXL_FACTORS, np.float32), np.asarray(SDXL_BIAS, np.float32),
                         "SDXL's published factors (ComfyUI latent_formats.SDXL)")
    return None


def fit_latent_rgb(latents: np.ndarray, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares factors and bias mapping latents to their decoded images.

    Args:
        latents: (n, C, h, w) float32, the UNet's latent space.
        images: (n, H, W, 3) uint8 decodes of them, H = f h; average-pooled f x f to latent
            resolution and taken to [-1, 1] before the fit.
    Returns:
        factors (C, 3) and bias (3,), float32, minimising the squared error over every latent pixel.
    """
    n, c, h, w = latents.shape
    f = images.shape[1] // h
    target = images.astype(np.float64).reshape(n, h, f, w, f, 3).mean(axis=(2, 4)) / 127.5 - 1.0  # (n, h, w, 3)
    x = latents.astype(np.float64).transpose(0, 2, 3, 1).reshape(-1, c)
    design = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)  # (pixels, C + 1)
    solution, *_ = np.linalg.lstsq(design, target.reshape(-1, 3), rcond=None)
    return solution[:c].astype(np.float32), solution[c].astype(np.float32)


def preview_grid(previews: np.ndarray) -> np.ndarray:
    """The batch's previews as one image, as AUTOMATIC1111 shows a batch's live preview by default
    (option ``show_progress_grid``: modules/sd_samplers_common.py ``samples_to_image_grid``, laid
    out by modules/images.py ``image_grid`` with its default ``n_rows = -1``: rows = round(sqrt(n)),
    columns = ceil(n / rows); empty cells black). 4 images -> 2 x 2, 2 -> 1 x 2, 1 -> itself.

    ``previews``: (n, h, w, 3) uint8 (n >= 1) -> (rows*h, cols*w, 3) uint8; a (h, w, 3) image is returned
    as it is. One image per preview instead of n: each file a client fetches costs it a round trip.

    Raises ValueError for an empty batch.
    """
    previews = np.asarray(previews)
    if previews.ndim == 3:
        return previews
    n, h, w, c = previews.shape
    if n == 0:
        raise ValueError("preview_grid: no previews")
    rows = min(n, max(1, round(n ** 0.5)))
    cols = -(-n // rows)
    grid = np.zeros((rows * h, cols * w, c), previews.dtype)
    for i, image in enumerate(previews):
        r, k = divmod(i, cols)
        grid[r * h:(r + 1) * h, k * w:(k + 1) * w] = image
    return grid
