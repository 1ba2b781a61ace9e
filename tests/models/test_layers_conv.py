"""layers.Conv2d's ways to run a 3x3 convolution: XLA's one convolution, or the image in horizontal strips.

"strips" (:func:`layers.conv_strips`) cuts the image into strips with a row of neighbours above and below and
convolves them as a batch without padding: the same products per output pixel; "dot" runs a 1x1 convolution as one
product over the channels. "auto" takes them on a TPU for 2 rows (one image and its CFG twin), where XLA's
small-batch layouts cost time (docs/benchmarks.md, "Convolutions at one image" and "Strips at every latent level").
Checked here: their values against XLA's convolution on fixed non-square inputs, where "auto" takes which (and how
many strips), and the refusals. The UNet and VAE in strips against diffusers: tests/models/test_models.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sdxl_engine.models import layers
from sdxl_engine.models.layers import Conv2d, conv_mode, conv_strip_count, conv_strips


def padded_conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"))


@pytest.mark.parametrize("strips, shape", [(4, (2, 16, 12, 5)), (2, (1, 8, 20, 3)), (8, (3, 24, 8, 4))])
def test_strips_are_the_padded_convolution_in_float32(strips, shape):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 3, shape[-1], 6)), jnp.float32)
    expected = padded_conv(x, w)
    got = conv_strips(x, w, strips)
    assert got.shape == expected.shape == (*shape[:3], 6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_a_module_in_strips_computes_what_it_computes_in_one_convolution(monkeypatch):
    conv = Conv2d(8, 16, 3, padding=1, rngs=nnx.Rngs(0))
    conv.bias[...] = jnp.arange(16, dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(1), (2, 12, 20, 8))
    one = conv(x)
    monkeypatch.setattr(layers, "CONV_MODE", "strips")
    np.testing.assert_allclose(np.asarray(conv(x)), np.asarray(one), rtol=1e-5, atol=1e-5)


def test_auto_takes_strips_on_a_tpu_for_two_rows_of_wide_convolutions(monkeypatch):
    same = ((1, 1), (1, 1))
    sdxl_32 = ((2, 32, 32, 1280), (3, 3, 1280, 1280))
    assert layers.CONV_MODE == "auto"
    assert conv_mode(*sdxl_32, 1, same) == "xla"  # these tests run on CPU devices
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "tpu")
    assert conv_mode(*sdxl_32, 1, same) == "strips"
    assert conv_mode((1, 64, 64, 1920), (3, 3, 1920, 640), 1, same) == "strips"  # one row (no CFG) too
    assert conv_mode((2, 128, 128, 640), (3, 3, 640, 640), 1, same) == "strips"  # up block 1's upsampler
    assert conv_mode((8, 32, 32, 1280), (3, 3, 1280, 1280), 1, same) == "xla"  # 4 images: XLA's own layout
    assert conv_mode((1, 64, 64, 320), (3, 3, 320, 640), 1, same) == "xla"  # one row, 320 in
    assert conv_strip_count(*sdxl_32, 1, same) == 4
    assert conv_strip_count((2, 128, 128, 960), (3, 3, 960, 320), 1, same) == 8  # 2 rows from 64²: 8, any channels
    assert conv_strip_count((2, 64, 64, 320), (3, 3, 320, 640), 1, same) == 8
    assert conv_strip_count((2, 128, 128, 320), (3, 3, 320, 320), 1, same) == 8
    assert conv_strip_count((2, 128, 128, 640), (3, 3, 640, 640), 1, same) == 8
    assert conv_strip_count((2, 256, 256, 320), (3, 3, 320, 320), 1, same) == 0  # a 2048² hires pass: not measured
    assert conv_strip_count((2, 100, 64, 640), (3, 3, 640, 640), 1, same) == 4  # 8 does not divide 100: 4 does
    assert conv_strip_count((2, 100, 64, 320), (3, 3, 320, 320), 1, same) == 0
    assert conv_strip_count((2, 256, 256, 640), (3, 3, 640, 640), 1, same) == 4
    assert conv_strip_count((1, 128, 128, 512), (3, 3, 512, 512), 1, same) == 0  # the VAE's, one image: slower
    assert conv_strip_count((1, 128, 128, 640), (3, 3, 640, 640), 1, same) == 4  # one row: the channels' rule
    assert conv_mode((1, 256, 256, 512), (3, 3, 512, 512), 1, same) == "xla"  # the VAE's widest
    assert conv_mode((2, 64, 64, 640), (3, 3, 640, 640), 2, same) == "xla"  # a downsampler
    assert conv_mode((2, 64, 64, 640), (1, 1, 640, 640), 1, ((0, 0), (0, 0))) == "dot"  # a 1x1 shortcut
    assert conv_mode((2, 30, 32, 1280), (3, 3, 1280, 1280), 1, same) == "xla"  # 4 strips do not divide 30 rows
    assert conv_mode((2, 4, 4, 1280), (3, 3, 1280, 1280), 1, same) == "xla"  # strips of one row
    monkeypatch.setattr(layers, "CONV_MODE", "xla")
    assert conv_mode(*sdxl_32, 1, same) == "xla"  # a name is obeyed
    monkeypatch.setattr(layers, "CONV_MODE", "strips")
    assert conv_mode((8, 16, 16, 4), (3, 3, 4, 8), 1, same) == "strips"
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "cpu")
    assert conv_mode((8, 16, 16, 4), (3, 3, 4, 8), 1, same) == "strips"


def test_a_one_by_one_convolution_of_two_rows_is_a_product_on_a_tpu(monkeypatch):
    conv = Conv2d(8, 16, 1, rngs=nnx.Rngs(0))
    conv.bias[...] = jnp.arange(16, dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(1), (2, 12, 20, 8))
    one = conv(x)
    assert conv_mode(x.shape, conv.weight.shape, 1, conv.padding) == "xla"  # CPU devices
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "tpu")
    assert conv_mode(x.shape, conv.weight.shape, 1, conv.padding) == "dot"
    assert conv_mode((1, 12, 20, 8), conv.weight.shape, 1, conv.padding) == "xla"  # one row: the VAE's were slower
    assert conv_mode((8, 12, 20, 8), conv.weight.shape, 1, conv.padding) == "xla"  # 4 images: XLA's own layout
    assert conv_mode(x.shape, (1, 1, 8, 16), 2, conv.padding) == "xla"  # strided
    np.testing.assert_allclose(np.asarray(conv(x)), np.asarray(one), rtol=1e-5, atol=1e-5)
    traced = str(jax.make_jaxpr(conv)(x))
    assert "dot_general" in traced and "conv_general_dilated" not in traced  # the product, not a convolution
    monkeypatch.setattr(layers, "CONV_MODE", "xla")
    assert conv_mode(x.shape, conv.weight.shape, 1, conv.padding) == "xla"


def test_an_unknown_mode_and_strips_that_do_not_divide_are_refused(monkeypatch):
    monkeypatch.setattr(layers, "CONV_MODE", "pallas")
    with pytest.raises(ValueError, match="conv mode 'pallas' is not one of auto, xla, strips"):
        conv_mode((2, 16, 16, 4), (3, 3, 4, 4), 1, ((1, 1), (1, 1)))
    with pytest.raises(ValueError, match="conv_strips: 4 strips do not divide height 10"):
        conv_strips(jnp.zeros((1, 10, 8, 2)), jnp.zeros((3, 3, 2, 2)), 4)
