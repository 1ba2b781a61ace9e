"""AUTOMATIC1111's web API (``/sdapi/v1/...``) on this server: txt2img, progress, interrupt, the lists.

The routes its clients call (webuiapi, Open WebUI, SillyTavern; README, "AUTOMATIC1111 API"):
``POST txt2img`` runs the page's ``/generate`` event (core.generate: same queue, handler, checks
and messages) as a job of its client (progress.JOBS; the client is its address); ``GET progress``
reads that client's running A1111 request, ``POST interrupt`` stops it (and its engine calls still to
come), ``POST skip`` ends its running engine call only: never a page's, a gradio_client's, another
protocol's or another address's request; ``sd-models``, ``options``, ``samplers``, ``schedulers``, ``loras``,
``prompt-styles``, ``upscalers``, ``latent-upscale-modes``, ``sd-vae``, ``sd-modules``,
``hypernetworks``, ``embeddings``, ``scripts``, ``cmd-flags`` and ``refresh-*`` describe the one
loaded model and what it takes.

Field mapping (:func:`to_call`): ``steps`` -> num_inference_steps, ``cfg_scale`` -> guidance_scale,
``sampler_name`` (else ``sampler_index``) with ``scheduler`` -> the sampler (A1111 1.9 splits
``DPM++ 2M Karras`` into sampler ``DPM++ 2M`` and scheduler ``Karras``), ``styles`` -> the page's
style (one at most), ``batch_size`` x ``n_iter`` -> the image count (the engine makes its batch per
call; fewer images return the first ones, more run further calls). A field left out takes the
engine's default (A1111's own 512 x 512, 50 steps, CFG 7 would not suit every model). Unknown
fields are ignored, as A1111 does; a value of the wrong type is FastAPI's 422; a value the engine
refuses is a 422 whose ``detail`` is the engine's message with A1111's field name.
"""

from __future__ import annotations

import base64
import io
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from PIL import Image
from pydantic import BaseModel, ConfigDict

from sdxl_engine.program.schedulers import SAMPLERS, UnknownSampler, get_sampler
from sdxl_engine.serving.apis.core import ApiError, Call, Interrupted, client_of, generate, model_name
from sdxl_engine.serving.progress import JOBS, Owner
from sdxl_engine.serving.styles import NO_STYLE, STYLES

PREFIX = "/sdapi/v1"
KARRAS = " Karras"
# A1111's scheduler names (modules/sd_schedulers.py) for what this engine's samplers do: "automatic"
# is each sampler's own spacing; "karras" is the Karras sigmas, which only "DPM++ 2M Karras" has here.
SCHEDULERS = ({"name": "automatic", "label": "Automatic", "aliases": None, "default_rho": -1,
               "need_inner_model": False},
              {"name": "karras", "label": "Karras", "aliases": None, "default_rho": 7.0, "need_inner_model": False})
FIELD_NAMES = (("num_inference_steps", "steps"), ("guidance_scale", "cfg_scale"), ("sampler", "sampler_name"),
               ("style", "styles"), ("images", "batch_size*n_iter"))


class Txt2Img(BaseModel):
    """The txt2img fields this server reads (A1111's StableDiffusionTxt2ImgProcessingAPI names); others are ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt: str | None = ""
    negative_prompt: str | None = ""
    seed: int | None = -1
    steps: int | None = None
    cfg_scale: float | None = None
    width: int | None = None
    height: int | None = None
    sampler_name: str | None = None
    sampler_index: str | None = None
    scheduler: str | None = None
    styles: list[str] | None = None
    batch_size: int = 1
    n_iter: int = 1
    send_images: bool = True
    save_images: bool = False


def sampler_of(sampler_name: str | None, scheduler: str | None) -> str | None:
    """The engine's sampler for A1111's ``sampler_name`` and ``scheduler`` (None: the engine's default).

    ``scheduler`` None, "" or "Automatic" keeps the sampler as named; "Karras" picks the sampler's
    Karras form (``DPM++ 2M`` -> ``DPM++ 2M Karras``, as A1111 1.9+ splits them). Names are
    case-insensitive. Raises ApiError 422 for an unknown sampler, or a scheduler it does not have.
    """
    try:
        sampler = None if sampler_name in (None, "") else get_sampler(sampler_name)
    except UnknownSampler as err:
        raise ApiError(422, f"sampler_name: {err}", "sampler_name") from None
    wanted = (scheduler or "automatic").strip().lower()
    if wanted == "automatic":
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
    return ("a1111", client_of(request))


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


def router(demo, engine, flags: dict, loras) -> APIRouter:
    """The ``/sdapi/v1`` routes for ``demo``'s ``/generate`` and ``engine``.

    ``flags``: what ``cmd-flags`` shows (safe values only: no paths, no key); ``loras``: a callable
    giving ``(names, reason)`` for ``/loras`` (apis.loras_of).
    """
    api = APIRouter(prefix=PREFIX)

    @api.post("/txt2img")
    async def txt2img(body: Txt2Img, request: Request):
        try:
            made = await generate(demo, engine, request, to_call(body), owner_of(request))
        except Interrupted as err:  # A1111 answers an interrupted job with what it has: here nothing
            return {"images": [], "parameters": body.model_dump(),
                    "info": json.dumps({"interrupted": True, "message": err.message, "all_seeds": [], "infotexts": []})}
        except ApiError as err:
            return a1111_error(err, bad_value=422)
        texts = [infotext(png) for png in made.pngs]
        images = [base64.b64encode(png).decode() for png in made.pngs] if body.send_images else []
        info = info_record(body, made.info, made.seeds, texts)
        if made.stopped is not None:  # interrupted (or a batch skipped) after some images: those, as A1111 does
            info.update(interrupted=True, message=made.stopped)
        return {"images": images, "parameters": body.model_dump(), "info": json.dumps(info)}

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
        return []

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
