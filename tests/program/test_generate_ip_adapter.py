"""IP-Adapter units through the compiled program: diffusers' StableDiffusionXLPipeline with ``load_ip_adapter``;
no recompile for new reference images, scales or start/end; scale 0 is no adapter.

References: tests/fixtures/tiny-pt-ip-adapter/ (``python -m tools.make_fixtures ip-adapter``, the torch venv):
tiny-pt with a tiny random plain IP-Adapter and image encoder in h94's layout, 10 Euler steps, 64x64, 2 images, "a
red circle" / "a blue square", guidance 5, the engine's noise of seeds 41 and 42; cases: one reference (scale 0.8),
a 64 x 40 reference (1.0), two references in one unit (0.6), and the Plus adapter (the Resampler, its own encoder) on
the 64 x 40 reference (0.7). Image tolerance as the other parity tests: max 4/255, mean 0.5/255 (uint8 units). The
adapters move diffusers' images by 2.8-5.4/255 (mean) from its images without one (reference.json), so a unit
dropped, or its tokens, scale or layers misplaced, fails.
"""

import json

import numpy as np
import pytest

from sdxl_engine.engine.control import control_arrays
from sdxl_engine.engine.ip_adapter import IPAdapterUnit, ip_arrays
from sdxl_engine.program.schedulers import make_schedule
from tests.helpers import FIXTURES

pytestmark = pytest.mark.engine

FOLDER = FIXTURES / "tiny-pt-ip-adapter"
META = json.loads((FOLDER / "reference.json").read_text())
SETTINGS = META["settings"]
STEPS = SETTINGS["num_inference_steps"]
NAME, PLUS = "ip-adapter_sdxl", "ip-adapter-plus_sdxl_vit-h"


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data, np.load(FIXTURES / "tiny-pt-img2img" / "noise.npz") as noise:
        out = {**dict(data), "seeds": noise["seeds"]}
    out["picture0"], out["picture1"] = out["pictures"]
    return out


def unit_of(case: str, reference, **changes) -> IPAdapterUnit:
    refs, scale = META["cases"][case]["references"], META["cases"][case]["scale"]
    images = tuple(reference[n] for n in refs)
    model = META["cases"][case].get("adapter", NAME)
    return IPAdapterUnit(**{"image": images if len(images) > 1 else images[0], "model": model, "weight": scale,
                            **changes})


@pytest.fixture(scope="module")
def program(tiny_pt, tiny_pt_programs):
    """tiny-pt with the adapters on 2 devices, and ``run(units)``: the units' program (compiled once per shape) on the
    fixture's prompt, seeds and schedule; ``run([])`` is the program without IP-Adapter (the session's)."""
    import dataclasses

    from sdxl_engine.checkpoint.ip_adapter import load_ip_adapter
    from sdxl_engine.program.compiling import compile_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize
    from sdxl_engine.program.sharding import replicated

    mesh, params = tiny_pt_programs.mesh, tiny_pt_programs.params
    adapters = {name: load_ip_adapter(name, FOLDER / "sdxl_models" / f"{name}.safetensors", "float32", tiny_pt.unet,
                                      sharding=replicated(mesh), log=lambda _: None) for name in (NAME, PLUS)}
    from sdxl_engine.checkpoint.controlnet import load_controlnet

    net = load_controlnet("cn-a", FIXTURES / "tiny-pt-controlnet" / "cn-a", "float32", sharding=replicated(mesh),
                          log=lambda _: None)
    model = dataclasses.replace(tiny_pt, ip_adapters=adapters, controlnets={"cn-a": net})
    ids, _ = tokenize(model, SETTINGS["prompt"])
    negative, _ = tokenize(model, SETTINGS["negative_prompt"])
    compiled = {}

    def run(units, seeds, control=()):
        schedule = make_schedule("Euler", model.scheduler_config, STEPS)
        inputs = ProgramInputs.build(ids, negative, False, list(seeds), SETTINGS["guidance_scale"], schedule, STEPS,
                                     STEPS)
        extra = {}
        if units:
            arrays = ip_arrays(units, model.ip_adapters, 0, STEPS, STEPS)
            inputs = inputs.with_ip_adapter(**arrays.inputs())
            extra = {"ip_adapter": tuple(model.ip_adapters[u.model].layer_params for u in units)}
            width = arrays.tokens.shape[2]
            shape = ProgramShape(2, 64, 64, max_steps=STEPS, ip_adapters=tuple(
                (model.ip_adapters[m].architecture, n, width) for m, n in zip(arrays.models, arrays.counts)))
            if control:  # ControlNet units beside: their arrays and params, their architectures in the shape
                inputs = inputs.with_control(**control_arrays(control, 64, 64, 2, 0, STEPS, STEPS).inputs())
                extra["controlnet"] = tuple(model.controlnets[u.model].params for u in control)
                shape = dataclasses.replace(shape, controlnets=tuple(model.controlnets[u.model].architecture
                                                                     for u in control))
        else:
            shape = ProgramShape(2, 64, 64, max_steps=STEPS)
            return np.asarray(tiny_pt_programs[shape].executable(params, inputs)[0]).astype(int)
        if shape not in compiled:
            compiled[shape] = compile_program(model, {**params, **extra}, shape, mesh)
        return np.asarray(compiled[shape].executable({**params, **extra}, inputs)[0]).astype(int)

    run.compiled = compiled
    return run


# Each case with a token count of its own compiles a program of its own: those are slow (the quick tier keeps one).
CASES = [pytest.param(case, marks=[pytest.mark.slow] if case in ("two_images", "plus") else [])
         for case in META["cases"]]


@pytest.mark.parametrize("case", CASES)
def test_ip_adapter_images_match_diffusers(program, reference, case):
    """Every case within 4/255 (max) and 0.5/255 (mean) of diffusers' images."""
    want = reference[f"{case}_images"].astype(int)
    diff = np.abs(program([unit_of(case, reference)], reference["seeds"]) - want)
    print(f"{case}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5, (case, diff.max(), diff.mean())


@pytest.mark.slow  # compiles the program with a ControlNet unit and an IP-Adapter unit
def test_with_a_controlnet_matches_diffusers(program, reference):
    """The plain adapter with tiny-pt-controlnet's cn-a (one unit over every step) within the tolerance of diffusers'
    StableDiffusionXLControlNetPipeline with the adapter loaded; the adapter shows beside the ControlNet (the images
    differ from the ControlNet alone's, tiny-pt-controlnet's "one" case: the same unit, prompt and noise, by more than
    1.5 x the mean tolerance, as the ControlNet tests' planted bugs must)."""
    from sdxl_engine.engine.control import ControlUnit

    case = META["with_controlnet"]
    unit = IPAdapterUnit(image=reference[case["references"][0]], model=NAME, weight=case["scale"])
    control = (ControlUnit(image=reference[case["control"]], model=case["controlnet"], weight=case["control_weight"]),)
    got = program([unit], reference["seeds"], control)
    diff = np.abs(got - reference["with_controlnet_images"].astype(int))
    print(f"with a ControlNet: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    with np.load(FIXTURES / "tiny-pt-controlnet" / "reference.npz") as data:
        alone = data["one_images"].astype(int)
    assert np.abs(got - alone).mean() > 0.75, np.abs(got - alone).mean()  # 1.5 x the mean tolerance (measured 1.6)


def test_scale_0_is_no_adapter(program, reference):
    """A unit at scale 0 gives diffusers' images without an adapter (within 1/255: its attention is added times 0;
    the program without a unit is compared with the same images by the tiny-pt tests), and at the case's scale they
    differ (the direction)."""
    none = reference["none_images"].astype(int)
    zero = program([unit_of("plain", reference, weight=0.0)], reference["seeds"])
    assert np.abs(zero - none).max() <= 1, np.abs(zero - none).max()
    assert np.abs(program([unit_of("plain", reference)], reference["seeds"]) - none).mean() > 2


@pytest.mark.slow  # the program without a unit (the session's, when another test compiled it)
def test_no_adapter_matches_diffusers(program, reference):
    """The program without a unit gives diffusers' images without the adapter, the same as scale 0's."""
    none = program([], reference["seeds"])
    diff = np.abs(none - reference["none_images"].astype(int))
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    assert np.abs(program([unit_of("plain", reference, weight=0.0)], reference["seeds"]) - none).max() <= 1


def test_new_images_scales_and_start_end_do_not_recompile(program, reference):
    """One executable (and one reference encoder) serves other reference images, scales and start/end: the images
    change, the compile counts do not (the tokens and scales are traced inputs; only the units' token counts and
    architectures are in the shape)."""
    from sdxl_engine.program import ip_adapter

    base = program([unit_of("plain", reference)], reference["seeds"])
    compiled, encoders = dict(program.compiled), ip_adapter.compiled_count()
    variants = [unit_of("plain", reference, image=reference["picture1"]),
                unit_of("plain", reference, weight=1.5),
                unit_of("plain", reference, guidance_start=0.3, guidance_end=0.7),
                unit_of("plain", reference, image=reference["tall"])]
    for unit in variants:
        got = program([unit], reference["seeds"])
        assert np.abs(got - base).mean() > 0.5, unit
    assert program.compiled.keys() == compiled.keys()
    assert all(program.compiled[k] is v for k, v in compiled.items())
    assert ip_adapter.compiled_count() == encoders
