"""serving/apis/mcp_server.py: the MCP tools on a real Service over a stand-in engine whose steps wait for the test
(tests.helpers.StepEngine), served by uvicorn in this process and called with the mcp SDK's client over streamable
HTTP: the tools' inputs (the page's endpoints' own, in order, described), images as the job's PNG bytes, refusals
naming the tool's input, the per-client cap shared with the other fronts, a call whose client leaves stopping its job,
progress per step. And tools.py's inputs against the Gradio endpoints of the same names."""

import asyncio
import base64
import contextlib
import inspect
import io
import json
import socket
import threading

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI
from PIL import Image

from sdxl_engine.config import EngineConfig
from sdxl_engine.service.jobs import CANCELLED
from sdxl_engine.service.service import Service
from sdxl_engine.serving.apis import tools
from sdxl_engine.serving.apis.mcp_server import McpServer, ToolRefusal
from tests.helpers import StepEngine, wait_until

CONFIG = EngineConfig.load(environ={})


class Served:
    """An app with only the MCP route (mount, lifespan) on a free loopback port, in a thread."""

    def __init__(self, service: Service):
        self.service = service
        mcp = McpServer(service, CONFIG, lambda request: "owner-" + request.client.host)

        @contextlib.asynccontextmanager
        async def lifespan(app):
            async with mcp.running():
                yield

        app = FastAPI(lifespan=lifespan)
        mcp.mount(app)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, "the server never started", 30)
        self.url = f"http://127.0.0.1:{self.port}/gradio_api/mcp/"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def engine():
    engine = StepEngine()
    yield engine
    engine.go(1000)


@pytest.fixture
def served(engine):
    running = Served(Service(engine, slots=1, limit=2))
    yield running
    engine.go(1000)
    running.stop()


async def in_session(url: str, work):
    """``await work(session)`` in an initialised MCP client session to ``url``."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with httpx.AsyncClient(timeout=60) as http, \
            streamable_http_client(url, http_client=http) as (read, write, _), ClientSession(read, write) as session:
        await session.initialize()
        return await work(session)


def released(engine: StepEngine, steps: int) -> threading.Timer:
    """Let ``steps`` denoising steps run once the call is on its way (the engine waits for them)."""
    timer = threading.Timer(0.3, engine.go, (steps,))
    timer.start()
    return timer


def test_the_tools_are_the_endpoints_inputs_in_order_described_with_the_pages_defaults(served):
    listed = asyncio.run(in_session(served.url, lambda session: session.list_tools())).tools
    assert [tool.name for tool in listed] == ["generate", "image_to_image"]
    generate, image = (tool.inputSchema for tool in listed)
    assert list(generate["properties"]) == ["prompt", "negative_prompt", "seed", "guidance_scale",
                                            "num_inference_steps", "width", "height", "style", "sampler",
                                            "refiner_switch_at", *tools.CONTROL_NAMES[:-1], "model",
                                            "schedule_type", *tools.IP_NAMES, "control_type",
                                            "ip_adapter_embeds"]
    assert tools.IP_NAMES == ("ip_adapter_image", "ip_adapter_model", "ip_adapter_weight", "ip_adapter_start",
                              "ip_adapter_end")
    assert tools.IP_UNIT_NAMES == (*tools.IP_NAMES, "ip_adapter_embeds")  # FaceID's, added later: last
    assert "--ip-adapter" in generate["properties"]["ip_adapter_image"]["description"]
    assert tools.CONTROL_NAMES == ("control_image", "control_model", "control_weight", "control_start",
                                   "control_end", "control_module", "control_type")  # the type added later: last
    assert list(image["properties"])[-15:] == [*tools.CONTROL_NAMES[:-1], "model", "schedule_type", *tools.IP_NAMES,
                                               "control_type", "ip_adapter_embeds"]
    for schema in (generate, image):
        embeds = schema["properties"]["ip_adapter_embeds"]
        assert embeds["type"] == ["array", "string"] and embeds["default"] == ""
        assert "insightface's normed_embedding" in embeds["description"]
        assert "Hard Edge" in schema["properties"]["control_type"]["description"]
        assert schema["properties"]["control_type"]["default"] == ""
    assert "canny" in generate["properties"]["control_module"]["description"]
    assert generate["required"] == ["prompt"] and image["required"] == ["prompt", "image"]
    seed = generate["properties"]["seed"]
    assert seed["type"] == "integer" and seed["default"] == -1 and "seed of the first image" in seed["description"]
    assert generate["properties"]["num_inference_steps"]["default"] == CONFIG.num_inference_steps
    assert generate["properties"]["sampler"]["enum"][0] == "Euler" and "(No style)" in generate["properties"][
        "style"]["enum"]
    assert generate["properties"]["sampler"]["enum"][-2:] == ["LMS", "Restart"]  # A1111's Restart too
    assert listed[0].description.startswith("Generate images from a text prompt with SDXL") and \
        " Returns: the images (PNG" in listed[0].description
    assert list(image["properties"])[:4] == ["prompt", "image", "mask", "strength"]
    assert "URLs are not fetched" in image["properties"]["image"]["description"]
    assert image["properties"]["upscale"] == {"type": "number", "default": 1.0,
                                              "description": image["properties"]["upscale"]["description"]}


def test_the_tools_inputs_are_the_gradio_endpoints_of_the_same_names():
    """gradio_client's /generate and /image_to_image take what the MCP tools take: names, order, defaults."""
    from sdxl_engine.serving import handler, history
    from sdxl_engine.serving.apis import mcp_image

    endpoints = {"generate": handler.api_function(lambda *a, **k: None, CONFIG, history.Pending()),
                 "image_to_image": mcp_image.image_tool(lambda *a, **k: None, CONFIG)}
    for name, inputs in (("generate", tools.generate_inputs(CONFIG)), ("image_to_image", tools.image_inputs(CONFIG))):
        parameters = [p for p in inspect.signature(endpoints[name]).parameters.values()
                      if p.name not in ("request", "progress")]
        assert [p.name for p in parameters] == [item.name for item in inputs]
        defaults = ["" if p.default is None else tools.REQUIRED if p.default is p.empty else p.default
                    for p in parameters]
        assert defaults == [item.default for item in inputs]


def test_a_call_answers_the_jobs_png_bytes_then_the_info_record(served, engine):
    released(engine, 2)
    result = asyncio.run(in_session(served.url, lambda session: session.call_tool(
        "generate", {"prompt": "a red circle", "seed": 12, "num_inference_steps": 2, "width": 48, "height": 32})))
    assert not result.isError, result.content
    (job,) = served.service.jobs(None)
    assert (job.front, job.owner, job.client) == ("mcp", "owner-127.0.0.1", "127.0.0.1")
    images = [base64.b64decode(c.data) for c in result.content if c.type == "image"]
    assert images == job.result.pngs and [c.mimeType for c in result.content[:2]] == ["image/png"] * 2
    assert np.asarray(Image.open(io.BytesIO(images[1])))[0, 0, 0] == 13  # StepEngine: pixel = seed
    assert result.content[-1].type == "text" and json.loads(result.content[-1].text)["seeds"] == [12, 13]


def test_refusals_are_tool_errors_naming_the_tools_input(served, engine):
    picture = io.BytesIO()
    Image.new("RGB", (48, 32), (10, 20, 30)).save(picture, format="PNG")
    picture = base64.b64encode(picture.getvalue()).decode()

    async def calls(session):
        return [await session.call_tool(name, arguments) for name, arguments in (
            ("generate", {"prompt": "x", "style": "Nope"}),
            ("generate", {"prompt": "x", "width": 50, "height": 32}),
            ("generate", {"prompt": "x", "steps": 3}),
            ("generate", {"seed": 3}),
            ("generate", {"prompt": "x", "seed": "five"}),
            ("image_to_image", {"prompt": "x", "image": picture[:40]}),
            ("image_to_image", {"prompt": "x", "image": picture, "upscale": 9}),
            ("image_to_image", {"prompt": "x", "image": picture, "upscale": 1.5}))]

    answers = asyncio.run(in_session(served.url, calls))
    assert all(answer.isError for answer in answers)
    texts = [answer.content[0].text for answer in answers]
    assert [text.split(":")[0] for text in texts] == ["style", "width", "steps", "prompt", "seed", "image",
                                                      "upscale", "upscale"]
    assert texts[0].startswith("style: 'Nope' is not one of ['(No style)'")
    assert "not an input of this tool; its inputs: prompt, negative_prompt, seed" in texts[2]
    assert texts[-1].startswith("upscale: 1.5 x 48x32 = 72x48, which this server does not make")  # hires_scale's
    assert texts[3] == "prompt: is required" and texts[4] == "seed: 'five' is not of type 'integer'"
    assert served.service.jobs(None) == [] and engine.calls == []  # nothing was queued


def test_mcp_calls_count_in_the_per_client_cap_with_the_other_fronts(served, engine):
    """limit 2: with one job of the address from another front and one MCP call in flight, a second MCP call is
    refused with the cap's message, and so is the other front's next job; the two in flight then finish."""
    from sdxl_engine.service.request import to_request
    from sdxl_engine.service.service import Refused

    other = served.service.submit(to_request(prompt="a1111's", num_inference_steps=1), owner="k", front="a1111",
                                  client="127.0.0.1")

    async def calls(session):
        first = asyncio.create_task(session.call_tool("generate", {"prompt": "x", "num_inference_steps": 1}))
        await asyncio.to_thread(wait_until, lambda: len(served.service.jobs(None)) == 2, "the MCP call's job")
        second = await session.call_tool("generate", {"prompt": "y", "num_inference_steps": 1})
        with pytest.raises(Refused) as refused:
            served.service.submit(to_request(prompt="z"), owner="k", front="openai", client="127.0.0.1")
        engine.go(2)
        return await first, second, refused.value

    first, second, refused = asyncio.run(in_session(served.url, calls))
    assert second.isError and "max_requests_per_client = 2" in second.content[0].text
    assert refused.status == 429 and not first.isError and other.status == "succeeded"


def test_a_call_whose_client_leaves_stops_its_job_and_the_next_runs(served, engine):
    async def leave(session):
        call = asyncio.create_task(session.call_tool("generate", {"prompt": "x", "num_inference_steps": 30}))
        await asyncio.to_thread(wait_until, lambda: served.service.running == 1, "the call never ran")
        engine.go(1)
        await asyncio.to_thread(wait_until, lambda: engine.steps_seen == 1, "no step ran")
        call.cancel()

    asyncio.run(in_session(served.url, leave))  # the session closes with the call's connection
    (job,) = served.service.jobs(None)
    wait_until(lambda: job.status == CANCELLED, "the job of a client that left was not stopped", 30)
    assert engine.steps_seen <= 2
    released(engine, 1)
    after = asyncio.run(in_session(served.url, lambda session: session.call_tool(
        "generate", {"prompt": "y", "seed": 3, "num_inference_steps": 1})))
    assert not after.isError and json.loads(after.content[-1].text)["seeds"] == [3, 4]


def test_a_call_with_a_progress_token_hears_each_step(served, engine):
    heard = []

    async def progress(done, total, message):
        heard.append((done, total, message))

    released(engine, 3)
    result = asyncio.run(in_session(served.url, lambda session: session.call_tool(
        "generate", {"prompt": "x", "num_inference_steps": 3}, progress_callback=progress)))
    assert not result.isError
    assert heard == [(1, 3, "step 1/3"), (2, 3, "step 2/3"), (3, 3, "step 3/3")]


def test_describe_splits_a_tools_doc():
    description, inputs = tools.describe(tools.image_doc())
    assert description.endswith("Returns: the images (PNG, with their generation parameters) and a JSON record: "
                                "seeds, size, strength, timings")
    assert list(inputs) == [item.name for item in tools.image_inputs(CONFIG)]
    assert "\n" not in inputs["refiner_switch_at"] and inputs["refiner_switch_at"].endswith("1 = no refiner")


def test_mount_serves_mcp_unless_turned_off_and_hands_its_session_manager_to_the_lifespan(engine):
    """apis.mount with MCP on adds the route and returns the session manager's run for the app's lifespan; with
    --no-mcp (access.mcp False) there is neither."""
    from sdxl_engine.serving.apis import access_for, mount

    service = Service(engine, slots=1, limit=2)
    for mcp, routes, contexts in ((True, ["/gradio_api/mcp", "/gradio_api/mcp/"], 1), (False, [], 0)):
        app = FastAPI()
        returned = mount(app, service, access_for("", share=False, public_api=False, mcp=mcp), {}, config=CONFIG,
                         log=lambda line: None)
        assert [path for route in app.routes if (path := getattr(route, "path", "")).startswith("/gradio_api/mcp")] \
            == routes
        assert len(returned) == contexts


def test_a_tool_call_with_a_control_image_asks_for_one_control_unit(engine):
    """The tools' control inputs (tools.CONTROL_INPUTS) become one ControlUnit of the decoded image; without a
    control image no unit; an image without a model is refused naming control_model."""
    import base64

    import numpy as np

    from sdxl_engine.service.images import png_bytes

    mcp = McpServer(Service(engine, slots=1, limit=2), CONFIG, lambda request: "me")
    picture = np.zeros((24, 40, 3), np.uint8)
    picture[:, :20] = 255
    control = base64.b64encode(png_bytes(picture)).decode()
    asked = asyncio.run(mcp.request_for("generate", {"prompt": "x", "control_image": control,
                                                     "control_model": "cn-a", "control_weight": 0.7,
                                                     "control_start": 0.1, "control_end": 0.9,
                                                     "control_module": "canny"}, "me"))
    (unit,) = asked.engine.control_units
    assert (unit.model, unit.weight, unit.guidance_start, unit.guidance_end, unit.module) == (
        "cn-a", 0.7, 0.1, 0.9, "canny")
    np.testing.assert_array_equal(unit.image, picture)
    plain = asyncio.run(mcp.request_for("image_to_image", {"prompt": "x", "image": control}, "me"))
    assert plain.engine.control_units == ()
    with_image = asyncio.run(mcp.request_for("image_to_image", {"prompt": "x", "image": control,
                                                                "control_image": control,
                                                                "control_model": "cn-a"}, "me"))
    assert with_image.engine.control_units[0].model == "cn-a" and with_image.engine.image is not None
    with pytest.raises(Exception, match="control_model: name the ControlNet"):
        asyncio.run(mcp.request_for("generate", {"prompt": "x", "control_image": control}, "me"))


def test_a_union_control_type_reaches_the_unit_and_its_refusals_name_control_type(engine):
    """Issue #60: both tools' ``control_type`` (a ControlNet-Union's: sd-webui-controlnet's name or diffusers')
    reaches the unit as sent ("" = none); the engine's refusals (a union unit without a type, an unknown type, a
    type for a plain ControlNet) name ``control_type``, its other refusals the control inputs
    (``control_model``), not ``control_units[0]...``."""
    import dataclasses

    from sdxl_engine.engine.errors import InvalidRequest
    from sdxl_engine.service.images import png_bytes
    from sdxl_engine.serving.handler import message_of

    service = Service(engine, slots=1, limit=2)
    mcp = McpServer(service, CONFIG, lambda request: "me")
    picture = base64.b64encode(png_bytes(np.full((24, 40, 3), 250, np.uint8))).decode()
    ask = {"prompt": "x", "control_image": picture, "control_model": "union"}
    for tool, extra in (("generate", {}), ("image_to_image", {"image": picture})):
        asked = asyncio.run(mcp.request_for(tool, {**ask, **extra, "control_type": "Depth"}, "me"))
        assert asked.engine.control_units[0].control_type == "Depth" and asked.field(
            "control_units[0].control_type") == "control_type"
        assert asyncio.run(mcp.request_for(tool, {**ask, **extra}, "me")).engine.control_units[0].control_type is None
    engine.limits = dataclasses.replace(engine.limits, controlnets=(("union", "1"), ("cn-a", "2")),
                                        controlnet_unions=(("union", 8),))
    refusals = []
    for change in ({}, {"control_type": "Pose"}, {"control_model": "cn-a", "control_type": "Depth"},
                   {"control_model": "cn-b", "control_type": "Depth"}):
        asked = asyncio.run(mcp.request_for("generate", {**ask, **change}, "me"))
        with pytest.raises(InvalidRequest) as err:
            service.submit(asked, owner="me", front="mcp", client="me")
        refusals.append(message_of(err.value, asked))
    assert [text.split(":")[0] for text in refusals] == ["control_type"] * 3 + ["control_model"], refusals
    assert "one of OpenPose, Depth, Soft Edge, Hard Edge" in refusals[0] and "'Pose'" in refusals[1]
    assert "not a ControlNet-Union" in refusals[2]
    (unit,) = service.submit(asyncio.run(mcp.request_for("generate", {**ask, "control_type": "hard edge"}, "me")),
                             owner="me", front="mcp", client="me").request.engine.control_units
    assert unit.control_type == (3,)  # validated: Hard Edge is diffusers' canny index


def test_a_generate_call_with_a_reference_image_asks_for_one_ip_adapter_unit_and_refusals_name_its_inputs(engine):
    """Issue #60: the generate tool's IP-Adapter inputs (tools.IP_INPUTS) become one IPAdapterUnit of the decoded
    (non-square) image, none without an image; an image without a model, or one that does not decode, is refused
    naming its input, and so are the engine's refusals of the unit (not ``ip_adapter_units[0]...``)."""
    import dataclasses

    from sdxl_engine.engine.errors import InvalidRequest
    from sdxl_engine.service.images import png_bytes
    from sdxl_engine.serving.handler import message_of

    service = Service(engine, slots=1, limit=2)
    mcp = McpServer(service, CONFIG, lambda request: "me")
    picture = np.zeros((24, 40, 3), np.uint8)
    picture[:, :20] = (250, 120, 0)
    reference = base64.b64encode(png_bytes(picture)).decode()
    ask = {"prompt": "x", "ip_adapter_image": reference, "ip_adapter_model": "ip-adapter_sdxl"}
    asked = asyncio.run(mcp.request_for("generate", {**ask, "ip_adapter_weight": 0.6, "ip_adapter_start": 0.2,
                                                     "ip_adapter_end": 0.9}, "me"))
    (unit,) = asked.engine.ip_adapter_units
    assert (unit.model, unit.weight, unit.guidance_start, unit.guidance_end) == ("ip-adapter_sdxl", 0.6, 0.2, 0.9)
    np.testing.assert_array_equal(unit.image, picture)
    assert asyncio.run(mcp.request_for("generate", {"prompt": "x"}, "me")).engine.ip_adapter_units == ()
    # The image tool takes the same unit beside its picture, its refusals named likewise.
    on_image = asyncio.run(mcp.request_for("image_to_image", {**ask, "image": reference}, "me"))
    assert on_image.engine.ip_adapter_units[0].model == "ip-adapter_sdxl" and on_image.engine.image is not None
    assert on_image.field("ip_adapter_units[0].guidance_end") == "ip_adapter_end"
    assert asyncio.run(mcp.request_for("image_to_image", {"prompt": "x", "image": reference}, "me")
                       ).engine.ip_adapter_units == ()
    for arguments, message in (({"ip_adapter_image": reference}, "ip_adapter_model: name the IP-Adapter"),
                               ({**ask, "ip_adapter_image": reference[:40]}, "ip_adapter_image: ")):
        with pytest.raises(ToolRefusal, match=message):
            asyncio.run(mcp.request_for("generate", {"prompt": "x", **arguments}, "me"))
    # The engine's checks (validation at the service's door): none loaded, then an unknown adapter, a weight.
    refusals = []
    for limits, change in ((engine.limits, {}), (dataclasses.replace(engine.limits, ip_adapters=(("a", "1"),)), {}),
                           (dataclasses.replace(engine.limits, ip_adapters=(("ip-adapter_sdxl", "1"),)),
                            {"ip_adapter_weight": 3})):
        engine.limits = limits
        asked = asyncio.run(mcp.request_for("generate", {**ask, **change}, "me"))
        with pytest.raises(InvalidRequest) as err:
            service.submit(asked, owner="me", front="mcp", client="me")
        refusals.append(message_of(err.value, asked))
    assert [text.split(":")[0] for text in refusals] == ["ip_adapter_image", "ip_adapter_model", "ip_adapter_weight"]
    assert "--ip-adapter" in refusals[0] and "loaded: a" in refusals[1]
    assert service.jobs(None) == [] and engine.calls == []


def test_ip_fields_take_a_faceid_embedding_in_place_of_the_image_and_refusals_name_ip_adapter_embeds():
    """tools.ip_fields with ``ip_adapter_embeds`` (an IP-Adapter FaceID's face embedding: a list of numbers, a list
    of such lists, or either as JSON text) makes one IPAdapterUnit of the embedding as sent (the engine checks the
    numbers, as the jobs API's), no image, under field names that make the engine's refusals name
    ``ip_adapter_embeds``; none for an empty value. Both an image and an embedding, an embedding without a model and
    text that is not JSON are refused naming the input."""
    from sdxl_engine.serving.apis.errors import ApiError

    face = [round((i % 7) / 7 - 0.4, 3) for i in range(512)]
    for sent, want in ((face, face), (json.dumps(face), face), (json.dumps([face, face[::-1]]), [face, face[::-1]])):
        fields = tools.ip_fields(ip_adapter_model="faceid [0a1b]", ip_adapter_weight=0.7, ip_adapter_start=0.1,
                                 ip_adapter_end=0.8, ip_adapter_embeds=sent)
        (unit,) = fields["ip_adapter_units"]
        assert unit.image is None and unit.embeds == want
        assert (unit.model, unit.weight, unit.guidance_start, unit.guidance_end) == ("faceid [0a1b]", 0.7, 0.1, 0.8)
        names = fields["field_names"]
        assert (names["ip_adapter_units"], names["ip_adapter_units[0].embeds"],
                names["ip_adapter_units[0].embeds[1]"], names["ip_adapter_units[0].image"],
                names["ip_adapter_units[0].weight"]) == ("ip_adapter_embeds", "ip_adapter_embeds",
                                                         "ip_adapter_embeds[1]", "ip_adapter_image",
                                                         "ip_adapter_weight")
    for empty in ("", None, "  "):
        assert tools.ip_fields(ip_adapter_model="faceid", ip_adapter_embeds=empty) == {}
    reference = base64.b64encode(png_of(np.zeros((8, 8, 3), np.uint8))).decode()
    assert tools.ip_fields(reference, "ip-adapter_sdxl")["field_names"]["ip_adapter_units"] == "ip_adapter_image"
    for kwargs, param, message in (
            (dict(ip_adapter_image=reference, ip_adapter_model="faceid", ip_adapter_embeds=face), "ip_adapter_embeds",
             "ip_adapter_embeds: send either ip_adapter_image (a reference image) or ip_adapter_embeds"),
            (dict(ip_adapter_embeds=face), "ip_adapter_model",
             "ip_adapter_model: name the IP-Adapter for the face embedding"),
            (dict(ip_adapter_model="faceid", ip_adapter_embeds="[0.1, 0.2"), "ip_adapter_embeds",
             "ip_adapter_embeds: not JSON"),
            (dict(ip_adapter_model="faceid", ip_adapter_embeds="[" * 100_000), "ip_adapter_embeds",
             "ip_adapter_embeds: not JSON")):
        with pytest.raises(ApiError) as err:
            tools.ip_fields(**kwargs)
        assert err.value.status == 400 and err.value.param == param and err.value.message.startswith(message)


def png_of(pixels: np.ndarray) -> bytes:
    from sdxl_engine.service.images import png_bytes

    return png_bytes(pixels)


def test_the_tools_faceid_embedding_reaches_the_unit_and_the_engines_refusals_name_ip_adapter_embeds(engine):
    """Both tools take ``ip_adapter_embeds`` (an array or JSON text; the schema refuses another type naming it) into
    the one IPAdapterUnit; the engine's checks at the service's door name the tool's input: an embedding of another
    width, a bad one among several (``ip_adapter_embeds[1]``), numbers sent as strings, an embedding for an image
    adapter, none loaded; a reference image for the FaceID adapter names ``ip_adapter_image`` as before."""
    import dataclasses

    from sdxl_engine.engine.errors import InvalidRequest
    from sdxl_engine.serving.handler import message_of

    service = Service(engine, slots=1, limit=2)
    mcp = McpServer(service, CONFIG, lambda request: "me")
    face = [0.01 * (i % 13) for i in range(512)]
    ask = {"prompt": "x", "ip_adapter_model": "faceid", "ip_adapter_weight": 0.6, "ip_adapter_embeds": face}
    picture = base64.b64encode(png_of(np.full((24, 40, 3), 90, np.uint8))).decode()
    for name, extra in (("generate", {}), ("image_to_image", {"image": picture})):
        for sent in (face, json.dumps(face)):
            asked = asyncio.run(mcp.request_for(name, {**ask, **extra, "ip_adapter_embeds": sent}, "me"))
            (unit,) = asked.engine.ip_adapter_units
            assert unit.image is None and unit.embeds == face and (unit.model, unit.weight) == ("faceid", 0.6)
            assert asked.field("ip_adapter_units[0].embeds") == "ip_adapter_embeds"
        with pytest.raises(ToolRefusal, match="^ip_adapter_embeds: send either ip_adapter_image"):
            asyncio.run(mcp.request_for(name, {**ask, **extra, "ip_adapter_image": picture}, "me"))
        with pytest.raises(ToolRefusal, match="^ip_adapter_embeds: 5 is not of type 'array', 'string'"):
            asyncio.run(mcp.request_for(name, {**ask, **extra, "ip_adapter_embeds": 5}, "me"))
    loaded = dataclasses.replace(engine.limits, ip_adapters=(("ip-adapter_sdxl", "1"), ("faceid", "2")),
                                 ip_adapter_embeds=(("faceid", 512),))
    refusals = []
    for limits, change in ((engine.limits, {}), (loaded, {"ip_adapter_embeds": face[:3]}),
                           (loaded, {"ip_adapter_embeds": [face, face[:5]]}),
                           (loaded, {"ip_adapter_embeds": [str(v) for v in face]}),
                           (loaded, {"ip_adapter_model": "ip-adapter_sdxl"}),
                           (loaded, {"ip_adapter_embeds": "", "ip_adapter_image": picture})):
        engine.limits = limits
        asked = asyncio.run(mcp.request_for("generate", {**ask, **change}, "me"))
        with pytest.raises(InvalidRequest) as err:
            service.submit(asked, owner="me", front="mcp", client="me")
        refusals.append(message_of(err.value, asked))
    assert [text.split(":")[0] for text in refusals] == ["ip_adapter_embeds", "ip_adapter_embeds",
                                                         "ip_adapter_embeds[1]", "ip_adapter_embeds",
                                                         "ip_adapter_embeds", "ip_adapter_image"], refusals
    assert "no IP-Adapter is loaded" in refusals[0] and "has 3 values" in refusals[1]
    assert "has 5 values" in refusals[2] and "got str '0.0' among them" in refusals[3]
    assert "takes a reference image, not face embeddings" in refusals[4]
    assert "faceid is an IP-Adapter FaceID" in refusals[5]
    assert service.jobs(None) == [] and engine.calls == []


def test_the_generate_tools_schedule_type_reaches_the_engine_and_an_unknown_one_is_refused_naming_it(served, engine):
    """Issue #62: ``schedule_type`` is an input of the generate tool (an enum of the engine's names, described with
    A1111's labels); its value reaches the engine's request as sent, left out it is automatic; a name outside the
    enum is a tool error naming the argument and queues nothing."""
    listed = asyncio.run(in_session(served.url, lambda session: session.list_tools())).tools
    schema = listed[0].inputSchema["properties"]["schedule_type"]
    assert schema["enum"] == ["automatic", "uniform", "karras", "exponential", "sgm_uniform", "simple", "beta",
                              "leading", "linspace", "trailing"]
    assert schema["default"] == "automatic" and "SGM Uniform" in schema["description"]
    refused = asyncio.run(in_session(served.url, lambda session: session.call_tool(
        "generate", {"prompt": "x", "schedule_type": "sideways"})))
    assert refused.isError and refused.content[0].text.startswith("schedule_type: 'sideways' is not one of")
    assert served.service.jobs(None) == []
    released(engine, 2)

    async def calls(session):
        return [await session.call_tool("generate", {"prompt": "x", "num_inference_steps": 1, **extra})
                for extra in ({"schedule_type": "karras"}, {})]

    answers = asyncio.run(in_session(served.url, calls))
    assert not any(answer.isError for answer in answers), answers
    sent = sorted((job.request.engine.schedule_type for job in served.service.jobs(None)), key=str)
    assert sent == ["automatic", "karras"]


def test_the_image_tools_schedule_type_reaches_the_engine_and_an_unknown_one_is_refused_naming_it(engine):
    """Issue #61: ``image_to_image`` takes ``schedule_type`` as the generate tool does (the same enum, default
    automatic, described), last among its inputs (a raw /image_to_image call without it gets the default: the
    guard's optional inputs); it reaches the engine's request, left out it is automatic; a name outside the enum is
    refused naming the argument."""
    from sdxl_engine.program.schedulers import SCHEDULE_TYPES
    from sdxl_engine.service.images import png_bytes

    mcp = McpServer(Service(engine, slots=1, limit=2), CONFIG, lambda request: "me")
    generate, image = (tool.inputSchema["properties"] for tool in mcp.tools)
    assert image["schedule_type"]["enum"] == generate["schedule_type"]["enum"] == list(SCHEDULE_TYPES)
    assert image["schedule_type"]["default"] == "automatic" and "automatic" in image["schedule_type"]["description"]
    assert tools.optional_inputs()["image_to_image"] == ("schedule_type", *tools.IP_NAMES, "control_type",
                                                         "ip_adapter_embeds")
    picture = base64.b64encode(png_bytes(np.full((24, 40, 3), 200, np.uint8))).decode()
    for extra, want in (({"schedule_type": "karras"}, "karras"), ({}, "automatic")):
        asked = asyncio.run(mcp.request_for("image_to_image", {"prompt": "x", "image": picture, "sampler": "UniPC",
                                                               **extra}, "me"))
        assert (asked.engine.schedule_type, asked.engine.sampler, asked.engine.image is not None) == (
            want, "UniPC", True)
    with pytest.raises(Exception, match=r"^schedule_type: 'sideways' is not one of"):
        asyncio.run(mcp.request_for("image_to_image", {"prompt": "x", "image": picture, "schedule_type": "sideways"},
                                    "me"))
