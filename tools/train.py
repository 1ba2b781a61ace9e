"""Train the ``tiny-shapes`` model: SDXL in miniature, on captioned shapes, on a CPU.

    python -m tools.train --out assets/tiny-shapes   # the shipped model (seed 0; time: docs/benchmarks.md)
    python -m tools.train --out /tmp/ts --vae-steps 200 --unet-steps 300   # a quick try
    python -m tools.train --out /tmp/ts --vae-from assets/tiny-shapes --unet-steps 600  # UNet only
    python -m tools.train lcm-lora         # its few-step LCM-LoRA (tools/train_lcm.py)
    python -m tools.train controlnet       # its canny ControlNet (tools/train_controlnet.py)

Stages, as SDXL was trained (Podell et al. 2023, with Rombach et al. 2022's latent diffusion):

1. Data: images and captions from :mod:`tools.shapes` (held-out combinations excluded).
2. VAE: a KL autoencoder (factor 4: 64x64x3 pixels -> 16x16x4 latents), loss = pixel MSE + a
   tiny KL term. Its ``scaling_factor`` is then set to 1 / std of the latents, so the latents
   the UNet sees have unit variance (SD's 0.18215 and SDXL's 0.13025 were found the same way).
3. Encode every training image once to latents (the VAE is frozen from here on).
4. UNet + both CLIP text encoders, from scratch: pick a timestep t, noise the latents with the
   scheduler's alphas_cumprod (DDPM forward process), and predict v (Salimans & Ho 2022) from
   the captions' encoder_hidden_states (both encoders' penultimate layers) and text_embeds (the
   second encoder's pooled projection) plus add_time_ids. The caption is dropped (zero
   embeddings, what the engine feeds for an empty negative prompt) 10 % of the time, so the
   same network is also the unconditional model of classifier-free guidance (Ho & Salimans
   2022). Timesteps are drawn logit-normal (Esser et al. 2024), the v-MSE weighted 1 except near
   t = 0 (``--t-sampling``, ``--loss-weight``, see :func:`train_unet`).
   An exponential moving average of the weights is what is saved.
5. Save in diffusers format (safetensors, PyTorch layout): the engine and diffusers' PyTorch
   ``StableDiffusionXLPipeline`` both load it.

Four choices make a model this small follow its prompt, each found by a failed run:
the text encoders start at useful scales (:func:`init_text_encoder`), the noise schedule is
shifted for 16x16 latents (:data:`SCHEDULER`), the UNet has SDXL's three levels (:data:`SPEC`),
and the loss is carried by the noisy timesteps (:func:`train_unet`). Without the first three the
first model learned colour but drew the background and the position the initial noise
suggested, whatever the prompt said; without the fourth, stars, crosses and diamonds came out
as blobs (held-out shape 56.2 % instead of 79.7 % at guidance 5).

Seeded and deterministic on one machine (same seed, steps and XLA build -> same weights).
Losses are printed every ``--log-every`` steps and stored in ``<out>/training.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from transformers import CLIPTokenizer

from sdxl_engine.checkpoint import builtin
from sdxl_engine.checkpoint.loading import load_model
from sdxl_engine.checkpoint.writing import save_folder
from sdxl_engine.models import build_component
from sdxl_engine.program.generate import encode_prompts
from tools import shapes

# The SDXL architecture at 64x64 (compare builtin.SDXL_BASE): same block types, attention with
# cross-attention to both text encoders, text_time added conditioning; far fewer channels.
SPEC = {
    **builtin.TINY,  # the two tiny CLIP text encoders
    # SDXL's three UNet levels (DownBlock2D, then two CrossAttnDownBlock2D) at 16x16, 8x8 and 4x4
    # latents: the 4x4 level sees the image's borders in every cell (zero padding), so the
    # cross-attention there can place a shape "on the left" or "at the top".
    "unet": dict(
        builtin.TINY["unet"],
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(32, 64, 64),
        attention_head_dim=(2, 4, 4),
        transformer_layers_per_block=(1, 1, 1),
    ),
    # tiny-random's VAE (factor 4: 64x64 pixels -> 16x16 latents) with wider middle blocks; the
    # scaling_factor is measured after training (stage 2).
    "vae": dict(builtin.TINY["vae"], block_out_channels=(32, 64, 64), scaling_factor=1.0),
}
# SDXL's Euler scheduler with the noise schedule shifted for 16x16 latents. SDXL's schedule was
# made for 128x128 latents; at 16x16 the coarse layout (background colour, where the shape is)
# still shows through the noise at every timestep, because a region's mean over many latent
# pixels averages the noise away (at t = 999: SNR 4.7e-3 per pixel, of order 1 for a region of
# 256 pixels). A model trained so reads the layout off the noise and ignores those words of the
# prompt. beta_end 0.012 -> 0.04 hides the background for t > ~830 and a shape's place for
# t > ~760 (our estimate, for a latent contrast of 2 between shape and background; Hoogeboom et
# al. 2023, "simple diffusion", shift the SNR down for low resolutions). "linspace" spacing
# makes sampling start at t = 999 (Lin et al. 2023), and v-prediction keeps the first steps, at
# sigma up to ~1e4, well conditioned (epsilon-prediction drew noise there).
SCHEDULER = dict(builtin.SDXL_SCHEDULER, beta_end=0.04, timestep_spacing="linspace", prediction_type="v_prediction")
ADD_TIME_IDS = (64, 64, 0, 0, 64, 64)  # original size, crop top-left, target size: what the engine sends


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="assets/tiny-shapes", help="output directory (replaced)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--images", type=int, default=20000, help="training images rendered")
    p.add_argument("--vae-steps", type=int, default=2000)
    p.add_argument("--vae-batch", type=int, default=16)
    p.add_argument("--vae-crop", type=int, default=32, help="VAE trains on random crops (pixels)")
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--unet-steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--caption-dropout", type=float, default=0.1)
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument("--loss-weight", choices=("min-snr", "v-clipped"), default="v-clipped",
                   help="per-timestep loss weight (see train_unet)")
    p.add_argument("--t-sampling", choices=("uniform", "logit-normal"), default="logit-normal",
                   help="how training timesteps are drawn (see train_unet)")
    p.add_argument("--t-mean", type=float, default=0.0, help="logit-normal location (of t / 1000)")
    p.add_argument("--t-std", type=float, default=1.0, help="logit-normal scale")
    p.add_argument("--vae-from", help="take the trained VAE of this model directory and skip stage 2 (for experiments)")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def adam(lr: float, steps: int):
    """AdamW with linear warm-up, cosine decay and gradient clipping (optax)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(200, steps // 10), steps, end_value=lr / 20)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))


def train_vae(vae, images: np.ndarray, args, key) -> tuple[dict, list]:
    """Stage 2. vae: its Component; images: (n, 64, 64, 3) uint8. Returns VAE params and [(step, loss, mse)]."""
    params = vae.init(key)  # eagerly: the compiled init's values to the bit, without its XLA compile (see main)
    opt = adam(args.vae_lr, args.vae_steps)
    opt_state = opt.init(params)

    def loss_fn(params, x, key):
        model = vae.bind(params)
        mean, logvar = model.encode(x)
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)  # a posterior sample
        recon = model.decode(z)
        mse = jnp.mean((recon - x) ** 2)
        kl = 0.5 * jnp.sum(mean**2 + jnp.exp(logvar) - 1.0 - logvar, axis=(1, 2, 3))  # diffusers' DiagonalGaussian.kl
        return mse + 1e-6 * jnp.mean(kl), mse

    @jax.jit
    def step(params, opt_state, x, key):
        (loss, mse), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, key)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, mse

    rng = np.random.default_rng(args.seed + 1)
    history = []
    for i in range(1, args.vae_steps + 1):
        y, x0 = rng.integers(0, shapes.SIZE - args.vae_crop + 1, size=2)
        crops = images[rng.integers(len(images), size=args.vae_batch), y: y + args.vae_crop, x0: x0 + args.vae_crop]
        x = shapes.to_pixels(crops)
        params, opt_state, loss, mse = step(params, opt_state, x, jax.random.fold_in(key, i))
        if i % args.log_every == 0 or i == args.vae_steps:
            history.append((i, float(loss), float(mse)))
            log(f"vae step {i}/{args.vae_steps} loss {float(loss):.5f} mse {float(mse):.5f}")
    return params, history


def init_text_encoder(params: dict, key) -> dict:
    """Fresh weights for a CLIP text encoder trained from scratch, at useful scales.

    transformers' CLIP initialises its embeddings with std 0.02 and 0.01 (made to be overwritten
    by pretrained weights): hidden states start near zero, the UNet's cross-attention can hardly
    tell tokens apart, and the prompt is learned very slowly. Here: token embeddings std 1,
    position embeddings std 0.5; the modules' own init already gives LeCun-normal weights
    (std 1/sqrt(fan_in)), zero biases and unit LayerNorms -- hidden states of order 1, as in a
    trained CLIP.
    """
    out = dict(params)
    for k, name in zip(jax.random.split(key, 2), ("embeddings.token_embedding.weight",
                                                   "embeddings.position_embedding.weight")):
        full = next(n for n in params if n.endswith(name))
        out[full] = (1.0 if "token" in name else 0.5) * jax.random.normal(k, params[full].shape, params[full].dtype)
    return out


def train_unet(components: dict, params: dict, latents: np.ndarray, ids: np.ndarray, alphas_cumprod, args, key):
    """Stage 4. latents (n, 4, 16, 16) scaled; ids (n, 2, 77) int32. Returns EMA params, history.

    Timesteps (``args.t_sampling``): "logit-normal" (the shipped recipe) draws t / 1000 =
    sigmoid(n), n ~ N(``t_mean`` 0, ``t_std`` 1), Esser et al. 2024 (SD3)'s choice: the middle
    timesteps, where on this shifted schedule a shape's outline forms (SNR ~0.6-0.005, t ~ 300-650),
    get 1.5x the draws of uniform t, the pure-noise end (t > 800, SNR < 1e-4) 0.4x. "uniform" is
    DDPM's U{0, ..., 999}.

    Loss weight per timestep, on the v-MSE (``args.loss_weight``):

    * "v-clipped" (the shipped recipe): min(1, 5 / (SNR + 1)), i.e. min(SNR + 1, 5) on the
      x0-MSE: plain v-MSE (as SD 2 and "simple diffusion", Hoogeboom et al. 2023, train) where
      SNR <= 4 (t > ~130 here), min-SNR's clipping at 5 for the near-clean rest.
    * "min-snr": min(SNR, 5) / (SNR + 1), Hang et al. 2023's min-SNR-5 for v-prediction (as
      diffusers' train_text_to_image). On the x0-MSE that is min(SNR, 5): with this shifted
      schedule < 6 % of its peak for t > 500, the noisy timesteps where the prompt decides where
      the shape goes and what it is.

    Measured, seed 0, 4000 steps, held-out shape / colour / position at guidance 7 (README,
    "tiny-shapes"): min-snr + uniform 60.9 / 100 / 100 % (shape 56.2 % at guidance 5),
    v-clipped + uniform 65.6 / 98.4 / 100 %, v-clipped + logit-normal 70.3 / 100 / 100 % (shape
    79.7 % at guidance 5). After 1200 steps position is 17 % with min-snr (chance 20 %) and 100 %
    with v-clipped.
    """
    opt = adam(args.lr, args.unet_steps)
    opt_state = opt.init(params)
    ema = params
    alphas_cumprod = jnp.asarray(alphas_cumprod, jnp.float32)
    time_ids = jnp.asarray(ADD_TIME_IDS, jnp.float32)
    v_prediction = SCHEDULER["prediction_type"] == "v_prediction"

    def loss_fn(params, x0, ids, keep, key):
        b = x0.shape[0]
        hidden, text_embeds = encode_prompts(components, params, ids)  # (b, 77, 64), (b, 32)
        hidden, text_embeds = hidden * keep[:, None, None], text_embeds * keep[:, None]
        k_t, k_noise = jax.random.split(key)
        if args.t_sampling == "logit-normal":  # t / 1000 = sigmoid(N(t_mean, t_std)), Esser et al. 2024
            u = jax.nn.sigmoid(args.t_mean + args.t_std * jax.random.normal(k_t, (b,)))
            t = jnp.clip((u * len(alphas_cumprod)).astype(jnp.int32), 0, len(alphas_cumprod) - 1)
        else:
            t = jax.random.randint(k_t, (b,), 0, len(alphas_cumprod))
        noise = jax.random.normal(k_noise, x0.shape)
        a = alphas_cumprod[t][:, None, None, None]
        noisy = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise  # q(x_t | x_0), Ho et al. 2020 eq. 4
        snr = alphas_cumprod[t] / (1 - alphas_cumprod[t])
        if v_prediction:  # v = sqrt(a) eps - sqrt(1 - a) x0 (Salimans & Ho 2022)
            target = jnp.sqrt(a) * noise - jnp.sqrt(1 - a) * x0
            clipped = args.loss_weight == "v-clipped"
            weight = jnp.minimum(1.0, 5.0 / (snr + 1)) if clipped else jnp.minimum(snr, 5.0) / (snr + 1)
        else:  # epsilon; min-SNR-5 weight for epsilon (Hang et al. 2023)
            target, weight = noise, jnp.minimum(snr, 5.0) / snr
        pred = components["unet"].bind(params["unet"])(noisy, t, hidden, text_embeds,
                                                       jnp.broadcast_to(time_ids, (b, 6)))
        return jnp.mean(weight * jnp.mean((pred - target) ** 2, axis=(1, 2, 3)))

    @jax.jit
    def step(params, ema, opt_state, x0, ids, keep, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, x0, ids, keep, key)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: args.ema * e + (1 - args.ema) * p, ema, params)
        return params, ema, opt_state, loss

    rng = np.random.default_rng(args.seed + 2)
    history, running = [], []
    for i in range(1, args.unet_steps + 1):
        idx = rng.integers(len(latents), size=args.batch)
        keep = (rng.random(args.batch) >= args.caption_dropout).astype(np.float32)
        params, ema, opt_state, loss = step(params, ema, opt_state, latents[idx], ids[idx], keep,
                                            jax.random.fold_in(key, i))
        running.append(loss)
        if i % args.log_every == 0 or i == args.unet_steps:
            mean = float(np.mean(jax.device_get(running)))
            running = []
            history.append((i, mean))
            log(f"unet step {i}/{args.unet_steps} loss {mean:.5f}")
    return ema, history


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lcm-lora"]:  # the few-step LoRA of a trained model (tools/train_lcm.py)
        from tools import train_lcm
        return train_lcm.main(argv[1:])
    if argv[:1] == ["controlnet"]:  # a canny ControlNet for the trained model (tools/train_controlnet.py)
        from tools import train_controlnet
        return train_controlnet.main(argv[1:])
    args = parse_args(argv)
    start = time.perf_counter()
    out = Path(args.out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    key = jax.random.key(args.seed)

    # 1. Data and tokens.
    images, captions, _ = shapes.make_dataset(args.images, args.seed)
    vocab_size = builtin.write_tokenizers(tmp)
    tokenizers = [CLIPTokenizer.from_pretrained(str(tmp / sub)) for sub in ("tokenizer", "tokenizer_2")]
    ids = np.stack([np.asarray(t(captions, padding="max_length", max_length=77, truncation=True).input_ids)
                    for t in tokenizers], axis=1).astype(np.int32)  # (n, 2, 77)
    log(f"{len(images)} images, e.g. {captions[:3]}; vocab {vocab_size} ({time.perf_counter() - start:.0f} s)")

    # 2-3. VAE, scaling factor, latents.
    configs = builtin.component_configs(SPEC, vocab_size)
    vae = build_component("vae", configs["vae"])
    if args.vae_from:
        vae_params = load_model(args.vae_from, dtype="float32", platform="cpu", cache_dir="").params["vae"]
        vae_history = []
    else:
        vae_params, vae_history = train_vae(vae, images, args, jax.random.fold_in(key, 1))
    raw = shapes.encode_all(vae, vae_params, images)  # stage 3
    scaling_factor = float(1.0 / raw.std())
    configs["vae"]["scaling_factor"] = scaling_factor
    vae_s = time.perf_counter() - start
    log(f"vae done in {vae_s:.0f} s; latent std {raw.std():.3f} -> scaling_factor {scaling_factor:.4f}")

    # 4. Text encoders + UNet.
    components = {name: build_component(name, configs[name]) for name in ("text_encoder", "text_encoder_2", "unet")}
    # Eagerly, op by op: the same values to the bit as jax.jit(c.init), and faster on a CPU, where compiling the
    # whole initialiser (every tensor's random draw in one program) costs more than running it (docs/benchmarks.md).
    params = {name: c.init(jax.random.fold_in(key, seed)) for (name, c), seed in zip(components.items(), (4, 5, 2))}
    for name, seed in (("text_encoder", 6), ("text_encoder_2", 7)):
        params[name] = init_text_encoder(params[name], jax.random.fold_in(key, seed))
    n_train = SCHEDULER["num_train_timesteps"]
    betas = np.linspace(SCHEDULER["beta_start"] ** 0.5, SCHEDULER["beta_end"] ** 0.5, n_train, dtype=np.float32) ** 2
    alphas_cumprod = np.cumprod(1.0 - betas, dtype=np.float32)
    params, unet_history = train_unet(components, params, raw * scaling_factor, ids, alphas_cumprod, args,
                                      jax.random.fold_in(key, 3))
    total_s = time.perf_counter() - start
    log(f"unet done; total {total_s:.0f} s")

    # 5. Save (diffusers format, safetensors) and the training record.
    params = jax.tree.map(np.asarray, {**params, "vae": vae_params})
    save_folder(tmp, configs, params, SCHEDULER, vocabulary=shapes.caption_words())
    record = {"args": vars(args), "vae_s": round(vae_s, 1), "total_s": round(total_s, 1),
              "scaling_factor": scaling_factor, "vae_loss": vae_history, "unet_loss": unet_history,
              "held_out": shapes.HELD_OUT, "jax": jax.__version__, "device": str(jax.devices()[0])}
    (tmp / "training.json").write_text(json.dumps(record, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(f"saved {out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
