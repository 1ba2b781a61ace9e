"""What a request hands back after the engine: lossless PNGs (in memory), the info record, saved copies.

The service (service/service.py) calls :func:`deliver` once per engine call, after ``engine.generate``; it turns
the result into PNG bytes that carry A1111's ``parameters``, the JSON record the APIs return and, with
``outputs_dir``, copies that never overwrite anything. Files a web server serves (the page's gallery) are written
by that front from the bytes, only where a URL must point at them.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from sdxl_engine.program.schedulers import DEFAULT_SCHEDULE_TYPE, ETA_DEFAULTS, SCHEDULE_TYPES
from sdxl_engine.service.images import a1111_parameters, encode_pngs, image_stem, request_stamp, write_new
from sdxl_engine.service.styles import NO_STYLE


@dataclasses.dataclass
class Delivery:
    """One request's files and record.

    ``paths``: the PNGs (A1111 ``parameters`` chunk, lossless) in a new folder, image i from
    ``info["seeds"][i]``. ``info``: the API's JSON record (docs/python.md). ``save_error``: why the
    copies to ``outputs_dir`` were not written (the images are still served; ``info["warnings"]``
    says so too), else None. ``pngs``: the files' bytes, in the same order (a protocol's answer takes
    them from memory: progress.Jobs.deliver).
    """

    paths: list[str]
    info: dict
    save_error: OSError | None = None
    save_warning: str = ""  # the warning in info["warnings"] when save_error is set
    pngs: list[bytes] = dataclasses.field(default_factory=list)
    stems: list[str] = dataclasses.field(default_factory=list)  # the files' names without ``.png``


def quote(text: str) -> str:
    """An infotext value as A1111's ``infotext_utils.quote``: JSON-quoted when it holds a comma, colon or newline."""
    return text if not any(c in text for c in ",:\n") else json.dumps(text, ensure_ascii=False)


def mode_parameters(req, refiner: str = "") -> dict:
    """A1111's infotext entries for what a validated request ran beyond text to image, under A1111's own keys
    (modules/processing.py): ``Denoising strength`` (img2img's strength, or the hires pass's), ``Hires upscale``,
    ``Hires steps``, ``Hires upscaler``, ``Hires sampler``, ``Hires prompt``, ``Hires negative prompt`` (those three
    when they differ from the first pass's), ``Schedule type`` (its A1111 label, unless automatic), ``Refiner``
    (``refiner``: its name), ``Refiner switch at``, and :func:`eta_parameters`'. {} for plain text to image with the
    automatic schedule type and no eta."""
    out: dict = {}
    schedule_type = getattr(req, "schedule_type", None)
    if schedule_type not in (None, DEFAULT_SCHEDULE_TYPE):  # A1111 1.9's key, its label (automatic: none, as before)
        out["Schedule type"] = SCHEDULE_TYPES[schedule_type]
    out.update(eta_parameters(req))
    if getattr(req, "image", None) is not None and req.strength is not None:
        out["Denoising strength"] = req.strength
    if getattr(req, "hires_scale", None) is not None:
        out.update({"Denoising strength": req.hires_strength, "Hires upscale": req.hires_scale,
                    **({"Hires steps": req.hires_steps} if req.hires_steps else {}),
                    "Hires upscaler": req.hires_upscaler})
        for key, value, first in (("Hires sampler", req.hires_sampler, req.sampler),
                                  ("Hires prompt", req.hires_prompt, req.prompt),
                                  ("Hires negative prompt", req.hires_negative_prompt, req.negative_prompt)):
            if value is not None and value != first:
                out[key] = quote(value)
    if getattr(req, "refiner_switch_at", None) is not None:
        out.update({"Refiner": refiner or "refiner", "Refiner switch at": req.refiner_switch_at})
    return out


def eta_parameters(req) -> dict:
    """A1111's infotext entry for a request's ``eta`` where a sampler that ran takes it (schedulers.ETA_DEFAULTS; the
    first pass's, and hires fix's second): ``Eta DDIM`` for DDIM, ``Eta`` for the others, each only where eta is not
    that sampler's default (A1111's Sampler.initialize: eta_infotext_field when eta != eta_default; TCD's default its
    gamma schedulers.TCD_GAMMA). {} without an eta."""
    eta = getattr(req, "eta", None)
    if eta is None:
        return {}
    out = {}
    for sampler in eta_samplers(req):
        if eta != ETA_DEFAULTS[sampler]:
            out["Eta DDIM" if sampler == "DDIM" else "Eta"] = eta
    return out


def eta_samplers(req) -> list[str]:
    """The samplers of ``req`` that ran and take an eta (schedulers.ETA_DEFAULTS): the first pass's, and hires fix's
    second, once each; the others ignore ``eta``, as A1111's do."""
    ran = dict.fromkeys((req.sampler, getattr(req, "hires_sampler", None) or req.sampler))
    return [sampler for sampler in ran if sampler in ETA_DEFAULTS]


def deliver(result, prompt: str, style: str, files_dir: Path | None = None, outputs_dir: str = "",
            keep: int | None = None, params: dict | None = None, model_hash: str | None = None) -> Delivery:
    """Encode ``result.images`` ((n, H, W, 3) uint8) as PNGs, write them, build the info record.

    Args:
        result: an engine result (``images``, ``seeds``, ``request``, ``timings`` in seconds,
            ``model``, ``warnings``, ``device_count``, ``device_summary``, optional ``replica``).
        prompt: what the user typed (before any style): it names the files
            (``seed42-a-red-circle.png``, the download's name).
        style: the style's name (``NO_STYLE`` for none), recorded in the PNGs and the record.
        files_dir: a folder the web server serves from; each request gets a new folder inside it. None: no files
            (``paths`` is empty; the bytes are in ``pngs``).
        outputs_dir: also save the PNGs here as ``<µs time>-<request id>-seed42-...png`` ("" = no);
            ``info["saved"]`` lists those file names, relative to ``outputs_dir``.
        keep: how many of the images (the first) the client receives (service.Service: a request's last call); only they
            are saved to ``outputs_dir``. None: all.
        params: more A1111 infotext entries (a protocol's: ``Mask blur``...), after :func:`mode_parameters`'.
        model_hash: the A1111 short hash of ``result.model`` (the model that made the images), for the infotext's
            ``Model hash``; None: not known (yet), left out.

    Raises:
        OSError: the PNGs could not be written under ``files_dir`` (nothing to serve). A failure
        to save to ``outputs_dir`` is returned as ``save_error`` instead, and added to
        ``info["warnings"]`` (and ``save_warning``).
    """
    req, latency = result.request, result.timings["latency"]
    extra = {**mode_parameters(req, getattr(result, "refiner", "")), **(params or {})}
    if "Hires resize" in extra:  # A1111 writes one of the two (processing.py: a resize, else the upscale factor)
        extra.pop("Hires upscale", None)
    for key, value in (getattr(result, "control_infotext", None) or {}).items():  # "ControlNet 0": "Module: ..."
        extra[key] = quote(value)
    if style != NO_STYLE:
        extra["Style"] = style
    loras = getattr(result, "loras", None) or {}  # {name: short hash} of the prompt's <lora:> tags
    if loras:  # as A1111's Lora extension writes it, JSON-quoted since the value holds ': ' and ', '
        extra["Lora hashes"] = json.dumps(", ".join(f"{name}: {short}" for name, short in loras.items()),
                                          ensure_ascii=False)
    pngs = encode_pngs(result.images, [a1111_parameters(req.prompt, req.negative_prompt, req.num_inference_steps,
                                                        req.guidance_scale, s, req.width, req.height, result.model,
                                                        extra, req.sampler, model_hash) for s in result.seeds])
    stems = [image_stem(s, prompt) for s in result.seeds]
    paths = [] if files_dir is None else write_served(pngs, stems, Path(files_dir))
    info = {
        "seeds": result.seeds, "latency_s": round(latency, 4), "device_count": result.device_count,
        "device": result.device_summary, "timings_s": {k: round(v, 4) for k, v in result.timings.items()},
        "prompt": req.prompt, "negative_prompt": req.negative_prompt, "guidance_scale": req.guidance_scale,
        "num_inference_steps": req.num_inference_steps, "sampler": req.sampler,
        "schedule_type": getattr(req, "schedule_type", None) or DEFAULT_SCHEDULE_TYPE, "width": req.width,
        "height": req.height, "model": result.model, "warnings": list(result.warnings), "style": style,
    }
    if getattr(req, "image", None) is not None:  # image to image: what ran of the steps, and the answer's size
        info.update(strength=req.strength, start_step=req.start_step, mask=req.mask is not None,
                    width=int(result.images.shape[2]), height=int(result.images.shape[1]))
    if getattr(req, "hires_scale", None) is not None:
        info["hires"] = {"scale": req.hires_scale, "strength": req.hires_strength, "steps": req.hires_steps,
                         "upscaler": req.hires_upscaler, "width": int(result.images.shape[2]),
                         "height": int(result.images.shape[1])}
    if getattr(req, "refiner_switch_at", None) is not None:
        info.update(refiner=getattr(result, "refiner", ""), refiner_switch_at=req.refiner_switch_at)
    if getattr(req, "eta", None) is not None and eta_samplers(req):  # as the infotext: not where no sampler used it
        info["eta"] = req.eta
    info["prompt_chunks"] = getattr(result, "prompt_chunks", 1)  # 75-token chunks the prompts ran with
    if loras:
        info["loras"] = dict(loras)
    if getattr(result, "replica", ""):  # scale-out mode: which Serve replica made it (timings_s also has "ray")
        info["replica"] = result.replica
    save_error, note = None, ""
    if outputs_dir:
        stamp = request_stamp()  # to the microsecond, plus a random id: two requests never share a name
        saved = []  # names only: the server's folder is the operator's business, not an API client's
        received = pngs[:keep] if keep is not None else pngs
        try:
            for data, stem in zip(received, stems):
                saved.append(write_new(data, Path(outputs_dir), f"{stamp}-{stem}").name)
        except OSError as err:
            save_error = err
            note = _save_warning(err, len(saved), len(received))
            info["warnings"].append(note)
        if saved:
            info["saved"] = saved
    return Delivery(paths, info, save_error, note, pngs, stems)


def write_served(pngs: list[bytes], stems: list[str], files_dir: Path) -> list[str]:
    """``pngs`` written into a new folder under ``files_dir`` (one per request: served as it is, never copied), named
    ``stems[i]`` + ``.png``; returns their paths. Raises OSError when they could not be written."""
    root = Path(files_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="sdxl-", dir=root))
    return [str(write_new(data, folder, stem)) for data, stem in zip(pngs, stems)]


def _save_warning(err: OSError, saved: int, total: int) -> str:
    """The reply's warning for copies to ``outputs_dir`` that could not be written: how many were,
    and the reason (``Permission denied``, ``No space left on device``), never the server's path."""
    which = f"{total - saved} of {total} images" if saved else "images"
    return (f"{which} not saved to the server's outputs folder ({type(err).__name__}: "
            f"{err.strerror or 'cannot write there'}); download them instead")
