"""Hires fix through the two compiled programs and the engine: diffusers' pipelines chained as AUTOMATIC1111's latent
hires fix, the conventions (the seed's hires noise stream, the second pass's start step, torch's interpolate for
each latent upscaler), two programs compiled once and nothing per strength, steps, seed or upscaler.

References: tests/fixtures/tiny-pt-hires/ (``python -m tools.hires_noise``, then ``python -m tools.fixtures_hires``):
tiny-pt's ``StableDiffusionXLPipeline(output_type="latent")`` at 64x64 from the engine's first noise, torch's
``F.interpolate`` to 24x24 latents (96x96, scale 1.5; tiny-pt's VAE factor is 4), then
``StableDiffusionXLImg2ImgPipeline`` on those latents with the engine's second-pass noise, for Euler and DPM++ 2M
Karras, the "Latent", "Latent (bicubic)" and "Latent (nearest-exact)" upscalers, both start-step rules; 10 first-pass
steps, guidance 5, seeds 41 and 42. Image tolerance as the other parity tests: max 4/255, mean 0.5/255 (uint8 units).
"""

import json

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest
from sdxl_engine.program.latent_upscale import HIRES_UPSCALERS, resize_matrix
from sdxl_engine.program.schedulers import hires_schedule, make_schedule
from tests.helpers import FIXTURES, TINY_PT_MAX_STEPS

pytestmark = pytest.mark.engine

FOLDER = FIXTURES / "tiny-pt-hires"
META = json.loads((FOLDER / "reference.json").read_text())
STEPS = META["steps"]


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data, np.load(FOLDER / "noise.npz") as noise:
        return {**dict(data), **{f"noise_{k}": v for k, v in noise.items()}}


def test_the_fixture_noise_is_the_engines_two_seed_rules(reference):
    """diffusers was given the program's rules for seeds 41, 42, exactly: the first pass's normal(key(seed_i),
    (4, 16, 16)), the second pass's normal(fold_in(key(seed_i), 0x48495245 "HIRE"), (4, 24, 24)). The second is not
    normal(key(seed_i), (4, 24, 24)), whose first 1024 values would repeat the first pass's noise."""
    import jax
    import jax.numpy as jnp

    from sdxl_engine.program.generate import HIRES_NOISE, initial_noise

    seeds = reference["noise_seeds"]
    assert seeds.tolist() == META["seeds"] and HIRES_NOISE == 0x48495245
    first = np.asarray(initial_noise(jnp.asarray(seeds, jnp.uint32), (4, 16, 16)))
    assert np.array_equal(first, reference["noise_noise"])
    spelled = np.stack([np.asarray(jax.random.normal(jax.random.fold_in(jax.random.key(int(s)), 0x48495245),
                                                     (4, 24, 24), jnp.float32)) for s in seeds])
    assert np.array_equal(spelled, reference["noise_hires_noise"])
    same_key = np.asarray(initial_noise(jnp.asarray(seeds, jnp.uint32), (4, 24, 24)))
    assert np.array_equal(same_key[0].ravel()[:1024], first[0].ravel())  # why the stream: key(seed) repeats itself
    assert not np.isin(reference["noise_hires_noise"][0], first[0]).any()


def test_the_upscalers_are_torchs_interpolate(reference):
    """Every A1111 latent upscaler's matrices applied on the devices equal torch's F.interpolate (align_corners
    False) at several sizes, to float32 rounding. jax.image.resize's "linear" is torch's bilinear, but its "cubic"
    (Keys a = -0.5, renormalized borders) is not torch's bicubic and its "nearest" is torch's nearest-exact, not
    nearest: why the matrices."""
    import jax
    import jax.numpy as jnp

    from sdxl_engine.program.latent_upscale import upscale_latents

    assert META["upscalers"] == list(HIRES_UPSCALERS)
    for n_in, n_out in META["resizes"]:
        x = reference[f"resize_{n_in}_{n_out}_input"]
        for k, name in enumerate(HIRES_UPSCALERS):
            m = resize_matrix(n_in, n_out, name)
            got = np.asarray(upscale_latents(jnp.asarray(x), m, m))
            want = reference[f"resize_{n_in}_{n_out}_{k}"]
            assert np.abs(got - want).max() < 1e-5, (n_in, n_out, name, np.abs(got - want).max())

        def jax_resize(method, x=x, n_out=n_out):
            return np.asarray(jax.image.resize(x, (*x.shape[:2], n_out, n_out), method, antialias=False))

        names = list(HIRES_UPSCALERS)
        assert np.abs(jax_resize("linear") - reference[f"resize_{n_in}_{n_out}_{names.index('Latent')}"]).max() < 1e-5
        cubic = reference[f"resize_{n_in}_{n_out}_{names.index('Latent (bicubic)')}"]
        assert np.abs(jax_resize("cubic") - cubic).max() > 1e-2
        exact = reference[f"resize_{n_in}_{n_out}_{names.index('Latent (nearest-exact)')}"]
        nearest = reference[f"resize_{n_in}_{n_out}_{names.index('Latent (nearest)')}"]
        assert np.array_equal(jax_resize("nearest"), exact) and not np.array_equal(exact, nearest)


def test_the_second_pass_schedule_rules():
    """hires_steps > 0: A1111's int(hires_steps / min(strength, 0.999)) steps of which the last hires_steps run;
    hires_steps 0: diffusers' get_timesteps on the first pass's steps. The fixture's cases, and the edges."""
    for case in META["cases"].values():
        assert hires_schedule(STEPS, case["hires_steps"], case["hires_strength"]) == (case["schedule_steps"],
                                                                                       case["start_step"])
    assert hires_schedule(20, 20, 0.7) == (28, 8)  # A1111's 20 steps at denoising 0.7
    assert hires_schedule(20, 20, 1.0) == (20, 0)  # 0.999: all steps, from the latents noised to the first sigma
    assert hires_schedule(20, 0, 0.7) == (20, 6) and hires_schedule(20, 0, 1.0) == (20, 0)
    with pytest.raises(ValueError, match="runs int"):
        hires_schedule(10, 0, 0.05)


@pytest.fixture(scope="module")
def passes(tiny_pt, tiny_pt_programs):
    """tiny-pt's hires programs, 2 images over 2 devices: the first pass (64x64, latents out) and the second (96x96,
    from latents), and how to run a case on them: (first-pass latents, upscaled latents, images)."""
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize
    from sdxl_engine.program.latent_upscale import sharded_upscale

    programs = tiny_pt_programs
    first = programs[ProgramShape(2, 64, 64, max_steps=TINY_PT_MAX_STEPS, latents_out=True)]
    second = programs[ProgramShape(2, 96, 96, max_steps=TINY_PT_MAX_STEPS, init_latents=True)]
    settings = META["settings"]
    ids, _ = tokenize(tiny_pt, settings["prompt"])
    negative, _ = tokenize(tiny_pt, settings["negative_prompt"])
    config = tiny_pt.scheduler_config

    def run(case, start=None, seeds=tuple(META["seeds"]), upscaler=None):
        meta = META["cases"][case]
        build = lambda schedule, steps, **kw: ProgramInputs.build(  # noqa: E731
            ids, negative, False, list(seeds), settings["guidance_scale"], schedule, steps, TINY_PT_MAX_STEPS, **kw)
        latents, finite = first.executable(programs.params,
                                           build(make_schedule(meta["sampler"], config, STEPS), STEPS))
        assert np.asarray(finite).all()
        m = resize_matrix(16, 24, upscaler or meta["upscaler"])
        large = sharded_upscale(programs.mesh)(latents, m, m)
        total, rule_start = hires_schedule(STEPS, meta["hires_steps"], meta["hires_strength"])
        inputs = build(make_schedule(meta["sampler"], config, total), total,
                       start_step=rule_start if start is None else start, init_latents=large)
        images = second.executable(programs.params, inputs)[0]
        return np.asarray(latents), np.asarray(large), np.asarray(images).astype(int)

    return run


@pytest.mark.slow  # compiles tiny-pt's two hires programs
@pytest.mark.parametrize("case", list(META["cases"]))
def test_hires_images_match_diffusers(passes, reference, case):
    """Each case's first-pass latents, upscaled latents and images match diffusers' (images within 4/255 max and
    0.5/255 mean); the second pass one step earlier or later, other seeds, or nearest in place of the case's
    upscaler, are far off (the comparison sees each)."""
    meta = META["cases"][case]
    latents, large, images = passes(case)
    want = reference[f"{case}_images"].astype(int)
    diff = np.abs(images - want)
    print(f"{case}: latents {np.abs(latents - reference[f'{case}_latents']).max():.2e}, upscaled "
          f"{np.abs(large - reference[f'{case}_upscaled']).max():.2e}, images max {diff.max()}/255, "
          f"mean {diff.mean():.4f}/255")
    assert np.abs(latents - reference[f"{case}_latents"]).max() < 1e-3
    assert np.abs(large - reference[f"{case}_upscaled"]).max() < 1e-3
    assert diff.max() <= 4 and diff.mean() <= 0.5, (case, diff.max(), diff.mean())
    start = meta["start_step"]
    wrongs = [dict(start=start - 1), dict(start=start + 1), dict(seeds=(43, 44))]
    wrongs += [dict(upscaler="Latent (nearest)")] if meta["upscaler"] != "Latent (nearest-exact)" else []
    for wrong in wrongs:
        off = np.abs(passes(case, **wrong)[2] - want)
        print(f"{case} {wrong}: mean {off.mean():.2f}/255")
        assert off.mean() > 1.0, (case, wrong, off.mean())


# ---- pixel upscalers (A1111's None, Lanczos, Nearest): the first pass's images resized on the host ----------------
PIXELS = json.loads((FOLDER / "pixels.json").read_text())


@pytest.fixture(scope="module")
def pixels():
    with np.load(FOLDER / "pixels.npz") as data, np.load(FOLDER / "noise.npz") as noise:
        return {**dict(data), **{f"noise_{k}": v for k, v in noise.items()}}


def test_pixel_upscalers_are_a1111s_resize_image(pixels):
    """image_upscale.upscale_images is A1111's resize_image(0, ...) chain for its built-in upscalers: the fixture's
    resize (a copy of A1111's code, another Pillow) to 1 level; Nearest is not Lanczos; None upscales as Lanczos
    (UpscalerNone leaves the image to the final Lanczos resize); a scale off the multiple of 8 resizes twice."""
    from PIL import Image

    from sdxl_engine.engine.image_upscale import IMAGE_UPSCALERS, upscale_image, upscale_images

    assert list(IMAGE_UPSCALERS) == ["None", "Lanczos", "Nearest"]
    for case, meta in PIXELS["cases"].items():
        got = upscale_images(pixels[f"{case}_first"], 96, 96, meta["upscaler"]).astype(int)
        assert got.shape == (2, 96, 96, 3) and np.abs(got - pixels[f"{case}_upscaled"]).max() <= 1, case
    first = pixels["euler_lanczos_05_first"]
    lanczos, nearest, none = (upscale_images(first, 96, 96, name).astype(int)
                              for name in ("Lanczos", "Nearest", "None"))
    assert np.array_equal(none, lanczos) and np.abs(nearest - lanczos).mean() > 2
    assert np.array_equal(nearest[:, ::3, ::3], first[:, ::2, ::2])  # nearest at 1.5x: source pixel 2i for 3i
    picture = Image.fromarray(first[0])
    # to 84 (scale 1.3125): Lanczos to 84, to 80 (A1111's multiple of 8), then to the asked 84 again
    chain = np.asarray(upscale_image(picture, 84, 84, "Lanczos")).astype(int)
    once = np.asarray(picture.resize((84, 84), Image.Resampling.LANCZOS)).astype(int)
    again = picture.resize((84, 84), Image.Resampling.LANCZOS).resize((80, 80), Image.Resampling.LANCZOS)
    assert np.array_equal(chain, np.asarray(again.resize((84, 84), Image.Resampling.LANCZOS)))
    assert np.abs(chain - once).max() > 0


@pytest.mark.slow  # compiles tiny-pt's second pass from pixels
@pytest.mark.parametrize("case", list(PIXELS["cases"]))
def test_hires_pixel_upscalers_match_diffusers(tiny_pt, tiny_pt_programs, pixels, case):
    """A pixel upscaler's hires fix: the first pass is text to image (diffusers' images to 4/255), and the second
    diffusers' img2img of the upscaled pictures with the seeds' hires noise (within 4/255 max, 0.5/255 mean). The
    second pass from one step later, or with the seeds' own noise stream, is far off."""
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize

    meta, settings, config = PIXELS["cases"][case], PIXELS["settings"], tiny_pt.scheduler_config
    programs = tiny_pt_programs
    ids, _ = tokenize(tiny_pt, settings["prompt"])
    negative, _ = tokenize(tiny_pt, settings["negative_prompt"])
    build = lambda schedule, steps, **kw: ProgramInputs.build(  # noqa: E731
        ids, negative, False, PIXELS["seeds"], settings["guidance_scale"], schedule, steps, TINY_PT_MAX_STEPS, **kw)
    first = programs[ProgramShape(2, 64, 64, max_steps=TINY_PT_MAX_STEPS)]
    images = np.asarray(first.executable(programs.params, build(make_schedule(meta["sampler"], config, STEPS),
                                                                 STEPS))[0]).astype(int)
    diff = np.abs(images - pixels[f"{case}_first"])
    assert diff.max() <= 4 and diff.mean() <= 0.5, (case, diff.max(), diff.mean())
    second = programs[ProgramShape(2, 96, 96, max_steps=TINY_PT_MAX_STEPS, init_image=True, hires_noise=True)]
    total, start = hires_schedule(STEPS, meta["hires_steps"], meta["hires_strength"])
    assert (total, start) == (meta["schedule_steps"], meta["start_step"])

    def run(start_step):
        inputs = build(make_schedule(meta["sampler"], config, total), total, start_step=start_step,
                       image=pixels[f"{case}_upscaled"])
        return np.asarray(second.executable(programs.params, inputs)[0]).astype(int)

    want = pixels[f"{case}_images"].astype(int)
    diff = np.abs(run(start) - want)
    print(f"{case}: first pass max {np.abs(images - pixels[f'{case}_first']).max()}, images max {diff.max()}/255, "
          f"mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5, (case, diff.max(), diff.mean())
    assert np.abs(run(start + 1) - want).mean() > 1.0
    own = programs[ProgramShape(2, 96, 96, max_steps=TINY_PT_MAX_STEPS, init_image=True)]  # the seeds' own noise
    inputs = build(make_schedule(meta["sampler"], config, total), total, start_step=start,
                   image=pixels[f"{case}_upscaled"])
    assert np.abs(np.asarray(own.executable(programs.params, inputs)[0]).astype(int) - want).mean() > 1.0


# ---- the engine: validation, two programs per size, no recompile per strength, steps, seed or upscaler -----------
def gen(engine, **kw):
    return engine.generate(GenerateRequest("a red circle", **{"seed": 1, "num_inference_steps": 6, **kw}))


@pytest.mark.slow  # compiles the hires fix's two programs on the session engine
def test_hires_compiles_two_programs_once_then_nothing(engine):
    """The first hires request compiles its first pass (the default size, latents out) and its second (the large
    size, from latents); hires_strength, hires_steps, the seed, the upscaler and the sampler change only traced
    inputs. The images are the second pass's size; text to image keeps its own program and images."""
    import jax

    txt = gen(engine).images
    width, height = engine.limits.default_size
    big = (int(width * 1.5) // engine.limits.multiple * engine.limits.multiple,
           int(height * 1.5) // engine.limits.multiple * engine.limits.multiple)
    passes = {(width, height, True, False), (*big, False, True)}  # (w, h, latents out, latents in)

    def compiled() -> set:  # the one-call programs' passes compiled so far on this (the session's) engine
        return {(s.width, s.height, s.latents_out, s.init_latents) for s in engine.programs.compiled
                if not s.two_calls}

    before, ready = engine.compile_count, passes & compiled()  # a test before it on this engine may have compiled
    first = gen(engine, hires_scale=1.5)                       # them (test_local's two-call modes: an Euler hires)
    assert engine.compile_count == before + 2 - len(ready)
    assert first.images.shape == (engine.batch, big[1], big[0], 3)
    assert first.request.hires_strength == 0.7 and first.request.hires_steps == 0
    assert first.request.hires_upscaler == "Latent"
    assert compiled() >= passes
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if "backend_compile" in event else None)
    before = engine.compile_count
    runs = {"strength": gen(engine, hires_scale=1.5, hires_strength=0.4),
            "steps": gen(engine, hires_scale=1.5, hires_steps=4),
            "seed": gen(engine, hires_scale=1.5, seed=9),
            "upscaler": gen(engine, hires_scale=1.5, hires_upscaler="Latent (bicubic)"),
            "sampler": gen(engine, hires_scale=1.5, sampler="DPM++ 2M Karras")}
    again = gen(engine, hires_scale=1.5)
    assert engine.compile_count == before and events == []
    assert np.array_equal(again.images, first.images)  # reproducible from the seed
    for name, run in runs.items():
        assert np.abs(run.images.astype(int) - first.images).mean() > 0.5, name
    assert np.array_equal(gen(engine).images, txt)


@pytest.mark.slow  # compiles a pixel hires fix's second program
def test_pixel_hires_is_txt2img_upscaled_then_denoised(engine):
    """A pixel upscaler (Lanczos): the first pass is the plain text-to-image program (its images are the txt2img
    images), the second an img2img program at the large size with the hires noise; upscaling those txt2img images
    given as the request's image (the page's Upscale) gives the same images to the byte, compiling nothing more.
    hires_sampler and hires_prompt change the second pass only, through traced inputs."""
    import jax

    txt = gen(engine)
    before = engine.compile_count
    pixels = gen(engine, hires_scale=1.5, hires_upscaler="Lanczos")
    assert engine.compile_count == before + 1  # the second pass; the first is text to image's
    assert {(s.init_image, s.hires_noise) for s in engine.programs.compiled} >= {(True, True)}
    m = engine.limits.multiple
    assert pixels.images.shape[1:3] == (int(txt.images.shape[1] * 1.5) // m * m,
                                        int(txt.images.shape[2] * 1.5) // m * m)
    latent = gen(engine, hires_scale=1.5)
    assert np.abs(pixels.images.astype(int) - latent.images).mean() > 0.5
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if "backend_compile" in event else None)
    before = engine.compile_count
    given = gen(engine, image=list(txt.images), hires_scale=1.5, hires_upscaler="Lanczos")
    assert np.array_equal(given.images, pixels.images)
    default = gen(engine, image=list(txt.images), hires_scale=1.5)  # an image's default upscaler: Lanczos
    assert np.array_equal(default.images, pixels.images) and default.request.hires_upscaler == "Lanczos"
    nearest = gen(engine, hires_scale=1.5, hires_upscaler="Nearest")
    sampler = gen(engine, hires_scale=1.5, hires_upscaler="Lanczos", hires_sampler="DPM++ 2M Karras")
    prompt = gen(engine, hires_scale=1.5, hires_upscaler="Lanczos", hires_prompt="a blue square")
    same = gen(engine, hires_scale=1.5, hires_upscaler="Lanczos", hires_prompt="a red circle",
               hires_sampler=engine.limits.default_sampler)
    assert engine.compile_count == before and events == []
    assert np.array_equal(same.images, pixels.images)
    for name, run in (("nearest", nearest), ("sampler", sampler), ("prompt", prompt)):
        assert np.abs(run.images.astype(int) - pixels.images).mean() > 0.5, name


@pytest.mark.slow  # compiles a non-square pixel hires fix's two programs
def test_a_non_square_pixel_hires_fix_is_width_by_height(engine):
    """64 x 48 at 2x through a pixel upscaler: the first pass's images are resized on the host to 128 wide and 96
    high (image_upscale.upscale_images(images, width, height)), and the answer is 4 images of 96 rows x 128 columns,
    close to the first pass's images upscaled (a width/height swap there gives the second program the wrong shape)."""
    small = gen(engine, width=64, height=48)
    large = gen(engine, width=64, height=48, hires_scale=2, hires_upscaler="Lanczos", hires_strength=0.2)
    assert large.images.shape == (4, 96, 128, 3)
    upscaled = np.stack([np.asarray(Image.fromarray(image).resize((128, 96), Image.Resampling.LANCZOS))
                         for image in small.images]).astype(int)
    other = np.stack([np.asarray(Image.fromarray(image).resize((128, 96), Image.Resampling.LANCZOS))
                      for image in small.images[::-1]]).astype(int)
    assert np.abs(large.images - upscaled).mean() < np.abs(large.images - other).mean()


@pytest.mark.slow  # compiles two hires fix programs unless the slow tests before it did (24 s here)
def test_hires_progress_counts_both_passes(engine):
    """6 first-pass steps, then at strength 0.5: 3 of 6 (diffusers' rule), or hires_steps 4: 4 of int(4 / 0.5) = 8
    (A1111's): progress counts to 9 of 9, or 10 of 10, through step 6 (each pass's last step always reports; fast
    steps report every few)."""
    for kw, total in ((dict(), 9), (dict(hires_steps=4), 10)):
        events = []
        engine.generate(GenerateRequest("a red circle", seed=1, num_inference_steps=6, hires_scale=1.5,
                                        hires_strength=0.5, **kw), on_step=events.append)
        steps = [e.step for e in events]
        assert {e.steps for e in events} == {total} and steps == sorted(set(steps)), (kw, steps)
        assert steps[0] == 1 and 6 in steps and steps[-1] == total, (kw, steps)


def test_hires_refusals_name_the_field(engine):
    """Refused before anything compiles or runs, each naming its field."""
    width, height = engine.limits.default_size
    image = np.zeros((height, width, 3), np.uint8)
    before = engine.compile_count
    cases = [(dict(hires_scale=1.0), "hires_scale"), (dict(hires_scale="big"), "hires_scale"),
             (dict(hires_scale=1.01), "hires_scale"), (dict(hires_scale=17.0), "hires_scale"),
             (dict(hires_scale=2.5, width=512, height=512), "hires_scale"),  # 1280x1280: past max_pixels
             (dict(hires_scale=1.5, image=image, hires_upscaler="Latent"), "hires_upscaler"),
             (dict(hires_scale=1.5, image=image, strength=0.5), "hires_scale"),
             (dict(hires_scale=1.5, image=image, mask=np.ones((height, width), np.float32)), "hires_scale"),
             (dict(hires_scale=1.5, hires_sampler="Euler q"), "hires_sampler"),
             (dict(hires_scale=1.5, hires_prompt=""), "hires_prompt"),
             (dict(hires_scale=1.5, hires_prompt="a cat <lora:nope:1>"), "hires_prompt"),
             (dict(hires_sampler="Euler"), "hires_sampler"), (dict(hires_prompt="a cat"), "hires_prompt"),
             (dict(hires_scale=1.5, hires_strength=0), "hires_strength"),
             (dict(hires_scale=1.5, hires_strength=1.5), "hires_strength"),
             (dict(hires_scale=1.5, hires_strength=0.1), "hires_strength"),  # int(6 x 0.1) = 0 steps
             (dict(hires_scale=1.5, hires_steps=-1), "hires_steps"),
             (dict(hires_scale=1.5, hires_steps=40, hires_strength=0.5), "hires_steps"),  # a schedule of 80
             (dict(hires_scale=1.5, hires_upscaler="ESRGAN"), "hires_upscaler"),
             (dict(hires_scale=1.5, hires_upscaler=["Latent"]), "hires_upscaler"),
             (dict(hires_strength=0.5), "hires_strength"), (dict(hires_steps=4), "hires_steps"),
             (dict(hires_upscaler="Latent"), "hires_upscaler")]
    for kw, field in cases:
        with pytest.raises(InvalidRequest) as err:
            gen(engine, **kw)
        assert err.value.field == field, (kw.keys(), err.value)
    assert engine.compile_count == before
