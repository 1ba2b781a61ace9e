"""The page's Model dropdown: the models it offers, what follows a choice (the model's own sampler, steps and
guidance, the Model default button, its sizes, its ControlNets, the few-steps preset's button), the Model default
button's event, and the model a restore (a history image, a PNG) names. The plain functions behind them are in
page.py (model_settings, model_widgets, model_default_settings); this module wires them as private page events."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gradio as gr

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.contract import EngineContract
from sdxl_engine.service import models
from sdxl_engine.serving.page import (
    model_default_settings,
    model_settings,
    model_widgets,
    page_event,
    png_model,
    size_choices,
)


@dataclasses.dataclass
class ModelWidgets:
    """The Model dropdown and the widgets that follow it besides the settings: the Model default button, the
    resolution, the ControlNet model and the few-steps preset's button (page.model_widgets' order)."""

    model: gr.Dropdown
    default: gr.Button
    resolution: gr.Dropdown
    control_model: gr.Dropdown
    fast: gr.Button

    @property
    def following(self) -> list:
        return [self.default, self.resolution, self.control_model, self.fast]


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
    widgets. A model chosen on the page brings its own defaults, sizes and ControlNets (what its API requests get);
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
