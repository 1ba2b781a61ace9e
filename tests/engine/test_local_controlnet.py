"""ControlNet units through the engine: start-up loading, validation against the loaded ControlNets, the plan (every
mode's program carries the units; hires fix's second pass its own arrays), diffusers' images end to end, and no
recompile across new images, weights, modes, start/end or another ControlNet of the same architecture.

The engine: tiny-pt with cn-a and cn-b (tests/fixtures/tiny-pt-controlnet, made by tools/fixtures_controlnet.py)
on the session's 4 CPU devices, 4 images per request, and a second model (tiny-pt-b) that only the last test asks
for; the fixture's 2 images are images 0 and 1 (seeds 41, 42).
"""

import json
import os

import numpy as np
import pytest

from sdxl_engine.engine.validation import ControlUnit, GenerateRequest, InvalidRequest, validate
from tests.helpers import FIXTURES

pytestmark = pytest.mark.engine

FOLDER = FIXTURES / "tiny-pt-controlnet"
META = json.loads((FOLDER / "reference.json").read_text())
SETTINGS = META["settings"]


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def tiny_pt_b(tmp_path_factory):
    """tiny-pt's folder as tiny-pt-b, its UNet's weights changed: one architecture, other images."""
    import shutil

    from safetensors.numpy import load_file, save_file

    other = tmp_path_factory.mktemp("models") / "tiny-pt-b"
    shutil.copytree(FIXTURES / "tiny-pt", other)
    weights = other / "unet" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    rng = np.random.default_rng(1)
    save_file({k: (v + rng.normal(0, 0.05, v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
               for k, v in tensors.items()}, weights)
    return other


@pytest.fixture(scope="module")
def cn_engine(tiny_pt_b):
    """tiny-pt (the default) and tiny-pt-b with cn-a and cn-b, room for one model on the devices (the several-models
    test's; the other tests ask the default model only)."""
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    config = EngineConfig.load({
        "model": str(FIXTURES / "tiny-pt"), "models": str(tiny_pt_b), "max_resident_models": 1, "cpu_devices": 4,
        "images_per_request": 4, "max_inference_steps": 10, "num_inference_steps": 10,
        "controlnet": f"{FOLDER / 'cn-a'}{os.pathsep}{FOLDER / 'cn-b'}", "max_run_seconds": 0, "precompile": "off"},
        environ={k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")})
    return Engine(config, log=lambda *_: None).start()


def request(units, **kw) -> GenerateRequest:
    return GenerateRequest(SETTINGS["prompt"], SETTINGS["negative_prompt"], META["seeds"][0],
                           SETTINGS["guidance_scale"], SETTINGS["num_inference_steps"], 64, 64, "Euler",
                           control_units=tuple(units), **kw)


def units_of(case, reference):
    return [ControlUnit(image=reference["controls"][u["control"]], model=u["model"], weight=u["weight"],
                        guidance_start=u["guidance_start"], guidance_end=u["guidance_end"])
            for u in META["cases"][case]["units"]]


def test_the_engine_loads_and_lists_its_controlnets(cn_engine):
    nets = cn_engine.model.controlnets
    assert list(nets) == ["cn-a", "cn-b"]
    assert cn_engine.limits.controlnets == (("cn-a", nets["cn-a"].hash), ("cn-b", nets["cn-b"].hash))
    assert {str(v.dtype) for v in nets["cn-a"].params.values()} == {cn_engine.model.dtype}


def test_refusals_name_the_unit_field(cn_engine, reference):
    before = cn_engine.compile_count
    with pytest.raises(InvalidRequest) as err:
        cn_engine.generate(request([ControlUnit(image=reference["controls"][0], model="canny-xl")]))
    assert err.value.field == "control_units[0].model" and "loaded: cn-a, cn-b" in err.value.message
    with pytest.raises(InvalidRequest) as err:
        cn_engine.generate(request([ControlUnit(image=reference["controls"][0], model="cn-a", module="depth_zoe")]))
    assert err.value.field == "control_units[0].module"
    assert cn_engine.compile_count == before


def test_every_mode_plans_its_units(cn_engine, reference):
    """txt2img, img2img, inpainting and hires fix's passes each carry the units' architectures in their program and
    their own arrays: the images fitted to each pass's size (a 64x64 map to hires fix's 96x96), the keep over each
    pass's steps, a canny unit soft in the second pass (hook.py)."""
    unit = ControlUnit(image=reference["controls"][0], model="cn-a", module="canny", guidance_end=0.5)
    arch = (cn_engine.model.controlnets["cn-a"].architecture,)
    plan = cn_engine.planner.plan(validate(request([unit], hires_scale=1.5), cn_engine.limits))
    assert plan.shape.controlnets == arch and plan.hires.shape.controlnets == arch
    assert plan.control.images.shape == (4, 1, 64, 64, 3) and plan.hires.control.images.shape == (4, 1, 96, 96, 3)
    assert plan.control.soft.tolist() == [0] and plan.hires.control.soft.tolist() == [1]
    start = plan.hires.start_step
    assert plan.hires.control.keep[0, :start].sum() == 0 and plan.hires.control.keep[0, start] == 1
    image = [reference["controls"][::-1][k % 2] for k in range(4)]
    for kw in (dict(image=image, strength=0.75), dict(image=image, mask=np.ones((64, 64), np.float32))):
        plan = cn_engine.planner.plan(validate(request([unit], **kw), cn_engine.limits))
        assert plan.shape.controlnets == arch and plan.control.keep[0, :plan.request.start_step].sum() == 0


@pytest.mark.slow  # compiles tiny-pt's program with one unit
def test_a_server_started_with_a_controlnet_has_its_one_unit_program_ready(cn_engine):
    """Issue #59: the first request with a unit compiled its program inside the request (22.7 s on a new user's
    server). The start compiles the default size's one-unit program for each architecture (cn-a and cn-b: one)."""
    width, height = cn_engine.limits.default_size
    arch = cn_engine.model.controlnets["cn-a"].architecture
    assert cn_engine.model.controlnets["cn-b"].architecture == arch
    shape = cn_engine.planner.shape(width, height, True, controlnets=(arch,))
    assert shape in cn_engine.programs.compiled
    assert sum(bool(s.controlnets) for s in cn_engine.programs.compiled) == 1


def test_one_unit_through_the_engine_matches_diffusers_and_never_recompiles(cn_engine, reference):
    """The fixture's "one" case (cn-a at 0.8) through Engine.generate: within the parity tolerance of diffusers'
    images; then other images, weights, modes, start/end and cn-b (same architecture) run on the same executable,
    and each shows in the images. The infotext names the unit as A1111 does."""
    result = cn_engine.generate(request(units_of("one", reference)))
    diff = np.abs(result.images[:2].astype(int) - reference["one_images"])
    print(f"one through the engine: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5
    title = cn_engine.model.controlnets["cn-a"].title
    assert result.control_infotext == {"ControlNet 0": f"Module: none, Model: {title}, Weight: 0.8, Resize Mode: "
                                                       "Crop and Resize, Processor Res: 512, Threshold A: -1.0, "
                                                       "Threshold B: -1.0, Guidance Start: 0.0, Guidance End: 1.0, "
                                                       "Pixel Perfect: False, Control Mode: Balanced"}
    before = cn_engine.compile_count
    controls = reference["controls"]
    variants = [ControlUnit(image=controls[1], model="cn-a", weight=0.8),
                ControlUnit(image=controls[0], model="cn-a", weight=0.4),
                ControlUnit(image=controls[0], model="cn-a", weight=0.8, guidance_start=0.2, guidance_end=0.6),
                ControlUnit(image=controls[0], model="cn-a", weight=0.8, control_mode="My prompt is more important"),
                ControlUnit(image=controls[0], model="cn-a", weight=0.8, control_mode="ControlNet is more important"),
                ControlUnit(image=controls[0], model="cn-b", weight=0.8),
                ControlUnit(image=np.full((40, 90, 3), 200, np.uint8), model="cn-a", module="invert",
                            resize_mode="Resize and Fill")]
    moved = [np.abs(cn_engine.generate(request([unit])).images.astype(int) - result.images).mean() for unit in variants]
    print("each variant's mean change /255:", [round(m, 3) for m in moved])
    assert min(moved) > 0.1, moved
    assert cn_engine.compile_count == before


@pytest.mark.slow  # compiles tiny-pt's img2img program with one unit
def test_img2img_with_a_unit_through_the_engine_matches_diffusers(cn_engine, reference):
    meta = META["cases"]["img2img"]
    pictures = reference["controls"][::-1]
    result = cn_engine.generate(request(units_of("img2img", reference), image=[pictures[k % 2] for k in range(4)],
                                        strength=meta["strength"]))
    assert result.request.start_step == meta["start_step"]
    diff = np.abs(result.images[:2].astype(int) - reference["img2img_images"])
    print(f"img2img through the engine: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5


@pytest.mark.slow  # compiles hires fix's two programs with one unit
def test_hires_fix_with_a_unit_runs_both_passes(cn_engine, reference):
    """Hires fix (a latent upscaler) with a canny unit: both passes' programs carry it (each with the map at its
    size), the images are the large ones, and the unit changes them (weight 0.8 against 0, the same programs)."""
    def run(weight):
        unit = ControlUnit(image=reference["controls"][0], model="cn-a", module="canny", weight=weight)
        return cn_engine.generate(request([unit], hires_scale=1.5, hires_steps=4))

    result = run(0.8)
    assert result.images.shape == (4, 96, 96, 3) and "Module: canny" in result.control_infotext["ControlNet 0"]
    shapes = [s for s in cn_engine.programs.compiled if s.controlnets]
    assert {(s.width, s.latents_out, s.init_latents) for s in shapes} >= {(64, True, False), (96, False, True)}
    assert np.abs(run(0.0).images.astype(int) - result.images).mean() > 1


@pytest.mark.slow  # starts an engine of tiny-pt-b and compiles its program with one unit
def test_a_unit_on_a_request_for_a_non_default_model(cn_engine, tiny_pt_b, reference):
    """Several models (docs/models.md) with ControlNets: the module's engine, tiny-pt and tiny-pt-b (tiny-pt's folder,
    its UNet's weights changed: one architecture, other images), cn-a and cn-b loaded once for the server, room for one
    model on the devices. A unit on a request for tiny-pt-b runs on that model's weights with the unit's ControlNet
    (the images of an engine serving tiny-pt-b alone with cn-a, to the byte), its infotext names the unit, the unit
    changes the images; the default model's unit request after it reloads tiny-pt and compiles nothing (one program
    per family and unit architectures, ProgramShape.controlnets)."""
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    environ = {k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")}
    two = cn_engine
    alone = Engine(EngineConfig.load({"cpu_devices": 4, "images_per_request": 4, "max_inference_steps": 10,
                                      "num_inference_steps": 10, "controlnet": str(FOLDER / "cn-a"),
                                      "max_run_seconds": 0, "precompile": "off", "model": str(tiny_pt_b)},
                                     environ=environ), log=lambda *_: None).start()
    assert two.model_names() == ["tiny-pt", "tiny-pt-b"]
    units = units_of("one", reference)

    result = two.generate(request(units, model="tiny-pt-b"))
    assert result.model == "tiny-pt-b" and two.resident_models() == ["tiny-pt-b"]
    listed = (("cn-a", two.controlnets["cn-a"].hash), ("cn-b", two.controlnets["cn-b"].hash))
    assert two.limits_for("tiny-pt-b").controlnets == two.limits.controlnets == listed
    assert two.setups["tiny-pt-b"].model.controlnets["cn-a"] is two.controlnets["cn-a"]  # loaded once, for all models
    title = two.controlnets["cn-a"].title
    assert result.control_infotext["ControlNet 0"].startswith(f"Module: none, Model: {title}, Weight: 0.8")
    np.testing.assert_array_equal(result.images, alone.generate(request(units)).images)
    assert np.abs(two.generate(request([], model="tiny-pt-b")).images.astype(int) - result.images).mean() > 0.1

    compiles = two.compile_count
    default = two.generate(request(units))  # tiny-pt again: reloaded, the same program
    assert default.model == "tiny-pt" and two.compile_count == compiles
    assert np.abs(default.images.astype(int) - result.images).mean() > 1  # two models, two sets of images
