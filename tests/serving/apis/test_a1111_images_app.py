"""AUTOMATIC1111's image routes through webuiapi against `python app.py`: img2img (with and without a mask, "only
masked"), txt2img's hires fix, the refiner fields, and the uploads' refusals. On the session's app (tests/conftest.py's
``app_server``: the default ``python app.py``) instead of one of the module's own: these tests change nothing another
file on that app sees (no setting, model or history; the sizes they compile, 64x64 and 128x128, are not a size any
test on it expects uncompiled), and they read their own log lines from where they began. The API key the module's
app had is tests/serving/apis/test_apis_app.py's to check.

An img2img answer must be the engine's own images for the same request (the init image and mask prepared as
A1111 does: a1111_images.prepare, A1111's step rule) under A1111's overlay: the session's tiny-shapes engine makes
the reference in this process (the compile cache is shared with the app)."""

import base64
import io
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from sdxl_engine.engine.validation import GenerateRequest
from sdxl_engine.service import image_prep as a1111_images
from tests.helpers import RunningApp

pytestmark = pytest.mark.e2e

PROMPT = "a red circle"
SIZE = dict(width=64, height=64)


@pytest.fixture(scope="module")
def app(app_server):
    return app_server


@pytest.fixture(scope="module")
def webui(app):
    import webuiapi

    return webuiapi.WebUIApi(host="127.0.0.1", port=app.port)


def init_image(size=(64, 64)) -> Image.Image:
    """A blue picture with a yellow square: what the requests start from."""
    image = Image.new("RGB", size, (30, 60, 200))
    ImageDraw.Draw(image).rectangle((size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2), fill=(230, 210, 40))
    return image


def mask_image(size=(64, 64), box=(36, 8, 60, 40)) -> Image.Image:
    """White (repaint) in ``box``, black elsewhere."""
    mask = Image.new("L", size, 0)
    ImageDraw.Draw(mask).rectangle(box, fill=255)
    return mask


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def engine_images(engine, prepared, steps, strength, seed=11) -> np.ndarray:
    """The session engine's images for the prepared request, finished as the server finishes them."""
    request = GenerateRequest(prompt=PROMPT, seed=seed, guidance_scale=5.0, num_inference_steps=steps, width=64,
                              height=64, sampler="Euler", image=prepared.image, mask=prepared.mask,
                              strength=strength, start_step=a1111_images.img2img_start_step(strength, steps))
    images = engine.generate(request).images
    return prepared.finish.apply(images) if prepared.finish is not None else images


def temp_files() -> set[str]:
    root = Path(os.environ["GRADIO_TEMP_DIR"])
    return {str(p) for p in root.rglob("*") if p.is_file()}


def test_img2img_with_a_mask_is_the_engines_inpainting_under_a1111s_overlay(webui, tiny_shapes_engine):
    """webuiapi's img2img with a mask (whole picture, blur 4, original content): 4 images equal to the engine's
    for the same prepared request (8 steps at 0.75: A1111 starts at step 1 and runs 7); outside the blurred mask
    the original's pixels exactly; inside, new ones; the infotext carries Denoising strength and Mask blur."""
    init, mask = init_image(), mask_image()
    result = webui.img2img(images=[init], mask_image=mask, prompt=PROMPT, seed=11, steps=8, cfg_scale=5.0,
                           sampler_name="Euler", denoising_strength=0.75, inpaint_full_res=False, mask_blur=4,
                           inpainting_fill=1, batch_size=4, **SIZE)
    got = np.stack([pixels(i) for i in result.images])
    prepared = a1111_images.prepare(init, mask, 64, 64, mask_blur_x=4, mask_blur_y=4, fill_mode=1)
    assert np.array_equal(got, engine_images(tiny_shapes_engine, prepared, 8, 0.75))
    keep = np.asarray(prepared.mask) == 0
    assert np.array_equal(got[:, keep], np.broadcast_to(pixels(init)[keep], got[:, keep].shape))
    repaint = np.asarray(mask) == 255
    assert np.abs(got[:, repaint].astype(int) - pixels(init)[repaint]).mean() > 10
    assert result.info["all_seeds"] == [11, 12, 13, 14] and result.info["denoising_strength"] == 0.75
    assert "Denoising strength: 0.75" in result.info["infotexts"][0] and "Mask blur: 4" in result.info["infotexts"][0]
    assert result.parameters["init_images"] is None  # include_init_images false: not echoed


def test_img2img_strength_sets_how_close_the_images_stay_and_each_seed_repeats(webui):
    """No mask: denoising_strength 0.3 stays closer to the init image than 0.9 (same seed); a request made twice
    gives the same bytes; a JPEG data URL of another size is resized to width x height (resize_mode 0)."""
    init = init_image((96, 80))
    buffer = io.BytesIO()
    init.save(buffer, format="JPEG", quality=95)
    url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
    target = pixels(init.convert("RGB").resize((64, 64), Image.Resampling.LANCZOS)).astype(int)

    def run(strength):
        answer = webui.session.post(f"{webui.baseurl}/img2img", json={
            "init_images": [url], "prompt": PROMPT, "seed": 5, "steps": 6, "cfg_scale": 5.0, "sampler_name": "Euler",
            "denoising_strength": strength, "batch_size": 4, **SIZE}).json()
        return [base64.b64decode(image) for image in answer["images"]]

    low, high, again = run(0.3), run(0.9), run(0.3)
    assert low == again and len(low) == 4
    distance = [np.abs(pixels(Image.open(io.BytesIO(png))).astype(int) - target).mean()
                for png in (low[0], high[0])]
    assert Image.open(io.BytesIO(low[0])).size == (64, 64)
    assert distance[0] < distance[1], distance


def test_only_masked_inpainting_pastes_back_into_the_originals_size(webui, tiny_shapes_engine):
    """inpaint_full_res (webuiapi's default): the box around the mask, grown by the padding to the request's aspect
    ratio, is made at 64 x 64 and pasted back: the answer has the init image's size (128 x 96), equals the engine's
    images for the cropped request, and is the original to the pixel outside the box."""
    init, mask = init_image((128, 96)), mask_image((128, 96), box=(70, 20, 100, 50))
    result = webui.img2img(images=[init], mask_image=mask, prompt=PROMPT, seed=11, steps=8, cfg_scale=5.0,
                           sampler_name="Euler", denoising_strength=0.75, inpaint_full_res=True,
                           inpaint_full_res_padding=4, mask_blur=2, batch_size=4, **SIZE)
    got = np.stack([pixels(i) for i in result.images])
    assert got.shape == (4, 96, 128, 3)
    prepared = a1111_images.prepare(init, mask, 64, 64, mask_blur_x=2, mask_blur_y=2, fill_mode=0, full_res=True,
                                    padding=4)
    assert np.array_equal(got, engine_images(tiny_shapes_engine, prepared, 8, 0.75))
    outside = np.ones((96, 128), bool)
    outside[20 - 8:50 + 9, 70 - 8:100 + 9] = False  # the box: the mask, its blur and padding
    assert np.array_equal(got[:, outside], np.broadcast_to(pixels(init)[outside], got[:, outside].shape))
    assert "Inpaint area: Only masked" in result.info["infotexts"][0]


def test_txt2img_hires_fix_gives_the_final_size_and_repeats_per_seed(webui):
    """SillyTavern's fields (enable_hr, hr_scale, hr_upscaler, denoising_strength, hr_second_pass_steps): the
    images are 2x the size, the same per seed, unlike a plain txt2img at that size; /latent-upscale-modes lists
    each upscaler the engine has, and each listed one runs; another upscaler is a 422 naming hr_upscaler."""
    modes = [m["name"] for m in webui.session.get(f"{webui.baseurl}/latent-upscale-modes").json()]
    assert modes[0] == "Latent" and "Latent (nearest-exact)" in modes
    fields = dict(prompt=PROMPT, seed=9, steps=4, cfg_scale=5.0, sampler_name="Euler", enable_hr=True, hr_scale=2,
                  denoising_strength=0.6, hr_second_pass_steps=3, **SIZE)
    first = webui.txt2img(hr_upscaler="Latent", **fields)
    again = webui.txt2img(hr_upscaler="Latent", **fields)
    plain = webui.txt2img(prompt=PROMPT, seed=9, steps=4, cfg_scale=5.0, sampler_name="Euler", width=128, height=128)
    assert first.image.size == (128, 128) and pixels(first.image).tolist() == pixels(again.image).tolist()
    assert not np.array_equal(pixels(first.image), pixels(plain.image))
    text = first.info["infotexts"][0]
    assert "Hires upscale: 2" in text and "Hires steps: 3" in text and "Denoising strength: 0.6" in text
    assert "Size: 64x64" in text  # A1111 records the first pass's size
    upscalers = [u["name"] for u in webui.session.get(f"{webui.baseurl}/upscalers").json()]
    assert upscalers == ["None", "Lanczos", "Nearest"]  # the decoded images resized, as A1111's built-in ones
    for mode in modes[1:] + upscalers:  # one step a pass: the sizes are the point here
        assert webui.txt2img(hr_upscaler=mode, **{**fields, "steps": 1, "hr_second_pass_steps": 1}).image.size == (
            128, 128), mode
    resized = webui.txt2img(hr_upscaler="Latent", **{**fields, "hr_resize_x": 128, "steps": 1,
                                                      "hr_second_pass_steps": 1})
    text = resized.info["infotexts"][0]  # A1111 records the size asked instead of the factor
    assert resized.image.size == (128, 128) and "Hires resize: 128x0" in text and "Hires upscale:" not in text
    bad = webui.session.post(f"{webui.baseurl}/txt2img", json={**fields, "hr_upscaler": "ESRGAN_4x"})
    assert bad.status_code == 422 and bad.json()["detail"].startswith("hr_upscaler: ")


def test_txt2img_hires_fix_second_pass_prompt_and_sampler(webui):
    """hr_prompt and hr_sampler_name run the second pass with them (SillyTavern leaves them empty: the first
    pass's); the infotext says so under A1111's keys; the same values as the first pass's change nothing."""
    fields = dict(prompt=PROMPT, seed=9, steps=4, cfg_scale=5.0, sampler_name="Euler", enable_hr=True, hr_scale=2,
                  denoising_strength=0.6, hr_upscaler="Lanczos", **SIZE)
    plain = webui.txt2img(**fields)
    same = webui.txt2img(hr_prompt=PROMPT, hr_sampler_name="Euler", **fields)
    other = webui.txt2img(hr_prompt="a blue square, flat", hr_sampler_name="DPM++ 2M", hr_scheduler="Karras",
                          **fields)
    assert pixels(same.image).tolist() == pixels(plain.image).tolist()
    assert np.abs(pixels(other.image).astype(int) - pixels(plain.image)).mean() > 0.5
    text = other.info["infotexts"][0]
    assert 'Hires prompt: "a blue square, flat"' in text and "Hires sampler: DPM++ 2M Karras" in text
    assert "Hires prompt" not in same.info["infotexts"][0]


def test_refiner_fields_name_what_is_loaded(webui):
    """No refiner loaded: refiner_checkpoint is A1111's 422 saying so; "None" asks for none; /sd-models lists the
    model alone."""
    answer = webui.session.post(f"{webui.baseurl}/txt2img", json={
        "prompt": PROMPT, "steps": 2, "refiner_checkpoint": "sd_xl_refiner_1.0.safetensors", **SIZE})
    assert answer.status_code == 422 and answer.json()["detail"].startswith(
        "refiner_checkpoint: no refiner is loaded here (the server starts one with --refiner)")
    assert webui.session.post(f"{webui.baseurl}/txt2img", json={
        "prompt": PROMPT, "steps": 2, "refiner_checkpoint": "None", **SIZE}).status_code == 200
    assert [m["model_name"] for m in webui.session.get(f"{webui.baseurl}/sd-models").json()] == ["tiny-shapes"]


def test_bad_uploads_are_refused_naming_the_field_and_nothing_is_written(app, webui):
    """A decompression bomb, a 20 MB PNG, a truncated JPEG, a text file as an image, a mask of another aspect
    ratio, no image: each A1111's 422 naming the field, one log line, no file written; then a good request works.
    The body cap is 48 MB on img2img (a 2 MB body passes) and stays 1 MB on txt2img."""
    before = temp_files()
    bomb = io.BytesIO()
    Image.new("1", (30000, 30000)).save(bomb, format="PNG")
    noise = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (2600, 2600, 3), np.uint8)).save(
        noise, format="PNG", compress_level=0)
    assert noise.tell() > 20_000_000
    jpeg = io.BytesIO()
    init_image().save(jpeg, format="JPEG")
    good = base64.b64encode(jpeg.getvalue()).decode()
    cases = [
        ({"init_images": [base64.b64encode(bomb.getvalue()).decode()]},
         "init_images[0]: the image claims too many pixels"),
        ({"init_images": [base64.b64encode(noise.getvalue()).decode()]}, "init_images[0]: the image is over 16 MiB"),
        ({"init_images": [base64.b64encode(jpeg.getvalue()[:300]).decode()]},
         "init_images[0]: a broken or truncated image"),
        ({"init_images": [base64.b64encode(b"just some text\n" * 20).decode()]},
         "init_images[0]: not a PNG, JPEG or WebP image"),
        ({"init_images": [good], "mask": base64.b64encode(_png(Image.new("L", (64, 32), 255))).decode()},
         "mask: is 64x32 pixels but the init image is 64x64"),
        ({}, "init_images: send one image"),
    ]
    for fields, message in cases:
        log_from = len(app.log)
        answer = webui.session.post(f"{webui.baseurl}/img2img", json={"prompt": PROMPT, "steps": 2, **SIZE, **fields})
        assert answer.status_code == 422 and answer.json()["detail"].startswith(message), (message, answer.text[:300])
        deadline = time.monotonic() + 30
        while not any("request refused: /sdapi/v1/img2img" in line for line in app.log[log_from:]):
            assert time.monotonic() < deadline, "".join(app.log[log_from:])
            time.sleep(0.05)
    big_but_fine = {"prompt": PROMPT, "steps": 2, "seed": 1, **SIZE, "init_images": [good],
                    "comment": "x" * 2_000_000}
    assert webui.session.post(f"{webui.baseurl}/img2img", json=big_but_fine).status_code == 200
    over = webui.session.post(f"{webui.baseurl}/options", json={"x": "x" * 2_000_000})  # txt2img: images' cap
    assert over.status_code == 413 and over.json()["detail"] == "request body too large (limit 1 MB)"
    new = temp_files() - before
    assert all(Path(p).suffix == ".png" and "sdxl-" in p for p in new), sorted(new)[:5]  # the answers' PNGs only
    assert not any(open(p, "rb").read() in (jpeg.getvalue(), bomb.getvalue()) for p in new)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_info_is_json_with_the_seeds_in_order(webui):
    """img2img's info parses as A1111's and lists each image's seed; its PNG parameters carry the Size made."""
    result = webui.img2img(images=[init_image()], prompt=PROMPT, seed=40, steps=2, batch_size=2, **SIZE)
    assert result.info["all_seeds"] == [40, 41] and len(result.images) == 2
    assert json.loads(json.dumps(result.info))["infotexts"][0].endswith("Denoising strength: 0.75")


def test_a_one_pixel_image_is_resized_and_an_rgba_mask_repaints_where_opaque(webui):
    """A 1 x 1 init image is resized to width x height (resize_mode 0, documented); an RGBA mask with transparency
    repaints where it is opaque (A1111's create_binary_mask reads its alpha): there the pixels change, where it is
    transparent they are the original's."""
    tiny = webui.img2img(images=[Image.new("RGB", (1, 1), (200, 40, 40))], prompt=PROMPT, seed=2, steps=2, **SIZE)
    assert tiny.image.size == (64, 64)
    init = init_image()
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 0))
    ImageDraw.Draw(mask).rectangle((0, 32, 63, 63), fill=(0, 0, 0, 255))  # the bottom half opaque: repaint it
    result = webui.img2img(images=[init], mask_image=mask, prompt=PROMPT, seed=2, steps=4, mask_blur=0,
                           inpaint_full_res=False, inpainting_fill=1, denoising_strength=1.0, **SIZE)
    got, original = pixels(result.image).astype(int), pixels(init).astype(int)
    assert np.array_equal(got[:32], original[:32])
    assert np.abs(got[32:] - original[32:]).mean() > 10


def test_base_and_refiner_from_every_protocols_client():
    """`--refiner`: /sd-models lists it after the model; A1111's txt2img with refiner_checkpoint naming it (an A1111
    title with a hash too) runs it at refiner_switch_at: the same images per seed, not the base's alone, and the
    infotext says Refiner and Refiner switch at; another name is a 422 naming the loaded refiner. gradio_client's
    /generate and the MCP generate tool with refiner_switch_at give A1111's refined images, their default (the
    page's slider, shown) is 0.8, and 1 is the base alone; OpenAI's quality "hd" refines at 0.8 (the PNG says so),
    "standard" does not."""
    import asyncio

    import httpx
    import openai
    import webuiapi
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    from tests.helpers import FIXTURES

    app = RunningApp("--model", str(FIXTURES / "tiny-pt"), "--refiner", str(FIXTURES / "tiny-pt-refiner"),
                     "--max-inference-steps", "8", "--num-inference-steps", "4", "--executable-cache", "off")
    try:
        api = webuiapi.WebUIApi(host="127.0.0.1", port=app.port)
        assert [m["model_name"] for m in api.session.get(f"{api.baseurl}/sd-models").json()] == [
            "tiny-pt", "tiny-pt-refiner"]
        fields = dict(prompt=PROMPT, seed=4, steps=4, cfg_scale=5.0, sampler_name="Euler", **SIZE)

        def txt2img(**more):  # webuiapi's txt2img has no refiner arguments: A1111's JSON as its clients send it
            answer = api.session.post(f"{api.baseurl}/txt2img", json={**fields, **more}).json()
            return pixels(Image.open(io.BytesIO(base64.b64decode(answer["images"][0])))), json.loads(answer["info"])

        refined, info = txt2img(refiner_checkpoint="tiny-pt-refiner", refiner_switch_at=0.5)
        again, _ = txt2img(refiner_checkpoint="tiny-pt-refiner [0123abcd]", refiner_switch_at=0.5)
        base, base_info = txt2img()
        assert np.array_equal(refined, again)
        assert np.abs(refined.astype(int) - base).mean() > 1
        assert info["infotexts"][0].endswith("Refiner: tiny-pt-refiner, Refiner switch at: 0.5")
        assert "Refiner" not in base_info["infotexts"][0]
        other = api.session.post(f"{api.baseurl}/txt2img", json={**fields, "refiner_checkpoint": "sd_xl_refiner_1.0"})
        assert other.status_code == 422 and other.json()["detail"] == (
            "refiner_checkpoint: unknown refiner 'sd_xl_refiner_1.0'; this server offers: tiny-pt-refiner")

        client = app.client()
        page = dict(prompt=PROMPT, seed=4, num_inference_steps=4, guidance_scale=5.0, sampler="Euler", **SIZE)
        parameters = {p["parameter_name"]: p for p in client.view_api(return_format="dict", print_info=False)[
            "named_endpoints"]["/generate"]["parameters"]}
        assert parameters["refiner_switch_at"]["parameter_default"] == 0.8
        gallery, page_info = client.predict(api_name="/generate", refiner_switch_at=0.5, **page)
        assert np.array_equal(pixels(Image.open(gallery[0]["image"])), refined)
        assert (page_info["refiner"], page_info["refiner_switch_at"]) == ("tiny-pt-refiner", 0.5)
        gallery, page_info = client.predict(api_name="/generate", refiner_switch_at=1, **page)
        assert np.array_equal(pixels(Image.open(gallery[0]["image"])), base) and "refiner" not in page_info

        async def mcp_call():
            async with httpx.AsyncClient(timeout=300) as http, \
                    streamable_http_client(app.url + "gradio_api/mcp/", http_client=http) as (read, write, _), \
                    ClientSession(read, write) as session:
                await session.initialize()
                return await session.call_tool("generate", {**page, "refiner_switch_at": 0.5})

        result = asyncio.run(mcp_call())
        assert not result.isError, result.content
        first = next(c for c in result.content if c.type == "image")
        assert np.array_equal(pixels(Image.open(io.BytesIO(base64.b64decode(first.data)))), refined)

        sdk = openai.OpenAI(base_url=app.url + "v1", api_key="unused", max_retries=0)
        for quality, says in (("hd", "Refiner: tiny-pt-refiner, Refiner switch at: 0.8"), ("standard", None)):
            made = sdk.images.generate(model="dall-e-3", prompt=PROMPT, size="64x64", quality=quality,
                                       response_format="b64_json")
            text = Image.open(io.BytesIO(base64.b64decode(made.data[0].b64_json))).text["parameters"]
            assert (says in text) if says else ("Refiner" not in text), text
    finally:
        app.stop()
