"""LoRA files -> low-rank deltas on a loaded model's parameters, merged outside the compiled program.

Formats (one ``.safetensors`` file; pickles are refused unopened, as for checkpoints):

* kohya (sd-scripts, A1111, ComfyUI): ``lora_unet_<module>``, ``lora_te1_<module>`` (``lora_te_``
  too) and ``lora_te2_<module>``, each with ``.lora_down.weight``, ``.lora_up.weight`` and an
  optional ``.alpha``. ``<module>`` is the module's dotted name with ``_`` for ``.``; for the UNet
  either diffusers' names (``down_blocks_1_attentions_0_...``) or the sgm/LDM names kohya trains
  SDXL with (``input_blocks_4_1_...``, ``middle_block_1_...``, ``output_blocks_2_2_conv``; resnets'
  ``in_layers_2``/``emb_layers_1``/``out_layers_3``/``skip_connection``, ``input_blocks_0_0`` is
  ``conv_in``, ``out_2`` ``conv_out``), as diffusers' ``_maybe_map_sgm_blocks_to_diffusers`` and
  ``_convert_unet_lora_key`` read them. Conv layers ("LoCon"): a 4-D down (rank, in, kh, kw) and
  up (out, rank, 1, 1).
* diffusers / PEFT: ``unet.<module>.lora_A.weight`` / ``.lora_B.weight``, ``text_encoder.*``,
  ``text_encoder_2.*``, and the older ``.lora.down.weight`` / ``.lora.up.weight``,
  ``.lora_linear_layer.down/up`` and attention-processor names (``attn1.processor.to_q_lora.down``),
  as diffusers' ``convert_unet_state_dict_to_peft`` / ``convert_state_dict_to_peft`` rename them.
* an IP-Adapter FaceID file's own LoRA (``ip_adapter.{i}.to_q_lora.down.weight`` ...): the caller names its keys
  in the diffusers format above (:func:`read_lora`'s ``keys``; checkpoint/ip_adapter.read_faceid_lora, as diffusers'
  ``_load_ip_adapter_loras``), and it is read and merged as any other LoRA.

Scale: kohya ``alpha / rank`` where ``.alpha`` is stored, else 1 (diffusers' ``network_alphas``);
PEFT files saved by diffusers >= 0.34 carry their ``LoraConfig`` in the ``lora_adapter_metadata``
header entry (``<component>.lora_alpha``, ``alpha_pattern``, ``use_rslora``), read as PEFT does
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA); without it, 1. A request's weight multiplies the
UNet's and both text encoders' deltas alike, as diffusers' ``set_adapters(names, adapter_weights)``.

The merge (:class:`LoraMerger`): ``W' = W + sum_i weight_i * scale_i * (up_i @ down_i)`` (float32,
then the params' dtype), by a function jitted per weight shape (weights are array arguments, so a new
weight reuses it) on the kept base parameters; the compiled generation program receives the merged
dict, whose arrays have the base's shapes, dtypes and shardings, so it never recompiles.
Unsupported on purpose, each refused by name: DoRA (``dora_scale``), LyCORIS LoHa (``hada_*``) and
LoKr (``lokr_*``), bias and norm deltas (``diff``, ``diff_b``). Damaged files are refused at read, naming
the tensor: NaN or infinite values, or a layer's delta past :data:`MAX_DELTA` (bounded without the product).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from sdxl_engine.checkpoint.weights import PICKLE_SUFFIXES, ModelLoadError, read_safetensors_header
from sdxl_engine.config import LORA_NAME, ConfigError, lora_entries
from sdxl_engine.models import Component

TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_te1_": "text_encoder", "lora_te_": "text_encoder",
                  "lora_te2_": "text_encoder_2"}
DIFFUSERS_PREFIXES = {"unet.": "unet", "text_encoder.": "text_encoder", "text_encoder_2.": "text_encoder_2"}
# (suffix of the down tensor, of the up tensor): kohya, PEFT, older diffusers (lora.down / lora_linear_layer)
PAIRS = ((".lora_down.weight", ".lora_up.weight"), (".lora_A.weight", ".lora_B.weight"),
         (".lora.down.weight", ".lora.up.weight"), (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight"))
# Attention-processor LoRA names of diffusers < 0.22 -> the module they adapt (UNet, then CLIP).
_PROCESSOR_NAMES = {"unet": {"to_q_lora": "to_q", "to_k_lora": "to_k", "to_v_lora": "to_v", "to_out_lora": "to_out.0"},
                    "text": {"to_q_lora": "q_proj", "to_k_lora": "k_proj", "to_v_lora": "v_proj",
                             "to_out_lora": "out_proj"}}
# Keys of formats or variants this reader does not implement, refused by name (pattern, what it is).
_UNSUPPORTED = ((re.compile(r"\.dora_scale$|lora_magnitude_vector"), "DoRA (dora_scale)"),
                (re.compile(r"\.hada_w[12]_[ab]$"), "LyCORIS LoHa (hada_*)"),
                (re.compile(r"\.lokr_w[12](_[ab])?$"), "LyCORIS LoKr (lokr_*)"),
                (re.compile(r"\.diff(_b)?$"), "full weight or bias deltas (diff / diff_b)"))
ADAPTER_METADATA = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY


class LoraError(ModelLoadError):
    """A LoRA file that cannot be applied to the loaded model; the message names the file and why."""


@dataclasses.dataclass(frozen=True)
class LoraLayer:
    """The low-rank delta of one weight.

    Attributes:
        component: "unet", "text_encoder" or "text_encoder_2".
        key: the parameter it changes (``down_blocks.1.attentions.0.proj_in.weight``).
        down: (rank, in * kh * kw) float32, PyTorch's order of the flattened input axes.
        up: (out, rank) float32, already multiplied by the file's scale (alpha / rank or 1).
    """

    component: str
    key: str
    down: np.ndarray
    up: np.ndarray


@dataclasses.dataclass(frozen=True)
class Lora:
    """One LoRA file read and checked against a model.

    Attributes:
        name: what prompts call it (``<lora:NAME:WEIGHT>``).
        path: the file.
        format: "kohya" or "diffusers".
        layers: one LoraLayer per adapted weight.
        hash: AUTOMATIC1111's LoRA hash (sha256, 64 hex): the file's ``sshs_model_hash`` metadata,
            else sha256 of the bytes after the safetensors header (kohya's "addnet" hash, which
            A1111 uses for safetensors LoRAs); :attr:`short_hash` is what PNG infotexts carry.
    """

    name: str
    path: Path
    format: str
    layers: tuple[LoraLayer, ...]
    hash: str

    @property
    def short_hash(self) -> str:
        """The first 12 hex digits of :attr:`hash` (A1111's ``shorthash``, in ``Lora hashes``)."""
        return self.hash[:12]

    def touched(self) -> dict[str, tuple[str, ...]]:
        """{component: the parameter keys this LoRA changes}."""
        out: dict[str, list[str]] = {}
        for layer in self.layers:
            out.setdefault(layer.component, []).append(layer.key)
        return {c: tuple(k) for c, k in out.items()}


# ---- reading ---------------------------------------------------------------------------------------

def check_lora_path(path: Path) -> None:
    """Raise LoraError for a path that is not an existing ``.safetensors`` file (pickles refused unopened)."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise LoraError(f"{path}: a pickle ({path.suffix}); LoRA pickles are never opened because unpickling can "
                        f"run code. Use the .safetensors version of this LoRA")
    if path.suffix.lower() != ".safetensors":
        raise LoraError(f"{path}: not a .safetensors file; LoRAs are read from .safetensors only")
    if not path.is_file():
        raise LoraError(f"{path}: no such LoRA file")


def lora_hash(path: Path) -> str:
    """A1111's hash of a safetensors LoRA (64 hex): ``sshs_model_hash`` from its metadata, else
    sha256 of everything after the 8-byte length and the JSON header (modules/hashes.py,
    ``addnet_hash_safetensors``; extensions-builtin/Lora/network.py ``NetworkOnDisk``)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length) or b"{}")
        stored = (header.get("__metadata__") or {}).get("sshs_model_hash")
        if stored:
            return str(stored)
        digest = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _metadata(path: Path) -> dict:
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(length)).get("__metadata__") or {}


def _hf_text_name(key: str) -> str:
    """A text encoder's parameter key as transformers names it (CLIPTextModel keeps everything under
    ``text_model.``, which the own CLIPTextModel drops; CLIPTextModelWithProjection keeps it)."""
    return key if key.startswith("text_model.") or key.startswith("text_projection") else "text_model." + key


def _ldm_unet_name(module: str, config) -> str | None:
    """The sgm/LDM name of a diffusers UNet module (``down_blocks.1.attentions.0.proj_in`` ->
    ``input_blocks.4.1.proj_in``), the inverse of diffusers' ``_maybe_map_sgm_blocks_to_diffusers``
    and ``_convert_unet_lora_key``; None for a module without one."""
    fixed = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "time_embedding.linear_1": "time_embed.0",
             "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
             "add_embedding.linear_2": "label_emb.0.2"}
    if module in fixed:
        return fixed[module]
    resnet = {"conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "conv2": "out_layers.3",
              "conv_shortcut": "skip_connection"}

    def inner(kind: str, rest: str) -> str:
        if kind == "resnets":
            head, _, tail = rest.partition(".")
            return resnet.get(head, head) + ("." + tail if tail else "")
        return rest

    per = config.layers_per_block
    if m := re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", module):
        b, kind, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
        index = 1 + sum(per[i] + 1 for i in range(b)) + layer
        return f"input_blocks.{index}.{0 if kind == 'resnets' else 1}.{inner(kind, rest)}"
    if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv", module):
        b = int(m[1])
        return f"input_blocks.{sum(per[i] + 1 for i in range(b + 1))}.0.op"
    if m := re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", module):
        kind, layer, rest = m[1], int(m[2]), m[3]
        index = 1 if kind == "attentions" else 2 * layer
        return f"middle_block.{index}.{inner(kind, rest)}"
    up = tuple(reversed(per))
    if m := re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", module):
        b, kind, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
        index = sum(up[i] + 1 for i in range(b)) + layer  # an up block has layers_per_block + 1 resnets
        return f"output_blocks.{index}.{0 if kind == 'resnets' else 1}.{inner(kind, rest)}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv", module):
        b = int(m[1])
        has_attention = "CrossAttn" in config.up_block_types[b]
        return f"output_blocks.{sum(up[i] + 1 for i in range(b)) + up[b]}.{2 if has_attention else 1}.conv"
    return None


def _kohya_names(components: tuple) -> dict[str, tuple[str, str]]:
    """{kohya module name (``lora_unet_input_blocks_4_1_proj_in``): (component, parameter key)} for every
    2-D or 4-D weight of ``components`` ((name, Component) pairs)."""
    names = {}
    for name, component in components:
        for key, shape in component.shapes.items():
            if not key.endswith(".weight") or len(shape) not in (2, 4):
                continue
            module = key[: -len(".weight")]
            if name == "unet":
                spellings = [module, _ldm_unet_name(module, component.config)]
                prefixes = ["lora_unet_"]
            else:
                spellings = [_hf_text_name(module)]
                prefixes = ["lora_te2_"] if name == "text_encoder_2" else ["lora_te1_", "lora_te_"]
            for spelling in filter(None, spellings):
                for prefix in prefixes:
                    names[prefix + spelling.replace(".", "_")] = (name, key)
    return names


def _diffusers_module(component: str, module: str) -> str:
    """A diffusers/PEFT module name as the own modules spell it (processor names renamed, ``text_model.``
    dropped where the own CLIPTextModel has none: the caller tries both)."""
    table = _PROCESSOR_NAMES["unet" if component == "unet" else "text"]
    parts = [p for p in module.split(".") if p != "processor"]
    return ".".join(table.get(p, p) for p in parts)


def _split_pair(key: str) -> tuple[str, str] | None:
    """(module, "down"|"up") for a LoRA tensor key, else None (alpha and anything else)."""
    for down, up in PAIRS:
        if key.endswith(down):
            return key[: -len(down)], "down"
        if key.endswith(up):
            return key[: -len(up)], "up"
    for old, new in (("_lora.down.weight", "down"), ("_lora.up.weight", "up")):  # attn1.processor.to_q_lora.down
        if key.endswith(old):
            return key[: -len(old)] + "_lora", new
    return None


def _peft_scale(metadata: Mapping[str, str], component: str, module: str, rank: int) -> float:
    """PEFT's ``scaling`` of one module from diffusers' saved LoraConfig (``lora_alpha / r``, rsLoRA
    ``lora_alpha / sqrt(r)``); 1 without it. ``alpha_pattern``/``rank_pattern`` keys are regexes matched
    as PEFT's ``get_pattern_key`` does, ``re.match(rf"(.*\\.)?({key})$", name)`` (a suffix at a dot, the
    key grouped so an alternation stays anchored), the first that matches winning, against the module's
    name in the PEFT-wrapped model (transformers' ``text_model.`` included for a text encoder)."""
    raw = metadata.get(ADAPTER_METADATA)
    if not raw:
        return 1.0
    config = json.loads(raw)
    get = lambda field, default=None: config.get(f"{component}.{field}", default)  # noqa: E731
    if get("lora_alpha") is None:
        return 1.0
    name = module if component == "unet" else _hf_text_name(module)
    alpha, r = float(get("lora_alpha")), rank
    for pattern, value in (get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            alpha = float(value)
            break
    for pattern, value in (get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            r = int(value)
            break
    return alpha / math.sqrt(r) if get("use_rslora", False) else alpha / r


def read_lora(name: str, path: Path, components: Mapping[str, Component],
              keys: Mapping[str, str] | None = None) -> Lora:
    """Read a LoRA file and check it against a model's components.

    Args:
        name: the name prompts use.
        path: a ``.safetensors`` LoRA (formats: the module docstring).
        components: the loaded model's {"unet", "text_encoder", "text_encoder_2", ...} -> Component.
        keys: {key in one of the formats above: the file's key it is read from}, for a file whose LoRA is stored
            under other names (an IP-Adapter FaceID file's ``ip_adapter.{i}.to_q_lora.*``:
            checkpoint/ip_adapter.faceid_lora_keys); only those keys are read. None: the file's own keys, all of them.
    Returns:
        the Lora, its tensors in float32 on the host.
    Raises:
        LoraError: a pickle or other suffix (unopened), an unreadable or truncated file, an unsupported
            variant (DoRA, LoHa, LoKr, weight deltas: by name), keys of no known format, a down without its
            up, keys that match no module of the model (the first few named), or shapes that do not fit
            (naming the key, both shapes, and when the widths are SD 1.x's or 2.x's, saying so), a tensor
            with NaN or infinite values or a non-finite scale (naming the key), or a layer whose delta may
            pass :data:`MAX_DELTA` at weight 1 (naming its up key).
    """
    path = Path(path)
    check_lora_path(path)
    try:
        infos = read_safetensors_header(path)
    except ModelLoadError as err:
        raise LoraError(f"LoRA {name!r}: {err}") from None
    where = f"LoRA {name!r} ({path})"
    source = dict(keys) if keys is not None else {k: k for k in infos}
    missing = [k for k in source.values() if k not in infos]
    if missing:
        raise LoraError(f"{where}: no tensor {missing[0]} in the file")
    infos = {k: infos[v] for k, v in source.items()}
    for key in infos:
        for pattern, what in _UNSUPPORTED:
            if pattern.search(key):
                raise LoraError(f"{where}: {what} is not supported (key {key}); use a plain LoRA")
    kohya = any(k.startswith(tuple(KOHYA_PREFIXES)) for k in infos)
    pairs = _pairs(where, infos, kohya)
    metadata = _metadata(path)
    own = tuple((n, c) for n, c in components.items() if n == "unet" or n in TEXT_ENCODERS)
    table = _kohya_names(own) if kohya else None
    targets, unmatched = {}, []
    for (prefix, module), _tensors in pairs.items():
        found = table.get(prefix + module) if kohya else _diffusers_target(components, prefix, module)
        if found is None:
            unmatched.append(prefix + module)
        else:
            targets[(prefix, module)] = found
    misfits = [_misfit(prefix + module, infos[pairs[(prefix, module)]["down"]].shape,
                       infos[pairs[(prefix, module)]["up"]].shape, components[c].shapes[k])
               for (prefix, module), (c, k) in targets.items()]
    misfits = [m for m in misfits if m]
    if misfits:
        raise LoraError(f"{where}: {len(misfits)} layer{'s' if len(misfits) > 1 else ''} do not fit this model's "
                        f"shapes (first: {misfits[0]}){_other_model_hint(infos)}"
                        + (f"; and {len(unmatched)} match no module" if unmatched else ""))
    if unmatched:
        raise LoraError(f"{where}: {len(unmatched)} of {len(pairs)} LoRA layers match no module of this model "
                        f"(first: {', '.join(unmatched[:5])}){_other_model_hint(infos)}")
    if not targets:
        raise LoraError(f"{where}: no LoRA layers found (expected {', '.join(d for d, _ in PAIRS)} keys)")
    layers = _read_layers(where, path, pairs, targets, infos, metadata, kohya, source)
    return Lora(name, path, "kohya" if kohya else "diffusers", layers, lora_hash(path))


def _pairs(where: str, infos: Mapping, kohya: bool) -> dict[tuple[str, str], dict[str, str]]:
    """{(prefix, module): {"down": key, "up": key, "alpha": key?}}; LoraError for foreign or unpaired keys."""
    prefixes = KOHYA_PREFIXES if kohya else DIFFUSERS_PREFIXES
    pairs: dict[tuple[str, str], dict[str, str]] = {}
    foreign = []
    for key in infos:
        prefix = next((p for p in sorted(prefixes, key=len, reverse=True) if key.startswith(p)), None)
        split = _split_pair(key)
        if prefix is None or (split is None and not key.endswith(".alpha")):
            foreign.append(key)
            continue
        module, role = split if split else (key[: -len(".alpha")], "alpha")
        pairs.setdefault((prefix, module[len(prefix):]), {})[role] = key
    if foreign:
        raise LoraError(f"{where}: {len(foreign)} keys of no LoRA format this server reads (first: "
                        f"{', '.join(foreign[:5])}); expected kohya lora_unet_/lora_te1_/lora_te2_ keys or "
                        f"diffusers unet./text_encoder./text_encoder_2. keys")
    for (prefix, module), roles in pairs.items():
        if "down" not in roles or "up" not in roles:
            missing = "up" if "down" in roles else "down"
            raise LoraError(f"{where}: {prefix}{module} has no {missing} weight")
    return pairs


def _diffusers_target(components: Mapping[str, Component], prefix: str, module: str) -> tuple[str, str] | None:
    component = DIFFUSERS_PREFIXES[prefix]
    name = _diffusers_module(component, module)
    shapes = components[component].shapes
    candidates = [name]
    if component in TEXT_ENCODERS and name.startswith("text_model."):
        candidates.append(name[len("text_model."):])
    for candidate in candidates:
        if candidate + ".weight" in shapes:
            return component, candidate + ".weight"
    return None


def _misfit(module: str, down: tuple, up: tuple, target: tuple) -> str | None:
    """Why a (down, up) pair cannot change a weight of module shape ``target``; None if it can."""
    torch_target = tuple(target[i] for i in (3, 2, 0, 1)) if len(target) == 4 else tuple(target)
    out, fan_in = torch_target[0], int(np.prod(torch_target[1:]))
    rank = down[0] if down else 0
    ok = (len(up) >= 2 and up[0] == out and up[1] == rank and int(np.prod(up[2:])) == 1
          and int(np.prod(down[1:])) == fan_in and (len(down) != 4 or len(torch_target) != 4
                                                     or tuple(down[1:]) == torch_target[1:]))
    if ok:
        return None
    return (f"{module}: down {tuple(down)} and up {tuple(up)} cannot change a weight of shape {torch_target} "
            f"(out, in{', kh, kw' if len(torch_target) == 4 else ''})")


def _other_model_hint(infos: Mapping) -> str:
    """What the file's widths say about the model it was made for (SD 1.x: cross-attention 768, SD 2.x: 1024)."""
    widths = {info.shape[-1] for key, info in infos.items() if "attn2" in key and ("to_k" in key or "to_v" in key)
              and ("lora_down" in key or "lora_A" in key or "lora.down" in key) and len(info.shape) == 2}
    if widths == {768}:
        return ". It looks like an SD 1.x LoRA (cross-attention width 768; SDXL's is 2048): it cannot apply to SDXL"
    if widths == {1024}:
        return ". It looks like an SD 2.x LoRA (cross-attention width 1024; SDXL's is 2048): it cannot apply to SDXL"
    return ". Is it a LoRA for this model?"


def _read_layers(where: str, path: Path, pairs, targets, infos, metadata,
                 kohya: bool, source: Mapping[str, str]) -> tuple[LoraLayer, ...]:
    """The tensors of every matched pair, flattened, in float32, ``up`` pre-multiplied by its scale;
    LoraError (naming the key) for a non-finite tensor or scale, or a delta past :data:`MAX_DELTA`.
    ``source``: {key as read: the file's key} (read_lora's ``keys``)."""
    layers = []
    with safe_open(str(path), framework="numpy") as f:
        get = lambda key: _float32(f, key, infos, source[key])  # noqa: E731
        for pair, (component, key) in targets.items():
            roles = pairs[pair]
            down = _finite(where, roles["down"], get(roles["down"]))
            up = _finite(where, roles["up"], get(roles["up"]))
            rank = down.shape[0]
            if "alpha" in roles:  # kohya's, or diffusers' own conversion keeping kohya's alpha as <module>.alpha
                scale = float(_finite(where, roles["alpha"], get(roles["alpha"])).reshape(())) / rank
            elif kohya:
                scale = 1.0
            else:
                scale = _peft_scale(metadata, component, key[: -len(".weight")], rank)
                if not math.isfinite(scale):
                    raise LoraError(f"{where}: the {ADAPTER_METADATA} header gives {roles['up']} a scale of "
                                    f"{scale}; a LoRA's scale must be a finite number")
            down, up = down.reshape(rank, -1), up.reshape(up.shape[0], rank) * scale
            _check_magnitude(where, roles["up"], down, up)
            layers.append(LoraLayer(component, key, down, up))
    return tuple(layers)


# The largest |entry| a layer's delta (scale * up @ down, at weight 1) may reach. Trained LoRAs change a
# weight by a small fraction of the weight itself (SDXL's weights are of order 1, their deltas far
# smaller); 1e4 is orders of magnitude past that, and a delta that large turns every image using the
# LoRA into NaN or noise at any prompt weight (0.001 still adds 10 to a weight of order 1; at weight 4
# it nears float16's largest finite value, 65504, in the merged weights). Such a file is damaged or
# came from a diverged training run: refused at start rather than failing every prompt that uses it.
MAX_DELTA = 1e4


def _finite(where: str, key: str, tensor: np.ndarray) -> np.ndarray:
    """``tensor``; LoraError naming ``key`` and the count of NaN / inf entries when it has any."""
    bad = ~np.isfinite(tensor)
    if bad.any():
        nan, inf = int(np.isnan(tensor).sum()), int(np.isinf(tensor).sum())
        raise LoraError(f"{where}: tensor {key} has {nan} NaN and {inf} infinite values of {tensor.size}; the "
                        f"file is damaged or was saved from a diverged training run")
    return tensor


def _check_magnitude(where: str, key: str, down: np.ndarray, up: np.ndarray) -> None:
    """LoraError naming ``key`` when the layer's delta may pass :data:`MAX_DELTA`.

    The bound ``max_i sum_r |up[i, r]| * max_j |down[r, j]|`` is at least every ``|(up @ down)[i, j]|``
    and costs O(out * rank + rank * in), not the full product's O(out * rank * in). float64, so that
    values near float32's limit cannot overflow into a spurious inf.
    """
    bound = float(np.max(np.abs(up.astype(np.float64)) @ np.max(np.abs(down.astype(np.float64)), axis=1)))
    if not bound <= MAX_DELTA:
        raise LoraError(f"{where}: tensor {key} (with its down weight and scale) gives a delta that may reach "
                        f"{bound:.3g} at weight 1; trained LoRAs stay far below {MAX_DELTA:g}, so the file is "
                        f"damaged or was saved from a diverged training run")


def _float32(handle, key: str, infos, stored: str | None = None) -> np.ndarray:
    """Tensor ``key`` (stored under ``stored``; None: ``key``) in float32."""
    dtype = infos[key].dtype
    if dtype not in ("F32", "F16", "BF16", "F64"):
        raise LoraError(f"{infos[key].file}: {key} is stored as {dtype}; LoRA tensors must be F32, F16, BF16 or F64")
    return np.asarray(handle.get_tensor(stored or key), dtype=np.float32)


# ---- which files -----------------------------------------------------------------------------------

def lora_sources(entries: str, folder: str, separator: str,
                 shipped: Mapping[str, Path] | None = None) -> dict[str, Path]:
    """{name: path} from ``--lora NAME=PATH`` entries (joined by ``separator``) and ``--lora-dir`` (every
    ``.safetensors`` there, named by its stem), in that order, then the model's own ``shipped`` LoRAs
    (its loras.json, checkpoint.loading.model_loras) whose names those two do not take.

    Raises:
        LoraError: an entry without ``NAME=``, a bad name (letters, digits, ``_ - .`` only: it is written
            in a ``<lora:NAME>`` tag), one name twice (two entries, or an entry and a file of the folder),
            a folder that does not exist.
    """
    sources: dict[str, Path] = {}

    def add(name: str, path: Path, origin: str) -> None:
        if not LORA_NAME.fullmatch(name):
            raise LoraError(f"{origin}: LoRA name {name!r} must be letters, digits, '_', '-' or '.' (it is written "
                            f"in <lora:NAME:WEIGHT> tags)")
        if name in sources:
            raise LoraError(f"{origin}: two LoRAs named {name!r} ({sources[name]} and {path}); each name once")
        sources[name] = path

    try:
        pairs = lora_entries(entries, separator)  # the setting's own check (EngineConfig refuses these at load)
    except ConfigError as err:
        raise LoraError(str(err)) from None
    for name, path in pairs:
        add(name, Path(path).expanduser(), f"--lora {name}={path}")
    if folder:
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise LoraError(f"--lora-dir {folder!r}: not a folder")
        for file in sorted(root.iterdir()):
            if file.suffix.lower() == ".safetensors" and file.is_file():
                add(file.stem, file, f"--lora-dir {folder!r}")
    for name, path in (shipped or {}).items():
        if name not in sources:
            add(name, Path(path), "the model's loras.json")
    return sources


def available_names(entries: str, folder: str, separator: str,
                    shipped: Mapping[str, Path] | None = None) -> list[str]:
    """The LoRA names :func:`lora_sources` gives, for the page's list; [] when the settings are bad (the
    engine's start reports that, in one line, and the process exits)."""
    try:
        return list(lora_sources(entries, folder, separator, shipped))
    except (LoraError, OSError):
        return []


# ---- merging ---------------------------------------------------------------------------------------

def place_lora(lora: Lora, sharding) -> dict[str, dict[str, tuple[jax.Array, jax.Array]]]:
    """{component: {key: (down, up)}} of ``lora`` on the devices with ``sharding`` (float32)."""
    out: dict[str, dict[str, tuple]] = {}
    for layer in lora.layers:
        out.setdefault(layer.component, {})[layer.key] = (jax.device_put(layer.down, sharding),
                                                          jax.device_put(layer.up, sharding))
    return out


def merge_layer(w: jax.Array, factors: tuple, weights: jax.Array, index: tuple[int, ...]) -> jax.Array:
    """One weight with its LoRAs' deltas: ``W + sum_i weights[index[i]] * (up_i @ down_i)``.

    Args:
        w: the base weight in the modules' layout, (out, in) or (kh, kw, in, out), any float dtype.
        factors: ((down (rank, in*kh*kw), up (out, rank)), ...) float32, one pair per LoRA touching ``w``
            (``up`` already scaled by alpha / rank).
        weights: (n,) float32, the weight of every LoRA of the set (a traced argument: a new weight does
            not recompile).
        index: static; which entry of ``weights`` belongs to each pair of ``factors``.
    Returns:
        ``w``'s shape and dtype; the sum is float32 (matmul at HIGHEST precision), cast once at the end,
        as PEFT's ``get_delta_weight`` + diffusers' ``fuse_lora`` compute it.
    """
    out_ch = w.shape[-1] if w.ndim == 4 else w.shape[0]
    total = jnp.zeros((out_ch, w.size // out_ch), jnp.float32)
    for (down, up), i in zip(factors, index):
        total = total + weights[i] * jnp.matmul(up, down, precision=jax.lax.Precision.HIGHEST)
    if w.ndim == 4:  # (out, in*kh*kw) in PyTorch's order -> the modules' (kh, kw, in, out)
        total = total.reshape(out_ch, w.shape[2], w.shape[0], w.shape[1]).transpose(2, 3, 1, 0)
    return (w.astype(jnp.float32) + total).astype(w.dtype)


class LoraMerger:
    """Merged parameters for LoRA sets, from the kept base parameters, outside the compiled program.

    Each touched weight is merged by :func:`merge_layer`, jitted once per distinct (weight shape, factor
    shapes, index): a new set of already-seen shapes, or new weights, compiles nothing. Per layer, not
    one program per set, so that only one layer's float32 delta is alive at a time (one program for a
    whole full-size set keeps many of them at once: docs/benchmarks.md) and a set of new names needs no
    compile of its own. The last merged set is kept, so repeated requests with the same tags merge
    nothing. Memory: the base parameters, the LoRAs' factors, one merged copy of the weights the current
    set touches (the previous copy is dropped before a new merge) and one layer's float32 delta.
    """

    def __init__(self, base: Mapping[str, Mapping[str, jax.Array]], loras: Mapping[str, Lora], sharding):
        self.base = base
        self.loras = dict(loras)
        self._sharding = sharding
        self._factors = {name: place_lora(lora, sharding) for name, lora in loras.items()}
        self._jitted = jax.jit(merge_layer, static_argnames=("index",), out_shardings=sharding)
        self._current: tuple | None = None
        self._params = base
        self.merges = 0  # sets merged (for tests and the log)

    def params(self, tags: Sequence[tuple[str, float]]):
        """The parameters for ``tags`` ((name, weight) pairs; names must be loaded): the base dict
        itself for none (or all weights 0), else a dict of the same structure, shapes, dtypes and
        shardings with the touched weights merged (the others are the base's arrays, not copies).
        Raises KeyError for a name not loaded."""
        active = tuple(sorted((n, float(w)) for n, w in tags if w != 0.0))
        if not active:
            return self.base
        if active == self._current:
            return self._params
        self._current, self._params = None, self.base  # drop the previous merged copy first
        weights = jax.device_put(np.asarray([w for _, w in active], np.float32), self._sharding)
        layers: dict[tuple[str, str], list] = {}
        for i, (name, _) in enumerate(active):
            for component, keys in self._factors[name].items():
                for key, pair in keys.items():
                    layers.setdefault((component, key), []).append((pair, i))
        merged = {c: dict(params) for c, params in self.base.items()}
        for (component, key), entries in sorted(layers.items()):
            merged[component][key] = self._jitted(self.base[component][key], tuple(p for p, _ in entries), weights,
                                                  index=tuple(i for _, i in entries))
        self._params, self._current = merged, active
        self.merges += 1
        return merged


def same_deltas(a: Lora, b: Lora, rtol: float = 2e-3) -> bool:
    """Whether ``a`` and ``b`` change the same weights by the same deltas at weight 1, whatever their files'
    formats, names and scales: the same (component, key) set and, per weight, ``|scale * up @ down|`` of one within
    ``rtol`` x the largest entry of the other's (2e-3: the two stored in float32 and float16; h94's
    ``ip-adapter-faceid_sdxl_lora.safetensors`` beside its FaceID file's own LoRA keys). float64, the products per
    layer (the caller compares a few LoRAs once per model, at its load)."""
    deltas = lambda lora: {(x.component, x.key): x for x in lora.layers}  # noqa: E731
    left, right = deltas(a), deltas(b)
    if left.keys() != right.keys():
        return False
    for where, x in left.items():
        y = right[where]
        dx = x.up.astype(np.float64) @ x.down.astype(np.float64)
        dy = y.up.astype(np.float64) @ y.down.astype(np.float64)
        if dx.shape != dy.shape or not np.abs(dx - dy).max() <= rtol * max(np.abs(dy).max(), 1e-12):
            return False
    return True


def lora_info(loras: Iterable[Lora]) -> list[dict]:
    """[{"name", "format", "layers", "hash"}] for the page and the start-up log."""
    return [{"name": lora.name, "format": lora.format, "layers": len(lora.layers), "hash": lora.short_hash}
            for lora in loras]
