"""What the page shows, as plain functions of values (app.py lays out the widgets and wires these in): the
status line, the banner, the size choices, the view after a Stop, settings read back from a PNG, the page-event
guard, the example prompts and presets."""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable

import gradio as gr

from sdxl_engine.checkpoint.loading import model_loras
from sdxl_engine.checkpoint.lora import LoraError, available_names, lora_sources
from sdxl_engine.checkpoint.weights import ModelLoadError
from sdxl_engine.config import ConfigError, EngineConfig
from sdxl_engine.engine.contract import EngineContract, clock
from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.engine.validation import MAX_GUIDANCE
from sdxl_engine.program.schedulers import DEFAULT_SCHEDULE_TYPE, SCHEDULE_TYPES
from sdxl_engine.service import models
from sdxl_engine.service.styles import (
    LCM_PRESET,
    NO_STYLE,
    STYLE_NAMES,
    FastPreset,
    fast_preset,
    get_style,
    without_fast_tag,
)
from sdxl_engine.serving.apis.a1111 import generation_parameters, refiner_name, sampler_of
from sdxl_engine.serving.apis.core import ApiError
from sdxl_engine.serving.apis.tools import generate_inputs
from sdxl_engine.serving.history import RESTORED_FIELDS
from sdxl_engine.serving.page_assets import MODEL_NOTES, REAL_SDXL_HINT

LOG = logging.getLogger(__name__)

# Prompts in the vocabulary of the default model, tiny-shapes (assets/tiny-shapes/vocabulary.txt): the examples of the
# built-in models (tiny-random's images are noise whatever the prompt).
EXAMPLES = ["a red circle on a blue background", "a large green square at the top", "a small yellow star on the left",
            "a purple triangle on a white background", "a large pink cross in the centre on a black background"]
# Every other model's (real SDXL): the blog's prompt first, then the kinds of picture SDXL is shown with.
SDXL_EXAMPLES = ["a photograph of an astronaut riding a horse",
                 "a watercolor painting of a lighthouse on a cliff at sunset",
                 "a close-up portrait of an old fisherman, dramatic lighting, 85mm photo",
                 "an isometric illustration of a cozy coffee shop, pastel colors",
                 "a red fox in a snowy forest, morning light, highly detailed"]
# No style in the examples: a style's added words ("anime artwork ...") pull tiny-shapes' images off the prompt.
# The blog's setting (the config's own defaults), one click away when a model's engine_defaults.json chose another.
BLOG_DEFAULT = (EngineConfig.sampler, EngineConfig.num_inference_steps)
WIDGETS_FOLLOWING = 8  # model_widgets' updates (page_models.ModelWidgets.following)


def lora_names_for(config: EngineConfig) -> list[str]:
    """The LoRA names the engine will load: the deployment's and the model's own (its loras.json)."""
    return available_names(config.lora, config.lora_dir, os.pathsep, model_loras(config.model))


def fast_preset_for(config: EngineConfig) -> FastPreset:
    """The Fast button's preset for the LoRAs the engine will load (the deployment's and the model's own): a
    few-step LoRA's recipe (styles.fast_preset: Lightning's, Hyper-SD's, DMD2's by their files' names), else LCM's;
    LCM's when the settings are bad (the engine's start reports those)."""
    try:
        return fast_preset(lora_sources(config.lora, config.lora_dir, os.pathsep, model_loras(config.model)))
    except (LoraError, OSError):
        return LCM_PRESET


def status_line(info: dict) -> str:
    """The one line under the gallery: latency breakdown, devices, size, steps, sampler (and its schedule type unless
    automatic), style and model (and the refiner and its switch, a hires fix's factor and strength, when the request
    ran them)."""
    if not isinstance(info, dict) or "timings_s" not in info:  # empty, or a raw call to this page event
        return ""
    t = info["timings_s"]
    saved = " · saved to the server's outputs folder" if info.get("saved") else ""
    replica = f" (replica `{info['replica']}`)" if info.get("replica") else ""
    ray = f" · ray {t['ray']:.2f} s" if "ray" in t else ""
    refined = (f" + refiner `{info.get('refiner') or 'refiner'}` from {info['refiner_switch_at']:g} of the steps"
               if info.get("refiner_switch_at") is not None else "")
    if "hires" in info:
        refined += f" · upscaled ×{info['hires']['scale']:g} (hires fix, strength {info['hires']['strength']:g})"
    steps = info["num_inference_steps"]
    typed = info.get("schedule_type") or DEFAULT_SCHEDULE_TYPE
    schedule = "" if typed == DEFAULT_SCHEDULE_TYPE else f" ({SCHEDULE_TYPES.get(typed, typed)} schedule)"
    return (f"**{info['latency_s']:.2f} s** for {len(info['seeds'])} images on **{info['device']}**{replica} "
            f"(queue {t['queue']:.2f} s · prep {t['prep']:.3f} s · device {t['device']:.2f} s · "
            f"post {t['post']:.3f} s{ray}) — {info['width']}×{info['height']}, {steps} "
            f"{info.get('sampler', 'Euler')} step{'' if steps == 1 else 's'}{schedule}, "
            f"CFG {info['guidance_scale']:g}, "
            f"seeds {info['seeds'][0]}–{info['seeds'][-1]}, style **{info.get('style', NO_STYLE)}**, model "
            f"`{info['model']}`{refined}{saved}")


def stopped_view(last: dict | None, heard: str) -> tuple:
    """(gallery, info, status) for the page after its request failed: a Stop (``heard`` says where it
    stopped) gets the line saying so and the last finished request's gallery and details back (``last``:
    ``{"gallery": [(path, caption)...], "info": {...}}`` as handler.api_function keeps it, or None: then an
    empty gallery, not a half-made preview); any other failure (``heard`` "") leaves the gallery and clears
    the line, which described the last request.

    ``heard``: what the page last showed of the stopped request (STOP_STEP_JS): ``"k/N"`` (step k of N,
    from the preview's caption or the progress line), ``"waiting"`` (no step yet), or ``""`` (no Stop).
    Raises ValueError for any other text, TypeError for a non-string (only a client other than the page
    sends them).
    """
    if heard == "":
        return gr.update(), gr.update(), ""
    if heard == "waiting":
        said = "Stopped before its first step; nothing saved."
    elif (match := re.fullmatch(r"(\d{1,6})/(\d{1,6})", heard)) is not None:
        said = f"Stopped at step {int(match[1])} of {int(match[2])}; nothing saved."
    else:
        raise ValueError(f"heard: expected 'k/N', 'waiting' or '', got {heard[:40]!r}")
    if not last:
        return [], None, f"**{said}**"
    return last["gallery"], last["info"], f"**{said}** Below, the last finished request: {status_line(last['info'])}"


REFINER_MIN, REFINER_OFF = 0.05, 1.0  # the refiner slider's range (page_image.refiner_slider); 1: base model only
MAX_PARAMETERS_CHARS = 60_000  # a parameters text is a few kB; PNG_SETTINGS_JS sends at most this


def png_model(text, offered: list[str]) -> str | None:
    """The ``Model`` of a PNG's ``parameters`` text when it is one of ``offered`` (the page's models), else None."""
    if not isinstance(text, str) or len(text) > MAX_PARAMETERS_CHARS or not text.strip() or not offered:
        return None
    name = generation_parameters(text).get("Model")
    return name if name in offered else None


def _unstyled(style: str, prompt: str, negative: str) -> tuple[str, str] | None:
    """(prompt, negative prompt) as typed before ``style`` was applied (styles.apply_style), or None when the
    texts are not that style's output."""
    template = get_style(style)
    before, _, after = template.prompt.partition("{prompt}")
    if not (prompt.startswith(before) and prompt.endswith(after) and len(prompt) >= len(before) + len(after)):
        return None
    typed = prompt[len(before):len(prompt) - len(after)]
    extra = template.negative_prompt
    if not extra:
        return typed, negative
    if negative == extra:
        return typed, ""
    return (typed, negative[:-len(extra) - 2]) if negative.endswith(", " + extra) else None


# The fields png_settings reads its own way (A1111's pairs and styles, the page's limits, sizes and models); any
# other of history.RESTORED_FIELDS is read by _read_as_inputs.
READ_OWN_WAY = ("prompt", "negative_prompt", "style", "seed", "guidance_scale", "num_inference_steps", "sampler",
                "schedule_type", "resolution", "refiner_switch_at", "model")


def _read_as_inputs(fields: dict, values: dict) -> list[str]:
    """Each field of history.RESTORED_FIELDS not in :data:`READ_OWN_WAY` whose key a PNG's parsed ``fields`` have,
    into ``values`` as its /generate input's kind (apis/tools.generate_inputs: int, float or str) when it converts
    and is one of the input's choices (if it has any); the engine checks its value when the page sends it. Returns
    what was not restored, for the note."""
    inputs = {item.name: item for item in generate_inputs(EngineConfig())}
    left = []
    for name, (label, key) in RESTORED_FIELDS.items():
        if name in READ_OWN_WAY or key not in fields or name not in inputs:
            continue
        item = inputs[name]
        try:
            value = item.kind(fields[key])
        except ValueError:
            value = None
        if value is None or item.choices and value not in item.choices:
            left.append(f"{label} {fields[key][:20]!r} (not a value this page takes)")
        else:
            values[name] = value
    return left


def png_settings(text: str, sizes: list[str], max_steps: int, max_seed: int,
                 refiner: bool = False, models: list[str] = ()) -> tuple[dict, str]:
    """The page's settings from a PNG's ``parameters`` text (this server's or A1111's; parsed by A1111's rules:
    apis.a1111.generation_parameters): ({field of history.RESTORED_FIELDS: value}, a Markdown note saying what was
    restored and what was not, and why).

    ``sizes``: the page's resolution values ("WxH"); ``max_steps``, ``max_seed``: the page's limits. A style
    the page has is taken back out of the prompt texts (the PNG holds them styled); a value the page cannot
    take (a sampler or size it lacks, steps past the limit) is left as it is and named in the note. With a
    ``refiner`` loaded, the refiner switch is restored too (``Refiner switch at``; 1, no refiner, for a PNG made
    without one); without one a PNG's refiner is named as not restored, and so are a hires fix and an image to
    image's strength (this form makes images from text only). Any other field of history.RESTORED_FIELDS is read
    from its key as its /generate input's kind (:func:`_read_as_inputs`). ``models``: the model names the page
    offers when it offers several (its Model dropdown): the PNG's ``Model`` is restored when it is one of them, else
    named as not restored; () (one model) leaves the model alone. A blank
    text (the browser found no ``parameters`` chunk) restores nothing. Raises TypeError or ValueError for
    text the page's script never sends (not a string, longer than MAX_PARAMETERS_CHARS)."""
    if not isinstance(text, str) or len(text) > MAX_PARAMETERS_CHARS:
        raise ValueError(f"text: expected a parameters text of at most {MAX_PARAMETERS_CHARS} characters")
    if not text.strip():
        return {}, "That file has no generation parameters (no `parameters` text in a PNG): nothing restored."
    fields = generation_parameters(text)
    values = {"prompt": fields["Prompt"], "negative_prompt": fields["Negative prompt"], "style": NO_STYLE}
    left: list[str] = []
    style = fields.get("Style", NO_STYLE)
    if style != NO_STYLE:
        typed = _unstyled(style, values["prompt"], values["negative_prompt"]) if style in STYLE_NAMES else None
        if typed is None:
            why = "the prompts are not its output" if style in STYLE_NAMES else "not one of this page's"
            left.append(f"style {style[:40]!r} ({why}: its words stay in the prompt)")
        else:
            values.update(prompt=typed[0], negative_prompt=typed[1], style=style)
    number = {"seed": ("Seed", int, 0, max_seed), "guidance_scale": ("CFG scale", float, 0.0, MAX_GUIDANCE),
              "num_inference_steps": ("Steps", int, 1, max_steps),
              **({"refiner_switch_at": ("Refiner switch at", float, REFINER_MIN, REFINER_OFF)} if refiner else {})}
    for name, (key, kind, low, high) in number.items():
        if key not in fields:
            continue
        try:
            value = kind(fields[key])
        except ValueError:
            value = None
        if value is not None and low <= value <= high:
            values[name] = value
        else:
            left.append(f"{key} {fields[key][:20]!r} (this page takes {low:g} to {high:g})")
    if "Sampler" in fields:  # A1111's pair (sampler_of: "DPM++ 2M" + "Karras"; none = Automatic, as it was made)
        try:
            sampler, schedule_type = sampler_of(fields["Sampler"], fields.get("Schedule type"))
            values["sampler"] = sampler or values.get("sampler")
            values["schedule_type"] = SCHEDULE_TYPES[schedule_type or DEFAULT_SCHEDULE_TYPE]  # the dropdown's label
        except ApiError as err:
            if err.param != "scheduler":
                left.append(f"sampler {fields['Sampler'][:40]!r} (not one of this server's)")
            else:  # the sampler is one of this server's; its schedule type is not (A1111's Align Your Steps)
                values["sampler"] = sampler_of(fields["Sampler"], None)[0] or values.get("sampler")
                left.append(f"schedule type {fields['Schedule type'][:40]!r} (not one of this server's)")
    if "Size-1" in fields and "Size-2" in fields:
        size = f"{fields['Size-1']}x{fields['Size-2']}"
        if size in sizes:
            values["resolution"] = size
        else:
            left.append(f"size {size} (not one of this model's sizes)")
    if "Refiner switch at" in fields and not refiner:  # with a refiner: read with the numbers above
        left.append(f"refiner switch at {fields['Refiner switch at'][:20]!r} (no refiner on this server)")
    elif refiner and "Refiner switch at" not in fields:
        values["refiner_switch_at"] = REFINER_OFF  # made without a refiner: base model only, as it was
    if models and "Model" in fields:
        if fields["Model"] in models:
            values["model"] = fields["Model"]
        else:
            left.append(f"model {fields['Model'][:60]!r} (not on this server)")
    if "Hires upscale" in fields or "Hires resize-1" in fields:  # A1111 writes one: a factor, or the size asked
        how = (f"upscale {fields['Hires upscale'][:20]!r}" if "Hires upscale" in fields else
               f"resize '{fields['Hires resize-1'][:6]}x{fields.get('Hires resize-2', '')[:6]}'")
        left.append(f"hires fix ({how}: the images were upscaled after; "
                    "Upscale under Image to image runs it on a picture)")
    elif "Denoising strength" in fields:
        left.append(f"denoising strength {fields['Denoising strength'][:20]!r} (made from a picture: "
                    "Image to image takes one)")
    for key in ("Eta DDIM", "Eta"):  # A1111's, written where eta was not the sampler's default (the API's field)
        if key in fields:
            left.append(f"{key.lower()} {fields[key][:20]!r} (this page runs each sampler's default eta; the A1111 "
                        "and jobs APIs take eta)")
        units = [key for key in fields if re.fullmatch(r"ControlNet \d+", key)]  # sd-webui-controlnet's unit fields
    if units:
        left.append(f"{', '.join(units)} (a ControlNet or IP-Adapter unit: the PNG holds its settings, not its "
                    "image; set it in the ControlNet section)")
    values = {name: value for name, value in values.items() if value is not None}
    left += _read_as_inputs(fields, values)
    restored = ", ".join(label for name, (label, _) in RESTORED_FIELDS.items() if name in values)
    note = f"Restored from the PNG: {restored}; press **Generate** to make it again."
    return values, note + (f" Not restored: {'; '.join(left)}." if left else "")


def engine_banner(engine: EngineContract | None) -> tuple[str, bool]:
    """(Markdown for the status banner, whether the engine is done starting) for ``engine``; a loaded refiner is
    named beside the model."""
    if engine is None:
        return "", True
    elapsed = clock() - engine.started
    if not engine.ready.is_set():
        return (f"**Starting the engine: {engine.stage}** — {elapsed:.0f} s so far. "
                "Requests sent now wait and run as soon as it is ready."), False
    if engine.error is not None:
        return f"**The engine failed to start:** {engine.error}", True
    ready_s = engine.startup.get("ready_s", elapsed)
    scale = engine.scale_out()
    refiner = f" + refiner `{name}`" if (name := refiner_name(engine)) else ""
    if scale is None:
        return (f"Ready on **{engine.device_summary}** — model `{engine.model.name}` ({engine.model.dtype}){refiner}, "
                f"started in {ready_s:.1f} s"), True
    return (f"**{scale.text}** on Ray Serve, each on **{engine.device_summary}** — model "
            f"`{engine.model.name}` ({engine.model.dtype}){refiner}, first replica ready in {ready_s:.1f} s"), \
        scale.settled


def model_choices(engine: EngineContract | None, configured: list[str]) -> dict:
    """The Model dropdown's choices, value (the default model) and visibility: shown when the server offers two or
    more models (the started engine's, service/models.names; before that ``configured``, the flags' names from
    service/models.configured: so /generate's API description lists them), else hidden (requests take the
    default)."""
    ready = engine is not None and engine.ready.is_set() and engine.error is None
    names = models.names(engine) if ready else configured
    return {"choices": names, "value": names[0] if names else None, "visible": len(names) > 1}


def size_choices(engine: EngineContract | None, limits=None) -> tuple[list[tuple[str, str]], str]:
    """Resolution dropdown (label, "WxH") choices and the default value for the default model's sizes (``limits``:
    another model's, validation.Limits); ("model default", "0x0") until ready."""
    if limits is None and (engine is None or not engine.ready.is_set() or engine.error is not None):
        return [("model default", "0x0")], "0x0"
    limits = limits or engine.limits
    default = limits.default_size
    choices = []
    for w, h in limits.sizes:
        shape = "square" if w == h else "landscape" if w > h else "portrait"
        choices.append((f"{w} × {h} ({shape}{', default' if (w, h) == default else ''})", f"{w}x{h}"))
    return choices, f"{default[0]}x{default[1]}"


SIZE = re.compile(r"[1-9]\d{0,4}x[1-9]\d{0,4}")  # a resolution value, "WxH"


def model_default_label(defaults: EngineConfig) -> str:
    """The "Model default" button's text for a model's resolved defaults (its sampler and steps)."""
    return f"Model default ({defaults.sampler}, {defaults.num_inference_steps} steps)"


def chosen_model(engine: EngineContract | None, name: str | None) -> tuple[str, EngineConfig] | None:
    """(the model ``name`` names, its own defaults: service/models.defaults_for, its engine_defaults.json read
    without loading it) once the engine is ready; None before, or when the engine refuses that model's
    engine_defaults.json (one log line: its request is refused with the reason).

    Raises LookupError (page_event: one log line, a gr.Error) for a name the engine does not offer."""
    if engine is None or not engine.ready.is_set() or engine.error is not None:
        return None
    try:
        model = models.choose(engine, name)
        return model, models.defaults_for(engine, model)
    except InvalidRequest as err:
        raise LookupError(err.message) from None
    except (ConfigError, ModelLoadError) as err:
        LOG.info(f"[app] model {name!r}: its defaults are not readable ({err}); the page keeps its settings"[:300])
        return None


def model_settings(engine: EngineContract | None, name: str | None) -> tuple:
    """The page's Model dropdown changed to ``name``: what follows it, as updates for (sampler, steps, guidance
    scale, then :func:`model_widgets`' eight: the Model default button, resolution, ControlNet model, the few-steps
    preset's button, the model note, the LoRA list, the IP-Adapter model, the examples). The first three and the
    button take that model's own defaults (:func:`chosen_model`), as a request for it through any API that
    sets none of them runs; the rest as :func:`model_widgets`. Nothing changes before the engine is ready, or for
    a model whose engine_defaults.json the engine refuses.

    Raises LookupError (page_event: one log line, a gr.Error) for a name the engine does not offer."""
    chosen = chosen_model(engine, name)
    if chosen is None:
        return (gr.update(),) * (3 + WIDGETS_FOLLOWING)
    model, defaults = chosen
    return (defaults.sampler, defaults.num_inference_steps, defaults.guidance_scale,
            *_widgets_for(engine, model, defaults))


def model_widgets(engine: EngineContract | None, name: str | None, size: str | None = None) -> tuple:
    """The widgets that follow the Model dropdown besides the settings (:func:`model_settings`), as updates for
    (the Model default button, resolution, ControlNet model, the few-steps preset's button, the model note, the
    LoRA list, the IP-Adapter model, the examples): the button's label of the model's defaults, its sizes, fitting
    ControlNets and IP-Adapters once loaded (else resolution "model default" and the lists as they are), the preset
    when it has the LoRA, the note of a built-in model (:func:`model_note`; hidden for others), the LoRAs its
    requests may tag and its example prompts (:func:`examples_for`). ``size``: a resolution ("WxH") to keep as the
    value (a restored one) when the model's sizes have it. After a restore (a history image,
    a PNG) set the dropdown itself. Nothing changes before the engine is ready or for a model it refuses.

    Raises LookupError (page_event) for a name the engine does not offer."""
    chosen = chosen_model(engine, name)
    return (gr.update(),) * WIDGETS_FOLLOWING if chosen is None else _widgets_for(engine, *chosen, size=size)


def _widgets_for(engine: EngineContract, model: str, defaults: EngineConfig, size: str | None = None) -> tuple:
    """:func:`model_widgets` for a chosen ``model`` and its ``defaults``."""
    try:
        loras = models.lora_names_for(engine, model)
        limits = models.loaded_limits(engine, model)
    except (ConfigError, ModelLoadError):
        return (gr.update(),) * WIDGETS_FOLLOWING
    fast = gr.update(visible=fast_preset_for(engine.config).lora in loras)
    note = model_note(model)
    following = (gr.update(value=note, visible=bool(note)),
                 gr.update(samples=[[f"<lora:{n}:1>"] for n in loras], visible=bool(loras)))
    examples = gr.update(samples=[[text, NO_STYLE] for text in examples_for(model)])
    if limits is None:  # not loaded yet: its sizes and the ControlNets that fit it are known once it is
        restored = [(size.replace("x", " × "), size)] if isinstance(size, str) and SIZE.fullmatch(size) and \
            size != "0x0" else []
        resolution = gr.update(choices=[("model default", "0x0"), *restored], value=restored[0][1] if restored
                               else "0x0")
        controlnets = ip_adapters = gr.update()
    else:
        choices, value = size_choices(engine, limits)
        names = [cn for cn, _ in limits.controlnets]
        kept = size if size in [v for _, v in choices] else value
        resolution = gr.update(choices=choices, value=kept)
        controlnets = gr.update(choices=names, value=names[0] if names else "")
        ips = [name for name, _ in limits.ip_adapters]
        ip_adapters = gr.update(choices=ips, value=ips[0] if ips else "")
    return (gr.update(value=model_default_label(defaults)), resolution, controlnets, fast, *following, ip_adapters,
            examples)


def model_default_settings(engine: EngineContract | None, config: EngineConfig, name: str | None,
                           text: str | None) -> tuple:
    """The Model default button: (sampler, steps, guidance scale, prompt ``text`` without the few-steps preset's
    tag) for the model the Model dropdown names (``name``: its own defaults, :func:`chosen_model`), or
    ``config``'s (the page's resolved defaults, the default model's) before the engine is ready or when that
    model's engine_defaults.json is refused.

    Raises LookupError (page_event: one log line, a gr.Error) for a name the engine does not offer."""
    chosen = chosen_model(engine, name)
    defaults = config if chosen is None else chosen[1]
    return (defaults.sampler, defaults.num_inference_steps, defaults.guidance_scale,
            without_fast_tag(text, fast_preset_for(config).lora))


def outpaint_default(engine: EngineContract | None) -> int:
    """The outpaint slider's start: an eighth of the default size's width in whole 8-pixel steps (128 px for
    SDXL's 1024), at least 8; 16 before the engine is ready."""
    choices, value = size_choices(engine)
    width = int(value.split("x")[0])
    return max(8, width // 64 * 8) if width else 16


def event_inputs(inputs: tuple, widgets: dict) -> list:
    """The page's components for an endpoint's ``inputs`` (apis/tools.Input, in the endpoint's order: e.g.
    tools.generate_inputs), each taken by its input's name from ``widgets`` ({name: component}), so the event's
    input list follows the one list of inputs. Raises KeyError naming an input the page has no widget for."""
    missing = [item.name for item in inputs if item.name not in widgets]
    if missing:
        raise KeyError(f"no page widget for the inputs {', '.join(missing)}")
    return [widgets[item.name] for item in inputs]


def page_event(fn: Callable) -> Callable:
    """``fn`` as a page event: input it cannot use (only a client other than the page sends it)
    is refused with one log line and a gr.Error, not a traceback."""
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except gr.Error:
            raise
        except (LookupError, TypeError, ValueError, AttributeError) as err:
            LOG.info(f"[app] page event {fn.__name__} refused: {type(err).__name__}: {err}"[:300])
            raise gr.Error("this page event got values the page does not send", print_exception=False) from err
    return guarded


def examples_for(model: str | None) -> list[str]:
    """The example prompts the page shows for ``model``: tiny-shapes' vocabulary for the built-in models
    (:data:`EXAMPLES`), real SDXL prompts for every other (:data:`SDXL_EXAMPLES`)."""
    return EXAMPLES if model in MODEL_NOTES else SDXL_EXAMPLES


def example_loader(default_model: str) -> Callable[[int, str | None], tuple[str, str]]:
    """The page event of the examples: ``load_example(index, model)`` is the example ``index`` of those shown for
    the Model dropdown's ``model`` (:func:`examples_for`; ``default_model``'s when it names none; the page sends both
    as they are): (its prompt, no style). It raises IndexError for an index the page never sends, TypeError for a
    model that is no name."""
    def load_example(index: int, model: str | None = None) -> tuple[str, str]:
        if model is not None and not isinstance(model, str):
            raise TypeError(f"model {type(model).__name__}")
        shown = examples_for(model or default_model)
        if type(index) is not int or not 0 <= index < len(shown):
            raise IndexError(f"no example {index!r}")
        return shown[index], NO_STYLE
    return load_example


def model_note(model: str) -> str:
    """The note under the banner for a built-in model (MODEL_NOTES, then how to start real SDXL); "" for others."""
    return MODEL_NOTES[model] + REAL_SDXL_HINT if model in MODEL_NOTES else ""


def lora_tag_adder(engine: EngineContract | None, config: EngineConfig) -> Callable[[int, str | None, str], str]:
    """The page event of the LoRA list: ``add_lora(index, text, model)`` is ``text`` with ``<lora:NAME:1>`` added
    for the ``index``-th LoRA the list shows for the Model dropdown's ``model`` (:func:`model_widgets`: the engine's
    for that model once ready, before that the configured ones, :func:`lora_names_for`), the tag alone for an empty
    prompt. IndexError for an index the page never sends; LookupError for a model the engine does not offer."""
    def add_lora(index: int, text: str | None, model: str | None = None) -> str:
        if model is not None and not isinstance(model, str):  # sent as is (preprocess=False): the page sends a name
            raise TypeError(f"model {type(model).__name__}")
        chosen = chosen_model(engine, model)
        names = lora_names_for(config) if chosen is None else models.lora_names_for(engine, chosen[0])
        if type(index) is not int or not 0 <= index < len(names):
            raise IndexError(f"no LoRA {index!r}")
        tag = f"<lora:{names[index]}:1>"
        return f"{text.rstrip()} {tag}" if isinstance(text, str) and text.strip() else tag
    return add_lora
