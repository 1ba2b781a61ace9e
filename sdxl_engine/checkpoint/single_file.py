"""One ``.safetensors`` file in Stability's original ("sgm"/LDM) layout, or one component's file, -> parameters.

An SDXL single file (``sd_xl_base_1.0.safetensors`` and its fine-tunes) holds every component under
one prefix each: ``model.diffusion_model.*`` (UNet), ``first_stage_model.*`` (VAE),
``conditioner.embedders.0.transformer.*`` (CLIP-L, transformers' names already) and
``conditioner.embedders.1.model.*`` (OpenCLIP ViT-bigG). The SDXL refiner's file
(``sd_xl_refiner_1.0.safetensors``) has the same UNet and VAE prefixes and one text encoder, the OpenCLIP
ViT-bigG as ``conditioner.embedders.0.model.*`` (text_encoder_2; no CLIP-L), identified as diffusers'
``infer_diffusers_model_type`` does ("xl_refiner": embedder 0 is OpenCLIP). Each tensor maps to one parameter of the
own modules by rule, the rules of diffusers' ``loaders/single_file_utils.py``
(``convert_ldm_unet_checkpoint``, ``convert_ldm_vae_checkpoint``, ``convert_ldm_clip_checkpoint``,
``convert_open_clip_checkpoint``):

* UNet: ``input_blocks.{i}.0`` -> ``down_blocks.{b}.resnets.{l}`` (``.0.op`` -> the downsampler),
  ``input_blocks.{i}.1`` -> ``down_blocks.{b}.attentions.{l}``, ``middle_block.{0,1,2}`` -> ``mid_block``,
  ``output_blocks.{i}.{0,1,2}`` -> ``up_blocks.{b}`` resnets/attentions/upsamplers, resnet inner names
  (``in_layers.0`` -> ``norm1``...), ``time_embed``, ``label_emb``, ``out.0``/``out.2``. The indices come
  from the config's ``layers_per_block``.
* VAE: ``down.{i}.block.{j}`` -> ``down_blocks.{i}.resnets.{j}``, ``up.{i}`` -> ``up_blocks.{n-1-i}``
  (LDM counts up blocks from the bottom), ``mid.block_{1,2}``/``mid.attn_1``, ``nin_shortcut`` ->
  ``conv_shortcut``, ``norm_out`` -> ``conv_norm_out``; the attention's 1x1 convolutions
  ``q``/``k``/``v``/``proj_out`` (out, in, 1, 1) become the linear ``to_q``/``to_k``/``to_v``/``to_out.0``.
* OpenCLIP: ``resblocks.{n}`` -> ``encoder.layers.{n}``, ``ln_1``/``ln_2``/``mlp.c_fc``/``mlp.c_proj``/
  ``attn.out_proj`` renamed, the fused ``attn.in_proj_weight``/``in_proj_bias`` (3 x width rows) cut
  into ``q_proj``/``k_proj``/``v_proj`` thirds, ``positional_embedding``, ``token_embedding``, ``ln_final``,
  and ``text_projection`` (width, projection) transposed to a linear weight.

Nothing is converted in memory as a whole: the plan (:class:`Source` per parameter) is made from
the header, checked (missing, unexpected, shapes, dtypes: the folder loader's checks and messages),
then each tensor is read memory-mapped in file order, cut or transposed, cast and placed, as
:func:`.weights.load_params` does for folders.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from sdxl_engine.checkpoint.weights import (
    BUFFERS,
    ModelLoadError,
    TensorInfo,
    _check,
    _read_safetensors,
    module_shape,
    read_safetensors_header,
    to_module_layout,
)
from sdxl_engine.models import Component

LOG = logging.getLogger(__name__)

__all__ = ["Checkpoint", "Source", "inspect_checkpoint", "load_checkpoint_params", "load_component_file",
           "is_single_file_name"]

# The sgm prefix of each component in an SDXL single file.
PREFIXES = {"unet": "model.diffusion_model.", "vae": "first_stage_model.",
            "text_encoder": "conditioner.embedders.0.transformer.", "text_encoder_2": "conditioner.embedders.1.model."}
# The refiner's file: OpenCLIP bigG (text_encoder_2) is embedder 0; the UNet and VAE as in the base.
REFINER_PREFIXES = {"unet": PREFIXES["unet"], "vae": PREFIXES["vae"],
                    "text_encoder_2": "conditioner.embedders.0.model."}
# Prefixes a component's own file may carry (--unet / --vae): sgm's, diffusers' pipeline-level name, LDM's "vae.".
COMPONENT_PREFIXES = {"unet": ("model.diffusion_model.", "unet."), "vae": ("first_stage_model.", "vae."),
                      "text_encoder": (PREFIXES["text_encoder"], "text_encoder."),
                      "text_encoder_2": (PREFIXES["text_encoder_2"], "text_encoder_2.")}
# Keys an SDXL file carries that are not weights of any module: OpenCLIP's contrastive temperature.
NOT_WEIGHTS = ("conditioner.embedders.1.model.logit_scale", "conditioner.embedders.0.model.logit_scale")
# Marker tensors of v-prediction fine-tunes (as ComfyUI and A1111 read them): v_pred -> prediction_type
# v_prediction; ztsnr -> zero terminal SNR (rescale_betas_zero_snr).
MARKERS = ("v_pred", "ztsnr")
SINGLE_FILE_SUFFIX = ".safetensors"


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one module parameter comes from: a tensor of the file and what is done to it (PyTorch layout).

    Attributes:
        info: the stored tensor (file, key, dtype, shape, offset).
        part: 0, 1 or 2: that third of dimension 0 (q, k, v of OpenCLIP's fused ``in_proj``); None: all.
        transpose: a 2-D tensor stored (in, out) (OpenCLIP's ``text_projection``), given as (out, in).
        squeeze: a 1x1 convolution kernel (out, in, 1, 1) or (out, in, 1) used as a linear weight (out, in).
    """

    info: TensorInfo
    part: int | None = None
    transpose: bool = False
    squeeze: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """The PyTorch-layout shape after the cut, transpose or squeeze."""
        shape = tuple(self.info.shape)
        if self.part is not None:
            shape = (shape[0] // 3,) + shape[1:]
        if self.transpose:
            shape = shape[::-1]
        if self.squeeze:
            shape = shape[:2]
        return shape

    def apply(self, array: np.ndarray) -> np.ndarray:
        """The stored ``array`` as the parameter, in PyTorch's layout (a view where possible)."""
        if self.part is not None:
            rows = array.shape[0] // 3
            array = array[self.part * rows:(self.part + 1) * rows]
        if self.transpose:
            array = array.T
        if self.squeeze:
            array = array.reshape(array.shape[:2])
        return array


# --- key rules: LDM/sgm names -> diffusers names ------------------------------------------------------------

_RESNET = (("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("out_layers.0", "norm2"), ("out_layers.3", "conv2"),
           ("emb_layers.1", "time_emb_proj"), ("skip_connection", "conv_shortcut"))
_UNET_TOP = {"time_embed.0": "time_embedding.linear_1", "time_embed.2": "time_embedding.linear_2",
             "input_blocks.0.0": "conv_in", "out.0": "conv_norm_out", "out.2": "conv_out",
             "label_emb.0.0": "add_embedding.linear_1", "label_emb.0.2": "add_embedding.linear_2"}


def _resnet(rest: str) -> str:
    for old, new in _RESNET:
        if rest.startswith(old + "."):
            return new + rest[len(old):]
    return rest


def unet_block_tables(config) -> tuple[dict[int, tuple[int, int]], dict[int, int], dict[int, tuple[int, int]],
                                       dict[int, int]]:
    """LDM block indices of a UNet config, as diffusers' conversion counts them.

    Returns:
        (input index -> (down block, layer), input index -> down block whose downsampler it is,
         output index -> (up block, layer), up block -> the output index holding its upsampler).
        ``input_blocks.0`` is conv_in; each down block has ``layers_per_block`` layers then, except the
        last, a downsampler; each up block has ``layers_per_block + 1`` layers (reversed), the
        upsampler inside its last one.
    """
    layers = tuple(config.layers_per_block)
    n = len(layers)
    down, downsamplers, up, upsamplers = {}, {}, {}, {}
    i = 1
    for b in range(n):
        for layer in range(layers[b]):
            down[i] = (b, layer)
            i += 1
        if b < n - 1:
            downsamplers[i] = b
            i += 1
    i = 0
    for b, count in enumerate(reversed(layers)):
        for layer in range(count + 1):
            up[i] = (b, layer)
            i += 1
        if b < n - 1:
            upsamplers[b] = i - 1
    return down, downsamplers, up, upsamplers


def unet_key(key: str, tables) -> str | None:
    """An LDM UNet key (without ``model.diffusion_model.``) -> the diffusers name; None if no rule fits."""
    down, downsamplers, up, upsamplers = tables
    for old, new in _UNET_TOP.items():
        if key.startswith(old + ".") and key.count(".") == old.count(".") + 1:
            return new + key[len(old):]
    m = re.fullmatch(r"middle_block\.([012])\.(.+)", key)
    if m:
        rest = m[2]
        return {"0": f"mid_block.resnets.0.{_resnet(rest)}", "1": f"mid_block.attentions.0.{rest}",
                "2": f"mid_block.resnets.1.{_resnet(rest)}"}[m[1]]
    m = re.fullmatch(r"(input_blocks|output_blocks)\.(\d+)\.(\d+)\.(.+)", key)
    if not m:
        return None
    kind, i, j, rest = m[1], int(m[2]), int(m[3]), m[4]
    if kind == "input_blocks":
        if i in downsamplers and j == 0 and rest.startswith("op."):
            return f"down_blocks.{downsamplers[i]}.downsamplers.0.conv.{rest[3:]}"
        if i not in down:
            return None
        b, layer = down[i]
        return {0: f"down_blocks.{b}.resnets.{layer}.{_resnet(rest)}",
                1: f"down_blocks.{b}.attentions.{layer}.{rest}"}.get(j)
    if i not in up:
        return None
    b, layer = up[i]
    if j == 0:
        return f"up_blocks.{b}.resnets.{layer}.{_resnet(rest)}"
    if upsamplers.get(b) == i and rest.startswith("conv.") and rest.count(".") == 1:
        return f"up_blocks.{b}.upsamplers.0.{rest}"  # index 1 without attention, 2 with
    return f"up_blocks.{b}.attentions.{layer}.{rest}" if j == 1 else None


_VAE_ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_VAE_TOP = {"encoder.norm_out": "encoder.conv_norm_out", "decoder.norm_out": "decoder.conv_norm_out"}


def vae_key(key: str, up_blocks: int) -> tuple[str, bool] | None:
    """An LDM VAE key (without ``first_stage_model.``) -> (diffusers name, whether it is a 1x1 conv to squeeze);
    None if no rule fits. ``up_blocks``: the number of decoder up blocks (LDM numbers them from the bottom)."""
    for old, new in _VAE_TOP.items():
        if key.startswith(old + "."):
            return new + key[len(old):], False
    if re.fullmatch(r"(encoder|decoder)\.(conv_in|conv_out)\.(weight|bias)|(post_)?quant_conv\.(weight|bias)", key):
        return key, False
    m = re.fullmatch(r"(encoder|decoder)\.(down|up)\.(\d+)\.(block\.(\d+)|downsample|upsample)\.(.+)", key)
    if m:
        side, kind, i, inner, j, rest = m[1], m[2], int(m[3]), m[4], m[5], m[6]
        if (side, kind) not in (("encoder", "down"), ("decoder", "up")):
            return None
        block = f"{side}.{kind}_blocks.{i if kind == 'down' else up_blocks - 1 - i}"
        if j is not None:
            return f"{block}.resnets.{j}.{rest.replace('nin_shortcut', 'conv_shortcut')}", False
        if inner == ("downsample" if kind == "down" else "upsample") and rest.startswith("conv."):
            return f"{block}.{inner}rs.0.{rest}", False
        return None
    m = re.fullmatch(r"(encoder|decoder)\.mid\.(block_([12])|attn_1)\.(.+)", key)
    if not m:
        return None
    side, rest = m[1], m[4]
    if m[3]:
        return f"{side}.mid_block.resnets.{int(m[3]) - 1}.{rest.replace('nin_shortcut', 'conv_shortcut')}", False
    name, _, leaf = rest.rpartition(".")
    if name not in _VAE_ATTENTION:
        return None
    return f"{side}.mid_block.attentions.0.{_VAE_ATTENTION[name]}.{leaf}", name != "norm" and leaf == "weight"


_OPEN_CLIP_TOP = {"positional_embedding": "text_model.embeddings.position_embedding.weight",
                  "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
                  "ln_final.weight": "text_model.final_layer_norm.weight",
                  "ln_final.bias": "text_model.final_layer_norm.bias"}
_OPEN_CLIP_LAYER = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
                    "attn.out_proj": "self_attn.out_proj"}


def open_clip_keys(key: str) -> list[tuple[str, int | None, bool]]:
    """An OpenCLIP text-tower key (without its ``conditioner.embedders.{1,0}.model.``: the base's, the refiner's)
    -> [(transformers name, third of
    a fused in_proj or None, transpose)]; [] if no rule fits."""
    if key in _OPEN_CLIP_TOP:
        return [(_OPEN_CLIP_TOP[key], None, False)]
    if key == "text_projection":
        return [("text_projection.weight", None, True)]
    m = re.fullmatch(r"transformer\.resblocks\.(\d+)\.(.+)\.(weight|bias)", key)
    m_fused = re.fullmatch(r"transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)", key)
    if m_fused:
        layer, leaf = m_fused[1], m_fused[2]
        return [(f"text_model.encoder.layers.{layer}.self_attn.{p}_proj.{leaf}", part, False)
                for part, p in enumerate("qkv")]
    if m and m[2] in _OPEN_CLIP_LAYER:
        return [(f"text_model.encoder.layers.{m[1]}.{_OPEN_CLIP_LAYER[m[2]]}.{m[3]}", None, False)]
    return []


# --- plans: which tensor fills which parameter ----------------------------------------------------------------

def _strip_text_model(component: Component, key: str) -> str:
    """transformers < 5 saved CLIPTextModel with a ``text_model.`` level the module does not have."""
    if key.startswith("text_model.") and not any(k.startswith("text_model.") for k in component.shapes):
        return key[len("text_model."):]
    return key


def plan_component(component: Component, infos: Mapping[str, TensorInfo],
                   layout: str) -> tuple[dict[str, Source], list[str]]:
    """{parameter: Source} for ``component`` from ``infos`` (keys without their component prefix); and the keys
    no rule maps to a parameter (buffers such as ``position_ids`` are skipped).

    Args:
        layout: "diffusers" (the modules' own names: a diffusers/transformers component file) or "ldm"
            (the original layout: LDM UNet and VAE names, OpenCLIP names for text_encoder_2;
            text_encoder's CLIP-L is stored with transformers' names in either).
    """
    plan, unexpected = {}, []
    tables = unet_block_tables(component.config) if component.name == "unet" else None
    for key, info in infos.items():
        if key.rsplit(".", 1)[-1] in BUFFERS:
            continue
        targets: list[tuple[str, Source]] = []
        if layout == "diffusers" or component.name == "text_encoder":
            targets = [(_strip_text_model(component, key), Source(info))]
        elif component.name == "unet":
            name = unet_key(key, tables)
            targets = [(name, Source(info))] if name else []
        elif component.name == "vae":
            found = vae_key(key, len(component.config.block_out_channels))
            if found:
                targets = [(found[0], Source(info, squeeze=found[1] and len(info.shape) in (3, 4)))]
        else:
            targets = [(_strip_text_model(component, name), Source(info, part=part, transpose=transpose))
                       for name, part, transpose in open_clip_keys(key)]
        if not targets or any(name not in component.shapes for name, _ in targets):
            unexpected.append(key)
            continue
        plan.update(targets)
    return plan, unexpected


def read_planned(component: Component, plan: Mapping[str, Source], unexpected: list[str], where: str, dtype,
                 place: Callable[[np.ndarray], object] = np.asarray) -> dict:
    """Check ``plan`` against ``component`` (the folder loader's checks and messages), then read, convert,
    cast to ``dtype`` and ``place`` each parameter, one tensor at a time in file order (memory-mapped).

    Returns {module key: placed array} in the module's order and layout (conv kernels (kh, kw, in, out)).
    Raises ModelLoadError: missing or unexpected keys, a shape the config does not expect, a non-float dtype.
    """
    _check(component, where, {k: module_shape(s.shape) for k, s in plan.items()},
           {k: s.info.dtype for k, s in plan.items()}, unexpected)
    out = {}
    for target, array in _read_safetensors({k: s.info for k, s in plan.items()}):
        array = plan[target].apply(array)
        out[target] = place(np.ascontiguousarray(to_module_layout(array)).astype(dtype, copy=False))
    return {k: out[k] for k in component.shapes}


# --- whole single files ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Checkpoint:
    """An SDXL single file, inspected from its header (no tensor read).

    Attributes:
        path: the file.
        parts: component name -> {key without its sgm prefix: TensorInfo}.
        leftovers: keys that belong to no component (EMA copies, another model's text encoder...).
        prediction_type: "v_prediction" when the file carries the ``v_pred`` marker, else None (the config's).
        zero_snr: True when the file carries the ``ztsnr`` marker (rescale_betas_zero_snr).
        refiner: an SDXL refiner's file (:data:`REFINER_PREFIXES`: no text_encoder), else a base-type one.
    """

    path: Path
    parts: dict[str, dict[str, TensorInfo]]
    leftovers: list[str]
    prediction_type: str | None = None
    zero_snr: bool = False
    refiner: bool = False

    @property
    def prefixes(self) -> dict[str, str]:
        """Component name -> its prefix in this file (:data:`PREFIXES`, or :data:`REFINER_PREFIXES`)."""
        return REFINER_PREFIXES if self.refiner else PREFIXES

    def scheduler_changes(self) -> dict:
        """The scheduler config fields the file's markers set (what ComfyUI and A1111 read from them)."""
        changes = {}
        if self.prediction_type:
            changes["prediction_type"] = self.prediction_type
        if self.zero_snr:
            changes["rescale_betas_zero_snr"] = True
        return changes


def is_single_file_name(name: str) -> bool:
    """Whether ``--model NAME`` names one safetensors file (a local path or a hub ``owner/repo/file.safetensors``)."""
    return name.endswith(SINGLE_FILE_SUFFIX)


def _has(keys, prefix: str) -> bool:
    return any(k.startswith(prefix) for k in keys)


def is_refiner_file(keys) -> bool:
    """Whether a single file's ``keys`` are an SDXL refiner's: OpenCLIP as embedder 0 and no embedder 1.

    diffusers' ``infer_diffusers_model_type`` tests one full-size key (``conditioner.embedders.0.model.transformer.
    resblocks.9.mlp.c_proj.bias``, "xl_refiner"); the prefix rule here holds for a text tower of any depth."""
    return _has(keys, REFINER_PREFIXES["text_encoder_2"]) and not _has(keys, "conditioner.embedders.1.")


def identify(path: Path, keys: list[str]) -> str:
    """What an SDXL single file is: "base" (a base-type file: CLIP-L and OpenCLIP) or "refiner"
    (:func:`is_refiner_file`, with a UNet); else raise ModelLoadError naming what the file is.

    Refused, each by name: SD3 (``joint_blocks``), Flux (``double_blocks``), Playground v2.5 (``edm_mean``:
    an EDM scheduler), SD 1.x (``cond_stage_model.transformer``) and
    2.x (``cond_stage_model.model``) without SDXL's ``conditioner``, a component alone (use --unet/--vae),
    anything else (its first keys named). The keys are diffusers' ``CHECKPOINT_KEY_NAMES`` families.
    """
    if any(re.match(r"(model\.diffusion_model\.)?joint_blocks\.", k) for k in keys):
        raise ModelLoadError(f"{path} is a Stable Diffusion 3 checkpoint (joint_blocks.*); this engine runs SDXL")
    if any(re.match(r"(model\.diffusion_model\.)?double_blocks\.", k) for k in keys):
        raise ModelLoadError(f"{path} is a Flux checkpoint (double_blocks.*); this engine runs SDXL")
    if "edm_mean" in keys:
        raise ModelLoadError(f"{path} is a Playground v2.5 checkpoint (edm_mean): SDXL's architecture with an EDM "
                             "scheduler and latent statistics this engine does not implement")
    if is_refiner_file(keys) and _has(keys, REFINER_PREFIXES["unet"]):
        return "refiner"
    sdxl = _has(keys, PREFIXES["text_encoder_2"]) and _has(keys, PREFIXES["unet"])
    if not sdxl and _has(keys, "cond_stage_model.transformer."):
        raise ModelLoadError(f"{path} is a Stable Diffusion 1.x checkpoint (cond_stage_model.transformer.*, one CLIP "
                             "text encoder); this engine runs SDXL")
    if not sdxl and _has(keys, "cond_stage_model.model."):
        raise ModelLoadError(f"{path} is a Stable Diffusion 2.x checkpoint (cond_stage_model.model.*, OpenCLIP-H); "
                             "this engine runs SDXL")
    if sdxl:
        return "base"
    if _has(keys, "model.diffusion_model.") or "conv_in.weight" in keys or _has(keys, "down_blocks."):
        raise ModelLoadError(f"{path} holds a UNet alone; pass it as --unet PATH, with --model for the other parts")
    if _has(keys, "first_stage_model.") or _has(keys, "encoder.down") or "decoder.conv_in.weight" in keys:
        raise ModelLoadError(f"{path} holds a VAE alone; pass it as --vae PATH, with --model for the other parts")
    raise ModelLoadError(f"{path} is not an SDXL single-file checkpoint: none of its keys are SDXL's "
                         f"(model.diffusion_model.*, conditioner.embedders.1.model.*); first keys: "
                         f"{', '.join(sorted(keys)[:3])}")


def inspect_checkpoint(path: Path) -> Checkpoint:
    """Read ``path``'s header, identify it (:func:`identify`: a base-type or a refiner file) and split its keys by
    component (:attr:`Checkpoint.prefixes`).

    Raises:
        ModelLoadError: not readable safetensors, truncated, or not an SDXL single file (naming what it is).
    """
    infos = read_safetensors_header(path)
    keys = list(infos)
    refiner = identify(path, keys) == "refiner"
    prefixes = REFINER_PREFIXES if refiner else PREFIXES
    parts: dict[str, dict[str, TensorInfo]] = {name: {} for name in prefixes}
    leftovers = []
    for key, info in infos.items():
        if key in MARKERS or key in NOT_WEIGHTS:
            continue
        for name, prefix in prefixes.items():
            if key.startswith(prefix):
                parts[name][key[len(prefix):]] = info
                break
        else:
            leftovers.append(key)
    return Checkpoint(path=path, parts=parts, leftovers=leftovers,
                      prediction_type="v_prediction" if "v_pred" in infos else None, zero_snr="ztsnr" in infos,
                      refiner=refiner)


def _group(key: str) -> str:
    """A component's sgm prefix (``model.diffusion_model.*``), else the key's first name (``model_ema.*``)."""
    prefix = next((p for p in (*PREFIXES.values(), REFINER_PREFIXES["text_encoder_2"]) if key.startswith(p)), None)
    return prefix + "*" if prefix else key.split(".", 1)[0] + (".*" if "." in key else "")


def describe_leftovers(keys: list[str]) -> str:
    """``12 tensors: model_ema.* (10), cond_stage_model.* (2)``: the keys grouped by component prefix or first name."""
    groups = Counter(_group(k) for k in keys)
    return f"{len(keys)} tensor{'s' * (len(keys) != 1)}: " + ", ".join(f"{g} ({n})" for g, n in groups.most_common())


def load_checkpoint_params(checkpoint: Checkpoint, components: Mapping[str, Component], dtype,
                           place: Callable[[np.ndarray], object] = np.asarray, skip: tuple[str, ...] = (),
                           log: Callable[[str], None] = LOG.info) -> dict[str, dict]:
    """Every component's parameters from an inspected single file (the components in ``skip`` are not read:
    --unet/--vae replace them).

    Args:
        components: name -> Component (from the --model-config folder's configs; a refiner file's: text_encoder_2,
            unet and vae).
        dtype: target dtype; place: as in :func:`.weights.load_params`.
    Returns:
        {component: {module key: placed array}} for the components not skipped.
    Raises:
        ModelLoadError: a component absent from the file (and not skipped), or the first component whose tensors
            do not fit its config (missing ones named, the first few), all before any tensor is read; see
            :func:`read_planned`.
    """
    plans, prefixes = {}, checkpoint.prefixes
    for name, component in components.items():
        if name in skip:
            continue
        if not checkpoint.parts[name]:  # some fine-tunes ship without a VAE ("no VAE baked in")
            flag = f"; pass --{name} PATH" if name in ("unet", "vae") else ""
            raise ModelLoadError(f"{checkpoint.path} has no {name} (no {prefixes[name]}* tensors){flag}")
        plan, unexpected = plan_component(component, checkpoint.parts[name], "ldm")
        where = f"{checkpoint.path} ({name}, {prefixes[name]}*)"
        _check(component, where, {k: module_shape(s.shape) for k, s in plan.items()},
               {k: s.info.dtype for k, s in plan.items()}, [prefixes[name] + k for k in unexpected])
        plans[name] = (plan, where)
    unused = [f"not used, {describe_leftovers(checkpoint.leftovers)}"] if checkpoint.leftovers else []
    unused += [f"{prefixes[name]}* ({len(checkpoint.parts[name])}) replaced by --{name}" for name in skip
               if checkpoint.parts[name]]
    if unused:
        log(f"[sdxl_engine] {checkpoint.path.name}: {'; '.join(unused)}")
    return {name: read_planned(components[name], plan, [], where, dtype, place)
            for name, (plan, where) in plans.items()}


def component_layout(component: Component, keys: list[str]) -> tuple[str, str]:
    """(prefix, layout) of a component's own file: the prefix its keys carry ("" for none) and "diffusers" when
    its keys are the modules' names, else "ldm"."""
    prefix = next((p for p in COMPONENT_PREFIXES[component.name] if _has(keys, p)), "")
    inner = [k[len(prefix):] for k in keys if k.startswith(prefix)]
    own = set(component.shapes)
    # Some names are the same in both (the VAE's conv_in, quant_conv): the layout is the one most keys have.
    same = sum(_strip_text_model(component, k) in own for k in inner)
    return prefix, "diffusers" if same * 2 > len(inner) else "ldm"


def load_component_file(component: Component, path: Path, dtype,
                        place: Callable[[np.ndarray], object] = np.asarray,
                        log: Callable[[str], None] = LOG.info) -> dict:
    """One component's parameters from a file of its own (``--unet`` / ``--vae``): diffusers or LDM layout,
    keys with or without the component prefix (``model.diffusion_model.``/``unet.``, ``first_stage_model.``/
    ``vae.``); keys under no such prefix in a prefixed file are named in one log line, not used.

    Raises ModelLoadError: unreadable or truncated file, missing/unexpected keys, shapes or dtypes that do not
    fit the config.
    """
    infos = read_safetensors_header(path)
    prefix, layout = component_layout(component, list(infos))
    inner = {k[len(prefix):]: v for k, v in infos.items() if k.startswith(prefix)}
    others = [k for k in infos if not k.startswith(prefix)]
    if others:
        log(f"[sdxl_engine] {path.name}: not used (not {component.name}), {describe_leftovers(others)}")
    plan, unexpected = plan_component(component, inner, layout)
    where = f"{path} ({component.name}, {layout} layout{f', {prefix}*' if prefix else ''})"
    return read_planned(component, plan, [prefix + k for k in unexpected], where, dtype, place)
