"""ControlNet units through the compiled program: diffusers' StableDiffusionXLControlNetPipeline (and its Img2Img and
Inpaint siblings) images, with A1111's step rule; no recompile for new images, weights, modes or start/end.

References: tests/fixtures/tiny-pt-controlnet/ (``python -m tools.fixtures_controlnet``, the torch venv): tiny-pt
with cn-a / cn-b (ControlNets made from its UNet, random zero convs), 10 Euler steps, 64x64, 2 images, "a red
circle" / "a blue square", guidance 5, the engine's noise of seeds 41 and 42. The fixture gave diffusers
``control_guidance_start/end`` that keep the same steps as A1111's rule on the engine's start/end (checked when it
was made: its reference.json lists both and each step's keep). Image tolerance as the other parity tests: max
4/255, mean 0.5/255 (uint8 units).

Planted bugs (the residuals on the prompt's CFG half only, diffusers' end rule in place of A1111's, each unit's
weight ignored) put the cases that show them off by more than 1.5 x the mean tolerance (0.75/255), so each of those
bugs fails these tests (docs/controlnet.md, "Tests").
"""

import dataclasses
import json

import numpy as np
import pytest

from sdxl_engine.engine.control import ControlUnit, control_arrays, diffusers_keep, keep_row
from sdxl_engine.program.schedulers import make_schedule
from tests.helpers import FIXTURES

pytestmark = pytest.mark.engine

FOLDER = FIXTURES / "tiny-pt-controlnet"
META = json.loads((FOLDER / "reference.json").read_text())
SETTINGS = META["settings"]
STEPS = SETTINGS["num_inference_steps"]
KINDS = {"StableDiffusionXLControlNetPipeline": "txt2img", "StableDiffusionXLControlNetImg2ImgPipeline": "img2img",
         "StableDiffusionXLControlNetInpaintPipeline": "inpaint"}


@pytest.fixture(scope="module")
def reference():
    with (np.load(FOLDER / "reference.npz") as data, np.load(FIXTURES / "tiny-pt-img2img" / "noise.npz") as noise,
          np.load(FIXTURES / "tiny-pt-inpaint" / "reference.npz") as inpaint):
        return {**dict(data), "seeds": noise["seeds"], "masks": inpaint["masks"]}  # the inpaint fixture's masks


def units_of(case: str, controls: np.ndarray) -> list[ControlUnit]:
    return [ControlUnit(image=controls[u["control"]], model=u["model"], weight=u["weight"],
                        guidance_start=u["guidance_start"], guidance_end=u["guidance_end"])
            for u in META["cases"][case]["units"]]


@pytest.fixture(scope="module")
def program():
    """tiny-pt with cn-a and cn-b on 2 devices, and ``run(case, ...)``: the case's program (compiled once per kind
    and unit count) on its inputs, with ``wrong`` changes to the control arrays."""
    import jax

    from sdxl_engine.checkpoint.controlnet import load_controlnet
    from sdxl_engine.checkpoint.loading import load_folder
    from sdxl_engine.program.compiling import compile_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize
    from sdxl_engine.program.sharding import make_mesh, replicated

    mesh = make_mesh(jax.devices()[:2])
    model = load_folder(FIXTURES / "tiny-pt", "tiny-pt", "float32")
    place = replicated(mesh)
    model.controlnets = {name: load_controlnet(name, FOLDER / name, "float32", sharding=place, log=lambda _: None)
                         for name in ("cn-a", "cn-b")}
    params = jax.device_put(model.params, place)
    ids, _ = tokenize(model, SETTINGS["prompt"])
    negative, _ = tokenize(model, SETTINGS["negative_prompt"])
    compiled = {}

    def shape_of(kind, units):
        arch = tuple(model.controlnets[u.model].architecture for u in units)
        return ProgramShape(2, 64, 64, max_steps=STEPS, init_image=kind != "txt2img", inpaint=kind == "inpaint",
                            controlnets=arch)

    def run(case, reference, units=None, **wrong):
        meta = META["cases"][case]
        kind = KINDS[meta["pipeline"]]
        units = units_of(case, reference["controls"]) if units is None else units
        shape = shape_of(kind, units)
        if shape not in compiled:
            compiled[shape] = compile_program(model, {**params, "controlnet": tuple(
                model.controlnets[u.model].params for u in units)}, shape, mesh)
        start = meta["start_step"]
        image = dict(image=reference["controls"][::-1], start_step=start) if kind != "txt2img" else {}
        if kind == "inpaint":
            image.update(mask=np.asarray(reference["masks"]) / 255.0, from_noise=meta["strength"] == 1.0)
        schedule = make_schedule("Euler", model.scheduler_config, STEPS)
        inputs = ProgramInputs.build(ids, negative, False, list(reference["seeds"]), SETTINGS["guidance_scale"],
                                     schedule, STEPS, STEPS, **image)
        arrays = control_arrays(units, 64, 64, 2, start, STEPS, STEPS)
        inputs = inputs.with_control(**{**arrays.inputs(), **wrong})
        control = tuple(model.controlnets[u.model].params for u in units)
        return np.asarray(compiled[shape].executable({**params, "controlnet": control}, inputs)[0]).astype(int)

    run.compiled, run.model, run.params, run.mesh, run.place = compiled, model, params, mesh, place
    return run


def _far(got, want, what):
    off = np.abs(got - want).mean()
    print(f"{what}: mean {off:.2f}/255")
    assert off > 0.75, (what, off)


@pytest.mark.slow  # compiles tiny-pt's programs with ControlNet units
@pytest.mark.parametrize("case", list(META["cases"]))
def test_controlnet_images_match_diffusers(program, reference, case):
    """Every case within 4/255 (max) and 0.5/255 (mean) of diffusers' images."""
    want = reference[f"{case}_images"].astype(int)
    diff = np.abs(program(case, reference) - want)
    print(f"{case}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5, (case, diff.max(), diff.mean())


def diffusers_keeps(case: str, units) -> np.ndarray:
    """(units, STEPS) keep of ``case``'s units by diffusers' rule on the engine's start/end (the planted end bug)."""
    meta = META["cases"][case]
    keep = np.zeros((len(units), STEPS), np.float32)
    for k, u in enumerate(units):
        for j in range(meta["runs"]):
            keep[k, meta["start_step"] + j] = diffusers_keep(j, meta["runs"], u.guidance_start, u.guidance_end)
    return keep


# bug -> (the cases that show it, the control arrays it plants)
BUGS = {
    "residuals on the prompt's half only": (tuple(META["cases"]), lambda units, case: dict(
        uncond=np.zeros((len(units),), np.float32))),
    "each unit's weight ignored": (("one", "two"), lambda units, case: dict(
        weight=np.ones((len(units),), np.float32))),
    "diffusers' end rule": (("start_end",), lambda units, case: dict(keep=diffusers_keeps(case, units))),
}


@pytest.mark.slow
@pytest.mark.parametrize("bug,case", [(bug, case) for bug, (cases, _) in BUGS.items() for case in cases])
def test_a_planted_bug_fails_the_comparison(program, reference, bug, case):
    """The same case with the bug planted in its inputs is off by more than 1.5 x the mean tolerance: the
    comparison above would fail with that bug in the engine (each was also planted in engine/control.py and
    program/generate.py and failed these tests: docs/controlnet.md, "Tests")."""
    units = units_of(case, reference["controls"])
    _far(program(case, reference, **BUGS[bug][1](units, case)), reference[f"{case}_images"].astype(int),
         f"{case}: {bug}")


@pytest.mark.slow
def test_new_images_weights_modes_and_start_end_do_not_recompile(program, reference):
    """One executable serves other control images, weights, control modes and start/end: the images change, the
    compile count does not (the units are traced inputs; only their number and architectures are in the shape)."""
    program("one", reference)
    compiled = dict(program.compiled)
    base = program("one", reference)
    controls = reference["controls"]
    variants = [ControlUnit(image=controls[1], model="cn-b", weight=0.3),
                ControlUnit(image=controls[0], model="cn-a", guidance_start=0.3, guidance_end=0.7),
                ControlUnit(image=controls[0], model="cn-a", control_mode="ControlNet is more important"),
                ControlUnit(image=255 - controls[0], model="cn-a", control_mode="My prompt is more important")]
    for unit in variants:
        got = program("one", reference, units=[unit])
        assert np.abs(got - base).mean() > 0.2, unit
    assert program.compiled.keys() == compiled.keys()
    assert all(program.compiled[k] is v for k, v in compiled.items())


def test_the_fixture_keeps_are_a1111s_rule():
    """The steps each unit ran in diffusers (its own rule on the fixture's start/end) are A1111's rule on the
    engine's: the references test the engine's rule."""
    for meta in META["cases"].values():
        for u in meta["units"]:
            row = keep_row(u["guidance_start"], u["guidance_end"], meta["start_step"], STEPS, STEPS)
            assert row[meta["start_step"]:].astype(bool).tolist() == u["keep"]
            assert not row[:meta["start_step"]].any()


def test_dataclass_units_compare_without_images():
    a, b = ControlUnit(image=np.zeros((2, 2, 3), np.uint8), model="x"), ControlUnit(image=None, model="x")
    assert a == b and dataclasses.replace(a, weight=0.5) != b


@pytest.mark.slow  # compiles tiny-pt + tiny-pt-refiner's program with one unit
def test_the_refiners_steps_take_no_control(program, reference):
    """diffusers' refiner takes no ControlNet: with the refiner from step 0 a unit at weight 0.8 gives the images of
    weight 0 exactly (its residuals are computed in the base UNet's branch only); switching at step 5 they differ."""
    import jax

    from sdxl_engine.checkpoint.loading import check_refiner, load_folder
    from sdxl_engine.program.compiling import compile_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize

    model, params = program.model, program.params
    refiner = load_folder(FIXTURES / "tiny-pt-refiner", "tiny-pt-refiner", "float32")
    check_refiner(model, refiner)
    base = dataclasses.replace(model, refiner=refiner)
    params = {**params, "refiner": jax.device_put({k: refiner.params[k] for k in ("text_encoder_2", "unet")},
                                                  program.place),
              "controlnet": (model.controlnets["cn-a"].params,)}
    shape = ProgramShape(2, 64, 64, max_steps=STEPS, refiner=True,
                         controlnets=(model.controlnets["cn-a"].architecture,))
    compiled = compile_program(base, params, shape, program.mesh)
    ids, _ = tokenize(model, SETTINGS["prompt"])
    negative, _ = tokenize(model, SETTINGS["negative_prompt"])
    schedule = make_schedule("Euler", model.scheduler_config, STEPS)

    def images(switch, weight):
        unit = ControlUnit(image=reference["controls"][0], model="cn-a", weight=weight)
        inputs = ProgramInputs.build(ids, negative, False, list(reference["seeds"]), SETTINGS["guidance_scale"],
                                     schedule, STEPS, STEPS).with_refiner(switch, schedule)
        inputs = inputs.with_control(**control_arrays([unit], 64, 64, 2, 0, STEPS, STEPS).inputs())
        return np.asarray(compiled.executable(params, inputs)[0]).astype(int)

    assert np.array_equal(images(0, 0.8), images(0, 0.0))
    assert np.abs(images(5, 0.8) - images(5, 0.0)).mean() > 1


@pytest.mark.slow  # compiles tiny-pt-inpaint's 9-channel program with one unit
def test_a_9_channel_inpainting_unet_takes_a_unit(program, reference):
    """An inpainting UNet's input is [latents, mask, masked image]; its ControlNet gets the latents alone (diffusers'
    inpaint pipeline, A1111's ``x[:, :4]``): a random ControlNet of the 9-channel UNet's blocks (4 input channels)
    runs, weight 0 and 1 differ, and the images are finite."""
    import jax

    from sdxl_engine.checkpoint.controlnet import LoadedControlNet
    from sdxl_engine.checkpoint.loading import load_folder
    from sdxl_engine.models import build_component
    from sdxl_engine.program.compiling import compile_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize

    model = load_folder(FIXTURES / "tiny-pt-inpaint", "tiny-pt-inpaint", "float32")
    unet = json.loads((FIXTURES / "tiny-pt-inpaint" / "unet" / "config.json").read_text())
    config = {k: v for k, v in unet.items() if not k.startswith("up_") and k not in ("out_channels", "sample_size")}
    component = build_component("controlnet", {**config, "in_channels": 4, "_class_name": "ControlNetModel",
                                               "conditioning_embedding_out_channels": [8, 16, 32]})
    net = LoadedControlNet("cn-9", FIXTURES, component, jax.jit(component.init)(jax.random.key(3)), "", "float32")
    model.controlnets = {"cn-9": net}
    params = jax.device_put({**model.params, "controlnet": (net.params,)}, program.place)
    shape = ProgramShape(2, 64, 64, max_steps=STEPS, init_image=True, inpaint=True, controlnets=(net.architecture,))
    compiled = compile_program(model, params, shape, program.mesh)
    ids, _ = tokenize(model, SETTINGS["prompt"])
    negative, _ = tokenize(model, SETTINGS["negative_prompt"])
    schedule = make_schedule("Euler", model.scheduler_config, STEPS)

    def images(weight):
        unit = ControlUnit(image=reference["controls"][1], model="cn-9", weight=weight)
        inputs = ProgramInputs.build(ids, negative, False, list(reference["seeds"]), SETTINGS["guidance_scale"],
                                     schedule, STEPS, STEPS, image=reference["controls"][::-1], start_step=0,
                                     mask=np.asarray(reference["masks"]) / 255.0, from_noise=True)
        inputs = inputs.with_control(**control_arrays([unit], 64, 64, 2, 0, STEPS, STEPS).inputs())
        out, finite = compiled.executable(params, inputs)
        assert np.asarray(finite).all()
        return np.asarray(out).astype(int)

    assert np.abs(images(1.0) - images(0.0)).mean() > 1
