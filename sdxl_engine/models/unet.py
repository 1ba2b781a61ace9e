"""SDXL's UNet (Podell et al. 2023; Rombach et al. 2022) in Flax NNX: diffusers' ``UNet2DConditionModel``.

Any SDXL-family config.json builds: ``block_out_channels``, ``layers_per_block``, per-block (and
per-layer) ``transformer_layers_per_block``, heads per block (``attention_head_dim`` /
``num_attention_heads``, with diffusers' naming quirk), ``use_linear_projection``,
``cross_attention_dim``, ``norm_num_groups`` / ``norm_eps``, ``only_cross_attention``,
``text_time`` added conditioning, and the DownBlock2D / CrossAttnDownBlock2D /
UNetMidBlock2DCrossAttn / CrossAttnUpBlock2D / UpBlock2D blocks. Options SDXL checkpoints do not
use are refused by :meth:`UNetConfig.from_dict` with the field's name.

Module names are diffusers' (``down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q``),
parameters are PyTorch-layout (see :mod:`.layers`). The public call takes and returns
channels-first arrays as diffusers does; inside, activations are channels-last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sdxl_engine.models.layers import Conv2d, GroupNorm, LayerNorm, Linear, activation, attention, timestep_embedding

DOWN_BLOCKS = ("DownBlock2D", "CrossAttnDownBlock2D")
UP_BLOCKS = ("UpBlock2D", "CrossAttnUpBlock2D")
# config.json fields that change the architecture, with the only value supported here.
_FIXED = {
    "mid_block_type": "UNetMidBlock2DCrossAttn", "addition_embed_type": "text_time", "class_embed_type": None,
    "time_embedding_type": "positional", "resnet_time_scale_shift": "default", "encoder_hid_dim_type": None,
    "encoder_hid_dim": None, "time_cond_proj_dim": None, "dual_cross_attention": False, "attention_type": "default",
    "center_input_sample": False, "resnet_skip_time_act": False, "timestep_post_act": None,
    "time_embedding_dim": None, "time_embedding_act_fn": None, "cross_attention_norm": None, "num_class_embeds": None,
    "class_embeddings_concat": False, "resnet_out_scale_factor": 1.0,
}


def _per_block(value, n: int, name: str) -> tuple:
    """An int/bool/None broadcast to ``n`` blocks, or a list of length ``n``. Raises ValueError."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} blocks")
        return tuple(value)
    return (value,) * n


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """diffusers' UNet2DConditionModel config, normalised to per-block tuples.

    ``upcast_attention`` is accepted and not kept: attention's softmax always runs in float32
    (layers.attention), which is what the flag asks of PyTorch's.
    """

    sample_size: int
    in_channels: int
    out_channels: int
    down_block_types: tuple[str, ...]
    up_block_types: tuple[str, ...]
    block_out_channels: tuple[int, ...]
    layers_per_block: tuple[int, ...]
    transformer_layers_per_block: tuple  # per block: an int or a tuple per layer
    reverse_transformer_layers_per_block: tuple  # per up block, likewise
    num_attention_heads: tuple[int, ...]
    cross_attention_dim: tuple[int, ...]
    only_cross_attention: tuple[bool, ...]
    mid_block_only_cross_attention: bool
    use_linear_projection: bool
    norm_num_groups: int
    norm_eps: float
    act_fn: str
    flip_sin_to_cos: bool
    freq_shift: float
    downsample_padding: int
    mid_block_scale_factor: float
    conv_in_kernel: int
    conv_out_kernel: int
    addition_time_embed_dim: int
    projection_class_embeddings_input_dim: int

    @classmethod
    def from_dict(cls, c: Mapping[str, Any]) -> UNetConfig:
        """Normalise a config.json dict. Raises ValueError naming an unsupported field or value."""
        for key, allowed in _FIXED.items():
            if c.get(key, allowed) != allowed:
                raise ValueError(f"unet config {key}={c.get(key)!r} is not supported (SDXL uses {allowed!r})")
        down, up = tuple(c["down_block_types"]), tuple(c["up_block_types"])
        for kind in down:
            if kind not in DOWN_BLOCKS:
                raise ValueError(f"unet down block {kind!r} is not supported ({', '.join(DOWN_BLOCKS)})")
        for kind in up:
            if kind not in UP_BLOCKS:
                raise ValueError(f"unet up block {kind!r} is not supported ({', '.join(UP_BLOCKS)})")
        n = len(down)
        if len(up) != n or len(c["block_out_channels"]) != n:
            raise ValueError(f"unet config has {n} down blocks, {len(up)} up blocks and "
                             f"{len(c['block_out_channels'])} block_out_channels")
        heads = c.get("num_attention_heads") or c.get("attention_head_dim", 8)  # diffusers' naming quirk (#2011)
        layers = _per_block(c.get("transformer_layers_per_block", 1), n, "transformer_layers_per_block")
        reverse = c.get("reverse_transformer_layers_per_block")
        only_cross = c.get("only_cross_attention", False)
        mid_only_cross = c.get("mid_block_only_cross_attention")
        if mid_only_cross is None:
            mid_only_cross = only_cross if isinstance(only_cross, bool) else False
        if c.get("addition_time_embed_dim") is None or c.get("projection_class_embeddings_input_dim") is None:
            raise ValueError("unet config needs addition_time_embed_dim and projection_class_embeddings_input_dim "
                             "(SDXL's text_time conditioning)")
        activation(c.get("act_fn", "silu"))
        return cls(
            sample_size=int(c.get("sample_size") or 128), in_channels=c.get("in_channels", 4),
            out_channels=c.get("out_channels", 4), down_block_types=down, up_block_types=up,
            block_out_channels=tuple(c["block_out_channels"]),
            layers_per_block=_per_block(c.get("layers_per_block", 2), n, "layers_per_block"),
            transformer_layers_per_block=tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in layers),
            reverse_transformer_layers_per_block=tuple(
                tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in reverse) if reverse else layers[::-1]),
            num_attention_heads=_per_block(heads, n, "attention_head_dim"),
            cross_attention_dim=_per_block(c.get("cross_attention_dim", 1280), n, "cross_attention_dim"),
            only_cross_attention=_per_block(only_cross, n, "only_cross_attention"),
            mid_block_only_cross_attention=bool(mid_only_cross),
            use_linear_projection=bool(c.get("use_linear_projection", False)),
            norm_num_groups=c.get("norm_num_groups", 32), norm_eps=c.get("norm_eps", 1e-5),
            act_fn=c.get("act_fn", "silu"), flip_sin_to_cos=c.get("flip_sin_to_cos", True),
            freq_shift=c.get("freq_shift", 0), downsample_padding=c.get("downsample_padding", 1),
            mid_block_scale_factor=c.get("mid_block_scale_factor", 1.0),
            conv_in_kernel=c.get("conv_in_kernel", 3), conv_out_kernel=c.get("conv_out_kernel", 3),
            addition_time_embed_dim=c["addition_time_embed_dim"],
            projection_class_embeddings_input_dim=c["projection_class_embeddings_input_dim"],
        )

    @property
    def downsampling(self) -> int:
        """How many times the UNet halves the latents (number of blocks - 1)."""
        return len(self.block_out_channels) - 1


class ResnetBlock2D(nnx.Module):
    """diffusers' ResnetBlock2D: norm-act-conv twice, the time embedding added in between.

    ``temb_channels=None`` (the VAE's blocks) has no ``time_emb_proj``. A 1x1
    ``conv_shortcut`` matches the channels when they change.
    """

    def __init__(self, in_channels: int, out_channels: int, temb_channels: int | None, groups: int, eps: float,
                 act_fn: str = "silu", output_scale_factor: float = 1.0, *, rngs: nnx.Rngs):
        self.act = activation(act_fn)
        self.output_scale_factor = output_scale_factor
        self.norm1 = GroupNorm(groups, in_channels, eps)
        self.conv1 = Conv2d(in_channels, out_channels, 3, padding=1, rngs=rngs)
        self.time_emb_proj = Linear(temb_channels, out_channels, rngs=rngs) if temb_channels else None
        self.norm2 = GroupNorm(groups, out_channels, eps)
        self.conv2 = Conv2d(out_channels, out_channels, 3, padding=1, rngs=rngs)
        self.conv_shortcut = Conv2d(in_channels, out_channels, 1, rngs=rngs) if in_channels != out_channels else None

    def __call__(self, x: jax.Array, temb: jax.Array | None = None) -> jax.Array:
        """x (b, h, w, in), temb (b, temb_channels) or None -> (b, h, w, out)."""
        h = self.conv1(self.act(self.norm1(x)))
        if self.time_emb_proj is not None:
            h = h + self.time_emb_proj(self.act(temb))[:, None, None, :]
        h = self.conv2(self.act(self.norm2(h)))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return (x + h) / self.output_scale_factor


class Downsample2D(nnx.Module):
    """A stride-2 3x3 ``conv``; ``padding=0`` pads only bottom and right (diffusers' VAE)."""

    def __init__(self, channels: int, padding: int = 1, *, rngs: nnx.Rngs):
        self.conv = Conv2d(channels, channels, 3, stride=2, padding=padding, pad_bottom_right=padding == 0, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.conv(x)


class Upsample2D(nnx.Module):
    """Nearest-neighbour x2 upsampling, then a 3x3 ``conv``."""

    def __init__(self, channels: int, *, rngs: nnx.Rngs):
        self.conv = Conv2d(channels, channels, 3, padding=1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)  # (b, 2h, 2w, c)
        return self.conv(x)


class Attention(nnx.Module):
    """diffusers' ``Attention``: ``to_q``/``to_k``/``to_v``, heads, ``to_out.0``.

    The UNet's attention has no q/k/v bias; the VAE's (``bias=True``) also has a
    ``group_norm`` before and a residual connection after (diffusers' ``AttnProcessor2_0``).
    """

    def __init__(self, query_dim: int, heads: int, dim_head: int, cross_attention_dim: int | None = None,
                 bias: bool = False, norm_groups: int | None = None, eps: float = 1e-5, *, rngs: nnx.Rngs):
        inner = heads * dim_head
        self.heads = heads
        self.group_norm = GroupNorm(norm_groups, query_dim, eps) if norm_groups else None
        self.to_q = Linear(query_dim, inner, bias=bias, rngs=rngs)
        self.to_k = Linear(cross_attention_dim or query_dim, inner, bias=bias, rngs=rngs)
        self.to_v = Linear(cross_attention_dim or query_dim, inner, bias=bias, rngs=rngs)
        self.to_out = nnx.List([Linear(inner, query_dim, rngs=rngs)])

    def __call__(self, x: jax.Array, context: jax.Array | None = None, ip: Sequence = (),
                 kv: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """x (b, tokens, query_dim), context (b, ctx_tokens, cross_attention_dim) or None (self-attention).

        ``ip``: IP-Adapter's decoupled cross-attention (diffusers' ``IPAdapterAttnProcessor2_0``), one
        ``(layer, tokens, scale)`` per adapter: its ``to_k_ip``/``to_v_ip`` (models/ip_adapter.py), its image tokens
        (b, image_tokens, cross_attention_dim) and a traced () scale; ``scale x attention(q, to_k_ip(tokens),
        to_v_ip(tokens))`` is added to the text attention before ``to_out``. () : none.
        ``kv``: ``(to_k(context), to_v(context))`` computed earlier (:meth:`text_kv`), each (b, ctx_tokens, inner);
        then ``context`` is not read."""
        q = self.to_q(x)
        if kv is None:
            context = x if context is None else context
            kv = self.to_k(context), self.to_v(context.astype(x.dtype))
        out = attention(q, *kv, self.heads)
        for layer, tokens, scale in ip:
            tokens = tokens.astype(x.dtype)
            image = attention(q, layer.to_k_ip(tokens), layer.to_v_ip(tokens), self.heads)
            out = out + scale.astype(out.dtype) * image
        return self.to_out[0](out)

    def text_kv(self, context: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(to_k(context), to_v(context))``, each (b, ctx_tokens, heads * dim_head) in the weights' dtype, for
        ``context`` (b, ctx_tokens, cross_attention_dim) in the weights' dtype."""
        return self.to_k(context), self.to_v(context)


# "split" (below), "fused" (one product, as XLA fuses it), "split-erf" ("split" with the GELU written as PyTorch's
# 0.5·x·(1 + erf(x/√2)), one rational polynomial instead of jax.nn.gelu's two-branch erfc), or the tanh form of GELU
# that the blog's pipeline computes (diffusers' FlaxGEGLU calls flax's nn.gelu, approximate=True by default; Hendrycks
# & Gimpel 2016, eq. 2) written two ways: "split-tanh" (jax.nn.gelu(approximate=True)) and "split-sigmoid"
# (x·sigmoid(2·√(2/π)·(x + 0.044715·x³)), the same function: 0.5·(1 + tanh z) = sigmoid(2z)). tools.tpu_profile
# --ff compares them side by side on a chip. "auto" (the default): "split-tanh" on a TPU, where the exact GELU's
# polynomial on the vector unit held the feed-forward's first Linear at 95-135 TFLOP/s (a 4-image request at 1024²
# 8.08 -> 7.41 s on a v5e; the images within 6 of 255, docs/benchmarks.md), "split" elsewhere: the exact GELU
# PyTorch's diffusers computes, which the CPU tests check to their tolerances.
GEGLU_MODES = ("split", "fused", "split-erf", "split-tanh", "split-sigmoid")
GEGLU_MODE = "auto"


def geglu_mode() -> str:
    """GEGLU_MODE, "auto" resolved for the backend the program traces for (jax.default_backend())."""
    if GEGLU_MODE == "auto":
        return "split-tanh" if jax.default_backend() == "tpu" else "split"
    return GEGLU_MODE


class GEGLU(nnx.Module):
    """Gated GELU (Shazeer 2020): ``proj`` to 2 x inner, then value * gelu(gate): the exact GELU, as diffusers' GEGLU,
    except on a TPU, where it is the tanh form the blog's Flax pipeline computes (:func:`geglu_mode`).

    ``proj``'s weight holds value's rows then gate's (diffusers' layout); here they are two products ("split"), so
    the GELU and the product are the gate product's epilogue, computed once and stored before the feed-forward's
    second Linear reads it (``optimization_barrier``). Left to itself ("fused"), XLA on a TPU put the exact GELU's
    erfc polynomial into that second Linear's input and computed it again for every tile of its output: the
    1024-token level's second Linear ran at 92 TFLOP/s against 183 after (docs/benchmarks.md, "On a TPU v5e chip").
    Each output is the same dot product either way (columns of one product); on XLA:CPU the values are identical."""

    def __init__(self, dim: int, inner: int, *, rngs: nnx.Rngs):
        self.proj = Linear(dim, inner * 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (..., dim) -> (..., inner), in the weights' dtype."""
        mode = geglu_mode()
        if mode == "fused":
            value, gate = jnp.split(self.proj(x), 2, axis=-1)
            return value * jax.nn.gelu(gate, approximate=False)
        w, b = self.proj.weight[...], self.proj.bias[...]
        inner = w.shape[0] // 2
        x = x.astype(w.dtype)
        value = jax.lax.dot_general(x, w[:inner], (((x.ndim - 1,), (1,)), ((), ()))) + b[:inner]
        gate = jax.lax.dot_general(x, w[inner:], (((x.ndim - 1,), (1,)), ((), ()))) + b[inner:]
        return jax.lax.optimization_barrier(value * _gelu(gate, mode))


def _gelu(gate: jax.Array, mode: str) -> jax.Array:
    """GELU of ``gate`` (any shape) in GEGLU_MODE ``mode``'s formula, in gate's dtype; the erf and tanh forms are
    computed in float32 (in bfloat16, 1 + erf and 1 + tanh cancel to nothing below about -2; PyTorch computes
    them in float32 too)."""
    g = gate.astype(jnp.float32)
    if mode == "split-erf":
        out = 0.5 * g * (1 + jax.lax.erf(g * 0.7071067811865476))  # 0.707...: 1/√2
    elif mode == "split-tanh":
        out = jax.nn.gelu(g, approximate=True)
    elif mode == "split-sigmoid":
        out = g * jax.nn.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))  # 1.595...: 2·√(2/π)
    else:
        return jax.nn.gelu(gate, approximate=False)
    return out.astype(gate.dtype)


class FeedForward(nnx.Module):
    """``ff.net``: GEGLU (index 0), dropout (index 1, no parameters), Linear (index 2)."""

    def __init__(self, dim: int, mult: int = 4, *, rngs: nnx.Rngs):
        self.net = nnx.List([GEGLU(dim, dim * mult, rngs=rngs), None, Linear(dim * mult, dim, rngs=rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.net[2](self.net[0](x))


class BasicTransformerBlock(nnx.Module):
    """Self-attention, cross-attention to the text, GEGLU feed-forward; pre-LayerNorm, residuals."""

    def __init__(self, dim: int, heads: int, dim_head: int, cross_attention_dim: int, only_cross_attention: bool,
                 *, rngs: nnx.Rngs):
        self.only_cross_attention = only_cross_attention
        self.norm1 = LayerNorm(dim)
        self.attn1 = Attention(dim, heads, dim_head, cross_attention_dim if only_cross_attention else None, rngs=rngs)
        self.norm2 = LayerNorm(dim)
        self.attn2 = Attention(dim, heads, dim_head, cross_attention_dim, rngs=rngs)
        self.norm3 = LayerNorm(dim)
        self.ff = FeedForward(dim, rngs=rngs)

    def __call__(self, x: jax.Array, context: jax.Array, ip: Iterator | None = None,
                 kv: Iterator | None = None) -> jax.Array:
        """x (b, tokens, dim), context (b, 77, cross_attention_dim) -> (b, tokens, dim). ``ip``, ``kv``: the UNet's
        iterators over its cross-attentions' IP-Adapter inputs and precomputed text keys and values
        (:meth:`UNet2DConditionModel.__call__`); this block's attn2 takes the next of each."""
        x = x + self.attn1(self.norm1(x), context if self.only_cross_attention else None)
        x = x + self.attn2(self.norm2(x), context, next(ip) if ip is not None else (),
                           next(kv) if kv is not None else None)
        return x + self.ff(self.norm3(x))


class Transformer2DModel(nnx.Module):
    """GroupNorm, ``proj_in`` (Linear or 1x1 conv), transformer blocks, ``proj_out``, residual."""

    def __init__(self, heads: int, dim_head: int, in_channels: int, num_layers: int, cross_attention_dim: int,
                 groups: int, use_linear_projection: bool, only_cross_attention: bool, *, rngs: nnx.Rngs):
        inner = heads * dim_head
        self.use_linear_projection = use_linear_projection
        self.norm = GroupNorm(groups, in_channels, 1e-6)
        proj = ((lambda i, o: Linear(i, o, rngs=rngs)) if use_linear_projection
                else (lambda i, o: Conv2d(i, o, 1, rngs=rngs)))
        self.proj_in = proj(in_channels, inner)
        self.transformer_blocks = nnx.List([
            BasicTransformerBlock(inner, heads, dim_head, cross_attention_dim, only_cross_attention, rngs=rngs)
            for _ in range(num_layers)])
        self.proj_out = proj(inner, in_channels)

    def __call__(self, x: jax.Array, context: jax.Array, ip: Iterator | None = None,
                 kv: Iterator | None = None) -> jax.Array:
        """x (b, h, w, c), context (b, 77, cross_attention_dim) -> (b, h, w, c); ``ip``, ``kv`` as
        BasicTransformerBlock's."""
        b, h, w, c = x.shape
        residual = x
        x = self.norm(x)
        if self.use_linear_projection:
            x = self.proj_in(x.reshape(b, h * w, c))  # (b, h*w, inner)
        else:
            x = self.proj_in(x).reshape(b, h * w, -1)
        for block in self.transformer_blocks:
            x = block(x, context, ip, kv)
        if self.use_linear_projection:
            x = self.proj_out(x).reshape(b, h, w, c)
        else:
            x = self.proj_out(x.reshape(b, h, w, -1))
        return x + residual


def _transformers(config: UNetConfig, channels: int, depths, num_layers: int, heads: int, cross_attention_dim: int,
                  only_cross: bool, rngs: nnx.Rngs) -> nnx.List:
    """One Transformer2DModel per resnet of a block; ``depths`` is an int or one int per layer."""
    depths = depths if isinstance(depths, tuple) else (depths,) * num_layers
    return nnx.List([
        Transformer2DModel(heads, channels // heads, channels, depths[j], cross_attention_dim, config.norm_num_groups,
                           config.use_linear_projection, only_cross, rngs=rngs)
        for j in range(num_layers)])


class DownBlock(nnx.Module):
    """DownBlock2D (``attentions`` is None) or CrossAttnDownBlock2D; optional ``downsamplers.0``."""

    def __init__(self, config: UNetConfig, i: int, in_channels: int, temb: int, *, rngs: nnx.Rngs):
        out = config.block_out_channels[i]
        n = config.layers_per_block[i]
        g, eps = config.norm_num_groups, config.norm_eps
        self.resnets = nnx.List([ResnetBlock2D(in_channels if j == 0 else out, out, temb, g, eps, config.act_fn,
                                               rngs=rngs) for j in range(n)])
        self.attentions = _transformers(config, out, config.transformer_layers_per_block[i], n,
                                        config.num_attention_heads[i], config.cross_attention_dim[i],
                                        config.only_cross_attention[i], rngs) \
            if config.down_block_types[i] == "CrossAttnDownBlock2D" else None
        final = i == len(config.block_out_channels) - 1
        self.downsamplers = None if final else nnx.List([Downsample2D(out, config.downsample_padding, rngs=rngs)])

    def __call__(self, x, temb, context, ip: Iterator | None = None,
                 kv: Iterator | None = None) -> tuple[jax.Array, list[jax.Array]]:
        """x (b, h, w, in) -> (b, h', w', out) and the skip connections (one per layer, + downsample)."""
        skips = []
        for j, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[j](x, context, ip, kv)
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
            skips.append(x)
        return x, skips


class UpBlock(nnx.Module):
    """UpBlock2D or CrossAttnUpBlock2D: each resnet takes the skip connection concatenated on channels."""

    def __init__(self, config: UNetConfig, i: int, prev_channels: int, temb: int, *, rngs: nnx.Rngs):
        reversed_channels = config.block_out_channels[::-1]
        out = reversed_channels[i]
        skip_in = reversed_channels[min(i + 1, len(reversed_channels) - 1)]
        n = config.layers_per_block[::-1][i] + 1
        g, eps = config.norm_num_groups, config.norm_eps
        self.resnets = nnx.List([
            ResnetBlock2D((prev_channels if j == 0 else out) + (skip_in if j == n - 1 else out), out, temb, g, eps,
                          config.act_fn, rngs=rngs)
            for j in range(n)])
        self.attentions = _transformers(config, out, config.reverse_transformer_layers_per_block[i], n,
                                        config.num_attention_heads[::-1][i], config.cross_attention_dim[::-1][i],
                                        config.only_cross_attention[::-1][i], rngs) \
            if config.up_block_types[i] == "CrossAttnUpBlock2D" else None
        final = i == len(reversed_channels) - 1
        self.upsamplers = None if final else nnx.List([Upsample2D(out, rngs=rngs)])

    def __call__(self, x, skips: list[jax.Array], temb, context, ip: Iterator | None = None,
                 kv: Iterator | None = None) -> jax.Array:
        """x (b, h, w, c) and this block's skips (last used first) -> (b, 2h, 2w, out) (or h, w when final)."""
        for j, resnet in enumerate(self.resnets):
            x = jnp.concatenate([x, skips.pop()], axis=-1)  # (b, h, w, c + skip channels)
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[j](x, context, ip, kv)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class MidBlock(nnx.Module):
    """UNetMidBlock2DCrossAttn: resnet, then (transformer, resnet)."""

    def __init__(self, config: UNetConfig, temb: int, *, rngs: nnx.Rngs):
        c = config.block_out_channels[-1]
        g, eps, s = config.norm_num_groups, config.norm_eps, config.mid_block_scale_factor
        self.resnets = nnx.List([ResnetBlock2D(c, c, temb, g, eps, config.act_fn, s, rngs=rngs) for _ in range(2)])
        self.attentions = _transformers(config, c, config.transformer_layers_per_block[-1], 1,
                                        config.num_attention_heads[-1], config.cross_attention_dim[-1],
                                        config.mid_block_only_cross_attention, rngs)

    def __call__(self, x, temb, context, ip: Iterator | None = None, kv: Iterator | None = None) -> jax.Array:
        x = self.resnets[0](x, temb)
        return self.resnets[1](self.attentions[0](x, context, ip, kv), temb)


class TimestepEmbedding(nnx.Module):
    """``linear_1``, activation, ``linear_2``: the MLP over a sinusoidal embedding."""

    def __init__(self, in_dim: int, dim: int, act_fn: str, *, rngs: nnx.Rngs):
        self.act = activation(act_fn)
        self.linear_1 = Linear(in_dim, dim, rngs=rngs)
        self.linear_2 = Linear(dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(self.act(self.linear_1(x)))


class UNet2DConditionModel(nnx.Module):
    """diffusers' UNet2DConditionModel for SDXL-family configs (see the module docstring)."""

    def __init__(self, config: UNetConfig, *, rngs: nnx.Rngs):
        self.config = config
        c0 = config.block_out_channels[0]
        temb = c0 * 4
        self.act = activation(config.act_fn)
        self.conv_in = Conv2d(config.in_channels, c0, config.conv_in_kernel, padding=(config.conv_in_kernel - 1) // 2,
                              rngs=rngs)
        self.time_embedding = TimestepEmbedding(c0, temb, config.act_fn, rngs=rngs)
        self.add_embedding = TimestepEmbedding(config.projection_class_embeddings_input_dim, temb, config.act_fn,
                                               rngs=rngs)
        channels = [c0, *config.block_out_channels]
        self.down_blocks = nnx.List([DownBlock(config, i, channels[i], temb, rngs=rngs)
                                     for i in range(len(config.block_out_channels))])
        self.mid_block = MidBlock(config, temb, rngs=rngs)
        reversed_channels = config.block_out_channels[::-1]
        self.up_blocks = nnx.List([UpBlock(config, i, reversed_channels[max(i - 1, 0)], temb, rngs=rngs)
                                   for i in range(len(reversed_channels))])
        self.conv_norm_out = GroupNorm(config.norm_num_groups, c0, config.norm_eps)
        self.conv_out = Conv2d(c0, config.out_channels, config.conv_out_kernel,
                               padding=(config.conv_out_kernel - 1) // 2, rngs=rngs)

    def embed_time(self, timesteps: jax.Array, text_embeds: jax.Array, time_ids: jax.Array, dtype) -> jax.Array:
        """Timestep embedding plus SDXL's added conditioning (pooled text, size and crop ids).

        Args:
            timesteps: (b,) numeric; text_embeds: (b, projection_dim); time_ids: (b, n) with
                n x addition_time_embed_dim + projection_dim = projection_class_embeddings_input_dim.
        Returns:
            (b, 4 x block_out_channels[0]) in ``dtype``.
        """
        cfg = self.config
        t_emb = timestep_embedding(timesteps, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift)
        emb = self.time_embedding(t_emb.astype(dtype))
        b = time_ids.shape[0]
        time_embeds = timestep_embedding(time_ids.reshape(-1), cfg.addition_time_embed_dim, cfg.flip_sin_to_cos,
                                         cfg.freq_shift).reshape(b, -1)  # (b, n * addition_time_embed_dim)
        add = jnp.concatenate([text_embeds.astype(dtype), time_embeds.astype(dtype)], axis=-1)
        return emb + self.add_embedding(add)

    def cross_attentions(self) -> list[Attention]:
        """Every transformer block's ``attn2`` (the cross-attention to the text) in the order a call runs them: down
        blocks, mid block, up blocks (models/ip_adapter.forward_order's order)."""
        blocks = [*self.down_blocks, self.mid_block, *self.up_blocks]
        return [t.attn2 for block in blocks for model in (block.attentions or ()) for t in model.transformer_blocks]

    def text_kv(self, encoder_hidden_states: jax.Array) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """Each cross-attention's keys and values of the text, in :meth:`cross_attentions`' order: what
        ``__call__(..., text_kv=...)`` takes, so a denoising loop projects its unchanging text once, not at every
        step (on a TPU v5e those projections were 78 ms of a 4-image request at 1024², docs/benchmarks.md).

        Args:
            encoder_hidden_states: (b, tokens, cross_attention_dim), any float dtype (cast to the weights').
        Returns:
            one ``(k, v)`` per cross-attention, each (b, tokens, heads * dim_head) in the weights' dtype.
        """
        context = encoder_hidden_states.astype(self.conv_in.weight[...].dtype)
        return tuple(a.text_kv(context) for a in self.cross_attentions())

    def __call__(self, sample: jax.Array, timesteps: jax.Array, encoder_hidden_states: jax.Array,
                 text_embeds: jax.Array, time_ids: jax.Array,
                 down_block_additional_residuals: Sequence[jax.Array] | None = None,
                 mid_block_additional_residual: jax.Array | None = None,
                 ip_adapter: Sequence[Sequence] | None = None,
                 text_kv: Sequence[tuple[jax.Array, jax.Array]] | None = None) -> jax.Array:
        """Predict the noise (or v) for a batch of latents.

        Args:
            sample: (b, in_channels, h, w) latents, channels-first; h and w multiples of
                2 ** (blocks - 1).
            timesteps: (b,) or () numeric timesteps.
            encoder_hidden_states: (b, 77, cross_attention_dim) both encoders' penultimate states.
            text_embeds: (b, projection_dim) pooled projection of text_encoder_2.
            time_ids: (b, 6) float: original size, crop top-left, target size (height, width each).
            down_block_additional_residuals: a ControlNet's residuals (models/controlnet.py), one per skip
                connection in order (conv_in's, each down layer's, each downsampler's), each channels-first
                (b, c_k, h_k, w_k); added to the skips after the down blocks, as diffusers'
                ``UNet2DConditionModel`` does. None: none.
            mid_block_additional_residual: (b, c_last, h_last, w_last) added to the mid block's output; None: none.
            ip_adapter: IP-Adapter inputs, one sequence per cross-attention in the order this call runs them (down
                blocks, mid block, up blocks: models/ip_adapter.forward_order), each of ``(layer, tokens, scale)``
                per adapter (:meth:`Attention.__call__`). None: none.
            text_kv: :meth:`text_kv` of ``encoder_hidden_states``, computed once for the many calls of a denoising
                loop (the text does not change between steps); the same values as without it. None: each
                cross-attention computes its keys and values from ``encoder_hidden_states``.
        Returns:
            (b, out_channels, h, w) in the parameters' dtype, channels-first.
        Raises:
            ValueError: ``ip_adapter`` or ``text_kv`` has more entries than the UNet has cross-attentions, or
                ControlNet residuals do not match the skips.
        """
        dtype = self.conv_in.weight[...].dtype
        b = sample.shape[0]
        temb = self.embed_time(jnp.broadcast_to(timesteps, (b,)), text_embeds, time_ids, dtype)
        context = encoder_hidden_states.astype(dtype)
        x = self.conv_in(jnp.transpose(sample, (0, 2, 3, 1)).astype(dtype))  # channels-last from here
        skips = [x]
        ip = None if ip_adapter is None else iter(ip_adapter)
        kv = None if text_kv is None else iter(text_kv)
        for block in self.down_blocks:
            x, block_skips = block(x, temb, context, ip, kv)
            skips.extend(block_skips)
        if down_block_additional_residuals is not None:
            if len(down_block_additional_residuals) != len(skips):
                raise ValueError(f"{len(down_block_additional_residuals)} down residuals for {len(skips)} skips")
            skips = [s + jnp.transpose(r, (0, 2, 3, 1)).astype(s.dtype)
                     for s, r in zip(skips, down_block_additional_residuals, strict=True)]
        x = self.mid_block(x, temb, context, ip, kv)
        if mid_block_additional_residual is not None:
            x = x + jnp.transpose(mid_block_additional_residual, (0, 2, 3, 1)).astype(x.dtype)
        for block in self.up_blocks:
            n = len(block.resnets)
            x = block(x, skips[-n:], temb, context, ip, kv)
            del skips[-n:]
        if ip is not None and next(ip, None) is not None:
            raise ValueError("ip_adapter has more entries than the UNet has cross-attention layers")
        if kv is not None and next(kv, None) is not None:
            raise ValueError("text_kv has more entries than the UNet has cross-attention layers")
        x = self.conv_out(self.act(self.conv_norm_out(x)))
        return jnp.transpose(x, (0, 3, 1, 2))  # (b, out_channels, h, w)
