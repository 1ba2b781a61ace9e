"""Train a canny (edges) ControlNet for ``tiny-shapes`` on a CPU: the ControlNet the demo ships and loads by default.

    python -m tools.train controlnet                          # the shipped assets/tiny-shapes-canny
    python -m tools.train controlnet --steps 100 --out /tmp/cn   # a quick try

ControlNet training as Zhang et al. 2023 ("Adding Conditional Control to Text-to-Image Diffusion Models") and
diffusers' ``examples/controlnet/train_controlnet_sdxl.py`` run it, on the frozen ``tiny-shapes`` model:

1. Data: images and captions of :mod:`tools.shapes` (held-out combinations excluded), encoded once by the model's
   VAE (posterior mean times ``scaling_factor``) and both text encoders. The control image of each is its canny
   edge map as the engine's preprocessor makes it (engine/control_preprocess.py, module ``canny``, A1111's default
   thresholds 100 / 200), half of them at the image's own 64 px and half at A1111's default processor resolution
   of 512 px fitted back to 64 ("Just Resize"), so both settings a client may send draw the same lines.
   Captions are dropped 10 % of the time (the unconditional model of classifier-free guidance), and half of the
   rest lose their position and size words ("a red circle"), so the edges alone must place and size the shape.
2. The ControlNet is ``ControlNetModel.from_unet`` of the model's UNet: its encoder (conv_in, the time and
   text-time embeddings, down blocks, mid block) copied from the UNet, the zero convolutions and the conditioning
   embedding's last convolution zero (so training starts at the plain model's output).
3. Each step: timesteps drawn logit-normal as tools/train.py draws them, the noisy latents, the ControlNet's
   residuals added to the frozen UNet's skips, and the v-prediction MSE with train.py's "v-clipped" weight.
   AdamW, gradient clipping at 1; the exponential moving average of the weights is what is saved.
4. Save in diffusers' layout (``config.json`` + ``diffusion_pytorch_model.safetensors``, PyTorch layout: diffusers'
   ``ControlNetModel.from_pretrained`` reads it) with the training record (``training.json``).

Seeded and deterministic on one machine. Its effect is measured by ``python -m tools.evaluate controlnet``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdxl_engine.checkpoint.loading import load_model
from sdxl_engine.checkpoint.weights import save_params
from sdxl_engine.engine.control_preprocess import fit, preprocess
from sdxl_engine.models import build_component
from sdxl_engine.program.schedulers import _alphas_cumprod, sampler_config
from tools import shapes
from tools.bench_controlnet import controlnet_config

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "assets" / "tiny-shapes"
OUT = ROOT / "assets" / "tiny-shapes-canny"
# The prefixes of the UNet's keys ControlNetModel.from_unet copies (diffusers: load_state_dict of each module).
FROM_UNET = ("conv_in.", "time_embedding.", "add_embedding.", "down_blocks.", "mid_block.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(MODEL))
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--images", type=int, default=8000)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ema", type=float, default=0.99)
    p.add_argument("--caption-dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--max-minutes", type=float, default=60.0, help="stop (and save) after this much training")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[train controlnet] {msg}", flush=True)


def edges(image: np.ndarray, resolution: int) -> np.ndarray:
    """The canny map of ``image`` (64, 64, 3) uint8 as the engine makes it at processor resolution ``resolution``,
    fitted to the image's size: (64, 64, 3) uint8, lines 255 on 0."""
    detected = preprocess(image, "canny", resolution=resolution)
    return fit(detected, image.shape[1], image.shape[0], "Just Resize")


def plain_caption(attrs: shapes.Attributes) -> str:
    """The caption without position or size: colour, shape and background only."""
    article = "an" if attrs.colour[0] in "aeiou" else "a"
    return f"{article} {attrs.colour} {attrs.shape} on a {attrs.background} background"


def from_unet(unet_params: dict, controlnet_shapes: dict) -> dict:
    """ControlNet parameters from the UNet's (``ControlNetModel.from_unet``): shared keys copied, the rest zero."""
    out = {}
    for key, shape in controlnet_shapes.items():
        if key.startswith(FROM_UNET) and key in unet_params:
            assert unet_params[key].shape == tuple(shape), key
            out[key] = jnp.asarray(unet_params[key], jnp.float32)
        else:
            out[key] = jnp.zeros(shape, jnp.float32)
    return out


# The page's example (ControlSection's "Example outline"): a large star's edges on the left, and a prompt that
# names no position, so where the star lands is the outline's doing.
EXAMPLE = shapes.Attributes("star", "yellow", "white", "left", "large")
EXAMPLE_PROMPT = "a yellow star on a white background"


def write_example(out: Path) -> None:
    """``out``/example.png (the canny map of :data:`EXAMPLE` at 64 px, what the ControlNet sees: preprocessor
    "none") and example.json (its prompt and preprocessor), which the page's ControlNet section offers."""
    from PIL import Image

    Image.fromarray(edges(shapes.render(EXAMPLE), shapes.SIZE)).save(out / "example.png")
    (out / "example.json").write_text(json.dumps({"prompt": EXAMPLE_PROMPT, "module": "none",
                                                  "image": "example.png"}, indent=1) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    key = jax.random.key(args.seed)
    model = load_model(args.model, dtype="float32", platform="cpu", cache_dir="")
    components, base = model.components, model.params
    unet = components["unet"]
    vae = components["vae"]
    vae_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    config = controlnet_config(json.loads((Path(args.model) / "unet" / "config.json").read_text()), vae_factor)
    controlnet = build_component("controlnet", config)
    params = from_unet(base["unet"], controlnet.shapes)
    # The conditioning embedding's blocks start random (diffusers' defaults), its conv_out zero (zero_module).
    fresh = jax.jit(controlnet.init)(jax.random.fold_in(key, 1))
    for k in params:
        if k.startswith("controlnet_cond_embedding.") and not k.startswith("controlnet_cond_embedding.conv_out."):
            params[k] = fresh[k]
    cfg = sampler_config("Euler", model.scheduler_config)
    alphas_cumprod = jnp.asarray(_alphas_cumprod(cfg), jnp.float32)
    v_prediction = cfg["prediction_type"] == "v_prediction"

    # 1. Data, once.
    images, captions, attrs = shapes.make_dataset(args.images, args.seed + 200)
    rng = np.random.default_rng(args.seed + 3)
    plain = rng.random(len(captions)) < 0.5
    captions = [plain_caption(a) if p else c for c, a, p in zip(captions, attrs, plain, strict=True)]
    controls = np.stack([edges(im, shapes.SIZE if i % 2 == 0 else 512) for i, im in enumerate(images)])
    controls = controls.transpose(0, 3, 1, 2).astype(np.float32) / 255.0  # (n, 3, 64, 64) in [0, 1]
    latents, hidden, pooled = shapes.encode_training_data(model, images, captions)
    data_s = time.perf_counter() - start
    log(f"{len(images)} images -> latents {latents.shape}, controls {controls.shape} "
        f"(edge pixels {float((controls > 0.5).mean()):.3f}), text {hidden.shape} ({data_s:.0f} s)")

    # 2-3. Training.
    h, w = latents.shape[-2:]
    time_ids = jnp.asarray([h * vae_factor, w * vae_factor, 0, 0, h * vae_factor, w * vae_factor], jnp.float32)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10),
                                                                     args.steps, end_value=args.lr / 10),
                                  weight_decay=1e-2))
    opt_state = opt.init(params)
    ema = params

    def loss_fn(params, x0, hid, emb, cond, keep, k):
        b = x0.shape[0]
        hid, emb = hid * keep[:, None, None], emb * keep[:, None]
        k_t, k_z = jax.random.split(k)
        u = jax.nn.sigmoid(jax.random.normal(k_t, (b,)))  # logit-normal, as tools/train.py
        t = jnp.clip((u * len(alphas_cumprod)).astype(jnp.int32), 0, len(alphas_cumprod) - 1)
        z = jax.random.normal(k_z, x0.shape)
        a = alphas_cumprod[t][:, None, None, None]
        noisy = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * z
        ids6 = jnp.broadcast_to(time_ids, (b, 6))
        down, mid = controlnet.bind(params)(noisy, t, hid, emb, ids6, cond)
        pred = unet.bind(base["unet"])(noisy, t, hid, emb, ids6, down_block_additional_residuals=down,
                                       mid_block_additional_residual=mid)
        snr = alphas_cumprod[t] / (1 - alphas_cumprod[t])
        if v_prediction:
            target, weight = jnp.sqrt(a) * z - jnp.sqrt(1 - a) * x0, jnp.minimum(1.0, 5.0 / (snr + 1))
        else:
            target, weight = z, jnp.minimum(snr, 5.0) / snr
        return jnp.mean(weight * jnp.mean((pred - target) ** 2, axis=(1, 2, 3)))

    @jax.jit
    def step(params, ema, opt_state, x0, hid, emb, cond, keep, k):
        loss, grads = jax.value_and_grad(loss_fn)(params, x0, hid, emb, cond, keep, k)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: args.ema * e + (1 - args.ema) * p, ema, params)
        return params, ema, opt_state, loss

    def batch_step(state, i):
        idx = rng.integers(len(latents), size=args.batch)
        keep = (rng.random(args.batch) >= args.caption_dropout).astype(np.float32)
        *state, loss = step(*state, latents[idx], hidden[idx], pooled[idx], controls[idx], keep,
                            jax.random.fold_in(key, 10 + i))
        return tuple(state), loss

    (params, ema, opt_state), progress = shapes.run_steps(batch_step, (params, ema, opt_state), args.steps,
                                                          args.log_every, args.max_minutes, log)
    train_s = progress.train_s

    # 4. Save.
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_params({k: np.asarray(v, np.float32) for k, v in jax.device_get(ema).items()},
                out / "diffusion_pytorch_model.safetensors")
    record = {"what": "canny ControlNet for tiny-shapes (tools/train_controlnet.py)",
              "command": "python -m tools.train controlnet " + " ".join(sys.argv[2:] if argv is None else argv),
              "args": vars(args), "model": Path(args.model).name, "steps_done": progress.done,
              "data": {"images": args.images, "data_seed": args.seed + 200, "generator": "tools.shapes.make_dataset",
                       "held_out_excluded": True, "control": "canny 100/200 at 64 px and at 512 px fitted to 64"},
              "data_s": round(data_s, 1), "train_s": round(train_s, 1),
              "total_s": round(time.perf_counter() - start, 1), "loss": progress.history,
              "jax": jax.__version__, "device": str(jax.devices()[0])}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    write_example(out)
    log(f"saved {out} ({(out / 'diffusion_pytorch_model.safetensors').stat().st_size / 1e6:.2f} MB); "
        f"{train_s / 60:.1f} min training")


if __name__ == "__main__":
    main()
