"""IP-Adapter (Ye et al. 2023) for SDXL in Flax NNX, as diffusers implements it (``load_ip_adapter``).

An adapter is an image projection, which turns the image encoder's output (clip_vision.py) into a few tokens of
the UNet's cross-attention width, and one ``to_k_ip`` / ``to_v_ip`` pair per cross-attention layer of the UNet: the
layer attends to the image tokens with its own query beside the text (decoupled cross-attention, diffusers'
``IPAdapterAttnProcessor2_0``) and adds ``scale`` x that to the text attention before ``to_out``
(:meth:`sdxl_engine.models.unet.Attention.__call__`).

Parameter names are those of h94/IP-Adapter's files, which diffusers reads (``_convert_ip_adapter_attn_to_diffusers``):
``ip_adapter.{2j + 1}.to_k_ip.weight`` for the j-th cross-attention layer in the order of diffusers'
``unet.attn_processors`` (down blocks, up blocks, then the mid block: :func:`cross_attention_layers`), and the image
projection under ``image_proj.`` with diffusers' names (``ImageProjection``: ``image_embeds``, ``norm``; the files'
``proj`` is renamed by rule in checkpoint/ip_adapter.py, as diffusers' ``_convert_ip_adapter_image_proj_to_diffusers``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from sdxl_engine.models.layers import LayerNorm, Linear
from sdxl_engine.models.unet import UNetConfig

PROJECTIONS = ("plain",)  # image projections built here: diffusers' ImageProjection


def _depths(depth, n: int) -> tuple[int, ...]:
    return depth if isinstance(depth, tuple) else (depth,) * n


def cross_attention_layers(config: UNetConfig) -> tuple[tuple[str, int], ...]:
    """(module path of each cross-attention, its width) in diffusers' ``unet.attn_processors`` order: the down
    blocks, the up blocks, then the mid block (the order of ``UNet2DConditionModel``'s registered children). Layer j
    has key id 2j + 1 in an IP-Adapter file."""
    out = []
    for i, kind in enumerate(config.down_block_types):
        if kind == "CrossAttnDownBlock2D":
            n = config.layers_per_block[i]
            for j, depth in enumerate(_depths(config.transformer_layers_per_block[i], n)):
                out += [(f"down_blocks.{i}.attentions.{j}.transformer_blocks.{t}.attn2", config.block_out_channels[i])
                        for t in range(depth)]
    reversed_channels = config.block_out_channels[::-1]
    for i, kind in enumerate(config.up_block_types):
        if kind == "CrossAttnUpBlock2D":
            n = config.layers_per_block[::-1][i] + 1
            for j, depth in enumerate(_depths(config.reverse_transformer_layers_per_block[i], n)):
                out += [(f"up_blocks.{i}.attentions.{j}.transformer_blocks.{t}.attn2", reversed_channels[i])
                        for t in range(depth)]
    depth = _depths(config.transformer_layers_per_block[-1], 1)[0]
    out += [(f"mid_block.attentions.0.transformer_blocks.{t}.attn2", config.block_out_channels[-1])
            for t in range(depth)]
    return tuple(out)


def forward_order(config: UNetConfig) -> tuple[int, ...]:
    """The index j (:func:`cross_attention_layers`) of each cross-attention in the order the UNet's call runs them:
    down blocks, mid block, up blocks."""
    names = [name for name, _ in cross_attention_layers(config)]
    rank = {"down_blocks": 0, "mid_block": 1, "up_blocks": 2}
    return tuple(sorted(range(len(names)), key=lambda j: (rank[names[j].split(".")[0]], j)))


@dataclasses.dataclass(frozen=True)
class IPAdapterConfig:
    """An adapter's shapes, read from its file and the UNet it fits (checkpoint/ip_adapter.py).

    Attributes:
        projection: "plain" (diffusers' ``ImageProjection``).
        image_embed_dim: the image encoder's output width the projection takes (its ``projection_dim`` for plain).
        cross_attention_dim: the UNet's cross-attention width (the tokens' width).
        tokens: image tokens per reference image (4 for plain).
        widths: each cross-attention layer's width, in key order (:func:`cross_attention_layers`).
    """

    projection: str
    image_embed_dim: int
    cross_attention_dim: int
    tokens: int
    widths: tuple[int, ...]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> IPAdapterConfig:
        """From the fields' values (``widths`` a list). Raises ValueError for a projection not built here."""
        if config["projection"] not in PROJECTIONS:
            raise ValueError(f"IP-Adapter image projection {config['projection']!r} is not supported "
                             f"({', '.join(PROJECTIONS)})")
        return cls(projection=config["projection"], image_embed_dim=int(config["image_embed_dim"]),
                   cross_attention_dim=int(config["cross_attention_dim"]), tokens=int(config["tokens"]),
                   widths=tuple(int(w) for w in config["widths"]))


class ImageProjection(nnx.Module):
    """diffusers' ``ImageProjection``: ``image_embeds`` (Linear to tokens x width), reshaped, then ``norm``."""

    def __init__(self, config: IPAdapterConfig, *, rngs: nnx.Rngs):
        self.tokens = config.tokens
        self.image_embeds = Linear(config.image_embed_dim, config.tokens * config.cross_attention_dim, rngs=rngs)
        self.norm = LayerNorm(config.cross_attention_dim)

    def __call__(self, image_embeds: jax.Array) -> jax.Array:
        """(n, image_embed_dim) -> (n, tokens, cross_attention_dim) in the parameters' dtype."""
        x = self.image_embeds(image_embeds)
        return self.norm(x.reshape(x.shape[0], self.tokens, -1))


class IPAdapterLayer(nnx.Module):
    """One cross-attention layer's ``to_k_ip`` and ``to_v_ip`` (no bias): the image tokens' keys and values."""

    def __init__(self, cross_attention_dim: int, width: int, *, rngs: nnx.Rngs):
        self.to_k_ip = Linear(cross_attention_dim, width, bias=False, rngs=rngs)
        self.to_v_ip = Linear(cross_attention_dim, width, bias=False, rngs=rngs)


class IPAdapterModel(nnx.Module):
    """An IP-Adapter file's modules: ``image_proj`` and ``ip_adapter`` (the layers at odd indices, as the files
    number them; the even ones are None and hold nothing)."""

    def __init__(self, config: IPAdapterConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.image_proj = ImageProjection(config, rngs=rngs)
        layers = []
        for width in config.widths:
            layers += [None, IPAdapterLayer(config.cross_attention_dim, width, rngs=rngs)]
        self.ip_adapter = nnx.List(layers)

    def layer(self, j: int) -> IPAdapterLayer:
        """Cross-attention layer j's (:func:`cross_attention_layers`)."""
        return self.ip_adapter[2 * j + 1]
