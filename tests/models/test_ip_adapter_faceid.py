"""IP-Adapter FaceID: models/ip_adapter.MLPProjModel against diffusers' IPAdapterFaceIDImageProjection, and
checkpoint/ip_adapter.py reading h94/IP-Adapter-FaceID's keys (no image encoder; its LoRA keys left unread; FaceID
Plus refused by name).

Reference: tests/fixtures/tiny-pt-ip-adapter-faceid/ (``python -m tools.make_fixtures ip-adapter-faceid``, the torch
venv): a tiny random FaceID adapter for tiny-pt (32-d embeddings -> 64 -> 4 tokens of 80), three random unit-norm
embeddings and diffusers' loaded projection's tokens of them and of a zero embedding.
"""

import json

import numpy as np
import pytest

from tests.helpers import FIXTURES

FOLDER = FIXTURES / "tiny-pt-ip-adapter-faceid"
FILE = FOLDER / "ip-adapter-faceid_sdxl.safetensors"
NAME = "ip-adapter-faceid_sdxl"


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def unet():
    from sdxl_engine.models import UNetConfig

    return UNetConfig.from_dict(json.loads((FIXTURES / "tiny-pt" / "unet" / "config.json").read_text()))


@pytest.fixture(scope="module")
def faceid(unet):
    from sdxl_engine.checkpoint.ip_adapter import load_ip_adapter

    return load_ip_adapter(NAME, FILE, "float32", unet, log=lambda line: None)


def test_the_file_loads_as_faceid_without_an_image_encoder(faceid):
    """FaceID's shapes from the file as diffusers reads them (32-d embeddings, hidden 64 = mult 2, 4 tokens of
    tiny-pt's 80), its 22 layers, no image encoder looked for (the fixture's folder has none)."""
    config = faceid.component.config
    assert (config.projection, config.image_embed_dim, config.faceid_hidden, config.tokens,
            config.cross_attention_dim, len(config.widths)) == ("faceid", 32, 64, 4, 80, 22)
    assert faceid.takes_embeds and faceid.embed_dim == 32
    assert faceid.encoder is None and faceid.encoder_path is None and faceid.encoder_params == {}
    assert faceid.image_size is None and faceid.lora_keys == 0
    assert {"image_proj.proj.0.weight", "image_proj.proj.2.bias", "image_proj.norm.weight",
            "ip_adapter.43.to_k_ip.weight"} <= set(faceid.params)


def test_tokens_match_diffusers(faceid, reference):
    """The projection's tokens of the fixture's three embeddings within 1e-5 (relative to the largest value) of
    diffusers' IPAdapterFaceIDImageProjection, the three units' tokens one after another; the negative row the
    projection of zero embeddings, as diffusers' of a zero embedding."""
    from sdxl_engine.program.ip_adapter import reference_tokens_fn

    tokens = np.asarray(reference_tokens_fn(None, faceid.component)({}, faceid.params, reference["embeds"]))
    assert tokens.shape == (2, 12, 80) and tokens.dtype == np.float32
    for got, want in ((tokens[1], reference["module_tokens"].reshape(12, 80)),
                      (tokens[0], np.tile(reference["module_negative"][0], (3, 1)))):
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_projection_on_fixed_arrays(faceid):
    """MLPProjModel's arithmetic written out in numpy on fixed arrays (a ramp of embeddings): proj.0, exact GELU,
    proj.2, the reshape to (n, 4, 80) token-major (row t is outputs t x 80 .. t x 80 + 79), LayerNorm (eps 1e-5)
    with the file's scale and shift, within 1e-5."""
    from math import erf

    p = {k: np.asarray(v, np.float64) for k, v in faceid.params.items() if k.startswith("image_proj.")}
    embeds = (np.arange(2 * 32, dtype=np.float64).reshape(2, 32) - 31.5) / 40.0
    hidden = embeds @ p["image_proj.proj.0.weight"].T + p["image_proj.proj.0.bias"]
    hidden = hidden * 0.5 * (1 + np.vectorize(erf)(hidden / np.sqrt(2)))
    x = (hidden @ p["image_proj.proj.2.weight"].T + p["image_proj.proj.2.bias"]).reshape(2, 4, 80)
    x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    want = x * p["image_proj.norm.weight"] + p["image_proj.norm.bias"]
    got = np.asarray(faceid.component.bind(faceid.params).image_proj(embeds.astype(np.float32)))
    assert got.shape == (2, 4, 80)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_its_lora_keys_are_left_unread_and_said(tmp_path, unet):
    """h94's file carries a LoRA for every attention (``ip_adapter.{i}.to_q_lora.down.weight`` ...): the adapter
    loads without them (the same params) and the log line says how to apply the LoRA."""
    from safetensors.numpy import load_file, save_file

    from sdxl_engine.checkpoint.ip_adapter import load_ip_adapter

    tensors = load_file(FILE)
    lora = {f"ip_adapter.{i}.to_{w}_lora.{d}.weight": np.zeros((4, 80) if d == "down" else (80, 4), np.float32)
            for i in (0, 1) for w in ("q", "k", "v", "out") for d in ("down", "up")}
    with_lora = tmp_path / "ip-adapter-faceid_sdxl.safetensors"
    save_file({**tensors, **lora}, with_lora)
    lines = []
    adapter = load_ip_adapter(NAME, with_lora, "float32", unet, log=lines.append)
    assert adapter.lora_keys == 16 and sorted(adapter.params) == sorted(tensors)
    assert "its LoRA (16 keys) is not applied" in lines[0] and "<lora:" in lines[0]


def test_faceid_plus_and_a_misfit_are_refused(tmp_path, unet):
    """FaceID Plus (``perceiver_resampler``: it needs a CLIP image too) is refused by name; a FaceID whose tokens are
    not the UNet's cross-attention width names the keys."""
    from safetensors.numpy import load_file, save_file

    from sdxl_engine.checkpoint.ip_adapter import load_ip_adapter
    from sdxl_engine.checkpoint.weights import ModelLoadError

    tensors = load_file(FILE)
    plus = tmp_path / "plus.safetensors"
    save_file({**tensors, "image_proj.perceiver_resampler.proj_in.weight": np.zeros((8, 8), np.float32)}, plus)
    with pytest.raises(ModelLoadError, match="FaceID Plus .*not supported: it takes a CLIP image"):
        load_ip_adapter("plus", plus, "float32", unet)
    narrow = tmp_path / "narrow.safetensors"
    save_file({**tensors, "image_proj.norm.weight": np.ones((64,), np.float32)}, narrow)
    with pytest.raises(ModelLoadError, match="image_proj.norm.weight .64."):
        load_ip_adapter("narrow", narrow, "float32", unet)
