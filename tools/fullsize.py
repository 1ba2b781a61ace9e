"""Full-size SDXL base on this machine: XLA's cost of a request, and parity with diffusers' PyTorch.

    python -m tools.bench --full-size          # cost: lower the real architecture, count FLOPs
    python -m tools.fullsize parity DIR        # DIR from `make_fixtures fullsize --out DIR`
    python -m tools.fullsize load DIR --dtype bfloat16   # load time and peak memory alone
    python -m tools.fullsize refiner DIR       # DIR from `tools.fullsize_refiner_fixture --out DIR` (torch venv)

``cost``: SDXL 1.0 base's real configs (sdxl_engine/checkpoint/configs/sdxl-base-1.0) with *abstract*
bfloat16 parameters (shapes only, no memory): one CFG UNet step, one VAE decode and the two text
encoders at 1024², lowered and counted by XLA, and the engine's whole program lowered too.

``parity``: random full-size weights saved as safetensors by diffusers/transformers' PyTorch
classes (``tools.make_fixtures fullsize``), loaded by the engine's loader in bfloat16
(load time and peak memory against the parameters' size) and in float32, then compared with the
PyTorch outputs saved beside them: the text encoders, one UNet call with CFG (batch 2, 64x64
latents, i.e. 512²) and one VAE decode, at rtol 1e-3.

``refiner``: a random full-size SDXL refiner folder loaded by the engine's loader in bfloat16 (a fresh process:
seconds, peak RSS growth, bytes per component), then XLA's buffer plan (``compile().memory_analysis()``: argument,
output and temporary bytes) of the engine's base program and of its base + refiner program
(``ProgramShape(refiner=True)``) at 1024², CFG, one image per device (and base + refiner at four), with abstract
bfloat16 parameters (SDXL base's configs, the refiner folder's configs), each compiled for this machine's backend
in a fresh process (``plan``), beside the plan of one CFG UNet call of the same model alone. Writes
bench_refiner_fullsize.json. On CPU the plan is the CPU compiler's, an approximation of an accelerator's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from sdxl_engine.checkpoint import builtin
from sdxl_engine.checkpoint.loading import LoadedModel, check_refiner, load_folder, model_kind, read_model_folder
from sdxl_engine.models import build_component
from sdxl_engine.program.compiling import jit_program
from sdxl_engine.program.generate import ImageConditioning, ProgramInputs, ProgramShape, keep_known, latent_shape
from sdxl_engine.program.sharding import make_mesh
from tools.report import write_section

ROOT = Path(__file__).resolve().parents[1]


def sdxl_base_model(dtype: str = "bfloat16") -> LoadedModel:
    """SDXL 1.0 base's components with abstract parameters (ShapeDtypeStructs), no tokenizers."""
    components = {n: build_component(n, c) for n, c in builtin.SDXL_BASE_CONFIGS.items()}
    return LoadedModel(name="sdxl-base-abstract", components=components,
                       params={n: c.abstract(jnp.dtype(dtype)) for n, c in components.items()},
                       tokenizer=None, tokenizer_2=None, scheduler_config=dict(builtin.SDXL_SCHEDULER), dtype=dtype)


def count_params(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def lowered_flops(fn, *args) -> float:
    """XLA's FLOP count of ``jax.jit(fn)`` lowered for abstract ``args`` (no compile, no run)."""
    cost = jax.jit(fn).lower(*args).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def cost_report(size: int = 1024, steps: int = 20, images: int = 4) -> dict:
    """FLOPs of one CFG UNet step, one VAE decode and the text encoders at ``size``² (bfloat16).

    Per request: images x (steps x unet_cfg_step + vae_decode) + text encoders (prompt and
    negative prompt for every image), as the engine's program runs them.
    """
    t0 = time.perf_counter()
    model = sdxl_base_model()
    c, p = model.components, model.params
    s, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    latent = size // model.vae_scale_factor

    def unet_cfg_step(params, x, t, hidden, text_embeds, time_ids):
        return c["unet"].bind(params)(x, t, hidden, text_embeds, time_ids)

    def text_encoders(p1, p2, ids):
        out2 = c["text_encoder_2"].bind(p2)(ids)
        return c["text_encoder"].bind(p1)(ids, penultimate_only=True).penultimate, out2.penultimate, out2.text_embeds

    def unet_step(rows: int) -> float:  # rows = 2 per image with CFG (uncond + text), 1 without
        return lowered_flops(unet_cfg_step, p["unet"], s((rows, 4, latent, latent), jnp.float32),
                             s((rows,), jnp.float32), s((rows, 77, 2048), bf16), s((rows, 1280), bf16),
                             s((rows, 6), jnp.float32))

    flops = {
        "unet_cfg_step": unet_step(2),
        "unet_step_no_cfg": unet_step(1),
        "vae_decode": lowered_flops(lambda params, z: c["vae"].bind(params).decode(z), p["vae"],
                                    s((1, 4, latent, latent), jnp.float32)),
        "vae_encode": lowered_flops(lambda params, x: c["vae"].bind(params).encode(x)[0], p["vae"],
                                    s((1, 3, size, size), jnp.float32)),
        "text_encoders_per_prompt": lowered_flops(text_encoders, p["text_encoder"], p["text_encoder_2"],
                                                  s((1, 77), jnp.int32)),
    }
    t1 = time.perf_counter()
    mesh = make_mesh()
    shape = ProgramShape(images, size, size, steps)

    def program_flops(shape: ProgramShape) -> float:
        lowered = jit_program(model, shape, mesh).lower(model.params, ProgramInputs.abstract(
            shape, latent_shape(model, size, size), mesh))
        cost = lowered.cost_analysis()
        return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])

    plain_program = program_flops(shape)
    program_lower_s = time.perf_counter() - t1
    # Image input: the img2img and inpainting programs against text to image. The inpainting program's excess over
    # img2img's (its per-step blend) is below the float32 resolution of XLA's total (about 8 MFLOP at 1e14: the
    # rounding of such totals), so the blend is counted on its own, for all images at once.
    img2img_program = program_flops(dataclasses.replace(shape, init_image=True))
    inpaint_program = program_flops(dataclasses.replace(shape, init_image=True, inpaint=True))
    lat = s((images, 4, latent, latent), jnp.float32)
    flops["inpaint_blend_per_step"] = lowered_flops(
        lambda x, known, noise, mask, sigmas, n: keep_known(x, ImageConditioning(known, noise, mask), SimpleNamespace(
            sigmas=sigmas, num_steps=n), 3), lat, lat, lat, s((images, 1, latent, latent), jnp.float32),
        s((steps + 1,), jnp.float32), s((), jnp.int32))
    hires = hires_costs(model, flops, size, steps, images)
    per_request = images * (steps * flops["unet_cfg_step"] + flops["vae_decode"]
                            + 2 * flops["text_encoders_per_prompt"])
    no_cfg = images * (steps * flops["unet_step_no_cfg"] + flops["vae_decode"] + flops["text_encoders_per_prompt"])
    return {
        "size": size, "steps": steps, "images": images, "dtype": "bfloat16",
        "params": {k: count_params(v) for k, v in p.items()},
        "tflop": {k: v / 1e12 for k, v in flops.items()},
        "tflop_per_request": per_request / 1e12,
        "tflop_per_request_no_cfg": no_cfg / 1e12,
        "unet_no_cfg_over_cfg": flops["unet_step_no_cfg"] / flops["unet_cfg_step"],
        "program_tflop_lowered": {"plain": plain_program / 1e12},
        "hires": hires,
        "image_input": image_input_costs(flops, steps, images, plain_program, img2img_program, inpaint_program),
        "lower_s": time.perf_counter() - t0,
        "engine_program_lower_s": program_lower_s,
        "platform": jax.devices()[0].platform,
    }


def hires_costs(model: LoadedModel, flops: dict, size: int, steps: int, images: int, scale: float = 1.5,
                strength: float = 0.7) -> dict:
    """Hires fix ``size``² -> (``size`` x ``scale``)² at the default strength and ``hires_steps`` 0 (the second pass
    runs int(steps x strength) of ``steps``): each pass's count from the parts (a CFG UNet step and a VAE decode
    lowered at the large size; the first pass has no decode). TFLOP per request."""
    c, p, s = model.components, model.params, jax.ShapeDtypeStruct
    large = int(size * scale) // model.size_multiple * model.size_multiple
    lat = large // model.vae_scale_factor
    unet = lowered_flops(lambda params, x, t, hidden, text_embeds, time_ids: c["unet"].bind(params)(
        x, t, hidden, text_embeds, time_ids), p["unet"], s((2, 4, lat, lat), jnp.float32), s((2,), jnp.float32),
        s((2, 77, 2048), jnp.bfloat16), s((2, 1280), jnp.bfloat16), s((2, 6), jnp.float32))
    decode = lowered_flops(lambda params, z: c["vae"].bind(params).decode(z), p["vae"],
                           s((1, 4, lat, lat), jnp.float32))
    runs = min(int(steps * strength), steps)
    text = images * 2 * flops["text_encoders_per_prompt"]
    first = images * steps * flops["unet_cfg_step"] + text
    second = images * (runs * unet + decode)
    txt = images * (steps * flops["unet_cfg_step"] + flops["vae_decode"]) + text
    return {"size": size, "large": large, "strength": strength, "second_pass_steps_run": runs,
            "unet_cfg_step_large_tflop": unet / 1e12, "vae_decode_large_tflop": decode / 1e12,
            "first_pass_tflop": first / 1e12, "second_pass_tflop": second / 1e12,
            "ratio_to_txt2img": (first + second) / txt}


def image_input_costs(flops: dict, steps: int, images: int, txt2img: float, img2img: float, inpaint: float) -> dict:
    """Image to image's cost at full size from the parts: strength s runs int(steps x s) UNet steps (diffusers'
    get_timesteps) plus one VAE encode per image; inpainting with a plain UNet adds its per-step blend (counted on its
    own: the programs' totals cannot resolve it). TFLOP per request."""
    text = images * 2 * flops["text_encoders_per_prompt"]
    txt = images * (steps * flops["unet_cfg_step"] + flops["vae_decode"]) + text
    blend = flops["inpaint_blend_per_step"]
    out = {"program_tflop_lowered": {"txt2img": txt2img / 1e12, "img2img": img2img / 1e12, "inpaint": inpaint / 1e12},
           "img2img_program_excess_tflop": (img2img - txt2img) / 1e12,
           "vae_encode_share_of_request": images * flops["vae_encode"] / txt,
           "inpaint_blend_flops_per_step": blend,
           "inpaint_blend_share_of_unet_cfg_step": blend / flops["unet_cfg_step"],
           "per_request_tflop": {}}
    for strength in (0.3, 0.5, 0.75, 1.0):
        run = min(int(steps * strength), steps)
        cost = images * (run * flops["unet_cfg_step"] + flops["vae_encode"] + flops["vae_decode"]) + text
        out["per_request_tflop"][str(strength)] = {"steps_run": run, "tflop": cost / 1e12,
                                                   "ratio_to_txt2img": cost / txt}
    return out


def markdown(r: dict) -> str:
    p = r["params"]
    return "\n".join([
        f"Full-size SDXL base, abstract bfloat16 weights, lowered on `{r['platform']}` (not run) in "
        f"{r['lower_s']:.0f} s:",
        "", "| what | value |", "|---|---|",
        f"| UNet params | {p['unet'] / 1e9:.3f} B |",
        f"| text encoders params | {p['text_encoder'] / 1e6:.0f} M + {p['text_encoder_2'] / 1e6:.0f} M |",
        f"| VAE params | {p['vae'] / 1e6:.1f} M |",
        f"| one CFG UNet step at {r['size']}² (batch 2) | {r['tflop']['unet_cfg_step']:.2f} TFLOP |",
        f"| one VAE decode at {r['size']}² | {r['tflop']['vae_decode']:.2f} TFLOP |",
        f"| text encoders, one prompt | {r['tflop']['text_encoders_per_prompt'] * 1e3:.1f} GFLOP |",
        f"| the engine's whole program ({r['images']} × {r['size']}², {r['steps']} steps) lowered in | "
        f"{r['engine_program_lower_s']:.0f} s |",
        f"| one request: {r['images']} images × ({r['steps']} steps + decode) + prompts | "
        f"{r['tflop_per_request']:.0f} TFLOP |",
        f"| one UNet step without CFG (guidance ≤ 1, batch 1) | {r['tflop']['unet_step_no_cfg']:.2f} TFLOP "
        f"({r['unet_no_cfg_over_cfg']:.4f} × the CFG step) |",
        f"| one request without CFG | {r['tflop_per_request_no_cfg']:.0f} TFLOP |",
        f"| one VAE encode at {r['size']}² (image to image) | {r['tflop']['vae_encode']:.2f} TFLOP "
        f"({r['image_input']['vae_encode_share_of_request'] * 100:.1f} % of a text-to-image request for all images) |",
        *(f"| img2img at strength {k} ({v['steps_run']} of {r['steps']} steps + encode) | {v['tflop']:.0f} TFLOP "
          f"({v['ratio_to_txt2img']:.3f} × text to image) |" for k, v in r["image_input"]["per_request_tflop"].items()),
        f"| hires fix {r['hires']['size']}² -> {r['hires']['large']}² (strength {r['hires']['strength']}, "
        f"{r['hires']['second_pass_steps_run']} of {r['steps']} steps at the large size) | first pass "
        f"{r['hires']['first_pass_tflop']:.0f} TFLOP (no decode) + second {r['hires']['second_pass_tflop']:.0f} TFLOP "
        f"(a CFG step {r['hires']['unet_cfg_step_large_tflop']:.2f}, "
        f"the decode {r['hires']['vae_decode_large_tflop']:.2f}) "
        f"= {r['hires']['ratio_to_txt2img']:.2f} × text to image at {r['size']}² |",
        f"| inpainting's per-step blend (plain UNet, all images; XLA count of keep_known) | "
        f"{r['image_input']['inpaint_blend_flops_per_step']:.3g} FLOP "
        f"({r['image_input']['inpaint_blend_share_of_unet_cfg_step'] * 100:.2g} % of a CFG UNet step) |",
    ])


def _rss(field: str) -> int:
    """Bytes of ``VmRSS`` / ``VmHWM`` (peak) in /proc/self/status (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # Linux: VmHWM := VmRSS
        f.write("5")


def timed_load(folder: Path, dtype: str) -> tuple[LoadedModel, dict]:
    """Load ``folder`` in ``dtype`` onto the default device; seconds, peak RSS growth and params bytes."""
    _reset_peak()
    before, t0 = _rss("VmRSS"), time.perf_counter()
    model = load_folder(folder, folder.name, dtype, log=lambda *_: None)
    jax.block_until_ready(model.params)
    nbytes = sum(v.nbytes for c in model.params.values() for v in c.values())
    return model, {"dtype": dtype, "load_s": time.perf_counter() - t0, "params_gb": nbytes / 1e9,
                   "component_gb": {n: sum(v.nbytes for v in c.values()) / 1e9 for n, c in model.params.items()},
                   "peak_growth_gb": (_rss("VmHWM") - before) / 1e9,
                   "peak_over_params": (_rss("VmHWM") - before) / nbytes}


def measure_load(folder: Path, dtype: str) -> dict:
    """:func:`timed_load` in a fresh process (a process's peak memory is only clean once)."""
    out = subprocess.run([sys.executable, "-m", "tools.fullsize", "load", str(folder), "--dtype", dtype],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- ``refiner``: base + refiner at full size, the refiner's load and XLA's buffer plan of the program -------------

PLAN_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
               "generated_code_size_in_bytes")


def abstract_refiner(folder: Path, dtype: str = "bfloat16") -> LoadedModel:
    """The refiner in ``folder`` (its configs and model_index.json only, no weights read) with abstract parameters:
    text_encoder_2 and UNet, what the engine keeps of a refiner (engine/local.py ``_load_refiner``: the VAE's freed)."""
    index = json.loads((folder / "model_index.json").read_text())
    components = read_model_folder(folder)
    return LoadedModel(name=f"{folder.name}-abstract", components=components,
                       params={n: components[n].abstract(jnp.dtype(dtype)) for n in ("text_encoder_2", "unet")},
                       tokenizer=None, tokenizer_2=None, scheduler_config=dict(builtin.SDXL_SCHEDULER), dtype=dtype,
                       kind=model_kind(index, components))


def unet_call_plan(model: LoadedModel, size: int, images: int = 1) -> dict:
    """``memory_analysis()`` of one CFG UNet call (2 rows per image: negative, prompt) of ``model`` alone at
    ``size``², its abstract parameters and conditioning in bfloat16 (the shapes the program's loop body feeds it),
    compiled."""
    s, unet = jax.ShapeDtypeStruct, model.components["unet"]
    latent = size // model.vae_scale_factor
    time_ids = model.kind.time_ids
    hidden = model.unet.cross_attention_dim[0]
    rows = 2 * images
    args = (model.params["unet"], s((rows, 4, latent, latent), jnp.float32), s((rows,), jnp.float32),
            s((rows, 77, hidden), jnp.bfloat16), s((rows, model.components["text_encoder_2"].config.projection_dim),
                                                   jnp.bfloat16), s((rows, time_ids), jnp.float32))
    t0 = time.perf_counter()
    stats = jax.jit(lambda params, *a: unet.bind(params)(*a)).lower(*args).compile().memory_analysis()
    return {"compile_s": time.perf_counter() - t0, "plan": {f: int(getattr(stats, f)) for f in PLAN_FIELDS}}


def buffer_plan(program: str, refiner_folder: Path, size: int, steps: int, images: int = 1) -> None:
    """Print, as JSON lines, the engine's program (``base`` or ``refiner``: base + refiner) for ``images`` per
    device with CFG at ``size``², abstract bfloat16 parameters: first when lowered (seconds, StableHLO characters),
    then when compiled (seconds and ``memory_analysis()``). Two lines, so a caller that stops a compile that runs
    too long still has the first."""
    t0 = time.perf_counter()
    model = sdxl_base_model()
    mesh = make_mesh()
    shape = ProgramShape(images * len(mesh.devices.flat), size, size, steps, refiner=program == "refiner")
    params = dict(model.params)
    if shape.refiner:
        model.refiner = abstract_refiner(refiner_folder)
        params["refiner"] = model.refiner.params
    lowered = jit_program(model, shape, mesh).lower(params, ProgramInputs.abstract(
        shape, latent_shape(model, size, size), mesh))
    out = {"program": program, "shape": dataclasses.asdict(shape), "devices": len(mesh.devices.flat),
           "platform": jax.devices()[0].platform, "lower_s": time.perf_counter() - t0,
           "stablehlo_chars": len(lowered.as_text()),
           "params_bytes": {n: int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(v)))
                            for n, v in params.items()}}
    print(json.dumps(out), flush=True)
    t1 = time.perf_counter()
    stats = lowered.compile().memory_analysis()
    out.update(compile_s=time.perf_counter() - t1, plan={f: int(getattr(stats, f)) for f in PLAN_FIELDS})
    print(json.dumps(out), flush=True)
    del lowered, stats
    # What one step's UNet call alone plans, to tell the UNets' activations from the rest of the program.
    out["unet_call"] = unet_call_plan(model.refiner if shape.refiner else model, size, images)
    print(json.dumps(out), flush=True)


def measure_plan(program: str, refiner_folder: Path, size: int, steps: int, timeout_s: float, images: int = 1) -> dict:
    """:func:`buffer_plan` in a fresh process, stopped after ``timeout_s``: then the lowered line alone, with
    ``compile_timed_out``."""
    cmd = [sys.executable, "-m", "tools.fullsize", "plan", str(refiner_folder), "--program", program,
           "--size", str(size), "--steps", str(steps), "--images", str(images)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        timed_out = True
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{' '.join(cmd)} printed nothing (rc {proc.returncode}): {stderr[-2000:]}")
    out = {**lines[-1], "compile_timed_out": timed_out, "timeout_s": timeout_s}
    if "plan" not in out and not timed_out:  # the compile failed: say why rather than report a lowered line alone
        out["compile_error"] = stderr[-2000:]
    return out


def pair_load(base: Path, refiner: Path, dtype: str = "bfloat16") -> dict:
    """Base then refiner loaded in one process as the engine's start does (``_load_refiner``: the refiner checked
    against the base, its VAE dropped): seconds of each, the parameter bytes kept on the device, and the process's
    peak and final RSS growth. Run it in a fresh process (:func:`measure_pair`)."""
    _reset_peak()
    before = _rss("VmRSS")
    base_model, base_load = timed_load(base, dtype)
    t0 = time.perf_counter()
    refiner_model = load_folder(refiner, refiner.name, dtype, log=lambda *_: None)
    check_refiner(base_model, refiner_model)
    refiner_model.params = {n: refiner_model.params[n] for n in ("text_encoder_2", "unet")}  # the VAE's freed
    jax.block_until_ready(refiner_model.params)
    refiner_s = time.perf_counter() - t0
    kept = {"base": sum(v.nbytes for c in base_model.params.values() for v in c.values()),
            "refiner": sum(v.nbytes for c in refiner_model.params.values() for v in c.values())}
    return {"dtype": dtype, "base_load_s": base_load["load_s"], "refiner_load_s": refiner_s,
            "params_kept_gb": {k: v / 1e9 for k, v in kept.items()}, "params_kept_total_gb": sum(kept.values()) / 1e9,
            "peak_growth_gb": (_rss("VmHWM") - before) / 1e9, "rss_growth_after_gb": (_rss("VmRSS") - before) / 1e9,
            "peak_over_kept": (_rss("VmHWM") - before) / sum(kept.values())}


def measure_pair(base: Path, refiner: Path) -> dict:
    """:func:`pair_load` in a fresh process."""
    out = subprocess.run([sys.executable, "-m", "tools.fullsize", "pair", str(refiner), "--base", str(base)],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def refiner_report(folder: Path, size: int = 1024, steps: int = 20, timeout_s: float = 900,
                   base: Path | None = None) -> dict:
    """The refiner folder's bfloat16 load (a fresh process, :func:`timed_load`) and the buffer plans of the base
    and base + refiner programs at one image per device, and of base + refiner at 4 (:func:`measure_plan`, one
    process each, one after the other)."""
    load = measure_load(folder, "bfloat16")
    plans = {name: measure_plan(program, folder, size, steps, timeout_s, images)
             for name, program, images in (("base", "base", 1), ("refiner", "refiner", 1),
                                           ("refiner_x4", "refiner", 4))}
    pair = measure_pair(base, folder) if base else None
    return {"folder": str(folder), "load_bfloat16": load, "base_and_refiner_load": pair, "plans": plans, "size": size,
            "steps": steps}


def refiner_markdown(r: dict) -> str:
    """bench_refiner_fullsize.json as two tables: the refiner's load, and the programs' buffer plans."""
    load, gb, gib = r["load_bfloat16"], (lambda b: f"{b / 1e9:.2f} GB"), (lambda b: f"{b / 2**30:.2f} GiB")
    kept = sum(load["component_gb"][n] for n in ("text_encoder_2", "unet")) * 1e9
    lines = [f"Random full-size SDXL refiner ({r['folder']}), loaded by the engine's loader in bfloat16 on "
             f"`{r['plans']['base']['platform']}` in a fresh process:", "",
             "| load | seconds | params as loaded | of which text_encoder_2 / UNet / VAE | kept by the engine "
             "(text_encoder_2 + UNet) | peak RSS growth | peak / params |", "|---|---|---|---|---|---|---|",
             f"| bfloat16 | {load['load_s']:.1f} | {load['params_gb']:.2f} GB | "
             + " / ".join(f"{load['component_gb'][n]:.2f}" for n in ("text_encoder_2", "unet", "vae"))
             + f" GB | {gb(kept)} ({gib(kept)}) | {load['peak_growth_gb']:.2f} GB | {load['peak_over_params']:.2f}x |",
             *([] if not r.get("base_and_refiner_load") else [
                 "", "Base then refiner in one fresh process, as the engine's start loads them (the refiner checked "
                 "against the base, its VAE dropped):", "",
                 "| base load | refiner load | params kept: base + refiner | peak RSS growth | peak / kept |",
                 "|---|---|---|---|---|",
                 (lambda q: f"| {q['base_load_s']:.1f} s | {q['refiner_load_s']:.1f} s | "
                            f"{q['params_kept_gb']['base']:.2f}"
                            f" + {q['params_kept_gb']['refiner']:.2f} = **{gb(q['params_kept_total_gb'] * 1e9)} "
                            f"({gib(q['params_kept_total_gb'] * 1e9)})** | {q['peak_growth_gb']:.2f} GB | "
                            f"{q['peak_over_kept']:.2f}x |")(r["base_and_refiner_load"])]),
             "", f"XLA's buffer plan (`compile().memory_analysis()`) of the engine's program at {r['size']}², CFG, "
             f"{r['steps']} steps, abstract bfloat16 parameters, compiled by the CPU backend (an approximation of an "
             "accelerator's plan), per device:", "",
             "| program | images per device | arguments (params read + inputs) | output | temporaries | "
             "arguments + output + temporaries | one CFG UNet call alone: temporaries | lowered / compiled in |",
             "|---|---|---|---|---|---|---|---|"]
    for _key, v in r["plans"].items():
        name = "base + refiner" if v["shape"]["refiner"] else "base"
        images = v["shape"]["batch"] // v["devices"]
        if "plan" not in v:
            lines.append(f"| {name} | {images} | compile did not finish in {v['timeout_s']:.0f} s "
                         f"({v.get('compile_error', 'stopped')[:200]}); lowered in {v['lower_s']:.0f} s, "
                         f"{v['stablehlo_chars'] / 1e6:.1f} M characters of StableHLO | | | | | |")
            continue
        p = v["plan"]
        total = p["argument_size_in_bytes"] + p["output_size_in_bytes"] + p["temp_size_in_bytes"]
        unet = v["unet_call"]["plan"]["temp_size_in_bytes"]
        lines.append(f"| {name} | {images} | {gb(p['argument_size_in_bytes'])} | "
                     f"{p['output_size_in_bytes'] / 1e6:.1f} MB"
                     f" | {gb(p['temp_size_in_bytes'])} | **{gb(total)} ({gib(total)})** | {gb(unet)} | "
                     f"{v['lower_s']:.0f} s / {v['compile_s']:.0f} s |")
    return "\n".join(lines)


def relative_error(ours, reference: np.ndarray) -> float:
    """max |ours - reference| / max |reference| (float64)."""
    ours = np.asarray(ours, np.float64)
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def parity(folder: Path) -> dict:
    """Load full-size random weights and compare each component with PyTorch's outputs (see the module docstring)."""
    with np.load(folder / "reference" / "arrays.npz") as data:
        ref = dict(data)
    out = {"loads": [measure_load(folder, dtype) for dtype in ("bfloat16", "float32")]}
    model = load_folder(folder, folder.name, "float32", log=lambda *_: None)
    c, p = model.components, model.params
    t0 = time.perf_counter()
    te1 = jax.jit(lambda params, ids: c["text_encoder"].bind(params)(ids))(p["text_encoder"], ref["ids_1"])
    te2 = jax.jit(lambda params, ids: c["text_encoder_2"].bind(params)(ids))(p["text_encoder_2"], ref["ids_2"])
    unet = jax.jit(lambda params, *a: c["unet"].bind(params)(*a))(
        p["unet"], ref["unet_sample"], ref["unet_timesteps"], ref["unet_encoder_hidden_states"],
        ref["unet_text_embeds"], ref["unet_time_ids"])
    vae = jax.jit(lambda params, z: c["vae"].bind(params).decode(z))(p["vae"], ref["vae_decode_in"])
    out["run_s"] = time.perf_counter() - t0
    out["relative_error"] = {
        "te1_hidden": relative_error(te1.penultimate, ref["te1_hidden"]),
        "te1_pooled": relative_error(te1.pooled, ref["te1_pooled"]),
        "te2_hidden": relative_error(te2.penultimate, ref["te2_hidden"]),
        "te2_text_embeds": relative_error(te2.text_embeds, ref["te2_text_embeds"]),
        "unet_cfg_batch2_64x64": relative_error(unet, ref["unet_out"]),
        "vae_decode_512": relative_error(vae, ref["vae_decode_out"]),
    }
    out["allclose_rtol_1e-3"] = {
        "unet": bool(np.allclose(np.asarray(unet), ref["unet_out"], rtol=1e-3,
                                 atol=1e-3 * np.abs(ref["unet_out"]).max())),
        "vae": bool(np.allclose(np.asarray(vae), ref["vae_decode_out"], rtol=1e-3,
                                atol=1e-3 * np.abs(ref["vae_decode_out"]).max())),
    }
    return out


def parity_markdown(r: dict) -> str:
    lines = ["Full-size SDXL base (random weights saved as safetensors by diffusers/transformers' PyTorch classes), "
             "loaded by the engine on this CPU and compared with PyTorch in float32:", "",
             "| load | seconds | params | peak RSS growth | peak / params |", "|---|---|---|---|---|"]
    lines += [f"| {s['dtype']} | {s['load_s']:.0f} | {s['params_gb']:.2f} GB | {s['peak_growth_gb']:.2f} GB | "
              f"{s['peak_over_params']:.2f}x |" for s in r["loads"]]
    lines += ["", "| output (float32) | max abs error / max abs value |", "|---|---|"]
    lines += [f"| {k} | {v:.1e} |" for k, v in r["relative_error"].items()]
    return "\n".join(lines)


def main(args=None) -> None:
    """``bench --full-size`` calls this with its args (cost); ``python -m ...fullsize parity DIR`` runs parity."""
    if args is None:
        parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        parser.add_argument("command", choices=("cost", "parity", "load", "refiner", "plan", "pair"))
        parser.add_argument("folder", nargs="?", help="parity, load: the folder make_fixtures fullsize wrote; "
                            "refiner, plan: the one tools.fullsize_refiner_fixture wrote")
        parser.add_argument("--program", default="refiner", choices=("base", "refiner"), help="plan: which program")
        parser.add_argument("--size", type=int, default=1024, help="refiner, plan: image side in pixels")
        parser.add_argument("--steps", type=int, default=20, help="refiner, plan: the program's max_steps")
        parser.add_argument("--images", type=int, default=1, help="plan: images per device (CFG: 2 UNet rows each)")
        parser.add_argument("--timeout", type=float, default=900, help="refiner: seconds a program may compile")
        parser.add_argument("--base", help="refiner, pair: a full-size base folder, loaded with the refiner in one "
                            "process (tools.fullsize_refiner_fixture --base)")
        parser.add_argument("--dtype", default="bfloat16", help="load: the parameters' dtype")
        parser.add_argument("--md", default=str(ROOT / "docs/benchmarks.md"))
        parser.add_argument("--json", default=str(ROOT / "docs" / "benchmarks" / "bench.json"))
        args = parser.parse_args()
    if getattr(args, "command", "cost") == "load":
        print(json.dumps(timed_load(Path(args.folder), args.dtype)[1]))
        return
    if getattr(args, "command", "cost") == "plan":
        buffer_plan(args.program, Path(args.folder), args.size, args.steps, args.images)
        return
    if getattr(args, "command", "cost") == "pair":  # prints the JSON; the refiner report's entry when it exists
        pair = pair_load(Path(args.base), Path(args.folder))
        path = Path(args.json).with_name("bench_refiner_fullsize.json")
        if path.exists():
            path.write_text(json.dumps({**json.loads(path.read_text()), "base_and_refiner_load": pair}, indent=2))
        print(json.dumps(pair))
        return
    if getattr(args, "command", "cost") == "refiner":
        report = refiner_report(Path(args.folder), args.size, args.steps, args.timeout,
                                Path(args.base) if args.base else None)
        path = Path(args.json).with_name("bench_refiner_fullsize.json")
        if report["base_and_refiner_load"] is None and path.exists():  # without --base: keep the last `pair` figures
            old = json.loads(path.read_text())
            report.update({k: v for k, v in old.items() if k.startswith("base_and_refiner_load")})
        path.write_text(json.dumps(report, indent=2))
        write_section(Path(args.md), "refiner-fullsize", refiner_markdown(report))
        print(refiner_markdown(report))
        return
    if getattr(args, "command", "cost") == "parity":
        report = parity(Path(args.folder))
        Path(args.json).with_name("bench_fullsize_parity.json").write_text(json.dumps(report, indent=2))
        write_section(Path(args.md), "fullsize-parity", parity_markdown(report))
        print(parity_markdown(report))
        return
    report = cost_report()
    Path(args.json).with_name("bench_fullsize.json").write_text(json.dumps(report, indent=2))
    write_section(Path(args.md), "fullsize", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
