"""Several models in one server on every front (issue #49; docs/models.md), through each front's own client against
`python app.py --model tiny-random --model <tiny-random-b>` on loopback: the page's /generate (gradio_client), MCP,
AUTOMATIC1111 (webuiapi, httpx), OpenAI (openai) and the jobs API.

tiny-random-b is tiny-random's architecture with other weights (builtin.create_tiny_random, seed 1), so both share
every program and differ in every image. Each model's images must be a single-model server's for the same request
(an engine serving tiny-random-b alone, started in this process: the page's defaults are the engine's), whichever
front named it; an unknown name is refused naming it and the
models offered, on every front; A1111's sd_model_checkpoint option is each client's own (two loopback addresses).
"""

import asyncio
import base64
import io
import json
import re
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from sdxl_engine.checkpoint.builtin import create_tiny_random
from tests.helpers import RunningApp

pytestmark = pytest.mark.e2e

PROMPT = "a red circle"
B = "tiny-random-b"
OFFERED = f"this server offers: tiny-random, {B}"


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """tiny-random's architecture with other weights (seed 1), as a diffusers folder named tiny-random-b."""
    return str(create_tiny_random(tmp_path_factory.mktemp("models") / B, seed=1))


@pytest.fixture(scope="module")
def single(other) -> list[bytes]:
    """The images (pixels) an engine serving tiny-random-b alone makes for :func:`page`'s request (seed 5): those a
    single-model server gives, its page's defaults being the engine's (no negative prompt, no style, the model's
    sampler and size). One app start less than a `python app.py --model <tiny-random-b>` of its own."""
    import os

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine
    from sdxl_engine.engine.validation import GenerateRequest

    config = EngineConfig.load({"model": other, "cpu_devices": 4}, environ={
        k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")})
    alone = Engine(config, log=lambda *_: None).start()
    images = alone.generate(GenerateRequest(PROMPT, seed=5, num_inference_steps=2, guidance_scale=5.0)).images
    return [np.ascontiguousarray(image).tobytes() for image in images]


@pytest.fixture(scope="module")
def two(other):
    running = RunningApp("--model", "tiny-random", "--model", other)
    yield running
    running.stop()


def pixels(png: bytes) -> bytes:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).tobytes()


def page(app, seed=5, **model) -> list[bytes]:
    gallery, _ = app.client().predict(api_name="/generate", prompt=PROMPT, seed=seed, num_inference_steps=2,
                                      guidance_scale=5.0, **model)
    return [open(item["image"], "rb").read() for item in gallery]


def infotext(png: bytes) -> str:
    return Image.open(io.BytesIO(png)).text["parameters"]


def sd_models(app, client=None) -> list[dict]:
    return (client or httpx).get(app.url + "sdapi/v1/sd-models", timeout=30).json()


def hashed(app) -> list[dict]:
    """/sd-models once every model's hash is known (they are computed on a background thread)."""
    deadline = time.monotonic() + 60
    listed = sd_models(app)
    while any(item["hash"] is None for item in listed):
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)
        listed = sd_models(app)
    return listed


async def mcp_call(app, arguments: dict):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with httpx.AsyncClient(timeout=120) as http, \
            streamable_http_client(app.url + "gradio_api/mcp/", http_client=http) as (read, write, _), \
            ClientSession(read, write) as session:
        await session.initialize()
        tools = (await session.list_tools()).tools
        return tools, await session.call_tool("generate", arguments)


def test_sd_models_lists_every_model_in_a1111s_shape_and_refresh_rescans(two, other):
    listed = hashed(two)
    assert [item["model_name"] for item in listed] == ["tiny-random", B]
    for item in listed:
        assert item["title"] == f"{item['model_name']} [{item['hash']}]" and re.fullmatch(r"[0-9a-f]{10}", item["hash"])
        assert re.fullmatch(r"[0-9a-f]{64}", item["sha256"]) and item["sha256"][:10] == item["hash"]
        assert item["config"] is None
    assert listed[1]["filename"] == other
    assert httpx.post(two.url + "sdapi/v1/refresh-checkpoints", timeout=30).status_code == 200
    assert [item["model_name"] for item in sd_models(two)] == ["tiny-random", B]
    models = httpx.get(two.url + "v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["tiny-random", B]


def test_each_front_serves_the_named_model_as_a_single_model_server_does(two, single):
    """The same request naming tiny-random-b on every front gives the single-model server's images; the PNG infotext
    names the model that made them, with its A1111 hash; the default is tiny-random's, by name as by default."""
    expected = single
    title_a, title = (item["title"] for item in hashed(two))
    b_hash = title.split(" [")[1][:-1]
    made = {"page": page(two, model=B)}
    a1111 = httpx.post(two.url + "sdapi/v1/txt2img", timeout=120, json={
        "prompt": PROMPT, "seed": 5, "steps": 2, "cfg_scale": 5.0, "batch_size": 4,
        "override_settings": {"sd_model_checkpoint": title}}).json()
    made["a1111"] = [base64.b64decode(image) for image in a1111["images"]]
    assert json.loads(a1111["info"])["sd_model_name"] == B and json.loads(a1111["info"])["sd_model_hash"] == b_hash
    assert not any("sd_model_checkpoint" in w for w in json.loads(a1111["info"])["warnings"])
    from openai import OpenAI

    openai = OpenAI(base_url=two.url + "v1", api_key="none")
    answer = openai.images.generate(model=B, prompt=PROMPT, n=1)  # OpenAI's request has no seed: its model only
    _, result = asyncio.run(mcp_call(two, {"prompt": PROMPT, "seed": 5, "num_inference_steps": 2,
                                           "guidance_scale": 5.0, "model": B}))
    assert not result.isError, result.content
    made["mcp"] = [base64.b64decode(c.data) for c in result.content if c.type == "image"]
    job = httpx.post(two.url + "v1/jobs", timeout=30, json={"prompt": PROMPT, "seed": 5, "num_inference_steps": 2,
                                                             "guidance_scale": 5.0, "model": B}).json()
    while (record := httpx.get(two.url + f"v1/jobs/{job['id']}", timeout=30).json())["status"] in ("queued",
                                                                                                   "running"):
        time.sleep(0.2)
    made["jobs"] = [base64.b64decode(image) for image in record["images"]]
    for front, pngs in made.items():
        assert [pixels(png) for png in pngs] == expected, front
        assert f"Model hash: {b_hash}, Model: {B}" in infotext(pngs[0]), front
    assert infotext(base64.b64decode(answer.data[0].b64_json)).endswith(f"Model: {B}")
    default = page(two)
    assert [pixels(png) for png in default] == [pixels(png) for png in page(two, model="tiny-random")]
    assert [pixels(png) for png in default] != expected and infotext(default[0]).endswith("Model: tiny-random")
    assert [m.id for m in openai.models.list().data] == ["tiny-random", B]
    alias = openai.images.generate(model="dall-e-3", prompt=PROMPT, n=1, response_format="b64_json")
    assert infotext(base64.b64decode(alias.data[0].b64_json)).endswith("Model: tiny-random")  # OpenAI's: the default


def test_an_unknown_model_is_refused_by_name_on_every_front(two):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=rf"model: unknown model 'sdxl-turbo'; {OFFERED}"):
        page(two, model="sdxl-turbo")
    a1111 = httpx.post(two.url + "sdapi/v1/txt2img", timeout=60, json={
        "prompt": PROMPT, "steps": 2, "override_settings": {"sd_model_checkpoint": "sdxl-turbo [0123456789]"}})
    assert a1111.status_code == 422 and a1111.json()["detail"] == (
        f"override_settings.sd_model_checkpoint: unknown model 'sdxl-turbo [0123456789]'; {OFFERED}")
    options = httpx.post(two.url + "sdapi/v1/options", timeout=30, json={"sd_model_checkpoint": "sdxl-turbo"})
    assert options.status_code == 422 and options.json()["detail"] == (
        f"sd_model_checkpoint: unknown model 'sdxl-turbo'; {OFFERED}")
    openai = httpx.post(two.url + "v1/images/generations", timeout=30, json={"prompt": PROMPT, "model": "sdxl-turbo"})
    assert openai.status_code == 404 and openai.json()["error"]["code"] == "model_not_found"
    assert f"unknown model 'sdxl-turbo'; {OFFERED}" in openai.json()["error"]["message"]
    tools, mcp = asyncio.run(mcp_call(two, {"prompt": PROMPT, "num_inference_steps": 2, "model": "sdxl-turbo"}))
    assert mcp.isError and f"model: unknown model 'sdxl-turbo'; {OFFERED}" in mcp.content[0].text
    assert f"tiny-random, {B}; empty = the default (tiny-random)" in tools[0].inputSchema["properties"]["model"][
        "description"]
    jobs = httpx.post(two.url + "v1/jobs", timeout=30, json={"prompt": PROMPT, "model": "sdxl-turbo"})
    assert jobs.status_code == 400 and jobs.json()["error"]["param"] == "model"
    assert f"unknown model 'sdxl-turbo'; {OFFERED}" in jobs.json()["error"]["message"]


def test_a1111_options_are_each_clients_own(two):
    """POST /options sets the caller's default model (its address here: no API key), never another's; an
    override_settings entry is the request's only; webuiapi's util_set_model and util_get_current_model."""
    import webuiapi

    first = httpx.Client(base_url=two.url + "sdapi/v1/", timeout=120)
    second = httpx.Client(base_url=two.url + "sdapi/v1/", timeout=120,  # another client: from 127.0.0.2
                          transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    title_a, title = (item["title"] for item in hashed(two))

    def model_of(client, **body) -> str:
        made = client.post("txt2img", json={"prompt": PROMPT, "seed": 5, "steps": 1, "batch_size": 1, **body})
        return json.loads(made.json()["info"])["sd_model_name"]

    try:
        assert first.post("options", json={"sd_model_checkpoint": B}).status_code == 200
        assert first.get("options").json()["sd_model_checkpoint"] == title
        assert second.get("options").json()["sd_model_checkpoint"].startswith("tiny-random [")
        assert (model_of(first), model_of(second)) == (B, "tiny-random")
        assert model_of(second, override_settings={"sd_model_checkpoint": B}) == B  # the request's only
        assert second.get("options").json()["sd_model_checkpoint"].startswith("tiny-random [")
        assert model_of(second) == "tiny-random"
        webui = webuiapi.WebUIApi(host="127.0.0.1", port=two.port)
        assert webui.util_get_model_names() == [title_a, title]  # A1111's titles, sorted
        webui.util_set_model(title_a, find_closest=False)  # the first client's default back to the server's
        assert webui.util_get_current_model() == title_a and model_of(first) == "tiny-random"
    finally:
        first.close()
        second.close()


def test_the_api_description_lists_the_models(two):
    """gradio_client's view_api and /gradio_api/info list /generate's model names (the flags', known before the
    engine has started: the page is built first), the default first and as the default value."""
    info = httpx.get(two.url + "gradio_api/info", timeout=30).json()
    (model,) = [p for p in info["named_endpoints"]["/generate"]["parameters"] if p["parameter_name"] == "model"]
    assert model["type"]["enum"] == ["tiny-random", B] and model["parameter_default"] == "tiny-random", model
    assert "Literal['tiny-random', 'tiny-random-b']" in model["python_type"]["type"], model
