"""The page's browser history: each finished request's record kept in this browser (encrypted BrowserState), a
click on a past image restoring its settings, and Clear. The records are made by the handler (history.make_record)
and held on the server per session (history.Pending) until the request's follow-up event takes them."""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from sdxl_engine.program.schedulers import DEFAULT_SCHEDULE_TYPE, SCHEDULE_TYPES
from sdxl_engine.serving import history
from sdxl_engine.serving.history import RESTORED_FIELDS
from sdxl_engine.serving.page import page_event
from sdxl_engine.serving.page_assets import CLEAR_HISTORY_JS, HISTORY_JS
from sdxl_engine.serving.page_image import REFINER_OFF


def wire_history(events: tuple, past: gr.BrowserState, pending: history.Pending, finished: history.Pending,
                 last_result: gr.State, history_gallery: gr.Gallery, history_note: gr.Markdown,
                 clear_history: gr.Button, settings: list, offered: Callable[[], list[str]] = list):
    """After each of ``events`` succeeds: its gallery and details into ``last_result`` (``finished``: the page
    shows them again after a Stop), its record from ``pending`` first into ``past``, the history redrawn in the
    browser (HISTORY_JS: thumbnails drawn there, no file written). A click on a past image sets ``settings``
    (history.RESTORED_FIELDS' widgets, in its order) to that image's record: each as kept, a field the record
    lacks (an older record's) left as it is, except the seed (that image's), the resolution (:func:`restored_size`),
    the sampler (Euler for a record without one), the schedule type (its A1111 label; Automatic for a record made
    before schedule types), the refiner switch (off without one) and the model (when ``offered()``, the names the
    Model dropdown offers, has it, else the model stays and the note says so). Clear empties the history. All
    private events. Returns the click's event (the page follows the model with its other widgets)."""

    @page_event
    def remember(past: list, request: gr.Request):
        return history.remember(past if isinstance(past, list) else [], pending.pop(request.session_hash))

    @page_event
    def keep_result(request: gr.Request):
        return finished.pop(request.session_hash)

    for done in events:
        done.success(keep_result, None, last_result, api_visibility="private", queue=False, show_progress="hidden")
        done.success(remember, past, past, api_visibility="private", show_progress="hidden").then(
            None, past, [history_gallery, history_note], js=HISTORY_JS, api_visibility="private")

    @page_event
    def restore(past: list, evt: gr.SelectData):
        rec, seed_value = history.entry(past, evt.index)
        size, note = restored_size(rec, seed_value)
        names = offered()
        if names and rec["model"] not in names:
            note += f" Its model, {rec['model']}, is not on this server now: the chosen model makes it."
        values = {name: gr.update() if rec.get(name) is None else rec[name] for name in RESTORED_FIELDS}
        values.update(seed=seed_value, resolution=gr.update() if size is None else size,
                      sampler=rec.get("sampler", "Euler"),
                      schedule_type=SCHEDULE_TYPES.get(rec.get("schedule_type"), SCHEDULE_TYPES[DEFAULT_SCHEDULE_TYPE]),
                      refiner_switch_at=rec.get("refiner_switch_at") or REFINER_OFF,
                      model=rec["model"] if rec["model"] in names else gr.update())
        return (*values.values(), note)

    restored = history_gallery.select(restore, past, [*settings, history_note], api_visibility="private",
                                      queue=False)
    clear_history.click(None, None, past, js=CLEAR_HISTORY_JS, api_visibility="private").then(
        None, past, [history_gallery, history_note], js=HISTORY_JS, api_visibility="private")
    return restored


def restored_size(rec: dict, seed: int) -> tuple[str | None, str]:
    """(the resolution to set, "WxH", or None to leave it; the note) for restoring history record ``rec``'s image
    of ``seed``. A record made from a picture (``from_image``: image to image, inpainting, upscale) has the
    picture's size, which the history does not keep: its settings come back, its size does not, and the note
    says how to make it again."""
    if rec.get("from_image"):
        return None, (f"Restored the settings of seed {seed} from {rec['time']} ({rec['model']}); it was made from a "
                      f"picture ({rec['width']}x{rec['height']}), which the history does not keep: put it under "
                      "**Image to image** again to remake it (**Generate** makes an image from the text alone).")
    return (f"{rec['width']}x{rec['height']}",
            f"Restored seed {seed} from {rec['time']} ({rec['model']}); press **Generate** to make it again.")
