"""AUTOMATIC1111's web API (``/sdapi/v1/...``) on this server: txt2img, img2img, progress, interrupt, the lists.

The routes its clients call (webuiapi, Open WebUI, SillyTavern; docs/protocols.md, "AUTOMATIC1111 API"):
``POST txt2img`` (with its hires fix and refiner fields) and ``img2img`` (its images prepared as A1111 does:
service/image_prep.py, in memory; the overlay recorded in the request as a PasteBack) build the service's request
(:func:`to_call`) and run it as a job of the front "a1111" (core.generate: the same line, cap, checks and messages
as every front's), owned by the client's address (``force_task_id`` names it: :func:`internal_router`);
``GET progress`` reads that client's running A1111 request, ``POST interrupt`` stops it (and its engine calls still
to come), ``POST skip`` ends its running engine call only: never a page's, a gradio_client's, another
protocol's or another address's request; ``sd-models``, ``options``, ``samplers``, ``schedulers``, ``loras``,
``prompt-styles``, ``upscalers``, ``latent-upscale-modes``, ``sd-vae``, ``sd-modules``,
``hypernetworks``, ``embeddings``, ``scripts``, ``cmd-flags`` and ``refresh-*`` describe the one
loaded model and what it takes; ``POST png-info`` reads an image's parameters text (:func:`png_info`);
``POST extra-single-image`` and ``extra-batch-images`` upscale with Pillow's Lanczos or Nearest (extras.py).

Field mapping (:func:`to_call`): ``steps`` -> num_inference_steps, ``cfg_scale`` -> guidance_scale,
``sampler_name`` (else ``sampler_index``) -> the sampler, ``scheduler`` -> schedule_type (A1111 1.9 splits
``DPM++ 2M Karras`` into sampler ``DPM++ 2M`` and scheduler ``Karras``: the same schedule here), ``eta`` -> eta (the
samplers that take one: Euler a, DPM2 a, the DPM++ SDEs, DDIM, TCD; the others ignore it, as A1111's), ``styles`` ->
the page's style (one at most), ``batch_size`` x ``n_iter`` -> the image count (the engine makes its batch per
call; fewer images return the first ones, more run further calls). A field left out takes the
engine's default (A1111's own 512 x 512, 50 steps, CFG 7 would not suit every model). Fields that
would change the images and are not honoured are named in ``info["warnings"]`` and one log line
(:data:`IGNORED`); other unknown fields are ignored, as A1111 does. A value of the wrong type (a
boolean for a number too) is FastAPI's 422; a value the engine refuses is a 422 whose ``detail`` is
the engine's message with A1111's field name; a body no answer could echo (a lone surrogate in any
string) or nested too deep is A1111's 422 before the route runs (:class:`CheckedBody`); an unknown
path is A1111's 404 (:func:`unknown_router`).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import io
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from PIL import Image
from pydantic import BaseModel, BeforeValidator, ConfigDict

from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.engine.ip_adapter import IPAdapterUnit
from sdxl_engine.engine.previews import preview_grid
from sdxl_engine.engine.validation import Limits, size_of
from sdxl_engine.program.latent_upscale import HIRES_UPSCALERS
from sdxl_engine.program.schedulers import (
    DEFAULT_SCHEDULE_TYPE,
    SAMPLERS,
    SCHEDULE_ALIASES,
    SCHEDULE_TYPES,
    UnknownSampler,
    UnknownScheduleType,
    get_schedule_type,
    split_sampler_name,
)
from sdxl_engine.service import models
from sdxl_engine.service.image_prep import FILL_MODES, PasteBack, img2img_start_step, prepare, same_aspect
from sdxl_engine.service.images import EXIF_IFD, USER_COMMENT, png_bytes
from sdxl_engine.service.jobs import QUEUED, RUNNING, Job
from sdxl_engine.service.request import Request as ServiceRequest
from sdxl_engine.service.service import Service
from sdxl_engine.service.styles import NO_STYLE, STYLES
from sdxl_engine.serving.apis.controlnet import SCRIPT as CONTROLNET
from sdxl_engine.serving.apis.controlnet import loaded_of, units_of
from sdxl_engine.serving.apis.core import (
    ApiError,
    Interrupted,
    generate,
    read_json,
    request_of,
    wait_started,
)
from sdxl_engine.serving.apis.extras import ExtrasBatchImages, ExtrasRequest, ExtrasSingleImage, upscaler_list
from sdxl_engine.serving.apis.extras import run as run_extras
from sdxl_engine.serving.apis.uploads import MAX_INPUT_SIDE, decode_image

LOG = logging.getLogger(__name__)

PREFIX = "/sdapi/v1"
KARRAS = " Karras"
# GET /schedulers: A1111's fields (modules/sd_schedulers.py's Scheduler: aliases, default_rho, need_inner_model) for
# the engine's schedule types (schedulers.SCHEDULE_TYPES: names and labels).
SCHEDULER_FIELDS = {"sgm_uniform": {"aliases": ["SGMUniform"]}, "karras": {"default_rho": 7.0},
                    **{name: {"need_inner_model": True} for name in ("uniform", "simple", "beta")}}
SCHEDULERS = tuple({"name": name, "label": label, "aliases": None, "default_rho": -1, "need_inner_model": False,
                    **SCHEDULER_FIELDS.get(name, {})} for name, label in SCHEDULE_TYPES.items())
# What clients send for "no scheduler" (lower-cased): Automatic, as A1111 reads them (SillyTavern sends "N/A").
NO_SCHEDULER = ("", "n/a", "use same scheduler")
# Every scheduler name and label of A1111's modules/sd_schedulers.py (1.10), lower-cased: one of these that this
# server lacks is refused; any other name is no scheduler at all, and A1111's get_sampler_and_scheduler reads it as
# Automatic (``schedulers_map.get(name, schedulers[0])``), so this server does too.
A1111_SCHEDULERS = frozenset(("automatic", "uniform", "karras", "exponential", "polyexponential", "sgm_uniform",
                              "sgm uniform", "sgmuniform", "kl_optimal", "kl optimal", "align_your_steps",
                              "align your steps", "simple", "normal", "ddim", "beta"))
FIELD_NAMES = (("num_inference_steps", "steps"), ("guidance_scale", "cfg_scale"), ("sampler", "sampler_name"),
               ("style", "styles"), ("images", "batch_size*n_iter"), ("hires_scale", "hr_scale"),
               ("hires_strength", "denoising_strength"), ("hires_steps", "hr_second_pass_steps"),
               ("hires_upscaler", "hr_upscaler"), ("strength", "denoising_strength"),
               ("start_step", "denoising_strength"), ("image", "init_images"),
               ("model", "override_settings.sd_model_checkpoint"), ("refiner", "refiner_checkpoint"),
               ("schedule_type", "scheduler"))
DEFAULT_SWITCH_AT = 0.8  # A1111's refiner_switch_at default (its UI's), diffusers' ensemble-of-experts example
NONE_NAMES = ("", "None")  # A1111's "no refiner" and "same sampler" values
SAME_SAMPLER = ("", "Use same sampler")


def _not_bool(value):
    """Pydantic takes true/false for a number (as 1/0); a number field here refuses them (FastAPI's 422)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]


class Txt2Img(BaseModel):
    """The txt2img fields this server reads (A1111's StableDiffusionTxt2ImgProcessingAPI names). Other
    fields are kept (``model_extra``, echoed in ``parameters`` as A1111 does) and not used: those that
    would change the images are named in the answer's warnings (:data:`IGNORED`, :func:`ignored_warnings`)."""

    model_config = ConfigDict(extra="allow")

    prompt: str | None = ""
    negative_prompt: str | None = ""
    seed: Int | None = -1
    steps: Int | None = None
    cfg_scale: Float | None = None
    width: Int | None = None
    height: Int | None = None
    sampler_name: str | None = None
    sampler_index: str | None = None
    scheduler: str | None = None
    eta: Float | None = None
    styles: list[str] | None = None
    batch_size: Int = 1
    n_iter: Int = 1
    send_images: bool = True
    save_images: bool = False
    denoising_strength: Float | None = None
    refiner_checkpoint: str | None = None
    refiner_switch_at: Float | None = None
    force_task_id: str | None = None  # the client's own id for this task (/internal/progress follows it)


class Txt2ImgHires(Txt2Img):
    """txt2img with A1111's hires fix fields (StableDiffusionProcessingTxt2Img): ``enable_hr`` turns it on;
    ``hr_scale`` (default 2) or ``hr_resize_x`` / ``hr_resize_y`` the final size; ``hr_upscaler`` one of
    ``/latent-upscale-modes`` (default Latent) or of ``/upscalers`` (None, Lanczos, Nearest: the decoded images
    resized); ``hr_second_pass_steps`` (0: ``steps``, as A1111); ``hr_sampler_name`` / ``hr_scheduler`` and
    ``hr_prompt`` / ``hr_negative_prompt`` the second pass's (unset or "": the first pass's);
    ``denoising_strength`` the second pass's (default 0.7, A1111's)."""

    enable_hr: bool = False
    hr_scale: Float = 2.0
    hr_upscaler: str | None = None
    hr_second_pass_steps: Int = 0
    hr_resize_x: Int = 0
    hr_resize_y: Int = 0
    hr_sampler_name: str | None = None
    hr_scheduler: str | None = None
    hr_prompt: str | None = ""
    hr_negative_prompt: str | None = ""


class Img2Img(Txt2Img):
    """A1111's StableDiffusionImg2ImgProcessingAPI fields this server reads (a1111_images.prepare): the first of
    ``init_images`` (base64 or a data URL) for every image, ``mask`` (white or opaque = repaint), ``mask_blur``
    (both sides) or ``mask_blur_x`` / ``mask_blur_y``, ``inpainting_fill`` (0 fill, 1 original, 2 latent noise,
    3 latent nothing), ``inpaint_full_res`` + ``inpaint_full_res_padding`` (only the masked area),
    ``inpainting_mask_invert``, ``resize_mode``, ``denoising_strength`` (A1111's step rule), ``mask_round`` (false:
    the blurred mask's grey levels blend the latents, the engine's ``soft_mask``), ``include_init_images`` (echo
    them in ``parameters``). Defaults are A1111's."""

    init_images: list[str] | None = None
    resize_mode: Int = 0
    mask: str | None = None
    mask_blur: Int | None = None
    mask_blur_x: Int = 4
    mask_blur_y: Int = 4
    inpainting_fill: Int = 0
    inpaint_full_res: bool = True
    inpaint_full_res_padding: Int = 0
    inpainting_mask_invert: Int = 0
    mask_round: bool = True
    include_init_images: bool = False


@dataclasses.dataclass(frozen=True)
class Ignored:
    """A txt2img field (A1111's StableDiffusionProcessingTxt2Img) that would change the images and is not
    honoured here: ``defaults`` are the values that change nothing (A1111's default, and what A1111 reads
    as it: None, an empty list), so only another value is named in a warning; or a function of the request
    giving them (None: the field changes nothing for that request); ``why`` says what happens."""

    name: str
    defaults: tuple | Callable[[BaseModel], tuple | None]
    why: str


def _other_scripts(body) -> tuple | None:
    """``alwayson_scripts``' defaults for the warning: a body whose scripts are ControlNet's alone (run here,
    controlnet.units_of) is at its default."""
    scripts = (body.model_extra or {}).get("alwayson_scripts")
    if isinstance(scripts, dict) and all(str(k).strip().lower() == CONTROLNET for k in scripts):
        return (*_UNSET, scripts)
    return _UNSET


_UNSET = (None, "", [], {})
# The fields of A1111's txt2img request (modules/processing.py, modules/api/models.py) that change what
# a user gets and that this server does not honour. The hires fix's own fields (hr_scale, hr_upscaler,
# hr_second_pass_steps, hr_resize_x/y, hr_checkpoint_name, hr_sampler_name, hr_prompt,
# hr_negative_prompt, denoising_strength) matter only with enable_hr, which is named for them all.
COMMON_IGNORED = (
    Ignored("alwayson_scripts", _other_scripts,
            "no scripts or extensions here but ControlNet (ADetailer...): the others did not run"),
    Ignored("script_name", _UNSET, "no scripts here: the plain generation ran"),
    Ignored("infotext", _UNSET, "infotext is not read here: send the fields themselves"),
    Ignored("restore_faces", (*_UNSET, False), "no face restoration here"),
    Ignored("tiling", (*_UNSET, False), "no tiling here: the images do not wrap around"),
    Ignored("subseed_strength", (*_UNSET, 0), "no variation seeds here: each image is its seed alone"),
    Ignored("seed_resize_from_w", (*_UNSET, 0, -1), "no seed resize here"),
    Ignored("seed_resize_from_h", (*_UNSET, 0, -1), "no seed resize here"),
    Ignored("s_churn", (*_UNSET, 0), "the sampler noise settings are fixed here (A1111's defaults)"),
    Ignored("s_tmin", (*_UNSET, 0), "the sampler noise settings are fixed here (A1111's defaults)"),
    Ignored("s_tmax", (*_UNSET, 0), "the sampler noise settings are fixed here (A1111's defaults)"),
    Ignored("s_noise", (*_UNSET, 1), "the sampler noise settings are fixed here (A1111's defaults)"),
    Ignored("s_min_uncond", (*_UNSET, 0), "no negative-guidance skipping here: every step uses the negative prompt"),
    Ignored("token_merging_ratio", (*_UNSET, 0), "no token merging here"),
    Ignored("disable_extra_networks", (*_UNSET, False), "<lora:...> tags in the prompt are applied here all the same"),
)
IGNORED = (  # txt2img's
    Ignored("firstphase_width", (*_UNSET, 0), "the hires fix's first pass is width x height here"),
    Ignored("firstphase_height", (*_UNSET, 0), "the hires fix's first pass is width x height here"),
    Ignored("init_images", _UNSET, "txt2img takes no image: send it to /sdapi/v1/img2img"),
    *COMMON_IGNORED,
)
IMG2IMG_IGNORED = (
    Ignored("initial_noise_multiplier", (*_UNSET, 1), "the initial noise is not scaled here"),
    Ignored("latent_mask", _UNSET, "a separate latent mask is not read here: the mask is used for both"),
    Ignored("image_cfg_scale", lambda body: None, "for instruct-pix2pix models only"),
    *COMMON_IGNORED,
)


def ignored_warnings(body: Txt2Img, options: dict, table: tuple = IGNORED) -> list[str]:
    """The warnings for a txt2img (or img2img: ``table`` :data:`IMG2IMG_IGNORED`) ``body``'s fields this server
    does not honour (:data:`IGNORED`), and for ``override_settings`` entries other than ``options`` (GET /options:
    the caller's: this server's fixed values) but ``sd_model_checkpoint`` (served: :func:`model_field`), one line
    each, in the table's order. A field at one of its defaults gives none."""
    sent = body.model_extra or {}
    warnings = []
    for row in table:
        defaults = row.defaults(body) if callable(row.defaults) else row.defaults
        if row.name in sent and defaults is not None and not _at_default(sent[row.name], defaults):
            warnings.append(f"{row.name}={_short(sent[row.name])} ignored: {row.why}")
    overrides = sent.get("override_settings")
    for key, value in (overrides.items() if isinstance(overrides, dict) else ()):
        if key in options and options[key] == value or key == MODEL_OPTION:  # the model: served (model_field)
            continue
        why = ("clip skip is fixed at 1 here" if key == "CLIP_stop_at_last_layers" else
               "options are fixed at start-up (flags or SDXL_* settings)")
        warnings.append(f"override_settings.{key}={_short(value)} ignored: {why}")
    return warnings


def _at_default(value, defaults: tuple) -> bool:
    return any(type(value) is type(d) and value == d or value is None and d is None
               or isinstance(value, (int, float)) and not isinstance(value, bool)
               and isinstance(d, (int, float)) and not isinstance(d, bool) and value == d for d in defaults)


def _short(value) -> str:
    """A sent value for a warning: JSON, cut to 60 characters."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 60 else text[:57] + "..."


def sampler_of(sampler_name: str | None, scheduler: str | None,
               field: str = "scheduler") -> tuple[str | None, str | None]:
    """(the engine's sampler, its schedule_type) for A1111's ``sampler_name`` and ``scheduler`` (None: the engine's
    default; schedule type None: automatic).

    ``scheduler`` is a name, label or alias of A1111's modules/sd_schedulers.py that this engine has
    (schedulers.SCHEDULE_TYPES), or one of this engine's own there (the spacings: leading, linspace, trailing, which
    its ``/schedulers`` lists); None, "", "N/A", "Automatic" and any name that is no scheduler of A1111's or this
    server's are automatic, as A1111 reads them; one of A1111's that this server lacks is refused. A sampler name
    ending in a schedule type that is no sampler here ("Euler a Karras") is split as A1111's
    get_sampler_and_scheduler splits it (schedulers.split_sampler_name), and its schedule type wins over
    ``scheduler``'s, as there.
    Names are case-insensitive. Raises ApiError 422 naming ``sampler_name`` for an unknown sampler, ``field`` for an
    unknown scheduler (the valid names listed).
    """
    name = None if sampler_name in (None, "") else sampler_name
    try:
        sampler, suffix = (None, None) if name is None else split_sampler_name(name)
    except UnknownSampler as err:
        raise ApiError(422, f"sampler_name: {err}", "sampler_name") from None
    given = " ".join((scheduler or "").split()).lower()
    ours = given in SCHEDULE_TYPES or given in SCHEDULE_ALIASES or given in (v.lower() for v in SCHEDULE_TYPES.values())
    wanted = suffix or (scheduler if given not in NO_SCHEDULER and (given in A1111_SCHEDULERS or ours) else None)
    try:
        schedule_type = get_schedule_type(wanted)
    except UnknownScheduleType as err:
        raise ApiError(422, f"{field}: {err} (A1111's labels: {', '.join(SCHEDULE_TYPES.values())})",
                       field) from None
    return sampler, None if schedule_type == DEFAULT_SCHEDULE_TYPE else schedule_type


def refiner_name(engine) -> str:
    """The loaded refiner's name as ``/sd-models`` lists it (a folder by its own name), "" without one."""
    setting = getattr(engine.config, "refiner", "") or ""
    return Path(setting).name if setting and Path(setting).exists() else setting


MODEL_OPTION = "sd_model_checkpoint"  # A1111's option (and override) naming the model, by title or name
MAX_OWNERS = 4096  # callers whose own default model (POST /options) is kept, the least recently set dropped first


def model_field(body: Txt2Img, engine, chosen: str | None) -> dict:
    """The engine field for the request's model: ``override_settings.sd_model_checkpoint`` (A1111's title
    ``"name [hash]"`` or the bare name: for this request only, as A1111 restores it afterwards), else ``chosen``
    (the caller's own default, set by ``POST /options``; None: the server's). {} for the server's default.

    Raises ApiError 422 naming ``override_settings.sd_model_checkpoint`` and the models offered, for a model this
    server does not have; naming ``override_settings`` when it is not an object (A1111's model takes a dict)."""
    overrides = (body.model_extra or {}).get("override_settings")
    if overrides is not None and not isinstance(overrides, dict):  # A1111's model: a dict (a 422 for another)
        raise ApiError(422, f"override_settings: expected an object of options ({{\"{MODEL_OPTION}\": ...}}), got "
                            f"{type(overrides).__name__} {_short(overrides)}", "override_settings")
    wanted = overrides.get(MODEL_OPTION) if isinstance(overrides, dict) else None
    field = f"override_settings.{MODEL_OPTION}"
    try:
        name = models.choose(engine, wanted, field) if wanted not in (None, "") else chosen
    except InvalidRequest as err:
        raise ApiError(422, f"{field}: {err.message}", field) from None
    return {} if name is None else {"model": name}


def refiner_fields(body: Txt2Img, engine) -> dict:
    """The engine fields for A1111's ``refiner_checkpoint`` and ``refiner_switch_at`` (default 0.8): {} when no
    refiner is asked for (None, "" or "None") or ``refiner_switch_at`` is 1 (A1111 switches once that share of
    the steps is done: never; sd_samplers_common.apply_refiner). A1111 titles (``name [hash]``) and file names with an
    extension match a refiner's name (service/models.refiners); a refiner other than the first is the request's
    ``refiner``.

    Raises ApiError 422 naming what is loaded: no refiner loaded, or another name."""
    wanted = (body.refiner_checkpoint or "").strip()
    if wanted in NONE_NAMES:
        return {}
    offered = models.refiners(engine, refiner_name(engine))
    if not offered:
        raise ApiError(422, f"refiner_checkpoint: no refiner is loaded here (the server starts one with "
                                  f"--refiner); got {wanted[:80]!r}", "refiner_checkpoint")
    plain = wanted.split(" [")[0].strip()
    name = next((n for n in offered if plain in (n, Path(n).stem) or Path(plain).stem in (n, Path(n).stem)), None)
    if name is None:
        raise ApiError(422, f"refiner_checkpoint: unknown refiner {wanted[:80]!r}; this server offers: "
                                  f"{', '.join(offered)}", "refiner_checkpoint")
    if body.refiner_switch_at == 1:  # A1111 switches once that share of the steps is done: at 1, never
        return {}
    switch = DEFAULT_SWITCH_AT if body.refiner_switch_at is None else body.refiner_switch_at
    return {"refiner_switch_at": switch, **({"refiner": name} if name != offered[0] else {})}


def hires_fields(body: Txt2ImgHires, width: int, height: int, steps: int) -> tuple[dict, list[str]]:
    """(engine fields, warnings) of txt2img's hires fix for a first pass of ``width`` x ``height`` and ``steps``
    steps: {} without ``enable_hr``. The second pass runs ``hr_second_pass_steps or steps`` steps, as A1111 passes
    them (processing.sample_hr_pass; setup_img2img_steps with steps given: exactly that many run). The final size
    is ``hr_scale`` x the size, or ``hr_resize_x`` / ``hr_resize_y`` (one of them: the other follows the aspect
    ratio; both: they must keep it, as this server scales both sides by one factor), each side down to the
    model's multiple (validation.hires_size). ``hr_sampler_name`` (with ``hr_scheduler``, else ``scheduler``),
    ``hr_prompt`` and ``hr_negative_prompt`` set the second pass's, as A1111's ``sample_hr_pass`` (unset, "" or
    "Use same sampler": the first pass's).

    Raises ApiError 422 naming hr_resize_x/hr_resize_y for a size of another aspect ratio, hr_sampler_name or
    hr_scheduler for one this server does not have."""
    if not body.enable_hr:
        return {}, []
    scale = body.hr_scale
    rx, ry = body.hr_resize_x, body.hr_resize_y
    if rx or ry:
        if rx and ry and not same_aspect((rx, ry), (width, height)):
            raise ApiError(422, f"hr_resize_x/hr_resize_y: {rx}x{ry} has another aspect ratio than the first pass's "
                                f"{width}x{height}; this server scales both sides by one factor: send hr_scale, or "
                                "one of hr_resize_x and hr_resize_y", "hr_resize_x")
        scale = rx / width if rx else ry / height
    fields = {"hires_scale": scale, "hires_strength": body.denoising_strength,
              "hires_steps": body.hr_second_pass_steps or steps, "hires_upscaler": body.hr_upscaler or None,
              "hires_prompt": body.hr_prompt or None, "hires_negative_prompt": body.hr_negative_prompt or None}
    same_scheduler = (body.hr_scheduler or "").strip().lower() in NO_SCHEDULER
    if (body.hr_sampler_name or "") not in SAME_SAMPLER or not same_scheduler:
        named = body.hr_sampler_name if (body.hr_sampler_name or "") not in SAME_SAMPLER else (
            body.sampler_name or body.sampler_index)
        first = sampler_of(body.sampler_name or body.sampler_index, body.scheduler)[1]
        try:
            sampler, schedule_type = sampler_of(named, body.scheduler if same_scheduler else body.hr_scheduler)
        except ApiError as err:
            field = "hr_scheduler" if err.param == "scheduler" else "hr_sampler_name"
            raise ApiError(422, f"{field}: {err.message.split(': ', 1)[-1]}", field) from None
        if schedule_type != first:  # one schedule type per request: only the Karras sampler's name carries its own
            if (sampler, schedule_type, first) != ("DPM++ 2M", "karras", None):
                if same_scheduler:  # the type came with the second pass's sampler name ("DPM++ SDE Karras")
                    raise ApiError(422, f"hr_sampler_name: {named!r} names the schedule type {schedule_type!r}; "
                                        f"this server's second pass runs the first pass's (scheduler "
                                        f"{body.scheduler or 'Automatic'!r}): send the sampler's own name, or that "
                                        "schedule type as scheduler", "hr_sampler_name")
                raise ApiError(422, f"hr_scheduler: {body.hr_scheduler!r}: this server's second pass runs the first "
                                    f"pass's schedule type (scheduler {body.scheduler or 'Automatic'!r}); send "
                                    "\"Use same scheduler\"", "hr_scheduler")
            sampler = "DPM++ 2M Karras"
        fields["hires_sampler"] = sampler
    return fields, []


def to_call(body: Txt2Img, width=None, height=None, paste_back: PasteBack | None = None,
            parameters: dict | None = None, **fields) -> ServiceRequest:
    """The service's request for a txt2img (or img2img) body (the module docstring's mapping); ``width`` and
    ``height`` (else the body's); ``paste_back``, ``parameters`` and ``fields`` (GenerateRequest fields: image,
    mask, strength, hires_*, refiner_switch_at): what the body asks beyond txt2img.

    Raises ApiError 422: an unknown sampler, scheduler or style, more than one style, batch_size or n_iter below 1.
    """
    sampler, schedule_type = sampler_of(body.sampler_name or body.sampler_index, body.scheduler)
    if schedule_type is not None:
        fields = {**fields, "schedule_type": schedule_type}
    if body.eta is not None:  # the engine's eta: the samplers that take one use it, the others ignore it, as A1111's
        fields = {**fields, "eta": body.eta}
    styles = [s for s in body.styles or [] if s and s != NO_STYLE]
    if len(styles) > 1:
        raise ApiError(422, f"styles: this server applies one style per request, got {len(styles)}: "
                            f"{', '.join(styles)}", "styles")
    for name in ("batch_size", "n_iter"):
        if getattr(body, name) < 1:
            raise ApiError(422, f"{name}: must be at least 1, got {getattr(body, name)}", name)
    try:
        return request_of(FIELD_NAMES, prompt=body.prompt, negative_prompt=body.negative_prompt, seed=body.seed,
                          guidance_scale=body.cfg_scale, num_inference_steps=body.steps,
                          width=body.width if width is None else width,
                          height=body.height if height is None else height, style=styles[0] if styles else NO_STYLE,
                          sampler=sampler, images=body.batch_size * body.n_iter, paste_back=paste_back,
                          parameters=parameters, **fields)
    except ApiError as err:  # the style: A1111 answers a bad value 422
        raise ApiError(422, err.message, err.param) from None


def img2img_call(body: Img2Img, engine, chosen: str | None = None) -> tuple[ServiceRequest, list[str]]:
    """(the service's request, warnings) of an A1111 img2img body: its images decoded in memory
    (uploads.decode_image), prepared as A1111 does (a1111_images.prepare) at ``width`` x ``height`` (the
    engine's default size for a side not sent), the steps run by A1111's rule (a1111_images.img2img_start_step;
    ``denoising_strength`` default 0.75), the overlay of the original outside the mask; the model
    :func:`model_field`'s (``chosen``: the caller's own default, or None).

    Raises ApiError 422 naming the field: no init image, an undecodable or oversized image, a mask of another
    aspect ratio, a value out of A1111's range, an unknown refiner."""
    if not body.init_images:
        raise ApiError(422, "init_images: send one image (base64 PNG, JPEG or WebP, or a data URL)", "init_images")
    warnings = []
    if len(body.init_images) > 1:
        warnings.append(f"init_images: {len(body.init_images)} images sent; the first is used for every image")
    ranges = (("resize_mode", body.resize_mode, 0, 3), ("inpainting_fill", body.inpainting_fill, 0, 3),
              ("mask_blur_x", body.mask_blur_x, 0, 64), ("mask_blur_y", body.mask_blur_y, 0, 64),
              ("mask_blur", body.mask_blur if body.mask_blur is not None else 0, 0, 64),
              ("inpaint_full_res_padding", body.inpaint_full_res_padding, 0, 256),
              ("inpainting_mask_invert", body.inpainting_mask_invert, 0, 1),
              ("denoising_strength", 0.75 if body.denoising_strength is None else body.denoising_strength, 0, 1))
    for name, value, low, high in ranges:
        if not low <= value <= high:
            raise ApiError(422, f"{name}: must be within {low} to {high}, got {value}", name)
    init = decode_image(body.init_images[0], "init_images[0]", mode=None)
    mask = None if not body.mask else decode_image(body.mask, "mask", mode=None)
    if mask is not None and mask.size != init.size and not same_aspect(mask.size, init.size):
        raise ApiError(422, f"mask: is {mask.width}x{mask.height} pixels but the init image is {init.width}x"
                            f"{init.height}; send a mask of the image's size (or its aspect ratio)", "mask")
    model = model_field(body, engine, chosen)  # its size and steps for the fields not sent, not the default's
    default_w, default_h = models.limits_for(engine, model.get("model")).default_size
    width, height = body.width or default_w, body.height or default_h
    for name, side in (("width", width), ("height", height)):
        if not 8 <= side <= MAX_INPUT_SIDE:
            raise ApiError(422, f"{name}: must be within 8 to {MAX_INPUT_SIDE} pixels, got {side}", name)
    own = models.loaded_limits(engine, model.get("model"))  # the model's own, once loaded
    if isinstance(own, Limits):  # the image is resized to width x height here: a size the model cannot make is theirs
        try:
            size_of(width, height, own)
        except InvalidRequest as err:
            raise ApiError(422, str(err), err.field) from None
    blur_x, blur_y = (body.mask_blur, body.mask_blur) if body.mask_blur is not None else (body.mask_blur_x,
                                                                                          body.mask_blur_y)
    prepared = prepare(init, mask, width, height, body.resize_mode, blur_x, blur_y, bool(body.inpainting_mask_invert),
                       body.inpainting_fill, body.inpaint_full_res, body.inpaint_full_res_padding)
    if mask is not None and body.inpainting_fill in (2, 3):
        warnings.append(f"inpainting_fill={body.inpainting_fill} ({FILL_MODES[body.inpainting_fill]}) "
                        "runs as 0 (fill) here: the masked area is pre-filled with the colours around it, and its "
                        "latents are not replaced")
    if body.resize_mode == 3:
        warnings.append("resize_mode=3 (latent upscale) runs as 0 (just resize) here: the image is resized before "
                        "it is encoded")
    steps = body.steps or models.default_steps(engine, model.get("model"))
    strength = 0.75 if body.denoising_strength is None else body.denoising_strength
    fields = {"image": prepared.image, "strength": strength if strength > 0 else None,
              "start_step": img2img_start_step(strength, steps) if isinstance(steps, int) else None,
              **({"mask": prepared.mask, "soft_mask": not body.mask_round} if prepared.mask is not None else {}),
              **refiner_fields(body, engine), **model}
    # Strength 0 runs A1111's one step from start_step alone (the engine takes no strength 0): its infotext still
    # says Denoising strength: 0, as A1111's does.
    params = prepared.params if strength > 0 else {"Denoising strength": 0, **prepared.params}
    return to_call(body, width, height, prepared.finish, params, **fields), warnings


def infotext(png: bytes) -> str:
    """The A1111 ``parameters`` text chunk of a PNG the handler wrote (delivery.py)."""
    return Image.open(io.BytesIO(png)).text.get("parameters", "")


class PngInfo(BaseModel):
    """A1111's PNGInfoRequest: ``image``, the image as base64 (a ``data:image/...;base64,`` URL too)."""

    image: str


# A1111's modules/infotext_utils.py: one "Key: value" of an infotext's last line (a value is plain up to the
# next comma, or JSON-quoted), and a size value ("1024x768").
_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
_IMAGE_SIZE = re.compile(r"^(\d+)x(\d+)$")
_UNICODE_COMMENT = b"UNICODE\0"  # EXIF UserComment's character-code prefix for UTF-16 text (piexif writes big-endian)


def generation_parameters(text: str) -> dict:
    """An infotext's fields as A1111's ``parse_generation_parameters`` reads them: ``Prompt`` (the lines
    before ``Negative prompt:``), ``Negative prompt``, and each ``Key: value`` of the last line as text
    (JSON-quoted values unquoted; a ``WxH`` value as ``Key-1`` and ``Key-2``). The last line counts as
    fields only when it holds at least 3 of them, as in A1111. A1111's defaults for fields the text
    lacks (hires fix, inpainting, RNG) are not added: this server has none of them."""
    *lines, last = text.strip().split("\n")
    if len(_PARAM.findall(last)) < 3:
        lines.append(last)
        last = ""
    prompt, negative, in_negative = [], [], False
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            in_negative, line = True, line[len("Negative prompt:"):].strip()
        (negative if in_negative else prompt).append(line)
    fields = {}
    for key, value in _PARAM.findall(last):
        if len(value) > 1 and value[0] == value[-1] == '"':
            try:
                value = json.loads(value)
            except ValueError:
                pass
        if (size := _IMAGE_SIZE.match(value)) is not None:
            fields[f"{key}-1"], fields[f"{key}-2"] = size[1], size[2]
        else:
            fields[key] = value
    return {**fields, "Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative)}


def png_info(image_b64: str) -> dict:
    """A1111's ``POST /sdapi/v1/png-info`` answer (PNGInfoResponse) for a base64 image: ``info``, the
    generation parameters text (a PNG's ``parameters`` chunk, or the EXIF UserComment of a JPEG or WebP,
    where A1111 and this server's OpenAI API put it); ``items``, the image's other text fields;
    ``parameters``, ``info`` parsed (:func:`generation_parameters`). Only the image's header and text
    are read, never its pixels. Raises ApiError 400 (param ``image``) for what is no image."""
    data = image_b64.strip()
    if data.startswith("data:image/"):
        data = data.partition(",")[2]
    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        items = dict(image.info)
        comment = image.getexif().get_ifd(EXIF_IFD).get(USER_COMMENT, b"") if "exif" in items else b""
    except Image.DecompressionBombError:  # Pillow's check on opening; its pixels would never be read here
        raise ApiError(400, "image: the image claims too many pixels (more than Pillow opens: "
                            f"{2 * Image.MAX_IMAGE_PIXELS})", "image") from None
    except (ValueError, OSError, SyntaxError) as err:  # binascii.Error is a ValueError
        reason = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(err))  # PIL names its buffer
        raise ApiError(400, f"image: not a base64 PNG, JPEG or WebP image ({reason[:80]})", "image") from None
    text = items.pop("parameters", None)
    if isinstance(comment, bytes) and comment:
        text = comment[8:].decode("utf-16-be", "replace") if comment.startswith(_UNICODE_COMMENT) \
            else comment[8:].decode("utf-8", "ignore")
    text = text if isinstance(text, str) else ""
    items = {k: v for k, v in items.items() if isinstance(k, str) and isinstance(v, str)}
    return {"info": text, "items": items, "parameters": generation_parameters(text) if text else {}}


def sd_model_list(engine) -> list[dict]:
    """``GET /sdapi/v1/sd-models``' entries for every model offered, the default first, in A1111's shape (its
    modules/api/models.py SDModelItem): ``title`` ``"name [hash10]"`` (the bare name while the hash is computed),
    ``model_name``, ``hash`` (10 hex digits), ``sha256``, ``filename`` (the file or folder; "" for a hub id or a
    built-in model), ``config`` null. Never waits for a hash (service/models.infos)."""
    return [{"title": i.title, "model_name": i.name, "hash": i.hash, "sha256": i.sha256, "filename": i.filename,
             "config": None} for i in models.infos(engine)]


def info_record(body: Txt2Img, info: dict, seeds: list[int], infotexts: list[str]) -> dict:
    """A1111's ``info`` object (processing.Processed.js) for one txt2img answer.

    ``info``: the handler's record (docs/python.md) of the first engine call; ``seeds``: every
    image's seed, in order; ``infotexts``: each image's parameters text.
    """
    n = len(seeds)
    sampler = info["sampler"]
    return {
        "prompt": body.prompt, "all_prompts": [info["prompt"]] * n,
        "negative_prompt": body.negative_prompt, "all_negative_prompts": [info["negative_prompt"]] * n,
        "seed": seeds[0] if seeds else -1, "all_seeds": seeds, "subseed": -1, "all_subseeds": [-1] * n,
        "subseed_strength": 0, "width": info["width"], "height": info["height"], "sampler_name": sampler,
        "scheduler": "Karras" if sampler.endswith(KARRAS) else SCHEDULE_TYPES[info.get("schedule_type",
                                                                                      DEFAULT_SCHEDULE_TYPE)],
        "cfg_scale": info["guidance_scale"],
        "steps": info["num_inference_steps"], "batch_size": body.batch_size, "n_iter": body.n_iter,
        "restore_faces": False, "face_restoration_model": None, "sd_model_name": info["model"],
        "sd_model_hash": None, "sd_vae_name": None, "sd_vae_hash": None, "seed_resize_from_w": -1,
        "seed_resize_from_h": -1,
        "denoising_strength": denoising_strength(body, info),
        "extra_generation_params": {} if info.get("style", NO_STYLE) == NO_STYLE else {"Style": info["style"]},
        "index_of_first_image": 0, "infotexts": infotexts, "styles": body.styles or [],
        "job_timestamp": time.strftime("%Y%m%d%H%M%S"), "clip_skip": 1, "is_using_inpainting_conditioning": False,
        "latency_s": info["latency_s"], "warnings": info["warnings"], "saved": info.get("saved", []),
    }


def denoising_strength(body: Txt2Img, info: dict) -> float | None:
    """A1111's ``denoising_strength`` in ``info``: img2img's (the engine's strength; the body's for 0, which
    runs by start step alone), the hires pass's, else None (a plain txt2img)."""
    if info.get("strength") is not None:
        return info["strength"]
    if getattr(body, "init_images", None):
        return 0.75 if body.denoising_strength is None else body.denoising_strength
    return (info.get("hires") or {}).get("strength")


def latest(requests: Service, owner: str) -> Job | None:
    """The A1111 job of ``owner`` that ``GET progress`` describes: its running one (A1111's progress is the running
    job's), else the first of its queued ones in line, else its newest finished one, else None."""
    jobs = requests.jobs(owner, front="a1111")  # newest first
    waiting = [job for job in jobs if job.status == RUNNING] or [job for job in jobs if job.status == QUEUED]
    return waiting[-1] if waiting else (jobs[0] if jobs else None)


def running(requests: Service, owner: str) -> list[Job]:
    """``owner``'s A1111 jobs running now: what ``POST interrupt`` and ``skip`` reach. A1111's interrupt and skip
    end the running job (modules/shared_state.State.interrupt: its next job begins with the flag cleared), so a
    request of the caller's that waits in line runs after it."""
    return [job for job in requests.jobs(owner, front="a1111") if job.status == RUNNING]


def progress_record(job: Job | None, skip_current_image: bool = False) -> dict:
    """A1111's ``GET /sdapi/v1/progress`` answer (modules/api/models.py ProgressResponse) for the caller's running
    A1111 request ``job`` (None or finished: idle): ``job_count`` its engine calls, ``job_no`` the running one
    (0-based), ``progress`` the share of all its calls' steps done, ``current_image`` its latest preview."""
    running = job is not None and not job.done
    preview = None if not running or skip_current_image or job.preview is None else \
        base64.b64encode(png_bytes(preview_grid(job.preview))).decode()
    return {
        "progress": job.fraction if running else 0.0, "eta_relative": (job.eta_s or 0.0) if running else 0.0,
        "state": {"skipped": running and job.skipped.is_set(), "interrupted": running and job.cancelled.is_set(),
                  "stopping_generation": running and job.cancelled.is_set(),
                  "job": f"job {job.id}" if running else "", "job_count": job.calls if running else 0,
                  "job_timestamp": "0", "job_no": job.call if running else 0,
                  "sampling_step": job.step if running else 0, "sampling_steps": job.steps if running else 0},
        "current_image": preview, "textinfo": (job.stage or None) if running else None,
    }


def internal_progress(job: Job | None, id_live_preview: int = -1) -> dict:
    """A1111's ``POST /internal/progress`` answer (modules/progress.py ProgressResponse) for one task: ``active``
    (running), ``queued``, ``completed``, ``progress`` (0..1, None when not running), ``eta`` (seconds),
    ``live_preview`` (a data URL of the latest preview, when newer than ``id_live_preview``), ``id_live_preview``
    (the step it was made at), ``textinfo``. An unknown task is neither active, queued nor completed, as A1111's."""
    if job is None:
        return {"active": False, "queued": False, "completed": False, "progress": None, "eta": None,
                "live_preview": None, "id_live_preview": id_live_preview, "textinfo": None}
    active, queued = job.status == "running", job.status == "queued"
    preview, preview_id = None, id_live_preview
    if active and job.preview is not None and job.step > id_live_preview:
        preview = "data:image/png;base64," + base64.b64encode(png_bytes(preview_grid(job.preview))).decode()
        preview_id = job.step
    text = (f"In queue: {job.position + 1} ahead of it" if queued and job.position is not None
            else job.stage or None) if not job.done else "Finished" if job.status == "succeeded" else job.status
    return {"active": active, "queued": queued, "completed": job.done, "progress": job.fraction if active else None,
            "eta": job.eta_s if active else None, "live_preview": preview, "id_live_preview": preview_id,
            "textinfo": text}


def a1111_error(err: ApiError, bad_value: int = 422) -> JSONResponse:
    """A refusal in A1111's error shape (modules/api/api.py handle_exception: error, detail, body, errors);
    ``bad_value``: the status for a refused value (an ApiError 400, the fronts' shared status for one). Every
    /sdapi/v1 route answers a value it cannot take 422, as FastAPI's own check of A1111's bodies does, so one
    mistake has one status whichever route it is sent to (an unknown model in POST /options as in txt2img)."""
    # A1111's "error" is the exception's class: FastAPI's HTTPException for an HTTP status it raises (a 401, a 429 of
    # too many requests, a 503 while the model loads), the server's own class for a failure inside (500).
    kind = "InvalidRequest" if err.status in (400, 422) else "ServerError" if err.status == 500 else "HTTPException"
    status = bad_value if err.status == 400 else err.status
    return JSONResponse({"error": kind, "detail": err.message, "body": "", "errors": err.message},
                        status_code=status, headers=err.headers)


class CheckedBody(APIRoute):
    """An ``/sdapi/v1`` route whose JSON body is refused before the route runs when it could not be
    answered (core.read_json: a string UTF-8 cannot carry, a lone surrogate, at any depth and in keys;
    nesting past core.MAX_JSON_DEPTH): A1111's 422 naming the field. FastAPI's documented seam for
    a route's request handling (a custom ``APIRoute``); the route still reads the same body."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request):
            raw = await request.body()  # Starlette keeps it: the route's own parse reads the same bytes
            try:
                read_json(raw)
            except ApiError as err:
                if err.message != "the request body is not JSON":  # not JSON: the route's own refusal
                    LOG.info(f"[app] request refused: {request.url.path}: {err.message}")
                    return a1111_error(err, bad_value=422)
            return await handler(request)

        return checked


def router(requests: Service, flags: dict, loras, owner_of: Callable) -> APIRouter:
    """The ``/sdapi/v1`` routes, generating through ``requests`` (service.Service) as jobs of the front "a1111".

    ``flags``: what ``cmd-flags`` shows (safe values only: no paths, no key); ``loras``: a callable
    giving ``(names, reason)`` for ``/loras`` (apis.loras_of); ``owner_of(request)``: who owns a route's jobs
    (core.owner_of: the API key, else the client's address), whose progress, interrupt and skip it reaches.
    """
    api = APIRouter(prefix=PREFIX, route_class=CheckedBody)
    engine = requests.engine
    extras_turn = asyncio.Lock()  # one Extras request at a time: each holds its images in memory

    def with_units(body: Txt2Img, make_call):
        """make_call()'s call with the body's ControlNet units (apis/controlnet.units_of) as its control_units, and
        those naming an IP-Adapter as its ip_adapter_units."""
        units, unit_warnings = units_of(body.model_extra or {}, loaded_of(engine), loaded_of(engine, "ip_adapters"),
                                        dict(engine.limits.controlnet_unions))
        call, more = make_call()
        control = tuple(u for u in units if not isinstance(u, IPAdapterUnit))
        ip = tuple(u for u in units if isinstance(u, IPAdapterUnit))
        if control or ip:
            call = dataclasses.replace(call, engine=dataclasses.replace(call.engine, control_units=control,
                                                                        ip_adapter_units=ip))
        return call, more + unit_warnings

    async def answer(route: str, body: Txt2Img, request: Request,
                     make_call: Callable[[], tuple[ServiceRequest, list[str]]],
                     warnings: list[str], echo: dict):
        """A1111's answer to a generation route: the images, ``parameters`` (``echo``: the body as A1111 echoes
        it) and ``info``; a refusal in A1111's shape (422 for a bad value, an unknown refiner too), one log
        line. ``make_call()`` gives the call and more warnings; it runs in a thread (images decode there)."""
        await wait_started(engine)
        try:
            if engine.error is not None:
                raise ApiError(503, f"the engine failed to start: {engine.error}")
            call, more = await asyncio.to_thread(with_units, body, make_call)
        except ApiError as err:
            LOG.info(f"[app] request refused: /sdapi/v1/{route}: {err.message}")
            return a1111_error(err, bad_value=422)
        warnings = warnings + more
        if warnings:
            LOG.info(f"[app] A1111 {route}: {len(warnings)} field(s) not honoured: {'; '.join(warnings)}")
        try:
            made = await generate(requests, request, call, "a1111", owner_of(request), task_id(body))
        except Interrupted as err:  # A1111 answers an interrupted job with what it has: here nothing
            return {"images": [], "parameters": echo,
                    "info": json.dumps({"interrupted": True, "message": err.message, "all_seeds": [], "infotexts": []})}
        except ApiError as err:
            return a1111_error(err, bad_value=422)
        texts = [infotext(png) for png in made.pngs]
        images = [base64.b64encode(png).decode() for png in made.pngs] if body.send_images else []
        info = info_record(body, {**made.info, "warnings": warnings + made.info["warnings"]}, made.seeds, texts)
        info["sd_model_hash"] = models.hash_of(engine, made.info["model"])  # the model that made them
        if made.stopped is not None:  # interrupted (or a batch skipped) after some images: those, as A1111 does
            info.update(interrupted=True, message=made.stopped)
        return {"images": images, "parameters": echo, "info": json.dumps(info)}

    @api.post("/txt2img")
    async def txt2img(body: Txt2ImgHires, request: Request):
        owner = owner_of(request)
        warnings = ignored_warnings(body, await get_options(request))

        def make_call():
            to_call(body)  # the body's own refusals (sampler, styles, batch) before the hires fix's
            model = model_field(body, engine, chosen.get(owner))  # the first pass's size and steps are its own
            size = models.limits_for(engine, model.get("model")).default_size
            first = (body.width or size[0], body.height or size[1])
            hires, more = hires_fields(body, *first, body.steps or models.default_steps(engine, model.get("model")))
            fields = {**hires, **refiner_fields(body, engine), **model}
            resized = hires and (body.hr_resize_x or body.hr_resize_y)  # A1111's infotext names the size it was given
            return to_call(body, parameters={"Hires resize": f"{body.hr_resize_x}x{body.hr_resize_y}"} if resized
                           else None, **fields), more

        return await answer("txt2img", body, request, make_call, warnings, body.model_dump())

    @api.post("/img2img")
    async def img2img(body: Img2Img, request: Request):
        warnings = ignored_warnings(body, await get_options(request), IMG2IMG_IGNORED)
        echo = body.model_dump()
        if not body.include_init_images:  # as A1111's api.img2imgapi: the images are echoed only when asked
            echo.update(init_images=None, mask=None)
        chosen_model = chosen.get(owner_of(request))
        return await answer("img2img", body, request, lambda: img2img_call(body, engine, chosen_model), warnings,
                            echo)

    @api.post("/png-info")
    async def png_info_route(body: PngInfo):
        try:
            return png_info(body.image)
        except ApiError as err:
            return a1111_error(err, bad_value=422)

    async def upscaled(route: str, body: ExtrasRequest, images: list[tuple[str, str]]):
        """(base64 PNGs, html_info) of an Extras route, or A1111's 422 naming the field; one log line either
        way for what is refused or not honoured. The work runs in a thread, one request at a time."""
        try:
            async with extras_turn:
                pngs, info, warnings = await asyncio.to_thread(run_extras, body, images)
        except ApiError as err:
            LOG.info(f"[app] request refused: {route}: {err.message}")
            return None, a1111_error(err, bad_value=422)
        if warnings:
            LOG.info(f"[app] A1111 {route}: {len(warnings)} field(s) not honoured: {'; '.join(warnings)}")
        return pngs, info

    @api.post("/extra-single-image")
    async def extra_single_image(body: ExtrasSingleImage):
        pngs, info = await upscaled("extra-single-image", body, [(body.image, "image")])
        return info if pngs is None else {"image": pngs[0], "html_info": info}

    @api.post("/extra-batch-images")
    async def extra_batch_images(body: ExtrasBatchImages):
        pngs, info = await upscaled("extra-batch-images", body,
                                    [(item.data, f"imageList[{i}].data") for i, item in enumerate(body.imageList)])
        return info if pngs is None else {"images": pngs, "html_info": info}

    @api.get("/progress")
    async def progress(request: Request, skip_current_image: bool = False):
        return progress_record(latest(requests, owner_of(request)), skip_current_image)

    # A1111 answers {} and null; these name what happened (A1111's clients read no body).
    @api.post("/interrupt")
    async def interrupt(request: Request):
        stopped = running(requests, owner_of(request))
        for job in stopped:
            requests.stop(job, "interrupted")
        return {"interrupted": bool(stopped)}

    @api.post("/skip")
    async def skip(request: Request):  # an engine call makes its batch at once: skip ends the running call
        skipped = running(requests, owner_of(request))
        for job in skipped:
            requests.skip(job)
        return {"skipped": bool(skipped)}

    @api.get("/sd-models")
    async def sd_models():  # every model (A1111's titles, hashes once known), then the refiners not among them
        listed = sd_model_list(engine)
        names = {item["model_name"] for item in listed}
        return listed + [{"title": n, "model_name": n, "hash": None, "sha256": None, "filename": n, "config": None}
                         for n in models.refiners(engine, refiner_name(engine)) if n not in names]

    # A1111's options are the whole server's; here sd_model_checkpoint is each caller's own (its owner: the API key,
    # else its address), so one client never switches the model under another. The rest are fixed at start-up.
    chosen: collections.OrderedDict[str, str] = collections.OrderedDict()  # owner -> its default model's name

    @api.get("/options")
    async def get_options(request: Request):
        name = chosen.get(owner_of(request)) or models.default(engine)
        info = next((i for i in sd_model_list(engine) if i["model_name"] == name), None)
        return {MODEL_OPTION: info["title"] if info else name, "sd_checkpoint_hash": info and info["sha256"],
                "sd_vae": "Automatic", "CLIP_stop_at_last_layers": 1, "samples_format": "png",
                "sd_checkpoints_limit": len(models.names(engine))}

    @api.post("/options")
    async def set_options(request: Request):
        try:
            wanted = await request.json()
        except ValueError:
            wanted = None
        if not isinstance(wanted, dict):
            return a1111_error(ApiError(422, "options: expected a JSON object of option names and values"))
        current = await get_options(request)
        changed = sorted(k for k, v in wanted.items() if k != MODEL_OPTION and (k not in current or current[k] != v))
        if changed:
            return a1111_error(ApiError(422, f"options are fixed at start-up (flags or SDXL_* settings); "
                                             f"cannot change {', '.join(changed)[:200]}"))
        if MODEL_OPTION in wanted:
            try:
                name = models.choose(engine, wanted[MODEL_OPTION], MODEL_OPTION)
            except InvalidRequest as err:
                return a1111_error(ApiError(422, str(err), MODEL_OPTION))
            owner = owner_of(request)
            chosen.pop(owner, None)
            if name is not None and name != models.default(engine):
                chosen[owner] = name
                while len(chosen) > MAX_OWNERS:
                    chosen.popitem(last=False)
        return None

    @api.get("/cmd-flags")
    async def cmd_flags():
        return flags

    @api.get("/samplers")
    async def samplers():  # A1111's "scheduler" option: the sampler's Automatic is Karras (Restart's too)
        return [{"name": s, "aliases": [],
                 "options": {"scheduler": "karras"} if s.endswith(KARRAS) or s == "Restart" else {}}
                for s in SAMPLERS]

    @api.get("/schedulers")
    async def schedulers():
        return list(SCHEDULERS)

    @api.get("/loras")
    async def loras_route():
        names, reason = loras()
        return JSONResponse([{"name": n, "alias": n, "path": n, "metadata": {}} for n in names],
                            headers={} if names else {"X-SDXL-Note": reason})

    @api.get("/prompt-styles")
    async def prompt_styles():
        return [{"name": s.name, "prompt": s.prompt, "negative_prompt": s.negative_prompt}
                for s in STYLES if s.name != NO_STYLE]

    @api.get("/upscalers")
    async def upscalers():
        return upscaler_list()

    @api.get("/latent-upscale-modes")
    async def latent_upscale_modes():  # txt2img's hr_upscaler: A1111's latent upscalers, each one the engine does
        return [{"name": name} for name in HIRES_UPSCALERS]

    @api.get("/sd-vae")
    async def sd_vae():  # the model's own VAE, part of the loaded model: nothing to choose
        return []

    @api.get("/sd-modules")
    async def sd_modules():  # Forge's list of separate VAE / text-encoder files: none here either
        return []

    @api.get("/hypernetworks")
    async def hypernetworks():
        return []

    @api.get("/embeddings")
    async def embeddings():
        return {"loaded": {}, "skipped": {}}

    @api.get("/scripts")
    async def scripts():
        return {"txt2img": [], "img2img": []}

    @api.post("/refresh-checkpoints")
    async def refresh_checkpoints():  # reads --models-dir and --refiners-dir again (the engine's catalogue)
        await asyncio.to_thread(models.rescan, engine)
        return None

    @api.post("/refresh-loras")
    async def refresh_loras():
        return None

    @api.post("/refresh-vae")
    async def refresh_vae():
        return None

    return api


class ProgressRequest(BaseModel):
    """A1111's ``POST /internal/progress`` body (modules/progress.py ProgressRequest)."""

    id_task: str | None = None
    id_live_preview: int = -1
    live_preview: bool = True


def internal_router(requests: Service, owner_of: Callable) -> APIRouter:
    """A1111's own task routes (modules/progress.py), for the caller's tasks only: ``POST /internal/progress``
    (``{"id_task", "id_live_preview"}`` -> :func:`internal_progress`; a task of another owner is unknown) and
    ``GET /internal/pending-tasks`` (the caller's queued and running task ids)."""
    api = APIRouter(prefix="/internal")

    @api.post("/progress")
    async def progress(body: ProgressRequest, request: Request):
        try:
            job = requests.get(body.id_task or "", owner_of(request))
        except LookupError:
            job = None
        answer = internal_progress(job, body.id_live_preview)
        if not body.live_preview:
            answer["live_preview"] = None
        return answer

    @api.get("/pending-tasks")
    async def pending_tasks(request: Request):
        tasks = [job.id for job in requests.jobs(owner_of(request)) if not job.done]
        return {"size": len(tasks), "tasks": tasks}

    return api


def task_id(body) -> str | None:
    """A1111's ``force_task_id`` (the client's own id for its task, which ``/internal/progress`` then follows), or
    None (a new one). Raises ApiError 422 for a value that is not a short printable string."""
    value = getattr(body, "force_task_id", None)
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > 128 or not value.isprintable():
        raise ApiError(422, "force_task_id: expected a printable string of at most 128 characters", "force_task_id")
    return value


def unknown_router() -> APIRouter:
    """Any other ``/sdapi/v1`` path or method, in A1111's error shape (its api.py answers every exception,
    a 404 included, as ``{"error", "detail", "body", "errors"}``); mounted after every /sdapi/v1 route
    (apis.mount), so it answers only what they do not."""
    api = APIRouter(prefix=PREFIX)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def unknown(path: str, request: Request):
        return a1111_error(ApiError(404, f"{request.method} {PREFIX}/{ascii(path)[1:-1][:80]} is not served here "
                                         "(docs/protocols.md, AUTOMATIC1111 API, lists the routes served)"))

    return api
