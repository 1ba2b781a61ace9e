"""One validation layer for every request, whether it comes from the page or the API.

Each check raises :class:`InvalidRequest` naming the argument, what was expected and what
arrived. Prompts are cleaned rather than refused where that loses nothing (control characters
become spaces); the rules are listed in the README's "Input rules" table. Values arrive as the
client sent them (the page's components do no checking of their own), so every check here also
covers the wrong type: text where a number belongs, a bool, a list, NaN or inf.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
import unicodedata

MAX_PROMPT_CHARS = 20_000  # far past 77 tokens; longer text is refused, not tokenized
MAX_GUIDANCE = 50.0
MAX_SIDE = 1 << 16  # pixels; anything larger is refused before it is compared with the buckets


class InvalidRequest(ValueError):
    """A request argument the engine cannot use; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


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


def clean_text(field: str, value, *, required: bool) -> str:
    """A prompt as text: control characters (NUL included) become spaces, runs of space fold.

    Emoji, right-to-left scripts and other printable text pass unchanged (zero-width joiners
    are kept for emoji sequences); direction overrides (U+202E...) are format characters and
    become spaces like the other control characters. None counts as empty text.

    Raises InvalidRequest for a non-string, for text over MAX_PROMPT_CHARS characters, and, when
    ``required``, for text that is empty after cleaning.
    """
    if value is None:  # a missing argument: the same as empty text
        value = ""
    if not isinstance(value, str):
        raise InvalidRequest(field, f"expected text, got {type(value).__name__}")
    if len(value) > MAX_PROMPT_CHARS:
        raise InvalidRequest(field, f"is {len(value)} characters long; the limit is {MAX_PROMPT_CHARS} "
                                    "(only the first 77 tokens are used anyway)")
    text = "".join(" " if unicodedata.category(c)[0] == "C" and c not in "\u200d\u200c" else c for c in value)
    text = " ".join(text.split())
    if required and not text:
        raise InvalidRequest(field, "is empty: describe the image you want, e.g. 'a red circle'")
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
        raise InvalidRequest(field, f"must be between {lo:g} and {hi:g}, got {number:g}")
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
    """Return a fully specified, clean copy of ``request`` (defaults filled, random seed drawn).

    Raises:
        InvalidRequest: the first argument that is out of range or of the wrong type.
    """
    prompt = clean_text("prompt", request.prompt, required=True)
    negative = clean_text("negative_prompt", request.negative_prompt, required=False)
    seed = -1 if request.seed is None else as_int("seed", request.seed, -1, limits.max_seed)
    if seed == -1:
        seed = secrets.randbelow(limits.max_seed + 1)
    guidance = limits.default_guidance if request.guidance_scale is None else as_float(
        "guidance_scale", request.guidance_scale, 0.0, MAX_GUIDANCE)
    steps = limits.default_steps if request.num_inference_steps is None else as_int(
        "num_inference_steps", request.num_inference_steps, 1, limits.max_steps)
    width, height = limits.default_size
    allowed = ", ".join(f"{w}x{h}" for w, h in limits.sizes)
    given = {}
    for field, value in (("width", request.width), ("height", request.height)):
        if value is not None:  # 0 (or None) = the model's default for that side
            given[field] = as_int(field, value, 0, MAX_SIDE)
            if given[field] % limits.multiple:
                raise InvalidRequest(field, f"{given[field]} is not a multiple of {limits.multiple} pixels "
                                            f"(the model works on {limits.multiple}-pixel blocks); "
                                            f"supported sizes: {allowed}")
    width, height = given.get("width") or width, given.get("height") or height
    if (width, height) not in limits.sizes:
        raise InvalidRequest("width/height", f"{width}x{height} is not a supported size; choose one of {allowed} "
                                             "(0 = the model's default)")
    return GenerateRequest(prompt, negative, seed, guidance, steps, width, height)


# SDXL's standard aspect buckets at 1024 px (Podell et al. 2023, appendix), width x height.
SDXL_BUCKETS = ((1024, 1024), (1152, 896), (896, 1152), (1216, 832), (832, 1216), (1344, 768), (768, 1344),
                (1536, 640), (640, 1536))


def size_buckets(native: int, multiple: int) -> tuple[tuple[int, int], ...]:
    """SDXL's aspect buckets scaled to a model whose native size is ``native`` pixels.

    Each side is rounded to ``multiple`` (what the VAE and UNet downsampling need); duplicates
    after rounding are dropped, order kept.
    """
    out = []
    for w, h in SDXL_BUCKETS:
        size = (max(multiple, round(w * native / 1024 / multiple) * multiple),
                max(multiple, round(h * native / 1024 / multiple) * multiple))
        if size not in out:
            out.append(size)
    return tuple(out)
