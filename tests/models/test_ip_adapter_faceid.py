"""IP-Adapter FaceID: models/ip_adapter.MLPProjModel against diffusers' IPAdapterFaceIDImageProjection, and
checkpoint/ip_adapter.py reading h94/IP-Adapter-FaceID's keys (no image encoder; its LoRA keys read as a LoRA named
as diffusers' ``_load_ip_adapter_loras`` names them; FaceID Plus refused by name).

Reference: tests/fixtures/tiny-pt-ip-adapter-faceid/ (``python -m tools.make_fixtures ip-adapter-faceid``, the torch
venv): a tiny random FaceID adapter for tiny-pt (32-d embeddings -> 64 -> 4 tokens of 80) with a rank-2 LoRA for
each of its 44 attentions, three random unit-norm embeddings and diffusers' loaded projection's tokens of them and of a
zero embedding; reference.json lists diffusers' ``unet.attn_processors`` names.
"""

import json

import numpy as np
import pytest

from tests.helpers import FIXTURES

FOLDER = FIXTURES / "tiny-pt-ip-adapter-faceid"
FILE = FOLDER / "ip-adapter-faceid_sdxl.safetensors"
NAME = "ip-adapter-faceid_sdxl"
META = json.loads((FOLDER / "reference.json").read_text())


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
    assert faceid.image_size is None and faceid.lora_keys == 44 * 8
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


def test_its_lora_keys_are_not_adapter_params_and_the_log_says_they_apply(unet):
    """h94's file carries a LoRA for every attention (``ip_adapter.{i}.to_q_lora.down.weight`` ...): the adapter's
    params leave those keys out, and the log line counts them and says they are merged at weight 1."""
    from safetensors import safe_open

    from sdxl_engine.checkpoint.ip_adapter import load_ip_adapter

    with safe_open(str(FILE), framework="numpy") as f:
        keys = set(f.keys())
    lines = []
    adapter = load_ip_adapter(NAME, FILE, "float32", unet, log=lines.append)
    lora = {k for k in keys if "_lora." in k}
    assert adapter.lora_keys == len(lora) == 352 and set(adapter.params) == keys - lora
    assert "its LoRA (352 keys, 44 attention layers) is merged into the UNet at weight 1" in lines[0]
    assert "not applied" not in lines[0]


@pytest.fixture(scope="module")
def components():
    from sdxl_engine.models import build_component

    config = json.loads((FIXTURES / "tiny-pt" / "unet" / "config.json").read_text())
    return {"unet": build_component("unet", config)}


def test_lora_keys_are_named_as_diffusers_names_them(unet):
    """checkpoint/ip_adapter.faceid_lora_keys: key id i is the i-th of diffusers' ``unet.attn_processors``
    (reference.json's names: attn1 and attn2 of each block, down blocks, up blocks, mid block), and every FaceID
    key maps to ``unet.<that name>.<to_q_lora ...>``, as ``_load_ip_adapter_loras``."""
    from sdxl_engine.checkpoint.ip_adapter import faceid_lora_keys
    from sdxl_engine.checkpoint.weights import read_safetensors_header
    from sdxl_engine.models.ip_adapter import attention_processors

    names = META["attn_processors"]
    assert len(names) == 44 and [f"{n}.processor" for n in attention_processors(unet)] == names
    keys = faceid_lora_keys(read_safetensors_header(FILE), unet, FILE)
    want = {f"unet.{names[i]}.{w}_lora.{d}.weight": f"ip_adapter.{i}.{w}_lora.{d}.weight"
            for i in range(44) for w in ("to_q", "to_k", "to_v", "to_out") for d in ("down", "up")}
    assert keys == want


def test_its_lora_reads_as_a_lora_of_the_unet(faceid, components):
    """read_faceid_lora: one layer per (attention, projection), 176, each the file's down and up tensors unchanged
    (scale 1: no alphas) on the weight diffusers' PEFT wraps: ``ip_adapter.0`` the first down block's attn1,
    ``ip_adapter.1`` its attn2 (to_k from the 80-wide tokens), ``to_out_lora`` ``to_out.0``."""
    from safetensors.numpy import load_file

    from sdxl_engine.checkpoint.ip_adapter import read_faceid_lora

    lora = read_faceid_lora(faceid, components)
    tensors = load_file(FILE)
    assert lora.name == f"faceid:{NAME}" and lora.format == "diffusers" and len(lora.layers) == 176
    layers = {layer.key: layer for layer in lora.layers}
    assert all(layer.component == "unet" for layer in lora.layers)
    block = "down_blocks.1.attentions.0.transformer_blocks.0"
    for key, i, which in ((f"{block}.attn1.to_q.weight", 0, "to_q"), (f"{block}.attn1.to_out.0.weight", 0, "to_out"),
                          (f"{block}.attn2.to_k.weight", 1, "to_k"),
                          ("mid_block.attentions.0.transformer_blocks.1.attn2.to_v.weight", 43, "to_v")):
        np.testing.assert_array_equal(layers[key].down, tensors[f"ip_adapter.{i}.{which}_lora.down.weight"])
        np.testing.assert_array_equal(layers[key].up, tensors[f"ip_adapter.{i}.{which}_lora.up.weight"])
    assert layers[f"{block}.attn2.to_k.weight"].down.shape == (2, 80)


def test_the_same_lora_in_another_file_is_told_apart_from_others(tmp_path, faceid, components):
    """lora.same_deltas: the FaceID LoRA saved on its own in diffusers' names in float16 (as h94's separate
    ip-adapter-faceid_sdxl_lora.safetensors) is the same; with one layer's up doubled, or one layer left out, it
    is not."""
    from safetensors.numpy import load_file, save_file

    from sdxl_engine.checkpoint.ip_adapter import faceid_lora_keys, read_faceid_lora
    from sdxl_engine.checkpoint.lora import read_lora, same_deltas
    from sdxl_engine.checkpoint.weights import read_safetensors_header

    own = read_faceid_lora(faceid, components)
    tensors = load_file(FILE)
    renamed = {new: tensors[old].astype(np.float16)
               for new, old in faceid_lora_keys(read_safetensors_header(FILE), components["unet"].config, FILE).items()}
    variants = {"same": renamed,
                "doubled": {k: v * 2 if k.endswith("attn2.processor.to_v_lora.up.weight") and "mid_block" in k
                            else v for k, v in renamed.items()},
                "fewer": {k: v for k, v in renamed.items() if "up_blocks.0.attentions.0.transformer_blocks.0.attn1"
                          not in k}}
    got = {}
    for name, variant in variants.items():
        save_file(variant, tmp_path / f"{name}.safetensors")
        got[name] = same_deltas(own, read_lora(name, tmp_path / f"{name}.safetensors", components))
    assert got == {"same": True, "doubled": False, "fewer": False}


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
