"""A diffusers-format SDXL folder (local, built in, or from the hub) -> a :class:`LoadedModel`.

The folder layout is diffusers': ``model_index.json``, then ``unet/``, ``vae/``,
``text_encoder/``, ``text_encoder_2/`` (``config.json`` + weights, see :mod:`.weights`),
``tokenizer/`` and ``tokenizer_2/`` (CLIP BPE: vocab.json + merges.txt, or tokenizer.json) and
``scheduler/scheduler_config.json``. PyTorch and Flax class names are both accepted in
``model_index.json``. Every failure is one :class:`~.weights.ModelLoadError` line that names the
path and what to do.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub import constants as hub_constants
from transformers import CLIPTokenizer

from sdxl_engine.checkpoint import builtin, recipes, single_file
from sdxl_engine.checkpoint.weights import PICKLE_SUFFIXES, ModelLoadError, find_weight_files, load_params
from sdxl_engine.checkpoint.writing import VOCABULARY_FILE

# Optional in a model folder: the sampler, steps and guidance it chooses for requests that set none (one JSON
# object, keys of config.MODEL_DEFAULT_FIELDS; "_" keys are notes); a deployment's explicit setting wins.
from sdxl_engine.config import ENGINE_DEFAULTS_FILE
from sdxl_engine.models import COMPONENTS, Component, build_component
from sdxl_engine.models.random_weights import random_params
from sdxl_engine.program.schedulers import UnsupportedSchedulerConfig, check_scheduler_config

__all__ = ["LoadedModel", "ModelKind", "ModelLoadError", "load_model", "resolve_dtype", "read_model_folder",
           "read_model_kind", "engine_defaults"]

LOG = logging.getLogger(__name__)
# model_index.json's _class_name: diffusers' SDXL pipelines. What a model can do is read from its files
# (ModelKind), not from this name: a base model saved by the img2img pipeline is still a base model.
PIPELINES = ("StableDiffusionXLPipeline", "FlaxStableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline",
             "StableDiffusionXLInpaintPipeline")
TOKENIZERS = ("CLIPTokenizer", "CLIPTokenizerFast")
OPTIONAL_COMPONENTS = ("text_encoder",)  # the refiner has text_encoder_2 only (model_index.json: [null, null])
TOKENIZER_OF = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}
# The setting a model comes from (as errors name it) -> what it is, the real weights to suggest and the folder to
# download them to. The refiner loads through the same functions as the model, so its errors must name --refiner
# and the refiner's weights, not --model and the base's.
MODEL_FLAGS = {"--model": ("SDXL model", "stabilityai/stable-diffusion-xl-base-1.0", "sdxl-base"),
               "--refiner": ("SDXL refiner", "stabilityai/stable-diffusion-xl-refiner-1.0", "sdxl-refiner")}


def _hub_hint(flag: str = "--model") -> str:
    """What to pass as ``flag`` for real SDXL weights (the end of a load error)."""
    _, repo, local = MODEL_FLAGS[flag]
    builtins = ("Built-in models: " + ", ".join(builtin.BUILTIN_NAMES) if flag == "--model"
                else "No built-in model is a refiner")
    return (f"Real SDXL needs its weights: on a machine that reaches the Hugging Face Hub use the hub id "
            f"({flag} {repo}), or download once (hf download {repo} --local-dir {local}) and start with "
            f"{flag} ./{local}. {builtins}")


# Files a hub snapshot needs besides the weights (never pickles).
_HUB_META = ("model_index.json", "scheduler/scheduler_config.json", "tokenizer/", "tokenizer_2/", ENGINE_DEFAULTS_FILE)


# SDXL's standard aspect buckets at 1024 px (Podell et al. 2023, appendix), width x height.
SDXL_BUCKETS = ((1024, 1024), (1152, 896), (896, 1152), (1216, 832), (832, 1216), (1344, 768), (768, 1344),
                (1536, 640), (640, 1536))


def size_buckets(native: int, multiple: int) -> tuple[tuple[int, int], ...]:
    """SDXL's aspect buckets scaled to a model whose native size is ``native`` pixels.

    Each side is rounded to ``multiple`` (what the VAE and UNet downsampling need); duplicates
    after rounding are dropped, order kept.
    """
    out = []
    for w, h in SDXL_BUCKETS:
        size = (max(multiple, round(w * native / 1024 / multiple) * multiple),
                max(multiple, round(h * native / 1024 / multiple) * multiple))
        if size not in out:
            out.append(size)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ModelKind:
    """What a model's files declare it is, read from model_index.json and the component configs
    (:func:`model_kind`), so a refiner and an inpainting UNet load as what they are.

    Attributes:
        text_encoders: the CLIP text encoders it has: ("text_encoder", "text_encoder_2") for SDXL base and
            its inpainting model, ("text_encoder_2",) for the refiner.
        time_ids: the UNet's added time ids: 6 (original size, crop top-left, target size) or 5 (original
            size, crop, aesthetic score: the refiner), from projection_class_embeddings_input_dim =
            time_ids x addition_time_embed_dim + text_encoder_2's projection_dim (diffusers'
            StableDiffusionXLImg2ImgPipeline._get_add_time_ids).
        unet_in_channels: the UNet's input channels: the VAE's latent channels (4), or 2 x latent + 1 (9:
            latents, mask, masked-image latents: an inpainting UNet).
        latent_channels: the VAE's latent channels.
        requires_aesthetics_score: model_index.json's flag (the refiner's: true).
        force_zeros_for_empty_prompt: model_index.json's flag (base: true, the refiner: false): an empty
            negative prompt is zeros rather than the encoded empty text.
    """

    text_encoders: tuple[str, ...] = ("text_encoder", "text_encoder_2")
    time_ids: int = 6
    unet_in_channels: int = 4
    latent_channels: int = 4
    requires_aesthetics_score: bool = False
    force_zeros_for_empty_prompt: bool = True

    @property
    def inpainting_unet(self) -> bool:
        """Whether the UNet takes [latents, mask, masked-image latents] (diffusers' 9-channel inpainting UNet)."""
        return self.unet_in_channels == 2 * self.latent_channels + 1

    @property
    def refiner(self) -> bool:
        """Whether this is an SDXL refiner (one text encoder, aesthetic-score time ids)."""
        return self.time_ids == 5 or "text_encoder" not in self.text_encoders

    def txt2img_refusal(self, name: str) -> str | None:
        """Why model ``name`` cannot serve text-to-image, or None when it can."""
        if self.refiner:
            return (f"{name} is an SDXL refiner ({' + '.join(self.text_encoders)}, {self.time_ids} time ids with "
                    "an aesthetic score): it refines another model's images and cannot make images from text; "
                    "serve an SDXL base model (for example --model stabilityai/stable-diffusion-xl-base-1.0) "
                    f"with {name} as --refiner")
        if self.inpainting_unet:
            return (f"{name} has an inpainting UNet ({self.unet_in_channels} input channels: latents, mask and "
                    "masked-image latents): it repaints masked regions of an image and cannot make images from "
                    "text alone; serve an SDXL base model (for example --model "
                    "stabilityai/stable-diffusion-xl-base-1.0)")
        return None


def model_kind(index: dict, components: dict[str, Component]) -> ModelKind:
    """The :class:`ModelKind` of a folder's model_index.json ``index`` and its checked ``components``."""
    unet, te2 = components["unet"].config, components["text_encoder_2"].config
    return ModelKind(
        text_encoders=tuple(n for n in ("text_encoder", "text_encoder_2") if n in components),
        time_ids=(unet.projection_class_embeddings_input_dim - te2.projection_dim) // unet.addition_time_embed_dim,
        unet_in_channels=unet.in_channels, latent_channels=components["vae"].config.latent_channels,
        requires_aesthetics_score=bool(index.get("requires_aesthetics_score", False)),
        force_zeros_for_empty_prompt=bool(index.get("force_zeros_for_empty_prompt", True)))


@dataclasses.dataclass
class LoadedModel:
    """Everything the compiled program needs from a model.

    Attributes:
        name: what the user asked for (built-in name, directory or hub id).
        components: {"text_encoder" (not in a refiner), "text_encoder_2", "unet", "vae"} -> Component
            (config, static module graph, parameter names and shapes).
        params: the same keys -> {checkpoint key: array} in ``dtype``, each put on the devices (load_folder's
            ``sharding``) as soon as it was read.
        tokenizer, tokenizer_2: transformers CLIPTokenizers (77 tokens each); ``tokenizer`` is None for a
            refiner (no text_encoder).
        scheduler_config: scheduler/scheduler_config.json as a dict.
        dtype: parameter dtype name ("float32", "bfloat16", "float16").
        load_s: seconds spent loading (and creating a built-in model the first time).
        source: the folder the files were read from ("" for weights made in memory).
        vocabulary: the words the model was trained on (its folder's vocabulary.txt), or None
            when unknown (real SDXL): prompts' other words get a warning.
        engine_defaults: the settings its folder's engine_defaults.json chooses ({} without one);
            the engine applies them with EngineConfig.with_model_defaults.
    """

    name: str
    components: dict[str, Component]
    params: dict[str, dict[str, Any]]
    tokenizer: Any
    tokenizer_2: Any
    scheduler_config: dict
    dtype: str
    load_s: float = 0.0
    source: str = ""
    vocabulary: frozenset[str] | None = None
    engine_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The few-step recipe its --unet file's or its own name matched (checkpoint/recipes.py; :func:`with_recipe`),
    # applied to ``scheduler_config`` and, where its folder has no engine_defaults.json, to ``engine_defaults``.
    recipe: recipes.Recipe | None = None
    kind: ModelKind = ModelKind()  # what the files declare (read_model_folder); SDXL base for built models
    # The SDXL refiner the engine attached to this base (--refiner; :func:`check_refiner` passed): its components
    # and kind are the program's refiner expert; its params (text_encoder_2, unet) go in the program's
    # params["refiner"]. None: no refiner.
    refiner: LoadedModel | None = None
    # The ControlNets the engine loaded beside this model (--controlnet; checkpoint/controlnet.py), by name: their
    # Components are the programs' (ProgramShape.controlnets names architectures); their params go in each request's
    # params["controlnet"]. Empty: none.
    controlnets: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The IP-Adapters the engine loaded beside this model (--ip-adapter; checkpoint/ip_adapter.py), by name: their
    # Components are the programs' (ProgramShape.ip_adapters names architectures); their params go in each request's
    # params["ip_adapter"]. Empty: none.
    ip_adapters: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def unet(self):
        return self.components["unet"].config

    @property
    def vae(self):
        return self.components["vae"].config

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell along each side: 2 ** (VAE blocks - 1); 8 for SDXL."""
        return self.vae.scale_factor

    @property
    def native_size(self) -> int:
        """The model's training resolution in pixels (1024 for SDXL base): UNet sample_size x VAE factor."""
        return self.unet.sample_size * self.vae_scale_factor

    @property
    def size_multiple(self) -> int:
        """Every image side must be a multiple of this many pixels (VAE factor x UNet downsampling)."""
        return self.vae_scale_factor * 2 ** self.unet.downsampling

    @property
    def latent_channels(self) -> int:
        """The VAE's latent channels (the UNet's input has more for an inpainting UNet: ModelKind)."""
        return self.vae.latent_channels

    def size_buckets(self) -> tuple[tuple[int, int], ...]:
        """SDXL's aspect buckets (width, height) scaled to this model's native size."""
        return size_buckets(self.native_size, self.size_multiple)


class RefinerMismatch(ModelLoadError):
    """A ``--refiner`` that cannot continue the base model's latents: not a refiner, or another latent space."""


def check_refiner(base: LoadedModel, refiner: LoadedModel) -> None:
    """Check that ``refiner`` can take over ``base``'s latents mid-loop (diffusers' ensemble of experts hands the
    base's latents to the refiner as they are, ``StableDiffusionXLImg2ImgPipeline(image=latents)``).

    Refused: a base model with an inpainting UNet; a model that is not an SDXL refiner
    (:attr:`ModelKind.refiner`: text_encoder_2 only) or whose UNet takes other than its VAE's latent channels (an
    inpainting UNet); a VAE with other latent channels, scaling or shift factor than the base's (the latents would
    mean something else to it); a tokenizer_2 other than the base's (the program encodes the base's tokenizer_2 ids
    with the refiner's text encoder).

    Raises RefinerMismatch naming both models and the value that differs.
    """
    def refuse(why: str) -> None:
        raise RefinerMismatch(f"--refiner {refiner.name}: {why}; it cannot refine {base.name}'s latents")

    if not refiner.kind.refiner:
        refuse(f"not an SDXL refiner ({' + '.join(refiner.kind.text_encoders)}, {refiner.kind.time_ids} time ids): "
               "a refiner has text_encoder_2 only (stabilityai/stable-diffusion-xl-refiner-1.0)")
    if base.kind.inpainting_unet:  # the refiner continues a plain UNet's latents; an inpainting model's steps differ
        refuse(f"{base.name} has an inpainting UNet ({base.kind.unet_in_channels} input channels), whose steps a "
               "refiner's plain UNet cannot take over here; serve the refiner with a base model")
    if refiner.kind.unet_in_channels != refiner.latent_channels:
        refuse(f"its UNet takes {refiner.kind.unet_in_channels} input channels, not its VAE's "
               f"{refiner.latent_channels} latent channels")
    for what, mine, theirs in (("latent channels", refiner.latent_channels, base.latent_channels),
                               ("VAE scaling_factor", refiner.vae.scaling_factor, base.vae.scaling_factor),
                               ("VAE shift_factor", refiner.vae.shift_factor, base.vae.shift_factor),
                               ("VAE scale factor (pixels per latent)", refiner.vae_scale_factor,
                                base.vae_scale_factor)):
        if mine != theirs:
            refuse(f"its {what} is {mine}, the base's {theirs}")
    tokenizers = (refiner.tokenizer_2, base.tokenizer_2)
    if (tokenizers[0].get_vocab() != tokenizers[1].get_vocab()
            or tokenizers[0].pad_token_id != tokenizers[1].pad_token_id):
        refuse("its tokenizer_2 differs from the base's (vocabulary or pad token)")


def resolve_dtype(name: str, platform: str) -> str:
    """``auto`` -> bfloat16 on TPU/GPU, float32 on CPU; other names pass through."""
    if name != "auto":
        return name
    return "float32" if platform == "cpu" else "bfloat16"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing; a diffusers-format SDXL folder has it") from None
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: not readable JSON ({type(err).__name__}: {err})") from err


def read_model_folder(folder: Path) -> dict[str, Component]:
    """Check ``model_index.json`` and build every component from its config.json (no weights).

    Returns {"text_encoder" (absent for a refiner), "text_encoder_2", "unet", "vae"} -> Component; what the
    model is (base, refiner, inpainting UNet) is :func:`read_model_kind`'s.

    Raises:
        ModelLoadError: not a diffusers folder, not SDXL (an SD 1.x/2.x folder), a required component
            missing or of an unknown class, a config the modules do not support, or components whose
            sizes do not fit together.
    """
    return _read_index_and_components(folder)[1]


def read_model_kind(folder: Path) -> ModelKind:
    """What the model in ``folder`` is (:class:`ModelKind`), from its files. Raises as :func:`read_model_folder`."""
    index, components = _read_index_and_components(folder)
    return model_kind(index, components)


def _read_index_and_components(folder: Path, flag: str = "--model") -> tuple[dict, dict[str, Component]]:
    index = _read_json(folder / "model_index.json")
    kind = index.get("_class_name", "?")
    if kind not in PIPELINES:
        what = ("an SD 1.x/2.x folder" if kind in ("StableDiffusionPipeline", "FlaxStableDiffusionPipeline")
                else "not an SDXL pipeline")
        raise ModelLoadError(f"{folder} holds a {kind} ({what}); this engine runs SDXL: a StableDiffusionXLPipeline "
                             "with text_encoder_2 and a text_time UNet. " + _hub_hint(flag))
    components = {}
    for name, (_, _, classes) in COMPONENTS.items():
        entry = index.get(name)
        if not entry or entry[-1] is None:
            if name in OPTIONAL_COMPONENTS and name in index:  # declared absent ([null, null]): a refiner
                continue
            raise ModelLoadError(f"{folder}/model_index.json has no {name}; SDXL text-to-image needs "
                                 f"{', '.join(COMPONENTS)} (a refiner: text_encoder_2, unet, vae)")
        if entry[-1] not in classes:
            raise ModelLoadError(f"{folder}: {name} is a {entry[-1]}; expected {' or '.join(classes)}")
        config_path = folder / name / "config.json"
        try:
            components[name] = build_component(name, _read_json(config_path))
        except (ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{config_path}: {err}") from err
    for encoder, name in TOKENIZER_OF.items():
        entry = index.get(name)
        if encoder in components and (not entry or entry[-1] not in TOKENIZERS):
            raise ModelLoadError(f"{folder}/model_index.json: {name} must be a CLIPTokenizer, got {entry}")
    _check_sizes(folder, components)
    return index, components


def _check_sizes(folder: Path, c: dict[str, Component]) -> None:
    """Refuse components whose sizes do not fit together (ModelLoadError naming both sides)."""
    unet, te2 = c["unet"].config, c["text_encoder_2"].config
    encoders = [n for n in ("text_encoder", "text_encoder_2") if n in c]
    hidden = sum(c[n].config.hidden_size for n in encoders)
    if any(d != hidden for d in unet.cross_attention_dim):
        what = ("the two text encoders' hidden sizes together "
                f"({' + '.join(str(c[n].config.hidden_size) for n in encoders)})" if len(encoders) == 2
                else f"text_encoder_2's hidden size ({hidden}), the one text encoder of a refiner")
        raise ModelLoadError(f"{folder}: unet cross_attention_dim {unet.cross_attention_dim} must equal {what}")
    extra = unet.projection_class_embeddings_input_dim - te2.projection_dim
    if extra not in (6 * unet.addition_time_embed_dim, 5 * unet.addition_time_embed_dim):
        raise ModelLoadError(f"{folder}: unet projection_class_embeddings_input_dim "
                             f"{unet.projection_class_embeddings_input_dim} must be 6 x addition_time_embed_dim + "
                             f"text_encoder_2 projection_dim = {6 * unet.addition_time_embed_dim + te2.projection_dim}"
                             f" (a refiner: 5 x ... = {5 * unet.addition_time_embed_dim + te2.projection_dim})")
    latent = c["vae"].config.latent_channels
    if unet.in_channels not in (latent, 2 * latent + 1):
        raise ModelLoadError(f"{folder}: unet in_channels {unet.in_channels} must be the vae's latent_channels "
                             f"{latent} (or {2 * latent + 1} for an inpainting UNet: latents, mask, masked image)")
    if unet.out_channels != latent:
        raise ModelLoadError(f"{folder}: unet out_channels {unet.out_channels} must be the vae's latent_channels "
                             f"{latent}")


def _tokenizer(folder: Path):
    try:
        return CLIPTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as err:
        raise ModelLoadError(f"{folder}: not a CLIP tokenizer (vocab.json + merges.txt or tokenizer.json): "
                             f"{type(err).__name__}: {err}") from err


def load_folder(folder: Path, name: str, dtype: str, sharding=None, variant: str = "",
                log: Callable[[str], None] = LOG.info, swaps: dict[str, str] | None = None,
                flag: str = "--model") -> LoadedModel:
    """Load every component of a diffusers-format SDXL folder.

    Args:
        folder: the model folder; name: what to call it in logs and images.
        dtype: "float32", "bfloat16" or "float16" (the parameters' dtype).
        sharding: where each parameter goes as soon as it is read (``jax.device_put``), so no
            host copy of the whole model is held; None = the default device.
        variant: preferred weight variant ("fp16"); others are used when it is absent.
        swaps: {"unet" or "vae": path} read in place of the folder's component (:func:`swap_source`).
        flag: the setting the folder comes from, as errors name it ("--model" or "--refiner").
    Raises:
        ModelLoadError: see :func:`read_model_folder`, :func:`swap_source` and :mod:`.weights`.
    """
    start = time.perf_counter()
    index, components = _read_index_and_components(folder, flag)
    scheduler_config = read_scheduler_config(folder)  # before the weights: a refused config fails fast
    target = jnp.dtype(dtype)
    place = lambda array: jax.device_put(array, sharding)  # noqa: E731
    params = _swapped(components, swaps or {}, target, place, log)
    read = []  # one log line for the folder's weight files, not one per component
    for cname, component in components.items():
        if cname in params:
            continue
        files = find_weight_files(folder / cname, variant)
        params[cname] = load_params(component, files, target, place)
        read.append(f"{cname} {files[0].name}{f' (+{len(files) - 1} shards)' if len(files) > 1 else ''}")
    if read:
        log(f"[sdxl_engine] weights: {', '.join(read)}")
    return LoadedModel(
        name=name, components=components, params=params,
        tokenizer=_tokenizer(folder / "tokenizer") if "text_encoder" in components else None,
        tokenizer_2=_tokenizer(folder / "tokenizer_2"), scheduler_config=scheduler_config, dtype=dtype,
        load_s=time.perf_counter() - start, source=str(folder), vocabulary=_vocabulary(folder),
        engine_defaults=read_engine_defaults(folder), kind=model_kind(index, components))


def reload_params(model: LoadedModel, sharding=None, variant: str = "",
                  log: Callable[[str], None] = LOG.info) -> dict[str, dict[str, Any]]:
    """The weights of a model loaded before, read again from its ``source`` (a diffusers folder's weight files, or a
    single file) with the components it has already (no config read, no module graph built: a reload costs the
    reading of the weights). For a model the engine dropped from the devices (engine/residency.py).

    Returns {component: {checkpoint key: array on ``sharding``}} in the model's dtype.
    Raises ModelLoadError: no source (a model made in memory), or files that no longer fit its components."""
    if not model.source:
        raise ModelLoadError(f"{model.name} was made in memory; it has no files to read again")
    source, target = Path(model.source), jnp.dtype(model.dtype)
    place = lambda array: jax.device_put(array, sharding)  # noqa: E731
    if source.is_file():
        return single_file.load_checkpoint_params(single_file.inspect_checkpoint(source), model.components, target,
                                                  place, log=log)
    return {name: load_params(component, find_weight_files(source / name, variant), target, place)
            for name, component in model.components.items()}


def read_scheduler_config(folder: Path) -> dict:
    """``folder``'s scheduler/scheduler_config.json, checked: every sampler follows it as diffusers would.

    Raises ModelLoadError naming the file and the first field no sampler of the engine
    implements (schedulers.check_scheduler_config); such a model is refused, never run with
    the field ignored.
    """
    path = folder / "scheduler" / "scheduler_config.json"
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {config!r:.80}")
    try:
        check_scheduler_config(config)
    except UnsupportedSchedulerConfig as err:
        raise ModelLoadError(f"{path}: {err}") from None
    return config


def _vocabulary(folder: Path) -> frozenset[str] | None:
    path = folder / VOCABULARY_FILE
    return frozenset(path.read_text().split()) if path.is_file() else None


def read_engine_defaults(folder: Path) -> dict[str, Any]:
    """``folder``'s engine_defaults.json without its ``_`` notes; {} when it has none.

    Raises ModelLoadError for a file that is not a JSON object.
    """
    path = folder / ENGINE_DEFAULTS_FILE
    if not path.is_file():
        return {}
    values = _read_json(path)
    if not isinstance(values, dict):
        raise ModelLoadError(f"{path}: expected a JSON object such as {{\"sampler\": \"Euler\"}}, got {values!r:.80}")
    return {k: v for k, v in values.items() if not k.startswith("_")}


def engine_defaults(model: str) -> dict[str, Any]:
    """The engine defaults of ``model`` that can be read before loading it: the shipped tiny-shapes' and a
    local folder's; else the few-step recipe its name matches (checkpoint/recipes.py: a folder, single file or hub
    id named as SDXL-Turbo's, Lightning's, ...); {} for the other built-ins and hub ids (a hub folder's own file is
    read once downloaded, when the engine loads it)."""
    if model == "tiny-shapes":
        return read_engine_defaults(builtin.TINY_SHAPES_DIR)
    if model in builtin.BUILTIN_NAMES:
        return {}
    folder = Path(model).expanduser()
    if folder.is_dir() and (folder / ENGINE_DEFAULTS_FILE).is_file():
        return read_engine_defaults(folder)
    recipe = recipes.find(model)
    return {} if recipe is None else recipe.engine_defaults()


# A model folder's own LoRAs, {"name": "file.safetensors"} (a file of the folder): tiny-shapes ships its
# LCM-LoRA as "lcm". Listed with the deployment's --lora / --lora-dir, which win for the same name.
MODEL_LORAS_FILE = "loras.json"
# A model folder's own ControlNets, {"name": "folder"} (a diffusers ControlNet folder of the folder, or a
# .safetensors file of it): tiny-shapes ships its canny ControlNet. Loaded with the deployment's --controlnet /
# --controlnet-dir, which win for the same name.
MODEL_CONTROLNETS_FILE = "controlnets.json"


def read_model_loras(folder: Path) -> dict[str, Path]:
    """``folder``'s loras.json as {name: path}; {} when it has none.

    Raises ModelLoadError for a file that is not a JSON object of names to file names, or that names a
    file outside the folder (a path with a folder part) or one that is not there.
    """
    return _read_shipped(Path(folder), MODEL_LORAS_FILE, "LoRA", {"lcm": "lcm-lora.safetensors"})


def read_model_controlnets(folder: Path) -> dict[str, Path]:
    """``folder``'s controlnets.json as {name: path} (a sub-folder with a config.json, or a file); {} without one.

    Raises ModelLoadError as :func:`read_model_loras`.
    """
    return _read_shipped(Path(folder), MODEL_CONTROLNETS_FILE, "ControlNet", {"canny": "controlnet-canny"})


def _read_shipped(folder: Path, file_name: str, what: str, example: dict) -> dict[str, Path]:
    path = folder / file_name
    if not path.is_file():
        return {}
    values = _read_json(path)
    if not isinstance(values, dict):
        raise ModelLoadError(f"{path}: expected a JSON object such as {json.dumps(example)}")
    out = {}
    for name, entry in values.items():
        if name.startswith("_"):
            continue
        if not isinstance(entry, str) or Path(entry).name != entry or not (folder / entry).exists():
            raise ModelLoadError(f"{path}: {what} {name!r}: {entry!r} is not a file of {folder}")
        out[name] = folder / entry
    return out


def model_loras(model: str) -> dict[str, Path]:
    """The LoRAs ``model`` ships (:func:`read_model_loras`) that can be known before loading it: the shipped
    tiny-shapes' and a local folder's; {} for the other built-ins, single files and hub ids."""
    folder = _shipping_folder(model)
    return {} if folder is None else read_model_loras(folder)


def model_controlnets(model: str) -> dict[str, Path]:
    """The ControlNets ``model`` ships (:func:`read_model_controlnets`), as :func:`model_loras` finds them."""
    folder = _shipping_folder(model)
    return {} if folder is None else read_model_controlnets(folder)


def _shipping_folder(model: str) -> Path | None:
    if model == "tiny-shapes":
        return builtin.TINY_SHAPES_DIR
    folder = Path(model).expanduser()
    return None if model in builtin.BUILTIN_NAMES or not folder.is_dir() else folder


def _variant_of(filename: str) -> str:
    """``x.safetensors``, ``x-00001-of-00002.safetensors``, ``x.safetensors.index.json`` -> "";
    ``x.fp16.safetensors``, ``x.fp16-00001-of-00002.safetensors``, ``x.safetensors.index.fp16.json`` -> "fp16"."""
    if ".safetensors.index" in filename:
        parts = filename.split(".safetensors.index")[1].split(".")
        return parts[1] if len(parts) == 3 else ""
    parts = filename[: -len(".safetensors")].split(".")
    return parts[1].split("-")[0] if len(parts) > 1 else ""


def hub_files(files: list[str], variant: str = "") -> list[str]:
    """The repository files a hub snapshot needs: metadata, configs, tokenizers, one weight set per component.

    Per component the preference of :func:`.weights.find_weight_files`: the variant's
    safetensors, the plain ones, another variant's, then Flax msgpack; pickles never.
    """
    wanted = [f for f in files if f.startswith(_HUB_META) or f.endswith("/config.json")]
    for name in COMPONENTS:
        inside = [f[len(name) + 1:] for f in files if f.startswith(name + "/") and "/" not in f[len(name) + 1:]]
        safetensors = [f for f in inside if f.endswith(".safetensors") or ".safetensors.index" in f]
        variants = sorted({_variant_of(f) for f in safetensors})
        for choice in ([variant] if variant else []) + [""] + variants:
            if choice in variants:
                wanted += [f"{name}/{f}" for f in safetensors if _variant_of(f) == choice]
                break
        else:
            wanted += [f"{name}/{f}" for f in inside if f.endswith(".msgpack")]
    return sorted(set(wanted))


def hub_snapshot(repo_id: str, revision: str = "", variant: str = "", flag: str = "--model") -> Path:
    """Download (or find in the local cache) only the files :func:`hub_files` selects; ``flag`` is the setting
    ``repo_id`` comes from, as errors name it ("--model" or "--refiner").

    Raises ModelLoadError when the hub cannot be reached and the cache does not have the files,
    for an unknown or gated repository, or a revision that does not exist.
    """
    kwargs = {"revision": revision or None}
    if _hub_offline():  # the cache only: asking the hub would only fail (after retries, where the check was missed)
        try:
            return Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
        except Exception as err:  # noqa: BLE001  not cached: huggingface_hub raises several types
            raise ModelLoadError(f"could not load {MODEL_FLAGS[flag][0]} {repo_id!r} from the hub (offline mode: "
                                 "HF_HUB_OFFLINE is set and the local cache does not have it). "
                                 f"{_hub_hint(flag)}") from err
    try:
        api = HfApi()
        unreachable = hub_unreachable(api.endpoint)
        if unreachable is not None:  # huggingface_hub would retry 5 times over ~25 s, a log line each, to no end
            raise ConnectionError(unreachable)
        patterns = hub_files(api.list_repo_files(repo_id, **kwargs), variant)
    except Exception as err:  # offline, DNS, HTTP, unknown or gated repo: huggingface_hub and httpx raise many types
        try:  # whatever the local cache already has
            return Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
        except Exception:  # not cached either: report the first, more telling error
            raise ModelLoadError(f"could not load {MODEL_FLAGS[flag][0]} {repo_id!r} from the hub "
                                 f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}). "
                                 f"{_hub_hint(flag)}") from err
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, **kwargs))
    except Exception as err:  # a download that breaks off, a full disk
        raise ModelLoadError(f"could not download {MODEL_FLAGS[flag][0]} {repo_id!r} ({type(err).__name__}: "
                             f"{str(err).splitlines()[0][:200] if str(err) else ''}). {_hub_hint(flag)}") from err


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_unreachable(endpoint: str, timeout_s: float = 5.0) -> str | None:
    """Why the hub at ``endpoint`` (a URL) cannot be reached (its host unknown, its port refusing or silent
    for ``timeout_s`` seconds), or None: it answers, or a proxy is set (then only a request can tell).
    One connection attempt, no retries."""
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None
    url = urllib.parse.urlsplit(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        return f"cannot reach {host}:{port}: {err.strerror or type(err).__name__}"
    return None


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now: huggingface_hub reads it once, when imported, so a
    value set later (by a test, or by code that imports the hub client first) would not stop its retries."""
    return hub_constants.HF_HUB_OFFLINE or any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
                                               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def load_model(model: str, *, dtype: str, platform: str, revision: str = "", variant: str = "", cache_dir: str,
               sharding=None, log: Callable[[str], None] = LOG.info, model_config: str = "", unet: str = "",
               vae: str = "", timestep_spacing: str = "", flag: str = "--model") -> LoadedModel:
    """Load an SDXL model by name: built-in, a local folder, a hub id, or a single file.

    Args:
        model: ``tiny-shapes`` (shipped in assets/), ``tiny-random``, ``sdxl-base-random``, a
            local diffusers-format directory, a hub id (``owner/name``), or one ``.safetensors``
            file in the original sgm layout, local or on the hub (``owner/name/file.safetensors``).
        dtype: ``auto``/``float32``/``bfloat16``/``float16``; platform: JAX backend ("cpu", "gpu", "tpu").
        revision: hub revision (branch, tag or commit); ignored for local folders.
        variant: preferred weight variant ("fp16"); cache_dir: where built-in models are created.
        sharding: see :func:`load_folder`.
        model_config: a diffusers SDXL folder whose configs and tokenizers a single file uses (as
            diffusers' ``from_single_file(config=...)``); "" = the shipped SDXL base configs.
        unet, vae: a file or folder read in place of that component (:func:`swap_source`); "" = the model's.
        timestep_spacing: "leading", "trailing" or "linspace" in place of the scheduler config's; "" = its own.
        flag: the setting ``model`` comes from, as errors name it: "--model", or "--refiner" for a refiner
            (whose ``model_config`` then comes from "--refiner-config").
    Raises:
        ModelLoadError: one line naming the setting, the path or id and what to do.
    """
    start = time.perf_counter()
    config_flag = f"{flag}-config"  # --model-config, --refiner-config: derived, so the two names cannot drift
    dtype = resolve_dtype(dtype, platform)
    swaps = {name: path for name, path in (("unet", unet), ("vae", vae)) if path}
    if model == "sdxl-base-random":
        if swaps or model_config:
            options = "--unet, --vae and --model-config" if flag == "--model" else config_flag
            raise ModelLoadError(f"{flag} sdxl-base-random is made in memory with random weights; {options} "
                                 "apply to models read from files")
        return _with_spacing(random_model(builtin.SDXL_BASE_CONFIGS, model, dtype, sharding), timestep_spacing)
    if single_file.is_single_file_name(model) and not Path(model).expanduser().is_dir():
        loaded = load_single_file(_single_file_path(model, revision, flag), dtype, sharding, model_config, swaps,
                                  log, config_flag)
        loaded.load_s = time.perf_counter() - start
        return _with_spacing(with_recipe(loaded, model, unet, False, log), timestep_spacing)
    if model_config:
        raise ModelLoadError(f"{config_flag} {model_config!r} is for single-file models (FILE.safetensors); "
                             f"{model!r} has its own configs")
    shown = model  # the name users see (page, API record, PNG parameters)
    if model in builtin.BUILTIN_NAMES:
        try:
            folder = builtin.model_path(model, cache_dir)
        except FileNotFoundError as err:
            raise ModelLoadError(str(err)) from err
    elif Path(model).expanduser().exists():
        folder = Path(model).expanduser()
        if folder.is_file():
            raise ModelLoadError(_not_safetensors_message(folder, flag))
        if not (folder / "model_index.json").is_file():
            raise ModelLoadError(f"{flag} {folder}: not a diffusers-format model directory (no model_index.json). "
                                 + _hub_hint(flag))
        # A local folder by its own name only: a public link must not show the server's paths (logs
        # and errors name the whole path).
        shown = folder.resolve().name
    elif model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelLoadError(f"{flag} {model!r} is neither a built-in name, an existing directory nor a hub id. "
                             + _hub_hint(flag))
    else:
        folder = hub_snapshot(model, revision, variant, flag)
    loaded = load_folder(folder, shown, dtype, sharding, variant, log, swaps, flag)
    loaded.load_s = time.perf_counter() - start
    own_defaults = (folder / ENGINE_DEFAULTS_FILE).is_file()
    return _with_spacing(with_recipe(loaded, model, unet, own_defaults, log), timestep_spacing)


def _not_safetensors_message(path: Path, flag: str = "--model") -> str:
    if path.suffix in PICKLE_SUFFIXES:
        return (f"{path} is a pickle checkpoint ({path.suffix}); it is never opened because unpickling can run "
                f"code. Use the .safetensors release of the model (single files load: {flag} FILE.safetensors)")
    return (f"{path} is a file but not .safetensors; {flag} takes a .safetensors single file, a diffusers-format "
            "folder, a built-in name or a hub id")


# --- single files and swapped parts ---------------------------------------------------------------------

# Where the shipped SDXL base configs come from (checkpoint/configs/README.md): their tokenizers' vocabulary is
# not shipped, so a single file with the default configs reads CLIP's from there (the hub cache, or a download).
SDXL_BASE_REPO = "stabilityai/stable-diffusion-xl-base-1.0"
SDXL_BASE_REVISION = "462165984030d82259a11f4367a4eed129e94a7b"
# A refiner single file's default configs: the refiner's repository (as diffusers' from_single_file reads them for
# "xl_refiner"), its configs and tokenizer_2 only, from the hub cache or downloaded once; no configs are shipped.
SDXL_REFINER_REPO = "stabilityai/stable-diffusion-xl-refiner-1.0"
_REFINER_CONFIG_FILES = ["model_index.json", "*/config.json", "scheduler/*", "tokenizer_2/*"]
SPACINGS = ("leading", "trailing", "linspace")


def _hub_file(spec: str, revision: str, what: str) -> Path:
    """``owner/name/path/in/repo.safetensors`` -> the file in the local hub cache (downloaded if needed).

    Raises ModelLoadError: offline and not cached, unknown repository or file, a broken download.
    """
    owner, name, filename = spec.split("/", 2)
    try:
        return Path(hf_hub_download(f"{owner}/{name}", filename, revision=revision or None,
                                    local_files_only=_hub_offline()))
    except Exception as err:  # noqa: BLE001  offline, DNS, HTTP, unknown repo or file: huggingface_hub raises many
        first = str(err).splitlines()[0][:200] if str(err) else ""
        raise ModelLoadError(f"could not get {what} {spec!r} from the hub ({type(err).__name__}: {first})"
                             + (" (offline mode: HF_HUB_OFFLINE is set)" if _hub_offline() else "")) from err


def _single_file_path(model: str, revision: str, flag: str = "--model") -> Path:
    """The local file a single-file ``--model`` (or ``--refiner``: ``flag``) names: a path, or a hub
    ``owner/name/file.safetensors``."""
    path = Path(model).expanduser()
    if path.is_file():
        return path
    if model.startswith((".", "/", "~")) or model.count("/") < 2:
        raise ModelLoadError(f"{flag} {model}: no such file (a single file is a local path or a hub "
                             "owner/name/file.safetensors)")
    return _hub_file(model, revision, f"the {flag} single file")


def _config_tokenizer(folder: Path, sub: str):
    """``folder/sub`` as a CLIPTokenizer; for a folder without the vocabulary (the shipped configs), CLIP's from
    SDXL base's repository at the configs' revision (the hub cache, else a download)."""
    if any((folder / sub / f).is_file() for f in ("vocab.json", "tokenizer.json")):
        return _tokenizer(folder / sub)
    try:  # file by file: transformers' from_pretrained of a repository it cannot reach gives an empty tokenizer
        paths = [hf_hub_download(SDXL_BASE_REPO, f"{sub}/{name}", revision=SDXL_BASE_REVISION,
                                 local_files_only=_hub_offline())
                 for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json")]
    except Exception as err:  # noqa: BLE001  offline, DNS, HTTP: huggingface_hub raises many types
        raise ModelLoadError(f"{folder / sub} has no vocabulary (vocab.json + merges.txt) and CLIP's could not be "
                             f"read from {SDXL_BASE_REPO} ({type(err).__name__}"
                             + (", offline mode" if _hub_offline() else "") + "): pass --model-config DIR, a "
                             "diffusers SDXL folder with tokenizer/ and tokenizer_2/") from err
    return _tokenizer(Path(paths[0]).parent)


def _refiner_configs(flag: str) -> Path:
    """SDXL refiner 1.0's configs and tokenizer_2 (:data:`SDXL_REFINER_REPO`): the hub cache, else a download.

    Raises ModelLoadError (offline with nothing cached, or the hub unreachable) saying to pass ``flag`` DIR."""
    try:
        return Path(snapshot_download(SDXL_REFINER_REPO, allow_patterns=_REFINER_CONFIG_FILES,
                                      local_files_only=_hub_offline()))
    except Exception as err:  # noqa: BLE001  offline, DNS, HTTP: huggingface_hub raises many types
        raise ModelLoadError(f"an SDXL refiner single file needs the refiner's configs, and {SDXL_REFINER_REPO}'s "
                             f"could not be read ({type(err).__name__}" + (", offline mode" if _hub_offline() else "")
                             + f"): pass {flag} DIR, a diffusers SDXL refiner folder (model_index.json, "
                             "text_encoder_2/, unet/, vae/ and scheduler/ configs, tokenizer_2/)") from err


def load_single_file(path: Path, dtype: str, sharding=None, model_config: str = "",
                     swaps: dict[str, str] | None = None, log: Callable[[str], None] = LOG.info,
                     config_flag: str = "--model-config") -> LoadedModel:
    """An SDXL single file in the original sgm layout (:mod:`.single_file`) with the configs and tokenizers of
    ``model_config`` (a diffusers SDXL folder; "" = the shipped SDXL base configs for a base-type file, SDXL
    refiner 1.0's from the hub for a refiner file: :func:`_refiner_configs`). A refiner file loads as a refiner
    (:class:`ModelKind` from the configs: text_encoder_2, unet, vae; no tokenizer), as a refiner folder does.

    The file's ``v_pred`` / ``ztsnr`` markers set the scheduler's ``prediction_type`` (v_prediction) and
    ``rescale_betas_zero_snr`` (True). Checked before any tensor is read: what the file is (another architecture
    refused by name), the configs, the scheduler, the tokenizers, every tensor's name, shape and dtype.

    Args:
        config_flag: the setting ``model_config`` came from, as errors name it (``--refiner-config`` for
            ``--refiner``).
    Raises:
        ModelLoadError: one line, naming the file and what to do; a refiner file with a base model's configs or
            the other way round.
    """
    checkpoint = single_file.inspect_checkpoint(path)
    if model_config:
        config_dir = Path(model_config).expanduser()
    else:
        config_dir = _refiner_configs(config_flag) if checkpoint.refiner else builtin.SDXL_BASE_DIR
    if not config_dir.is_dir():
        raise ModelLoadError(f"{config_flag} {model_config!r}: no such folder (a diffusers SDXL folder: "
                             "model_index.json, component configs, tokenizer/ and tokenizer_2/)")
    index, components = _read_index_and_components(config_dir)
    kind = model_kind(index, components)
    if kind.refiner != checkpoint.refiner:
        file_is, configs_are = ("an SDXL refiner", "a base model's") if checkpoint.refiner else (
            "an SDXL base-type", "an SDXL refiner's")
        prefixes = ", ".join(p + "*" for p in checkpoint.prefixes.values())
        raise ModelLoadError(f"{path} is {file_is} single file ({prefixes}), but the configs of {config_dir.name} "
                             f"are {configs_are}; pass {config_flag} DIR with "
                             f"{'a refiner' if checkpoint.refiner else 'a base model'}'s configs")
    scheduler_config = {**read_scheduler_config(config_dir), **checkpoint.scheduler_changes()}
    if checkpoint.scheduler_changes():
        _check_scheduler(scheduler_config, f"{path} (its v_pred/ztsnr markers)")
        log(f"[sdxl_engine] {path.name}: scheduler {checkpoint.scheduler_changes()} (the file's markers)")
    tokenizers = [_config_tokenizer(config_dir, TOKENIZER_OF[name]) if name in components else None
                  for name in ("text_encoder", "text_encoder_2")]
    target = jnp.dtype(dtype)
    place = lambda array: jax.device_put(array, sharding)  # noqa: E731
    params = _swapped(components, swaps or {}, target, place, log)
    params.update(single_file.load_checkpoint_params(checkpoint, components, target, place, skip=tuple(params),
                                                     log=log))
    log(f"[sdxl_engine] {path.name}: {'refiner ' * checkpoint.refiner}single file, configs of {config_dir.name}")
    return LoadedModel(name=path.name, components=components, params={k: params[k] for k in components},
                       tokenizer=tokenizers[0], tokenizer_2=tokenizers[1], scheduler_config=scheduler_config,
                       dtype=dtype, source=str(path), vocabulary=_vocabulary(config_dir),
                       engine_defaults=read_engine_defaults(config_dir), kind=kind)


def swap_source(name: str, spec: str, component: Component) -> tuple[Component, Path]:
    """Where ``--unet`` / ``--vae`` ``spec`` reads ``name`` from, and its Component (no tensor read).

    ``spec``: a ``.safetensors`` file (diffusers or LDM layout, with or without the component's prefix:
    :func:`.single_file.load_component_file`), a hub ``owner/name/file.safetensors``, a component folder
    (config.json + weights, as in a diffusers model) or a model folder holding ``name/``. A folder's
    config.json replaces the model's config of that component; a file keeps ``component``.

    Returns (the Component to use, the file or component folder).
    Raises ModelLoadError: not found, a pickle or another non-safetensors file, a config the modules refuse.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / name).is_dir() and not (path / "config.json").is_file():
            path = path / name
        if (path / "config.json").is_file():
            try:
                component = build_component(name, _read_json(path / "config.json"))
            except (ValueError, KeyError, TypeError) as err:
                raise ModelLoadError(f"{path / 'config.json'}: {err}") from err
        return component, path
    if not path.is_file():
        if spec.startswith((".", "/", "~")) or spec.count("/") < 2 or not spec.endswith(".safetensors"):
            raise ModelLoadError(f"--{name} {spec!r}: no such file or folder")
        path = _hub_file(spec, "", f"--{name} file")
    if path.suffix != ".safetensors":
        raise ModelLoadError(_not_safetensors_message(path, f"--{name}"))
    return component, path


def _swapped(components: dict[str, Component], swaps: dict[str, str], dtype, place,
             log: Callable[[str], None]) -> dict[str, dict]:
    """The swapped components' parameters (``components`` updated with their configs, which must fit the
    other parts before any tensor is read: :func:`_check_sizes`)."""
    sources = {}
    for name, spec in swaps.items():
        components[name], sources[name] = swap_source(name, spec, components[name])
    if swaps:
        _check_sizes(Path("--" + " --".join(swaps)), components)
    params = {}
    for name, path in sources.items():
        if path.is_dir():
            params[name] = load_params(components[name], find_weight_files(path), dtype, place)
        else:
            params[name] = single_file.load_component_file(components[name], path, dtype, place, log)
        log(f"[sdxl_engine] {name}: {path.name} (--{name})")
    return params


def _check_scheduler(config: dict, where: str) -> None:
    try:
        check_scheduler_config(config)
    except UnsupportedSchedulerConfig as err:
        raise ModelLoadError(f"{where}: {err}") from None


def with_recipe(loaded: LoadedModel, model: str, unet: str = "", own_defaults: bool = False,
                log: Callable[[str], None] = LOG.info) -> LoadedModel:
    """``loaded`` with the few-step recipe of its ``--unet`` file (``unet``), else of its own name (``model``): the
    recipe's scheduler fields in its scheduler config, and its defaults in place of ``engine_defaults`` unless the
    folder has its own (``own_defaults``) and the recipe is the model's own (a swapped UNet's recipe replaces the
    folder's engine_defaults.json, which chose settings for the UNet it replaces). One log line says what applied.
    A name no recipe matches: ``loaded`` as it is (checkpoint/recipes.py).

    Raises ModelLoadError for recipe fields the scheduler config cannot take (its check's message)."""
    recipe, whose = recipes.find(unet), "--unet"
    if recipe is None:
        recipe, whose = recipes.find(model), "the model"
    if recipe is None:
        return loaded
    loaded.recipe = recipe
    if recipe.scheduler:
        loaded.scheduler_config = {**loaded.scheduler_config, **recipe.scheduler}
        _check_scheduler(loaded.scheduler_config, f"the {recipe.name} recipe")
    kept = own_defaults and whose != "--unet"
    if not kept:
        loaded.engine_defaults = recipe.engine_defaults()
    log(f"[sdxl_engine] few-step recipe {recipe.name} ({whose} {recipes.name_of(unet or model)}): scheduler "
        f"{recipe.scheduler}, defaults "
        + (f"of its {ENGINE_DEFAULTS_FILE} (kept)" if kept else str(recipe.defaults))
        + (f"; {recipe.note}" if recipe.note else "") + f" ({recipe.source.split(': ')[0]})")
    return loaded


def _with_spacing(loaded: LoadedModel, spacing: str) -> LoadedModel:
    """``loaded`` with its scheduler config's ``timestep_spacing`` replaced by ``spacing`` ("" = unchanged).

    Raises ModelLoadError for a spacing no sampler implements."""
    if not spacing:
        return loaded
    if spacing not in SPACINGS:
        raise ModelLoadError(f"--timestep-spacing {spacing!r}: choose {', '.join(SPACINGS)}")
    loaded.scheduler_config = {**loaded.scheduler_config, "timestep_spacing": spacing}
    _check_scheduler(loaded.scheduler_config, f"--timestep-spacing {spacing}")
    return loaded


def random_model(configs: dict[str, dict], name: str, dtype: str, sharding=None, seed: int = 0) -> LoadedModel:
    """An SDXL-architecture model with random weights made on the devices, for timing without a download.

    Every tensor comes from one jitted fill function (compiled once per distinct shape) that
    writes it in ``dtype`` straight into its sharding, with the mean and spread the modules'
    initialisers give it, so the host never holds a float32 copy (models/random_weights.py).
    Tokenizers are the project's own (any text tokenizes); the scheduler is SDXL base's.
    """
    start = time.perf_counter()
    components = {n: build_component(n, configs[n]) for n in COMPONENTS}
    params = random_params(components, jnp.dtype(dtype), sharding, seed)
    with tempfile.TemporaryDirectory() as tmp:
        builtin.write_tokenizers(Path(tmp))
        tokenizers = [_tokenizer(Path(tmp) / sub) for sub in ("tokenizer", "tokenizer_2")]
    return LoadedModel(name=name, components=components, params=params, tokenizer=tokenizers[0],
                       tokenizer_2=tokenizers[1], scheduler_config=dict(builtin.SDXL_SCHEDULER), dtype=dtype,
                       load_s=time.perf_counter() - start)
