"""Full-size SDXL base with random weights: lower the real architecture and count its FLOPs.

``python -m sdxl_engine.bench --full-size`` builds the SDXL 1.0 base modules (UNet 2.57 B
params) in bfloat16 with *abstract* parameters (``jax.eval_shape``: shapes and dtypes, no
memory), lowers one CFG UNet step, one VAE decode and the two text encoders at 1024², and
reports XLA's cost analysis. No weights are downloaded or materialised, so any machine can
check that the real architecture lowers through the engine's code and what a request costs.
"""

from __future__ import annotations

import json
import time

from . import builtin


def build_modules(spec: dict, vocab_size: int, dtype_name: str) -> dict:
    """Flax module objects (no params) of an SDXL-architecture spec such as builtin.SDXL_BASE."""
    import jax.numpy as jnp
    from diffusers import FlaxAutoencoderKL, FlaxUNet2DConditionModel
    from transformers import FlaxCLIPTextModel, FlaxCLIPTextModelWithProjection

    dtype = getattr(jnp, dtype_name)
    cfg1, cfg2 = builtin.clip_configs(spec, vocab_size)
    return {
        "text_encoder": FlaxCLIPTextModel(cfg1, _do_init=False, dtype=dtype),
        "text_encoder_2": FlaxCLIPTextModelWithProjection(cfg2, _do_init=False, dtype=dtype),
        "unet": FlaxUNet2DConditionModel(**spec["unet"], dtype=dtype),
        "vae": FlaxAutoencoderKL(**spec["vae"], dtype=dtype),
    }


def _init_fns(modules: dict) -> dict:
    return {
        "text_encoder": lambda key: modules["text_encoder"].init_weights(key, (1, 77)),
        "text_encoder_2": lambda key: modules["text_encoder_2"].init_weights(key, (1, 77)),
        "unet": modules["unet"].init_weights,
        "vae": modules["vae"].init_weights,
    }


def abstract_params(modules: dict, dtype_name: str) -> dict:
    """{component: tree of ShapeDtypeStruct in ``dtype_name``}: shapes only, no memory."""
    import jax
    import jax.numpy as jnp

    dtype = getattr(jnp, dtype_name)
    shapes = {k: jax.eval_shape(fn, jax.random.key(0)) for k, fn in _init_fns(modules).items()}
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), shapes)


def random_params(modules: dict, dtype_name: str, seed: int = 0) -> dict:
    """Random params, initialised and cast to ``dtype_name`` inside one jit per component.

    On an accelerator the arrays are created on the device (no host copy of 10 GB of float32).
    """
    import jax
    import jax.numpy as jnp

    dtype = getattr(jnp, dtype_name)
    keys = jax.random.split(jax.random.key(seed), 4)
    return {k: jax.jit(lambda key, fn=fn: jax.tree.map(lambda x: x.astype(dtype), fn(key)))(key)
            for key, (k, fn) in zip(keys, _init_fns(modules).items())}


def random_model(spec: dict = builtin.SDXL_BASE, dtype_name: str = "bfloat16", seed: int = 0, name: str = "sdxl-base-random"):
    """A LoadedModel of ``spec`` with random weights (the ``sdxl-base-random`` built-in model)."""
    import tempfile
    from pathlib import Path

    from diffusers import FlaxEulerDiscreteScheduler
    from transformers import CLIPTokenizer

    from .loading import LoadedModel

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        builtin.write_tokenizers(Path(tmp))
        tokenizers = [CLIPTokenizer.from_pretrained(str(Path(tmp) / sub)) for sub in ("tokenizer", "tokenizer_2")]
    modules = build_modules(spec, spec["text_encoder"].get("vocab_size", len(tokenizers[0])), dtype_name)
    return LoadedModel(name=name, tokenizer=tokenizers[0], tokenizer_2=tokenizers[1],
                       scheduler=FlaxEulerDiscreteScheduler(**builtin.SDXL_SCHEDULER),
                       params=random_params(modules, dtype_name, seed), dtype=dtype_name,
                       load_s=time.perf_counter() - t0, **modules)


def count_params(tree) -> int:
    import jax
    import numpy as np

    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def lowered_flops(fn, *args) -> float:
    """XLA's FLOP count of ``jax.jit(fn)`` lowered for abstract ``args`` (no compile, no run)."""
    import jax

    cost = jax.jit(fn).lower(*args).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def lower_engine_program(modules, params, size: int, steps: int, images: int) -> float:
    """Lower the engine's own sharded program (program.py) for full-size SDXL; seconds taken.

    Raises whatever lowering raises: the point is to show the real architecture goes through
    the same code path the server compiles.
    """
    from diffusers import FlaxEulerDiscreteScheduler

    from .loading import LoadedModel
    from .program import ProgramShape, abstract_inputs, jit_program
    from .sharding import make_mesh

    t0 = time.perf_counter()
    model = LoadedModel(name="sdxl-base-random", tokenizer=None, tokenizer_2=None,
                        scheduler=FlaxEulerDiscreteScheduler(**builtin.SDXL_SCHEDULER), params=params,
                        dtype="bfloat16", **modules)
    mesh = make_mesh()
    shape = ProgramShape(images, size, size, steps)
    jit_program(model, shape, mesh).lower(params, *abstract_inputs(shape, mesh))
    return time.perf_counter() - t0


def cost_report(size: int = 1024, steps: int = 20, images: int = 4) -> dict:
    """FLOPs of one CFG UNet step, one VAE decode and the text encoders at ``size``² (bfloat16).

    Per request: images x (steps x unet_cfg_step + vae_decode) + text encoders (prompt and
    negative prompt for every image), as the engine's program runs them.
    """
    import jax
    import jax.numpy as jnp

    t0 = time.perf_counter()
    modules = build_modules(builtin.SDXL_BASE, 49408, "bfloat16")
    params = abstract_params(modules, "bfloat16")
    unet, vae = modules["unet"], modules["vae"]
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    latent = size // 8

    def unet_cfg_step(p, x, t, hidden, text_embeds, time_ids):
        return unet.apply({"params": p}, x, t, encoder_hidden_states=hidden,
                          added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids}).sample

    def vae_decode(p, z):
        return vae.apply({"params": p}, z, method=vae.decode).sample

    def text_encoders(p1, p2, ids):
        h1 = modules["text_encoder"](ids, params=p1, output_hidden_states=True).hidden_states[-2]
        out2 = modules["text_encoder_2"](ids, params=p2, output_hidden_states=True)
        return h1, out2.hidden_states[-2], out2.text_embeds

    flops = {
        "unet_cfg_step": lowered_flops(unet_cfg_step, params["unet"], s((2, 4, latent, latent), bf16), s((2,), jnp.int32),
                                       s((2, 77, 2048), bf16), s((2, 1280), bf16), s((2, 6), bf16)),
        "vae_decode": lowered_flops(vae_decode, params["vae"], s((1, 4, latent, latent), bf16)),
        "text_encoders_per_prompt": lowered_flops(text_encoders, params["text_encoder"], params["text_encoder_2"],
                                                  s((1, 77), jnp.int32)),
    }
    program_lower_s = lower_engine_program(modules, params, size, steps, images)
    per_request = images * (steps * flops["unet_cfg_step"] + flops["vae_decode"] + 2 * flops["text_encoders_per_prompt"])
    return {
        "size": size, "steps": steps, "images": images, "dtype": "bfloat16",
        "params": {k: count_params(v) for k, v in params.items()},
        "tflop": {k: v / 1e12 for k, v in flops.items()},
        "tflop_per_request": per_request / 1e12,
        "lower_s": time.perf_counter() - t0,
        "engine_program_lower_s": program_lower_s,
        "platform": jax.devices()[0].platform,
    }


def markdown(r: dict) -> str:
    p = r["params"]
    return "\n".join([
        f"Full-size SDXL base, random bfloat16 weights, lowered on `{r['platform']}` (not run) in {r['lower_s']:.0f} s:",
        "", "| what | value |", "|---|---|",
        f"| UNet params | {p['unet'] / 1e9:.3f} B |",
        f"| text encoders params | {p['text_encoder'] / 1e6:.0f} M + {p['text_encoder_2'] / 1e6:.0f} M |",
        f"| VAE params | {p['vae'] / 1e6:.1f} M |",
        f"| one CFG UNet step at {r['size']}² (batch 2) | {r['tflop']['unet_cfg_step']:.2f} TFLOP |",
        f"| one VAE decode at {r['size']}² | {r['tflop']['vae_decode']:.2f} TFLOP |",
        f"| text encoders, one prompt | {r['tflop']['text_encoders_per_prompt'] * 1e3:.1f} GFLOP |",
        f"| the engine's whole program ({r['images']} × {r['size']}², {r['steps']} steps) lowered in | {r['engine_program_lower_s']:.0f} s |",
        f"| one request: {r['images']} images × ({r['steps']} steps + decode) + prompts | {r['tflop_per_request']:.0f} TFLOP |",
    ])


def main(args) -> None:
    from pathlib import Path

    from .bench import write_section
    report = cost_report()
    Path(args.json).with_name("bench_fullsize.json").write_text(json.dumps(report, indent=2))
    write_section(Path(args.md), "fullsize", markdown(report))
    print(markdown(report))
