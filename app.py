"""The Gradio page in front of the SDXL engine: layout and events only; ``python app.py`` (see ``--help``) serves it.

Its Generate event is also the API endpoint ``/generate``: keyword inputs ``prompt, negative_prompt, seed,
guidance_scale, num_inference_steps, width, height`` and the optional ``style`` and ``sampler``; outputs the gallery
and a JSON object (``seeds``, ``latency_s``, ``device_count`` ...: README). The request handler, the process's life
(flags, HTTP guard, clean stop), the history and the page's CSS/scripts live in ``sdxl_engine/serving``.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Callable

from sdxl_engine.serving import main as process  # imports nothing heavy: no Gradio, no JAX

TITLE = "Fast Stable Diffusion XL with JAX"
if __name__ == "__main__":  # first: stop signals handled, flags and settings checked (exit 2), Gradio's variables
    START = process.prepare(TITLE)

import gradio as gr

from sdxl_engine.checkpoint.loading import model_loras
from sdxl_engine.checkpoint.lora import available_names
from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.contract import EngineContract, clock
from sdxl_engine.engine.validation import MAX_GUIDANCE
from sdxl_engine.program.schedulers import SAMPLERS
from sdxl_engine.serving import handler, history
from sdxl_engine.serving.apis.a1111 import generation_parameters, sampler_of
from sdxl_engine.serving.apis.core import ApiError
from sdxl_engine.serving.page_assets import (CLEAR_HISTORY_JS, HISTORY_JS, HISTORY_KEY, HISTORY_NOTE, MODEL_NOTES,
                                             PAGE_CSS, PARSE_SIZE_JS, REAL_SDXL_HINT, SCROLL_TO_GALLERY_JS,
                                             NEW_REQUEST_JS, PNG_SETTINGS_HTML, PNG_SETTINGS_JS, STOP_STEP_JS)
from sdxl_engine.serving.styles import (FAST_LABEL, FAST_LORA, FAST_PRESET, NO_STYLE, STYLE_NAMES, get_style,
                                        has_fast_tag, with_fast_tag, without_fast_tag)

# Prompts in the vocabulary of the default model, tiny-shapes (sdxl_engine/assets/tiny-shapes/vocabulary.txt).
EXAMPLES = ["a red circle on a blue background", "a large green square at the top", "a small yellow star on the left",
            "a purple triangle on a white background", "a large pink cross in the centre on a black background"]
# No style in the examples: a style's added words ("anime artwork ...") pull tiny-shapes' images off the prompt.
# The blog's setting (the config's own defaults), one click away when a model's engine_defaults.json chose another.
BLOG_DEFAULT = (EngineConfig.sampler, EngineConfig.num_inference_steps)
def lora_names_for(config: EngineConfig) -> list[str]:
    """The LoRA names the engine will load: the deployment's and the model's own (its loras.json)."""
    return available_names(config.lora, config.lora_dir, os.pathsep, model_loras(config.model))


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


def stopped_view(last: dict | None, heard: str) -> tuple:
    """(gallery, info, status) for the page after its request failed: a Stop (``heard`` says where it
    stopped) gets the line saying so and the last finished request's gallery and details back (``last``:
    ``{"gallery": [(path, caption)...], "info": {...}}`` as handler.api_function keeps it, or None: then an
    empty gallery, not a half-made preview); any other failure (``heard`` "") leaves the gallery and clears
    the line, which described the last request.

    ``heard``: what the page last showed of the stopped request (STOP_STEP_JS): ``"k/N"`` (step k of N,
    from the preview's caption or the progress line), ``"waiting"`` (no step yet), or ``""`` (no Stop).
    Raises ValueError for any other text, TypeError for a non-string (only a client other than the page
    sends them).
    """
    if heard == "":
        return gr.update(), gr.update(), ""
    if heard == "waiting":
        said = "Stopped before its first step; nothing saved."
    elif (match := re.fullmatch(r"(\d{1,6})/(\d{1,6})", heard)) is not None:
        said = f"Stopped at step {int(match[1])} of {int(match[2])}; nothing saved."
    else:
        raise ValueError(f"heard: expected 'k/N', 'waiting' or '', got {heard[:40]!r}")
    if not last:
        return [], None, f"**{said}**"
    return last["gallery"], last["info"], f"**{said}** Below, the last finished request: {status_line(last['info'])}"


PNG_FIELDS = {"prompt": "prompt", "negative_prompt": "negative prompt", "style": "style", "seed": "seed",
              "guidance_scale": "CFG", "num_inference_steps": "steps", "sampler": "sampler", "resolution": "size"}
MAX_PARAMETERS_CHARS = 60_000  # a parameters text is a few kB; PNG_SETTINGS_JS sends at most this


def _unstyled(style: str, prompt: str, negative: str) -> tuple[str, str] | None:
    """(prompt, negative prompt) as typed before ``style`` was applied (styles.apply_style), or None when the
    texts are not that style's output."""
    template = get_style(style)
    before, _, after = template.prompt.partition("{prompt}")
    if not (prompt.startswith(before) and prompt.endswith(after) and len(prompt) >= len(before) + len(after)):
        return None
    typed = prompt[len(before):len(prompt) - len(after)]
    extra = template.negative_prompt
    if not extra:
        return typed, negative
    if negative == extra:
        return typed, ""
    return (typed, negative[:-len(extra) - 2]) if negative.endswith(", " + extra) else None


def png_settings(text: str, sizes: list[str], max_steps: int, max_seed: int) -> tuple[dict, str]:
    """The page's settings from a PNG's ``parameters`` text (this server's or A1111's; parsed by A1111's rules:
    apis.a1111.generation_parameters): ({field of PNG_FIELDS: value}, a Markdown note saying what was
    restored and what was not, and why).

    ``sizes``: the page's resolution values ("WxH"); ``max_steps``, ``max_seed``: the page's limits. A style
    the page has is taken back out of the prompt texts (the PNG holds them styled); a value the page cannot
    take (a sampler or size it lacks, steps past the limit) is left as it is and named in the note. A blank
    text (the browser found no ``parameters`` chunk) restores nothing. Raises TypeError or ValueError for
    text the page's script never sends (not a string, longer than MAX_PARAMETERS_CHARS)."""
    if not isinstance(text, str) or len(text) > MAX_PARAMETERS_CHARS:
        raise ValueError(f"text: expected a parameters text of at most {MAX_PARAMETERS_CHARS} characters")
    if not text.strip():
        return {}, "That file has no generation parameters (no `parameters` text in a PNG): nothing restored."
    fields = generation_parameters(text)
    values = {"prompt": fields["Prompt"], "negative_prompt": fields["Negative prompt"], "style": NO_STYLE}
    left: list[str] = []
    style = fields.get("Style", NO_STYLE)
    if style != NO_STYLE:
        typed = _unstyled(style, values["prompt"], values["negative_prompt"]) if style in STYLE_NAMES else None
        if typed is None:
            why = "the prompts are not its output" if style in STYLE_NAMES else "not one of this page's"
            left.append(f"style {style[:40]!r} ({why}: its words stay in the prompt)")
        else:
            values.update(prompt=typed[0], negative_prompt=typed[1], style=style)
    number = {"seed": ("Seed", int, 0, max_seed), "guidance_scale": ("CFG scale", float, 0.0, MAX_GUIDANCE),
              "num_inference_steps": ("Steps", int, 1, max_steps)}
    for name, (key, kind, low, high) in number.items():
        if key not in fields:
            continue
        try:
            value = kind(fields[key])
        except ValueError:
            value = None
        if value is not None and low <= value <= high:
            values[name] = value
        else:
            left.append(f"{key} {fields[key][:20]!r} (this page takes {low:g} to {high:g})")
    if "Sampler" in fields:
        try:
            values["sampler"] = sampler_of(fields["Sampler"], fields.get("Schedule type")) or values.get("sampler")
        except ApiError:
            left.append(f"sampler {(fields['Sampler'] + ' ' + fields.get('Schedule type', '')).strip()[:40]!r} "
                        f"(not one of this server's)")
    if "Size-1" in fields and "Size-2" in fields:
        size = f"{fields['Size-1']}x{fields['Size-2']}"
        if size in sizes:
            values["resolution"] = size
        else:
            left.append(f"size {size} (not one of this model's sizes)")
    values = {name: value for name, value in values.items() if value is not None}
    restored = ", ".join(label for name, label in PNG_FIELDS.items() if name in values)
    note = f"Restored from the PNG: {restored}; press **Generate** to make it again."
    return values, note + (f" Not restored: {'; '.join(left)}." if left else "")


def engine_banner(engine: EngineContract | None) -> tuple[str, bool]:
    """(Markdown for the status banner, whether the engine is done starting) for ``engine``."""
    if engine is None:
        return "", True
    elapsed = clock() - engine.started
    if not engine.ready.is_set():
        return (f"**Starting the engine: {engine.stage}** — {elapsed:.0f} s so far. "
                "Requests sent now wait and run as soon as it is ready."), False
    if engine.error is not None:
        return f"**The engine failed to start:** {engine.error}", True
    ready_s = engine.startup.get("ready_s", elapsed)
    scale = engine.scale_out()
    if scale is None:
        return (f"Ready on **{engine.device_summary}** — model `{engine.model.name}` ({engine.model.dtype}), "
                f"started in {ready_s:.1f} s"), True
    return (f"**{scale.text}** on Ray Serve, each on **{engine.device_summary}** — model "
            f"`{engine.model.name}` ({engine.model.dtype}), first replica ready in {ready_s:.1f} s"), scale.settled


def size_choices(engine: EngineContract | None) -> tuple[list[tuple[str, str]], str]:
    """Resolution dropdown (label, "WxH") choices and the default value; ("model default", "0x0") until ready."""
    if engine is None or not engine.ready.is_set() or engine.error is not None:
        return [("model default", "0x0")], "0x0"
    default = engine.limits.default_size
    choices = []
    for w, h in engine.limits.sizes:
        shape = "square" if w == h else "landscape" if w > h else "portrait"
        choices.append((f"{w} × {h} ({shape}{', default' if (w, h) == default else ''})", f"{w}x{h}"))
    return choices, f"{default[0]}x{default[1]}"


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


def build_demo(generate: Callable, config: EngineConfig, engine: EngineContract | None = None, concurrency: int = 1,
               history_secret: str | None = None) -> gr.Blocks:
    """The page. ``generate`` has serving.handler.handle_generate's signature minus the engine (tests pass a fake).

    ``engine`` (optional) feeds the start-up banner and the resolution list; without it the page offers the
    model's default size only. ``concurrency``: requests run at once (the one place that serialises them: one
    per engine). ``history_secret``: the browsers' history key (history.browser_secret: this, else
    SDXL_HISTORY_SECRET, else the one kept in the cache folder). Only ``/generate`` is an API endpoint; the
    other events are private (guard.Routes lets them through only as the page calls them), and each one that
    runs on the server is a :func:`page_event`. None writes a file: the history's thumbnails are drawn in the
    browser (HISTORY_JS)."""
    with gr.Blocks(title=TITLE) as demo:
        gr.Markdown(f"# {TITLE}\nFour images per prompt, generated in parallel across the accelerator's devices.")
        banner = gr.Markdown(engine_banner(engine)[0], elem_id="engine-status")
        if config.model in MODEL_NOTES:
            gr.Markdown(MODEL_NOTES[config.model] + REAL_SDXL_HINT, elem_id="model-note")
        with gr.Row(equal_height=True, elem_id="prompt-row"):  # the prompt, across the page
            prompt = gr.Textbox(label="Prompt", placeholder="a red circle on a blue background", scale=5,
                                lines=1, max_lines=3, elem_id="prompt")
            run = gr.Button("Generate", variant="primary", scale=1, min_width=120, elem_id="generate")
            stop = gr.Button("Stop", variant="stop", scale=0, min_width=80, elem_id="stop")  # issue #23
        # (#22) One line on the prompt syntax (engine/prompts.py; README, "Prompt syntax").
        gr.Markdown(f"`(word:1.3)` `(word)` more, `[word]` less; `BREAK` starts a new chunk; up to "
                    f"{config.max_prompt_chunks * 75} tokens.", elem_id="prompt-hint")
        with gr.Row(elem_id="main-row"):
            with gr.Column(scale=2, elem_id="settings-col"):  # how to make it
                style = gr.Radio(list(STYLE_NAMES), value=NO_STYLE, label="Style", elem_id="style")
                with gr.Row(elem_id="preset-row"):  # (#26) few steps, or back to the model's own setting
                    fast = gr.Button(FAST_LABEL, size="sm", elem_id="fast-preset",
                                     visible=FAST_LORA in lora_names_for(config))
                    model_default = gr.Button(f"Model default ({config.sampler}, {config.num_inference_steps} steps)",
                                              size="sm", elem_id="model-default")
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
        # (#21) The loaded LoRAs: a click adds its <lora:NAME:1> tag to the prompt (the engine reads the tags).
        lora_names = lora_names_for(config)
        lora_list = gr.Dataset(components=[prompt], samples=[[f"<lora:{name}:1>"] for name in lora_names],
                               type="index", label="LoRAs (click to add its tag to the prompt; edit the weight, -4 to 4)",
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
        last_result = gr.State(None)  # the last finished request's gallery and details, shown again after a Stop
        # Where the page's Stop found its request (STOP_STEP_JS), "" when there was no Stop; kept in the browser.
        heard = gr.Textbox("", visible="hidden", elem_id="stop-heard")
        pending = history.Pending()  # each generation's history record, until this browser's history takes it
        finished = history.Pending(max_per_session=1)  # each session's last finished gallery, until it is kept

        # named as the /generate API's inputs
        generate_images = handler.api_function(generate, config, pending, finished)

        # On a narrow screen bring the gallery into view for the progress, and again once the images are in.
        gr.on([run.click, prompt.submit], None, None, None, js=SCROLL_TO_GALLERY_JS, queue=False,
              api_visibility="private")
        # A Stop's line described the stopped request: a new one takes it away (a finished one's line stays).
        gr.on([run.click, prompt.submit], None, status, [status, heard], js=NEW_REQUEST_JS, queue=False,
              api_visibility="private")
        # preprocess=False: values reach the engine as sent, so its checks and messages (with the
        # argument's name) apply to page and API alike, instead of Gradio's unnamed bound checks.
        event = gr.on([run.click, prompt.submit], generate_images,
                      [prompt, negative_prompt, seed, guidance_scale, num_inference_steps, width, height, style, sampler],
                      [gallery, info], api_name="generate", concurrency_id="engine",
                      concurrency_limit=concurrency, preprocess=False)
        event.success(page_event(status_line), info, status, api_visibility="private")
        # Issue #23: Stop cancels this browser's request; Gradio closes its generator, which stops the engine
        # after the running step (handler.stream_previews). Nothing else: another browser's request runs on.
        # The page then says where it stopped and shows the last finished result again, not the half-made
        # preview (stopped_view). The step is read in the browser as the Stop is clicked; the rest runs as the
        # cancelled event's failure, which Gradio's page sends once the cancel is through: previews still on
        # their way before that would otherwise land on the restored gallery.
        stop.click(None, None, heard, js=STOP_STEP_JS, cancels=[event], api_visibility="private", queue=False)
        event.failure(page_event(stopped_view), [last_result, heard], [gallery, info, status],
                      api_visibility="private", queue=False, show_progress="hidden")
        event.success(None, None, None, js=SCROLL_TO_GALLERY_JS, queue=False, api_visibility="private")

        @page_event
        def remember(past: list, request: gr.Request):
            return history.remember(past if isinstance(past, list) else [], pending.pop(request.session_hash))

        @page_event
        def keep_result(request: gr.Request):
            return finished.pop(request.session_hash)

        event.success(keep_result, None, last_result, api_visibility="private", queue=False, show_progress="hidden")
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
        # (#26) Leaving the fast preset: its tag goes and the guidance comes back (the blog button's first event
        # above still sets just the sampler and steps).
        blog_default.click(page_event(lambda text: (without_fast_tag(text), config.guidance_scale)
                                      if has_fast_tag(text) else (gr.update(), gr.update())),
                           prompt, [prompt, guidance_scale], api_visibility="private", queue=False)
        fast.click(page_event(lambda text: (*FAST_PRESET, with_fast_tag(text))), prompt,
                   [sampler, num_inference_steps, guidance_scale, prompt], api_visibility="private", queue=False)
        model_default.click(page_event(lambda text: (config.sampler, config.num_inference_steps, config.guidance_scale,
                                                     without_fast_tag(text))), prompt,
                            [sampler, num_inference_steps, guidance_scale, prompt], api_visibility="private",
                            queue=False)
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
        def restore_png(text: str):
            values, note = png_settings(text, [value for _, value in size_choices(engine)[0]],
                                        config.max_inference_steps, config.max_seed)
            return (*(values.get(name, gr.update()) for name in PNG_FIELDS), note)

        # The browser sends the PNG's parameters text only (PNG_SETTINGS_JS): no file reaches the server.
        png_file.input(restore_png, png_file, [prompt, negative_prompt, style, seed, guidance_scale,
                                               num_inference_steps, sampler, resolution, png_note],
                       api_visibility="private", queue=False, show_progress="hidden")

        @page_event
        def load_example(index: int):
            if type(index) is not int or not 0 <= index < len(EXAMPLES):
                raise IndexError(f"no example {index!r}")
            return EXAMPLES[index], NO_STYLE

        examples.click(load_example, examples, [prompt, style], api_visibility="private", queue=False,
                       show_progress="hidden")

        @page_event
        def add_lora(index: int, text: str | None):
            if type(index) is not int or not 0 <= index < len(lora_names):
                raise IndexError(f"no LoRA {index!r}")
            tag = f"<lora:{lora_names[index]}:1>"
            return f"{text.rstrip()} {tag}" if isinstance(text, str) and text.strip() else tag

        lora_list.click(add_lora, [lora_list, prompt], prompt, api_visibility="private", queue=False,
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
        if engine is not None and engine.scale_out() is not None:  # scale-out: the replica count after each request
            event.then(lambda: engine_banner(engine)[0], None, banner, api_visibility="private", queue=False,
                       show_progress="hidden")
        demo.load(refresh, None, [banner, resolution, timer], api_visibility="private", queue=False,
                  show_progress="hidden")
        demo.load(None, past, [history_gallery, history_note], js=HISTORY_JS, api_visibility="private")
    return demo


if __name__ == "__main__":  # the process's life (exit statuses, clean stop): sdxl_engine/serving/main.py
    process.run(build_demo, PAGE_CSS, TITLE, start=START)
