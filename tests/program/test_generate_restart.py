"""Restart through the compiled two-call program against A1111's loop on tiny-pt, and its noise rule.

References: tests/fixtures/restart-steps.{json,npz}'s image cases (``make_fixtures restart``: A1111's restart_sampler
re-implemented in torch on tiny-pt's text encoders, UNet and VAE, on given latents, the jumps' noise
restart-noise.npz's: the engine's step noise of seeds 11, 12 at the steps it adds it, ``python -m
tools.restart_noise``); tests/program/test_schedulers_restart.py checks every step on fixed arrays without a compile.
"""

import json

import numpy as np
import pytest

from sdxl_engine.program.schedulers import make_schedule
from tests.helpers import FIXTURES

STEPS = json.loads((FIXTURES / "restart-steps.json").read_text())
MAX_STEPS = 36  # both cases' program (TINY_PT_MAX_STEPS' 10 is under Restart's 20 steps for a restart)


@pytest.fixture(scope="module")
def arrays():
    with np.load(FIXTURES / "restart-steps.npz") as data:
        return dict(data)


def test_the_jump_noise_is_the_engines_step_noise_of_the_step_before():
    """restart-noise.npz (what the image fixtures' A1111 loop added) is the program's step noise of the seeds at the
    steps the engine's schedule adds it: normal(fold_in(key(seed_i), k + 1)) at k = the step before each jump."""
    import jax.numpy as jnp

    from sdxl_engine.program.generate import step_noise

    config = json.loads((FIXTURES / "tiny-pt" / "scheduler" / "scheduler_config.json").read_text())
    with np.load(FIXTURES / "restart-noise.npz") as data:
        noise = dict(data)
    seeds = jnp.asarray(noise["seeds"], jnp.uint32)
    for case in ("restart_image", "restart36_image"):
        meta = STEPS[f"{case}_case"]
        schedule = make_schedule("Restart", config, meta["num_inference_steps"])
        jumps = np.flatnonzero(schedule.d)
        assert jumps.tolist() == noise[f"{case}_steps"].tolist() == [j - 1 for j, _ in meta["noise_draws"]]
        shape = noise[f"{case}_noise"].shape[2:]
        for row, k in enumerate(jumps):
            assert np.array_equal(np.asarray(step_noise(seeds, int(k), shape)), noise[f"{case}_noise"][row])


@pytest.mark.engine
@pytest.mark.slow  # compiles tiny-pt's two-call program at max_steps 36 for both cases' sizes
@pytest.mark.parametrize("case", ["restart_image", "restart36_image"])
def test_restart_images_match_a1111s_loop(case, arrays, tiny_pt_programs):
    """Image level, through the compiled loop (both UNet calls per step, the jumps' noise drawn by the program from the
    seeds): A1111's restart_sampler on tiny-pt and the engine's program on the same latents agree to 4/255 max and
    0.02/255 mean, as the other two-call samplers. 20 steps at 64x64 (one stretch of 9 restart steps) and 36 at 64x96
    (not square; two stretches). The same schedule without its jumps' noise (d = 0), or with its second calls dropped
    (f = 0), is far off (mean > 1/255)."""
    import dataclasses

    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize

    meta = STEPS[f"{case}_case"]
    model, params = tiny_pt_programs.model, tiny_pt_programs.params
    latents, want = arrays[f"{case}_latents"], arrays[f"{case}_images"].astype(int)
    steps = meta["num_inference_steps"]
    shape = ProgramShape(2, meta["height"], meta["width"], max_steps=MAX_STEPS, given_latents=True, two_calls=True)
    program = tiny_pt_programs[shape]
    ids, _ = tokenize(model, meta["prompt"])
    negative, _ = tokenize(model, meta["negative_prompt"])

    def images(schedule):
        inputs = ProgramInputs.build(ids, negative, False, np.asarray(meta["seeds"], np.uint32),
                                     meta["guidance_scale"], schedule, steps, shape.max_steps, latents=latents)
        return np.asarray(program.executable(params, inputs)[0]).astype(int)

    schedule = make_schedule("Restart", meta["scheduler_config"], steps)
    pairs = np.asarray(meta["step_list"])
    assert len(pairs) == steps and np.allclose(schedule.sigmas[:steps], pairs[:, 0], rtol=1e-5)
    diff = np.abs(images(schedule) - want)
    print(f"Restart {steps} steps {meta['width']}x{meta['height']}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.02, (diff.max(), diff.mean())
    quiet = np.abs(images(dataclasses.replace(schedule, d=0 * schedule.d)) - want)
    print(f"Restart without its jumps' noise: max {quiet.max()}/255, mean {quiet.mean():.3f}/255")
    assert quiet.mean() > 1.0, (quiet.mean(), diff.mean())
    zeros = 0 * schedule.second.f
    one_call = dataclasses.replace(schedule, second=dataclasses.replace(schedule.second, f=zeros))
    off = np.abs(images(one_call) - want)
    print(f"Restart without its second calls: max {off.max()}/255, mean {off.mean():.3f}/255")
    assert off.mean() > 1.0, (off.mean(), diff.mean())
