"""Inpainting through the compiled program: diffusers' StableDiffusionXLInpaintPipeline's images with a plain
4-channel UNet (tiny-pt) and a 9-channel inpainting UNet (tiny-pt-inpaint), and the conventions each one rests on.

References: tests/fixtures/tiny-pt-inpaint/ (``python -m tools.img2img_noise``, then ``python -m
tools.fixtures_inpaint``): 64x64, 10 steps, two fixed pictures and two masks (a rectangle, a disc), Euler at strength
0.75 and 1, DPM++ 2M Karras at 0.6, DDIM at 1; image latents the VAE posterior's mean, the noise the engine's for seeds
41 and 42. Tolerance as the other parity tests: max 4/255, mean 0.5/255 (uint8 units).
"""

import dataclasses
import json

import numpy as np
import pytest

from sdxl_engine.program.schedulers import img2img_start, make_schedule
from tests.helpers import FIXTURES

pytestmark = pytest.mark.engine

FOLDER = FIXTURES / "tiny-pt-inpaint"
META = json.loads((FOLDER / "reference.json").read_text())
SETTINGS = META["settings"]
STEPS = SETTINGS["num_inference_steps"]
MODELS = {4: FIXTURES / "tiny-pt", 9: FOLDER}


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def programs():
    """The inpainting programs of tiny-pt (4 channels) and tiny-pt-inpaint (9): 2 images at 64x64 with CFG over 2
    devices, and ``run(channels, sampler, strength, ...)`` -> (2, 64, 64, 3) int images. ``run.compile(channels)``
    compiles that model's program again (for a test that patched what it traces), and ``run(..., program=it)`` runs
    it on the same weights and inputs."""
    import jax

    from sdxl_engine.checkpoint.loading import load_folder
    from sdxl_engine.program.compiling import compile_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize
    from sdxl_engine.program.sharding import make_mesh, replicated

    mesh = make_mesh(jax.devices()[:2])
    shape = ProgramShape(2, 64, 64, max_steps=STEPS, init_image=True, inpaint=True)
    built = {}
    for channels, folder in MODELS.items():
        model = load_folder(folder, folder.name, "float32")
        params = jax.device_put(model.params, replicated(mesh))
        built[channels] = (model, params, compile_program(model, params, shape, mesh))

    def run(channels, sampler, strength, pictures, masks, seeds=tuple(META["seeds"]), start=None, from_noise=None,
            program=None, **replace):
        model, params, compiled = built[channels]
        compiled = program or compiled
        start = img2img_start(STEPS, strength) if start is None else start
        ids, _ = tokenize(model, SETTINGS["prompt"])
        negative, _ = tokenize(model, SETTINGS["negative_prompt"])
        schedule = make_schedule(sampler, model.scheduler_config, STEPS)
        inputs = ProgramInputs.build(ids, negative, False, list(seeds), SETTINGS["guidance_scale"], schedule, STEPS,
                                     STEPS, image=pictures, start_step=start, mask=np.asarray(masks) / 255.0,
                                     from_noise=strength == 1.0 if from_noise is None else from_noise)
        inputs = dataclasses.replace(inputs, **replace)
        return np.asarray(compiled.executable(params, inputs)[0]).astype(int)

    def recompile(channels):
        model, params, _ = built[channels]
        return compile_program(model, params, shape, mesh)

    run.compile = recompile
    return run


def case_args(case):
    meta = META["cases"][case]
    return meta["unet_in_channels"], meta["sampler"], meta["strength"]


@pytest.mark.slow  # compiles two inpainting programs at the fixture's shape
@pytest.mark.parametrize("case", list(META["cases"]))
def test_inpaint_images_match_diffusers(programs, reference, case):
    """Each UNet, sampler and strength within 4/255 (max) and 0.5/255 (mean) of diffusers' images."""
    want = reference[f"{case}_images"].astype(int)
    diff = np.abs(programs(*case_args(case), reference["pictures"], reference["masks"]) - want)
    print(f"{case}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5, (case, diff.max(), diff.mean())


SOFT = json.loads((FOLDER / "soft.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SOFT["cases"]))
def test_soft_masks_match_diffusers_without_binarizing(programs, case):
    """A blurred mask kept soft (the engine's ``soft_mask``: diffusers' mask processor with ``do_binarize`` off):
    within 4/255 max and 0.5/255 mean of diffusers' images, 4 and 9 channels; the same mask binarized at 0.5 (the
    default) is far off, and validation keeps the grey levels only with soft_mask."""
    from sdxl_engine.engine.validation import as_masks

    meta = SOFT["cases"][case]
    with np.load(FOLDER / "soft.npz") as data:
        pictures, masks, want = data["pictures"], data["masks"], data[f"{case}_images"].astype(int)
    args = meta["unet_in_channels"], meta["sampler"], meta["strength"]
    diff = np.abs(programs(*args, pictures, masks) - want)
    print(f"{case}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5, (case, diff.max(), diff.mean())
    binary = as_masks(list(masks), pictures, 2) * 255
    assert set(np.unique(binary)) == {0.0, 255.0}
    assert np.array_equal(as_masks(list(masks), pictures, 2, binarize=False) * 255, masks.astype(np.float32))
    assert np.abs(programs(*args, pictures, binary) - want).mean() > max(0.5, 20 * diff.mean())


def _off(programs, reference, case, **wrong):
    want = reference[f"{case}_images"].astype(int)
    return np.abs(programs(*case_args(case), reference["pictures"], reference["masks"], **wrong) - want).mean()


@pytest.mark.slow
def test_the_comparison_sees_start_step_noise_and_the_strength_1_rule(programs, reference):
    """Each convention moves the images far from diffusers': the start step one off, other seeds' noise. At
    strength 1 the noised image instead of pure noise (diffusers' ``is_strength_max``) differs less (sigma_max is
    about 14.6, so the image is a small part of the start), yet well beyond the rounding the right rule leaves."""
    for case, wrong, least in (("unet4_euler_075", dict(start=2), 1.5), ("unet4_euler_075", dict(start=4), 1.5),
                               ("unet4_euler_075", dict(seeds=(43, 44)), 1.5),
                               ("unet9_euler_075", dict(seeds=(43, 44)), 1.5),
                               ("unet4_euler_1", dict(from_noise=False), 0.1),
                               ("unet9_euler_1", dict(from_noise=False), 0.1)):
        right, off = _off(programs, reference, case), _off(programs, reference, case, **wrong)
        print(f"{case} {wrong}: mean {off:.3f}/255 (the right inputs: {right:.4f})")
        assert off > least and off > 20 * right, (case, wrong, off, right)


@pytest.mark.slow
def test_an_empty_mask_keeps_the_image_whatever_the_seed_or_strength(programs, reference):
    """4-channel UNet, an all-zero mask: after the last step the blend puts the clean image latents back, so the
    output is the image's decode whatever the seed and strength; a full mask with the same inputs is another
    image. (The pixel-level "stays outside the mask" check runs on the trained tiny-shapes in the engine test:
    tiny-pt's VAE is random and its attention mixes the whole picture.)"""
    pictures, masks = reference["pictures"], reference["masks"]
    kept = programs(4, "Euler", 0.75, pictures, np.zeros_like(masks))
    other = programs(4, "DPM++ 2M Karras", 0.3, pictures, np.zeros_like(masks), seeds=(7, 8))
    assert np.abs(other - kept).max() <= 1
    full = programs(4, "Euler", 0.75, pictures, np.full_like(masks, 255))
    assert np.abs(full - kept).mean() > 5


def _clean_blend(latents, image, inputs, i):
    return (1 - image.mask) * image.latents + image.mask * latents


def _fresh_noise_blend(latents, image, inputs, i):
    from sdxl_engine.program.generate import step_noise

    sigma_next = inputs.sigmas[i + 1] * (i + 1 < inputs.num_steps)
    fresh = step_noise(inputs.seeds, i, image.latents.shape[1:])
    return (1 - image.mask) * (image.latents + sigma_next * fresh) + image.mask * latents


@pytest.mark.slow
def test_the_blend_uses_the_renoised_image_latents(programs, reference):
    """Blending with the clean image latents at every step (no re-noising: the known region's noise level wrong)
    or re-noising with a fresh draw per step is far from diffusers'; the re-noising with the request's one draw is
    what the reference did. Both wrong blends run in one program (one compile): the first seed's image blends
    without re-noising, the second's with fresh noise per step (``shard_map`` gives each device its own images, so
    the image is told by its seed)."""
    import jax.numpy as jnp

    from sdxl_engine.program import generate

    first_seed = META["seeds"][0]

    def wrong(latents, image, inputs, i):
        first = (inputs.seeds == first_seed)[:, None, None, None]
        return jnp.where(first, _clean_blend(latents, image, inputs, i), _fresh_noise_blend(latents, image, inputs, i))

    saved = generate.keep_known
    try:
        generate.keep_known = wrong  # a new compile: the patched function is traced into a fresh program
        compiled = programs.compile(4)
    finally:
        generate.keep_known = saved
    images = programs(4, "Euler", 0.75, reference["pictures"], reference["masks"], program=compiled)
    off = np.abs(images - reference["unet4_euler_075_images"].astype(int)).mean(axis=(1, 2, 3))
    print(f"un-noised (seed {first_seed}): mean {off[0]:.2f}/255; fresh noise per step: mean {off[1]:.2f}/255")
    assert off[0] > 1.0 and off[1] > 1.0, off


def test_an_inpainting_unet_runs_inpainting_programs_only():
    """A 9-channel UNet has nothing to put in its mask channels without a mask: refused by name, as is a mask
    without an image."""
    from sdxl_engine.checkpoint.loading import load_folder
    from sdxl_engine.program.generate import ProgramShape, static_options

    model = load_folder(FOLDER, "tiny-pt-inpaint", "float32")
    assert model.kind.inpainting_unet and model.kind.unet_in_channels == 9
    for shape in (ProgramShape(2, 64, 64, 10), ProgramShape(2, 64, 64, 10, init_image=True)):
        with pytest.raises(ValueError, match="inpainting programs only"):
            static_options(model, shape)
    with pytest.raises(ValueError, match="needs init_image"):
        static_options(model, ProgramShape(2, 64, 64, 10, inpaint=True))
    assert static_options(model, ProgramShape(2, 64, 64, 10, init_image=True, inpaint=True)).inpainting_unet


# ---- the engine: validation, the inpainting program per size, no recompile per mask --------------------------
def picture(engine, k=0) -> np.ndarray:
    """(H, W, 3) uint8 at the engine's default size: a colour ramp shifted by ``k``."""
    width, height = engine.limits.default_size
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(x * 4 + k) % 256, (y * 4) % 256, (255 - x - y + 3 * k) % 256], -1).astype(np.uint8)


def left_half(engine) -> np.ndarray:
    width, height = engine.limits.default_size
    mask = np.zeros((height, width), np.uint8)
    mask[:, : width // 2] = 255
    return mask


def gen(engine, **kw):
    from sdxl_engine.engine.validation import GenerateRequest

    return engine.generate(GenerateRequest("a red circle", **{"seed": 1, "num_inference_steps": 6, **kw}))


@pytest.mark.slow  # compiles the inpainting program on the session engine
def test_inpainting_compiles_once_then_nothing_for_mask_image_or_strength(engine):
    """The first masked request at a size compiles the inpainting program; the mask, image, strength (1 included)
    and seed change only traced inputs. An empty mask returns the same images for any seed; img2img keeps its own
    program."""
    import jax

    image, mask = picture(engine), left_half(engine)
    first = gen(engine, image=image, mask=mask, strength=0.75)
    assert any(s.inpaint for s in engine.programs.compiled)
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if "backend_compile" in event else None)
    before = engine.compile_count
    runs = {"strength 1": gen(engine, image=image, mask=mask, strength=1.0),
            "other mask": gen(engine, image=image, mask=255 - mask, strength=0.75),
            "empty, seed 1": gen(engine, image=image, mask=np.zeros_like(mask), strength=0.75),
            "empty, seed 9": gen(engine, image=image, mask=np.zeros_like(mask), strength=0.5, seed=9),
            "per image": gen(engine, image=image, mask=[mask] + [255 - mask] * (engine.batch - 1), strength=0.75)}
    assert engine.compile_count == before and events == [], events
    assert np.abs(runs["empty, seed 1"].images.astype(int) - runs["empty, seed 9"].images).max() <= 1
    for name in ("strength 1", "other mask"):
        assert np.abs(runs[name].images.astype(int) - first.images).mean() > 1, name
    assert np.array_equal(runs["per image"].images[0], first.images[0])
    assert np.array_equal(runs["per image"].images[1], runs["other mask"].images[1])


@pytest.mark.slow  # compiles tiny-shapes' img2img and inpainting programs (45 s here)
def test_inpainting_keeps_what_the_mask_keeps(tiny_shapes_engine):
    """On the trained tiny-shapes: a blue square on white with the left half masked, at strength 1 towards "a red
    circle". The right half (away from the mask's edge) stays near the image's own decode (an empty mask's output:
    the VAE's reconstruction, the most any inpainting keeps); the left half moves far from it; without the mask
    (img2img at 1) the right half moves too."""
    engine = tiny_shapes_engine
    width, height = engine.limits.default_size
    image = np.full((height, width, 3), 255, np.uint8)
    image[height // 4: 3 * height // 4, width // 4: 3 * width // 4] = (20, 40, 230)
    mask = left_half(engine)
    right, left = np.s_[:, :, width // 2 + 8:], np.s_[:, :, : width // 2]
    run = lambda **kw: gen(engine, image=image, strength=1.0, num_inference_steps=10, **kw).images.astype(int)  # noqa: E731
    kept, masked, plain = run(mask=np.zeros_like(mask)), run(mask=mask), run()
    distance = lambda out, part: np.abs(out[part] - kept[part]).mean()  # noqa: E731
    print(f"the decode's distance to the input {np.abs(kept - image).mean():.1f}; to the decode: right half masked "
          f"{distance(masked, right):.1f}, img2img {distance(plain, right):.1f}; left half masked "
          f"{distance(masked, left):.1f}")
    # Measured: right half masked 12.3, img2img 162.9, left half masked 84.2 (tiny-shapes' latents are 8x8: the
    # decoder's receptive field reaches past the 8-pixel margin, so the kept half is near, not equal).
    assert distance(masked, right) < 20 and distance(masked, left) > 3 * distance(masked, right)
    assert distance(plain, right) > 5 * distance(masked, right)


def test_inpainting_refusals_name_the_mask(engine):
    """Refused before anything compiles or runs, each naming ``mask``: no image, a wrong type, shape, dtype or value
    range, another aspect ratio, a wrong count. A mask of the image's aspect ratio at another size is resized."""
    from sdxl_engine.engine.validation import InvalidRequest

    image, mask = picture(engine), left_half(engine)
    before = engine.compile_count
    cases = [dict(mask=mask), dict(image=image, mask=mask.tolist()), dict(image=image, mask=mask[None, None]),
             dict(image=image, mask=mask.astype(np.int64)), dict(image=image, mask=mask / 100.0),
             dict(image=image, mask=np.full(mask.shape, np.nan)), dict(image=image, mask=mask[:, : mask.shape[1] // 2]),
             dict(image=image, mask=[mask] * (engine.batch + 1))]
    for kw in cases:
        with pytest.raises(InvalidRequest) as err:
            gen(engine, **kw)
        assert err.value.field == "mask", (kw, err.value)
    for kw in (dict(image=image, soft_mask=True), dict(image=image, mask=mask, soft_mask="yes")):
        with pytest.raises(InvalidRequest) as err:
            gen(engine, **kw)
        assert err.value.field == "soft_mask", (kw, err.value)
    assert engine.compile_count == before


def test_a_mask_is_made_grey_resized_and_binarized_as_diffusers_does():
    """as_masks: RGB made grey as PIL's "L", a half-size mask resized to the image (Lanczos), values binarized at
    0.5 (diffusers' VaeImageProcessor with do_binarize), one mask broadcast to every image."""
    from sdxl_engine.engine.validation import as_masks

    images = np.zeros((2, 16, 24, 3), np.uint8)
    rgb = np.zeros((16, 24, 3), np.uint8)
    rgb[:, 12:] = (255, 255, 255)
    rgb[:, :4] = (200, 0, 0)  # grey 0.299 * 200 = 59.8: kept
    got = as_masks(rgb, images, 2)
    assert got.shape == (2, 16, 24) and got.dtype == np.float32
    assert (got[:, :, 12:] == 1).all() and (got[:, :, :12] == 0).all()
    soft = np.tile(np.linspace(0, 1, 24, dtype=np.float32), (16, 1))
    assert np.array_equal(as_masks(soft, images, 2)[0], (soft >= 0.5).astype(np.float32))
    half = as_masks(rgb[::2, ::2], images, 2)  # 12x8, the same aspect ratio
    assert half.shape == (2, 16, 24) and (half[:, :, 14:] == 1).all() and (half[:, :, :10] == 0).all()
    assert as_masks([rgb, 255 - rgb], images, 2)[1, 0, 0] == 1


def test_outpainting_grows_the_canvas_with_edge_colours_and_masks_the_new_area():
    """grow_canvas through validate: the image padded with its edge pixels, the new area masked (1), the image's own
    area keeping its mask (or 0 without one); the grown size is the request's."""
    from sdxl_engine.engine.validation import GenerateRequest, Limits, validate

    limits = Limits(max_seed=10, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=10,
                    default_guidance=5.0, multiple=8, max_pixels=128 * 128, batch=2)
    image = np.zeros((48, 40, 3), np.uint8)
    image[:, 0] = (255, 0, 0)  # left edge red, top-right pixel green
    image[0, -1] = (0, 255, 0)
    own = np.zeros((48, 40), np.uint8)
    own[10:20, 10:20] = 255
    got = validate(GenerateRequest("a", image=image, mask=own, outpaint=(8, 0, 16, 16)), limits)
    assert (got.width, got.height) == (64, 64) and got.outpaint is None
    assert got.image.shape == (2, 64, 64, 3) and got.mask.shape == (2, 64, 64)
    assert np.array_equal(got.image[0, :48, 8:48], image)
    assert (got.image[0, :48, :8] == (255, 0, 0)).all()  # the left edge's colour continues
    assert (got.image[0, 0, 48:] == (0, 255, 0)).all()  # the top-right pixel's to the right
    assert (got.image[0, 48:, 8:48] == got.image[0, 47, 8:48]).all()  # the bottom row's down
    assert (got.mask[:, :, :8] == 1).all() and (got.mask[:, :, 48:] == 1).all() and (got.mask[:, 48:] == 1).all()
    assert np.array_equal(got.mask[0, :48, 8:48], (own >= 128).astype(np.float32))
    plain = validate(GenerateRequest("a", image=image, outpaint=[8, 0, 16, 16]), limits)
    assert plain.mask[0, :48, 8:48].sum() == 0 and plain.mask.sum() == 2 * (64 * 64 - 48 * 40)


@pytest.mark.parametrize("sides, words", [((0, 0, 0, 0), "adds no pixels"), ((8, 8, 8), "4 whole numbers"),
                                          ((8, -8, 8, 8), "between 0 and"), ((8, 0.5, 8, 8), "whole number"),
                                          ((4, 0, 0, 0), "grown canvas"),
                                          ((8, 0, 8, 0), None)])
def test_outpainting_refusals_name_the_field(sides, words):
    from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, Limits, validate

    limits = Limits(max_seed=10, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=10,
                    default_guidance=5.0, multiple=8, max_pixels=128 * 128, batch=2)
    request = GenerateRequest("a", image=np.zeros((48, 48, 3), np.uint8), outpaint=sides)
    if words is None:
        assert validate(request, limits).width == 64
        with pytest.raises(InvalidRequest, match="outpaint"):
            validate(dataclasses.replace(request, image=None), limits)
        return
    with pytest.raises(InvalidRequest) as err:
        validate(request, limits)
    assert err.value.field == "outpaint" and words in str(err.value), err.value


def test_outpainting_is_inpainting_on_the_grown_canvas(engine):
    """An outpainting request gives the images of the inpainting request with the canvas and mask grow_canvas makes
    (the same program: no compile once the size's inpainting program exists)."""
    from sdxl_engine.engine.validation import grow_canvas

    width, height = engine.limits.default_size
    image = picture(engine)[:, 8: width - 8]
    out = gen(engine, image=image, outpaint=(8, 0, 8, 0), strength=1.0)
    canvas, mask = grow_canvas(image[None], None, (8, 0, 8, 0))
    same = gen(engine, image=canvas[0], mask=mask[0], strength=1.0)
    assert out.images.shape == (engine.batch, height, width, 3)
    assert np.array_equal(out.images, same.images)


@pytest.fixture(scope="module")
def inpaint_engine():
    """An engine serving tests/fixtures/tiny-pt-inpaint (a 9-channel inpainting UNet) on 4 CPU devices."""
    import os

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    config = EngineConfig.load({"model": str(FOLDER), "cpu_devices": 4}, environ={
        k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")})
    return Engine(config, log=lambda *_: None).start()


@pytest.mark.slow  # starts an engine on the inpainting model
def test_an_inpainting_model_serves_masked_requests_with_diffusers_images(inpaint_engine, reference):
    """A 9-channel model starts (its start-up program is the inpainting one), makes diffusers' images for a masked
    request (the fixture's case through the whole engine: validation, plan, program), and refuses a request
    without a mask naming ``mask`` and saying what the model does."""
    from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest

    engine = inpaint_engine
    assert engine.batch == 4 and all(s.inpaint for s in engine.programs.compiled)
    meta = META["cases"]["unet9_euler_075"]
    pictures, masks = list(reference["pictures"]) * 2, list(reference["masks"]) * 2
    before = engine.compile_count
    result = engine.generate(GenerateRequest(SETTINGS["prompt"], negative_prompt=SETTINGS["negative_prompt"],
                                             seed=META["seeds"][0], guidance_scale=SETTINGS["guidance_scale"],
                                             num_inference_steps=STEPS, sampler="Euler", image=pictures, mask=masks,
                                             strength=meta["strength"]))
    assert engine.compile_count == before
    diff = np.abs(result.images[:2].astype(int) - reference["unet9_euler_075_images"])
    print(f"through the engine: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5
    for kw in (dict(), dict(image=pictures[0])):
        with pytest.raises(InvalidRequest, match="inpainting UNet .* only repaints the masked part") as err:
            engine.generate(GenerateRequest("a red circle", **kw))
        assert err.value.field == "mask"


@pytest.mark.slow  # compiles one more 9-channel program, with the masked image left unmasked
def test_the_inpainting_unet_sees_the_masked_image(programs, reference):
    """The 9-channel UNet's third input is the image with the repainted area zeroed ((mask < 0.5) in [-1, 1]): the
    whole image there instead is 10x farther from diffusers' images than the right program (the random UNet reads
    those channels weakly, so the parity tolerance alone would not see it)."""
    from sdxl_engine.program import generate

    saved = generate.image_conditioning

    def unmasked(st, params, inputs):
        image = saved(st, params, inputs)
        return image._replace(masked=generate.encode_image(st, params, inputs.image))

    try:
        generate.image_conditioning = unmasked
        compiled = programs.compile(9)
    finally:
        generate.image_conditioning = saved
    images = programs(9, "Euler", 0.75, reference["pictures"], reference["masks"], program=compiled)
    wrong = np.abs(images - reference["unet9_euler_075_images"].astype(int)).mean()
    right = _off(programs, reference, "unet9_euler_075")
    print(f"masked image unmasked: mean {wrong:.3f}/255 (the right program: {right:.4f})")
    assert wrong > 10 * right and wrong > 0.05, (wrong, right)


def test_the_inpainting_unets_masked_image_zeroes_the_repainted_part():
    """image_conditioning, not compiled (the VAE encoder runs eagerly): the 9-channel UNet's masked image is
    diffusers' ``init_image * (mask < 0.5)``, the picture in [-1, 1] with 0 wherever the mask repaints (>= 0.5),
    encoded; an empty mask's masked image is the picture's own latents. Non-square (64 wide, 48 high), a hard mask
    (the left 16 columns) and a soft one (0.5 repaints, 0.25 keeps). Catches an inverted masked image
    (``image * mask``, or keeping the repainted part) in seconds; the slow parity tests barely see it."""
    from sdxl_engine.checkpoint.loading import load_folder
    from sdxl_engine.program.generate import (
        ProgramInputs,
        ProgramShape,
        encode_image,
        encode_pixels,
        image_conditioning,
        static_options,
    )

    model = load_folder(FOLDER, "tiny-pt-inpaint", "float32")
    st = static_options(model, ProgramShape(2, 48, 64, STEPS, init_image=True, inpaint=True))
    pictures = np.random.default_rng(3).integers(0, 256, (2, 48, 64, 3), dtype=np.uint8)
    masks = np.zeros((2, 48, 64), np.float32)
    masks[0, :, :16] = 1.0
    masks[1, 8:40, 20:44] = 0.5
    masks[1, :, 48:] = 0.25

    def conditioning(mask):
        inputs = ProgramInputs.build(np.zeros((2, 77), np.int32), np.zeros((2, 77), np.int32), True, [41, 42], 5.0,
                                     make_schedule("Euler", model.scheduler_config, STEPS), STEPS, STEPS,
                                     image=pictures, start_step=3, mask=mask)
        return image_conditioning(st, model.params, inputs)

    got = conditioning(masks)
    unit = pictures.astype(np.float32) / 255.0 * 2.0 - 1.0  # (2, 48, 64, 3) in [-1, 1]
    kept = np.where(masks[..., None] < 0.5, unit, 0.0).transpose(0, 3, 1, 2)  # (2, 3, 48, 64)
    assert (kept[0, :, :, :16] == 0).all() and (kept[1, :, 8:40, 20:44] == 0).all()
    assert np.array_equal(kept[1, :, :, 48:], unit[1, :, 48:].transpose(2, 0, 1))  # 0.25: kept
    want = np.asarray(encode_pixels(st, model.params, kept))
    assert got.masked.shape == (2, 4, 12, 16)
    np.testing.assert_allclose(np.asarray(got.masked), want, atol=1e-5)
    inverted = np.asarray(encode_pixels(st, model.params, np.where(masks[..., None] >= 0.5, unit, 0.0)
                                        .transpose(0, 3, 1, 2)))
    assert np.abs(want - inverted).mean() > 100 * 1e-5  # the inverted image is far from it
    np.testing.assert_array_equal(np.asarray(got.mask), masks[:, None, ::4, ::4])  # (2, 1, 12, 16), nearest
    empty = conditioning(np.zeros_like(masks))
    np.testing.assert_allclose(np.asarray(empty.masked), np.asarray(encode_image(st, model.params, pictures)),
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(empty.latents), np.asarray(empty.masked), atol=1e-5)


def test_a_refiner_is_refused_beside_an_inpainting_model():
    """The refiner continues a plain UNet's latents: with an inpainting base model it is refused at start, naming
    both models."""
    from sdxl_engine.checkpoint.loading import RefinerMismatch, check_refiner, load_folder

    base = load_folder(FOLDER, "tiny-pt-inpaint", "float32")
    refiner = load_folder(FIXTURES / "tiny-pt-refiner", "tiny-pt-refiner", "float32")
    with pytest.raises(RefinerMismatch, match="tiny-pt-refiner: tiny-pt-inpaint has an inpainting UNet"):
        check_refiner(base, refiner)
    check_refiner(load_folder(MODELS[4], "tiny-pt", "float32"), refiner)  # a plain base: accepted
