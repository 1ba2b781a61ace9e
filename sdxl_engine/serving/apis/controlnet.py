"""AUTOMATIC1111's sd-webui-controlnet on this server: its units in txt2img / img2img bodies
(``alwayson_scripts.controlnet.args``: :func:`units_of`) and its ``/controlnet/*`` routes (:func:`router`).

The shapes are the extension's (``scripts/api.py``, ``internal_controlnet/external_code.py`` and ``args.py``): a
unit's ``enabled``, ``module``, ``model`` ("name" or "name [hash]"), ``weight``, ``image`` (base64, a data URL, or
``{"image", "mask"}``), ``resize_mode``, ``control_mode``, ``guidance_start``, ``guidance_end``, ``pixel_perfect``,
``processor_res``, ``threshold_a``, ``threshold_b``, ``low_vram`` (accepted, no effect here), ``hr_option``
("Both" runs; another is a warning) and the legacy names ``input_image``, ``guidance`` (the end) and ``lowvram``.
The engine (engine/control.py) validates the values; an unknown model or module is refused here, naming the field
the client sent and the name. A unit whose model is a loaded IP-Adapter (the extension's IP-Adapter units: module
``ip-adapter_clip_sdxl``, ``ip-adapter_clip_sdxl_plus_vith``, ``ip-adapter_clip_h`` or ``ip-adapter-auto``, model
``ip-adapter_sdxl [hash]``) becomes an engine IPAdapterUnit (its image, weight, guidance start and end;
engine/ip_adapter.py: the adapter's own image encoder, found beside its file, encodes the image, whichever CLIP module
the unit names). An IP-Adapter FaceID unit sends the face's embedding in ``ip_adapter_embeds`` (this server's field, not
the extension's: 512 floats, insightface's ``normed_embedding``, or a list of them), module ``ip-adapter_face_id`` (or
none): the extension's ``ip-adapter_face_id*`` modules run insightface on its server, which this one has not, so those
modules without ``ip_adapter_embeds`` are refused saying so. A unit whose model is a loaded ControlNet-Union takes its
control type from the extension's ``union_control_type`` (its ``ControlNetUnionControlType`` values "OpenPose", "Depth",
"Soft Edge", "Hard Edge", "Normal Map", "Segmentation", "Tile", "Inpaint", or the tags its type filter maps to them),
else from the engine's ``control_type`` (diffusers' names or indices), else from the unit's ``module`` (canny and
lineart: hard edge, scribble: soft edge, tile and blur: tile, ...): :func:`union_type`. No Gradio here.
"""

from __future__ import annotations

import base64
import io

import numpy as np
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from PIL import Image

from sdxl_engine.engine.control import UNION_TYPES, ControlUnit, detect, model_name_of
from sdxl_engine.engine.control_preprocess import MODULES, module_name
from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.engine.ip_adapter import IPAdapterUnit
from sdxl_engine.serving.apis.errors import ApiError
from sdxl_engine.serving.apis.uploads import decode_image

SCRIPT = "controlnet"  # the extension's script, as A1111 finds an alwayson script: by title, any case
API_VERSION = 3  # external_code.get_api_version()
# How the extension's unit model (pydantic) reads an ``enabled`` that turns a unit off.
UNIT_OFF = (False, 0, "0", "false", "off", "no", "n", "f")
LEGACY = {"input_image": "image", "guidance": "guidance_end", "lowvram": "low_vram"}  # args.py legacy_field_alias
# A unit's fields passed to ControlUnit as they are (the engine checks their values).
PASSED = ("weight", "guidance_start", "guidance_end", "control_mode", "resize_mode", "pixel_perfect",
          "processor_res", "threshold_a", "threshold_b")
# The sliders each module shows (external_code.get_modules_detail: name, value, min, max, step).
SLIDERS = {"canny": (("Low Threshold", 100, 1, 255, 1), ("High Threshold", 200, 1, 255, 1)),
           "tile_resample": (("Down Sampling Rate", 1.0, 1.0, 8.0, 0.01),),
           "blur_gaussian": (("Sigma", 9.0, 0.01, 64.0, 0.01),),
           "scribble_xdog": (("XDoG Threshold", 32, 1, 64, 1),)}
# The extension's IP-Adapter modules this server runs (the CLIP image encoder's preprocessors): listed while an
# IP-Adapter is loaded. Its face ones (ip-adapter_face_id*: insightface embeddings) are refused by name.
IP_MODULES = ("ip-adapter-auto", "ip-adapter_clip_sdxl", "ip-adapter_clip_sdxl_plus_vith", "ip-adapter_clip_h")
# With ip_adapter_embeds (an IP-Adapter FaceID's face embedding, sent by the client), the modules a unit may name.
FACE_MODULES = ("ip-adapter_face_id", "ip-adapter-auto", "none")
IP_PASSED = ("weight", "guidance_start", "guidance_end")  # an IP-Adapter unit's fields passed as they are
# sd-webui-controlnet's control types (its preprocessors' tags, scripts/supported_preprocessor.py) for this server's
# /controlnet/control_types: each tag's modules among this server's (the extension's tags of them) and the union
# control type it is (enums.py ControlNetUnionControlType.from_str, engine/control.UNION_TYPES' index): a loaded
# ControlNet-Union is listed under each tag whose type it has.
CONTROL_TAGS = {"Canny": (("canny", "invert"), 3), "Depth": ((), 1), "Inpaint": ((), 7),
                "Lineart": (("lineart_standard", "invert"), 3), "MLSD": (("invert",), 3), "NormalMap": ((), 4),
                "OpenPose": ((), 0), "Scribble": (("scribble_xdog", "invert"), 2), "Segmentation": ((), 5),
                "SoftEdge": ((), 2), "Tile": (("tile_resample", "blur_gaussian"), 6)}
# The words a plain model's name has for a tag (supported_preprocessor.py ``tag_to_filters``: the tag and its
# aliases), as the extension files a model under a type by its name.
TAG_WORDS = {"segmentation": ("seg",), "normalmap": ("normal",), "openpose": ("densepose",), "scribble": ("sketch",),
             "tile": ("blur",), "ip-adapter": ("ip_adapter", "ipadapter")}
# Its ``from_str`` (the type filter's tags) and the module names' leading words: -> the type's index.
UNION_TAGS = {"openpose": 0, "dw": 0, "depth": 1, "softedge": 2, "scribble": 2, "hed": 2, "pidi": 2, "canny": 3,
              "lineart": 3, "mlsd": 3, "invert": 3, "normal": 4, "normalmap": 4, "segmentation": 5, "seg": 5,
              "tile": 6, "blur": 6, "inpaint": 7}


def is_off(enabled) -> bool:
    """Whether a unit's ``enabled`` turns it off (absent = on, as the extension)."""
    return enabled in UNIT_OFF or isinstance(enabled, str) and enabled.strip().lower() in UNIT_OFF


def script_units(extra: dict) -> tuple[str, list] | None:
    """(the field name ``alwayson_scripts.<script>.args``, its units) of a body's extra fields, or None when it has
    no ControlNet script (any key casing: "controlnet", "ControlNet"). Raises ApiError 422: args not a list."""
    scripts = extra.get("alwayson_scripts")
    for name, script in (scripts.items() if isinstance(scripts, dict) else ()):
        if str(name).strip().lower() != SCRIPT:
            continue
        field = f"alwayson_scripts.{name}.args"
        units = script.get("args") if isinstance(script, dict) else script
        if units is None:
            return None
        if not isinstance(units, list):
            raise ApiError(422, f"{field}: expected a list of ControlNet units, got {type(units).__name__}", field)
        return field, units
    return None


def unit_image(value, field: str) -> tuple[np.ndarray, bool]:
    """(the control image (H, W, 3) uint8, whether a mask came with it) of a unit's ``image``: base64, a data URL,
    ``{"image": ..., "mask": ...}`` or ``[image, mask]``. The mask is for the extension's inpaint modules, which
    this server does not run: it is not used. Raises ApiError 422 naming the field."""
    mask = False
    if isinstance(value, dict):
        value, mask = value.get("image"), bool(value.get("mask") or value.get("mask_image"))
        field = f"{field}.image"
    elif isinstance(value, (list, tuple)) and value:
        value, mask = value[0], len(value) > 1 and bool(value[1])
    if not isinstance(value, str) or not value:
        raise ApiError(422, f"{field}: send the control image (base64 PNG, JPEG or WebP, or a data URL)", field)
    try:
        return np.asarray(decode_image(value, field, mode="RGB"), dtype=np.uint8), mask
    except ApiError as err:
        raise ApiError(422, err.message, err.param) from None


def ip_unit(values: dict, model: str, field: str) -> IPAdapterUnit:
    """The engine's IPAdapterUnit of an enabled A1111 unit whose model is a loaded IP-Adapter. Raises ApiError 422
    naming the field: a module that is not an IP-Adapter one (a face one without ``ip_adapter_embeds`` by name), no
    image. With ``ip_adapter_embeds`` (FaceID): the unit's embeds, the image not read."""
    module = values.get("module") or "ip-adapter-auto"
    if values.get("ip_adapter_embeds") is not None:
        if module not in FACE_MODULES:
            raise ApiError(422, f"{field}.module: with ip_adapter_embeds (a face embedding) send module "
                                f"ip-adapter_face_id, got {module!r}", f"{field}.module")
        return IPAdapterUnit(embeds=values["ip_adapter_embeds"], model=model,
                             **{k: values[k] for k in IP_PASSED if k in values and values[k] is not None})
    if isinstance(module, str) and module.startswith("ip-adapter_face_id"):
        raise ApiError(422, f"{field}.module: {module!r} runs insightface on the server, which this server has not: "
                            "compute the face's embedding on the client (insightface's normed_embedding, 512 floats) "
                            "and send it as the unit's ip_adapter_embeds, for an IP-Adapter FaceID model "
                            "(ip-adapter-faceid_sdxl)", f"{field}.module")
    if not isinstance(module, str) or not module.startswith("ip-adapter"):
        raise ApiError(422, f"{field}.module: {model!r} is an IP-Adapter; send one of its modules "
                            f"({', '.join(IP_MODULES)}), got {module!r}", f"{field}.module")
    if module not in IP_MODULES:
        raise ApiError(422, f"{field}.module: {module!r} is not run here; use one of {', '.join(IP_MODULES)}",
                       f"{field}.module")
    image, _ = unit_image(values.get("image"), f"{field}.image")
    return IPAdapterUnit(image=image, model=model,
                         **{k: values[k] for k in IP_PASSED if k in values and values[k] is not None})


def module_union_type(module: str) -> int | None:
    """The union control type (its index) of the map a preprocessor makes, by the module's first word (``canny``,
    ``invert``, ``lineart_standard``: Hard Edge; ``scribble_xdog``: Soft Edge; ``tile_resample``, ``blur_gaussian``:
    Tile); None for ``none`` (the picture is the map: any type)."""
    return UNION_TAGS.get(str(module).split("_")[0]) if module else None


def given_union_type(values: dict, field: str) -> int | None:
    """The unit's ``union_control_type`` as an index: a name or tag of the extension's (any case), or an index
    (checked by the engine against the model's types); None when absent, empty or "Unknown" (the extension's
    default). Raises ApiError 422 naming ``union_control_type``: an unknown name, or a value that is not one name
    or index (a list, a bool)."""
    given = values.get("union_control_type")
    if given is None or isinstance(given, str) and given.strip().lower() in ("", "unknown"):
        return None
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    if not isinstance(given, str):
        raise ApiError(422, f"{field}.union_control_type: expected one control type (a name such as 'Depth'), got "
                            f"{type(given).__name__} {str(given)[:80]}; one of {', '.join(UNION_TYPES)}",
                       f"{field}.union_control_type")
    text = given.strip().lower()
    names = {name.lower(): k for k, name in enumerate(UNION_TYPES)}
    index = names.get(text, UNION_TAGS.get(text.replace(" ", "")))
    if index is None:
        raise ApiError(422, f"{field}.union_control_type: unknown control type {given[:80]!r}; one of "
                            f"{', '.join(UNION_TYPES)}", f"{field}.union_control_type")
    return index


def union_type(values: dict, module: str, field: str) -> int | str:
    """A ControlNet-Union unit's control type: ``union_control_type`` (:func:`given_union_type`), else
    ``control_type`` (the engine's: a diffusers name or index, checked by the engine), else the module's first word
    (``canny``, ``lineart_standard``, ``scribble_xdog``, ``tile_resample``, ``blur_gaussian``, ``invert``). Raises
    ApiError 422 naming ``union_control_type`` when none gives one, or a bad one."""
    given = given_union_type(values, field)
    if given is not None:
        return given
    if values.get("control_type") not in (None, ""):
        return values["control_type"]
    index = module_union_type(module)
    if index is None:
        raise ApiError(422, f"{field}.union_control_type: the unit's model is a ControlNet-Union and its module "
                            f"{module!r} names no control type; send union_control_type (one of "
                            f"{', '.join(UNION_TYPES)})", f"{field}.union_control_type")
    return index


def to_unit(raw: dict, field: str, loaded: dict[str, str], ip_loaded: dict[str, str] | None = None,
            unions: dict[str, int] | None = None) -> tuple[ControlUnit | IPAdapterUnit, list[str]]:
    """(the engine's unit, warnings) of one enabled A1111 unit ``raw`` (legacy names read); ``loaded``: the loaded
    ControlNets' {name: "name [hash]"}, ``ip_loaded`` the IP-Adapters' (a unit naming one is an IPAdapterUnit:
    :func:`ip_unit`); ``unions``: {name: control types} of the loaded ControlNet-Unions (their units get a control
    type: :func:`union_type`). Raises ApiError 422 naming ``field``'s entry: two names for one field, an unknown
    model or module, no image, a union unit without a control type."""
    values = dict(raw)
    for old, new in LEGACY.items():
        if old in values:
            if new in values:
                raise ApiError(422, f"{field}.{old}: conflicts with {new} (send one of them)", f"{field}.{old}")
            values[new] = values.pop(old)
    model = model_name_of(values.get("model"))
    if model in (ip_loaded or {}):
        return ip_unit(values, model, field), []
    if model not in loaded:
        names = ", ".join([*loaded.values(), *(ip_loaded or {}).values()]) or \
            "none (the server was started without --controlnet)"
        raise ApiError(422, f"{field}.model: no ControlNet named {values.get('model')!r} is loaded; loaded: {names}",
                       f"{field}.model")
    try:
        module = module_name(f"{field}.module", values.get("module", "none"))
    except InvalidRequest as err:
        raise ApiError(422, f"{err.field}: {err.message}", err.field) from None
    image, mask = unit_image(values.get("image"), f"{field}.image")
    warnings = []
    if mask or values.get("mask") or values.get("mask_image"):  # webuiapi sends the unit's "mask" beside "image"
        warnings.append(f"{field}.image: the mask is not used (it is for inpaint modules, which this server does "
                        "not run)")
    if values.get("hr_option") not in (None, "", "Both", 0):
        warnings.append(f"{field}.hr_option={values['hr_option']!r} runs as \"Both\" here: the unit steers both "
                        "passes of a hires fix")
    if model in (unions or {}):
        kind = union_type(values, module, field)
    else:  # the extension sends the field with every unit; a plain ControlNet reads none (a bad value is refused)
        kind = None
        if given_union_type(values, field) is not None:
            warnings.append(f"{field}.union_control_type={values['union_control_type']!r} is not used: {model!r} is "
                            "not a ControlNet-Union")
    unit = ControlUnit(image=image, model=model, module=module, control_type=kind,
                       **{k: values[k] for k in PASSED if k in values and values[k] is not None})
    return unit, warnings


def units_of(extra: dict, loaded: dict[str, str], ip_loaded: dict[str, str] | None = None,
             unions: dict[str, int] | None = None) -> tuple[tuple[ControlUnit | IPAdapterUnit, ...], list[str]]:
    """(the engine's units, warnings) of a txt2img / img2img body's extra fields: the enabled units of
    ``alwayson_scripts.controlnet.args`` in order (disabled ones skipped, as the extension does): ControlUnits, and
    IPAdapterUnits for those naming an IP-Adapter. ``loaded``, ``ip_loaded``: {name: "name [hash]"} of the
    ControlNets and IP-Adapters; ``unions``: {name: control types} of the ControlNet-Unions. Raises ApiError 422
    naming the field (:func:`to_unit`)."""
    found = script_units(extra)
    if found is None:
        return (), []
    field, raw_units = found
    units, warnings = [], []
    for i, raw in enumerate(raw_units):
        if not isinstance(raw, dict):
            raise ApiError(422, f"{field}[{i}]: expected a ControlNet unit (an object)", f"{field}[{i}]")
        if is_off(raw.get("enabled", True)):
            continue
        unit, more = to_unit(raw, f"{field}[{i}]", loaded, ip_loaded, unions)
        units.append(unit)
        warnings += more
    return tuple(units), warnings


def loaded_of(engine, field: str = "controlnets") -> dict[str, str]:
    """{name: "name [hash]"} of the engine's loaded ControlNets (engine.limits.controlnets; ``field``
    "ip_adapters": its IP-Adapters), in load order."""
    return {name: f"{name} [{digest}]" if digest else name
            for name, digest in getattr(engine.limits, field, ()) or ()}


def module_detail(name: str) -> dict:
    """The extension's ``module_detail`` entry of a module: ``model_free`` and its ``sliders``."""
    res = MODULES[name][0]
    sliders = [{"name": "Resolution", "value": res, "min": 64, "max": 2048, "step": 8}] if res else []
    sliders += [dict(zip(("name", "value", "min", "max", "step"), s, strict=True)) for s in SLIDERS.get(name, ())]
    return {"model_free": name == "none", "sliders": sliders}


def control_type_entry(modules: list[str], models: list[str]) -> dict:
    """One type of /controlnet/control_types (the extension's ``format_control_type``): its modules ("none" first)
    and models ("None" first), each default the second entry when there is one (global_state.select_control_type,
    Preprocessor.get_default_preprocessor)."""
    modules, models = ["none", *(m for m in modules if m != "none")], ["None", *models]
    return {"module_list": modules, "model_list": models, "default_option": modules[min(1, len(modules) - 1)],
            "default_model": models[min(1, len(models) - 1)]}


def control_types(loaded: dict[str, str], unions: dict[str, int], ip_loaded: dict[str, str]) -> dict:
    """sd-webui-controlnet's ``GET /controlnet/control_types`` body for this server: {"control_types": {tag:
    {module_list, model_list, default_option, default_model}}}, "All" first (every module and model), then each
    tag of :data:`CONTROL_TAGS` (its modules; the plain ControlNets whose name has the tag's word, as the extension
    files them, and the ControlNet-Unions of ``unions`` ({name: control types}) that have its type), and
    "IP-Adapter" while one is loaded. ``loaded``, ``ip_loaded``: {name: "name [hash]"} (:func:`loaded_of`)."""
    ip = IP_MODULES if ip_loaded else ()
    types = {"All": {"module_list": [*MODULES, *ip], "model_list": ["None", *loaded.values(), *ip_loaded.values()],
                     "default_option": "none", "default_model": "None"}}
    for tag, (modules, kind) in CONTROL_TAGS.items():
        words = (tag.lower(), *TAG_WORDS.get(tag.lower(), ()))
        models = [title for name, title in loaded.items() if kind < unions.get(name, 0) or
                  name not in unions and any(word in name.lower() for word in words)]
        types[tag] = control_type_entry(list(modules), models)
    if ip_loaded:
        types["IP-Adapter"] = control_type_entry(list(IP_MODULES), list(ip_loaded.values()))
    return {"control_types": types}


def _png_b64(image: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def router(engine) -> APIRouter:
    """The extension's routes (scripts/api.py): ``GET /controlnet/version``, ``model_list`` (the loaded ones as
    "name [hash]"), ``module_list`` (with ``module_detail``), ``control_types`` (:func:`control_types`),
    ``settings``, ``POST /controlnet/detect`` (the preprocessors, engine/control.detect, on the host: no device
    time)."""
    api = APIRouter(prefix="/controlnet")

    @api.get("/version")
    async def version():
        return {"version": API_VERSION}

    @api.get("/model_list")
    async def model_list(update: bool = True):
        return {"model_list": [*loaded_of(engine).values(), *loaded_of(engine, "ip_adapters").values()]}

    @api.get("/module_list")
    async def module_list(alias_names: bool = False):
        ip = IP_MODULES if loaded_of(engine, "ip_adapters") else ()
        return {"module_list": [*MODULES, *ip],
                "module_detail": {**{name: module_detail(name) for name in MODULES},
                                  **{name: {"model_free": False, "sliders": []} for name in ip}}}

    @api.get("/control_types")
    async def control_types_route():
        unions = dict(getattr(engine.limits, "controlnet_unions", ()) or ())
        return control_types(loaded_of(engine), unions, loaded_of(engine, "ip_adapters"))

    @api.get("/settings")
    async def settings():
        return {"control_net_unit_count": engine.limits.max_control_units}

    @api.post("/detect")
    def detect_route(body: dict):
        # webuiapi's controlnet_detect sends the extension's older name, controlnet_images
        images = body.get("controlnet_input_images") or body.get("controlnet_images") or []
        if not isinstance(images, list) or not images:
            return JSONResponse({"detail": "No image selected"}, status_code=422)
        module = body.get("controlnet_module", "none")
        args = {k: body.get(f"controlnet_{k}", -1) for k in ("processor_res", "threshold_a", "threshold_b")}
        try:
            maps = [detect(unit_image(image, f"controlnet_input_images[{i}]")[0], module, **args)
                    for i, image in enumerate(images)]
        except ApiError as err:
            return JSONResponse({"detail": err.message}, status_code=422)
        except InvalidRequest as err:
            field = f"controlnet_{err.field.rpartition('.')[2]}"  # control_units[0].module -> controlnet_module
            return JSONResponse({"detail": f"{field}: {err.message}"}, status_code=422)
        return {"images": [_png_b64(m) for m in maps], "info": "Success"}

    return api
