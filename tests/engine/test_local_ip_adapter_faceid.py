"""An IP-Adapter FaceID through the engine: --ip-adapter loads it without an image encoder, the limits name it as
taking face embeddings, a unit's embeddings (lists of floats, as the fronts pass them) make diffusers' images end to
end, and new embeddings or scales compile nothing (the start compiled the one-unit program and the projection). The
file's LoRA is merged for the requests with a FaceID unit only (diffusers applies it once loaded: its images are
with it), once when the prompt tags the same LoRA loaded with --lora (h94's separate file: here the fixture's LoRA
keys in diffusers' names, float16), and never named in the infotext's LoRA hashes.

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


def separate_lora(folder) -> str:
    """The fixture's FaceID LoRA on its own, as h94's ip-adapter-faceid_sdxl_lora.safetensors: its keys in diffusers'
    names (checkpoint/ip_adapter.faceid_lora_keys), float16. Returns its path."""
    from safetensors.numpy import load_file, save_file

    from sdxl_engine.checkpoint.ip_adapter import faceid_lora_keys
    from sdxl_engine.checkpoint.weights import read_safetensors_header
    from sdxl_engine.models import UNetConfig

    file = FOLDER / f"{NAME}.safetensors"
    unet = UNetConfig.from_dict(json.loads((FIXTURES / "tiny-pt" / "unet" / "config.json").read_text()))
    tensors = load_file(file)
    path = folder / "faceid_lora.safetensors"
    save_file({new: tensors[old].astype(np.float16)
               for new, old in faceid_lora_keys(read_safetensors_header(file), unet, file).items()}, path)
    return str(path)


@pytest.fixture(scope="module")
def faceid_engine(tmp_path_factory):
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    config = EngineConfig.load({
        "model": str(FIXTURES / "tiny-pt"), "cpu_devices": 4, "images_per_request": 4, "max_inference_steps": 10,
        "num_inference_steps": 10, "ip_adapter": str(FOLDER / f"{NAME}.safetensors"),
        "lora": f"faceid_lora={separate_lora(tmp_path_factory.mktemp('lora'))}",
        "max_run_seconds": 0, "precompile": "off"},
        environ={k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")})
    lines = []
    engine = Engine(config, log=lines.append).start()
    engine.test_lines = lines
    return engine


def request(units, prompt: str = SETTINGS["prompt"], **kw) -> GenerateRequest:
    return GenerateRequest(prompt, SETTINGS["negative_prompt"], META["seeds"][0],
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
    assert result.loras == {}  # the FaceID LoRA is the unit's, not a prompt tag's
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


def test_its_lora_applies_to_faceid_requests_only_and_once(faceid_engine, reference):
    """Diffusers' images are with the file's LoRA (the fixture's faceid_images; without it they are 47/255 (max) away):
    a request without a unit, before and after a FaceID one, gives the images of the model alone (diffusers'
    none_images, within the tolerance; the two runs the same images): the LoRA is merged for FaceID units only.
    The start says the --lora faceid_lora has the same deltas; a FaceID request whose prompt tags it at 1 gets it
    once (diffusers' faceid_images within the tolerance, its tag in the LoRA hashes), at 0 not at all (diffusers'
    faceid_no_lora_images: the tag's weight decides)."""
    none = reference["none_images"].astype(int)
    before = faceid_engine.generate(request([]))
    case = META["cases"]["faceid"]
    unit = IPAdapterUnit(embeds=reference["embeds"][case["embeds"][0]].tolist(), model=NAME, weight=case["scale"])
    faceid_engine.generate(request([unit]))
    after = faceid_engine.generate(request([]))
    np.testing.assert_array_equal(after.images, before.images)
    diff = np.abs(after.images[:2].astype(int) - none)
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    assert any("IP-Adapter ip-adapter-faceid_sdxl's LoRA is the LoRA faceid_lora" in line
               for line in faceid_engine.test_lines)
    prompt = SETTINGS["prompt"] + " <lora:faceid_lora:1>"
    for weight, want in (("1", "faceid_images"), ("0", "faceid_no_lora_images")):
        tagged = faceid_engine.generate(request([unit], prompt=prompt.replace(":1>", f":{weight}>")))
        diff = np.abs(tagged.images[:2].astype(int) - reference[want])
        print(f"tagged at {weight}: max {diff.max()}/255, mean {diff.mean():.4f}/255 from {want}")
        assert diff.max() <= 4 and diff.mean() <= 0.5, (weight, diff.max(), diff.mean())
        assert tagged.loras == {"faceid_lora": faceid_engine.loras.loras["faceid_lora"].short_hash}
