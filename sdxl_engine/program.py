"""The compiled program: text encoders, CFG denoising loop and VAE decode in one jitted function.

Static (bound before compiling; changing any of them compiles a new program): the module
objects, the batch size, the image height and width, the largest step count and the
prediction type. Everything that changes per request is a traced array argument, so a new
prompt, negative prompt, seed, guidance scale or step count (up to ``max_steps``) reuses the
same executable:

====================  ========================  =========  ==========================================
argument              shape                     dtype      meaning
====================  ========================  =========  ==========================================
prompt_ids            (batch, 2, 77)            int32      token ids for tokenizer and tokenizer_2
negative_ids          (batch, 2, 77)            int32      the same for the negative prompt
negative_zero         (batch,)                  float32    1 = empty negative prompt: zero embeddings
seeds                 (batch,)                  uint32     image i's initial noise comes from seed i
guidance_scale        (batch,)                  float32    classifier-free guidance scale
timesteps             (max_steps,)              float32    Euler timesteps, padded after num_steps
sigmas                (max_steps + 1,)          float32    Euler sigmas, sigmas[num_steps] = 0
num_steps             ()                        int32      denoising steps to run (1..max_steps)
init_noise_sigma      ()                        float32    scale of the initial noise
====================  ========================  =========  ==========================================

Outputs: ``images`` (batch, height, width, 3) uint8, channels-last, 0..255; ``finite`` (batch,)
bool, False where the decoded image held NaN or inf (the caller reports an error instead of
showing a black square).

The batch is split over the mesh's ``data`` axis with ``jax.shard_map``: every device runs the
whole program on its own images, params replicated, with no cross-device communication.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from .sharding import DATA_AXIS, batch_sharded, check_batch, replicated

TOKENS = 77  # CLIP context length of both SDXL tokenizers


@dataclasses.dataclass(frozen=True)
class ProgramShape:
    """The static shape of one compiled program; each distinct value is one compile."""

    batch: int  # images per request (global, over all devices)
    height: int  # pixels
    width: int  # pixels
    max_steps: int  # longest denoising loop the padded sigmas allow


@dataclasses.dataclass
class CompiledProgram:
    """An ahead-of-time compiled executable and what it took to build."""

    shape: ProgramShape
    executable: Callable
    compile_s: float  # seconds to lower and compile (includes a persistent-cache hit)
    flops: float | None  # XLA's cost analysis of the whole program (all devices), if reported


def euler_schedule(config, num_steps: int, max_steps: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Euler discrete timesteps and sigmas on the host, padded to ``max_steps``.

    Same numbers as diffusers' ``FlaxEulerDiscreteScheduler.set_timesteps`` (``linspace`` and
    ``leading`` spacing, ``scaled_linear``/``linear`` betas), computed with numpy so a new step
    count costs no device dispatch. Sigma formula: sigma = sqrt((1 - alphā) / alphā) (Karras et
    al. 2022, k-diffusion), interpolated at the chosen timesteps.

    Returns:
        timesteps (max_steps,) float32, sigmas (max_steps + 1,) float32 (zero after the last
        real sigma), init_noise_sigma (float).
    """
    n_train = config.num_train_timesteps
    if config.beta_schedule == "scaled_linear":
        betas = np.linspace(config.beta_start**0.5, config.beta_end**0.5, n_train, dtype=np.float32) ** 2
    elif config.beta_schedule == "linear":
        betas = np.linspace(config.beta_start, config.beta_end, n_train, dtype=np.float32)
    else:
        raise ValueError(f"beta_schedule {config.beta_schedule!r} is not supported (scaled_linear, linear)")
    alphas_cumprod = np.cumprod(1.0 - betas, dtype=np.float32)
    if config.timestep_spacing == "linspace":
        timesteps = np.linspace(n_train - 1, 0, num_steps, dtype=np.float32)
    elif config.timestep_spacing == "leading":
        ratio = n_train // num_steps
        timesteps = (np.arange(num_steps) * ratio).round()[::-1].astype(np.float32) + 1  # diffusers' steps_offset
    else:
        raise ValueError(f"timestep_spacing {config.timestep_spacing!r} is not supported (linspace, leading)")
    all_sigmas = ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5
    sigmas = np.interp(timesteps, np.arange(n_train), all_sigmas).astype(np.float32)
    init = float(sigmas.max()) if config.timestep_spacing == "linspace" else float((sigmas.max() ** 2 + 1) ** 0.5)
    padded_t = np.zeros(max_steps, np.float32)
    padded_t[:num_steps] = timesteps
    padded_s = np.zeros(max_steps + 1, np.float32)
    padded_s[:num_steps] = sigmas
    return padded_t, padded_s, init


def encode_prompts(model, params, ids):
    """Both CLIP text encoders, SDXL style (penultimate hidden states, pooled projection).

    Args:
        ids: (n, 2, 77) int32 token ids; [:, 0] for text_encoder, [:, 1] for text_encoder_2.
    Returns:
        encoder_hidden_states (n, 77, hidden_1 + hidden_2) and text_embeds (n, projection_2), in
        the model's dtype.
    """
    out_1 = model.text_encoder(ids[:, 0], params=params["text_encoder"], output_hidden_states=True)
    out_2 = model.text_encoder_2(ids[:, 1], params=params["text_encoder_2"], output_hidden_states=True)
    hidden = jnp.concatenate([out_1.hidden_states[-2], out_2.hidden_states[-2]], axis=-1)  # (n, 77, h1 + h2)
    return hidden, out_2.text_embeds  # text_embeds: (n, projection_dim)


def cfg_combine(noise_uncond, noise_text, guidance_scale):
    """Classifier-free guidance (Ho & Salimans 2022) as diffusers' SDXL pipeline combines it:
    ``uncond + g * (text - uncond)``, so g = 0 gives the unconditional prediction and g = 1 the
    text-conditioned one. float32: noise_* (b, c, h, w), guidance_scale (b,), one per image.
    """
    return noise_uncond + guidance_scale[:, None, None, None] * (noise_text - noise_uncond)


def euler_step(latents, model_output, sigma, sigma_next, prediction_type: str):
    """One Euler step x_{i+1} = x_i + d_i (sigma_{i+1} - sigma_i) (Karras et al. 2022, Alg. 2).

    The derivative d = (x - x0_pred) / sigma is diffusers' FlaxEulerDiscreteScheduler.step. All
    float32: latents (b, c, h, w), model_output like latents, sigmas scalars.
    """
    if prediction_type == "epsilon":
        pred_original = latents - sigma * model_output
    elif prediction_type == "v_prediction":
        pred_original = model_output * (-sigma / (sigma**2 + 1) ** 0.5) + latents / (sigma**2 + 1)
    else:
        raise ValueError(f"prediction_type {prediction_type!r} is not supported (epsilon, v_prediction)")
    derivative = (latents - pred_original) / sigma
    return latents + derivative * (sigma_next - sigma)


def build_generate(model, shape: ProgramShape, python_loop: bool = False) -> Callable:
    """The per-device generate function for ``shape`` (see the module docstring for arguments).

    Args:
        model: a LoadedModel (module objects and scheduler config; params come as an argument).
        python_loop: run the denoising steps in a Python loop instead of ``lax.fori_loop``
            (debugging only: needs a concrete ``num_steps``, i.e. no jit).
    """
    factor = model.vae_scale_factor
    latent_shape = (model.latent_channels, shape.height // factor, shape.width // factor)
    prediction_type = model.scheduler.config.prediction_type
    scaling_factor = model.vae.config.scaling_factor

    def generate(params, prompt_ids, negative_ids, negative_zero, seeds, guidance_scale,
                 timesteps, sigmas, num_steps, init_noise_sigma):
        b = prompt_ids.shape[0]
        # 1. Text: negative and positive prompts in one encoder batch, negatives first.
        hidden, text_embeds = encode_prompts(model, params, jnp.concatenate([negative_ids, prompt_ids]))  # (2b, 77, D)
        keep = jnp.concatenate([1.0 - negative_zero, jnp.ones((b,), jnp.float32)]).astype(hidden.dtype)  # (2b,)
        hidden = hidden * keep[:, None, None]  # empty negative prompt -> zeros, as SDXL base does
        text_embeds = text_embeds * keep[:, None]
        size = jnp.array([shape.height, shape.width, 0, 0, shape.height, shape.width], hidden.dtype)
        add_time_ids = jnp.broadcast_to(size, (2 * b, 6))  # original size, crop top-left, target size
        cond = {"text_embeds": text_embeds, "time_ids": add_time_ids}

        # 2. Initial noise, float32: image i from its own seed, whatever device it lands on.
        latents = jax.vmap(lambda s: jax.random.normal(jax.random.key(s), latent_shape, jnp.float32))(seeds)
        latents = latents * init_noise_sigma  # (b, c, h, w)

        # 3. Denoising loop: CFG over a doubled batch, Euler step in float32.
        def step(i, latents):
            sigma, sigma_next = sigmas[i], sigmas[i + 1]
            x = jnp.concatenate([latents, latents]) / jnp.sqrt(sigma**2 + 1)  # (2b, c, h, w)
            t = jnp.broadcast_to(timesteps[i].astype(jnp.int32), (2 * b,))
            noise = model.unet.apply({"params": params["unet"]}, x.astype(hidden.dtype), t,
                                     encoder_hidden_states=hidden, added_cond_kwargs=cond).sample
            noise_uncond, noise_text = jnp.split(noise.astype(jnp.float32), 2)  # (b, c, h, w) each
            return euler_step(latents, cfg_combine(noise_uncond, noise_text, guidance_scale), sigma, sigma_next,
                              prediction_type)

        if python_loop:
            for i in range(int(num_steps)):
                latents = step(i, latents)
        else:
            latents = jax.lax.fori_loop(0, num_steps, step, latents)

        # 4. VAE decode, then channels-first [-1, 1] -> channels-last uint8 [0, 255].
        decoded = model.vae.apply({"params": params["vae"]}, (latents / scaling_factor).astype(hidden.dtype),
                                  method=model.vae.decode).sample.astype(jnp.float32)  # (b, 3, H, W)
        finite = jnp.isfinite(decoded).all(axis=(1, 2, 3))
        pixels = jnp.clip(decoded / 2 + 0.5, 0.0, 1.0).transpose(0, 2, 3, 1)  # (b, H, W, 3)
        return jnp.round(pixels * 255).astype(jnp.uint8), finite

    return generate


def abstract_inputs(shape: ProgramShape, mesh: Mesh) -> tuple:
    """ShapeDtypeStructs (with shardings) of the per-request arguments, for lowering."""
    b, sb, rep = shape.batch, batch_sharded(mesh), replicated(mesh)
    s = jax.ShapeDtypeStruct
    return (
        s((b, 2, TOKENS), jnp.int32, sharding=sb),
        s((b, 2, TOKENS), jnp.int32, sharding=sb),
        s((b,), jnp.float32, sharding=sb),
        s((b,), jnp.uint32, sharding=sb),
        s((b,), jnp.float32, sharding=sb),
        s((shape.max_steps,), jnp.float32, sharding=rep),
        s((shape.max_steps + 1,), jnp.float32, sharding=rep),
        s((), jnp.int32, sharding=rep),
        s((), jnp.float32, sharding=rep),
    )


def jit_program(model, shape: ProgramShape, mesh: Mesh):
    """``jax.jit`` of the sharded program with explicit in/out shardings (not yet compiled)."""
    check_batch(shape.batch, mesh)
    spec_b, spec_r = P(DATA_AXIS), P()
    sharded = jax.shard_map(
        build_generate(model, shape),
        mesh=mesh,
        in_specs=(spec_r, spec_b, spec_b, spec_b, spec_b, spec_b, spec_r, spec_r, spec_r, spec_r),
        out_specs=(spec_b, spec_b),
    )
    sb, rep = batch_sharded(mesh), replicated(mesh)
    return jax.jit(sharded, in_shardings=(rep, sb, sb, sb, sb, sb, rep, rep, rep, rep), out_shardings=(sb, sb))


def compile_program(model, params, shape: ProgramShape, mesh: Mesh) -> CompiledProgram:
    """Lower and compile ahead of time for ``shape``; ``params`` may be arrays or ShapeDtypeStructs."""
    start = time.perf_counter()
    lowered = jit_program(model, shape, mesh).lower(params, *abstract_inputs(shape, mesh))
    executable = lowered.compile()
    flops = None
    try:
        cost = executable.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = float(cost.get("flops")) if cost and cost.get("flops") is not None else None
    except Exception:  # cost analysis is best-effort and backend-dependent
        flops = None
    return CompiledProgram(shape=shape, executable=executable, compile_s=time.perf_counter() - start, flops=flops)
