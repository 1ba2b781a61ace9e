"""The browser history's record and restore (serving/history.py, serving/page_history.py) and the PNG restore
(page.png_settings) follow one list of fields, history.RESTORED_FIELDS."""

from types import SimpleNamespace

import gradio as gr
import numpy as np

from sdxl_engine.service.images import a1111_parameters
from sdxl_engine.serving import history, page
from sdxl_engine.serving.apis import tools
from sdxl_engine.serving.page_history import wire_history

USER = {"prompt": "a cat", "negative_prompt": "", "style": "(No style)"}
INFO = {"seeds": [5, 6], "guidance_scale": 7.0, "num_inference_steps": 4, "sampler": "DDIM", "width": 80,
        "height": 48, "model": "tiny", "latency_s": 1.0, "schedule_type": "karras"}


def restore_of(offered=list):
    """The history gallery's restore event (its function), wired as app.py wires it."""
    with gr.Blocks() as demo:
        settings = [gr.Textbox(label=name) for name in history.RESTORED_FIELDS]
        wire_history((), gr.BrowserState([]), history.Pending(), history.Pending(), gr.State(None), gr.Gallery(),
                     gr.Markdown(), gr.Button(), settings, offered)
    (restore,) = [f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "restore"]
    return restore


def test_a_field_added_to_the_restored_fields_is_kept_and_restored_without_another_line(monkeypatch):
    """A new page setting named in RESTORED_FIELDS (here a made-up ``clip_skip``) is kept in the record from the
    info record and set again by a click on a past image, in its place, with no line in make_record or restore;
    a record made before it leaves its widget as it is. The fields kept their own way still are: the typed texts,
    the image's seed, the size as "WxH", the schedule type's label, the refiner off, the model only when offered."""
    monkeypatch.setitem(history.RESTORED_FIELDS, "clip_skip", ("clip skip", "Clip skip"))
    images = np.zeros((2, 8, 8, 3), np.uint8)
    record = {**history.make_record(USER, {**INFO, "clip_skip": 2}, images), "time": "t"}
    assert record["clip_skip"] == 2 and record["seeds"] == [5, 6] and "seed" not in record
    out = restore_of()([record], SimpleNamespace(index=1))
    values = dict(zip(history.RESTORED_FIELDS, out))
    assert len(out) == len(history.RESTORED_FIELDS) + 1 and out[-1].startswith("Restored seed 6 from t (tiny)")
    assert {name: values[name] for name in ("prompt", "seed", "guidance_scale", "num_inference_steps", "sampler",
                                            "schedule_type", "resolution", "refiner_switch_at", "clip_skip")} == {
        "prompt": "a cat", "seed": 6, "guidance_scale": 7.0, "num_inference_steps": 4, "sampler": "DDIM",
        "schedule_type": "Karras", "resolution": "80x48", "refiner_switch_at": 1.0, "clip_skip": 2}
    assert values["model"] == gr.update()  # one model on the server: the dropdown stays
    offered = restore_of(lambda: ["tiny", "other"])([record], SimpleNamespace(index=0))
    assert dict(zip(history.RESTORED_FIELDS, offered))["model"] == "tiny"
    older = {key: value for key, value in record.items() if key != "clip_skip"}
    assert dict(zip(history.RESTORED_FIELDS, restore_of()([older], SimpleNamespace(index=0))))["clip_skip"] == \
        gr.update()


def test_a_field_added_to_the_restored_fields_is_read_back_from_a_png_as_its_inputs_kind(monkeypatch):
    """The PNG restore reads such a field (a made-up ``clip_skip``, an int input of /generate) from its key in the
    parameters text, as its input's kind, and names it in the note; a value of another kind is named as not
    restored; the fields read their own way still are."""
    monkeypatch.setitem(history.RESTORED_FIELDS, "clip_skip", ("clip skip", "Clip skip"))
    original = tools.generate_inputs
    monkeypatch.setattr(page, "generate_inputs", lambda config: (*original(config), tools.Input("clip_skip", int, 0)))
    text = a1111_parameters("a cat", "", 12, 4.5, 77, 64, 64, "tiny", {"Clip skip": 2}, "Euler")
    values, note = page.png_settings(text, ["64x64"], 50, 99)
    assert (values["clip_skip"], values["seed"], values["resolution"]) == (2, 77, "64x64")
    assert note.startswith("Restored from the PNG: prompt, negative prompt, style, seed, CFG, steps, sampler, "
                           "schedule type, size, clip skip;")
    values, note = page.png_settings(text.replace("Clip skip: 2", "Clip skip: two"), ["64x64"], 50, 99)
    assert "clip_skip" not in values and "Not restored: clip skip 'two' (not a value this page takes)." in note
