"""IP-Adapter (Ye et al. 2023) for SDXL in Flax NNX, as diffusers implements it (``load_ip_adapter``).

An adapter is an image projection, which turns the image encoder's output (clip_vision.py) into a few tokens of
the UNet's cross-attention width, and one ``to_k_ip`` / ``to_v_ip`` pair per cross-attention layer of the UNet: the
layer attends to the image tokens with its own query beside the text (decoupled cross-attention, diffusers'
``IPAdapterAttnProcessor2_0``) and adds ``scale`` x that to the text attention before ``to_out``
(:meth:`sdxl_engine.models.unet.Attention.__call__`).

Parameter names are those of h94/IP-Adapter's files (the original IP-Adapter's modules), so the files' keys map one to
one: ``ip_adapter.{2j + 1}.to_k_ip.weight`` for the j-th cross-attention layer in the order of diffusers'
``unet.attn_processors`` (down blocks, up blocks, then the mid block: :func:`cross_attention_layers`; diffusers'
``_convert_ip_adapter_attn_to_diffusers`` reads them so), and the image projection under ``image_proj.``: the plain
adapter's ``ImageProjModel`` (``proj``, ``norm``: diffusers' ``ImageProjection`` names ``proj`` ``image_embeds``) and
Plus's ``Resampler`` (``latents``, ``proj_in``, ``layers.{i}.0`` a ``PerceiverAttention`` with ``norm1``, ``norm2``,
``to_q``, ``to_kv``, ``to_out``, ``layers.{i}.1`` its feed-forward: ``0`` LayerNorm, ``1`` and ``3`` Linear;
``proj_out``, ``norm_out``: diffusers' ``IPAdapterPlusImageProjection``, whose loader splits ``to_kv`` into ``to_k``
and ``to_v`` and renames the rest; the arithmetic is the same), and FaceID's ``MLPProjModel`` (``proj.0`` Linear,
``proj.1`` GELU, ``proj.2`` Linear, ``norm``: diffusers' ``IPAdapterFaceIDImageProjection``, its loader naming
``proj.0`` ``ff.net.0.proj`` and ``proj.2`` ``ff.net.2``), which takes a face embedding (insightface's
``normed_embedding``, 512 wide) in place of an image encoder's output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sdxl_engine.models.layers import LayerNorm, Linear, attention
from sdxl_engine.models.unet import UNetConfig

# image projections built here: ImageProjModel (plain), Resampler (Plus), MLPProjModel (FaceID: face embeddings in)
PROJECTIONS = ("plain", "plus", "faceid")
PLUS_HEAD_DIM = 64  # the Resampler's attention head width (diffusers reads its heads as to_q's rows // 64)


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


def attention_processors(config: UNetConfig) -> tuple[str, ...]:
    """The module path of every attention of the UNet in diffusers' ``unet.attn_processors`` order (its key ``<path>
    .processor``): each transformer block's ``attn1`` then ``attn2``, the blocks as :func:`cross_attention_layers`.
    Index i is key id i of an IP-Adapter file (``ip_adapter.{i}.*``; the cross-attention j is 2j + 1), as diffusers'
    ``_load_ip_adapter_loras`` enumerates ``attn_processors`` for FaceID's LoRA keys."""
    out = []
    for name, _ in cross_attention_layers(config):
        out += [name[: -len("attn2")] + "attn1", name]
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
        projection: "plain" (``ImageProjModel``, diffusers' ``ImageProjection``: the encoder's ``image_embeds``),
            "plus" (``Resampler``, diffusers' ``IPAdapterPlusImageProjection``: the encoder's penultimate hidden
            states) or "faceid" (``MLPProjModel``, diffusers' ``IPAdapterFaceIDImageProjection``: a face embedding
            the client sends; no image encoder).
        image_embed_dim: the width of what the projection takes (the image encoder's ``projection_dim`` for plain, its
            ``hidden_size`` for Plus; the face embedding's, 512, for FaceID).
        cross_attention_dim: the UNet's cross-attention width (the tokens' width).
        tokens: image tokens per reference image (4 for plain; the Resampler's queries for Plus).
        widths: each cross-attention layer's width, in key order (:func:`cross_attention_layers`).
        plus_dim, plus_heads, plus_depth: the Resampler's width, heads (of 64) and blocks (0 for plain).
        faceid_hidden: FaceID's hidden width (``proj.0``'s outputs: ``mult`` x image_embed_dim; 0 for the others).
    """

    projection: str
    image_embed_dim: int
    cross_attention_dim: int
    tokens: int
    widths: tuple[int, ...]
    plus_dim: int = 0
    plus_heads: int = 0
    plus_depth: int = 0
    faceid_hidden: int = 0

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> IPAdapterConfig:
        """From the fields' values (``widths`` a list). Raises ValueError for a projection not built here."""
        if config["projection"] not in PROJECTIONS:
            raise ValueError(f"IP-Adapter image projection {config['projection']!r} is not supported "
                             f"({', '.join(PROJECTIONS)})")
        return cls(projection=config["projection"], image_embed_dim=int(config["image_embed_dim"]),
                   cross_attention_dim=int(config["cross_attention_dim"]), tokens=int(config["tokens"]),
                   widths=tuple(int(w) for w in config["widths"]), plus_dim=int(config.get("plus_dim", 0)),
                   plus_heads=int(config.get("plus_heads", 0)), plus_depth=int(config.get("plus_depth", 0)),
                   faceid_hidden=int(config.get("faceid_hidden", 0)))


class ImageProjModel(nnx.Module):
    """The plain adapter's projection (diffusers' ``ImageProjection``): ``proj`` (Linear to tokens x width),
    reshaped, then ``norm``."""

    def __init__(self, config: IPAdapterConfig, *, rngs: nnx.Rngs):
        self.tokens = config.tokens
        self.proj = Linear(config.image_embed_dim, config.tokens * config.cross_attention_dim, rngs=rngs)
        self.norm = LayerNorm(config.cross_attention_dim)

    def __call__(self, image_embeds: jax.Array) -> jax.Array:
        """(n, image_embed_dim) -> (n, tokens, cross_attention_dim) in the parameters' dtype."""
        x = self.proj(image_embeds)
        return self.norm(x.reshape(x.shape[0], self.tokens, -1))


class MLPProjModel(nnx.Module):
    """FaceID's projection (diffusers' ``IPAdapterFaceIDImageProjection``: a ``FeedForward`` with GELU, then a
    LayerNorm): ``proj.0`` (Linear to faceid_hidden), exact GELU (``proj.1``, no parameters), ``proj.2`` (Linear to
    tokens x width), reshaped to tokens, then ``norm``."""

    def __init__(self, config: IPAdapterConfig, *, rngs: nnx.Rngs):
        self.tokens = config.tokens
        self.proj = nnx.List([Linear(config.image_embed_dim, config.faceid_hidden, rngs=rngs), None,
                              Linear(config.faceid_hidden, config.tokens * config.cross_attention_dim, rngs=rngs)])
        self.norm = LayerNorm(config.cross_attention_dim)

    def __call__(self, id_embeds: jax.Array) -> jax.Array:
        """(n, image_embed_dim) -> (n, tokens, cross_attention_dim) in the parameters' dtype."""
        x = self.proj[2](jax.nn.gelu(self.proj[0](id_embeds), approximate=False))
        return self.norm(x.reshape(x.shape[0], self.tokens, -1))


class PerceiverAttention(nnx.Module):
    """The Resampler's attention: the latents attend to [the image's features, the latents] (``norm1`` on the
    features, ``norm2`` on the latents; ``to_kv`` the keys and values in one Linear, keys first)."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        inner = heads * PLUS_HEAD_DIM
        self.heads = heads
        self.norm1 = LayerNorm(dim)
        self.norm2 = LayerNorm(dim)
        self.to_q = Linear(dim, inner, bias=False, rngs=rngs)
        self.to_kv = Linear(dim, inner * 2, bias=False, rngs=rngs)
        self.to_out = Linear(inner, dim, bias=False, rngs=rngs)

    def __call__(self, x: jax.Array, latents: jax.Array) -> jax.Array:
        """x (n, positions, dim), latents (n, queries, dim) -> (n, queries, dim)."""
        x, latents = self.norm1(x), self.norm2(latents)
        kv = self.to_kv(jnp.concatenate([x, latents], axis=1))  # (n, positions + queries, 2 x inner)
        k, v = jnp.split(kv, 2, axis=-1)
        return self.to_out(attention(self.to_q(latents), k, v, self.heads))


class Resampler(nnx.Module):
    """IP-Adapter Plus's projection (diffusers' ``IPAdapterPlusImageProjection``): learned ``latents`` queries that
    attend to the image encoder's penultimate hidden states (after ``proj_in``) through ``layers`` of
    PerceiverAttention and a GELU feed-forward, each with a residual, then ``proj_out`` and ``norm_out``."""

    def __init__(self, config: IPAdapterConfig, *, rngs: nnx.Rngs):
        dim = config.plus_dim
        self.latents = nnx.Param(jax.random.normal(rngs.params(), (1, config.tokens, dim), jnp.float32) / dim**0.5)
        self.proj_in = Linear(config.image_embed_dim, dim, rngs=rngs)
        self.layers = nnx.List([
            nnx.List([PerceiverAttention(dim, config.plus_heads, rngs=rngs),
                      nnx.List([LayerNorm(dim), Linear(dim, dim * 4, bias=False, rngs=rngs), None,
                                Linear(dim * 4, dim, bias=False, rngs=rngs)])])
            for _ in range(config.plus_depth)])
        self.proj_out = Linear(dim, config.cross_attention_dim, rngs=rngs)
        self.norm_out = LayerNorm(config.cross_attention_dim)

    def __call__(self, hidden_states: jax.Array) -> jax.Array:
        """(n, positions, image_embed_dim) -> (n, tokens, cross_attention_dim) in the parameters' dtype."""
        x = self.proj_in(hidden_states)
        latents = jnp.broadcast_to(self.latents[...].astype(x.dtype), (x.shape[0], *self.latents.shape[1:]))
        for attn, ff in self.layers:
            latents = attn(x, latents) + latents
            hidden = ff[1](ff[0](latents))
            latents = ff[3](jax.nn.gelu(hidden, approximate=False)) + latents
        return self.norm_out(self.proj_out(latents))


PROJECTION_MODULES = {"plain": ImageProjModel, "plus": Resampler, "faceid": MLPProjModel}  # by config.projection


class IPAdapterLayer(nnx.Module):
    """One cross-attention layer's ``to_k_ip`` and ``to_v_ip`` (no bias): the image tokens' keys and values."""

    def __init__(self, cross_attention_dim: int, width: int, *, rngs: nnx.Rngs):
        self.to_k_ip = Linear(cross_attention_dim, width, bias=False, rngs=rngs)
        self.to_v_ip = Linear(cross_attention_dim, width, bias=False, rngs=rngs)


def _layers(cross_attention_dim: int, widths: tuple[int, ...], rngs: nnx.Rngs) -> nnx.List:
    """The ``ip_adapter`` list: layer j at index 2j + 1 (as the files number them; the even ones are None)."""
    layers = []
    for width in widths:
        layers += [None, IPAdapterLayer(cross_attention_dim, width, rngs=rngs)]
    return nnx.List(layers)


class IPAdapterModel(nnx.Module):
    """An IP-Adapter file's modules: ``image_proj`` and ``ip_adapter`` (:func:`_layers`)."""

    def __init__(self, config: IPAdapterConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.image_proj = PROJECTION_MODULES[config.projection](config, rngs=rngs)
        self.ip_adapter = _layers(config.cross_attention_dim, config.widths, rngs)


@dataclasses.dataclass(frozen=True)
class IPAdapterLayersConfig:
    """What the generate program runs of an adapter: its layers' widths (key order) and the tokens' width. Every
    adapter for one UNet has the same (its architecture: checkpoint/ip_adapter.architecture)."""

    cross_attention_dim: int
    widths: tuple[int, ...]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> IPAdapterLayersConfig:
        return cls(cross_attention_dim=int(config["cross_attention_dim"]), widths=tuple(int(w) for w in
                                                                                        config["widths"]))


class IPAdapterLayers(nnx.Module):
    """The ``ip_adapter`` part of an adapter file alone (its keys a subset of :class:`IPAdapterModel`'s): what the
    generate program binds, so adapters whose image projections differ (plain, Plus, another encoder) share it."""

    def __init__(self, config: IPAdapterLayersConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.ip_adapter = _layers(config.cross_attention_dim, config.widths, rngs)

    def layer(self, j: int) -> IPAdapterLayer:
        """Cross-attention layer j's (:func:`cross_attention_layers`)."""
        return self.ip_adapter[2 * j + 1]
