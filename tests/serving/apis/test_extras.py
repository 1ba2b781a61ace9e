"""serving/apis/extras.py: A1111's Extras upscaling and the bounds on the images clients send (no app)."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.serving.apis import extras
from sdxl_engine.serving.apis.core import ApiError
from sdxl_engine.serving.apis.extras import ExtrasBatchImages, ExtrasSingleImage
from tests.helpers import png_header_only


def b64(image: Image.Image, fmt: str = "PNG", **kw) -> str:
    out = io.BytesIO()
    image.save(out, format=fmt, **kw)
    return base64.b64encode(out.getvalue()).decode()


def gradient(width: int, height: int) -> Image.Image:
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    return Image.fromarray(np.concatenate([np.broadcast_to(x, (height, width, 1)),
                                           np.broadcast_to(y, (height, width, 1)),
                                           np.full((height, width, 1), 99, np.float32)], axis=2).astype(np.uint8))


def refusal(data: str, field: str = "image") -> str:
    with pytest.raises(ApiError) as caught:
        extras.decode_image(data, field)
    assert caught.value.status == 400 and caught.value.param == field
    return caught.value.message


def test_a_one_pixel_image_and_a_data_url_are_accepted():
    image = extras.decode_image(b64(Image.new("RGB", (1, 1), (10, 20, 30))), "image")
    assert image.size == (1, 1) and image.getpixel((0, 0)) == (10, 20, 30)
    url = "data:image/webp;base64," + b64(Image.new("RGBA", (3, 2), (1, 2, 3, 255)), "WEBP", lossless=True)
    image = extras.decode_image(url, "image")
    assert image.mode == "RGB" and image.size == (3, 2) and image.getpixel((2, 1)) == (1, 2, 3)


def test_broken_truncated_and_non_images_are_refused_naming_the_field():
    jpeg = base64.b64decode(b64(gradient(64, 64), "JPEG"))
    truncated = base64.b64encode(jpeg[: len(jpeg) // 2]).decode()
    assert refusal(truncated, "imageList[1].data").startswith("imageList[1].data: a broken or truncated image (")
    text_named_png = base64.b64encode(b"this is a text file named picture.png\n").decode()
    assert refusal(text_named_png) == "image: not a PNG, JPEG or WebP image"
    gif = io.BytesIO()
    Image.new("RGB", (4, 4)).save(gif, format="GIF")
    assert refusal(base64.b64encode(gif.getvalue()).decode()) == "image: not a PNG, JPEG or WebP image"
    assert refusal("not base64!") == "image: not base64 data"
    assert refusal(" https://example.com/a.png").startswith("image: a URL; this server never fetches one")
    assert refusal("") == "image: no image (empty)"


def test_a_decompression_bomb_is_refused_from_its_header():
    bomb = base64.b64encode(png_header_only(8000, 8000)).decode()  # 200 bytes claiming 192 MB of pixels
    assert refusal(bomb) == "image: the image is 8000x8000 pixels; at most 2048x2048 here"
    huge = base64.b64encode(png_header_only(100_000, 100_000)).decode()  # past Pillow's own limit too
    assert refusal(huge) == "image: the image claims too many pixels; at most 2048x2048 here"
    assert refusal(b64(Image.new("L", (2049, 1)))) == "image: the image is 2049x1 pixels; at most 2048x2048 here"
    assert extras.decode_image(b64(Image.new("L", (2048, 8))), "image").size == (2048, 8)


def test_exif_orientation_is_applied():
    image = gradient(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to view
    decoded = extras.decode_image(b64(image, "JPEG", exif=exif.tobytes(), quality=95), "image")
    assert decoded.size == (20, 40)


def test_sizes_follow_a1111_and_the_output_is_bounded():
    req = ExtrasSingleImage(upscaler_1="Lanczos", upscaling_resize=1.5)
    assert extras.output_size(req, 100, 75) == (144, 112, 1.5)  # int(150)//8*8, int(112.5)//8*8
    assert extras.output_size(ExtrasSingleImage(upscaling_resize=2), 1, 1)[:2] == (2, 2)  # under 8: not 0
    to = ExtrasSingleImage(resize_mode=1, upscaling_resize_w=300, upscaling_resize_h=100)
    assert extras.output_size(to, 100, 50) == (300, 100, 3.0)
    assert extras.output_size(to.model_copy(update={"upscaling_crop": False}), 100, 50) == (296, 144, 3.0)
    assert extras.output_size(ExtrasSingleImage(upscaling_resize=4.1), 1000, 10)[:2] == (4096, 40)  # 4100 -> 4096
    with pytest.raises(ApiError) as caught:
        extras.output_size(ExtrasSingleImage(upscaling_resize=4.2), 1000, 10)
    assert caught.value.message == "upscaling_resize: the result would be 4200x40 pixels; at most 4096x4096 here"
    assert caught.value.param == "upscaling_resize"
    with pytest.raises(ApiError, match=r"^upscaling_resize_w/upscaling_resize_h: the result would be 4097x8 "):
        extras.output_size(ExtrasSingleImage(resize_mode=1, upscaling_resize_w=4097, upscaling_resize_h=8), 8, 8)


def test_lanczos_and_nearest_upscale_and_warnings_name_what_is_not_applied():
    source = gradient(16, 8)
    req = ExtrasSingleImage(upscaler_1="Nearest", upscaling_resize=2, upscaler_2="ESRGAN_4x",
                            extras_upscaler_2_visibility=0.5, gfpgan_visibility=0.3)
    pngs, info, warnings = extras.run(req, [(b64(source), "image")])
    with Image.open(io.BytesIO(base64.b64decode(pngs[0]))) as out:
        assert out.size == (32, 16) and out.format == "PNG"
        assert np.array_equal(np.asarray(out)[::2, ::2], np.asarray(source))  # nearest: each pixel twice
        assert out.text["postprocessing"].startswith("Postprocess upscale by: 2, Postprocess upscaler: Nearest\n")
    assert warnings == ["upscaler_2 'ESRGAN_4x' (visibility 0.5) is not applied: one upscaler only here",
                        "gfpgan_visibility 0.3 is not applied: no face restoration here"]
    assert info == ("<p>Postprocess upscale by: 2, Postprocess upscaler: Nearest<br>\n"
                    "upscaler_2 &#x27;ESRGAN_4x&#x27; (visibility 0.5) is not applied: one upscaler only here<br>\n"
                    "gfpgan_visibility 0.3 is not applied: no face restoration here</p>")
    lanczos = ExtrasSingleImage(upscaler_1="Lanczos", resize_mode=1, upscaling_resize_w=32, upscaling_resize_h=32)
    pngs, info, warnings = extras.run(lanczos, [(b64(source), "image")])
    with Image.open(io.BytesIO(base64.b64decode(pngs[0]))) as out:
        pixels = np.asarray(out)
    assert pixels.shape == (32, 32, 3) and warnings == []
    # The factor that covers both sides (4: 64x32), then the middle 32x32 of it (A1111's crop to fit).
    expected = np.asarray(source.resize((64, 32), Image.Resampling.LANCZOS))[:, 16:48]
    assert np.array_equal(pixels, expected)
    wide = ExtrasSingleImage(upscaler_1="Lanczos", resize_mode=1, upscaling_resize_w=48, upscaling_resize_h=8)
    with Image.open(io.BytesIO(base64.b64decode(extras.run(wide, [(b64(gradient(8, 8)), "image")])[0][0]))) as out:
        pixels = np.asarray(out)
    assert pixels.shape == (8, 48, 3)  # factor 6: 48x48, its middle 8 rows
    assert np.array_equal(pixels, np.asarray(gradient(8, 8).resize((48, 48), Image.Resampling.LANCZOS))[20:28])
    assert info == "<p>Postprocess upscale to: 32x32, Postprocess upscaler: Lanczos, Postprocess crop to: 32x32</p>"


def test_none_keeps_the_image_and_an_unknown_upscaler_or_a_bad_batch_item_is_refused():
    source = gradient(8, 8)
    pngs, info, _ = extras.run(ExtrasSingleImage(), [(b64(source), "image")])  # A1111's default: "None"
    with Image.open(io.BytesIO(base64.b64decode(pngs[0]))) as out:
        assert np.array_equal(np.asarray(out), np.asarray(source))
    assert info == "<p></p>"
    with pytest.raises(ApiError, match=r"^upscaler_1: no upscaler 'R-ESRGAN 4x\+' here; "
                                       r"one of None, Lanczos, Nearest$"):
        extras.run(ExtrasSingleImage(upscaler_1="R-ESRGAN 4x+"), [(b64(source), "image")])
    batch = ExtrasBatchImages(upscaler_1="Lanczos", imageList=[{"data": b64(source), "name": "a.png"},
                                                               {"data": "aGVsbG8=", "name": "b.png"}])
    with pytest.raises(ApiError) as caught:
        extras.run(batch, [(item.data, f"imageList[{i}].data") for i, item in enumerate(batch.imageList)])
    assert caught.value.message == "imageList[1].data: not a PNG, JPEG or WebP image"
    with pytest.raises(ApiError, match=r"^imageList: 17 images; at most 16 in one request$"):
        extras.run(batch, [(b64(source), "x")] * 17)
    big = ExtrasSingleImage(upscaler_1="Nearest", upscaling_resize=512)  # 8x8 -> 4096x4096 each
    with pytest.raises(ApiError, match=r"^imageList: the results would hold 50331648 pixels; at most 33554432 "):
        extras.run(big, [(b64(source), f"imageList[{i}].data") for i in range(3)])


def test_upscalers_are_listed_with_a1111s_fields():
    assert extras.upscaler_list() == [
        {"name": name, "model_name": None, "model_path": None, "model_url": None, "scale": 4}
        for name in ("None", "Lanczos", "Nearest")]
