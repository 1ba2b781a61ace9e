"""IP-Adapter checkpoints -> a :class:`LoadedIPAdapter`: h94/IP-Adapter's files, as people download them.

Sources (``EngineConfig.ip_adapter``: paths joined by ``os.pathsep``, the flag ``--ip-adapter PATH`` repeatable):
one ``.safetensors`` file with h94's keys, ``image_proj.*`` (the image projection) and ``ip_adapter.{2j + 1}.to_k_ip
/ to_v_ip.weight`` (one pair per cross-attention layer of the UNet: models/ip_adapter.cross_attention_layers), as
``sdxl_models/ip-adapter_sdxl.safetensors``. Named by the file's stem. What diffusers' ``load_ip_adapter`` reads from
the same files; a pickle (``.bin``) is never opened.

Its image encoder (a transformers ``CLIPVisionModelWithProjection`` folder: config.json and model.safetensors) is
found beside it by h94's layout: the first of ``<file's folder>/image_encoder`` (``sdxl_models/image_encoder``:
ViT-bigG), ``<file's folder>/../image_encoder`` and ``<file's folder>/../models/image_encoder`` (ViT-H) whose output
width is what the adapter's projection takes (so ``ip-adapter_sdxl_vit-h`` finds ViT-H and ``ip-adapter_sdxl``
bigG).

Image projections (the files' keys are the modules' names: models/ip_adapter.py): the plain adapter's
(``image_proj.proj.*``, ``image_proj.norm.*``: ``ip-adapter_sdxl``, ``ip-adapter_sdxl_vit-h``), Plus's Resampler
(``image_proj.latents``, ``proj_in``, ``layers.*``, ``proj_out``, ``norm_out``: ``ip-adapter-plus_sdxl_vit-h``,
``ip-adapter-plus-face_sdxl_vit-h``) and FaceID's MLP (``image_proj.proj.0.*``, ``proj.2.*``, ``norm.*``:
h94/IP-Adapter-FaceID's ``ip-adapter-faceid_sdxl`` and ``ip-adapter-faceid-portrait_sdxl``, converted from their
``.bin`` to ``.safetensors`` keeping the keys), its shapes read from the file as diffusers'
``_convert_ip_adapter_image_proj_to_diffusers`` reads them. Refused by name: Full Face, FaceID Plus (v1 and v2: they
take a CLIP image beside the face embedding).

FaceID takes no image encoder (its input is a face embedding the client computes with insightface): none is looked
for. h94's FaceID file also carries a LoRA for every attention layer of the UNet (``ip_adapter.{i}.to_q_lora.*``,
``to_k_lora``, ``to_v_lora``, ``to_out_lora``, ``down`` and ``up``, i in diffusers' ``unet.attn_processors`` order;
diffusers' ``load_ip_adapter`` applies it at weight 1, ``_load_ip_adapter_loras``). Those keys are not adapter
params: :func:`read_faceid_lora` renames them as diffusers does and reads them with checkpoint/lora.read_lora against
each model, and the engine merges that LoRA (its LoraMerger, as a prompt's ``<lora:NAME:1>``) into the UNet for the
requests with a unit of this adapter, once even when the prompt tags the same LoRA (engine/local.py,
docs/ip-adapter.md). The load's log line says so and counts the keys.

The hash is AUTOMATIC1111's model hash of the adapter file (checkpoint/controlnet.model_hash).
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

from sdxl_engine.checkpoint import lora as lora_mod
from sdxl_engine.checkpoint.controlnet import NAME, model_hash
from sdxl_engine.checkpoint.weights import (
    PICKLE_SUFFIXES,
    ModelLoadError,
    find_weight_files,
    load_params,
    read_safetensors_header,
)
from sdxl_engine.models import Component, build_component
from sdxl_engine.models.ip_adapter import PLUS_HEAD_DIM, attention_processors, cross_attention_layers
from sdxl_engine.models.unet import UNetConfig

LOG = logging.getLogger(__name__)
# image projection keys -> the adapter kind a file is, for the ones refused by name
REFUSED = (("image_proj.proj.3.weight", "IP-Adapter Full Face is not supported"),
           ("image_proj.perceiver_resampler.proj_in.weight",
            "IP-Adapter FaceID Plus (v1/v2) is not supported: it takes a CLIP image beside the face embedding (its "
            "projection's shortcut and Resampler)"))
# FaceID's LoRA (module docstring): not adapter params; read per model as a LoRA (read_faceid_lora)
LORA_KEY = re.compile(r"ip_adapter\.(\d+)\.(to_(q|k|v|out)_lora\..*)")
ENCODER_FOLDERS = ("image_encoder", "../image_encoder", "../models/image_encoder")  # beside the file, in order


@dataclasses.dataclass
class LoadedIPAdapter:
    """One IP-Adapter and its image encoder, loaded onto the devices.

    Attributes:
        name: what requests call it (the file name without ``.safetensors``).
        path: the adapter file.
        component: its Component ("ip_adapter": image projection and per-layer ``to_k_ip``/``to_v_ip``).
            ``component.config.projection`` "faceid": its units send face embeddings, not images
            (:attr:`takes_embeds`), and it has no image encoder (``encoder`` None).
        params: {key: array} of the adapter in ``dtype``, on the devices.
        layers: the Component of its layers alone ("ip_adapter_layers"): what the generate program binds.
        layer_params: ``params``' ``ip_adapter.*`` entries (the same arrays): what the program takes.
        encoder_path: the image encoder's folder (None for FaceID).
        encoder: the image encoder's Component ("image_encoder"; None for FaceID).
        encoder_params: {key: array} of the image encoder in ``dtype``, on the devices ({} for FaceID).
        hash: A1111's model hash of the adapter file.
        dtype: the parameters' dtype name.
    """

    name: str
    path: Path
    component: Component
    params: dict
    encoder_path: Path | None
    encoder: Component | None
    encoder_params: dict
    hash: str
    dtype: str
    layers: Component
    layer_params: dict
    load_s: float = 0.0
    lora_keys: int = 0  # FaceID's LoRA keys (module docstring): not in params; read_faceid_lora reads them per model

    @property
    def architecture(self) -> str:
        """:func:`architecture` of its layers: adapters with equal ids share compiled programs."""
        return architecture(self.layers)

    @property
    def tokens(self) -> int:
        """Image tokens per reference image."""
        return self.component.config.tokens

    @property
    def image_size(self) -> int | None:
        """The image encoder's input size (pixels, square); None for FaceID (no encoder)."""
        return None if self.encoder is None else self.encoder.config.image_size

    @property
    def takes_embeds(self) -> bool:
        """FaceID: its units send face embeddings (IPAdapterUnit.embeds), not reference images."""
        return self.component.config.projection == "faceid"

    @property
    def embed_dim(self) -> int:
        """The width of a face embedding its units send (FaceID: 512 for h94's files)."""
        return self.component.config.image_embed_dim

    @property
    def title(self) -> str:
        """``name [hash]``, as sd-webui-controlnet lists models."""
        return f"{self.name} [{self.hash}]"


def architecture(layers: Component) -> str:
    """A short id of what the program runs of an adapter (its "ip_adapter_layers" Component): its layers' widths and
    the tokens' width (sha256 of the config, 16 hex digits). The image projection and encoder run before the program
    (program/ip_adapter.py), so they are not in it: every adapter for one UNet has one architecture."""
    text = json.dumps(dataclasses.asdict(layers.config), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ip_adapter_sources(entries: str, separator: str = os.pathsep) -> dict[str, Path]:
    """{name: path} of ``EngineConfig.ip_adapter`` (paths joined by ``separator``), in order.

    Raises ModelLoadError: a path that does not exist or is not a .safetensors file, a pickle, a name twice."""
    sources: dict[str, Path] = {}
    for entry in (e.strip() for e in entries.split(separator) if e.strip()):
        path, origin = Path(entry).expanduser(), f"--ip-adapter {entry}"
        if path.suffix.lower() in PICKLE_SUFFIXES:
            raise ModelLoadError(f"{origin}: a pickle ({path.suffix}); pickles are never opened because unpickling "
                                 "can run code. Use the .safetensors version of this IP-Adapter")
        if not path.is_file():
            raise ModelLoadError(f"{origin}: no such file")
        if path.suffix != ".safetensors":
            raise ModelLoadError(f"{origin}: not a .safetensors file (h94/IP-Adapter's sdxl_models/*.safetensors)")
        if not NAME.fullmatch(path.stem):
            raise ModelLoadError(f"{origin}: IP-Adapter name {path.stem!r} must be letters, digits, spaces or "
                                 "_ - . + ( ) [ ] (requests name it)")
        if path.stem in sources:
            raise ModelLoadError(f"{origin}: two IP-Adapters named {path.stem!r}; rename one")
        sources[path.stem] = path
    return sources


def adapter_config(path: Path, unet: UNetConfig) -> dict:
    """The adapter's config (models/ip_adapter.IPAdapterConfig's fields) from the file's tensor shapes and the UNet.

    Raises ModelLoadError: a projection refused by name (:data:`REFUSED`), not an IP-Adapter, or layers that do not
    fit the UNet (count, widths, the tokens' width)."""
    header = read_safetensors_header(path)
    for key, why in REFUSED:
        if key in header:
            raise ModelLoadError(f"{path}: {why}; load a plain, Plus or FaceID IP-Adapter "
                                 "(ip-adapter_sdxl.safetensors, ip-adapter-plus_sdxl_vit-h.safetensors, "
                                 "ip-adapter-faceid_sdxl.safetensors)")
    faceid = all(f"image_proj.{k}.weight" in header for k in ("proj.0", "proj.2", "norm"))
    if "image_proj.proj.weight" not in header and "image_proj.latents" not in header and not faceid:
        raise ModelLoadError(f"{path}: not an IP-Adapter in h94's layout (no image_proj.proj.weight, "
                             "image_proj.latents or image_proj.proj.0/proj.2/norm.weight); load a plain, Plus or "
                             "FaceID IP-Adapter (ip-adapter_sdxl.safetensors, ip-adapter-plus_sdxl_vit-h.safetensors, "
                             "ip-adapter-faceid_sdxl.safetensors)")
    layers = cross_attention_layers(unet)
    cross = unet.cross_attention_dim[-1]
    ids = sorted(int(m[1]) for k in header if (m := re.fullmatch(r"ip_adapter\.(\d+)\.to_k_ip\.weight", k)))
    if ids != [2 * j + 1 for j in range(len(layers))]:
        raise ModelLoadError(f"{path}: {len(ids)} ip_adapter layers, the model's UNet has {len(layers)} "
                             "cross-attention layers. Is it an SDXL IP-Adapter for this model family?")
    for j, (name, width) in enumerate(layers):
        shape = header[f"ip_adapter.{2 * j + 1}.to_k_ip.weight"].shape
        if tuple(shape) != (width, cross):
            raise ModelLoadError(f"{path}: ip_adapter.{2 * j + 1}.to_k_ip.weight ({name}) has shape {tuple(shape)}, "
                                 f"the model's UNet needs {(width, cross)}. Is it an SDXL IP-Adapter for this model?")
    widths = [w for _, w in layers]
    if "image_proj.latents" in header:  # Plus: the Resampler's shapes
        _, tokens, dim = header["image_proj.latents"].shape  # (1, queries, dim)
        out = header["image_proj.proj_out.weight"].shape[0]
        if out != cross:
            raise ModelLoadError(f"{path}: image_proj.proj_out.weight gives {out}-wide tokens, the UNet's "
                                 f"cross-attention width is {cross}")
        depth = len([k for k in header if re.fullmatch(r"image_proj\.layers\.\d+\.0\.to_q\.weight", k)])
        heads = header["image_proj.layers.0.0.to_q.weight"].shape[0] // PLUS_HEAD_DIM
        return dict(projection="plus", image_embed_dim=header["image_proj.proj_in.weight"].shape[1],
                    cross_attention_dim=cross, tokens=tokens, widths=widths, plus_dim=dim, plus_heads=heads,
                    plus_depth=depth)
    if faceid:  # MLPProjModel: proj.0 (hidden, id dim), proj.2 (tokens x cross, hidden), norm (cross,)
        hidden, id_dim = header["image_proj.proj.0.weight"].shape
        out = header["image_proj.proj.2.weight"].shape[0]
        norm = header["image_proj.norm.weight"].shape[0]
        if norm != cross or out % cross:
            raise ModelLoadError(f"{path}: FaceID's image_proj.norm.weight ({norm}) and image_proj.proj.2.weight's "
                                 f"{out} outputs are not tokens of the UNet's cross-attention width {cross}")
        return dict(projection="faceid", image_embed_dim=id_dim, cross_attention_dim=cross, tokens=out // cross,
                    widths=widths, faceid_hidden=hidden)
    proj = header["image_proj.proj.weight"].shape  # (tokens x cross, image_embed_dim)
    if proj[0] % cross:
        raise ModelLoadError(f"{path}: image_proj.proj.weight's {proj[0]} outputs are not tokens of the UNet's "
                             f"cross-attention width {cross}")
    return dict(projection="plain", image_embed_dim=proj[1], cross_attention_dim=cross, tokens=proj[0] // cross,
                widths=widths)


def _encoder_config(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None


def find_image_encoder(path: Path, image_embed_dim: int, field: str = "projection_dim") -> Path:
    """The adapter's image encoder folder (:data:`ENCODER_FOLDERS`, the first whose ``field`` is ``image_embed_dim``:
    ``projection_dim`` for a plain adapter, ``hidden_size`` for Plus). Raises ModelLoadError naming the folders tried
    and what each had."""
    tried = []
    for rel in ENCODER_FOLDERS:
        folder = (path.parent / rel).resolve()
        config = _encoder_config(folder)
        if config is None:
            tried.append(f"{folder} (no config.json)")
            continue
        config = config.get("vision_config", config)
        if config.get(field) == image_embed_dim:
            return folder
        tried.append(f"{folder} ({field} {config.get(field)})")
    raise ModelLoadError(f"{path}: no image encoder with {field} {image_embed_dim} beside it (h94/IP-Adapter's "
                         f"layout); tried {'; '.join(tried)}")


def _build(name: str, config: dict, where: Path) -> Component:
    try:
        return build_component(name, config)
    except (ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{where}: {err}") from err


def check_fits(adapter: LoadedIPAdapter, unet: UNetConfig) -> None:
    """Raise ModelLoadError unless ``adapter``'s layers are ``unet``'s cross-attentions (count and widths, in order)
    and its tokens have the UNet's cross-attention width."""
    config = adapter.component.config
    widths = tuple(w for _, w in cross_attention_layers(unet))
    if config.widths != widths or config.cross_attention_dim != unet.cross_attention_dim[-1]:
        raise ModelLoadError(f"IP-Adapter {adapter.name} ({adapter.path}) does not fit the model: its "
                             f"{len(config.widths)} layers of widths {list(config.widths)} over "
                             f"{config.cross_attention_dim}-wide tokens, the UNet's {len(widths)} cross-attentions "
                             f"{list(widths)} over {unet.cross_attention_dim[-1]}. Is it an SDXL IP-Adapter for this "
                             "model family?")


def load_ip_adapter(name: str, path: Path, dtype: str, unet: UNetConfig, sharding=None,
                    log: Callable[[str], None] = LOG.info) -> LoadedIPAdapter:
    """Read, check and place one IP-Adapter and its image encoder (module docstring), each parameter put on the
    devices (``sharding``, None: the default device) in ``dtype`` as soon as it is read.

    Raises ModelLoadError: not a supported IP-Adapter, one that does not fit ``unet``, no image encoder for it
    (FaceID needs none), keys or shapes that do not fit the configs."""
    start = time.perf_counter()
    component = _build("ip_adapter", adapter_config(path, unet), path)
    place = lambda array: jax.device_put(array, sharding)  # noqa: E731
    config = component.config
    faceid = config.projection == "faceid"
    lora_keys = sum(1 for k in read_safetensors_header(path) if LORA_KEY.fullmatch(k)) if faceid else 0
    params = load_params(component, [path], jnp.dtype(dtype), place,
                         skip=(lambda key: LORA_KEY.fullmatch(key) is not None) if faceid else None)
    folder = encoder = None
    encoder_params: dict = {}
    if not faceid:
        folder = find_image_encoder(path, config.image_embed_dim,
                                    "hidden_size" if config.projection == "plus" else "projection_dim")
        encoder = _build("image_encoder", _encoder_config(folder), folder / "config.json")
        encoder_params = load_params(encoder, find_weight_files(folder), jnp.dtype(dtype), place)
    layers = _build("ip_adapter_layers", dict(cross_attention_dim=config.cross_attention_dim, widths=config.widths),
                    path)
    loaded = LoadedIPAdapter(name=name, path=path, component=component, params=params, encoder_path=folder,
                             encoder=encoder, encoder_params=encoder_params, hash=model_hash(path), dtype=dtype,
                             layers=layers, layer_params={k: params[k] for k in layers.shapes},
                             load_s=time.perf_counter() - start, lora_keys=lora_keys)
    if faceid:
        lora = (f"; its LoRA ({lora_keys} keys, {lora_keys // 8} attention layers) is merged into the UNet at weight 1 "
                "for requests with a unit of it, as diffusers' load_ip_adapter applies it") if lora_keys else ""
        log(f"[sdxl_engine] IP-Adapter {loaded.title}: {path.name}, FaceID, {config.tokens} tokens per "
            f"{config.image_embed_dim}-d face embedding (sent by the client; no image encoder), "
            f"{len(config.widths)} layers, read in {loaded.load_s:.2f} s{lora}")
        return loaded
    log(f"[sdxl_engine] IP-Adapter {loaded.title}: {path.name}, {config.projection}, {config.tokens} tokens per image, "
        f"{len(component.config.widths)} layers, image encoder {folder} ({encoder.config.image_size} px), "
        f"read in {loaded.load_s:.2f} s")
    return loaded


def faceid_lora_name(adapter: str) -> str:
    """The name a FaceID adapter's LoRA has among a model's LoRAs (engine/local.py merges it by name): ``faceid:``
    and the adapter's name. A prompt's tag cannot name it (``:`` is not in a LoRA name: config.LORA_NAME), so it
    never clashes with a ``--lora`` entry."""
    return f"faceid:{adapter}"


def faceid_lora_keys(keys, unet: UNetConfig, where: Path) -> dict[str, str]:
    """{diffusers' key: the file's key} of a FaceID file's LoRA, named as diffusers' ``_load_ip_adapter_loras`` names
    it: ``ip_adapter.{i}.to_q_lora.down.weight`` -> ``unet.<name>.to_q_lora.down.weight`` where ``<name>`` is the i-th
    key of ``unet.attn_processors`` (``down_blocks.1.attentions.0.transformer_blocks.0.attn1.processor``:
    models/ip_adapter.attention_processors; attn1 and attn2 alike), likewise ``to_k_lora``, ``to_v_lora``,
    ``to_out_lora`` and ``up``. checkpoint/lora.read_lora reads those names (its diffusers format: ``processor``
    dropped, ``to_out_lora`` -> ``to_out.0``) as diffusers' ``load_lora_weights`` does.

    Args:
        keys: the file's tensor keys (its safetensors header); those that are not :data:`LORA_KEY` are left out.
        unet: the UNet the LoRA is read against.
        where: the file, for the message.
    Raises:
        LoraError: a key id past the UNet's attention count (diffusers would drop it silently).
    """
    names = attention_processors(unet)
    out = {}
    for key in keys:
        if not (m := LORA_KEY.fullmatch(key)):
            continue
        if int(m[1]) >= len(names):
            raise lora_mod.LoraError(f"{where}: FaceID LoRA key {key}: the model's UNet has {len(names)} attention "
                                     f"layers (ids 0..{len(names) - 1}). Is it an SDXL FaceID file for this model?")
        out[f"unet.{names[int(m[1])]}.processor.{m[2]}"] = key
    return out


def read_faceid_lora(adapter: LoadedIPAdapter, components: dict[str, Component]) -> lora_mod.Lora | None:
    """The LoRA a FaceID file carries (module docstring), read and checked against a model's ``components`` by
    checkpoint/lora.read_lora (float32 host arrays: ``down`` (rank, in), ``up`` (out, rank), scale 1 as diffusers'
    ``load_lora_weights`` gives a LoRA without alphas), named :func:`faceid_lora_name`; None for an adapter without
    LoRA keys (every plain or Plus adapter).

    Raises:
        LoraError: keys that do not fit the model's UNet (:func:`faceid_lora_keys`; shapes, unpaired keys, values:
            read_lora).
    """
    if not adapter.lora_keys:
        return None
    keys = faceid_lora_keys(read_safetensors_header(adapter.path), components["unet"].config, adapter.path)
    return lora_mod.read_lora(faceid_lora_name(adapter.name), adapter.path, components, keys=keys)
