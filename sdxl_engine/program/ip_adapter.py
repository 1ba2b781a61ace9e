"""IP-Adapter's reference images -> image tokens: the image encoder and the adapter's image projection, once per
request, before the generate program (which takes the tokens as a traced input: program/generate.py ``ip_tokens``).

diffusers' ``StableDiffusionXLPipeline.prepare_ip_adapter_image_embeds`` and ``MultiIPAdapterImageProjection``: the
images' ``image_embeds`` (batch, projection_dim) through the projection, each image's tokens one after another (an
adapter with n images gives n x tokens tokens); the negative (CFG's unconditional) row is the projection of zeros
(``torch.zeros_like(image_embeds)``), not zero tokens.

FaceID takes no image: its units' face embeddings (n, 512) go through its projection alone, the negative row the
projection of zero embeddings (diffusers' FaceID example: ``torch.zeros_like(ref_images_embeds)`` as the negative
``ip_adapter_image_embeds``).

One jitted function per (image encoder, adapter) config pair (FaceID's: (None, adapter)), compiled by JAX at its first
image (embedding) count: a new reference image or embedding compiles nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from sdxl_engine.models import Component

_ENCODERS: dict = {}  # (encoder config, adapter config) -> jitted function


def reference_tokens_fn(encoder: Component | None, adapter: Component) -> Callable:
    """The jitted ``(encoder_params, adapter_params, pixels) -> tokens`` of an image encoder and an adapter; for FaceID
    (``encoder`` None) ``pixels`` are the face embeddings (n, image_embed_dim) float32 and ``encoder_params`` ``{}``.

    pixels: (n, 3, S, S) float32, channels-first, CLIPImageProcessor's output (engine/ip_adapter.clip_pixels).
    tokens: (2, n x tokens, cross_attention_dim) float32: row 0 the negative, row 1 the images'. The plain projection
    takes the encoder's ``image_embeds``, its negative zero embeddings; Plus's Resampler the penultimate hidden
    states, its negative those of a zero image (diffusers' ``encode_image(..., output_hidden_states=True)``:
    ``image_encoder(torch.zeros_like(image))``)."""
    key = (None if encoder is None else encoder.config, adapter.config)
    if key not in _ENCODERS:
        plus, faceid = adapter.config.projection == "plus", adapter.config.projection == "faceid"

        def tokens(encoder_params, adapter_params, pixels):
            n = pixels.shape[0]
            project = adapter.bind(adapter_params).image_proj
            if faceid:  # pixels: the face embeddings; the negative their zeros'
                both = project(jnp.concatenate([jnp.zeros_like(pixels), pixels]))  # (2n, tokens, width)
                return both.reshape(2, n * both.shape[1], both.shape[2]).astype(jnp.float32)
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
