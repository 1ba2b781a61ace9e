"""The engine's LCM step noise for the LCM image fixture: tests/fixtures/lcm-noise.npz.

    .venv/bin/python -m tools.lcm_noise        (the runtime's venv: JAX, no torch)

diffusers' LCMScheduler draws fresh noise between steps with torch; the engine draws it with the
documented seed rule (program/generate.py ``step_noise``: image i's noise at step k is
``jax.random.normal(jax.random.fold_in(jax.random.key(seed_i), k + 1), (C, h, w))``). So that
the two pipelines' images can be compared, this writes the engine's noises for the fixture's
seeds, and ``python -m tools.make_fixtures samplers`` (torch venv) hands them to diffusers'
scheduler in order instead of its own ``randn_tensor``. Run this first.

The file holds ``seeds`` (2,) uint32 and ``noise`` (STEPS - 1, 2, C, h, w) float32: the noise of
steps 0 .. STEPS - 2 (LCM adds none after its last step). tests/program/test_generate_lcm.py checks that the
engine's rule still gives these arrays exactly.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from sdxl_engine.program.generate import step_noise

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "lcm-noise.npz"
SEEDS = (11, 12)  # the two images' seeds (the image cases' latents are given, so only the step noise uses them)
STEPS = 4  # the image cases' step count
SHAPE = (4, 16, 16)  # tiny-pt's latents of a 64x64 image (VAE factor 4)


def lcm_noise(seeds=SEEDS, steps: int = STEPS, shape=SHAPE) -> np.ndarray:
    """(steps - 1, len(seeds), *shape) float32: step k's noise of each seed, by the program's own ``step_noise``."""
    ids = jnp.asarray(seeds, jnp.uint32)
    return np.stack([np.asarray(step_noise(ids, k, shape)) for k in range(steps - 1)]).astype(np.float32)


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez's format with fixed zip timestamps, so the same arrays give the same bytes (as make_fixtures')."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for key, value in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(value), allow_pickle=False)
            zf.writestr(zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue(),
                        compress_type=zipfile.ZIP_DEFLATED)


def main() -> None:
    write_npz(OUT, {"seeds": np.asarray(SEEDS, np.uint32), "noise": lcm_noise()})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
