"""Every image mode once on the chip, through the service in-process: one command, JSON out.

    python3.11 -m tools.tpu_modes --out DIR [--modes txt2img,img2img,inpaint,controlnet,hires,lcm,lightning,union,
                                              ip_adapter] [--size 1024]
    python -m tools.tpu_modes --out DIR --flops     # XLA's FLOPs of a step with and without a ControlNet unit (CPU)

The lent TPU v5e machine opens no sockets, so the engine (``sdxl-base-random``: SDXL 1.0 base's architecture,
random bfloat16 weights made on the chip) and :class:`~sdxl_engine.service.service.Service` run in this process and
each request goes in by ``Service.submit``, as every front sends it. With ``controlnet`` or ``union`` in ``--modes`` a
random full-size SDXL ControlNet or ControlNet-Union (``ControlNetModel.from_unet``'s config, bfloat16) is written to
DIR first and loaded by ``--controlnet`` as a server would; with ``ip_adapter`` a random IP-Adapter Plus and its
ViT-H/14 image encoder in h94's layout, loaded by ``--ip-adapter``. The engine compiles each add-on's one-unit program
before it is ready (a full-size one takes minutes on the chip: run the add-on modes one per command). ``lightning``
is SDXL-Lightning 4-step's recipe (Euler, trailing, 4 steps, no CFG). Each mode's first request compiles its program
(a new program shape, inside the request: its latency is the compile plus one run); a second request with another
seed measures the run alone. The engine's start-up log goes to stderr with times as it goes. One JSON line per mode
as it finishes, and all of them in DIR/tpu_modes.json (rewritten after each mode, so a command cut short by the
machine's 10-minute limit keeps the modes it finished).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

PROMPT = "a photograph of an astronaut riding a horse"
MODES = ("txt2img", "img2img", "inpaint", "controlnet", "hires", "lcm", "lightning", "union", "ip_adapter")
# CLIP ViT-H/14's vision tower (laion2B; h94/IP-Adapter's models/image_encoder/config.json): Plus SDXL's encoder
VIT_H = dict(hidden_size=1280, intermediate_size=5120, projection_dim=1024, num_hidden_layers=32,
             num_attention_heads=16, image_size=224, patch_size=14, hidden_act="gelu", layer_norm_eps=1e-5)
CONFIG_DIR = Path(__file__).resolve().parents[1] / "sdxl_engine" / "checkpoint" / "configs" / "sdxl-base-1.0"


def mode_fields(mode: str, size: int) -> dict:
    """The request fields (``to_request``'s names) of one mode at ``size``² (hires: made at half, upscaled 2x)."""
    from sdxl_engine.engine.control import ControlUnit
    from sdxl_engine.engine.ip_adapter import IPAdapterUnit

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
        # SDXL-Lightning 4-step's recipe (checkpoint/recipes.py): Euler, trailing timesteps, no CFG
        "lightning": {"sampler": "Euler", "num_inference_steps": 4, "guidance_scale": 0.0,
                      "schedule_type": "trailing"},
        "union": {"control_units": (ControlUnit(image=edges, model="controlnet-union-random", control_type="canny"),)},
        "ip_adapter": {"ip_adapter_units": (IPAdapterUnit(image=picture[: size // 2],
                                                          model="ip-adapter-plus_random"),)},
    }[mode]


def _model_configs(model: str) -> tuple[dict, dict]:
    """``model``'s UNet and VAE config.json dicts (SDXL 1.0 base's for ``sdxl-base-random``)."""
    from sdxl_engine.checkpoint import builtin

    folder = CONFIG_DIR if model == "sdxl-base-random" else builtin.model_path(model, "")
    return tuple(json.loads((folder / part / "config.json").read_text()) for part in ("unet", "vae"))


def _write_random(name: str, config: dict, file: Path, seed: int = 0) -> None:
    """Component ``name`` of ``config`` with random bfloat16 weights, made on the devices, as safetensors ``file``
    (checkpoint keys: the files people download) with ``config`` as config.json beside it where the loader reads
    it."""
    import jax
    import jax.numpy as jnp

    from sdxl_engine.checkpoint.weights import save_params
    from sdxl_engine.models import build_component

    component = build_component(name, config)
    params = jax.jit(lambda key: jax.tree.map(lambda x: x.astype(jnp.bfloat16), component.init(key)))(
        jax.random.key(seed))
    file.parent.mkdir(parents=True, exist_ok=True)
    save_params({k: np.asarray(v) for k, v in params.items()}, file)


def union_config(config: dict) -> dict:
    """A ControlNet ``config`` as a ControlNet-Union's: xinsir's six control types, the token transformer at the first
    block's width (320 in SDXL)."""
    width = config["block_out_channels"][0]
    return {**config, "_class_name": "ControlNetUnionModel", "num_control_type": 6, "num_trans_channel": width,
            "num_proj_channel": width, "num_trans_head": max(1, width // 40)}


def ip_adapter_config(unet, width: int) -> dict:
    """An IP-Adapter Plus config (16 tokens, h94's Resampler of depth 4) for ``unet`` (a UNetConfig) on an image
    encoder of hidden size ``width``."""
    from sdxl_engine.models.ip_adapter import cross_attention_layers

    return dict(projection="plus", image_embed_dim=width, cross_attention_dim=unet.cross_attention_dim[-1], tokens=16,
                widths=[w for _, w in cross_attention_layers(unet)], plus_dim=width, plus_heads=width // 64,
                plus_depth=4)


def write_controlnet(out: Path, model: str, union: bool = False) -> Path:
    """A random ControlNet (``union``: a ControlNet-Union, xinsir's six control types) for ``model``'s UNet in
    ``out`` (config.json + bfloat16 safetensors): SDXL's full-size one for ``sdxl-base-random``."""
    from tools.bench_controlnet import controlnet_config

    unet, vae = _model_configs(model)
    config = controlnet_config(unet, 2 ** (len(vae["block_out_channels"]) - 1))
    if union:
        config = union_config(config)
    file = out / "diffusion_pytorch_model.safetensors"
    if file.exists() and (out / "config.json").exists() and json.loads((out / "config.json").read_text()) == config:
        return out  # written by an earlier run into the same DIR (a full-size one takes minutes on the chip)
    (out / "config.json").unlink(missing_ok=True)
    _write_random("controlnet_union" if union else "controlnet", config, file)
    (out / "config.json").write_text(json.dumps(config, indent=2))  # last: a write cut short leaves none
    return out


def write_ip_adapter(out: Path, model: str) -> Path:
    """A random IP-Adapter Plus for ``model``'s UNet in h94's layout: ``out``/ip-adapter-plus_random.safetensors and
    its image encoder in ``out``/image_encoder (CLIP ViT-H/14's vision tower, :data:`VIT_H`, as
    ip-adapter-plus_sdxl_vit-h's; a tiny model gets a small one). Returns the adapter file."""
    from sdxl_engine.models import UNetConfig

    unet = UNetConfig.from_dict(_model_configs(model)[0])
    encoder = VIT_H if model == "sdxl-base-random" else {**VIT_H, "hidden_size": 64, "intermediate_size": 128,
                                                        "projection_dim": 32, "num_hidden_layers": 2,
                                                        "num_attention_heads": 2, "image_size": 56}
    adapter = ip_adapter_config(unet, encoder["hidden_size"])
    config = {"architectures": ["CLIPVisionModelWithProjection"], **encoder}
    file, written = out / "ip-adapter-plus_random.safetensors", out / "written.json"
    if file.exists() and written.exists() and json.loads(written.read_text()) == {"encoder": config,
                                                                                     "adapter": adapter}:
        return file  # written by an earlier run into the same DIR (the full-size pair took 142 s on the chip)
    written.unlink(missing_ok=True)
    (out / "image_encoder").mkdir(parents=True, exist_ok=True)
    (out / "image_encoder" / "config.json").write_text(json.dumps(config, indent=2))
    _write_random("image_encoder", encoder, out / "image_encoder" / "model.safetensors", seed=1)
    _write_random("ip_adapter", adapter, file, seed=2)
    written.write_text(json.dumps({"encoder": config, "adapter": adapter}))  # last: both files are whole
    return file


def controlnet_flops(model: str = "sdxl-base-random", size: int = 1024) -> dict:
    """XLA's FLOP count of one CFG step's UNet call (2 rows, ``size``², abstract bfloat16 parameters: lowered only,
    nothing compiled or run; ``tools.fullsize.lowered_flops``) and of what each add-on adds to it: a ControlNet's call,
    a ControlNet-Union's call on one image (:func:`write_controlnet`'s union config), and the UNet call with one
    IP-Adapter Plus unit (16 image tokens, :func:`write_ip_adapter`'s config; the image encoder and the projection run
    once per request, outside the steps). Each ratio is (step with the add-on) / (step without): the FLOP side of the
    chip's device-time ratios. Runs on CPU."""
    import jax
    import jax.numpy as jnp

    from sdxl_engine.models import UNetConfig, build_component
    from sdxl_engine.models.ip_adapter import forward_order
    from tools.bench_controlnet import controlnet_config
    from tools.fullsize import lowered_flops

    unet_config, vae_config = _model_configs(model)
    factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
    unet = build_component("unet", unet_config)
    config = controlnet_config(unet_config, factor)
    net = build_component("controlnet", config)
    union = build_component("controlnet_union", union_config(config))
    s, bf16, latent = jax.ShapeDtypeStruct, jnp.bfloat16, size // factor
    text = unet_config["projection_class_embeddings_input_dim"] - 6 * unet_config["addition_time_embed_dim"]
    common = (s((2, 4, latent, latent), jnp.float32), s((2,), jnp.float32),
              s((2, 77, unet_config["cross_attention_dim"]), bf16), s((2, text), bf16), s((2, 6), jnp.float32))
    image = s((2, 3, size, size), jnp.float32)
    unet_flops = lowered_flops(lambda p, *a: unet.bind(p)(*a), unet.abstract(bf16), *common)
    net_flops = lowered_flops(lambda p, *a: net.bind(p)(*a), net.abstract(bf16), *common, image)
    union_flops = lowered_flops(lambda p, *a: union.bind(p)(*a), union.abstract(bf16), *common, image)
    unet_cfg = UNetConfig.from_dict(unet_config)
    plus = ip_adapter_config(unet_cfg, VIT_H["hidden_size"])  # the program binds its layers only
    adapter = build_component("ip_adapter_layers", {k: plus[k] for k in ("cross_attention_dim", "widths")})
    order = forward_order(unet_cfg)

    def with_ip(params, tokens, *a):
        layers = adapter.bind(params["ip"])
        return unet.bind(params["unet"])(*a, ip_adapter=[[(layers.layer(j), tokens, jnp.float32(1.0))] for j in order])

    ip_flops = lowered_flops(with_ip, {"unet": unet.abstract(bf16), "ip": adapter.abstract(bf16)},
                             s((2, 16, unet_cfg.cross_attention_dim[-1]), bf16), *common)
    tf = 1e12
    return {"size": size, "unet_cfg_step_tflop": unet_flops / tf, "controlnet_cfg_step_tflop": net_flops / tf,
            "step_with_unit_over_without": (unet_flops + net_flops) / unet_flops,
            "union_cfg_step_tflop": union_flops / tf,
            "step_with_union_unit_over_without": (unet_flops + union_flops) / unet_flops,
            "unet_with_ip_adapter_cfg_step_tflop": ip_flops / tf,
            "step_with_ip_adapter_unit_over_without": ip_flops / unet_flops}


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
    p.add_argument("--flops", action="store_true", help="print XLA's FLOPs of a step with and without a ControlNet "
                                                        "unit (lowered only, runs on CPU) and exit")
    args = p.parse_args(argv)
    if args.flops:
        print(json.dumps(controlnet_flops(args.model, args.size)), flush=True)
        return
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
    t0 = time.perf_counter()
    nets = [write_controlnet(args.out / f"controlnet{kind}-random", args.model, union=bool(kind))
            for kind in ("", "-union") if f"{kind[1:] or 'controlnet'}" in modes]
    if nets:
        settings["controlnet"] = os.pathsep.join(map(str, nets))
    if "ip_adapter" in modes:
        settings["ip_adapter"] = str(write_ip_adapter(args.out / "ip-adapter", args.model))
    report["addons_written_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    print(json.dumps({"addons_written_s": report["addons_written_s"]}), flush=True)
    begun = time.perf_counter()
    engine = Engine(EngineConfig.load(settings), log=lambda line: print(
        f"[{time.perf_counter() - begun:6.1f} s] {line}", file=sys.stderr, flush=True)).start()
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
