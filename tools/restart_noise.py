"""The engine's step noise for the Restart image fixtures: tests/fixtures/restart-noise.npz.

    .venv/bin/python -m tools.restart_noise        (the runtime's venv: JAX, no torch)

A1111's Restart adds fresh noise (torch.randn_like) before each step that jumps back up; the engine draws it as the
step noise of the step before the jump (program/generate.py ``step_noise``: image i's noise at step k is
``jax.random.normal(jax.random.fold_in(jax.random.key(seed_i), k + 1), (C, h, w))``). So that the two can be
compared, this writes the engine's step noise for the fixture's seeds and ``python -m tools.make_fixtures restart``
(torch venv) hands row k to A1111's loop where the engine's step k adds it. Run this first.

The file holds ``seeds`` (2,) uint32 and, per image case (:data:`CASES`: steps, latents' (C, h, w)), ``<case>_steps``
(k,) int32, the steps that add noise in the engine's Restart schedule of tiny-pt's scheduler config (its ``d`` not 0),
and ``<case>_noise`` (k, 2, C, h, w) float32, their noise. tests/program/test_generate_restart.py checks that the
engine's schedule and rule still give these arrays exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from sdxl_engine.program.generate import step_noise
from sdxl_engine.program.schedulers import make_schedule
from tools.lcm_noise import write_npz

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
OUT = FIXTURES / "restart-noise.npz"
SEEDS = (11, 12)  # the two images' seeds (the image cases' latents are given, so only the step noise uses them)
# image case -> (steps, tiny-pt's latents (C, h, w): VAE factor 4). 20 steps: one restart stretch; 36: two, not square.
CASES = {"restart_image": (20, (4, 16, 16)), "restart36_image": (36, (4, 16, 24))}


def restart_noise(steps: int, shape: tuple[int, int, int], seeds=SEEDS) -> tuple[np.ndarray, np.ndarray]:
    """(the steps whose Restart schedule on tiny-pt adds noise (k,) int32, their noise (k, len(seeds), *shape) float32
    by the program's own ``step_noise``)."""
    config = json.loads((FIXTURES / "tiny-pt" / "scheduler" / "scheduler_config.json").read_text())
    jumps = np.flatnonzero(make_schedule("Restart", config, steps).d).astype(np.int32)
    ids = jnp.asarray(seeds, jnp.uint32)
    return jumps, np.stack([np.asarray(step_noise(ids, int(k), shape)) for k in jumps]).astype(np.float32)


def main() -> None:
    arrays = {"seeds": np.asarray(SEEDS, np.uint32)}
    for name, (steps, shape) in CASES.items():
        arrays[f"{name}_steps"], arrays[f"{name}_noise"] = restart_noise(steps, shape)
    write_npz(OUT, arrays)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
