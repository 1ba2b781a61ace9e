"""Previews reach the gallery as one PNG file of the batch's grid, written once:
handler._preview_gallery, previews.preview_grid."""

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.engine.previews import preview_grid
from sdxl_engine.engine.steps import StepEvent
from sdxl_engine.serving import handler


def test_a_preview_is_one_lossless_png_of_the_batchs_grid_in_one_folder_of_gradios_temp_folder(tmp_path,
                                                                                               monkeypatch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    rng = np.random.default_rng(0)
    first, second = (rng.integers(0, 256, (4, 16, 24, 3), dtype=np.uint8) for _ in range(2))
    folder: list = []
    items = handler._preview_gallery(StepEvent(3, 20, first, 0.1), folder)
    later = handler._preview_gallery(StepEvent(6, 20, second, 0.2), folder)
    assert [caption for _, caption in items] == ["preview · step 3/20"]
    assert [caption for _, caption in later] == ["preview · step 6/20"]
    assert len(folder) == 1 and folder[0].parent == tmp_path.resolve()  # one folder per request, served as is
    for (path, _), batch in zip(items + later, (first, second)):
        assert str(path).startswith(str(folder[0]))
        with Image.open(path) as png:
            assert png.format == "PNG" and "parameters" not in png.info
            grid = np.asarray(png.convert("RGB"))
        assert grid.shape == (32, 48, 3)  # 2 x 2 images of 16 x 24, in order
        rows = [np.concatenate(batch[:2], axis=1), np.concatenate(batch[2:], axis=1)]
        np.testing.assert_array_equal(grid, np.concatenate(rows, axis=0))


def test_a_preview_that_cannot_be_written_is_skipped(tmp_path, monkeypatch, runtime_log):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(blocker))
    assert handler._preview_gallery(StepEvent(1, 2, np.zeros((1, 8, 8, 3), np.uint8), 0.1), []) == []
    assert any("[app] warning: could not write a preview to Gradio's temp folder" in line for line in runtime_log)


def test_the_grid_is_a1111s_layout():
    """modules/images.py image_grid with n_rows -1: rows = round(sqrt(n)), columns = ceil(n / rows), black fill."""
    def batch(n):
        return np.stack([np.full((2, 3, 3), i + 1, np.uint8) for i in range(n)])

    shapes = {n: preview_grid(batch(n)).shape[:2] for n in (1, 2, 3, 4, 5, 8, 9)}
    assert shapes == {1: (2, 3), 2: (2, 6), 3: (4, 6), 4: (4, 6), 5: (4, 9), 8: (6, 9), 9: (6, 9)}
    five = preview_grid(batch(5))
    assert five[0, ::3, 0].tolist() == [1, 2, 3] and five[2, ::3, 0].tolist() == [4, 5, 0]  # row-major, then black
    single = np.zeros((2, 3, 3), np.uint8)
    assert preview_grid(single) is single
    with pytest.raises(ValueError, match="no previews"):
        preview_grid(np.zeros((0, 2, 3, 3), np.uint8))
