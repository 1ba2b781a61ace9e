"""The engine's initial noise for the img2img fixture: tests/fixtures/tiny-pt-img2img/noise.npz.

    .venv/bin/python -m tools.img2img_noise        (the runtime's venv: JAX, no torch)

img2img adds the txt2img noise of each image's seed to the image latents at the start sigma
(program/generate.py ``initial_latents``: ``jax.random.normal(jax.random.key(seed_i), (C, h, w))``).
diffusers draws its own with torch; so that the two pipelines' images can be compared, this writes the
engine's noise for the fixture's seeds, and ``python -m tools.make_fixtures img2img`` (torch venv) hands
it to diffusers' ``prepare_latents`` instead of its ``randn_tensor``. Run this first.

The file holds ``seeds`` (2,) uint32 and ``noise`` (2, C, h, w) float32. tests/program/test_generate_img2img.py
checks that the engine's rule still gives this array exactly.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from sdxl_engine.program.generate import initial_noise
from tools.lcm_noise import write_npz

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tiny-pt-img2img" / "noise.npz"
SEEDS = (41, 42)  # the two images' seeds
SHAPE = (4, 16, 16)  # tiny-pt's latents of a 64x64 image (VAE factor 4)


def img2img_noise(seeds=SEEDS, shape=SHAPE) -> np.ndarray:
    """(len(seeds), *shape) float32: each seed's initial noise, by the program's own ``initial_noise``."""
    return np.asarray(initial_noise(jnp.asarray(seeds, jnp.uint32), shape), np.float32)


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    write_npz(OUT, {"seeds": np.asarray(SEEDS, np.uint32), "noise": img2img_noise()})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
