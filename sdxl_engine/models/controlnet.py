"""SDXL's ControlNet (Zhang et al. 2023) in Flax NNX: diffusers' ``ControlNetModel`` for ``text_time`` configs.

A ControlNet is a copy of the UNet's encoder (``conv_in``, the time and added embeddings, ``down_blocks``,
``mid_block``: the UNet's own modules from :mod:`.unet`) plus ``controlnet_cond_embedding`` (a small conv net
that brings the conditioning image, pixels in [0, 1], down to the latents' size) and one 1x1 "zero convolution"
per skip connection (``controlnet_down_blocks.{k}``) and for the mid block (``controlnet_mid_block``). Its outputs
are added to the UNet's skip connections and mid-block output (:class:`.unet.UNet2DConditionModel`'s
``down_block_additional_residuals`` / ``mid_block_additional_residual``).

Module and parameter names are diffusers' (``controlnet_down_blocks.3.weight``,
``controlnet_cond_embedding.blocks.1.weight``), so a diffusers checkpoint's keys map by rule
(checkpoint/weights.py). The public call takes and returns channels-first arrays as diffusers does.

Not supported (refused by :meth:`ControlNetConfig.from_dict` naming the field): ``global_pool_conditions`` (the
shuffle ControlNets of SD 1.5), ``class_embed_type``, and ControlNet-Union's ``ControlNetUnionModel`` (another
class: loading refuses it by name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sdxl_engine.models.layers import Conv2d
from sdxl_engine.models.unet import DownBlock, MidBlock, TimestepEmbedding, UNet2DConditionModel, UNetConfig

# A1111's soft injection ("My prompt is more important", "ControlNet is more important"): residual k of n is
# scaled by SOFT_BASE ** (12 - k) (sd-webui-controlnet scripts/hook.py: ``0.825 ** float(12 - i) for i in
# range(13)``, cut to SDXL's 10 residuals).
SOFT_BASE = 0.825
SOFT_TOP = 12


def soft_scales(n: int) -> tuple[float, ...]:
    """The per-residual factors of A1111's soft injection for ``n`` residuals (skips in order, then the mid
    block): ``0.825 ** (12 - k)``, k = 0 .. n - 1 (SDXL's 10: 0.825^12 .. 0.825^3)."""
    return tuple(SOFT_BASE ** float(SOFT_TOP - k) for k in range(n))


@dataclasses.dataclass(frozen=True)
class ControlNetConfig:
    """diffusers' ControlNetModel config: the encoder's as a :class:`.unet.UNetConfig` (up blocks mirrored from the
    down blocks, never built) and the conditioning embedding's.

    Attributes:
        unet: the encoder's config (conv_in, embeddings, down and mid blocks).
        conditioning_channels: channels of the conditioning image (3: RGB).
        conditioning_embedding_out_channels: the conditioning embedding's conv channels; it downsamples
            2 ** (len - 1) times (8 for SDXL: pixels to latents).
        bgr: ``controlnet_conditioning_channel_order`` "bgr" (the image's channels are flipped first).
    """

    unet: UNetConfig
    conditioning_channels: int
    conditioning_embedding_out_channels: tuple[int, ...]
    bgr: bool = False

    @classmethod
    def from_dict(cls, c: Mapping[str, Any]) -> ControlNetConfig:
        """A ControlNetModel config.json dict. Raises ValueError naming an unsupported field or value."""
        if c.get("global_pool_conditions", False):
            raise ValueError("controlnet config global_pool_conditions=true is not supported (shuffle ControlNets)")
        order = c.get("controlnet_conditioning_channel_order", "rgb")
        if order not in ("rgb", "bgr"):
            raise ValueError(f"controlnet config controlnet_conditioning_channel_order={order!r}: rgb or bgr")
        down = list(c["down_block_types"])
        up = ["CrossAttnUpBlock2D" if kind == "CrossAttnDownBlock2D" else "UpBlock2D" for kind in reversed(down)]
        # sample_size is not the encoder's business (from_unet does not copy it): left out, so equal nets compare equal
        encoder = {k: v for k, v in c.items() if k not in ("up_block_types", "out_channels", "sample_size")}
        encoder.update(up_block_types=up, out_channels=c.get("in_channels", 4))
        return cls(unet=UNetConfig.from_dict(encoder), conditioning_channels=int(c.get("conditioning_channels", 3)),
                   conditioning_embedding_out_channels=tuple(c.get("conditioning_embedding_out_channels",
                                                                   (16, 32, 96, 256))),
                   bgr=order == "bgr")

    @property
    def residuals(self) -> int:
        """How many residuals it returns: one per UNet skip connection (conv_in, each layer, each downsampler) and
        the mid block's (10 for SDXL)."""
        u = self.unet
        return 1 + sum(u.layers_per_block) + u.downsampling + 1

    @property
    def image_factor(self) -> int:
        """Pixels per latent cell the conditioning embedding assumes: 2 ** (len(channels) - 1) (8 for SDXL)."""
        return 2 ** (len(self.conditioning_embedding_out_channels) - 1)


class ControlNetConditioningEmbedding(nnx.Module):
    """``conv_in``, then ``blocks`` (pairs: a 3x3 conv, a stride-2 3x3 conv to the next width), SiLU after each,
    then ``conv_out`` to the UNet's first width (zero-initialised in training; loaded here)."""

    def __init__(self, out_channels: int, conditioning_channels: int, channels: tuple[int, ...], *,
                 rngs: nnx.Rngs):
        self.conv_in = Conv2d(conditioning_channels, channels[0], 3, padding=1, rngs=rngs)
        blocks = []
        for i in range(len(channels) - 1):
            blocks.append(Conv2d(channels[i], channels[i], 3, padding=1, rngs=rngs))
            blocks.append(Conv2d(channels[i], channels[i + 1], 3, stride=2, padding=1, rngs=rngs))
        self.blocks = nnx.List(blocks)
        self.conv_out = Conv2d(channels[-1], out_channels, 3, padding=1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (b, H, W, conditioning_channels) -> (b, H / f, W / f, out_channels), channels-last."""
        x = jax.nn.silu(self.conv_in(x))
        for block in self.blocks:
            x = jax.nn.silu(block(x))
        return self.conv_out(x)


class ControlNetModel(nnx.Module):
    """diffusers' ControlNetModel for SDXL-family configs (see the module docstring)."""

    # The UNet's: timestep embedding plus pooled text and time ids, from the same attribute names.
    embed_time = UNet2DConditionModel.embed_time

    def __init__(self, config: ControlNetConfig, *, rngs: nnx.Rngs):
        self.config = config.unet
        self.cond_config = config
        u = config.unet
        c0 = u.block_out_channels[0]
        temb = c0 * 4
        self.conv_in = Conv2d(u.in_channels, c0, u.conv_in_kernel, padding=(u.conv_in_kernel - 1) // 2, rngs=rngs)
        self.time_embedding = TimestepEmbedding(c0, temb, u.act_fn, rngs=rngs)
        self.add_embedding = TimestepEmbedding(u.projection_class_embeddings_input_dim, temb, u.act_fn, rngs=rngs)
        self.controlnet_cond_embedding = ControlNetConditioningEmbedding(
            c0, config.conditioning_channels, config.conditioning_embedding_out_channels, rngs=rngs)
        channels = [c0, *u.block_out_channels]
        self.down_blocks = nnx.List([DownBlock(u, i, channels[i], temb, rngs=rngs)
                                     for i in range(len(u.block_out_channels))])
        zero = [Conv2d(c0, c0, 1, rngs=rngs)]
        for i, out in enumerate(u.block_out_channels):
            zero += [Conv2d(out, out, 1, rngs=rngs) for _ in range(u.layers_per_block[i])]
            if i < len(u.block_out_channels) - 1:
                zero.append(Conv2d(out, out, 1, rngs=rngs))
        self.controlnet_down_blocks = nnx.List(zero)
        self.mid_block = MidBlock(u, temb, rngs=rngs)
        self.controlnet_mid_block = Conv2d(u.block_out_channels[-1], u.block_out_channels[-1], 1, rngs=rngs)

    def __call__(self, sample: jax.Array, timesteps: jax.Array, encoder_hidden_states: jax.Array,
                 text_embeds: jax.Array, time_ids: jax.Array, controlnet_cond: jax.Array,
                 conditioning_scale: float | jax.Array = 1.0) -> tuple[tuple[jax.Array, ...], jax.Array]:
        """The residuals for one UNet call (diffusers' ``ControlNetModel.forward`` without guess mode).

        Args:
            sample: (b, in_channels, h, w) the UNet's latent input (after the sampler's input scaling; the latents
                alone for an inpainting UNet, as diffusers and A1111 give a ControlNet), channels-first.
            timesteps, encoder_hidden_states, text_embeds, time_ids: as :class:`.unet.UNet2DConditionModel`.
            controlnet_cond: (b, conditioning_channels, h x f, w x f) the conditioning image, float in [0, 1]
                (diffusers' control image processor: no normalisation), channels-first.
            conditioning_scale: multiplies every residual (diffusers' ``controlnet_conditioning_scale``).
        Returns:
            (down residuals, one per UNet skip connection in order, each (b, c_k, h_k, w_k); the mid block's
            (b, c_last, h_last, w_last)), channels-first, in the parameters' dtype.
        """
        dtype = self.conv_in.weight[...].dtype
        b = sample.shape[0]
        temb = self.embed_time(jnp.broadcast_to(timesteps, (b,)), text_embeds, time_ids, dtype)
        context = encoder_hidden_states.astype(dtype)
        cond = jnp.transpose(controlnet_cond, (0, 2, 3, 1)).astype(dtype)  # channels-last from here
        if self.cond_config.bgr:
            cond = cond[..., ::-1]
        x = self.conv_in(jnp.transpose(sample, (0, 2, 3, 1)).astype(dtype))
        x = x + self.controlnet_cond_embedding(cond)
        skips = [x]
        for block in self.down_blocks:
            x, block_skips = block(x, temb, context)
            skips.extend(block_skips)
        x = self.mid_block(x, temb, context)
        scale = jnp.asarray(conditioning_scale, dtype)
        down = tuple(jnp.transpose(conv(s), (0, 3, 1, 2)) * scale
                     for conv, s in zip(self.controlnet_down_blocks, skips, strict=True))
        mid = jnp.transpose(self.controlnet_mid_block(x), (0, 3, 1, 2)) * scale
        return down, mid
