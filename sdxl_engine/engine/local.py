"""The serving engine: one per process; loads, compiles before serving, then runs requests.

Start-up stages (each logged with its duration): configure JAX, load the model straight onto the
devices, compile the default size ahead of time (or load it from the executable cache, see
executables.py), run one zero-step warm-up request. Other size buckets and the no-CFG variant
(guidance <= 1) compile on first use and stay cached (and land in the executable cache, or with
it off in the persistent compilation cache, so a restart does not compile them again). Per request:
plan (plan.Planner, made at start), get or compile the plan's program (programs.Programs), run it.

The engine runs whatever it is given: requests are serialised in one place in front of it
(Gradio's concurrency limit in the app, one ongoing request per Ray Serve replica). A stopped request
may still run its last step after that place let the next one in, so :meth:`Engine.generate` also
takes a lock: the next request waits for that step, counted as its queue time.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from sdxl_engine import config as config_mod
from sdxl_engine.checkpoint import catalogue as catalogue_mod
from sdxl_engine.checkpoint import controlnet as controlnet_mod
from sdxl_engine.checkpoint import ip_adapter as ip_adapter_mod
from sdxl_engine.checkpoint import loading
from sdxl_engine.checkpoint import lora as lora_mod
from sdxl_engine.checkpoint import recipes as recipes_mod
from sdxl_engine.config import EngineConfig
from sdxl_engine.engine import faults, memory
from sdxl_engine.engine.contract import GenerateResult, ScaleOut, clock, queue_seconds, wait_for_start
from sdxl_engine.engine.control import ControlArrays, infotext
from sdxl_engine.engine.durations import RunTimes
from sdxl_engine.engine.errors import EngineNotReady, GenerationError, ModelUnavailable
from sdxl_engine.engine.image_upscale import upscale_images
from sdxl_engine.engine.ip_adapter import IPAdapterArrays, compile_reference_tokens
from sdxl_engine.engine.ip_adapter import infotext as ip_infotext
from sdxl_engine.engine.memory import MemoryBudget
from sdxl_engine.engine.plan import Plan, Planner
from sdxl_engine.engine.previews import latent_rgb_for
from sdxl_engine.engine.programs import Programs
from sdxl_engine.engine.residency import Residency, Resident, host_bytes, tree_bytes
from sdxl_engine.engine.steps import StepEvent, StepReceiver, Stopped
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, Limits, validate
from sdxl_engine.program import sharding
from sdxl_engine.program.compiling import CompiledProgram, abstract_params, program_family
from sdxl_engine.program.executables import ExecutableCache, key_digest, runtime_key
from sdxl_engine.program.generate import ProgramInputs
from sdxl_engine.program.latent_upscale import sharded_upscale
from sdxl_engine.program.schedulers import TWO_CALLS

LOG = logging.getLogger(__name__)


def out_of_device_memory(err: BaseException) -> bool:
    """Whether ``err`` is XLA's refusal of a program whose buffers exceed the device's memory (RESOURCE_EXHAUSTED:
    "Ran out of memory in memory space hbm", "exceeds available HBM")."""
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "Out of memory" in text


def start_does_not_fit(width: int, height: int, batch: int, devices: str, err: BaseException) -> str:
    """The start-up's one-line message when the default program does not fit the devices' memory: what was asked,
    XLA's own figures (its first line) and what to change (fewer images per request first, then the size)."""
    smaller = f"--images-per-request {batch // 2}" if batch > 1 and batch % 2 == 0 else "a smaller --width/--height"
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    return (f"the default program ({width}x{height} x {batch} images per request) does not fit the memory of "
            f"{devices}: {first[:300]}. Start with {smaller} (images per request: {batch}), or a smaller "
            "--width/--height")


def _no_progress(stage: str) -> None:
    """The default ``progress`` callback of :meth:`Engine.generate`: report nothing."""


def _pass_events(on_step: Callable[[StepEvent], None] | None, before: int, first: int, total: int):
    """``on_step`` for one pass of a hires request: the pass's step k (1-based in its schedule, whose first ``first``
    steps are skipped) reported as step ``before + k - first`` of ``total`` (both passes' steps), so progress
    counts through both."""
    if on_step is None:
        return None
    return lambda event: on_step(dataclasses.replace(event, step=before + event.step - first, steps=total))


# A refiner LoRA's names, for the Planner (which checks tags against them; a LoraMerger would hold the weights).
LoraNames = collections.namedtuple("LoraNames", "loras")


@dataclasses.dataclass(eq=False)
class ModelSetup:
    """What the engine knows of one model once it has loaded it; kept when its weights leave the devices (it holds
    none), so the model's requests are validated and planned, and its programs found, without loading it again.

    Attributes:
        name: the catalogue's name (what requests send, GenerateResult.model).
        model: the LoadedModel with its params (and its refiner's) as ShapeDtypeStructs: configs, tokenizers,
            scheduler config, kind, and the server's ControlNets that fit it (``controlnets``: their Components and
            params, loaded once for every model); what the planner and the programs read.
        defaults: the config with the model's engine_defaults.json (config.resolve_defaults).
        limits: what its requests may ask for (Limits: sizes, defaults, its LoRAs).
        planner: its Planner.
        programs: the compiled programs of its family (compiling.program_family): shared by every model of the
            same architecture, dtype and kind, so a switch between them compiles nothing.
        loras, refiner_loras: its LoRAs read and checked against it ({name: Lora}; merged per request by the
            resident's LoraMerger).
        faceid_loras: {IP-Adapter name: FaceIDLora} of its FaceID adapters that carry a LoRA (merged by the same
            LoraMerger for requests with a unit of the adapter: :meth:`Engine._faceid_tags`).
        latent_rgb: its previews' factors (previews.latent_rgb_for), or None.
        startup_mode: the program flags every request of it needs (an inpainting UNet's).
    """

    name: str
    model: loading.LoadedModel
    defaults: EngineConfig
    limits: Limits
    planner: Planner
    programs: Programs
    loras: dict
    refiner_loras: dict
    latent_rgb: Any = None
    startup_mode: dict = dataclasses.field(default_factory=dict)
    faceid_loras: dict = dataclasses.field(default_factory=dict)

    def merged_loras(self) -> dict:
        """{name: Lora} the model's LoraMerger holds: its LoRAs, then its FaceID adapters' (named
        checkpoint/ip_adapter.faceid_lora_name, which no tag can name)."""
        return {**self.loras, **{f.lora.name: f.lora for f in self.faceid_loras.values()}}


@dataclasses.dataclass(frozen=True)
class FaceIDLora:
    """A FaceID adapter's own LoRA read against one model (checkpoint/ip_adapter.read_faceid_lora).

    Attributes:
        lora: the Lora, merged at weight 1 for a request with a unit of the adapter (diffusers' ``load_ip_adapter``
            applies it at 1: ``set_adapters([f"faceid_{k}"], adapter_weights=[1.0])``).
        same: the names of the model's LoRAs with the same deltas (lora.same_deltas: h94's separate
            ``ip-adapter-faceid_sdxl_lora.safetensors`` loaded with --lora): a prompt tagging one of them gets it at
            the tag's weight, not twice.
    """

    lora: lora_mod.Lora
    same: frozenset


@dataclasses.dataclass(eq=False)
class ModelState:
    """A resident model's LoRA mergers (Resident.state): they hold its device params, so they go with them."""

    loras: lora_mod.LoraMerger
    refiner_loras: lora_mod.LoraMerger | None


class Engine:
    """Load + compile at :meth:`start`; :meth:`generate` runs one request.

    Implements :class:`~sdxl_engine.engine.contract.EngineContract` (what the page may use). Use
    :meth:`start_in_background` for the app's start. ``log``: where the start-up lines go (tests collect
    them); None: the engine's module loggers, each line at its level.
    """

    def __init__(self, config: EngineConfig, log: Callable[[str], None] | None = None):
        self.config = config
        # Set at start (None until then): the device mesh, images per request, the devices' platform.
        self.mesh: jax.sharding.Mesh | None = None
        self.batch: int | None = None
        self.platform = ""
        # Several models (docs/models.md), set at start: the models offered by name (checkpoint/catalogue.py), what
        # is known of each loaded so far (ModelSetup, by name), the compiled programs of each model family (shared
        # by its models), which models are on the devices (engine/residency.py), and the refiner (attached to each).
        self.catalogue: catalogue_mod.Catalogue | None = None
        self.setups: dict[str, ModelSetup] = {}
        self.families: dict[str, Programs] = {}
        self.residency: Residency | None = None
        self._refiner: loading.LoadedModel | None = None
        self._refiners: dict[str, loading.LoadedModel] = {}  # by name: the first (attached to the models), then others
        self._refiner_lock = threading.Lock()  # one refiner load at a time
        self._lora_sources: dict = {}  # the --lora / --lora-dir files, read against each model it loads
        # The ControlNets (--controlnet, --controlnet-dir; docs/controlnet.md), by name: server-wide, loaded once at
        # start and kept on the devices; each model's setup carries those that fit it (LoadedModel.controlnets).
        self.controlnets: dict[str, controlnet_mod.LoadedControlNet] = {}
        # The IP-Adapters (--ip-adapter; docs/ip-adapter.md), by name, likewise: loaded once at start with their image
        # encoders; each model's setup carries those that fit it (LoadedModel.ip_adapters).
        self.ip_adapters: dict[str, ip_adapter_mod.LoadedIPAdapter] = {}
        self.device_summary = ""  # set at start, e.g. "4 × cpu"
        self._collect = log  # handed on as it is: None lets each module log to its own logger
        self._log, self._warn = log or LOG.info, log or LOG.warning
        self.compile_cache_dir = ""  # set at start (apply_jax_options: "" = no persistent cache)
        self.executables: ExecutableCache | None = None  # set at start: <compile_cache_dir>/executables, or None
        self._start_name: str | None = None  # set at start with the executable cache: what starts.json calls it
        self._preloading = 0  # executables the start reads while the model loads (ExecutableCache.preload)
        self.stage = "starting"
        self.started = clock()
        self.startup: dict[str, float] = {}
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._faults = faults.injector()  # TEST-ONLY (faults.py): None unless the switch is on; read once
        self._request_lock = threading.Lock()  # one request at a time, also one a cancel left running for a step
        self.precompiled = threading.Event()  # set when the background precompile finished (or was not run)
        self.run_times: RunTimes | None = None  # set at start (max_run_seconds): the device-time estimate's figures
        self.memory: MemoryBudget | None = None  # set at start: the memory a request's run may take
        if self._faults:
            self._warn(f"[sdxl_engine] WARNING: {faults.ENV} is on: test-only faults can be triggered by prompts")

    # ---- the default model, as the single-model engine showed it ------------------------------------
    # The page, the protocols, the tools and the tests read these; each is the default model's (the first --model).
    def _default(self) -> ModelSetup | None:
        return self.setups.get(self.catalogue.default) if self.catalogue is not None else None

    def _default_resident(self) -> Resident | None:
        setup = self._default()
        return None if setup is None or self.residency is None else self.residency.peek(setup.name)

    @property
    def model(self) -> loading.LoadedModel | None:
        """The default model (its params as ShapeDtypeStructs: the weights are :attr:`params`), None before start."""
        setup = self._default()
        return None if setup is None else setup.model

    @property
    def params(self):
        """The default model's parameters on the devices (None while it is not resident). Settable (tests)."""
        resident = self._default_resident()
        return None if resident is None else resident.params

    @params.setter
    def params(self, value) -> None:
        self._default_resident().params = value

    @property
    def defaults(self) -> EngineConfig:
        """The config with the default model's engine_defaults.json (before start: the config)."""
        setup = self._default()
        return self.config if setup is None else setup.defaults

    @property
    def limits(self) -> Limits | None:
        """What requests for the default model may ask for (:meth:`limits_for`: another model's)."""
        setup = self._default()
        return None if setup is None else setup.limits

    @property
    def planner(self) -> Planner | None:
        setup = self._default()
        return None if setup is None else setup.planner

    @property
    def programs(self) -> Programs | None:
        """The default model's family's compiled programs (:attr:`families`: all of them)."""
        setup = self._default()
        return None if setup is None else setup.programs

    @property
    def latent_rgb(self):
        setup = self._default()
        return None if setup is None else setup.latent_rgb

    @property
    def _startup_mode(self) -> dict:
        setup = self._default()
        return {} if setup is None else setup.startup_mode

    @property
    def loras(self) -> lora_mod.LoraMerger | None:
        """The default model's LoRA merger while it is resident."""
        resident = self._default_resident()
        return None if resident is None else resident.state.loras

    @property
    def refiner_loras(self) -> lora_mod.LoraMerger | None:
        resident = self._default_resident()
        return None if resident is None else resident.state.refiner_loras

    # ---- several models: the API the fronts call (docs/models.md) ---------------------------------------
    def model_names(self) -> list[str]:
        """The models requests may name (GenerateRequest.model), the default first."""
        return self.catalogue.names() if self.catalogue is not None else [self.config.model]

    @property
    def default_model(self) -> str:
        """The default model's name (a request's ``model=None``)."""
        return self.catalogue.default if self.catalogue is not None else catalogue_mod.entry_name(self.config.model)

    def models_info(self) -> list[catalogue_mod.ModelInfo]:
        """Every model's listing entry (name, A1111 title "name [hash]", hash, sha256, filename), the default first.
        Never waits: a hash not computed yet is None (the first call starts hashing on a background thread)."""
        return self.catalogue.infos() if self.catalogue is not None else []

    def find_model(self, text: str) -> str | None:
        """The model a client's text names: a name or an A1111 title "name [hash]" (Catalogue.find), or None."""
        return self.catalogue.find(text) if self.catalogue is not None else None

    def resident_models(self) -> list[str]:
        """The models whose weights are on the devices now, least recently used first."""
        return self.residency.names() if self.residency is not None else []

    def limits_for(self, model: str | None) -> Limits | None:
        """What requests for ``model`` (None: the default) may ask for, once the engine has loaded it (its sizes,
        defaults and LoRAs); None for a model not loaded yet (the engine validates such a request once it is).

        Raises InvalidRequest (``model``) for a name that is not offered."""
        name = self._model_name(model)
        setup = self.setups.get(name)
        return None if setup is None else setup.limits

    def defaults_for(self, model: str | None) -> EngineConfig:
        """What a request for ``model`` (None: the default) that sets nothing runs with: the config with that model's
        engine_defaults.json (config.resolve_defaults). Once loaded, the engine's own resolution; before that, the
        file read from the model's folder (loading.engine_defaults: the config's values for a hub id or a
        single file, whose settings are known only once loaded). Never loads a model.

        Raises InvalidRequest (``model``) for a name that is not offered, ConfigError or ModelLoadError for an
        engine_defaults.json the engine would refuse at its load."""
        name = self._model_name(model)
        setup = self.setups.get(name)
        if setup is not None:
            return setup.defaults
        spec = self.catalogue.model(name).spec if self.catalogue is not None else self.config.model
        return config_mod.resolve_defaults(self.config, loading.engine_defaults(spec), spec)

    def lora_names_for(self, model: str | None) -> tuple[str, ...]:
        """The LoRAs ``<lora:NAME>`` tags of a request for ``model`` (None: the default) may name: once it is loaded,
        those read and checked against it (Limits.loras); before that, those it will try (--lora, --lora-dir and
        its folder's loras.json; one that does not fit it is left out at its load). Never loads a model.

        Raises InvalidRequest (``model``) for a name that is not offered."""
        name = self._model_name(model)
        setup = self.setups.get(name)
        if setup is not None:
            return setup.limits.loras
        if self.catalogue is None:
            return ()
        try:
            return tuple(self._lora_sources_of(self.catalogue.model(name)))
        except (lora_mod.LoraError, loading.ModelLoadError, OSError):  # its load says why, in one line
            return ()

    def rescan_models(self) -> tuple[list[str], list[str]]:
        """Read ``--models-dir`` / ``--refiners-dir`` again (A1111's /sdapi/v1/refresh-checkpoints); returns the
        (added, removed) names. A removed model's loaded weights stay until the residency drops them."""
        return self.catalogue.rescan()

    def _model_name(self, model: str | None) -> str:
        """``model`` checked against the catalogue (None: the default's name).

        Raises InvalidRequest (``model``) naming it and the models offered."""
        if model is None:
            return self.default_model
        names = self.model_names()
        model = model.strip() if isinstance(model, str) else model  # as validate's as_model
        if not isinstance(model, str) or model not in names:
            raise InvalidRequest("model", f"unknown model {str(model)[:120]!r}; this server offers: "
                                          + ", ".join(names))
        return model

    # ---- start-up -------------------------------------------------------------------------
    def start(self) -> Engine:
        """Run every start-up stage in this thread; sets ``ready`` or ``error``. Returns self."""
        try:
            self._start()
            self.stage = "ready"
            self.ready.set()
        except BaseException as err:
            if self.executables:
                self.executables.finish_start(None)  # what was read early is dropped; nothing recorded
            self.error = err
            self.stage = f"failed: {err}"
            self.ready.set()
            raise
        return self

    def start_in_background(self) -> Engine:
        """:meth:`start` on a daemon thread; returns self at once (``ready`` tells when it is done; a start-up
        failure is kept in ``error``, not raised: the app prints it and exits)."""
        def start_quietly() -> None:
            try:
                self.start()
            except BaseException:  # noqa: BLE001 - recorded in self.error; the app prints it once and exits
                pass

        threading.Thread(target=start_quietly, name="engine-start", daemon=True).start()
        return self

    def _stage(self, name: str, note: str = ""):
        self.stage = name
        self._log(f"[sdxl_engine] {name}{f' ({note})' if note else ''} ...")
        return time.perf_counter()

    def _done(self, key: str, t0: float) -> None:
        self.startup[key] = time.perf_counter() - t0
        self._log(f"[sdxl_engine] {key}: {self.startup[key]:.2f} s")

    def _start(self) -> None:
        # 1. JAX options (before JAX's first array), the mesh and the batch.
        self.compile_cache_dir = config_mod.apply_jax_options(self.config, log=self._collect)
        if self.compile_cache_dir and self.config.executable_cache:
            self.executables = ExecutableCache(Path(self.compile_cache_dir) / "executables")
        self._log(f"[sdxl_engine] config: {self._config_shown()}")
        self.mesh = sharding.make_mesh()
        self.batch = self.config.images_per_request or sharding.default_batch(self.mesh.devices.size)
        sharding.check_batch(self.batch, self.mesh)
        config_mod.check_seed_range(self.config.max_seed, self.batch)
        self.device_summary = sharding.device_summary(self.mesh)
        if self.executables:  # the executables the last start of this configuration loaded, read while models load
            devices = list(self.mesh.devices.flat)
            self._start_name = key_digest({"config": dataclasses.asdict(self.config), **runtime_key(devices)})
            self._preloading = self.executables.preload(self._start_name, devices, self.config.compile_threads)

        # 2. The models offered (names: checkpoint/catalogue.py), then the default one, each parameter straight onto
        # the devices; the LoRAs' files checked first.
        self.catalogue = catalogue_mod.Catalogue(
            [self.config.model, *catalogue_mod.split_specs(self.config.models)], self.config.models_dir,
            [*([self.config.refiner] if self.config.refiner else []), *catalogue_mod.split_specs(self.config.refiners)],
            self.config.refiners_dir, cache_dir=self.config.model_cache_dir, log=self._log)
        names = self.catalogue.names()
        if len(names) > 1:
            self._log(f"[sdxl_engine] models: {', '.join(names)} (the default: {names[0]}; docs/models.md)")
        entry = self.catalogue.model(None)
        lora_sources = self._lora_sources_of(entry)
        for path in lora_sources.values():
            lora_mod.check_lora_path(path)
        t0 = self._stage("loading model onto the devices", f"and reading the {self._preloading} executables the last "
                         "start of this configuration loaded" if self._preloading else "")  # a few lines: one here
        if self._faults:  # TEST-ONLY (faults.py): a start slow enough to watch
            self._faults.on_start()
        self.platform = jax.devices()[0].platform
        loaded = self._read_model(entry, default=True)
        jax.block_until_ready(loaded.params)
        self._done("load_s", t0)
        self._load_refiner(loaded)
        self._load_controlnets(loaded)  # server-wide, once: every model's setup carries those that fit it
        self._load_ip_adapters(loaded)  # likewise
        setup = self._setup(entry.name, loaded, lora_sources, strict=True)
        resident = self._resident(setup, self._params_of(loaded))
        del loaded  # the resident holds the weights now, and is what drops them
        # room for one model until the memory is measured (5.)
        self.residency = Residency(self._load_for_request, resident.nbytes, 0, self._collect)
        self.residency.add(resident)

        # 3. Compile the default size (CFG, the default guidance's mode) ahead of time.
        width, height = self.limits.default_size
        self._stage(f"compiling {width}x{height} x {self.batch} images"
                    + (", unless the executable cache has them" if self.executables else ""))
        try:
            self.startup["compile_s"] = self.program(width, height, self.defaults.guidance_scale > 1,
                                                     **self._startup_mode).compile_s
        except Exception as err:  # XLA's out-of-memory is an XlaRuntimeError (jax's own type moved between versions)
            if not out_of_device_memory(err):
                raise
            raise EngineNotReady(start_does_not_fit(width, height, self.batch, self.device_summary, err)) from err

        # 3b. With ControlNets: the one-unit program of the default size for each architecture that fits the default
        # model, so a server that says ready has it (the first request with a unit compiled it inside the request).
        for arch in sorted({net.architecture for net in self.model.controlnets.values()}):
            self._stage(f"compiling {width}x{height} x {self.batch} images with a ControlNet unit")
            self.program(width, height, self.defaults.guidance_scale > 1, controlnets=(arch,), **self._startup_mode)
        # 3c. With IP-Adapters: the one-unit, one-image program of the default size for each kind (architecture,
        # tokens per image) that fits the default model, likewise.
        width_ip = self.model.unet.cross_attention_dim[-1]
        for arch, tokens in sorted({(a.architecture, a.tokens) for a in self.model.ip_adapters.values()}):
            self._stage(f"compiling {width}x{height} x {self.batch} images with an IP-Adapter unit")
            self.program(width, height, self.defaults.guidance_scale > 1, ip_adapters=((arch, tokens, width_ip),),
                         **self._startup_mode)
        # 3d. Each IP-Adapter's image encoder and projection for a one-image unit: jitted apart from the program (its
        # tokens are computed once per request and traced), so it is compiled here, not inside the first request.
        if self.ip_adapters:
            t0 = self._stage("compiling the IP-Adapters' image encoders for one reference image")
            for adapter in self.ip_adapters.values():
                compile_reference_tokens(adapter)
            self._done("ip_encoder_s", t0)

        # 4. One request through the compiled program with zero denoising steps: the executable runs
        # (first-run allocations; text encoders and VAE decode checked finite) without paying a UNet
        # step, which the compile (or the executable cache) has readied already.
        t0 = self._stage("warm-up request")
        image = dict(image=np.full((height, width, 3), 128, np.uint8), mask=np.ones((height, width), np.float32),
                     strength=1.0) if self._startup_mode else {}
        plan = self.planner.plan(validate(GenerateRequest("warm-up", seed=0, num_inference_steps=1, **image),
                                          self.limits))
        warm = self.program(width, height, plan.shape.cfg, plan.shape.chunks, **self._startup_mode)
        self._run(plan, warm, loop_steps=0)
        self._done("warmup_s", t0)
        self._time_runs(plan, warm)
        # 5. What a request's run may take of the memory left now (weights loaded, first program warmed up).
        budget = self.memory = MemoryBudget.measure(self.mesh, self.limits.multiple, self.batch,
                                                    self.config.max_run_memory_gb)
        self._size_residency(budget, resident)
        times = self.run_times
        self._log(f"[sdxl_engine] a request's run may take {budget.capacity / 1e9:.1f} GB of {budget.where}"
                  + ("" if self.config.max_run_memory_gb else
                     f" (free at ready less {memory.RESERVE:.0%}; max_run_memory_gb)")
                  + ("" if times is None else
                     f" and {times.limit_s:g} s of device time (max_run_seconds; measured at {width}x{height} x "
                     f"{self.batch} images: {times.fixed_s:.3f} s + {times.step_s:.3f} s per step)"))
        read = ""
        if self.executables:
            taken, dropped = self.executables.finish_start(self._start_name)
            if taken or dropped:  # said in the ready line: a start logs a few lines (tests/test_app.py)
                read = f"; {taken} executables read while the model loaded" + (
                    f", {dropped} read and not needed (dropped)" if dropped else "")
        self.startup["ready_s"] = clock() - self.started
        self._log(f"[sdxl_engine] ready in {self.startup['ready_s']:.2f} s on {self.device_summary} "
                  f"({self.model.name}, {self.model.dtype}{read})")
        self._start_precompile()

    def _time_runs(self, plan: Plan, program: CompiledProgram) -> None:
        """Measure the default program's device seconds with 0, 1 and 5 denoising steps (the warm-up's plan, warmed
        up; each the quicker of two runs): what durations.RunTimes scales to estimate every request (config
        ``max_run_seconds``; 0: not measured)."""
        self.run_times = None
        cost = self.programs.costs.estimate(plan.shape)
        if not self.config.max_run_seconds or cost is None:
            return
        self.stage = "timing the denoising steps"  # logged with the memory budget, in one line (_start)
        t0 = time.perf_counter()

        def device_s(steps: int) -> float:
            return min(self._run(plan, program, loop_steps=steps).timings["device"] for _ in range(2))

        fixed = device_s(0)
        one = device_s(1)  # a loop's entry and first step cost more than the steps after them
        five = device_s(5)
        self.run_times = RunTimes(self.config.max_run_seconds, cost, fixed, max((five - one) / 4, 1e-6), self.batch)
        self.startup["timing_s"] = time.perf_counter() - t0

    def _load_refiner(self, loaded: loading.LoadedModel) -> None:
        """With ``config.refiner``: load the SDXL refiner onto the same devices (replicated over the mesh) the first
        time (its VAE is not kept: the base's decodes), check it against the model ``loaded``
        (loading.check_refiner) and attach it (``loaded.refiner``; its text_encoder_2 and UNet go in the program's
        ``params["refiner"]``: :meth:`_params_of`). A mismatch stops the start for the default model; another model
        is served without the refiner (one log line)."""
        if not self.catalogue.names(refiners=True):
            return
        if self._refiner is None:
            t0 = self._stage("loading the refiner onto the devices")
            entry = self.catalogue.refiner(None)
            refiner = self._read_refiner(entry.spec, loaded.dtype)
            loading.check_refiner(loaded, refiner)
            self._refiner = self._refiners[entry.name] = refiner
            self._done("refiner_load_s", t0)
        try:
            loading.check_refiner(loaded, self._refiner)
        except loading.RefinerMismatch as err:
            if not self.setups:  # the default model
                raise
            self._warn(f"[sdxl_engine] {loaded.name} is served without the refiner: {err}")
            return
        loaded.refiner = self._refiner

    def _read_refiner(self, spec: str, dtype: str) -> loading.LoadedModel:
        """A refiner onto the devices (replicated), its text_encoder_2 and UNet kept (the base's VAE decodes)."""
        refiner = loading.load_model(spec, dtype=dtype, platform=self.platform, variant=self.config.variant,
                                     cache_dir=self.config.model_cache_dir, sharding=sharding.replicated(self.mesh),
                                     log=self._collect or loading.LOG.info, model_config=self.config.refiner_config,
                                     flag="--refiner")
        refiner.params = {name: refiner.params[name] for name in ("text_encoder_2", "unet")}  # the VAE's freed
        jax.block_until_ready(refiner.params)
        return refiner

    def refiner_names(self) -> list[str]:
        """The refiners requests may name (GenerateRequest.refiner), the default (the first --refiner) first."""
        return self.catalogue.names(refiners=True) if self.catalogue is not None else []

    def _chosen_refiner(self, name: str | None, progress: Callable[[str], None]) -> loading.LoadedModel | None:
        """The refiner a request names (None: the first, attached to every model: None is returned, nothing to
        swap), loaded on first use (``progress("loading model")``; kept on the devices from then on). It must be
        of the first refiner's architecture: its weights then go to the same programs.

        Raises InvalidRequest (``refiner``): an unknown name, or another architecture. ModelUnavailable: its files
        could not be read."""
        names = self.refiner_names()
        if name is None or (names and name == names[0]):
            return None
        if name not in names:
            raise InvalidRequest("refiner", f"unknown refiner {name[:120]!r}; this server offers: "
                                            + (", ".join(names) or "none"))
        with self._refiner_lock:
            refiner = self._refiners.get(name)
            if refiner is None:
                progress("loading model")
                try:
                    refiner = self._read_refiner(self.catalogue.refiner(name).spec, self._refiner.dtype)
                except (loading.ModelLoadError, OSError) as err:
                    raise ModelUnavailable(f"refiner {name!r} could not be loaded: {err}") from err
                first = self._refiner
                same = ({k: c.config for k, c in refiner.components.items() if k in refiner.params}
                        == {k: c.config for k, c in first.components.items() if k in first.params}
                        and refiner.kind == first.kind)
                if not same:
                    raise InvalidRequest("refiner", f"{name} is not of the first refiner's ({names[0]}) architecture; "
                                                    "this server runs refiners of one architecture")
                self._refiners[name] = refiner
        return refiner

    def _load_controlnets(self, loaded: loading.LoadedModel) -> None:
        """With ``config.controlnet`` / ``controlnet_dir`` (and the default model's own, ``model_controlnets``):
        load each ControlNet once for the whole server, in the
        default model ``loaded``'s dtype (every model's: config ``dtype``) onto the devices (replicated), a single
        file without a config after its UNet's (diffusers' from_unet rule), and keep them (:attr:`controlnets`, by
        name). Each model's :meth:`_setup` checks which fit it (:meth:`_fitting_controlnets`)."""
        shipped = loading.model_controlnets(self.config.model) if self.config.model_controlnets else {}
        sources = controlnet_mod.controlnet_sources(self.config.controlnet, self.config.controlnet_dir,
                                                    shipped=shipped)
        if not sources:
            return
        t0 = self._stage(f"loading {len(sources)} ControlNets onto the devices")
        unet_config = dataclasses.asdict(loaded.unet)  # a single file without a config: from_unet's rule
        nets = {}
        for name, path in sources.items():
            nets[name] = controlnet_mod.load_controlnet(name, path, loaded.dtype, unet_config,
                                                        sharding.replicated(self.mesh), log=self._collect or self._log)
        self.controlnets = nets
        jax.block_until_ready([n.params for n in nets.values()])
        self._done("controlnet_load_s", t0)

    def _load_ip_adapters(self, loaded: loading.LoadedModel) -> None:
        """With ``config.ip_adapter``: load each IP-Adapter and its image encoder once for the whole server, in the
        default model ``loaded``'s dtype onto the devices (replicated), read against its UNet, and keep them
        (:attr:`ip_adapters`, by name). Each model's :meth:`_setup` checks which fit it
        (:meth:`_fitting_ip_adapters`)."""
        sources = ip_adapter_mod.ip_adapter_sources(self.config.ip_adapter)
        if not sources:
            return
        t0 = self._stage(f"loading {len(sources)} IP-Adapters onto the devices")
        self.ip_adapters = {name: ip_adapter_mod.load_ip_adapter(name, path, loaded.dtype, loaded.unet,
                                                                 sharding.replicated(self.mesh),
                                                                 log=self._collect or self._log)
                            for name, path in sources.items()}
        jax.block_until_ready([(a.params, a.encoder_params) for a in self.ip_adapters.values()])
        self._done("ip_adapter_load_s", t0)

    def _fitting_ip_adapters(self, loaded: loading.LoadedModel, strict: bool) -> dict:
        """{name: LoadedIPAdapter} of the server's IP-Adapters that fit the model ``loaded`` (checkpoint/ip_adapter
        .check_fits); one that does not, as :meth:`_fitting_controlnets`."""
        return self._fitting("IP-Adapter", self.ip_adapters, lambda a: ip_adapter_mod.check_fits(a, loaded.unet),
                             loaded.name, strict)

    def _fitting(self, kind: str, addons: dict, check: Callable, model: str, strict: bool) -> dict:
        """{name: add-on} of ``addons`` that ``check`` passes for ``model``; one it refuses (ModelLoadError): with
        ``strict`` the error stops the start, else it is left out for this model (one log line)."""
        fitting = {}
        for name, addon in addons.items():
            try:
                check(addon)
            except loading.ModelLoadError as err:
                if strict:
                    raise
                self._warn(f"[sdxl_engine] {kind} {name} is left out for {model}: {err}")
                continue
            fitting[name] = addon
        return fitting

    @staticmethod
    def _ip_adapter(params: dict, ip: IPAdapterArrays | None, inputs: ProgramInputs,
                    setup: ModelSetup) -> tuple[dict, ProgramInputs]:
        """``params`` and ``inputs`` for a pass of model ``setup`` with IP-Adapter units (``ip``, a plan's): each
        unit's adapter params in ``params["ip_adapter"]``, the units' arrays in the inputs; as they are without."""
        if ip is None:
            return params, inputs
        adapters = setup.model.ip_adapters
        return ({**params, "ip_adapter": tuple(adapters[m].layer_params for m in ip.models)},
                inputs.with_ip_adapter(**ip.inputs()))

    def _fitting_controlnets(self, loaded: loading.LoadedModel, strict: bool) -> dict:
        """{name: LoadedControlNet} of the server's ControlNets that fit the model ``loaded``
        (checkpoint/controlnet.check_fits). One that does not: with ``strict`` (the default model) its ModelLoadError
        stops the start; else it is left out for this model (one log line; units naming it are refused for it)."""
        return self._fitting("ControlNet", self.controlnets,
                             lambda net: controlnet_mod.check_fits(net, loaded.components["unet"],
                                                                   loaded.vae_scale_factor, loaded.latent_channels),
                             loaded.name, strict)

    @staticmethod
    def _control(params: dict, control: ControlArrays | None, inputs: ProgramInputs,
                 setup: ModelSetup) -> tuple[dict, ProgramInputs]:
        """``params`` and ``inputs`` for a pass of model ``setup`` with ControlNet units (``control``, a plan's):
        each unit's ControlNet params in ``params["controlnet"]``, the units' arrays in the inputs; as they are
        without."""
        if control is None:
            return params, inputs
        nets = setup.model.controlnets
        return ({**params, "controlnet": tuple(nets[m].params for m in control.models)},
                inputs.with_control(**control.inputs()))

    @staticmethod
    def _params_of(loaded: loading.LoadedModel) -> dict:
        """The program's params of ``loaded``: its own, and its refiner's under ``"refiner"``."""
        return loaded.params if loaded.refiner is None else {**loaded.params, "refiner": loaded.refiner.params}

    def _lora_sources_of(self, entry: catalogue_mod.ModelEntry) -> dict:
        """{name: path} of the LoRAs ``entry`` may use: --lora and --lora-dir, then the model's own (loras.json)."""
        return lora_mod.lora_sources(self.config.lora, self.config.lora_dir, os.pathsep,
                                     loading.model_loras(entry.spec))

    def _read_model(self, entry: catalogue_mod.ModelEntry, default: bool = False) -> loading.LoadedModel:
        """Read ``entry`` onto the devices (replicated over the mesh). ``--unet``, ``--vae``, ``--revision`` and
        ``--timestep-spacing`` apply to the default model only; ``--model-config`` to every single file.

        Raises ModelLoadError: a read error, or an SDXL refiner (it cannot make images from text)."""
        swaps = dict(unet=self.config.unet, vae=self.config.vae, timestep_spacing=self.config.timestep_spacing,
                     revision=self.config.revision) if default else {}
        loaded = loading.load_model(entry.spec, dtype=self.config.dtype, platform=self.platform,
                                    variant=self.config.variant, cache_dir=self.config.model_cache_dir,
                                    sharding=sharding.replicated(self.mesh), log=self._collect or loading.LOG.info,
                                    model_config=self.config.model_config, **swaps)
        if loaded.kind.refiner:
            raise loading.ModelLoadError(loaded.kind.txt2img_refusal(loaded.name))
        return loaded

    def _setup(self, name: str, loaded: loading.LoadedModel, lora_sources: dict, strict: bool) -> ModelSetup:
        """What the engine keeps of model ``name`` (ModelSetup), made from its first load: the server's ControlNets
        that fit it (``loaded.controlnets``, kept by its skeleton: its planner's and its family's programs' units) and
        its LoRAs, read against it (``strict``: one that does not fit stops the start; else it is left out for this
        model, one log line), its defaults, limits and planner, and its family's programs (found, or made for the
        first of its family; models of one family fit the same ControlNets: the fit reads the configs the family
        digests)."""
        startup_mode = dict(init_image=True, inpaint=True) if loaded.kind.inpainting_unet else {}
        loaded.controlnets = self._fitting_controlnets(loaded, strict)  # the skeleton keeps them (the planner's)
        loaded.ip_adapters = self._fitting_ip_adapters(loaded, strict)
        loras, for_refiner = self._read_loras(loaded, lora_sources, strict)
        faceid_loras = self._faceid_loras(loaded, loras, strict)  # may leave an adapter out (before the limits)
        defaults = self._model_defaults(loaded, self.catalogue.model(name).spec)
        limits = self._limits(loaded, defaults, (*loras, *for_refiner), startup_mode,
                              lora_recipes(lora_sources, loras, self._log))
        params = self._params_of(loaded)
        skeleton = dataclasses.replace(loaded, params=abstract_params(loaded.params), refiner=None if loaded.refiner
                                       is None else dataclasses.replace(loaded.refiner,
                                                                        params=abstract_params(loaded.refiner.params)))
        family = program_family(loaded, params)
        programs = self.families.get(family)
        if programs is None:
            programs = self.families[family] = Programs(skeleton, abstract_params(params), self.mesh, self.batch,
                                                        self.executables, self.config, self.compile_cache_dir,
                                                        limits.sizes, self._collect)
        elif self.setups:
            self._log(f"[sdxl_engine] {name} shares the compiled programs of "
                      + ", ".join(s.name for s in self.setups.values() if s.programs is programs)
                      + " (the same architecture, dtype and kind: nothing compiles for it)")
        planner = Planner(skeleton, self.config, limits, self.batch, LoraNames(for_refiner) if for_refiner else None)
        setup = self.setups[name] = ModelSetup(name, skeleton, defaults, limits, planner, programs, loras, for_refiner,
                                               latent_rgb_for(loaded.source, loaded.latent_channels), startup_mode,
                                               faceid_loras)
        return setup

    def _resident(self, setup: ModelSetup, params) -> Resident:
        """A Resident of ``setup``'s model with ``params`` on the devices and its LoRA mergers."""
        place = sharding.replicated(self.mesh)
        state = ModelState(lora_mod.LoraMerger(params, setup.merged_loras(), place),
                           lora_mod.LoraMerger(params["refiner"], setup.refiner_loras, place)
                           if setup.refiner_loras else None)
        own = {k: v for k, v in params.items() if k != "refiner"}  # the refiner's stay resident, shared by all
        return Resident(setup.name, params, tree_bytes(own), state)

    def _load_for_request(self, name: str, host_params) -> Resident:
        """The residency's loader (engine/residency.py), on its thread: model ``name`` onto the devices, from the
        host cache's arrays (``host_params``) or its file; its ModelSetup made on its first load."""
        setup = self.setups.get(name)
        if host_params is not None and setup is not None:
            params = jax.device_put(host_params, sharding.replicated(self.mesh))
            jax.block_until_ready(params)
            return self._resident(setup, params)
        entry = self.catalogue.model(name)
        default = name == self.catalogue.default
        if setup is not None and setup.model.source and not (default and (self.config.unet or self.config.vae)):
            # loaded before: its weights alone, read with the components it has (loading.reload_params)
            params = loading.reload_params(setup.model, sharding.replicated(self.mesh), self.config.variant,
                                           self._collect or loading.LOG.info)
            if setup.model.refiner is not None:
                params = {**params, "refiner": self._refiner.params}
            jax.block_until_ready(params)
            return self._resident(setup, params)
        loaded = self._read_model(entry, default=default)
        jax.block_until_ready(loaded.params)
        self._load_refiner(loaded)
        if setup is None:
            setup = self._setup(name, loaded, self._lora_sources_of(entry), strict=False)
        return self._resident(setup, self._params_of(loaded))

    def _size_residency(self, budget: MemoryBudget, resident: Resident) -> None:
        """Bound the resident models (``max_resident_models``; 0: as many as half the memory a run may take holds
        beside the default, at least 1, at most the models offered) and the host cache (``max_host_models``), and
        keep the room of the resident models beyond the first out of what a run may take (``budget``, unless
        ``max_run_memory_gb`` set it). ``resident``: the default model, whose size stands for every model's."""
        devices = self.mesh.devices.size
        per_pool = resident.nbytes * budget.pool // devices  # its weights' bytes in the pool a run's budget counts
        count = self.config.max_resident_models
        if not count:
            count = 1 + (int(budget.capacity * 0.5 // per_pool) if budget.capacity and per_pool else 0)
            count = max(1, min(count, len(self.catalogue.names())))
        self.residency.capacity = count * resident.nbytes
        if not self.config.max_run_memory_gb and budget.capacity:
            budget.capacity = max(0, budget.capacity - (count - 1) * per_pool)
        one = host_bytes(resident.params) or 1
        hosts = self.config.max_host_models
        if hosts < 0:
            hosts = 0 if self.platform == "cpu" else int(0.5 * memory.host_available_bytes() // one)
        self.residency.host_capacity = hosts * one
        if len(self.catalogue.names()) > 1:
            self._log(f"[sdxl_engine] resident models: up to {count} on the devices "
                      f"({self.residency.capacity / 1e9:.2f} GB of weights), {hosts} more in host memory "
                      "(max_resident_models, max_host_models)")

    def _read_loras(self, loaded: loading.LoadedModel, sources: dict, strict: bool) -> tuple[dict, dict]:
        """Read and check every LoRA against the model ``loaded``, or, when it does not fit the model and a refiner is
        loaded, against the refiner (a LoRA trained for the refiner: its tags then change the refiner's steps).
        A LoRA that fits neither: with ``strict`` (the default model) LoraError stops the start; else it is left
        out for this model (one log line; its tags are refused for it). Returns ({name: Lora} of the model's,
        {name: Lora} of the refiner's)."""
        t0 = time.perf_counter()
        if sources and strict:  # the banner's stage; the log gets one line, after
            self.stage = f"loading {len(sources)} LoRAs"
        loras, for_refiner = {}, {}
        for name, path in sources.items():
            try:
                loras[name] = lora_mod.read_lora(name, path, loaded.components)
            except lora_mod.LoraError as err:
                try:
                    if loaded.refiner is None:
                        raise
                    for_refiner[name] = lora_mod.read_lora(name, path, {
                        k: c for k, c in loaded.refiner.components.items() if k in loaded.refiner.params})
                except lora_mod.LoraError:
                    if strict:
                        raise err from None
                    self._warn(f"[sdxl_engine] LoRA {name} is left out for {loaded.name}: {err}")
        if sources:
            took = time.perf_counter() - t0
            if strict:  # the start's figure
                self.startup["lora_s"] = took
            self._log(f"[sdxl_engine] LoRAs{'' if strict else ' of ' + loaded.name}: " + ", ".join(
                f"{i['name']} ({i['format']}, {i['layers']} layers, hash {i['hash']}"
                f"{', for the refiner' if i['name'] in for_refiner else ''})"
                for i in lora_mod.lora_info([*loras.values(), *for_refiner.values()]))
                + f"; read in {took:.2f} s")
        return loras, for_refiner

    def _lora_params(self, loras: tuple[tuple[str, float], ...], served: Resident | None = None,
                     faceid: tuple[tuple[str, float], ...] = ()) -> tuple[dict, dict[str, str]]:
        """The params of model ``served`` (None: the default) for a plan's LoRAs (``Plan.loras``: the prompt's tags
        as (name, weight); merged outside the compiled program by that model's own mergers; the base params without
        any; a refiner LoRA merges into ``params["refiner"]``) and {name: short hash} of those tags. The tags were
        checked by validate (Limits.loras) and the plan (a refiner LoRA needs the refiner). ``faceid``: its FaceID
        adapters' LoRAs the plan's units bring (:meth:`_faceid_tags`), merged into the UNet in the same set, not
        in the hashes (the infotext's "Lora hashes" are the prompt's tags; the unit names the adapter)."""
        served = served or self._default_resident()
        if not loras and not faceid:
            return served.params, {}
        mergers = served.state
        refiner = mergers.refiner_loras.loras if mergers.refiner_loras else {}
        params = mergers.loras.params([(name, weight) for name, weight in loras if name not in refiner] + list(faceid))
        if any(name in refiner for name, _ in loras):
            params = {**params, "refiner": mergers.refiner_loras.params([(name, weight) for name, weight in loras
                                                                        if name in refiner])}
        return params, {name: (refiner.get(name) or mergers.loras.loras[name]).short_hash for name, _ in loras}

    @staticmethod
    def _faceid_tags(plan: Plan, setup: ModelSetup) -> tuple[tuple[str, float], ...]:
        """(LoRA name, 1.0) of each FaceID adapter with a LoRA (ModelSetup.faceid_loras) that a unit of ``plan``
        uses, once however many units use it, as diffusers' ``load_ip_adapter`` applies it (weight 1); none for an
        adapter whose LoRA the prompt already tags (FaceIDLora.same: the tag's weight applies, not both)."""
        if plan.ip is None or not setup.faceid_loras:
            return ()
        tagged = {name for name, _ in plan.loras}
        entries = (setup.faceid_loras.get(model) for model in dict.fromkeys(plan.ip.models))
        return tuple((entry.lora.name, 1.0) for entry in entries if entry is not None and not entry.same & tagged)

    def _faceid_loras(self, loaded: loading.LoadedModel, loras: dict, strict: bool) -> dict:
        """{IP-Adapter name: FaceIDLora} of the FaceID adapters fitting ``loaded`` (``loaded.ip_adapters``) that carry
        a LoRA, read against it (checkpoint/ip_adapter.read_faceid_lora) and compared with its LoRAs ``loras``
        ({name: Lora}; lora.same_deltas). One whose LoRA does not fit the model: with ``strict`` its LoraError stops
        the start, else the adapter is left out for this model (one log line), as an adapter that does not fit."""
        out = {}
        for name, adapter in list(loaded.ip_adapters.items()):
            try:
                lora = ip_adapter_mod.read_faceid_lora(adapter, loaded.components)
            except lora_mod.LoraError as err:
                if strict:
                    raise
                self._warn(f"[sdxl_engine] IP-Adapter {name} is left out for {loaded.name}: {err}")
                del loaded.ip_adapters[name]
                continue
            if lora is not None:
                same = frozenset(n for n, other in loras.items() if lora_mod.same_deltas(lora, other))
                out[name] = FaceIDLora(lora, same)
                if same:
                    self._log(f"[sdxl_engine] IP-Adapter {name}'s LoRA is the LoRA {', '.join(sorted(same))}: a "
                              "prompt that tags it gets it at the tag's weight, not twice")
        return out

    def _config_shown(self) -> dict:
        """The config for the start-up line: a field the model's engine_defaults.json may still choose
        (not set explicitly) shows as ``"model default, else 20"``; the next lines say what applied."""
        return {k: f"model default, else {v!r}"
                if k in config_mod.MODEL_DEFAULT_FIELDS and k not in self.config.explicit
                else v for k, v in self.config.as_dict().items()}

    def _model_defaults(self, model: loading.LoadedModel, spec: str) -> EngineConfig:
        """The config with ``model``'s engine_defaults.json where it set nothing (``spec``: what it was loaded from,
        for the operator); one log line names what applied."""
        defaults = config_mod.resolve_defaults(self.config, model.engine_defaults, spec)
        if model.engine_defaults:
            used = {k: getattr(defaults, k) for k in model.engine_defaults if k not in self.config.explicit}
            kept = sorted(model.engine_defaults.keys() & self.config.explicit)
            self._log(f"[sdxl_engine] the model's defaults ({loading.ENGINE_DEFAULTS_FILE}): {used}"
                      + (f"; set explicitly, so kept: {', '.join(kept)}" if kept else ""))
        builtin_used = {k: getattr(defaults, k) for k in config_mod.MODEL_DEFAULT_FIELDS
                        if k not in self.config.explicit and k not in model.engine_defaults
                        and (k not in ("width", "height") or getattr(defaults, k))}  # a size 0: the model's native
        if builtin_used:
            self._log(f"[sdxl_engine] the engine's defaults, which the model does not choose: {builtin_used}")
        return defaults

    def _limits(self, model: loading.LoadedModel, defaults: EngineConfig, loras: tuple[str, ...],
                startup_mode: dict, recipes_of_loras: tuple = ()) -> Limits:
        """What requests for ``model`` may ask for: every field from its resolved ``defaults`` (ModelSetup.defaults),
        its geometry, its LoRAs' names (``loras``) and their few-step recipes (``recipes_of_loras``:
        :func:`lora_recipes`), in this one place.

        Raises ConfigError for a default width/height the model cannot make.
        """
        native, multiple = model.native_size, model.size_multiple
        default = (defaults.width or native, defaults.height or native)
        if default[0] % multiple or default[1] % multiple:
            raise config_mod.ConfigError(f"width/height {default[0]}x{default[1]}: the model {defaults.model!r} needs "
                                         f"multiples of {multiple} pixels (0 = its native {native}x{native})")
        sizes = model.size_buckets()
        if default not in sizes:
            sizes = (default,) + sizes
        max_pixels = defaults.max_pixels or max(4 * native * native, 1024 * 1024)
        return Limits(max_seed=defaults.max_seed, max_steps=defaults.max_inference_steps, sizes=sizes,
                      default_size=default, default_steps=defaults.num_inference_steps,
                      default_guidance=defaults.guidance_scale, multiple=multiple, default_sampler=defaults.sampler,
                      loras=tuple(loras),
                      max_pixels=max(max_pixels, *(w * h for w, h in sizes)), batch=self.batch,
                      requires_mask=f"{model.name} has an inpainting UNet ({model.kind.unet_in_channels} "
                                    "input channels: latents, mask, masked image)" if startup_mode else "",
                      refiner=model.refiner is not None,
                      controlnets=tuple((name, net.hash) for name, net in model.controlnets.items()),
                      max_control_units=self.config.max_control_units,
                      controlnet_unions=tuple((name, net.union) for name, net in model.controlnets.items()
                                              if net.union),
                      controlnets_unfit=tuple(name for name in self.controlnets if name not in model.controlnets),
                      model=model.name,
                      ip_adapters=tuple((name, a.hash) for name, a in model.ip_adapters.items()),
                      max_ip_adapter_units=self.config.max_ip_adapter_units, lora_recipes=recipes_of_loras,
                      ip_adapter_embeds=tuple((name, a.embed_dim) for name, a in model.ip_adapters.items()
                                              if a.takes_embeds))

    def _start_precompile(self) -> None:
        """Compile the no-CFG variant of the default size, then the other size buckets, in a
        daemon thread (config ``precompile``: auto = on unless the devices are CPUs); sets ``precompiled``."""
        mode = self.config.precompile
        if mode == "off" or (mode == "auto" and self.platform == "cpu"):
            self.precompiled.set()
            return
        default = self.limits.default_size
        todo = [(*default, not (self.defaults.guidance_scale > 1))] + [(w, h, True) for w, h in self.limits.sizes
                                                                        if (w, h) != default]
        self.programs.precompile([self.planner.shape(w, h, cfg, two_calls=self._default_two_calls,
                                                     **self._startup_mode) for w, h, cfg in todo], self.precompiled)

    def program(self, width: int, height: int, cfg: bool = True, chunks: int = 1, init_image: bool = False,
                inpaint: bool = False, controlnets: tuple[str, ...] = (),
                ip_adapters: tuple[tuple[str, int, int], ...] = (), two_calls: bool | None = None) -> CompiledProgram:
        """The compiled program for a size (pixels), CFG mode, prompt chunk count, image mode, ControlNet units'
        architectures, IP-Adapter units' (architecture, tokens, width) and model calls per step (``two_calls``; None:
        the default sampler's), compiled on this thread on first use (Programs.get); for start-up and the tools."""
        two_calls = self._default_two_calls if two_calls is None else two_calls
        return self.programs.get(self.planner.shape(width, height, cfg, chunks, init_image, inpaint, controlnets,
                                                    ip_adapters, two_calls=two_calls))

    @property
    def _default_two_calls(self) -> bool:
        """Whether the default sampler calls the model twice per step (its programs are ProgramShape.two_calls, so
        start-up compiles and precompiles those: the warm-up request and a request without a sampler run them)."""
        return self.defaults.sampler in TWO_CALLS

    @property
    def compile_count(self) -> int:
        """Programs made so far (compiled, or loaded from the executable cache) for every model family; 0 before
        start. A switch between models of one family adds none."""
        return sum(programs.count for programs in self.families.values())

    def is_compiled(self, width: int, height: int, cfg: bool = True, chunks: int = 1) -> bool:
        """Whether the program for this size bucket (pixels), CFG mode and prompt chunk count is compiled already."""
        return self.programs is not None and self.planner.shape(
            width, height, cfg, chunks, two_calls=self._default_two_calls) in self.programs.compiled

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until start-up finished. Raises EngineNotReady if it failed or timed out."""
        wait_for_start(self, timeout)

    def scale_out(self) -> ScaleOut | None:
        """None: one engine, in this process (the contract's scale-out description)."""
        return None

    # ---- requests -------------------------------------------------------------------------
    def generate(self, request: GenerateRequest, ready_timeout: float | None = None,
                 progress: Callable[[str], None] | None = None, arrived: float | None = None,
                 on_step: Callable[[StepEvent], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerateResult:
        """Validate, then run one request on the devices.

        ``request.model`` names the model (None: the default; docs/models.md).

        ``progress``, if given, is called on this thread with each stage's name as it starts:
        ``"loading model"`` (only for a model not on the devices: its load, on the loader thread, while requests
        for resident models run on), ``"compiling"`` (only for the first request of a size bucket, CFG mode or
        prompt chunk count),
        ``"preparing"`` (tokenize, schedule), ``"on device"`` (the one compiled program: text
        encoders, the denoising loop and the VAE decode; it reports nothing from inside),
        ``"to host"``.

        ``arrived`` (contract.clock() when the request reached the server) is where
        ``timings["queue"]`` starts (contract.queue_seconds); by default it starts when this call does.

        ``on_step(StepEvent)`` hears each denoising step as every device finishes it, with
        a preview of the images every ``preview_every`` steps; it is called on XLA's thread while the
        devices wait, so it must only hand the event on. ``should_stop()`` is polled before the
        program and at every step: True ends the request after the running step (with the config's
        ``progress`` off, only before the program), raising Stopped; the engine is free at once.

        Raises:
            InvalidRequest: a bad argument (nothing ran), including a bad or unknown ``<lora:...>`` tag, and an unknown
                ``model`` (field "model", the message naming it and the models offered).
            ModelUnavailable: the request's model could not be loaded (nothing ran; the other models serve on).
            EngineNotReady: start-up failed or did not finish within ``ready_timeout`` seconds.
            GenerationError: the program produced non-finite pixels.
            InvalidRequest (``width``): also when the devices ran out of memory at the request's size.
            faults.InjectedFault: only with the test-only switch on (faults.py) and a ``fault:raise`` prompt.
            Stopped: ``should_stop()`` answered True; no images.
        """
        called = clock()
        self.wait_ready(ready_timeout)
        progress = progress or _no_progress
        t0 = time.perf_counter()
        name = self._model_name(request.model)  # an unknown model is refused by name, before anything else
        known = self.setups.get(name)
        if known is not None:  # a model loaded before: its request is refused before it waits for a load
            request = validate(request, known.limits)
        # A model not on the devices loads on the loader thread (progress "loading model"); requests for resident
        # models run on meanwhile (engine/residency.py). Held until the run ends: it is not dropped under it.
        try:
            served = self.residency.acquire(name, progress, should_stop)
        except (loading.ModelLoadError, lora_mod.LoraError, config_mod.ConfigError, OSError) as err:
            raise ModelUnavailable(f"model {name!r} could not be loaded: {err}") from err
        try:
            return self._generate(request, served, called, t0, arrived, progress, on_step, should_stop)
        finally:
            self.residency.release(served)

    def _generate(self, request: GenerateRequest, served: Resident, called: float, t0: float, arrived: float | None,
                  progress: Callable[[str], None], on_step: Callable[[StepEvent], None] | None,
                  should_stop: Callable[[], bool] | None) -> GenerateResult:
        """:meth:`generate` once its model ``served`` is resident and held: plan, get or compile, run."""
        setup = self.setups[served.name]
        programs = setup.programs
        plan = setup.planner.plan(validate(request, setup.limits))  # every refusal before anything waits or compiles
        refiner = self._chosen_refiner(plan.request.refiner, progress)  # None: the model's own (the first)
        if refiner is not None and setup.refiner_loras and any(n in setup.refiner_loras for n, _ in plan.loras):
            raise InvalidRequest("prompt", f"a refiner LoRA's tag applies to the first refiner only, not to "
                                           f"{plan.request.refiner}: leave the tag out, or the refiner")
        self._admit(plan, programs)  # what it would cost, estimated from the sizes compiled so far: refused first
        # a new size compiles on the compile thread: other requests run on (Programs.for_request)
        program = programs.for_request(plan.shape, plan.request.client, progress, should_stop)
        second = None if plan.hires is None else programs.for_request(plan.hires.shape, plan.request.client,
                                                                       progress, should_stop)
        self._admit(plan, programs)  # XLA's counts of the compiled programs: refused before running
        prep_s = time.perf_counter() - t0
        waiting = clock()
        self._wait_turn(progress, should_stop)  # one request on the devices at a time; the wait is queue time
        try:
            start = clock()
            result = (self._run(plan, program, progress, on_step=on_step, should_stop=should_stop, served=served,
                                refiner=refiner)
                      if second is None else self._run_hires(plan, program, second, progress, on_step, should_stop,
                                                             served))
        except jax.errors.JaxRuntimeError as err:
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            raise self._out_of_memory(plan, err) from None
        finally:
            self._request_lock.release()
        if (self.run_times is not None and second is None and self._faults is None  # faults: simulated time
                and programs is self.programs):  # measured on the default's family
            width, height, cost, steps, calls = self._runs(plan, programs)[0]
            self.run_times.observe(width, height, cost, steps, result.timings["device"], calls)
        result.timings["queue"] = queue_seconds(arrived, called, called) + (start - waiting)
        result.timings["prep"] += prep_s
        result.timings["latency"] += prep_s
        return result

    def _admit(self, plan: Plan, programs: Programs | None = None) -> None:
        """Refuse ``plan`` when its programs' memory or device time is over what this server allows (memory.py,
        durations.py), by XLA's counts of those compiled, else by their estimates; nothing is refused while either is
        unknown. The hires fix's second pass names ``hires_scale`` (its size) and ``hires_steps``.

        ``programs``: the plan's model's family's (None: the default's); the device-time estimate is measured on the
        default's family and applies to it only.

        Raises InvalidRequest."""
        programs = programs or self.programs
        costs = programs.costs
        if self.memory is not None:
            for shape, field in [(plan.shape, "width")] + ([] if plan.hires is None else
                                                           [(plan.hires.shape, "hires_scale")]):
                if refused := self.memory.refusal(shape, costs.estimate(shape), costs, field):
                    raise refused
        if self.run_times is not None and programs is self.programs:
            field = "num_inference_steps" if plan.hires is None else "hires_steps"
            if refused := self.run_times.refusal(self._runs(plan, programs), field):
                raise refused

    def _runs(self, plan: Plan, programs: Programs | None = None) -> list[tuple]:
        """(width, height, its program's costs.ProgramCost or estimate or None, denoising steps that run, model calls
        per step) of each program call of ``plan``, in order (``programs``: its family's; None: the default's)."""
        request, costs = plan.request, (programs or self.programs).costs
        steps = request.num_inference_steps if plan.steps is None else plan.steps
        start = (request.start_step if plan.start_step is None else plan.start_step) if plan.image is not None else 0
        calls = lambda shape: 2 if shape.two_calls else 1  # noqa: E731
        runs = [(plan.shape.width, plan.shape.height, costs.estimate(plan.shape), steps - (start or 0),
                 calls(plan.shape))]
        if plan.hires is not None:
            runs.append((plan.hires.shape.width, plan.hires.shape.height, costs.estimate(plan.hires.shape),
                         plan.hires.steps - plan.hires.start_step, calls(plan.hires.shape)))
        return runs

    def _out_of_memory(self, plan: Plan, err: Exception) -> InvalidRequest:
        """The refusal of a request whose program ran out of device memory (XLA's RESOURCE_EXHAUSTED): the size
        is what the client can change, and a retry of the same request would fail again. (The server logs the
        refusal as it logs any: one line.)"""
        shape = plan.shape if plan.hires is None else plan.hires.shape
        first = str(err).strip().splitlines()[0][:160]
        return InvalidRequest("width", f"{shape.width}x{shape.height} x {self.batch} images needs more memory than "
                                       f"this server's devices have ({self.device_summary}: {first}); choose a "
                                       "smaller size")

    def _wait_turn(self, progress: Callable[[str], None], should_stop: Callable[[], bool] | None) -> None:
        """Take the devices (``_request_lock``): at once, or after ``progress("waiting")`` once the request
        ahead has finished (the one a compile let run meanwhile, or a stopped one's last step). A stop
        while waiting frees the request at once (Stopped); nothing ran."""
        if self._request_lock.acquire(blocking=False):
            return
        progress("waiting")
        while not self._request_lock.acquire(timeout=0.1):
            if should_stop is not None and should_stop():
                raise Stopped("stopped before it started")

    def _run(self, plan: Plan, program: CompiledProgram, progress: Callable[[str], None] = _no_progress,
             loop_steps: int | None = None, on_step: Callable[[StepEvent], None] | None = None,
             should_stop: Callable[[], bool] | None = None, served: Resident | None = None,
             refiner: loading.LoadedModel | None = None) -> GenerateResult:
        """Run a plan on its compiled program with model ``served``'s weights (None: the default model's) and the
        refiner ``refiner``'s (None: the model's own, the first); ``loop_steps`` (the warm-up's 0) overrides how many
        denoising steps run."""
        t0 = time.perf_counter()
        request = plan.request
        served = served or self._default_resident()
        setup = self.setups[served.name]
        progress("preparing")
        # the tags' LoRAs and the FaceID units' merged; the tokens are without them
        params, loras = self._lora_params(plan.loras, served, self._faceid_tags(plan, setup))
        if refiner is not None:  # another refiner of the first one's architecture: its weights, the same program
            params = {**params, "refiner": refiner.params}
        steps = request.num_inference_steps if plan.steps is None else plan.steps
        start = request.start_step if plan.start_step is None else plan.start_step
        inputs = ProgramInputs.build(plan.prompt.ids, plan.negative.ids, not plan.negative.words.strip(), plan.seeds,
                                     request.guidance_scale, plan.schedule, steps if loop_steps is None else loop_steps,
                                     self.config.max_inference_steps, prompt_weights=plan.prompt.weights,
                                     negative_weights=plan.negative.weights, image=plan.image,
                                     start_step=None if plan.image is None else start, mask=plan.mask,
                                     # diffusers' inpainting at strength 1 starts from noise (is_strength_max)
                                     from_noise=request.strength == 1.0)
        if plan.refiner_start is not None:  # the refiner's switch step and aesthetic scores (diffusers' defaults)
            inputs = inputs.with_refiner(plan.refiner_start, plan.schedule)
        params, inputs = self._control(params, plan.control, inputs, setup)  # the units' ControlNets and arrays
        params, inputs = self._ip_adapter(params, plan.ip, inputs, setup)  # the IP-Adapters and their tokens
        # TEST-ONLY fault hooks (faults.py): self._faults is None unless SDXL_FAULT_INJECTION=1.
        params = self._faults.params(request.prompt, params) if self._faults else params
        if should_stop is not None and should_stop():
            raise Stopped("stopped before it started")
        progress("on device")
        t1 = time.perf_counter()
        if self._faults:  # simulated device time, counted as device time
            self._faults.on_device(request.prompt)
        out = self._on_device(program, params, inputs, int(inputs.num_steps), on_step, should_stop, setup.latent_rgb)
        result = self._result(plan, out, loras, t0, t1, progress, setup=setup)
        if refiner is not None:
            result.refiner = request.refiner
        return result

    def _result(self, plan: Plan, out, loras: dict[str, str], t0: float, t1: float, progress: Callable[[str], None],
                what: str = "", setup: ModelSetup | None = None) -> GenerateResult:
        """The GenerateResult of a run of model ``setup`` (None: the default) whose last program call returned
        ``out`` = (images, finite) on the devices: copied to the host, checked finite, timed (``t0`` the run's
        start, ``t1`` the device's start).

        Raises GenerationError naming the seeds whose images hold NaN/inf (``what``: the mode, for the message)."""
        setup = setup or self._default()
        model = setup.model
        progress("to host")
        t2 = time.perf_counter()
        images, finite = np.asarray(out[0]), np.asarray(out[1])
        t3 = time.perf_counter()
        if self._faults:
            self._faults.after_run(plan.request.prompt)
        if not finite.all():
            bad = [s for s, ok in zip(plan.seeds, finite) if not ok]
            raise GenerationError(f"the model produced non-finite pixels (NaN/inf) for seeds {bad}{what}; "
                                  f"try another seed or a lower guidance scale ({model.dtype} weights)")
        timings = {"prep": t1 - t0, "device": t2 - t1, "post": t3 - t2, "latency": t3 - t0}
        return GenerateResult(images=images, seeds=plan.seeds, request=plan.request, timings=timings,
                              warnings=setup.planner.warnings(plan.prompt, plan.negative),
                              device_count=self.mesh.devices.size, device_summary=self.device_summary,
                              model=setup.name, prompt_chunks=plan.prompt.chunks, loras=loras,
                              refiner=model.refiner.name if plan.request.refiner_switch_at is not None
                              and model.refiner is not None else "",
                              control_infotext=self._units_infotext(plan.request, model))

    def _units_infotext(self, request: GenerateRequest, model) -> dict[str, str]:
        """A1111's infotext entries of ``request``'s ControlNet units (``model``'s, by their titles), then of its
        IP-Adapter units, numbered on (engine/control.py and engine/ip_adapter.py ``infotext``)."""
        return {**infotext(request.control_units, {name: net.title for name, net in model.controlnets.items()}),
                **ip_infotext(request.ip_adapter_units, {name: f"{name} [{a.hash}]"
                                                         for name, a in self.ip_adapters.items()},
                              first=len(request.control_units))}

    def _run_hires(self, plan: Plan, first: CompiledProgram, second: CompiledProgram,
                   progress: Callable[[str], None] = _no_progress, on_step: Callable[[StepEvent], None] | None = None,
                   should_stop: Callable[[], bool] | None = None, served: Resident | None = None) -> GenerateResult:
        """Run a hires plan: 1. the first pass (text to image at the request's size, its final latents out; with
        a pixel upscaler its images), 2. the latents upscaled on the devices (the plan's matrices; the images on the
        host, image_upscale.py), 3. the second pass (image to image from those latents or pixels at the large size,
        from the hires start step, the seeds' hires noise, the hires prompts and sampler). Latents stay on the
        devices; the images are the second pass's. Progress counts both passes' steps that run (``_pass_events``).

        Raises GenerationError: the first pass's images hold NaN/inf (a pixel upscaler; latents carry it through)."""
        t0 = time.perf_counter()
        request, hires = plan.request, plan.hires
        served = served or self._default_resident()
        setup = self.setups[served.name]
        progress("preparing")
        params, loras = self._lora_params(plan.loras, served, self._faceid_tags(plan, setup))  # for both passes
        params = self._faults.params(request.prompt, params) if self._faults else params  # TEST-ONLY (faults.py)
        inputs = ProgramInputs.build(plan.prompt.ids, plan.negative.ids, not plan.negative.words.strip(), plan.seeds,
                                     request.guidance_scale, plan.schedule, request.num_inference_steps,
                                     self.config.max_inference_steps, prompt_weights=plan.prompt.weights,
                                     negative_weights=plan.negative.weights)
        first_params, inputs = self._control(params, plan.control, inputs, setup)
        first_params, inputs = self._ip_adapter(first_params, plan.ip, inputs, setup)
        if should_stop is not None and should_stop():
            raise Stopped("stopped before it started")
        steps, total = request.num_inference_steps, request.num_inference_steps + hires.runs
        progress("on device")
        t1 = time.perf_counter()
        if self._faults:  # simulated device time, counted as device time
            self._faults.on_device(request.prompt)
        # The first pass's finite flags are not read here: a NaN in its latents stays NaN through the second pass,
        # whose flags _result checks.
        latents, finite = self._on_device(first, first_params, inputs, steps, _pass_events(on_step, 0, 0, total),
                                          should_stop, setup.latent_rgb)
        pixels = None
        if hires.pixels:  # the first pass's images, upscaled on the host as A1111's resize_image
            images, finite = np.asarray(latents), np.asarray(finite)
            if not finite.all():
                bad = [s for s, ok in zip(plan.seeds, finite) if not ok]
                raise GenerationError(f"the model produced non-finite pixels (NaN/inf) for seeds {bad} in the hires "
                                      "fix's first pass; try another seed or a lower guidance scale")
            pixels = upscale_images(images, hires.shape.width, hires.shape.height, hires.upscaler)
        # a latent upscaler: (b, C, H/f, W/f), split over data, never on the host
        large = None if hires.pixels else sharded_upscale(self.mesh)(latents, hires.rows, hires.cols)
        inputs = ProgramInputs.build(hires.prompt.ids, hires.negative.ids, not hires.negative.words.strip(),
                                     plan.seeds, request.guidance_scale, hires.schedule, hires.steps,
                                     self.config.max_inference_steps, start_step=hires.start_step,
                                     prompt_weights=hires.prompt.weights, negative_weights=hires.negative.weights,
                                     image=pixels, init_latents=large)
        params, inputs = self._control(params, hires.control, inputs, setup)
        params, inputs = self._ip_adapter(params, hires.ip, inputs, setup)
        out = self._on_device(second, params, inputs, hires.steps,
                              _pass_events(on_step, steps, hires.start_step, total), should_stop, setup.latent_rgb)
        return self._result(plan, out, loras, t0, t1, progress, " (hires fix)", setup)

    def _on_device(self, program: CompiledProgram, params, inputs: ProgramInputs, steps: int,
                   on_step: Callable[[StepEvent], None] | None, should_stop: Callable[[], bool] | None,
                   latent_rgb=None):
        """One program call, with its per-step receiver (when the program has the step hook: the host runs its
        steps, compiling.SteppedExecutable) for ``steps`` steps (``latent_rgb``: the model's preview factors);
        returns its outputs on the devices, ready. Raises what on_step/should_stop raised, or Stopped."""
        if not program.shape.step_hook:
            out = program.executable(params, inputs)
            jax.block_until_ready(out)
            return out
        receiver = StepReceiver(self.mesh.devices.size, steps, self.config.preview_every, latent_rgb, on_step,
                                should_stop)
        out = program.executable.run(params, inputs, receiver)
        if receiver.error is not None:
            raise receiver.error
        if out is None or receiver.stopped:
            raise Stopped(f"stopped after step {receiver.done} of {steps}")
        jax.block_until_ready(out)
        return out


def lora_recipes(sources: dict, loras, log: Callable[[str], None]) -> tuple:
    """Limits.lora_recipes of the model's ``loras`` (names; ``sources``: {name: file}): each one whose file a few-step
    recipe names (checkpoint/recipes.py), with that recipe's fields; one log line per such LoRA."""
    found = []
    for name in loras:
        recipe = recipes_mod.find(str(sources.get(name, "")), lora=True)
        if recipe is not None:
            found.append((name, tuple(recipe.defaults.items())))
            log(f"[sdxl_engine] LoRA {name}: few-step recipe {recipe.name} for the requests tagging it that leave "
                f"them out: {recipe.defaults}" + (f"; {recipe.note}" if recipe.note else ""))
    return tuple(found)
