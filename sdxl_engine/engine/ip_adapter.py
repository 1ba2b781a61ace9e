"""IP-Adapter units on the host: the request's :class:`IPAdapterUnit`, its validation, the reference images as the
image encoder takes them (:func:`clip_pixels`) and the arrays a program takes (:class:`IPAdapterArrays`: each unit's
image tokens, its scale and its per-step keep). docs/ip-adapter.md.

* **Reference images** go through CLIPImageProcessor's steps, as diffusers' ``load_ip_adapter`` makes it
  (``CLIPImageProcessor(size=S, crop_size=S)``, S the encoder's ``image_size``): the short side resized to S
  (PIL bicubic, the long side ``int(S x long / short)``), the middle S x S cropped, x / 255, normalised by OpenAI
  CLIP's mean and std. Several images of one unit give their tokens one after another (diffusers' list of images for
  one adapter).
* **Face embeddings** (FaceID adapters: ``IPAdapterUnit.embeds``): what insightface's ``FaceAnalysis`` gives a face
  as ``normed_embedding`` (512 floats), computed by the client (the engine runs no face detector): through FaceID's
  projection alone, the negative row that of zeros, as diffusers' ``ip_adapter_image_embeds`` with
  ``torch.zeros_like`` negatives. Several embeddings of one unit give their tokens one after another, as images.
* **Scale** (``weight``): diffusers' ``set_ip_adapter_scale``: the image attention's factor in every layer; 0 adds
  nothing (the images of no adapter).
* **Step schedule**: A1111's rule as a ControlNet unit's (engine/control.keep_row): the unit's scale is 0 at the
  steps outside ``guidance_start .. guidance_end``. diffusers has no start/end for IP-Adapter.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Mapping, Sequence

import numpy as np
import PIL.Image

from sdxl_engine.engine.control import (
    MAX_WEIGHT,
    ControlUnit,
    _number,
    as_control_image,
    keep_row,
    model_name_of,
    unit_infotext,
)
from sdxl_engine.engine.errors import InvalidRequest

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' image_utils, CLIPImageProcessor's defaults
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_REFERENCE_IMAGES = 4  # reference images (or face embeddings) per unit: each count is its own program shape
FACEID_MODULE = "ip-adapter_face_id"  # sd-webui-controlnet's FaceID preprocessor (insightface on its server)


@dataclasses.dataclass(frozen=True)
class IPAdapterUnit:
    """One IP-Adapter unit of a request.

    Attributes:
        image: the reference image, (H, W, 3) uint8 RGB (any size; grey and RGBA made RGB), or a tuple of them
            (their tokens one after another, as diffusers' list of images for one adapter). Not compared. None for a
            FaceID adapter's unit.
        embeds: a FaceID adapter's input in place of ``image``: one face embedding (a sequence or (d,) array of d
            floats, d the adapter's width: 512, insightface's ``normed_embedding``), or several ((n, d) or a sequence
            of them, n 1 .. :data:`MAX_REFERENCE_IMAGES`: their tokens one after another). Validated to a tuple of
            (d,) float32 arrays. Not compared. None for the other adapters' units.
        model: a loaded IP-Adapter's name (or ``"name [hash]"``; the hash is not checked).
        weight: the adapter's scale (diffusers' ``set_ip_adapter_scale``), 0 .. 2.
        guidance_start, guidance_end: the share of the steps it acts in, 0 .. 1, start <= end (A1111's rule, as a
            ControlNet unit's).
    """

    image: object = dataclasses.field(default=None, compare=False)
    model: str = ""
    weight: float = 1.0
    guidance_start: float = 0.0
    guidance_end: float = 1.0
    embeds: object = dataclasses.field(default=None, compare=False)

    @property
    def images(self) -> tuple:
        """The reference images as a tuple (one or several)."""
        return tuple(self.image) if isinstance(self.image, (list, tuple)) else (self.image,)


def as_embeds(field: str, value, dim: int) -> tuple[np.ndarray, ...]:
    """A unit's ``embeds`` as a tuple of (dim,) float32 arrays: one embedding (d numbers) or several ((n, d) or a list
    of d-number lists). Raises InvalidRequest naming ``field`` (or ``field[i]`` for one of several): not numbers, not
    ``dim`` wide, not finite, none or more than :data:`MAX_REFERENCE_IMAGES`."""
    want = (f"a face embedding of {dim} floats (insightface's normed_embedding) or a list of 1 .. "
            f"{MAX_REFERENCE_IMAGES} of them")
    if isinstance(value, np.ndarray):
        if value.ndim not in (1, 2) or not np.issubdtype(value.dtype, np.number) or value.dtype == np.bool_:
            raise InvalidRequest(field, f"expected {want}, got an array of shape {value.shape} {value.dtype}")
        several = value.ndim == 2
        rows = list(value) if several else [value]
    elif isinstance(value, (list, tuple)):
        several = bool(value) and all(isinstance(v, (list, tuple, np.ndarray)) for v in value)
        rows = list(value) if several else [value]
    else:
        raise InvalidRequest(field, f"expected {want}, got {type(value).__name__}")
    if not 1 <= len(rows) <= MAX_REFERENCE_IMAGES:
        raise InvalidRequest(field, f"{len(rows)} face embeddings; a unit takes 1 .. {MAX_REFERENCE_IMAGES}")
    out = []
    for i, row in enumerate(rows):
        f = f"{field}[{i}]" if several else field
        if isinstance(row, np.ndarray):
            if row.ndim != 1 or not np.issubdtype(row.dtype, np.number) or row.dtype == np.bool_:
                raise InvalidRequest(f, f"expected {dim} floats, got an array of shape {row.shape} {row.dtype}")
            array = row.astype(np.float64)
        else:
            bad = next((v for v in row if isinstance(v, bool) or not isinstance(v, numbers.Real)), None)
            if bad is not None:
                raise InvalidRequest(f, f"expected {dim} floats, got {type(bad).__name__} {bad!r} among them")
            array = np.asarray(row, np.float64)
        if array.shape != (dim,):
            raise InvalidRequest(f, f"has {array.shape[0]} values; this IP-Adapter takes {dim}-d face embeddings "
                                    "(insightface's normed_embedding)")
        if not np.isfinite(array).all():
            raise InvalidRequest(f, f"value {int(np.flatnonzero(~np.isfinite(array))[0])} is not finite (NaN or "
                                    "infinite)")
        if np.abs(array).max() > np.finfo(np.float32).max:
            raise InvalidRequest(f, "a value is beyond float32's range")
        out.append(np.ascontiguousarray(array, np.float32))
    return tuple(out)


def validate_ip_units(units, loaded: Sequence[str], max_units: int,
                      embed_dims: Mapping[str, int] | None = None) -> tuple[IPAdapterUnit, ...]:
    """A request's ``ip_adapter_units`` checked and normalised: the model a loaded name, the images (H, W, 3)
    uint8 (1 .. :data:`MAX_REFERENCE_IMAGES`) or, for a FaceID adapter (``embed_dims``: {name: its embeddings'
    width} of the loaded FaceID adapters), the face embeddings (:func:`as_embeds`), numbers in range.

    Raises InvalidRequest naming the field: ``ip_adapter_units`` (not a list, too many units, none loaded),
    ``ip_adapter_units[k].model`` (unknown: lists the loaded ones), ``.image`` / ``.image[i]`` (an image adapter's
    unit without one; an image for a FaceID adapter), ``.embeds`` / ``.embeds[i]`` (a FaceID adapter's unit without
    them, embeddings for an image adapter, see :func:`as_embeds`), ``.weight``, ``.guidance_start`` /
    ``.guidance_end``."""
    embed_dims = embed_dims or {}
    if units is None:
        return ()
    if isinstance(units, IPAdapterUnit) or not isinstance(units, (list, tuple)):
        raise InvalidRequest("ip_adapter_units", f"expected a list of IPAdapterUnit, got {type(units).__name__}")
    if units and not loaded:
        raise InvalidRequest("ip_adapter_units", "no IP-Adapter is loaded on this server (start it with --ip-adapter "
                                                 "PATH), so it cannot run IP-Adapter units")
    if len(units) > max_units:
        raise InvalidRequest("ip_adapter_units", f"{len(units)} units; this server runs at most {max_units} per "
                                                 "request (max_ip_adapter_units)")
    out = []
    for k, unit in enumerate(units):
        f = f"ip_adapter_units[{k}]"
        if not isinstance(unit, IPAdapterUnit):
            raise InvalidRequest(f, f"expected an IPAdapterUnit, got {type(unit).__name__}")
        name = model_name_of(unit.model)
        if name not in loaded:
            raise InvalidRequest(f"{f}.model", f"no IP-Adapter named {unit.model!r} is loaded; loaded: "
                                               f"{', '.join(loaded)}")
        checked, embeds = None, None
        if name in embed_dims:  # FaceID: face embeddings, no image
            if unit.image is not None:
                raise InvalidRequest(f"{f}.image", f"{name} is an IP-Adapter FaceID: it takes no image but the face's "
                                                   f"embedding ({embed_dims[name]} floats, insightface's "
                                                   f"normed_embedding, computed by the client) as embeds")
            if unit.embeds is None:
                raise InvalidRequest(f"{f}.embeds", f"{name} is an IP-Adapter FaceID: send the face's embedding "
                                                    f"({embed_dims[name]} floats, insightface's normed_embedding); "
                                                    "this server runs no face detector")
            embeds = as_embeds(f"{f}.embeds", unit.embeds, embed_dims[name])
        else:
            if unit.embeds is not None:
                raise InvalidRequest(f"{f}.embeds", f"{name} takes a reference image, not face embeddings (those are "
                                                    "for an IP-Adapter FaceID)")
            if unit.image is None:
                raise InvalidRequest(f"{f}.image", f"{name} takes a reference image: send one (or several)")
            images = unit.images
            if not 1 <= len(images) <= MAX_REFERENCE_IMAGES:
                raise InvalidRequest(f"{f}.image", f"{len(images)} reference images; a unit takes 1 .. "
                                                   f"{MAX_REFERENCE_IMAGES}")
            several = isinstance(unit.image, (list, tuple))
            checked = tuple(as_control_image(f"{f}.image[{i}]" if several else f"{f}.image", image)
                            for i, image in enumerate(images))
        start = _number(f"{f}.guidance_start", unit.guidance_start, 0.0, 1.0)
        end = _number(f"{f}.guidance_end", unit.guidance_end, 0.0, 1.0)
        if start > end:
            raise InvalidRequest(f"{f}.guidance_start", f"{start:g} is after guidance_end {end:g}: the unit would "
                                                        "never act")
        out.append(IPAdapterUnit(image=checked, model=name, weight=_number(f"{f}.weight", unit.weight, 0.0,
                                                                           MAX_WEIGHT),
                                 guidance_start=start, guidance_end=end, embeds=embeds))
    return tuple(out)


def a1111_module(name: str) -> str:
    """sd-webui-controlnet's preprocessor for the SDXL IP-Adapter ``name``, as its ``ip-adapter-auto`` picks one by
    the model's name: the ViT-H files' (``..._vit-h``) ``ip-adapter_clip_sdxl_plus_vith``, else ViT-bigG's
    ``ip-adapter_clip_sdxl`` (the pairs the extension's own IP-Adapter tests send)."""
    return "ip-adapter_clip_sdxl_plus_vith" if "vit-h" in name.lower() else "ip-adapter_clip_sdxl"


def infotext(units: Sequence[IPAdapterUnit], titles: Mapping[str, str], first: int = 0) -> dict[str, str]:
    """A1111's infotext entries of validated ``units`` as sd-webui-controlnet writes an IP-Adapter unit: a
    ControlNet unit's entry, ``"ControlNet {first + k}"`` (after the request's ``first`` ControlNet units), with
    the module :func:`a1111_module`, the model ``titles``' "name [hash]", the weight, guidance start and end, and
    the other fields a unit has by default (engine/control.unit_infotext: "Crop and Resize", as the reference is
    centre-cropped; resolution 512). A FaceID unit's (face embeddings) module is :data:`FACEID_MODULE`."""
    return {f"ControlNet {first + k}": unit_infotext(
        ControlUnit(model=u.model, weight=u.weight, guidance_start=u.guidance_start, guidance_end=u.guidance_end),
        titles.get(u.model, u.model), FACEID_MODULE if u.embeds is not None else a1111_module(u.model))
        for k, u in enumerate(units)}


def clip_pixels(image: np.ndarray, size: int) -> np.ndarray:
    """One reference image (H, W, 3) uint8 as the image encoder takes it: (3, size, size) float32, channels-first,
    normalised (CLIPImageProcessor's resize, centre crop, rescale and normalise: the module docstring)."""
    h, w = image.shape[:2]
    short, long = min(h, w), max(h, w)
    new_long = int(size * long / short)
    new_h, new_w = (size, new_long) if h <= w else (new_long, size)
    resized = np.asarray(PIL.Image.fromarray(image).resize((new_w, new_h), PIL.Image.Resampling.BICUBIC))
    top, left = (new_h - size) // 2, (new_w - size) // 2
    crop = resized[top:top + size, left:left + size].astype(np.float64) / 255.0  # (size, size, 3)
    normed = (crop - np.asarray(OPENAI_CLIP_MEAN)) / np.asarray(OPENAI_CLIP_STD)
    return np.ascontiguousarray(normed.transpose(2, 0, 1), np.float32)


@dataclasses.dataclass(frozen=True)
class IPAdapterArrays:
    """The ip_* inputs of one program call (program/generate.py ``ProgramInputs.with_ip_adapter``).

    tokens (2, total tokens, width) float32: each unit's image tokens in order (row 0 the negative, row 1 the
    images'); scale (units,) float32; keep (units, max_steps) float32; models: each unit's IP-Adapter name, in order
    (its params go in params["ip_adapter"]); counts: each unit's token count (the program's shape).
    """

    tokens: np.ndarray
    scale: np.ndarray
    keep: np.ndarray
    models: tuple[str, ...]
    counts: tuple[int, ...]

    def inputs(self) -> dict:
        """Keyword arguments of ``ProgramInputs.with_ip_adapter``."""
        return dict(tokens=self.tokens, scale=self.scale, keep=self.keep)

    def split(self) -> list[np.ndarray]:
        """Each unit's tokens (2, its tokens, width), as :func:`reference_tokens` made them."""
        return np.split(self.tokens, np.cumsum(self.counts)[:-1], axis=1)


def reference_tokens(unit: IPAdapterUnit, adapter) -> np.ndarray:
    """A validated unit's image tokens (2, images x tokens, width) float32 by its adapter (a
    checkpoint/ip_adapter.LoadedIPAdapter): its images through the image encoder and the projection
    (program/ip_adapter.py), once per request; a FaceID unit's face embeddings through its projection."""
    from sdxl_engine.program.ip_adapter import reference_tokens_fn

    if adapter.takes_embeds:
        fn = reference_tokens_fn(None, adapter.component)
        return np.asarray(fn({}, adapter.params, np.stack(unit.embeds)))
    pixels = np.stack([clip_pixels(image, adapter.image_size) for image in unit.images])  # (n, 3, S, S)
    fn = reference_tokens_fn(adapter.encoder, adapter.component)
    return np.asarray(fn(adapter.encoder_params, adapter.params, pixels))


def compile_reference_tokens(adapter) -> float:
    """Compile (and run once) ``adapter``'s image encoder and projection for a one-image unit, by the path a request
    takes (:func:`reference_tokens`): that function runs outside the generate program, so without this the first
    request with a unit compiles it inside the request (a ViT-H/14 encoder took over 30 s so on a TPU v5e).
    ``adapter``: a checkpoint/ip_adapter.LoadedIPAdapter. Returns the seconds it took."""
    t0 = time.perf_counter()
    if adapter.takes_embeds:  # FaceID: one zero face embedding
        reference_tokens(IPAdapterUnit(embeds=(np.zeros(adapter.embed_dim, np.float32),), model=adapter.name),
                         adapter)
        return time.perf_counter() - t0
    size = adapter.image_size
    reference_tokens(IPAdapterUnit(image=np.full((size, size, 3), 128, np.uint8), model=adapter.name), adapter)
    return time.perf_counter() - t0


def ip_arrays(units: Sequence[IPAdapterUnit], adapters: Mapping[str, object], first: int, steps: int,
              max_steps: int, tokens: Sequence[np.ndarray] | None = None) -> IPAdapterArrays:
    """The arrays of validated ``units`` (``adapters``: the loaded IP-Adapters by name) for a pass whose loop runs
    steps ``first .. steps - 1``; ``tokens``: each unit's :func:`reference_tokens` computed already (hires fix's
    second pass reuses the first's), None: computed here."""
    tokens = [reference_tokens(u, adapters[u.model]) for u in units] if tokens is None else list(tokens)
    return IPAdapterArrays(
        tokens=np.concatenate(tokens, axis=1), scale=np.asarray([u.weight for u in units], np.float32),
        keep=np.stack([keep_row(u.guidance_start, u.guidance_end, first, steps, max_steps) for u in units]),
        models=tuple(u.model for u in units), counts=tuple(t.shape[1] for t in tokens))
