"""sd-webui-controlnet's API through its own client, webuiapi (``ControlNetUnit``), against ``python app.py --model
tests/fixtures/tiny-pt --model tiny-shapes --controlnet tests/fixtures/tiny-pt-controlnet/cn-a --controlnet
tests/fixtures/tiny-pt-controlnet-union/union --ip-adapter
tests/fixtures/tiny-pt-ip-adapter/sdxl_models/ip-adapter_sdxl.safetensors:tests/fixtures/tiny-pt-ip-adapter-faceid/\
ip-adapter-faceid_sdxl.safetensors`` on loopback; the jobs API's and gradio_client's ``/generate`` control and
IP-Adapter inputs (FaceID's face embedding too) against the same app. One app for the module: the
ControlNet-Union's tests (below) run on it too, as one app start serves both (the union's file had its own app,
about 30 s of the suite's time).

A unit's images must be what the engine makes for that unit: the same PNG pixels as the jobs API's for the same
request and unit (both fronts build one ControlUnit), and not the images without the unit."""

import asyncio
import base64
import contextlib
import io
import json
import os
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.helpers import RunningApp

pytestmark = pytest.mark.e2e

CONTROLNET = "tests/fixtures/tiny-pt-controlnet/cn-a"
UNION = "tests/fixtures/tiny-pt-controlnet-union/union"
IP_ADAPTER = "tests/fixtures/tiny-pt-ip-adapter/sdxl_models/ip-adapter_sdxl.safetensors"
FACEID = "tests/fixtures/tiny-pt-ip-adapter-faceid/ip-adapter-faceid_sdxl.safetensors"  # loaded after IP_ADAPTER
ASK = dict(prompt="a red circle", seed=5, steps=4, cfg_scale=5.0, width=64, height=64, sampler_name="Euler")


@pytest.fixture(scope="module")
def app():
    # tiny-shapes beside: a model of another architecture, which cn-a and the union do not fit; cn-a first, the
    # page's default ControlNet; the MCP server on for the union's MCP test
    running = RunningApp("--model", "tests/fixtures/tiny-pt", "--model", "tiny-shapes", "--controlnet", CONTROLNET,
                         "--controlnet", UNION, "--ip-adapter", os.pathsep.join((IP_ADAPTER, FACEID)), timeout=600)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def webui(app):
    import webuiapi

    return webuiapi.WebUIApi(host="127.0.0.1", port=app.port)


def control_picture() -> Image.Image:
    """A non-square control map: a white bar on black, off-centre."""
    pixels = np.zeros((48, 80, 3), np.uint8)
    pixels[10:30, 12:40] = 255
    return Image.fromarray(pixels)


def b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def job_images(app, body: dict) -> list[np.ndarray]:
    job = httpx.post(app.url + "v1/jobs", json=body, timeout=60).json()
    deadline = time.monotonic() + 300
    while (got := httpx.get(app.url + f"v1/jobs/{job['id']}", timeout=60).json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, "the job never finished"
        time.sleep(0.2)
    assert got["status"] == "succeeded", got
    return [pixels(Image.open(io.BytesIO(base64.b64decode(png)))) for png in got["images"]]


def test_lists_and_detect(webui):
    title, union_title, ip_title, faceid_title = webui.controlnet_model_list()
    assert title.startswith("cn-a") and union_title.startswith("union [") and ip_title.startswith("ip-adapter_sdxl [")
    assert faceid_title.startswith("ip-adapter-faceid_sdxl [")
    assert webui.controlnet_module_list()[:2] == ["none", "canny"]
    found = webui.controlnet_detect([control_picture()], module="canny", processor_res=96, threshold_a=100,
                                    threshold_b=200)
    edges = np.asarray(found.images[0])  # webuiapi sends the extension's older controlnet_images, as data URLs
    assert found.info == "Success" and edges.shape[:2] == (96, 160)  # 48 x 80 at a short side of 96
    assert edges.max() == 255 and edges[:, 100:].max() == 0  # the bar's edges, on the left


def test_a_unit_steers_the_images_as_the_engine_runs_it_and_says_so_in_the_infotext(app, webui):
    import webuiapi

    title = webui.controlnet_model_list()[0]
    unit = webuiapi.ControlNetUnit(image=control_picture(), module="none", model=title, weight=1.5,
                                   resize_mode="Crop and Resize", guidance_end=0.8)
    plain = webui.txt2img(**ASK)
    steered = webui.txt2img(**ASK, controlnet_units=[unit])
    assert len(steered.images) == 1  # A1111's batch_size 1
    same = [np.array_equal(pixels(a), pixels(b)) for a, b in zip(plain.images, steered.images, strict=True)]
    assert not any(same), "the unit changed nothing"
    text = steered.info["infotexts"][0]
    assert f'ControlNet 0: "Module: none, Model: {title}, Weight: 1.5, Resize Mode: Crop and Resize' in text
    assert "Guidance End: 0.8" in text and "ControlNet 0" not in plain.info["infotexts"][0]
    jobs = job_images(app, {"prompt": ASK["prompt"], "seed": 5, "num_inference_steps": 4, "guidance_scale": 5.0,
                            "width": 64, "height": 64, "sampler": "Euler", "images": 1, "control_units": [
                                {"image": b64(control_picture()), "model": "cn-a", "weight": 1.5,
                                 "guidance_end": 0.8}]})
    for ours, theirs in zip(steered.images, jobs, strict=True):
        np.testing.assert_array_equal(pixels(ours), theirs)
    client = app.client()
    gallery, info = client.predict(prompt=ASK["prompt"], seed=5, num_inference_steps=4, guidance_scale=5.0,
                                   width=64, height=64, sampler="Euler", control_image=b64(control_picture()),
                                   control_model=title, control_weight=1.5, control_end=0.8, api_name="/generate")
    np.testing.assert_array_equal(pixels(Image.open(gallery[0]["image"])), jobs[0])  # the batch's first: seed 5


def test_gradio_clients_ip_adapter_inputs_make_the_jobs_apis_images_and_say_so_in_the_infotext(app):
    """Issue #60: /generate's IP-Adapter inputs (a non-square reference image as base64, the adapter, weight,
    start, end) make the jobs API's images for the same unit (one IPAdapterUnit on both fronts), not those without
    it; the PNG's infotext has the unit as sd-webui-controlnet writes one; a weight out of range is refused naming
    ip_adapter_weight."""
    from gradio_client.exceptions import AppError

    reference = Image.fromarray(np.tile(np.linspace(0, 255, 72, dtype=np.uint8)[None, :, None], (40, 1, 3)))
    ask = dict(prompt="a red circle", seed=5, num_inference_steps=4, guidance_scale=5.0, width=64, height=64,
               sampler="Euler")
    unit = {"image": b64(reference), "model": "ip-adapter_sdxl", "weight": 0.8, "guidance_end": 0.75}
    jobs = job_images(app, {**ask, "images": 1, "ip_adapter_units": [unit]})
    plain = job_images(app, {**ask, "images": 1})
    client = app.client()
    gallery, info = client.predict(**ask, ip_adapter_image=b64(reference), ip_adapter_model="ip-adapter_sdxl",
                                   ip_adapter_weight=0.8, ip_adapter_end=0.75, api_name="/generate")
    first = Image.open(gallery[0]["image"])
    np.testing.assert_array_equal(pixels(first), jobs[0])  # the batch's first: seed 5
    assert not np.array_equal(jobs[0], plain[0]), "the unit changed nothing"
    (title,) = [t for t in httpx.get(app.url + "controlnet/model_list", timeout=30).json()["model_list"]
                if t.startswith("ip-adapter_sdxl")]
    assert (f'ControlNet 0: "Module: ip-adapter_clip_sdxl, Model: {title}, Weight: 0.8, Resize Mode: Crop and '
            'Resize') in first.info["parameters"] and "Guidance End: 0.75" in first.info["parameters"]
    with pytest.raises(AppError, match="ip_adapter_weight: "):
        client.predict(**ask, ip_adapter_image=b64(reference), ip_adapter_model="ip-adapter_sdxl",
                       ip_adapter_weight=2.5, api_name="/generate")


def test_gradio_clients_faceid_embedding_makes_the_jobs_apis_images(app):
    """/generate's ``ip_adapter_embeds`` (a face embedding for the FaceID adapter, as a list or JSON text) makes the
    jobs API's images for the same ``embeds`` unit (one IPAdapterUnit on both fronts, the same seed), not those
    without it; an image for the FaceID adapter is refused naming ip_adapter_image, an embedding for the image
    adapter naming ip_adapter_embeds."""
    from gradio_client.exceptions import AppError

    face = np.random.default_rng(7).standard_normal(32)  # the tiny fixture's width (h94's file: 512)
    face = (face / np.linalg.norm(face)).round(6).tolist()  # normed, as insightface's normed_embedding
    ask = dict(prompt="a red circle", seed=5, num_inference_steps=4, guidance_scale=5.0, width=64, height=64,
               sampler="Euler")
    unit = {"embeds": face, "model": "ip-adapter-faceid_sdxl", "weight": 0.8, "guidance_end": 0.75}
    jobs = job_images(app, {**ask, "images": 1, "ip_adapter_units": [unit]})
    plain = job_images(app, {**ask, "images": 1})
    assert not np.array_equal(jobs[0], plain[0]), "the unit changed nothing"
    client = app.client()
    for sent in (face, json.dumps(face)):
        gallery, info = client.predict(**ask, ip_adapter_model="ip-adapter-faceid_sdxl", ip_adapter_weight=0.8,
                                       ip_adapter_end=0.75, ip_adapter_embeds=sent, api_name="/generate")
        np.testing.assert_array_equal(pixels(Image.open(gallery[0]["image"])), jobs[0])  # the batch's first: seed 5
    with pytest.raises(AppError, match="ip_adapter_image: ip-adapter-faceid_sdxl is an IP-Adapter FaceID"):
        client.predict(**ask, ip_adapter_image=b64(control_picture()), ip_adapter_model="ip-adapter-faceid_sdxl",
                       api_name="/generate")
    with pytest.raises(AppError, match="ip_adapter_embeds: ip-adapter_sdxl takes a reference image"):
        client.predict(**ask, ip_adapter_model="ip-adapter_sdxl", ip_adapter_embeds=face, api_name="/generate")


def test_a_unit_for_a_model_it_does_not_fit_is_refused_naming_the_model(app):
    """cn-a (and the union) are tiny-pt's architecture: a jobs API request for tiny-shapes with a cn-a unit is refused
    saying they do not fit tiny-shapes (it used to say no ControlNet was loaded), and the server serves on. (One
    ControlNet's sentence, "cn-a is for ...": tests/engine/test_control.py.)"""
    body = {"prompt": "a red circle", "model": "tiny-shapes", "num_inference_steps": 2, "control_units": [
        {"image": b64(control_picture()), "model": "cn-a"}]}
    answer = httpx.post(app.url + "v1/jobs", json=body, timeout=60)
    if answer.status_code == 202:  # checked at the door against the default's limits until tiny-shapes has loaded
        deadline = time.monotonic() + 300
        while (answer := httpx.get(app.url + f"v1/jobs/{answer.json()['id']}", timeout=60)).json()["status"] in (
                "queued", "running"):
            assert time.monotonic() < deadline, "the job never finished"
            time.sleep(0.2)
        assert answer.json()["status"] == "failed", answer.json()
    assert answer.json()["error"] == {"field": "control_units", "message": (
        "control_units: no ControlNet of this server fits the model tiny-shapes: cn-a, union are for another "
        "architecture; "
        "choose a model they fit, or drop the units")}, answer.json()
    assert len(job_images(app, {**body, "model": "tiny-pt", "width": 64, "height": 64})) == 4


@pytest.mark.parametrize("unit, named", [
    ({"model": "control_v11p_sd15_canny", "module": "none"}, "control_v11p_sd15_canny"),
    ({"model": "cn-a", "module": "depth_midas"}, "depth_midas"),
])
def test_an_unknown_model_or_module_is_refused_by_name(app, unit, named):
    body = {**ASK, "alwayson_scripts": {"ControlNet": {"args": [{"image": b64(control_picture()), **unit}]}}}
    answer = httpx.post(app.url + "sdapi/v1/txt2img", json=body, timeout=60)
    assert answer.status_code == 422 and named in answer.json()["detail"]
    assert answer.json()["detail"].startswith("alwayson_scripts.ControlNet.args[0].")


@contextlib.contextmanager
def controlnet_section(app):
    """The page in Chromium (offline: tests/serving/test_page_browser.OfflinePage) once the engine is ready, seed 5,
    its ControlNet section open; yields (page, offline, sent): ``sent`` collects the bodies of the page's
    queue/join calls (/generate's inputs as the page sends them). Skips without /usr/bin/chromium."""
    from pathlib import Path

    if not Path("/usr/bin/chromium").exists():
        pytest.skip("/usr/bin/chromium not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    from tests.serving.test_page_browser import ARGS, OfflinePage

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
            page.wait_for_selector("#control-upload input[type=file]", state="attached")
            yield page, offline, sent
        finally:
            offline.close()
            browser.close()


def test_the_pages_controlnet_section_makes_the_units_images(app):
    """The page's ControlNet section in Chromium: upload the picture, it shows in its box, Preview shows the map
    ("none": the picture itself), Generate sends the picture as /generate's control_image (base64 PNG of the same
    pixels) with the section's model and settings, and the gallery shows the images gradio_client gets for those
    values: not the images without the unit."""
    from tests.serving.test_page_browser import gallery_pixels

    picture = io.BytesIO()
    control_picture().save(picture, format="PNG")
    with controlnet_section(app) as (page, offline, sent):
        # A file that is no image, whatever its name, is refused with a sentence (the guard's plain 415:
        # Gradio's pop-up shows "HTTP 415: <body>"), and the box takes a picture after it.
        page.locator("#control-upload input[type=file]").set_input_files(
            {"name": "notes.png", "mimeType": "image/png", "buffer": b"%PDF-1.4 not a picture"})
        page.wait_for_selector(".toast-body.error", timeout=30_000)
        toast = page.inner_text(".toast-body.error")
        assert "uploads take PNG, JPEG or WebP images only" in toast and "{" not in toast, toast
        page.locator(".toast-body.error button").first.click()  # closed, as a user does
        page.locator("#control-upload input[type=file]").set_input_files(
            {"name": "control.png", "mimeType": "image/png", "buffer": picture.getvalue()})
        # The picture shows in its box (the app's PNG of it: an upload is never served back), once the upload
        # event has answered with its text.
        page.wait_for_function("document.querySelector('#control-picture img')?.naturalWidth === 80",
                               timeout=60_000)
        page.click("#control-preview")
        page.wait_for_function("document.querySelector('#control-detected img')", timeout=60_000)
        # The picture and its map side by side in boxes of one height (a small picture left a strip beside the
        # map's tall box).
        boxes = [page.locator(box).bounding_box() for box in ("#control-picture", "#control-detected")]
        assert boxes[0]["height"] == boxes[1]["height"] >= 200 and boxes[0]["y"] == boxes[1]["y"], boxes
        page.fill("#prompt textarea", ASK["prompt"])
        page.click("#generate")
        page.wait_for_function("document.querySelector('#result-status')?.innerText.includes('images on')",
                               timeout=120_000)
        shown = [gallery_pixels(page, i).astype(np.int16) for i in range(4)]
        # The page never asks for an upload (the server never serves one back): no refused GET.
        refused = [line for line in app.log if "not a file of this app" in line]
        assert offline.blocked == [] and refused == [], refused
    call = next(json.loads(body) for body in sent if body and len(json.loads(body).get("data") or []) == 25)
    data = call["data"]
    assert data[18:23] == ["", "ip-adapter_sdxl", 1, 0, 1]  # the IP-Adapter section's: no reference image, no unit
    assert data[23] is None  # the Control type, hidden for a plain ControlNet: none sent
    assert data[24] is None  # ip_adapter_embeds (FaceID's, API clients only): none from the page
    np.testing.assert_array_equal(pixels(Image.open(io.BytesIO(base64.b64decode(data[10])))),
                                  pixels(control_picture()))
    assert data[11] == "cn-a" and data[15] == "none" and data[16] == "tiny-pt" and data[2] == 5
    assert data[17] == "Automatic"  # the Schedule type dropdown
    client = app.client()
    steered, _ = client.predict(*data[:10], b64(control_picture()), *data[11:], api_name="/generate")
    plain, _ = client.predict(*data[:10], "", *data[11:], api_name="/generate")
    for i, image in enumerate(shown):
        np.testing.assert_array_equal(image, pixels(Image.open(steered[i]["image"])))
        assert not np.array_equal(image, pixels(Image.open(plain[i]["image"])))

# ControlNet-Union: a unit's control type through every front (issue #60, item 3; these tests had an app of
# their own, test_controlnet_union_app.py). ``union``: a random 8-type union made from tiny-pt's UNet, as
# ProMax. The type must reach the engine's unit: /generate's ``control_type`` (gradio_client), the MCP tool's,
# A1111's ``union_control_type`` and the page's Control type make the jobs API's images for the same unit and
# type (the jobs API's engine names, "depth", are the same type as the fronts' "Depth"), another type makes
# other images, the same type the same pixels; a bad type is refused naming the field.

JOB_ASK = dict(prompt="a red circle", seed=5, num_inference_steps=4, guidance_scale=5.0, width=64, height=64,
           sampler="Euler")


def edge_picture() -> Image.Image:
    """A non-square edge-like map: a white bar's outline on black, off-centre."""
    pixels = np.zeros((48, 80, 3), np.uint8)
    pixels[10:30, 12:40] = 255
    pixels[12:28, 14:38] = 0
    return Image.fromarray(pixels)


def union_unit(kind: str) -> dict:
    """The jobs API's unit of the control picture on the union, of type ``kind`` (the engine's names)."""
    return {"image": b64(edge_picture()), "model": "union", "control_type": kind}


def union_generate(client, **values) -> tuple[list[np.ndarray], str]:
    """/generate's images (pixels) and the first one's PNG parameters for JOB_ASK and ``values``."""
    gallery, _ = client.predict(**{**JOB_ASK, **values}, api_name="/generate")
    first = Image.open(gallery[0]["image"])
    return [pixels(Image.open(item["image"])) for item in gallery], first.info["parameters"]


def test_the_lists_name_the_union_under_every_type_it_has(app):
    """/controlnet/model_list lists the union (as "name [hash]") beside the plain one (and the IP-Adapter);
    /controlnet/control_types (sd-webui-controlnet's shape) has it under every tag, Tile and Inpaint too (8 types),
    and the plain cn-a, whose name has no type's word, under "All" only (the IP-Adapter under "All" and its own
    tag); module_list is the preprocessors."""
    import webuiapi

    webui = webuiapi.WebUIApi(host="127.0.0.1", port=app.port)
    titles = webui.controlnet_model_list()
    assert [t.split(" [")[0] for t in titles] == ["cn-a", "union", "ip-adapter_sdxl", "ip-adapter-faceid_sdxl"]
    union = titles[1]
    assert union.startswith("union [")
    assert webui.controlnet_module_list()[:2] == ["none", "canny"]
    types = httpx.get(app.url + "controlnet/control_types", timeout=30).json()["control_types"]
    assert list(types) == ["All", "Canny", "Depth", "Inpaint", "Lineart", "MLSD", "NormalMap", "OpenPose",
                           "Scribble", "Segmentation", "SoftEdge", "Tile", "IP-Adapter"]
    assert types["All"]["model_list"] == ["None", *titles]
    assert types["IP-Adapter"]["model_list"] == ["None", *titles[2:]]
    for tag, entry in types.items():
        if tag not in ("All", "IP-Adapter"):
            assert entry["model_list"] == ["None", union] and entry["default_model"] == union, tag
    assert types["Canny"]["module_list"] == ["none", "canny", "invert"] and types["Canny"]["default_option"] == "canny"


def test_gradio_clients_control_type_reaches_the_union_and_the_infotext(app):
    """/generate's control_type: "Hard Edge" twice gives the same pixels; "Depth" other images (moved from Hard
    Edge's by more than half of what the unit moves them from no unit's, in another direction); each the jobs API's
    images for the engine's name of the type ("canny", "depth"); the PNG says "Union Control Type: Depth" in its
    ControlNet entry. Refused, naming control_type: no type for the union, an unknown one, a type for the plain
    cn-a."""
    from gradio_client.exceptions import AppError

    client = app.client()
    unit = dict(control_image=b64(edge_picture()), control_model="union")
    hard, _ = union_generate(client, **unit, control_type="Hard Edge")
    again, _ = union_generate(client, **unit, control_type="Hard Edge")
    depth, text = union_generate(client, **unit, control_type="Depth")
    plain, _ = union_generate(client)
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
    body = {**JOB_ASK, "images": 1}
    np.testing.assert_array_equal(job_images(app, {**body, "control_units": [union_unit("canny")]})[0], hard[0])
    np.testing.assert_array_equal(job_images(app, {**body, "control_units": [union_unit("depth")]})[0], depth[0])
    (title,) = [t for t in httpx.get(app.url + "controlnet/model_list", timeout=30).json()["model_list"]
                if t.startswith("union [")]
    assert f'ControlNet 0: "Module: none, Model: {title}, Weight: 1.0' in text, text
    assert 'Control Mode: Balanced, Union Control Type: Depth"' in text, text
    for values, words in (({}, "needs a control type"), ({"control_type": "Pose"}, "unknown control type 'Pose'"),
                          ({"control_model": "cn-a", "control_type": "Depth"}, "not a ControlNet-Union")):
        with pytest.raises(AppError, match=f"^control_type: .*{words}"):
            union_generate(client, **{**unit, **values})


def test_the_image_tools_control_type_reaches_the_union(app):
    """/image_to_image's control_type (its last input): the jobs API's images for the same picture, strength and
    unit; another type other images."""
    client = app.client()
    picture = np.zeros((64, 64, 3), np.uint8)
    picture[:, :, 2] = np.linspace(0, 255, 64, dtype=np.uint8)[None, :]
    init = b64(Image.fromarray(picture))
    shared = dict(prompt=JOB_ASK["prompt"], image=init, strength=0.6, seed=5, guidance_scale=5.0, num_inference_steps=4,
                  width=64, height=64, sampler="Euler", control_image=b64(edge_picture()), control_model="union")
    made = {}
    for kind in ("Hard Edge", "Depth"):
        gallery, _ = client.predict(**shared, control_type=kind, api_name="/image_to_image")
        made[kind] = pixels(Image.open(gallery[0]["image"]))
    assert np.abs(made["Hard Edge"] - made["Depth"]).mean() > 0.5
    jobs = job_images(app, {**JOB_ASK, "images": 1, "image": init, "strength": 0.6,
                            "control_units": [union_unit("Hard Edge")]})
    np.testing.assert_array_equal(jobs[0], made["Hard Edge"])


def test_a1111s_union_control_type_and_a_modules_type_reach_the_union(app):
    """sd-webui-controlnet's union_control_type ("Depth") makes the jobs API's "depth" images and writes the type in
    the infotext; webuiapi's ControlNetUnit (which has no such field) with module canny runs as Hard Edge (the
    extension's type of its module)."""
    import webuiapi

    (title,) = [t for t in httpx.get(app.url + "controlnet/model_list", timeout=30).json()["model_list"]
                if t.startswith("union [")]
    a1111 = dict(prompt=JOB_ASK["prompt"], seed=5, steps=4, cfg_scale=5.0, width=64, height=64, sampler_name="Euler")
    raw = {"image": b64(edge_picture()), "model": title, "module": "none", "union_control_type": "Depth"}
    answer = httpx.post(app.url + "sdapi/v1/txt2img", json={**a1111, "alwayson_scripts": {
        "controlnet": {"args": [raw]}}}, timeout=300).json()
    theirs = pixels(Image.open(io.BytesIO(base64.b64decode(answer["images"][0]))))
    body = {**JOB_ASK, "images": 1}
    np.testing.assert_array_equal(theirs, job_images(app, {**body, "control_units": [union_unit("depth")]})[0])
    assert "Union Control Type: Depth" in json.loads(answer["info"])["infotexts"][0]
    webui = webuiapi.WebUIApi(host="127.0.0.1", port=app.port)
    unit = webuiapi.ControlNetUnit(image=edge_picture(), module="canny", model=title, processor_res=64,
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

    arguments = {**JOB_ASK, "control_image": b64(edge_picture()), "control_model": "union"}
    result = asyncio.run(call({**arguments, "control_type": "Depth"}))
    assert not result.isError, result.content
    first = pixels(Image.open(io.BytesIO(base64.b64decode(result.content[0].data))))
    np.testing.assert_array_equal(first, job_images(app, {**JOB_ASK, "images": 1,
                                                          "control_units": [union_unit("depth")]})[0])
    refused = asyncio.run(call({**arguments, "control_type": "Pose"}))
    assert refused.isError and refused.content[0].text.startswith("control_type: "), refused.content


def test_the_pages_control_type_shows_for_the_union_and_reaches_it(app):
    """The page in Chromium: the ControlNet section's Control type shows once the union is chosen (hidden for cn-a,
    the server's first ControlNet and the section's default), its types
    ProMax's eight; choosing Depth and Generate sends control_type "Depth" (/generate's last input) and shows
    gradio_client's images for those values; choosing cn-a hides it."""
    from tests.serving.test_page_browser import gallery_pixels

    picture = io.BytesIO()
    edge_picture().save(picture, format="PNG")
    with controlnet_section(app) as (page, offline, sent):
        assert not page.locator("#control-type input").is_visible()  # cn-a, the default: no type to choose
        page.click("#control-model input")
        page.locator("[role=option]", has_text="union").first.click()
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
        page.fill("#prompt textarea", JOB_ASK["prompt"])
        page.click("#generate")
        page.wait_for_function("document.querySelector('#result-status')?.innerText.includes('images on')",
                               timeout=180_000)
        shown = [gallery_pixels(page, i).astype(np.int16) for i in range(4)]
        page.click("#control-model input")
        page.locator("[role=option]", has_text="cn-a").first.click()
        page.wait_for_selector("#control-type", state="hidden")
        assert offline.blocked == []
    calls = [json.loads(body)["data"] for body in sent if body and len(json.loads(body).get("data") or []) == 25]
    data = calls[-1]
    assert data[11] == "union" and data[23] == "Depth" and data[2] == 5, data[:3] + data[11:]
    client = app.client()
    steered, _ = client.predict(*data[:10], b64(edge_picture()), *data[11:], api_name="/generate")
    for i, image in enumerate(shown):
        np.testing.assert_array_equal(image, pixels(Image.open(steered[i]["image"])))
