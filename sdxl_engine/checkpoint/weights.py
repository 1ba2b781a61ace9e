"""Checkpoint files -> a component's parameters: safetensors (PyTorch layout) or legacy Flax msgpack.

Formats, per component folder (``unet/``, ``vae/``, ``text_encoder/``, ``text_encoder_2/``):

* ``diffusion_pytorch_model.safetensors`` (diffusers) or ``model.safetensors`` (transformers),
  a ``variant`` such as ``diffusion_pytorch_model.fp16.safetensors``, or shards listed in
  ``<name>.safetensors.index[.<variant>].json``. Read with ``safetensors`` (memory-mapped),
  never torch. The own modules use PyTorch's names and layouts, so a key maps to the parameter
  of the same name; convolution kernels (the 4-D tensors) are transposed from PyTorch's
  (out, in, kh, kw) to the modules' (kh, kw, in, out); transformers >= 5 saves
  ``CLIPTextModel`` without the ``text_model.`` level that older files have (the prefix is
  dropped where the module has none), and non-parameter buffers (``position_ids``) are skipped.
* ``diffusion_flax_model.msgpack`` / ``flax_model.msgpack``: what diffusers' and transformers'
  deleted Flax classes saved (SDXL base's Flax weights, the shipped tiny-shapes). By rule: list
  indices written ``down_blocks_1`` match ``down_blocks.1``, ``kernel`` is ``weight`` (a Dense
  kernel (in, out) transposed to (out, in); a Conv kernel is already (kh, kw, in, out)),
  ``scale`` and ``embedding`` are ``weight``, and the VAE attention's ``query``/``key``/``value``
  /``proj_attn`` are ``to_q``/``to_k``/``to_v``/``to_out.0``.
* Pickles (``*.bin``, ``*.ckpt``, ``*.pt``, ``*.pth``) are never opened.

Every check runs on the file headers before any tensor is read: missing and unexpected keys,
shapes against the config, dtypes. Tensors are then read in file order, cast to the target dtype
and handed to ``place`` one at a time, and the file is reopened every :data:`REMAP_BYTES` so the
mapped pages do not pile up in the process's memory: the peak stays near the parameters' size in
the target dtype.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
from flax.serialization import msgpack_restore
from safetensors import safe_open
from safetensors.numpy import save_file

from sdxl_engine.models import Component

PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth", ".pkl")
SAFE_FORMATS = ("*.safetensors (PyTorch layout; sharded with an index json, or a variant such as fp16) "
                "or Flax *.msgpack")
SAFETENSORS_STEMS = ("diffusion_pytorch_model", "model")
MSGPACK_NAMES = ("diffusion_flax_model.msgpack", "flax_model.msgpack")
BUFFERS = ("position_ids",)  # non-parameter buffers some checkpoints carry
FLOAT_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bfloat16"}
# Reopen a safetensors file after this many bytes read, dropping its mapped pages: the pages read since the last
# reopening stay resident, so a larger interval raises the loading peak well above the params' size (docs/benchmarks.md,
# "Figures behind choices in the code"; tests/checkpoint/test_weights.py bounds the peak).
REMAP_BYTES = 16 << 20
_FLAX_RENAMES = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message names the path and what to do."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor as a checkpoint stores it: file, its key there, dtype code, shape, byte offset."""

    file: Path
    file_key: str
    dtype: str  # safetensors code (F32, F16, BF16...) or a numpy dtype name for msgpack
    shape: tuple[int, ...]
    offset: int = 0


def find_weight_files(folder: Path, variant: str = "") -> list[Path]:
    """The weight files of one component folder, preferring ``variant``, then safetensors.

    Order: ``<stem>[.variant].safetensors`` or its sharded index
    (``<stem>.safetensors.index[.variant].json``), the same without the variant, any other
    variant (e.g. only the fp16 files were downloaded), then Flax msgpack.

    Raises:
        ModelLoadError: no weights, or only pickles (refused: they can run code when opened).
    """
    suffixes = ([f".{variant}"] if variant else []) + [""]
    suffixes += sorted({"." + p.name.split(".")[-2] for stem in SAFETENSORS_STEMS
                        for p in folder.glob(f"{stem}.safetensors.index.*.json")} |
                       {"." + p.name.split(".")[1] for stem in SAFETENSORS_STEMS
                        for p in folder.glob(f"{stem}.*.safetensors") if p.name.count(".") == 2})
    for suffix in suffixes:
        for stem in SAFETENSORS_STEMS:
            if (single := folder / f"{stem}{suffix}.safetensors").is_file():
                return [single]
            if (index := folder / f"{stem}.safetensors.index{suffix}.json").is_file():
                return _shards(index)
    for name in MSGPACK_NAMES:
        if (folder / name).is_file():
            return [folder / name]
    pickles = sorted(p.name for p in folder.glob("*") if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(f"{folder}: only pickle weights ({', '.join(pickles)}); they are never opened because "
                             f"unpickling can run code. Use the safe formats: {SAFE_FORMATS}")
    raise ModelLoadError(f"{folder}: no weights found; expected {SAFE_FORMATS}")


def _shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from err
    files = [index.parent / name for name in dict.fromkeys(weight_map.values())]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing[:5])}")
    return files


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """{key: TensorInfo} from a safetensors header (8-byte length, then JSON); no tensor is read.

    Raises ModelLoadError for a file that is not safetensors or is shorter than its header says
    (a truncated download).
    """
    def truncated(size: int, needed: int) -> ModelLoadError:
        return ModelLoadError(f"{path}: truncated ({size} bytes, the header needs {needed}); download it again")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:  # cut inside the length field
                raise truncated(size, 8)
            (length,) = struct.unpack("<Q", prefix)
            if length > 100 << 20:
                raise ValueError(f"header length {length}")
            if size < 8 + length:  # cut inside the JSON header
                raise truncated(size, 8 + length)
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as err:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err})") from err
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if size < 8 + length + end:
        raise truncated(size, 8 + length + end)
    return {key: TensorInfo(path, key, info["dtype"], tuple(info["shape"]), info["data_offsets"][0])
            for key, info in header.items()}


def _flax_key(path: tuple[str, ...]) -> tuple[str, str]:
    """A legacy Flax param path -> (PyTorch-style key, normalised so ``x.1`` reads ``x_1``), and its leaf kind."""
    *modules, leaf = path
    modules = [_FLAX_RENAMES.get(m, m) for m in modules]
    return ".".join(modules + ["weight" if leaf in ("kernel", "scale", "embedding") else leaf]), leaf


def _normalise(key: str) -> str:
    """``down_blocks.1.resnets.0`` and ``down_blocks_1.resnets_0`` both read ``down_blocks_1.resnets_0``."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"_\1", key)


def _msgpack_tensors(path: Path) -> dict[tuple, np.ndarray]:
    try:
        tree = msgpack_restore(path.read_bytes())
    except Exception as err:  # msgpack raises its own error types for truncated or foreign data
        raise ModelLoadError(f"{path}: not a readable Flax msgpack file ({type(err).__name__}: {err})") from err
    out = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, prefix + (k,))
            else:
                out[prefix + (k,)] = np.asarray(v)
    walk(tree, ())
    return out


def _transpose_flax(array: np.ndarray, leaf: str) -> np.ndarray:
    """A legacy Flax tensor in the modules' layout: only a Dense kernel (in, out) becomes (out, in)."""
    return array.T if leaf == "kernel" and array.ndim == 2 else array


def to_module_layout(array: np.ndarray) -> np.ndarray:
    """A PyTorch-layout tensor in the modules' layout: conv kernels (out, in, kh, kw) -> (kh, kw, in, out)."""
    return array.transpose(2, 3, 1, 0) if array.ndim == 4 else array


def to_torch_layout(array: np.ndarray) -> np.ndarray:
    """The inverse of :func:`to_module_layout`: conv kernels (kh, kw, in, out) -> (out, in, kh, kw)."""
    return array.transpose(3, 2, 0, 1) if array.ndim == 4 else array


def module_shape(torch_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The modules' shape of a tensor stored with ``torch_shape``."""
    return tuple(torch_shape[i] for i in (2, 3, 1, 0)) if len(torch_shape) == 4 else tuple(torch_shape)


def _map_keys(component: Component, keys: list[str]) -> tuple[dict[str, str], list[str]]:
    """{checkpoint key: module key} by the prefix and buffer rules; and the keys nothing maps to."""
    own = component.shapes
    strip = not any(k.startswith("text_model.") for k in own)
    mapping, unexpected = {}, []
    for key in keys:
        if key.rsplit(".", 1)[-1] in BUFFERS:
            continue
        target = key[len("text_model."):] if strip and key.startswith("text_model.") else key
        if target in own:
            mapping[key] = target
        else:
            unexpected.append(key)
    return mapping, unexpected


def _check(component: Component, where: str, found: Mapping[str, tuple], dtypes: Mapping[str, str],
           unexpected: list[str]) -> None:
    """Raise ModelLoadError for missing/unexpected keys, a shape that differs, or a non-float dtype."""
    missing = [k for k in component.shapes if k not in found]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (first: {', '.join(missing[:5])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (first: {', '.join(unexpected[:5])})")
        raise ModelLoadError(f"{where}: the weights do not fit the {component.name} config: {'; '.join(parts)}. "
                             "Is config.json the one these weights were saved with?")
    for key, shape in component.shapes.items():
        if tuple(found[key]) != tuple(shape):
            raise ModelLoadError(f"{where}: {key} has shape {_stored(found[key])} in the file, the config expects "
                                 f"{_stored(shape)}. Is config.json the one these weights were saved with?")
    for key, dtype in dtypes.items():
        if dtype not in FLOAT_DTYPES and dtype not in ("float64", "float32", "float16", "bfloat16"):
            raise ModelLoadError(f"{where}: {key} is stored as {dtype}; supported weight dtypes are "
                                 "F32, F16, BF16 and F64 (quantised checkpoints are not supported)")


def _stored(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A module shape as PyTorch stores it (what a user sees in the file)."""
    return tuple(shape[i] for i in (3, 2, 0, 1)) if len(shape) == 4 else tuple(shape)


def load_params(component: Component, files: list[Path], dtype,
                place: Callable[[np.ndarray], object] = np.asarray,
                skip: Callable[[str], bool] | None = None) -> dict:
    """Read, check and cast a component's weights; ``place`` each tensor as soon as it is read.

    Args:
        component: the built module (names and shapes to fill).
        files: from :func:`find_weight_files` (safetensors files or shards, or one msgpack).
        dtype: target dtype (numpy or ml_dtypes, e.g. ``jnp.bfloat16``).
        place: called with each (shape as in the module, ``dtype``) numpy array; returns what
            the dict keeps (``jax.device_put`` with a sharding puts it on the devices at once).
        skip: keys of the files left unread (neither loaded nor "unexpected"); None: none.
    Returns:
        {module key: placed array} for every parameter of ``component``.
    Raises:
        ModelLoadError: see :func:`find_weight_files` and the checks in the module docstring.
    """
    where = str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} shards)"
    if files[0].suffix == ".msgpack":
        return _load_msgpack(component, files[0], dtype, place)
    infos: dict[str, TensorInfo] = {}
    for file in files:
        infos.update(read_safetensors_header(file))
    if skip is not None:
        infos = {k: v for k, v in infos.items() if not skip(k)}
    mapping, unexpected = _map_keys(component, list(infos))
    by_target = {target: infos[key] for key, target in mapping.items()}
    _check(component, where, {k: module_shape(v.shape) for k, v in by_target.items()},
           {k: v.dtype for k, v in by_target.items()}, unexpected)
    out = {}
    for target, array in _read_safetensors(by_target):
        out[target] = place(np.ascontiguousarray(to_module_layout(array)).astype(dtype, copy=False))
    return {k: out[k] for k in component.shapes}


def _read_safetensors(infos: Mapping[str, TensorInfo]) -> Iterator[tuple[str, np.ndarray]]:
    """(module key, numpy array) in file and offset order, reopening each file every REMAP_BYTES."""
    order = sorted(infos.items(), key=lambda item: (str(item[1].file), item[1].offset))
    handle, current, read = None, None, 0
    try:
        for target, info in order:
            if info.file != current or read > REMAP_BYTES:
                if handle is not None:
                    handle.__exit__(None, None, None)
                handle = safe_open(str(info.file), framework="numpy").__enter__()
                current, read = info.file, 0
            array = handle.get_tensor(info.file_key)
            read += array.nbytes
            yield target, array
    finally:
        if handle is not None:
            handle.__exit__(None, None, None)


def _load_msgpack(component: Component, path: Path, dtype, place) -> dict:
    tensors = _msgpack_tensors(path)
    own = {_normalise(k): k for k in component.shapes}
    strip = not any(k.startswith("text_model.") for k in component.shapes)
    mapping, unexpected = {}, []
    for flax_path in tensors:
        key, leaf = _flax_key(flax_path)
        key = key[len("text_model."):] if strip and key.startswith("text_model.") else key
        target = own.get(_normalise(key))
        if target is None:
            unexpected.append("/".join(flax_path))
        else:
            mapping[flax_path] = (target, leaf)
    found = {target: _transpose_flax(tensors[p], leaf).shape for p, (target, leaf) in mapping.items()}
    _check(component, str(path), found, {target: tensors[p].dtype.name for p, (target, _) in mapping.items()},
           unexpected)
    out = {}
    for flax_path, (target, leaf) in mapping.items():
        out[target] = place(np.ascontiguousarray(_transpose_flax(tensors.pop(flax_path), leaf)).astype(dtype))
    return {k: out[k] for k in component.shapes}


def save_params(params: Mapping[str, np.ndarray], path: Path) -> Path:
    """Write {checkpoint key: array in the modules' layout} as one safetensors file in PyTorch's
    layout (conv kernels back to (out, in, kh, kw)), atomically.

    Arrays are written in their own dtype (bfloat16 included). Returns ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    save_file({k: np.ascontiguousarray(to_torch_layout(np.asarray(v))) for k, v in params.items()}, str(tmp),
              metadata={"format": "pt"})
    tmp.replace(path)
    return path
