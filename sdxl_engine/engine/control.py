"""ControlNet units on the host: the request's :class:`ControlUnit`, its validation, the arrays a program takes
(:class:`ControlArrays`: images at the pass's size, weights, injection modes, per-step keep) and the infotext.

The semantics are AUTOMATIC1111's sd-webui-controlnet (``scripts/hook.py``, ``scripts/controlnet.py``,
``internal_controlnet/args.py``); docs/controlnet.md has the table. In short:

* **Step schedule** (hook.py ``guidance_schedule_handler``): a unit is skipped at step i of the N steps that run
  when ``i / N < guidance_start or i / N > guidance_end``. diffusers' pipelines skip it when ``i / N < start or
  (i + 1) / N > end``: one step earlier at the end (end 0.5 of 10 steps: A1111 runs steps 0..5, diffusers 0..4).
  img2img counts the steps that run (A1111's ``t_enc + 1`` sampling steps; diffusers' timesteps after
  ``get_timesteps``).
* **control_mode** (controlnet.py: ``soft_injection = mode != Balanced``, ``cfg_injection = mode == ControlNet``;
  hook.py ``control_scales`` and ``cond_mark``): "Balanced": each residual times the weight, on both CFG halves
  (diffusers without guess mode); "My prompt is more important": residual k of n times weight x 0.825 ** (12 - k)
  (SDXL's 10: 0.825^12 .. 0.825^3); "ControlNet is more important": those soft scales, and the residuals on the
  prompt's half only (the negative prompt's rows get none).
* **Several units** add their residuals.
* **ControlNet-Union** (diffusers' ``StableDiffusionXLControlNetUnionPipeline``): a unit of a union model names
  each image's control type (``control_type``: sd-webui-controlnet's names, :data:`UNION_TYPES`, diffusers' names,
  :data:`CONTROL_TYPES`, or indices), and may carry several images, one type each, in one call; its weight scales
  the residuals (one image) or each image's share (several), as diffusers' ``controlnet_conditioning_scale``.
* **Hires fix** (``hr_option`` "Both"): both passes, the control image fitted to each pass's size; in the second pass
  a unit whose module is canny (or mlsd) gets the soft scales (hook.py ``high_res_fix_forced_soft_injection``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence

import numpy as np

from sdxl_engine.engine.control_preprocess import (
    MODULES,
    RESIZE_MODES,
    fit,
    module_name,
    pixel_perfect_resolution,
    preprocess,
)
from sdxl_engine.engine.errors import InvalidRequest

CONTROL_MODES = ("Balanced", "My prompt is more important", "ControlNet is more important")
# sd-webui-controlnet's older names of the resize modes (args.py ``check_resize_mode``).
RESIZE_ALIASES = {"Inner Fit (Scale to Fit)": "Crop and Resize", "Outer Fit (Shrink to Fit)": "Resize and Fill",
                  "Scale to Fit (Inner Fit)": "Crop and Resize", "Envelope (Outer Fit)": "Resize and Fill"}
MAX_WEIGHT = 2.0  # sd-webui-controlnet's ``weight`` bound (args.py: ge 0, le 2)
PROCESSOR_RES = (64, 2048)  # its resolution slider's bounds; -1 = the module's default
MAX_CONTROL_SIDE = 8192  # pixels: a control image larger than this is refused before any resize
MAX_UNION_IMAGES = 4  # control images one ControlNet-Union unit may carry (each count is its own program)
# diffusers' control_mode indices (xinsir's ControlNetPlus ``TASKNAME2ID``; ProMax adds tile and repaint), and what
# each covers. Kept here, not in models/controlnet_union.py: the settings' check (serving/main.prepare) imports this
# module before JAX, and the model never reads the names.
CONTROL_TYPES = {"openpose": 0, "depth": 1, "hed": 2, "pidi": 2, "scribble": 2, "ted": 2, "canny": 3, "lineart": 3,
                 "anime_lineart": 3, "mlsd": 3, "normal": 4, "segment": 5, "tile": 6, "repaint": 7}
# The same types by sd-webui-controlnet's names (scripts/enums.py ``ControlNetUnionControlType`` values), in index
# order: what every front shows and takes (the page's Control type, /generate's and MCP's control_type, A1111's
# union_control_type) and what the infotext writes. A 6-type union (xinsir's first) takes the first six.
UNION_TYPES = ("OpenPose", "Depth", "Soft Edge", "Hard Edge", "Normal Map", "Segmentation", "Tile", "Inpaint")
# each name a unit's control_type may be (any case): diffusers' and the extension's
TYPE_INDEX = {**CONTROL_TYPES, **{name.lower(): k for k, name in enumerate(UNION_TYPES)}}


@dataclasses.dataclass(frozen=True)
class ControlUnit:
    """One ControlNet unit of a request (sd-webui-controlnet's ``ControlNetUnit``, the fields the engine uses).

    Attributes:
        image: the control image, (H, W, 3) uint8 RGB (any size: fitted to the request's by ``resize_mode``;
            (H, W) grey or (H, W, 4) RGBA are made RGB as A1111's HWC3). Not compared (numpy arrays).
        model: a loaded ControlNet's name, or ``"name [hash]"`` as A1111's model list writes it (the hash part is
            not checked).
        weight: its residuals' scale, 0 .. 2.
        guidance_start, guidance_end: the share of the steps it runs in, 0 .. 1, start <= end (A1111's rule:
            skipped at step i of N when i / N < start or i / N > end).
        control_mode: one of :data:`CONTROL_MODES` (or its index 0, 1, 2).
        resize_mode: one of ``RESIZE_MODES`` (or its index, or an older alias): how the map meets the request's
            size.
        pixel_perfect: the preprocessor's resolution from the image and request sizes (``processor_res`` ignored).
        processor_res: the preprocessor's resolution (its short side), 64 .. 2048; -1: the module's default (512).
        module: the preprocessor (engine/control_preprocess.py: none, canny, invert, tile_resample, blur_gaussian,
            scribble_xdog, lineart_standard).
        threshold_a, threshold_b: the preprocessor's two sliders (canny: low, high); -1: its defaults.
        control_type: a ControlNet-Union unit's control type per image: a name of :data:`UNION_TYPES` ("Hard
            Edge", "Depth", ...) or of :data:`CONTROL_TYPES` ("canny", "depth", "openpose", ...), any case, or
            diffusers' index (0 .. the model's types - 1), or a list of them, one per image of ``image`` (then a
            list of images: several types in one unit). None for a plain ControlNet. Validated: a tuple of indices.
    """

    image: object = dataclasses.field(default=None, compare=False)
    model: str = ""
    weight: float = 1.0
    guidance_start: float = 0.0
    guidance_end: float = 1.0
    control_mode: str = "Balanced"
    resize_mode: str = "Crop and Resize"
    pixel_perfect: bool = False
    processor_res: int = -1
    module: str = "none"
    threshold_a: float = -1.0
    threshold_b: float = -1.0
    control_type: object = None

    @property
    def images(self) -> tuple:
        """Its control images: the list of a several-image union unit, else the one image."""
        return tuple(self.image) if isinstance(self.image, (list, tuple)) else (self.image,)


def model_name_of(model) -> str:
    """A unit's model text without A1111's `` [hash]`` suffix."""
    text = model.strip() if isinstance(model, str) else ""
    if text.endswith("]") and " [" in text:
        text = text[:text.rindex(" [")]
    return text


def _number(field: str, value, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidRequest(field, f"expected a number between {lo:g} and {hi:g}, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidRequest(field, f"must be between {lo:g} and {hi:g}, got {value:g}")
    return float(value)


def _choice(field: str, value, names: Sequence[str], aliases: Mapping[str, str] | None = None) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(names):
        return names[value]
    value = (aliases or {}).get(value, value) if isinstance(value, str) else value
    if value in names:
        return value
    raise InvalidRequest(field, f"expected one of {', '.join(repr(n) for n in names)} (or 0..{len(names) - 1}), got "
                                f"{value!r}")


def as_control_image(field: str, image) -> np.ndarray:
    """A unit's image as (H, W, 3) uint8 (grey and RGBA made RGB as A1111's HWC3). Raises InvalidRequest."""
    from sdxl_engine.engine.control_preprocess import hwc3

    if not isinstance(image, np.ndarray):
        raise InvalidRequest(field, f"expected a (height, width, 3) uint8 numpy array, got {type(image).__name__}")
    if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
        raise InvalidRequest(field, f"expected (height, width, 3) uint8 RGB pixels, got {image.shape} {image.dtype}")
    if min(image.shape[:2]) < 1 or max(image.shape[:2]) > MAX_CONTROL_SIDE:
        raise InvalidRequest(field, f"is {image.shape[1]}x{image.shape[0]} pixels; each side must be 1 .. "
                                    f"{MAX_CONTROL_SIDE}")
    return np.ascontiguousarray(hwc3(image))


def as_control_types(field: str, value, types: int) -> tuple[int, ...]:
    """A union unit's ``control_type`` as indices: a name of :data:`UNION_TYPES` or :data:`CONTROL_TYPES` (any case)
    or an index below ``types`` (the model's count; an int or its decimal string), or a list of them. Raises
    InvalidRequest naming ``field``."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    offered = (f"one of {', '.join(UNION_TYPES[:types])} (or diffusers' {', '.join(CONTROL_TYPES)}; or "
               f"0..{types - 1})")
    if value is None or value == "" or not values:
        raise InvalidRequest(field, f"a ControlNet-Union unit needs a control type per image: {offered}")
    out = []
    for v in values:
        # a number in a string too: the page's, gradio_client's and MCP's control_type is a text input
        index = (int(v.strip()) if v.strip().isdecimal() else TYPE_INDEX.get(v.strip().lower())) if isinstance(
            v, str) else v
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise InvalidRequest(field, f"unknown control type {v!r}: {offered}")
        if not 0 <= index < types:
            raise InvalidRequest(field, f"control type {v!r} (index {index}): this ControlNet-Union has {types} types "
                                        f"({', '.join(UNION_TYPES[:types])}; Tile and Inpaint (tile 6, repaint 7) "
                                        "are ProMax's)")
        out.append(int(index))
    return tuple(out)


def _union_fields(f: str, unit: ControlUnit, name: str, types: int) -> dict:
    """A unit's ``image`` and ``control_type`` checked for its ControlNet (``types``: its union's type count, 0 for a
    plain ControlNet)."""
    images = unit.images
    if not types:
        if unit.control_type not in (None, "", (), []):
            raise InvalidRequest(f"{f}.control_type", f"ControlNet {name!r} is not a ControlNet-Union: it takes no "
                                                      "control type; leave control_type out")
        if len(images) != 1:
            raise InvalidRequest(f"{f}.image", f"{len(images)} images; ControlNet {name!r} takes one (several go to "
                                               "a ControlNet-Union unit, one control type each)")
        return dict(image=as_control_image(f"{f}.image", images[0]))
    kinds = as_control_types(f"{f}.control_type", unit.control_type, types)
    if not 1 <= len(images) <= MAX_UNION_IMAGES:
        raise InvalidRequest(f"{f}.image", f"{len(images)} images; a ControlNet-Union unit takes 1..{MAX_UNION_IMAGES}")
    if len(kinds) != len(images):
        raise InvalidRequest(f"{f}.control_type", f"{len(kinds)} control types for {len(images)} images: one type "
                                                  "per image")
    checked = tuple(as_control_image(f"{f}.image" if len(images) == 1 else f"{f}.image[{i}]", image)
                    for i, image in enumerate(images))
    return dict(image=checked[0] if len(checked) == 1 else checked, control_type=kinds)


def validate_units(units, loaded: Sequence[str], max_units: int, unfit: Sequence[str] = (),
                   model: str = "", unions: Mapping[str, int] | None = None) -> tuple[ControlUnit, ...]:
    """A request's ``control_units`` checked and normalised: names resolved (``model``: a loaded name; ``module``,
    ``control_mode``, ``resize_mode``: their canonical names), numbers in range, the image (H, W, 3) uint8.

    ``loaded``: the names of the ControlNets the request's model can run; ``max_units``: how many units a request may
    have; ``unfit``: the server's other ControlNets (another architecture than the request's model, named ``model``),
    which a unit's refusal names as such; ``unions``: {name: control types} of the loaded ControlNet-Unions (their
    units need ``control_type``; the others refuse it).
    Raises InvalidRequest naming the field, e.g. ``control_units[1].model`` (an unknown model: the message names it
    and lists the loaded ones; one that does not fit the model, or none loaded: says so), ``control_units[0].module``
    (UnknownModule).
    """
    if units is None:
        return ()
    if isinstance(units, ControlUnit) or not isinstance(units, (list, tuple)):
        raise InvalidRequest("control_units", f"expected a list of ControlUnit, got {type(units).__name__}")
    if units and not loaded and unfit:
        raise InvalidRequest("control_units", f"no ControlNet of this server fits the model {model or '(default)'}: "
                                              f"{', '.join(unfit)} {'is' if len(unfit) == 1 else 'are'} for another "
                                              "architecture; choose a model they fit, or drop the units")
    if units and not loaded:
        raise InvalidRequest("control_units", "no ControlNet is loaded on this server (start it with --controlnet "
                                              "PATH or --controlnet-dir DIR), so it cannot run ControlNet units")
    if len(units) > max_units:
        raise InvalidRequest("control_units", f"{len(units)} units; this server runs at most {max_units} per request "
                                              "(max_control_units)")
    out = []
    for k, unit in enumerate(units):
        f = f"control_units[{k}]"
        if not isinstance(unit, ControlUnit):
            raise InvalidRequest(f, f"expected a ControlUnit, got {type(unit).__name__}")
        name = model_name_of(unit.model)
        if name in unfit:
            raise InvalidRequest(f"{f}.model", f"ControlNet {name!r} does not fit the model {model or '(default)'} "
                                               f"(another architecture); it can run: {', '.join(loaded)}")
        if name not in loaded:
            raise InvalidRequest(f"{f}.model", f"no ControlNet named {unit.model!r} is loaded; loaded: "
                                               f"{', '.join(loaded)}")
        start = _number(f"{f}.guidance_start", unit.guidance_start, 0.0, 1.0)
        end = _number(f"{f}.guidance_end", unit.guidance_end, 0.0, 1.0)
        if start > end:
            raise InvalidRequest(f"{f}.guidance_start", f"{start:g} is after guidance_end {end:g}: the unit would "
                                                        "never run")
        if unit.pixel_perfect not in (True, False):
            raise InvalidRequest(f"{f}.pixel_perfect", f"expected true or false, got {unit.pixel_perfect!r}")
        res = unit.processor_res
        if isinstance(res, bool) or not isinstance(res, numbers.Integral) or not (
                res < 0 or PROCESSOR_RES[0] <= res <= PROCESSOR_RES[1]):
            raise InvalidRequest(f"{f}.processor_res", f"expected -1 (the module's default) or a whole number "
                                                       f"{PROCESSOR_RES[0]}..{PROCESSOR_RES[1]}, got {res!r}")
        thresholds = [_number(f"{f}.{t}", getattr(unit, t), -1.0, 1e4) for t in ("threshold_a", "threshold_b")]
        out.append(ControlUnit(
            **_union_fields(f, unit, name, (unions or {}).get(name, 0)), model=name,
            weight=_number(f"{f}.weight", unit.weight, 0.0, MAX_WEIGHT), guidance_start=start, guidance_end=end,
            control_mode=_choice(f"{f}.control_mode", unit.control_mode, CONTROL_MODES),
            resize_mode=_choice(f"{f}.resize_mode", unit.resize_mode, RESIZE_MODES, RESIZE_ALIASES),
            pixel_perfect=bool(unit.pixel_perfect), processor_res=int(res) if res > 0 else -1,
            module=module_name(f"{f}.module", unit.module), threshold_a=thresholds[0], threshold_b=thresholds[1]))
    return tuple(out)


def a1111_keep(step: int, runs: int, start: float, end: float) -> bool:
    """Whether a unit runs at ``step`` (0-based) of the ``runs`` steps that run: A1111's rule, skipped when
    ``step / runs < start or step / runs > end``."""
    return not (step / runs < start or step / runs > end)


def diffusers_keep(step: int, runs: int, start: float, end: float) -> bool:
    """diffusers' rule, for comparison (docs/controlnet.md): skipped when ``step / runs < start or (step + 1) / runs >
    end``."""
    return not (step / runs < start or (step + 1) / runs > end)


def keep_row(start: float, end: float, first: int, steps: int, max_steps: int) -> np.ndarray:
    """(max_steps,) float32: 1 at the loop steps ``first .. steps - 1`` where the unit runs (A1111's rule on the
    ``steps - first`` steps that run), 0 elsewhere (the skipped start of img2img, the padding)."""
    row = np.zeros((max_steps,), np.float32)
    runs = steps - first
    for j in range(runs):
        row[first + j] = float(a1111_keep(j, runs, start, end))
    return row


def mode_factors(mode: str, module: str = "none", hires_pass: bool = False) -> tuple[float, float]:
    """(soft, uncond) of a control mode: soft 1 = A1111's soft injection scales; uncond = the factor on the negative
    prompt's rows (0: cfg injection). Hires fix's second pass makes a canny unit soft (hook.py)."""
    soft = float(mode != "Balanced" or (hires_pass and ("canny" in module or "mlsd" in module)))
    return soft, float(mode != "ControlNet is more important")


def control_image(unit: ControlUnit, width: int, height: int, image=None) -> np.ndarray:
    """A validated unit's conditioning image (``image``, one of a union unit's; None: its one image) at (height,
    width, 3) uint8: its module's map (at ``processor_res``, or the pixel-perfect resolution), fitted by its resize
    mode (engine/control_preprocess.py)."""
    image = unit.image if image is None else image
    res = (pixel_perfect_resolution(image, height, width, unit.resize_mode) if unit.pixel_perfect
           else unit.processor_res)
    detected = preprocess(image, unit.module, res, unit.threshold_a, unit.threshold_b)
    return fit(detected, width, height, unit.resize_mode)


@dataclasses.dataclass(frozen=True)
class ControlArrays:
    """The control_* inputs of one program call (program/generate.py ``ProgramInputs.with_control``).

    images (batch, the units' images, H, W, 3) uint8 (each unit's in turn); weight, soft, uncond (units,) float32;
    keep (units, max_steps) float32; types (the units' images,) int32, each image's union control type (0 for a plain
    ControlNet's); models: each unit's ControlNet name, in order (its params go in params["controlnet"]).
    """

    images: np.ndarray
    weight: np.ndarray
    soft: np.ndarray
    uncond: np.ndarray
    keep: np.ndarray
    models: tuple[str, ...]
    types: np.ndarray | None = None

    def inputs(self) -> dict:
        """Keyword arguments of ``ProgramInputs.with_control``."""
        return dict(images=self.images, weight=self.weight, soft=self.soft, uncond=self.uncond, keep=self.keep,
                    types=self.types)



def control_arrays(units: Sequence[ControlUnit], width: int, height: int, batch: int, first: int, steps: int,
                   max_steps: int, hires_pass: bool = False) -> ControlArrays:
    """The arrays of validated ``units`` for a pass at (width, height) of ``batch`` images whose loop runs steps
    ``first .. steps - 1``; ``hires_pass``: hires fix's second pass (:func:`mode_factors`)."""
    # (the units' images, H, W, 3), each unit's in turn
    images = np.stack([control_image(u, width, height, image) for u in units for image in u.images])
    types = np.asarray([t for u in units for t in (u.control_type or (0,) * len(u.images))], np.int32)
    factors = [mode_factors(u.control_mode, u.module, hires_pass) for u in units]
    return ControlArrays(types=types,
        images=np.ascontiguousarray(np.broadcast_to(images, (batch, *images.shape))),
        weight=np.asarray([u.weight for u in units], np.float32),
        soft=np.asarray([s for s, _ in factors], np.float32), uncond=np.asarray([c for _, c in factors], np.float32),
        keep=np.stack([keep_row(u.guidance_start, u.guidance_end, first, steps, max_steps) for u in units]),
        models=tuple(u.model for u in units))


def unit_images(units: Sequence[ControlUnit]) -> tuple[int, ...]:
    """ProgramShape.control_images of validated ``units``: each one's image count, or () when each has one."""
    counts = tuple(len(u.images) for u in units)
    return counts if any(n != 1 for n in counts) else ()


def infotext(units: Sequence[ControlUnit], titles: Mapping[str, str]) -> dict[str, str]:
    """A1111's infotext entries of validated ``units``: {"ControlNet 0": "Module: canny, Model: name [hash], Weight:
    1.0, Resize Mode: Crop and Resize, Processor Res: 512, Threshold A: 100.0, Threshold B: 200.0, Guidance Start:
    0.0, Guidance End: 1.0, Pixel Perfect: False, Control Mode: Balanced"} (internal_controlnet/args.py
    ``serialize``: its fields in its order; -1 defaults written as the module's values, as its
    ``bound_check_params`` sets them). ``titles``: {name: "name [hash]"}. The values hold commas: a PNG's
    parameters quote them (A1111's ``quote``: JSON), as the delivery does for every value."""
    return {f"ControlNet {k}": unit_infotext(u, titles.get(u.model, u.model)) for k, u in enumerate(units)}


def unit_infotext(u: ControlUnit, title: str, module: str | None = None) -> str:
    """One unit's :func:`infotext` value: ``title`` its model's "name [hash]"; ``module``: the name written in
    place of the unit's own (an IP-Adapter unit's, engine/ip_adapter.infotext: its sliders as the model-free
    "none" module's)."""
    res, a, b = MODULES[u.module]
    fields = [("Module", module or u.module), ("Model", title), ("Weight", u.weight), ("Resize Mode", u.resize_mode),
              ("Processor Res", u.processor_res if u.processor_res > 0 else (res or 512)),
              ("Threshold A", u.threshold_a if u.threshold_a >= 0 else (a if a is not None else -1.0)),
              ("Threshold B", u.threshold_b if u.threshold_b >= 0 else (b if b is not None else -1.0)),
              ("Guidance Start", u.guidance_start), ("Guidance End", u.guidance_end),
              ("Pixel Perfect", u.pixel_perfect), ("Control Mode", u.control_mode)]
    if u.control_type:  # a union unit's types: the extension's ControlNetUnit field union_control_type, as its
        # serialize writes a field (args.py field_to_displaytext, the enum's value), so its parse reads one type back
        fields.append(("Union Control Type", " + ".join(UNION_TYPES[t] for t in u.control_type)))
    return ", ".join(f"{name}: {value}" for name, value in fields)


def detect(image, module: str = "none", processor_res: int = -1, threshold_a: float = -1,
           threshold_b: float = -1) -> np.ndarray:
    """The detected map of one image by one preprocessor (sd-webui-controlnet's ``/controlnet/detect`` body): the
    image checked as a unit's (``image``), the module resolved (:func:`.control_preprocess.module_name`: an alias
    read, a model-backed or unknown one refused), the map (H', W', 3) uint8 at ``processor_res`` (-1: the module's
    default). Raises InvalidRequest (UnknownModule for ``module``) naming the field."""
    (unit,) = validate_units([ControlUnit(image=image, model="-", module=module, processor_res=processor_res,
                                          threshold_a=threshold_a, threshold_b=threshold_b)], ["-"], 1)
    return preprocess(unit.image, unit.module, unit.processor_res, unit.threshold_a, unit.threshold_b)
