"""An IP-Adapter FaceID through the engine: --ip-adapter loads it without an image encoder, the limits name it as
taking face embeddings, a unit's embeddings (lists of floats, as the fronts pass them) make diffusers' images end to
end, and new embeddings or scales compile nothing (the start compiled the one-unit program and the projection).

The engine: tiny-pt with tests/fixtures/tiny-pt-ip-adapter-faceid's adapter (tools/fixtures_ip_adapter_faceid.py) on
the session's 4 CPU devices, 4 images per request; the fixture's 2 images are images 0 and 1 (seeds 41, 42). Marked
slow: the start compiles the default program and the one-unit program.
"""

import json
import os

import numpy as np
import pytest

from sdxl_engine.engine.ip_adapter import IPAdapterUnit
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest
from tests.helpers import FIXTURES

pytestmark = [pytest.mark.engine, pytest.mark.slow]

FOLDER = FIXTURES / "tiny-pt-ip-adapter-faceid"
META = json.loads((FOLDER / "reference.json").read_text())
SETTINGS = META["settings"]
NAME = "ip-adapter-faceid_sdxl"


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def faceid_engine():
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    config = EngineConfig.load({
        "model": str(FIXTURES / "tiny-pt"), "cpu_devices": 4, "images_per_request": 4, "max_inference_steps": 10,
        "num_inference_steps": 10, "ip_adapter": str(FOLDER / f"{NAME}.safetensors"),
        "max_run_seconds": 0, "precompile": "off"},
        environ={k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")})
    return Engine(config, log=lambda *_: None).start()


def request(units, **kw) -> GenerateRequest:
    return GenerateRequest(SETTINGS["prompt"], SETTINGS["negative_prompt"], META["seeds"][0],
                           SETTINGS["guidance_scale"], SETTINGS["num_inference_steps"], 64, 64, "Euler",
                           ip_adapter_units=tuple(units), **kw)


def test_faceid_loads_without_an_encoder_and_its_units_match_diffusers(faceid_engine, reference):
    """The limits list the adapter and its embeddings' width; the start compiled its projection for one embedding
    (ip_encoder_s); the "faceid" case through Engine.generate within the parity tolerance of diffusers' images; an
    image for it is refused naming the field; other embeddings and scales run on the same executables."""
    from sdxl_engine.program import ip_adapter

    adapter = faceid_engine.model.ip_adapters[NAME]
    assert adapter.encoder is None and faceid_engine.limits.ip_adapters == ((NAME, adapter.hash),)
    assert faceid_engine.limits.ip_adapter_embeds == ((NAME, 32),) and faceid_engine.startup["ip_encoder_s"] > 0
    case = META["cases"]["faceid"]
    embeds = reference["embeds"][case["embeds"][0]].tolist()
    result = faceid_engine.generate(request([IPAdapterUnit(embeds=embeds, model=NAME, weight=case["scale"])]))
    diff = np.abs(result.images[:2].astype(int) - reference["faceid_images"])
    print(f"faceid through the engine: max {diff.max()}/255, mean {diff.mean():.4f}/255")
    assert diff.max() <= 4 and diff.mean() <= 0.5
    assert result.control_infotext["ControlNet 0"].startswith("Module: ip-adapter_face_id, Model: "
                                                              "ip-adapter-faceid_sdxl [")
    before, projections = faceid_engine.compile_count, ip_adapter.compiled_count()
    with pytest.raises(InvalidRequest) as err:
        faceid_engine.generate(request([IPAdapterUnit(image=np.zeros((8, 8, 3), np.uint8), model=NAME)]))
    assert err.value.field == "ip_adapter_units[0].image" and "takes no image" in err.value.message
    for unit in (IPAdapterUnit(embeds=reference["embeds"][1].tolist(), model=NAME, weight=case["scale"]),
                 IPAdapterUnit(embeds=embeds, model=NAME, weight=0.4)):
        images = faceid_engine.generate(request([unit])).images
        assert np.abs(images.astype(int) - result.images).mean() > 0.5, unit
    assert faceid_engine.compile_count == before and ip_adapter.compiled_count() == projections
