"""Samplers through the compiled program: Euler a's noise per step, DDIM's clip, DDIM images against diffusers.

References: tests/fixtures/sampler-steps.{json,npz} (as tests/program/test_schedulers.py, which checks the
coefficients and every step on fixed arrays without a compile)."""

import json

import numpy as np
import pytest

from sdxl_engine.program.schedulers import make_schedule
from tests.helpers import FIXTURES, TINY_PT_MAX_STEPS

pytestmark = pytest.mark.engine

STEPS = json.loads((FIXTURES / "sampler-steps.json").read_text())


@pytest.fixture(scope="module")
def steps_arrays():
    with np.load(FIXTURES / "sampler-steps.npz") as data:
        return dict(data)


# ---- the program's plumbing: Euler a's noise per step, DDIM's clip -----------------------------------------------
def _decode(engine, latents: np.ndarray) -> np.ndarray:
    """The program's VAE stage alone: (b, C, h, w) float32 latents -> (b, H, W, 3) uint8."""
    import jax
    import jax.numpy as jnp

    from sdxl_engine.program.generate import unscale_latents

    vae = engine.model.components["vae"]

    @jax.jit
    def decode(params, z):
        out = vae.bind(params).decode(unscale_latents(z, engine.model.vae)).astype(jnp.float32)
        return jnp.round(jnp.clip(out / 2 + 0.5, 0.0, 1.0).transpose(0, 2, 3, 1) * 255).astype(jnp.uint8)

    return np.asarray(decode(engine.params["vae"], jnp.asarray(latents)))


def _run_coefficients(engine, seeds, steps, **coefficients):
    """The engine's compiled default program on a schedule whose coefficients are replaced (others: 0)."""
    import dataclasses

    from sdxl_engine.program.generate import ProgramInputs, tokenize

    width, height = engine.limits.default_size
    program = engine.program(width, height, cfg=True)
    schedule = make_schedule("Euler a", engine.model.scheduler_config, steps)
    zeros = np.zeros(steps, np.float32)
    schedule = dataclasses.replace(schedule, **{**{k: zeros for k in "abcde"}, **coefficients})
    ids, _ = tokenize(engine.model, "a red circle")
    inputs = ProgramInputs.build(ids, ids, False, seeds, 5.0, schedule, steps, engine.config.max_inference_steps)
    images, _ = program.executable(engine.params, inputs)
    return np.asarray(images)


def test_euler_a_step_noise_follows_the_documented_seed_rule(engine):
    """Step k's noise of image i is normal(fold_in(key(seed_i), k + 1)): with only d_k = 1 (and the initial
    noise scaled by 0) the final latents are that noise alone, decoded; rebuilt here from the rule."""
    import jax

    from sdxl_engine.program.generate import latent_shape

    width, height = engine.limits.default_size
    shape = latent_shape(engine.model, height, width)
    seeds = [7, 8, 9, 10][: engine.batch]
    for k in (0, 3):
        d = np.zeros(4, np.float32)
        d[k] = 1.0
        images = _run_coefficients(engine, seeds, 4, a=np.ones(4, np.float32), d=d, init_scale=0.0)
        noise = np.stack([np.asarray(jax.random.normal(jax.random.fold_in(jax.random.key(s), k + 1), shape))
                          for s in seeds])
        want = _decode(engine, noise)
        assert np.abs(images.astype(int) - want.astype(int)).max() <= 1, f"step {k}"


def test_the_program_clips_x0_where_the_schedule_says(engine):
    """With a = 0, b = e = 1: x' = clip(x0); clip range 0 makes the final latents 0 whatever the UNet says,
    so the images are the decode of zeros. (An engine that drops e or clip_range decodes x0 instead.)"""
    from sdxl_engine.program.generate import latent_shape

    width, height = engine.limits.default_size
    shape = (engine.batch, *latent_shape(engine.model, height, width))
    ones = np.ones(2, np.float32)
    images = _run_coefficients(engine, list(range(engine.batch)), 2, b=ones, e=ones, clip_range=0.0)
    want = _decode(engine, np.zeros(shape, np.float32))
    assert np.abs(images.astype(int) - want.astype(int)).max() <= 1
    unclipped = _run_coefficients(engine, list(range(engine.batch)), 2, b=ones, e=ones)  # clip_range inf: x0 itself
    assert np.abs(unclipped.astype(int) - want.astype(int)).max() > 8


@pytest.mark.slow  # runs tiny-pt's program (the session's, compiled once) at the fixture's shape
def test_ddim_images_match_diffusers_when_the_config_lacks_clip_sample(steps_arrays, tiny_pt_programs):
    """Image level, the issue's case: tiny-pt's pipeline with DDIMScheduler.from_config of a config without
    clip_sample (so True) and the engine's program on the same latents agree within 4/255 (test_models' image
    tolerance); the unclipped DDIM the engine used to run is far off."""
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize

    meta = STEPS["ddim_image_case"]
    assert meta["clip_sample"] is True and "clip_sample" not in meta["scheduler_config"]
    model, params = tiny_pt_programs.model, tiny_pt_programs.params
    latents, want = steps_arrays["ddim_image_latents"], steps_arrays["ddim_image_images"].astype(int)
    assert meta["num_inference_steps"] <= TINY_PT_MAX_STEPS
    shape = ProgramShape(2, meta["height"], meta["width"], max_steps=TINY_PT_MAX_STEPS, given_latents=True)
    program = tiny_pt_programs[shape]
    ids, _ = tokenize(model, meta["prompt"])
    negative, _ = tokenize(model, meta["negative_prompt"])

    def images(config):
        schedule = make_schedule("DDIM", config, meta["num_inference_steps"])
        inputs = ProgramInputs.build(ids, negative, False, np.zeros(2, np.uint32), meta["guidance_scale"], schedule,
                                     meta["num_inference_steps"], shape.max_steps, latents=latents)
        return np.asarray(program.executable(params, inputs)[0]).astype(int)

    diff = np.abs(images(meta["scheduler_config"]) - want)
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    unclipped = np.abs(images({**meta["scheduler_config"], "clip_sample": False}) - want)
    assert unclipped.max() > 40, unclipped.max()


@pytest.mark.slow  # compiles tiny-pt's program at the fixture's shape
def test_ddim_images_match_diffusers_on_a_config_saved_by_euler(steps_arrays):
    """Image level: tiny-pt's pipeline with DDIMScheduler.from_config of a config as EulerDiscreteScheduler
    saves it (no clip_sample, set_alpha_to_one, sample_max_value, skip_prk_steps: DDIM's defaults True, True;
    leading, steps_offset 1), 10 steps, guidance 4, no negative prompt; the engine's program with its empty
    negative prompt (zeros, as diffusers' force_zeros_for_empty_prompt) on the same latents agrees within
    test_models' image tolerance, and each of the three other clip_sample x set_alpha_to_one choices does not."""
    import jax

    from sdxl_engine.checkpoint.loading import load_folder
    from sdxl_engine.program.compiling import compile_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize
    from sdxl_engine.program.sharding import make_mesh, replicated

    meta = STEPS["ddim_euler_image_case"]
    config = meta["scheduler_config"]
    assert meta["clip_sample"] is True and meta["set_alpha_to_one"] is True and meta["negative_prompt"] is None
    assert not {"clip_sample", "set_alpha_to_one", "sample_max_value", "skip_prk_steps"} & set(config)
    model = load_folder(FIXTURES / "tiny-pt", "tiny-pt", "float32")
    mesh = make_mesh(jax.devices()[:2])
    latents, want = steps_arrays["ddim_euler_image_latents"], steps_arrays["ddim_euler_image_images"].astype(int)
    steps = meta["num_inference_steps"]
    shape = ProgramShape(2, meta["height"], meta["width"], max_steps=steps, given_latents=True)
    params = jax.device_put(model.params, replicated(mesh))
    program = compile_program(model, params, shape, mesh)
    ids, _ = tokenize(model, meta["prompt"])
    empty, _ = tokenize(model, "")

    def images(config):
        schedule = make_schedule("DDIM", config, steps)
        assert schedule.timesteps.tolist() == meta["timesteps"]
        inputs = ProgramInputs.build(ids, empty, True, np.zeros(2, np.uint32), meta["guidance_scale"], schedule,
                                     steps, shape.max_steps, latents=latents)
        return np.asarray(program.executable(params, inputs)[0]).astype(int)

    diff = np.abs(images(config) - want)
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    for clip, to_one in ((True, False), (False, True), (False, False)):
        other = np.abs(images({**config, "clip_sample": clip, "set_alpha_to_one": to_one}) - want)
        assert other.mean() > 0.5 and other.max() > 4, (clip, to_one, other.max(), other.mean())


def fixture_image_case(steps_arrays, tiny_pt_programs, key: str):
    """The sampler-steps fixture's ``key`` image case (tools/fixtures_samplers.py): (its meta, diffusers' images
    (2, H, W, 3) int, ``images(schedule)``: tiny-pt's compiled program's images (2, H, W, 3) int on the case's
    latents, prompts and guidance with ``schedule``)."""
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize

    meta = STEPS[f"{key}_image_case"]
    model, params = tiny_pt_programs.model, tiny_pt_programs.params
    latents, want = steps_arrays[f"{key}_image_latents"], steps_arrays[f"{key}_image_images"].astype(int)
    steps = meta["num_inference_steps"]
    shape = ProgramShape(2, meta["height"], meta["width"], max_steps=TINY_PT_MAX_STEPS, given_latents=True)
    program = tiny_pt_programs[shape]
    ids, _ = tokenize(model, meta["prompt"])
    negative, _ = tokenize(model, meta["negative_prompt"])

    def images(schedule):
        inputs = ProgramInputs.build(ids, negative, False, np.zeros(2, np.uint32), meta["guidance_scale"], schedule,
                                     steps, shape.max_steps, latents=latents)
        return np.asarray(program.executable(params, inputs)[0]).astype(int)

    return meta, want, images


@pytest.mark.slow  # runs tiny-pt's program (the session's, compiled once) at the fixture's shape
def test_unipc_images_match_diffusers(steps_arrays, tiny_pt_programs):
    """Image level, through the compiled loop and its carry of earlier x0s: tiny-pt's pipeline with
    UniPCMultistepScheduler.from_config of its config and the engine's program on the same latents agree within
    test_models' image tolerance (4/255 max, 0.5/255 mean; measured 0/255); UniPC without its corrector (every step
    in disable_corrector) or the update without the x0 of two steps back (c2 = 0) is more than 4 x as far off
    (measured max 2/255, mean 0.19/255 and max 43/255, mean 4.5/255: on tiny-pt the corrector moves the images
    little, so the tolerance alone would not see it; the ratio does)."""
    import dataclasses

    meta, want, images = fixture_image_case(steps_arrays, tiny_pt_programs, "unipc")
    steps = meta["num_inference_steps"]
    schedule = make_schedule("UniPC", meta["scheduler_config"], steps)
    assert schedule.timesteps.tolist() == meta["timesteps"] and (schedule.c2[2:-1] != 0).all()
    diff = np.abs(images(schedule) - want)
    print(f"UniPC: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    uncorrected = make_schedule("UniPC", {**meta["scheduler_config"], "disable_corrector": list(range(steps))}, steps)
    for name, wrong in (("no corrector", uncorrected), ("c2 = 0", dataclasses.replace(schedule, c2=0 * schedule.c2))):
        off = np.abs(images(wrong) - want)
        print(f"UniPC {name}: max {off.max()}/255, mean {off.mean():.3f}/255")
        assert off.mean() > 0.05 and diff.mean() < off.mean() / 4, (name, off.mean(), diff.mean())


@pytest.mark.slow  # runs tiny-pt's program (the session's, compiled once) at the fixture's shape
def test_lms_images_match_diffusers(steps_arrays, tiny_pt_programs):
    """Image level, through the compiled loop and its carry of history entries (LMS's derivatives of the last three
    steps): tiny-pt's pipeline with LMSDiscreteScheduler.from_config of its config (step order 4) and the engine's
    program on the same latents agree within test_models' image tolerance (4/255 max, 0.5/255 mean); the update
    without its fourth-order term (c3 = 0) or with x0 in the history in place of the derivatives is farther off."""
    import dataclasses

    meta, want, images = fixture_image_case(steps_arrays, tiny_pt_programs, "lms")
    steps = meta["num_inference_steps"]
    schedule = make_schedule("LMS", meta["scheduler_config"], steps)
    assert schedule.timesteps.tolist() == meta["timesteps"] and (schedule.c3[3:] != 0).all()
    diff = np.abs(images(schedule) - want)
    print(f"LMS: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    for name, wrong in (("c3 = 0", dataclasses.replace(schedule, c3=0 * schedule.c3)),
                        ("x0 history", dataclasses.replace(schedule, hx=None, hx0=None))):
        off = np.abs(images(wrong) - want)
        print(f"LMS {name}: max {off.max()}/255, mean {off.mean():.3f}/255")
        assert off.mean() > diff.mean(), (name, off.mean(), diff.mean())
