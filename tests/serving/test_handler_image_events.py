"""The page's two image events (handler.image_function, upscale_function) take /generate's inputs from its one list
(apis/tools.generate_inputs), as /generate's own event does: a new input costs no line in handler.py or
page_image.py."""

import asyncio
import inspect
from types import SimpleNamespace

from PIL import Image

from sdxl_engine.config import EngineConfig
from sdxl_engine.serving import handler, history
from sdxl_engine.serving.apis import tools

CONFIG = EngineConfig.load(environ={})


def test_an_input_added_to_generate_reaches_both_image_events_signatures_and_requests(tmp_path, monkeypatch):
    """A made-up ``clip_skip`` added at the end of generate_inputs is a parameter of both image events (after the
    inputs they had: the raw calls' positions stay) and reaches the request each builds by its name; the ControlNet
    unit's inputs stay out of both, the refiner switch out of Upscale's."""
    original = tools.generate_inputs
    monkeypatch.setattr(tools, "generate_inputs", lambda config: (*original(config), tools.Input("clip_skip", int, 0)))
    img2img = handler.image_function(None, CONFIG, history.Pending(), None, None)
    upscale = handler.upscale_function(None, CONFIG, history.Pending(), None, None)
    nine = [item.name for item in original(CONFIG)][:9]
    assert list(inspect.signature(img2img).parameters) == [
        *nine, "image", "mode", "strength", "sides", "pixels", "refiner_switch_at", "model", "schedule_type",
        "clip_skip", "request", "progress"]
    assert list(inspect.signature(upscale).parameters) == [
        *nine, "last", "index", "hires_scale", "hires_upscaler", "hires_strength", "model", "schedule_type",
        "clip_skip", "request", "progress"]
    asked = []
    monkeypatch.setattr(handler, "to_request", lambda **fields: asked.append(fields) or fields)

    async def follow(requests, request, *args, **kwargs):  # what the event submits to the service
        yield [], {"seeds": [7]}

    monkeypatch.setattr(handler, "follow", follow)
    monkeypatch.setattr(handler, "readable", lambda demo, path: True)
    monkeypatch.setattr(handler, "discard_uploads", lambda *a, **k: None)
    picture = tmp_path / "picture.png"
    Image.new("RGB", (48, 32), (200, 10, 10)).save(picture)
    quiet = dict(request=SimpleNamespace(session_hash="s", client=None, headers={}), progress=lambda *a, **k: None)
    editor = {"background": {"path": str(picture)}, "layers": [], "composite": {"path": str(picture)}}
    last = {"gallery": [[str(picture), "seed 3"]], "info": {"seeds": [3]}}

    async def run(stream):
        return [out async for out in stream]

    asyncio.run(run(img2img("a red circle", "", 3, 5.0, 2, 48, 32, image=editor, clip_skip=2, model="m", **quiet)))
    asyncio.run(run(upscale("a red circle", "", 9, 5.0, 2, 0, 0, last=last, index=0, clip_skip=3, **quiet)))
    assert [fields["clip_skip"] for fields in asked] == [2, 3]
    assert asked[0]["model"] == "m" and asked[0]["strength"] == 0.75 and asked[0]["image"].shape == (32, 48, 3)
    assert asked[1]["hires_scale"] == 1.5 and (asked[1]["seed"], asked[1]["width"], asked[1]["height"]) == (3, 0, 0)
    assert not any(name.startswith("control") for fields in asked for name in fields)
