"""Previews reach the gallery as PNG files written once (issue #23, item 5): handler._preview_gallery."""

import numpy as np
from PIL import Image

from sdxl_engine.engine.steps import StepEvent
from sdxl_engine.serving import handler


def test_previews_are_lossless_pngs_in_one_folder_of_gradios_temp_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    rng = np.random.default_rng(0)
    first, second = (rng.integers(0, 256, (4, 16, 24, 3), dtype=np.uint8) for _ in range(2))
    folder: list = []
    items = handler._preview_gallery(StepEvent(3, 20, first, 0.1), folder)
    later = handler._preview_gallery(StepEvent(6, 20, second, 0.2), folder)
    assert [caption for _, caption in items] == ["preview · step 3/20"] * 4
    assert [caption for _, caption in later] == ["preview · step 6/20"] * 4
    assert len(folder) == 1 and folder[0].parent == tmp_path.resolve()  # one folder per request, served as is
    for (path, _), image in zip(items + later, list(first) + list(second)):
        assert str(path).startswith(str(folder[0]))
        with Image.open(path) as png:
            assert png.format == "PNG" and "parameters" not in png.info
            np.testing.assert_array_equal(np.asarray(png.convert("RGB")), image)


def test_a_preview_that_cannot_be_written_is_skipped(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(blocker))
    assert handler._preview_gallery(StepEvent(1, 2, np.zeros((1, 8, 8, 3), np.uint8), 0.1), []) == []
    assert "[app] warning: could not write a preview to Gradio's temp folder" in capsys.readouterr().out
