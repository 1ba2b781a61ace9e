"""IP-Adapter FaceID units (face embeddings) through the compiled program: diffusers' StableDiffusionXLPipeline with
``load_ip_adapter(..., image_encoder_folder=None)`` and ``ip_adapter_image_embeds``; no recompile for new embeddings
or scales; scale 0 is no adapter. The file's LoRA, which ``load_ip_adapter`` applies at weight 1, is merged here as
the engine merges it (checkpoint/ip_adapter.read_faceid_lora, lora.LoraMerger): without it, or at another weight,
the images are far from diffusers'.

References: tests/fixtures/tiny-pt-ip-adapter-faceid/ (``python -m tools.make_fixtures ip-adapter-faceid``, the torch
venv): tiny-pt with a tiny random FaceID adapter (32-d embeddings, 4 tokens), 10 Euler steps, 64x64, 2 images, "a
red circle" / "a blue square", guidance 5, the engine's noise of seeds 41 and 42; cases: one embedding (scale 1.0),
two embeddings in one unit (0.8). Image tolerance as the other parity tests: max 4/255, mean 0.5/255 (uint8 units).
The adapter and its LoRA move diffusers' images by 4.0-4.6/255 (mean) from its images without one, the LoRA alone
by 4.9/255 (mean), 47/255 (max) (reference.json), so a unit dropped, its tokens or scale misplaced, or its LoRA
dropped, misplaced or at another weight, fails.
"""

import json

import numpy as np
import pytest

from sdxl_engine.engine.ip_adapter import IPAdapterUnit, ip_arrays, validate_ip_units
from sdxl_engine.program.schedulers import make_schedule
from tests.helpers import FIXTURES

pytestmark = pytest.mark.engine

FOLDER = FIXTURES / "tiny-pt-ip-adapter-faceid"
META = json.loads((FOLDER / "reference.json").read_text())
SETTINGS = META["settings"]
STEPS = SETTINGS["num_inference_steps"]
NAME = "ip-adapter-faceid_sdxl"


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data, np.load(FIXTURES / "tiny-pt-img2img" / "noise.npz") as noise:
        return {**dict(data), "seeds": noise["seeds"]}


def unit_of(case: str, reference, **changes) -> IPAdapterUnit:
    """The case's unit as a client sends it: the embeddings as lists of floats, validated as the engine does."""
    rows, scale = META["cases"][case]["embeds"], META["cases"][case]["scale"]
    embeds = [reference["embeds"][r].tolist() for r in rows]
    unit = IPAdapterUnit(**{"embeds": embeds if len(embeds) > 1 else embeds[0], "model": NAME, "weight": scale,
                            **changes})
    return validate_ip_units([unit], [NAME], 1, {NAME: 32})[0]


@pytest.fixture(scope="module")
def program(tiny_pt, tiny_pt_programs):
    """tiny-pt with the FaceID adapter on the session's devices, and ``run(units, seeds, lora=1.0)``: the units'
    program (compiled once per shape) on the fixture's prompt, seeds and schedule, with the adapter's LoRA merged at
    weight ``lora`` (0: the base params)."""
    import dataclasses

    from sdxl_engine.checkpoint.ip_adapter import load_ip_adapter, read_faceid_lora
    from sdxl_engine.checkpoint.lora import LoraMerger
    from sdxl_engine.program.compiling import compile_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize
    from sdxl_engine.program.sharding import replicated

    mesh, params = tiny_pt_programs.mesh, tiny_pt_programs.params
    adapter = load_ip_adapter(NAME, FOLDER / f"{NAME}.safetensors", "float32", tiny_pt.unet,
                              sharding=replicated(mesh), log=lambda _: None)
    model = dataclasses.replace(tiny_pt, ip_adapters={NAME: adapter})
    lora = read_faceid_lora(adapter, tiny_pt.components)
    merger = LoraMerger(params, {lora.name: lora}, replicated(mesh))
    ids, _ = tokenize(model, SETTINGS["prompt"])
    negative, _ = tokenize(model, SETTINGS["negative_prompt"])
    compiled = {}

    def run(units, seeds, lora_weight=1.0):
        merged = merger.params([(lora.name, lora_weight)])
        schedule = make_schedule("Euler", model.scheduler_config, STEPS)
        inputs = ProgramInputs.build(ids, negative, False, list(seeds), SETTINGS["guidance_scale"], schedule, STEPS,
                                     STEPS)
        arrays = ip_arrays(units, model.ip_adapters, 0, STEPS, STEPS)
        inputs = inputs.with_ip_adapter(**arrays.inputs())
        extra = {"ip_adapter": tuple(model.ip_adapters[u.model].layer_params for u in units)}
        width = arrays.tokens.shape[2]
        shape = ProgramShape(2, 64, 64, max_steps=STEPS, ip_adapters=tuple(
            (model.ip_adapters[m].architecture, n, width) for m, n in zip(arrays.models, arrays.counts)))
        if shape not in compiled:
            compiled[shape] = compile_program(model, {**params, **extra}, shape, mesh)
        return np.asarray(compiled[shape].executable({**merged, **extra}, inputs)[0]).astype(int)

    run.compiled = compiled
    return run


# Each case with a token count of its own compiles a program of its own: those are slow (the quick tier keeps one).
CASES = [pytest.param(case, marks=[pytest.mark.slow] if case != "faceid" else []) for case in META["cases"]]


@pytest.mark.parametrize("case", CASES)
def test_faceid_images_match_diffusers(program, reference, case):
    """Every case within 4/255 (max) and 0.5/255 (mean) of diffusers' images."""
    want = reference[f"{case}_images"].astype(int)
    diff = np.abs(program([unit_of(case, reference)], reference["seeds"]) - want)
    print(f"{case}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5, (case, diff.max(), diff.mean())


def test_without_its_lora_or_at_another_weight_the_images_do_not_match(program, reference):
    """The "faceid" case without the LoRA matches diffusers' images with the LoRA at weight 0 (within the
    tolerance: the LoRA is the only difference), and is far from diffusers' images with it (max past 20/255, mean
    past 2/255); at weight 0.5 it is past the tolerance too. So the match above needs the LoRA, whole."""
    unit = unit_of("faceid", reference)
    want, alone = reference["faceid_images"].astype(int), reference["faceid_no_lora_images"].astype(int)
    without = program([unit], reference["seeds"], lora_weight=0.0)
    diff = np.abs(without - alone)
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    far = np.abs(without - want)
    print(f"without the LoRA: max {far.max()}/255, mean {far.mean():.4f}/255 from diffusers'")
    assert far.max() > 20 and far.mean() > 2, (far.max(), far.mean())
    half = np.abs(program([unit], reference["seeds"], lora_weight=0.5) - want)
    print(f"the LoRA at 0.5: max {half.max()}/255, mean {half.mean():.4f}/255 from diffusers'")
    assert half.max() > 4 and half.mean() > 0.5, (half.max(), half.mean())


def test_scale_0_is_no_adapter_and_new_embeddings_or_scales_do_not_recompile(program, reference):
    """A unit at scale 0 without the LoRA gives diffusers' images without an adapter (within 1/255); then other
    embeddings, a scale and start/end run on the one executable and the one projection function (the compile counts
    stay) and change the images."""
    from sdxl_engine.program import ip_adapter

    none = reference["none_images"].astype(int)
    base = program([unit_of("faceid", reference)], reference["seeds"])
    compiled, projections = dict(program.compiled), ip_adapter.compiled_count()
    zero = program([unit_of("faceid", reference, weight=0.0)], reference["seeds"], lora_weight=0.0)
    assert np.abs(zero - none).max() <= 1, np.abs(zero - none).max()
    assert np.abs(base - none).mean() > 2
    for unit in (unit_of("faceid", reference, embeds=reference["embeds"][1].tolist()),
                 unit_of("faceid", reference, embeds=(-reference["embeds"][0]).tolist()),
                 unit_of("faceid", reference, weight=0.5),
                 unit_of("faceid", reference, guidance_start=0.3, guidance_end=0.7)):
        got = program([unit], reference["seeds"])
        assert np.abs(got - base).mean() > 0.5, unit
    assert program.compiled.keys() == compiled.keys()
    assert all(program.compiled[k] is v for k, v in compiled.items())
    assert ip_adapter.compiled_count() == projections
