"""IP-Adapter's reference images -> image tokens: the image encoder and the adapter's image projection, once per
request, before the generate program (which takes the tokens as a traced input: program/generate.py ``ip_tokens``).

diffusers' ``StableDiffusionXLPipeline.prepare_ip_adapter_image_embeds`` and ``MultiIPAdapterImageProjection``: the
images' ``image_embeds`` (batch, projection_dim) through the projection, each image's tokens one after another (an
adapter with n images gives n x tokens tokens); the negative (CFG's unconditional) row is the projection of zeros
(``torch.zeros_like(image_embeds)``), not zero tokens.

One jitted function per (image encoder, adapter) config pair, compiled by JAX at its first image count: a new
reference image compiles nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from sdxl_engine.models import Component

_ENCODERS: dict = {}  # (encoder config, adapter config) -> jitted function


def reference_tokens_fn(encoder: Component, adapter: Component) -> Callable:
    """The jitted ``(encoder_params, adapter_params, pixels) -> tokens`` of an image encoder and an adapter.

    pixels: (n, 3, S, S) float32, channels-first, CLIPImageProcessor's output (engine/ip_adapter.clip_pixels).
    tokens: (2, n x tokens, cross_attention_dim) float32: row 0 the negative, row 1 the images'. The plain projection
    takes the encoder's ``image_embeds``, its negative zero embeddings; Plus's Resampler the penultimate hidden
    states, its negative those of a zero image (diffusers' ``encode_image(..., output_hidden_states=True)``:
    ``image_encoder(torch.zeros_like(image))``)."""
    key = (encoder.config, adapter.config)
    if key not in _ENCODERS:
        plus = adapter.config.projection == "plus"

        def tokens(encoder_params, adapter_params, pixels):
            n = pixels.shape[0]
            project = adapter.bind(adapter_params).image_proj
            encode = encoder.bind(encoder_params)
            if plus:
                hidden = encode(jnp.concatenate([jnp.zeros_like(pixels), pixels])).penultimate  # (2n, positions, h)
                both = project(hidden)  # (2n, tokens, width)
            else:
                embeds = encode(pixels).image_embeds  # (n, projection_dim)
                both = project(jnp.concatenate([jnp.zeros_like(embeds), embeds]))  # (2n, tokens, width)
            return both.reshape(2, n * both.shape[1], both.shape[2]).astype(jnp.float32)  # (2, n x tokens, width)

        _ENCODERS[key] = jax.jit(tokens)
    return _ENCODERS[key]


def compiled_count() -> int:
    """How many executables the reference encoders hold (JAX's own caches, summed): what a test counts."""
    return sum(fn._cache_size() for fn in _ENCODERS.values())
