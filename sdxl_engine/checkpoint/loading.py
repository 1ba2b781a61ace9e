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
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub import constants as hub_constants
from transformers import CLIPTokenizer

from sdxl_engine.checkpoint import builtin
from sdxl_engine.models import COMPONENTS, Component, build_component
from sdxl_engine.models.random_weights import random_params
from sdxl_engine.program.schedulers import UnsupportedSchedulerConfig, check_scheduler_config
from sdxl_engine.checkpoint.weights import ModelLoadError, find_weight_files, load_params
from sdxl_engine.checkpoint.writing import VOCABULARY_FILE
# Optional in a model folder: the sampler, steps and guidance it chooses for requests that set none (one JSON
# object, keys of config.MODEL_DEFAULT_FIELDS; "_" keys are notes); a deployment's explicit setting wins.
from sdxl_engine.config import ENGINE_DEFAULTS_FILE

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "resolve_dtype", "read_model_folder", "engine_defaults"]

LOG = logging.getLogger("sdxl_engine")
PIPELINES = ("StableDiffusionXLPipeline", "FlaxStableDiffusionXLPipeline")
TOKENIZERS = ("CLIPTokenizer", "CLIPTokenizerFast")
_HUB_HINT = ("Real SDXL needs its weights: on a machine that reaches the Hugging Face Hub use the hub id "
             "(--model stabilityai/stable-diffusion-xl-base-1.0), or download once "
             "(hf download stabilityai/stable-diffusion-xl-base-1.0 --local-dir sdxl-base) and start with "
             "--model ./sdxl-base. Built-in models: " + ", ".join(builtin.BUILTIN_NAMES))
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


@dataclasses.dataclass
class LoadedModel:
    """Everything the compiled program needs from a model.

    Attributes:
        name: what the user asked for (built-in name, directory or hub id).
        components: {"text_encoder", "text_encoder_2", "unet", "vae"} -> Component (config,
            static module graph, parameter names and shapes).
        params: the same keys -> {checkpoint key: array} in ``dtype``, each put on the devices (load_folder's
            ``sharding``) as soon as it was read.
        tokenizer, tokenizer_2: transformers CLIPTokenizers (77 tokens each).
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
        return self.unet.in_channels

    def size_buckets(self) -> tuple[tuple[int, int], ...]:
        """SDXL's aspect buckets (width, height) scaled to this model's native size."""
        return size_buckets(self.native_size, self.size_multiple)


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

    Raises:
        ModelLoadError: not a diffusers folder, not SDXL (an SD 1.x/2.x folder, a refiner), a
            component missing or of an unknown class, a config the modules do not support, or
            components whose sizes do not fit together.
    """
    index = _read_json(folder / "model_index.json")
    kind = index.get("_class_name", "?")
    if kind not in PIPELINES:
        what = ("an SD 1.x/2.x folder" if kind in ("StableDiffusionPipeline", "FlaxStableDiffusionPipeline")
                else "not a text-to-image SDXL pipeline")
        raise ModelLoadError(f"{folder} holds a {kind} ({what}); this engine runs SDXL: a StableDiffusionXLPipeline "
                             "with text_encoder_2 and a text_time UNet. " + _HUB_HINT)
    components = {}
    for name, (_, _, classes) in COMPONENTS.items():
        entry = index.get(name)
        if not entry or entry[-1] is None:
            raise ModelLoadError(f"{folder}/model_index.json has no {name}; SDXL text-to-image needs "
                                 f"{', '.join(COMPONENTS)}")
        if entry[-1] not in classes:
            raise ModelLoadError(f"{folder}: {name} is a {entry[-1]}; expected {' or '.join(classes)}")
        config_path = folder / name / "config.json"
        try:
            components[name] = build_component(name, _read_json(config_path))
        except (ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{config_path}: {err}") from err
    for name in ("tokenizer", "tokenizer_2"):
        entry = index.get(name)
        if not entry or entry[-1] not in TOKENIZERS:
            raise ModelLoadError(f"{folder}/model_index.json: {name} must be a CLIPTokenizer, got {entry}")
    _check_sizes(folder, components)
    return components


def _check_sizes(folder: Path, c: dict[str, Component]) -> None:
    unet, te1, te2 = c["unet"].config, c["text_encoder"].config, c["text_encoder_2"].config
    hidden = te1.hidden_size + te2.hidden_size
    if any(d != hidden for d in unet.cross_attention_dim):
        raise ModelLoadError(f"{folder}: unet cross_attention_dim {unet.cross_attention_dim} must equal the two text "
                             f"encoders' hidden sizes together ({te1.hidden_size} + {te2.hidden_size})")
    added = 6 * unet.addition_time_embed_dim + te2.projection_dim
    if unet.projection_class_embeddings_input_dim != added:
        raise ModelLoadError(f"{folder}: unet projection_class_embeddings_input_dim "
                             f"{unet.projection_class_embeddings_input_dim} must be 6 x addition_time_embed_dim + "
                             f"text_encoder_2 projection_dim = {added}")
    if c["vae"].config.latent_channels != unet.in_channels:
        raise ModelLoadError(f"{folder}: vae latent_channels {c['vae'].config.latent_channels} != unet in_channels "
                             f"{unet.in_channels}")


def _tokenizer(folder: Path):
    try:
        return CLIPTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as err:
        raise ModelLoadError(f"{folder}: not a CLIP tokenizer (vocab.json + merges.txt or tokenizer.json): "
                             f"{type(err).__name__}: {err}") from err


def load_folder(folder: Path, name: str, dtype: str, sharding=None, variant: str = "",
                log: Callable[[str], None] = LOG.info) -> LoadedModel:
    """Load every component of a diffusers-format SDXL folder.

    Args:
        folder: the model folder; name: what to call it in logs and images.
        dtype: "float32", "bfloat16" or "float16" (the parameters' dtype).
        sharding: where each parameter goes as soon as it is read (``jax.device_put``), so no
            host copy of the whole model is held; None = the default device.
        variant: preferred weight variant ("fp16"); others are used when it is absent.
    Raises:
        ModelLoadError: see :func:`read_model_folder` and :mod:`.weights`.
    """
    start = time.perf_counter()
    components = read_model_folder(folder)
    scheduler_config = read_scheduler_config(folder)  # before the weights: a refused config fails fast
    target = jnp.dtype(dtype)
    place = lambda array: jax.device_put(array, sharding)  # noqa: E731
    params = {}
    for cname, component in components.items():
        files = find_weight_files(folder / cname, variant)
        params[cname] = load_params(component, files, target, place)
        log(f"[sdxl_engine] {cname}: {files[0].name}{f' (+{len(files) - 1} shards)' if len(files) > 1 else ''}")
    return LoadedModel(
        name=name, components=components, params=params,
        tokenizer=_tokenizer(folder / "tokenizer"), tokenizer_2=_tokenizer(folder / "tokenizer_2"),
        scheduler_config=scheduler_config, dtype=dtype, load_s=time.perf_counter() - start, source=str(folder), vocabulary=_vocabulary(folder),
        engine_defaults=read_engine_defaults(folder))


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
    local folder's; {} for the other built-ins and for hub ids (read once downloaded, when the engine loads it)."""
    if model == "tiny-shapes":
        return read_engine_defaults(builtin.TINY_SHAPES_DIR)
    folder = Path(model).expanduser()
    return {} if model in builtin.BUILTIN_NAMES or not folder.is_dir() else read_engine_defaults(folder)


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


def hub_snapshot(repo_id: str, revision: str = "", variant: str = "") -> Path:
    """Download (or find in the local cache) only the files :func:`hub_files` selects.

    Raises ModelLoadError when the hub cannot be reached and the cache does not have the files,
    for an unknown or gated repository, or a revision that does not exist.
    """
    kwargs = {"revision": revision or None}
    if _hub_offline():  # the cache only: asking the hub would only fail (after retries, where the check was missed)
        try:
            return Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
        except Exception as err:  # noqa: BLE001  not cached: huggingface_hub raises several types
            raise ModelLoadError(f"could not load SDXL model {repo_id!r} from the hub (offline mode: HF_HUB_OFFLINE "
                                 f"is set and the local cache does not have it). {_HUB_HINT}") from err
    try:
        patterns = hub_files(HfApi().list_repo_files(repo_id, **kwargs), variant)
    except Exception as err:  # offline, DNS, HTTP, unknown or gated repo: huggingface_hub and httpx raise many types
        try:  # whatever the local cache already has
            return Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
        except Exception:  # not cached either: report the first, more telling error
            raise ModelLoadError(f"could not load SDXL model {repo_id!r} from the hub ({type(err).__name__}: "
                                 f"{str(err).splitlines()[0][:200] if str(err) else ''}). {_HUB_HINT}") from err
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, **kwargs))
    except Exception as err:  # a download that breaks off, a full disk
        raise ModelLoadError(f"could not download SDXL model {repo_id!r} ({type(err).__name__}: "
                             f"{str(err).splitlines()[0][:200] if str(err) else ''}). {_HUB_HINT}") from err


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now: huggingface_hub reads it once, when imported, so a
    value set later (by a test, or by code that imports the hub client first) would not stop its retries."""
    return hub_constants.HF_HUB_OFFLINE or any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
                                               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def load_model(model: str, *, dtype: str, platform: str, revision: str = "", variant: str = "", cache_dir: str,
               sharding=None, log: Callable[[str], None] = LOG.info) -> LoadedModel:
    """Load an SDXL model by name: built-in, a local folder, or a hub id.

    Args:
        model: ``tiny-shapes`` (shipped in assets/), ``tiny-random``, ``sdxl-base-random``, a
            local diffusers-format directory, or a hub id (``owner/name``).
        dtype: ``auto``/``float32``/``bfloat16``/``float16``; platform: JAX backend ("cpu", "gpu", "tpu").
        revision: hub revision (branch, tag or commit); ignored for local folders.
        variant: preferred weight variant ("fp16"); cache_dir: where built-in models are created.
        sharding: see :func:`load_folder`.
    Raises:
        ModelLoadError: one line naming the path or id and what to do.
    """
    start = time.perf_counter()
    dtype = resolve_dtype(dtype, platform)
    if model == "sdxl-base-random":
        return random_model(builtin.SDXL_BASE_CONFIGS, model, dtype, sharding)
    shown = model  # the name users see (page, API record, PNG parameters)
    if model in builtin.BUILTIN_NAMES:
        try:
            folder = builtin.model_path(model, cache_dir)
        except FileNotFoundError as err:
            raise ModelLoadError(str(err)) from err
    elif Path(model).expanduser().exists():
        folder = Path(model).expanduser()
        if folder.is_file():
            raise ModelLoadError(_single_file_message(folder))
        if not (folder / "model_index.json").is_file():
            raise ModelLoadError(f"{folder} is not a diffusers-format model directory (no model_index.json). {_HUB_HINT}")
        # A local folder by its own name only: a public link must not show the server's paths (logs
        # and errors name the whole path).
        shown = folder.resolve().name
    elif model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelLoadError(f"model {model!r} is neither a built-in name, an existing directory nor a hub id. {_HUB_HINT}")
    else:
        folder = hub_snapshot(model, revision, variant)
    loaded = load_folder(folder, shown, dtype, sharding, variant, log)
    loaded.load_s = time.perf_counter() - start
    return loaded


def _single_file_message(path: Path) -> str:
    return (f"{path} is a single file; this engine loads diffusers-format folders (model_index.json and one "
            "folder per component). Single-file A1111/ComfyUI checkpoints are not supported: convert it once with "
            "diffusers (StableDiffusionXLPipeline.from_single_file(path).save_pretrained(dir, "
            "safe_serialization=True)) and start with --model dir.")


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
