"""CLIP text encoders (Radford et al. 2021) as SDXL uses them, in Flax NNX.

``CLIPTextModel`` is SDXL's first text encoder (CLIP ViT-L/14's text tower) and
``CLIPTextModelWithProjection`` its second (OpenCLIP ViT-bigG/14's, with the projection whose
pooled output feeds the UNet's ``text_embeds``). Module and parameter names are transformers'
(``embeddings.token_embedding.weight``, ``encoder.layers.3.self_attn.q_proj.weight``,
``text_model.final_layer_norm.bias``, ``text_projection.weight``), so checkpoint keys map one to
one (see :mod:`sdxl_engine.checkpoint.weights` for the ``text_model.`` prefix rule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sdxl_engine.models.layers import Embedding, LayerNorm, Linear, activation, attention


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """The fields of transformers' ``CLIPTextConfig`` (config.json) that the model reads."""

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 2  # 2 = legacy configs: pool at argmax(input_ids) (transformers PR #24773)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> CLIPTextConfig:
        """Keep the known fields of a config.json dict (others, e.g. dropout, do not matter here).

        Raises ValueError for a hidden size that does not split over the heads.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        out = cls(**{k: v for k, v in config.items() if k in names and v is not None})
        if out.hidden_size % out.num_attention_heads:
            raise ValueError(f"hidden_size {out.hidden_size} does not split over {out.num_attention_heads} heads")
        activation(out.hidden_act)
        return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CLIPTextOutput:
    """What SDXL needs from a text encoder.

    Attributes:
        penultimate: (batch, 77, hidden) output of the second-to-last layer (before the final
            layer norm): SDXL's ``hidden_states[-2]``.
        last_hidden_state: (batch, 77, hidden) after the final layer norm; None when skipped.
        pooled: (batch, hidden) last_hidden_state at the end-of-text token; None when skipped.
        text_embeds: (batch, projection_dim) the projected pooled output (with projection only).
    """

    penultimate: jax.Array
    last_hidden_state: jax.Array | None = None
    pooled: jax.Array | None = None
    text_embeds: jax.Array | None = None


class CLIPAttention(nnx.Module):
    """Self-attention over the tokens; causal for the text encoders, not for the vision encoder (clip_vision.py)."""

    def __init__(self, config: CLIPTextConfig, causal: bool = True, *, rngs: nnx.Rngs):
        d = config.hidden_size
        self.heads = config.num_attention_heads
        self.causal = causal
        self.k_proj = Linear(d, d, rngs=rngs)
        self.v_proj = Linear(d, d, rngs=rngs)
        self.q_proj = Linear(d, d, rngs=rngs)
        self.out_proj = Linear(d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        out = attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.heads, is_causal=self.causal)
        return self.out_proj(out)


class CLIPMLP(nnx.Module):
    def __init__(self, config: CLIPTextConfig, *, rngs: nnx.Rngs):
        self.act = activation(config.hidden_act)
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, rngs=rngs)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
    """Pre-norm transformer layer: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: CLIPTextConfig, causal: bool = True, *, rngs: nnx.Rngs):
        self.self_attn = CLIPAttention(config, causal, rngs=rngs)
        self.layer_norm1 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.mlp = CLIPMLP(config, rngs=rngs)
        self.layer_norm2 = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nnx.Module):
    def __init__(self, config: CLIPTextConfig, causal: bool = True, *, rngs: nnx.Rngs):
        self.layers = nnx.List([CLIPEncoderLayer(config, causal, rngs=rngs) for _ in range(config.num_hidden_layers)])


class CLIPTextEmbeddings(nnx.Module):
    def __init__(self, config: CLIPTextConfig, *, rngs: nnx.Rngs):
        self.token_embedding = Embedding(config.vocab_size, config.hidden_size, std=0.02, rngs=rngs)
        self.position_embedding = Embedding(config.max_position_embeddings, config.hidden_size, std=0.01, rngs=rngs)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        positions = jnp.arange(input_ids.shape[-1])
        return self.token_embedding(input_ids) + self.position_embedding(positions)[None]


class CLIPTextModel(nnx.Module):
    """transformers' ``CLIPTextModel`` (≥ 5: no ``text_model.`` level): SDXL's first text encoder."""

    def __init__(self, config: CLIPTextConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embeddings = CLIPTextEmbeddings(config, rngs=rngs)
        self.encoder = CLIPEncoder(config, rngs=rngs)
        self.final_layer_norm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def __call__(self, input_ids: jax.Array, penultimate_only: bool = False) -> CLIPTextOutput:
        """Encode token ids with a causal mask (no padding mask, as SDXL's pipeline calls it).

        Args:
            input_ids: (batch, seq) int32.
            penultimate_only: stop after the second-to-last layer (SDXL's first encoder needs
                nothing else); last_hidden_state and pooled are then None.
        Returns:
            CLIPTextOutput in the parameters' dtype.
        """
        x = self.embeddings(input_ids)
        layers = self.encoder.layers
        for layer in list(layers)[:-1]:
            x = layer(x)
        penultimate = x  # hidden_states[-2]: the embeddings themselves for a one-layer encoder
        if penultimate_only:
            return CLIPTextOutput(penultimate=penultimate)
        last = self.final_layer_norm(layers[len(layers) - 1](x))
        if self.config.eos_token_id == 2:  # legacy configs: the end token has the largest id
            eos = jnp.argmax(input_ids, axis=-1)
        else:  # the first end-of-text token (padding may repeat it)
            eos = jnp.argmax(input_ids == self.config.eos_token_id, axis=-1)
        pooled = jnp.take_along_axis(last, eos[:, None, None], axis=1)[:, 0]  # (batch, hidden)
        return CLIPTextOutput(penultimate=penultimate, last_hidden_state=last, pooled=pooled)


class CLIPTextModelWithProjection(nnx.Module):
    """transformers' ``CLIPTextModelWithProjection``: SDXL's second text encoder."""

    def __init__(self, config: CLIPTextConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.text_model = CLIPTextModel(config, rngs=rngs)
        self.text_projection = Linear(config.hidden_size, config.projection_dim, bias=False, rngs=rngs)

    def __call__(self, input_ids: jax.Array) -> CLIPTextOutput:
        """Like CLIPTextModel, plus ``text_embeds`` (batch, projection_dim) = projection(pooled)."""
        out = self.text_model(input_ids)
        return dataclasses.replace(out, text_embeds=self.text_projection(out.pooled))
