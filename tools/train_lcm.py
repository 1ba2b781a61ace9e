"""Distil a model into an LCM-LoRA: latent consistency distillation on a CPU (``python -m tools.train lcm-lora``).

    python -m tools.train lcm-lora                         # the shipped tiny-shapes LCM-LoRA (docs/benchmarks.md)
    python -m tools.train lcm-lora --steps 100 --out /tmp/lcm.safetensors   # a quick try

Latent consistency distillation (Luo et al. 2023, "Latent Consistency Models", Algorithm 1) with the
LoRA of Luo et al. 2023b ("LCM-LoRA"), as diffusers' ``examples/consistency_distillation/
train_lcm_distill_lora_sdxl.py`` runs it, on a frozen teacher (the model itself, no LoRA):

1. Data: training images and captions of :mod:`tools.shapes` (held-out combinations excluded),
   encoded once by the model's VAE (posterior mean times ``scaling_factor``) and both text
   encoders (the teacher's unconditional input is the zero embedding, what the engine feeds for an
   empty negative prompt).
2. Each step: a DDIM solver step index n ~ U{0..N-1} over N = ``--ddim-steps`` (50) timesteps
   t_n = 20 (n + 1) - 1 (diffusers' ``DDIMSolver``), the noisy latents at t_n, then
   * the student (UNet + LoRA) at t_n, with the consistency boundary condition
     f(x, t) = c_skip(t) x + c_out(t) x0(x, t) (``LCMScheduler.get_scalings_for_boundary_condition_discrete``,
     sigma_data 0.5, ``timestep_scaling`` 10);
   * the teacher's classifier-free-guided x0 and epsilon at t_n (guidance ``--guidance``, the
     engine's convention: uncond + g (cond - uncond)), one DDIM step to t_{n-1} = t_n - 20;
   * the target: f at (x_{t_{n-1}}, t_{n-1}) without gradient, by an exponential moving average of
     the student's LoRA (``--target-ema`` 0.95, the paper's mu; the LoRA script uses the student
     itself, ``--target-ema 0``: with it this model's LoRA collapsed within 500 steps at lr 1e-3);
   * loss: the mean squared difference (the LoRA script's default ``l2``), or pseudo-Huber
     sqrt(d^2 + c^2) - c per element, c = ``--huber-c`` (Song & Dhariwal 2023).
3. Save the LoRA in diffusers' PEFT format (``unet.<module>.lora_A.weight`` (r, in[, kh, kw]),
   ``lora_B.weight`` (out, r[, 1, 1]), the LoraConfig in the ``lora_adapter_metadata`` header), so
   that diffusers' ``load_lora_weights`` reads it too, and the training record beside it
   (``<out minus .safetensors>.json``: data, steps, losses, time).

The LoRA adapts lcm-lora-sdxl's modules (:data:`TARGETS`). The guidance is fixed, not sampled
(the LoRA version has no guidance input): the student learns the teacher at guidance ``--guidance``.
Seeded and deterministic on one machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import save_file

from sdxl_engine.checkpoint.loading import load_model
from sdxl_engine.checkpoint.lora import merge_layer
from sdxl_engine.program.schedulers import _alphas_cumprod, sampler_config
from tools import shapes

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "assets" / "tiny-shapes"
# The modules lcm-lora-sdxl adapts (its LoraConfig's target_modules; PEFT matches them as name suffixes).
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1", "conv2",
           "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "time_emb_proj")
SIGMA_DATA = 0.5


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.train lcm-lora", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(MODEL), help="the teacher (a diffusers folder)")
    p.add_argument("--out", default=str(MODEL / "lcm-lora.safetensors"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--images", type=int, default=8000, help="training images rendered (data seed: --seed + 100)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=16.0, help="lora_alpha (scale alpha / rank)")
    p.add_argument("--guidance", type=float, default=5.0, help="the teacher's guidance_scale")
    p.add_argument("--ddim-steps", type=int, default=50, help="DDIM solver timesteps (LCMScheduler's "
                   "original_inference_steps)")
    p.add_argument("--timestep-scaling", type=float, default=10.0)
    p.add_argument("--loss", choices=("l2", "huber"), default="l2", help="the LoRA script's --loss_type")
    p.add_argument("--huber-c", type=float, default=0.001)
    p.add_argument("--target-ema", type=float, default=0.95, help="the target network is an EMA of the student's "
                   "LoRA with this decay (Luo et al. 2023's mu; 0 = the student itself, as the LoRA script)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--save-every", type=int, default=0, help="also save <out>.step<N>.safetensors every N steps")
    p.add_argument("--max-minutes", type=float, default=85.0, help="stop (and save) after this much training time")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[lcm-lora {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def lora_targets(shapes_: dict[str, tuple]) -> dict[str, tuple[int, int, int, bool]]:
    """{weight key: (out, in, kernel, is_conv)} of the UNet weights a LoRA on :data:`TARGETS` adapts.

    shapes_: the UNet's {key: shape} in the modules' layout ((out, in) or (kh, kw, in, out)).
    """
    out = {}
    for key, shape in shapes_.items():
        if not key.endswith(".weight") or len(shape) not in (2, 4):
            continue
        module = key[: -len(".weight")]
        if any(module == t or module.endswith("." + t) for t in TARGETS):
            out[key] = (shape[0], shape[1], 1, False) if len(shape) == 2 else (shape[3], shape[2], shape[0], True)
    return out


def init_lora(targets: dict, rank: int, key) -> dict[str, tuple[jax.Array, jax.Array]]:
    """{key: (down (r, in*k*k), up (out, r))}: down as PEFT's kaiming-uniform(a = sqrt 5), up zeros (a no-op)."""
    out = {}
    for i, (name, (o, n_in, k, _)) in enumerate(sorted(targets.items())):
        fan_in = n_in * k * k
        bound = 1 / math.sqrt(fan_in)  # kaiming_uniform with a = sqrt(5): gain sqrt(2 / 6) * sqrt(3 / fan_in)
        down = jax.random.uniform(jax.random.fold_in(key, i), (rank, fan_in), jnp.float32, -bound, bound)
        out[name] = (down, jnp.zeros((o, rank), jnp.float32))
    return out


def merged(base: dict, lora: dict, scale: float) -> dict:
    """The UNet params with ``scale * up @ down`` added to each adapted weight (engine's merge_layer)."""
    params = dict(base)
    for key, (down, up) in lora.items():
        params[key] = merge_layer(base[key], ((down, up * scale),), jnp.ones((1,), jnp.float32), (0,))
    return params


def boundary(t, timestep_scaling: float):
    """c_skip, c_out at integer timesteps t (LCMScheduler.get_scalings_for_boundary_condition_discrete)."""
    scaled = t.astype(jnp.float32) * timestep_scaling
    c_skip = SIGMA_DATA**2 / (scaled**2 + SIGMA_DATA**2)
    c_out = scaled / jnp.sqrt(scaled**2 + SIGMA_DATA**2)
    return c_skip, c_out


def predictions(output, sample, alpha, prediction_type: str):
    """(x0, epsilon) from a UNet output at x-space ``sample`` with alphā ``alpha`` (diffusers' conversions)."""
    a, s = jnp.sqrt(alpha), jnp.sqrt(1 - alpha)
    if prediction_type == "v_prediction":
        return a * sample - s * output, a * output + s * sample
    if prediction_type == "epsilon":
        return (sample - s * output) / a, output
    return output, (sample - a * output) / s  # "sample"


def save_lora(path: Path, lora: dict, targets: dict, rank: int, alpha: float, record: dict) -> None:
    """The LoRA as diffusers' ``save_lora_weights`` writes a PEFT UNet LoRA, and the record as JSON."""
    tensors = {}
    for key, (down, up) in sorted(lora.items()):
        o, n_in, k, conv = targets[key]
        module = key[: -len(".weight")]
        down, up = np.asarray(down, np.float32), np.asarray(up, np.float32)
        if conv:  # PEFT's Conv2d LoRA: lora_A a (k x k) conv to r channels, lora_B a 1x1 conv
            down, up = down.reshape(rank, n_in, k, k), up.reshape(o, rank, 1, 1)
        tensors[f"unet.{module}.lora_A.weight"] = np.ascontiguousarray(down)
        tensors[f"unet.{module}.lora_B.weight"] = np.ascontiguousarray(up)
    config = {"r": rank, "lora_alpha": alpha, "target_modules": sorted(TARGETS), "init_lora_weights": True,
              "lora_dropout": 0.0, "bias": "none", "use_dora": False, "use_rslora": False, "peft_type": "LORA",
              "alpha_pattern": {}, "rank_pattern": {}}
    metadata = {"format": "pt", "lora_adapter_metadata": json.dumps({f"unet.{k}": v for k, v in config.items()},
                                                                     sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.rename(path)
    path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    key = jax.random.key(args.seed)
    model = load_model(args.model, dtype="float32", platform="cpu", cache_dir="")
    components, base = model.components, model.params
    cfg = sampler_config("Euler", model.scheduler_config)
    prediction_type = cfg["prediction_type"]
    alphas_cumprod = jnp.asarray(_alphas_cumprod(cfg), jnp.float32)
    n_train = len(alphas_cumprod)

    # 1. Data: latents and text embeddings, once.
    images, captions, _ = shapes.make_dataset(args.images, args.seed + 100)
    latents, hidden, pooled = shapes.encode_training_data(model, images, captions)  # train's stage 3 and the text
    data_s = time.perf_counter() - start
    log(f"{len(images)} images -> latents {latents.shape} std {latents.std():.3f}, text {hidden.shape} "
        f"({data_s:.0f} s)")

    # 2. Distillation.
    targets = lora_targets(components["unet"].shapes)
    lora = init_lora(targets, args.rank, jax.random.fold_in(key, 1))
    n_params = sum(d.size + u.size for d, u in lora.values())
    log(f"LoRA rank {args.rank} on {len(targets)} weights: {n_params} parameters")
    scale = args.alpha / args.rank
    unet = components["unet"]
    h, w = latents.shape[-2:]
    time_ids = jnp.asarray([h * 4, w * 4, 0, 0, h * 4, w * 4], jnp.float32)  # (original, crop, target): pixels
    ratio = n_train // args.ddim_steps
    ddim_t = jnp.asarray(np.arange(1, args.ddim_steps + 1) * ratio - 1, jnp.int32)  # diffusers' DDIMSolver
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10),
                                                                     args.steps, end_value=args.lr / 10),
                                  weight_decay=1e-2))
    opt_state = opt.init(lora)
    target_lora = lora

    def run(params, x, t, hid, emb):
        b = x.shape[0]
        return unet.bind(params)(x, t, hid, emb, jnp.broadcast_to(time_ids, (b, 6)))

    def loss_fn(lora, target_lora, x0, hid, emb, k):
        b = x0.shape[0]
        k_n, k_z = jax.random.split(k)
        n = jax.random.randint(k_n, (b,), 0, args.ddim_steps)
        t_start = ddim_t[n]
        t_prev = jnp.maximum(t_start - ratio, 0)
        a_start = alphas_cumprod[t_start][:, None, None, None]
        a_prev = jnp.where(t_start - ratio >= 0, alphas_cumprod[t_prev], alphas_cumprod[0])[:, None, None, None]
        z = jax.random.normal(k_z, x0.shape)
        noisy = jnp.sqrt(a_start) * x0 + jnp.sqrt(1 - a_start) * z
        student = merged(base["unet"], lora, scale)
        c_skip0, c_out0 = (c[:, None, None, None] for c in boundary(t_start, args.timestep_scaling))
        x0_student, _ = predictions(run(student, noisy, t_start, hid, emb), noisy, a_start, prediction_type)
        pred = c_skip0 * noisy + c_out0 * x0_student
        # Teacher: CFG'd x0 and epsilon at t_start (one batch of 2b), then one DDIM step to t_prev.
        out = run(base["unet"], jnp.concatenate([noisy, noisy]), jnp.concatenate([t_start, t_start]),
                  jnp.concatenate([jnp.zeros_like(hid), hid]), jnp.concatenate([jnp.zeros_like(emb), emb]))
        x0_t, eps_t = predictions(out, jnp.concatenate([noisy, noisy]), jnp.concatenate([a_start, a_start]),
                                  prediction_type)
        g = args.guidance
        x0_t = x0_t[:b] + g * (x0_t[b:] - x0_t[:b])
        eps_t = eps_t[:b] + g * (eps_t[b:] - eps_t[:b])
        x_prev = jnp.sqrt(a_prev) * x0_t + jnp.sqrt(1 - a_prev) * eps_t
        # Target: the EMA of the student's LoRA (or the student itself) at (x_prev, t_prev), no gradient.
        frozen = jax.lax.stop_gradient(merged(base["unet"], target_lora, scale))
        c_skip1, c_out1 = (c[:, None, None, None] for c in boundary(t_prev, args.timestep_scaling))
        x0_next, _ = predictions(run(frozen, x_prev, t_prev, hid, emb), x_prev, a_prev, prediction_type)
        target = jax.lax.stop_gradient(c_skip1 * x_prev + c_out1 * x0_next)
        if args.loss == "huber":
            return jnp.mean(jnp.sqrt((pred - target) ** 2 + args.huber_c**2) - args.huber_c)
        return jnp.mean((pred - target) ** 2)

    @jax.jit
    def step(lora, target_lora, opt_state, x0, hid, emb, k):
        loss, grads = jax.value_and_grad(loss_fn)(lora, target_lora, x0, hid, emb, k)
        updates, opt_state = opt.update(grads, opt_state, lora)
        lora = optax.apply_updates(lora, updates)
        target_lora = jax.tree.map(lambda t, p: args.target_ema * t + (1 - args.target_ema) * p, target_lora, lora)
        return lora, target_lora, opt_state, loss

    def make_record(done: int, train_s: float, history: list) -> dict:
        return {"what": "LCM-LoRA of the teacher model by latent consistency distillation (tools/train_lcm.py)",
                "command": "python -m tools.train lcm-lora " + " ".join(sys.argv[2:] if argv is None else argv),
                "args": vars(args), "teacher": str(Path(args.model).name), "steps_done": done,
                "data": {"images": args.images, "data_seed": args.seed + 100,
                         "generator": "tools.shapes.make_dataset", "held_out_excluded": True},
                "lora": {"rank": args.rank, "alpha": args.alpha, "weights": len(targets),
                         "parameters": int(n_params), "targets": list(TARGETS)},
                "data_s": round(data_s, 1), "train_s": round(train_s, 1),
                "total_s": round(time.perf_counter() - start, 1), "loss": list(history),
                "jax": jax.__version__, "device": str(jax.devices()[0])}

    rng = np.random.default_rng(args.seed + 2)

    def batch_step(state, i):
        idx = rng.integers(len(latents), size=args.batch)
        *state, loss = step(*state, latents[idx], hidden[idx], pooled[idx], jax.random.fold_in(key, 10 + i))
        return tuple(state), loss

    def save_every(i, state, progress):  # --save-every: <out>.step<N>.safetensors along the way
        if args.save_every and i % args.save_every == 0 and i < args.steps:
            out = Path(args.out)
            save_lora(out.with_name(f"{out.stem}.step{i}.safetensors"), jax.device_get(state[0]), targets, args.rank,
                      args.alpha, make_record(i, progress.train_s, progress.history))

    (lora, target_lora, opt_state), progress = shapes.run_steps(batch_step, (lora, target_lora, opt_state),
                                                                args.steps, args.log_every, args.max_minutes, log,
                                                                save_every)
    train_s = progress.train_s
    record = make_record(progress.done, train_s, progress.history)
    save_lora(Path(args.out), jax.device_get(lora), targets, args.rank, args.alpha, record)
    log(f"saved {args.out} ({Path(args.out).stat().st_size / 1e6:.2f} MB); {train_s / 60:.1f} min training")


if __name__ == "__main__":
    main()
