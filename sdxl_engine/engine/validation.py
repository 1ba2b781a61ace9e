"""One validation layer for every request, whether it comes from the page or the API.

Each check raises :class:`InvalidRequest` naming the argument, what was expected and what
arrived. Prompts are cleaned rather than refused where that loses nothing (control characters
become spaces); the rules are listed in the docs/input-rules.md table. Values arrive as the
client sent them (the page's components do no checking of their own), so every check here also
covers the wrong type: text where a number belongs, a bool, a list, NaN or inf.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
import unicodedata

import numpy as np

from sdxl_engine.engine.control import ControlUnit, validate_units
from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.engine.image_upscale import IMAGE_UPSCALERS
from sdxl_engine.engine.ip_adapter import IPAdapterUnit, validate_ip_units
from sdxl_engine.engine.prompts import check_prompt, parse_lora_tags
from sdxl_engine.program.latent_upscale import DEFAULT_UPSCALER, HIRES_UPSCALERS
from sdxl_engine.program.schedulers import (
    DEFAULT_SAMPLER,
    DEFAULT_SCHEDULE_TYPE,
    UnknownSampler,
    UnknownScheduleType,
    get_sampler,
    get_schedule_type,
    hires_schedule,
    img2img_start,
    split_sampler_name,
)

# InvalidRequest: from errors.py, ControlUnit: from control.py, kept here (one import for every request field)
__all__ = ["ControlUnit", "GenerateRequest", "InvalidRequest", "Limits", "validate"]

MAX_PROMPT_CHARS = 20_000  # far past 77 tokens; longer text is refused, not tokenized
MAX_GUIDANCE = 50.0
MAX_SIDE = 1 << 16  # pixels; anything larger is refused before it is compared with the buckets
DEFAULT_STRENGTH = 0.75  # img2img with an image and neither strength nor start_step (A1111's img2img default)
DEFAULT_IMAGE_UPSCALER = "Lanczos"  # hires fix of an input image (no latents to upscale)
DEFAULT_HIRES_STRENGTH = 0.7  # hires fix's second pass (A1111's txt2img denoising strength default)
MAX_HIRES_SCALE = 16.0  # far past any size max_pixels allows; larger is refused before the size is computed


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """What a user asks for. ``None`` means the engine's default; seed -1 means random."""

    prompt: str
    negative_prompt: str = ""
    seed: int = -1
    guidance_scale: float | None = None
    num_inference_steps: int | None = None
    width: int | None = None
    height: int | None = None
    sampler: str | None = None  # an A1111 sampler name (schedulers.SAMPLERS)
    client: str = ""  # who asks (the peer address): per-client limits such as one pending new-size compile
    # Image to image (docs/image-to-image.md). ``image``: None = text to image; one (H, W, 3) uint8 array for
    # every image of the request, or a list of one per image; validated: (batch, H, W, 3) uint8. Arrays are not
    # compared or hashed (compare=False: numpy's == is elementwise), so two requests differing only in their
    # image compare equal. ``strength`` in (0, 1] (default DEFAULT_STRENGTH): the last int(steps x strength)
    # steps run. ``start_step``: the first step that runs, 0 .. steps - 1, instead of strength's rule (it wins
    # when both are given); validated, it is always set for an image.
    image: object = dataclasses.field(default=None, compare=False)
    strength: float | None = None
    start_step: int | None = None
    # Inpainting (with an image): white (>= 0.5) = repaint, black = keep. One mask for every image or a list of one
    # per image, each (H, W) uint8 / bool / float in [0, 1], or (H, W, 3 or 4) uint8 (made grey as PIL's "L");
    # validated: (batch, H, W) float32 of 0 and 1 at the image's size (as_masks).
    mask: object = dataclasses.field(default=None, compare=False)
    # With a mask: keep its grey levels (a blurred mask blends the repainted latents into the kept ones by them;
    # A1111's mask_round off) instead of binarizing it at 0.5 (diffusers' VaeImageProcessor do_binarize). False
    # (the default): binarized.
    soft_mask: bool = False
    # Outpainting (with an image): pixels to add (left, top, right, bottom), each >= 0. The canvas grows by them,
    # the new area filled with the nearest edge pixel's colour and masked (repainted); the image's own area keeps
    # its mask (none: kept). Validated: None, and image and mask the grown ones (grow_canvas).
    outpaint: tuple | None = None
    # The SDXL refiner (docs/refiner.md): the switch point in [0, 1) of diffusers' ensemble of experts (the base's
    # denoising_end, the refiner's denoising_start), e.g. 0.8; 0 = the refiner alone (with an image: the refiner as
    # a plain img2img model); None = the base model alone. Needs a loaded refiner.
    refiner_switch_at: float | None = None
    # Hires fix (docs/hires-fix.md). ``hires_scale`` > 1 turns it on: the image is made at width x height, upscaled
    # (``hires_upscaler``: an A1111 latent upscaler, default "Latent" (bilinear), resizes its latents on the devices;
    # "None", "Lanczos" or "Nearest" its decoded pixels on the host, image_upscale.py) to :func:`hires_size` and
    # denoised again there from ``hires_strength`` in (0, 1] (default DEFAULT_HIRES_STRENGTH) with ``hires_steps``
    # steps (0, the default: schedulers.hires_schedule's rule on num_inference_steps), with ``hires_sampler`` and
    # ``hires_prompt`` / ``hires_negative_prompt`` (None: the first pass's). The images are the large ones. With an
    # ``image`` (and no mask, strength or outpaint) there is no first pass: the image is the one upscaled (a pixel
    # upscaler, default "Lanczos"). Validated: all None without hires_scale.
    hires_scale: float | None = None
    hires_strength: float | None = None
    hires_steps: int | None = None
    hires_upscaler: str | None = None
    hires_sampler: str | None = None
    hires_prompt: str | None = None
    hires_negative_prompt: str | None = None
    # ControlNet units (docs/controlnet.md; engine/control.py ControlUnit: image, model, weight, guidance_start/end,
    # control_mode, resize_mode, pixel_perfect, processor_res, module, threshold_a/b), in order; each names a loaded
    # ControlNet (Limits.controlnets). With a refiner, control applies to the base model's steps; with hires fix, to
    # both passes (the image fitted to each pass's size). Validated: a tuple of normalised units (names resolved).
    control_units: tuple[ControlUnit, ...] = ()
    # IP-Adapter units (docs/ip-adapter.md; engine/ip_adapter.py IPAdapterUnit: image (one or a tuple), model, weight,
    # guidance_start/end; a FaceID adapter's embeds, face embeddings, in place of image), in order; each names a
    # loaded IP-Adapter (Limits.ip_adapters). The base model's steps only with a refiner; both passes of hires fix.
    # Validated: a tuple of normalised units (images (H, W, 3) uint8; embeds (d,) float32 arrays).
    ip_adapter_units: tuple[IPAdapterUnit, ...] = ()
    # Which of the server's models makes the images, by name (docs/models.md; Engine.model_names): None = the
    # default (the first --model). Checked by the engine (an unknown name: InvalidRequest naming it and the models
    # offered), whose limits for that model validate the rest.
    model: str | None = None
    # Which of the server's refiners runs the steps from refiner_switch_at (needs it), by name (Engine.refiner_names;
    # A1111's refiner_checkpoint): None = the first --refiner. Refiners of the first one's architecture only (they
    # share its programs); the engine checks the name.
    refiner: str | None = None
    # The schedule type (A1111 1.9's ``scheduler``, docs/samplers.md): a schedulers.SCHEDULE_TYPES name, label or alias
    # (None: "automatic", each sampler's own spacing); both passes of hires fix and the refiner's steps use it.
    # Validated: the name ("karras"). DDIM, LCM and TCD keep their own timesteps (the plan refuses another, naming it).
    schedule_type: str | None = None
    # A1111's ``eta`` (docs/samplers.md): the noise multiplier in [0, 1] of the samplers that take one
    # (schedulers.ETA_DEFAULTS: Euler a, DPM2 a, the DPM++ SDEs (k-diffusion's eta), DDIM (diffusers' DDIMScheduler.step
    # eta), TCD (its gamma)); None: each sampler's default there (1; DDIM 0; TCD schedulers.TCD_GAMMA). The other
    # samplers ignore it, as A1111's do. Both passes of hires fix and the refiner's steps use it. Validated: a float.
    eta: float | None = None
    # The Limits this exact object was validated against (set by :func:`validate` only; not an argument, and
    # dataclasses.replace makes an unstamped copy), so a request checked where it arrived (apis/core.check, a
    # Ray front) is not validated again by the engine that runs it.
    validated_for: Limits | None = dataclasses.field(default=None, init=False, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the loaded engine accepts; built once from the config and the model."""

    max_seed: int
    max_steps: int
    sizes: tuple[tuple[int, int], ...]  # allowed (width, height) buckets, in pixels
    default_size: tuple[int, int]
    default_steps: int
    default_guidance: float
    multiple: int = 8  # every side must be a multiple of this many pixels (VAE x UNet downsampling)
    default_sampler: str = DEFAULT_SAMPLER
    loras: tuple[str, ...] = ()  # names of the loaded LoRAs, which <lora:NAME:WEIGHT> tags may pick
    # Largest image in pixels (width x height) a request may ask for; any size of multiples of ``multiple``
    # up to it is served (the ``sizes`` buckets are compiled ahead; another compiles on first use). 0: the
    # buckets only.
    max_pixels: int = 0
    batch: int = 0  # images per request: a list of input images must hold this many (0: not checked)
    # Non-empty: every request needs an image and a mask (or outpaint), and this names the model that needs them
    # (one with an inpainting UNet). "": masks are optional.
    requires_mask: str = ""
    refiner: bool = False  # a refiner is loaded (--refiner): requests may set refiner_switch_at
    # The loaded ControlNets as (name, A1111 hash) pairs, in load order: what control units may name, and what a
    # model list shows ("name [hash]"). Empty: none loaded, control units are refused.
    controlnets: tuple[tuple[str, str], ...] = ()
    max_control_units: int = 3  # ControlNet units a request may have (config max_control_units)
    # The loaded ControlNet-Unions among ``controlnets`` as (name, control types) pairs: their units name a control
    # type per image (ControlUnit.control_type); the others' units may not.
    controlnet_unions: tuple[tuple[str, int], ...] = ()
    # The server's ControlNets that do not fit this model (another architecture: left out for it), and the model's
    # name, for the refusal of a unit naming one ("cn-a does not fit tiny-shapes"), not "none loaded".
    controlnets_unfit: tuple[str, ...] = ()
    model: str = ""
    # The loaded IP-Adapters that fit this model as (name, A1111 hash) pairs, in load order: what IP-Adapter units may
    # name. Empty: none, IP-Adapter units are refused.
    ip_adapters: tuple[tuple[str, str], ...] = ()
    max_ip_adapter_units: int = 2  # IP-Adapter units a request may have (config max_ip_adapter_units)
    # The IP-Adapter FaceIDs among ``ip_adapters`` as (name, face embedding width) pairs: their units send face
    # embeddings (IPAdapterUnit.embeds), not images.
    ip_adapter_embeds: tuple[tuple[str, int], ...] = ()
    # The loaded LoRAs whose files a few-step recipe names (checkpoint/recipes.py: Lightning's, Hyper-SD's, DMD2's), as
    # (name, ((field, value), ...)) pairs of sampler, num_inference_steps, guidance_scale, schedule_type: a request
    # whose prompt tags one and leaves those fields out runs them (the first tagged one's), not the model's defaults.
    lora_recipes: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()


# Characters that draw nothing yet are neither whitespace to str.split() nor control/format
# characters: Hangul fillers, the blank braille pattern, the combining grapheme joiner, Khmer's
# invisible vowels, the Mongolian vowel separator. They count as spaces.
BLANKS = frozenset("\u115f\u1160\u3164\uffa0\u2800\u034f\u17b4\u17b5\u180e")
JOINERS = frozenset("\u200c\u200d")  # ZWNJ, ZWJ: kept only between two visible characters (emoji sequences)


def _is_modifier(c: str) -> bool:
    """Variation selectors and tag characters: kept only right after a visible character (❤️, flags)."""
    o = ord(c)
    return 0xFE00 <= o <= 0xFE0F or 0xE0100 <= o <= 0xE01EF or 0xE0020 <= o <= 0xE007F


def _is_blank(c: str) -> bool:
    """Whether ``c`` shows nothing by itself: whitespace, a control/format/unassigned (C*) character or a BLANK."""
    return c.isspace() or c in BLANKS or unicodedata.category(c)[0] == "C"


def clean_text(field: str, value, *, required: bool) -> str:
    """A prompt as text: every character that shows nothing becomes a space, runs of space fold.

    Blank characters are whitespace, control characters (NUL included), format characters
    (Unicode Cf: zero-width spaces, direction overrides U+202E..., soft hyphens), unassigned and
    private-use code points, and the whitespace-like :data:`BLANKS` (Hangul fillers U+3164...,
    blank braille U+2800). Zero-width joiners, variation selectors and tag characters are kept
    where they bind visible characters (emoji sequences such as 👩‍👩‍👧, ❤️); alone they are
    blank too. Emoji, right-to-left scripts and other printable text pass unchanged. None counts
    as empty text.

    Raises InvalidRequest for a non-string, for text over MAX_PROMPT_CHARS characters, and, when
    ``required``, for text that is empty after cleaning (nothing visible in it).
    """
    if value is None:  # a missing argument: the same as empty text
        value = ""
    if not isinstance(value, str):
        raise InvalidRequest(field, f"expected text, got {type(value).__name__}")
    if len(value) > MAX_PROMPT_CHARS:
        raise InvalidRequest(field, f"is {len(value)} characters long; the limit is {MAX_PROMPT_CHARS} "
                                    "(a prompt is read up to max_prompt_chunks x 75 tokens, far fewer characters)")
    out: list[str] = []
    for i, c in enumerate(value):
        after_visible = bool(out) and out[-1] != " "
        if c in JOINERS:
            following = value[i + 1] if i + 1 < len(value) else " "
            keep = after_visible and not _is_blank(following) and following not in JOINERS
        elif _is_modifier(c):
            keep = after_visible
        else:
            keep = not _is_blank(c)
        out.append(c if keep else " ")
    text = " ".join("".join(out).split())
    if required and not text:
        raise InvalidRequest(field, "is empty (nothing visible in it): describe the image you want, "
                                    "e.g. 'a red circle'")
    return text


def as_int(field: str, value, lo: int, hi: int) -> int:
    """An integer in [lo, hi]; a float (or numeric text) is accepted only when whole (3.0, not 3.5).

    Raises InvalidRequest for bools, non-numbers, NaN/inf, fractions and values outside [lo, hi].
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise InvalidRequest(field, f"expected a whole number, got {type(value).__name__}")
    try:
        number = _parse_number(value) if isinstance(value, str) else value
    except ValueError:
        raise InvalidRequest(field, f"expected a whole number, got {_short(value)}") from None
    if not isinstance(number, int) and (not math.isfinite(number) or number != int(number)):
        raise InvalidRequest(field, f"expected a whole number, got {_short(value)}")
    number = int(number)
    if not lo <= number <= hi:
        raise InvalidRequest(field, f"must be between {lo} and {hi}, got {_short(number)}")
    return number


def as_float(field: str, value, lo: float, hi: float) -> float:
    """A finite float in [lo, hi]; numeric text is accepted. Raises InvalidRequest otherwise."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise InvalidRequest(field, f"expected a number, got {type(value).__name__}")
    try:
        number = float(_parse_number(value) if isinstance(value, str) else value)
    except (ValueError, OverflowError):
        raise InvalidRequest(field, f"expected a number, got {_short(value)}") from None
    if not math.isfinite(number):
        raise InvalidRequest(field, f"must be a finite number, got {_short(value)}")
    if not lo <= number <= hi:
        shown = f"{number:g}" if float(f"{number:g}") == number else repr(number)  # 1.0000001 is not "1"
        raise InvalidRequest(field, f"must be between {lo:g} and {hi:g}, got {shown}")
    return number


def _parse_number(text: str) -> int | float:
    """Numeric text as an int when it is one ("12"), else a float ("1.5", "nan"); ValueError otherwise."""
    text = text.strip()
    if len(text) > 40:  # no number a user means is that long; int() of huge text is slow
        raise ValueError(text)
    try:
        return int(text)
    except ValueError:
        return float(text)


def _short(value) -> str:
    """repr() cut to 40 characters, for messages."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validate(request: GenerateRequest, limits: Limits) -> GenerateRequest:
    """Return a fully specified, clean copy of ``request`` (defaults filled, random seed drawn), stamped as
    validated against ``limits``; a request :func:`validate` returned for equal limits comes back as it is (each
    request is validated once, wherever it was first checked: apis/core.check, a Ray front, the engine).

    Raises:
        InvalidRequest: the first argument that is out of range or of the wrong type; a prompt whose
            ``<lora:...>`` tags are malformed or name a LoRA not in ``limits.loras``, or that holds
            only syntax (prompts.check_prompt); a control unit's field (``control_units[k].model`` for an
            unknown ControlNet, naming the loaded ones; control.validate_units).
    """
    if request.validated_for == limits:
        return request
    prompt = clean_text("prompt", request.prompt, required=True)
    check_prompt(prompt, limits.loras, model=limits.model)  # its <lora:...> tags and A1111 syntax (engine/prompts.py)
    negative = clean_text("negative_prompt", request.negative_prompt, required=False)
    recipe = lora_recipe(prompt, limits)
    seed = -1 if request.seed is None else as_int("seed", request.seed, -1, limits.max_seed)
    if seed == -1:
        seed = secrets.randbelow(limits.max_seed + 1)
    guidance = recipe.get("guidance_scale", limits.default_guidance) if request.guidance_scale is None else as_float(
        "guidance_scale", request.guidance_scale, 0.0, MAX_GUIDANCE)
    steps = min(recipe.get("num_inference_steps", limits.default_steps), limits.max_steps) \
        if request.num_inference_steps is None else as_int("num_inference_steps", request.num_inference_steps, 1,
                                                           limits.max_steps)
    if request.soft_mask not in (True, False):
        raise InvalidRequest("soft_mask", f"expected true or false, got {_short(request.soft_mask)}")
    if request.soft_mask and request.mask is None:
        raise InvalidRequest("soft_mask", "applies to a mask only: send a mask with it, or leave it out")
    if request.image is None:
        for field in ("strength", "start_step", "mask", "outpaint"):
            if getattr(request, field) is not None:
                raise InvalidRequest(field, "applies to image to image only: send an image with it, or leave it out")
        width, height = size_of(request.width, request.height, limits)
        image, strength, start, mask = None, None, None, None
    else:
        image = as_images(request.image, limits.batch)
        mask = None if request.mask is None else as_masks(request.mask, image, limits.batch,
                                                          binarize=not request.soft_mask)
        if request.outpaint is None:
            width, height = image_size(image, request.width, request.height, limits)
        else:
            image, mask = grow_canvas(image, mask, as_sides(request.outpaint))
            try:
                width, height = image_size(image, request.width, request.height, limits)
            except InvalidRequest as err:
                raise InvalidRequest("outpaint", f"the grown canvas {err.message}") from None
        if request.hires_scale is None:
            strength, start = as_strength(request.strength, request.start_step, steps)
        else:  # hires fix of this image: its own strength and start step (hires_strength, as_hires)
            strength, start = None, None
    if limits.requires_mask and mask is None:
        raise InvalidRequest("mask", f"{limits.requires_mask}: it only repaints the masked part of an image; send an "
                                     "image with a mask (white = repaint) or outpaint sides")
    hires = as_hires(request, width, height, steps, limits)
    sampler, named_type = as_sampler("sampler", recipe.get("sampler", limits.default_sampler) if request.sampler is
                                     None else request.sampler, split=True)
    if hires["hires_scale"] is not None:
        hires["hires_sampler"] = sampler if request.hires_sampler is None else as_sampler("hires_sampler",
                                                                                        request.hires_sampler)
    client = request.client if isinstance(request.client, str) else ""
    checked = GenerateRequest(prompt, negative, seed, guidance, steps, width, height, sampler, client,
                              image=image, strength=strength, start_step=start, mask=mask,
                              soft_mask=bool(request.soft_mask) and mask is not None,
                              refiner_switch_at=as_switch(request.refiner_switch_at, limits, request.hires_scale),
                              control_units=validate_units(request.control_units, [n for n, _ in limits.controlnets],
                                                           limits.max_control_units, limits.controlnets_unfit,
                                                           limits.model, dict(limits.controlnet_unions)),
                              ip_adapter_units=validate_ip_units(request.ip_adapter_units,
                                                                 [n for n, _ in limits.ip_adapters],
                                                                 limits.max_ip_adapter_units,
                                                                 dict(limits.ip_adapter_embeds)),
                              model=as_model(request.model),
                              refiner=as_refiner(request.refiner, request.refiner_switch_at),
                              schedule_type=with_named_type(as_schedule_type(
                                  recipe.get("schedule_type") if request.schedule_type is None and request.sampler is
                                  None else request.schedule_type), named_type, request.sampler),
                              eta=None if request.eta is None else as_float("eta", request.eta, 0.0, 1.0), **hires)
    object.__setattr__(checked, "validated_for", limits)  # frozen: the one place the stamp is set
    return checked


def lora_recipe(prompt: str, limits: Limits) -> dict:
    """The few-step recipe's fields (:attr:`Limits.lora_recipes`) of the first LoRA ``prompt`` tags that has one;
    {} when it tags none (the model's defaults apply). The prompt's tags were checked (prompts.check_prompt)."""
    if not limits.lora_recipes:
        return {}
    recipes = dict(limits.lora_recipes)
    for tag in parse_lora_tags(prompt)[1]:
        if tag.name in recipes:
            return dict(recipes[tag.name])
    return {}


def as_model(value) -> str | None:
    """A request's ``model``: None (the default) or a name (which names exist, the engine checks)."""
    if value is None or (isinstance(value, str) and value.strip()):
        return None if value is None else value.strip()
    raise InvalidRequest("model", f"expected a model's name (text), got {type(value).__name__} {_short(value)}"
                         if not isinstance(value, str) else f"expected a model's name, got {_short(value)}")


def as_refiner(value, switch) -> str | None:
    """A request's ``refiner``: None (the first refiner) or a name, with ``refiner_switch_at`` set."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest("refiner", f"expected a refiner's name, got {_short(value)}")
    if switch is None:
        raise InvalidRequest("refiner", "applies with refiner_switch_at only (e.g. 0.8): send both, or leave it out")
    return value.strip()


def as_switch(value, limits: Limits, hires_scale=None) -> float | None:
    """A request's ``refiner_switch_at``: None (no refiner), or a number in [0, 1) with a refiner loaded
    (``limits.refiner``) and no hires fix (``hires_scale`` None). 0: the refiner runs every step (with an image,
    the refiner as a plain img2img model; A1111 switches at once too).

    Raises InvalidRequest naming ``refiner_switch_at``.
    """
    if value is None:
        return None
    if not limits.refiner:
        raise InvalidRequest("refiner_switch_at", "no refiner is loaded: start the server with --refiner "
                                                  "DIR|HUB_ID|FILE (an SDXL refiner), or leave it out")
    if hires_scale is not None:  # worded without field names: each protocol names both its own way
        raise InvalidRequest("refiner_switch_at", "the refiner does not run with hires fix (an upscale): ask for one "
                                                  "or the other, not both")
    switch = as_float("refiner_switch_at", value, 0.0, 1.0)
    if switch == 1.0:
        raise InvalidRequest("refiner_switch_at", "must be at least 0 and below 1 (the share of the schedule the "
                                                  "base model runs, e.g. 0.8; 0: the refiner alone), got 1")
    return switch


def as_sampler(field: str, value, split: bool = False):
    """An A1111 sampler name (schedulers.get_sampler's spellings) as its canonical name; with ``split``, (that name,
    the schedule type an older combined name carries, or None): "DPM++ SDE Karras" is ("DPM++ SDE", "karras")
    (schedulers.split_sampler_name, as A1111 reads it).
    Raises InvalidRequest naming ``field``: a value that is not text says so (it names no sampler at all)."""
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(field, f"expected a sampler's name (text), got {type(value).__name__} {_short(value)}")
    try:
        return split_sampler_name(value) if split else get_sampler(value)
    except UnknownSampler as err:
        raise InvalidRequest(field, str(err)) from None


def with_named_type(schedule_type: str, named: str | None, sampler) -> str:
    """The request's schedule type given the one its sampler's name carried (``named``, :func:`as_sampler`'s
    split; None: none): that one where the request's is automatic; the same one is fine; another is refused.
    Raises InvalidRequest naming ``schedule_type``."""
    if named is None or schedule_type in (named, DEFAULT_SCHEDULE_TYPE):
        return named or schedule_type
    raise InvalidRequest("schedule_type", f"the sampler {_short(sampler)} names the schedule type {named!r}, and "
                                          f"schedule_type asks for {schedule_type!r}: send the sampler's own name "
                                          "with the schedule type you want")


def as_schedule_type(value) -> str:
    """A request's ``schedule_type`` as its name (schedulers.get_schedule_type's spellings; None: "automatic").
    Raises InvalidRequest naming ``schedule_type`` and listing the names."""
    if value is not None and not isinstance(value, str):
        raise InvalidRequest("schedule_type", f"expected a schedule type's name (text), got {type(value).__name__} "
                                              f"{_short(value)}")
    try:
        return get_schedule_type(value)
    except UnknownScheduleType as err:
        raise InvalidRequest("schedule_type", str(err)) from None


HIRES_FIELDS = ("hires_scale", "hires_strength", "hires_steps", "hires_upscaler", "hires_sampler", "hires_prompt",
                "hires_negative_prompt")


def as_hires(request: GenerateRequest, width: int, height: int, steps: int, limits: Limits) -> dict:
    """The validated hires fields of ``request`` (its base size and first-pass ``steps`` validated), by name: all
    None without ``hires_scale``; else the scale, the strength (default :data:`DEFAULT_HIRES_STRENGTH`), the second
    pass's step count (0 = the rule on ``steps``, see schedulers.hires_schedule) and the upscaler's A1111 name.

    With an input image (hires fix of that image, no first pass): no mask, strength, start step or outpaint, and
    a pixel upscaler (default "Lanczos"). The second pass's sampler is validated by the caller (as_sampler).

    Raises InvalidRequest naming the field: a hires field without ``hires_scale``; hires with a mask, strength,
    start step or outpaint; a scale not above 1, or whose size (:func:`hires_size`) is not one this server makes
    or no larger; a strength outside (0, 1] or too small to run a step; a second-pass schedule longer than
    ``limits.max_steps``; an unknown upscaler, or a latent one for an input image; a bad hires prompt.
    """
    if request.hires_scale is None:
        for field in HIRES_FIELDS[1:]:
            if getattr(request, field) is not None:
                raise InvalidRequest(field, "applies to hires fix only: send hires_scale (above 1) with it, or "
                                            "leave it out")
        return dict.fromkeys(HIRES_FIELDS)
    for field in ("mask", "outpaint", "strength", "start_step"):
        if getattr(request, field) is not None:
            raise InvalidRequest("hires_scale", f"hires fix takes no {field} (hires_strength is its strength; an "
                                                f"image alone is upscaled): send the {field} or hires_scale, "
                                                "not both")
    scale = as_float("hires_scale", request.hires_scale, 0.0, MAX_HIRES_SCALE)
    if scale <= 1:
        raise InvalidRequest("hires_scale", f"must be above 1 (the second pass's size over the first's), got {scale:g}")
    large = hires_size(width, height, scale, limits.multiple)
    if large == (width, height):
        raise InvalidRequest("hires_scale", f"{scale:g} x {width}x{height} rounds down to {width}x{height} at "
                                            f"multiples of {limits.multiple} pixels: use a larger scale")
    try:
        size_of(*large, limits)
    except InvalidRequest as err:
        raise InvalidRequest("hires_scale", f"{scale:g} x {width}x{height} = {large[0]}x{large[1]}, which this "
                                            f"server does not make: {err.message}") from None
    strength = DEFAULT_HIRES_STRENGTH if request.hires_strength is None else as_float(
        "hires_strength", request.hires_strength, 0.0, 1.0)
    if strength == 0:
        raise InvalidRequest("hires_strength", "must be above 0 (0 would upscale without denoising) and at most 1")
    hires_steps = 0 if request.hires_steps is None else as_int("hires_steps", request.hires_steps, 0, limits.max_steps)
    try:
        total, _ = hires_schedule(steps, hires_steps, strength)
    except ValueError as err:
        raise InvalidRequest("hires_strength", str(err)) from None
    if total > limits.max_steps:
        raise InvalidRequest("hires_steps", f"{hires_steps} steps at hires_strength {strength:g} take a schedule of "
                                            f"int({hires_steps} / {strength:g}) = {total} steps; this server runs at "
                                            f"most {limits.max_steps}: fewer steps or a higher strength")
    given = request.image is not None
    upscaler = request.hires_upscaler
    if upscaler is None:
        upscaler = DEFAULT_IMAGE_UPSCALER if given else DEFAULT_UPSCALER
    names = list(IMAGE_UPSCALERS) if given else [*HIRES_UPSCALERS, *IMAGE_UPSCALERS]
    if not isinstance(upscaler, str) or upscaler not in names:
        why = ("an input image is upscaled as pixels (a latent upscaler needs the first pass's latents)"
               if given and upscaler in HIRES_UPSCALERS else f"unknown upscaler {_short(upscaler)}")
        raise InvalidRequest("hires_upscaler", f"{why}; choose one of {', '.join(names)}")
    prompts = {}
    for field in ("hires_prompt", "hires_negative_prompt"):
        value = getattr(request, field)
        if value is not None:
            value = clean_text(field, value, required=field == "hires_prompt")
            if field == "hires_prompt":
                check_prompt(value, limits.loras, field, limits.model)
                if _tags(value) != _tags(request.prompt):
                    raise InvalidRequest(field, "its <lora:...> tags differ from the prompt's: both passes use "
                                                "the prompt's LoRAs here; write the same tags, or none in neither")
        prompts[field] = value
    return dict(hires_scale=scale, hires_strength=strength, hires_steps=hires_steps, hires_upscaler=upscaler,
                hires_sampler=None, **prompts)


def _tags(prompt) -> list[tuple[str, float]]:
    """A prompt's LoRA tags as sorted (name, weight) pairs."""
    return sorted((tag.name, tag.weight) for tag in parse_lora_tags(prompt if isinstance(prompt, str) else "")[1])


def hires_size(width: int, height: int, scale: float, multiple: int) -> tuple[int, int]:
    """Hires fix's second (width, height): each side times ``scale``, cut to a whole pixel as A1111 does
    (``int(width * hr_scale)``), then down to a multiple of ``multiple`` (the model's block)."""
    return int(width * scale) // multiple * multiple, int(height * scale) // multiple * multiple


def as_images(value, batch: int) -> np.ndarray:
    """A request's input image(s) as one (n, H, W, 3) uint8 array: one (H, W, 3) uint8 array (every image of
    the request starts from it; n = ``batch``, or 1 when ``batch`` is 0), or a list/tuple of ``batch`` such
    arrays of one size (one per image). Values are not converted: another dtype is refused, not rescaled.

    Raises InvalidRequest naming ``image``.
    """
    many = isinstance(value, (list, tuple))
    items = list(value) if many else [value]
    if many and batch and len(items) != batch:
        raise InvalidRequest("image", f"a list of {len(items)} images; this server makes {batch} images per "
                                      f"request: send one image for all of them, or {batch}")
    if not items:
        raise InvalidRequest("image", "an empty list; send one (height, width, 3) uint8 image")
    for item in items:
        if not isinstance(item, np.ndarray):
            raise InvalidRequest("image", f"expected a numpy array of (height, width, 3) uint8 pixels, got "
                                          f"{type(item).__name__}")
        if item.dtype != np.uint8 or item.ndim != 3 or item.shape[2] != 3:
            raise InvalidRequest("image", f"expected (height, width, 3) uint8 RGB pixels, got {item.shape} "
                                          f"{item.dtype}")
    if len({item.shape for item in items}) > 1:
        raise InvalidRequest("image", f"the images differ in size ({', '.join(str(i.shape) for i in items)}); "
                                      "send images of one size")
    stacked = np.stack(items)
    if not many:
        stacked = np.broadcast_to(stacked, (batch or 1, *stacked.shape[1:]))
    return np.ascontiguousarray(stacked)


def as_masks(value, images: np.ndarray, batch: int, binarize: bool = True) -> np.ndarray:
    """A request's inpainting mask(s) as (n, H, W) float32 of 0 (keep) and 1 (repaint), n and (H, W) those of
    ``images`` (:func:`as_images`' (n, H, W, 3)); with ``binarize`` False, of its values in [0, 1] as they are.

    Each mask: (H, W) uint8 (0..255), bool or float in [0, 1], or (H, W, 3 or 4) uint8 made grey as PIL's
    ``convert("L")`` (the alpha channel, if any, ignored); one for every image or a list of one per image. A mask
    of another size with the image's aspect ratio (to a pixel) is resized to it with Lanczos, as diffusers'
    ``VaeImageProcessor`` resizes a mask; then binarized at 0.5 (``do_binarize``: < 0.5 keep, else repaint).

    Raises InvalidRequest naming ``mask``.
    """
    import PIL.Image

    many = isinstance(value, (list, tuple))
    items = list(value) if many else [value]
    if many and len(items) not in (1, len(images)):
        raise InvalidRequest("mask", f"a list of {len(items)} masks for {len(images)} images: send one mask for all "
                                     f"of them, or one per image")
    height, width = images.shape[1:3]
    grey = []
    for item in items:
        if not isinstance(item, np.ndarray):
            raise InvalidRequest("mask", f"expected a numpy array, (height, width) or (height, width, 3), got "
                                         f"{type(item).__name__}")
        if item.ndim == 3 and item.shape[2] in (3, 4) and item.dtype == np.uint8:
            item = np.asarray(PIL.Image.fromarray(np.ascontiguousarray(item[..., :3])).convert("L"))
        if item.ndim != 2:
            raise InvalidRequest("mask", f"expected (height, width) values or (height, width, 3) uint8 pixels, "
                                         f"got shape {item.shape} {item.dtype}")
        if item.dtype == np.bool_:
            item = item.astype(np.float32)
        elif item.dtype == np.uint8:
            item = item.astype(np.float32) / 255.0
        elif np.issubdtype(item.dtype, np.floating):
            if not np.isfinite(item).all() or item.min() < 0 or item.max() > 1:
                raise InvalidRequest("mask", "float values must be finite and within [0, 1] (1 = repaint)")
            item = item.astype(np.float32)
        else:
            raise InvalidRequest("mask", f"expected uint8, bool or float values, got {item.dtype}")
        if item.shape != (height, width):
            h, w = item.shape
            if abs(w * height / h - width) > 1 or abs(h * width / w - height) > 1:
                raise InvalidRequest("mask", f"is {w}x{h} pixels, the image {width}x{height}: a mask of another "
                                             "size must have the image's aspect ratio (it is resized to the image); "
                                             "send a mask of the image's size")
            resized = PIL.Image.fromarray(np.round(item * 255).astype(np.uint8)).resize((width, height),
                                                                                         PIL.Image.LANCZOS)
            item = np.asarray(resized, np.float32) / 255.0
        grey.append((item >= 0.5).astype(np.float32) if binarize else item)
    return np.ascontiguousarray(np.broadcast_to(np.stack(grey), (len(images), height, width)))


def as_sides(value) -> tuple[int, int, int, int]:
    """An outpainting request's (left, top, right, bottom) pixels, each a whole number 0..MAX_SIDE, not all 0.

    Raises InvalidRequest naming ``outpaint``."""
    if not isinstance(value, (list, tuple)) or len(value) != 4:
        raise InvalidRequest("outpaint", f"expected 4 whole numbers of pixels (left, top, right, bottom), got "
                                         f"{_short(value)}")
    try:
        sides = tuple(as_int("outpaint", v, 0, MAX_SIDE) for v in value)
    except InvalidRequest as err:
        raise InvalidRequest("outpaint", f"(left, top, right, bottom) {err.message}") from None
    if not any(sides):
        raise InvalidRequest("outpaint", "adds no pixels (all four sides 0): give the pixels to add on some side")
    return sides


def grow_canvas(images: np.ndarray, mask: np.ndarray | None,
                sides: tuple[int, int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Outpainting's canvas: ``images`` (n, H, W, 3) uint8 grown by ``sides`` (left, top, right, bottom) pixels,
    the new area filled with the nearest edge pixel's colour (``np.pad`` mode "edge": the colours the border
    continues, which the denoising then repaints; at strength 1 it starts from noise there anyway), and the mask
    (n, H, W) float32 (None: all kept) grown with 1 (repaint) over the new area.

    Returns (n, H + top + bottom, W + left + right, 3) uint8 and (n, H', W') float32.
    """
    left, top, right, bottom = sides
    canvas = np.pad(images, ((0, 0), (top, bottom), (left, right), (0, 0)), mode="edge")
    mask = np.zeros(images.shape[:3], np.float32) if mask is None else mask
    return canvas, np.pad(mask, ((0, 0), (top, bottom), (left, right)), constant_values=1.0)


def image_size(images: np.ndarray, width, height, limits: Limits) -> tuple[int, int]:
    """The (width, height) of an img2img request: the image's own. A side given (not 0/None) must equal it
    (the engine does not resize: the caller does); the size must be one this server makes (:func:`size_of`).

    Raises InvalidRequest naming ``image`` (or ``width``/``height`` for a value that is not a whole number).
    """
    size = (images.shape[2], images.shape[1])
    for field, value, own in (("width", width, size[0]), ("height", height, size[1])):
        given = 0 if value is None else as_int(field, value, 0, MAX_SIDE)
        if given and given != own:
            raise InvalidRequest("image", f"is {size[0]}x{size[1]} pixels but the request's {field} is {given}: "
                                          "resize the image to the request's size, or send width/height 0 to use "
                                          "the image's")
    try:
        return size_of(*size, limits)
    except InvalidRequest as err:
        raise InvalidRequest("image", f"its size is not one this server makes: {err.message}") from None


def as_strength(strength, start_step, steps: int) -> tuple[float | None, int]:
    """(strength, start step) of an img2img request of ``steps`` steps: ``start_step`` (0 .. steps - 1) when
    given, which wins over ``strength`` (then kept as given, validated); else diffusers' rule on ``strength``
    in (0, 1], default :data:`DEFAULT_STRENGTH` (schedulers.img2img_start).

    Raises InvalidRequest naming ``strength`` or ``start_step``.
    """
    if strength is not None:
        strength = as_float("strength", strength, 0.0, 1.0)
        if strength == 0:
            raise InvalidRequest("strength", "must be above 0 (0 would return the image unchanged) and at most 1")
    if start_step is not None:
        return strength, as_int("start_step", start_step, 0, steps - 1)
    strength = DEFAULT_STRENGTH if strength is None else strength
    try:
        return strength, img2img_start(steps, strength)
    except ValueError as err:
        raise InvalidRequest("strength", str(err)) from None


def size_of(width, height, limits: Limits) -> tuple[int, int]:
    """The (width, height) in pixels a request asks for: 0 or None = the default size's side; any multiple
    of ``limits.multiple`` with width x height up to ``limits.max_pixels`` (the buckets only without one).

    Raises InvalidRequest naming ``width``, ``height`` or ``width/height``.
    """
    buckets = ", ".join(f"{w}x{h}" for w, h in limits.sizes)
    rule = (f"any multiple of {limits.multiple} pixels per side, up to {limits.max_pixels} pixels in all "
            f"(max_pixels; the model's sizes: {buckets})" if limits.max_pixels else f"supported sizes: {buckets}")
    given = {}
    for field, value in (("width", width), ("height", height)):
        if value is not None:  # 0 (or None) = the model's default for that side
            given[field] = as_int(field, value, 0, MAX_SIDE)
            if given[field] % limits.multiple:
                raise InvalidRequest(field, f"{given[field]} is not a multiple of {limits.multiple} pixels "
                                            f"(the model works on {limits.multiple}-pixel blocks); {rule}")
    size = (given.get("width") or limits.default_size[0], given.get("height") or limits.default_size[1])
    if size in limits.sizes:
        return size
    if not limits.max_pixels:
        raise InvalidRequest("width/height", f"{size[0]}x{size[1]} is not a supported size; choose one of "
                                             f"{buckets} (0 = the model's default)")
    if size[0] * size[1] > limits.max_pixels:
        raise InvalidRequest("width/height", f"{size[0]}x{size[1]} is {size[0] * size[1]} pixels; this server "
                                             f"makes up to {limits.max_pixels} (max_pixels), any multiple of "
                                             f"{limits.multiple} pixels per side (the model's sizes: {buckets})")
    return size

