"""serving/apis/uploads.py: a client's image bounded before it is decoded (base64 text, then bytes, then the
header's size), decoded in memory, oriented and converted; each refusal an ApiError 400 naming the field."""

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.serving import guard
from sdxl_engine.serving.apis import uploads
from sdxl_engine.serving.apis.errors import ApiError
from sdxl_engine.serving.apis.uploads import MAX_IMAGE_BYTES, MAX_INPUT_SIDE, decode_base64, decode_image, open_image


def encoded(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kw)
    return out.getvalue()


def padded(size: int) -> bytes:
    """A valid 6 x 4 PNG (colour (1, 2, 3)) made ``size`` bytes long with zeros after its IEND chunk."""
    whole = encoded(Image.new("RGB", (6, 4), (1, 2, 3)))
    return whole + b"\0" * (size - len(whole))


def header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims ``width`` x ``height`` RGB pixels and whose one IDAT holds almost nothing."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def refused(function, *args, **kw) -> ApiError:
    with pytest.raises(ApiError) as err:
        function(*args, **kw)
    assert err.value.status == 400
    return err.value


def test_the_bounds_are_the_guards_and_fit_its_image_body_cap():
    """One image is at most 16 MiB (the guard's, which Gradio's upload cap uses too) and 2048 pixels a side; an
    image and a mask as base64 (4/3 of their bytes) fit the image routes' 48 MB body cap."""
    assert MAX_IMAGE_BYTES == guard.MAX_IMAGE_BYTES == 16 * 2**20 and MAX_INPUT_SIDE == 2048
    assert uploads.FORMATS == ("PNG", "JPEG", "WEBP")
    assert 2 * (MAX_IMAGE_BYTES * 4 // 3 + 4) < guard.MAX_IMAGE_BODY_BYTES


# --- decode_base64

def test_base64_text_a_data_url_and_line_breaks_decode_to_the_bytes():
    raw = encoded(Image.new("RGB", (3, 2), (9, 8, 7)))
    text = base64.b64encode(raw).decode()
    assert decode_base64(text, "image") == raw
    assert decode_base64(f"  data:image/png;base64,{text}\n", "image") == raw
    assert decode_base64("\n".join(text[i:i + 76] for i in range(0, len(text), 76)), "image") == raw


@pytest.mark.parametrize("data, message", [
    ("https://example.com/a.png", "init_images[0]: a URL; this server never fetches one: send the image itself as "
                                  "base64 (or a data:image/png;base64,... URL)"),
    (" HTTP://example.com/a.png", "init_images[0]: a URL; this server never fetches one"),
    ("file:///etc/passwd", "init_images[0]: a URL; this server never fetches one"),
    ("ftp://example.com/a.png", "init_images[0]: a URL; this server never fetches one"),
    ("not base64!", "init_images[0]: not base64 data"),
    ("QUJ", "init_images[0]: not base64 data"),  # padding missing
    ("", "init_images[0]: no image (empty)"),
    ("data:image/png;base64,", "init_images[0]: no image (empty)"),
    (None, "init_images[0]: no image (empty)"),  # not a string: nothing to decode
    (b"QUJD", "init_images[0]: no image (empty)"),
])
def test_base64_refusals_name_the_field(data, message):
    err = refused(decode_base64, data, "init_images[0]")
    assert err.param == "init_images[0]" and err.message.startswith(message), err.message


def test_base64_text_too_long_for_the_limit_is_refused_before_decoding(monkeypatch):
    """The text's length alone tells the size: past (MAX_IMAGE_BYTES + 2) // 3 * 4 + 4096 characters it is refused
    without decoding (here even text that is not base64); the base64 of exactly MAX_IMAGE_BYTES + 1 bytes is within
    the text bound, so open_image's byte bound refuses it."""
    limit = (MAX_IMAGE_BYTES + 2) // 3 * 4 + 4096
    err = refused(decode_base64, "!" * (limit + 1), "mask")
    assert (err.param, err.message) == ("mask", "mask: the image is over 16 MiB")
    assert refused(decode_base64, "!" * limit, "mask").message == "mask: not base64 data"  # within: decoded
    over = padded(MAX_IMAGE_BYTES + 1)
    assert len(decode_base64(base64.b64encode(over).decode(), "mask")) == MAX_IMAGE_BYTES + 1
    err = refused(decode_image, base64.b64encode(over).decode(), "mask")
    assert (err.param, err.message) == ("mask", "mask: the image is over 16 MiB")


# --- open_image

def test_an_image_of_exactly_the_byte_limit_opens_and_one_byte_more_is_refused():
    image = open_image(padded(MAX_IMAGE_BYTES), "image")
    assert image.size == (6, 4) and image.mode == "RGB" and image.getpixel((5, 3)) == (1, 2, 3)
    err = refused(open_image, padded(MAX_IMAGE_BYTES + 1), "image[1]")
    assert (err.param, err.message) == ("image[1]", "image[1]: the image is over 16 MiB")


def test_each_format_decodes_to_its_pixels_in_the_mode_asked():
    pixels = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3) * 3  # 6 wide, 4 high
    rgb = Image.fromarray(pixels)
    for raw in (encoded(rgb, "PNG"), encoded(rgb, "WEBP", lossless=True)):
        image = open_image(raw, "image")
        assert image.mode == "RGB" and np.array_equal(np.asarray(image), pixels)
    jpeg = open_image(encoded(Image.new("RGB", (6, 4), (200, 40, 40)), "JPEG", quality=95), "image")
    assert jpeg.size == (6, 4) and np.abs(np.asarray(jpeg).astype(int) - [200, 40, 40]).max() <= 4
    grey = open_image(encoded(rgb), "image", "L")
    assert grey.mode == "L" and np.array_equal(np.asarray(grey), np.asarray(rgb.convert("L")))
    rgba = np.dstack([pixels, np.full((4, 6), 77, np.uint8)])
    kept = open_image(encoded(Image.fromarray(rgba, "RGBA")), "mask", None)  # None: the file's own mode
    assert kept.mode == "RGBA" and np.array_equal(np.asarray(kept), rgba)
    assert (np.asarray(open_image(encoded(Image.fromarray(pixels)), "image", "RGBA"))[..., 3] == 255).all()


def test_a_palettes_transparent_colour_becomes_alpha():
    """A "P" image whose palette entry 1 is transparent: as RGBA its alpha is 0 there and its colour the palette's;
    as "L" the grey of the palette colour (ITU-R 601-2 luma); mode None keeps "P"."""
    image = Image.new("P", (6, 4), 0)
    image.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    image.paste(1, (0, 0, 2, 4))
    image.info["transparency"] = 1
    raw = encoded(image)
    rgba = np.asarray(open_image(raw, "mask", "RGBA"))
    assert rgba[:, :2, 3].tolist() == [[0, 0]] * 4 and (rgba[:, 2:, 3] == 255).all()
    assert rgba[0, 3, :3].tolist() == [10, 20, 30]
    grey = np.asarray(open_image(raw, "mask", "L"))
    assert grey[0, 0] == round(0.299 * 200 + 0.587 * 100 + 0.114 * 50)  # the transparent entry's colour
    assert grey[0, 5] == round(0.299 * 10 + 0.587 * 20 + 0.114 * 30)
    assert open_image(raw, "mask", None).mode == "P"


def test_the_exif_orientation_is_applied():
    """A 40 x 20 picture, red in its left 5 columns, tagged "rotate 90 degrees clockwise to view" (orientation 6):
    decoded 20 x 40 with the red along the top, as a viewer shows it."""
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :5] = (255, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 6
    image = open_image(encoded(Image.fromarray(pixels), "PNG", exif=exif.tobytes()), "image")
    assert image.size == (20, 40)
    out = np.asarray(image)
    assert (out[:5] == (255, 0, 0)).all() and (out[5:] == 0).all()


def test_a_side_over_the_limit_is_refused_from_the_header():
    assert open_image(encoded(Image.new("L", (MAX_INPUT_SIDE, 3))), "image").size == (2048, 3)
    for width, height in ((MAX_INPUT_SIDE + 1, 3), (3, MAX_INPUT_SIDE + 1)):
        err = refused(open_image, encoded(Image.new("L", (width, height))), "image")
        assert err.message == f"image: the image is {width}x{height} pixels; at most 2048x2048 here"
    err = refused(open_image, header_only(8000, 6000), "mask")  # 200 bytes claiming 144 MB of pixels
    assert (err.param, err.message) == ("mask", "mask: the image is 8000x6000 pixels; at most 2048x2048 here")
    err = refused(open_image, header_only(100_000, 90_000), "mask")  # past Pillow's own bomb check too
    assert err.message == "mask: the image claims too many pixels; at most 2048x2048 here"


def test_empty_other_formats_and_broken_data_are_refused_naming_the_field():
    assert refused(open_image, b"", "image").message == "image: no image (empty)"
    assert refused(open_image, b"plain text, named a.png", "image").message == "image: not a PNG, JPEG or WebP image"
    gif = encoded(Image.new("RGB", (4, 4)), "GIF")
    assert refused(open_image, gif, "image").message == "image: not a PNG, JPEG or WebP image"
    png = encoded(Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)))
    err = refused(open_image, png[: len(png) // 2], "init_images[0]")
    assert err.param == "init_images[0]" and err.message.startswith("init_images[0]: a broken or truncated image (")


# --- decode_image

def test_decode_image_is_base64_then_open_image():
    pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 10
    text = "data:image/png;base64," + base64.b64encode(encoded(Image.fromarray(pixels))).decode()
    image = decode_image(text, "image")
    assert image.size == (3, 2) and np.array_equal(np.asarray(image), pixels)
    assert decode_image(text, "image", "L").mode == "L"
    assert refused(decode_image, "https://a.example/b.png", "mask").param == "mask"
    err = refused(decode_image, base64.b64encode(b"GIF89a not really").decode(), "mask")
    assert (err.param, err.message) == ("mask", "mask: not a PNG, JPEG or WebP image")
