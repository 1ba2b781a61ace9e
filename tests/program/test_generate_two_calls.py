"""Heun, DPM2 and DPM2 a through the compiled two-call program against diffusers' images, and what the program shape
shares.

References: tests/fixtures/two-call-steps.{json,npz}'s image cases (``make_fixtures two-call-samplers``: tiny-pt's
StableDiffusionXLPipeline with HeunDiscreteScheduler / KDPM2DiscreteScheduler / KDPM2AncestralDiscreteScheduler from
its config, on given latents, DPM2 a's step noise the engine's for the case's seeds (lcm-noise.npz);
tests/program/test_schedulers_two_calls.py checks every step on fixed arrays without a compile)."""

import json

import numpy as np
import pytest

from sdxl_engine.program.schedulers import TWO_CALLS, make_schedule
from tests.helpers import FIXTURES, TINY_PT_MAX_STEPS

STEPS = json.loads((FIXTURES / "two-call-steps.json").read_text())


@pytest.fixture(scope="module")
def arrays():
    with np.load(FIXTURES / "two-call-steps.npz") as data:
        return dict(data)


@pytest.mark.engine
@pytest.mark.slow  # compiles tiny-pt's two-call program (the session's, once) at the fixture's shape
@pytest.mark.parametrize("case", ["heun_image", "dpm2_image", "dpm2a_image"])
def test_two_call_images_match_diffusers(case, arrays, tiny_pt_programs):
    """Image level, through the compiled loop's two UNet calls per step (CFG, the second call's timestep and input
    scaling, the last step's skipped call): tiny-pt's pipeline with the sampler's class and the engine's two-call
    program on the same latents agree to 4/255 max and 0.02/255 mean (measured: Heun max 1/255, mean 0.0001/255; DPM2
    0/255). The mean is tighter than test_models' 0.5/255 because tiny-pt's random UNet barely reads its timestep: the
    second call given the step's first timestep instead of its own moved the mean by only 0.10/255 (Heun) and
    0.36/255 (DPM2). The same schedule with its second call dropped (f = g = 0) is far off (mean 4.7/255, 10/255).
    DPM2 a (4 steps): diffusers' randn_tensor hands out the engine's step noise of seeds 11, 12 (the program draws its
    own from the seeds): measured max 1/255, mean 0.0000/255; without its second call mean 12.0/255, without its noise
    (d = 0) mean 11.7/255."""
    import dataclasses

    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize

    meta = STEPS[f"{case}_case"]
    model, params = tiny_pt_programs.model, tiny_pt_programs.params
    latents, want = arrays[f"{case}_latents"], arrays[f"{case}_images"].astype(int)
    steps = meta["num_inference_steps"]
    shape = ProgramShape(2, meta["height"], meta["width"], max_steps=TINY_PT_MAX_STEPS, given_latents=True,
                         two_calls=True)
    program = tiny_pt_programs[shape]
    ids, _ = tokenize(model, meta["prompt"])
    negative, _ = tokenize(model, meta["negative_prompt"])

    def images(schedule):
        seeds = np.asarray(meta.get("seeds", [0, 0]), np.uint32)  # DPM2 a's step noise: the fixture's seeds'
        inputs = ProgramInputs.build(ids, negative, False, seeds, meta["guidance_scale"], schedule, steps,
                                     shape.max_steps, latents=latents)
        return np.asarray(program.executable(params, inputs)[0]).astype(int)

    schedule = make_schedule(meta["sampler"], meta["scheduler_config"], steps)
    assert np.allclose(schedule.timesteps, meta["timesteps"][0::2], atol=1e-3)
    assert np.allclose(schedule.second.timesteps[:-1], meta["timesteps"][1::2], atol=1e-3)
    diff = np.abs(images(schedule) - want)
    print(f"{meta['sampler']}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.02, (diff.max(), diff.mean())
    zeros = 0 * schedule.second.f
    one_call = dataclasses.replace(schedule, second=dataclasses.replace(schedule.second, f=zeros, g=zeros))
    off = np.abs(images(one_call) - want)
    print(f"{meta['sampler']} without its second call: max {off.max()}/255, mean {off.mean():.3f}/255")
    assert off.mean() > 1.0, (off.mean(), diff.mean())
    if schedule.d.any():
        quiet = np.abs(images(dataclasses.replace(schedule, d=0 * schedule.d)) - want)
        print(f"{meta['sampler']} without its noise: max {quiet.max()}/255, mean {quiet.mean():.3f}/255")
        assert quiet.mean() > 1.0, (quiet.mean(), diff.mean())


def test_one_two_call_shape_serves_every_two_call_sampler_step_count_and_schedule_type():
    """The plan's ProgramShape: a one-call sampler's program is the one it was (two_calls False); every two-call
    sampler (schedulers.TWO_CALLS), any step count and any schedule type, share one shape (one compile), which
    differs from Euler's only in two_calls; their inputs differ only in values, not in which fields or shapes."""
    import dataclasses

    from sdxl_engine.program.generate import ProgramInputs, ProgramShape

    base = STEPS["base_config"]
    euler = ProgramShape(4, 64, 64, 20)
    shapes, structures = set(), set()
    ids = np.zeros((2, 77), np.int32)
    for sampler in TWO_CALLS:
        for steps, schedule_type in ((4, None), (20, "karras"), (9, "beta"), (13, "trailing")):
            schedule = make_schedule(sampler, base, steps, schedule_type)
            shapes.add(dataclasses.replace(euler, two_calls=schedule.two_calls))
            inputs = ProgramInputs.build(ids, ids, False, range(4), 5.0, schedule, steps, 20)
            structures.add(tuple((f.name, None if getattr(inputs, f.name) is None else
                                  np.shape(getattr(inputs, f.name))) for f in dataclasses.fields(inputs)))
    assert shapes == {dataclasses.replace(euler, two_calls=True)} and len(structures) == 1
    assert not make_schedule("Euler", base, 20).two_calls and not euler.two_calls
    specs = ProgramInputs.specs(dataclasses.replace(euler, two_calls=True))
    assert all(getattr(specs, k) is not None for k in ("mid_timesteps", "mid_sigmas", "f", "g", "d2"))
    assert all(getattr(ProgramInputs.specs(euler), k) is None for k in ("mid_timesteps", "f", "g", "d2"))
