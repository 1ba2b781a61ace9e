"""The TCD sampler through the compiled program: images against diffusers' TCDScheduler, no compile for a switch to
it from Euler or LCM, and its step limit refused before anything compiles.

References: tests/fixtures/tcd-steps.{json,npz} (``image_cases``: tiny-pt's StableDiffusionXLPipeline with
TCDScheduler.from_config of its config, 4 steps, eta 0.3 (the engine's gamma), 64x64, on given latents, its step noise
replaced by the engine's, tests/fixtures/lcm-noise.npz from ``python -m tools.lcm_noise``: the same seeds, steps and
shape as LCM's image cases, whose test checks that file against the program's rule). Image tolerance as LCM's: max
4/255, mean 0.5/255 (uint8 units).
"""

import json

import numpy as np
import pytest

from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest
from sdxl_engine.program.schedulers import TCD_GAMMA, make_schedule
from tests.helpers import FIXTURES, TINY_PT_MAX_STEPS

pytestmark = pytest.mark.engine

STEPS = json.loads((FIXTURES / "tcd-steps.json").read_text())
META = STEPS["image_cases"]


@pytest.fixture(scope="module")
def tcd_arrays():
    with np.load(FIXTURES / "tcd-steps.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def lcm_noise():
    with np.load(FIXTURES / "lcm-noise.npz") as data:
        return dict(data)


def gen(engine, prompt="a red circle", **kw):
    return engine.generate(GenerateRequest(prompt, **{"seed": 1, "num_inference_steps": 4, **kw}))


@pytest.mark.slow  # tiny-pt's programs without and with CFG at the fixture's shape (the session's: compiled once)
def test_tcd_images_match_diffusers(tcd_arrays, lcm_noise, tiny_pt_programs):
    """tiny-pt's pipeline with TCDScheduler (eta 0.3) and the engine's program on the same latents and step noise
    agree within 4/255 (max) and 0.5/255 (mean), at guidance 5 and 1 (no CFG); the same program with LCM's or Euler's
    coefficients, or with other seeds' step noise, is off (the comparison sees the sampler and the noise)."""
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize

    model, params = tiny_pt_programs.model, tiny_pt_programs.params
    latents, seeds = tcd_arrays["tcd_image_latents"], lcm_noise["seeds"]
    assert META["seeds"] == seeds.tolist()
    for key in ("tcd_image", "tcd_image_nocfg"):
        case = META[key]
        steps, guidance = case["num_inference_steps"], case["guidance_scale"]
        assert steps <= TINY_PT_MAX_STEPS and case["eta"] == TCD_GAMMA
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

        assert make_schedule("TCD", model.scheduler_config, steps).timesteps.tolist() == case["timesteps"]
        want = tcd_arrays[f"{key}_images"].astype(int)
        diff = np.abs(images("TCD") - want)
        print(f"{key}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
        assert diff.max() <= 4 and diff.mean() <= 0.5, (key, diff.max(), diff.mean())
        lcm, euler = np.abs(images("LCM") - want), np.abs(images("Euler") - want)
        noise = np.abs(images("TCD", seeds + 2) - want)
        print(f"{key}: LCM's mean {lcm.mean():.2f}/255 (max {lcm.max()}), Euler's {euler.mean():.2f}/255, other "
              f"noise's {noise.mean():.2f}/255")
        # LCM is TCD's nearest neighbour (the same timesteps and x0, a little less noise between steps): 1.9/255 on
        # tiny-pt, still four times the tolerance and far over TCD's own
        assert lcm.mean() > 1 and lcm.max() > 4 and euler.mean() > 2 and noise.mean() > 2, (key, lcm.mean())


def test_switching_between_euler_lcm_and_tcd_compiles_nothing(engine):
    """TCD is coefficients of the one-call program: after Euler's and LCM's requests (both CFG modes), TCD's at
    other step counts and guidance compile nothing (the engine's count and JAX's backend_compile events), and back."""
    import jax

    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if "backend_compile" in event else None)
    euler = gen(engine), gen(engine, guidance_scale=1.0)  # both CFG modes' programs exist from here on
    lcm = gen(engine, sampler="LCM")
    before = engine.compile_count
    events.clear()
    tcd = (gen(engine, sampler="TCD"), gen(engine, sampler="TCD", guidance_scale=1.0, num_inference_steps=2),
           gen(engine, sampler="TCD", schedule_type="trailing", num_inference_steps=3))
    again = gen(engine, sampler="LCM"), gen(engine)
    assert engine.compile_count == before and events == []
    assert not np.array_equal(tcd[0].images, euler[0].images) and not np.array_equal(tcd[0].images, lcm.images)
    assert np.array_equal(gen(engine, sampler="TCD").images, tcd[0].images)  # deterministic per seed
    assert np.array_equal(again[0].images, lcm.images) and np.array_equal(again[1].images, euler[0].images)


def test_more_tcd_steps_than_the_model_allows_is_refused_before_compiling(engine, monkeypatch):
    """A model whose TCD grid has 3 original steps: 4 TCD steps is a typed request error naming the steps, raised
    before the (not yet compiled) size bucket's program is built; a schedule type TCD does not take is one too."""
    width, height = engine.limits.sizes[-1]
    monkeypatch.setattr(engine.programs, "compiled", {shape: program for shape, program
                                                      in engine.programs.compiled.items()
                                                      if (shape.width, shape.height) != (width, height)})
    monkeypatch.setitem(engine.model.scheduler_config, "original_inference_steps", 3)
    monkeypatch.setattr(engine.planner, "_schedules", {})
    before = engine.compile_count
    with pytest.raises(InvalidRequest) as err:
        gen(engine, sampler="TCD", num_inference_steps=4, width=width, height=height)
    assert err.value.field == "num_inference_steps" and "TCD runs at most 3 steps" in str(err.value)
    with pytest.raises(InvalidRequest) as err:
        gen(engine, sampler="TCD", schedule_type="karras", width=width, height=height)
    assert err.value.field == "schedule_type"
    assert engine.compile_count == before and not engine.is_compiled(width, height)
