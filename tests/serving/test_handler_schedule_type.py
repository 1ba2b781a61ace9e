"""/generate's ``schedule_type`` (issue #62) on the compiled tiny-shapes engine at 64 x 64, as gradio_client calls it
(handler.api_function in-process, tests/helpers.page_generate): karras makes other images than the call without it,
the same images as the A1111 route's ``scheduler: Karras`` for the same seed, and an unknown name is refused naming
``schedule_type``."""

import gradio as gr
import numpy as np
import pytest
from PIL import Image

from sdxl_engine.serving.apis.a1111 import Txt2Img
from sdxl_engine.serving.apis.a1111 import to_call as a1111_call
from tests.helpers import page_generate

pytestmark = pytest.mark.engine

SETTINGS = dict(seed=3, num_inference_steps=4, width=64, height=64, sampler="Euler")


def pixels(gallery) -> np.ndarray:
    """The gallery's images (PNG files, lossless) as (n, H, W, 3) uint8."""
    return np.stack([np.asarray(Image.open(path).convert("RGB")) for path, _ in gallery])


def test_karras_differs_from_the_default_and_matches_the_a1111_route(tiny_shapes_engine, tmp_path):
    karras, info, record = page_generate(tiny_shapes_engine, "a red circle", schedule_type="karras",
                                         files_dir=tmp_path, **SETTINGS)
    plain, plain_info, _ = page_generate(tiny_shapes_engine, "a red circle", files_dir=tmp_path, **SETTINGS)
    assert info["schedule_type"] == "karras" and plain_info["schedule_type"] == "automatic"
    assert record["schedule_type"] == "karras"  # what the browser history restores
    assert np.abs(pixels(karras).astype(int) - pixels(plain)).mean() > 1.0
    a1111 = a1111_call(Txt2Img(prompt="a red circle", sampler_name="Euler", scheduler="Karras", seed=3, steps=4,
                               width=64, height=64, cfg_scale=info["guidance_scale"]))
    assert np.array_equal(tiny_shapes_engine.generate(a1111.engine).images, pixels(karras))


def test_an_unknown_schedule_type_is_refused_naming_the_field(tiny_shapes_engine, tmp_path):
    with pytest.raises(gr.Error) as err:
        page_generate(tiny_shapes_engine, "a red circle", schedule_type="sideways", files_dir=tmp_path, **SETTINGS)
    assert err.value.message == ("schedule_type: unknown schedule type 'sideways'; choose one of automatic, uniform, "
                                 "karras, exponential, sgm_uniform, simple, beta, leading, linspace, trailing")
