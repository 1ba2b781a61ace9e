"""The Gradio page in front of the SDXL engine: layout and events only; ``python app.py`` (see ``--help``) serves it.

Its Generate event is also the API endpoint ``/generate``: keyword inputs ``prompt, negative_prompt, seed,
guidance_scale, num_inference_steps, width, height`` and the optional ``style`` and ``sampler``; outputs the gallery
and a JSON object (``seeds``, ``latency_s``, ``device_count`` ...: README). The request handler, the process's life
(flags, HTTP guard, clean stop), the history and the page's CSS/scripts live in ``sdxl_engine/serving``.
"""

from __future__ import annotations

from sdxl_engine.serving import main as process  # imports nothing heavy: no Gradio, no JAX

TITLE = "Fast Stable Diffusion XL with JAX"
if __name__ == "__main__":  # first: stop signals handled, flags and settings checked (exit 2), Gradio's variables
    START = process.prepare(TITLE)

import gradio as gr

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.contract import EngineContract
from sdxl_engine.engine.validation import MAX_GUIDANCE
from sdxl_engine.program.schedulers import SAMPLERS, SCHEDULE_TYPES
from sdxl_engine.service.models import configured as models_configured
from sdxl_engine.service.service import Service
from sdxl_engine.service.styles import NO_STYLE, STYLE_NAMES
from sdxl_engine.serving import handler, history
from sdxl_engine.serving.apis.mcp_image import API_NAME as IMAGE_TOOL
from sdxl_engine.serving.apis.mcp_image import image_tool
from sdxl_engine.serving.apis.tools import generate_inputs
from sdxl_engine.serving.history import RESTORED_FIELDS
from sdxl_engine.serving.page import (
    BLOG_DEFAULT,
    event_inputs,
    example_loader,
    examples_for,
    fast_preset_for,
    lora_names_for,
    lora_tag_adder,
    model_choices,
    model_default_label,
    model_note,
    page_event,
    size_choices,
)
from sdxl_engine.serving.page_assets import (
    HISTORY_JS,
    HISTORY_KEY,
    HISTORY_NOTE,
    PAGE_CSS,
    PARSE_SIZE_JS,
    PNG_SETTINGS_HTML,
    PNG_SETTINGS_JS,
)
from sdxl_engine.serving.page_history import wire_history
from sdxl_engine.serving.page_image import (
    control_section,
    image_events,
    image_section,
    ip_section,
    refiner_slider,
    wire_control_section,
    wire_image_section,
    wire_ip_section,
    wire_selection,
)
from sdxl_engine.serving.page_models import (
    ModelWidgets,
    offered,
    wire_models,
    wire_png_restore,
    wire_presets,
    wire_start,
)
from sdxl_engine.serving.page_requests import wire_outcomes, wire_starts


def build_demo(requests: Service, config: EngineConfig, engine: EngineContract | None = None,
               history_secret: str | None = None) -> gr.Blocks:
    """The page, one client of ``requests`` (the service, sdxl_engine.service: tests give it a fake engine): its
    events submit jobs there, which orders the work and holds the per-client cap for every front, so Gradio's
    queue runs them as they come (``concurrency_limit=None``).

    ``engine`` (optional) feeds the start-up banner and the resolution list; without it the page offers the
    model's default size only. ``history_secret``: the browsers' history key (history.browser_secret: this, else
    SDXL_HISTORY_SECRET, else the one kept in the cache folder). Only ``/generate`` is an API endpoint; the
    other events are private (guard.Routes lets them through only as the page calls them), and each one that
    runs on the server is a :func:`page_event`. None writes a file: the history's thumbnails are drawn in the
    browser (HISTORY_JS)."""
    with gr.Blocks(title=TITLE) as demo:
        gr.Markdown(f"# {TITLE}\nFour images per prompt, generated in parallel across the accelerator's devices.")
        # Empty as served: the page's config is built once, while the engine starts, so a line put in here would
        # say "Starting" on every page load long after; the load event (refresh, below) writes the engine's state.
        banner = gr.Markdown("", elem_id="engine-status")
        note = gr.Markdown(model_note(config.model), visible=bool(model_note(config.model)), elem_id="model-note")
        with gr.Row(equal_height=True, elem_id="prompt-row"):  # the prompt, across the page
            prompt = gr.Textbox(label="Prompt", placeholder="a red circle on a blue background", scale=5,
                                lines=1, max_lines=3, elem_id="prompt")
            run = gr.Button("Generate", variant="primary", scale=1, min_width=120, elem_id="generate")
            stop = gr.Button("Stop", variant="stop", scale=0, min_width=80, elem_id="stop")
        # One line on the prompt syntax (engine/prompts.py; docs/prompts.md).
        gr.Markdown(f"`(word:1.3)` `(word)` more, `[word]` less; `BREAK` starts a new chunk; up to "
                    f"{config.max_prompt_chunks * 75} tokens.", elem_id="prompt-hint")
        with gr.Row(elem_id="main-row"):
            with gr.Column(scale=2, elem_id="settings-col"):  # how to make it
                # Which of the server's models makes the images: shown once the engine offers two or more. Its
                # value reaches the engine as sent (preprocess=False): an unknown name is refused by name.
                configured = models_configured(config)  # the flags' model names, read once (not on each refresh)
                model = gr.Dropdown(**model_choices(engine, configured), label="Model", elem_id="model")
                style = gr.Radio(list(STYLE_NAMES), value=NO_STYLE, label="Style", elem_id="style")
                with gr.Row(elem_id="preset-row"):  # few steps, or back to the model's own setting
                    fast = gr.Button(fast_preset_for(config).label, size="sm", elem_id="fast-preset",
                                     visible=fast_preset_for(config).lora in lora_names_for(config))
                    model_default = gr.Button(model_default_label(config), size="sm", elem_id="model-default")
                with gr.Row(elem_id="size-row"):
                    choices, default_size = size_choices(engine)
                    resolution = gr.Dropdown(choices, value=default_size, label="Resolution (width × height, pixels)",
                                             elem_id="resolution")
                    seed = gr.Number(value=-1, precision=0, minimum=-1, maximum=config.max_seed,
                                     label="Seed (-1 = random)", elem_id="seed")
                with gr.Row():
                    randomize = gr.Button("Randomize seed", size="sm", elem_id="randomize")
                    reuse = gr.Button("Reuse selected image's seed", size="sm", interactive=False, elem_id="reuse")
                with gr.Accordion("Advanced settings", open=False):
                    negative_prompt = gr.Textbox(label="Negative prompt", placeholder="what to avoid",
                                                 elem_id="negative")
                    with gr.Row(elem_id="sampler-row"):  # A1111's pair: the sampler and its schedule type
                        sampler = gr.Dropdown(list(SAMPLERS), value=config.sampler, label="Sampler", elem_id="sampler")
                        schedule_type = gr.Dropdown(list(SCHEDULE_TYPES.values()), value="Automatic",
                                                    label="Schedule type", elem_id="schedule-type")
                    guidance_scale = gr.Slider(0.0, MAX_GUIDANCE, value=config.guidance_scale, step=0.5,
                                               label="Guidance scale (≤ 1: no CFG, one UNet pass per image)")
                    num_inference_steps = gr.Slider(1, config.max_inference_steps, value=config.num_inference_steps,
                                                    step=1, precision=0, label="Steps",
                                                    elem_id="steps")  # precision 0: an int in the API
                    blog_default = gr.Button(f"Blog default ({BLOG_DEFAULT[0]}, {BLOG_DEFAULT[1]} steps)", size="sm",
                                             elem_id="blog-default")
                    refiner_switch = refiner_slider(config)  # shown only when a refiner is loaded
                    with gr.Row(visible=False):  # set from the resolution list; still the API's width/height
                        width = gr.Number(value=0, precision=0, label="Width (px, 0 = model default)")
                        height = gr.Number(value=0, precision=0, label="Height (px, 0 = model default)")
                image = image_section(config, engine)  # Image to image (serving/page_image.py)
                control = control_section(config, engine)  # ControlNet, shown when one is loaded (page_image.py)
                ip = ip_section(config, engine)  # Image prompt (IP-Adapter), shown when one is loaded (page_image.py)
            with gr.Column(scale=3, elem_id="output-col"):  # what came out (first on a phone: PAGE_CSS)
                gallery = gr.Gallery(label="Images", columns=2, format="png", object_fit="contain",
                                     buttons=["download", "fullscreen"], interactive=False, elem_id="gallery")
                status = gr.Markdown(elem_id="result-status")
                with gr.Row(elem_id="gallery-actions"):  # the selected image into the image editor
                    send_image = gr.Button("Send to image", size="sm", interactive=False, elem_id="send-to-image")
                    send_inpaint = gr.Button("Inpaint", size="sm", interactive=False, elem_id="send-to-inpaint")
                    send_upscale = gr.Button("Upscale (hires fix)", size="sm", interactive=False,
                                             elem_id="send-to-upscale")
                with gr.Accordion("Details (JSON, as the API returns it)", open=False):
                    info = gr.JSON(label="Details")
        # A Dataset of index type, not gr.Examples: Gradio's own example loader fails with a traceback on
        # an index the page never sends; this one refuses it in one line (page_event).
        examples = gr.Dataset(components=[prompt, style], samples=[[text, NO_STYLE] for text in
                                                                   examples_for(config.model)],
                              type="index", label="Examples (click to fill the prompt and style)", elem_id="examples")
        # The loaded LoRAs: a click adds its <lora:NAME:1> tag to the prompt (the engine reads the tags).
        lora_names = lora_names_for(config)
        lora_list = gr.Dataset(components=[prompt], samples=[[f"<lora:{name}:1>"] for name in lora_names],
                               type="index",
                               label="LoRAs (click to add its tag to the prompt; edit the weight, -4 to 4)",
                               elem_id="loras", visible=bool(lora_names))
        with gr.Accordion("Restore settings from a PNG", open=False, elem_id="png-settings-box"):
            png_file = gr.HTML("", html_template=PNG_SETTINGS_HTML, js_on_load=PNG_SETTINGS_JS, elem_id="png-settings")
            png_note = gr.Markdown("A PNG this page or AUTOMATIC1111 made carries its prompt and settings; it is read "
                                   "in this browser, not uploaded.", elem_id="png-note")
        with gr.Accordion("History (this browser)", open=True):
            history_note = gr.Markdown(HISTORY_NOTE, elem_id="history-note")
            history_gallery = gr.Gallery(label="Past generations", show_label=False, columns=10, height=300,
                                         allow_preview=False, fit_columns=False, format="jpeg", interactive=False,
                                         elem_id="history")
            clear_history = gr.Button("Clear history", size="sm")
        past = gr.BrowserState([], storage_key=HISTORY_KEY, secret=history.browser_secret(history_secret))
        selected_seed = gr.State(None)
        selected_index = gr.State(None)  # the gallery image selected (Send to image / Inpaint)
        last_result = gr.State(None)  # the last finished request's gallery and details, shown again after a Stop
        # Where the page's Stop found its request (STOP_STEP_JS), "" when there was no Stop; kept in the browser.
        heard = gr.Textbox("", visible="hidden", elem_id="stop-heard")
        pending = history.Pending()  # each generation's history record, until this browser's history takes it
        finished = history.Pending(max_per_session=1)  # each session's last finished gallery, until it is kept

        following = handler.PageJobs(requests)  # each session's running jobs, for Stop (page_requests.wire_outcomes)
        generate_images = handler.api_function(requests, config, pending, finished, demo, following)
        generate_from_image = handler.image_function(requests, config, pending, finished, demo, following)
        upscale_image = handler.upscale_function(requests, config, pending, finished, demo, following)

        # A request's start and end on the page: the gallery in view, Stop, the status line (page_requests.py).
        wire_starts([run.click, prompt.submit, image.run.click, send_upscale.click], status, heard)
        wire_control_section(control, demo, prompt)
        wire_ip_section(ip, demo)
        # /generate's widgets by its input's names (apis/tools.generate_inputs: the events' inputs follow that list).
        widgets = dict(prompt=prompt, negative_prompt=negative_prompt, seed=seed, guidance_scale=guidance_scale,
                       num_inference_steps=num_inference_steps, width=width, height=height, style=style,
                       sampler=sampler, refiner_switch_at=refiner_switch, **control.named, model=model,
                       schedule_type=schedule_type, **ip.named)
        restored = [{**widgets, "resolution": resolution}[name] for name in RESTORED_FIELDS]  # a PNG, a past image
        # preprocess=False: values reach the engine as sent, so its checks and messages (with the argument's name)
        # apply to page and API alike, instead of Gradio's unnamed bound checks; concurrency_limit None: the
        # service (not Gradio's queue) orders the requests and caps each client.
        event = gr.on([run.click, prompt.submit], generate_images, event_inputs(generate_inputs(config), widgets),
                      [gallery, info], api_name="generate", concurrency_limit=None, preprocess=False)
        events = (event, *image_events(config, image, widgets, generate_from_image, upscale_image, send_upscale,
                                       last_result, selected_index, gallery, info))
        # The status line; Stop cancels this browser's request and shows the last finished result again.
        wire_outcomes(events, stop, gallery, info, status, heard, last_result, following.stop_left)
        # The MCP image tool (an API endpoint without widgets): the picture as base64 text (apis/mcp_image.py).
        gr.api(image_tool(requests, config, engine), api_name=IMAGE_TOOL, concurrency_limit=None)

        # The Model dropdown, the presets and what follows a model (serving/page_models.py).
        model_settings = [sampler, num_inference_steps, guidance_scale]
        follow_model = wire_models(engine, config, ModelWidgets(model, model_default, resolution, control.model, fast,
                                                                note, lora_list, ip.model, examples), prompt,
                                   model_settings)
        follow_model(wire_history(events, past, pending, finished, last_result, history_gallery, history_note,
                                  clear_history, restored, lambda: offered(engine)))
        # The gallery's selection: Reuse seed, Send to image / Inpaint / Upscale (serving/page_image.py).
        wire_selection(events, gallery, info, seed, selected_seed, reuse, selected_index,
                       [send_image, send_inpaint, send_upscale])
        wire_image_section(image, gallery, last_result, selected_index, send_image, send_inpaint, send_upscale)
        # This one needs nothing from the server: done in the browser, so there is no handler to call.
        randomize.click(None, None, seed, js="() => -1", api_visibility="private")
        wire_presets(config, blog_default, fast, prompt, model_settings, schedule_type)
        resolution.change(None, resolution, [width, height], js=PARSE_SIZE_JS, api_visibility="private")
        # The browser sends the PNG's parameters text only (PNG_SETTINGS_JS): no file reaches the server.
        follow_model(wire_png_restore(engine, config, png_file, restored, png_note))

        examples.click(page_event(example_loader(config.model)), [examples, model], [prompt, style],
                       api_visibility="private", queue=False, show_progress="hidden", preprocess=False)
        lora_list.click(page_event(lora_tag_adder(engine, config)), [lora_list, prompt, model], prompt,
                        api_visibility="private", queue=False, show_progress="hidden", preprocess=False)

        # The banner, then what the started engine offers: sizes, the brush, the models (serving/page_models.py).
        wire_start(demo, engine, configured, banner, resolution, image.init_image, model, events)
        demo.load(None, past, [history_gallery, history_note], js=HISTORY_JS, api_visibility="private")
    return demo


if __name__ == "__main__":  # the process's life (exit statuses, clean stop): sdxl_engine/serving/main.py
    process.run(build_demo, PAGE_CSS, TITLE, start=START)
