"""Engine unit tests on the tiny random SDXL over 4 CPU devices."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest
from sdxl_engine.program.generate import tokenize
from tests.helpers import FIXTURES, ROOT

pytestmark = pytest.mark.engine


def gen(engine, prompt="a red circle", **kw):
    return engine.generate(GenerateRequest(prompt, **{"seed": 1, "num_inference_steps": 4, **kw}))


# tiny-shapes (trained: its images have colours and shapes) against the images the previous engine made
# (tests/fixtures/tiny-shapes-reference.*; test_models.py checks all four cases). The same tolerance as
# there: mean <= 0.5/255 for "the same image"; a setting that matters moves the mean by well over 1/255.
SHAPES_DIR = FIXTURES
SHAPES_CASES = json.loads((SHAPES_DIR / "tiny-shapes-reference.json").read_text())["cases"]
SAME, OTHER = 0.5, 1.0


@pytest.fixture(scope="module")
def shapes_reference():
    with np.load(SHAPES_DIR / "tiny-shapes-reference.npz") as data:
        return {k: data[f"case{k}_images"].astype(np.int32) for k in range(len(SHAPES_CASES))}


def shapes(engine, k=0, **changes):
    """tiny-shapes' images (int32) for reference case ``k`` with ``changes`` to its request."""
    case = {**SHAPES_CASES[k], **changes}
    return engine.generate(GenerateRequest(case["prompt"], case["negative_prompt"], case["seed"],
                                           case["guidance_scale"], case["num_inference_steps"], case["width"],
                                           case["height"])
                           ).images.astype(np.int32)


def mean_diff(a, b) -> float:
    return float(np.abs(a.astype(np.int32) - b.astype(np.int32)).mean())


def colour(images, channel: int) -> float:
    """How much a channel (0 red, 1 green, 2 blue) stands out: its mean minus the other two's, in /255."""
    x = images.astype(np.float64)
    return float((x[..., channel] - (x.sum(-1) - x[..., channel]) / 2).mean())


def test_four_images_shape_dtype_and_seeds(engine):
    result = gen(engine, seed=42)
    assert result.images.shape == (4, 64, 64, 3)
    assert result.images.dtype == np.uint8
    assert result.seeds == [42, 43, 44, 45]
    assert result.device_count == 4 and result.device_summary == "4 × cpu"
    assert set(result.timings) == {"queue", "prep", "device", "post", "latency"}
    assert all(v >= 0 for v in result.timings.values())
    assert result.images.std() > 5  # not a flat/black square


def test_a_requests_four_images_are_its_four_seeds_reference_images(tiny_shapes_engine, shapes_reference):
    result = tiny_shapes_engine.generate(GenerateRequest("a red circle", "", 0, 5.0, 20))
    assert result.images.shape == (4, 64, 64, 3) and result.images.dtype == np.uint8 and result.seeds == [0, 1, 2, 3]
    ref = shapes_reference[0]
    assert [mean_diff(result.images[i], ref[i]) <= SAME for i in range(4)] == [True] * 4
    assert min(mean_diff(ref[i], ref[j]) for i in range(4) for j in range(i + 1, 4)) > 10 * OTHER  # four images


def test_same_seed_same_images(engine):
    assert np.array_equal(gen(engine, seed=7).images, gen(engine, seed=7).images)


def test_another_seed_gives_that_seeds_reference_images(tiny_shapes_engine, shapes_reference):
    """Seed 1's images 0-2 are the reference's seeds 1-3 (case 0 made seeds 0-3), not seed 0's."""
    ref, images = shapes_reference[0], shapes(tiny_shapes_engine, seed=1)
    assert [mean_diff(images[i], ref[i + 1]) <= SAME for i in range(3)] == [True] * 3
    assert mean_diff(images[0], ref[0]) > OTHER


def test_image_i_reproduced_by_its_own_seed(engine):
    # Image i of seed s uses seed s + i: requesting seed s + 2 reproduces it as image 0.
    first = gen(engine, seed=100).images
    again = gen(engine, seed=102).images
    assert np.array_equal(first[2], again[0])


def test_the_prompts_colour_shows_in_the_images(tiny_shapes_engine):
    """A red circle is red and not blue; a blue square blue and not red: by a wide measured margin."""
    red, blue = shapes(tiny_shapes_engine), shapes(tiny_shapes_engine, prompt="a blue square")
    assert colour(red, 0) > 15 > -15 > colour(blue, 0), (colour(red, 0), colour(blue, 0))
    assert colour(blue, 2) > 15 + colour(red, 2), (colour(blue, 2), colour(red, 2))


def test_the_negative_prompts_words_are_the_references(tiny_shapes_engine, shapes_reference):
    """Reference case 1 was made with the negative prompt "blue": that gives its images, the same words after
    cleaning too; none or another negative prompt gives others."""
    ref = shapes_reference[1]
    assert SHAPES_CASES[1]["negative_prompt"] == "blue"
    assert mean_diff(shapes(tiny_shapes_engine, 1), ref) <= SAME
    assert mean_diff(shapes(tiny_shapes_engine, 1, negative_prompt=" blue\u200b "), ref) <= SAME
    for other in ("", "green"):
        assert mean_diff(shapes(tiny_shapes_engine, 1, negative_prompt=other), ref) > 10 * OTHER, other


def test_random_seeds_differ_between_requests(engine):
    a, b = gen(engine, seed=-1), gen(engine, seed=-1)
    assert a.seeds[0] != b.seeds[0] and not np.array_equal(a.images, b.images)
    assert a.request.seed == a.seeds[0] and b.request.seed == b.seeds[0]


def test_a_negative_prompt_red_takes_the_red_out(tiny_shapes_engine):
    """"a circle" (no colour asked) with the negative prompt "red": red falls by a wide measured margin
    (README, quality table: the share of a negative prompt's colour falls)."""
    for prompt in ("a circle", "a square"):
        plain = colour(shapes(tiny_shapes_engine, prompt=prompt), 0)
        without_red = colour(shapes(tiny_shapes_engine, prompt=prompt, negative_prompt="red"), 0)
        assert without_red < plain - 15, (prompt, plain, without_red)


def test_guidance_and_steps_are_the_references(tiny_shapes_engine, shapes_reference):
    """Reference case 1 (guidance 7, 12 steps): those values give its images, others do not."""
    ref = shapes_reference[1]
    assert (SHAPES_CASES[1]["guidance_scale"], SHAPES_CASES[1]["num_inference_steps"]) == (7.0, 12)
    assert mean_diff(shapes(tiny_shapes_engine, 1), ref) <= SAME
    for guidance in (5.0, 9.0):
        assert mean_diff(shapes(tiny_shapes_engine, 1, guidance_scale=guidance), ref) > OTHER, guidance
    for steps in (11, 20):
        assert mean_diff(shapes(tiny_shapes_engine, 1, num_inference_steps=steps), ref) > OTHER, steps


@pytest.mark.slow  # compiles tiny-shapes' program without guidance (guidance 1)
def test_more_guidance_moves_the_image_toward_the_prompts_colour(tiny_shapes_engine):
    """A blue square at guidance 1 (the conditional prediction alone), 1.5, 3 and 5: bluer each time."""
    blueness = [colour(shapes(tiny_shapes_engine, prompt="a blue square", guidance_scale=g), 2) for g in (1, 1.5, 3, 5)]
    assert all(b - a >= 2 for a, b in zip(blueness, blueness[1:])), blueness


def test_no_recompile_for_prompt_seed_guidance_steps_and_sampler(engine):
    """Every one-call sampler runs on the one program (the two-call ones share their own:
    test_a_two_call_sampler_compiles_one_more_program_once)."""
    import jax

    from sdxl_engine.program.schedulers import SAMPLERS, TWO_CALLS

    SAMPLERS = tuple(s for s in SAMPLERS if s not in TWO_CALLS)  # noqa: N806

    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if "backend_compile" in event else None)
    gen(engine), gen(engine, guidance_scale=0.5)  # both CFG modes' programs exist from here on
    before = engine.compile_count
    events.clear()
    for i, (prompt, seed, guidance, steps) in enumerate(
            [("a red circle", 1, 7.0, 4), ("a blue square on the left", 9, 1.5, 11), ("a star", 3, 12.0, 1),
             ("a green triangle", 5, 0.0, engine.config.max_inference_steps), ("a red star", 2, 1.0, 3)]):
        gen(engine, prompt=prompt, negative_prompt="blurry" if i % 2 else "", seed=seed, guidance_scale=guidance,
            num_inference_steps=steps, sampler=SAMPLERS[i % len(SAMPLERS)])
    for sampler in SAMPLERS[5:]:  # every other sampler (DPM++ 3M SDE's x0 of two steps back, UniPC's corrector)
        gen(engine, sampler=sampler, num_inference_steps=3)
    assert engine.compile_count == before
    assert events == []


def test_a_two_call_sampler_compiles_one_more_program_once(engine):
    """A Heun request after Euler's compiles one program more (its shape's two_calls); DPM2, DPM++ SDE and DPM2 a,
    other step counts, guidance in the same CFG mode and every schedule type run on it, and Euler's is still the one
    it was: nothing compiles after the first two-call request."""
    import jax

    from sdxl_engine.program.schedulers import SCHEDULE_TYPES

    gen(engine, num_inference_steps=3)
    before = engine.compile_count
    heun = gen(engine, sampler="Heun", num_inference_steps=3)
    assert engine.compile_count in (before, before + 1)  # another test of the session may have compiled it first
    compiled = engine.compile_count
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if "backend_compile" in event else None)
    images = {}
    for i, (sampler, schedule_type) in enumerate(
            [("DPM2", None), ("DPM++ SDE", None), ("Heun", "karras"), ("DPM2 a", None)]
            + [("DPM2", t) for t in SCHEDULE_TYPES] + [("DPM2 a", "karras")]):
        images[sampler, schedule_type] = gen(engine, sampler=sampler, schedule_type=schedule_type,
                                             num_inference_steps=2 + i % 4, guidance_scale=3.0 + i).images
    gen(engine, num_inference_steps=3)
    assert engine.compile_count == compiled and events == []
    assert not np.array_equal(heun.images, images["DPM2", None])
    assert not np.array_equal(images["DPM2", None], images["DPM++ SDE", None])
    assert not np.array_equal(images["DPM2", None], images["DPM2 a", None])
    again = gen(engine, sampler="DPM++ SDE", num_inference_steps=3, guidance_scale=4.0)  # per seed, as Euler a
    assert np.array_equal(again.images, images["DPM++ SDE", None])
    again = gen(engine, sampler="DPM2 a", num_inference_steps=5, guidance_scale=6.0)
    assert np.array_equal(again.images, images["DPM2 a", None])
    assert engine.compile_count == compiled and events == []


@pytest.mark.slow  # compiles the two-call program of image to image, inpainting and hires fix's two passes
def test_the_two_call_samplers_run_in_every_mode(engine):
    """Image to image (DPM2 from its start step), inpainting (Heun: a plain UNet's second call's input blended at
    its mid sigma; DPM2 a: its step noise too) and hires fix with a two-call sampler in either pass run on their
    two-call programs: four finite images, each differing from the same request with Euler; the same request again
    gives the same images."""
    width, height = engine.limits.default_size
    image = np.zeros((height, width, 3), np.uint8)
    image[:, : width // 2] = (200, 30, 30)
    mask = np.zeros((height, width), np.float32)
    mask[: height // 2] = 1.0
    cases = [dict(image=image, strength=0.6), dict(image=image, mask=mask, strength=0.9),
             dict(hires_scale=1.5, hires_steps=3, hires_sampler="DPM++ SDE"), dict(hires_scale=1.5, hires_steps=3),
             dict(image=image, mask=mask, strength=0.9)]
    for sampler, kw in zip(("DPM2", "Heun", "Euler", "Heun", "DPM2 a"), cases, strict=True):
        first = gen(engine, sampler=sampler, num_inference_steps=4, **kw)
        assert first.images.shape[0] == 4 and np.isfinite(first.images).all(), (sampler, kw.keys())
        assert np.array_equal(gen(engine, sampler=sampler, num_inference_steps=4, **kw).images, first.images)
        other = gen(engine, sampler="Euler", num_inference_steps=4, **{**kw, "hires_sampler": "Euler"}
                    if "hires_scale" in kw else kw)
        assert not np.array_equal(other.images, first.images), (sampler, kw.keys())


def test_guidance_up_to_1_follows_the_prompt_without_cfg(engine):
    """diffusers: guidance <= 1 means no classifier-free guidance, the conditional prediction alone
    (so guidance 0 is not the unconditional image: the prompt still matters)."""
    red, blue = gen(engine, guidance_scale=0.0).images, gen(engine, prompt="a blue square", guidance_scale=0.0).images
    assert not np.array_equal(red, blue)
    assert np.array_equal(gen(engine, guidance_scale=0.0).images, red)
    assert engine.is_compiled(64, 64, cfg=False)
    # At 1 both modes give the text-conditioned prediction: the same images up to float rounding.
    with_cfg = gen(engine, guidance_scale=1.0 + 1e-6).images.astype(int)
    assert np.abs(gen(engine, guidance_scale=1.0).images.astype(int) - with_cfg).max() <= 2


def test_samplers_differ_and_euler_a_is_deterministic_per_seed(engine):
    from sdxl_engine.program.schedulers import SAMPLERS

    images = {sampler: gen(engine, sampler=sampler, num_inference_steps=6).images for sampler in SAMPLERS}
    for a in SAMPLERS:
        for b in SAMPLERS:
            assert a == b or not np.array_equal(images[a], images[b]), (a, b)
    assert np.array_equal(gen(engine, sampler="Euler a", num_inference_steps=6).images, images["Euler a"])
    shifted = gen(engine, sampler="Euler a", num_inference_steps=6, seed=2).images  # seed 1 + 1: image 1 again
    assert np.array_equal(shifted[0], images["Euler a"][1])


@pytest.mark.slow  # compiles another size bucket's program
def test_new_size_bucket_compiles_once(engine, monkeypatch):
    """A size bucket's first request compiles its program, the next reuses it. Independent of what
    other tests compiled on the shared engine: the bucket's programs are taken out of its table for
    this test (and the table restored after it)."""
    width, height = engine.limits.sizes[-1]
    monkeypatch.setattr(engine.programs, "compiled", {shape: program for shape, program
                                                      in engine.programs.compiled.items()
                                                      if (shape.width, shape.height) != (width, height)})
    assert not engine.is_compiled(width, height)
    before = engine.compile_count
    result = gen(engine, width=width, height=height)
    assert result.images.shape == (4, height, width, 3) and engine.is_compiled(width, height)
    gen(engine, width=width, height=height, seed=5)
    assert engine.compile_count == before + 1


def test_long_prompt_truncated_with_warning(engine):
    result = gen(engine, prompt="a red circle " * 100)
    # Cut at max_prompt_chunks (3) chunks of 75 tokens ("a red circle" is 3): the images of the first 75 repeats.
    np.testing.assert_array_equal(result.images, gen(engine, prompt="a red circle " * 75).images)
    assert result.warnings == ["prompt needs more than 3 chunks of 75 tokens (each BREAK starts one) and was cut "
                               "to 3 (225 tokens, the max_prompt_chunks setting)"] and result.prompt_chunks == 3
    assert gen(engine).warnings == [] and gen(engine, prompt="a red circle " * 60).warnings == []
    # The count agrees with the tokenizer's own at the edge: 75 words + BOS + EOS fit, 76 do not.
    assert [tokenize(engine.model, " ".join(["red"] * n))[1] for n in (75, 76)] == [False, True]


@pytest.mark.slow  # a fresh interpreter loading tiny-shapes
def test_a_long_prompt_logs_nothing():
    """The user hears of the cut (a warning in the result); the server log does not: transformers warns
    on stderr when it encodes untruncated text longer than 77 tokens (QA). In a fresh process, as
    transformers warns once per tokenizer."""
    code = ("from sdxl_engine.checkpoint.loading import load_model; "
            "from sdxl_engine.program.generate import tokenize; "
            "from sdxl_engine.engine.prompts import tokenize_prompt; "
            "m = load_model('tiny-shapes', dtype='float32', platform='cpu', cache_dir='unused'); "
            "tokenize_prompt((m.tokenizer, m.tokenizer_2), 'a (red) circle ' * 100, 3); "
            "print(tokenize(m, 'a red circle ' * 60)[1])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]
    assert "sequence length" not in out.stderr, out.stderr[-2000:]


def test_words_the_model_does_not_know_are_named_in_a_warning(engine):
    result = gen(engine, prompt="a red zebra circle 🦓, zebra", negative_prompt="blurry quokka")
    assert result.warnings == [
        "prompt: tiny-random was not trained on these words, so they do not steer its images, but they still "
        "change them: zebra, 🦓",
        "negative prompt: tiny-random was not trained on these words, so they do not steer its images, but they "
        "still change them: quokka"]
    assert gen(engine, prompt="a large red circle on the left", negative_prompt="blurry, green").warnings == []


@pytest.fixture(scope="module")
def healthy_images(engine):
    return gen(engine).images


REFUSED = [
    (dict(prompt=""), "prompt: is empty"),
    (dict(prompt="   \t"), "prompt: is empty"),
    (dict(prompt=None), "prompt: is empty"),
    (dict(prompt=5), "prompt: expected text, got int"),
    (dict(seed=-2), "seed: must be between -1"),
    (dict(seed=2**40), "seed: must be between -1"),
    (dict(seed=1.5), "seed: expected a whole number"),
    (dict(guidance_scale=float("nan")), "guidance_scale: must be a finite number"),
    (dict(guidance_scale=-1), "guidance_scale: must be between 0"),
    (dict(num_inference_steps=0), "num_inference_steps: must be between 1"),
    (dict(num_inference_steps=10**9), "num_inference_steps: must be between 1"),
    (dict(width=63), "width: 63 is not a multiple of 8 pixels (the model works on 8-pixel blocks); any multiple "
                     "of 8 pixels per side, up to 1048576 pixels in all (max_pixels; the model's sizes: 64x64, "
                     "72x56, "),
    (dict(width=2048, height=1024), "width/height: 2048x1024 is 2097152 pixels; this server makes up to 1048576 "
                                    "(max_pixels), any multiple of 8 pixels per side (the model's sizes: 64x64, "),
]


@pytest.mark.parametrize("kwargs, message", REFUSED)
def test_bad_input_raises_typed_error(engine, kwargs, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        gen(engine, **kwargs)


def test_engine_stays_healthy_after_every_bad_input(engine, healthy_images):
    """A refusal runs nothing, so one request after all of them shows the engine is still whole."""
    for kwargs, message in REFUSED:
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            gen(engine, **kwargs)
    np.testing.assert_array_equal(gen(engine).images, healthy_images)  # the same images as before any error


def test_random_seed_is_reported(engine):
    a = gen(engine, seed=-1)
    assert 0 <= a.seeds[0] <= engine.config.max_seed and a.request.seed == a.seeds[0]


def test_output_is_sharded_over_the_data_axis(engine):
    from sdxl_engine.program.generate import ProgramShape

    # the engine's ProgramShape: its step hook on (progress)
    program = engine.programs.compiled[engine.planner.shape(64, 64)]
    assert program.shape == ProgramShape(4, 64, 64, engine.config.max_inference_steps, step_hook=True)
    out_sharding = program.executable.output_shardings[0]
    assert out_sharding.spec[0] == "data"
    assert out_sharding.mesh.devices.size == 4


@pytest.mark.slow  # compiles a whole program for a second model
def test_random_weight_builder_goes_through_the_engine_program(engine):
    """The code behind `sdxl-base-random`, run at tiny scale: one jitted initialiser per component
    puts params of the abstract shapes on the devices, and the engine's program runs on them."""
    import jax

    from sdxl_engine.checkpoint import builtin
    from sdxl_engine.checkpoint.loading import random_model
    from sdxl_engine.program.compiling import compile_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape
    from sdxl_engine.program.schedulers import make_schedule
    from sdxl_engine.program.sharding import replicated

    configs = builtin.component_configs(builtin.TINY, len(builtin.build_vocab()[0]))
    model = random_model(configs, "tiny-check", "float32", replicated(engine.mesh))
    for name, component in model.components.items():
        assert {k: (v.shape, str(v.dtype)) for k, v in model.params[name].items()} == {
            k: (s.shape, str(s.dtype)) for k, s in component.abstract(np.float32).items()}
    assert all(leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 4
               for leaf in jax.tree.leaves(model.params))
    program = compile_program(model, model.params, ProgramShape(4, 64, 64, 4), engine.mesh)
    ids = np.zeros((2, 77), np.int32)
    inputs = ProgramInputs.build(ids, ids, True, range(4), 5.0, make_schedule("Euler", model.scheduler_config, 4), 4, 4)
    images, finite = program.executable(model.params, inputs)
    assert np.asarray(images).shape == (4, 64, 64, 3) and np.asarray(finite).all()


def test_seeds_wrap_past_max_seed_and_every_caption_seed_reproduces(engine):
    top = engine.limits.max_seed
    result = gen(engine, seed=top - 1)
    assert result.seeds == [top - 1, top, 0, 1]
    assert np.array_equal(gen(engine, seed=top).images[0], result.images[1])
    assert np.array_equal(gen(engine, seed=0).images[0], result.images[2])


# The maths of one denoising step, against diffusers' formulas written out here on fixed arrays
# (StableDiffusionXLPipeline's guidance, EulerDiscreteScheduler.step for Euler). Every sampler's
# step against diffusers' own step() is in tests/program/test_schedulers.py; the whole pipeline against diffusers'
# PyTorch outputs in test_models.py.
def diffusers_cfg(uncond, text, guidance_scale):
    return uncond + guidance_scale * (text - uncond)


def diffusers_euler(sample, model_output, sigma, sigma_next, prediction_type):
    if prediction_type == "epsilon":
        pred_original_sample = sample - sigma * model_output
    else:  # v_prediction
        pred_original_sample = model_output * (-sigma / (sigma**2 + 1) ** 0.5) + (sample / (sigma**2 + 1))
    derivative = (sample - pred_original_sample) / sigma
    dt = sigma_next - sigma
    return sample + derivative * dt


def test_cfg_combine_is_diffusers_guidance():
    from sdxl_engine.program.generate import cfg_combine

    rng = np.random.default_rng(0)
    uncond, text = rng.normal(size=(2, 4, 4, 8, 8)).astype(np.float32)
    guidance = np.array([0.0, 1.0, 5.0, 7.5], np.float32)
    out = np.asarray(cfg_combine(uncond, text, guidance))
    for i, g in enumerate(guidance):
        np.testing.assert_allclose(out[i], diffusers_cfg(uncond[i], text[i], g), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out[0], uncond[0])  # g = 0: unconditional
    np.testing.assert_allclose(out[1], text[1], atol=1e-6)  # g = 1: text-conditioned
    assert np.asarray(cfg_combine(np.zeros((1, 1, 1, 1), np.float32), np.ones((1, 1, 1, 1), np.float32),
                                  np.array([5.0], np.float32))).item() == 5.0  # pushed towards the text, 5x


@pytest.mark.parametrize("prediction_type, expected", [("epsilon", 0.5), ("v_prediction", 0.37639320)])
def test_euler_update_is_diffusers_step(prediction_type, expected):
    """The program's step (denoised x0, then the sampler's update with Euler's coefficients) is
    diffusers' EulerDiscreteScheduler.step, written out above."""
    from sdxl_engine.program.generate import denoised, sampler_update

    def euler(sample, output, sigma, sigma_next):
        x0 = denoised(sample, output, sigma, prediction_type)
        a = sigma_next / sigma
        return sampler_update(sample, x0, np.zeros_like(x0), np.zeros_like(x0), a, 1 - a, 0.0, 0.0)

    # By hand: x = 1, output 0.5, sigma 2 -> 1. epsilon: x0 = 0, d = 0.5, x' = 1 - 0.5.
    # v: x0 = 0.5 * -2 / sqrt(5) + 1 / 5, d = (1 - x0) / 2, x' = 1 - d.
    assert float(euler(np.float32(1.0), np.float32(0.5), np.float32(2.0), np.float32(1.0))) == pytest.approx(
        expected, rel=1e-6)
    rng = np.random.default_rng(1)
    sample, output = rng.normal(size=(2, 4, 4, 8, 8)).astype(np.float32)
    for sigma, sigma_next in ((14.6, 11.2), (1.3, 0.6), (0.03, 0.0)):
        got = np.asarray(euler(sample, output, np.float32(sigma), np.float32(sigma_next)))
        np.testing.assert_allclose(got, diffusers_euler(sample, output, np.float32(sigma), np.float32(sigma_next),
                                                        prediction_type), rtol=1e-5, atol=1e-5)
