"""Gradio page in front of the SDXL engine. UI only: every model call goes through one engine.

Run ``python app.py`` (see ``--help``). The page's Generate event is also the API endpoint
``/generate``: keyword inputs ``prompt, negative_prompt, seed, guidance_scale,
num_inference_steps, width, height`` and the optional ``style`` and ``sampler``; outputs the
gallery and a JSON object with ``seeds``, ``latency_s`` and ``device_count`` (and more,
documented in the README). Serving (launch options, HTTP guard, clean stop), the command line
and the browser history live in ``sdxl_engine/serving``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

from sdxl_engine.serving import cli, delivery, history, scaleout, server

if __name__ == "__main__":  # before Gradio is imported: it reads GRADIO_TEMP_DIR and GRADIO_SERVER_PORT at import
    server.usable_output_dir()
    if (bad_env := cli.environment_error()) is not None:
        print(f"error: bad setting: {bad_env}", file=sys.stderr)
        sys.exit(server.EXIT_BAD_SETTING)

import gradio as gr
from gradio.networking import GRADIO_API_SERVER
from starlette.exceptions import StarletteDeprecationWarning

from sdxl_engine.config import ConfigError, EngineConfig
from sdxl_engine.engine.local import EngineNotReady, GenerationError, get_engine, with_model_defaults
from sdxl_engine.checkpoint.loading import ModelLoadError, engine_defaults
from sdxl_engine.program.schedulers import SAMPLERS
from sdxl_engine.serving.styles import NO_STYLE, STYLE_NAMES, UnknownStyle, apply_style, get_style
from sdxl_engine.engine.validation import MAX_GUIDANCE, GenerateRequest, InvalidRequest

# Gradio uses Starlette names deprecated since (HTTP_422_UNPROCESSABLE_ENTITY): warnings in the
# server log per request that only Gradio can act on.
warnings.filterwarnings("ignore", category=StarletteDeprecationWarning, module=r"gradio(\.|$)")

TITLE = "Fast Stable Diffusion XL with JAX"
# Prompts in the vocabulary of the default model, tiny-shapes (sdxl_engine/assets/tiny-shapes/vocabulary.txt).
EXAMPLES = ["a red circle on a blue background", "a large green square at the top", "a small yellow star on the left",
            "a purple triangle on a white background", "a large pink cross in the centre on a black background"]
# The examples select no style: a style's added words ("anime artwork ...") are outside
# tiny-shapes' vocabulary and pull its images off the prompt (QA: 10 of 16 styled images had the right colour).
STAGES = {  # engine stage -> (progress fraction, what the page says)
    "compiling": (0.03, "Compiling the program for this size (first request at it; reused afterwards)"),
    "preparing": (0.05, "Preparing: tokenizing the prompts, scheduling {steps} {sampler} steps"),
    "on device": (0.1, "On {devices}: encoding the prompts, denoising {steps} steps, decoding with the VAE"),
    "to host": (0.9, "Copying {n} images to the host"),
}
MODEL_NOTES = {  # shown under the banner for the built-in models
    "tiny-shapes": "Model `tiny-shapes`: a small demo model (SDXL architecture, 64×64, trained here on captioned "
                   "shapes: circle, square, triangle, star, cross, diamond; 8 colours; left/right/top/bottom/centre; "
                   "small/large; white/black/gray/blue backgrounds). ",
    "tiny-random": "Model `tiny-random`: the SDXL architecture with random weights (for tests): expect noise. ",
}
# The blog's setting (the config's own defaults), one click away when a model's engine_defaults.json chose another.
BLOG_DEFAULT = (EngineConfig.sampler, EngineConfig.num_inference_steps)
# Ends with the command (no full stop after it): on a phone the code wraps, and a stop would sit alone on a line.
REAL_SDXL_HINT = "For real SDXL, start it with: `python app.py --model stabilityai/stable-diffusion-xl-base-1.0`"
# At 1280x800 the 2x2 gallery is as wide as the window's height allows, so all four images show
# without scrolling. Below 768 px the columns stack with the gallery first, right under the
# prompt; scroll anchoring is off there, or the browser scrolls the images away as it grows.
# There the prompt and Generate, and the resolution and seed, take a line each (side by side
# they squeeze the text). Toasts sit at the bottom left, off the Generate button (top right)
# and the gallery; on a phone, at the bottom. The history's tiles fill the width (no sideways
# scrolling); captions wrap instead of ending in "…".
PAGE_CSS = """
#gallery .grid-container { max-width: max(240px, min(100%, calc(100vh - 380px))); margin-inline: auto; }
@media (max-width: 767px) { #output-col { order: -1; } #main-row { overflow-anchor: none; }
  #prompt-row, #size-row, #size-row .form { flex-wrap: wrap; }
  #prompt-row > *, #size-row > *, #size-row .form > * { flex: 1 1 100% !important; } }
.toast-wrap { top: auto !important; bottom: var(--size-3) !important; left: var(--size-3) !important;
  right: auto !important; align-items: start !important; }
@media (max-width: 767px) { .toast-wrap { right: var(--size-3) !important; width: auto !important; } }
#history .grid-container { grid-template-columns: repeat(auto-fill, minmax(120px, 1fr)) !important; }
#history .caption-label, #gallery .caption-label { white-space: normal !important; overflow: visible !important;
  text-overflow: clip !important;
  max-width: calc(100% - 8px) !important; line-height: 1.2; }
"""
HISTORY_KEY = "sdxl-jax-history"  # the BrowserState's localStorage key
HISTORY_NOTE = "Click an image to restore its prompt, style, seed and settings."
# The history gallery, drawn in the browser from the records' JPEG data URLs (the server writes no
# thumbnail), in history.entry's order. A history this browser kept but cannot read now (the history
# key changed: README, "History") comes back empty; a count kept beside it tells that case apart.
HISTORY_JS = """(past) => { const records = Array.isArray(past) ? past : [];
  const items = [];
  for (const r of records) {
    if (!r || !Array.isArray(r.seeds) || !Array.isArray(r.thumbs)) continue;
    const style = r.style && r.style !== %s ? ` · ${r.style}` : '';
    r.seeds.forEach((seed, i) => { const url = r.thumbs[i];
      if (typeof url !== 'string' || !url.startsWith('data:image/jpeg;base64,')) return;
      items.push({image: {url: url, orig_name: `seed${seed}.jpg`, mime_type: 'image/jpeg'},
                  caption: `seed ${seed}${style} · ${String(r.prompt).slice(0, 40)}`});
    });
  }
  const countKey = %s + '-count', kept = Number(localStorage.getItem(countKey) || 0);
  const lost = records.length === 0 && kept > 0 && localStorage.getItem(%s) !== null;
  if (!lost) localStorage.setItem(countKey, String(records.length));
  document.querySelector('#history')?.setAttribute('data-drawn', String(Date.now()));  /* when it was drawn last */
  return [items, lost ? %s : %s]; }""" % (json.dumps(NO_STYLE), json.dumps(HISTORY_KEY), json.dumps(HISTORY_KEY),
    json.dumps("This browser's earlier history cannot be read: the server's history key changed since it was saved "
               "(README, \"History\"). New generations start a new history."), json.dumps(HISTORY_NOTE))
# An emptied history is not an unreadable one: the count beside it goes to 0 first. (The one output's
# value is wrapped in a list: Gradio reads an array returned by a page script as the list of outputs.)
CLEAR_HISTORY_JS = f"() => {{ localStorage.setItem({json.dumps(HISTORY_KEY + '-count')}, '0'); return [[]]; }}"
PARSE_SIZE_JS = "(v) => String(v || '0x0').split('x').map(Number)"  # "WxH" -> [width, height], as parse_size
SCROLL_TO_GALLERY_JS = """() => { if (window.innerWidth < 768) {  /* after the page's own updates settle */
  setTimeout(() => document.querySelector('#gallery')?.scrollIntoView({block: 'start'}), 100); } }"""


def refuse(err: Exception) -> gr.Error:
    """The gr.Error for a request the engine refused (bad input, not started) or that failed with
    a message for the user (an unusable image, a lost Ray replica: GenerationError), after one
    log line that says which: neither is a traceback in the server log."""
    print(f"[app] request {'failed' if isinstance(err, GenerationError) else 'refused'}: {err}", flush=True)
    return gr.Error(str(err), print_exception=False)


def handle_generate(engine, prompt, negative_prompt, seed, guidance_scale, num_inference_steps, width, height,
                    style=NO_STYLE, sampler=None, progress: Callable | None = None, files_dir: str | None = None,
                    arrived: float | None = None):
    """One /generate call: values as the client sent them in; (gallery items, info, history record) out.

    The engine validates every value (width/height 0 or None = the model's default; sampler None
    = the engine's default). Raises gr.Error with the engine's message for bad input, an engine
    that is not ready or an unusable image; any other failure is logged and reported without
    internals. ``style`` names a preset of sdxl_engine.serving.styles (applied here, so the engine sees
    plain text). ``arrived`` (``time.monotonic()`` at the server, server.arrival_time) makes
    ``timings_s.queue`` count the wait in Gradio's queue too.

    ``progress(fraction, desc=...)`` (a gr.Progress) hears each stage; while the engine is still
    starting, the request waits and reports the start-up stage and elapsed seconds.

    The gallery items are (PNG path, caption): the PNGs (with their A1111 parameters) lie in a new
    folder under ``files_dir`` (default: Gradio's temp folder, which serves them as they are),
    named after seed and prompt (``seed42-a-red-circle.png``, the download's name). With the
    config's ``outputs_dir`` they are saved there too, as ``<µs time>-<request id>-seed42-...png``.
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
                              width=width, height=height, sampler=sampler)

    def on_stage(stage: str) -> None:
        fraction, text = STAGES.get(stage, (None, stage))
        steps = engine.limits.default_steps if num_inference_steps is None else num_inference_steps
        report(fraction, desc=text.format(steps=steps, sampler=sampler or engine.limits.default_sampler,
                                          devices=engine.device_summary, n=engine.batch))

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
    try:
        out = delivery.deliver(result, prompt, style, files_dir or gr.utils.get_upload_folder(),
                               engine.config.outputs_dir)
    except OSError as err:
        print(f"[app] error: could not write the images to Gradio's temp folder: {err}", flush=True)
        raise gr.Error(f"the server could not store the images ({type(err).__name__}); please retry later",
                       print_exception=False) from err
    if out.save_error is not None:  # the images are still shown and downloadable; saving is best-effort
        print(f"[app] warning: could not save to outputs_dir {engine.config.outputs_dir!r}: {out.save_error}",
              flush=True)
        gr.Warning(out.save_warning)
    info, label = out.info, "" if style == NO_STYLE else f" · {style}"
    gallery = [(path, f"seed {s}{label} · {info['latency_s']:.2f} s") for path, s in zip(out.paths, result.seeds)]
    for warning in result.warnings:
        gr.Warning(warning if style == NO_STYLE else f"{warning} (the {style} style adds words around yours)")
    record = history.make_record({"prompt": prompt, "negative_prompt": negative_prompt, "style": style}, info,
                                 result.images)
    return gallery, info, record


def status_line(info: dict) -> str:
    """The one line under the gallery: latency breakdown, devices, size, steps, sampler, style and model."""
    if not isinstance(info, dict) or "timings_s" not in info:  # empty, or a raw call to this page event
        return ""
    t = info["timings_s"]
    saved = " · saved to the server's outputs folder" if info.get("saved") else ""
    replica = f" (replica `{info['replica']}`)" if info.get("replica") else ""
    ray = f" · ray {t['ray']:.2f} s" if "ray" in t else ""
    return (f"**{info['latency_s']:.2f} s** for {len(info['seeds'])} images on **{info['device']}**{replica} "
            f"(queue {t['queue']:.2f} s · prep {t['prep']:.3f} s · device {t['device']:.2f} s · "
            f"post {t['post']:.3f} s{ray}) — {info['width']}×{info['height']}, {info['num_inference_steps']} "
            f"{info.get('sampler', 'Euler')} steps, CFG {info['guidance_scale']:g}, seeds {info['seeds'][0]}–"
            f"{info['seeds'][-1]}, style **{info.get('style', NO_STYLE)}**, model `{info['model']}`{saved}")


def engine_banner(engine) -> tuple[str, bool]:
    """(Markdown for the status banner, whether the engine is done starting) for ``engine``."""
    if engine is None:
        return "", True
    elapsed = time.perf_counter() - engine.started
    if not engine.ready.is_set():
        return (f"**Starting the engine: {engine.stage}** — {elapsed:.0f} s so far. "
                "Requests sent now wait and run as soon as it is ready."), False
    if engine.error is not None:
        return f"**The engine failed to start:** {engine.error}", True
    ready_s = engine.startup.get("ready_s", elapsed)
    counts = getattr(engine, "replicas", None)  # scale-out mode (sdxl_engine.serving.replicas.RemoteEngine)
    if counts is None:
        return (f"Ready on **{engine.device_summary}** — model `{engine.model.name}` ({engine.model.dtype}), "
                f"started in {ready_s:.1f} s"), True
    return (f"**{engine.count_text()}** on Ray Serve, each on **{engine.device_summary}** — model "
            f"`{engine.model.name}` ({engine.model.dtype}), first replica ready in {ready_s:.1f} s"), counts.settled


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


def parse_size(value: str) -> tuple[int, int]:
    """"WxH" from the resolution list -> (width, height) in pixels; "0x0" = the model's default."""
    w, h = (value or "0x0").split("x")
    return int(w), int(h)


def page_event(fn: Callable) -> Callable:
    """``fn`` as a page event: input it cannot use (only a client other than the page sends it)
    is refused with one log line and a gr.Error, not a traceback."""
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except gr.Error:
            raise
        except (LookupError, TypeError, ValueError, AttributeError) as err:
            print(f"[app] page event {fn.__name__} refused: {type(err).__name__}: {err}"[:300], flush=True)
            raise gr.Error("this page event got values the page does not send", print_exception=False) from err
    return guarded


def build_demo(generate: Callable, config: EngineConfig, engine=None, concurrency: int = 1,
               history_secret: str | None = None) -> gr.Blocks:
    """The page. ``generate`` has handle_generate's signature minus the engine (tests pass a fake).

    ``engine`` (optional) feeds the start-up banner and the resolution list; without it the page
    offers the model's default size only. ``concurrency``: requests run at once (the one place
    that serialises them: one per engine). ``history_secret``: the browsers' history key
    (history.browser_secret: this, else SDXL_HISTORY_SECRET, else the one kept in the cache folder).

    Only ``/generate`` is an API endpoint; the page's other events are private (the HTTP guard,
    sdxl_engine.serving.server.Routes, lets them through only as the page calls them), and every
    one that runs on the server is a :func:`page_event`. None writes a file: the history's
    thumbnails are drawn in the browser (HISTORY_JS).
    """
    with gr.Blocks(title=TITLE) as demo:
        gr.Markdown(f"# {TITLE}\nFour images per prompt, generated in parallel across the accelerator's devices.")
        banner = gr.Markdown(engine_banner(engine)[0], elem_id="engine-status")
        if config.model in MODEL_NOTES:
            gr.Markdown(MODEL_NOTES[config.model] + REAL_SDXL_HINT, elem_id="model-note")
        with gr.Row(equal_height=True, elem_id="prompt-row"):  # the prompt, across the page
            prompt = gr.Textbox(label="Prompt", placeholder="a red circle on a blue background", scale=5,
                                lines=1, max_lines=3, elem_id="prompt")
            run = gr.Button("Generate", variant="primary", scale=1, min_width=120, elem_id="generate")
        with gr.Row(elem_id="main-row"):
            with gr.Column(scale=2, elem_id="settings-col"):  # how to make it
                style = gr.Radio(list(STYLE_NAMES), value=NO_STYLE, label="Style", elem_id="style")
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
                    sampler = gr.Dropdown(list(SAMPLERS), value=config.sampler, label="Sampler", elem_id="sampler")
                    guidance_scale = gr.Slider(0.0, MAX_GUIDANCE, value=config.guidance_scale, step=0.5,
                                               label="Guidance scale (≤ 1: no CFG, one UNet pass per image)")
                    num_inference_steps = gr.Slider(1, config.max_inference_steps, value=config.num_inference_steps,
                                                    step=1, precision=0, label="Steps",
                                                    elem_id="steps")  # precision 0: an int in the API
                    blog_default = gr.Button(f"Blog default ({BLOG_DEFAULT[0]}, {BLOG_DEFAULT[1]} steps)", size="sm",
                                             elem_id="blog-default")
                    with gr.Row(visible=False):  # set from the resolution list; still the API's width/height
                        width = gr.Number(value=0, precision=0, label="Width (px, 0 = model default)")
                        height = gr.Number(value=0, precision=0, label="Height (px, 0 = model default)")
            with gr.Column(scale=3, elem_id="output-col"):  # what came out (first on a phone: PAGE_CSS)
                gallery = gr.Gallery(label="Images", columns=2, format="png", object_fit="contain",
                                     buttons=["download", "fullscreen"], interactive=False, elem_id="gallery")
                status = gr.Markdown(elem_id="result-status")
                with gr.Accordion("Details (JSON, as the API returns it)", open=False):
                    info = gr.JSON(label="Details")
        # A Dataset of index type, not gr.Examples: Gradio's own example loader fails with a traceback on
        # an index the page never sends; this one refuses it in one line (page_event).
        examples = gr.Dataset(components=[prompt, style], samples=[[text, NO_STYLE] for text in EXAMPLES],
                              type="index", label="Examples (click to fill the prompt and style)", elem_id="examples")
        with gr.Accordion("History (this browser)", open=True):
            history_note = gr.Markdown(HISTORY_NOTE, elem_id="history-note")
            history_gallery = gr.Gallery(label="Past generations", show_label=False, columns=10, height=300,
                                         allow_preview=False,
                                         fit_columns=False, format="jpeg", interactive=False, elem_id="history")
            clear_history = gr.Button("Clear history", size="sm")
        past = gr.BrowserState([], storage_key=HISTORY_KEY, secret=history.browser_secret(history_secret))
        selected_seed = gr.State(None)
        pending = history.Pending()  # each generation's history record, until this browser's history takes it

        def generate_images(prompt: str, negative_prompt: str | None = None, seed: int = -1,
                            guidance_scale: float = config.guidance_scale,
                            num_inference_steps: int = config.num_inference_steps, width: int = 0, height: int = 0,
                            style: str = NO_STYLE, sampler: str = config.sampler, request: gr.Request = None,
                            progress=gr.Progress()):
            # Named parameters: gradio_client callers use these keywords (the /generate contract);
            # only optional inputs are ever added, at the end. ``request`` and ``progress`` are Gradio's.
            gallery, info, record = generate(prompt, negative_prompt, seed, guidance_scale, num_inference_steps, width,
                                             height, style, sampler, progress=progress,
                                             arrived=server.arrival_time(request))
            pending.put(getattr(request, "session_hash", None), record)
            return gallery, info

        # On a narrow screen bring the gallery into view for the progress, and again once the images are in.
        gr.on([run.click, prompt.submit], None, None, None, js=SCROLL_TO_GALLERY_JS, queue=False,
              api_visibility="private")
        # preprocess=False: values reach the engine as sent, so its checks and messages (with the
        # argument's name) apply to page and API alike, instead of Gradio's unnamed bound checks.
        event = gr.on([run.click, prompt.submit], generate_images,
                      [prompt, negative_prompt, seed, guidance_scale, num_inference_steps, width, height, style, sampler],
                      [gallery, info], api_name="generate", concurrency_id="engine",
                      concurrency_limit=concurrency, preprocess=False)
        event.success(page_event(status_line), info, status, api_visibility="private")
        event.failure(None, None, status, js="() => ''", api_visibility="private")  # the line was the last request's
        event.success(None, None, None, js=SCROLL_TO_GALLERY_JS, queue=False, api_visibility="private")

        @page_event
        def remember(past: list, request: gr.Request):
            return history.remember(past if isinstance(past, list) else [], pending.pop(request.session_hash))

        event.success(remember, past, past, api_visibility="private", show_progress="hidden").then(
            None, past, [history_gallery, history_note], js=HISTORY_JS, api_visibility="private")
        event.success(lambda: (None, gr.Button("Reuse selected image's seed", interactive=False)), None,
                      [selected_seed, reuse], api_visibility="private", queue=False)

        @page_event
        def select_image(info: dict, evt: gr.SelectData):
            seed = info["seeds"][evt.index] if info and evt.index is not None else None
            return seed, gr.Button(f"Reuse seed {seed}" if seed is not None else "Reuse selected image's seed",
                                   interactive=seed is not None)

        gallery.select(select_image, info, [selected_seed, reuse], api_visibility="private", queue=False)
        # The seed kept by select_image is server-side state (gr.State), so this one runs on the server.
        reuse.click(page_event(lambda s: -1 if s is None else int(s)), selected_seed, seed, api_visibility="private",
                    queue=False)
        # These two need nothing from the server: done in the browser, so there is no handler to call.
        randomize.click(None, None, seed, js="() => -1", api_visibility="private")
        blog_default.click(page_event(lambda: BLOG_DEFAULT), None, [sampler, num_inference_steps],
                           api_visibility="private", queue=False)
        resolution.change(None, resolution, [width, height], js=PARSE_SIZE_JS, api_visibility="private")

        @page_event
        def restore(past: list, evt: gr.SelectData):
            rec, seed_value = history.entry(past, evt.index)
            return (rec["prompt"], rec["negative_prompt"], rec["style"], seed_value, rec["guidance_scale"],
                    rec["num_inference_steps"], rec.get("sampler", "Euler"), f"{rec['width']}x{rec['height']}",
                    f"Restored seed {seed_value} from {rec['time']} ({rec['model']}); press **Generate** to make it again.")

        history_gallery.select(restore, past, [prompt, negative_prompt, style, seed, guidance_scale,
                                               num_inference_steps, sampler, resolution, history_note],
                               api_visibility="private", queue=False)
        clear_history.click(None, None, past, js=CLEAR_HISTORY_JS, api_visibility="private").then(
            None, past, [history_gallery, history_note], js=HISTORY_JS, api_visibility="private")

        @page_event
        def load_example(index: int):
            if type(index) is not int or not 0 <= index < len(EXAMPLES):
                raise IndexError(f"no example {index!r}")
            return EXAMPLES[index], NO_STYLE

        examples.click(load_example, examples, [prompt, style], api_visibility="private", queue=False,
                       show_progress="hidden")

        timer = gr.Timer(1.0, active=engine is not None and not engine.ready.is_set())

        @page_event
        def refresh():
            text, done = engine_banner(engine)
            if not done:
                return text, gr.Dropdown(), gr.Timer(active=True)
            sizes, value = size_choices(engine)
            return text, gr.Dropdown(choices=sizes, value=value), gr.Timer(active=False)

        timer.tick(refresh, None, [banner, resolution, timer], api_visibility="private", queue=False,
                   show_progress="hidden")
        if getattr(engine, "replicas", None) is not None:  # scale-out: the replica count after each request
            event.then(lambda: engine_banner(engine)[0], None, banner, api_visibility="private", queue=False,
                       show_progress="hidden")
        demo.load(refresh, None, [banner, resolution, timer], api_visibility="private", queue=False,
                  show_progress="hidden")
        demo.load(None, past, [history_gallery, history_note], js=HISTORY_JS, api_visibility="private")
    return demo


def page_defaults(config: EngineConfig) -> EngineConfig:
    """``config`` with the model's engine_defaults.json where it set nothing: the page's sampler, steps and
    guidance, which are also the API's defaults (read before the engine has loaded the model, which applies the
    same file; a hub id's file is read only then, so the page keeps the config's values for it).

    Raises ConfigError or ModelLoadError for a file the engine would refuse too.
    """
    return with_model_defaults(config, engine_defaults(config.model), config.model)


def main(argv=None) -> int:
    """Start the engine in the background, serve the page; returns the exit status (see server.serve)."""
    args = cli.parse_args(argv, TITLE)
    signals = server.StopSignals()  # from here on a stop signal ends in a clean stop, not the default kill
    signals.install()
    try:
        config = EngineConfig.load(cli.engine_overrides(args))
        page_config = page_defaults(config)
        cli.check_outputs_dir(config.outputs_dir)
    except (ConfigError, ModelLoadError) as err:
        print(server.start_error_line(err), file=sys.stderr)
        return server.exit_status(err)
    if (taken := server.port_error(args.host, args.port)) is not None:
        print(f"error: cannot serve on {args.host}:{args.port}: {taken}", file=sys.stderr)
        return server.EXIT_START_FAILED
    try:
        engine, concurrency = start_engine(config, args)
    except (ConfigError, RuntimeError) as err:  # a bad scale-out setting (2); Ray could not start or join (1)
        print(server.start_error_line(err), file=sys.stderr)
        return server.exit_status(err)
    gate = server.RequestGate()
    demo = build_demo(lambda *values, **kw: gate.run(handle_generate, engine, *values, **kw), page_config, engine,
                      concurrency=concurrency, history_secret=args.history_secret)
    demo.queue(max_size=config.max_queue_size)
    share = args.share and cli.share_possible(f"http://{args.host}:{args.port}/", GRADIO_API_SERVER)
    try:
        return server.serve(demo, engine, {**server.launch_options(args.host, args.port, share), "css": PAGE_CSS},
                            gate, signals=signals)
    finally:
        if args.replicas is not None:
            engine.close()  # after the drain: delete the Serve application, stop the private Ray cluster


def start_engine(config: EngineConfig, args) -> tuple:
    """(engine, page concurrency): the local engine started in the background (one request at a
    time), or with ``--replicas`` the stand-in for the Ray Serve replicas (one request per replica)."""
    if args.replicas is None:
        return get_engine(config, background=True), 1
    scaleout.ray_environment(private=args.ray_address is None)  # before Ray's import, which reads it
    # Imported only here: without --replicas `python app.py` never loads Ray (README, "Scale-out on Ray Serve").
    from sdxl_engine.serving import replicas

    engine = replicas.RemoteEngine.launch(config, args.replicas, address=args.ray_address, app_name=args.ray_app,
                                          resources=args.replica_resources)
    return engine, engine.slots


if __name__ == "__main__":
    status = main()
    # No interpreter teardown: a stop while the engine still compiles in its background thread
    # would tear down JAX under that thread (a segfault after "[app] stopped"). Everything the
    # process owns is closed by now; only the output buffers are left to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
