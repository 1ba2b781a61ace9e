"""The project's own Flax NNX modules for the SDXL family, and how parameters meet them.

Why NNX: modules are plain Python objects whose attributes are named exactly as diffusers' and
transformers' PyTorch modules (``nnx.List`` gives ``down_blocks.1``), so the flattened state of a
module *is* the list of checkpoint keys: the mapping is the identity, not a table. The compiled
program stays pure: :class:`Component` splits a module once into a static graph definition and
a flat ``{checkpoint key: array}`` dict, and rebuilds the module from that dict inside
``jax.jit`` (:meth:`Component.bind`).

A component's parameters are that flat dict everywhere in the engine (placement, sharding,
casting, the persistent caches); the modules are only ever called through ``bind``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sdxl_engine.models.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTextOutput
from sdxl_engine.models.clip_vision import CLIPVisionConfig, CLIPVisionModelWithProjection
from sdxl_engine.models.controlnet import ControlNetConfig, ControlNetModel
from sdxl_engine.models.controlnet_union import ControlNetUnionConfig, ControlNetUnionModel
from sdxl_engine.models.ip_adapter import IPAdapterConfig, IPAdapterLayers, IPAdapterLayersConfig, IPAdapterModel
from sdxl_engine.models.unet import UNet2DConditionModel, UNetConfig
from sdxl_engine.models.vae import AutoencoderKL, VAEConfig

__all__ = ["ADDONS", "COMPONENTS", "Component", "build_component", "CLIPTextOutput", "UNetConfig", "VAEConfig",
           "CLIPTextConfig"]

# component name -> (config class, module class, class names accepted in model_index.json)
COMPONENTS: dict[str, tuple[type, type, tuple[str, ...]]] = {
    "text_encoder": (CLIPTextConfig, CLIPTextModel, ("CLIPTextModel", "FlaxCLIPTextModel")),
    "text_encoder_2": (CLIPTextConfig, CLIPTextModelWithProjection,
                       ("CLIPTextModelWithProjection", "FlaxCLIPTextModelWithProjection")),
    "unet": (UNetConfig, UNet2DConditionModel, ("UNet2DConditionModel", "FlaxUNet2DConditionModel")),
    "vae": (VAEConfig, AutoencoderKL, ("AutoencoderKL", "FlaxAutoencoderKL")),
}
# Components loaded beside a model, never listed in its model_index.json (checkpoint/controlnet.py), same shape.
ADDONS: dict[str, tuple[type, type, tuple[str, ...]]] = {
    "controlnet": (ControlNetConfig, ControlNetModel, ("ControlNetModel",)),
    "controlnet_union": (ControlNetUnionConfig, ControlNetUnionModel, ("ControlNetUnionModel",)),
    # IP-Adapter (checkpoint/ip_adapter.py): its image encoder and the adapter file's modules
    "image_encoder": (CLIPVisionConfig, CLIPVisionModelWithProjection, ("CLIPVisionModelWithProjection",)),
    "ip_adapter": (IPAdapterConfig, IPAdapterModel, ()),
    "ip_adapter_layers": (IPAdapterLayersConfig, IPAdapterLayers, ()),  # the program's part of "ip_adapter"
}


@dataclasses.dataclass(frozen=True)
class Component:
    """One model component: its config, static module graph and parameter names and shapes.

    Attributes:
        name: "text_encoder", "text_encoder_2", "unet", "vae" or an ADDONS one ("controlnet", "image_encoder",
            "ip_adapter").
        config: the normalised config (CLIPTextConfig, UNetConfig, VAEConfig, ControlNetConfig, CLIPVisionConfig or
            IPAdapterConfig).
        graphdef: NNX graph definition (static; part of every compiled program).
        shapes: {checkpoint key: shape} of every parameter, in module order.
    """

    name: str
    config: Any
    graphdef: Any
    shapes: Mapping[str, tuple[int, ...]]
    _paths: Mapping[str, tuple] = dataclasses.field(repr=False)

    def bind(self, params: Mapping[str, jax.Array]) -> nnx.Module:
        """The module with ``params`` ({checkpoint key: array}, traced or concrete) as its weights.

        Raises KeyError for a missing key (loading checks the set first, with a clear message).
        """
        return nnx.merge(self.graphdef, nnx.from_flat_state([(path, params[k]) for k, path in self._paths.items()]))

    def init(self, key: jax.Array, dtype=jnp.float32) -> dict[str, jax.Array]:
        """Fresh random parameters ({checkpoint key: array} in ``dtype``); jit it to build them on device."""
        _, module_cls, _ = {**COMPONENTS, **ADDONS}[self.name]
        _, state = nnx.split(module_cls(self.config, rngs=nnx.Rngs(key)))
        return {_key(path): value.get_value().astype(dtype) for path, value in nnx.to_flat_state(state)}

    def abstract(self, dtype) -> dict[str, jax.ShapeDtypeStruct]:
        """{checkpoint key: ShapeDtypeStruct} in ``dtype``: shapes only, no memory."""
        return {k: jax.ShapeDtypeStruct(s, dtype) for k, s in self.shapes.items()}


def _key(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def build_component(name: str, config: Mapping[str, Any]) -> Component:
    """The Component for a config.json dict, built abstractly (no parameter memory).

    Raises:
        ValueError: an unknown component name, or a config the modules do not support (the
            message names the field).
    """
    known = {**COMPONENTS, **ADDONS}
    if name not in known:
        raise ValueError(f"unknown component {name!r} ({', '.join(known)})")
    config_cls, module_cls, _ = known[name]
    cfg = config if isinstance(config, config_cls) else config_cls.from_dict(config)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: module_cls(cfg, rngs=nnx.Rngs(0))))
    flat = nnx.to_flat_state(state)
    return Component(name=name, config=cfg, graphdef=graphdef,
                     shapes={_key(p): tuple(v.get_value().shape) for p, v in flat},
                     _paths={_key(p): p for p, _ in flat})
