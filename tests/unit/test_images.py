"""PNG files: A1111 parameters, lossless bytes, safe names, files never replaced."""

import io
import threading

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.serving.images import a1111_parameters, encode_pngs, parse_a1111_parameters, png_bytes, slug, write_new


def test_a1111_parameters_roundtrip():
    text = a1111_parameters("a red circle", "blurry", 20, 7.0, 42, 64, 64, "tiny-random")
    assert text == "a red circle\nNegative prompt: blurry\nSteps: 20, Sampler: Euler, CFG scale: 7, Seed: 42, Size: 64x64, Model: tiny-random"
    parsed = parse_a1111_parameters(text)
    assert parsed["Seed"] == "42" and parsed["negative_prompt"] == "blurry" and parsed["Size"] == "64x64"
    text = a1111_parameters("a red circle", "", 8, 1.0, 7, 64, 64, "tiny-shapes", {"Style": "Anime"}, "DPM++ 2M Karras")
    assert text == "a red circle\nSteps: 8, Sampler: DPM++ 2M Karras, CFG scale: 1, Seed: 7, Size: 64x64, Model: tiny-shapes, Style: Anime"
    assert parse_a1111_parameters(text)["Sampler"] == "DPM++ 2M Karras"


@pytest.mark.parametrize("shape", [(1, 1, 3), (37, 53, 3), (64, 64, 3)])
def test_png_bytes_is_lossless_and_carries_its_parameters(shape):
    image = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    for text in ("a red circle\nSteps: 20, Sampler: Euler", "café 🔴 ünïcödé"):  # Latin-1 (tEXt) and UTF-8 (iTXt)
        decoded = Image.open(io.BytesIO(png_bytes(image, text)))
        assert np.array_equal(np.asarray(decoded), image) and decoded.text["parameters"] == text
    pngs = encode_pngs(np.stack([image, 255 - image]), ["one", "two"])
    assert [Image.open(io.BytesIO(p)).text["parameters"] for p in pngs] == ["one", "two"]
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(pngs[1]))), 255 - image)


def test_write_new_never_replaces_a_file(tmp_path):
    (tmp_path / "seed1-a-red-circle.png").write_bytes(b"first")
    assert write_new(b"second", tmp_path, "seed1-a-red-circle").name == "seed1-a-red-circle-2.png"
    assert (tmp_path / "seed1-a-red-circle.png").read_bytes() == b"first"
    paths = []
    threads = [threading.Thread(target=lambda i=i: paths.append(write_new(bytes([i]) * 1000, tmp_path, "same")))
               for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 16 and sorted(p.read_bytes()[0] for p in paths) == list(range(16))
    assert not list(tmp_path.glob(".*"))  # no temporary file left


@pytest.mark.parametrize("text, expected", [
    ("a red circle", "a-red-circle"), ("A Red Circle, on a blue background!", "a-red-circle-on-a-blue"),
    ("Café crème", "cafe-creme"), ("🔴🔵", "image"), ("", "image"), ("../../etc/passwd", "etc-passwd"),
])
def test_slug_is_a_safe_file_name_part(text, expected):
    assert slug(text) == expected
