"""PNG files: A1111 parameters, lossless bytes, safe names, files never replaced."""

import errno
import io
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.service.images import a1111_parameters, encode_pngs, parse_a1111_parameters, png_bytes, slug, write_new
from tests.helpers import FullDiskFile


def test_a1111_parameters_roundtrip():
    text = a1111_parameters("a red circle", "blurry", 20, 7.0, 42, 64, 64, "tiny-random")
    assert text == ("a red circle\nNegative prompt: blurry\nSteps: 20, Sampler: Euler, CFG scale: 7, Seed: 42, "
                    "Size: 64x64, Model: tiny-random")
    parsed = parse_a1111_parameters(text)
    assert parsed["Seed"] == "42" and parsed["negative_prompt"] == "blurry" and parsed["Size"] == "64x64"
    text = a1111_parameters("a red circle", "", 8, 1.0, 7, 64, 64, "tiny-shapes", {"Style": "Anime"}, "DPM++ 2M Karras")
    assert text == ("a red circle\nSteps: 8, Sampler: DPM++ 2M Karras, CFG scale: 1, Seed: 7, Size: 64x64, "
                    "Model: tiny-shapes, Style: Anime")
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


def _full_disk_open(room: int, failing_suffix: str, opened: list):
    """An ``open`` whose files ending ``failing_suffix`` take ``room`` bytes, then fail as a full disk does."""
    import builtins

    def fake_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        if not str(path).endswith(failing_suffix):
            return f
        opened.append(Path(path).name)
        return FullDiskFile(f, room)

    return fake_open


@pytest.mark.parametrize("links", [True, False], ids=["hard-link", "no-links"])
@pytest.mark.parametrize("room", [0, 100])
def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch, links, room):
    """A full disk fails the save with ENOSPC and leaves no ``.partial`` file and no part of the PNG, whether the
    temporary file (hard links) or the final name (a file system without them) was being written."""
    from sdxl_engine.service import images

    (tmp_path / "kept.png").write_bytes(b"another file")
    opened = []
    if not links:
        def no_link(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(images.os, "link", no_link)
    monkeypatch.setattr(images, "open", _full_disk_open(room, ".partial" if links else ".png", opened), raising=False)
    with pytest.raises(OSError) as err:
        write_new(b"x" * 1000, tmp_path, "seed1-x")
    assert err.value.errno == errno.ENOSPC
    assert len(opened) == 1 and opened[0].endswith(".partial" if links else ".png")  # the failing write was reached
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.png"]
