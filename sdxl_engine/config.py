"""One typed, read-only engine configuration, built once from defaults, environment and flags.

Every field can be set by an environment variable named ``SDXL_<FIELD>`` (upper case) or by an
override passed to :meth:`EngineConfig.load` (the app's command-line flags). Values are converted
to the type of the field's default; an unknown key or an unconvertible value raises
:class:`ConfigError`. Derived values (device count, batch) are computed later, once, by the
engine, because they need JAX's backend.

A model folder may choose its own sampler, steps and guidance (:data:`MODEL_DEFAULT_FIELDS`, in
its ``engine_defaults.json``): :func:`resolve_defaults` (the one place, for the page and the engine)
puts them in place of the defaults below, never in place of a value the environment or an override set.

JAX-wide options (CPU device count, persistent compilation cache) must be set before JAX creates
its first array; :func:`apply_jax_options` does that and is called by the engine before anything
else touches JAX.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# No JAX here (apply_jax_options imports it): the process checks its settings with this module before
# the heavy imports, so a malformed one ends the start at once (serving/main.py).

LOG = logging.getLogger(__name__)

ENV_PREFIX = "SDXL_"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sdxl_engine"


# The settings a model folder's engine_defaults.json may choose (loading.py); the others are the deployment's.
MODEL_DEFAULT_FIELDS = ("sampler", "num_inference_steps", "guidance_scale", "width", "height")
# The file in a model folder that chooses them (read by checkpoint.loading, which imports this name).
ENGINE_DEFAULTS_FILE = "engine_defaults.json"
# How prompt weights apply (engine/prompts.py): A1111's "Original" emphasis, or none (the syntax is read,
# every weight is 1). MAX_PROMPT_CHUNKS: each chunk count is a program, so their number stays small.
EMPHASIS_MODES = ("original", "none")
MAX_PROMPT_CHUNKS = 8
# A LoRA's name: it is written in <lora:NAME:WEIGHT> tags.
LORA_NAME = re.compile(r"[\w.\-]+")


class ConfigError(ValueError):
    """A configuration key or value that the engine cannot use."""


# A1111's sampler names, each a set of per-step coefficients in program/schedulers.py (which imports these: the
# config, the lowest layer, checks the configured sampler at load without importing the program).
SAMPLERS = ("Euler", "Euler a", "DPM++ 2M", "DPM++ 2M Karras", "DPM++ 2M SDE", "DPM++ 3M SDE", "UniPC", "DDIM",
            "LCM", "Heun", "DPM2", "DPM++ SDE", "TCD", "DPM2 a", "LMS", "Restart")
DEFAULT_SAMPLER = "Euler"  # the blog's


class UnknownSampler(ValueError):
    """A sampler name that is not one of :data:`SAMPLERS`."""


def get_sampler(name) -> str:
    """The canonical A1111 name for ``name`` (case and spaces ignored; None = the default).

    Raises UnknownSampler listing the choices.
    """
    if name is None or name == "":
        return DEFAULT_SAMPLER
    if isinstance(name, str):
        wanted = " ".join(name.split()).lower()
        for sampler in SAMPLERS:
            if sampler.lower() == wanted:
                return sampler
    raise UnknownSampler(f"unknown sampler {str(name)[:40]!r}; choose one of {', '.join(SAMPLERS)}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings; frozen, so a running engine cannot drift from what it logged at start."""

    # Which weights: a built-in name ("tiny-shapes", the trained demo model shipped in assets/;
    # "tiny-random", "sdxl-base-random"), a local diffusers-format directory, a hub id such as
    # "stabilityai/stable-diffusion-xl-base-1.0", or one .safetensors single file in the original
    # (sgm) layout, local or on the hub as owner/name/file.safetensors (see model_config).
    model: str = "tiny-shapes"
    # More models that requests may choose by name (GenerateRequest.model; docs/models.md): entries as ``model``'s,
    # joined by os.pathsep (the flag --model, repeated: its first value is ``model``, the default, the others these).
    models: str = ""
    # A folder whose every diffusers folder and SDXL .safetensors file is a model too (A1111's models/Stable-diffusion),
    # named by its folder or file name without the extension; "" = none. Rescanned by Engine.rescan_models.
    models_dir: str = ""
    # Hub revision (branch, tag or commit); "" = the default branch.
    revision: str = ""
    # Preferred weight files variant ("fp16" reads diffusion_pytorch_model.fp16.safetensors and the
    # like, half the download); "" = the plain files. Weights are cast to ``dtype`` either way.
    variant: str = ""
    # Parameter storage and compute dtype: "auto" = bfloat16 on TPU/GPU, float32 on CPU.
    # Latents, noise, guidance and the scheduler's sigmas stay float32 whatever this says.
    dtype: str = "auto"
    # Default image size in pixels; 0 = the model's native size (unet sample_size x VAE factor); a model's
    # engine_defaults.json (or its few-step recipe: SDXL-Turbo's 512) may choose it unless set explicitly.
    width: int = 0
    height: int = 0
    # Default number of denoising steps and classifier-free guidance scale. 5 is diffusers'
    # StableDiffusionXLPipeline default and tiny-shapes' best on prompts it was trained on
    # (shape accuracy at guidance 3 / 5 / 7: docs/benchmarks.md, "Figures behind choices in the code").
    # These two, the sampler and the size yield to a model's engine_defaults.json unless set explicitly.
    num_inference_steps: int = 20
    guidance_scale: float = 5.0
    # Default sampler, an A1111 name: Euler (the blog's), Euler a, DPM++ 2M, DPM++ 2M Karras, DPM++ 2M SDE,
    # DPM++ 3M SDE, UniPC, DDIM, LCM, Heun, DPM2, DPM++ SDE, TCD, DPM2 a, LMS, Restart (schedulers.TWO_CALLS: Heun,
    # DPM2, DPM++ SDE, DPM2 a and Restart call the UNet twice a step).
    sampler: str = "Euler"
    # Largest step count a request may ask for: the compiled loop is padded to it, so any count
    # from 1 to this runs on one program without recompiling.
    max_inference_steps: int = 50
    # Images per request (the global batch, sharded over devices); 0 = 4 when the device count
    # divides 4, else one per device.
    images_per_request: int = 0
    # On a CPU-only host JAX presents this many CPU devices, so the fan-out runs as on a v5e-4.
    cpu_devices: int = 4
    # Persistent XLA compilation cache; "" disables it.
    compile_cache_dir: str = str(DEFAULT_CACHE / "jax")
    # Keep compiled programs as serialized executables in <compile_cache_dir>/executables, so a
    # restart loads them without tracing or compiling (executables.py: only files this
    # installation wrote, mode 0600, listed with their hashes, are loaded). Off (or no
    # compile_cache_dir): every start traces and lowers again, and the XLA cache serves the compile.
    executable_cache: bool = True
    # Where built-in models are created on first use and kept.
    model_cache_dir: str = str(DEFAULT_CACHE / "models")
    # Largest seed a user may type; image i of a request uses seed + i.
    max_seed: int = 2**32 - 1
    # Requests allowed to wait in the queue before new ones are told to retry.
    max_queue_size: int = 16
    # /generate calls one client may have queued or running at once (a client: an IP address, an
    # IPv6 one by its /64, never anything the client sends, such as Gradio's session hash). Over it a
    # call is refused with a message naming this limit, so no client fills the queue.
    max_requests_per_client: int = 2
    # Reverse proxies whose X-Forwarded-For names the client: IP addresses or networks (10.0.0.0/8),
    # comma-separated; "" = none, so X-Forwarded-For is ignored and the peer address is the client.
    trusted_proxies: str = ""
    # Directory where the app saves every generated PNG (with its parameters); "" = do not save.
    # Off unless set, so a public link (--share, a Space) writes nothing to disk by default.
    outputs_dir: str = ""
    # Gradio's temp folder (GRADIO_TEMP_DIR), where every request's PNGs are served from: the
    # app keeps its own files there under this many megabytes, deleting the oldest first...
    temp_max_mb: float = 500.0
    # ...but never a file younger than this many seconds (a client may still be downloading it).
    temp_keep_s: float = 600.0
    # --- single files and swapped parts ---
    # For a single-file model: a diffusers SDXL folder whose component configs, scheduler and tokenizers it
    # uses (as diffusers' from_single_file(config=...)); "" = the shipped SDXL base configs.
    model_config: str = ""
    # A UNet / VAE read in place of the model's: a .safetensors file (diffusers or original layout, with or
    # without the component prefix), a hub owner/name/file.safetensors, or a folder; "" = the model's own.
    unet: str = ""
    vae: str = ""
    # Replaces the scheduler config's timestep_spacing: leading, trailing (what few-step UNets such as
    # SDXL-Lightning need) or linspace; "" = the model's.
    timestep_spacing: str = ""
    # An SDXL refiner (diffusers' "ensemble of experts", docs/refiner.md): a diffusers-format folder, a hub id, a
    # built-in name or a refiner single file (sd_xl_refiner_1.0.safetensors, see refiner_config), loaded onto the
    # same devices beside the model; requests may then ask for refiner_switch_at. "" = none.
    refiner: str = ""
    # For a single-file refiner: a diffusers SDXL refiner folder whose configs and tokenizer_2 it uses (as
    # model_config for the model); "" = stabilityai/stable-diffusion-xl-refiner-1.0's, from the hub cache or hub.
    refiner_config: str = ""
    # More refiners that requests may choose by name (GenerateRequest.refiner; the flag --refiner repeated: its first
    # value is ``refiner``, the default), and a folder of them (refiner single files and diffusers folders).
    refiners: str = ""
    refiners_dir: str = ""
    # ---- several models (docs/models.md) ----
    # Models whose weights stay on the devices at once, the least recently used dropped for a new one; 0 = auto: as
    # many as the devices' memory holds beside a run (free memory at ready, less the run's reserve, over the largest
    # model's weights), at least 1.
    max_resident_models: int = 0
    # Models dropped from the devices whose weights stay in host memory (a reload copies them back instead of
    # reading the file again); -1 = auto: as many as half of the host's available memory holds, and none on CPU
    # devices (their memory is the host's: a copy would hold the weights twice; the file's pages stay in the page
    # cache); 0 = none.
    max_host_models: int = -1

    # Long prompts and emphasis (docs/prompts.md).
    # Prompt chunks of 75 tokens a request may use (3 = 225 tokens); each chunk count 1..this compiles
    # once, on its first request, and longer prompts are cut with a warning.
    max_prompt_chunks: int = 3
    # How (word:1.2) weights apply: "original" (A1111's: scale the token's hidden state, restore the
    # chunk's mean) or "none" (brackets and BREAK are still syntax; every weight counts as 1).
    emphasis: str = "original"

    # ---- LoRAs ----
    # LoRA files that prompts pick with <lora:NAME:WEIGHT>: NAME=PATH entries, several separated by
    # os.pathsep (":" on Linux, as in PATH; the flag --lora NAME=PATH may instead be repeated). Each is
    # read and checked against the model at start (checkpoint/lora.py); a bad one stops the start.
    lora: str = ""
    # A folder whose every .safetensors file is a LoRA named by its file stem ("" = none).
    lora_dir: str = ""

    # ---- ControlNets (docs/controlnet.md) ----
    # ControlNets that requests' control units name: diffusers ControlNetModel folders (config.json + safetensors)
    # or .safetensors files in diffusers' layout, several separated by os.pathsep (the flag --controlnet PATH may
    # instead be repeated); each is named by its folder or file name without .safetensors, loaded in the model's
    # dtype and checked against the model at start (checkpoint/controlnet.py); a bad one stops the start.
    controlnet: str = ""
    # A folder whose every ControlNet (a sub-folder with config.json, or a .safetensors file) is loaded ("" = none).
    controlnet_dir: str = ""
    # Also load the ControlNets the default model's folder ships (its controlnets.json: tiny-shapes' canny
    # ControlNet, assets/tiny-shapes/controlnet-canny), after those two (which win for the same name).
    model_controlnets: bool = True
    # ControlNet units one request may have (A1111's "Multi-ControlNet" unit count); each count compiles its own
    # program on first use.
    max_control_units: int = 3

    # ---- IP-Adapter (docs/ip-adapter.md) ----
    # IP-Adapters that requests' ip_adapter_units name: h94/IP-Adapter's .safetensors files (sdxl_models/
    # ip-adapter_sdxl.safetensors), several separated by os.pathsep (the flag --ip-adapter PATH may instead be
    # repeated); each is named by its file name without .safetensors, its image encoder found beside it by h94's
    # layout (image_encoder/, ../image_encoder/, ../models/image_encoder/), loaded in the model's dtype and checked
    # against the model at start (checkpoint/ip_adapter.py); a bad one stops the start.
    ip_adapter: str = ""
    # IP-Adapter units one request may have; each count (and each unit's reference image count) compiles its own
    # program on first use.
    max_ip_adapter_units: int = 2

    # Progress, previews, Stop between the steps: the host runs the denoising steps in chunks (every step, or about
    # 0.1 s of faster steps: engine/steps.py) and reports each; off: one executable runs the whole loop, and Stop acts
    # only before a request starts.
    progress: bool = True
    # Steps between live previews of the running images (with progress on); -1 = about twice a second,
    # from the measured step time; 0 = no previews.
    preview_every: int = -1
    # After ready, compile the no-CFG variant of the default size and the other size buckets in the
    # background: on, off, or auto = on unless the devices are CPUs (where it slows the requests meanwhile).
    precompile: str = "auto"
    # Any image size the model's geometry allows is served (multiples of its block size: 8 x 2^downsamplings
    # pixels), up to this many pixels per image; 0 = auto: 4 x the model's native area, and at least
    # 1024 x 1024 (so every client's usual sizes: 512x512, 768x768, 1792x1024 on real SDXL). The model's size
    # buckets are compiled ahead; another size compiles on its first request, on the engine's compile
    # thread, while requests at compiled sizes run on.
    max_pixels: int = 0
    # New sizes compiling (or waiting to) at once; each client may wait for one. Over it a request at a
    # new size is refused with a message (retry later, or use a compiled size) instead of a stall.
    max_pending_compiles: int = 2
    # Threads that compile (or load from the executable cache) one program's three stages side by side (progress
    # on: prepare, advance, finish); 1 = one after another. On a TPU v5e a full-size cold start's compile went from
    # over 260 s to 127 s with 3, the host's memory peak from 21.8 to 23.5 GB (docs/benchmarks.md).
    compile_threads: int = 3
    # Compiled programs kept in memory beyond the size buckets' (the least recently used dropped; the
    # executable cache keeps them on disk, so one comes back without compiling).
    max_resident_programs: int = 8
    # Memory a request's run may take, in GB (on CPU devices: of the host's memory, which they share; on
    # accelerators: per device); 0 = auto: what is free once the engine is ready, less a reserve. A request whose
    # program needs more (XLA's count) is refused before it runs, naming the largest size that fits (engine/memory.py).
    max_run_memory_gb: float = 0.0
    # The longest a request may hold the devices, in seconds, as estimated before it runs (engine/durations.py:
    # XLA's FLOPs of its program x the device time per step measured at start-up and on every request); a longer
    # one is refused naming the steps that fit, so one client's long run does not hold the others. 0 = no limit.
    max_run_seconds: float = 30.0

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> EngineConfig:
        """Build the config: defaults, then ``SDXL_*`` environment variables, then ``overrides``.

        Raises:
            ConfigError: for a key that is not a field, or a value that does not convert to the
                field's type.
        """
        environ = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name in fields:
            key = ENV_PREFIX + name.upper()
            if key in environ:
                values[name] = environ[key]
        for name, value in (overrides or {}).items():
            if name not in fields:
                raise ConfigError(f"unknown config key {name!r}; known keys: {', '.join(sorted(fields))}")
            if value is not None:
                values[name] = value
        config = cls(**{name: _convert(name, fields[name].default, value) for name, value in values.items()})
        object.__setattr__(config, "_explicit", frozenset(values))  # not a field: equality and as_dict ignore it
        if "num_inference_steps" in values:  # else the model's default decides (with_model_defaults checks it)
            config.check_steps("set")
        return config

    @property
    def explicit(self) -> frozenset[str]:
        """The fields the environment or an override set (:meth:`load`); for a config built directly, the
        fields that differ from their defaults. A model's defaults never replace these."""
        return self._explicit

    def with_model_defaults(self, defaults: Mapping[str, Any], model: str = "the model",
                            source: str = "") -> EngineConfig:
        """This config with a model's own defaults (its engine_defaults.json) for the fields not :attr:`explicit`.

        Args:
            defaults: {field: value}, fields of :data:`MODEL_DEFAULT_FIELDS` only, converted and
                checked as :meth:`load` does; every value is checked, even one an explicit setting hides.
            model: names the model in the message of :meth:`check_steps` ("model 'tiny-shapes'").
            source: where ``defaults`` come from, put before the message of an error in them.
        Raises:
            ConfigError: another key, or a value that does not convert or is out of range; or the
                step count that will be used (set, the model's or the engine's default) exceeds
                ``max_inference_steps``: a value an explicit setting hides is not compared with it.
        """
        try:
            values = self._model_values(defaults)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}" if source else str(err)) from None
        config = dataclasses.replace(self, **{k: v for k, v in values.items() if k not in self.explicit})
        object.__setattr__(config, "_explicit", self.explicit)
        if "num_inference_steps" in self.explicit:
            origin = "set"
        elif "num_inference_steps" in values:
            origin = f"not set, so the default of {model}, from its engine_defaults.json"
        else:
            origin = f"not set, so the engine's default, as {model} chooses none"
        config.check_steps(origin)
        return config

    def _model_values(self, defaults: Mapping[str, Any]) -> dict[str, Any]:
        """``defaults`` converted to the fields' types and checked (ConfigError), whether used or not."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        for name in defaults:
            if name not in MODEL_DEFAULT_FIELDS:
                raise ConfigError(f"a model may choose only {', '.join(MODEL_DEFAULT_FIELDS)}, not {name!r}")
        values = {name: _convert(name, fields[name].default, value) for name, value in defaults.items()}
        dataclasses.replace(self, **values)  # checks each (__post_init__; the step limit: check_steps)
        return values

    def check_steps(self, origin: str) -> None:
        """Raise ConfigError if ``num_inference_steps`` exceeds ``max_inference_steps``.

        Args:
            origin: where the step count came from ("set", or which default), shown in the message.
        """
        if self.num_inference_steps > self.max_inference_steps:
            shown = "" if origin == "set" else f", {origin}"
            raise ConfigError(
                f"num_inference_steps ({self.num_inference_steps}{shown}) exceeds max_inference_steps "
                f"({self.max_inference_steps})"
                + ("" if origin == "set" else f": set num_inference_steps to {self.max_inference_steps} or less, "
                                               "or raise max_inference_steps")
            )

    def __post_init__(self):
        object.__setattr__(self, "_explicit", frozenset(f.name for f in dataclasses.fields(self)
                                                        if getattr(self, f.name) != f.default))
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        try:
            object.__setattr__(self, "sampler", get_sampler(self.sampler))  # canonical A1111 spelling
        except UnknownSampler as err:
            raise ConfigError(f"sampler: {err}") from None
        for name in ("num_inference_steps", "max_inference_steps", "cpu_devices"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        # num_inference_steps against max_inference_steps: check_steps, once the steps used are known
        # (load for a set value, with_model_defaults for a default: the model's may differ from this class's).
        for name in ("width", "height", "images_per_request"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be 0 (auto) or positive, got {getattr(self, name)}")
        for name in ("width", "height"):
            if getattr(self, name) % 8:
                raise ConfigError(f"{name} must be 0 (the model's size) or a multiple of 8 pixels, "
                                  f"got {getattr(self, name)}")
        if not 0.0 <= self.guidance_scale <= 50.0:  # also refuses NaN
            raise ConfigError(f"guidance_scale must be between 0 and 50, got {self.guidance_scale}")
        if not 0 <= self.max_seed <= 2**32 - 1:
            raise ConfigError(f"max_seed must be between 0 and 2**32 - 1 (seeds are uint32), got {self.max_seed}")
        if self.images_per_request:  # with 0 (auto), the engine checks once it knows the batch
            check_seed_range(self.max_seed, self.images_per_request)
        for name in ("max_queue_size", "max_requests_per_client"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.temp_max_mb > 0:  # also refuses NaN
            raise ConfigError(f"temp_max_mb must be a positive number of megabytes, got {self.temp_max_mb}")
        if not 0 <= self.temp_keep_s < float("inf"):
            raise ConfigError(f"temp_keep_s must be a finite number of seconds, 0 or more, got {self.temp_keep_s}")
        if not 1 <= self.max_prompt_chunks <= MAX_PROMPT_CHUNKS:
            raise ConfigError(f"max_prompt_chunks must be between 1 and {MAX_PROMPT_CHUNKS}, "
                              f"got {self.max_prompt_chunks}")
        if self.emphasis not in EMPHASIS_MODES:
            raise ConfigError(f"emphasis must be {' or '.join(EMPHASIS_MODES)}, got {self.emphasis!r}")
        if self.timestep_spacing not in ("", "leading", "trailing", "linspace"):
            raise ConfigError(f"timestep_spacing must be leading, trailing or linspace (or empty: the model's), "
                              f"got {self.timestep_spacing!r}")
        trusted_networks(self.trusted_proxies)
        lora_entries(self.lora)
        if self.preview_every < -1:
            raise ConfigError(f"preview_every must be -1 (about twice a second), 0 (off) or a number of steps, "
                              f"got {self.preview_every}")
        if self.precompile not in ("auto", "on", "off"):
            raise ConfigError(f"precompile must be auto, on or off, got {self.precompile!r}")
        if self.max_pixels < 0:
            raise ConfigError(f"max_pixels must be 0 (auto) or a number of pixels, got {self.max_pixels}")
        if not self.max_run_seconds >= 0:
            raise ConfigError("max_run_seconds must be 0 (no limit) or a number of seconds, "
                              f"got {self.max_run_seconds}")
        if not self.max_run_memory_gb >= 0:
            raise ConfigError(f"max_run_memory_gb must be 0 (auto) or a number of GB, got {self.max_run_memory_gb}")
        if self.max_resident_models < 0:
            raise ConfigError(f"max_resident_models must be 0 (auto) or a number of models, got "
                              f"{self.max_resident_models}")
        if self.max_host_models < -1:
            raise ConfigError(f"max_host_models must be -1 (auto), 0 (none) or a number of models, got "
                              f"{self.max_host_models}")
        for name in ("max_pending_compiles", "max_resident_programs", "compile_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")

    def as_dict(self) -> dict[str, Any]:
        """The resolved fields, for the one start-up log line."""
        return dataclasses.asdict(self)


def resolve_defaults(config: EngineConfig, model_defaults: Mapping[str, Any], model_name: str) -> EngineConfig:
    """What a request that sets nothing runs with: ``config`` with the model's engine_defaults.json
    (``model_defaults``, {field: value}) for the fields the config did not set explicitly.

    The one place defaults are resolved: the page calls it before the engine has loaded the model
    (serving.handler.page_defaults), the engine once it has (its ``defaults``, and from them its
    ``limits.default_*``). ``model_name`` (a built-in name, a folder or a hub id) names the model in
    messages.

    Raises ConfigError naming the file and the model for a key or value the model may not choose, or
    for a step count over ``max_inference_steps`` (saying whether it was set or which default it is).
    """
    return config.with_model_defaults(model_defaults, model=f"model {model_name!r}",
                                      source=f"{ENGINE_DEFAULTS_FILE} of model {model_name!r}")


def check_seed_range(max_seed: int, images: int) -> None:
    """Raise ConfigError unless the ``images`` of one request can have distinct seeds from 0 to ``max_seed``.

    Image i of a request uses ``(seed + i) % (max_seed + 1)`` (engine.py), so the seeds of one
    request are distinct, and so are its images, exactly when ``max_seed + 1 >= images``.
    """
    if max_seed + 1 < images:
        raise ConfigError(f"max_seed ({max_seed}) leaves {max_seed + 1} distinct seed{'s' if max_seed else ''} "
                          f"for the {images} images of a request, so some would be identical: set max_seed to "
                          f"{images - 1} or more")


def trusted_networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """The ``trusted_proxies`` setting as networks: comma-separated addresses (one host each) or networks.

    Raises:
        ConfigError: an entry that is neither an IP address nor a network, naming it.
    """
    networks = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ConfigError(f"trusted_proxies: {entry!r} is not an IP address or network (e.g. 10.0.0.2 or "
                              "10.0.0.0/8); separate several with commas") from None
    return tuple(networks)


def lora_entries(text: str, separator: str = os.pathsep) -> tuple[tuple[str, str], ...]:
    """The ``lora`` setting as (name, path) pairs, in order: ``NAME=PATH`` entries joined by ``separator``.

    Only the text is checked here (files: checkpoint.lora.lora_sources and check_lora_path).

    Raises:
        ConfigError: an entry without ``NAME=`` or a path, a name that is not letters, digits, ``_ - .``
            (:data:`LORA_NAME`), or one name twice; the message quotes the entry as ``--lora '...'``.
    """
    pairs: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in text.split(separator))):
        name, eq, path = (part.strip() for part in entry.partition("="))
        if not eq or not name or not path:
            raise ConfigError(f"lora: --lora {entry!r}: expected NAME=PATH (e.g. ink=loras/ink.safetensors)")
        if not LORA_NAME.fullmatch(name):
            raise ConfigError(f"lora: --lora {entry!r}: LoRA name {name!r} must be letters, digits, '_', '-' or '.' "
                              "(it is written in <lora:NAME:WEIGHT> tags)")
        if name in pairs:
            raise ConfigError(f"lora: --lora {entry!r}: two LoRAs named {name!r} ({pairs[name]} and {path}); "
                              "each name once")
        pairs[name] = path
    return tuple(pairs.items())


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def _convert(name: str, default: Any, value: Any) -> Any:
    kind = type(default)
    try:
        if kind is bool and isinstance(value, str):
            word = value.strip().lower()
            if word not in TRUE_WORDS + FALSE_WORDS:
                raise ValueError(f"not one of {', '.join(TRUE_WORDS + FALSE_WORDS)}")
            return word in TRUE_WORDS
        if kind is int and isinstance(value, str):
            return int(value.strip(), 0)
        return kind(value)
    except (TypeError, ValueError) as err:
        kind_name = {"int": "whole number", "float": "number", "str": "text",
                     "bool": "boolean"}.get(kind.__name__, kind.__name__)
        hint = f" ({', '.join(TRUE_WORDS)} or {', '.join(FALSE_WORDS)})" if kind is bool else ""
        raise ConfigError(f"{name} must be a {kind_name}{hint}, got {value!r}") from err


_applied: dict[str, Any] = {}

# JAX's own environment variables for the options the engine would otherwise set. JAX reads them
# when it is imported; when one is set, its value wins over the engine's setting (the user asked
# JAX directly) and one log line says so.
JAX_ENV = {
    "jax_num_cpu_devices": "JAX_NUM_CPU_DEVICES",
    "jax_compilation_cache_dir": "JAX_COMPILATION_CACHE_DIR",
    "jax_persistent_cache_min_compile_time_secs": "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "jax_persistent_cache_min_entry_size_bytes": "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
}
_XLA_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\S+)")


def plan_jax_options(config: EngineConfig,
                     environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The JAX options the engine sets for ``config``, and one note per option JAX's own variable decides.

    Wanted: ``cpu_devices`` CPU devices, the persistent compilation cache in
    ``compile_cache_dir``, and every program kept in it (JAX's defaults skip programs that
    compile in under a second, which is all of them for the tiny models). An option whose JAX
    variable is set (:data:`JAX_ENV`; for the CPU device count also XLA_FLAGS'
    ``--xla_force_host_platform_device_count``) is left to JAX.

    Returns:
        ({jax option: value} to set, log lines naming each value that won and why).
    """
    environ = os.environ if environ is None else environ
    wanted = {"jax_num_cpu_devices": config.cpu_devices}
    if config.compile_cache_dir:
        wanted.update({"jax_compilation_cache_dir": config.compile_cache_dir,
                       "jax_persistent_cache_min_compile_time_secs": 0.0,
                       "jax_persistent_cache_min_entry_size_bytes": -1})
    plan, notes = {}, []
    for option, value in wanted.items():
        variable = JAX_ENV[option]
        if environ.get(variable, "") != "":
            notes.append(f"[sdxl_engine] {option}: {variable}={environ[variable]} is set, so JAX's own setting wins "
                         f"over the engine's {value!r}")
            continue
        flag = _XLA_DEVICE_COUNT.search(environ.get("XLA_FLAGS", "")) if option == "jax_num_cpu_devices" else None
        if flag:
            notes.append(f"[sdxl_engine] {option}: XLA_FLAGS has --xla_force_host_platform_device_count={flag[1]}, "
                         f"so XLA's setting wins over the engine's cpu_devices={value}")
            continue
        plan[option] = value
    return plan, notes


def apply_jax_options(config: EngineConfig, environ: Mapping[str, str] | None = None,
                      log: Callable[[str], None] | None = None) -> str:
    """Set the JAX options that only work before JAX's first array (see :func:`plan_jax_options`).

    Logs one line per option that JAX's own environment variable decides instead. An
    unwritable cache directory (the engine's or JAX_COMPILATION_CACHE_DIR's) logs a warning and
    leaves the cache off. Calling it again with the same values is a no-op. ``log``: where the lines
    go (tests collect them); None: this module's logger, each line at its level.

    Returns:
        the compilation cache directory in use ("" = none).
    """
    import jax  # here, not at the top: see the imports

    plan, notes = plan_jax_options(config, environ)
    cache_dir = plan.get("jax_compilation_cache_dir", jax.config.jax_compilation_cache_dir or "")
    wanted = {**plan, "cache": cache_dir}
    if _applied.get("wanted") == wanted:
        return _applied["cache"]
    info, warn = log or LOG.info, log or LOG.warning
    for note in notes:
        info(note)
    if not _applied and "jax_num_cpu_devices" in plan:
        try:
            jax.config.update("jax_num_cpu_devices", plan["jax_num_cpu_devices"])
        except RuntimeError:  # something ran a JAX operation first: keep what the backend has
            warn(f"[sdxl_engine] warning: JAX was initialised before the engine; cpu_devices={config.cpu_devices} "
                f"not applied ({len(jax.devices())} devices)")
    if cache_dir:
        try:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            probe = Path(cache_dir) / ".write_probe"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            warn(f"[sdxl_engine] warning: compile cache {cache_dir!r} is not writable ({err}); running without it")
            cache_dir = ""
            jax.config.update("jax_compilation_cache_dir", None)
    if cache_dir:
        for option, value in plan.items():
            if option != "jax_num_cpu_devices":
                jax.config.update(option, value)
    _applied.clear()
    _applied.update(wanted=wanted, cache=cache_dir)
    return cache_dir
