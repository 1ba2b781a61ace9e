"""models/controlnet.py against diffusers' ControlNetModel, and the UNet's additional residuals.

Reference: tests/fixtures/tiny-pt-controlnet/ (``python -m tools.fixtures_controlnet``, the torch venv): cn-a, a
ControlNet made from tiny-pt's UNet (``ControlNetModel.from_unet``, zero convs given random weights, saved in
float16), and one call of it in float32 on fixed inputs at conditioning scale 0.7 (``module_*``).
"""

import json

import numpy as np
import pytest

from tests.helpers import FIXTURES

FOLDER = FIXTURES / "tiny-pt-controlnet"


@pytest.fixture(scope="module")
def reference():
    with np.load(FOLDER / "reference.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def controlnet():
    from sdxl_engine.checkpoint.controlnet import load_controlnet

    return load_controlnet("cn-a", FOLDER / "cn-a", "float32", log=lambda line: None)


def test_the_config_reads_diffusers_fields(controlnet):
    """from_unet's config: the encoder's blocks, the conditioning embedding's channels; 10 residuals (conv_in, 2
    layers x 3 blocks, 2 downsamplers, the mid block); the conditioning embedding downsamples 4 times (tiny-pt's VAE
    factor)."""
    config = controlnet.component.config
    assert config.unet.block_out_channels == (16, 32, 32)
    assert config.conditioning_embedding_out_channels == (8, 16, 32)
    assert config.residuals == 10 and config.image_factor == 4 and not config.bgr
    keys = controlnet.component.shapes
    assert "controlnet_mid_block.weight" in keys and "controlnet_down_blocks.8.weight" in keys
    assert "controlnet_cond_embedding.blocks.3.weight" in keys and not any(k.startswith("up_blocks") for k in keys)


def test_residuals_match_diffusers(controlnet, reference):
    """Each of the 10 residuals within 1e-4 (relative to its largest value) of diffusers' ControlNetModel."""
    import jax.numpy as jnp

    net = controlnet.component.bind(controlnet.params)
    r = {k[len("module_"):]: v for k, v in reference.items() if k.startswith("module_")}
    down, mid = net(jnp.asarray(r["sample"]), jnp.asarray(r["timestep"]), jnp.asarray(r["hidden"]),
                    jnp.asarray(r["text_embeds"]), jnp.asarray(r["time_ids"]), jnp.asarray(r["cond"]), 0.7)
    assert len(down) == 9
    for k, got in enumerate([*down, mid]):
        want = r[f"down_{k}"] if k < 9 else r["mid"]
        assert got.shape == want.shape, (k, got.shape, want.shape)
        err = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
        assert err < 1e-4, (k, err)


def test_a_bgr_controlnet_flips_the_image(controlnet, reference):
    """controlnet_conditioning_channel_order "bgr": the same as giving the RGB module the flipped image."""
    import jax.numpy as jnp

    from sdxl_engine.models import build_component
    from sdxl_engine.models.controlnet import ControlNetConfig

    config = json.loads((FOLDER / "cn-a" / "config.json").read_text())
    bgr = build_component("controlnet", {**config, "controlnet_conditioning_channel_order": "bgr"})
    assert isinstance(bgr.config, ControlNetConfig) and bgr.config.bgr
    r = {k[len("module_"):]: jnp.asarray(v) for k, v in reference.items() if k.startswith("module_")}
    args = (r["sample"], r["timestep"], r["hidden"], r["text_embeds"], r["time_ids"])
    _, flipped = bgr.bind(controlnet.params)(*args, r["cond"][:, ::-1])
    _, plain = controlnet.component.bind(controlnet.params)(*args, r["cond"])
    np.testing.assert_allclose(np.asarray(flipped), np.asarray(plain), rtol=1e-5, atol=1e-5)


def test_unsupported_configs_are_refused_by_field():
    from sdxl_engine.models import build_component

    config = json.loads((FOLDER / "cn-a" / "config.json").read_text())
    with pytest.raises(ValueError, match="global_pool_conditions"):
        build_component("controlnet", {**config, "global_pool_conditions": True})
    with pytest.raises(ValueError, match="channel_order"):
        build_component("controlnet", {**config, "controlnet_conditioning_channel_order": "gbr"})


def test_the_unet_adds_residuals_to_its_skips_and_mid_block():
    """down_block_additional_residuals land on the skip connections (not the flowing hidden state) and the mid
    residual on the mid block's output, as diffusers: zeros change nothing, and the residuals' effect equals
    running the UNet with those skips shifted by hand."""
    import jax.numpy as jnp

    from sdxl_engine.checkpoint.loading import load_folder

    model = load_folder(FIXTURES / "tiny-pt", "tiny-pt", "float32")
    unet = model.components["unet"].bind(model.params["unet"])
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(1, 4, 16, 16), jnp.float32)
    args = (x, jnp.asarray([500.0]), jnp.asarray(rng.randn(1, 77, 80), jnp.float32),
            jnp.asarray(rng.randn(1, 48), jnp.float32), jnp.asarray([[64, 64, 0, 0, 64, 64]], jnp.float32))
    shapes = [(1, 16, 16, 16)] * 3 + [(1, 16, 8, 8)] + [(1, 32, 8, 8)] * 2 + [(1, 32, 4, 4)] * 3
    zeros = [jnp.zeros(s) for s in shapes]
    plain = unet(*args)
    np.testing.assert_array_equal(np.asarray(unet(*args, zeros, jnp.zeros((1, 32, 4, 4)))), np.asarray(plain))
    residuals = [jnp.asarray(rng.randn(*s), jnp.float32) for s in shapes]
    moved = unet(*args, residuals, jnp.asarray(rng.randn(1, 32, 4, 4), jnp.float32))
    assert np.abs(np.asarray(moved - plain)).mean() > 1e-3
    only_mid = unet(*args, zeros, jnp.ones((1, 32, 4, 4)))
    assert np.abs(np.asarray(only_mid - plain)).mean() > 1e-4
    with pytest.raises(ValueError, match="8 down residuals for 9 skips"):
        unet(*args, residuals[:8], None)
