"""Loading SDXL components through diffusers' / transformers' Flax classes.

``load_model`` accepts a built-in name, a local diffusers-format directory or a hub id, and
returns a :class:`LoadedModel`: module objects (static, part of the compiled program), their
parameters (arrays, cast to the storage dtype), the two tokenizers and the Euler scheduler.
Weights load only from Flax msgpack files (diffusers / transformers ``from_pretrained`` without
``from_pt``), never from pickles.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from . import builtin

_HUB_HINT = (
    "Real SDXL needs the weights: run on a machine that reaches the Hugging Face Hub, or download "
    "them once (huggingface-cli download stabilityai/stable-diffusion-xl-base-1.0 "
    "--local-dir sdxl-base) and start with --model ./sdxl-base. Built-in models: "
    + ", ".join(builtin.BUILTIN_NAMES)
)


class ModelLoadError(RuntimeError):
    """The model could not be found or is not an SDXL model; the message says what to do."""


@dataclasses.dataclass
class LoadedModel:
    """Everything the compiled program needs from a model.

    Attributes:
        name: what the user asked for (built-in name, directory or hub id).
        text_encoder, text_encoder_2: Flax CLIP text models (the second with projection).
        unet: FlaxUNet2DConditionModel with ``text_time`` added conditioning.
        vae: FlaxAutoencoderKL.
        tokenizer, tokenizer_2: CLIP tokenizers, 77 tokens each.
        scheduler: FlaxEulerDiscreteScheduler; its state stays float32 on the host.
        params: ``{"text_encoder", "text_encoder_2", "unet", "vae"}`` parameter trees in ``dtype``.
        dtype: storage/compute dtype name of the parameters ("float32", "bfloat16", ...).
        load_s: seconds spent loading (and creating a built-in model the first time).
    """

    name: str
    text_encoder: Any
    text_encoder_2: Any
    unet: Any
    vae: Any
    tokenizer: Any
    tokenizer_2: Any
    scheduler: Any
    params: dict
    dtype: str
    load_s: float = 0.0

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell along each side: 2 ** (VAE blocks - 1); 8 for SDXL."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def native_size(self) -> int:
        """The model's training resolution in pixels (1024 for SDXL base)."""
        return self.unet.config.sample_size * self.vae_scale_factor

    @property
    def latent_channels(self) -> int:
        return self.unet.config.in_channels


def resolve_dtype(name: str, platform: str) -> str:
    """``auto`` -> bfloat16 on TPU/GPU, float32 on CPU; other names pass through."""
    if name != "auto":
        return name
    return "float32" if platform == "cpu" else "bfloat16"


def builtin_path(name: str, cache_dir: str) -> Path:
    """Directory of a built-in model, created on first use (atomically: temp dir, then rename)."""
    out = Path(cache_dir) / f"{name}-v1"
    if (out / "model_index.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent)) / out.name
    builtin.create_tiny_random(staging)
    try:
        staging.rename(out)
    except OSError:  # another process finished first: use its copy
        pass
    shutil.rmtree(staging.parent, ignore_errors=True)
    return out


def load_model(model: str, *, dtype: str, platform: str, revision: str = "", cache_dir: str) -> LoadedModel:
    """Load an SDXL model.

    Args:
        model: ``tiny-shapes`` (shipped in assets/), ``tiny-random``, a local diffusers-format
            directory, or a hub id.
        dtype: ``auto``/``float32``/``bfloat16``/``float16`` for parameters and compute.
        platform: JAX backend platform ("cpu", "gpu", "tpu"), for ``auto``.
        revision: hub revision; ignored for local directories.
        cache_dir: where built-in models are created.

    Raises:
        ModelLoadError: missing directory, a directory that is not SDXL, or a hub id that cannot
            be fetched (offline, unknown, gated); the message names what was looked for.
    """
    import jax.numpy as jnp
    from diffusers import FlaxEulerDiscreteScheduler, FlaxStableDiffusionXLPipeline

    start = time.perf_counter()
    dtype = resolve_dtype(dtype, platform)
    if model == "sdxl-base-random":  # real architecture, random weights, built on the device
        from .fullsize import random_model

        return random_model(dtype_name=dtype)
    if model == "tiny-shapes":
        if not (builtin.TINY_SHAPES_DIR / "model_index.json").is_file():
            raise ModelLoadError(f"the shipped model is missing from {builtin.TINY_SHAPES_DIR}; "
                                 "recreate it with: python -m sdxl_engine.train")
        source = str(builtin.TINY_SHAPES_DIR)
    elif model in builtin.BUILTIN_NAMES:
        source = str(builtin_path(model, cache_dir))
    elif Path(model).expanduser().exists():
        source = str(Path(model).expanduser())
        if not (Path(source) / "model_index.json").is_file():
            raise ModelLoadError(f"{source} is not a diffusers-format model directory (no model_index.json). {_HUB_HINT}")
    elif model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelLoadError(f"model {model!r} is neither a built-in name, an existing directory nor a hub id. {_HUB_HINT}")
    else:
        source = model
    kwargs = {"revision": revision} if revision and source == model else {}
    if platform != "cpu":
        kwargs["split_head_dim"] = True  # the blog's TPU setting: attention heads as a separate axis
    try:
        pipe, params = FlaxStableDiffusionXLPipeline.from_pretrained(source, dtype=getattr(jnp, dtype), **kwargs)
    except Exception as err:  # diffusers raises OSError, ValueError, EnvironmentError, HTTP errors...
        raise ModelLoadError(f"could not load SDXL model {model!r} ({type(err).__name__}: {err}). {_HUB_HINT}") from err
    unet_cfg = pipe.unet.config
    if getattr(pipe, "text_encoder_2", None) is None or unet_cfg.addition_embed_type != "text_time":
        raise ModelLoadError(f"{model!r} is not an SDXL model (needs text_encoder_2 and a text_time UNet). {_HUB_HINT}")
    params = dict(params)
    params.pop("scheduler", None)  # recomputed on the host in float32 per step count
    cast = getattr(jnp, dtype)
    params = {k: _cast_tree(v, cast) for k, v in params.items()}
    return LoadedModel(
        name=model, text_encoder=pipe.text_encoder, text_encoder_2=pipe.text_encoder_2, unet=pipe.unet,
        vae=pipe.vae, tokenizer=pipe.tokenizer, tokenizer_2=pipe.tokenizer_2,
        scheduler=FlaxEulerDiscreteScheduler.from_config(pipe.scheduler.config),  # the blog's sampler
        params=params, dtype=dtype, load_s=time.perf_counter() - start,
    )


def _cast_tree(tree, dtype):
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: jnp.asarray(x, dtype) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else x, tree)
