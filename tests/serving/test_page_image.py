"""The "Image to image" section's settings that need no browser (serving/page_image.py); the section in a browser:
tests/serving/test_page_browser.py."""

import threading
from types import SimpleNamespace

from sdxl_engine.serving.page_image import brush_radius, editor_tools


def engine_of(default_size: tuple[int, int]):
    """What size_choices reads of an engine that is ready: its limits' sizes and default size."""
    ready = threading.Event()
    ready.set()
    return SimpleNamespace(ready=ready, error=None,
                           limits=SimpleNamespace(default_size=default_size, sizes=(default_size,)))


def test_the_brush_is_a_sixteenth_of_the_models_shorter_side():
    """Gradio's "auto" brush is a fixed 25 px radius (about 80 % of a 64 x 64 picture); here it follows the model's
    size: tiny-shapes' 64 -> 4 px, SDXL's 1024 -> 64 px, a portrait default by its shorter side (832 x 1216 -> 52)."""
    assert [brush_radius(engine_of(size)) for size in ((64, 64), (1024, 1024), (832, 1216), (16, 8))] == [4, 64, 52, 1]
    assert brush_radius(None) is None  # before the engine is ready: the page's refresh sets it then
    tools = editor_tools(engine_of((1216, 832)))
    assert tools["brush"].default_size == 52 and tools["eraser"].default_size == 52
    assert tools["brush"].colors == ["#000000"] and tools["brush"].color_mode == "fixed"  # gr.ImageMask's own brush
    assert editor_tools(None)["brush"].default_size == "auto"


def test_the_control_section_shows_with_a_controlnet_and_turns_its_upload_into_generates_text(tmp_path, monkeypatch):
    """page_image.control_section: shown only when a ControlNet is loaded, its inputs /generate's control inputs in
    apis/tools.CONTROL_INPUTS' order; the upload becomes base64 PNG text (what gradio_client sends as
    control_image), and Preview's map is engine/control.detect's (canny on a non-square picture)."""
    import base64
    import io
    from pathlib import Path
    from types import SimpleNamespace

    import gradio as gr
    import numpy as np
    import pytest
    from PIL import Image

    from sdxl_engine.serving import handler, page_image
    from sdxl_engine.serving.apis.tools import CONTROL_NAMES

    # tiny-shapes' own canny ControlNet shows the section by itself, with its example outline; off, nothing shows.
    for model, own, shown in (("tiny-shapes", True, True), ("tiny-shapes", False, False), ("tiny-random", True, False)):
        with gr.Blocks():
            section = page_image.control_section(SimpleNamespace(controlnet="", controlnet_dir="", model=model,
                                                                 model_controlnets=own))
        assert section.box.visible is shown and section.example.visible is shown
    assert section.example_values is None
    with gr.Blocks():
        section = page_image.control_section(SimpleNamespace(controlnet="", controlnet_dir="", model="tiny-shapes",
                                                             model_controlnets=True))
    assert section.model.choices == [("tiny-shapes-canny", "tiny-shapes-canny")]
    text, outline, module, name, prompt = section.example_values
    assert (module, name, prompt) == ("none", "tiny-shapes-canny", "a yellow star on a white background")
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(base64.b64decode(text))).convert("RGB")), outline)
    assert outline.shape == (64, 64, 3) and outline[..., 0].mean() < 40  # white lines on black, on the left half
    assert outline[:, :32].sum() > 4 * outline[:, 32:].sum()
    for paths, shown in (("", False), ("tests/fixtures/tiny-pt-controlnet/cn-a:x/canny-xl.safetensors", True)):
        config = SimpleNamespace(controlnet=paths, controlnet_dir="", model="tiny-random", model_controlnets=True)
        with gr.Blocks():
            section = page_image.control_section(config)
        assert section.box.visible is shown and section.example.visible is False
    assert section.model.choices == [("cn-a", "cn-a"), ("canny-xl", "canny-xl")] and section.model.value == "cn-a"
    assert [c.elem_id for c in section.inputs] == ["control-image", "control-model", "control-weight",
                                                   "control-start", "control-end", "control-module", "control-type"]
    assert section.control_type.visible is False and section.unions == {}  # no union among them
    assert len(section.inputs) == len(CONTROL_NAMES)
    picture = np.zeros((48, 80, 3), np.uint8)
    picture[:, :40] = 255
    # The picture's upload event reads the file the guard let through, as base64 PNG text, and deletes the upload.
    upload = tmp_path / "picture.png"
    Image.fromarray(picture).save(upload)
    (tmp_path / "note.txt").write_text("not an image")
    discarded = []
    monkeypatch.setattr(handler, "readable", lambda demo, path: Path(path).parent == tmp_path)
    monkeypatch.setattr(handler, "discard_uploads", lambda demo, paths: discarded.extend(paths))
    encoded_picture = page_image.picture_function(demo=None)
    text, shown, box = encoded_picture({"path": str(upload), "meta": {"_type": "gradio.FileData"}})
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(base64.b64decode(text)))), picture)
    assert shown == box and Path(shown).read_bytes() == base64.b64decode(text)  # one PNG, written once
    assert discarded == [str(upload)]
    for value, message in (({"path": "/etc/hostname"}, "control image: not a file this page uploaded"),
                           ({"path": str(tmp_path / "note.txt")}, "control image"), ({"junk": 1}, "not a file"),
                           (None, "not a file")):
        with pytest.raises(gr.Error, match=message):
            encoded_picture(value)
    assert page_image.detected_map("", "canny") is None
    edges = page_image.detected_map(text, "canny")
    assert edges.shape[:2] == (512, 853) and edges[:, 420:433].max() == 255 and edges[:, :400].max() == 0
    with pytest.raises(gr.Error):
        page_image.detected_map(text, "openpose")


def test_after_the_control_upload_its_file_box_holds_the_apps_png_which_the_guard_serves(tmp_path):
    """Issue #59: the ControlNet file box kept the upload's own file after the upload event read (and deleted) it,
    so the box's download link was refused (a 404 and a log line: an upload is never served back). The event now
    answers the box too, with the app's PNG of the picture (the picture's box shows the same file): a new file in
    Gradio's temp folder that Gradio records as the box's (what it does with an output path) and the guard serves.
    The upload itself is served neither before nor after."""
    from pathlib import Path

    import numpy as np
    from PIL import Image

    import app
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.serving import gradio_internals, guard

    demo = app.build_demo(lambda *a, **k: None, EngineConfig.load(environ={}))  # tiny-shapes' ControlNet: shown
    blocks = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    (event,) = [f for f in demo.fns.values() if f.api_name == guard.CONTROL_EVENT]
    outputs = [b.elem_id for b in event.outputs]
    assert outputs == ["control-image", "control-picture", "control-upload"]
    # An upload as Gradio's upload route leaves it: a file in its temp folder, named in the demo's upload set.
    folder = Path(gradio_internals.upload_folder()) / "a-test-upload"
    folder.mkdir(parents=True, exist_ok=True)
    upload = folder / "control.png"
    picture = np.zeros((40, 24, 3), np.uint8)
    picture[:, 12:] = 255
    Image.fromarray(picture).save(upload)
    gradio_internals.upload_files(demo).add(str(upload))
    routes = guard.Routes(demo)
    assert routes.refusal("GET", f"/gradio_api/file={upload}", "") == "not a file of this app"
    answer = dict(zip(outputs, event.fn({"path": str(upload), "meta": {"_type": "gradio.FileData"}})))
    for name in ("control-picture", "control-upload"):
        path = answer[name]
        assert blocks[name].move_resource_to_block_cache(path) == path  # already in Gradio's folder: not copied
        assert Path(path).parent != folder and routes.refusal("GET", f"/gradio_api/file={path}", "") is None
        np.testing.assert_array_equal(np.asarray(Image.open(path)), picture)
    assert not upload.exists() and routes.refusal("GET", f"/gradio_api/file={upload}", "") == "not a file of this app"


def test_the_ip_adapter_section_shows_with_an_adapter_and_its_values_reach_the_request(tmp_path, monkeypatch):
    """Issue #60: the page's "Image prompt (IP-Adapter)" section is shown only when an IP-Adapter is loaded (the
    engine's list once ready, else the flag's file names), its widgets are /generate's IP-Adapter inputs
    (apis/tools.IP_NAMES, in order), its upload event (guard.IP_EVENT) answers the picture as base64 PNG text, and
    the Generate event sends that text, the adapter and the sliders as one IPAdapterUnit of the request (the
    picture's pixels, non-square); with no picture there is no unit."""
    import asyncio
    import base64
    import dataclasses
    import io
    from pathlib import Path

    import gradio as gr
    import numpy as np
    import pytest
    from PIL import Image

    import app
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.service.service import Service
    from sdxl_engine.serving import guard, handler, page_image
    from sdxl_engine.serving.apis.tools import IP_NAMES, generate_inputs
    from tests.helpers import StepEngine

    path = "tests/fixtures/tiny-pt-ip-adapter/sdxl_models/ip-adapter_sdxl.safetensors"
    for paths, names in (("", []), (path, ["ip-adapter_sdxl"])):
        with gr.Blocks():
            section = page_image.ip_section(SimpleNamespace(ip_adapter=paths))
        assert section.box.visible is bool(names) and [v for _, v in section.model.choices] == names
    class Ready(StepEngine):  # the contract's model and config (no Ray)
        config = EngineConfig.load(environ={})

        def scale_out(self):
            return None

    engine = Ready()
    with gr.Blocks():
        assert page_image.ip_section(SimpleNamespace(ip_adapter=path), engine).box.visible is False  # none loaded
    engine.limits = dataclasses.replace(engine.limits, ip_adapters=(("ip-adapter_sdxl", "0a1b2c3d"),))
    config = engine.config
    demo = app.build_demo(Service(engine), config, engine)
    blocks = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    assert blocks["ip-adapter-box"].visible is True and blocks["ip-model"].value == "ip-adapter_sdxl"
    (generate,) = [f for f in demo.fns.values() if f.api_name == "generate"]
    names = [item.name for item in generate_inputs(config)]
    assert [generate.inputs[names.index(n)].elem_id for n in IP_NAMES] == ["ip-image", "ip-model", "ip-weight",
                                                                            "ip-start", "ip-end"]
    # FaceID's face embedding, /generate's last input: a hidden JSON value the page leaves empty (API clients only)
    embeds = generate.inputs[names.index("ip_adapter_embeds")]
    assert (names[-1], embeds.elem_id, embeds.visible, embeds.value) == ("ip_adapter_embeds", "ip-embeds", False, None)
    (upload,) = [f for f in demo.fns.values() if f.api_name == guard.IP_EVENT]
    assert [b.elem_id for b in upload.outputs] == ["ip-image", "ip-picture", "ip-upload"]
    picture = np.zeros((40, 72, 3), np.uint8)
    picture[:, :30] = (200, 40, 10)
    file = tmp_path / "reference.png"
    Image.fromarray(picture).save(file)
    monkeypatch.setattr(handler, "readable", lambda demo, p: Path(p).parent == tmp_path)
    monkeypatch.setattr(handler, "discard_uploads", lambda demo, paths: None)
    text, shown, _ = upload.fn({"path": str(file), "meta": {"_type": "gradio.FileData"}})
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(base64.b64decode(text)))), picture)
    with pytest.raises(gr.Error, match="reference image: not a file this page uploaded"):
        upload.fn({"path": "/etc/hostname"})

    got = []

    async def follow(requests, asked, *args, **kwargs):  # what the event submits to the service
        got.append(asked)
        yield [], {"seeds": [7]}

    monkeypatch.setattr(handler, "follow", follow)
    request = SimpleNamespace(session_hash="s", client=None, headers={})

    async def run(sent):
        return [out async for out in generate.fn(*sent, request=request, progress=lambda *a, **k: None)]

    values = ["a red circle", *[c.value for c in generate.inputs][1:]]
    asyncio.run(run(values))
    assert got[-1].engine.ip_adapter_units == ()
    for name, value in zip(IP_NAMES, (text, "ip-adapter_sdxl", 0.6, 0.2, 0.9), strict=True):
        values[names.index(name)] = value
    asyncio.run(run(values))
    (unit,) = got[-1].engine.ip_adapter_units
    assert (unit.model, unit.weight, unit.guidance_start, unit.guidance_end) == ("ip-adapter_sdxl", 0.6, 0.2, 0.9)
    np.testing.assert_array_equal(unit.image, picture)
    assert got[-1].field("ip_adapter_units[0].weight") == "ip_adapter_weight"  # a refusal names the page's input


def test_the_control_type_shows_for_a_union_with_its_types_and_follows_the_preprocessor():
    """Issue #60: page_image.control_unions reads which ControlNets are unions from their config files, before the
    engine loads them (the union fixture: 8 types; cn-a plain; a path that is not there: none); control_type_choice
    shows the union's type names (6 for xinsir's first union, ProMax's 8), keeps a type the union has, takes the
    preprocessor's (canny: Hard Edge; scribble_xdog: Soft Edge) when it changes or nothing else says, and hides at
    None for a plain ControlNet (nothing sent)."""
    from types import SimpleNamespace

    from sdxl_engine.checkpoint.controlnet import union_types
    from sdxl_engine.serving.page_image import control_type_choice, control_unions

    config = SimpleNamespace(controlnet="tests/fixtures/tiny-pt-controlnet/cn-a:tests/fixtures/tiny-pt-controlnet-union"
                             "/union:x/gone.safetensors", controlnet_dir="", model="tiny-random",
                             model_controlnets=True)
    assert control_unions(config) == {"union": 8}
    assert union_types("tests/fixtures/tiny-pt-controlnet-union/union") == 8
    assert union_types("tests/fixtures/tiny-pt-controlnet/cn-a") == 0 and union_types("x/gone.safetensors") == 0
    unions = {"union": 8, "first": 6}
    plain = control_type_choice(unions, "cn-a", "Depth", "canny")
    assert (plain.visible, plain.value, plain.choices) == (False, None, [])
    shown = control_type_choice(unions, "union [e3b0c442]", None, "none")
    assert shown.visible and shown.value == "OpenPose" and [c[0] for c in shown.choices] == [
        "OpenPose", "Depth", "Soft Edge", "Hard Edge", "Normal Map", "Segmentation", "Tile", "Inpaint"]
    assert [c[0] for c in control_type_choice(unions, "first", None, "none").choices][-1] == "Segmentation"
    assert control_type_choice(unions, "union", None, "canny").value == "Hard Edge"
    assert control_type_choice(unions, "union", "Depth", "canny").value == "Depth"  # the ControlNet changed: kept
    assert control_type_choice(unions, "union", "Depth", "scribble_xdog", True).value == "Soft Edge"
    assert control_type_choice(unions, "union", "Depth", "none", True).value == "Depth"  # none names no type
    assert control_type_choice(unions, "first", "Tile", "tile_resample").value == "OpenPose"  # ProMax's only
