"""engine/plan.py: a validated request in the program's terms (Planner.plan's Plan and HiresPlan, the ProgramShape,
schedules, tokens, warnings) on tiny-pt's tokenizers and scheduler, without compiling or running anything. Sizes are
non-square (width 96 or 64, height 64 or 48), so a width/height swap shows."""

import dataclasses
import types

import numpy as np
import pytest

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.image_upscale import upscale_images
from sdxl_engine.engine.plan import HiresPlan, Plan, Planner
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, Limits, validate
from sdxl_engine.program.generate import ProgramShape
from sdxl_engine.program.latent_upscale import resize_matrix
from sdxl_engine.program.schedulers import make_schedule

BATCH = 4
LIMITS = Limits(max_seed=1000, max_steps=100, sizes=((96, 64), (64, 48)), default_size=(96, 64), default_steps=10,
                default_guidance=5.0, multiple=16, max_pixels=128 * 128, batch=BATCH, loras=("ink", "wax"))


@pytest.fixture(scope="module")
def config():
    return EngineConfig.load({"max_prompt_chunks": 2}, environ={})


@pytest.fixture(scope="module")
def planner(tiny_pt, config):
    return Planner(tiny_pt, config, LIMITS, BATCH)


def request(limits=LIMITS, **kw) -> GenerateRequest:
    return validate(GenerateRequest(kw.pop("prompt", "a red circle"), **{"seed": 7, "num_inference_steps": 10, **kw}),
                    limits)


def refused(planner, field, words, **kw) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        planner.plan(request(**kw))
    assert err.value.field == field and words in str(err.value), str(err.value)
    return err.value


def test_shape_is_the_compile_key_of_a_size_in_width_by_height(planner, config):
    assert planner.shape(96, 64) == ProgramShape(BATCH, 64, 96, config.max_inference_steps, cfg=True, chunks=1,
                                                 step_hook=config.progress)
    shape = planner.shape(96, 64, cfg=False, chunks=2, init_image=True, inpaint=True)
    assert (shape.batch, shape.width, shape.height, shape.max_steps) == (BATCH, 96, 64, 50)
    assert (shape.cfg, shape.chunks, shape.init_image, shape.inpaint) == (False, 2, True, True)


def test_a_text_to_image_plan(planner, tiny_pt):
    """96 x 64, guidance 5 (CFG), Euler 10 steps: the shape, the schedule (make_schedule's), seeds seed + i, the
    tokenized prompts of one chunk, nothing of img2img, hires or the refiner."""
    plan = planner.plan(request(width=96, height=64, negative_prompt="a blue square"))
    assert isinstance(plan, Plan) and plan.shape == planner.shape(96, 64)
    assert (plan.shape.width, plan.shape.height) == (96, 64)
    assert plan.seeds == [7, 8, 9, 10]
    expected = make_schedule("Euler", tiny_pt.scheduler_config, 10)
    assert np.array_equal(plan.schedule.timesteps, expected.timesteps) and len(plan.schedule.timesteps) == 10
    assert plan.prompt.ids.shape == plan.negative.ids.shape == (2, 77) and plan.prompt.words == "a red circle"
    assert plan.negative.words == "a blue square" and not np.array_equal(plan.prompt.ids, plan.negative.ids)
    assert (plan.image, plan.mask, plan.hires, plan.refiner_start, plan.steps, plan.start_step, plan.loras) == (
        None, None, None, None, None, None, ())


def test_guidance_1_runs_without_cfg_and_seeds_wrap_past_max_seed(planner):
    """diffusers: guidance <= 1 runs the conditional UNet only (cfg False); image i's seed is seed + i, wrapping
    past max_seed (1000) to 0 so each caption's seed is a valid request seed."""
    plan = planner.plan(request(guidance_scale=1.0, seed=999))
    assert plan.shape.cfg is False and plan.seeds == [999, 1000, 0, 1]
    assert planner.plan(request(guidance_scale=1.5)).shape.cfg is True


def test_lora_tags_are_parsed_once_in_their_order(planner):
    plan = planner.plan(request(prompt="a red circle <lora:wax:-1> <lora:ink:0.5>"))
    assert plan.loras == (("wax", -1.0), ("ink", 0.5)) and plan.prompt.words.strip() == "a red circle"


def test_img2img_and_inpainting_plans_carry_the_pixels_per_image(planner):
    """One (H, W, 3) image serves every image (broadcast to the batch), its size the program's (64 x 48: width
    64, height 48); a mask makes the inpainting program and is broadcast too; strength's start step stays the
    request's (the plan's steps/start_step are for hires of an image only)."""
    image = np.arange(48 * 64 * 3, dtype=np.uint32).reshape(48, 64, 3).astype(np.uint8)
    plan = planner.plan(request(image=image, strength=0.5))
    assert plan.shape == planner.shape(64, 48, init_image=True) and (plan.shape.width, plan.shape.height) == (64, 48)
    assert plan.image.shape == (BATCH, 48, 64, 3) and all(np.array_equal(i, image) for i in plan.image)
    assert plan.mask is None and plan.request.start_step == 5 and plan.start_step is None
    mask = np.zeros((48, 64), np.uint8)
    mask[:, :16] = 255
    plan = planner.plan(request(image=image, mask=mask, strength=1.0))
    assert plan.shape == planner.shape(64, 48, init_image=True, inpaint=True)
    assert plan.mask.shape == (BATCH, 48, 64) and plan.mask.dtype == np.float32
    assert (plan.mask[:, :, :16] == 1).all() and (plan.mask[:, :, 16:] == 0).all()


def test_an_image_count_other_than_one_or_the_batch_is_refused_naming_image(planner):
    valid = request(image=np.zeros((48, 64, 3), np.uint8))
    three = dataclasses.replace(valid, image=np.zeros((3, 48, 64, 3), np.uint8))
    with pytest.raises(InvalidRequest) as err:
        planner.plan(three)
    assert err.value.field == "image"
    assert str(err.value).endswith("3 images; this server makes 4 per request: send one for all of them, or 4")


def test_hires_with_a_latent_upscaler_plans_a_second_pass_of_scale_times_width_by_height(planner, tiny_pt):
    """64 x 48 at hires_scale 2: the second pass is 128 wide and 96 high (validation.hires_size); the first pass
    returns latents (latents_out); the upscale matrices take tiny-pt's (48/4, 64/4) latents to (96/4, 128/4):
    rows (24, 12), cols (32, 16) (large x small); 10 steps at hires_strength 0.5 (hires_steps 0) run the last 5
    of 10."""
    plan = planner.plan(request(width=64, height=48, hires_scale=2, hires_strength=0.5,
                                hires_upscaler="Latent (bicubic)"))
    assert plan.shape == dataclasses.replace(planner.shape(64, 48), latents_out=True)
    hires = plan.hires
    assert isinstance(hires, HiresPlan) and not hires.pixels and hires.upscaler == "Latent (bicubic)"
    assert (hires.shape.width, hires.shape.height) == (128, 96)
    assert hires.shape == dataclasses.replace(planner.shape(128, 96), init_latents=True)
    assert hires.rows.shape == (24, 12) and hires.cols.shape == (32, 16)
    np.testing.assert_array_equal(hires.rows, resize_matrix(12, 24, "Latent (bicubic)"))
    np.testing.assert_array_equal(hires.cols, resize_matrix(16, 32, "Latent (bicubic)"))
    assert (hires.steps, hires.start_step, hires.runs) == (10, 5, 5)
    assert np.array_equal(hires.schedule.timesteps, make_schedule("Euler", tiny_pt.scheduler_config, 10).timesteps)
    assert hires.prompt.words == "a red circle"


def test_hires_with_a_pixel_upscaler_is_an_img2img_second_pass_with_its_own_prompts_and_steps(planner):
    """A pixel upscaler: the first pass decodes as usual, the second pass is an img2img program with the hires
    noise at 128 x 96; A1111's rule for hires_steps 6 at 0.5: a schedule of int(6 / 0.5) = 12, the last 6 run;
    the hires prompts are the second pass's."""
    plan = planner.plan(request(width=64, height=48, hires_scale=2, hires_strength=0.5, hires_steps=6,
                                hires_upscaler="Lanczos", hires_prompt="a red circle, sharp",
                                hires_negative_prompt="blur"))
    assert plan.shape == planner.shape(64, 48) and not plan.shape.latents_out
    hires = plan.hires
    assert hires.pixels and hires.rows is None and hires.cols is None
    assert hires.shape == dataclasses.replace(planner.shape(128, 96), init_image=True, hires_noise=True)
    assert (hires.steps, hires.start_step, hires.runs, len(hires.schedule.timesteps)) == (12, 6, 6, 12)
    assert (hires.prompt.words, hires.negative.words) == ("a red circle, sharp", "blur")


def test_hires_of_an_input_image_is_its_second_pass_alone_on_the_upscaled_pixels(planner):
    image = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    plan = planner.plan(request(image=image, hires_scale=2, hires_strength=0.5))  # Lanczos, the image default
    assert plan.hires is None and plan.shape == dataclasses.replace(planner.shape(128, 96), init_image=True,
                                                                    hires_noise=True)
    assert plan.image.shape == (BATCH, 96, 128, 3)
    np.testing.assert_array_equal(plan.image, upscale_images(np.broadcast_to(image, (BATCH, 48, 64, 3)), 128, 96,
                                                             "Lanczos"))
    assert (plan.steps, plan.start_step) == (10, 5)


def test_hires_refusals_name_the_hires_field(planner):
    """LCM as the second pass's sampler cannot take a 60-step schedule (hires_steps 30 at 0.5; tiny-pt's
    original_inference_steps is 50): hires_steps; a sampler the model's scheduler config rules out: hires_sampler."""
    err = refused(planner, "hires_steps", "the second pass's 60-step schedule: LCM runs at most 50 steps",
                  width=64, height=48, hires_scale=2, hires_strength=0.5, hires_steps=30, hires_sampler="LCM")
    assert "hires_sampler" not in str(err)
    zero_snr = dataclasses.replace(planner.model, scheduler_config={**planner.model.scheduler_config,
                                                                    "rescale_betas_zero_snr": True})
    other = Planner(zero_snr, planner.config, LIMITS, BATCH)
    with pytest.raises(InvalidRequest) as err:
        other.plan(request(width=64, height=48, hires_scale=2, hires_sampler="DDIM"))
    assert err.value.field == "hires_sampler" and "DDIM cannot run tiny-pt" in str(err.value)


def test_schedules_are_cached_and_their_refusals_name_the_field(planner):
    assert planner.schedule("Euler", 10) is planner.schedule("Euler", 10)
    assert len(planner.schedule("DPM++ 2M Karras", 7).timesteps) == 7
    with pytest.raises(InvalidRequest) as err:
        planner.schedule("LCM", 51)
    assert (err.value.field, str(err.value)) == (
        "num_inference_steps", "num_inference_steps: LCM runs at most 50 steps for this model (its scheduler's "
                               "original_inference_steps), got 51")
    zero_snr = dataclasses.replace(planner.model, scheduler_config={**planner.model.scheduler_config,
                                                                    "rescale_betas_zero_snr": True})
    with pytest.raises(InvalidRequest) as err:
        Planner(zero_snr, planner.config, LIMITS, BATCH).schedule("DDIM", 10)
    assert err.value.field == "sampler" and str(err.value).startswith(
        "sampler: DDIM cannot run tiny-pt: rescale_betas_zero_snr=True is not supported")


def test_tokens_pad_both_prompts_to_one_chunk_count(planner):
    """A prompt of two chunks (BREAK) pads a one-chunk negative with the empty prompt's chunk; a negative of
    syntax only is the empty prompt (one chunk: BREAKs alone do not make the program's prompts two chunks)."""
    prompt, negative = planner.tokens("a red circle BREAK a blue square", "green")
    assert (prompt.chunks, negative.chunks) == (2, 2) and prompt.ids.shape == negative.ids.shape == (2, 154)
    assert np.array_equal(negative.ids[:, 77:], negative.empty_chunk)
    _, empty = planner.tokens("a red circle", "")
    _, syntax = planner.tokens("a red circle", "(( ))")
    assert np.array_equal(syntax.ids, empty.ids) and syntax.words.strip() == ""
    prompt, negative = planner.tokens("a red circle", "BREAK BREAK")  # two empty chunks as they are
    assert (prompt.chunks, negative.chunks) == (1, 1) and np.array_equal(negative.ids, empty.ids)


def test_warnings_say_what_was_cut_clamped_or_unknown(planner, tiny_pt):
    """max_prompt_chunks 2 here: a prompt of 3 chunks is cut to 2 (150 tokens); a weight of 20 is clamped to 10;
    a model with a vocabulary names the words it was not trained on."""
    prompt, negative = planner.tokens("a BREAK b BREAK c", "(blue:20)")
    assert planner.warnings(prompt, negative) == [
        "prompt needs more than 2 chunks of 75 tokens (each BREAK starts one) and was cut to 2 (150 tokens, the "
        "max_prompt_chunks setting)",
        "negative prompt: a weight beyond ±10 was clamped to ±10"]
    assert planner.warnings(*planner.tokens("a red circle", "")) == []
    assert planner.warnings(*planner.tokens("[red:blue:0.5] circle", "[a|b]")) == [
        "prompt: [red:blue:0.5] is A1111's prompt editing or alternation, which this server does not do (one prompt "
        "for every step): read as words in brackets",
        "negative prompt: [a|b] is A1111's prompt editing or alternation, which this server does not do (one prompt "
        "for every step): read as words in brackets"]
    known = Planner(dataclasses.replace(tiny_pt, vocabulary=frozenset({"a", "red", "circle"})), planner.config,
                    LIMITS, BATCH)
    said = known.warnings(*known.tokens("a red zebra circle", "purple"))
    assert [w.split(":")[0] for w in said] == ["prompt", "negative prompt"]
    assert said[0].endswith("they still change them: zebra") and said[1].endswith(": purple")


def test_the_refiner_plan_starts_at_its_switch_step_and_needs_its_multiple(tiny_pt, config):
    """With a refiner (its UNet's size multiple 32, as tiny-pt-refiner's): refiner_switch_at 0.8 of Euler's 10
    steps (901 ... 1) switches at step 8 on the refiner's program (shape.refiner); a size not a multiple of 32
    (80 x 48, 96 x 48) is refused naming width; a refiner LoRA's tag in a request that does not run the refiner is
    refused naming prompt."""
    model = dataclasses.replace(tiny_pt, refiner=types.SimpleNamespace(size_multiple=32))
    limits = dataclasses.replace(LIMITS, refiner=True, sizes=((96, 64), (80, 48)))
    planner = Planner(model, config, limits, BATCH, refiner_loras=types.SimpleNamespace(loras={"ink": None}))
    plan = planner.plan(request(limits, width=96, height=64, refiner_switch_at=0.8))
    assert plan.refiner_start == 8 and plan.shape == dataclasses.replace(planner.shape(96, 64), refiner=True)
    zero = planner.plan(request(limits, refiner_switch_at=0))
    assert zero.refiner_start == 0
    for width, height in ((80, 48), (96, 48), (80, 64)):
        with pytest.raises(InvalidRequest) as err:
            planner.plan(request(limits, width=width, height=height, refiner_switch_at=0.8))
        assert (err.value.field, str(err.value)) == (
            "width", f"width: {width}x{height}: the refiner needs multiples of 32 pixels; choose such a size, or "
                     "leave refiner_switch_at out")
    with pytest.raises(InvalidRequest) as err:
        planner.plan(request(limits, prompt="a red circle <lora:ink:1>"))
    assert err.value.field == "prompt" and "<lora:ink> is a LoRA for the refiner" in str(err.value)
    tagged = planner.plan(request(limits, prompt="a red circle <lora:ink:1>", refiner_switch_at=0.8))
    assert tagged.loras == (("ink", 1.0),) and tagged.refiner_start == 8


@pytest.mark.parametrize("sampler, hires_sampler", [("Euler", "Heun"), ("DPM++ SDE", "Euler"), ("DPM2", "DPM2"),
                                                    ("Restart", "Euler"), ("Euler", "Restart")])
def test_each_pass_takes_the_program_of_its_own_samplers_model_calls(planner, sampler, hires_sampler):
    """A two-call sampler (schedulers.TWO_CALLS) plans the two-call program (ProgramShape.two_calls), a one-call
    sampler the program it always had; hires fix's second pass follows its own sampler, not the first pass's."""
    plan = planner.plan(request(width=64, height=48, sampler=sampler, hires_scale=2, hires_sampler=hires_sampler,
                                hires_upscaler="Latent (bicubic)"))
    assert plan.shape.two_calls == (sampler != "Euler") == plan.schedule.two_calls
    assert plan.hires.shape.two_calls == (hires_sampler != "Euler") == plan.hires.schedule.two_calls
    assert dataclasses.replace(plan.shape, two_calls=False) == dataclasses.replace(planner.shape(64, 48),
                                                                                  latents_out=True)
