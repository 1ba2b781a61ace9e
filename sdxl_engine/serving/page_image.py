"""The page's "Image to image" section: its widgets (:func:`image_section`, with the hires fix settings of the
gallery's Upscale) and the events that stay inside it (:func:`wire_image_section`: the mode's strength and
outpaint row, the gallery's Send to image / Inpaint / Upscale buttons), and the Generate-from-image and Upscale
events (:func:`image_events`), which app.py wires beside /generate's to the page's other events."""

from __future__ import annotations

import base64
import dataclasses
import io
import os
from collections.abc import Callable
from pathlib import Path

import gradio as gr
import numpy as np

from sdxl_engine.checkpoint.controlnet import union_types
from sdxl_engine.checkpoint.loading import model_controlnets
from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.contract import EngineContract
from sdxl_engine.engine.control import UNION_TYPES, detect, model_name_of
from sdxl_engine.engine.control_preprocess import MODULES
from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.engine.image_upscale import IMAGE_UPSCALERS
from sdxl_engine.engine.validation import DEFAULT_IMAGE_UPSCALER
from sdxl_engine.service import delivery
from sdxl_engine.serving import gradio_internals, guard, image_input
from sdxl_engine.serving.apis.controlnet import module_union_type
from sdxl_engine.serving.apis.errors import ApiError
from sdxl_engine.serving.apis.tools import IP_UNIT_NAMES, image_event_inputs, upscale_event_inputs
from sdxl_engine.serving.apis.uploads import decode_image
from sdxl_engine.serving.page import (
    REFINER_MIN,
    REFINER_OFF,
    event_inputs,
    outpaint_default,
    page_event,
    size_choices,
)
from sdxl_engine.serving.page_assets import PICTURE_CHECK_HTML, PICTURE_CHECK_JS

BRUSH_SHARE = 16  # the brush's radius: the model's native size (its default size's shorter side) over this


@dataclasses.dataclass(frozen=True)
class ImageSection:
    """The section's components: ``named``, the image events' own inputs among them by their names."""

    box: gr.Accordion
    init_image: gr.ImageMask
    image_mode: gr.Radio
    strength: gr.Slider
    outpaint_row: gr.Row
    outpaint_sides: gr.CheckboxGroup
    outpaint_pixels: gr.Slider
    run: gr.Button
    hires_scale: gr.Slider
    hires_upscaler: gr.Dropdown
    hires_strength: gr.Slider

    @property
    def named(self) -> dict:
        """The image events' own inputs in this section by their names (apis/tools.image_event_inputs and
        upscale_event_inputs): {name: component}."""
        return {"image": self.init_image, "mode": self.image_mode, "strength": self.strength,
                "sides": self.outpaint_sides, "pixels": self.outpaint_pixels, "hires_scale": self.hires_scale,
                "hires_upscaler": self.hires_upscaler, "hires_strength": self.hires_strength}


def refiner_slider(config: EngineConfig) -> gr.Slider:
    """The refiner switch (``refiner_switch_at``: the share of the steps on the base model; 1 = no refiner), an
    input of /generate and of the image event; shown, at 0.8 (diffusers' and A1111's usual switch), only when a
    refiner is loaded (``config.refiner``), else hidden at 1 (off)."""
    return gr.Slider(REFINER_MIN, REFINER_OFF, value=0.8 if config.refiner else REFINER_OFF, step=0.05,
                     visible=bool(config.refiner), label="Refiner switch (share of the steps on the base model; "
                     "1 = no refiner)", elem_id="refiner-switch")


def brush_radius(engine: EngineContract | None) -> int | None:
    """The image editor's brush and eraser radius, in the picture's pixels: the model's native size (the default
    size's shorter side) over :data:`BRUSH_SHARE` (4 px for tiny-shapes' 64, 64 px for SDXL's 1024), so a dab covers
    a like share of a picture at the model's size. Gradio's "auto" is a fixed 25 px, whose circle covered about
    80 % of a 64 x 64 picture. None until the engine is ready (the page's refresh sets it then)."""
    width, height = (int(side) for side in size_choices(engine)[1].split("x"))
    return max(1, round(min(width, height) / BRUSH_SHARE)) if width and height else None


def editor_tools(engine: EngineContract | None) -> dict:
    """The ``brush`` and ``eraser`` of the image editor (gr.ImageMask's black, fixed-colour brush) at
    :func:`brush_radius`; Gradio's own size ("auto") until the engine is ready."""
    radius = brush_radius(engine) or "auto"
    return dict(brush=gr.Brush(default_size=radius, colors=["#000000"], color_mode="fixed"),
                eraser=gr.Eraser(default_size=radius))


def image_section(config: EngineConfig, engine: EngineContract | None) -> ImageSection:
    """Image to image, inpainting, outpainting, in a closed accordion (text to image looks as it did), placed where
    it is called inside the page's Blocks. Its own button and event (handler.image_function); the prompt and settings
    above it apply too, the refiner switch (:func:`refiner_slider`, under the advanced settings) among them."""
    with gr.Accordion("Image to image", open=False, elem_id="img2img-box") as box:
        gr.Markdown("Upload a picture (PNG, JPEG or WebP, at most 2048 px a side); for **Inpaint**, paint "
                    "over what to repaint. The picture is resized to the **Resolution** above (Lanczos, "
                    "stretched to its shape); it is deleted from the server after its request.",
                    elem_id="img2img-note")
        init_image = gr.ImageMask(label="Picture", type="filepath", sources=["upload", "clipboard"], image_mode="RGB",
                                  layers=False, transforms=(), height=320, elem_id="init-image",
                                  **editor_tools(engine))
        gr.HTML("", html_template=PICTURE_CHECK_HTML, js_on_load=PICTURE_CHECK_JS, elem_id="init-image-check")
        image_mode = gr.Radio(list(image_input.MODES), value=image_input.IMG2IMG, label="Mode", elem_id="img2img-mode")
        strength = gr.Slider(0.01, 1.0, value=image_input.DEFAULT_STRENGTH[image_input.IMG2IMG], step=0.01,
                             label="Strength (how much changes: 1 = from noise)", elem_id="strength")
        with gr.Row(visible=False, elem_id="outpaint-row") as outpaint_row:
            outpaint_sides = gr.CheckboxGroup(list(image_input.SIDES), value=["Right"], label="Sides to extend",
                                              elem_id="outpaint-sides")
            outpaint_pixels = gr.Slider(8, 1024, value=outpaint_default(engine), step=8, precision=0,
                                        label="Pixels per side (the canvas stays the Resolution)",
                                        elem_id="outpaint-pixels")
        run = gr.Button("Generate from image", variant="primary", elem_id="generate-image")
        gr.Markdown("**Upscale (hires fix)** under the gallery: the selected image, upscaled and denoised again at "
                    "the larger size with its seed and the prompt above.", elem_id="upscale-note")
        with gr.Row(elem_id="upscale-row"):
            hires_scale = gr.Slider(1.25, 2.0, value=1.5, step=0.25, label="Upscale by", elem_id="hires-scale")
            hires_upscaler = gr.Dropdown(list(IMAGE_UPSCALERS), value=DEFAULT_IMAGE_UPSCALER, label="Upscaler",
                                         elem_id="hires-upscaler")
            hires_strength = gr.Slider(0.05, 1.0, value=0.5, step=0.05, label="Upscale strength",
                                       elem_id="hires-strength")
    return ImageSection(box, init_image, image_mode, strength, outpaint_row, outpaint_sides, outpaint_pixels,
                        run, hires_scale, hires_upscaler, hires_strength)


def wire_image_section(section: ImageSection, gallery: gr.Gallery, last_result: gr.State,
                       selected_index: gr.State, send_image: gr.Button, send_inpaint: gr.Button,
                       send_upscale: gr.Button) -> None:
    """The section's own events: a gallery selection enables Send to image / Inpaint / Upscale; the first two put
    the selected image of the last finished request (server state: no file comes from the browser) into the
    editor; the mode sets its strength and shows the outpaint row."""

    @page_event
    def select_for_image(last: dict | None, evt: gr.SelectData):
        index = evt.index if last and type(evt.index) is int and 0 <= evt.index < len(last["gallery"]) else None
        return index, *(gr.Button(interactive=index is not None) for _ in range(3))

    gallery.select(select_for_image, last_result, [selected_index, send_image, send_inpaint, send_upscale],
                   api_visibility="private", queue=False)

    def send_to_editor(mode: str):
        @page_event
        def send(last: dict | None, index: int | None):
            if not last or type(index) is not int or not 0 <= index < len(last["gallery"]):
                raise IndexError(f"no gallery image {index!r}")
            path = last["gallery"][index][0]
            return ({"background": path, "layers": [], "composite": path}, mode,
                    image_input.DEFAULT_STRENGTH[mode], gr.Accordion(open=True))
        return send

    for button, mode in ((send_image, image_input.IMG2IMG), (send_inpaint, image_input.INPAINT)):
        button.click(send_to_editor(mode), [last_result, selected_index],
                     [section.init_image, section.image_mode, section.strength, section.box],
                     api_visibility="private", queue=False)
    section.image_mode.change(page_event(lambda mode: (image_input.DEFAULT_STRENGTH[mode],
                                                       gr.Row(visible=mode == image_input.OUTPAINT))),
                              section.image_mode, [section.strength, section.outpaint_row], api_visibility="private",
                              queue=False, show_progress="hidden", preprocess=False)  # a mode the page never sends


def wire_selection(events: tuple, gallery: gr.Gallery, info: gr.JSON, seed: gr.Number, selected_seed: gr.State,
                   reuse: gr.Button, selected_index: gr.State, send_buttons: list) -> None:
    """The gallery's selection besides the image section's (:func:`wire_image_section`): a selected image's seed
    (from ``info``, the request's details) kept in ``selected_seed`` (server state) and named on ``reuse``, whose
    click puts it into ``seed`` (-1 without one); each of ``events``' new result deselects (``reuse``, the
    ``selected_index`` and the gallery's ``send_buttons``: Send to image, Inpaint, Upscale, off)."""
    for done in events:
        done.success(lambda: (None, gr.Button("Reuse selected image's seed", interactive=False), None,
                              *(gr.Button(interactive=False) for _ in send_buttons)), None,
                     [selected_seed, reuse, selected_index, *send_buttons], api_visibility="private", queue=False)

    @page_event
    def select_image(info: dict, evt: gr.SelectData):
        seed = info["seeds"][evt.index] if info and evt.index is not None else None
        return seed, gr.Button(f"Reuse seed {seed}" if seed is not None else "Reuse selected image's seed",
                               interactive=seed is not None)

    gallery.select(select_image, info, [selected_seed, reuse], api_visibility="private", queue=False)
    reuse.click(page_event(lambda s: -1 if s is None else int(s)), selected_seed, seed, api_visibility="private",
                queue=False)


def image_events(config: EngineConfig, section: ImageSection, widgets: dict, generate_from_image, upscale_image,
                 send_upscale: gr.Button, last_result: gr.State, selected_index: gr.State, gallery: gr.Gallery,
                 info: gr.JSON) -> tuple:
    """The page's two image events, private (the API stays /generate), submitting to the service as /generate
    (Gradio's queue runs them as they come: the service orders them and caps each client): Generate from image
    (handler.image_function) and the gallery's Upscale (handler.upscale_function). Their inputs are the widgets of
    apis/tools.image_event_inputs and upscale_event_inputs, each taken by its name (page.event_inputs) from
    ``widgets`` (/generate's: {name: component}), the section's own (:attr:`ImageSection.named`: the editor's value
    as sent, since guard.Routes let only uploads and the app's PNGs through) and the Upscale's ``last_result`` and
    ``selected_index``. Returns (image event, upscale event)."""
    named = {**widgets, **section.named, "last": last_result, "index": selected_index}
    image_event = section.run.click(
        generate_from_image, event_inputs(image_event_inputs(config), named), [gallery, info],
        api_name=guard.IMAGE_EVENT, api_visibility="private", concurrency_limit=None, preprocess=False)
    upscale_event = send_upscale.click(
        upscale_image, event_inputs(upscale_event_inputs(config), named), [gallery, info],
        api_name="upscale", api_visibility="private", concurrency_limit=None, preprocess=False)
    return image_event, upscale_event


@dataclasses.dataclass
class ControlSection:
    """The page's ControlNet section (shown when a ControlNet is loaded): ``upload`` (the file; a private event
    turns it into ``image``, base64 PNG text: /generate's ``control_image``, so gradio_client and the page send the
    same, and shows it in ``picture`` and in ``upload`` itself as the app's PNG), the preprocessor ``module`` with
    ``preview`` (the detected map into ``detected``), the ControlNet ``model``, ``weight``, ``start`` and ``end``,
    the ``control_type`` (shown while ``model`` is a ControlNet-Union: :func:`control_type_choice`; ``unions``, the
    server's {name: control types}); ``example`` (a model's shipped ControlNet's example.json: tiny-shapes' canny
    ControlNet's star outline)."""

    box: gr.Accordion
    upload: gr.File
    picture: gr.Image
    image: gr.Textbox
    module: gr.Dropdown
    preview: gr.Button
    detected: gr.Image
    model: gr.Dropdown
    weight: gr.Slider
    start: gr.Slider
    end: gr.Slider
    control_type: gr.Dropdown  # a ControlNet-Union's control type (UNION_TYPES' names); hidden at None otherwise
    example: gr.Button  # fills the section (and the prompt) with a shipped ControlNet's example; hidden without one
    example_values: tuple | None = None  # (base64 PNG, picture, module, ControlNet name, prompt) of that example
    unions: dict = dataclasses.field(default_factory=dict)  # {ControlNet name: its control types}, the unions'

    @property
    def named(self) -> dict:
        """/generate's control inputs by their names (apis/tools.CONTROL_NAMES): {name: component}."""
        return {"control_image": self.image, "control_model": self.model, "control_weight": self.weight,
                "control_start": self.start, "control_end": self.end, "control_module": self.module,
                "control_type": self.control_type}

    @property
    def inputs(self) -> list:
        """/generate's control inputs, in apis/tools.CONTROL_NAMES' order."""
        return list(self.named.values())


def controlnet_names(config: EngineConfig) -> list[str]:
    """The ControlNets ``--controlnet`` names (a folder's name, a file's without ``.safetensors``), as the engine
    names them (checkpoint/controlnet.py), then the model's own (``model_controlnets``); ``--controlnet-dir``'s are
    listed once the engine is ready."""
    paths = [p for p in (config.controlnet or "").split(os.pathsep) if p]
    names = [Path(p).name[:-len(".safetensors")] if p.endswith(".safetensors") else Path(p.rstrip("/")).name
             for p in paths]
    shipped = model_controlnets(config.model) if config.model_controlnets else {}
    return names + [name for name in shipped if name not in names]


def control_unions(config: EngineConfig, engine: EngineContract | None = None) -> dict[str, int]:
    """{name: control types} of the server's ControlNet-Unions: those of the ControlNets ``--controlnet``,
    ``--controlnet-dir`` and the model's own name, read from their config files (checkpoint/controlnet.union_types:
    the page knows them before the engine has loaded them), then the engine's once ready (Limits.controlnet_unions)."""
    paths = [Path(p).expanduser() for p in (getattr(config, "controlnet", "") or "").split(os.pathsep) if p]
    folder = Path(getattr(config, "controlnet_dir", "") or "").expanduser()
    if getattr(config, "controlnet_dir", "") and folder.is_dir():
        paths += sorted(folder.iterdir())
    shipped = model_controlnets(config.model) if getattr(config, "model_controlnets", False) else {}
    found = {(p.name[:-len(".safetensors")] if p.name.endswith(".safetensors") else p.name): union_types(p)
             for p in [*paths, *map(Path, shipped.values())]}
    limits = getattr(engine, "limits", None) if engine is not None and engine.ready.is_set() else None
    found.update(dict(getattr(limits, "controlnet_unions", ()) or ()))
    return {name: types for name, types in found.items() if types}


def control_type_choice(unions: dict[str, int], model, current=None, module=None, follow_module: bool = False):
    """The Control type dropdown for the ControlNet ``model`` (``unions``: :func:`control_unions`): hidden at None
    (no control type sent: a plain ControlNet takes none) unless ``model`` is a union; then its types' names
    (engine/control.UNION_TYPES: 6 or ProMax's 8) with, as the value, the ``current`` one while the union has it,
    else the type of the map the preprocessor ``module`` makes (apis/controlnet.module_union_type: canny, Hard
    Edge), else the first. ``follow_module``: the preprocessor changed: its type wins over ``current``."""
    types = unions.get(model_name_of(model), 0)
    if not types:
        return gr.Dropdown(choices=[], value=None, visible=False)
    choices = list(UNION_TYPES[:types])
    by_module = module_union_type(module)
    by_module = choices[by_module] if by_module is not None and by_module < types else None
    value = (by_module if follow_module and by_module else current if current in choices else
             by_module or choices[0])
    return gr.Dropdown(choices=choices, value=value, visible=True)


CONTROL_BOX_PX = 240  # the ControlNet section's two picture boxes (the picture, the detected map): CSS pixels
CONTROL_UPLOAD_PX = 140  # its file box: the drop zone with its three lines (at 90 its label hid the first)


def control_section(config: EngineConfig, engine: EngineContract | None = None) -> ControlSection:
    """The ControlNet section's widgets (:class:`ControlSection`), in an accordion shown when ``config`` loads a
    ControlNet; the model list is the engine's once it is ready (Limits.controlnets), else the flags' names."""
    limits = getattr(engine, "limits", None) if engine is not None and engine.ready.is_set() else None
    names = [name for name, _ in limits.controlnets] if limits is not None else controlnet_names(config)
    unions = control_unions(config, engine)
    with gr.Accordion("ControlNet", open=False, visible=bool(names or config.controlnet_dir),
                      elem_id="controlnet-box") as box:
        # A file box, not an image box: Gradio's image box shows an upload by asking the server for it, and an
        # upload is never served back (guard.Routes): every upload logged a refused GET. The picture shows in
        # its own box once the upload event answers with the app's PNG of it, which replaces the upload in this
        # box too: its download link gives that PNG (the upload's link was a 404).
        upload = gr.File(label="Control image file (PNG, JPEG or WebP)", file_types=[".png", ".jpg", ".jpeg", ".webp"],
                         height=CONTROL_UPLOAD_PX, elem_id="control-upload")
        with gr.Row():
            # One height for both: each box otherwise takes its content's, and a small picture left a strip
            # beside the tall empty map.
            picture = gr.Image(label="Control image", interactive=False, height=CONTROL_BOX_PX,
                               elem_id="control-picture")
            detected = gr.Image(label="Detected map", interactive=False, height=CONTROL_BOX_PX,
                                elem_id="control-detected")
        image = gr.Textbox("", visible=False, elem_id="control-image")  # the picture as base64 PNG
        with gr.Row():
            module = gr.Dropdown(list(MODULES), value="none", label="Preprocessor", elem_id="control-module")
            preview = gr.Button("Preview", size="sm", elem_id="control-preview")
            model = gr.Dropdown(names, value=names[0] if names else "", allow_custom_value=True, label="ControlNet",
                                elem_id="control-model")
            # A ControlNet-Union's control type: what the picture is (an edge map, a depth map, a pose...). Built
            # hidden at None, the API's default (Gradio's API takes a widget's first value as its input's default: a
            # gradio_client call naming a union and no type is refused, as the tools' default ""), with every type's
            # name (what view_api lists), and set by the page's load for the chosen ControlNet (wire_control_section).
            control_type = gr.Dropdown(list(UNION_TYPES), value=None, visible=False, elem_id="control-type",
                                       label="Control type", info="ControlNet-Union: what the control image is")
        with gr.Row():
            weight = gr.Slider(0.0, 2.0, value=1.0, step=0.05, label="Control weight", elem_id="control-weight")
            start = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label="Starting step (share)", elem_id="control-start")
            end = gr.Slider(0.0, 1.0, value=1.0, step=0.05, label="Ending step (share)", elem_id="control-end")
        values = shipped_example(config, names)
        example = gr.Button("Example outline",
                            size="sm", visible=values is not None, elem_id="control-example")
    return ControlSection(box, upload, picture, image, module, preview, detected, model, weight, start, end,
                          control_type, example, values, unions)


def shipped_example(config: EngineConfig, names: list[str]) -> tuple | None:
    """The first of the model's own ControlNets (``model_controlnets``) among ``names`` whose folder has an
    example.json (``{"prompt", "module", "image"}``, the image a PNG beside it: tools/train_controlnet.py writes
    tiny-shapes'), as (base64 PNG, (H, W, 3) uint8 picture, module, ControlNet name, prompt); None without one."""
    import json

    from PIL import Image

    shipped = model_controlnets(config.model) if config.model_controlnets else {}
    for name, folder in shipped.items():
        spec = Path(folder) / "example.json"
        if name not in names or not spec.is_file():
            continue
        values = json.loads(spec.read_text())
        data = (Path(folder) / Path(values["image"]).name).read_bytes()
        picture = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        return base64.b64encode(data).decode(), picture, values["module"], name, values["prompt"]
    return None


def picture_function(demo, label: str = "control image", field: str = "control_image") -> Callable:
    """The ControlNet picture's upload event (guard.CONTROL_EVENT; the IP-Adapter's reference picture's,
    guard.IP_EVENT, with ``label`` "reference image" and ``field`` "ip_adapter_image"; it does not preprocess:
    Gradio would decode any file it is named): the picture's file (an upload or one of the app's PNGs of ``demo``,
    handler.readable; the guard checked it too) read as the image event reads its picture (image_input.read_file,
    apis.uploads' decoding) and made into one PNG by the app, answered as (its base64 text: /generate's
    ``field``, its path, its path again). The path is a new file in a new folder of Gradio's temp folder
    (delivery.write_served), shown in the picture's box and put back into the file box, so the box's download link
    gives the app's PNG: an upload is never served back (guard.Routes) and is deleted once read, which left the
    box's link a 404. A value that is not such a file, or not an image, is gr.Error with the reason; so is a PNG
    that could not be written."""
    from sdxl_engine.serving import handler  # here: handler imports the apis package, whose routes import it

    def encoded_picture(value) -> tuple[str, str, str]:  # sync: Gradio runs it on a worker thread
        path = value.get("path") if isinstance(value, dict) else None
        try:
            if not isinstance(path, str) or not handler.readable(demo, path):
                raise ApiError(400, f"{label}: not a file this page uploaded", field)
            picture = image_input.open_image(image_input.read_file(path, label), label, "RGB")
        except ApiError as err:
            raise gr.Error(err.message, print_exception=False) from None
        finally:
            if isinstance(path, str):
                handler.discard_uploads(demo, [path])
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        try:
            (path,) = delivery.write_served([buffer.getvalue()], [label.split()[0]],
                                            Path(gradio_internals.upload_folder()))
        except OSError as err:
            raise gr.Error(f"the server could not store the {label} ({type(err).__name__}); please retry "
                           "later", print_exception=False) from err
        return base64.b64encode(buffer.getvalue()).decode(), path, path

    return encoded_picture


def detected_map(image: str, module: str):
    """The preprocessor's map of the section's picture (base64 PNG text, decoded as a client's image is:
    apis.uploads.decode_image) by engine/control.detect, or None without a picture; a picture it cannot decode or a
    module the engine refuses is a gr.Error with the message."""
    if not image:
        return None
    try:
        return detect(np.asarray(decode_image(image, "control image", "RGB")), module)
    except ApiError as err:
        raise gr.Error(err.message, print_exception=False) from None
    except InvalidRequest as err:
        raise gr.Error(str(err), print_exception=False) from None


def wire_control_section(section: ControlSection, demo, prompt: gr.Textbox) -> None:
    """The section's own events, private: the upload encoded into ``image`` and shown again, in the picture's box
    and the file box, as the app's PNG (guard.CONTROL_EVENT: the one event besides the image event whose call may
    name an upload; :func:`picture_function`), its removal emptying ``image`` (in the browser), Preview's detected
    map, the example button filling the picture, preprocessor, ControlNet and ``prompt``, and the Control type
    following the ControlNet and the preprocessor (:func:`control_type_choice`: shown for a union only)."""
    section.upload.upload(page_event(picture_function(demo)), section.upload,
                          [section.image, section.picture, section.upload],
                          api_name=guard.CONTROL_EVENT, api_visibility="private", preprocess=False)
    section.upload.clear(None, None, [section.image, section.picture], js="() => ['', null]", queue=False,
                         api_visibility="private")
    section.preview.click(page_event(detected_map), [section.image, section.module], section.detected,
                          api_visibility="private", preprocess=False)  # detect checks the module by name
    for changed, follow_module in ((section.model.change, False), (section.module.change, True), (demo.load, False)):
        changed(page_event(lambda model, current, module, follow=follow_module: control_type_choice(
            section.unions, model, current, module, follow)), [section.model, section.control_type, section.module],
            section.control_type, api_visibility="private", queue=False, show_progress="hidden", preprocess=False)
    if section.example_values is not None:
        values = section.example_values
        section.example.click(lambda: values, None, [section.image, section.picture, section.module, section.model,
                                                     prompt], api_visibility="private", queue=False)


@dataclasses.dataclass
class IPSection:
    """The page's "Image prompt (IP-Adapter)" section (shown when an IP-Adapter is loaded): ``upload`` (the reference
    picture's file; a private event turns it into ``image``, base64 PNG text: /generate's ``ip_adapter_image``, as
    the ControlNet section's picture, and shows it in ``picture``), the adapter ``model``, ``weight``, ``start`` and
    ``end``; and ``embeds``, hidden and empty: /generate's ``ip_adapter_embeds`` (an IP-Adapter FaceID's face
    embedding, which only an API client sends: the page cannot compute insightface's embeddings), so the event's
    input list has every /generate input."""

    box: gr.Accordion
    upload: gr.File
    picture: gr.Image
    image: gr.Textbox
    model: gr.Dropdown
    weight: gr.Slider
    start: gr.Slider
    end: gr.Slider
    embeds: gr.JSON

    @property
    def named(self) -> dict:
        """/generate's IP-Adapter inputs by their names (apis/tools.IP_UNIT_NAMES): {name: component}."""
        return dict(zip(IP_UNIT_NAMES, (self.image, self.model, self.weight, self.start, self.end, self.embeds),
                        strict=True))


def ip_adapter_names(config: EngineConfig, engine: EngineContract | None = None) -> list[str]:
    """The IP-Adapters requests may name: the engine's once it is ready (Limits.ip_adapters), else the names
    ``--ip-adapter`` gives them (a file's name without ``.safetensors``, as checkpoint/ip_adapter.py names them)."""
    limits = getattr(engine, "limits", None) if engine is not None and engine.ready.is_set() else None
    if limits is not None:
        return [name for name, _ in limits.ip_adapters]
    paths = [p.strip() for p in (getattr(config, "ip_adapter", "") or "").split(os.pathsep) if p.strip()]
    return [Path(p).name[:-len(".safetensors")] if p.endswith(".safetensors") else Path(p).name for p in paths]


def ip_section(config: EngineConfig, engine: EngineContract | None = None) -> IPSection:
    """The IP-Adapter section's widgets (:class:`IPSection`), in an accordion shown when an IP-Adapter is loaded
    (:func:`ip_adapter_names`); the reference picture in a file box, as the ControlNet section's (an upload is
    never served back: the app's PNG of it shows in ``picture``)."""
    names = ip_adapter_names(config, engine)
    with gr.Accordion("Image prompt (IP-Adapter)", open=False, visible=bool(names), elem_id="ip-adapter-box") as box:
        upload = gr.File(label="Reference image file (PNG, JPEG or WebP): its style or subject steers the images",
                         file_types=[".png", ".jpg", ".jpeg", ".webp"], height=CONTROL_UPLOAD_PX,
                         elem_id="ip-upload")
        picture = gr.Image(label="Reference image", interactive=False, height=CONTROL_BOX_PX, elem_id="ip-picture")
        image = gr.Textbox("", visible=False, elem_id="ip-image")  # the picture as base64 PNG
        model = gr.Dropdown(names, value=names[0] if names else "", allow_custom_value=True, label="IP-Adapter",
                            elem_id="ip-model")
        with gr.Row():
            weight = gr.Slider(0.0, 2.0, value=1.0, step=0.05, label="Weight", elem_id="ip-weight")
            start = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label="Starting step (share)", elem_id="ip-start")
            end = gr.Slider(0.0, 1.0, value=1.0, step=0.05, label="Ending step (share)", elem_id="ip-end")
        embeds = gr.JSON(None, visible=False, elem_id="ip-embeds")  # FaceID's embedding: API clients only
    return IPSection(box, upload, picture, image, model, weight, start, end, embeds)


def wire_ip_section(section: IPSection, demo) -> None:
    """The section's own events, private: the upload encoded into ``image`` and shown again as the app's PNG
    (guard.IP_EVENT, as the ControlNet picture's: :func:`picture_function`), its removal emptying ``image``."""
    section.upload.upload(page_event(picture_function(demo, "reference image", "ip_adapter_image")),
                          section.upload, [section.image, section.picture, section.upload],
                          api_name=guard.IP_EVENT, api_visibility="private", preprocess=False)
    section.upload.clear(None, None, [section.image, section.picture], js="() => ['', null]", queue=False,
                         api_visibility="private")
