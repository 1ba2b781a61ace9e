"""Every image mode once on the chip, through the service in-process: one command, JSON out.

    python3.11 -m tools.tpu_modes --out DIR [--modes txt2img,img2img,inpaint,controlnet,hires,lcm] [--size 1024]

The lent TPU v5e machine opens no sockets, so the engine (``sdxl-base-random``: SDXL 1.0 base's architecture,
random bfloat16 weights made on the chip) and :class:`~sdxl_engine.service.service.Service` run in this process and
each request goes in by ``Service.submit``, as every front sends it. With ``controlnet`` in ``--modes`` a random
full-size SDXL ControlNet (``ControlNetModel.from_unet``'s config, bfloat16) is written to DIR first and loaded by
``--controlnet`` as a server would. Each mode's first request compiles its program (a new program shape, inside the
request: its latency is the compile plus one run); a second request with another seed measures the run alone.
One JSON line per mode as it finishes, and all of them in DIR/tpu_modes.json (rewritten after each mode, so a
command cut short by the machine's 10-minute limit keeps the modes it finished).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

PROMPT = "a photograph of an astronaut riding a horse"
MODES = ("txt2img", "img2img", "inpaint", "controlnet", "hires", "lcm")
CONFIG_DIR = Path(__file__).resolve().parents[1] / "sdxl_engine" / "checkpoint" / "configs" / "sdxl-base-1.0"


def mode_fields(mode: str, size: int) -> dict:
    """The request fields (``to_request``'s names) of one mode at ``size``² (hires: made at half, upscaled 2x)."""
    from sdxl_engine.engine.control import ControlUnit

    rng = np.random.default_rng(0)
    picture = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    mask = np.zeros((size, size), np.float32)
    mask[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = 1.0
    edges = np.zeros((size, size, 3), np.uint8)
    edges[size // 4: 3 * size // 4, size // 4] = edges[size // 4, size // 4: 3 * size // 4] = 255
    return {
        "txt2img": {},
        "img2img": {"image": picture, "strength": 0.75},
        "inpaint": {"image": picture, "mask": mask, "strength": 0.75},
        "controlnet": {"control_units": (ControlUnit(image=edges, model="controlnet-random"),)},
        "hires": {"width": size // 2, "height": size // 2, "hires_scale": 2.0, "hires_strength": 0.7},
        "lcm": {"sampler": "LCM", "num_inference_steps": 4, "guidance_scale": 1.0},
    }[mode]


def write_controlnet(out: Path, model: str) -> Path:
    """A random ControlNet for ``model``'s UNet (bfloat16 safetensors) in ``out``, made on the devices: SDXL's
    full-size one for ``sdxl-base-random``."""
    import jax
    import jax.numpy as jnp

    from sdxl_engine.checkpoint import builtin
    from sdxl_engine.checkpoint.weights import save_params
    from sdxl_engine.models import build_component
    from tools.bench_controlnet import controlnet_config

    folder = CONFIG_DIR if model == "sdxl-base-random" else builtin.model_path(model, "")
    vae = json.loads((folder / "vae" / "config.json").read_text())
    config = controlnet_config(json.loads((folder / "unet" / "config.json").read_text()),
                               2 ** (len(vae["block_out_channels"]) - 1))
    component = build_component("controlnet", config)
    params = jax.jit(lambda key: jax.tree.map(lambda x: x.astype(jnp.bfloat16), component.init(key)))(
        jax.random.key(0))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_params({k: np.asarray(v) for k, v in params.items()}, out / "diffusion_pytorch_model.safetensors")
    return out


def run_job(service, fields: dict, seed: int) -> dict:
    """One request through ``service``: latency (submit to done), the engine's timings, its outcome."""
    from sdxl_engine.service.request import to_request

    values = {"num_inference_steps": 20, "guidance_scale": 5.0, **fields}
    start = time.perf_counter()
    job = service.submit(to_request(prompt=PROMPT, seed=seed, **values), owner="tpu-modes", front="bench")
    while not job.done:
        job.wait(len(job.events()), timeout=1.0)
    out = {"latency_s": time.perf_counter() - start, "status": job.status}
    if job.error is not None:
        out["error"] = f"{type(job.error).__name__}: {job.error}"
    if job.result is not None:
        out["timings"] = {k: v for k, v in (job.result.info.get("timings_s") or {}).items()
                          if isinstance(v, (int, float))}
        out["image_shape"] = list(job.result.images.shape)
        out["mean_pixel"] = float(job.result.images.mean())
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--model", default="sdxl-base-random")
    p.add_argument("--cpu-devices", type=int, default=0, help=argparse.SUPPRESS)  # CPU runs of this tool (tests)
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    import jax

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine
    from sdxl_engine.service.service import Service

    report: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "size": args.size,
                    "python": sys.version.split()[0], "jax": jax.__version__, "modes": {}}
    settings = {"model": args.model, "width": args.size, "height": args.size, "images_per_request": 1,
                "num_inference_steps": 20, "guidance_scale": 5.0, "sampler": "Euler", "progress": True,
                "precompile": "off", "max_run_seconds": 0,
                **({"cpu_devices": args.cpu_devices} if args.cpu_devices else {})}
    if "controlnet" in modes:
        t0 = time.perf_counter()
        settings["controlnet"] = str(write_controlnet(args.out / "controlnet-random", args.model))
        report["controlnet_written_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = Engine(EngineConfig.load(settings), log=lambda line: None).start()
    report.update(start_s=time.perf_counter() - t0, startup=dict(engine.startup), device=engine.device_summary)
    service = Service(engine, slots=1, limit=4)
    try:
        for mode in modes:
            fields = mode_fields(mode, args.size)
            row = {"first": run_job(service, fields, seed=1), "second": run_job(service, fields, seed=2)}
            report["modes"][mode] = row
            print(json.dumps({"mode": mode, **row}), flush=True)
            (args.out / "tpu_modes.json").write_text(json.dumps(report, indent=1))
    finally:
        service.close()
    stats = jax.devices()[0].memory_stats() or {}
    report["hbm_peak_gb"] = stats.get("peak_bytes_in_use", 0) / 2**30 or None
    (args.out / "tpu_modes.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "modes"}), flush=True)


if __name__ == "__main__":
    main()
