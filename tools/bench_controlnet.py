"""ControlNet's cost: device time of one unit against none on a tiny model (alternating rounds), and XLA's FLOP ratio at
full size 1024² (docs/benchmarks.md, "ControlNet").

    python -m tools.bench_controlnet time [--model tiny-shapes] [--steps 20] [--runs 7]
    python -m tools.bench_controlnet flops [--size 1024] [--steps 20]

Each prints its JSON and keeps it in docs/benchmarks/bench_controlnet.json under its command's name.

``time``: a random ControlNet made from the model's UNet (``ControlNetModel.from_unet``'s config, the conditioning
embedding downsampling by the VAE's factor) is written to a temporary folder and loaded with ``--controlnet``; one
engine; each round runs a request without a unit and one with a unit (Balanced, the whole schedule), in turn;
reports each leg's median ``timings["device"]``, the median of the per-round ratios, the compiles the measured
rounds made (0: the unit's image, weight and start/end are traced inputs) and XLA's FLOP ratio of a request with and
without the unit at that size (:func:`request_flops`).

``flops``: SDXL 1.0 base's real configs with abstract bfloat16 parameters and a full-size SDXL ControlNet of the same
UNet (``diffusers/controlnet-canny-sdxl-1.0``'s architecture: from_unet, conditioning channels 16, 32, 96, 256),
lowered (not run) by XLA: one CFG UNet step with and without the ControlNet's residuals, the VAE decode and the text
encoders, and a request of 4 images and ``--steps`` steps from them (:func:`request_flops`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from sdxl_engine.engine.validation import ControlUnit, GenerateRequest

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "bench_controlnet.json"  # each command's key


def controlnet_config(unet_config: dict, vae_factor: int) -> dict:
    """``ControlNetModel.from_unet``'s config of a UNet config dict, the conditioning embedding downsampling by
    ``vae_factor`` (SDXL's 8: diffusers' default channels 16, 32, 96, 256)."""
    channels = {8: [16, 32, 96, 256], 4: [16, 32, 96], 2: [16, 32]}[vae_factor]
    keep = ("in_channels", "flip_sin_to_cos", "freq_shift", "down_block_types", "only_cross_attention",
            "block_out_channels", "layers_per_block", "downsample_padding", "mid_block_scale_factor", "act_fn",
            "norm_num_groups", "norm_eps", "cross_attention_dim", "transformer_layers_per_block", "attention_head_dim",
            "num_attention_heads", "use_linear_projection", "addition_embed_type", "addition_time_embed_dim",
            "projection_class_embeddings_input_dim", "upcast_attention")
    config = {k: v for k, v in unet_config.items() if k in keep}
    return {**config, "_class_name": "ControlNetModel", "conditioning_embedding_out_channels": channels}


def write_random_controlnet(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """A random ControlNet for the diffusers model folder ``model_dir`` in ``out`` (config.json + safetensors)."""
    import jax

    from sdxl_engine.checkpoint.weights import save_params
    from sdxl_engine.models import build_component

    unet = json.loads((model_dir / "unet" / "config.json").read_text())
    vae = json.loads((model_dir / "vae" / "config.json").read_text())
    config = controlnet_config(unet, 2 ** (len(vae["block_out_channels"]) - 1))
    component = build_component("controlnet", config)
    params = jax.jit(component.init)(jax.random.key(seed))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_params({k: np.asarray(v) for k, v in params.items()}, out / "diffusion_pytorch_model.safetensors")
    return out


def cmd_time(model: str, steps: int, runs: int) -> dict:
    from sdxl_engine.checkpoint import builtin
    from sdxl_engine.config import EngineConfig, apply_jax_options
    from sdxl_engine.engine.local import Engine

    with tempfile.TemporaryDirectory() as tmp:
        net = Path(tmp) / "bench-cn"
        config = EngineConfig.load({"model": model, "controlnet": str(net), "max_run_seconds": 0,
                                    "precompile": "off"})
        apply_jax_options(config)  # before JAX's first array (the random ControlNet's): the engine's CPU devices
        folder = Path(model) if Path(model).is_dir() else builtin.model_path(model, config.model_cache_dir)
        write_random_controlnet(folder, net)
        engine = Engine(config, log=lambda *_: None).start()
        width, height = engine.limits.default_size
        y, x = np.mgrid[0:height, 0:width]
        edges = (((x // 8 + y // 8) % 2) * 255).astype(np.uint8)[..., None].repeat(3, -1)
        legs = {"no unit": (), "one unit": (ControlUnit(image=edges, model="bench-cn"),)}

        def run(units, seed: int) -> float:
            return engine.generate(GenerateRequest("a red circle", seed=seed, num_inference_steps=steps,
                                                   control_units=units)).timings["device"]

        for units in legs.values():  # compile and warm up each program
            run(units, 0)
        before = engine.compile_count
        rounds = [{name: run(units, seed) for name, units in legs.items()} for seed in range(1, runs + 1)]
        return {"model": engine.model.name, "devices": engine.device_summary, "batch": engine.batch,
                "size": [width, height], "steps": steps, "runs": runs,
                "device_s": {name: statistics.median(r[name] for r in rounds) for name in legs},
                "ratio_median": statistics.median(r["one unit"] / r["no unit"] for r in rounds),
                "ratios": [round(r["one unit"] / r["no unit"], 3) for r in rounds],
                "compiles_while_measuring": engine.compile_count - before,
                "flops": request_flops(engine.model.components, abstract(engine.params),
                                       engine.model.controlnets["bench-cn"].component,
                                       abstract(engine.model.controlnets["bench-cn"].params), width, steps,
                                       engine.batch)}


def request_flops(components: dict, params: dict, controlnet, controlnet_params, size: int, steps: int,
                  images: int) -> dict:
    """XLA's FLOPs (lowered, not compiled) of one CFG UNet step with and without ``controlnet`` (its residuals added),
    one VAE decode and the text encoders at ``size``², and per request: images x (steps x step + decode) + the text
    encoders for the prompt and negative prompt of every image (how tools/fullsize.py counts a request; the whole
    program's own count is no use here: XLA counts a loop's body once)."""
    import jax
    import jax.numpy as jnp

    from tools.fullsize import lowered_flops

    s = jax.ShapeDtypeStruct
    unet, vae = components["unet"], components["vae"]
    dtype = next(iter(params["unet"].values())).dtype
    f = vae.config.scale_factor
    latent, channels = size // f, vae.config.latent_channels
    hidden, pooled = unet.config.cross_attention_dim[-1], components["text_encoder_2"].config.projection_dim
    args = (s((2, channels, latent, latent), jnp.float32), s((2,), jnp.float32), s((2, 77, hidden), dtype),
            s((2, pooled), dtype), s((2, 6), jnp.float32))

    def step(p, x, t, h, e, ids):
        return unet.bind(p)(x, t, h, e, ids)

    def control_step(p, cp, x, t, h, e, ids, cond):
        down, mid = controlnet.bind(cp)(x, t, h, e, ids, cond)
        return unet.bind(p)(x, t, h, e, ids, down, mid)

    def text(p1, p2, ids):
        out = components["text_encoder_2"].bind(p2)(ids)
        return components["text_encoder"].bind(p1)(ids, penultimate_only=True).penultimate, out.text_embeds

    flops = {"unet_cfg_step": lowered_flops(step, params["unet"], *args),
             "unet_cfg_step_with_controlnet": lowered_flops(control_step, params["unet"], controlnet_params, *args,
                                                            s((2, 3, size, size), dtype)),
             "vae_decode": lowered_flops(lambda p, z: vae.bind(p).decode(z), params["vae"],
                                         s((1, channels, latent, latent), jnp.float32)),
             "text_encoders_per_prompt": lowered_flops(text, params["text_encoder"], params["text_encoder_2"],
                                                       s((1, 77), jnp.int32))}
    fixed = images * flops["vae_decode"] + 2 * images * flops["text_encoders_per_prompt"]
    plain = images * steps * flops["unet_cfg_step"] + fixed
    controlled = images * steps * flops["unet_cfg_step_with_controlnet"] + fixed
    return {"size": size, "steps": steps, "images": images, "tflop": {k: v / 1e12 for k, v in flops.items()},
            "tflop_per_request": {"no unit": plain / 1e12, "one unit": controlled / 1e12},
            "step_ratio": flops["unet_cfg_step_with_controlnet"] / flops["unet_cfg_step"],
            "request_ratio": controlled / plain}


def abstract(tree):
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def cmd_flops(size: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from sdxl_engine.checkpoint import builtin
    from sdxl_engine.models import build_component
    from tools.fullsize import count_params, sdxl_base_model

    model = sdxl_base_model()
    component = build_component("controlnet", controlnet_config(builtin.SDXL_BASE_CONFIGS["unet"], 8))
    cn_params = component.abstract(jnp.bfloat16)
    out = request_flops(model.components, model.params, component, cn_params, size, steps, 4)
    return {**out, "platform": jax.devices()[0].platform, "dtype": "bfloat16",
            "params": {"unet": count_params(model.params["unet"]), "controlnet": count_params(cn_params)}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("time")
    t.add_argument("--model", default="tiny-shapes")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--runs", type=int, default=7)
    f = sub.add_parser("flops")
    f.add_argument("--size", type=int, default=1024)
    f.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    out = cmd_time(args.model, args.steps, args.runs) if args.cmd == "time" else cmd_flops(args.size, args.steps)
    print(json.dumps(out, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    saved = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    RESULTS.write_text(json.dumps({**saved, args.cmd: out}, indent=2) + "\n")


if __name__ == "__main__":
    main()
