"""The page's image to image input (serving/image_input.py): the editor's files to the engine's fields."""

import io

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.serving import image_input
from sdxl_engine.serving.apis.core import ApiError


def write_png(path, pixels) -> dict:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    path.write_bytes(buffer.getvalue())
    return {"path": str(path), "meta": {"_type": "gradio.FileData"}}


@pytest.fixture
def editor(tmp_path):
    """An editor value: a 32 x 48 picture and a brush layer with a stroke (opaque) over rows 10-19, columns 8-23."""
    picture = np.zeros((32, 48, 3), np.uint8)
    picture[:, :24] = (200, 20, 20)
    picture[:, 24:] = (20, 20, 200)
    layer = np.zeros((32, 48, 4), np.uint8)
    layer[10:20, 8:24] = (0, 0, 0, 255)
    layer[25, 40] = (0, 0, 0, 1)  # a stroke's faint edge: drawn too
    value = {"background": write_png(tmp_path / "background.png", picture),
             "layers": [write_png(tmp_path / "layer_0.png", layer)], "composite": None}
    return value, picture


def test_the_mask_is_every_pixel_a_stroke_touched(editor):
    value, picture = editor
    read = image_input.read_editor(value, lambda path: True)
    assert np.array_equal(read.image, picture)
    expected = np.zeros((32, 48), np.uint8)
    expected[10:20, 8:24] = 255
    expected[25, 40] = 255
    assert np.array_equal(read.mask, expected)


def test_files_the_page_may_not_read_and_missing_pictures_are_refused(editor, tmp_path):
    value, _ = editor
    with pytest.raises(ApiError, match="not a file this page uploaded"):
        image_input.read_editor(value, lambda path: not path.endswith("layer_0.png"))
    with pytest.raises(ApiError, match="no image in the editor"):
        image_input.read_editor({"background": None, "layers": [], "composite": None}, lambda path: True)
    (tmp_path / "text.png").write_bytes(b"hello")
    with pytest.raises(ApiError, match="not a PNG, JPEG or WebP"):
        image_input.read_editor({"background": {"path": str(tmp_path / "text.png")}}, lambda path: True)
    with pytest.raises(ApiError, match="no longer on the server"):
        image_input.read_editor({"background": {"path": str(tmp_path / "gone.png")}}, lambda path: True)


def test_inpaint_resizes_to_the_resolution_and_pastes_the_picture_back_outside_the_mask(editor):
    value, _ = editor
    read = image_input.read_editor(value, lambda path: True)
    asked = image_input.request_fields(read, image_input.INPAINT, 1.0, 64, 64)
    image, mask = asked.fields["image"], asked.fields["mask"]
    assert image.shape == (64, 64, 3) and mask.shape == (64, 64) and asked.fields["strength"] == 1.0
    assert np.array_equal(image, np.asarray(Image.fromarray(read.image).resize((64, 64), Image.Resampling.LANCZOS)))
    assert mask[30, 20] == 255 and mask[0, 0] == 0  # (row 15, column 10) of the 32 x 48 picture, scaled
    made = np.full((4, 64, 64, 3), 7, np.uint8)
    out = asked.finish.apply(made)
    keep = mask < 128
    assert np.array_equal(out[:, keep], np.broadcast_to(image[keep], (4, *image[keep].shape)))
    assert (out[:, ~keep] == 7).all()


def test_modes_give_the_engine_fields_they_need(editor):
    value, _ = editor
    read = image_input.read_editor(value, lambda path: True)
    plain = image_input.request_fields(read, image_input.IMG2IMG, 0.75, 64, 48, refiner_switch_at=0.8)
    assert set(plain.fields) == {"image", "strength", "refiner_switch_at"} and plain.finish is None
    assert plain.fields["image"].shape == (48, 64, 3)
    out = image_input.request_fields(read, image_input.OUTPAINT, 1.0, 64, 64, ["Right"], 16)
    assert out.fields["outpaint"] == (0, 0, 16, 0) and out.fields["image"].shape == (64, 48, 3)
    assert out.fields["mask"].shape == (64, 48)
    result = out.finish.apply(np.zeros((4, 64, 64, 3), np.uint8))
    assert (result[:, :, 48:] == 0).all()  # the new area is the engine's
    assert np.array_equal(result[0, 0, :8], out.fields["image"][0, :8])  # the picture's unmasked pixels kept
    with pytest.raises(ApiError, match="mask: draw over"):
        image_input.request_fields(image_input.EditorImage(read.image, None), image_input.INPAINT, 1.0, 64, 64)
    with pytest.raises(ApiError, match="outpaint: pick"):
        image_input.request_fields(read, image_input.OUTPAINT, 1.0, 64, 64, [], 16)
    with pytest.raises(ApiError, match="leave the picture"):
        image_input.request_fields(read, image_input.OUTPAINT, 1.0, 64, 64, ["Left", "Right"], 30)
    with pytest.raises(ApiError, match="pick a resolution"):
        image_input.request_fields(read, image_input.IMG2IMG, 0.75, 0, 0)


def test_the_pages_default_strengths_are_a1111s_and_the_inpainting_start():
    """The slider's value per mode: image to image A1111's img2img default (0.75, the engine's too); inpaint and
    outpaint 1 (the masked area starts from noise)."""
    from sdxl_engine.engine.validation import DEFAULT_STRENGTH

    assert image_input.DEFAULT_STRENGTH == {image_input.IMG2IMG: 0.75, image_input.INPAINT: 1.0,
                                            image_input.OUTPAINT: 1.0}
    assert image_input.DEFAULT_STRENGTH[image_input.IMG2IMG] == DEFAULT_STRENGTH
