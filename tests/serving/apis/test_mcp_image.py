"""The MCP image tool (apis/mcp_image.py) as a client of the service: its calls count in the per-client cap with the
page's events, and the engine's refusals name the tool's inputs (``upscale`` for the engine's ``hires_scale``)."""

import asyncio
import base64
import io

import gradio as gr
import numpy as np
import pytest
from PIL import Image

from sdxl_engine.service.service import Service, over_limit_message
from sdxl_engine.serving import handler, history
from sdxl_engine.serving.apis.mcp_image import image_tool
from tests.serving.test_handler_follow import CONFIG, PageEngine, caller, collect, generate


def picture() -> str:
    data = io.BytesIO()
    Image.new("RGB", (48, 32), (10, 200, 10)).save(data, format="PNG")
    return base64.b64encode(data.getvalue()).decode()


@pytest.fixture
def tool(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    fake = PageEngine()
    requests = Service(fake, slots=1, limit=1)
    yield fake, requests, image_tool(requests, CONFIG, fake)
    requests.close()
    fake.go(1000)


def test_the_tool_makes_images_as_a_job_of_its_caller(tool):
    fake, requests, image_to_image = tool
    fake.go(100)
    gallery, info = asyncio.run(image_to_image("a green square", picture(), seed=5, num_inference_steps=2, width=48,
                                               height=32, request=caller("10.0.0.7")))
    assert info["seeds"] == [5, 6] and info["strength"] == 0.75 and len(gallery) == 2
    assert requests.jobs("10.0.0.7")[0].front == "page"  # a Gradio endpoint (gradio_client); MCP is mcp_server.py


def test_the_tool_counts_in_the_cap_with_the_pages_events(tool):
    fake, requests, image_to_image = tool
    function = handler.api_function(requests, CONFIG, history.Pending())

    async def main():
        held = asyncio.ensure_future(collect(generate(function, address="10.0.0.7"), []))
        await asyncio.sleep(0.1)
        with pytest.raises(gr.Error) as refused:
            await image_to_image("a green square", picture(), num_inference_steps=2, width=48, height=32,
                                 request=caller("10.0.0.7"))
        fake.go(1000)
        await asyncio.wait_for(held, 10)
        return refused.value.message

    assert asyncio.run(main()) == handler.shown(over_limit_message(1))


def test_an_engine_refusal_names_the_tools_input(tool):
    fake, requests, image_to_image = tool
    with pytest.raises(gr.Error) as refused:  # 72x48 is no size of the stand-in's
        asyncio.run(image_to_image("a green square", picture(), num_inference_steps=2, width=48, height=32,
                                   upscale=1.5, request=caller("10.0.0.7")))
    assert refused.value.message.startswith("upscale: ")


def test_a_size_the_server_cannot_make_names_width_or_height_not_the_image(tool):
    """The tool resizes the image to width x height itself, so a size the engine refuses is the caller's width or
    height (a multiple of 16 here: 72 is not one), refused before anything runs."""
    from sdxl_engine.engine.validation import Limits

    fake, requests, image_to_image = tool
    fake.limits = Limits(max_seed=100, max_steps=8, sizes=((48, 32),), default_size=(48, 32), default_steps=2,
                         default_guidance=5.0, multiple=16, max_pixels=64 * 64, model="tiny-shapes")
    for width, height, field, model in ((72, 32, "width", ""), (48, 40, "height", "tiny-shapes"),
                                        (80, 64, "width/height", "")):  # the default model, by name or not
        with pytest.raises(gr.Error) as refused:
            asyncio.run(image_to_image("a green square", picture(), num_inference_steps=2, width=width,
                                       height=height, model=model, request=caller("10.0.0.7")))
        assert refused.value.message.startswith(f"{field}: "), refused.value.message
    assert not requests.jobs("10.0.0.7")


def test_tool_inputs_refuse_a_size_the_model_cannot_make_before_decoding():
    """What both image tools (this Gradio endpoint and the MCP server's) call: with the default model's limits a
    width the model cannot make is the width's fault, even with a picture that does not decode."""
    from sdxl_engine.engine.validation import Limits
    from sdxl_engine.serving.apis.core import ApiError
    from sdxl_engine.serving.apis.tools import tool_inputs

    limits = Limits(max_seed=100, max_steps=8, sizes=((48, 32),), default_size=(48, 32), default_steps=2,
                    default_guidance=5.0, multiple=16, max_pixels=64 * 64)
    with pytest.raises(ApiError) as refused:
        tool_inputs("not a picture", "", -1, 72, 32, (48, 32), limits=limits)
    assert refused.value.message.startswith("width: 72 is not a multiple of 16 pixels")
    fields, _, w, h = tool_inputs(picture(), "", -1, 48, 32, (48, 32), limits=limits)
    assert (w, h) == (48, 32) and fields["image"].shape == (32, 48, 3)


def test_gradio_clients_faceid_embedding_reaches_the_engine_and_its_refusals_name_ip_adapter_embeds(tool):
    """gradio_client's /image_to_image and /generate take ``ip_adapter_embeds`` (FaceID's face embedding, their last
    input) into the engine's one IPAdapterUnit, as a list or JSON text; with no adapter loaded the refusal names it,
    and an embedding sent beside a reference image is refused naming both inputs. Left out (the default), no unit."""
    import dataclasses
    import json

    fake, requests, image_to_image = tool
    generate_function = handler.api_function(requests, CONFIG, history.Pending())
    face = [0.02 * (i % 11) - 0.1 for i in range(512)]
    ask = dict(ip_adapter_model="faceid", ip_adapter_weight=0.5)

    def image_call(**kwargs):
        return asyncio.run(image_to_image("a green square", picture(), num_inference_steps=2, width=48, height=32,
                                          **ask, **kwargs, request=caller("10.0.0.7")))

    def generate_call(**kwargs):
        return asyncio.run(collect(generate(generate_function, address="10.0.0.8", **ask, **kwargs), []))

    fake.go(1000)  # a call not refused runs at once (and is counted below), rather than waiting for its steps
    for call in (image_call, generate_call):
        with pytest.raises(gr.Error) as refused:
            call(ip_adapter_embeds=face)
        assert refused.value.message.startswith("ip_adapter_embeds: no IP-Adapter is loaded"), refused.value.message
        with pytest.raises(gr.Error) as refused:
            call(ip_adapter_embeds=face, ip_adapter_image=picture())
        assert refused.value.message.startswith("ip_adapter_embeds: send either ip_adapter_image")
    assert fake.calls == []
    fake.limits = dataclasses.replace(fake.limits, ip_adapters=(("faceid", "1"),), ip_adapter_embeds=(("faceid", 512),))
    image_call(ip_adapter_embeds=face)
    generate_call(ip_adapter_embeds=json.dumps([face, face]))
    generate_call()
    first, second, plain = fake.calls
    assert [len(unit.embeds) for unit in first.ip_adapter_units + second.ip_adapter_units] == [1, 2]
    assert first.image is not None and second.image is None and plain.ip_adapter_units == ()
    (unit,) = first.ip_adapter_units
    assert (unit.model, unit.weight, unit.image) == ("faceid", 0.5, None)
    np.testing.assert_allclose(unit.embeds[0], face, rtol=1e-6)
    np.testing.assert_allclose(second.ip_adapter_units[0].embeds[1], face, rtol=1e-6)
