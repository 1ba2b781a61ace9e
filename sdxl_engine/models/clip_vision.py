"""CLIP's image encoder (Radford et al. 2021) as IP-Adapter uses it, in Flax NNX: transformers'
``CLIPVisionModelWithProjection``.

IP-Adapter's SDXL files name two of them (h94/IP-Adapter): OpenCLIP ViT-bigG/14 (``sdxl_models/image_encoder``) and
ViT-H/14 (``models/image_encoder``); any ``clip_vision_model`` config.json builds. Module and parameter names are
transformers' (``vision_model.embeddings.patch_embedding.weight``, ``vision_model.pre_layrnorm.weight``,
``vision_model.encoder.layers.3.self_attn.q_proj.weight``, ``visual_projection.weight``), so the files' keys map one
to one; the encoder layers are the text encoders' (clip.py) without the causal mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sdxl_engine.models.clip import CLIPEncoder
from sdxl_engine.models.layers import Conv2d, Embedding, LayerNorm, Linear, activation


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    """The fields of transformers' ``CLIPVisionConfig`` (the image encoder's config.json) that the model reads."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> CLIPVisionConfig:
        """Keep the known fields of a config.json dict (a ``CLIPConfig``'s ``vision_config`` too).

        Raises ValueError for a hidden size that does not split over the heads, an image size that the patches do
        not divide, or an unknown activation."""
        config = config.get("vision_config", config)
        names = {f.name for f in dataclasses.fields(cls)}
        out = cls(**{k: v for k, v in config.items() if k in names and v is not None})
        if out.hidden_size % out.num_attention_heads:
            raise ValueError(f"hidden_size {out.hidden_size} does not split over {out.num_attention_heads} heads")
        if out.image_size % out.patch_size:
            raise ValueError(f"image_size {out.image_size} is not a multiple of patch_size {out.patch_size}")
        activation(out.hidden_act)
        return out

    @property
    def positions(self) -> int:
        """Tokens: the class token and one per patch."""
        return (self.image_size // self.patch_size) ** 2 + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CLIPVisionOutput:
    """What IP-Adapter reads from the image encoder.

    Attributes:
        image_embeds: (batch, projection_dim) the projected, normalised class token (the plain adapter's input).
        penultimate: (batch, positions, hidden) the second-to-last layer's output, ``hidden_states[-2]`` (Plus's).
    """

    image_embeds: jax.Array
    penultimate: jax.Array


class CLIPVisionEmbeddings(nnx.Module):
    def __init__(self, config: CLIPVisionConfig, *, rngs: nnx.Rngs):
        self.patch = config.patch_size
        self.class_embedding = nnx.Param(jax.random.normal(rngs.params(), (config.hidden_size,), jnp.float32))
        self.patch_embedding = Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                      stride=config.patch_size, bias=False, rngs=rngs)
        self.position_embedding = Embedding(config.positions, config.hidden_size, std=0.02, rngs=rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        """pixels (b, S, S, channels), channels-last -> (b, positions, hidden): the class token, then the patches
        row by row (transformers' ``flatten(2).transpose(1, 2)`` of its channels-first patches)."""
        patches = self.patch_embedding(pixels)  # (b, S / p, S / p, hidden)
        b, _, _, d = patches.shape
        patches = patches.reshape(b, -1, d)  # (b, patches, hidden)
        cls = jnp.broadcast_to(self.class_embedding[...].astype(patches.dtype), (b, 1, d))
        x = jnp.concatenate([cls, patches], axis=1)  # (b, positions, hidden)
        return x + self.position_embedding(jnp.arange(x.shape[1]))[None]


class CLIPVisionTransformer(nnx.Module):
    def __init__(self, config: CLIPVisionConfig, *, rngs: nnx.Rngs):
        self.embeddings = CLIPVisionEmbeddings(config, rngs=rngs)
        self.pre_layrnorm = LayerNorm(config.hidden_size, config.layer_norm_eps)  # transformers' spelling
        self.encoder = CLIPEncoder(config, causal=False, rngs=rngs)
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def __call__(self, pixels: jax.Array) -> tuple[jax.Array, jax.Array]:
        """pixels (b, S, S, channels) -> (pooled (b, hidden), penultimate (b, positions, hidden))."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        layers = list(self.encoder.layers)
        for layer in layers[:-1]:
            x = layer(x)
        penultimate = x  # hidden_states[-2]: the embeddings (after pre_layrnorm) for a one-layer encoder
        last = layers[-1](x)
        return self.post_layernorm(last[:, 0]), penultimate


class CLIPVisionModelWithProjection(nnx.Module):
    """transformers' ``CLIPVisionModelWithProjection``: IP-Adapter's image encoder."""

    def __init__(self, config: CLIPVisionConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.vision_model = CLIPVisionTransformer(config, rngs=rngs)
        self.visual_projection = Linear(config.hidden_size, config.projection_dim, bias=False, rngs=rngs)

    def __call__(self, pixel_values: jax.Array) -> CLIPVisionOutput:
        """Encode preprocessed images (engine/ip_adapter.py: CLIPImageProcessor's resize, crop and normalisation).

        Args:
            pixel_values: (batch, channels, S, S) float, channels-first as transformers takes them; S = image_size.
        Returns:
            CLIPVisionOutput in the parameters' dtype.
        """
        dtype = self.visual_projection.weight[...].dtype
        pooled, penultimate = self.vision_model(jnp.transpose(pixel_values, (0, 2, 3, 1)).astype(dtype))
        return CLIPVisionOutput(image_embeds=self.visual_projection(pooled), penultimate=penultimate)
