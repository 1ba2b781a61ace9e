"""ControlNet-Union (xinsir's ControlNetPlus) in Flax NNX: diffusers' ``ControlNetUnionModel`` for ``text_time``
configs. One file serves every control type (openpose, depth, soft and hard edges, normal, segment; ProMax: tile,
repaint), and one call takes several control images, each with its type.

It is a :class:`.controlnet.ControlNetModel` (the UNet's encoder, ``controlnet_cond_embedding``, the zero convs)
plus what mixes the control images (diffusers' names, so a checkpoint's keys map by rule):

* ``task_embedding`` (num_control_type, C): added to each image's pooled embedding by the image's type;
* ``transformer_layes.{i}`` (sic: diffusers' and xinsir's name): ``ResidualAttentionBlock`` s (``attn`` a
  ``torch.nn.MultiheadAttention``: ``in_proj_weight``, ``in_proj_bias``, ``out_proj``; ``ln_1``, ``mlp.c_fc``,
  ``mlp.c_proj`` with QuickGELU, ``ln_2``) over the tokens [image 1 .. image n, the latents' mean];
* ``spatial_ch_projs``: each image's token to a per-channel shift of its embedding;
* ``control_add_embedding``: a TimestepEmbedding of the sinusoids of the multi-hot ``control_type``, added to the
  time embedding.

Two of diffusers' rules kept for parity (docs/controlnet.md, "ControlNet-Union"):

* its ``nn.MultiheadAttention`` is built without ``batch_first``, so the (rows, tokens, C) input is read as
  (sequence, batch, C): each token attends over the **rows** of the batch (both CFG halves and every image), not
  over the other tokens. The call takes ``rows_axis``: under ``shard_map`` the keys and values are gathered from
  every device, so the rows attended are the whole batch's, as diffusers' single call sees them.
  (sd-webui-controlnet and ComfyUI attend over the tokens, without the latents' token: their images differ.)
* the scale: one image, every residual times it; several images, each image's embedding and token times its own
  scale and the residuals unscaled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sdxl_engine.models.controlnet import ControlNetConfig, ControlNetModel
from sdxl_engine.models.layers import LayerNorm, Linear, timestep_embedding
from sdxl_engine.models.unet import TimestepEmbedding


@dataclasses.dataclass(frozen=True)
class ControlNetUnionConfig(ControlNetConfig):
    """diffusers' ControlNetUnionModel config: a :class:`.controlnet.ControlNetConfig` and the union's parts.

    Attributes:
        num_control_type: how many control types it knows (6: xinsir's union; 8: ProMax's, tile and repaint).
        num_trans_channel, num_trans_head, num_trans_layer: the token transformer's width, heads and depth.
        num_proj_channel: ``spatial_ch_projs``' output width.
    """

    num_control_type: int = 6
    num_trans_channel: int = 320
    num_trans_head: int = 8
    num_trans_layer: int = 1
    num_proj_channel: int = 320

    @classmethod
    def from_dict(cls, c: Mapping[str, Any]) -> ControlNetUnionConfig:
        """A ControlNetUnionModel config.json dict. Raises ValueError naming an unsupported field or value."""
        if c.get("controlnet_conditioning_channel_order", "rgb") != "rgb":
            raise ValueError("controlnet union config controlnet_conditioning_channel_order must be rgb (diffusers "
                             "refuses bgr for ControlNetUnionModel)")
        union = {k: int(c.get(k, f.default)) for k, f in cls.__dataclass_fields__.items()
                 if k.startswith("num_")}
        base = ControlNetConfig.from_dict({k: v for k, v in c.items() if k not in union})
        width = base.unet.block_out_channels[0]
        for field in ("num_trans_channel", "num_proj_channel"):
            if union[field] != width:
                raise ValueError(f"controlnet union config {field}={union[field]}: the union's tokens are the first "
                                 f"block's width, {width}")
        if union["num_trans_channel"] % union["num_trans_head"]:
            raise ValueError(f"controlnet union config num_trans_head={union['num_trans_head']} does not divide "
                             f"num_trans_channel={union['num_trans_channel']}")
        if union["num_control_type"] < 1 or union["num_trans_layer"] < 0:
            raise ValueError(f"controlnet union config num_control_type={union['num_control_type']}, "
                             f"num_trans_layer={union['num_trans_layer']}: at least one type, no negative depth")
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ControlNetConfig)}, **union)


class MultiheadAttention(nnx.Module):
    """``torch.nn.MultiheadAttention(d, heads)`` (no ``batch_first``): ``in_proj_weight`` (3d, d), ``in_proj_bias``,
    ``out_proj``. Attends over the input's first axis (see the module docstring)."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.in_proj_weight = nnx.Param(jax.random.normal(rngs.params(), (3 * dim, dim)) / math.sqrt(dim))
        self.in_proj_bias = nnx.Param(jnp.zeros((3 * dim,), jnp.float32))
        self.out_proj = Linear(dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array, rows_axis: str | None = None) -> jax.Array:
        """x (rows, tokens, d) -> (rows, tokens, d): token t of each row attends over token t of every row (those of
        every device along ``rows_axis`` under ``shard_map``)."""
        w = self.in_proj_weight[...]
        qkv = jnp.einsum("rtd,ed->rte", x.astype(w.dtype), w) + self.in_proj_bias[...]
        q, k, v = jnp.split(qkv, 3, axis=-1)  # each (rows, tokens, d)
        if rows_axis is not None:
            k, v = (jax.lax.all_gather(a, rows_axis, tiled=True) for a in (k, v))  # (all rows, tokens, d)
        r, t, d = q.shape
        h = self.heads
        q, k, v = (a.reshape(a.shape[0], t, h, d // h).astype(jnp.float32) for a in (q, k, v))
        scores = jnp.einsum("ithc,jthc->thij", q, k) / math.sqrt(d // h)  # (tokens, heads, rows, all rows)
        out = jnp.einsum("thij,jthc->ithc", jax.nn.softmax(scores, axis=-1), v).reshape(r, t, d)
        return self.out_proj(out.astype(w.dtype))


class ResidualAttentionMlp(nnx.Module):
    """``c_fc`` (d -> 4d), QuickGELU (x * sigmoid(1.702 x)), ``c_proj`` (4d -> d)."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.c_fc = Linear(dim, dim * 4, rngs=rngs)
        self.c_proj = Linear(dim * 4, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.c_fc(x)
        return self.c_proj(x * jax.nn.sigmoid(1.702 * x))


class ResidualAttentionBlock(nnx.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(x)) (diffusers' ``ResidualAttentionBlock``)."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.attn = MultiheadAttention(dim, heads, rngs=rngs)
        self.ln_1 = LayerNorm(dim)
        self.mlp = ResidualAttentionMlp(dim, rngs=rngs)
        self.ln_2 = LayerNorm(dim)

    def __call__(self, x: jax.Array, rows_axis: str | None = None) -> jax.Array:
        x = x + self.attn(self.ln_1(x), rows_axis)
        return x + self.mlp(self.ln_2(x))


class ControlNetUnionModel(ControlNetModel):
    """diffusers' ControlNetUnionModel for SDXL-family configs (see the module docstring)."""

    def __init__(self, config: ControlNetUnionConfig, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        u, c = config.unet, config.num_trans_channel
        self.task_embedding = nnx.Param(math.sqrt(c) * jax.random.normal(rngs.params(), (config.num_control_type, c)))
        self.transformer_layes = nnx.List([ResidualAttentionBlock(c, config.num_trans_head, rngs=rngs)
                                           for _ in range(config.num_trans_layer)])
        self.spatial_ch_projs = Linear(c, config.num_proj_channel, rngs=rngs)
        self.control_add_embedding = TimestepEmbedding(u.addition_time_embed_dim * config.num_control_type,
                                                       u.block_out_channels[0] * 4, "silu", rngs=rngs)

    def __call__(self, sample: jax.Array, timesteps: jax.Array, encoder_hidden_states: jax.Array,
                 text_embeds: jax.Array, time_ids: jax.Array, controlnet_cond: jax.Array,
                 conditioning_scale: float | jax.Array = 1.0, control_type_idx: jax.Array | None = None,
                 rows_axis: str | None = None) -> tuple[tuple[jax.Array, ...], jax.Array]:
        """The residuals for one UNet call (diffusers' ``ControlNetUnionModel.forward`` without guess mode).

        Args:
            sample, timesteps, encoder_hidden_states, text_embeds, time_ids: as :class:`.controlnet.ControlNetModel`.
            controlnet_cond: (images, b, conditioning_channels, H, W) the unit's control images, float in [0, 1],
                channels-first (one image: (b, 3, H, W) is taken too).
            conditioning_scale: a scalar or (images,): one image, every residual times it; several, each image's
                embedding and token (diffusers' rule).
            control_type_idx: (images,) int, each image's control type (0 .. num_control_type - 1); the multi-hot
                ``control_type`` is made from them (diffusers' pipeline ``scatter_``). None: type 0 each.
            rows_axis: the mesh axis the rows are split over under ``shard_map`` (the token attention reads every
                device's rows), or None (all rows here).
        Returns:
            (down residuals, the mid residual), channels-first, in the parameters' dtype.
        """
        cfg = self.cond_config
        dtype = self.conv_in.weight[...].dtype
        cond = controlnet_cond if controlnet_cond.ndim == 5 else controlnet_cond[None]
        n, b = cond.shape[0], sample.shape[0]
        idx = jnp.zeros((n,), jnp.int32) if control_type_idx is None else jnp.asarray(control_type_idx, jnp.int32)
        scale = jnp.broadcast_to(jnp.asarray(conditioning_scale, jnp.float32), (n,)).astype(dtype)
        # 1. time, added conditioning and the control types' embedding (one-hot rows of the types, summed: multi-hot)
        temb = self.embed_time(jnp.broadcast_to(timesteps, (b,)), text_embeds, time_ids, dtype)
        control_type = jnp.minimum(jax.nn.one_hot(idx, cfg.num_control_type).sum(0), 1.0)  # (num_control_type,)
        types = timestep_embedding(control_type, cfg.unet.addition_time_embed_dim, cfg.unet.flip_sin_to_cos,
                                   cfg.unet.freq_shift).reshape(1, -1)  # (1, num_control_type * embed dim)
        temb = temb + self.control_add_embedding(jnp.broadcast_to(types, (b, types.shape[1])).astype(dtype))
        context = encoder_hidden_states.astype(dtype)
        # 2. the images' embeddings mixed with the latents by the token transformer
        x = self.conv_in(jnp.transpose(sample, (0, 2, 3, 1)).astype(dtype))  # (b, h, w, C) channels-last
        several = n > 1  # diffusers: one image unscaled here (its residuals scaled), several each by its scale
        conditions, tokens = [], []
        for k in range(n):
            condition = self.controlnet_cond_embedding(jnp.transpose(cond[k], (0, 2, 3, 1)).astype(dtype))
            token = condition.mean(axis=(1, 2)) + self.task_embedding[...][idx[k]].astype(dtype)  # (b, C)
            conditions.append(condition * scale[k] if several else condition)
            tokens.append(token * scale[k] if several else token)
        tokens.append(x.mean(axis=(1, 2)))
        seq = jnp.stack(tokens, axis=1)  # (b, n + 1, C)
        for layer in self.transformer_layes:
            seq = layer(seq, rows_axis)
        fuser = jnp.zeros_like(x)
        for k in range(n):
            alpha = self.spatial_ch_projs(seq[:, k])[:, None, None, :]  # (b, 1, 1, C)
            fuser = fuser + conditions[k] + (alpha * scale[k] if several else alpha)
        x = x + fuser
        # 3. down and mid blocks, the zero convs
        skips = [x]
        for block in self.down_blocks:
            x, block_skips = block(x, temb, context)
            skips.extend(block_skips)
        x = self.mid_block(x, temb, context)
        out_scale = jnp.asarray(1.0, dtype) if several else scale[0]
        down = tuple(jnp.transpose(conv(s), (0, 3, 1, 2)) * out_scale
                     for conv, s in zip(self.controlnet_down_blocks, skips, strict=True))
        mid = jnp.transpose(self.controlnet_mid_block(x), (0, 3, 1, 2)) * out_scale
        return down, mid
