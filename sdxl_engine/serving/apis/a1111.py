"""AUTOMATIC1111's web API (``/sdapi/v1/...``) on this server: txt2img, progress, interrupt, the lists.

The routes its clients call (webuiapi, Open WebUI, SillyTavern; README, "AUTOMATIC1111 API"):
``POST txt2img`` runs the page's ``/generate`` event (core.generate: same queue, handler, checks
and messages) as a job of its client (progress.JOBS; the client is its address); ``GET progress``
reads that client's running A1111 request, ``POST interrupt`` stops it (and its engine calls still to
come), ``POST skip`` ends its running engine call only: never a page's, a gradio_client's, another
protocol's or another address's request; ``sd-models``, ``options``, ``samplers``, ``schedulers``, ``loras``,
``prompt-styles``, ``upscalers``, ``latent-upscale-modes``, ``sd-vae``, ``sd-modules``,
``hypernetworks``, ``embeddings``, ``scripts``, ``cmd-flags`` and ``refresh-*`` describe the one
loaded model and what it takes; ``POST png-info`` reads an image's parameters text (:func:`png_info`);
``POST extra-single-image`` and ``extra-batch-images`` upscale with Pillow's Lanczos or Nearest (extras.py).

Field mapping (:func:`to_call`): ``steps`` -> num_inference_steps, ``cfg_scale`` -> guidance_scale,
``sampler_name`` (else ``sampler_index``) with ``scheduler`` -> the sampler (A1111 1.9 splits
``DPM++ 2M Karras`` into sampler ``DPM++ 2M`` and scheduler ``Karras``), ``styles`` -> the page's
style (one at most), ``batch_size`` x ``n_iter`` -> the image count (the engine makes its batch per
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
import dataclasses
import io
import json
import re
import time
from typing import Annotated, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from PIL import Image
from pydantic import BaseModel, BeforeValidator, ConfigDict

from sdxl_engine.program.schedulers import SAMPLERS, UnknownSampler, get_sampler
from sdxl_engine.serving import admission
from sdxl_engine.serving.apis.core import ApiError, Call, Interrupted, generate, model_name, read_json
from sdxl_engine.serving.apis.extras import ExtrasBatchImages, ExtrasRequest, ExtrasSingleImage, upscaler_list
from sdxl_engine.serving.apis.extras import run as run_extras
from sdxl_engine.serving.apis.openai_images import EXIF_IFD, USER_COMMENT
from sdxl_engine.serving.progress import JOBS, Owner
from sdxl_engine.serving.styles import NO_STYLE, STYLES

PREFIX = "/sdapi/v1"
KARRAS = " Karras"
# A1111's scheduler names (modules/sd_schedulers.py) for what this engine's samplers do: "automatic"
# is each sampler's own spacing; "karras" is the Karras sigmas, which only "DPM++ 2M Karras" has here.
SCHEDULERS = ({"name": "automatic", "label": "Automatic", "aliases": None, "default_rho": -1,
               "need_inner_model": False},
              {"name": "karras", "label": "Karras", "aliases": None, "default_rho": 7.0, "need_inner_model": False})
# Every scheduler name and label of A1111's modules/sd_schedulers.py (1.10), lower-cased: one of these that
# this server lacks is refused; any other name is no scheduler at all, and A1111 reads it as Automatic.
A1111_SCHEDULERS = frozenset(("automatic", "uniform", "karras", "exponential", "polyexponential", "sgm_uniform",
                              "sgm uniform", "sgmuniform", "kl_optimal", "kl optimal", "align_your_steps",
                              "align your steps", "simple", "normal", "ddim", "beta"))
FIELD_NAMES = (("num_inference_steps", "steps"), ("guidance_scale", "cfg_scale"), ("sampler", "sampler_name"),
               ("style", "styles"), ("images", "batch_size*n_iter"))


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
    styles: list[str] | None = None
    batch_size: Int = 1
    n_iter: Int = 1
    send_images: bool = True
    save_images: bool = False


@dataclasses.dataclass(frozen=True)
class Ignored:
    """A txt2img field (A1111's StableDiffusionProcessingTxt2Img) that would change the images and is not
    honoured here: ``defaults`` are the values that change nothing (A1111's default, and what A1111 reads
    as it: None, an empty list), so only another value is named in a warning; or a function of the request
    giving them (None: the field changes nothing for that request); ``why`` says what happens."""

    name: str
    defaults: tuple | Callable[[BaseModel], tuple | None]
    why: str


def _eta_defaults(body) -> tuple | None:
    """eta's neutral values for the request's sampler: A1111's eta_ancestral 1 for Euler a, eta_ddim 0 for DDIM;
    the other samplers here draw no noise, so eta changes nothing for them."""
    name = (body.sampler_name or body.sampler_index or "").strip().lower()
    return (*_UNSET, 1) if name == "euler a" else (*_UNSET, 0) if name == "ddim" else None


_UNSET = (None, "", [], {})
# The fields of A1111's txt2img request (modules/processing.py, modules/api/models.py) that change what
# a user gets and that this server does not honour. The hires fix's own fields (hr_scale, hr_upscaler,
# hr_second_pass_steps, hr_resize_x/y, hr_checkpoint_name, hr_sampler_name, hr_prompt,
# hr_negative_prompt, denoising_strength) matter only with enable_hr, which is named for them all.
IGNORED = (
    Ignored("enable_hr", (*_UNSET, False), "no hires fix here: the images are made at width x height in one pass"),
    Ignored("firstphase_width", (*_UNSET, 0), "no hires fix here: the images are made at width x height"),
    Ignored("firstphase_height", (*_UNSET, 0), "no hires fix here: the images are made at width x height"),
    Ignored("refiner_checkpoint", _UNSET, "no refiner here: the loaded model makes every step"),
    Ignored("alwayson_scripts", _UNSET, "no scripts or extensions here (ControlNet, ADetailer...): they did not run"),
    Ignored("script_name", _UNSET, "no scripts here: the plain txt2img ran"),
    Ignored("infotext", _UNSET, "infotext is not read here: send the fields themselves"),
    Ignored("init_images", _UNSET, "txt2img takes no image, and img2img is not served here"),
    Ignored("restore_faces", (*_UNSET, False), "no face restoration here"),
    Ignored("tiling", (*_UNSET, False), "no tiling here: the images do not wrap around"),
    Ignored("subseed_strength", (*_UNSET, 0), "no variation seeds here: each image is its seed alone"),
    Ignored("seed_resize_from_w", (*_UNSET, 0, -1), "no seed resize here"),
    Ignored("seed_resize_from_h", (*_UNSET, 0, -1), "no seed resize here"),
    Ignored("eta", _eta_defaults, "eta is fixed per sampler here (Euler a 1, DDIM 0: A1111's defaults)"),
    Ignored("s_churn", (*_UNSET, 0), "the sampler noise settings are fixed here (A1111's defaults)"),
    Ignored("s_tmin", (*_UNSET, 0), "the sampler noise settings are fixed here (A1111's defaults)"),
    Ignored("s_tmax", (*_UNSET, 0), "the sampler noise settings are fixed here (A1111's defaults)"),
    Ignored("s_noise", (*_UNSET, 1), "the sampler noise settings are fixed here (A1111's defaults)"),
    Ignored("s_min_uncond", (*_UNSET, 0), "no negative-guidance skipping here: every step uses the negative prompt"),
    Ignored("token_merging_ratio", (*_UNSET, 0), "no token merging here"),
    Ignored("disable_extra_networks", (*_UNSET, False), "<lora:...> tags in the prompt are applied here all the same"),
)


def ignored_warnings(body: Txt2Img, options: dict) -> list[str]:
    """The warnings for a txt2img ``body``'s fields this server does not honour (:data:`IGNORED`), and for
    ``override_settings`` entries other than ``options`` (GET /options: this server's fixed values), one
    line each, in the table's order. A field at one of its defaults gives none."""
    sent = body.model_extra or {}
    warnings = []
    for row in IGNORED:
        defaults = row.defaults(body) if callable(row.defaults) else row.defaults
        if row.name in sent and defaults is not None and not _at_default(sent[row.name], defaults):
            warnings.append(f"{row.name}={_short(sent[row.name])} ignored: {row.why}")
    overrides = sent.get("override_settings")
    for key, value in (overrides.items() if isinstance(overrides, dict) else ()):
        if key in options and options[key] == value:
            continue
        why = (f"this server serves one model, {options['sd_model_checkpoint']!r}, loaded at start-up"
               if key == "sd_model_checkpoint" else
               "clip skip is fixed at 1 here" if key == "CLIP_stop_at_last_layers" else
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


def sampler_of(sampler_name: str | None, scheduler: str | None) -> str | None:
    """The engine's sampler for A1111's ``sampler_name`` and ``scheduler`` (None: the engine's default).

    ``scheduler`` None, "" or "Automatic" keeps the sampler as named; "Karras" picks the sampler's
    Karras form (``DPM++ 2M`` -> ``DPM++ 2M Karras``, as A1111 1.9+ splits them). A name that is no
    A1111 scheduler (clients send "N/A") is Automatic, as A1111's sd_samplers.get_sampler_and_scheduler
    reads it. Names are case-insensitive. Raises ApiError 422 for an unknown sampler, or an A1111
    scheduler this server does not have for it (the images would differ from A1111's).
    """
    try:
        sampler = None if sampler_name in (None, "") else get_sampler(sampler_name)
    except UnknownSampler as err:
        raise ApiError(422, f"sampler_name: {err}", "sampler_name") from None
    wanted = (scheduler or "automatic").strip().lower()
    if wanted == "automatic" or wanted not in A1111_SCHEDULERS:
        return sampler
    if wanted == "karras" and sampler is not None:
        if sampler.endswith(KARRAS):
            return sampler
        if sampler + KARRAS in SAMPLERS:
            return sampler + KARRAS
    choices = ", ".join(f"{s.removesuffix(KARRAS)} with {'Karras' if s.endswith(KARRAS) else 'Automatic'}"
                        for s in SAMPLERS)
    named = f"sampler {sampler_name!r}" if sampler is not None else "the default sampler (no sampler_name given)"
    raise ApiError(422, f"scheduler: {scheduler!r} is not available for {named}; "
                        f"this server has {choices}", "scheduler")


def to_call(body: Txt2Img) -> Call:
    """The ``/generate`` call for a txt2img body (the module docstring's mapping).

    Raises ApiError 422: an unknown sampler or scheduler, more than one style, batch_size or
    n_iter below 1.
    """
    sampler = sampler_of(body.sampler_name or body.sampler_index, body.scheduler)
    styles = [s for s in body.styles or [] if s and s != NO_STYLE]
    if len(styles) > 1:
        raise ApiError(422, f"styles: this server applies one style per request, got {len(styles)}: "
                            f"{', '.join(styles)}", "styles")
    for name in ("batch_size", "n_iter"):
        if getattr(body, name) < 1:
            raise ApiError(422, f"{name}: must be at least 1, got {getattr(body, name)}", name)
    return Call(prompt=body.prompt, negative_prompt=body.negative_prompt, seed=body.seed,
                guidance_scale=body.cfg_scale, num_inference_steps=body.steps, width=body.width,
                height=body.height, style=styles[0] if styles else NO_STYLE, sampler=sampler,
                images=body.batch_size * body.n_iter, field_names=FIELD_NAMES)


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
    except (ValueError, OSError, SyntaxError) as err:  # binascii.Error is a ValueError
        raise ApiError(400, f"image: not a base64 PNG, JPEG or WebP image ({str(err)[:80]})", "image") from None
    text = items.pop("parameters", None)
    if isinstance(comment, bytes) and comment:
        text = comment[8:].decode("utf-16-be", "replace") if comment.startswith(_UNICODE_COMMENT) \
            else comment[8:].decode("utf-8", "ignore")
    text = text if isinstance(text, str) else ""
    items = {k: v for k, v in items.items() if isinstance(k, str) and isinstance(v, str)}
    return {"info": text, "items": items, "parameters": generation_parameters(text) if text else {}}


def info_record(body: Txt2Img, info: dict, seeds: list[int], infotexts: list[str]) -> dict:
    """A1111's ``info`` object (processing.Processed.js) for one txt2img answer.

    ``info``: the handler's record (README, "API") of the first engine call; ``seeds``: every
    image's seed, in order; ``infotexts``: each image's parameters text.
    """
    n = len(seeds)
    sampler = info["sampler"]
    return {
        "prompt": body.prompt, "all_prompts": [info["prompt"]] * n,
        "negative_prompt": body.negative_prompt, "all_negative_prompts": [info["negative_prompt"]] * n,
        "seed": seeds[0] if seeds else -1, "all_seeds": seeds, "subseed": -1, "all_subseeds": [-1] * n,
        "subseed_strength": 0, "width": info["width"], "height": info["height"], "sampler_name": sampler,
        "scheduler": "Karras" if sampler.endswith(KARRAS) else "Automatic", "cfg_scale": info["guidance_scale"],
        "steps": info["num_inference_steps"], "batch_size": body.batch_size, "n_iter": body.n_iter,
        "restore_faces": False, "face_restoration_model": None, "sd_model_name": info["model"],
        "sd_model_hash": None, "sd_vae_name": None, "sd_vae_hash": None, "seed_resize_from_w": -1,
        "seed_resize_from_h": -1, "denoising_strength": None,
        "extra_generation_params": {} if info.get("style", NO_STYLE) == NO_STYLE else {"Style": info["style"]},
        "index_of_first_image": 0, "infotexts": infotexts, "styles": body.styles or [],
        "job_timestamp": time.strftime("%Y%m%d%H%M%S"), "clip_skip": 1, "is_using_inpainting_conditioning": False,
        "latency_s": info["latency_s"], "warnings": info["warnings"], "saved": info.get("saved", []),
    }


def owner_of(request) -> Owner:
    """The A1111 client a route's Starlette ``request`` comes from: its address (progress.Owner)."""
    return ("a1111", admission.client_address(request))


def progress_record(owner: Owner, skip_current_image: bool = False) -> dict:
    """A1111's ``GET /sdapi/v1/progress`` answer (modules/api/models.py ProgressResponse) for ``owner``'s
    running A1111 request (progress.JOBS): ``job_count`` its engine calls, ``job_no`` the running one
    (0-based), ``progress`` the share of all its calls' steps done."""
    snap = JOBS.snapshot(owner)
    running = snap.job is not None
    preview = None if skip_current_image or snap.preview is None else base64.b64encode(snap.preview).decode()
    return {
        "progress": snap.fraction, "eta_relative": snap.eta_s or 0.0,
        "state": {"skipped": snap.skipped, "interrupted": snap.interrupted,
                  "stopping_generation": snap.interrupted,
                  "job": f"job {snap.job}" if running else "", "job_count": snap.calls,
                  "job_timestamp": "0", "job_no": snap.call, "sampling_step": snap.step,
                  "sampling_steps": snap.steps},
        "current_image": preview, "textinfo": snap.stage or None,
    }


def a1111_error(err: ApiError, bad_value: int = 400) -> JSONResponse:
    """A refusal in A1111's error shape (modules/api/api.py handle_exception: error, detail, body, errors);
    ``bad_value``: the status for a refused value (txt2img answers them 422, as FastAPI's own check does)."""
    kind = "HTTPException" if err.status in (401, 403, 404) else "InvalidRequest" if err.status in (400, 422) \
        else "ServerError"
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
                    print(f"[app] request refused: {request.url.path}: {err.message}", flush=True)
                    return a1111_error(err, bad_value=422)
            return await handler(request)

        return checked


def router(demo, engine, flags: dict, loras) -> APIRouter:
    """The ``/sdapi/v1`` routes for ``demo``'s ``/generate`` and ``engine``.

    ``flags``: what ``cmd-flags`` shows (safe values only: no paths, no key); ``loras``: a callable
    giving ``(names, reason)`` for ``/loras`` (apis.loras_of).
    """
    api = APIRouter(prefix=PREFIX, route_class=CheckedBody)
    extras_turn = asyncio.Lock()  # one Extras request at a time: each holds its images in memory

    @api.post("/txt2img")
    async def txt2img(body: Txt2Img, request: Request):
        warnings = ignored_warnings(body, await get_options())
        if warnings:
            print(f"[app] A1111 txt2img: {len(warnings)} field(s) not honoured: {'; '.join(warnings)}", flush=True)
        try:
            made = await generate(demo, engine, request, to_call(body), owner_of(request))
        except Interrupted as err:  # A1111 answers an interrupted job with what it has: here nothing
            return {"images": [], "parameters": body.model_dump(),
                    "info": json.dumps({"interrupted": True, "message": err.message, "all_seeds": [], "infotexts": []})}
        except ApiError as err:
            return a1111_error(err, bad_value=422)
        texts = [infotext(png) for png in made.pngs]
        images = [base64.b64encode(png).decode() for png in made.pngs] if body.send_images else []
        info = info_record(body, {**made.info, "warnings": warnings + made.info["warnings"]}, made.seeds, texts)
        if made.stopped is not None:  # interrupted (or a batch skipped) after some images: those, as A1111 does
            info.update(interrupted=True, message=made.stopped)
        return {"images": images, "parameters": body.model_dump(), "info": json.dumps(info)}

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
            print(f"[app] request refused: {route}: {err.message}", flush=True)
            return None, a1111_error(err, bad_value=422)
        if warnings:
            print(f"[app] A1111 {route}: {len(warnings)} field(s) not honoured: {'; '.join(warnings)}", flush=True)
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

    @api.post("/img2img")
    async def img2img():
        return a1111_error(ApiError(404, "img2img is not served here: this server makes images from text only "
                                         "(POST /sdapi/v1/txt2img)"))

    @api.get("/progress")
    async def progress(request: Request, skip_current_image: bool = False):
        return progress_record(owner_of(request), skip_current_image)

    @api.post("/interrupt")
    async def interrupt(request: Request):
        return {"interrupted": JOBS.interrupt(owner_of(request))}

    @api.post("/skip")
    async def skip(request: Request):  # an engine call makes its batch at once: skip ends the running call
        return {"interrupted": JOBS.skip(owner_of(request))}

    @api.get("/sd-models")
    async def sd_models():
        name = model_name(engine)
        return [{"title": name, "model_name": name, "hash": None, "sha256": None, "filename": name, "config": None}]

    @api.get("/options")
    async def get_options():
        return {"sd_model_checkpoint": model_name(engine), "sd_checkpoint_hash": None, "sd_vae": "Automatic",
                "CLIP_stop_at_last_layers": 1, "samples_format": "png", "sd_checkpoints_limit": 1}

    @api.post("/options")
    async def set_options(request: Request):
        try:
            wanted = await request.json()
        except ValueError:
            wanted = None
        if not isinstance(wanted, dict):
            return a1111_error(ApiError(422, "options: expected a JSON object of option names and values"))
        current = await get_options()
        changed = sorted(k for k, v in wanted.items() if k not in current or current[k] != v)
        if "sd_model_checkpoint" in changed:
            other = str(wanted["sd_model_checkpoint"])[:80]
            return a1111_error(ApiError(400, f"sd_model_checkpoint: this server serves one model, "
                                             f"{model_name(engine)!r}, loaded at start-up; cannot switch to {other!r}"))
        if changed:
            return a1111_error(ApiError(400, f"options are fixed at start-up (flags or SDXL_* settings); "
                                             f"cannot change {', '.join(changed)[:200]}"))
        return None

    @api.get("/cmd-flags")
    async def cmd_flags():
        return flags

    @api.get("/samplers")
    async def samplers():
        return [{"name": s, "aliases": [], "options": {"scheduler": "karras"} if s.endswith(KARRAS) else {}}
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
    async def latent_upscale_modes():
        return []

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
    async def refresh_checkpoints():
        return None

    @api.post("/refresh-loras")
    async def refresh_loras():
        return None

    @api.post("/refresh-vae")
    async def refresh_vae():
        return None

    return api


def unknown_router() -> APIRouter:
    """Any other ``/sdapi/v1`` path or method, in A1111's error shape (its api.py answers every exception,
    a 404 included, as ``{"error", "detail", "body", "errors"}``); mounted after every /sdapi/v1 route
    (apis.mount), so it answers only what they do not."""
    api = APIRouter(prefix=PREFIX)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def unknown(path: str, request: Request):
        return a1111_error(ApiError(404, f"{request.method} {PREFIX}/{ascii(path)[1:-1][:80]} is not served here "
                                         "(the README's AUTOMATIC1111 section lists the routes served)"))

    return api
