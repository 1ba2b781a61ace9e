"""OpenAI's ``POST /v1/images/edits`` through the openai SDK, unmodified, against `python app.py` (tiny-shapes) on
loopback, with its own temp folders: an edit with a mask keeps every pixel outside it exactly and repaints inside;
one without redraws the whole image from it, nearer to it at a low strength than text to image is; bad uploads
are 400s naming the field, after which the server still edits; nothing but the answers' PNGs lands in the temp
folders. One app for the module (the unit tests, tests/serving/apis/test_openai_images_edits.py, cover the fields
one by one)."""

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.helpers import RunningApp

pytestmark = pytest.mark.e2e

PROMPT = "a red circle"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    temp = tmp_path_factory.mktemp("edits")
    (temp / "gradio").mkdir()
    (temp / "tmp").mkdir()
    # its own Gradio temp folder and TMPDIR, which the last test reads: no upload may land in either
    running = RunningApp(env={"GRADIO_TEMP_DIR": str(temp / "gradio"), "TMPDIR": str(temp / "tmp")})
    running.temp = temp
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(app):
    from openai import OpenAI

    return OpenAI(base_url=app.url + "v1", api_key="any")  # the app runs without --api-key


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def split_image(size: int = 64) -> np.ndarray:
    """Blue left half, yellow right half: a picture a red circle is not."""
    pixels = np.zeros((size, size, 3), np.uint8)
    pixels[:, : size // 2] = (30, 60, 200)
    pixels[:, size // 2:] = (230, 210, 40)
    return pixels


def decoded(item) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json))).convert("RGB")).astype(np.int16)


def test_an_edit_with_a_mask_repaints_inside_it_and_keeps_every_pixel_outside(client):
    """images.edit(image, mask with a transparent centre square, n=2, size 64x64): two 64x64 PNGs equal to the
    image outside the square, byte for byte (the overlay), and different inside it (repainted at strength 1)."""
    pixels = split_image()
    alpha = np.full((64, 64), 255, np.uint8)
    alpha[16:48, 16:48] = 0  # fully transparent: edit here
    mask = np.dstack([np.zeros((64, 64, 3), np.uint8), alpha])
    result = client.images.edit(image=("in.png", png(pixels), "image/png"), prompt=PROMPT, n=2, size="64x64",
                                mask=("mask.png", png(mask), "image/png"))
    assert len(result.data) == 2 and result.size == "64x64"
    inside = alpha == 0
    for item in result.data:
        image = decoded(item)
        assert image.shape == (64, 64, 3)
        assert np.array_equal(image[~inside], pixels[~inside])
        assert np.abs(image[inside] - pixels[inside]).mean() > 10
    assert not np.array_equal(decoded(result.data[0]), decoded(result.data[1]))  # two seeds


def test_an_edit_without_a_mask_redraws_the_image_from_it(client):
    """images.edit without a mask is image to image of the whole picture: at strength 0.3 (the strength field,
    sent as the SDK's extra_body) the results are nearer to the image (mean absolute difference) than the
    default strength's (0.75) and than images.generate's pictures for the same prompt, and differ from it.
    (At 0.75 tiny-shapes redraws nearly as much as text to image does: 94 against 89 to 113 measured.) A 96x64
    image is resized to the default size (64x64)."""
    pixels = split_image()

    def distance(result) -> float:
        assert len(result.data) == 2
        return float(np.mean([np.abs(decoded(item) - pixels).mean() for item in result.data]))

    image = ("in.png", png(pixels), "image/png")
    light = distance(client.images.edit(image=image, prompt=PROMPT, n=2, extra_body={"strength": 0.3}))
    default = distance(client.images.edit(image=image, prompt=PROMPT, n=2))
    made = distance(client.images.generate(prompt=PROMPT, size="64x64", n=2))
    assert 2 < light < min(default, made), (light, default, made)
    wide = np.concatenate([split_image(), split_image()[:, :32]], axis=1)  # 96x64
    assert decoded(client.images.edit(image=("w.png", png(wide), "image/png"), prompt=PROMPT).data[0]).shape == \
        (64, 64, 3)


def test_bad_uploads_are_400s_naming_the_field_and_the_server_edits_on_and_keeps_no_upload(app, client):
    """No image, a text file named .png, a truncated PNG, a mask without alpha, a mask of another size (under a
    3 MB image, past Starlette's 1 MB spool): 400s in OpenAI's shape naming image or mask; then an edit works.
    The temp folders hold only the handler's PNGs (answers and step previews), none of the uploaded files."""
    import openai

    good = png(split_image())
    whole = png(np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8))
    assert len(whole) > 3_000_000
    no_alpha = png(np.zeros((64, 64, 3), np.uint8))
    other_size = png(np.zeros((32, 32, 4), np.uint8))
    cases = [
        (dict(image=("t.png", b"this is text, not a PNG", "image/png")), "image", "image: not a PNG, JPEG or WebP"),
        (dict(image=("cut.png", good[: len(good) // 2], "image/png")), "image", "image: a broken or truncated image"),
        (dict(image=("in.png", good, "image/png"), mask=("m.png", no_alpha, "image/png")), "mask",
         "mask: has no alpha channel (mode RGB)"),
        (dict(image=("big.png", whole, "image/png"), mask=("m.png", other_size, "image/png")), "mask",
         "mask: is 32x32 pixels, the image 1024x1024"),
    ]
    for files, param, message in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.images.edit(prompt=PROMPT, **files)
        assert (err.value.status_code, err.value.param, err.value.type) == (400, param, "invalid_request_error")
        assert err.value.body["message"].startswith(message)
    missing = httpx.post(app.url + "v1/images/edits", data={"prompt": PROMPT},
                         files={"other": ("x.txt", b"x", "text/plain")})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "image"
    assert len(client.images.edit(image=("in.png", good, "image/png"), prompt=PROMPT, n=1).data) == 1
    uploads = {good, whole, no_alpha, other_size}
    for root in ("gradio", "tmp"):
        for path in (app.temp / root).rglob("*"):
            if path.is_file():  # the answers (64x64) and the step previews (sdxl-preview-*/stepN.png), nothing else
                assert root == "gradio" and path.suffix == ".png", path
                assert path.read_bytes() not in uploads, path
                assert path.parent.name.startswith("sdxl-preview-") or Image.open(path).size == (64, 64), path
