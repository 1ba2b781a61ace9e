"""A ControlNet-Union unit's control type through every front of a running app: ``python app.py --model
tests/fixtures/tiny-pt --controlnet tests/fixtures/tiny-pt-controlnet-union/union --controlnet
tests/fixtures/tiny-pt-controlnet/cn-a`` on loopback (``union``: a random 8-type union made from tiny-pt's UNet, as
ProMax; ``cn-a``: a plain ControlNet). One app for the module (issue #60, item 3).

The type must reach the engine's unit: /generate's ``control_type`` (gradio_client), the MCP tool's, A1111's
``union_control_type`` and the page's Control type make the jobs API's images for the same unit and type (the
jobs API's engine names, "depth", are the same type as the fronts' "Depth"), another type makes other images,
the same type the same pixels; a bad type is refused naming the field."""

import asyncio
import base64
import io
import json
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.helpers import RunningApp

pytestmark = pytest.mark.e2e

UNION = "tests/fixtures/tiny-pt-controlnet-union/union"
CONTROLNET = "tests/fixtures/tiny-pt-controlnet/cn-a"
ASK = dict(prompt="a red circle", seed=5, num_inference_steps=4, guidance_scale=5.0, width=64, height=64,
           sampler="Euler")


@pytest.fixture(scope="module")
def app():
    running = RunningApp("--model", "tests/fixtures/tiny-pt", "--controlnet", UNION, "--controlnet", CONTROLNET,
                         timeout=600)
    yield running
    running.stop()


def control_picture() -> Image.Image:
    """A non-square edge-like map: a white bar's outline on black, off-centre."""
    pixels = np.zeros((48, 80, 3), np.uint8)
    pixels[10:30, 12:40] = 255
    pixels[12:28, 14:38] = 0
    return Image.fromarray(pixels)


def b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def job(app, body: dict) -> dict:
    """A finished jobs API job's record (the images as base64 PNGs)."""
    asked = httpx.post(app.url + "v1/jobs", json=body, timeout=60).json()
    deadline = time.monotonic() + 300
    while (got := httpx.get(app.url + f"v1/jobs/{asked['id']}", timeout=60).json())["status"] in ("queued",
                                                                                                    "running"):
        assert time.monotonic() < deadline, "the job never finished"
        time.sleep(0.2)
    assert got["status"] == "succeeded", got
    return got


def job_images(app, body: dict) -> list[np.ndarray]:
    return [pixels(Image.open(io.BytesIO(base64.b64decode(png)))) for png in job(app, body)["images"]]


def union_unit(kind: str) -> dict:
    """The jobs API's unit of the control picture on the union, of type ``kind`` (the engine's names)."""
    return {"image": b64(control_picture()), "model": "union", "control_type": kind}


def generate(client, **values) -> tuple[list[np.ndarray], str]:
    """/generate's images (pixels) and the first one's PNG parameters for ASK and ``values``."""
    gallery, _ = client.predict(**{**ASK, **values}, api_name="/generate")
    first = Image.open(gallery[0]["image"])
    return [pixels(Image.open(item["image"])) for item in gallery], first.info["parameters"]


def test_the_lists_name_the_union_under_every_type_it_has(app):
    """/controlnet/model_list lists the union (as "name [hash]") beside the plain one; /controlnet/control_types
    (sd-webui-controlnet's shape) has it under every tag, Tile and Inpaint too (8 types), and the plain cn-a, whose
    name has no type's word, under "All" only; module_list is the preprocessors."""
    import webuiapi

    webui = webuiapi.WebUIApi(host="127.0.0.1", port=app.port)
    titles = webui.controlnet_model_list()
    assert [t.split(" [")[0] for t in titles] == ["union", "cn-a"] and titles[0].startswith("union [")
    assert webui.controlnet_module_list()[:2] == ["none", "canny"]
    types = httpx.get(app.url + "controlnet/control_types", timeout=30).json()["control_types"]
    assert list(types) == ["All", "Canny", "Depth", "Inpaint", "Lineart", "MLSD", "NormalMap", "OpenPose",
                           "Scribble", "Segmentation", "SoftEdge", "Tile"]
    assert types["All"]["model_list"] == ["None", *titles]
    for tag, entry in types.items():
        if tag != "All":
            assert entry["model_list"] == ["None", titles[0]] and entry["default_model"] == titles[0], tag
    assert types["Canny"]["module_list"] == ["none", "canny", "invert"] and types["Canny"]["default_option"] == "canny"


def test_gradio_clients_control_type_reaches_the_union_and_the_infotext(app):
    """/generate's control_type: "Hard Edge" twice gives the same pixels; "Depth" other images (moved from Hard
    Edge's by more than half of what the unit moves them from no unit's, in another direction); each the jobs API's
    images for the engine's name of the type ("canny", "depth"); the PNG says "Union Control Type: Depth" in its
    ControlNet entry. Refused, naming control_type: no type for the union, an unknown one, a type for the plain
    cn-a."""
    from gradio_client.exceptions import AppError

    client = app.client()
    unit = dict(control_image=b64(control_picture()), control_model="union")
    hard, _ = generate(client, **unit, control_type="Hard Edge")
    again, _ = generate(client, **unit, control_type="Hard Edge")
    depth, text = generate(client, **unit, control_type="Depth")
    plain, _ = generate(client)
    for a, b in zip(hard, again, strict=True):
        np.testing.assert_array_equal(a, b)
    between = [float(np.abs(a - b).mean()) for a, b in zip(hard, depth, strict=True)]
    steered = [float(np.abs(a - b).mean()) for a, b in zip(hard, plain, strict=True)]
    cosines = [float(np.sum((a - c) * (b - c)) / np.linalg.norm(a - c) / np.linalg.norm(b - c))
               for a, b, c in zip(hard, depth, plain, strict=True)]
    # Measured (this fixture, seed 5, 4 Euler steps): Hard Edge moves each image 10.4 .. 11.6 levels (mean absolute,
    # 0..255) from no unit's, Depth 10.5 .. 11.9 from Hard Edge's; the two moves' cosine is 0.51 .. 0.54: one
    # picture pulls both ways alike (not noise), the type turns the pull by about 58 degrees.
    assert min(steered) > 5 and all(b > 0.5 * u for b, u in zip(between, steered, strict=True)), (between, steered)
    assert all(0.2 < c < 0.8 for c in cosines), cosines
    body = {**ASK, "images": 1}
    np.testing.assert_array_equal(job_images(app, {**body, "control_units": [union_unit("canny")]})[0], hard[0])
    np.testing.assert_array_equal(job_images(app, {**body, "control_units": [union_unit("depth")]})[0], depth[0])
    title = httpx.get(app.url + "controlnet/model_list", timeout=30).json()["model_list"][0]
    assert f'ControlNet 0: "Module: none, Model: {title}, Weight: 1.0' in text, text
    assert 'Control Mode: Balanced, Union Control Type: Depth"' in text, text
    for values, words in (({}, "needs a control type"), ({"control_type": "Pose"}, "unknown control type 'Pose'"),
                          ({"control_model": "cn-a", "control_type": "Depth"}, "not a ControlNet-Union")):
        with pytest.raises(AppError, match=f"^control_type: .*{words}"):
            generate(client, **{**unit, **values})


def test_the_image_tools_control_type_reaches_the_union(app):
    """/image_to_image's control_type (its last input): the jobs API's images for the same picture, strength and
    unit; another type other images."""
    client = app.client()
    picture = np.zeros((64, 64, 3), np.uint8)
    picture[:, :, 2] = np.linspace(0, 255, 64, dtype=np.uint8)[None, :]
    init = b64(Image.fromarray(picture))
    shared = dict(prompt=ASK["prompt"], image=init, strength=0.6, seed=5, guidance_scale=5.0, num_inference_steps=4,
                  width=64, height=64, sampler="Euler", control_image=b64(control_picture()), control_model="union")
    made = {}
    for kind in ("Hard Edge", "Depth"):
        gallery, _ = client.predict(**shared, control_type=kind, api_name="/image_to_image")
        made[kind] = pixels(Image.open(gallery[0]["image"]))
    assert np.abs(made["Hard Edge"] - made["Depth"]).mean() > 0.5
    jobs = job_images(app, {**ASK, "images": 1, "image": init, "strength": 0.6,
                            "control_units": [union_unit("Hard Edge")]})
    np.testing.assert_array_equal(jobs[0], made["Hard Edge"])


def test_a1111s_union_control_type_and_a_modules_type_reach_the_union(app):
    """sd-webui-controlnet's union_control_type ("Depth") makes the jobs API's "depth" images and writes the type in
    the infotext; webuiapi's ControlNetUnit (which has no such field) with module canny runs as Hard Edge (the
    extension's type of its module)."""
    import webuiapi

    title = httpx.get(app.url + "controlnet/model_list", timeout=30).json()["model_list"][0]
    a1111 = dict(prompt=ASK["prompt"], seed=5, steps=4, cfg_scale=5.0, width=64, height=64, sampler_name="Euler")
    raw = {"image": b64(control_picture()), "model": title, "module": "none", "union_control_type": "Depth"}
    answer = httpx.post(app.url + "sdapi/v1/txt2img", json={**a1111, "alwayson_scripts": {
        "controlnet": {"args": [raw]}}}, timeout=300).json()
    theirs = pixels(Image.open(io.BytesIO(base64.b64decode(answer["images"][0]))))
    body = {**ASK, "images": 1}
    np.testing.assert_array_equal(theirs, job_images(app, {**body, "control_units": [union_unit("depth")]})[0])
    assert "Union Control Type: Depth" in json.loads(answer["info"])["infotexts"][0]
    webui = webuiapi.WebUIApi(host="127.0.0.1", port=app.port)
    unit = webuiapi.ControlNetUnit(image=control_picture(), module="canny", model=title, processor_res=64,
                                   threshold_a=100, threshold_b=200, resize_mode="Crop and Resize")
    result = webui.txt2img(**a1111, controlnet_units=[unit])
    assert "Module: canny" in result.info["infotexts"][0]
    assert "Union Control Type: Hard Edge" in result.info["infotexts"][0]
    refused = httpx.post(app.url + "sdapi/v1/txt2img", json={**a1111, "alwayson_scripts": {
        "controlnet": {"args": [{**raw, "union_control_type": "Sketchy"}]}}}, timeout=60)
    assert refused.status_code == 422
    assert refused.json()["detail"].startswith("alwayson_scripts.controlnet.args[0].union_control_type: unknown")


def test_the_mcp_tools_control_type_reaches_the_union(app):
    """The mcp SDK's generate call with control_type "Depth" answers the jobs API's "depth" images; an unknown type
    is a tool error naming control_type."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async def call(arguments: dict):
        async with httpx.AsyncClient(timeout=300) as http, \
                streamable_http_client(app.url + "gradio_api/mcp/", http_client=http) as (read, write, _), \
                ClientSession(read, write) as session:
            await session.initialize()
            return await session.call_tool("generate", arguments)

    arguments = {**ASK, "control_image": b64(control_picture()), "control_model": "union"}
    result = asyncio.run(call({**arguments, "control_type": "Depth"}))
    assert not result.isError, result.content
    first = pixels(Image.open(io.BytesIO(base64.b64decode(result.content[0].data))))
    np.testing.assert_array_equal(first, job_images(app, {**ASK, "images": 1,
                                                          "control_units": [union_unit("depth")]})[0])
    refused = asyncio.run(call({**arguments, "control_type": "Pose"}))
    assert refused.isError and refused.content[0].text.startswith("control_type: "), refused.content


def test_the_pages_control_type_shows_for_the_union_and_reaches_it(app):
    """The page in Chromium: the ControlNet section's Control type shows while the union is chosen, its types
    ProMax's eight; choosing Depth and Generate sends control_type "Depth" (/generate's last input) and shows
    gradio_client's images for those values; choosing cn-a hides it."""
    from pathlib import Path

    if not Path("/usr/bin/chromium").exists():
        pytest.skip("/usr/bin/chromium not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    from tests.serving.test_page_browser import ARGS, OfflinePage, gallery_pixels

    picture = io.BytesIO()
    control_picture().save(picture, format="PNG")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        offline = OfflinePage(browser, app.url)
        sent: list[str] = []
        try:
            page = offline.open()
            page.on("request", lambda r: sent.append(r.post_data) if "queue/join" in r.url else None)
            page.wait_for_function("document.querySelector('#engine-status')?.innerText.includes('Ready on')")
            page.fill("#seed input", "5")
            page.locator("#controlnet-box button").first.click()
            page.wait_for_selector("#control-type input", state="visible")
            page.locator("#control-upload input[type=file]").set_input_files(
                {"name": "control.png", "mimeType": "image/png", "buffer": picture.getvalue()})
            page.wait_for_function("document.querySelector('#control-picture img')?.naturalWidth === 80",
                                   timeout=60_000)
            page.click("#control-type input")
            options = [text.split("\n")[-1].strip() for text in page.locator("[role=option]").all_inner_texts()]
            assert options == ["OpenPose", "Depth", "Soft Edge", "Hard Edge", "Normal Map", "Segmentation", "Tile",
                               "Inpaint"], options
            page.locator("[role=option]", has_text="Depth").first.click()
            page.fill("#prompt textarea", ASK["prompt"])
            page.click("#generate")
            page.wait_for_function("document.querySelector('#result-status')?.innerText.includes('images on')",
                                   timeout=180_000)
            shown = [gallery_pixels(page, i).astype(np.int16) for i in range(4)]
            page.click("#control-model input")
            page.locator("[role=option]", has_text="cn-a").first.click()
            page.wait_for_selector("#control-type", state="hidden")
            assert offline.blocked == []
        finally:
            offline.close()
            browser.close()
    calls = [json.loads(body)["data"] for body in sent if body and len(json.loads(body).get("data") or []) == 24]
    data = calls[-1]
    assert data[11] == "union" and data[-1] == "Depth" and data[2] == 5, data[:3] + data[11:]
    client = app.client()
    steered, _ = client.predict(*data[:10], b64(control_picture()), *data[11:], api_name="/generate")
    for i, image in enumerate(shown):
        np.testing.assert_array_equal(image, pixels(Image.open(steered[i]["image"])))
