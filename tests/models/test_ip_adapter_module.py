"""models/clip_vision.py and models/ip_adapter.py against transformers' CLIPVisionModelWithProjection and diffusers'
ImageProjection; checkpoint/ip_adapter.py reading h94's layout; engine/ip_adapter.clip_pixels against
CLIPImageProcessor.

Reference: tests/fixtures/tiny-pt-ip-adapter/ (``python -m tools.make_fixtures ip-adapter``, the torch venv): tiny
random image encoders and a plain and a Plus IP-Adapter for tiny-pt in h94's file layout, diffusers' feature
extractor's pixels of three pictures (one 64 x 40), the loaded encoder's ``image_embeds`` and the plain projection's
tokens of them, and the Plus Resampler's tokens of the second encoder's penultimate hidden states.
"""

import json

import numpy as np
import pytest

from tests.helpers import FIXTURES

FOLDER = FIXTURES / "tiny-pt-ip-adapter"
FILE = FOLDER / "sdxl_models" / "ip-adapter_sdxl.safetensors"
PLUS = FOLDER / "sdxl_models" / "ip-adapter-plus_sdxl_vit-h.safetensors"
META = json.loads((FOLDER / "reference.json").read_text())
NAMES = ("picture0", "picture1", "tall")


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def unet():
    from sdxl_engine.models import UNetConfig

    return UNetConfig.from_dict(json.loads((FIXTURES / "tiny-pt" / "unet" / "config.json").read_text()))


@pytest.fixture(scope="module")
def adapter(unet):
    from sdxl_engine.checkpoint.ip_adapter import load_ip_adapter

    return load_ip_adapter("ip-adapter_sdxl", FILE, "float32", unet, log=lambda line: None)


@pytest.fixture(scope="module")
def plus(unet):
    from sdxl_engine.checkpoint.ip_adapter import load_ip_adapter

    return load_ip_adapter("ip-adapter-plus_sdxl_vit-h", PLUS, "float32", unet, log=lambda line: None)


def test_layers_are_numbered_as_diffusers_numbers_them(unet):
    """Key id 2j + 1 is the j-th cross-attention of diffusers' ``unet.attn_processors`` (down, up, mid), as the
    fixture recorded; the call order puts the mid block between the down and up blocks."""
    from sdxl_engine.models.ip_adapter import cross_attention_layers, forward_order

    layers = cross_attention_layers(unet)
    assert {str(2 * j + 1): name for j, (name, _) in enumerate(layers)} == META["layers"]
    order = [layers[j][0].split(".")[0] for j in forward_order(unet)]
    assert order == sorted(order, key=["down_blocks", "mid_block", "up_blocks"].index)
    assert sorted(forward_order(unet)) == list(range(len(layers)))


def test_the_file_and_its_image_encoder_load_by_h94s_layout(adapter):
    """The plain projection (4 tokens of tiny-pt's 80 wide cross-attention), 22 layers, the image encoder found at
    sdxl_models/image_encoder with its config.json's fields."""
    config = adapter.component.config
    assert (config.projection, config.tokens, config.cross_attention_dim, config.image_embed_dim) == ("plain", 4, 80,
                                                                                                      24)
    assert len(config.widths) == 22 and adapter.encoder_path == (FOLDER / "sdxl_models" / "image_encoder").resolve()
    assert adapter.image_size == 32 and adapter.encoder.config.patch_size == 8
    assert "image_proj.proj.weight" in adapter.params and "ip_adapter.43.to_v_ip.weight" in adapter.params
    assert len(adapter.hash) == 8 and adapter.title == f"ip-adapter_sdxl [{adapter.hash}]"


def test_plus_reads_the_resampler_and_finds_vit_h_by_layout(plus):
    """Plus's shapes from the file as diffusers reads them (6 queries of width 48, 1 head of 64, 4 blocks, the
    encoder's hidden size 40 in), and its encoder found at models/image_encoder (h94's ViT-H place) by hidden size, past
    sdxl_models/image_encoder (hidden 32)."""
    config = plus.component.config
    assert (config.projection, config.tokens, config.plus_dim, config.plus_heads, config.plus_depth,
            config.image_embed_dim) == ("plus", 6, 48, 1, 4, 40)
    assert plus.encoder_path == (FOLDER / "models" / "image_encoder").resolve()
    assert "image_proj.layers.3.0.to_kv.weight" in plus.params and "image_proj.layers.0.1.3.weight" in plus.params


def test_plus_tokens_match_diffusers(plus, reference):
    """The Resampler's tokens of the encoder's penultimate hidden states (``hidden_states[-2]``) within 1e-5
    (relative) of diffusers' IPAdapterPlusImageProjection, and the negative row that of a zero image."""
    from sdxl_engine.program.ip_adapter import reference_tokens_fn

    pixels = np.stack([reference[f"pixels_{n}"] for n in NAMES])
    tokens = np.asarray(reference_tokens_fn(plus.encoder, plus.component)(plus.encoder_params, plus.params, pixels))
    assert tokens.shape == (2, 18, 80)
    for got, want in ((tokens[1], reference["module_plus_tokens"].reshape(18, 80)),
                      (tokens[0], np.tile(reference["module_plus_negative"][0], (3, 1)))):
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_clip_pixels_are_clip_image_processors(reference):
    """Resize (the short side to 32, bicubic), centre crop and normalisation as CLIPImageProcessor: within 1e-5 for
    the square pictures and the 64 x 40 one."""
    from sdxl_engine.engine.ip_adapter import clip_pixels

    pictures = {"picture0": reference["pictures"][0], "picture1": reference["pictures"][1], "tall": reference["tall"]}
    for name in NAMES:
        got = clip_pixels(pictures[name], 32)
        assert got.shape == (3, 32, 32) and got.dtype == np.float32
        np.testing.assert_allclose(got, reference[f"pixels_{name}"], atol=1e-5, err_msg=name)


def test_image_embeds_and_tokens_match_diffusers(adapter, reference):
    """The encoder's image_embeds and the projection's tokens of the fixture's pixels within 1e-5 (relative to the
    largest value) of transformers' and diffusers'; the negative row is the projection of zero embeddings."""
    from sdxl_engine.program.ip_adapter import reference_tokens_fn

    pixels = np.stack([reference[f"pixels_{n}"] for n in NAMES])
    embeds = np.asarray(adapter.encoder.bind(adapter.encoder_params)(pixels).image_embeds)
    want = reference["module_image_embeds"]
    assert np.abs(embeds - want).max() / np.abs(want).max() < 1e-5
    tokens = np.asarray(reference_tokens_fn(adapter.encoder, adapter.component)(adapter.encoder_params,
                                                                                adapter.params, pixels))
    assert tokens.shape == (2, 12, 80)
    want = reference["module_tokens"].reshape(12, 80)
    assert np.abs(tokens[1] - want).max() / np.abs(want).max() < 1e-5
    zero = np.asarray(adapter.component.bind(adapter.params).image_proj(np.zeros((1, 24), np.float32)))[0]
    np.testing.assert_allclose(tokens[0], np.tile(zero, (3, 1)), atol=1e-6)


def test_refusals_name_the_file_and_the_kind(tmp_path, unet):
    """Full Face refused by name, a file whose layers do not fit the UNet, no image encoder beside it, pickles and a
    missing file."""
    from safetensors.numpy import load_file, save_file

    from sdxl_engine.checkpoint.ip_adapter import ip_adapter_sources, load_ip_adapter
    from sdxl_engine.checkpoint.weights import ModelLoadError

    tensors = load_file(FILE)
    face = tmp_path / "face.safetensors"
    save_file({**tensors, "image_proj.proj.3.weight": np.zeros((80,), np.float32)}, face)
    with pytest.raises(ModelLoadError, match="Full Face is not supported"):
        load_ip_adapter("face", face, "float32", unet)
    short = tmp_path / "short.safetensors"
    save_file({k: v for k, v in tensors.items() if not k.startswith("ip_adapter.43.")}, short)
    with pytest.raises(ModelLoadError, match="21 ip_adapter layers.*22 cross-attention"):
        load_ip_adapter("short", short, "float32", unet)
    alone = tmp_path / "alone.safetensors"
    save_file(tensors, alone)
    with pytest.raises(ModelLoadError, match="no image encoder with projection_dim 24"):
        load_ip_adapter("alone", alone, "float32", unet)
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="pickle"):
        ip_adapter_sources(str(tmp_path / "x.bin"))
    with pytest.raises(ModelLoadError, match="no such file"):
        ip_adapter_sources(str(tmp_path / "missing.safetensors"))
    assert ip_adapter_sources(f"{FILE}:{alone}", ":") == {"ip-adapter_sdxl": FILE, "alone": alone}


def test_sdxl_bases_cross_attentions_are_h94s_70_layers():
    """SDXL base's UNet has the 70 cross-attentions h94's SDXL files number 1, 3, ... 139: 24 in the down blocks
    (640 and 1280 wide), 36 in the up blocks, then the mid block's 10; its call order puts those 10 between."""
    from sdxl_engine.checkpoint.builtin import SDXL_BASE_DIR
    from sdxl_engine.models import UNetConfig
    from sdxl_engine.models.ip_adapter import cross_attention_layers, forward_order

    unet = UNetConfig.from_dict(json.loads((SDXL_BASE_DIR / "unet" / "config.json").read_text()))
    layers = cross_attention_layers(unet)
    assert len(layers) == 70 and [w for _, w in layers].count(640) == 4 + 6
    assert layers[0] == ("down_blocks.1.attentions.0.transformer_blocks.0.attn2", 640)
    assert layers[24] == ("up_blocks.0.attentions.0.transformer_blocks.0.attn2", 1280)
    assert layers[69] == ("mid_block.attentions.0.transformer_blocks.9.attn2", 1280)
    assert forward_order(unet)[24:34] == tuple(range(60, 70))
