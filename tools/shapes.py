"""The captioned-shapes data set of the ``tiny-shapes`` model, and an independent checker.

Data: a 64x64 RGB image is drawn with Pillow from attributes (shape, colour, background,
position, size; a few pixels of jitter), at 4x resolution then downsampled (anti-aliased
edges). Its caption comes from a few templates that name all or some of the attributes, so
the model learns both "a red circle" and "a large red circle on the left on a white
background". A fixed set of (colour, shape, position) combinations, :data:`HELD_OUT`, is never
drawn for training; the evaluation asks for exactly those.

Checker (:func:`analyse`): reads an image with no knowledge of the model: background = median
of the border pixels; foreground = pixels far from it; colour = the palette hue nearest to most
foreground pixels' hue; position = the nearest of the five anchor points to the foreground
centroid; shape = the best-matching template (IoU of the foreground mask, cropped to its
bounding box and resized to 32x32, against the same for each shape drawn cleanly).

Latents (:func:`encode_all`): the images as a VAE sees them (:func:`to_pixels`) and their posterior means, which
tools/train.py (its stage 3) and tools/train_lcm.py both train on.

Training steps (:func:`run_steps`): the step loop tools/train_lcm.py and tools/train_controlnet.py share (the mean
loss logged every few steps, a callback after each step, a time limit).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageDraw

SIZE = 64  # pixels, the model's native resolution
SUPERSAMPLE = 4

SHAPES = ("circle", "square", "triangle", "star", "cross", "diamond")
COLOURS = {  # name -> RGB; hues 0, 32, 54, 127, 186, 226, 277, 325 degrees
    "red": (220, 30, 30), "orange": (245, 140, 20), "yellow": (240, 220, 30), "green": (40, 180, 60),
    "cyan": (30, 200, 220), "blue": (30, 80, 230), "purple": (140, 40, 200), "pink": (240, 100, 180),
}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128), "blue": (35, 50, 140)}
POSITIONS = {"left": (18, 32), "right": (46, 32), "top": (32, 18), "bottom": (32, 46), "centre": (32, 32)}  # (x, y)
SIZES = {"small": 10, "large": 15}  # radius in pixels
WHERE = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom",
         "centre": "in the centre"}

# (colour, shape, position) combinations never drawn for training: each colour twice, each
# shape at least twice, each position three or four times.
HELD_OUT = (
    ("red", "star", "left"), ("orange", "cross", "top"), ("yellow", "circle", "right"),
    ("green", "triangle", "bottom"), ("cyan", "square", "centre"), ("blue", "diamond", "left"),
    ("purple", "circle", "top"), ("pink", "triangle", "right"), ("red", "square", "bottom"),
    ("orange", "diamond", "centre"), ("yellow", "star", "top"), ("green", "cross", "right"),
    ("cyan", "circle", "bottom"), ("blue", "triangle", "centre"), ("purple", "star", "right"),
    ("pink", "cross", "left"),
)

# Caption templates and their weights: full descriptions most often, partial ones so that
# short prompts ("a red circle") and colour-only negative prompts ("red") are in distribution.
TEMPLATES = (
    ("{a} {size} {colour} {shape} {where} on a {bg} background", 5),
    ("{a} {colour} {shape} {where} on a {bg} background", 2),
    ("{a} {size} {colour} {shape} {where}", 2),
    ("{a} {colour} {shape} {where}", 2),
    ("{a} {colour} {shape} on a {bg} background", 1.5),
    ("{a} {size} {colour} {shape}", 1),
    ("{a} {colour} {shape}", 2),
    ("a {shape} {where}", 0.5),
    ("a {shape}", 0.5),
    ("{a} {colour} shape", 0.5),
    ("{colour}", 0.3),
)


def caption_words() -> frozenset[str]:
    """Every word of every caption :func:`caption` can write: the words tiny-shapes was trained on."""
    literal = {word for template, _ in TEMPLATES for word in re.sub(r"\{\w+\}", " ", template).split()}
    where = {word for phrase in WHERE.values() for word in phrase.split()}
    return frozenset(literal | where | {"a", "an", "center"} | set(SHAPES) | set(COLOURS) | set(BACKGROUNDS)
                     | set(SIZES))


@dataclasses.dataclass(frozen=True)
class Attributes:
    """What one image shows; ``dx``, ``dy`` are jitter in pixels around the position's anchor."""

    shape: str
    colour: str
    background: str
    position: str
    size: str
    dx: int = 0
    dy: int = 0


def polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """Vertices of a polygonal shape centred at (cx, cy) with circumradius ``r`` (pixels, y down)."""
    if shape == "square":
        h = 0.82 * r
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "triangle":  # equilateral, pointing up, centroid at (cx, cy)
        return [(cx + r * math.cos(a), cy - r * math.sin(a)) for a in (math.pi / 2, 7 * math.pi / 6, 11 * math.pi / 6)]
    if shape == "star":  # five points, inner radius 0.45 r
        return [(cx + rr * math.cos(math.pi / 2 + k * math.pi / 5), cy - rr * math.sin(math.pi / 2 + k * math.pi / 5))
                for k, rr in zip(range(10), [r, 0.45 * r] * 5)]
    if shape == "cross":  # plus sign, arms 0.7 r wide
        w = 0.35 * r
        return [(cx - w, cy - r), (cx + w, cy - r), (cx + w, cy - w), (cx + r, cy - w), (cx + r, cy + w),
                (cx + w, cy + w), (cx + w, cy + r), (cx - w, cy + r), (cx - w, cy + w), (cx - r, cy + w),
                (cx - r, cy - w), (cx - w, cy - w)]
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def render(attrs: Attributes, size: int = SIZE) -> np.ndarray:
    """Draw ``attrs``; returns (size, size, 3) uint8 RGB. Deterministic."""
    s = SUPERSAMPLE * size / SIZE
    image = Image.new("RGB", (round(SUPERSAMPLE * size),) * 2, BACKGROUNDS[attrs.background])
    draw = ImageDraw.Draw(image)
    x, y = POSITIONS[attrs.position]
    cx, cy, r = (x + attrs.dx) * s, (y + attrs.dy) * s, SIZES[attrs.size] * s
    fill = COLOURS[attrs.colour]
    if attrs.shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon(polygon(attrs.shape, cx, cy, r), fill=fill)
    return np.asarray(image.resize((size, size), Image.Resampling.BOX))


def caption(attrs: Attributes, rng: np.random.Generator) -> str:
    """A caption for ``attrs`` from a weighted random template."""
    weights = np.array([w for _, w in TEMPLATES], float)
    template = TEMPLATES[rng.choice(len(TEMPLATES), p=weights / weights.sum())][0]
    where = WHERE[attrs.position]
    if attrs.position == "centre" and rng.random() < 0.3:
        where = "in the center"
    first = attrs.size if "{size}" in template else attrs.colour
    return template.format(a="an" if first[0] in "aeiou" else "a", size=attrs.size, colour=attrs.colour,
                           shape=attrs.shape, where=where, bg=attrs.background)


def prompt_for(colour: str, shape: str, position: str, size: str = "large", background: str = "white") -> str:
    """The full-description prompt the evaluation uses (the most frequent training template)."""
    return (f"{'an' if size[0] in 'aeiou' else 'a'} {size} {colour} {shape} {WHERE[position]} "
            f"on a {background} background")


def sample_attributes(rng: np.random.Generator, exclude=HELD_OUT) -> Attributes:
    """Random attributes, never a held-out (colour, shape, position) nor a blue shape on blue."""
    held = set(exclude)
    while True:
        attrs = Attributes(
            shape=SHAPES[rng.integers(len(SHAPES))], colour=list(COLOURS)[rng.integers(len(COLOURS))],
            background=list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))],
            position=list(POSITIONS)[rng.integers(len(POSITIONS))], size=list(SIZES)[rng.integers(len(SIZES))],
            dx=int(rng.integers(-3, 4)), dy=int(rng.integers(-3, 4)))
        if (attrs.colour, attrs.shape, attrs.position) not in held and attrs.colour != attrs.background:
            return attrs


def make_dataset(n: int, seed: int) -> tuple[np.ndarray, list[str], list[Attributes]]:
    """``n`` training examples: images (n, 64, 64, 3) uint8, captions, attributes. Seeded."""
    rng = np.random.default_rng(seed)
    attrs = [sample_attributes(rng) for _ in range(n)]
    captions = [caption(a, rng) for a in attrs]
    return np.stack([render(a) for a in attrs]), captions, attrs


# ---- the independent checker ---------------------------------------------------------------

def _hue_degrees(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hue (degrees), saturation and value (0..1) of (..., 3) uint8 RGB, standard HSV formulas."""
    x = rgb.astype(np.float32) / 255.0
    mx, mn = x.max(-1), x.min(-1)
    delta = np.maximum(mx - mn, 1e-6)
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    hue = np.where(mx == r, ((g - b) / delta) % 6, np.where(mx == g, (b - r) / delta + 2, (r - g) / delta + 4)) * 60
    return hue, (mx - mn) / np.maximum(mx, 1e-6), mx


PALETTE_HUES = {name: float(_hue_degrees(np.array(rgb, np.uint8))[0]) for name, rgb in COLOURS.items()}


def nearest_colour(hue: np.ndarray) -> np.ndarray:
    """Index into COLOURS of the palette hue nearest (circularly) to each hue in degrees."""
    ref = np.array(list(PALETTE_HUES.values()))
    diff = np.abs(hue[..., None] - ref)
    return np.minimum(diff, 360 - diff).argmin(-1)


def foreground_mask(image: np.ndarray, threshold: float = 80.0) -> np.ndarray:
    """(H, W) bool: pixels whose RGB distance from the background (median border pixel) > threshold."""
    border = np.concatenate([image[:3].reshape(-1, 3), image[-3:].reshape(-1, 3),
                             image[:, :3].reshape(-1, 3), image[:, -3:].reshape(-1, 3)])
    background = np.median(border, axis=0)
    return np.linalg.norm(image.astype(np.float32) - background, axis=-1) > threshold


def _normalised_mask(mask: np.ndarray, size: int = 32) -> np.ndarray | None:
    ys, xs = np.nonzero(mask)
    if len(xs) < 4:
        return None
    crop = mask[ys.min(): ys.max() + 1, xs.min(): xs.max() + 1]
    return np.asarray(Image.fromarray(crop.astype(np.uint8) * 255).resize((size, size),
                                                                          Image.Resampling.BILINEAR)) > 127


_TEMPLATES: dict[str, np.ndarray] = {}


def _shape_templates() -> dict[str, np.ndarray]:
    if not _TEMPLATES:
        for shape in SHAPES:
            image = render(Attributes(shape, "red", "white", "centre", "large"), size=4 * SIZE)
            _TEMPLATES[shape] = _normalised_mask(foreground_mask(image))
    return _TEMPLATES


def analyse(image: np.ndarray) -> dict:
    """Read colour, shape and position off an image, independently of any model.

    Args:
        image: (H, W, 3) uint8 RGB, H = W = 64 (positions are in 64x64 pixel coordinates).
    Returns:
        ``colour``, ``shape``, ``position`` (names, or None with no foreground),
        ``colour_shares`` (name -> fraction of foreground pixels of that hue; grey pixels count
        for none), ``foreground`` (fraction of the image).
    """
    mask = foreground_mask(image)
    result = {"colour": None, "shape": None, "position": None, "colour_shares": {c: 0.0 for c in COLOURS},
              "foreground": float(mask.mean())}
    if mask.sum() < 4:
        return result
    hue, sat, val = _hue_degrees(image[mask])
    chromatic = (sat > 0.3) & (val > 0.25)
    votes = np.bincount(nearest_colour(hue[chromatic]), minlength=len(COLOURS))
    result["colour_shares"] = {c: float(v) / mask.sum() for c, v in zip(COLOURS, votes)}
    if votes.sum():
        result["colour"] = list(COLOURS)[int(votes.argmax())]
    ys, xs = np.nonzero(mask)
    scale = SIZE / image.shape[0]
    cx, cy = xs.mean() * scale, ys.mean() * scale
    result["position"] = min(POSITIONS, key=lambda p: (POSITIONS[p][0] - cx) ** 2 + (POSITIONS[p][1] - cy) ** 2)
    norm = _normalised_mask(mask)
    if norm is not None:
        ious = {s: (norm & t).sum() / max((norm | t).sum(), 1) for s, t in _shape_templates().items()}
        result["shape"] = max(ious, key=ious.get)
    return result


def to_pixels(images: np.ndarray) -> np.ndarray:
    """(n, H, W, 3) uint8 -> (n, 3, H, W) float32 in [-1, 1], the VAE's input layout."""
    return images.transpose(0, 3, 1, 2).astype(np.float32) / 127.5 - 1.0


def encode_all(vae, params, images: np.ndarray, batch: int = 500) -> np.ndarray:
    """The posterior means of all ``images`` under ``vae`` with ``params``, (n, 4, 16, 16) float32, unscaled."""
    import jax  # here: the data set and its checker need no JAX

    encode = jax.jit(lambda p, x: vae.bind(p).encode(x)[0])
    return np.concatenate([np.asarray(encode(params, to_pixels(images[i: i + batch])))
                           for i in range(0, len(images), batch)])


def encode_training_data(model, images: np.ndarray, captions: list[str], batch: int = 500):
    """What tools/train_lcm.py and tools/train_controlnet.py train on, computed once: the scaled latents of
    ``images`` ((n, 4, 16, 16) float32, posterior means times the VAE's ``scaling_factor``) and both text encoders'
    outputs for ``captions`` (encoder_hidden_states (n, 77, d) and text_embeds (n, d2), program.generate's
    encode_prompts), ``model`` a checkpoint.loading.LoadedModel."""
    import jax

    from sdxl_engine.program.generate import encode_prompts

    ids = np.stack([np.asarray(t(captions, padding="max_length", max_length=77, truncation=True).input_ids)
                    for t in (model.tokenizer, model.tokenizer_2)], axis=1).astype(np.int32)
    vae = model.components["vae"]
    latents = encode_all(vae, model.params["vae"], images, batch=250) * vae.config.scaling_factor
    text = jax.jit(lambda p, i: encode_prompts(model.components, p, i))
    hidden, pooled = [], []
    for i in range(0, len(ids), batch):
        h, e = text(model.params, ids[i: i + batch])
        hidden.append(np.asarray(h))
        pooled.append(np.asarray(e))
    return latents, np.concatenate(hidden), np.concatenate(pooled)


@dataclasses.dataclass
class Steps:
    """A training loop's progress (:func:`run_steps`): ``history``, the mean loss of each logged stretch as
    [(step, loss rounded to 6 places)]; ``done``, the steps run; ``train_s``, the seconds since the first step
    began (at the last callback while it runs, then in all)."""

    history: list = dataclasses.field(default_factory=list)
    done: int = 0
    train_s: float = 0.0


def run_steps(step: Callable, state, steps: int, log_every: int, max_minutes: float, log: Callable[[str], None],
              after: Callable | None = None) -> tuple[object, Steps]:
    """Run ``state, loss = step(state, i)`` for i = 1 ... ``steps`` (one training step: ``state`` is what it carries,
    ``loss`` a scalar, a device array left unread until logged). Every ``log_every`` steps and at the last, the mean
    loss since the last log goes into the history and is logged as ``step i/steps loss L (S s/step)``; then
    ``after(i, state, progress)`` runs (a periodic save: ``progress`` is the :class:`Steps` so far); past
    ``max_minutes`` of training it logs ``time limit: stopping after i steps`` and stops. Returns (the last state,
    the :class:`Steps`)."""
    import jax  # here: the data set and its checker need no JAX

    progress, running, start = Steps(), [], time.perf_counter()
    for i in range(1, steps + 1):
        state, loss = step(state, i)
        running.append(loss)
        progress.done = i
        elapsed = time.perf_counter() - start
        if i % log_every == 0 or i == steps:
            mean = float(np.mean(jax.device_get(running)))
            running = []
            progress.history.append((i, round(mean, 6)))
            log(f"step {i}/{steps} loss {mean:.5f} ({elapsed / i:.2f} s/step)")
        if after is not None:
            progress.train_s = time.perf_counter() - start
            after(i, state, progress)
        if elapsed > max_minutes * 60:
            log(f"time limit: stopping after {i} steps")
            break
    progress.train_s = time.perf_counter() - start
    return state, progress
