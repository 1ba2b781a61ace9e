"""Image to image through the compiled program and the engine: diffusers' StableDiffusionXLImg2ImgPipeline's
images, the conventions (posterior mean, start step, the seed's noise), no recompile per strength or image.

References: tests/fixtures/tiny-pt-img2img/ (``python -m tools.img2img_noise``, then ``python -m
tools.make_fixtures img2img``): tiny-pt's img2img pipeline with Euler, DPM++ 2M Karras and DDIM at strengths
0.3 and 0.75, 10 steps, 64x64, two fixed pictures, the image latents the VAE posterior's mean, the noise the
engine's for seeds 41 and 42. Image tolerance as the other parity tests: max 4/255, mean 0.5/255 (uint8 units).
"""

import dataclasses
import json

import numpy as np
import pytest

from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest
from sdxl_engine.program.schedulers import img2img_start, make_schedule
from tests.helpers import FIXTURES

pytestmark = pytest.mark.engine

FOLDER = FIXTURES / "tiny-pt-img2img"
META = json.loads((FOLDER / "reference.json").read_text())
SETTINGS = META["settings"]
STEPS = SETTINGS["num_inference_steps"]


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data, np.load(FOLDER / "noise.npz") as noise:
        return {**dict(data), **{f"noise_{k}": v for k, v in noise.items()}}


def test_the_fixture_noise_is_the_engines_seed_rule(reference):
    """The noise diffusers was given is the program's txt2img rule for the fixture's seeds, exactly:
    normal(key(seed_i), (C, h, w)) in tiny-pt's 64x64 latent shape."""
    import jax.numpy as jnp

    from sdxl_engine.program.generate import initial_noise

    assert reference["noise_seeds"].tolist() == META["seeds"]
    got = np.asarray(initial_noise(jnp.asarray(reference["noise_seeds"], jnp.uint32), (4, 16, 16)))
    assert np.array_equal(got, reference["noise_noise"])


def test_the_start_step_is_diffusers_get_timesteps():
    """steps - int(steps x strength): the fixture's cases, and the edges (strength 1 runs all, a strength too
    small for one step is refused)."""
    for case in META["cases"].values():
        assert img2img_start(STEPS, case["strength"]) == case["start_step"]
    assert img2img_start(20, 1.0) == 0 and img2img_start(20, 0.5) == 10 and img2img_start(7, 0.3) == 5
    with pytest.raises(ValueError, match="runs int"):
        img2img_start(10, 0.05)


def test_a_start_step_makes_the_first_dpm_step_first_order():
    """The step a run begins at has no previous x0: DPM++ 2M's update there is first order (b + c, c = 0), as
    diffusers' scheduler after set_begin_index; Euler's and DDIM's schedules are unchanged."""
    from sdxl_engine.checkpoint.loading import load_folder

    config = load_folder(FIXTURES / "tiny-pt", "tiny-pt", "float32").scheduler_config
    dpm = make_schedule("DPM++ 2M Karras", config, STEPS)
    started = dpm.starting_at(3)
    assert dpm.c[3] != 0 and started.c[3] == 0
    assert started.b[3] == pytest.approx(1 - dpm.a[3], rel=1e-6)
    assert np.array_equal(started.b[4:], dpm.b[4:]) and np.array_equal(started.c[4:], dpm.c[4:])
    for sampler in ("Euler", "DDIM"):
        schedule = make_schedule(sampler, config, STEPS)
        assert np.array_equal(schedule.starting_at(3).b, schedule.b)


@pytest.fixture(scope="module")
def program():
    """tiny-pt's img2img program: 2 images at 64x64 with CFG over 2 devices, and how to run a case on it."""
    import jax

    from sdxl_engine.checkpoint.loading import load_folder
    from sdxl_engine.program.compiling import compile_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize
    from sdxl_engine.program.sharding import make_mesh, replicated

    model = load_folder(FIXTURES / "tiny-pt", "tiny-pt", "float32")
    mesh = make_mesh(jax.devices()[:2])
    params = jax.device_put(model.params, replicated(mesh))
    shape = ProgramShape(2, 64, 64, max_steps=STEPS, init_image=True)
    compiled = compile_program(model, params, shape, mesh)
    ids, _ = tokenize(model, SETTINGS["prompt"])
    negative, _ = tokenize(model, SETTINGS["negative_prompt"])

    def run(sampler, strength, pictures, seeds=tuple(META["seeds"]), start=None, first_order=True):
        start = img2img_start(STEPS, strength) if start is None else start
        schedule = make_schedule(sampler, model.scheduler_config, STEPS)
        inputs = ProgramInputs.build(ids, negative, False, list(seeds), SETTINGS["guidance_scale"], schedule, STEPS,
                                     STEPS, image=pictures, start_step=start)
        if not first_order:  # undo what build does: the start step's update second order, on a zero previous x0
            raw = schedule.padded(STEPS)
            inputs = dataclasses.replace(inputs, b=raw["b"], c=raw["c"])
        return np.asarray(compiled.executable(params, inputs)[0]).astype(int)

    return run


@pytest.mark.slow  # compiles tiny-pt's img2img program at the fixture's shape
@pytest.mark.parametrize("case", list(META["cases"]))
def test_img2img_images_match_diffusers(program, reference, case):
    """Each sampler and strength within 4/255 (max) and 0.5/255 (mean) of diffusers' images; the same run one
    step earlier or later, or with other seeds' noise, is far off (the comparison sees the start step and the
    noise), and DPM++'s without the first-order start step too."""
    meta = META["cases"][case]
    want = reference[f"{case}_images"].astype(int)
    run = lambda **kw: np.abs(program(meta["sampler"], meta["strength"], reference["pictures"], **kw) - want)  # noqa: E731
    diff = run()
    print(f"{case}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5, (case, diff.max(), diff.mean())
    start = meta["start_step"]
    for wrong in (dict(start=start - 1), dict(start=start + 1), dict(seeds=(43, 44))):
        off = run(**wrong)
        print(f"{case} {wrong}: mean {off.mean():.2f}/255")
        assert off.mean() > 1.5, (case, wrong, off.mean())
    if meta["sampler"].startswith("DPM"):
        assert run(first_order=False).mean() > 1.5


# ---- the engine: plan, program per size, no recompile per strength or image -----------------------------------
def pictures(engine, k=0) -> np.ndarray:
    """(H, W, 3) uint8 at the engine's default size: a colour ramp shifted by ``k``."""
    width, height = engine.limits.default_size
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(x * 4 + k) % 256, (y * 4) % 256, (255 - x - y + 3 * k) % 256], -1).astype(np.uint8)


def gen(engine, **kw):
    return engine.generate(GenerateRequest("a red circle", **{"seed": 1, "num_inference_steps": 6, **kw}))


@pytest.mark.slow  # compiles the image to image program on the session engine
def test_img2img_compiles_once_then_nothing_for_strength_image_or_start_step(engine):
    """The first img2img request at a size compiles its program; strength, the image (one for all, or one per
    image), start_step, seed and sampler change only traced inputs. Text to image keeps its own program."""
    import jax

    from sdxl_engine.program.generate import ProgramShape

    txt = gen(engine).images
    first = gen(engine, image=pictures(engine), strength=0.5)
    width, height = engine.limits.default_size
    assert first.request.start_step == 3 and first.images.shape == (engine.batch, height, width, 3)
    compiled = engine.programs.compiled
    assert any(s.init_image for s in compiled) and isinstance(next(iter(compiled)), ProgramShape)
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if "backend_compile" in event else None)
    before = engine.compile_count
    runs = [gen(engine, image=pictures(engine), strength=0.9),
            gen(engine, image=pictures(engine, 40), strength=0.5),
            gen(engine, image=[pictures(engine, 60 * k) for k in range(engine.batch)], strength=0.5),
            gen(engine, image=pictures(engine), start_step=5, sampler="DPM++ 2M Karras", seed=7)]
    assert engine.compile_count == before and events == []
    assert np.array_equal(gen(engine).images, txt)  # text to image: its own program, the same images
    # Each change shows: strength, the image, one image per output image.
    assert np.abs(runs[0].images.astype(int) - first.images).mean() > 1
    assert np.abs(runs[1].images.astype(int) - first.images).mean() > 1
    per_image = runs[2].images
    assert np.array_equal(per_image[0], first.images[0])  # image 0: the same picture, seed and strength
    assert np.abs(per_image[1].astype(int) - first.images[1]).mean() > 1


def test_img2img_progress_reports_the_steps_that_run(engine):
    """With the per-step hook on (the default config), strength 0.5 of 6 steps reports steps 4, 5 and 6 of 6: the
    three that run, numbered in the whole schedule."""
    events = []
    engine.generate(GenerateRequest("a red circle", seed=1, num_inference_steps=6, image=pictures(engine),
                                    strength=0.5), on_step=events.append)
    assert engine.config.progress
    assert [(e.step, e.steps) for e in events] == [(4, 6), (5, 6), (6, 6)]


def test_img2img_keeps_the_image_at_low_strength(tiny_shapes_engine):
    """On the trained tiny-shapes (its VAE reconstructs its pictures): a blue square on white stays near the
    input at strength 0.2 and moves away at 1, towards the prompt's red circle."""
    engine = tiny_shapes_engine
    width, height = engine.limits.default_size
    image = np.full((height, width, 3), 255, np.uint8)
    image[height // 4: 3 * height // 4, width // 4: 3 * width // 4] = (20, 40, 230)
    distance = {s: np.abs(gen(engine, image=image, strength=s, num_inference_steps=10).images.astype(int)
                          - image).mean() for s in (0.2, 1.0)}
    print(f"mean distance to the input: {distance}")
    assert distance[0.2] < 20 and distance[1.0] > 5 * distance[0.2], distance


def test_img2img_refusals_name_the_field(engine):
    """Refused before anything compiles or runs, each naming its field."""
    image = pictures(engine)
    width, height = engine.limits.default_size
    before = engine.compile_count
    cases = [(dict(image=image, strength=0), "strength"), (dict(image=image, strength=1.5), "strength"),
             (dict(image=image, strength="much"), "strength"), (dict(image=image, strength=0.05), "strength"),
             (dict(image=image.astype(np.float32)), "image"), (dict(image=image[..., :2]), "image"),
             (dict(image=image, width=width + 8), "image"), (dict(image=[image] * (engine.batch + 1)), "image"),
             (dict(image=image[:, :-3]), "image"), (dict(strength=0.5), "strength"),
             (dict(image=image, start_step=6), "start_step")]
    for kw, field in cases:
        with pytest.raises(InvalidRequest) as err:
            gen(engine, **kw)
        assert err.value.field == field, (kw.keys(), err.value)
    assert engine.compile_count == before
