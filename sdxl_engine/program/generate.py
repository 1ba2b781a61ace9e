"""The compiled program: text encoders, CFG denoising loop and VAE decode in one jitted function.

Static (bound before compiling; changing any of them compiles a new program): the model's
modules (their graph definitions), the batch size, the image height and width, the largest
step count, the prediction type and whether classifier-free guidance runs (guidance > 1, as
diffusers decides). Everything that changes per request is a traced array in
:class:`ProgramInputs`, so a new prompt, negative prompt, seed, guidance scale (within one CFG
mode), step count (up to ``max_steps``) or sampler (schedulers.py: every sampler is per-step
coefficients) reuses the same executable.

The initial noise of image i is ``jax.random.normal(jax.random.key(seed_i), (C, H/f, W/f),
float32)`` (channels-first; f the VAE factor, 8 for SDXL), with ``seed_i = seed + i`` for the
request's seed, times the sampler's initial scale (diffusers' ``init_noise_sigma``); Euler a's
step noise is ``jax.random.normal(jax.random.fold_in(jax.random.key(seed_i), step + 1), ...)``:
any implementation can reproduce an image from its seed with JAX's threefry generator.

Outputs: ``images`` (batch, height, width, 3) uint8, channels-last, 0..255; ``finite`` (batch,)
bool, False where the decoded image held NaN or inf (the caller reports an error instead of
showing a black square).

The batch is split over the mesh's ``data`` axis with ``jax.shard_map``: every device runs the
whole program on its own images, params replicated, with no cross-device communication.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as jax_config  # its thread-local enable_compilation_cache switch has no public API
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sdxl_engine.program.executables import ExecutableCache, key_digest, source_digest
from sdxl_engine.checkpoint.loading import LoadedModel
from sdxl_engine.program.schedulers import Schedule
from sdxl_engine.program.sharding import DATA_AXIS, check_batch

TOKENS = 77  # CLIP context length of both SDXL tokenizers


@dataclasses.dataclass(frozen=True)
class ProgramShape:
    """The static shape of one compiled program; each distinct value is one compile."""

    batch: int  # images per request (global, over all devices)
    height: int  # pixels
    width: int  # pixels
    max_steps: int  # longest denoising loop the padded schedule allows
    cfg: bool = True  # classifier-free guidance (UNet on 2 x batch); False: guidance <= 1, conditional only
    given_latents: bool = False  # True: initial latents come in ProgramInputs.latents (tests, tools)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProgramInputs:
    """Everything that changes per request, as arrays: one pytree, its sharding declared once.

    ====================  ========================  =========  ======================================
    field                 shape                     dtype      meaning
    ====================  ========================  =========  ======================================
    prompt_ids            (batch, 2, 77)            int32      token ids for tokenizer and tokenizer_2
    negative_ids          (batch, 2, 77)            int32      the same for the negative prompt
    negative_zero         (batch,)                  float32    1 = empty negative prompt: zero embeddings
    seeds                 (batch,)                  uint32     image i's initial noise comes from seed i
    guidance_scale        (batch,)                  float32    classifier-free guidance scale (cfg only)
    timesteps             (max_steps,)              float32    the UNet's timestep per step, padded
    sigmas                (max_steps + 1,)          float32    sigma-space noise level per step
    a, b, c, d, e         (max_steps,)              float32    the sampler's update (schedulers.py)
    clip_range            ()                        float32    x0 clipped to +-clip_range where e != 0 (inf)
    num_steps             ()                        int32      denoising steps to run (1..max_steps)
    init_scale            ()                        float32    initial latents = noise x init_scale
    final_scale           ()                        float32    VAE input = final latents x final_scale
    latents               (batch, C, h, w) or None  float32    given initial noise (given_latents only)
    ====================  ========================  =========  ======================================
    """

    prompt_ids: jax.Array
    negative_ids: jax.Array
    negative_zero: jax.Array
    seeds: jax.Array
    guidance_scale: jax.Array
    timesteps: jax.Array
    sigmas: jax.Array
    a: jax.Array
    b: jax.Array
    c: jax.Array
    d: jax.Array
    e: jax.Array
    clip_range: jax.Array
    num_steps: jax.Array
    init_scale: jax.Array
    final_scale: jax.Array
    latents: jax.Array | None = None

    @staticmethod
    def specs(given_latents: bool = False) -> "ProgramInputs":
        """PartitionSpecs: per-image fields split over ``data``, the schedule replicated."""
        d, r = P(DATA_AXIS), P()
        return ProgramInputs(d, d, d, d, d, r, r, r, r, r, r, r, r, r, r, r, d if given_latents else None)

    @staticmethod
    def build(prompt_ids: np.ndarray, negative_ids: np.ndarray, negative_empty: bool, seeds, guidance_scale: float,
              schedule: Schedule, steps: int, max_steps: int, latents: np.ndarray | None = None) -> "ProgramInputs":
        """One request's inputs: (2, 77) ids broadcast to every image, a seed per image, a padded schedule.

        ``negative_empty``: no negative prompt, so its embeddings are zeros (SDXL base's
        ``force_zeros_for_empty_prompt``).
        """
        n = len(seeds)
        return ProgramInputs(
            prompt_ids=np.broadcast_to(prompt_ids, (n, 2, TOKENS)),
            negative_ids=np.broadcast_to(negative_ids, (n, 2, TOKENS)),
            negative_zero=np.full((n,), float(negative_empty), np.float32),
            seeds=np.asarray(seeds, np.uint32), guidance_scale=np.full((n,), guidance_scale, np.float32),
            **schedule.padded(max_steps), clip_range=np.float32(schedule.clip_range), num_steps=np.int32(steps),
            init_scale=np.float32(schedule.init_scale),
            final_scale=np.float32(schedule.final_scale), latents=latents)

    @staticmethod
    def abstract(shape: ProgramShape, latent_shape: tuple[int, int, int], mesh: Mesh) -> "ProgramInputs":
        """ShapeDtypeStructs with their shardings, for lowering ahead of time."""
        b, n, s, f32 = shape.batch, shape.max_steps, jax.ShapeDtypeStruct, jnp.float32
        steps = s((n,), f32)
        structs = ProgramInputs(
            s((b, 2, TOKENS), jnp.int32), s((b, 2, TOKENS), jnp.int32), s((b,), f32), s((b,), jnp.uint32),
            s((b,), f32), steps, s((n + 1,), f32), steps, steps, steps, steps, steps, s((), f32), s((), jnp.int32),
            s((), f32), s((), f32),
            s((b, *latent_shape), f32) if shape.given_latents else None)
        return jax.tree.map(lambda x, spec: s(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), structs,
                            ProgramInputs.specs(shape.given_latents))


@dataclasses.dataclass
class CompiledProgram:
    """An ahead-of-time compiled executable and what it took to build."""

    shape: ProgramShape
    executable: Callable  # (params, ProgramInputs) -> (images, finite)
    compile_s: float  # seconds to make it: lower + compile (a persistent-cache hit included) + the executable
    # cache's lookup and store; or, when loaded, the lookup and deserialization alone
    flops: float | None  # XLA's cost analysis of the whole program (all devices), if reported
    loaded: bool = False  # True: deserialized from the executable cache (nothing traced or compiled)
    cache_note: str = ""  # the executable cache's one-line account (loaded / why not / stored), "" without one


def encode_prompts(components: dict, params: dict, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Both CLIP text encoders, SDXL style (penultimate hidden states, pooled projection).

    Args:
        components, params: a model's Components and parameters, by component name.
        ids: (n, 2, 77) int32 token ids; [:, 0] for text_encoder, [:, 1] for text_encoder_2.
    Returns:
        encoder_hidden_states (n, 77, hidden_1 + hidden_2) and text_embeds (n, projection_2), in
        the parameters' dtype (diffusers' ``StableDiffusionXLPipeline.encode_prompt``).
    """
    te1 = components["text_encoder"].bind(params["text_encoder"])
    te2 = components["text_encoder_2"].bind(params["text_encoder_2"])
    out_1 = te1(ids[:, 0], penultimate_only=True)
    out_2 = te2(ids[:, 1])
    hidden = jnp.concatenate([out_1.penultimate, out_2.penultimate], axis=-1)  # (n, 77, h1 + h2)
    return hidden, out_2.text_embeds  # text_embeds: (n, projection_dim)


def tokenize(model: LoadedModel, text: str) -> tuple[np.ndarray, bool]:
    """(2, 77) int32 ids of ``text`` for tokenizer and tokenizer_2 (each padded with its own pad
    token, as diffusers' SDXL pipeline does), and whether the text was cut to 77 tokens."""
    rows, truncated = [], False
    for tok in (model.tokenizer, model.tokenizer_2):
        ids = tok(text, padding="max_length", max_length=TOKENS, truncation=True).input_ids
        # One token past the limit tells: untruncated encoding (or tokenize()) would log transformers'
        # "sequence length is longer than the specified maximum" warning for every long prompt.
        truncated |= len(tok(text, truncation=True, max_length=TOKENS + 1).input_ids) > TOKENS
        rows.append(ids)
    return np.asarray(rows, np.int32), truncated


def cfg_combine(noise_uncond: jax.Array, noise_text: jax.Array, guidance_scale: jax.Array) -> jax.Array:
    """Classifier-free guidance (Ho & Salimans 2022): uncond + g (text - uncond).

    Shapes (b, c, h, w) float32 for the predictions, (b,) for ``guidance_scale``; diffusers'
    ``StableDiffusionXLPipeline`` denoising loop.
    """
    return noise_uncond + guidance_scale[:, None, None, None] * (noise_text - noise_uncond)


def denoised(latents: jax.Array, model_output: jax.Array, sigma, prediction_type: str) -> jax.Array:
    """The UNet's estimate of the clean latents x0 from sigma-space latents (Karras et al. 2022).

    epsilon: x - sigma eps; v_prediction: x / (sigma^2 + 1) - sigma v / sqrt(sigma^2 + 1)
    (Salimans & Ho 2022); sample: the output itself (x0 is the same in sigma and x-space), as
    diffusers' ``EulerDiscreteScheduler.step`` computes ``pred_original_sample``. Float32, (b, c, h, w).
    """
    if prediction_type == "epsilon":
        return latents - sigma * model_output
    if prediction_type == "v_prediction":
        return model_output * (-sigma / (sigma**2 + 1) ** 0.5) + latents / (sigma**2 + 1)
    if prediction_type == "sample":
        return model_output
    raise ValueError(f"prediction_type {prediction_type!r} is not supported (epsilon, v_prediction, sample)")


def sampler_update(latents, x0, x0_prev, noise, a, b, c, d, e=0.0, clip_range=jnp.inf):
    """x_{i+1} = a x_i + b x0_i + c x0_{i-1} + d z_i + e (clip(x0_i) - x0_i): every sampler of schedulers.py.

    The clip term is DDIM's ``clip_sample`` (x0 clipped elementwise to [-clip_range, clip_range]);
    with e = 0 or clip_range = inf it adds exactly 0, so the other samplers are unchanged.
    """
    clipped = jnp.clip(x0, -clip_range, clip_range) - x0
    return a * latents + b * x0 + c * x0_prev + d * noise + e * clipped


def step_noise(seeds: jax.Array, step, latent_shape: tuple[int, int, int]) -> jax.Array:
    """Euler a's noise at ``step`` for each image: normal(fold_in(key(seed), step + 1)); (b, C, h, w) float32."""
    return jax.vmap(lambda s: jax.random.normal(jax.random.fold_in(jax.random.key(s), step + 1), latent_shape,
                                                jnp.float32))(seeds)


def initial_noise(seeds: jax.Array, latent_shape: tuple[int, int, int]) -> jax.Array:
    """(b,) uint32 seeds -> (b, C, h, w) float32 standard normal noise, image i from its own seed."""
    return jax.vmap(lambda s: jax.random.normal(jax.random.key(s), latent_shape, jnp.float32))(seeds)


def latent_shape(model: LoadedModel, height: int, width: int) -> tuple[int, int, int]:
    """(C, h, w) of the latents of a height x width image."""
    f = model.vae_scale_factor
    return (model.latent_channels, height // f, width // f)


def build_generate(model: LoadedModel, shape: ProgramShape, python_loop: bool = False) -> Callable:
    """The per-device generate function ``(params, inputs: ProgramInputs) -> (images, finite)``.

    Args:
        model: a LoadedModel (module graphs and configs; params come as an argument).
        python_loop: run the denoising steps in a Python loop instead of ``lax.fori_loop``
            (debugging only: needs a concrete ``num_steps``, i.e. no jit).
    """
    noise_shape = latent_shape(model, shape.height, shape.width)
    prediction_type = model.scheduler_config.get("prediction_type", "epsilon")
    vae_cfg = model.vae
    unet_component, vae_component = model.components["unet"], model.components["vae"]

    def generate(params, inputs: ProgramInputs):
        b = inputs.prompt_ids.shape[0]
        unet, vae = unet_component.bind(params["unet"]), vae_component.bind(params["vae"])
        # 1. Text: with CFG the negative and positive prompts in one encoder batch, negatives first.
        ids = jnp.concatenate([inputs.negative_ids, inputs.prompt_ids]) if shape.cfg else inputs.prompt_ids
        hidden, text_embeds = encode_prompts(model.components, params, ids)  # (n, 77, D), (n, P); n = 2b or b
        if shape.cfg:
            keep = jnp.concatenate([1.0 - inputs.negative_zero, jnp.ones((b,), jnp.float32)]).astype(hidden.dtype)
            hidden = hidden * keep[:, None, None]  # empty negative prompt -> zeros, as SDXL base does
            text_embeds = text_embeds * keep[:, None]
        rows = hidden.shape[0]
        size = jnp.array([shape.height, shape.width, 0, 0, shape.height, shape.width], jnp.float32)
        add_time_ids = jnp.broadcast_to(size, (rows, 6))  # original size, crop top-left, target size

        # 2. Initial noise, float32: image i from its own seed, whatever device it lands on.
        noise = inputs.latents if shape.given_latents else initial_noise(inputs.seeds, noise_shape)
        latents = noise * inputs.init_scale  # (b, c, h, w), sigma space

        # 3. Denoising loop: the UNet (with CFG over a doubled batch), then the sampler's update, float32.
        def step(i, carry):
            latents, x0_prev = carry
            sigma = inputs.sigmas[i]
            x = latents / jnp.sqrt(sigma**2 + 1)  # the UNet's input scaling
            x = jnp.concatenate([x, x]) if shape.cfg else x  # (rows, c, h, w)
            t = jnp.broadcast_to(inputs.timesteps[i], (rows,))
            out = unet(x, t, hidden, text_embeds, add_time_ids).astype(jnp.float32)
            if shape.cfg:
                out = cfg_combine(*jnp.split(out, 2), inputs.guidance_scale)  # (b, c, h, w)
            x0 = denoised(latents, out, sigma, prediction_type)
            z = step_noise(inputs.seeds, i, noise_shape)
            update = sampler_update(latents, x0, x0_prev, z, inputs.a[i], inputs.b[i], inputs.c[i], inputs.d[i],
                                    inputs.e[i], inputs.clip_range)
            return update, x0

        carry = (latents, jnp.zeros_like(latents))
        if python_loop:
            for i in range(int(inputs.num_steps)):
                carry = step(i, carry)
        else:
            carry = jax.lax.fori_loop(0, inputs.num_steps, step, carry)
        latents = carry[0] * inputs.final_scale

        # 4. VAE decode, then channels-first [-1, 1] -> channels-last uint8 [0, 255].
        decoded = vae.decode(unscale_latents(latents, vae_cfg)).astype(jnp.float32)  # (b, 3, H, W)
        finite = jnp.isfinite(decoded).all(axis=(1, 2, 3))
        pixels = jnp.clip(decoded / 2 + 0.5, 0.0, 1.0).transpose(0, 2, 3, 1)  # (b, H, W, 3)
        return jnp.round(pixels * 255).astype(jnp.uint8), finite

    return generate


def unscale_latents(latents: jax.Array, vae_cfg) -> jax.Array:
    """Latents the UNet works on -> what the VAE decodes: / scaling_factor (+ shift_factor),
    as diffusers' SDXL pipeline does before ``vae.decode``. (b, c, h, w) float32."""
    out = latents / vae_cfg.scaling_factor
    return out + vae_cfg.shift_factor if vae_cfg.shift_factor else out


def jit_program(model: LoadedModel, shape: ProgramShape, mesh: Mesh):
    """``jax.jit`` of the sharded program with explicit in/out shardings (not yet compiled)."""
    check_batch(shape.batch, mesh)
    specs = ProgramInputs.specs(shape.given_latents)
    sharded = jax.shard_map(build_generate(model, shape), mesh=mesh, in_specs=(P(), specs),
                            out_specs=(P(DATA_AXIS), P(DATA_AXIS)))
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    batch = NamedSharding(mesh, P(DATA_AXIS))
    return jax.jit(sharded, in_shardings=(NamedSharding(mesh, P()), shardings), out_shardings=(batch, batch))


def compile_program(model: LoadedModel, params, shape: ProgramShape, mesh: Mesh) -> CompiledProgram:
    """Lower and compile ahead of time for ``shape``; ``params`` may be arrays or ShapeDtypeStructs."""
    start = time.perf_counter()
    abstract = ProgramInputs.abstract(shape, latent_shape(model, shape.height, shape.width), mesh)
    executable = jit_program(model, shape, mesh).lower(params, abstract).compile()
    return CompiledProgram(shape=shape, executable=executable, compile_s=time.perf_counter() - start,
                           flops=_flops(executable))


def _flops(executable) -> float | None:
    try:
        cost = executable.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost.get("flops")) if cost and cost.get("flops") is not None else None
    except Exception:  # cost analysis is best-effort and backend-dependent
        return None


# The folders the program is traced from: every Python file in them, found when the key is made (not a
# hand-kept list, which would forget the next new file), is part of the executable-cache key. The weights'
# names, shapes and dtypes, and every component's config, are in the key as data (program_key).
_PACKAGE = Path(__file__).resolve().parents[1]
PROGRAM_FOLDERS = (_PACKAGE / "program", _PACKAGE / "models")


def program_sources() -> tuple[Path, ...]:
    """Every ``*.py`` under :data:`PROGRAM_FOLDERS`, sorted by path relative to the package."""
    return tuple(sorted((p for folder in PROGRAM_FOLDERS for p in folder.rglob("*.py")),
                        key=lambda p: p.relative_to(_PACKAGE).as_posix()))


@functools.cache
def _source_digest() -> str:
    return source_digest(program_sources())


def program_key(model: LoadedModel, params, shape: ProgramShape, mesh: Mesh) -> dict:
    """The executable cache's key for this program, computed without tracing.

    Everything static that the traced program depends on: the shape (batch, size, loop length,
    CFG mode, given latents), every component's config, the prediction type, the parameters'
    names, shapes, dtypes and shardings, the mesh (axis names, device ids in order) and a hash
    of the source files it is traced from (:func:`program_sources`). The cache adds versions,
    backend, devices and JAX options (:func:`.executables.runtime_key`).
    """
    cfg = "" if shape.cfg else " without CFG"
    return {
        "program": f"{shape.width}x{shape.height} x {shape.batch} images, {shape.max_steps} steps{cfg}",
        "shape": dataclasses.asdict(shape),
        "model": {name: dataclasses.asdict(c.config) for name, c in model.components.items()},
        "prediction_type": model.scheduler_config.get("prediction_type", "epsilon"),
        "dtype": model.dtype,
        "params": key_digest([[jax.tree_util.keystr(path), list(x.shape), str(x.dtype),
                               str(getattr(x, "sharding", None))]
                              for path, x in jax.tree_util.tree_leaves_with_path(params)]),
        "mesh": {"axes": list(mesh.axis_names), "devices": [d.id for d in mesh.devices.flat]},
        "source": _source_digest(),
    }


def cached_program(model: LoadedModel, params, shape: ProgramShape, mesh: Mesh,
                   cache: ExecutableCache | None) -> CompiledProgram:
    """The program for ``shape``: loaded from ``cache`` when it holds a trusted entry, else compiled and stored.

    Without a cache this is :func:`compile_program`. A loaded program is neither traced, lowered
    nor compiled: its argument pytree is rebuilt from ``params`` and the abstract inputs. A
    compiled one bypasses JAX's persistent compilation cache (see below), so a miss here is a
    full compile. ``cache_note`` of the result says what the cache did, in one line.
    """
    if cache is None:
        return compile_program(model, params, shape, mesh)
    start = time.perf_counter()
    abstract = ProgramInputs.abstract(shape, latent_shape(model, shape.height, shape.width), mesh)
    in_tree, out_tree = jax.tree.structure(((params, abstract), {})), jax.tree.structure((0, 0))  # (images, finite)
    key, devices = program_key(model, params, shape, mesh), list(mesh.devices.flat)
    found = cache.load(key, in_tree, out_tree, devices)
    if found.executable is not None:
        return CompiledProgram(shape=shape, executable=found.executable, compile_s=time.perf_counter() - start,
                               flops=_flops(found.executable), loaded=True, cache_note=found.note)
    # What is stored must come from a fresh compile: XLA:CPU (jaxlib 0.12) drops kernels when it re-serializes an
    # executable it deserialized, such as one JAX's persistent cache served (measured: the reloaded copy fails with
    # "Function multiply_add_fusion not found"). So this program bypasses that cache; everything else still uses it.
    with jax_config.enable_compilation_cache(False):
        program = compile_program(model, params, shape, mesh)
    program.cache_note = f"{found.note}; {cache.store(key, program.executable, devices, in_tree, out_tree)}"
    program.compile_s = time.perf_counter() - start
    return program
