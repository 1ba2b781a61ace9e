"""The page's Model dropdown and the settings that follow a model: the models it offers, what follows a choice
(the model's own sampler, steps and guidance, the Model default button, its sizes, its ControlNets, the few-steps
preset's button), the Model default, Blog default and few-steps preset buttons' events, the model a restore (a
history image, a PNG) names and the PNG restore's event, and the engine's start (the banner, then the models, sizes
and brush the started engine has). The plain functions behind them are in page.py (model_settings, model_widgets,
model_default_settings, png_settings, engine_banner); this module wires them as private page events."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gradio as gr

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.contract import EngineContract
from sdxl_engine.service import models
from sdxl_engine.service.styles import has_fast_tag, with_fast_tag, without_fast_tag
from sdxl_engine.serving.history import RESTORED_FIELDS
from sdxl_engine.serving.page import (
    BLOG_DEFAULT,
    engine_banner,
    fast_preset_for,
    model_choices,
    model_default_settings,
    model_settings,
    model_widgets,
    page_event,
    png_model,
    png_settings,
    size_choices,
)
from sdxl_engine.serving.page_image import editor_tools


@dataclasses.dataclass
class ModelWidgets:
    """The Model dropdown and the widgets that follow it besides the settings: the Model default button, the
    resolution, the ControlNet model, the few-steps preset's button, the model note, the LoRA list, the
    IP-Adapter model and the examples (page.model_widgets' order)."""

    model: gr.Dropdown
    default: gr.Button
    resolution: gr.Dropdown
    control_model: gr.Dropdown
    fast: gr.Button
    note: gr.Markdown
    loras: gr.Dataset
    ip_model: gr.Dropdown
    examples: gr.Dataset

    @property
    def following(self) -> list:
        return [self.default, self.resolution, self.control_model, self.fast, self.note, self.loras, self.ip_model,
                self.examples]


def offered(engine: EngineContract | None) -> list[str]:
    """The models the Model dropdown offers once the engine is ready (two or more), else none to choose."""
    ready = engine is not None and engine.ready.is_set() and engine.error is None
    names = models.names(engine) if ready else []
    return names if len(names) > 1 else []


def png_choices(engine: EngineContract | None, text) -> tuple[list[str], list[str]]:
    """(the models offered, the resolution values) for restoring a PNG's ``parameters`` ``text``: the sizes of the
    model that made it once that model is loaded (page.png_model), else the default model's."""
    names = offered(engine)
    made_by = png_model(text, names)
    limits = models.loaded_limits(engine, made_by) if made_by else None
    return names, [value for _, value in size_choices(engine, limits)[0]]


def wire_models(engine: EngineContract | None, config: EngineConfig, widgets: ModelWidgets, prompt: gr.Textbox,
                settings: list) -> Callable:
    """The dropdown's and the Model default button's events; ``settings``: the sampler, steps and guidance
    widgets. A model chosen on the page brings its own defaults, sizes, ControlNets and IP-Adapters (what its API
    requests get);
    the button brings them back (and drops the few-steps preset's tag from ``prompt``). Both take the dropdown's
    value as sent (preprocess=False): an unknown name is refused by name. Returns ``follow(event)``: after
    ``event`` (a restore that set the dropdown and the resolution), the other widgets follow the model."""

    @page_event
    def choose_model(name):
        return model_settings(engine, name)

    @page_event
    def chosen_model_default(name, text):
        return model_default_settings(engine, config, name, text)

    @page_event
    def follow_model(name, size):
        return model_widgets(engine, name, size=size)

    widgets.model.input(choose_model, widgets.model, [*settings, *widgets.following], api_visibility="private",
                        queue=False, show_progress="hidden", preprocess=False)
    widgets.default.click(chosen_model_default, [widgets.model, prompt], [*settings, prompt],
                          api_visibility="private", queue=False, preprocess=False)

    def follow(event) -> None:
        event.then(follow_model, [widgets.model, widgets.resolution], widgets.following, api_visibility="private",
                   queue=False, show_progress="hidden", preprocess=False)

    return follow


def wire_presets(config: EngineConfig, blog_default: gr.Button, fast: gr.Button, prompt: gr.Textbox, settings: list,
                 schedule_type: gr.Dropdown) -> None:
    """The Blog default and few-steps preset buttons' events; ``settings``: the sampler, steps and guidance
    widgets (:func:`wire_models`' order). Blog default sets the blog's sampler and steps (page.BLOG_DEFAULT) and,
    leaving the few-steps preset, takes its tag out of ``prompt`` and brings ``config``'s guidance back, with
    ``schedule_type`` Automatic; the preset (page.fast_preset_for: a few-step LoRA's recipe, else LCM's) sets its
    sampler, steps, guidance and schedule type and adds its LoRA's tag."""
    sampler, steps, guidance = settings
    preset = fast_preset_for(config)
    # Both presets run their sampler's own schedule (LCM takes no other: a leftover Karras was refused).
    blog_default.click(page_event(lambda: (*BLOG_DEFAULT, "Automatic")), None, [sampler, steps, schedule_type],
                       api_visibility="private", queue=False)
    # Leaving the fast preset: its tag goes and the guidance comes back (the event above still sets just the
    # sampler and steps).
    blog_default.click(page_event(lambda text: (without_fast_tag(text, preset.lora), config.guidance_scale)
                                  if has_fast_tag(text, preset.lora) else (gr.update(), gr.update())),
                       prompt, [prompt, guidance], api_visibility="private", queue=False)
    fast.click(page_event(lambda text: (*preset.settings[:3], with_fast_tag(text, preset.lora), preset.settings[3])),
               prompt, [sampler, steps, guidance, prompt, schedule_type], api_visibility="private", queue=False)


def wire_png_restore(engine: EngineContract | None, config: EngineConfig, png_file: gr.HTML, settings: list,
                     note: gr.Markdown):
    """The PNG restore's event: the ``parameters`` text the browser read from a PNG (``png_file``'s script, page
    assets' PNG_SETTINGS_JS: no file reaches the server) sets ``settings`` (history.RESTORED_FIELDS' widgets, in
    its order; a value it does not restore is left as it is) and ``note`` says what was restored
    (page.png_settings, with the sizes of the PNG's model once loaded: :func:`png_choices`). Returns the event
    (the page follows the model with its other widgets)."""

    @page_event
    def restore_png(text: str):
        names, sizes = png_choices(engine, text)
        values, said = png_settings(text, sizes, config.max_inference_steps, config.max_seed, bool(config.refiner),
                                    names)
        return (*(values.get(name, gr.update()) for name in RESTORED_FIELDS), said)

    return png_file.input(restore_png, png_file, [*settings, note], api_visibility="private", queue=False,
                          show_progress="hidden")


def wire_start(demo: gr.Blocks, engine: EngineContract | None, configured: list[str], banner: gr.Markdown,
               resolution: gr.Dropdown, init_image: gr.ImageMask, model: gr.Dropdown, events: tuple) -> None:
    """The page's view of the engine's start: each page load, and every second until the engine is ready, writes
    the ``banner`` (page.engine_banner); once ready, the ``resolution`` choices (its sizes), the image editor's
    brush (page_image.editor_tools) and the ``model`` dropdown (page.model_choices; ``configured``: the flags'
    names) take the started engine's. With scale-out (Ray) the banner says the replica count again after each of
    ``events``."""
    timer = gr.Timer(1.0, active=engine is not None and not engine.ready.is_set())

    @page_event
    def refresh():
        text, done = engine_banner(engine)
        if not done:
            return text, gr.Dropdown(), gr.skip(), gr.skip(), gr.Timer(active=True)
        sizes, value = size_choices(engine)
        return text, gr.Dropdown(choices=sizes, value=value), gr.ImageMask(**editor_tools(engine)), \
            gr.Dropdown(**model_choices(engine, configured)), gr.Timer(active=False)

    refreshed = [banner, resolution, init_image, model, timer]
    timer.tick(refresh, None, refreshed, api_visibility="private", queue=False, show_progress="hidden")
    if engine is not None and engine.scale_out() is not None:
        for done in events:
            done.then(lambda: engine_banner(engine)[0], None, banner, api_visibility="private", queue=False,
                      show_progress="hidden")
    demo.load(refresh, None, refreshed, api_visibility="private", queue=False, show_progress="hidden")
