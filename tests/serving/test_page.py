"""The page builder driven by a fake engine (no app process, no compile)."""



def test_page_builder_with_fake_engine():
    """The page is built around a service (sdxl_engine.service) over any engine (a stand-in here: no model)."""
    import app
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.service.service import Service
    from tests.helpers import StepEngine

    demo = app.build_demo(Service(StepEngine()), EngineConfig.load(environ={}))
    api = demo.get_api_info()["named_endpoints"]["/generate"]
    names = [p["parameter_name"] for p in api["parameters"]]
    # The first seven are the /generate contract; later inputs are optional additions.
    assert names[:7] == ["prompt", "negative_prompt", "seed", "guidance_scale", "num_inference_steps", "width",
                         "height"]
    assert names[7:] == ["style", "sampler", "refiner_switch_at", "control_image", "control_model", "control_weight",
                         "control_start", "control_end", "control_module", "model", "schedule_type",
                         "ip_adapter_image", "ip_adapter_model", "ip_adapter_weight", "ip_adapter_start",
                         "ip_adapter_end", "control_type", "ip_adapter_embeds"]
    assert api["parameters"][7]["parameter_has_default"]
    assert [p["parameter_has_default"] for p in api["parameters"]] == [False] + [True] * 24
    assert api["parameters"][-2]["parameter_default"] is None  # control_type: none, a plain ControlNet's
    # ip_adapter_embeds (FaceID's face embedding, API clients only: a hidden JSON value on the page), none by default
    assert api["parameters"][-1]["parameter_default"] is None and api["parameters"][-1]["component"] == "Json"
    assert api["parameters"][-2]["python_type"]["type"] == ("Literal['OpenPose', 'Depth', 'Soft Edge', 'Hard Edge', "
                                                            "'Normal Map', 'Segmentation', 'Tile', 'Inpaint']")
    assert api["parameters"][9]["parameter_default"] == 1  # no refiner loaded: "1 = no refiner"
    assert api["parameters"][8]["python_type"]["type"] == ("Literal['Euler', 'Euler a', 'DPM++ 2M', "
                                                           "'DPM++ 2M Karras', 'DPM++ 2M SDE', 'DPM++ 3M SDE', "
                                                           "'UniPC', 'DDIM', 'LCM', 'Heun', 'DPM2', 'DPM++ SDE', "
                                                           "'TCD', 'DPM2 a', 'LMS', 'Restart']")
    assert len(api["returns"]) == 2  # the gallery and the JSON info (the history record never leaves the server)
    # What view_api shows: whole numbers as int (a slider reports float unless told otherwise).
    assert [p["python_type"]["type"] for p in api["parameters"][:7]] == ["str", "str", "int", "float", "int", "int",
                                                                          "int"]


def test_the_refiner_switch_shows_only_with_a_refiner_and_1_is_none():
    """The refiner slider (under the advanced settings, an input of /generate and of the image event) is hidden
    at 1 without a refiner and shown at 0.8 with one; the API's default follows; tools.refiner_switch reads 1
    (and None) as no refiner and passes anything else on for the engine to check."""
    import app
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.serving.apis.tools import refiner_switch
    from tests.helpers import FIXTURES

    def slider_and_default(config):
        demo = app.build_demo(lambda *v, **kw: ([], {}, None), config)
        slider = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "refiner-switch")
        api = demo.get_api_info()["named_endpoints"]["/generate"]
        return slider.visible, slider.value, api["parameters"][9]["parameter_default"]

    assert slider_and_default(EngineConfig.load(environ={})) == (False, 1.0, 1.0)
    refined = EngineConfig.load({"model": str(FIXTURES / "tiny-pt"), "refiner": str(FIXTURES / "tiny-pt-refiner")},
                                environ={})
    assert slider_and_default(refined) == (True, 0.8, 0.8)
    assert [refiner_switch(v) for v in (None, 1, 1.0, 0.8, 0.0, 0, "x", 1.5)] == [None, None, None, 0.8, 0, 0, "x",
                                                                                    1.5]


def test_page_lists_the_loras_and_a_click_adds_a_tag(tmp_path):
    """The page lists the configured LoRAs (names from --lora and --lora-dir, in that order); a click
    appends ``<lora:NAME:1>`` to the prompt; an index the page never sends is refused in one line."""
    import gradio as gr
    import pytest

    import app
    from sdxl_engine.config import EngineConfig
    from tests.helpers import FIXTURES

    (tmp_path / "ink.safetensors").write_bytes(b"")
    config = EngineConfig.load({"lora": f"peft={FIXTURES / 'tiny-pt-lora' / 'peft.safetensors'}",
                                "lora_dir": str(tmp_path)}, environ={})
    demo = app.build_demo(lambda *v, **kw: ([], {}, None), config)
    listing = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "loras")
    # the deployment's (--lora, then --lora-dir), then tiny-shapes' own LCM-LoRA (its loras.json)
    assert listing.visible and [s[0] for s in listing.samples] == ["<lora:peft:1>", "<lora:ink:1>", "<lora:lcm:1>"]
    add = next(f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "add_lora")
    assert add(1, "a red circle ", "tiny-shapes") == "a red circle <lora:ink:1>"  # before the engine is ready
    assert add(0, "", "tiny-shapes") == add(0, None, "tiny-shapes") == "<lora:peft:1>"
    with pytest.raises(gr.Error):
        add(3, "x", "tiny-shapes")
    shipped = app.build_demo(lambda *v, **kw: ([], {}, None), EngineConfig.load(environ={}))
    assert [s[0] for s in next(b for b in shipped.blocks.values() if getattr(b, "elem_id", None) == "loras").samples
            ] == ["<lora:lcm:1>"]
    plain = app.build_demo(lambda *v, **kw: ([], {}, None), EngineConfig.load({"model": "tiny-random"}, environ={}))
    assert not next(b for b in plain.blocks.values() if getattr(b, "elem_id", None) == "loras").visible


def test_stopped_view_says_where_and_gives_the_last_finished_result_back():
    """After Stop: "Stopped at step k of N; nothing saved", with the last finished gallery and details back
    (its own status line after the message), or an empty gallery when nothing finished before; after a
    failure that was no Stop, the line goes and the gallery stays."""
    import gradio as gr
    import pytest

    from sdxl_engine.serving import page

    info = {"seeds": [7, 8, 9, 10], "latency_s": 1.5, "device": "4 × cpu", "width": 64, "height": 64,
            "num_inference_steps": 8, "sampler": "Euler", "guidance_scale": 5.0, "model": "tiny-shapes",
            "timings_s": {"queue": 0.0, "prep": 0.001, "device": 1.4, "post": 0.002}}
    last = {"gallery": [("/tmp/a.png", "seed 7 · 1.50 s"), ("/tmp/b.png", "seed 8 · 1.50 s")], "info": info}
    gallery, details, status = page.stopped_view(last, "4/50")
    assert gallery == last["gallery"] and details is info
    assert status == ("**Stopped at step 4 of 50; nothing saved.** Below, the last finished request: "
                      + page.status_line(info))
    assert status.endswith("seeds 7–10, style **(No style)**, model `tiny-shapes`")
    refined = {**info, "refiner": "tiny-pt-refiner", "refiner_switch_at": 0.8}
    assert page.status_line(refined).endswith("model `tiny-shapes` + refiner `tiny-pt-refiner` from 0.8 of the steps")
    upscaled = {**info, "hires": {"scale": 1.5, "strength": 0.4}}
    assert page.status_line(upscaled).endswith("model `tiny-shapes` · upscaled ×1.5 (hires fix, strength 0.4)")
    assert "64×64, 8 Euler steps, CFG 5," in page.status_line(info)
    assert "64×64, 8 Euler steps (Karras schedule), CFG 5," in page.status_line({**info, "schedule_type": "karras"})
    assert "64×64, 8 Euler steps (SGM Uniform schedule), CFG 5," in page.status_line({**info,
                                                                                     "schedule_type": "sgm_uniform"})
    assert "8 Euler steps, CFG 5," in page.status_line({**info, "schedule_type": "automatic"})
    assert "64×64, 1 Euler step, CFG 5," in page.status_line({**info, "num_inference_steps": 1})  # not "1 ... steps"
    assert page.stopped_view(None, "12/30") == ([], None, "**Stopped at step 12 of 30; nothing saved.**")
    assert page.stopped_view(None, "waiting") == ([], None, "**Stopped before its first step; nothing saved.**")
    assert page.stopped_view(last, "") == (gr.update(), gr.update(), "")  # another failure: the line goes
    with pytest.raises(ValueError, match="heard: expected 'k/N', 'waiting' or '', got '<b>4/50'"):
        page.stopped_view(last, "<b>4/50")


def test_api_function_keeps_the_last_finished_gallery_for_the_session(tmp_path, monkeypatch):
    """The Generate event keeps each session's finished gallery and details where the page's follow-up event
    takes them (the state a Stop shows again); the history record goes to its own holder."""
    import asyncio
    from types import SimpleNamespace

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.service.service import Service
    from sdxl_engine.serving import handler, history
    from tests.serving.test_handler_follow import PageEngine

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    fake = PageEngine()
    fake.go(100)
    pending, finished = history.Pending(), history.Pending(max_per_session=1)
    generate = handler.api_function(Service(fake), EngineConfig.load(environ={}), pending, finished)
    request = SimpleNamespace(session_hash="s1", client=SimpleNamespace(host="10.0.0.1"), headers={})

    async def run():
        return [out async for out in generate("a red circle", seed=1, num_inference_steps=2, width=48, height=32,
                                              request=request, progress=lambda *a, **k: None)]

    gallery, info = asyncio.run(run())[-1]
    assert [caption.split(" · ")[0] for _, caption in gallery] == ["seed 1", "seed 2"] and info["seeds"] == [1, 2]
    assert finished.pop("s1") == {"gallery": gallery, "info": info}
    record = pending.pop("s1")
    assert record["prompt"] == "a red circle" and record["seeds"] == [1, 2] and finished.pop("s1") is None


def test_png_settings_restores_this_servers_and_a1111s_parameters():
    """A PNG's parameters text back into the page's fields: this server's (a style taken back out of the
    prompts it wrapped), A1111's (DPM++ 2M with Schedule type Karras), and what the page cannot take named."""
    import pytest

    from sdxl_engine.service.images import a1111_parameters
    from sdxl_engine.service.styles import apply_style
    from sdxl_engine.serving import page

    styled, negative = apply_style("Cinematic", "a green square, big", "blurry")
    text = a1111_parameters(styled, negative, 12, 4.5, 77, 64, 64, "tiny-shapes", {"Style": "Cinematic"}, "DDIM")
    values, note = page.png_settings(text, ["64x64", "80x48"], 50, 2**32 - 1)
    assert values == {"prompt": "a green square, big", "negative_prompt": "blurry", "style": "Cinematic", "seed": 77,
                      "guidance_scale": 4.5, "num_inference_steps": 12, "sampler": "DDIM", "schedule_type": "Automatic",
                      "resolution": "64x64"}
    assert note == ("Restored from the PNG: prompt, negative prompt, style, seed, CFG, steps, sampler, schedule type, "
                    "size; press **Generate** to make it again.")
    ddim = text.replace("Sampler: DDIM", "Sampler: DDIM, Eta DDIM: 0.5")  # eta: the APIs' field, not the page's
    assert "Eta DDIM: 0.5" in ddim and page.png_settings(ddim, ["64x64", "80x48"], 50, 2**32 - 1) == (
        values, note.replace("to make it again.", "to make it again. Not restored: eta ddim '0.5' (this page runs "
                             "each sampler's default eta; the A1111 and jobs APIs take eta)."))
    a1111 = ("masterpiece, a cat <lora:ink:0.5>\nwearing a hat\nNegative prompt: lowres, \"bad\"\n"
             "Steps: 70, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7, Seed: 1234, Size: 1024x1024, "
             "Model hash: 31e35c80fc, Model: sd_xl_base_1.0, Style: \"My, style\", Version: v1.10.1")
    values, note = page.png_settings(a1111, ["64x64"], 50, 2**32 - 1)
    assert values == {"prompt": "masterpiece, a cat <lora:ink:0.5>\nwearing a hat", "negative_prompt": 'lowres, "bad"',
                      "style": "(No style)", "seed": 1234, "guidance_scale": 7.0, "sampler": "DPM++ 2M",
                      "schedule_type": "Karras"}
    assert note == ("Restored from the PNG: prompt, negative prompt, style, seed, CFG, sampler, schedule type; press "
                    "**Generate** to make it again. Not restored: style 'My, style' (not one of this page's: its words "
                    "stay in the prompt); Steps '70' (this page takes 1 to 50); size 1024x1024 (not one of this "
                    "model's sizes).")
    values, note = page.png_settings("a cat\nSteps: 4, Seed: 5", [], 50, 99)
    assert values == {"prompt": "a cat\nSteps: 4, Seed: 5", "negative_prompt": "",
                      "style": "(No style)"}  # fewer than 3 fields: A1111 reads the line as prompt
    values, note = page.png_settings("a cat\nSteps: 4, Sampler: DPM adaptive, Seed: x, CFG scale: 2", [], 50, 99)
    assert values["num_inference_steps"] == 4 and "sampler 'DPM adaptive' (not one of this server's)" in note
    assert "Seed 'x' (this page takes 0 to 99)" in note
    values, note = page.png_settings("a cat\nSteps: 4, Sampler: DPM2 a, Schedule type: Align Your Steps, Seed: 5",
                                     [], 50, 99)  # the sampler is restored; the schedule type it lacks is named
    assert values["sampler"] == "DPM2 a" and "schedule_type" not in values
    assert "Not restored: schedule type 'Align Your Steps' (not one of this server's)" in note and "DPM2" not in note
    restored = page.png_settings("a cat\nSteps: 4, Sampler: Euler, Schedule type: Trailing, Seed: 5", [], 50, 99)[0]
    assert (restored["sampler"], restored["schedule_type"]) == ("Euler", "Trailing")  # the page's own spacings
    note = page.png_settings('a cat\nSteps: 4, Seed: 5, ControlNet 0: "Module: none, Model: union, Weight: 1.0", '
                             'ControlNet 1: "Module: ip-adapter-auto, Model: ip"', [], 50, 99)[1]
    assert note.endswith("Not restored: ControlNet 0, ControlNet 1 (a ControlNet or IP-Adapter unit: the PNG holds "
                         "its settings, not its image; set it in the ControlNet section).")  # not dropped unsaid
    restored = page.png_settings("a cat\nSteps: 4, Sampler: UniPC, Schedule type: Karras, Seed: 5", [], 50, 99)[0]
    assert (restored["sampler"], restored["schedule_type"]) == ("UniPC", "Karras")  # one of this server's since #61
    restored = page.png_settings("a cat\nSteps: 24, Sampler: Restart, Schedule type: Karras, Seed: 5", [], 50, 99)[0]
    assert (restored["sampler"], restored["schedule_type"]) == ("Restart", "Karras")  # A1111's Restart too
    assert page.png_settings(" ", [], 50, 99) == ({}, "That file has no generation parameters (no `parameters` text "
                                                     "in a PNG): nothing restored.")
    with pytest.raises(ValueError, match="at most 60000 characters"):
        page.png_settings("x" * 60_001, [], 50, 99)


def test_png_settings_restores_the_refiner_switch_and_names_what_the_text_form_cannot_make_again():
    """With a refiner loaded the PNG's ``Refiner switch at`` goes back on the slider (1, base model only, for
    a PNG made without one); without a refiner, and for a hires fix or an image to image, the note says so."""
    from sdxl_engine.service.images import a1111_parameters
    from sdxl_engine.serving import page

    refined = a1111_parameters("a cat", "", 12, 4.5, 77, 64, 64, "tiny-shapes",
                               {"Refiner": "tiny-refiner", "Refiner switch at": 0.65}, "Euler")
    values, note = page.png_settings(refined, ["64x64"], 50, 99, refiner=True)
    assert values["refiner_switch_at"] == 0.65 and values["seed"] == 77 and "refiner switch;" in note
    values, note = page.png_settings(refined, ["64x64"], 50, 99, refiner=False)
    assert "refiner_switch_at" not in values
    assert "Not restored: refiner switch at '0.65' (no refiner on this server)." in note
    plain = a1111_parameters("a cat", "", 12, 4.5, 77, 64, 64, "tiny-shapes", {}, "Euler")
    assert page.png_settings(plain, ["64x64"], 50, 99, refiner=True)[0]["refiner_switch_at"] == 1.0
    assert "refiner_switch_at" not in page.png_settings(plain, ["64x64"], 50, 99)[0]
    hires = a1111_parameters("a cat", "", 12, 4.5, 77, 96, 96, "tiny-shapes",
                             {"Denoising strength": 0.5, "Hires upscale": 1.5, "Hires upscaler": "Latent"}, "Euler")
    values, note = page.png_settings(hires, ["64x64"], 50, 99)
    assert "hires fix (upscale '1.5': the images were upscaled after" in note and "resolution" not in values
    resized = hires.replace("Hires upscale: 1.5", "Hires resize: 96x0")  # A1111's record of hr_resize_x
    assert "hires fix (resize '96x0': the images were" in page.png_settings(resized, ["64x64"], 50, 99)[1]
    picture = a1111_parameters("a cat", "", 12, 4.5, 77, 64, 64, "tiny-shapes", {"Denoising strength": 0.4}, "Euler")
    assert "denoising strength '0.4' (made from a picture" in page.png_settings(picture, ["64x64"], 50, 99)[1]


def test_a_history_record_made_from_a_picture_restores_its_settings_but_not_its_size():
    """The history keeps whether an image was made from a picture (img2img's ``strength``, an upscale's ``hires``
    in the info); restoring one leaves the resolution (the picture's size, not one the page offers) and says why."""
    import numpy as np

    from sdxl_engine.serving import history
    from sdxl_engine.serving.page_history import restored_size

    user = {"prompt": "a cat", "negative_prompt": "", "style": "(No style)"}
    info = {"seeds": [5, 6], "guidance_scale": 7.0, "num_inference_steps": 4, "width": 64, "height": 64,
            "model": "tiny", "latency_s": 1.0}
    images = np.zeros((2, 8, 8, 3), np.uint8)
    text = history.make_record(user, info, images)
    assert "from_image" not in text
    assert restored_size({**text, "time": "t"}, 6) == ("64x64", "Restored seed 6 from t (tiny); press **Generate** "
                                                                "to make it again.")
    upscaled = history.make_record(user, {**info, "width": 96, "height": 96, "hires": {"scale": 1.5}}, images)
    edited = history.make_record(user, {**info, "strength": 0.5}, images)
    assert upscaled["from_image"] is True and edited["from_image"] is True
    size, note = restored_size({**upscaled, "time": "t"}, 5)
    assert size is None and "made from a picture (96x96)" in note and "Image to image" in note


def test_every_page_event_reads_the_nine_inputs_in_the_declared_order(monkeypatch):
    """/generate's inputs (apis/tools.generate_inputs: its contract order) begin the three page events' signatures
    (Gradio reads their parameter names and positions; app.py lists the page's components in that order), and
    /generate's request holds each value under its name."""
    import asyncio
    import inspect
    from types import SimpleNamespace

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.serving import handler, history
    from sdxl_engine.serving.apis.tools import generate_inputs

    config = EngineConfig.load(environ={})
    names = tuple(i.name for i in generate_inputs(config))[:9]
    functions = [handler.api_function(None, config, history.Pending()),
                 handler.image_function(None, config, history.Pending(), None, None),
                 handler.upscale_function(None, config, history.Pending(), None, None)]
    for function in functions:
        assert tuple(inspect.signature(function).parameters)[:9] == names, function.__name__
    sent = dict(zip(names, ("p", "n", 7, 3.5, 6, 64, 80, "Anime", "Euler a")))
    got = []

    async def follow(requests, asked, *args, **kwargs):  # what the event submits to the service
        got.append(asked)
        yield [], {"seeds": [7]}

    monkeypatch.setattr(handler, "follow", follow)
    generate = handler.api_function(None, config, history.Pending())

    async def run():
        return [out async for out in generate(**sent, request=SimpleNamespace(session_hash="s", client=None,
                                                                                 headers={}),
                                               progress=lambda *a, **k: None)]

    asyncio.run(run())
    engine = got[0].engine
    assert (got[0].prompt, got[0].negative_prompt, engine.seed, engine.guidance_scale, engine.num_inference_steps,
            engine.width, engine.height, got[0].style, engine.sampler) == tuple(sent.values())


def test_a_page_load_on_a_ready_server_shows_no_starting_message():
    """The page is built while the engine starts; once it is ready, a page load shows no "Starting the engine"
    line: the page as served (its config) has an empty banner, and the load event puts the engine's line in."""
    import app
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.contract import clock
    from sdxl_engine.service.service import Service
    from tests.helpers import StepEngine

    class Starting(StepEngine):  # the contract's start state, device summary and model (no refiner, no Ray)
        config = EngineConfig.load(environ={})

        def scale_out(self):
            return None

    engine = Starting()
    engine.ready.clear()
    demo = app.build_demo(Service(engine), EngineConfig.load(environ={}), engine)
    banner = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "engine-status")
    refresh = next(f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "refresh")
    engine.stage, engine.started = "loading model onto the devices", clock()  # (after the build: 0 s so far)
    assert refresh()[0].startswith("**Starting the engine: loading model onto the devices** — 0 s so far.")
    engine.startup["ready_s"] = 3.25
    engine.ready.set()  # minutes later: the server is ready, the page's config is the one built above
    served = next(c for c in demo.config["components"] if c["id"] == banner._id)
    assert served["props"]["value"] == ""
    assert refresh()[0] == "Ready on **1 x cpu** — model `step-model` (float32), started in 3.2 s"


def test_gradio_client_naming_a_model_gets_its_own_settings_for_those_it_leaves_out(monkeypatch):
    """gradio_client fills a left-out input with the page's default (the default model's sampler, steps and
    guidance): on /generate and /image_to_image, such a call naming a model runs that model's own (None: the
    engine's defaults for it, as A1111, MCP and the jobs API); values it sets are kept, and so are the page's."""
    import asyncio
    import base64
    from types import SimpleNamespace

    import numpy as np

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.service.images import png_bytes
    from sdxl_engine.serving import handler, history
    from sdxl_engine.serving.apis import mcp_image

    config = EngineConfig.load(environ={})  # the page's defaults: Euler, 20 steps, guidance 5
    got = []

    async def follow(requests, asked, *args, **kwargs):  # what the event submits to the service
        got.append(asked.engine)
        yield [], {"seeds": [7]}

    monkeypatch.setattr(handler, "follow", follow)
    monkeypatch.setattr(mcp_image, "follow", follow)
    generate = handler.api_function(None, config, history.Pending())

    def call(headers, **values):
        request = SimpleNamespace(session_hash="s", client=None, headers=headers)
        asyncio.run(anext(generate(prompt="p", request=request, progress=lambda *a, **k: None, **values)))
        return got[-1].sampler, got[-1].num_inference_steps, got[-1].guidance_scale

    client = {"x-gradio-user": "api"}
    page_defaults = dict(sampler="Euler", num_inference_steps=20, guidance_scale=5.0)  # what gradio_client sends
    assert (config.sampler, config.num_inference_steps, config.guidance_scale) == tuple(page_defaults.values())
    assert call(client, model="b", **page_defaults) == (None, None, None)  # b's own
    assert call(client, model="b", **{**page_defaults, "num_inference_steps": 6}) == (None, 6, None)
    assert call(client, **page_defaults) == ("Euler", 20, 5.0)  # the default model: its own are these
    assert call({}, model="b", **page_defaults) == ("Euler", 20, 5.0)  # the page's widgets, as set
    picture = "data:image/png;base64," + base64.b64encode(png_bytes(np.zeros((8, 8, 3), np.uint8))).decode()
    image_tool = mcp_image.image_tool(None, config)
    asyncio.run(image_tool(prompt="p", image=picture, model="b", request=SimpleNamespace(
        session_hash="s", client=None, headers=client), **page_defaults))
    assert (got[-1].sampler, got[-1].num_inference_steps, got[-1].guidance_scale) == (None, None, None)


def test_the_schedule_type_dropdown_is_generates_input_and_its_value_reaches_the_request(monkeypatch):
    """Issue #62: the page's "Schedule type" dropdown (A1111's labels, Automatic) is the /generate event's input in
    schedule_type's place (apis/tools.generate_inputs: every input's widget by name); the label it sends reaches the
    service's request; a PNG's ``Schedule type: Karras`` and a past image's record go back into it."""
    import asyncio
    from types import SimpleNamespace

    import app
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.service.images import a1111_parameters
    from sdxl_engine.service.service import Service
    from sdxl_engine.serving import handler, page
    from sdxl_engine.serving.apis.tools import generate_inputs
    from tests.helpers import StepEngine

    config = EngineConfig.load(environ={})
    demo = app.build_demo(Service(StepEngine()), config)
    (generate,) = [f for f in demo.fns.values() if f.api_name == "generate"]
    names = [item.name for item in generate_inputs(config)]
    dropdown = generate.inputs[names.index("schedule_type")]
    assert (dropdown.elem_id, dropdown.label, dropdown.value) == ("schedule-type", "Schedule type", "Automatic")
    assert [label for label, _ in dropdown.choices] == ["Automatic", "Uniform", "Karras", "Exponential",
                                                        "SGM Uniform", "Simple", "Beta", "Leading", "Linspace",
                                                        "Trailing"]
    assert [c.elem_id for c in generate.inputs[:9]] == ["prompt", "negative", "seed", None, "steps", None, None,
                                                         "style", "sampler"]
    got = []

    async def follow(requests, asked, *args, **kwargs):  # what the event submits to the service
        got.append(asked.engine)
        yield [], {"seeds": [7]}

    monkeypatch.setattr(handler, "follow", follow)
    values = [c.value for c in generate.inputs]
    values[names.index("schedule_type")] = "Karras"
    request = SimpleNamespace(session_hash="s", client=None, headers={})

    async def run(sent):
        return [out async for out in generate.fn(*sent, request=request, progress=lambda *a, **k: None)]

    asyncio.run(run(["a red circle", *values[1:]]))
    assert got[-1].schedule_type == "Karras" and got[-1].sampler == config.sampler
    text = a1111_parameters("a cat", "", 12, 4.5, 77, 64, 64, "tiny-shapes", {"Schedule type": "Karras"}, "Euler")
    values, note = page.png_settings(text, ["64x64"], 50, 99)
    assert (values["sampler"], values["schedule_type"]) == ("Euler", "Karras") and "sampler, schedule type" in note
    (restore,) = [f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "restore"]
    record = {"time": "t", "prompt": "a cat", "negative_prompt": "", "style": "(No style)", "seeds": [5],
              "guidance_scale": 4.5, "num_inference_steps": 12, "sampler": "Euler", "width": 64, "height": 64,
              "model": "step-model", "schedule_type": "sgm_uniform"}
    restored = restore([record], SimpleNamespace(index=0))
    assert restored[6:8] == ("Euler", "SGM Uniform")
    assert restore([{**record, "schedule_type": None}], SimpleNamespace(index=0))[7] == "Automatic"  # an old record


def test_a_pngs_controlnet_and_ip_adapter_entries_parse_as_a1111_reads_them_and_leave_the_restore_as_it_was():
    """Issue #60: a PNG with a ControlNet unit's and an IP-Adapter unit's entries (engine/control and
    engine/ip_adapter ``infotext``, JSON-quoted as the delivery writes them: their values hold commas): A1111's
    parse (apis.a1111.generation_parameters) reads each back as it was, and the page's PNG restore (which restores
    no unit, and names them as not restored) reads the rest of the text as it does without them."""
    import json

    import numpy as np

    from sdxl_engine.engine.control import ControlUnit, infotext
    from sdxl_engine.engine.ip_adapter import IPAdapterUnit
    from sdxl_engine.engine.ip_adapter import infotext as ip_infotext
    from sdxl_engine.service.images import a1111_parameters
    from sdxl_engine.serving.apis.a1111 import generation_parameters
    from sdxl_engine.serving.page import png_settings

    picture = np.zeros((8, 8, 3), np.uint8)
    written = {**infotext([ControlUnit(image=picture, model="cn-a", module="canny")], {}),
               **ip_infotext([IPAdapterUnit(image=picture, model="ip-adapter_sdxl", weight=0.6)],
                             {"ip-adapter_sdxl": "ip-adapter_sdxl [0a1b2c3d]"}, first=1)}
    assert list(written) == ["ControlNet 0", "ControlNet 1"]
    text = a1111_parameters("a cat", "", 10, 5.0, 7, 64, 48, "tiny-pt",
                            {key: json.dumps(value) for key, value in written.items()})
    parsed = generation_parameters(text)
    assert {key: parsed[key] for key in written} == written and (parsed["Seed"], parsed["Steps"]) == ("7", "10")
    args = (["64x48"], 20, 2**31 - 1)
    values, note = png_settings(text, *args)
    without = png_settings(a1111_parameters("a cat", "", 10, 5.0, 7, 64, 48, "tiny-pt"), *args)
    assert values == without[0]  # the same values; the note says the units were not restored
    assert note == without[1] + (" Not restored: ControlNet 0, ControlNet 1 (a ControlNet or IP-Adapter unit: the "
                                 "PNG holds its settings, not its image; set it in the ControlNet section).")
