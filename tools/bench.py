"""Benchmark: the engine, its parts, its server and what a user would run instead, side by side in one run.

``python -m tools.bench [--torch-python PATH]`` measures on one model (tiny-shapes):

2. the engine's ``generate`` at guidance 5 (CFG) and at guidance 1 (no CFG, one UNet pass);
3. the engine's parts compiled alone (text encoders once, one CFG denoising step x steps, VAE
   decode): the floor for this machine;
4. served latency: ``gradio_client`` calls of ``/generate`` against ``python app.py``;
5. compiles triggered by changing sampler, CFG mode, prompt, seed, guidance, steps and size;
6. cold start (empty compilation cache) and warm restart: process start to first image;
7. peak host memory (and device memory where the backend reports it);
8. diffusers' PyTorch StableDiffusionXLPipeline on the same safetensors weights, latents, steps
   and size (tools/torch_reference.py in ``--torch-python``'s interpreter; skipped, saying so,
   without it), and how far its images are from the engine's;
9. the host side at 1024²: PNG encoding, the page's handler after the device, and served minus
   engine time.

Medians over ``--runs`` runs after one warm-up, with min and max, the contenders interleaved so
a noisy neighbour slows them alike. Results go to docs/benchmarks.md (a table between markers) and a
JSON file. ``--full-size`` instead lowers the real SDXL base architecture with abstract bfloat16
weights and reports XLA's cost analysis; ``--warm-start`` times full-size starts (tools/warmstart.py);
``--vs-torch --model DIR --torch-python PATH`` runs legs 2 and 8 only, for a full-size folder::

    SDXL_CPU_DEVICES=1 SDXL_IMAGES_PER_REQUEST=1 SDXL_WIDTH=256 SDXL_HEIGHT=256 SDXL_DTYPE=float32 \
        python -m tools.bench --vs-torch --model DIR --steps 4 --runs 3 --torch-python PATH
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from gradio_client import Client
from jax.sharding import PartitionSpec as P
from PIL import Image

from sdxl_engine.config import EngineConfig, apply_jax_options
from sdxl_engine.engine.contract import GenerateResult
from sdxl_engine.engine.local import Engine
from sdxl_engine.engine.steps import StepEvent
from sdxl_engine.engine.validation import GenerateRequest
from sdxl_engine.program.compiling import compile_program
from sdxl_engine.program.generate import (
    ProgramInputs,
    ProgramShape,
    cfg_combine,
    denoised,
    encode_prompts,
    initial_noise,
    latent_shape,
    sampler_update,
    tokenize,
)
from sdxl_engine.program.schedulers import make_schedule
from sdxl_engine.program.sharding import DATA_AXIS
from sdxl_engine.service.delivery import write_served
from sdxl_engine.service.images import encode_pngs
from sdxl_engine.service.request import to_request
from sdxl_engine.service.service import Service
from tools import fullsize, progress_cost, warmstart
from tools.report import write_section
from tools.timing import stats, timed

ROOT = Path(__file__).resolve().parents[1]


class CompileCounter:
    """Counts XLA backend compiles (JAX's monitoring event) while active."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


# ---- 3. the engine's parts alone -------------------------------------------------------------
def engine_parts(engine) -> dict:
    """Callables for text encoding, one CFG UNet + Euler step, and VAE decode, each its own sharded jit."""
    m, mesh, b = engine.model, engine.mesh, engine.batch
    w, h = engine.limits.default_size
    d, r = P(DATA_AXIS), P()
    prediction_type = m.scheduler_config.get("prediction_type", "epsilon")

    def sharded(fn, in_specs, out_specs=d):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    encode_j = sharded(lambda params, ids: encode_prompts(m.components, params, ids), (r, d), (d, d))
    ids = jnp.zeros((2 * b, 2, 77), jnp.int32)
    hidden, pooled = encode_j(engine.params, ids)
    time_ids = jnp.ones((2 * b, 6), jnp.float32)

    def step(params, latents, hidden, pooled, time_ids):
        x = jnp.concatenate([latents, latents])
        t = jnp.full((x.shape[0],), 500.0, jnp.float32)
        out = m.components["unet"].bind(params["unet"])(x, t, hidden, pooled, time_ids).astype(jnp.float32)
        uncond, text = jnp.split(out, 2)
        x0 = denoised(latents, cfg_combine(uncond, text, jnp.full((latents.shape[0],), 7.0)), 1.0, prediction_type)
        return sampler_update(latents, x0, x0, 0.0, 0.9, 0.1, 0.0, 0.0)  # an Euler step, sigma 1 -> 0.9

    step_j = sharded(step, (r, d, d, d, d))
    latents = jnp.zeros((b, *latent_shape(m, h, w)), jnp.float32)

    def decode(params, latents):
        out = m.components["vae"].bind(params["vae"]).decode(latents)
        return jnp.round(jnp.clip(out.astype(jnp.float32) / 2 + 0.5, 0, 1) * 255).astype(jnp.uint8)

    decode_j = sharded(decode, (r, d))
    return {
        "text_encoders": lambda: jax.block_until_ready(encode_j(engine.params, ids)),
        "denoise_step": lambda: step_j(engine.params, latents, hidden, pooled, time_ids).block_until_ready(),
        "vae_decode": lambda: decode_j(engine.params, latents).block_until_ready(),
    }


# ---- 4 and 6. the app as a process -----------------------------------------------------------
def served(args, cache_dir: str, calls: int) -> dict:
    """Start ``python app.py`` with ``cache_dir``; time process start -> first image, then ``calls``."""
    import psutil  # a dev-only dependency (requirements-dev.txt), for the served leg

    with socket.socket() as sock:  # a free loopback port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "SDXL_COMPILE_CACHE_DIR": cache_dir, "SDXL_MODEL": args.model, "PYTHONUNBUFFERED": "1",
           "GRADIO_ANALYTICS_ENABLED": "False"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = None
        while client is None:
            if proc.poll() is not None:
                raise RuntimeError("app exited: " + proc.stdout.read())
            try:
                client = Client(f"http://127.0.0.1:{port}/", verbose=False)
            except Exception:
                time.sleep(0.2)
        request = dict(prompt="a red circle", seed=0, num_inference_steps=args.steps, api_name="/generate")
        client.predict(**request)  # waits for the engine: first image
        first_image = time.perf_counter() - t0
        samples, engine_latency, no_download = [], [], []
        for i in range(calls):
            t1 = time.perf_counter()
            _, info = client.predict(**{**request, "seed": i})
            samples.append(time.perf_counter() - t1)
            engine_latency.append(info["latency_s"])
        bare = Client(f"http://127.0.0.1:{port}/", verbose=False, download_files=False)
        for i in range(calls):
            t1 = time.perf_counter()
            bare.predict(**{**request, "seed": i})
            no_download.append(time.perf_counter() - t1)
        rss = psutil.Process(proc.pid).memory_info().rss
        return {"first_image_s": first_image, "served": stats(samples), "served_no_download": stats(no_download),
                "engine_in_app": stats(engine_latency),
                "server_rss_mb": rss / 2**20}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---- 8. diffusers' PyTorch pipeline, what a user would run instead ------------------------------
def torch_reference(engine, python: str, steps: int, runs: int, workdir: Path) -> dict:
    """diffusers' StableDiffusionXLPipeline (PyTorch, ``python`` must have torch) on the engine's
    weights, initial latents, steps and size, in a subprocess; and the engine's images on the same
    latents (its program with given latents), compared pixel by pixel.

    Returns {"skipped": reason} when the model is not a safetensors folder or ``python`` fails.
    """
    if not diffusers_can_load(engine.model):
        return {"skipped": f"{engine.model.name} is not a safetensors folder diffusers can load"}
    ours = engine_on_latents(engine, steps, workdir)
    return run_torch(python, engine.model.source, ours, steps, runs, workdir)


def diffusers_can_load(model) -> bool:
    """Whether the loaded model came from a folder of safetensors (what the PyTorch pipeline reads)."""
    return bool(model.source) and any(Path(model.source).glob("*/*.safetensors"))


def machine(engine) -> str:
    """The run's machine line: architecture, cores, the engine's devices."""
    return f"{platform.machine()} {os.cpu_count()} cores, {engine.device_summary}"


def engine_on_latents(engine, steps: int, workdir: Path) -> np.ndarray:
    """The engine's images (n, H, W, 3) uint8 from the seed rule's latents for seeds 0..n-1, which
    it also writes to ``workdir/latents.npz`` for the PyTorch pipeline (Euler, guidance 5)."""
    model = engine.model
    width, height = engine.limits.default_size
    latents = np.asarray(initial_noise(np.arange(engine.batch, dtype=np.uint32), latent_shape(model, height, width)))
    np.savez(workdir / "latents.npz", latents=latents)
    program = compile_program(model, engine.params, ProgramShape(engine.batch, height, width,
                                                                 engine.config.max_inference_steps,
                                                                 given_latents=True), engine.mesh)
    ids, _ = tokenize(model, "a red circle on the left")
    empty, _ = tokenize(model, "")
    inputs = ProgramInputs.build(ids, empty, True, range(engine.batch), 5.0,
                                 make_schedule("Euler", model.scheduler_config, steps), steps,
                                 engine.config.max_inference_steps, latents=latents)
    return np.asarray(program.executable(engine.params, inputs)[0])


def run_torch(python: str, source: str, ours: np.ndarray, steps: int, runs: int, workdir: Path) -> dict:
    """tools/torch_reference.py in ``python`` on ``workdir/latents.npz``; its timing and how far its
    images are from ``ours``."""
    cmd = [python, "-m", "tools.torch_reference", "--model", source, "--latents",
           str(workdir / "latents.npz"), "--steps", str(steps), "--runs", str(runs),
           "--out", str(workdir / "torch.npz")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return {"skipped": f"{python} could not run the PyTorch pipeline: {done.stderr.strip().splitlines()[-1:]}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    with np.load(workdir / "torch.npz") as data:
        diff = np.abs(ours.astype(np.int16) - data["images"].astype(np.int16))
    return {**result, "max_abs_diff_255": int(diff.max()), "mean_abs_diff_255": float(diff.mean())}


# ---- 9. the host side at 1024², everything after the device ------------------------------------
class _FixedEngine:
    """An engine stand-in that answers every request with the same images at once (device time 0),
    so the page's host side (PNG encoding, files, JSON, Gradio) is all that is measured."""

    def __init__(self, engine, images):
        self.images, self.model, self.limits, self.startup = images, engine.model, engine.limits, {}
        self.config, self.batch, self.device_summary = engine.config, len(images), engine.device_summary
        self.ready, self.error, self.stage, self.started = threading.Event(), None, "ready", time.perf_counter()
        self.ready.set()

    def scale_out(self):  # the engine contract's: one engine, no replicas
        return None

    def generate(self, request, progress=None, arrived=None, on_step=None, should_stop=None):
        height, width = self.images.shape[1:3]
        request = GenerateRequest(request.prompt, request.negative_prompt or "", 7, 5.0, 20, width, height, "Euler")
        timings = {"prep": 0.0, "device": 0.0, "post": 0.0, "latency": 0.0, "queue": 0.0}
        return GenerateResult(self.images, list(range(7, 7 + self.batch)), request, timings, [], self.batch,
                              self.device_summary, self.model.name)


def host_side(engine, size: int, runs: int) -> dict:
    """Seconds after the device for 4 images of ``size``² (tiny-shapes' images upscaled: its 64² output,
    flat shapes as the model draws them at any size): PNG encoding alone (the engine's writer
    against Pillow's default, what Gradio's Gallery did with PIL images), the page's whole handler,
    and served by a real Gradio server (gradio_client, files downloaded) minus the engine's time."""
    from sdxl_engine.serving import handler
    small = engine.generate(GenerateRequest("a red circle on the left", seed=0, num_inference_steps=20)).images
    images = np.repeat(np.repeat(small, size // small.shape[1], axis=1), size // small.shape[2], axis=2)
    fixed = _FixedEngine(engine, images)
    texts = ["a red circle on the left\nSteps: 20, Sampler: Euler"] * len(images)

    def pil_default():
        for image in images:
            Image.fromarray(image).save(io.BytesIO(), format="PNG")

    service = Service(fixed)
    with tempfile.TemporaryDirectory() as files:
        out = timed({"encode: engine (Sub filter, zlib RLE level 1, parallel)": lambda: encode_pngs(images, texts),
                     "encode: Pillow default (what the Gallery did)": pil_default,
                     "page path after the device (the service's job, the gallery's files)": lambda: _page_path(
                         service, "a red circle on the left", 20, files)}, runs)
    import gradio as gr

    from sdxl_engine.serving import history

    # the app's /generate is an async generator (handler.follow); gradio_client downloads the
    # files of every message it yields and then those of the final answer, so its final PNGs come twice.
    stream = handler.api_function(service, fixed.config, history.Pending())

    async def streaming(text, progress=gr.Progress()):
        async for out in stream(text, None, 7, 5.0, 20, 0, 0, progress=progress):
            yield out

    demos = _served_pair(service, 20, streaming)
    try:
        plain, streamed = (Client(demo.local_url, verbose=False) for demo in demos)
        # gradio_client makes a new httpx client per file, with a TLS context even for http://: without it
        # (ssl_verify=False, harmless on a loopback http:// URL) the downloads' own cost shows.
        no_tls = Client(demos[1].local_url, verbose=False, ssl_verify=False)
        text = "a red circle on the left"
        out.update(timed({
            "served minus engine (gradio_client, 4 PNGs downloaded)":
                lambda: plain.predict(text, api_name="/generate"),
            "served minus engine, streaming /generate (gradio_client downloads the final PNGs twice)":
                lambda: streamed.predict(text, api_name="/generate"),
            "served minus engine, streaming /generate, gradio_client ssl_verify=False":
                lambda: no_tls.predict(text, api_name="/generate"),
        }, runs))
    finally:
        for demo in demos:
            demo.close()
    return {"size": size, "png_kb": [len(p) // 1000 for p in encode_pngs(images, texts)], "seconds": out}


class _SteppingEngine(_FixedEngine):
    """The fixed engine with ``steps`` denoising steps of ``step_s`` seconds of simulated device time, each
    reported to ``on_step``, with a preview (the batch at latent resolution, 1/8 of the images' side)
    every ``preview_every`` steps: the streamed path's host side with a device that takes time."""

    def __init__(self, engine, images, steps: int, step_s: float, preview_every: int):
        super().__init__(engine, images)
        self.steps, self.step_s, self.preview_every = steps, step_s, preview_every
        self.preview = np.ascontiguousarray(images[:, ::8, ::8])

    def generate(self, request, progress=None, arrived=None, on_step=None, should_stop=None):
        t0 = time.perf_counter()
        for k in range(1, self.steps + 1):
            time.sleep(self.step_s)
            if on_step is not None:
                preview = self.preview if self.preview_every and k % self.preview_every == 0 else None
                on_step(StepEvent(k, self.steps, preview, time.perf_counter() - t0))
        return super().generate(request)


def served_stream(engine, size: int, runs: int, steps: int = 20, step_s: float = 0.05, preview_every: int = 5) -> dict:
    """seconds a gradio_client caller waits beyond the simulated device time
    (``steps`` x ``step_s``) for 4 images of ``size``², a preview every ``preview_every`` steps, in one run
    with interleaved rounds: the plain function (no previews: the path before streaming); the app's
    streaming /generate (each preview one grid image: handler._preview_gallery); the same with one file per
    image per preview (the design before the grid, rebuilt here for the comparison)."""
    import gradio as gr

    from sdxl_engine.service.images import png_bytes, write_new
    from sdxl_engine.serving import handler, history

    small = engine.generate(GenerateRequest("a red circle on the left", seed=0, num_inference_steps=20)).images
    images = np.repeat(np.repeat(small, size // small.shape[1], axis=1), size // small.shape[2], axis=2)
    stepping = _SteppingEngine(engine, images, steps, step_s, preview_every)
    device_s = steps * step_s
    grid_gallery = handler._preview_gallery

    def per_image_gallery(event, folder):  # one PNG per image per preview (the design before the grid)
        if not folder:
            folder.append(Path(tempfile.mkdtemp(prefix="sdxl-preview-", dir=gr.utils.get_upload_folder())))
        return [(str(write_new(png_bytes(image), folder[0], f"step{event.step}-{i}")),
                 f"preview · step {event.step}/{event.steps}") for i, image in enumerate(event.preview)]

    service = Service(stepping)
    stream = handler.api_function(service, stepping.config, history.Pending())
    chosen = {"gallery": grid_gallery}

    async def streaming(text, progress=gr.Progress()):
        handler._preview_gallery = chosen["gallery"]
        try:
            async for out in stream(text, None, 7, 5.0, steps, 0, 0, progress=progress):
                yield out
        finally:
            handler._preview_gallery = grid_gallery

    demos = _served_pair(service, steps, streaming)
    try:
        plain, streamed = (Client(demo.local_url, verbose=False) for demo in demos)
        text = "a red circle on the left"

        def stream_with(gallery):
            chosen["gallery"] = gallery
            job = streamed.submit(text, api_name="/generate")
            job.result()
            return job

        previews = {"grid": len(stream_with(grid_gallery).outputs()) - 1}
        out = timed({
            "plain function (no previews)": lambda: plain.predict(text, api_name="/generate"),
            "streaming /generate, a preview = 1 grid PNG (the app)": lambda: stream_with(grid_gallery),
            "streaming /generate, a preview = 4 PNGs (before)": lambda: stream_with(per_image_gallery),
        }, runs)
    finally:
        for demo in demos:
            demo.close()
    minus = {name: {k: v - device_s if k in ("median", "min", "max", "mean") else v for k, v in value.items()}
             for name, value in out.items()}
    return {"size": size, "steps": steps, "step_s": step_s, "preview_every": preview_every, "device_s": device_s,
            "messages_with_previews": previews["grid"], "served_minus_device_s": minus}


def _page_path(service, text: str, steps: int, files: str) -> list[str]:
    """The page's path after the device, without Gradio: the service's job (its PNGs encoded once) and the files
    the gallery serves (delivery.write_served)."""
    job = service.submit(to_request(prompt=text, seed=7, guidance_scale=5.0, num_inference_steps=steps), "bench",
                         "page")
    while not job.done:
        job.wait(len(job.events()), 1.0)
    return write_served(job.result.pngs, job.result.stems, Path(files))


def _served_pair(service, steps: int, streaming) -> list:
    """Two launched pages on free ports: the page's path as a plain function on ``service`` (its last answer only:
    no previews), and ``streaming``."""
    from sdxl_engine.serving import handler

    async def plain(text):
        request = to_request(prompt=text, seed=7, guidance_scale=5.0, num_inference_steps=steps)
        return [out async for out in handler.follow(service, request, None)][-1]

    demos = [served_page(plain), served_page(streaming)]
    for demo in demos:
        demo.queue()
        demo.launch(server_port=_free_port(), prevent_thread_lock=True, quiet=True)
    return demos


def served_page(generate):
    """A page with the app's /generate outputs (a PNG Gallery and the info JSON) around ``generate``.

    Tools import the runtime, never the repository's app.py (STYLE.md rule 21), so this is the
    served path's part that costs time after the device: Gradio's server, the handler, the PNG
    files and their download; the page's other widgets add no per-request work.
    """
    import gradio as gr

    with gr.Blocks() as demo:
        prompt = gr.Textbox()
        gallery = gr.Gallery(columns=2, format="png")
        info = gr.JSON()
        prompt.submit(generate, prompt, [gallery, info], api_name="generate")
    return demo


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- the run ---------------------------------------------------------------------------------
def run(args) -> dict:
    config = EngineConfig.load({"model": args.model, "num_inference_steps": args.steps})
    apply_jax_options(config)
    counter = CompileCounter()
    engine = Engine(config, log=lambda *a: None).start()
    size = engine.limits.default_size[0]
    steps, runs = args.steps, args.runs
    out = {"machine": machine(engine), "model": config.model,
           "steps": steps, "size": size, "batch": engine.batch, "runs": runs, "startup_s": engine.startup}

    request = GenerateRequest("a red circle", seed=0, num_inference_steps=steps)
    no_cfg = GenerateRequest("a red circle", seed=0, num_inference_steps=steps, guidance_scale=1.0)
    device = {"guidance 5 (CFG)": [], "guidance 1 (no CFG)": []}
    parts = engine_parts(engine)
    measured = timed({"engine": lambda: device["guidance 5 (CFG)"].append(engine.generate(request).timings["device"]),
                      "engine, guidance 1": lambda: device["guidance 1 (no CFG)"].append(
                          engine.generate(no_cfg).timings["device"]), **parts}, runs)
    out["engine"], out["engine_guidance_1"] = measured["engine"], measured["engine, guidance 1"]
    out["device_s"] = {k: stats(v[1:]) for k, v in device.items()}  # the first of each was the warm-up
    out["parts"] = {k: measured[k] for k in parts}
    out["parts"]["sum"] = sum(measured[k]["median"] * (steps if k == "denoise_step" else 1) for k in parts)

    # 5. compiles (and the first call's seconds) per change
    def measure(call):
        c0, t0 = counter.count, time.perf_counter()
        call()
        return {"compiles": counter.count - c0, "first_call_s": time.perf_counter() - t0}

    w2, h2 = engine.limits.sizes[1]
    base = dict(prompt="a red circle", seed=0, num_inference_steps=steps)
    changes = {
        "sampler: DPM++ 2M Karras": dict(sampler="DPM++ 2M Karras"),
        "sampler: Euler a": dict(sampler="Euler a"),
        "guidance 1 after guidance 5 (other CFG mode, compiled once above)": dict(guidance_scale=1.0),
        "guidance 0.5 (no CFG again)": dict(guidance_scale=0.5),
        "prompt": dict(prompt="a blue square"),
        "negative_prompt": dict(negative_prompt="blurry"),
        "seed": dict(seed=99),
        "guidance": dict(guidance_scale=2.0),
        "steps": dict(num_inference_steps=steps // 2 or 1),
        "size: precompiled bucket": dict(seed=1),
        f"size: new bucket {w2}x{h2}": dict(width=w2, height=h2),
    }
    out["compiles"] = {name: measure(lambda change=change: engine.generate(GenerateRequest(**{**base, **change})))
                       for name, change in changes.items()}

    # 7. memory
    out["peak_host_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    stats_dev = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
    out["device_peak_bytes"] = (stats_dev or {}).get("peak_bytes_in_use")

    if args.torch_python:
        with tempfile.TemporaryDirectory() as work:
            out["torch"] = torch_reference(engine, args.torch_python, steps, runs, Path(work))
    else:
        out["torch"] = {"skipped": "no --torch-python given (an interpreter with torch and diffusers)"}
    if not args.skip_served:
        out["host_side"] = host_side(engine, 1024, runs)
        with tempfile.TemporaryDirectory() as cache:
            out["cold"] = served(args, cache, runs)
            out["warm"] = served(args, cache, runs)
    return out


def vs_torch(args) -> dict:
    """Legs 2 and 8 alone (``--vs-torch``), for a model too big for the other legs on a CPU (the
    full-size random folder of ``make_fixtures fullsize``; size, devices and dtype from ``SDXL_*``):
    the engine's request timed in a child process (which also makes its images on the shared
    latents and exits), then diffusers' PyTorch pipeline alone, so the two never hold the model in
    memory at once (at full size two float32 copies do not fit this machine together)."""
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, "-m", "tools.bench", "--vs-torch-engine", work, "--model", args.model,
                        "--steps", str(args.steps), "--runs", str(args.runs)], cwd=ROOT, check=True)
        out = json.loads((Path(work) / "engine.json").read_text())
        out["torch"] = run_torch(args.torch_python, out.pop("source"), np.load(Path(work) / "ours.npy"), args.steps,
                                 args.runs, Path(work))
    if "median_s" in out["torch"]:
        out["engine / diffusers PyTorch pipeline"] = out["engine"]["median"] / out["torch"]["median_s"]
    return out


def vs_torch_engine(args, workdir: Path) -> None:
    """The engine's side of ``--vs-torch`` (run in its own process): timing, images, latents to ``workdir``."""
    config = EngineConfig.load({"model": args.model, "num_inference_steps": args.steps})
    apply_jax_options(config)
    engine = Engine(config, log=lambda *a: None).start()
    if not diffusers_can_load(engine.model):
        raise SystemExit(f"error: {args.model} is not a safetensors folder diffusers can load")
    request = GenerateRequest("a red circle on the left", seed=0, num_inference_steps=args.steps, sampler="Euler")
    out = {"machine": machine(engine), "model": config.model,
           "dtype": engine.model.dtype, "size": engine.limits.default_size, "batch": engine.batch, "steps": args.steps,
           "engine": timed({"engine": lambda: engine.generate(request)}, args.runs)["engine"],
           "source": engine.model.source}
    np.save(workdir / "ours.npy", engine_on_latents(engine, args.steps, workdir))
    (workdir / "engine.json").write_text(json.dumps(out, default=str))


def ratios(r: dict) -> dict:
    """The issue's targets as ratios of figures measured in the same run."""
    out = {"engine / sum of parts": r["engine"]["median"] / r["parts"]["sum"],
           "device time, guidance 1 (no CFG) / guidance 5": r["device_s"]["guidance 1 (no CFG)"]["median"]
           / r["device_s"]["guidance 5 (CFG)"]["median"]}
    if "median_s" in r.get("torch", {}):
        out["engine / diffusers PyTorch pipeline"] = r["engine"]["median"] / r["torch"]["median_s"]
    if "cold" in r:
        out["served / engine"] = r["warm"]["served"]["median"] / r["engine"]["median"]
        out["served, response only / engine"] = r["warm"]["served_no_download"]["median"] / r["engine"]["median"]
        out["warm restart / cold start"] = r["warm"]["first_image_s"] / r["cold"]["first_image_s"]
    return out


def markdown(r: dict) -> str:
    """The docs/benchmarks.md table for one run."""
    def row(name, s):
        return f"| {name} | {s['median']:.4f} | {s['min']:.4f} | {s['max']:.4f} |"

    lines = [f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {r['machine']} · model `{r['model']}` · "
             f"{r['batch']} images of {r['size']}² · {r['steps']} steps · medians of {r['runs']} runs after warm-up",
             "", "| what (seconds per request) | median | min | max |", "|---|---|---|---|",
             row("2. engine.generate", r["engine"]),
             row("2b. engine.generate, guidance 1 (no CFG: one UNet pass per image)", r["engine_guidance_1"]),
             row("3a. part: text encoders (once)", r["parts"]["text_encoders"]),
             row("3b. part: one CFG denoising step", r["parts"]["denoise_step"]),
             row("3c. part: VAE decode", r["parts"]["vae_decode"]),
             f"| 3. sum of parts (3a + {r['steps']}×3b + 3c) | {r['parts']['sum']:.4f} | | |"]
    if "cold" in r:
        lines.append(row("4. served: gradio_client /generate, 4 PNGs downloaded (warm app)", r["warm"]["served"]))
        lines.append(row("4b. served: gradio_client /generate, response only (files not fetched)",
                         r["warm"]["served_no_download"]))
        lines.append(row("4c. engine latency reported inside the app", r["warm"]["engine_in_app"]))
    torch_r = r.get("torch", {})
    if "median_s" in torch_r:
        lines.append(f"| 8. diffusers' PyTorch StableDiffusionXLPipeline (torch {torch_r['torch']}, "
                     f"{torch_r['threads']} threads), same weights, latents, steps, size | {torch_r['median_s']:.4f} | "
                     f"{torch_r['min_s']:.4f} | {torch_r['max_s']:.4f} |")
    if "host_side" in r:
        for name, value in r["host_side"]["seconds"].items():
            lines.append(row(f"9. {r['host_side']['size']}², 4 images: {name}", value))
    lines += ["", "| ratio (same run) | value |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in ratios(r).items()]
    lines += ["", "| 5. change from the previous request | engine: compiles | engine: first call |", "|---|---|---|"]
    for name, e in r["compiles"].items():
        lines.append(f"| {name} | {e['compiles']} | {e['first_call_s']:.2f} s |")
    lines += ["", "| start-up and memory | value |", "|---|---|",
              f"| engine start-up: load / compile / warm-up | {r['startup_s']['load_s']:.2f} / "
              f"{r['startup_s']['compile_s']:.2f} / {r['startup_s']['warmup_s']:.2f} s |"]
    if "cold" in r:
        lines += ["| 6. cold start, process start → first image (empty compile cache) | "
                  f"{r['cold']['first_image_s']:.2f} s |",
                  f"| 6. warm restart, process start → first image | {r['warm']['first_image_s']:.2f} s |",
                  f"| app server RSS after the calls | {r['warm']['server_rss_mb']:.0f} MiB |"]
    lines.append(f"| 7. bench process peak host RSS | {r['peak_host_rss_mb']:.0f} MiB |")
    lines.append(f"| 7. device peak bytes | {r['device_peak_bytes'] or 'not reported by this backend'} |")
    if "max_abs_diff_255" in torch_r:
        lines.append(f"| 8. engine vs PyTorch images, same latents: max / mean abs difference | "
                     f"{torch_r['max_abs_diff_255']} / {torch_r['mean_abs_diff_255']:.3f} (of 255) |")
    elif torch_r:
        lines.append(f"| 8. diffusers' PyTorch reference | skipped: {torch_r['skipped']} |")
    if "host_side" in r:
        lines.append(f"| 9. PNG sizes at {r['host_side']['size']}² | {r['host_side']['png_kb']} kB |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model to benchmark (default: the engine's default)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--skip-served", action="store_true", help="skip the app-process measurements (4, 6, 9)")
    parser.add_argument("--torch-python", help="an interpreter with torch and diffusers, for the PyTorch reference (8)")
    parser.add_argument("--full-size", action="store_true", help="lower full-size SDXL base with random weights")
    parser.add_argument("--warm-start", action="store_true",
                        help="full-size start to ready, cold vs warm caches, in fresh processes (tools/warmstart.py)")
    parser.add_argument("--vs-torch", action="store_true",
                        help="only the engine's request and the PyTorch pipeline's (needs --torch-python); "
                             "prints JSON, writes bench_vs_torch.json")
    parser.add_argument("--vs-torch-engine", metavar="DIR", help=argparse.SUPPRESS)  # --vs-torch's child process
    parser.add_argument("--progress-cost", action="store_true",
                        help="only the per-step hook's cost: device time with progress/previews on and off "
                             "(tools/progress_cost.py); prints JSON, writes bench_progress.json")
    parser.add_argument("--served-stream", action="store_true",
                        help="served minus device time at 1024², plain vs streaming with previews (grid vs per image)")
    parser.add_argument("--md", default=str(ROOT / "docs/benchmarks.md"))
    parser.add_argument("--json", default=str(ROOT / "docs" / "benchmarks" / "bench.json"))
    args = parser.parse_args(argv)
    if args.full_size:
        return fullsize.main(args)
    if args.warm_start:
        return warmstart.main(args)
    args.model = args.model or EngineConfig.model
    if args.progress_cost:
        result = progress_cost.main(args)
        Path(args.json).with_name("bench_progress.json").write_text(json.dumps(result, indent=2, default=str))
        print(json.dumps(result, indent=1, default=str))
        return
    if args.served_stream:
        config = EngineConfig.load({"model": args.model})
        apply_jax_options(config)
        result = served_stream(Engine(config, log=lambda *a: None).start(), 1024, args.runs)
        Path(args.json).with_name("bench_served_stream.json").write_text(json.dumps(result, indent=2, default=str))
        print(json.dumps(result, indent=1, default=str))
        return
    if args.vs_torch_engine:
        return vs_torch_engine(args, Path(args.vs_torch_engine))
    if args.vs_torch:
        if not args.torch_python:
            parser.error("--vs-torch needs --torch-python (an interpreter with torch and diffusers)")
        result = vs_torch(args)
        Path(args.json).with_name("bench_vs_torch.json").write_text(json.dumps(result, indent=2, default=str))
        print(json.dumps(result, indent=1, default=str))
        return
    result = run(args)
    Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    write_section(Path(args.md), "tiny", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
