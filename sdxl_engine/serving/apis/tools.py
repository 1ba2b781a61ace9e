"""The two tools, ``generate`` and ``image_to_image``, declared once for the fronts that offer them: their inputs
(name, type, default, in order), their descriptions, and the image tool's preparation of its picture. The MCP
server (mcp_server.py) lists and runs them; the page's Gradio endpoints of the same names (handler.api_function,
mcp_image.image_tool: gradio_client's ``/generate`` and ``/image_to_image``) take the same inputs, which a unit test
holds them to. No Gradio and no HTTP here.

The image tool's picture and optional mask come as base64 text, decoded in memory (uploads.decode_image): no URL is
ever fetched and nothing the client sends becomes a file.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

import numpy as np
from PIL import Image

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.control import CONTROL_TYPES, UNION_TYPES, ControlUnit
from sdxl_engine.engine.control_preprocess import MODULES
from sdxl_engine.engine.ip_adapter import MAX_REFERENCE_IMAGES, IPAdapterUnit
from sdxl_engine.engine.validation import DEFAULT_STRENGTH, InvalidRequest, Limits, size_of
from sdxl_engine.program.schedulers import DEFAULT_SCHEDULE_TYPE, SAMPLERS, SCHEDULE_TYPES
from sdxl_engine.service.image_prep import PasteBack, binary_mask, flatten, overlay, same_aspect
from sdxl_engine.service.styles import NO_STYLE, STYLE_NAMES
from sdxl_engine.serving.apis.errors import ApiError
from sdxl_engine.serving.apis.uploads import MAX_INPUT_SIDE, decode_image

GENERATE = "generate"
IMAGE_TO_IMAGE = "image_to_image"
MASK_STRENGTH = 1.0  # with a mask the white part is made anew (diffusers' inpainting default), as OpenAI's edits
MAX_UPSCALE = 4.0  # A1111's "Upscale by" slider's top (hires fix); the engine also checks the size it makes
TOOL_FIELDS = {"hires_scale": "upscale", "hires_strength": "strength"}  # engine field -> the image tool's input
LANCZOS = Image.Resampling.LANCZOS

# The tools' descriptions: a summary, then ``Args:`` (one line per input, in the inputs' order), then ``Returns:``
# (:func:`describe` splits them). A backslash at a line's end continues that line (the text has no line break there).
# The control inputs' Args lines, the same in both tools' descriptions ({modules}: the preprocessors' names).
CONTROL_DOC = """    control_image: optional ControlNet: a control image (edges, depth, pose map...) as base64 PNG, \
JPEG or WebP (a data URL too); empty = no control. Needs a ControlNet loaded (the server's --controlnet)
    control_model: the ControlNet's name, as /controlnet/model_list lists it ("name" or "name [hash]")
    control_weight: the control's strength, 0 to 2
    control_start: the share of the steps where the control begins, 0 to 1
    control_end: the share of the steps where it ends, 0 to 1, not below control_start
    control_module: the preprocessor run on the control image first: {modules} (none = the image is the map)"""
# The control type's Args line (an input added later: the last of both tools).
CONTROL_TYPE_DOC = """    control_type: with a ControlNet-Union (xinsir's union / ProMax) as control_model, what the \
control image is: one of {types} (sd-webui-controlnet's names; Tile and Inpaint are ProMax's), or \
diffusers' {diffusers}; empty for a plain ControlNet (which takes none)"""
# The FaceID embedding's Args line (an input added later: the last of both tools).
IP_EMBEDS_DOC = """    ip_adapter_embeds: optional IP-Adapter FaceID: in place of ip_adapter_image (not with it), \
the face's embedding computed by the client (insightface's normed_embedding): a JSON list of 512 numbers, or a \
list of up to 4 such lists (several photos of one face), as an array or as JSON text; empty = none. \
ip_adapter_model must name a loaded FaceID adapter (an image adapter refuses it); the other ip_adapter_ inputs \
apply as to an image"""

# The IP-Adapter inputs' Args lines, the same in both tools' descriptions.
IP_DOC = """    ip_adapter_image: optional IP-Adapter: a reference image whose style or subject steers the images, as \
base64 PNG, JPEG or WebP (a data URL too); empty = none. Needs an IP-Adapter loaded (the server's --ip-adapter)
    ip_adapter_model: the IP-Adapter's name, as /controlnet/model_list lists it ("name" or "name [hash]")
    ip_adapter_weight: the adapter's strength (diffusers' scale), 0 to 2
    ip_adapter_start: the share of the steps where the adapter begins, 0 to 1
    ip_adapter_end: the share of the steps where it ends, 0 to 1, not below ip_adapter_start"""

GENERATE_DOC = """Generate images from a text prompt with SDXL: the engine's batch (4 images), seeds seed, seed+1, ...

Args:
    prompt: what the images should show, e.g. "a red circle on a blue background"
    negative_prompt: what to keep out of the images (optional)
    seed: seed of the first image, 0 to max_seed; -1 picks one at random (the answer says which)
    guidance_scale: classifier-free guidance, 0 to 50; 1 or less turns it off
    num_inference_steps: denoising steps, 1 to the server's maximum
    width: image width in pixels, one of the model's sizes; 0 = the model's default
    height: image height in pixels, one of the model's sizes; 0 = the model's default
    style: a style preset, one of {styles}
    sampler: one of {samplers}
    refiner_switch_at: with a refiner loaded (the server's --refiner), the share of the steps on the base model \
before the refiner takes over, 0 to below 1 (0 = the refiner alone); 1 = no refiner; default: the page's slider \
(0.8 with a refiner)
{control}
    model: {models}
    schedule_type: the spacing of the sampler's noise levels (A1111's "Schedule type"), one of {schedule_types}; \
automatic = the sampler's own; DDIM, LCM and TCD take automatic only. A1111's labels ({labels}) are taken too
{ip}
{control_type}
{ip_embeds}
Returns:
    the images (PNG, with their generation parameters) and a JSON record: seeds, size, steps, sampler, \
schedule_type, timings, model
"""

IMAGE_DOC = """Change a picture with SDXL: image to image (restyle the whole picture to the prompt) or, with a mask, \
inpainting (repaint only the mask's white part; every other pixel stays the original's). Makes the server's batch \
(4 images), seeds seed, seed+1, ...

Args:
    prompt: what the images should show, e.g. "a red circle on a blue background"
    image: the input picture as base64 PNG, JPEG or WebP (a data:image/...;base64, URL too), at most 2048 x 2048 \
pixels and 16 MiB; it is resized to width x height. URLs are not fetched: send the bytes
    mask: optional, base64 PNG of the picture's size (or its aspect ratio): white = repaint, black = keep (a mask \
with transparency: opaque = repaint). Empty: the whole picture changes
    strength: how much changes, above 0 to 1 (1 = made anew); -1 = 0.75 without a mask, 1.0 with one
    negative_prompt: what to keep out of the images (optional)
    seed: seed of the first image, 0 to max_seed; -1 picks one at random (the answer says which)
    guidance_scale: classifier-free guidance, 0 to 50; 1 or less turns it off
    num_inference_steps: denoising steps; with strength s about s x this many run
    width: output width in pixels, one of the model's sizes; 0 = the model's default
    height: output height in pixels, one of the model's sizes; 0 = the model's default
    sampler: an A1111 sampler name, as the generate tool takes
    refiner_switch_at: with a refiner loaded (the server's --refiner), the share of the steps on the base model \
before the refiner takes over, 0 to below 1 (0 = the refiner alone); 1 = no refiner
    upscale: 1 = off; above 1, at most 4 (e.g. 1.5 or 2) = hires fix: the picture (at width x height) upscaled by \
this factor (Lanczos) and denoised again at the larger size with strength (-1 = 0.7); no mask with it
{control}
    model: {models}
    schedule_type: the spacing of the sampler's noise levels, as the generate tool takes it: one of \
{schedule_types}; automatic = the sampler's own
{ip}
{control_type}
{ip_embeds}
Returns:
    the images (PNG, with their generation parameters) and a JSON record: seeds, size, strength, timings
"""

REQUIRED = object()  # an input's default when it has none (the client must send it)


@dataclasses.dataclass(frozen=True)
class Input:
    """One input of a tool: its ``name``, Python ``kind`` (str, int or float), ``default`` (:data:`REQUIRED`: none)
    and ``choices`` (the values it may take, or () for any)."""

    name: str
    kind: type
    default: object = REQUIRED
    choices: tuple = ()


# One ControlNet unit (engine/control.ControlUnit; no unit without a control image), last in both tools.
CONTROL_INPUTS = (Input("control_image", str, ""), Input("control_model", str, ""),
                  Input("control_weight", float, 1.0), Input("control_start", float, 0.0),
                  Input("control_end", float, 1.0), Input("control_module", str, "none"))
# Its control type (a ControlNet-Union's; engine/control.UNION_TYPES' names), added later: last in both tools.
CONTROL_TYPE = Input("control_type", str, "")
CONTROL_NAMES = (*(i.name for i in CONTROL_INPUTS), CONTROL_TYPE.name)
# The engine's fields of that unit (validation's InvalidRequest.field) -> the input a refusal names.
CONTROL_FIELDS = {"control_units": "control_image", "control_units[0].image": "control_image",
                  "control_units[0].model": "control_model", "control_units[0].weight": "control_weight",
                  "control_units[0].guidance_start": "control_start", "control_units[0].guidance_end": "control_end",
                  "control_units[0].module": "control_module", "control_units[0].control_type": "control_type"}
# One IP-Adapter unit (engine/ip_adapter.IPAdapterUnit; none without a reference image), last in both tools.
IP_INPUTS = (Input("ip_adapter_image", str, ""), Input("ip_adapter_model", str, ""),
             Input("ip_adapter_weight", float, 1.0), Input("ip_adapter_start", float, 0.0),
             Input("ip_adapter_end", float, 1.0))
IP_NAMES = tuple(i.name for i in IP_INPUTS)
# The engine's fields of that unit (validation's InvalidRequest.field) -> the input a refusal names.
IP_FIELDS = {"ip_adapter_units": "ip_adapter_image", "ip_adapter_units[0].image": "ip_adapter_image",
             "ip_adapter_units[0].model": "ip_adapter_model", "ip_adapter_units[0].weight": "ip_adapter_weight",
             "ip_adapter_units[0].guidance_start": "ip_adapter_start",
             "ip_adapter_units[0].guidance_end": "ip_adapter_end",
             "ip_adapter_units[0].embeds": "ip_adapter_embeds",
             **{f"ip_adapter_units[0].embeds[{i}]": f"ip_adapter_embeds[{i}]" for i in range(MAX_REFERENCE_IMAGES)}}
# A FaceID adapter's face embedding(s) in place of the reference image (IPAdapterUnit.embeds), added later: last in
# both tools. Its kind ``list``: a JSON array (MCP's schema takes JSON text too, see mcp_server.JSON_TYPES).
IP_EMBEDS = Input("ip_adapter_embeds", list, "")
IP_UNIT_NAMES = (*IP_NAMES, IP_EMBEDS.name)  # every input of the one IP-Adapter unit, as ip_fields takes them


def generate_inputs(config) -> tuple[Input, ...]:
    """``/generate``'s inputs, in order: the one list that the MCP ``generate`` tool's schema, the page event's
    Python signature (handler.api_function, :func:`signature_of`), the page's widget list (page.event_inputs) and
    the guard's optional inputs (:func:`optional_inputs`) are built from. Its first :data:`FIRST_RELEASE` are the
    first release's; an input added later goes at the end (old clients send fewer values: the guard fills in the
    rest). Each name is a GenerateRequest field or one :func:`request_values` maps; its defaults are the page's
    (``config``: handler.page_defaults' resolved EngineConfig)."""
    return (Input("prompt", str), Input("negative_prompt", str, ""), Input("seed", int, -1),
            Input("guidance_scale", float, config.guidance_scale),
            Input("num_inference_steps", int, config.num_inference_steps), Input("width", int, 0),
            Input("height", int, 0), Input("style", str, NO_STYLE, tuple(STYLE_NAMES)),
            Input("sampler", str, config.sampler, tuple(SAMPLERS)),
            Input("refiner_switch_at", float, 0.8 if config.refiner else 1.0), *CONTROL_INPUTS, Input("model", str, ""),
            Input("schedule_type", str, DEFAULT_SCHEDULE_TYPE, tuple(SCHEDULE_TYPES)), *IP_INPUTS, CONTROL_TYPE,
            IP_EMBEDS)


FIRST_RELEASE = 9  # /generate's first release took its first nine inputs: a raw call must send at least those
IMAGE_FIRST_RELEASE = 20  # /image_to_image's inputs before schedule_type: a raw call must send at least those


# The page's two image events (handler.image_function and upscale_function; private, the page's own) take
# /generate's inputs but these: Generate from image and Upscale take no ControlNet or IP-Adapter unit, and Upscale
# no refiner switch (its hires fix runs on the base model).
IMAGE_EVENT_LEFT_OUT = (*CONTROL_NAMES, *IP_UNIT_NAMES)
UPSCALE_EVENT_LEFT_OUT = (*CONTROL_NAMES, *IP_UNIT_NAMES, "refiner_switch_at")


def page_event_inputs(config, own: tuple[Input, ...], left_out: tuple[str, ...]) -> tuple[Input, ...]:
    """A page event's inputs, in order: /generate's first :data:`FIRST_RELEASE` (:func:`generate_inputs`), then
    the event's ``own``, then /generate's later inputs but those named in ``left_out``. So an input added to
    :func:`generate_inputs` (at its end) reaches the event's signature (:func:`signature_of`), its widget list
    (page.event_inputs) and its request (:func:`request_values`) with no line here."""
    inputs = generate_inputs(config)
    later = tuple(item for item in inputs[FIRST_RELEASE:] if item.name not in left_out)
    return (*inputs[:FIRST_RELEASE], *own, *later)


def image_event_inputs(config) -> tuple[Input, ...]:
    """Generate from image's inputs (:func:`page_event_inputs`): its own are the image editor's value, the mode
    (image_input.MODES), the strength and the outpaint sides and pixels; then /generate's later inputs but
    :data:`IMAGE_EVENT_LEFT_OUT`."""
    from sdxl_engine.serving import image_input  # here: image_input imports this package (apis.uploads)

    own = (Input("image", dict, None), Input("mode", str, image_input.IMG2IMG),
           Input("strength", float, image_input.DEFAULT_STRENGTH[image_input.IMG2IMG]), Input("sides", list, None),
           Input("pixels", int, 0))
    return page_event_inputs(config, own, IMAGE_EVENT_LEFT_OUT)


def upscale_event_inputs(config) -> tuple[Input, ...]:
    """The gallery's Upscale's inputs (:func:`page_event_inputs`): its own are the last finished request (server
    state), the gallery index selected and the hires fix's scale, upscaler and strength; then /generate's later
    inputs but :data:`UPSCALE_EVENT_LEFT_OUT`."""
    own = (Input("last", dict, None), Input("index", int, None), Input("hires_scale", float, 1.5),
           Input("hires_upscaler", str, "Lanczos"), Input("hires_strength", float, 0.5))
    return page_event_inputs(config, own, UPSCALE_EVENT_LEFT_OUT)


def optional_inputs() -> dict[str, tuple[str, ...]]:
    """{endpoint: the names of its inputs added after its first release, in order} (:data:`FIRST_RELEASE`,
    :data:`IMAGE_FIRST_RELEASE`): a raw call may leave them out and gets their defaults (guard.completed)."""
    config = EngineConfig()
    return {GENERATE: tuple(item.name for item in generate_inputs(config)[FIRST_RELEASE:]),
            IMAGE_TO_IMAGE: tuple(item.name for item in image_inputs(config)[IMAGE_FIRST_RELEASE:])}


def signature_of(inputs: tuple[Input, ...], *trailing: inspect.Parameter) -> inspect.Signature:
    """The Python signature of an endpoint function taking ``inputs`` (positional or by keyword, in order, with
    their defaults; :data:`REQUIRED`: none; an empty text as None), then ``trailing`` (Gradio's ``request`` and
    ``progress``): what Gradio reads to name the API's inputs and to pass its own objects. The None: Gradio's API
    description makes an input whose widget has no value (the page's negative prompt) optional only when its
    function's default is None."""
    def default(value):
        return inspect.Parameter.empty if value is REQUIRED else None if value == "" else value

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([*(inspect.Parameter(item.name, kind, annotation=item.kind, default=default(item.default))
                                for item in inputs), *trailing])


def request_values(values: dict) -> dict:
    """``to_request``'s keywords (service.request.to_request) for one ``/generate`` call's ``values`` (by
    :func:`generate_inputs`' names): the refiner switch as :func:`refiner_switch` reads it (left out for "no
    refiner"), the model as :func:`model_field`, the control inputs as one ControlUnit (:func:`control_fields`;
    none when the call has none: the page's image events), the IP-Adapter inputs as one IPAdapterUnit
    (:func:`ip_fields`), with the ``field_names`` that make the engine's refusals of either unit name those inputs,
    and every other input under its own name (a GenerateRequest field: a new one needs no line here).

    Raises ApiError 400 naming the control or IP-Adapter input it cannot use."""
    values = dict(values)
    control = control_fields(**{name: values.pop(name) for name in CONTROL_NAMES if name in values})
    ip = ip_fields(**{name: values.pop(name) for name in IP_UNIT_NAMES if name in values})
    names = {**control.pop("field_names", {}), **ip.pop("field_names", {})}
    switch = refiner_switch(values.pop("refiner_switch_at", None))
    model = model_field(values.pop("model", None))
    return {**values, **control, **ip, **model, **({} if switch is None else {"refiner_switch_at": switch}),
            **({"field_names": names} if names else {})}


def image_inputs(config) -> tuple[Input, ...]:
    """The ``image_to_image`` tool's inputs, in order, its defaults the page's (``config``); an input added later
    goes at the end (:data:`IMAGE_FIRST_RELEASE`)."""
    return (Input("prompt", str), Input("image", str), Input("mask", str, ""), Input("strength", float, -1.0),
            Input("negative_prompt", str, ""), Input("seed", int, -1),
            Input("guidance_scale", float, config.guidance_scale),
            Input("num_inference_steps", int, config.num_inference_steps), Input("width", int, 0),
            Input("height", int, 0), Input("sampler", str, config.sampler), Input("refiner_switch_at", float, 1.0),
            Input("upscale", float, 1.0), *CONTROL_INPUTS, Input("model", str, ""),
            Input("schedule_type", str, DEFAULT_SCHEDULE_TYPE, tuple(SCHEDULE_TYPES)), *IP_INPUTS, CONTROL_TYPE,
            IP_EMBEDS)


def generate_doc(models: list[str] = ()) -> str:
    """:data:`GENERATE_DOC` with the style, sampler, preprocessor, control type and model names filled in
    (``models``: the server's, the default first: service/models.names; () before they are known)."""
    return GENERATE_DOC.format(styles=", ".join(STYLE_NAMES), samplers=", ".join(SAMPLERS),
                               control=CONTROL_DOC.format(modules=", ".join(MODULES)), models=model_doc(models),
                               schedule_types=", ".join(SCHEDULE_TYPES), labels=", ".join(SCHEDULE_TYPES.values()),
                               ip=IP_DOC, control_type=control_type_doc(), ip_embeds=IP_EMBEDS_DOC)


def image_doc(models: list[str] = ()) -> str:
    """:data:`IMAGE_DOC` with the preprocessor, control type, model and schedule type names filled in (as
    :func:`generate_doc`)."""
    return IMAGE_DOC.format(control=CONTROL_DOC.format(modules=", ".join(MODULES)), models=model_doc(models),
                            schedule_types=", ".join(SCHEDULE_TYPES), ip=IP_DOC, control_type=control_type_doc(),
                            ip_embeds=IP_EMBEDS_DOC)


def control_type_doc() -> str:
    """:data:`CONTROL_TYPE_DOC` with the union's type names (engine/control.UNION_TYPES, CONTROL_TYPES)."""
    return CONTROL_TYPE_DOC.format(types=", ".join(UNION_TYPES), diffusers=", ".join(CONTROL_TYPES))


def control_fields(control_image: str = "", control_model: str = "", control_weight: float = 1.0,
                   control_start: float = 0.0, control_end: float = 1.0, control_module: str = "none",
                   control_type: str = "") -> dict:
    """The engine's ``control_units`` field for a tool's control inputs (:data:`CONTROL_NAMES`) and the
    ``field_names`` (:data:`CONTROL_FIELDS`) under which the engine's refusals of it name those inputs: {} without a
    control image, else one ControlUnit of the image (base64, decoded as RGB; the page's widget gives an (H, W, 3)
    uint8 array), the model, weight, start, end, module and control type ("" or None: none, a plain ControlNet's;
    the engine checks their values: an unknown model or module is refused naming it, a union's unit without a
    type or a plain one with one names ``control_type``).

    Raises ApiError 400 naming the input: an image that does not decode, an image without a model."""
    if control_image is None or isinstance(control_image, str) and not control_image:
        return {}
    if not isinstance(control_model, str) or not control_model.strip():
        raise ApiError(400, "control_model: name the ControlNet for the control image (the server's "
                            "/controlnet/model_list)", "control_model")
    image = np.asarray(control_image if not isinstance(control_image, str) else
                       decode_image(control_image, "control_image", mode="RGB"), dtype=np.uint8)
    unit = ControlUnit(image=image, model=control_model, weight=control_weight, guidance_start=control_start,
                       guidance_end=control_end, module=control_module or "none",
                       control_type=control_type if control_type not in (None, "") else None)
    return {"control_units": (unit,), "field_names": dict(CONTROL_FIELDS)}


def ip_fields(ip_adapter_image: str = "", ip_adapter_model: str = "", ip_adapter_weight: float = 1.0,
              ip_adapter_start: float = 0.0, ip_adapter_end: float = 1.0, ip_adapter_embeds: list | str = "") -> dict:
    """The engine's ``ip_adapter_units`` field for /generate's IP-Adapter inputs (:data:`IP_INPUTS` and
    :data:`IP_EMBEDS`) and the ``field_names`` (:data:`IP_FIELDS`) under which the engine's refusals of it name those
    inputs: {} without a reference image or face embedding, else one IPAdapterUnit of the image (base64, decoded as
    RGB; the page's sends its upload's PNG as base64 too) or, for an IP-Adapter FaceID, of the embedding
    (``ip_adapter_embeds``: a list of numbers or of lists, as the jobs API's ``embeds`` and A1111's
    ``ip_adapter_embeds``, or that list as JSON text: passed on as it is, :func:`embeds_value`), the model, weight,
    start and end. The engine checks their values: an unknown adapter is refused naming ``ip_adapter_model`` and
    listing the loaded ones, embeddings that are not a FaceID adapter's width or sent to an image adapter name
    ``ip_adapter_embeds`` (``ip_adapter_embeds[1]`` for one of several), an image sent to a FaceID adapter names
    ``ip_adapter_image``.

    Raises ApiError 400 naming the input: an image that does not decode, embeddings that are not JSON, both an image
    and embeddings, either without a model."""
    embeds = embeds_value(ip_adapter_embeds)
    image_sent = not (ip_adapter_image is None or isinstance(ip_adapter_image, str) and not ip_adapter_image)
    if embeds is not None and image_sent:
        raise ApiError(400, "ip_adapter_embeds: send either ip_adapter_image (a reference image) or "
                            "ip_adapter_embeds (an IP-Adapter FaceID's face embedding), not both", "ip_adapter_embeds")
    if embeds is None and not image_sent:
        return {}
    if not isinstance(ip_adapter_model, str) or not ip_adapter_model.strip():
        what = "face embedding" if embeds is not None else "reference image"
        raise ApiError(400, f"ip_adapter_model: name the IP-Adapter for the {what} (the server's "
                            "/controlnet/model_list)", "ip_adapter_model")
    settings = dict(model=ip_adapter_model, weight=ip_adapter_weight, guidance_start=ip_adapter_start,
                    guidance_end=ip_adapter_end)
    if embeds is not None:  # FaceID: the engine checks the numbers (ip_adapter.as_embeds), as the jobs API's
        return {"ip_adapter_units": (IPAdapterUnit(embeds=embeds, **settings),),
                "field_names": {**IP_FIELDS, "ip_adapter_units": "ip_adapter_embeds"}}
    image = np.asarray(ip_adapter_image if not isinstance(ip_adapter_image, str) else
                       decode_image(ip_adapter_image, "ip_adapter_image", mode="RGB"), dtype=np.uint8)
    return {"ip_adapter_units": (IPAdapterUnit(image=image, **settings),), "field_names": dict(IP_FIELDS)}


def embeds_value(value):
    """``ip_adapter_embeds`` as the unit's ``embeds``: None (no embedding) for None or a blank text; JSON text
    decoded (an MCP or gradio_client caller may send the list as text); any other value as sent, for the engine to
    check (engine/ip_adapter.as_embeds: a list of numbers or of lists, a FaceID adapter's width).

    Raises ApiError 400 naming ``ip_adapter_embeds``: text that is not JSON."""
    if value is None or isinstance(value, str) and not value.strip():
        return None
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            raise ApiError(400, "ip_adapter_embeds: not JSON: send the face's embedding as a list of numbers "
                                "(insightface's normed_embedding, 512) or a list of such lists", "ip_adapter_embeds"
                           ) from None
    return value


def model_doc(models: list[str]) -> str:
    """The ``model`` input's description for the server's ``models`` (the default first)."""
    named = f": {', '.join(models)}" if models else ""
    default = f" ({models[0]})" if models else ""
    return (f"which of the server's models makes the images, by name{named}; empty = the default{default}. An "
            "unknown name is refused naming the models offered")


def model_field(value) -> dict:
    """The engine's ``model`` field for a tool's (or the page's) model input: {} for None or "" (the default);
    else the name as sent, for the engine to check (an unknown one is refused naming the models offered)."""
    return {} if value is None or value == "" else {"model": value}


def describe(doc: str) -> tuple[str, dict[str, str]]:
    """(the tool's description: the summary, then ``Returns: ...``; each input's description by name) of a tool's
    ``doc`` (:data:`GENERATE_DOC`'s layout)."""
    summary, _, rest = doc.partition("\nArgs:\n")
    args, _, returns = rest.partition("\nReturns:\n")
    inputs = {}
    for line in args.splitlines():
        name, colon, text = line.strip().partition(": ")
        if colon:
            inputs[name] = text.strip()
    summary, returns = " ".join(summary.split()), " ".join(returns.split())
    return f"{summary}{'' if summary.endswith('.') else '.'} Returns: {returns}", inputs


def refiner_switch(value):
    """The engine's ``refiner_switch_at`` for a refiner switch sent (the page's slider, a tool's input): None (no
    refiner) for None or 1, the slider's "no refiner" (also what a page without a refiner sends: the slider is
    hidden there at 1); any other value as sent (a whole float as an int), for the engine to check
    (validation.as_switch: a number in [0, 1), and only with a refiner loaded)."""
    if value is None or (type(value) in (int, float) and value == 1):
        return None
    return int(value) if isinstance(value, float) and value.is_integer() else value


def tool_inputs(image: str, mask: str, strength: float, width: int, height: int,
                default_size: tuple[int, int], refiner_switch_at=None,
                upscale=None, limits: Limits | None = None) -> tuple[dict, PasteBack | None, int, int]:
    """(the engine's fields, the overlay or None, width, height) of one image tool call: the image decoded (a
    transparent one flattened on white) and resized with Lanczos to ``width`` x ``height`` (0: ``default_size``'s
    side); the mask made binary (image_prep.binary_mask), resized with the image, cut at 128 (255 = repaint), and
    the overlay of the original outside it; ``strength`` -1 (or None) takes 0.75 without a mask, 1.0 with one.
    ``refiner_switch_at`` (:func:`refiner_switch`: None or 1 = no refiner) goes on as sent. ``upscale`` other
    than None or 1 is the hires fix of the picture: ``hires_scale`` with ``hires_strength`` = ``strength`` (-1:
    the engine's default, validation.DEFAULT_HIRES_STRENGTH) and the engine's pixel upscaler for an input image
    (validation.DEFAULT_IMAGE_UPSCALER); the engine checks the scale and the size it makes.

    ``limits``: the model's (its engine's Limits), when known: a width x height it cannot make is refused naming
    width, height or width/height (the picture is resized to them here, so the engine's refusal would name the
    image), before the picture is decoded.

    Raises ApiError 400 naming the field: a side that is not a whole number of 8 to 2048 pixels (or, with ``limits``,
    a size the model does not make), an undecodable
    or oversized image or mask (uploads.decode_image), a mask of another aspect ratio, or with nothing to repaint;
    ``upscale`` with a mask, or outside 1 to :data:`MAX_UPSCALE`.
    """
    size = []
    for name, value, default in (("width", width, default_size[0]), ("height", height, default_size[1])):
        side = value or default
        if isinstance(side, float) and side.is_integer():
            side = int(side)
        if isinstance(side, bool) or not isinstance(side, int) or not 8 <= side <= MAX_INPUT_SIDE:
            raise ApiError(400, f"{name}: must be a whole number of pixels, 8 to {MAX_INPUT_SIDE}, or 0 for the "
                                f"model's default; got {value!r}", name)
        size.append(side)
    w, h = size
    if limits is not None:
        try:
            size_of(w, h, limits)
        except InvalidRequest as err:
            raise ApiError(400, str(err), err.field) from None
    picture = flatten(decode_image(image, "image", mode=None))
    original = picture.size
    if picture.size != (w, h):
        picture = picture.resize((w, h), LANCZOS)
    pixels = np.asarray(picture, dtype=np.uint8)
    fields: dict = {"image": pixels}
    finish = None
    if mask:
        grey = binary_mask(decode_image(mask, "mask", mode=None))
        if grey.size != original and not same_aspect(grey.size, original):
            raise ApiError(400, f"mask: is {grey.width}x{grey.height} pixels but the image is {original[0]}x"
                                f"{original[1]}: send a mask of the image's size (or its aspect ratio)", "mask")
        if grey.size != (w, h):
            grey = grey.resize((w, h), LANCZOS)
        repaint = np.where(np.asarray(grey) >= 128, 255, 0).astype(np.uint8)
        if not repaint.any():
            raise ApiError(400, "mask: has no white (repaint) pixel, so nothing would change: paint white where the "
                                "picture is to be repainted", "mask")
        fields["mask"] = repaint
        finish = overlay(pixels, (repaint == 255).astype(np.float32))
    switch = refiner_switch(refiner_switch_at)
    if switch is not None:
        fields["refiner_switch_at"] = switch
    if upscale is not None and upscale != 1:
        if isinstance(upscale, bool) or not isinstance(upscale, (int, float)) or not 1 < upscale <= MAX_UPSCALE:
            raise ApiError(400, f"upscale: 1 (off), or above 1 and at most {MAX_UPSCALE:g} (the hires fix's factor); "
                                f"got {upscale!r}", "upscale")
        if mask:
            raise ApiError(400, "upscale: upscales the whole picture: send no mask with it (or upscale 1)", "upscale")
        fields["hires_scale"] = upscale
        if strength is not None and strength != -1:
            fields["hires_strength"] = strength
        return fields, None, w, h
    if strength is None or strength == -1:
        strength = MASK_STRENGTH if mask else DEFAULT_STRENGTH
    fields["strength"] = strength
    return fields, finish, w, h


def field_names(fields: dict) -> dict:
    """The image tool's names (:data:`TOOL_FIELDS`) of the engine ``fields`` a call sets, for request.to_request's
    ``field_names``: a refusal of ``hires_scale`` names ``upscale``."""
    return {field: name for field, name in TOOL_FIELDS.items() if field in fields}
