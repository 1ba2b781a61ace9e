"""The LCM sampler through the compiled program: images against diffusers' LCMScheduler, the step
noise rule, no compile for a switch to it, and its step limit refused before anything compiles.

References: tests/fixtures/sampler-steps.{json,npz} (``lcm_image_cases``: tiny-pt's StableDiffusionXLPipeline
with LCMScheduler.from_config of its config, 4 steps, 64x64, on given latents, its step noise replaced by
the engine's, tests/fixtures/lcm-noise.npz from ``python -m tools.lcm_noise``). Image tolerance as
test_generate_samplers' DDIM case: max 4/255, mean 0.5/255 (uint8 units).
"""

import json

import numpy as np
import pytest

from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest
from sdxl_engine.program.schedulers import make_schedule
from tests.helpers import FIXTURES, TINY_PT_MAX_STEPS

pytestmark = pytest.mark.engine

STEPS = json.loads((FIXTURES / "sampler-steps.json").read_text())
META = STEPS["lcm_image_cases"]


@pytest.fixture(scope="module")
def steps_arrays():
    with np.load(FIXTURES / "sampler-steps.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def lcm_noise():
    with np.load(FIXTURES / "lcm-noise.npz") as data:
        return dict(data)


def gen(engine, prompt="a red circle", **kw):
    return engine.generate(GenerateRequest(prompt, **{"seed": 1, "num_inference_steps": 4, **kw}))


def test_the_engine_step_noise_is_the_fixture_noise(lcm_noise, tiny_pt):
    """The noise diffusers' LCMScheduler was given is the program's own rule for the fixture's seeds, exactly:
    normal(fold_in(key(seed_i), k + 1)) at step k, in tiny-pt's 64x64 latent shape."""
    import jax.numpy as jnp

    from sdxl_engine.program.generate import latent_shape, step_noise

    shape = latent_shape(tiny_pt, META["height"], META["width"])
    assert lcm_noise["noise"].shape == (META["lcm_image"]["num_inference_steps"] - 1, 2, *shape)
    assert lcm_noise["seeds"].tolist() == META["seeds"]
    for k, want in enumerate(lcm_noise["noise"]):
        got = np.asarray(step_noise(jnp.asarray(lcm_noise["seeds"], jnp.uint32), k, shape))
        assert np.array_equal(got, want), k


@pytest.mark.slow  # tiny-pt's programs without and with CFG at the fixture's shape (the session's: compiled once)
def test_lcm_images_match_diffusers(steps_arrays, lcm_noise, tiny_pt_programs):
    """tiny-pt's pipeline with LCMScheduler and the engine's program on the same latents and step noise agree
    within 4/255 (max) and 0.5/255 (mean), at guidance 1 (no CFG) and 5; the same program with Euler's
    coefficients, or with other seeds' step noise, is far off (the comparison sees the sampler and the noise)."""
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize

    model, params = tiny_pt_programs.model, tiny_pt_programs.params
    latents, seeds = steps_arrays["lcm_image_latents"], lcm_noise["seeds"]
    for key in ("lcm_image", "lcm_image_cfg"):
        case = META[key]
        steps, guidance = case["num_inference_steps"], case["guidance_scale"]
        assert steps <= TINY_PT_MAX_STEPS
        shape = ProgramShape(2, META["height"], META["width"], max_steps=TINY_PT_MAX_STEPS, cfg=guidance > 1,
                             given_latents=True)
        program = tiny_pt_programs[shape]
        ids, _ = tokenize(model, case["prompt"])
        negative, _ = tokenize(model, case["negative_prompt"])

        def images(sampler, seeds=seeds, case=case, steps=steps, guidance=guidance, ids=ids, negative=negative,
                   shape=shape, program=program):
            schedule = make_schedule(sampler, model.scheduler_config, steps)
            inputs = ProgramInputs.build(ids, negative, not case["negative_prompt"], seeds, guidance, schedule, steps,
                                         shape.max_steps, latents=latents)
            return np.asarray(program.executable(params, inputs)[0]).astype(int)

        assert make_schedule("LCM", model.scheduler_config, steps).timesteps.tolist() == case["timesteps"]
        diff = np.abs(images("LCM") - steps_arrays[f"{key}_images"].astype(int))
        print(f"{key}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
        assert diff.max() <= 4 and diff.mean() <= 0.5, (key, diff.max(), diff.mean())
        other = np.abs(images("Euler") - steps_arrays[f"{key}_images"].astype(int))
        noise = np.abs(images("LCM", seeds + 2) - steps_arrays[f"{key}_images"].astype(int))
        print(f"{key}: Euler's mean {other.mean():.2f}/255, other noise's mean {noise.mean():.2f}/255")
        assert other.mean() > 2 and noise.mean() > 2, (key, other.mean(), noise.mean())


def test_switching_from_euler_to_lcm_compiles_nothing(engine):
    import jax

    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if "backend_compile" in event else None)
    euler = gen(engine), gen(engine, guidance_scale=1.0)  # both CFG modes' programs exist from here on
    before = engine.compile_count
    events.clear()
    lcm = gen(engine, sampler="LCM"), gen(engine, sampler="LCM", guidance_scale=1.0, num_inference_steps=2)
    assert engine.compile_count == before and events == []
    assert not np.array_equal(lcm[0].images, euler[0].images)
    assert np.array_equal(gen(engine, sampler="LCM").images, lcm[0].images)  # deterministic per seed


def test_more_lcm_steps_than_the_model_allows_is_refused_before_compiling(engine, monkeypatch):
    """A model whose LCM schedule has 3 original steps: 4 LCM steps is a typed request error naming the
    steps and the limit, raised before the (not yet compiled) size bucket's program is built; Euler runs."""
    width, height = engine.limits.sizes[-1]
    monkeypatch.setattr(engine.programs, "compiled", {shape: program for shape, program
                                                      in engine.programs.compiled.items()
                                                      if (shape.width, shape.height) != (width, height)})
    monkeypatch.setitem(engine.model.scheduler_config, "original_inference_steps", 3)
    monkeypatch.setattr(engine.planner, "_schedules", {})
    before = engine.compile_count
    with pytest.raises(InvalidRequest) as err:
        gen(engine, sampler="LCM", num_inference_steps=4, width=width, height=height)
    assert err.value.field == "num_inference_steps"
    assert str(err.value) == ("num_inference_steps: LCM runs at most 3 steps for this model (its scheduler's "
                              "original_inference_steps), got 4")
    assert engine.compile_count == before and not engine.is_compiled(width, height)
    assert gen(engine, sampler="LCM", num_inference_steps=3).images.shape[0] == engine.batch
