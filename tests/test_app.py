"""The app as users reach it: `python app.py` in a subprocess, called through gradio_client."""

import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import FIXTURES, log_message

pytestmark = pytest.mark.e2e


def call(app_server, **kwargs):
    return app_server.client().predict(api_name="/generate", **kwargs)


def test_generate_red_circle_returns_the_reference_images_and_json(app_server):
    """The default app (tiny-shapes) through gradio_client gives the images of tests/fixtures'
    tiny-shapes reference case 0 ("a red circle", seed 0, guidance 5, 20 steps; mean <= 0.5/255, the
    tolerance test_models.py uses), red ones, and the JSON record of that request."""
    gallery, info = call(app_server, prompt="a red circle", seed=0, guidance_scale=5.0, num_inference_steps=20)
    assert len(gallery) == 4
    arrays = np.stack([np.asarray(Image.open(item["image"]).convert("RGB")) for item in gallery]).astype(np.int32)
    with np.load(FIXTURES / "tiny-shapes-reference.npz") as data:
        reference = data["case0_images"].astype(np.int32)
    assert arrays.shape == reference.shape == (4, 64, 64, 3)
    assert [float(np.abs(a - r).mean()) <= 0.5 for a, r in zip(arrays, reference)] == [True] * 4
    red = arrays[..., 0] - (arrays[..., 1] + arrays[..., 2]) / 2
    assert red.mean() > 15  # red stands out of the image (by measurement: about 30/255)
    assert info["seeds"] == [0, 1, 2, 3]
    assert {k: info[k] for k in ("prompt", "negative_prompt", "guidance_scale", "num_inference_steps", "width",
                                 "height", "model", "sampler", "style", "device_count")} == {
        "prompt": "a red circle", "negative_prompt": "", "guidance_scale": 5.0, "num_inference_steps": 20,
        "width": 64, "height": 64, "model": "tiny-shapes", "sampler": "Euler", "style": "(No style)",
        "device_count": 4}
    assert isinstance(info["latency_s"], float) and info["latency_s"] > 0
    for item, seed in zip(gallery, info["seeds"]):
        assert f"seed {seed}" in item["caption"] and item["caption"].endswith(" s")
        assert Path(item["image"]).name == f"seed{seed}-a-red-circle.png"  # what a download is called


def test_same_seed_through_api_is_deterministic(app_server):
    g1, i1 = call(app_server, prompt="a blue square", seed=123, num_inference_steps=5)
    g2, i2 = call(app_server, prompt="a blue square", seed=123, num_inference_steps=5)
    assert i1["seeds"] == i2["seeds"] == [123, 124, 125, 126]
    for a, b in zip(g1, g2):
        assert np.array_equal(np.asarray(Image.open(a["image"])), np.asarray(Image.open(b["image"])))


def test_bad_input_reaches_client_as_clear_error(app_server):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="prompt: is empty"):
        call(app_server, prompt="  ")
    gallery, _ = call(app_server, prompt="still works")
    assert len(gallery) == 4


def test_style_through_api_is_applied_and_recorded(app_server):
    gallery, info = call(app_server, prompt="a red circle", seed=5, num_inference_steps=3, style="Cinematic")
    assert info["style"] == "Cinematic" and info["prompt"].startswith("cinematic still a red circle . ")
    assert gallery[0]["caption"].startswith("seed 5 · Cinematic · ")
    with Image.open(gallery[0]["image"]) as image:
        assert "Style: Cinematic" in image.text["parameters"]


# Deprecation notices of diffusers' and transformers' Flax classes (they go with those classes).
FLAX_NOTICES = ("Flax classes are deprecated", "TensorFlow and JAX classes are deprecated")


def test_start_logs_a_few_useful_lines(app_server):
    lines = [line for line in app_server.log if not any(n in line for n in FLAX_NOTICES)]
    ready = next(i for i, line in enumerate(lines) if "[sdxl_engine] ready in" in line)
    assert ready + 1 <= 20, "".join(lines[:ready + 1])
    assert not [line for line in lines[:ready + 1] if "Warning" in line or "share=True" in line]
    # whether a cache served the program: the executable cache (loaded / stored) or XLA's compile cache
    assert any("compile cache: " in line or "executable cache: " in line for line in lines[:ready])


def new_log_lines(app_server, call) -> list[str]:
    """The lines ``app_server`` logs while ``call()`` runs (and half a second after)."""
    before = len(app_server.log)
    call()
    time.sleep(0.5)
    return [line for line in app_server.log[before:] if not any(n in line for n in FLAX_NOTICES)]


def test_a_refused_request_logs_one_line_and_a_good_one_none(app_server):
    from gradio_client.exceptions import AppError

    def refused():
        with pytest.raises(AppError, match="prompt: is empty"):
            call(app_server, prompt="\u200d")

    lines = new_log_lines(app_server, refused)
    assert len(lines) == 1 and log_message(lines[0]).startswith("[app] request refused: prompt: is empty"), lines
    assert new_log_lines(app_server, lambda: call(app_server, prompt="a red circle", num_inference_steps=2)) == []


def test_words_outside_tiny_shapes_vocabulary_are_named(app_server):
    """tiny-shapes knows only its training captions' words: the others are named, so a user knows
    why the image does not follow them."""
    _, info = call(app_server, prompt="a red circle next to a dog 🐶", num_inference_steps=2)
    assert info["warnings"] == ["prompt: tiny-shapes was not trained on these words, so they do not steer its "
                                "images, but they still change them: next, to, dog, 🐶"]
    _, info = call(app_server, prompt="a small red circle in the centre on a white background", num_inference_steps=2)
    assert info["warnings"] == []


def test_a_new_size_compiles_without_holding_up_other_clients(app_server):
    """256x256, no bucket of tiny-shapes (whose largest side is 192), is served: it compiles once on the engine's
    compile thread, and a request at a compiled size sent during that compile is answered before it ends."""
    compiling = app_server.client().submit(api_name="/generate", prompt="a red circle", seed=3, num_inference_steps=2,
                                           width=256, height=256)
    deadline = time.monotonic() + 120
    while not any("Compiling 256x256" in (getattr(u, "desc", "") or "")
                  for u in compiling.status().progress_data or []):
        assert time.monotonic() < deadline and not compiling.done(), compiling.status()
        time.sleep(0.05)
    gallery, info = call(app_server, prompt="a blue square", seed=4, num_inference_steps=2)
    assert len(gallery) == 4 and (info["width"], info["height"]) == (64, 64)
    assert not compiling.done()  # answered while the 256x256 program still compiled
    gallery, info = compiling.result(timeout=600)
    assert (info["width"], info["height"]) == (256, 256) and len(gallery) == 4
    assert any("compiled 256x256 x 4 images" in line for line in app_server.log)
