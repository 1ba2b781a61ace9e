"""ControlNet checkpoints -> a :class:`LoadedControlNet`: diffusers folders and single safetensors files.

Sources (``EngineConfig.controlnet``: paths joined by ``os.pathsep``, the flag ``--controlnet PATH`` repeatable;
``EngineConfig.controlnet_dir``: every ControlNet in one folder):

* a diffusers ``ControlNetModel`` folder: ``config.json`` (``_class_name`` ControlNetModel) and
  ``diffusion_pytorch_model[.fp16].safetensors`` (or shards): ``diffusers/controlnet-canny-sdxl-1.0``,
  ``xinsir/controlnet-*-sdxl-1.0``. Named by the folder's name.
* a diffusers ``ControlNetUnionModel`` folder (xinsir's ``controlnet-union-sdxl-1.0``, its ProMax): the same,
  ``_class_name`` ControlNetUnionModel (component "controlnet_union", models/controlnet_union.py), one file for
  every control type. A single union file needs its config beside it (the head count is in no tensor).
* one ``.safetensors`` file with diffusers' key names (``controlnet_cond_embedding.*``,
  ``controlnet_down_blocks.*``: lllyasviel's ``diffusers_xl_*_full.safetensors`` and a folder's weights file
  alone). Its config: ``<stem>.json`` or ``config.json`` beside it, else the model's UNet config (diffusers'
  ``ControlNetModel.from_unet``) with the conditioning embedding's channels and the transformer depths read from
  the file's tensor shapes. Named by the file's stem.

Weights go through checkpoint/weights.py (the same key rules, checks and bounded reads as every component), cast to
the model's dtype and put on the devices as they are read. ControlNet-XS, SparseCtrl and ControlNet-LoRA / LLLite
files are refused by name. A loaded ControlNet must fit the model it steers (the UNet's
skip connections, the text conditioning, the VAE's factor): :func:`check_fits`.

The hash is AUTOMATIC1111's model hash of the weights file (``sd_models.model_hash``: sha256 of 64 KiB at
offset 1 MiB, 8 hex digits), which sd-webui-controlnet shows as ``name [hash]`` in its model list.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from sdxl_engine.checkpoint.weights import (
    PICKLE_SUFFIXES,
    ModelLoadError,
    find_weight_files,
    load_params,
    read_safetensors_header,
)
from sdxl_engine.models import Component, build_component

LOG = logging.getLogger(__name__)
NAME = re.compile(r"[A-Za-z0-9_.\-+ ()\[\]]+")  # what a client may write in a unit's model field
REFUSED_CLASSES = {"ControlNetXSAdapter": "ControlNet-XS is not supported",
                   "SparseControlNetModel": "SparseCtrl is not supported"}


@dataclasses.dataclass
class LoadedControlNet:
    """One ControlNet, loaded onto the devices.

    Attributes:
        name: what requests call it (folder name, or file name without ``.safetensors``).
        path: the folder or file it came from.
        component: its Component ("controlnet": config, static module graph, parameter names and shapes).
        params: {checkpoint key: array} in ``dtype``, on the devices.
        hash: A1111's model hash of its weights file (8 hex digits, :func:`model_hash`).
        dtype: the parameters' dtype name.
    """

    name: str
    path: Path
    component: Component
    params: dict
    hash: str
    dtype: str
    load_s: float = 0.0

    @property
    def architecture(self) -> str:
        """:func:`architecture` of its config: ControlNets with equal ids share compiled programs."""
        return architecture(self.component)

    @property
    def union(self) -> int:
        """How many control types it takes (a ControlNet-Union: 6, ProMax 8); 0 for a plain ControlNet."""
        return getattr(self.component.config, "num_control_type", 0)

    @property
    def title(self) -> str:
        """``name [hash]``, as sd-webui-controlnet lists models (and writes them in infotexts)."""
        return f"{self.name} [{self.hash}]"


def architecture(component: Component) -> str:
    """A short id of a ControlNet's architecture: sha256 of its normalised config (16 hex digits). The programs
    are keyed by it (ProgramShape.controlnets), so two ControlNets of one architecture run on one executable with
    each one's params."""
    text = json.dumps(dataclasses.asdict(component.config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_hash(path: Path) -> str:
    """AUTOMATIC1111's ``sd_models.model_hash``: sha256 of the 64 KiB at offset 0x100000 (less for a smaller
    file), first 8 hex digits."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(0x100000)
        digest.update(f.read(0x10000))
    return digest.hexdigest()[:8]


def controlnet_sources(entries: str, folder: str, separator: str = os.pathsep,
                       shipped: dict[str, Path] | None = None) -> dict[str, Path]:
    """{name: path} of ``EngineConfig.controlnet`` (paths joined by ``separator``) then every ControlNet in
    ``EngineConfig.controlnet_dir`` (each sub-folder with a config.json, each ``.safetensors`` file), in order, then
    ``shipped`` (the model folder's own, checkpoint.loading.model_controlnets) whose names those do not take.

    Raises ModelLoadError: a path that does not exist, a pickle, one name twice, a folder that is not one.
    """
    sources: dict[str, Path] = {}

    def add(path: Path, origin: str) -> None:
        name = path.stem if path.suffix == ".safetensors" else path.name
        if path.suffix.lower() in PICKLE_SUFFIXES:
            raise ModelLoadError(f"{origin}: a pickle ({path.suffix}); pickles are never opened because unpickling "
                                 "can run code. Use the .safetensors version of this ControlNet")
        if not path.exists():
            raise ModelLoadError(f"{origin}: no such file or folder")
        if not NAME.fullmatch(name):
            raise ModelLoadError(f"{origin}: ControlNet name {name!r} must be letters, digits, spaces or _ - . + ( ) "
                                 "[ ] (requests name it)")
        if name in sources:
            raise ModelLoadError(f"{origin}: two ControlNets named {name!r} ({sources[name]} and {path}); rename one")
        sources[name] = path

    for entry in (e for e in entries.split(separator) if e.strip()):
        add(Path(entry.strip()).expanduser(), f"--controlnet {entry.strip()}")
    if folder:
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise ModelLoadError(f"--controlnet-dir {folder!r}: not a folder")
        for path in sorted(root.iterdir()):
            if (path.is_dir() and (path / "config.json").is_file()) or path.suffix == ".safetensors":
                add(path, f"--controlnet-dir {folder}: {path.name}")
    for name, path in (shipped or {}).items():
        sources.setdefault(name, path)
    return sources


def union_types(path: Path) -> int:
    """How many control types the ControlNet at ``path`` (a folder or a single file) takes, read from its config
    alone, before it loads (the page shows a union's Control type from it): a ControlNet-Union's ``num_control_type``
    (diffusers' default 6), 0 for a plain ControlNet or a config that is not there or not readable (its loading says
    why)."""
    path = Path(path)
    for candidate in ([path / "config.json"] if path.is_dir() else [path.with_suffix(".json"),
                                                                    path.parent / "config.json"]):
        if candidate.is_file():
            try:
                config = json.loads(candidate.read_text())
            except (OSError, ValueError):
                return 0
            if not isinstance(config, dict) or config.get("_class_name") != "ControlNetUnionModel":
                return 0
            types = config.get("num_control_type", 6)
            return types if type(types) is int and types > 0 else 0
    return 0


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: not readable JSON ({type(err).__name__}: {err})") from err
    kind = config.get("_class_name", "ControlNetModel")
    if kind in REFUSED_CLASSES:
        raise ModelLoadError(f"{path}: a {kind}: {REFUSED_CLASSES[kind]}; use a plain ControlNetModel")
    if kind not in ("ControlNetModel", "FlaxControlNetModel", "ControlNetUnionModel"):
        raise ModelLoadError(f"{path}: a {kind}, not a ControlNetModel or ControlNetUnionModel config")
    return config


def _build(config: dict, where: Path) -> Component:
    kind = "controlnet_union" if config.get("_class_name") == "ControlNetUnionModel" else "controlnet"
    try:
        return build_component(kind, config)
    except (ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{where}: {err}") from err


def config_from_file(path: Path, unet_config: dict | None) -> dict:
    """A single file's ControlNet config: ``<stem>.json`` or ``config.json`` beside it, else ``unet_config`` (the
    model's UNet config as a dict (its config.json, or ``dataclasses.asdict`` of its UNetConfig), as
    ``ControlNetModel.from_unet``) with what the file's tensor shapes say: the
    conditioning embedding's channels, conv_in's input channels and each attention's transformer depth."""
    for candidate in (path.with_suffix(".json"), path.parent / "config.json"):
        if candidate.is_file():
            return _read_config(candidate)
    if unet_config is None:
        raise ModelLoadError(f"{path}: a single file needs {path.stem}.json or config.json beside it (or the model's "
                             "UNet config)")
    header = read_safetensors_header(path)
    if "task_embedding" in header:
        raise ModelLoadError(f"{path}: a ControlNet-Union file; put its config.json ({path.stem}.json or config.json) "
                             "beside it (its attention's head count is in no tensor), or load its folder")
    if not any(k.startswith("controlnet_down_blocks.") for k in header):
        what = ("a ControlNet-LoRA / LLLite file" if any("lora" in k or "lllite" in k for k in header)
                else "not a ControlNet in diffusers' layout")
        raise ModelLoadError(f"{path}: {what} (no controlnet_down_blocks.* tensors); load a diffusers ControlNetModel "
                             "file or folder (config.json + diffusion_pytorch_model.safetensors)")
    embed = sorted((int(m[1]), header[k].shape[0]) for k in header
                   if (m := re.fullmatch(r"controlnet_cond_embedding\.blocks\.(\d+)\.weight", k)))
    channels = [header["controlnet_cond_embedding.conv_in.weight"].shape[0]] + [c for i, c in embed if i % 2 == 1]
    depth: dict[tuple[str, int], int] = {}
    for k in header:
        if m := re.match(r"(down_blocks\.(\d+)\.attentions\.(\d+)|mid_block\.attentions\.0)"
                         r"\.transformer_blocks\.(\d+)\.", k):
            key = ("mid", 0) if m[2] is None else (m[2], int(m[3]))
            depth[key] = max(depth.get(key, 0), int(m[4]) + 1)
    own = unet_config["transformer_layers_per_block"]
    per_block = []
    for i in range(len(unet_config["block_out_channels"])):
        default = own[i] if isinstance(own, (list, tuple)) else own
        layers = [depth.get((str(i), j)) for j in range(_layers(unet_config, i))]
        if all(d is None for d in layers):
            per_block.append(default)
        else:
            per_block.append(layers[0] if len(set(layers)) == 1 else [d or 0 for d in layers])
    if ("mid", 0) in depth:
        per_block[-1] = depth[("mid", 0)]  # the mid block reads the last block's depth
    config = {k: v for k, v in unet_config.items()
              if k not in ("up_block_types", "out_channels", "reverse_transformer_layers_per_block", "_class_name")}
    config.update(_class_name="ControlNetModel", in_channels=header["conv_in.weight"].shape[1],
                  conditioning_embedding_out_channels=channels, transformer_layers_per_block=per_block)
    return config


def _layers(unet_config: dict, i: int) -> int:
    layers = unet_config.get("layers_per_block", 2)
    return layers[i] if isinstance(layers, (list, tuple)) else layers


def read_controlnet(path: Path, unet_config: dict | None = None) -> tuple[Component, list[Path]]:
    """The Component and weight files of a ControlNet folder or file (no tensor read).

    ``unet_config``: the model's UNet config.json dict, for a single file without a config beside it.
    Raises ModelLoadError naming the path and what to do.
    """
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: no config.json; a diffusers ControlNetModel folder has config.json and "
                                 "diffusion_pytorch_model.safetensors")
        return _build(_read_config(path / "config.json"), path / "config.json"), find_weight_files(path)
    if path.suffix != ".safetensors":
        raise ModelLoadError(f"{path}: not a .safetensors file; ControlNets load from safetensors only")
    return _build(config_from_file(path, unet_config), path), [path]


def load_controlnet(name: str, path: Path, dtype: str, unet_config: dict | None = None, sharding=None,
                    log: Callable[[str], None] = LOG.info) -> LoadedControlNet:
    """Read, check and place one ControlNet (module docstring), each parameter put on the devices (``sharding``,
    None: the default device) in ``dtype`` as soon as it is read.

    Raises ModelLoadError: not a ControlNet, a config the modules refuse, keys or shapes that do not fit it.
    """
    start = time.perf_counter()
    component, files = read_controlnet(path, unet_config)
    place = lambda array: jax.device_put(array, sharding)  # noqa: E731
    params = load_params(component, files, jnp.dtype(dtype), place)
    loaded = LoadedControlNet(name=name, path=path, component=component, params=params,
                              hash=model_hash(files[0]), dtype=dtype, load_s=time.perf_counter() - start)
    shards = f" (+{len(files) - 1} shards)" if len(files) > 1 else ""
    log(f"[sdxl_engine] ControlNet {loaded.title}: {files[0].name}{shards}, {component.config.residuals} residuals, "
        f"read in {loaded.load_s:.2f} s")
    return loaded


def check_fits(controlnet: LoadedControlNet, unet: Component, vae_scale_factor: int, latent_channels: int) -> None:
    """Raise ModelLoadError unless ``controlnet``'s residuals fit ``unet``'s skip connections (same widths, layers
    per block, block count), its text conditioning is the UNet's (cross-attention width, added-embedding width), its
    conditioning embedding downsamples by the VAE's factor and it takes the latents' channels."""
    c, u = controlnet.component.config, unet.config
    e = c.unet
    checks = [("block_out_channels", e.block_out_channels, u.block_out_channels),
              ("layers_per_block", e.layers_per_block, u.layers_per_block),
              ("cross_attention_dim", e.cross_attention_dim[-1], u.cross_attention_dim[-1]),
              ("projection_class_embeddings_input_dim", e.projection_class_embeddings_input_dim,
               u.projection_class_embeddings_input_dim),
              ("addition_time_embed_dim", e.addition_time_embed_dim, u.addition_time_embed_dim),
              ("in_channels", e.in_channels, latent_channels),
              ("conditioning downsampling (2 ** (len(conditioning_embedding_out_channels) - 1))", c.image_factor,
               vae_scale_factor)]
    for field, own, model in checks:
        if own != model:
            raise ModelLoadError(f"ControlNet {controlnet.name} ({controlnet.path}) does not fit the model: its "
                                 f"{field} is {own}, the model's {model}. Is it an SDXL ControlNet for this model "
                                 "family?")
