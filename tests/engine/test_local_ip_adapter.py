"""IP-Adapter units through the engine: --ip-adapter loading (the image encoder found by h94's layout), the limits,
refusals naming the field, the plan of every mode (the units' shape and arrays; hires fix's second pass the same
tokens), diffusers' images end to end and no recompile for a new reference image or scale.

The engine: tiny-pt with tests/fixtures/tiny-pt-ip-adapter's plain adapter (tools/fixtures_ip_adapter.py) on the
session's 4 CPU devices, 4 images per request; the fixture's 2 images are images 0 and 1 (seeds 41, 42). Marked
slow: the start compiles the default program and the one-unit program (docs/ip-adapter.md, "Tests").
"""

import json
import os

import numpy as np
import pytest

from sdxl_engine.engine.ip_adapter import IPAdapterUnit
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, validate
from tests.helpers import FIXTURES

pytestmark = [pytest.mark.engine, pytest.mark.slow]

FOLDER = FIXTURES / "tiny-pt-ip-adapter"
META = json.loads((FOLDER / "reference.json").read_text())
SETTINGS = META["settings"]
NAME = "ip-adapter_sdxl"


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def ip_engine():
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    config = EngineConfig.load({
        "model": str(FIXTURES / "tiny-pt"), "cpu_devices": 4, "images_per_request": 4, "max_inference_steps": 10,
        "num_inference_steps": 10, "ip_adapter": str(FOLDER / "sdxl_models" / f"{NAME}.safetensors"),
        "max_run_seconds": 0, "precompile": "off"},
        environ={k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")})
    return Engine(config, log=lambda *_: None).start()


def request(units, **kw) -> GenerateRequest:
    return GenerateRequest(SETTINGS["prompt"], SETTINGS["negative_prompt"], META["seeds"][0],
                           SETTINGS["guidance_scale"], SETTINGS["num_inference_steps"], 64, 64, "Euler",
                           ip_adapter_units=tuple(units), **kw)


def test_the_engine_loads_lists_and_has_the_one_unit_program_ready(ip_engine):
    """The adapter and its image encoder load in the model's dtype; the limits list (name, hash); the start compiled
    the default size's one-unit, one-image program (as a ControlNet unit's, issue #59) and the encoder's function
    for one reference image (on the chip a ViT-H/14's compile took over 30 s inside the first request)."""
    adapter = ip_engine.model.ip_adapters[NAME]
    assert ip_engine.limits.ip_adapters == ((NAME, adapter.hash),)
    assert {str(v.dtype) for v in adapter.encoder_params.values()} == {ip_engine.model.dtype}
    width, height = ip_engine.limits.default_size
    shape = ip_engine.planner.shape(width, height, True, ip_adapters=((adapter.architecture, 4, 80),))
    assert shape in ip_engine.programs.compiled
    # and the image encoder with the projection for a one-image unit: a request's reference tokens compile nothing
    from sdxl_engine.engine.ip_adapter import reference_tokens
    from sdxl_engine.program.ip_adapter import reference_tokens_fn

    assert ip_engine.startup["ip_encoder_s"] > 0
    fn = reference_tokens_fn(adapter.encoder, adapter.component)
    before = fn._cache_size()
    assert before >= 1
    tokens = reference_tokens(IPAdapterUnit(image=np.zeros((40, 72, 3), np.uint8), model=NAME), adapter)
    assert tokens.shape == (2, 4, 80) and fn._cache_size() == before


def test_refusals_name_the_unit_field(ip_engine, reference):
    before = ip_engine.compile_count
    with pytest.raises(InvalidRequest) as err:
        ip_engine.generate(request([IPAdapterUnit(image=reference["pictures"][0], model="ip-adapter_sdxl_vit-h")]))
    assert err.value.field == "ip_adapter_units[0].model" and f"loaded: {NAME}" in err.value.message
    with pytest.raises(InvalidRequest) as err:
        ip_engine.generate(request([IPAdapterUnit(image=reference["pictures"][0], model=NAME, weight=-1)]))
    assert err.value.field == "ip_adapter_units[0].weight"
    assert ip_engine.compile_count == before


def test_every_mode_plans_its_units(ip_engine, reference):
    """txt2img, img2img and hires fix's passes carry the unit in their program shape; the keep covers the steps
    that run (from img2img's start; the second pass's own); hires fix's second pass has the first's tokens."""
    unit = IPAdapterUnit(image=reference["tall"], model=NAME, guidance_end=0.5)
    entry = ((ip_engine.model.ip_adapters[NAME].architecture, 4, 80),)
    plan = ip_engine.planner.plan(validate(request([unit], hires_scale=1.5), ip_engine.limits))
    assert plan.shape.ip_adapters == entry and plan.hires.shape.ip_adapters == entry
    np.testing.assert_array_equal(plan.ip.tokens, plan.hires.ip.tokens)
    start = plan.hires.start_step
    assert plan.hires.ip.keep[0, :start].sum() == 0 and plan.hires.ip.keep[0, start] == 1
    image = [reference["pictures"][k % 2] for k in range(4)]
    plan = ip_engine.planner.plan(validate(request([unit], image=image, strength=0.75), ip_engine.limits))
    assert plan.shape.ip_adapters == entry and plan.shape.init_image
    assert plan.ip.keep[0, :plan.request.start_step].sum() == 0 and plan.ip.keep[0, plan.request.start_step] == 1


def test_one_unit_through_the_engine_matches_diffusers_and_never_recompiles(ip_engine, reference):
    """The fixture's "plain" case through Engine.generate within the parity tolerance of diffusers' images; then
    another reference image and another scale run on the same executable (the compile count stays) and show."""
    result = ip_engine.generate(request([IPAdapterUnit(image=reference["pictures"][0], model=NAME, weight=0.8)]))
    diff = np.abs(result.images[:2].astype(int) - reference["plain_images"])
    print(f"plain through the engine: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5
    before = ip_engine.compile_count
    for unit in (IPAdapterUnit(image=reference["pictures"][1], model=NAME, weight=0.8),
                 IPAdapterUnit(image=reference["pictures"][0], model=NAME, weight=1.6)):
        images = ip_engine.generate(request([unit])).images
        assert np.abs(images.astype(int) - result.images).mean() > 0.5, unit
    assert ip_engine.compile_count == before
