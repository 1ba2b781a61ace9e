"""The engine's noise for the hires fix fixture: tests/fixtures/tiny-pt-hires/noise.npz.

    .venv/bin/python -m tools.hires_noise        (the runtime's venv: JAX, no torch)

Hires fix draws two noises per image (program/generate.py): the first pass's initial noise,
``normal(key(seed_i), (C, h, w))`` at the base size, and the second pass's,
``normal(fold_in(key(seed_i), HIRES_NOISE), (C, H, W))`` at the large size. diffusers draws its own with torch;
so that the pipelines' images can be compared, this writes the engine's, and ``python -m tools.fixtures_hires``
(torch venv) hands them to diffusers (the txt2img pipeline's ``latents``, the img2img pipeline's ``randn_tensor``).
Run this first.

The file holds ``seeds`` (2,) uint32, ``noise`` (2, 4, 16, 16) and ``hires_noise`` (2, 4, 24, 24) float32 (tiny-pt:
VAE factor 4, 64x64 then 96x96). tests/program/test_generate_hires.py checks that the engine's rules still give them
exactly.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from sdxl_engine.program.generate import HIRES_NOISE, initial_noise
from tools.lcm_noise import write_npz

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tiny-pt-hires" / "noise.npz"
SEEDS = (41, 42)  # the two images' seeds
SHAPE, HIRES_SHAPE = (4, 16, 16), (4, 24, 24)  # tiny-pt's latents at 64x64 and at 96x96 (scale 1.5)


def main() -> None:
    seeds = jnp.asarray(SEEDS, jnp.uint32)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    write_npz(OUT, {"seeds": np.asarray(SEEDS, np.uint32),
                    "noise": np.asarray(initial_noise(seeds, SHAPE), np.float32),
                    "hires_noise": np.asarray(initial_noise(seeds, HIRES_SHAPE, HIRES_NOISE), np.float32)})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
