"""Gradio page in front of the SDXL engine. UI only: every model call goes through one engine.

Run ``python app.py`` (see ``--help``). The page's Generate event is also the API endpoint
``/generate``: keyword inputs ``prompt, negative_prompt, seed, guidance_scale,
num_inference_steps, width, height`` and the optional ``style``; outputs the gallery and a JSON
object with ``seeds``, ``latency_s`` and ``device_count`` (and more, documented in the README).
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

import serving

if __name__ == "__main__":  # before Gradio is imported: it reads GRADIO_TEMP_DIR once, at import time
    serving.usable_output_dir()

import gradio as gr
from starlette.exceptions import StarletteDeprecationWarning

# Gradio 6.17 uses Starlette names deprecated since (HTTP_422_UNPROCESSABLE_ENTITY): two warnings
# per request in the server log that only Gradio can act on.
warnings.filterwarnings("ignore", category=StarletteDeprecationWarning, module=r"gradio(\.|$)")

from sdxl_engine.config import ConfigError, EngineConfig
from sdxl_engine.engine import EngineNotReady, GenerationError, get_engine
from sdxl_engine.images import a1111_parameters, image_stem, png_bytes, request_stamp, to_pil, write_new
from sdxl_engine.styles import NO_STYLE, STYLE_NAMES, UnknownStyle, apply_style, get_style
from sdxl_engine.validation import MAX_GUIDANCE, GenerateRequest, InvalidRequest

TITLE = "Fast Stable Diffusion XL with JAX"
# Prompts in the vocabulary of the default model, tiny-shapes (sdxl_engine/shapes.py).
EXAMPLES = ["a red circle on a blue background", "a large green square at the top", "a small yellow star on the left",
            "a purple triangle on a white background", "a large pink cross in the centre on a black background"]
# The style each example row selects (paired with EXAMPLES in order, repeating). None: a style's
# added words ("anime artwork ...", negative "black and white ...") are outside tiny-shapes'
# vocabulary and pull its images off the prompt (QA: 10 of 16 styled images had the right colour).
EXAMPLE_STYLES = (NO_STYLE,)
HISTORY_LIMIT = 20  # generations kept in the browser's history (localStorage)
THUMB_PX = 96  # longest side of a history thumbnail, pixels
STAGES = {  # engine stage -> (progress fraction, what the page says)
    "waiting for the device": (0.02, "Waiting for the device (another request is running)"),
    "compiling": (0.03, "Compiling the program for this size (first request at it; reused afterwards)"),
    "preparing": (0.05, "Preparing: tokenizing the prompts, scheduling {steps} Euler steps"),
    "on device": (0.1, "On {devices}: encoding the prompts, denoising {steps} steps, decoding with the VAE"),
    "to host": (0.9, "Copying {n} images to the host"),
}
MODEL_NOTES = {  # shown under the banner for the built-in models
    "tiny-shapes": "Model `tiny-shapes`: a small demo model (SDXL architecture, 64×64, trained here on captioned "
                   "shapes: circle, square, triangle, star, cross, diamond; 8 colours; left/right/top/bottom/centre; "
                   "small/large; white/black/gray/blue backgrounds). ",
    "tiny-random": "Model `tiny-random`: the SDXL architecture with random weights (for tests): expect noise. ",
}
# The layout (launch(css=...)). At 1280x800 the 2x2 gallery is as wide as the window's height
# allows, so all four images show without scrolling. Below 768 px the columns stack: the gallery
# comes first, right under the prompt, not under the styles, resolution and seed; scroll anchoring
# is off there, or the browser scrolls the images away as the gallery grows.
PAGE_CSS = """
#gallery .grid-container { max-width: max(240px, min(100%, calc(100vh - 380px))); margin-inline: auto; }
@media (max-width: 767px) { #output-col { order: -1; } #main-row { overflow-anchor: none; } }
"""
SCROLL_TO_GALLERY_JS = """() => { if (window.innerWidth < 768) {  /* after the page's own updates settle */
  setTimeout(() => document.querySelector('#gallery')?.scrollIntoView({block: 'start'}), 100); } }"""
REAL_SDXL_HINT = ("For real SDXL start with "
                  "`python app.py --model stabilityai/stable-diffusion-xl-base-1.0`.")


def refuse(err: Exception) -> gr.Error:
    """The gr.Error for a request the engine refused (bad input, not started, unusable image),
    after one log line: a user's mistake is not a traceback in the server log."""
    print(f"[app] request refused: {err}", flush=True)
    return gr.Error(str(err), print_exception=False)


def handle_generate(engine, prompt, negative_prompt, seed, guidance_scale, num_inference_steps, width, height,
                    style=NO_STYLE, progress: Callable | None = None, files_dir: str | None = None,
                    arrived: float | None = None):
    """One /generate call: values as the client sent them in, (gallery items, info dict) out.

    The engine validates every value (width/height 0 or None = the model's default). Raises
    gr.Error with the engine's message for bad input, an engine that is not ready or an unusable
    image; any other failure is logged here and reported without internals.

    ``style`` names a preset of sdxl_engine.styles (applied here, so the engine sees plain text).
    ``arrived`` (``time.monotonic()`` when the request reached the server; see
    serving.arrival_time) makes ``timings_s.queue`` count the wait in Gradio's queue too.

    ``progress(fraction, desc=...)`` (a gr.Progress) hears each stage; while the engine is still
    starting, the request waits and reports the start-up stage and elapsed seconds. When the
    config has ``outputs_dir``, every image is also saved there as PNG with its parameters.

    The gallery items are (PNG path, caption): each PNG lies in a new folder of its own under
    ``files_dir`` (default: Gradio's temp folder, which serves it as it is), named after its seed
    and the prompt's first words (``seed42-a-red-circle.png``), which is the name a download gets.
    Saved copies are named ``<time to the µs>-<request id>-seed42-a-red-circle.png``.
    """
    report = progress if progress is not None else (lambda *_, **__: None)  # gr.Progress is falsy (len 0)
    try:
        styled_prompt, styled_negative = apply_style(style, prompt, negative_prompt)
        style = get_style(style).name
    except UnknownStyle as err:
        raise refuse(err) from err
    while not engine.ready.wait(0.5):
        report(0.0, desc=f"Starting the engine: {engine.stage} ({time.perf_counter() - engine.started:.0f} s)")
    request = GenerateRequest(prompt=styled_prompt, negative_prompt=styled_negative, seed=seed,
                              guidance_scale=guidance_scale, num_inference_steps=num_inference_steps,
                              width=width, height=height)

    def on_stage(stage: str) -> None:
        fraction, text = STAGES.get(stage, (None, stage))
        report(fraction, desc=text.format(steps=num_inference_steps, devices=getattr(engine, "device_summary", ""),
                                          n=getattr(engine, "batch", "")))

    since = None if arrived is None else time.perf_counter() - (time.monotonic() - arrived)  # on the engine's clock
    try:
        result = engine.generate(request, progress=on_stage, arrived=since)
    except (InvalidRequest, EngineNotReady, GenerationError) as err:
        raise refuse(err) from err
    except Exception as err:
        traceback.print_exc()
        raise gr.Error(f"the engine failed on this request ({type(err).__name__}); it is logged on the server. "
                       "Please retry.") from err
    report(0.95, desc="Encoding PNGs")
    req = result.request
    latency = result.timings["latency"]
    extra = {} if style == NO_STYLE else {"Style": style}
    texts = [a1111_parameters(req.prompt, req.negative_prompt, req.num_inference_steps, req.guidance_scale, s,
                              req.width, req.height, result.model, extra) for s in result.seeds]
    pngs = [png_bytes(image) for image in to_pil(result.images, texts)]
    stems = [image_stem(s, prompt) for s in result.seeds]  # seed42-a-red-circle: the download's name
    try:  # one new folder per request in Gradio's temp folder: served from there, never copied
        folder = Path(tempfile.mkdtemp(prefix="sdxl-", dir=Path(files_dir or gr.utils.get_upload_folder()).resolve()))
        paths = [str(write_new(data, folder, stem)) for data, stem in zip(pngs, stems)]
    except OSError as err:
        print(f"[app] error: could not write the images to Gradio's temp folder: {err}", flush=True)
        raise gr.Error(f"the server could not store the images ({type(err).__name__}); please retry later",
                       print_exception=False) from err
    label = "" if style == NO_STYLE else f" · {style}"
    gallery = [(path, f"seed {s}{label} · {latency:.2f} s") for path, s in zip(paths, result.seeds)]
    for warning in result.warnings:
        gr.Warning(warning if style == NO_STYLE else f"{warning} (the {style} style adds words around yours)")
    info = {
        "seeds": result.seeds,
        "latency_s": round(latency, 4),
        "device_count": result.device_count,
        "device": result.device_summary,
        "timings_s": {k: round(v, 4) for k, v in result.timings.items()},
        "prompt": req.prompt,
        "negative_prompt": req.negative_prompt,
        "guidance_scale": req.guidance_scale,
        "num_inference_steps": req.num_inference_steps,
        "width": req.width,
        "height": req.height,
        "model": result.model,
        "warnings": result.warnings,
        "style": style,
        "user_prompt": prompt,
        "user_negative_prompt": negative_prompt or "",
    }
    outputs_dir = getattr(engine.config, "outputs_dir", "")
    if outputs_dir:
        stamp = request_stamp()  # to the microsecond, plus a random id: two requests never share a name
        try:
            info["saved"] = [str(write_new(data, Path(outputs_dir), f"{stamp}-{stem}"))
                             for data, stem in zip(pngs, stems)]
        except OSError as err:  # the images are still shown and downloadable; saving is best-effort
            print(f"[app] warning: could not save to outputs_dir {outputs_dir!r}: {err}", flush=True)
            gr.Warning(f"Images not saved to the outputs folder ({type(err).__name__}); download them instead.")
    return gallery, info


def status_line(info: dict) -> str:
    """The one line under the gallery: latency breakdown, devices, size, steps, style and model."""
    if not info:
        return ""
    t = info["timings_s"]
    style = info.get("style", NO_STYLE)
    saved = f" · saved to `{Path(info['saved'][0]).parent}`" if info.get("saved") else ""
    return (f"**{info['latency_s']:.2f} s** for {len(info['seeds'])} images on **{info['device']}** "
            f"(queue {t['queue']:.2f} s · prep {t['prep']:.3f} s · device {t['device']:.2f} s · "
            f"post {t['post']:.3f} s) — {info['width']}×{info['height']}, {info['num_inference_steps']} steps, "
            f"CFG {info['guidance_scale']:g}, seeds {info['seeds'][0]}–{info['seeds'][-1]}, "
            f"style **{style}**, model `{info['model']}`{saved}")


def engine_banner(engine) -> tuple[str, bool]:
    """(Markdown for the status banner, whether the engine is done starting) for ``engine``.

    While it starts: the stage (loading, placing, compiling, warm-up) and the seconds since start.
    """
    if engine is None:
        return "", True
    elapsed = time.perf_counter() - engine.started
    if not engine.ready.is_set():
        return (f"**Starting the engine: {engine.stage}** — {elapsed:.0f} s so far. "
                "Requests sent now wait and run as soon as it is ready."), False
    if engine.error is not None:
        return f"**The engine failed to start:** {engine.error}", True
    ready_s = engine.startup.get("ready_s", elapsed)
    return (f"Ready on **{engine.device_summary}** — model `{engine.model.name}` ({engine.model.dtype}), "
            f"started in {ready_s:.1f} s"), True


def size_choices(engine) -> tuple[list[tuple[str, str]], str]:
    """Resolution dropdown (label, "WxH") choices and the default value; ("model default", "0x0") until ready."""
    if engine is None or not engine.ready.is_set() or engine.error is not None:
        return [("model default", "0x0")], "0x0"
    default = engine.limits.default_size
    choices = []
    for w, h in engine.limits.sizes:
        shape = "square" if w == h else "landscape" if w > h else "portrait"
        choices.append((f"{w} × {h} ({shape}{', default' if (w, h) == default else ''})", f"{w}x{h}"))
    return choices, f"{default[0]}x{default[1]}"


def thumbnail_url(path: str) -> str:
    """A small JPEG data URL (longest side THUMB_PX pixels) of the image at ``path``, for the history."""
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
        image.thumbnail((THUMB_PX, THUMB_PX))
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def history_record(info: dict, gallery: list) -> dict:
    """What the browser keeps of one generation: its settings, seeds and thumbnails (a few KB)."""
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "prompt": info["user_prompt"], "negative_prompt": info["user_negative_prompt"], "style": info["style"],
        "seeds": info["seeds"], "guidance_scale": info["guidance_scale"],
        "num_inference_steps": info["num_inference_steps"], "width": info["width"], "height": info["height"],
        "model": info["model"], "latency_s": info["latency_s"],
        "thumbs": [thumbnail_url(item[0]) for item in gallery],
    }


def history_items(history: list) -> list[tuple]:
    """Flatten the history (newest first) to gallery items: (PIL thumbnail, caption), one per image."""
    from PIL import Image

    items = []
    for record in history or []:
        for seed, url in zip(record["seeds"], record["thumbs"]):
            image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
            style = "" if record["style"] == NO_STYLE else f" · {record['style']}"
            items.append((image, f"seed {seed}{style} · {record['prompt'][:40]}"))
    return items


def history_entry(history: list, index: int) -> tuple[dict, int]:
    """The record and seed behind item ``index`` of :func:`history_items`. Raises IndexError."""
    for record in history or []:
        if index < len(record["seeds"]):
            return record, record["seeds"][index]
        index -= len(record["seeds"])
    raise IndexError("no such history item")


def build_demo(generate: Callable, config: EngineConfig, engine=None) -> gr.Blocks:
    """The page. ``generate`` has handle_generate's signature minus the engine (tests pass a fake).

    ``engine`` (optional) feeds the start-up banner and the resolution list; without it the page
    offers the model's default size only.
    """
    with gr.Blocks(title=TITLE) as demo:
        gr.Markdown(f"# {TITLE}\nFour images per prompt, generated in parallel across the accelerator's devices.")
        banner = gr.Markdown(engine_banner(engine)[0], elem_id="engine-status")
        if config.model in MODEL_NOTES:
            gr.Markdown(MODEL_NOTES[config.model] + REAL_SDXL_HINT)
        with gr.Row(equal_height=True):  # the prompt, across the page
            prompt = gr.Textbox(label="Prompt", placeholder="a red circle on a blue background", scale=5,
                                lines=1, max_lines=3, elem_id="prompt")
            run = gr.Button("Generate", variant="primary", scale=1, min_width=120, elem_id="generate")
        with gr.Row(elem_id="main-row"):
            with gr.Column(scale=2, elem_id="settings-col"):  # how to make it
                style = gr.Radio(list(STYLE_NAMES), value=NO_STYLE, label="Style", elem_id="style")
                with gr.Row():
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
                    guidance_scale = gr.Slider(0.0, MAX_GUIDANCE, value=config.guidance_scale, step=0.5,
                                               label="Guidance scale")
                    num_inference_steps = gr.Slider(1, config.max_inference_steps, value=config.num_inference_steps,
                                                    step=1, precision=0, label="Steps")  # precision 0: int in the API
                    with gr.Row(visible=False):  # set from the resolution list; still the API's width/height
                        width = gr.Number(value=0, precision=0, label="Width (px, 0 = model default)")
                        height = gr.Number(value=0, precision=0, label="Height (px, 0 = model default)")
            with gr.Column(scale=3, elem_id="output-col"):  # what came out (first on a phone: PAGE_CSS)
                gallery = gr.Gallery(label="Images", columns=2, format="png", object_fit="contain",
                                     buttons=["download", "fullscreen"], interactive=False, elem_id="gallery")
                status = gr.Markdown(elem_id="result-status")
                with gr.Accordion("Details (JSON, as the API returns it)", open=False):
                    info = gr.JSON(label="Details")
        gr.Examples([[text, EXAMPLE_STYLES[i % len(EXAMPLE_STYLES)]] for i, text in enumerate(EXAMPLES)],
                    inputs=[prompt, style], label="Examples (click to fill the prompt and style)")
        with gr.Accordion("History (this browser)", open=True):
            history_note = gr.Markdown("Click an image to restore its prompt, style, seed and settings.")
            history_gallery = gr.Gallery(label="Past generations", columns=10, height=300, allow_preview=False,
                                         fit_columns=False, format="png", interactive=False, elem_id="history")
            clear_history = gr.Button("Clear history", size="sm")
        history = gr.BrowserState([], storage_key="sdxl-jax-history")
        selected_seed = gr.State(None)
        inputs = [prompt, negative_prompt, seed, guidance_scale, num_inference_steps, width, height, style]

        def generate_images(prompt: str, negative_prompt: str | None = None, seed: int = -1,
                            guidance_scale: float = config.guidance_scale,
                            num_inference_steps: int = config.num_inference_steps, width: int = 0, height: int = 0,
                            style: str = NO_STYLE, request: gr.Request = None, progress=gr.Progress()):
            # Named parameters: gradio_client callers use these keywords (the /generate contract);
            # only optional inputs are ever added, at the end. ``request`` and ``progress`` are
            # Gradio's, not inputs.
            return generate(prompt, negative_prompt, seed, guidance_scale, num_inference_steps, width, height, style,
                            progress=progress, arrived=serving.arrival_time(request))

        # On a narrow screen the gallery sits under the prompt, but the page may be scrolled: bring it
        # into view for the progress, and again once the images are in.
        gr.on([run.click, prompt.submit], None, None, None, js=SCROLL_TO_GALLERY_JS, queue=False,
              api_visibility="private")
        # preprocess=False: values reach the engine as sent, so its checks and messages (with the
        # argument's name) apply to page and API alike, instead of Gradio's unnamed bound checks.
        event = gr.on([run.click, prompt.submit], generate_images, inputs, [gallery, info], api_name="generate",
                      concurrency_id="engine", concurrency_limit=1, preprocess=False)
        event.success(status_line, info, status, api_visibility="private")
        event.success(None, None, None, js=SCROLL_TO_GALLERY_JS, queue=False, api_visibility="private")  # the images
        event.success(remember, [history, info, gallery], [history, history_gallery], api_visibility="private",
                      show_progress="hidden")
        event.success(lambda: (None, gr.Button("Reuse selected image's seed", interactive=False)), None,
                      [selected_seed, reuse], api_visibility="private", queue=False)

        def select_image(info: dict, evt: gr.SelectData):
            seed = info["seeds"][evt.index] if info and evt.index is not None else None
            return seed, gr.Button(f"Reuse seed {seed}" if seed is not None else "Reuse selected image's seed",
                                   interactive=seed is not None)

        gallery.select(select_image, info, [selected_seed, reuse], api_visibility="private", queue=False)
        reuse.click(lambda s: -1 if s is None else s, selected_seed, seed, api_visibility="private", queue=False)
        randomize.click(lambda: -1, None, seed, api_visibility="private", queue=False)
        resolution.change(parse_size, resolution, [width, height], api_visibility="private", queue=False)

        def restore(history: list, evt: gr.SelectData):
            record, seed_value = history_entry(history, evt.index)
            return (record["prompt"], record["negative_prompt"], record["style"], seed_value, record["guidance_scale"],
                    record["num_inference_steps"], f"{record['width']}x{record['height']}",
                    f"Restored seed {seed_value} from {record['time']} ({record['model']}); press **Generate** to "
                    "make it again.")

        history_gallery.select(restore, history, [prompt, negative_prompt, style, seed, guidance_scale,
                                                  num_inference_steps, resolution, history_note],
                               api_visibility="private", queue=False)
        clear_history.click(lambda: ([], []), None, [history, history_gallery], api_visibility="private", queue=False)

        timer = gr.Timer(1.0, active=engine is not None and not engine.ready.is_set())

        def refresh():
            text, done = engine_banner(engine)
            if not done:
                return text, gr.Dropdown(), gr.Timer(active=True)
            sizes, value = size_choices(engine)
            return text, gr.Dropdown(choices=sizes, value=value), gr.Timer(active=False)

        timer.tick(refresh, None, [banner, resolution, timer], api_visibility="private", queue=False,
                   show_progress="hidden")
        demo.load(refresh, None, [banner, resolution, timer], api_visibility="private", queue=False,
                  show_progress="hidden")
        demo.load(history_items, history, history_gallery, api_visibility="private", queue=False,
                  show_progress="hidden")
    return demo


def parse_size(value: str) -> tuple[int, int]:
    """"WxH" from the resolution list -> (width, height) in pixels; "0x0" = the model's default."""
    w, h = (value or "0x0").split("x")
    return int(w), int(h)


def remember(history: list, info: dict, gallery: list) -> tuple[list, list]:
    """Put a finished generation first in the browser history (at most HISTORY_LIMIT kept)."""
    history = [history_record(info, gallery)] + list(history or [])[:HISTORY_LIMIT - 1]
    return history, history_items(history)


def tcp_port(text: str) -> int:
    """argparse type for --port / GRADIO_SERVER_PORT: a whole number 1-65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (a whole number from 1 to 65535)")
    return port


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags; a bad flag or GRADIO_SERVER_PORT exits 2 with argparse's one-line message."""
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--share", action="store_true", help="ask Gradio for a public link")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--port", type=tcp_port, default=os.environ.get("GRADIO_SERVER_PORT", "7860"),
                        help="TCP port (env GRADIO_SERVER_PORT)")
    for name in ("model", "revision", "dtype", "width", "height", "num_inference_steps", "max_inference_steps",
                 "images_per_request", "cpu_devices", "compile_cache_dir", "outputs_dir", "temp_max_mb", "temp_keep_s"):
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                            help=f"engine setting {name} (env SDXL_{name.upper()})")
    return parser.parse_args(argv)


def share_possible(local_url: str, timeout: float = 5.0) -> bool:
    """Whether Gradio's share server answers; if not, print one line saying the app stays local.

    Gradio itself would try, fail and print several lines of advice; offline, one clear line is
    enough. A custom share server (GRADIO_SHARE_SERVER_ADDRESS) is not probed.
    """
    if os.environ.get("GRADIO_SHARE_SERVER_ADDRESS"):
        return True
    import httpx
    from gradio.networking import GRADIO_API_SERVER

    try:
        httpx.get(GRADIO_API_SERVER, timeout=timeout).raise_for_status()
        return True
    except (httpx.HTTPError, OSError) as err:
        print(f"[app] --share: no public link (cannot reach {httpx.URL(GRADIO_API_SERVER).host}: "
              f"{type(err).__name__}); serving locally only at {local_url}", flush=True)
        return False


def main(argv=None) -> int:
    """Start the engine in the background, serve the page; returns the exit status (see serving.serve)."""
    args = parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k not in ("share", "host", "port") and v is not None}
    try:
        config = EngineConfig.load(overrides)
    except ConfigError as err:
        print(serving.start_error_line(err), file=sys.stderr)
        return serving.exit_status(err)
    engine = get_engine(config, background=True)
    gate = serving.RequestGate()
    demo = build_demo(lambda *values, **kw: gate.run(handle_generate, engine, *values, **kw), config, engine)
    demo.queue(max_size=config.max_queue_size, default_concurrency_limit=1)
    share = args.share and share_possible(f"http://{args.host}:{args.port}/")
    return serving.serve(demo, engine, {**serving.launch_options(args.host, args.port, share), "css": PAGE_CSS}, gate)


if __name__ == "__main__":
    sys.exit(main())
