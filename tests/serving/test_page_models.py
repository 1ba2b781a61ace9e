"""The page's Model dropdown (page.model_settings) and Model default button (page.model_default_settings): a model
chosen on the page brings its own sampler, steps and guidance (what a request for it through any API that sets none
of them runs with), its sizes and the ControlNets and IP-Adapters that fit it once loaded; an unknown name is
refused."""

import threading
import types

import gradio as gr
import pytest

from sdxl_engine.checkpoint.weights import ModelLoadError
from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.serving.page import (
    model_default_label,
    model_default_settings,
    model_settings,
    model_widgets,
    page_event,
)

DEFAULTS = {"a": EngineConfig(), "b": EngineConfig(sampler="DPM++ 2M", num_inference_steps=6, guidance_scale=2.0),
            "broken": None}
LIMITS_A = types.SimpleNamespace(default_size=(64, 48), sizes=((64, 48), (48, 64)), controlnets=(("cn-a", "x"),),
                                 ip_adapters=(("ip-a", "w"),))
LIMITS_B = types.SimpleNamespace(default_size=(96, 64), sizes=((96, 64), (64, 96), (80, 80)),
                                 controlnets=(("cn-b", "y"), ("cn-c", "z")), ip_adapters=())


class Catalogued:
    """The local engine's models calls (engine/local.Engine): a loaded, b not until ``loaded["b"]`` is set."""

    error = None
    default_model = "a"
    limits = LIMITS_A
    config = EngineConfig()  # its LoRAs (tiny-shapes' lcm) choose the Fast button's preset (page.fast_preset_for)

    def __init__(self, ready=True):
        self.ready = threading.Event()
        if ready:
            self.ready.set()
        self.loaded = {"a": LIMITS_A}

    def model_names(self):
        return list(DEFAULTS)

    def find_model(self, text):
        return text if text in DEFAULTS else None

    def _check(self, name):
        if name is not None and name not in DEFAULTS:
            raise InvalidRequest("model", f"unknown model {name!r}; this server offers: a, b, broken")

    def limits_for(self, name):
        self._check(name)
        return self.loaded.get(name or "a")

    def lora_names_for(self, name):
        self._check(name)
        return ("lcm", "ink") if (name or "a") == "a" else ("ink",)

    def defaults_for(self, name):
        self._check(name)
        if DEFAULTS[name or "a"] is None:
            raise ModelLoadError("broken/engine_defaults.json: expected a JSON object")
        return DEFAULTS[name or "a"]


def updated(update):
    return {k: v for k, v in update.items() if k != "__type__"}


def test_a_loaded_model_brings_its_defaults_sizes_and_controlnets():
    engine = Catalogued()
    engine.loaded["b"] = LIMITS_B
    sampler, steps, guidance, button, resolution, controlnet, fast, note, loras, ip, examples = model_settings(engine,
                                                                                                           "b")
    assert (sampler, steps, guidance) == ("DPM++ 2M", 6, 2.0)
    assert updated(button) == {"value": "Model default (DPM++ 2M, 6 steps)"}
    assert updated(fast) == {"visible": False}  # b has no LoRA named lcm: no few-steps preset for it
    assert updated(note) == {"value": "", "visible": False}  # not a built-in model: no note on tiny-shapes
    assert updated(loras) == {"samples": [["<lora:ink:1>"]], "visible": True}  # b's own LoRAs only
    assert updated(resolution)["value"] == "96x64"
    assert [value for _, value in updated(resolution)["choices"]] == ["96x64", "64x96", "80x80"]
    assert updated(resolution)["choices"][0][0] == "96 × 64 (landscape, default)"
    assert updated(controlnet) == {"choices": ["cn-b", "cn-c"], "value": "cn-b"}
    assert updated(ip) == {"choices": [], "value": ""}  # no IP-Adapter fits b
    back = model_settings(engine, "a")  # and back: the default model's own again
    assert back[:3] == ("Euler", 20, 5.0) and updated(back[3]) == {"value": "Model default (Euler, 20 steps)"}
    assert updated(back[4])["value"] == "64x48" and updated(back[5]) == {"choices": ["cn-a"], "value": "cn-a"}
    assert updated(back[6]) == {"visible": True}
    assert updated(back[8]) == {"samples": [["<lora:lcm:1>"], ["<lora:ink:1>"]], "visible": True}
    assert updated(back[9]) == {"choices": ["ip-a"], "value": "ip-a"}
    assert updated(examples)["samples"][0] == ["a photograph of an astronaut riding a horse", "(No style)"]


def test_the_examples_follow_the_model(monkeypatch):
    """A built-in model shows tiny-shapes' example prompts, another real SDXL ones, and a click loads the example
    the chosen model shows (the default model's when the dropdown names none); an index past them is refused."""
    from sdxl_engine.serving import page

    monkeypatch.setattr(page, "MODEL_NOTES", {"a": "Model `a`. "})
    assert updated(model_settings(Catalogued(), "a")[10])["samples"][0] == [page.EXAMPLES[0], "(No style)"]
    load = page.example_loader("a")
    assert load(0, "a") == load(0, None) == (page.EXAMPLES[0], "(No style)")
    assert load(0, "b") == (page.SDXL_EXAMPLES[0], "(No style)")
    with pytest.raises(IndexError, match="no example 5"):
        load(5, "b")
    with pytest.raises(TypeError):
        load(0, {"junk": 1})


def test_the_note_follows_the_model(monkeypatch):
    """A built-in model's note (tiny-shapes') shows for it and goes for another model; the default's shows at once."""
    from sdxl_engine.serving import page

    engine = Catalogued()
    monkeypatch.setattr(page, "MODEL_NOTES", {"a": "Model `a`: shapes. "})
    note = updated(model_settings(engine, "a")[7])
    assert note["visible"] and note["value"].startswith("Model `a`: shapes. For real SDXL, start it with")
    assert updated(model_settings(engine, "b")[7]) == {"value": "", "visible": False}


def test_a_lora_click_adds_the_chosen_models_lora():
    """The LoRA list's click reads the list the chosen model shows (a's: lcm, ink; b's: ink), the configured ones
    before the engine is ready; an index past the model's list is refused."""
    from sdxl_engine.serving.page import lora_tag_adder

    config = EngineConfig.load({"model": "tiny-random", "lora_dir": ""}, environ={})
    add = lora_tag_adder(Catalogued(), config)
    assert add(0, "x", "a") == "x <lora:lcm:1>" and add(0, "x", "b") == "x <lora:ink:1>"
    with pytest.raises(IndexError, match="no LoRA 1"):
        add(1, "x", "b")
    with pytest.raises(IndexError, match="no LoRA 0"):  # not ready: tiny-random's configured list is empty
        lora_tag_adder(Catalogued(ready=False), config)(0, "x", "a")


def test_a_model_not_loaded_yet_brings_its_defaults_and_lets_the_engine_choose_its_size():
    sampler, steps, guidance, button, resolution, controlnet, fast, *_ = model_settings(Catalogued(), "b")
    assert (sampler, steps, guidance) == ("DPM++ 2M", 6, 2.0)
    assert updated(resolution) == {"choices": [("model default", "0x0")], "value": "0x0"}
    assert updated(controlnet) == {}  # which ControlNets fit it is known once it is loaded


def test_nothing_changes_before_the_engine_is_ready_or_for_refused_defaults():
    for engine, name in ((None, "b"), (Catalogued(ready=False), "b"), (Catalogued(), "broken")):
        assert all(updated(u) == {} for u in model_settings(engine, name))


def test_an_unknown_model_is_refused_by_name():
    with pytest.raises(LookupError, match="unknown model 'z'; this server offers: a, b, broken"):
        model_settings(Catalogued(), "z")
    with pytest.raises(gr.Error, match="values the page does not send"):  # as the page's event runs it
        page_event(lambda name: model_settings(Catalogued(), name))("z")


def test_model_default_takes_the_chosen_models_settings_and_drops_the_fast_tag():
    config = EngineConfig(num_inference_steps=8)  # the page's resolved defaults (the default model's)
    engine = Catalogued()
    assert model_default_settings(engine, config, "b", "a star <lora:lcm:1>") == ("DPM++ 2M", 6, 2.0, "a star")
    assert model_default_settings(engine, config, "a", "a star") == ("Euler", 20, 5.0, "a star")
    for before in (None, Catalogued(ready=False)):  # no engine yet: the page's own defaults
        assert model_default_settings(before, config, "b", "a star") == ("Euler", 8, 5.0, "a star")
    assert model_default_settings(engine, config, "broken", "a star") == ("Euler", 8, 5.0, "a star")
    with pytest.raises(LookupError, match="unknown model 'z'"):
        model_default_settings(engine, config, "z", "a star")
    assert model_default_label(DEFAULTS["b"]) == "Model default (DPM++ 2M, 6 steps)"


def test_a_png_restores_its_model_when_the_page_offers_it():
    """png_settings with the page's models (a server with several): the PNG's Model comes back when offered, else is
    named as not restored; with one model (no models given) the model is left alone, as before."""
    from sdxl_engine.service.images import a1111_parameters
    from sdxl_engine.serving.page import png_model, png_settings

    text = a1111_parameters("a red circle", "", 20, 5.0, 7, 96, 64, "b", {}, "Euler")
    values, note = png_settings(text, ["96x64"], 50, 2**32 - 1, models=["a", "b"])
    assert values["model"] == "b" and values["resolution"] == "96x64"
    assert note == ("Restored from the PNG: prompt, negative prompt, style, seed, CFG, steps, sampler, schedule type, "
                    "size, model; press **Generate** to make it again.")
    values, note = png_settings(text, ["96x64"], 50, 2**32 - 1, models=["a", "c"])
    assert "model" not in values and note.endswith("Not restored: model 'b' (not on this server).")
    values, _ = png_settings(text, ["96x64"], 50, 2**32 - 1)
    assert "model" not in values
    assert png_model(text, ["a", "b"]) == "b" and png_model(text, ["a"]) is None and png_model(text, []) is None
    assert png_model("", ["a", "b"]) is None and png_model(None, ["a", "b"]) is None


def test_a_restored_model_keeps_the_restored_size_among_its_own():
    """model_widgets after a restore (history, PNG): the restored size stays when the model has it (loaded), and is
    offered beside "model default" before the model is loaded; another size gives way to the model's default."""
    engine = Catalogued()
    engine.loaded["b"] = LIMITS_B
    button, resolution, _, fast, *_ = model_widgets(engine, "b", size="80x80")
    assert updated(resolution)["value"] == "80x80" and updated(button) == {"value": "Model default (DPM++ 2M, 6 steps)"}
    assert updated(model_widgets(engine, "b", size="64x48")[1])["value"] == "96x64"  # not one of b's
    del engine.loaded["b"]
    resolution = updated(model_widgets(engine, "b", size="80x80")[1])
    assert resolution == {"choices": [("model default", "0x0"), ("80 × 80", "80x80")], "value": "80x80"}
    assert updated(model_widgets(engine, "b", size="junk")[1]) == {"choices": [("model default", "0x0")],
                                                                   "value": "0x0"}


def test_the_dropdown_offers_two_or_more_models_once_ready_and_a_png_restores_with_its_models_sizes(runtime_log):
    """serving/page_models: offered() is the engine's names once ready (none for one model, before it is ready);
    png_choices gives the sizes of the model a PNG names once loaded, else the default's; page.chosen_model is
    the one reading of a name for every model event: None before ready or for refused defaults (one log line),
    LookupError for an unknown name."""
    from sdxl_engine.service.images import a1111_parameters
    from sdxl_engine.serving.page import chosen_model
    from sdxl_engine.serving.page_models import offered, png_choices

    engine = Catalogued()
    assert offered(engine) == ["a", "b", "broken"] and offered(Catalogued(ready=False)) == [] and offered(None) == []
    text = a1111_parameters("a red circle", "", 20, 5.0, 7, 96, 64, "b", {}, "Euler")
    assert png_choices(engine, text) == (["a", "b", "broken"], ["64x48", "48x64"])  # b not loaded: the default's
    engine.loaded["b"] = LIMITS_B
    assert png_choices(engine, text) == (["a", "b", "broken"], ["96x64", "64x96", "80x80"])
    assert chosen_model(engine, "b") == ("b", DEFAULTS["b"]) and chosen_model(Catalogued(ready=False), "b") is None
    assert chosen_model(engine, "broken") is None
    assert runtime_log == ["[app] model 'broken': its defaults are not readable (broken/engine_defaults.json: "
                           "expected a JSON object); the page keeps its settings"]
    with pytest.raises(LookupError, match="unknown model 'z'"):
        chosen_model(engine, "z")


def test_the_page_wires_the_dropdown_and_the_model_default_button_once():
    """app.build_demo wires the Model dropdown's choice and the Model default button through page_models: one
    event each, with the settings and the widgets that follow the model as outputs."""
    import app
    from sdxl_engine.service.service import Service
    from tests.helpers import StepEngine

    demo = app.build_demo(Service(StepEngine()), EngineConfig.load(environ={}))
    ids = {b.elem_id: b._id for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    named = {f.fn.__name__: f for f in demo.fns.values() if f.fn is not None}
    choose, default = named["choose_model"], named["chosen_model_default"]
    assert [b._id for b in choose.inputs] == [ids["model"]] and len(choose.outputs) == 11
    assert [b._id for b in choose.outputs][3:] == [ids["model-default"], ids["resolution"], ids["control-model"],
                                                   ids["fast-preset"], ids["model-note"], ids["loras"],
                                                   ids["ip-model"], ids["examples"]]
    assert [b._id for b in default.inputs] == [ids["model"], ids["prompt"]] and len(default.outputs) == 4
    assert sum(f.fn.__name__ == "follow_model" for f in demo.fns.values() if f.fn is not None) == 2  # both restores
