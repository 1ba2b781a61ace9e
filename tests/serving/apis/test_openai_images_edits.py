"""OpenAI's ``POST /v1/images/edits`` without an engine (serving/apis/openai_images.py): the multipart form read in
memory, its fields mapped to the /generate call (generations' checks), the image resized to the request's size,
OpenAI's mask (alpha 0 = edit) turned into the engine's (255 = repaint) with the overlay that keeps every other
pixel, the defaults (strength 1.0 with a mask, validation.DEFAULT_STRENGTH without), the refusals in OpenAI's
shape naming the field. The route is driven over HTTP (FastAPI's TestClient, the openai SDK over it) with a
stand-in for core.generate that records the call it gets. tests/serving/apis/test_openai_images_edits_app.py runs it
on the app."""

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from sdxl_engine.engine.validation import DEFAULT_STRENGTH, Limits
from sdxl_engine.serving.apis.core import ApiError, request_of
from sdxl_engine.serving.apis.openai_images import (
    FIELD_NAMES,
    MASK_STRENGTH,
    EditUpload,
    edit_call,
    edit_mask,
    read_form,
)
from tests.helpers import extra_fields

LIMITS = Limits(max_seed=2**32 - 1, max_steps=50, sizes=((64, 64), (80, 48)), default_size=(64, 64),
                default_steps=8, default_guidance=5.0, multiple=16, default_sampler="Euler", max_pixels=128 * 128)


def png(image: Image.Image, text: str | None = None) -> bytes:
    info = None
    if text is not None:
        info = PngImagePlugin.PngInfo()
        info.add_text("parameters", text)
    out = io.BytesIO()
    image.save(out, "PNG", pnginfo=info)
    return out.getvalue()


def noise(width: int, height: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def hole_mask(width: int, height: int, box: tuple[int, int, int, int]) -> Image.Image:
    """An OpenAI mask: opaque black, fully transparent (alpha 0) inside ``box`` (left, top, right, bottom)."""
    alpha = np.full((height, width), 255, np.uint8)
    left, top, right, bottom = box
    alpha[top:bottom, left:right] = 0
    return Image.fromarray(np.dstack([np.zeros((height, width, 3), np.uint8), alpha]), "RGBA")


# --- edit_call / edit_mask: the image and mask as the engine gets them

def test_an_image_of_the_requests_size_reaches_the_engine_unchanged_for_img2img_at_the_default_strength():
    pixels = noise(64, 64)
    call = edit_call(request_of(FIELD_NAMES, prompt="x"), EditUpload(png(Image.fromarray(pixels))), LIMITS)
    assert (call.engine.width, call.engine.height) == (64, 64)  # the engine's default size (size left out)
    assert set(extra_fields(call)) == {"image", "strength"} and call.paste_back is None
    assert extra_fields(call)["strength"] == DEFAULT_STRENGTH == 0.75
    assert extra_fields(call)["image"].dtype == np.uint8 and np.array_equal(extra_fields(call)["image"], pixels)


def test_the_image_is_resized_with_lanczos_to_the_requested_size_and_strength_is_the_forms():
    pixels = noise(100, 60)
    call = edit_call(request_of(FIELD_NAMES, prompt="x", width=80, height=48),
                     EditUpload(png(Image.fromarray(pixels)), strength=0.3), LIMITS)
    expected = np.asarray(Image.fromarray(pixels).resize((80, 48), Image.Resampling.LANCZOS))
    assert extra_fields(call)["image"].shape == (48, 80, 3)
    assert np.array_equal(extra_fields(call)["image"], expected)
    assert not np.array_equal(expected, np.asarray(Image.fromarray(pixels).resize((80, 48), Image.Resampling.BILINEAR)))
    assert extra_fields(call)["strength"] == 0.3


def test_a_mask_marks_its_transparent_pixels_for_repainting_and_the_overlay_keeps_the_others():
    pixels = noise(64, 64)
    mask = hole_mask(64, 64, (16, 8, 40, 32))
    call = edit_call(request_of(FIELD_NAMES, prompt="x"), EditUpload(png(Image.fromarray(pixels)), png(mask)),
                     LIMITS)
    fields = extra_fields(call)
    expected = np.zeros((64, 64), np.uint8)
    expected[8:32, 16:40] = 255
    assert fields["mask"].dtype == np.uint8 and np.array_equal(fields["mask"], expected)
    assert fields["strength"] == MASK_STRENGTH == 1.0
    results = noise(64, 64, 7)[None].repeat(2, axis=0)  # what the engine made, for two images
    finished = call.paste_back.apply(results)
    edited = expected == 255  # where edited: the result; elsewhere: the image
    assert np.array_equal(finished[:, edited], results[:, edited])
    assert np.array_equal(finished[:, ~edited], np.broadcast_to(pixels[~edited], finished[:, ~edited].shape))


def test_a_mask_is_resized_with_the_image_and_binarized():
    """A 160x96 image's mask, transparent in its left half, for an edit at 80x48: the repaint area is the left half
    at the new size, only 0 and 255."""
    mask = hole_mask(160, 96, (0, 0, 80, 96))
    repaint = edit_mask(mask, (160, 96), (80, 48))
    assert repaint.shape == (48, 80) and set(np.unique(repaint)) == {0, 255}
    assert (repaint[:, :40] == 255).all() and (repaint[:, 40:] == 0).all()


def test_a_palette_mask_with_a_transparent_colour_counts_as_alpha():
    mask = Image.new("P", (32, 32), 0)
    mask.putpalette([0, 0, 0, 255, 255, 255] + [0] * 762)
    mask.paste(1, (0, 0, 8, 8))
    mask.info["transparency"] = 1  # palette entry 1 is fully transparent
    decoded = Image.open(io.BytesIO(png(mask)))
    repaint = edit_mask(decoded, (32, 32), (32, 32))
    assert repaint[:8, :8].min() == 255 and repaint.sum() == 64 * 255


@pytest.mark.parametrize("mask, message", [
    (Image.new("RGB", (64, 64), "white"), "mask: has no alpha channel (mode RGB): send a PNG with transparency"),
    (hole_mask(32, 32, (0, 0, 8, 8)), "mask: is 32x32 pixels, the image 64x64: send a mask of the image's size"),
    (hole_mask(64, 64, (0, 0, 0, 0)), "mask: no fully transparent pixel (alpha 0), so nothing to edit"),
])
def test_mask_refusals_name_the_mask(mask, message):
    with pytest.raises(ApiError) as err:
        edit_call(request_of(FIELD_NAMES, prompt="x"),
                  EditUpload(png(Image.fromarray(noise(64, 64))), png(mask)), LIMITS)
    assert (err.value.status, err.value.param) == (400, "mask") and err.value.message.startswith(message)


def test_a_size_the_engine_does_not_make_is_refused_naming_size_before_any_decoding():
    with pytest.raises(ApiError) as err:  # the image is not even an image: the size is checked first
        edit_call(request_of(FIELD_NAMES, prompt="x", width=72, height=64), EditUpload(b"not an image"), LIMITS)
    assert err.value.param == "size" and err.value.message.startswith("size: 72 is not a multiple of 16 pixels")


# --- The route over HTTP, with a stand-in for core.generate

@pytest.fixture
def served(monkeypatch, tmp_path, runtime_log):
    """(TestClient of the mounted APIs, the calls core.generate got, the lines logged): red PNGs of the call's size."""
    from tests.helpers import mounted_apis

    return mounted_apis(monkeypatch, tmp_path, LIMITS, lambda call, seeds: [
        png(Image.new("RGB", (call.engine.width, call.engine.height), "red"),
            f"{call.prompt}\nSeed: {s}") for s in seeds],
        lambda call, seeds: {"width": call.engine.width, "height": call.engine.height, "seeds": seeds}, runtime_log)


def test_the_openai_sdk_edits_with_a_mask_and_every_generations_field(served):
    """openai's images.edit (multipart, as the SDK sends it): n, size, model alias, output_format, the mask; the
    call carries them in /generate's terms, the answer is the generations route's."""
    from openai import OpenAI

    client, calls, lines = served
    sdk = OpenAI(base_url="http://testserver/v1", api_key="any", http_client=client)
    pixels = noise(100, 60)
    result = sdk.images.edit(image=("in.png", png(Image.fromarray(pixels)), "image/png"), prompt="a red circle",
                             mask=("mask.png", png(hole_mask(100, 60, (0, 0, 50, 60))), "image/png"), n=2,
                             size="80x48", model="gpt-image-1", output_format="webp", output_compression=80,
                             user="u")
    (call,) = calls
    assert (call.prompt, call.images, call.engine.width, call.engine.height) == ("a red circle", 2, 80, 48)
    assert np.array_equal(extra_fields(call)["image"],
                          np.asarray(Image.fromarray(pixels).resize((80, 48), Image.Resampling.LANCZOS)))
    assert (extra_fields(call)["mask"][:, :40] == 255).all() and (extra_fields(call)["mask"][:, 40:] == 0).all()
    assert extra_fields(call)["strength"] == 1.0
    assert result.output_format == "webp" and len(result.data) == 2
    assert Image.open(io.BytesIO(base64.b64decode(result.data[1].b64_json))).format == "WEBP"
    assert lines == []  # nothing ignored


def test_several_images_edit_the_first_and_say_so_and_strength_overrides(served):
    client, calls, lines = served
    first, second = png(Image.fromarray(noise(64, 64, 1))), png(Image.fromarray(noise(64, 64, 2)))
    answer = client.post("/v1/images/edits", data={"prompt": "x", "strength": "0.4", "quality": "high"},
                         files=[("image[]", ("a.png", first, "image/png")),
                                ("image[]", ("b.png", second, "image/png"))])
    assert answer.status_code == 200, answer.text
    assert np.array_equal(extra_fields(calls[0])["image"], noise(64, 64, 1))
    assert extra_fields(calls[0])["strength"] == 0.4 and calls[0].paste_back is None
    warnings = ('image[]: 2 images sent, the first one edited: this server edits one image per request; '
                'quality="high" ignored: no refiner is loaded here to refine with (the server runs one with --refiner)')
    assert answer.headers["x-sdxl-warnings"] == warnings
    assert lines == [f"[app] OpenAI images: 2 field(s) not honoured: {warnings}"]


def test_the_edit_stream_is_image_edit_events_through_the_sdk(served):
    from openai import OpenAI

    client, _, _ = served
    sdk = OpenAI(base_url="http://testserver/v1", api_key="any", http_client=client)
    events = list(sdk.images.edit(image=("in.png", png(Image.fromarray(noise(64, 64))), "image/png"), prompt="x",
                                  n=2, stream=True))
    assert [(type(e).__name__, e.type, e.size) for e in events] == [
        ("ImageEditCompletedEvent", "image_edit.completed", "64x64")] * 2


def test_strength_reaches_the_engine_from_the_sdks_extra_body(served):
    """The README's way to set strength with the SDK: extra_body travels as a form field."""
    from openai import OpenAI

    client, calls, _ = served
    sdk = OpenAI(base_url="http://testserver/v1", api_key="any", http_client=client)
    sdk.images.edit(image=("in.png", png(Image.fromarray(noise(64, 64))), "image/png"), prompt="x",
                    mask=("m.png", png(hole_mask(64, 64, (0, 0, 8, 8))), "image/png"), extra_body={"strength": 0.5})
    assert extra_fields(calls[0])["strength"] == 0.5


def _broken_png() -> bytes:
    whole = png(Image.fromarray(noise(64, 64)))
    return whole[: len(whole) // 2]


@pytest.mark.parametrize("files, data, param, message", [
    ([], {"prompt": "x"}, "image", "image: is required"),
    ([("image", ("a.png", b"just some text", "image/png"))], {"prompt": "x"}, "image",
     "image: not a PNG, JPEG or WebP image"),
    ([("image", ("a.png", _broken_png(), "image/png"))], {"prompt": "x"}, "image",
     "image: a broken or truncated image"),
    ([("image", ("a.png", png(Image.fromarray(noise(64, 64))), "image/png")),
      ("mask", ("m.png", png(Image.new("L", (64, 64), 0)), "image/png"))], {"prompt": "x"}, "mask",
     "mask: has no alpha channel (mode L)"),
    ([("image", ("a.png", png(Image.fromarray(noise(64, 64))), "image/png")),
      ("mask", ("m.png", png(hole_mask(64, 48, (0, 0, 4, 4))), "image/png"))], {"prompt": "x"}, "mask",
     "mask: is 64x48 pixels, the image 64x64"),
    ([("image", ("a.png", png(Image.fromarray(noise(64, 64))), "image/png"))], {}, "prompt", "prompt: is required"),
    ([("image", ("a.png", png(Image.fromarray(noise(64, 64))), "image/png"))], {"prompt": "x", "n": "two"}, "n",
     "n: expected a whole number, got \"two\""),
    ([("image", ("a.png", png(Image.fromarray(noise(64, 64))), "image/png"))], {"prompt": "x", "strength": "lots"},
     "strength", "strength: expected a number in (0, 1], got \"lots\""),
    ([("image", ("a.png", png(Image.fromarray(noise(64, 64))), "image/png"))], {"prompt": "x", "size": "big"},
     "size", "size: expected \"WIDTHxHEIGHT\""),
    ([("image", ("a.png", png(Image.fromarray(noise(64, 64))), "image/png")),
      ("prompt", ("p.txt", b"x", "text/plain"))], {}, "prompt", "prompt: expected text, got a file"),
])
def test_refusals_are_400s_in_openais_shape_naming_the_field(served, files, data, param, message):
    client, calls, _ = served
    answer = client.post("/v1/images/edits", data=data, files=files or {"unused": ("u.txt", b"", "text/plain")})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error") and error["message"].startswith(message)
    assert calls == []


def test_an_image_sent_as_text_and_a_body_that_is_not_a_form_are_400s(served):
    client, calls, _ = served
    as_text = client.post("/v1/images/edits", data={"prompt": "x", "image": "aGVsbG8="},
                          files={"unused": ("u.txt", b"", "text/plain")})
    assert as_text.status_code == 400 and as_text.json()["error"]["param"] == "image"
    assert as_text.json()["error"]["message"].startswith("image: expected an image file (a form part with a filename)")
    json_body = client.post("/v1/images/edits", json={"prompt": "x", "image": "aGVsbG8="})
    assert json_body.status_code == 400 and json_body.json()["error"]["message"] == (
        "the request body must be multipart/form-data (an image file and text fields, as openai's images.edit "
        'sends them), got "application/json"')
    too_many = client.post("/v1/images/edits", data={"prompt": "x"},
                           files=[("image[]", (f"{i}.png", b"x", "image/png")) for i in range(5)])
    assert too_many.status_code == 400 and "Too many files" in too_many.json()["error"]["message"]
    assert calls == []


def test_a_model_not_served_is_a_404_before_any_image_is_decoded(served):
    client, _, _ = served
    answer = client.post("/v1/images/edits", data={"prompt": "x", "model": "sdxl-turbo"},
                         files={"image": ("a.png", b"not even an image", "image/png")})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"


def test_file_parts_stay_in_memory_however_large():
    """A 3 MB file part: Starlette's own parser (spool 1 MB) moves it to a file on disk; read_form keeps it in
    memory (SpooledTemporaryFile never rolled over), whole."""
    from starlette.formparsers import MultiPartParser
    from starlette.requests import Request

    payload = bytes(np.random.default_rng(0).integers(0, 256, 3_000_000, dtype=np.uint8))
    boundary = "b0undary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nx\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode() + payload + f"\r\n--{boundary}--\r\n".encode()
    headers = [(b"content-type", f"multipart/form-data; boundary={boundary}".encode()),
               (b"content-length", str(len(body)).encode())]

    def request() -> Request:
        chunks = [body[i:i + 65536] for i in range(0, len(body), 65536)]

        async def receive():
            return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}

        return Request({"type": "http", "method": "POST", "path": "/v1/images/edits", "headers": headers}, receive)

    async def parse():
        form = await read_form(request())
        starlette_request = request()
        plain = await MultiPartParser(starlette_request.headers, starlette_request.stream()).parse()
        return form, plain

    form, plain = asyncio.run(parse())
    assert plain["image"].file._rolled  # what Starlette alone does: to disk
    upload = form["image"]
    assert not upload.file._rolled and form["prompt"] == "x"
    assert upload.file.read() == payload


def test_the_engines_refiner_and_hires_fields_ride_in_extra_body(served):
    """Not OpenAI's fields, the engine's own (the SDK's extra_body): generations take refiner_switch_at (which
    wins over quality hd's 0.8) and the hires fix fields as the engine names them; an edit takes
    refiner_switch_at as a number, and refuses a hires field naming it."""
    from openai import BadRequestError, OpenAI

    client, calls, _ = served
    sdk = OpenAI(base_url="http://testserver/v1", api_key="any", http_client=client, max_retries=0)
    sdk.images.generate(prompt="x", size="64x64", quality="hd", extra_body={"refiner_switch_at": 0.6})
    sdk.images.generate(prompt="x", size="64x64", extra_body={"hires_scale": 1.5, "hires_upscaler": "Lanczos",
                                                "hires_strength": 0.4, "hires_steps": 6})
    assert extra_fields(calls[0]) == {"refiner_switch_at": 0.6}
    assert extra_fields(calls[1]) == {"hires_scale": 1.5, "hires_upscaler": "Lanczos", "hires_strength": 0.4,
                                     "hires_steps": 6}
    image = ("in.png", png(Image.fromarray(noise(64, 64))), "image/png")
    sdk.images.edit(image=image, prompt="x", extra_body={"refiner_switch_at": "0.5"})
    assert extra_fields(calls[2])["refiner_switch_at"] == 0.5 and extra_fields(calls[2])["strength"] == 0.75
    for extra, message in (({"hires_scale": "1.5"}, "hires_scale: the hires fix applies to generations"),
                           ({"refiner_switch_at": "late"}, "refiner_switch_at: expected a number in [0, 1)")):
        with pytest.raises(BadRequestError) as err:
            sdk.images.edit(image=image, prompt="x", extra_body=extra)
        assert err.value.body["message"].startswith(message)
    assert len(calls) == 3


def test_only_fully_transparent_pixels_are_edited_a_partly_transparent_one_is_kept():
    """OpenAI's rule: the mask's fully transparent pixels (alpha 0) are edited; every other alpha, 1 and 254
    included, keeps the image's pixel (and the overlay puts it back). A non-square 48 x 32 mask at its own size."""
    alpha = np.full((32, 48), 255, np.uint8)
    alpha[4:12, 30:44] = 0  # the edit area: rows 4-11, columns 30-43
    alpha[20, :6] = [1, 2, 127, 128, 253, 254]  # partly transparent: kept
    alpha[25:28, 2:40] = 1
    mask = Image.fromarray(np.dstack([np.zeros((32, 48, 3), np.uint8), alpha]), "RGBA")
    expected = np.zeros((32, 48), np.uint8)
    expected[4:12, 30:44] = 255
    assert np.array_equal(edit_mask(mask, (48, 32), (48, 32)), expected)
    limits = Limits(max_seed=2**32 - 1, max_steps=50, sizes=((48, 32),), default_size=(48, 32), default_steps=8,
                    default_guidance=5.0, multiple=16)
    pixels = noise(48, 32)
    call = edit_call(request_of(FIELD_NAMES, prompt="x"), EditUpload(png(Image.fromarray(pixels)), png(mask)),
                     limits)
    assert np.array_equal(extra_fields(call)["mask"], expected)
    finished = call.paste_back.apply(np.full((1, 32, 48, 3), 7, np.uint8))[0]
    assert np.array_equal(finished[20, :6], pixels[20, :6]) and np.array_equal(finished[26], pixels[26])
    assert (finished[4:12, 30:44] == 7).all()


def padded_png(size: int, width: int = 64, height: int = 48) -> bytes:
    """A valid grey PNG of ``width`` x ``height``, ``size`` bytes long (zeros after IEND, which decoders skip)."""
    whole = png(Image.new("RGB", (width, height), (90, 90, 90)))
    return whole + b"\0" * (size - len(whole))


def test_an_image_or_mask_over_the_per_image_limit_under_the_body_cap_is_refused_naming_it(served):
    """A file part of MAX_IMAGE_BYTES + 1 bytes (a valid PNG, padded): well under the edits route's body cap
    (guard.MAX_IMAGE_BODY_BYTES, 48 MB), refused by the per-image bound before it is decoded, naming the field; the
    same PNG one byte shorter is an edit."""
    from sdxl_engine.serving.guard import MAX_IMAGE_BODY_BYTES, MAX_IMAGE_BYTES

    client, calls, _ = served
    over = padded_png(MAX_IMAGE_BYTES + 1, 64, 64)
    assert 2 * len(over) + 100_000 < MAX_IMAGE_BODY_BYTES  # an image and a mask of this size pass the body cap
    answer = client.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", over, "image/png")})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["message"]) == ("image", "image: the image is over 16 MiB") and calls == []
    mask = png(hole_mask(64, 64, (0, 0, 8, 8)))
    answer = client.post("/v1/images/edits", data={"prompt": "x"}, files={
        "image": ("a.png", png(Image.fromarray(noise(64, 64))), "image/png"),
        "mask": ("m.png", mask + b"\0" * (MAX_IMAGE_BYTES + 1 - len(mask)), "image/png")})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["message"]) == ("mask", "mask: the image is over 16 MiB") and calls == []
    fine = client.post("/v1/images/edits", data={"prompt": "x"},
                       files={"image": ("a.png", over[:MAX_IMAGE_BYTES], "image/png")})
    assert fine.status_code == 200, fine.text
    assert len(calls) == 1 and (extra_fields(calls[0])["image"] == 90).all()
