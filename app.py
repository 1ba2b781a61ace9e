"""Gradio page in front of the SDXL engine. UI only: every model call goes through one engine.

Run ``python app.py`` (see ``--help``). The page's Generate event is also the API endpoint
``/generate``: keyword inputs ``prompt, negative_prompt, seed, guidance_scale,
num_inference_steps, width, height``; outputs the gallery and a JSON object with ``seeds``,
``latency_s`` and ``device_count`` (and more, documented in the README).
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

import gradio as gr

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine import EngineNotReady, GenerationError, get_engine
from sdxl_engine.images import a1111_parameters, to_pil
from sdxl_engine.validation import GenerateRequest, InvalidRequest

TITLE = "Fast Stable Diffusion XL with JAX"
# Prompts in the vocabulary of the default model, tiny-shapes (sdxl_engine/shapes.py).
EXAMPLES = ["a red circle on a blue background", "a large green square at the top", "a small yellow star on the left",
            "a purple triangle on a white background", "a large pink cross in the centre on a black background"]
DEMO_MODEL_NOTE = ("Model `{model}`: a small demo model (SDXL architecture, 64×64, trained here on captioned shapes: "
                   "circle, square, triangle, star, cross, diamond; 8 colours; left/right/top/bottom/centre; small/large; "
                   "white/black/gray/blue backgrounds). For real SDXL start with "
                   "`python app.py --model stabilityai/stable-diffusion-xl-base-1.0 --revision refs/pr/95`.")


def handle_generate(engine, prompt, negative_prompt, seed, guidance_scale, num_inference_steps, width, height):
    """One /generate call: widget values in, (gallery items, info dict) out; gr.Error on bad input."""
    size = {} if not width and not height else {"width": width or None, "height": height or None}
    request = GenerateRequest(prompt=prompt, negative_prompt=negative_prompt or "", seed=-1 if seed is None else seed,
                              guidance_scale=guidance_scale, num_inference_steps=num_inference_steps, **size)
    try:
        result = engine.generate(request)
    except (InvalidRequest, EngineNotReady, GenerationError) as err:
        raise gr.Error(str(err)) from err
    req = result.request
    latency = result.timings["latency"]
    texts = [a1111_parameters(req.prompt, req.negative_prompt, req.num_inference_steps, req.guidance_scale, s,
                              req.width, req.height, result.model) for s in result.seeds]
    gallery = [(image, f"seed {s} · {latency:.2f} s") for image, s in zip(to_pil(result.images, texts), result.seeds)]
    for warning in result.warnings:
        gr.Warning(warning)
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
    }
    return gallery, info


def status_line(info: dict) -> str:
    """The one line under the gallery: latency breakdown and devices."""
    if not info:
        return ""
    t = info["timings_s"]
    return (f"**{info['latency_s']:.2f} s** for {len(info['seeds'])} images on {info['device']} "
            f"(queue {t['queue']:.2f} s · prep {t['prep']:.3f} s · device {t['device']:.2f} s · "
            f"post {t['post']:.3f} s) — {info['width']}×{info['height']}, {info['num_inference_steps']} steps, "
            f"model `{info['model']}`")


def build_demo(generate: Callable, config: EngineConfig) -> gr.Blocks:
    """The page. ``generate`` has handle_generate's signature minus the engine (tests pass a fake)."""
    with gr.Blocks(title=TITLE) as demo:
        gr.Markdown(f"# {TITLE}\nFour images per prompt, generated in parallel across the accelerator's devices.")
        if config.model in ("tiny-shapes", "tiny-random"):
            gr.Markdown(DEMO_MODEL_NOTE.format(model=config.model))
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", placeholder="a red circle on a blue background", scale=5,
                                lines=1, max_lines=3)
            run = gr.Button("Generate", variant="primary", scale=1)
        gallery = gr.Gallery(label="Images", columns=2, format="png", height="auto", object_fit="contain")
        status = gr.Markdown()
        with gr.Accordion("Advanced settings", open=False):
            negative_prompt = gr.Textbox(label="Negative prompt", placeholder="what to avoid")
            guidance_scale = gr.Slider(0.0, 20.0, value=config.guidance_scale, step=0.5, label="Guidance scale")
            num_inference_steps = gr.Slider(1, config.max_inference_steps, value=config.num_inference_steps, step=1,
                                            label="Steps")
            seed = gr.Number(value=-1, precision=0, minimum=-1, maximum=config.max_seed, label="Seed (-1 = random)")
            with gr.Row():
                width = gr.Number(value=0, precision=0, label="Width (px, 0 = model default)")
                height = gr.Number(value=0, precision=0, label="Height (px, 0 = model default)")
        info = gr.JSON(label="Details", open=False)
        gr.Examples(EXAMPLES, inputs=[prompt])
        inputs = [prompt, negative_prompt, seed, guidance_scale, num_inference_steps, width, height]

        def generate_images(prompt: str, negative_prompt: str | None = None, seed: int = -1,
                            guidance_scale: float = config.guidance_scale,
                            num_inference_steps: int = config.num_inference_steps, width: int = 0, height: int = 0):
            # Named parameters: gradio_client callers use these keywords (the /generate contract).
            return generate(prompt, negative_prompt, seed, guidance_scale, num_inference_steps, width, height)

        event = gr.on([run.click, prompt.submit], generate_images, inputs, [gallery, info], api_name="generate",
                      concurrency_id="engine", concurrency_limit=1)
        event.success(status_line, info, status, api_visibility="private")
    return demo


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--share", action="store_true", help="ask Gradio for a public link")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    for name in ("model", "revision", "dtype", "width", "height", "num_inference_steps", "max_inference_steps",
                 "images_per_request", "cpu_devices", "compile_cache_dir"):
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                            help=f"engine setting {name} (env SDXL_{name.upper()})")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k not in ("share", "host", "port") and v is not None}
    config = EngineConfig.load(overrides)
    engine = get_engine(config, background=True)
    demo = build_demo(lambda *values: handle_generate(engine, *values), config)
    demo.queue(max_size=config.max_queue_size, default_concurrency_limit=1)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share)


if __name__ == "__main__":
    main()
