"""The SDXL refiner (diffusers' ensemble of experts) through the compiled program and the engine: diffusers' images,
the conventions (the switch step, the aesthetic score in the time ids, the refiner's own force_zeros), one program
for every switch point, and the refusals.

References: tests/fixtures/tiny-pt-refiner-reference/ (``python -m tools.refiner_fixtures``, the torch venv): tiny-pt
as the base, ``StableDiffusionXLPipeline(denoising_end=s, output_type="latent")``, then tests/fixtures/tiny-pt-refiner/
as ``StableDiffusionXLImg2ImgPipeline(image=latents, denoising_start=s)``; Euler at s = 0.8, 0.5 and 0.65 (that one
with a negative prompt) and DPM++ 2M Karras at 0.8, 10 steps, guidance 5, 64x64, two images, the initial noise the
engine's for seeds 41 and 42 (tests/fixtures/tiny-pt-img2img/noise.npz). Image tolerance as the other parity tests:
max 4/255, mean 0.5/255 (uint8 units); the refiner's text embeddings within 1e-5, its time ids exact.
"""

import dataclasses
import json
import math
import os

import numpy as np
import pytest

from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, Limits, validate
from sdxl_engine.program.schedulers import make_schedule, refiner_start
from tests.helpers import FIXTURES

pytestmark = pytest.mark.engine

REFINER = FIXTURES / "tiny-pt-refiner"
FOLDER = FIXTURES / "tiny-pt-refiner-reference"
META = json.loads((FOLDER / "reference.json").read_text())
SETTINGS = META["settings"]
STEPS = SETTINGS["num_inference_steps"]
SEEDS = tuple(META["seeds"])


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def models(tiny_pt):
    """tiny-pt with tiny-pt-refiner attached (a copy: the session's tiny_pt stays base only), and its params
    {tiny-pt's components, "refiner": {"text_encoder_2", "unet"}}, as the engine arranges them."""
    from sdxl_engine.checkpoint.loading import check_refiner, load_folder

    refiner = load_folder(REFINER, "tiny-pt-refiner", "float32")
    check_refiner(tiny_pt, refiner)
    base = dataclasses.replace(tiny_pt, refiner=refiner)
    return base, {**tiny_pt.params, "refiner": {k: refiner.params[k] for k in ("text_encoder_2", "unet")}}


def inputs_for(base, case: dict, seeds=SEEDS, switch: int | None = None, **refiner_kw):
    """ProgramInputs of a fixture case (plain diffusers tokens: the prompt has no syntax), refiner from ``switch``
    (default: the case's step)."""
    from sdxl_engine.program.generate import ProgramInputs, tokenize

    ids, _ = tokenize(base, SETTINGS["prompt"])
    negative, _ = tokenize(base, case["negative_prompt"])
    schedule = make_schedule(case["sampler"], base.scheduler_config, STEPS)
    inputs = ProgramInputs.build(ids, negative, not case["negative_prompt"], list(seeds), SETTINGS["guidance_scale"],
                                 schedule, STEPS, STEPS)
    return inputs.with_refiner(case["refiner_start"] if switch is None else switch, schedule, **refiner_kw)


# ---- the fixture, the switch rule, the refusals: no compile --------------------------------------------------------
def test_the_fixture_is_a_refiner_for_tiny_pt(models):
    """tiny-pt-refiner loads as what it declares (text_encoder_2 only, 5 time ids, requires_aesthetics_score,
    no force-zero) and fits tiny-pt (check_refiner passed in the fixture): same VAE latents, same tokenizer_2."""
    base, params = models
    kind = base.refiner.kind
    assert kind.refiner and kind.text_encoders == ("text_encoder_2",) and kind.time_ids == 5
    assert kind.requires_aesthetics_score and not kind.force_zeros_for_empty_prompt
    assert base.refiner.tokenizer is None and set(params["refiner"]) == {"text_encoder_2", "unet"}
    assert base.refiner.vae.scaling_factor == base.vae.scaling_factor and base.refiner.latent_channels == 4


def test_the_switch_step_is_diffusers_denoising_end_rule(tiny_pt):
    """The refiner's first step is the count of timesteps >= round(1000 - 1000 s): the fixture's (what diffusers'
    base ran, and its refiner's begin_index) for every case; the edges and refusals."""
    for case in META["cases"].values():
        schedule = make_schedule(case["sampler"], tiny_pt.scheduler_config, STEPS)
        assert np.array_equal(schedule.timesteps, np.float32(case["timesteps"]))
        assert refiner_start(schedule.timesteps, case["switch_at"]) == case["refiner_start"]
    euler = make_schedule("Euler", tiny_pt.scheduler_config, STEPS).timesteps  # 901, 801, ..., 1
    switches = {0.0: 0, 0.05: 0, 0.1: 1, 0.79: 7, 0.8: 8, 0.9: 9, 0.999: 10}  # 0: the refiner runs every step
    assert {s: refiner_start(euler, s) for s in switches} == switches
    for bad in (1.0, -0.5, math.nan):
        with pytest.raises(ValueError, match="switch_at must be at least 0 and below 1"):
            refiner_start(euler, bad)


def test_refiner_switch_at_is_validated_naming_the_field():
    limits = Limits(max_seed=100, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=10,
                    default_guidance=5.0, multiple=16)
    with pytest.raises(InvalidRequest, match="no refiner is loaded: start the server with --refiner") as err:
        validate(GenerateRequest("a red circle", refiner_switch_at=0.8), limits)
    assert err.value.field == "refiner_switch_at"
    assert validate(GenerateRequest("a red circle"), limits).refiner_switch_at is None
    with_refiner = dataclasses.replace(limits, refiner=True)
    assert validate(GenerateRequest("a red circle", refiner_switch_at="0.8"), with_refiner).refiner_switch_at == 0.8
    assert validate(GenerateRequest("a red circle", refiner_switch_at=0), with_refiner).refiner_switch_at == 0
    for bad in (1, 1.5, -0.2, "soon", float("nan"), True, [0.8]):
        with pytest.raises(InvalidRequest) as err:
            validate(GenerateRequest("a red circle", refiner_switch_at=bad), with_refiner)
        assert err.value.field == "refiner_switch_at", bad
    big = dataclasses.replace(with_refiner, max_pixels=128 * 128)  # a size hires 1.5 can reach
    assert validate(GenerateRequest("a red circle", hires_scale=1.5), big).hires_scale == 1.5
    with pytest.raises(InvalidRequest, match="does not run with hires fix") as err:
        validate(GenerateRequest("a red circle", refiner_switch_at=0.8, hires_scale=1.5), big)
    assert err.value.field == "refiner_switch_at" and "hires_scale" not in str(err.value)  # each protocol's own name
    with pytest.raises(InvalidRequest, match="no refiner is loaded"):  # what is missing first, not the combination
        validate(GenerateRequest("a red circle", refiner_switch_at=0.8, hires_scale=1.5),
                 dataclasses.replace(big, refiner=False))


def test_a_refiner_that_cannot_take_the_models_latents_is_refused(tiny_pt, models):
    """check_refiner: a base model as the refiner, another latent space (channels, scaling factor), another
    tokenizer_2 (RefinerMismatch, a ModelLoadError: one line at start)."""
    from sdxl_engine.checkpoint.loading import RefinerMismatch, check_refiner

    refiner = models[0].refiner
    vae = refiner.components["vae"]

    def with_vae(refiner=refiner, **changes):
        return dataclasses.replace(refiner, components={**refiner.components, "vae": dataclasses.replace(
            vae, config=dataclasses.replace(vae.config, **changes))})

    sixteen = dataclasses.replace(refiner, kind=dataclasses.replace(refiner.kind, unet_in_channels=16))
    cases = [(tiny_pt, "not an SDXL refiner"),
             (with_vae(latent_channels=16), "its UNet takes 4 input channels, not its VAE's 16 latent channels"),
             (with_vae(sixteen, latent_channels=16), "its latent channels is 16, the base's 4"),
             (with_vae(scaling_factor=0.18215), "VAE scaling_factor is 0.18215, the base's 0.13025"),
             (dataclasses.replace(refiner, tokenizer_2=tiny_pt.tokenizer), "tokenizer_2 differs")]
    for bad, message in cases:
        with pytest.raises(RefinerMismatch, match=message) as err:
            check_refiner(tiny_pt, bad)
        assert "cannot refine tiny-pt's latents" in str(err.value) and "\n" not in str(err.value)


def test_the_refiners_conditioning_is_diffusers(models, reference):
    """refiner_expert (not compiled) = diffusers' refiner encode_prompt and _get_add_time_ids: text_encoder_2's
    penultimate states and pooled projection; the empty negative prompt ENCODED (the refiner's
    force_zeros_for_empty_prompt is false, while the base zeros it); time ids (64, 64, 0, 0, 6.0) on the prompt rows
    and (64, 64, 0, 0, 2.5) on the negative ones. A refiner with force_zeros true would zero that negative."""
    from sdxl_engine.program.generate import ProgramShape, encode_text, refiner_expert, static_options

    base, params = models
    case = META["cases"]["euler_08"]  # an empty negative prompt
    st = static_options(base, ProgramShape(2, 64, 64, STEPS, refiner=True))
    inputs = inputs_for(base, case)
    expert = refiner_expert(st, params, inputs)
    ref = {k[len("refiner_"):]: v for k, v in reference.items() if k.startswith("refiner_")}
    # (4, 77, 48), (4, 48): neg, neg, pos, pos
    hidden, pooled = np.asarray(expert.hidden), np.asarray(expert.text_embeds)
    for rows, which in ((slice(0, 2), "negative_"), (slice(2, 4), "")):
        np.testing.assert_allclose(hidden[rows], np.broadcast_to(ref[f"{which}prompt_embeds"], (2, 77, 48)), atol=1e-5)
        np.testing.assert_allclose(pooled[rows], np.broadcast_to(ref[f"{which}pooled_prompt_embeds"], (2, 48)),
                                   atol=1e-5)
    assert np.abs(ref["negative_prompt_embeds"]).mean() > 0.1  # the encoded empty text is far from zeros
    assert np.array_equal(np.asarray(expert.add_time_ids),
                          np.concatenate([np.repeat(ref["add_neg_time_ids"], 2, 0),
                                          np.repeat(ref["add_time_ids"], 2, 0)]))
    assert np.asarray(encode_text(st, params, inputs).hidden)[:2, :77].max() == 0  # the base's empty negative: zeros
    zeroing = dataclasses.replace(base.refiner, kind=dataclasses.replace(base.refiner.kind,
                                                                         force_zeros_for_empty_prompt=True))
    st_zeros = static_options(dataclasses.replace(base, refiner=zeroing), st.shape)
    zeroed = refiner_expert(st_zeros, params, inputs)
    assert np.asarray(zeroed.hidden)[:2].max() == 0 and np.asarray(zeroed.text_embeds)[:2].max() == 0
    np.testing.assert_array_equal(np.asarray(zeroed.hidden)[2:], hidden[2:])


def test_the_refiners_time_ids_are_height_width_on_a_non_square_size(models):
    """diffusers' StableDiffusionXLImg2ImgPipeline._get_add_time_ids with requires_aesthetics_score:
    ``original_size + crops_coords_top_left + (aesthetic_score,)``, original_size = (height, width): at 96 wide and
    64 high, (64, 96, 0, 0, score) on every row, the negative rows' score negative_aesthetic_score (CFG: negatives
    first), the prompt rows' aesthetic_score; without CFG the prompt rows only. A refiner UNet of 6 time ids gets the
    base's (64, 96, 0, 0, 64, 96). Not compiled (the text encoder runs eagerly)."""
    from sdxl_engine.program.generate import ProgramShape, refiner_expert, static_options

    base, params = models
    case = META["cases"]["euler_08"]
    inputs = inputs_for(base, case, aesthetic_score=7.0, negative_aesthetic_score=1.5)
    shape = ProgramShape(2, 64, 96, STEPS, refiner=True)  # batch, height, width
    assert (shape.width, shape.height) == (96, 64)
    got = np.asarray(refiner_expert(static_options(base, shape), params, inputs).add_time_ids)
    assert got.tolist() == [[64, 96, 0, 0, 1.5]] * 2 + [[64, 96, 0, 0, 7.0]] * 2
    plain = dataclasses.replace(shape, cfg=False)
    got = np.asarray(refiner_expert(static_options(base, plain), params, inputs).add_time_ids)
    assert got.tolist() == [[64, 96, 0, 0, 7.0]] * 2
    six = dataclasses.replace(base.refiner, kind=dataclasses.replace(base.refiner.kind, time_ids=6))
    got = np.asarray(refiner_expert(static_options(dataclasses.replace(base, refiner=six), shape), params,
                                    inputs).add_time_ids)
    assert got.tolist() == [[64, 96, 0, 0, 64, 96]] * 4


# ---- the compiled program on 2 devices: diffusers' images -----------------------------------------------------------
@pytest.fixture(scope="module")
def program(models):
    """tiny-pt + tiny-pt-refiner's program: 2 images at 64x64 with CFG over 2 devices, and how to run a case on it."""
    import jax

    from sdxl_engine.program.compiling import compile_program
    from sdxl_engine.program.generate import ProgramShape
    from sdxl_engine.program.sharding import make_mesh, replicated

    base, params = models
    mesh = make_mesh(jax.devices()[:2])
    params = jax.device_put(params, replicated(mesh))
    compiled = compile_program(base, params, ProgramShape(2, 64, 64, max_steps=STEPS, refiner=True), mesh)

    def run(inputs, other_params=None):
        """The case's images (uint8 values as int); ``other_params``: params of the same shapes in place of these."""
        chosen = params if other_params is None else jax.device_put(other_params, replicated(mesh))
        return np.asarray(compiled.executable(chosen, inputs)[0]).astype(int)

    return run


@pytest.mark.slow  # compiles tiny-pt + tiny-pt-refiner's program at the fixture's shape
@pytest.mark.parametrize("case", list(META["cases"]))
def test_refiner_images_match_diffusers(program, models, reference, case):
    """Each switch point and sampler within 4/255 (max) and 0.5/255 (mean) of diffusers' base + refiner (measured:
    max 1/255, mean at most 0.0001/255: a few pixels rounded the other way).

    The switch one step earlier or later, and DPM++'s switch step second order (its scheduler not restarted), are
    off by 0.18-0.74/255 mean: the random tiny models change little in the last steps, so some of these stay
    within the loose parity tolerance, but each is over 1000 x the right run's difference; the check is mean
    > 0.1/255 and the right run 10 x closer to diffusers (so the conventions broken in the program fail it too).
    (The aesthetic score moves these images by only 0.002-0.05/255; its convention is checked on the
    time ids themselves, test_the_refiners_conditioning_is_diffusers.)"""
    base, _ = models
    meta = META["cases"][case]
    want = reference[f"{case}_images"].astype(int)
    diff = np.abs(program(inputs_for(base, meta)) - want)
    print(f"{case}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5, (case, diff.max(), diff.mean())
    start = meta["refiner_start"]
    wrong = {"switch one step early": inputs_for(base, meta, switch=start - 1),
             "switch one step late": inputs_for(base, meta, switch=start + 1)}
    if meta["sampler"].startswith("DPM"):
        plain = make_schedule(meta["sampler"], base.scheduler_config, STEPS).padded(STEPS)
        wrong["switch step second order"] = dataclasses.replace(inputs_for(base, meta), b=plain["b"], c=plain["c"])
    offs = {name: np.abs(program(inputs) - want) for name, inputs in wrong.items()}
    for name, off in offs.items():
        print(f"{case} {name}: max {off.max()}/255, mean {off.mean():.3f}/255")
    for name, off in offs.items():  # far off, and the run with the conventions 10 x closer than it
        assert off.mean() > 0.1 and diff.mean() < off.mean() / 10, (case, name, off.mean(), diff.mean())


# ---- the refiner's single file (sd_xl_refiner_1.0's layout) ---------------------------------------------------------
REFINER_FILE = FIXTURES / "tiny-single-refiner" / "tiny-refiner-sgm.fp16.safetensors"


@pytest.mark.slow  # runs the program compiled above (shared with test_refiner_images_match_diffusers)
def test_the_single_file_refiner_refines_as_its_folder(program, models, reference):
    """tiny-pt-refiner written as one sgm file (tools/fixtures_refiner_single.py, float16) and loaded as --refiner
    loads it passes check_refiner, and its text_encoder_2 and UNet on the same program give diffusers' images within
    the parity tolerance, and the folder's images to float16 rounding: max 1/255, mean at most 0.005/255 (measured
    0.0003/255; text_projection left untransposed, which the random tiny models barely show: 0.02/255)."""
    from sdxl_engine.checkpoint.loading import check_refiner, load_model

    base, params = models
    single = load_model(str(REFINER_FILE), dtype="float32", platform="cpu", cache_dir="unused",
                        model_config=str(REFINER), flag="--refiner")
    check_refiner(base, single)
    swapped = {**params, "refiner": {k: single.params[k] for k in ("text_encoder_2", "unet")}}
    for case in ("euler_08", "euler_065_negative"):
        meta = META["cases"][case]
        inputs = inputs_for(base, meta)
        mine, folder = program(inputs, swapped), program(inputs)
        diff, off = np.abs(mine - reference[f"{case}_images"]), np.abs(mine - folder)
        print(f"single-file refiner {case}: max {diff.max()}/255, mean {diff.mean():.4f}/255; "
              f"vs the folder's: max {off.max()}/255, mean {off.mean():.4f}/255")
        assert diff.max() <= 4 and diff.mean() <= 0.5, (case, diff.max(), diff.mean())
        assert off.max() <= 1 and off.mean() <= 0.005, (case, off.max(), off.mean())  # float16 rounding only


def test_single_files_as_refiner_and_model_are_what_they_are():
    """A base single file as --refiner is refused by check_refiner (not a refiner); a refiner single file as --model
    loads as a refiner and the start stops with the refiner's line (it cannot make images from text). Both before
    anything compiles."""
    from sdxl_engine.checkpoint.loading import ModelLoadError, RefinerMismatch
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    tiny_pt, base_file = str(FIXTURES / "tiny-pt"), str(FIXTURES / "tiny-single" / "tiny-sdxl-sgm.fp16.safetensors")
    engine = Engine(EngineConfig.load({"model": tiny_pt, "refiner": base_file, "refiner_config": tiny_pt,
                                       "cpu_devices": 4}, environ={}), log=lambda *_: None)
    with pytest.raises(RefinerMismatch, match=r"^--refiner tiny-sdxl-sgm.fp16.safetensors: not an SDXL refiner "
                                              r"\(text_encoder \+ text_encoder_2, 6 time ids\)"):
        engine.start()
    assert engine.compile_count == 0
    engine = Engine(EngineConfig.load({"model": str(REFINER_FILE), "model_config": str(REFINER), "cpu_devices": 4},
                                      environ={}), log=lambda *_: None)
    with pytest.raises(ModelLoadError, match=r"^tiny-refiner-sgm.fp16.safetensors is an SDXL refiner "
                                             r"\(text_encoder_2, 5 time ids with an aesthetic score\): it refines "
                                             r"another model's images"):
        engine.start()
    assert engine.compile_count == 0


# ---- the engine: --refiner, one program for every switch point, refusals ---------------------------------------------
@pytest.fixture(scope="module")
def refiner_engine():
    """The engine serving tiny-pt with tiny-pt-refiner (4 CPU devices: 4 images, seeds 41..44 for seed 41), and
    the fixture's refiner LoRA (``refiner-ink``), which fits the refiner only."""
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    config = EngineConfig.load({"model": str(FIXTURES / "tiny-pt"), "refiner": str(REFINER), "cpu_devices": 4,
                                "sampler": "Euler", "guidance_scale": 5.0,
                                "lora": f"refiner-ink={FOLDER / 'refiner-lora.safetensors'}"}, environ={
        k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")})
    return Engine(config, log=lambda *_: None).start()


def refine(engine, case: dict, **kw):
    return engine.generate(GenerateRequest(SETTINGS["prompt"], negative_prompt=case["negative_prompt"], seed=SEEDS[0],
                                           num_inference_steps=STEPS, guidance_scale=SETTINGS["guidance_scale"],
                                           width=64, height=64, sampler=case["sampler"],
                                           refiner_switch_at=case["switch_at"], **kw))


@pytest.mark.slow  # starts an engine on tiny-pt and compiles its refiner program
def test_the_engine_refines_as_diffusers_with_one_program_for_every_switch_point(refiner_engine, reference):
    """--refiner: the first refiner request compiles its program; every other switch point, negative prompt and
    sampler runs on it with 0 compiles, each case's first two images (seeds 41, 42) within the parity tolerance of
    diffusers'. A request without refiner_switch_at runs the base program, as before."""
    import jax

    engine = refiner_engine
    assert engine.limits.refiner and engine.model.refiner is not None
    assert set(engine.params["refiner"]) == {"text_encoder_2", "unet"} and "vae" not in engine.model.refiner.params
    cases = list(META["cases"].values())
    first = refine(engine, cases[0])
    assert sum(shape.refiner for shape in engine.programs.compiled) == 1
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if "backend_compile" in event else None)
    before = engine.compile_count
    results = [first] + [refine(engine, case) for case in cases[1:]]
    assert engine.compile_count == before and events == [], "another switch point compiled"
    for key, result in zip(META["cases"], results):
        diff = np.abs(result.images[:2].astype(int) - reference[f"{key}_images"])
        print(f"engine {key}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
        assert diff.max() <= 4 and diff.mean() <= 0.5, (key, diff.max(), diff.mean())
    plain = engine.generate(GenerateRequest(SETTINGS["prompt"], seed=SEEDS[0], num_inference_steps=STEPS))
    assert plain.request.refiner_switch_at is None and engine.compile_count == before  # the start's base program
    assert np.abs(plain.images.astype(int) - first.images).mean() > 0.1  # the base's last 2 steps: 0.55/255


IMAGES = json.loads((FOLDER / "images.json").read_text())


@pytest.mark.slow  # compiles tiny-pt + refiner's image to image program on the engine above
def test_the_refiner_on_an_input_image_is_diffusers_img2img(refiner_engine):
    """An input image with refiner_switch_at 0: the refiner alone as a plain img2img model (diffusers'
    StableDiffusionXLImg2ImgPipeline of the refiner); with 0.8: tiny-pt's img2img up to the switch, then the
    refiner (denoising_end / denoising_start). Each within the parity tolerance (first two images, seeds 41, 42),
    on one program; the base alone on the same image is far off the refiner's."""
    with np.load(FOLDER / "images.npz") as data:
        pictures, want = data["pictures"], {k: data[f"{k}_images"].astype(int) for k in IMAGES["cases"]}
    engine = refiner_engine
    batch = list(pictures) * (engine.batch // 2)  # image i of the request starts from picture i % 2

    def run(case, **kw):
        return engine.generate(GenerateRequest(SETTINGS["prompt"], negative_prompt="a blue square", seed=SEEDS[0],
                                               num_inference_steps=STEPS, guidance_scale=SETTINGS["guidance_scale"],
                                               sampler=case["sampler"], image=batch, strength=case["strength"],
                                               **kw)).images[:2].astype(int)

    before = None
    for key, case in IMAGES["cases"].items():
        got = run(case, refiner_switch_at=case["switch_at"])
        before = engine.compile_count if before is None else before
        diff = np.abs(got - want[key])
        print(f"engine {key}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
        assert diff.max() <= 4 and diff.mean() <= 0.5, (key, diff.max(), diff.mean())
    assert engine.compile_count == before  # every switch point and sampler: the one image program with the refiner
    alone = IMAGES["cases"]["refiner_alone_05"]
    assert np.abs(run(alone) - want["refiner_alone_05"]).mean() > 5  # the base alone: another model's image


@pytest.mark.slow  # the refiner engine above; its refiner program
def test_a_refiner_loras_tag_changes_the_refiners_steps_as_diffusers_does(refiner_engine):
    """A LoRA that fits the refiner, not the model, loads for the refiner; its tag merges it into the refiner's
    weights (the base's stay), as diffusers' load_lora_weights + set_adapters on the refiner pipeline: within the
    parity tolerance of diffusers' ensemble with it (switch 0.3: the refiner runs 7 of 10 steps) and 10 x closer to
    it than to the ensemble without it. Without refiner_switch_at the tag is refused naming the prompt."""
    meta = json.loads((FOLDER / "lora.json").read_text())
    with np.load(FOLDER / "lora.npz") as data:
        want, plain = data["lora_images"].astype(int), data["plain_images"].astype(int)
    engine = refiner_engine
    assert engine.refiner_loras is not None and list(engine.refiner_loras.loras) == ["refiner-ink"]
    assert list(engine.loras.loras) == [] and "refiner-ink" in engine.limits.loras
    before = engine.compile_count
    request = dict(negative_prompt="", seed=SEEDS[0], num_inference_steps=STEPS, sampler="Euler", width=64, height=64,
                   guidance_scale=SETTINGS["guidance_scale"], refiner_switch_at=meta["switch_at"])
    got = engine.generate(GenerateRequest(f"{SETTINGS['prompt']} <lora:refiner-ink:{meta['weight']}>", **request))
    diff = np.abs(got.images[:2].astype(int) - want)
    print(f"refiner LoRA: max {diff.max()}/255, mean {diff.mean():.4f}/255; without it "
          f"{np.abs(plain - want).mean():.3f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5 and diff.mean() * 10 < np.abs(plain - want).mean()
    assert got.loras == {"refiner-ink": engine.refiner_loras.loras["refiner-ink"].short_hash}
    without = engine.generate(GenerateRequest(SETTINGS["prompt"], **request))
    assert np.abs(without.images[:2].astype(int) - plain).max() <= 4 and engine.compile_count == before
    assert engine.params["refiner"]["unet"] is engine.refiner_loras.base["unet"]  # the kept weights unchanged
    with pytest.raises(InvalidRequest, match="is a LoRA for the refiner") as err:
        engine.generate(GenerateRequest(f"{SETTINGS['prompt']} <lora:refiner-ink:1>", seed=1, width=64, height=64))
    assert err.value.field == "prompt"


@pytest.mark.slow  # starts an engine on tiny-pt (shared with the test above)
def test_the_engine_refuses_a_size_the_refiner_cannot_make(refiner_engine):
    """tiny-pt makes multiples of 16 pixels, its refiner (one block more) of 32: 80x80 with the refiner is refused
    naming width, before anything compiles."""
    before = refiner_engine.compile_count
    with pytest.raises(InvalidRequest, match="the refiner needs multiples of 32 pixels") as err:
        refiner_engine.generate(GenerateRequest("a red circle", width=80, height=80, refiner_switch_at=0.8))
    assert err.value.field == "width" and refiner_engine.compile_count == before


def test_the_engine_refuses_a_base_model_as_the_refiner_at_start():
    """--refiner with a model that is not a refiner stops the start with one line (before anything compiles)."""
    from sdxl_engine.checkpoint.loading import RefinerMismatch
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    tiny_pt = str(FIXTURES / "tiny-pt")
    engine = Engine(EngineConfig.load({"model": tiny_pt, "refiner": tiny_pt, "cpu_devices": 4}, environ={}),
                    log=lambda *_: None)
    with pytest.raises(RefinerMismatch, match=r"^--refiner tiny-pt: not an SDXL refiner"):
        engine.start()
    assert engine.compile_count == 0 and engine.error is not None
