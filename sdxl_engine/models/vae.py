"""SDXL's VAE in Flax NNX: diffusers' ``AutoencoderKL`` (Kingma & Welling 2014; Rombach et al. 2022).

The decoder turns latents into pixels (what the engine runs); the encoder (for training) gives
the posterior's mean and log-variance. Module names are diffusers' (``decoder.up_blocks.0.
resnets.1.conv2``, ``encoder.mid_block.attentions.0.to_q``), parameters PyTorch-layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sdxl_engine.models.layers import Conv2d, GroupNorm, activation
from sdxl_engine.models.unet import Attention, Downsample2D, ResnetBlock2D, Upsample2D

_EPS = 1e-6  # diffusers' VAE blocks use resnet_eps=1e-6 throughout


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """diffusers' AutoencoderKL config fields that the model reads."""

    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    latent_channels: int = 4
    norm_num_groups: int = 32
    act_fn: str = "silu"
    sample_size: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    @classmethod
    def from_dict(cls, c: Mapping[str, Any]) -> VAEConfig:
        """Keep the known fields of config.json. Raises ValueError for unsupported block types."""
        for key, kind in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
            if any(t != kind for t in c.get(key, ())):
                raise ValueError(f"vae config {key}={c.get(key)!r} is not supported (only {kind})")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in c.items() if k in names and v is not None}
        activation(values.get("act_fn", "silu"))
        return cls(**values)

    @property
    def scale_factor(self) -> int:
        """Pixels per latent cell along each side: 2 ** (blocks - 1); 8 for SDXL."""
        return 2 ** (len(self.block_out_channels) - 1)


class VAEMidBlock(nnx.Module):
    """UNetMidBlock2D: resnet, self-attention over all pixels (one head), resnet."""

    def __init__(self, channels: int, groups: int, act_fn: str, add_attention: bool, *, rngs: nnx.Rngs):
        self.resnets = nnx.List([ResnetBlock2D(channels, channels, None, groups, _EPS, act_fn, rngs=rngs)
                                 for _ in range(2)])
        self.attentions = nnx.List([Attention(channels, 1, channels, bias=True, norm_groups=groups, eps=_EPS,
                                              rngs=rngs)]) if add_attention else None

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.resnets[0](x)
        if self.attentions is not None:
            b, h, w, c = x.shape
            attn = self.attentions[0]
            x = x + attn(attn.group_norm(x).reshape(b, h * w, c)).reshape(b, h, w, c)
        return self.resnets[1](x)


class EncoderBlock(nnx.Module):
    """DownEncoderBlock2D: resnets, then a stride-2 conv padded bottom-right (not after the last block)."""

    def __init__(self, in_channels: int, out: int, layers: int, groups: int, act_fn: str, final: bool, *,
                 rngs: nnx.Rngs):
        self.resnets = nnx.List([ResnetBlock2D(in_channels if j == 0 else out, out, None, groups, _EPS, act_fn,
                                               rngs=rngs) for j in range(layers)])
        self.downsamplers = None if final else nnx.List([Downsample2D(out, padding=0, rngs=rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.downsamplers is None else self.downsamplers[0](x)


class DecoderBlock(nnx.Module):
    """UpDecoderBlock2D: resnets, then nearest x2 and a conv (not after the last block)."""

    def __init__(self, in_channels: int, out: int, layers: int, groups: int, act_fn: str, final: bool, *,
                 rngs: nnx.Rngs):
        self.resnets = nnx.List([ResnetBlock2D(in_channels if j == 0 else out, out, None, groups, _EPS, act_fn,
                                               rngs=rngs) for j in range(layers)])
        self.upsamplers = None if final else nnx.List([Upsample2D(out, rngs=rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.upsamplers is None else self.upsamplers[0](x)


class Encoder(nnx.Module):
    def __init__(self, config: VAEConfig, *, rngs: nnx.Rngs):
        ch, g, act = config.block_out_channels, config.norm_num_groups, config.act_fn
        self.act = activation(act)
        self.conv_in = Conv2d(config.in_channels, ch[0], 3, padding=1, rngs=rngs)
        self.down_blocks = nnx.List([
            EncoderBlock(ch[max(i - 1, 0)], ch[i], config.layers_per_block, g, act, i == len(ch) - 1, rngs=rngs)
            for i in range(len(ch))])
        self.mid_block = VAEMidBlock(ch[-1], g, act, config.mid_block_add_attention, rngs=rngs)
        self.conv_norm_out = GroupNorm(g, ch[-1], _EPS)
        self.conv_out = Conv2d(ch[-1], 2 * config.latent_channels, 3, padding=1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(self.act(self.conv_norm_out(self.mid_block(x))))


class Decoder(nnx.Module):
    def __init__(self, config: VAEConfig, *, rngs: nnx.Rngs):
        ch, g, act = config.block_out_channels[::-1], config.norm_num_groups, config.act_fn
        self.act = activation(act)
        self.conv_in = Conv2d(config.latent_channels, ch[0], 3, padding=1, rngs=rngs)
        self.mid_block = VAEMidBlock(ch[0], g, act, config.mid_block_add_attention, rngs=rngs)
        self.up_blocks = nnx.List([
            DecoderBlock(ch[max(i - 1, 0)], ch[i], config.layers_per_block + 1, g, act, i == len(ch) - 1, rngs=rngs)
            for i in range(len(ch))])
        self.conv_norm_out = GroupNorm(g, ch[-1], _EPS)
        self.conv_out = Conv2d(ch[-1], config.out_channels, 3, padding=1, rngs=rngs)

    def __call__(self, z: jax.Array) -> jax.Array:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(self.act(self.conv_norm_out(x)))


class AutoencoderKL(nnx.Module):
    """diffusers' AutoencoderKL; public calls take and return channels-first arrays."""

    def __init__(self, config: VAEConfig, *, rngs: nnx.Rngs):
        self.config = config
        z = config.latent_channels
        self.encoder = Encoder(config, rngs=rngs)
        self.quant_conv = Conv2d(2 * z, 2 * z, 1, rngs=rngs) if config.use_quant_conv else None
        self.post_quant_conv = Conv2d(z, z, 1, rngs=rngs) if config.use_post_quant_conv else None
        self.decoder = Decoder(config, rngs=rngs)

    def _dtype(self):
        return self.decoder.conv_in.weight[...].dtype

    def encode(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
        """images (b, 3, H, W) in [-1, 1] -> posterior mean and log-variance (b, latent, H/f, W/f).

        The log-variance is clipped to [-30, 20] as diffusers' DiagonalGaussianDistribution does.
        Outputs are in the parameters' dtype.
        """
        moments = self.encoder(jnp.transpose(images, (0, 2, 3, 1)).astype(self._dtype()))
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        mean, logvar = jnp.split(jnp.transpose(moments, (0, 3, 1, 2)), 2, axis=1)
        return mean, jnp.clip(logvar, -30.0, 20.0)

    def decode(self, latents: jax.Array) -> jax.Array:
        """latents (b, latent_channels, h, w), already divided by scaling_factor -> (b, 3, h*f, w*f).

        Pixels are in about [-1, 1] (not clipped), parameters' dtype, channels-first.
        """
        z = jnp.transpose(latents, (0, 2, 3, 1)).astype(self._dtype())
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return jnp.transpose(self.decoder(z), (0, 3, 1, 2))
