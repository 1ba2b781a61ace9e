"""ControlNet-Union units through the compiled program: diffusers' StableDiffusionXLControlNetUnionPipeline images,
one control type and two types in one unit; no recompile for another control type or image.

References: tests/fixtures/tiny-pt-controlnet-union/ (``python -m tools.make_fixtures controlnet-union``, the torch
venv): tiny-pt with ``union`` (a ControlNet-Union made from its UNet, 8 types), 10 Euler steps, 64x64, 2 images, "a
red circle" / "a blue square", guidance 5, the engine's noise of seeds 41 and 42, tiny-pt-controlnet's control
pictures. Image tolerance as the other parity tests: max 4/255, mean 0.5/255 (uint8 units).

The program runs on 2 devices, one image each: the union's token attention reads every row of the batch (diffusers'
``nn.MultiheadAttention`` without ``batch_first``), gathered from both devices, as diffusers' one call sees them.
"""

import json

import numpy as np
import pytest

from sdxl_engine.engine.control import ControlUnit, control_arrays, unit_images, validate_units
from sdxl_engine.program.schedulers import make_schedule
from tests.helpers import FIXTURES

pytestmark = pytest.mark.engine

FOLDER = FIXTURES / "tiny-pt-controlnet-union"
META = json.loads((FOLDER / "reference.json").read_text())
SETTINGS = META["settings"]
STEPS = SETTINGS["num_inference_steps"]


@pytest.fixture(scope="module")
def reference():
    with (np.load(FOLDER / "reference.npz") as data, np.load(FIXTURES / "tiny-pt-img2img" / "noise.npz") as noise,
          np.load(FIXTURES / "tiny-pt-controlnet" / "reference.npz") as controls):
        return {**{k: v for k, v in data.items() if k.endswith("_images")}, "seeds": noise["seeds"],
                "controls": controls["controls"]}


def unit_of(case: str, controls: np.ndarray, **change) -> ControlUnit:
    meta = META["cases"][case]
    images = [controls[i] for i in meta["controls"]]
    return ControlUnit(**{**dict(image=images[0] if len(images) == 1 else tuple(images), model="union",
                                 weight=meta["scale"], control_type=tuple(meta["control_types"])), **change})


@pytest.fixture(scope="module")
def program():
    """tiny-pt with ``union`` on 2 devices, and ``run(unit)``: the unit's program (compiled once per image count) on
    the reference's inputs."""
    import jax

    from sdxl_engine.checkpoint.controlnet import load_controlnet
    from sdxl_engine.checkpoint.loading import load_folder
    from sdxl_engine.program.compiling import compile_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize
    from sdxl_engine.program.sharding import make_mesh, replicated

    mesh = make_mesh(jax.devices()[:2])
    model = load_folder(FIXTURES / "tiny-pt", "tiny-pt", "float32")
    place = replicated(mesh)
    union = load_controlnet("union", FOLDER / "union", "float32", sharding=place, log=lambda _: None)
    model.controlnets = {"union": union}
    params = {**jax.device_put(model.params, place), "controlnet": (union.params,)}
    ids, _ = tokenize(model, SETTINGS["prompt"])
    negative, _ = tokenize(model, SETTINGS["negative_prompt"])
    schedule = make_schedule("Euler", model.scheduler_config, STEPS)
    compiled = {}

    def run(unit: ControlUnit, seeds) -> np.ndarray:
        (unit,) = validate_units([unit], ["union"], 1, unions={"union": union.union})
        shape = ProgramShape(2, 64, 64, max_steps=STEPS, controlnets=(union.architecture,),
                             control_images=unit_images([unit]))
        if shape not in compiled:
            compiled[shape] = compile_program(model, params, shape, mesh)
        inputs = ProgramInputs.build(ids, negative, False, list(seeds), SETTINGS["guidance_scale"], schedule, STEPS,
                                     STEPS)
        inputs = inputs.with_control(**control_arrays([unit], 64, 64, 2, 0, STEPS, STEPS).inputs())
        return np.asarray(compiled[shape].executable(params, inputs)[0]).astype(int)

    run.compiled = compiled
    return run


def _close(got, want, case):
    diff = np.abs(got - want)
    print(f"{case}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5, (case, diff.max(), diff.mean())


@pytest.mark.slow  # compiles tiny-pt's program with a union unit, and with a two-image one
def test_union_images_match_diffusers_and_new_types_or_images_compile_nothing(program, reference):
    """One image as canny (type 3), then as depth (type 1), on one executable: each within 4/255 (max) and 0.5/255
    (mean) of diffusers' images; the type moves the images (the two references differ by about 11/255 mean); a type
    by name is its index's; another image gives other images; no compile. Then two images in one unit, depth and
    hard edge at the unit's weight: within the same tolerance; normal in place of depth moves the images."""
    canny = program(unit_of("one", reference["controls"]), reference["seeds"])
    _close(canny, reference["one_images"].astype(int), "one")
    depth = program(unit_of("one_depth", reference["controls"]), reference["seeds"])
    _close(depth, reference["one_depth_images"].astype(int), "one_depth")
    assert np.abs(canny - depth).mean() > 5
    by_name = program(unit_of("one", reference["controls"], control_type="lineart"), reference["seeds"])
    np.testing.assert_array_equal(by_name, canny)
    other = program(unit_of("one", reference["controls"], image=reference["controls"][1]), reference["seeds"])
    assert np.abs(other - canny).max() > 0  # another image: other images
    assert len(program.compiled) == 1
    two = program(unit_of("two", reference["controls"]), reference["seeds"])
    _close(two, reference["two_images"].astype(int), "two")
    normal = program(unit_of("two", reference["controls"], control_type=("normal", 3)), reference["seeds"])
    assert np.abs(normal - two).mean() > 1
    assert len(program.compiled) == 2  # the image count is the program's shape
