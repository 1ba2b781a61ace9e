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

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from sdxl_engine import config as config_mod
from sdxl_engine.checkpoint import controlnet as controlnet_mod
from sdxl_engine.checkpoint import loading
from sdxl_engine.checkpoint import lora as lora_mod
from sdxl_engine.config import EngineConfig
from sdxl_engine.engine import faults, memory
from sdxl_engine.engine.contract import GenerateResult, ScaleOut, clock, queue_seconds, wait_for_start
from sdxl_engine.engine.control import ControlArrays, infotext
from sdxl_engine.engine.durations import RunTimes
from sdxl_engine.engine.errors import GenerationError
from sdxl_engine.engine.image_upscale import upscale_images
from sdxl_engine.engine.memory import MemoryBudget
from sdxl_engine.engine.plan import Plan, Planner
from sdxl_engine.engine.previews import latent_rgb_for
from sdxl_engine.engine.programs import Programs
from sdxl_engine.engine.steps import StepEvent, StepReceiver, Stopped
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, Limits, validate
from sdxl_engine.program import sharding
from sdxl_engine.program.compiling import CompiledProgram
from sdxl_engine.program.executables import ExecutableCache
from sdxl_engine.program.generate import ProgramInputs
from sdxl_engine.program.latent_upscale import sharded_upscale
from sdxl_engine.program.step_hook import STEP_HOOK

LOG = logging.getLogger(__name__)


def _no_progress(stage: str) -> None:
    """The default ``progress`` callback of :meth:`Engine.generate`: report nothing."""


def _pass_events(on_step: Callable[[StepEvent], None] | None, before: int, first: int, total: int):
    """``on_step`` for one pass of a hires request: the pass's step k (1-based in its schedule, whose first ``first``
    steps are skipped) reported as step ``before + k - first`` of ``total`` (both passes' steps), so progress
    counts through both."""
    if on_step is None:
        return None
    return lambda event: on_step(dataclasses.replace(event, step=before + event.step - first, steps=total))


class Engine:
    """Load + compile at :meth:`start`; :meth:`generate` runs one request.

    Implements :class:`~sdxl_engine.engine.contract.EngineContract` (what the page may use). Use
    :meth:`start_in_background` for the app's start. ``log``: where the start-up lines go (tests collect
    them); None: the engine's module loggers, each line at its level.
    """

    def __init__(self, config: EngineConfig, log: Callable[[str], None] | None = None):
        self.config = config
        self.defaults = config  # set at start: config.resolve_defaults with the model's engine_defaults.json
        # Set at start (None until then): the device mesh, images per request, the loaded model
        # (loading.LoadedModel) and its parameters, the request limits, the devices' platform.
        self.mesh: jax.sharding.Mesh | None = None
        self.batch: int | None = None
        self.model: loading.LoadedModel | None = None
        self.params = None
        self.limits: Limits | None = None
        self.platform = ""
        self.device_summary = ""  # set at start, e.g. "4 × cpu"
        self._collect = log  # handed on as it is: None lets each module log to its own logger
        self._log, self._warn = log or LOG.info, log or LOG.warning
        self.programs: Programs | None = None  # set at start: the compiled programs (engine/programs.py)
        self._startup_mode: dict = {}  # the program flags every request of this model needs (start: an inpainting UNet)
        self.planner: Planner | None = None  # set at start, once the model, its LoRAs and the limits are known
        self.compile_cache_dir = ""  # set at start (apply_jax_options: "" = no persistent cache)
        self.executables: ExecutableCache | None = None  # set at start: <compile_cache_dir>/executables, or None
        self.loras: lora_mod.LoraMerger | None = None  # set at start: the LoRAs and their merged params
        self.refiner_loras: lora_mod.LoraMerger | None = None  # the refiner's LoRAs (params["refiner"]), if any
        self.stage = "starting"
        self.started = clock()
        self.startup: dict[str, float] = {}
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._faults = faults.injector()  # TEST-ONLY (faults.py): None unless the switch is on; read once
        self._request_lock = threading.Lock()  # one request at a time, also one a cancel left running for a step
        self.latent_rgb = None  # set at start: previews.LatentRGB of the model, or None (no previews)
        self.precompiled = threading.Event()  # set when the background precompile finished (or was not run)
        self.run_times: RunTimes | None = None  # set at start (max_run_seconds): the device-time estimate's figures
        self.memory: MemoryBudget | None = None  # set at start: the memory a request's run may take
        if self._faults:
            self._warn(f"[sdxl_engine] WARNING: {faults.ENV} is on: test-only faults can be triggered by prompts")

    # ---- start-up -------------------------------------------------------------------------
    def start(self) -> Engine:
        """Run every start-up stage in this thread; sets ``ready`` or ``error``. Returns self."""
        try:
            self._start()
            self.stage = "ready"
            self.ready.set()
        except BaseException as err:
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

    def _stage(self, name: str):
        self.stage = name
        self._log(f"[sdxl_engine] {name} ...")
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

        # 2. The model, each parameter straight onto the devices; the LoRAs' files checked first.
        lora_sources = lora_mod.lora_sources(self.config.lora, self.config.lora_dir, os.pathsep,
                                             loading.model_loras(self.config.model))  # the model's own
        for path in lora_sources.values():
            lora_mod.check_lora_path(path)
        t0 = self._stage("loading model onto the devices")
        if self._faults:  # TEST-ONLY (faults.py): a start slow enough to watch
            self._faults.on_start()
        self.platform = jax.devices()[0].platform
        self.model = loading.load_model(self.config.model, dtype=self.config.dtype, platform=self.platform,
                                        revision=self.config.revision, variant=self.config.variant,
                                        cache_dir=self.config.model_cache_dir,
                                        sharding=sharding.replicated(self.mesh),
                                        log=self._collect or loading.LOG.info, model_config=self.config.model_config,
                                        unet=self.config.unet, vae=self.config.vae,
                                        timestep_spacing=self.config.timestep_spacing)
        if self.model.kind.refiner:
            raise loading.ModelLoadError(self.model.kind.txt2img_refusal(self.model.name))
        # An inpainting UNet serves masked requests only: its programs are inpainting ones from the start on.
        self._startup_mode = dict(init_image=True, inpaint=True) if self.model.kind.inpainting_unet else {}
        self.params = self.model.params
        jax.block_until_ready(self.params)
        self._done("load_s", t0)
        self._load_refiner()
        self._load_loras(lora_sources)
        self._load_controlnets()
        self.defaults = self._model_defaults()
        self.limits = self._limits(self.defaults)
        self.planner = Planner(self.model, self.config, self.limits, self.batch, self.refiner_loras)
        self.programs = Programs(self.model, self.params, self.mesh, self.batch, self.executables, self.config,
                                 self.compile_cache_dir, self.limits.sizes, self._collect)
        self.latent_rgb = latent_rgb_for(self.model.source, self.model.latent_channels)

        # 3. Compile the default size (CFG, the default guidance's mode) ahead of time.
        width, height = self.limits.default_size
        self._stage(f"compiling {width}x{height} x {self.batch} images"
                    + (", unless the executable cache has them" if self.executables else ""))
        self.startup["compile_s"] = self.program(width, height, self.defaults.guidance_scale > 1,
                                                 **self._startup_mode).compile_s

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
        times = self.run_times
        self._log(f"[sdxl_engine] a request's run may take {budget.capacity / 1e9:.1f} GB of {budget.where}"
                  + ("" if self.config.max_run_memory_gb else
                     f" (free at ready less {memory.RESERVE:.0%}; max_run_memory_gb)")
                  + ("" if times is None else
                     f" and {times.limit_s:g} s of device time (max_run_seconds; measured at {width}x{height} x "
                     f"{self.batch} images: {times.fixed_s:.3f} s + {times.step_s:.3f} s per step)"))
        self.startup["ready_s"] = clock() - self.started
        self._log(f"[sdxl_engine] ready in {self.startup['ready_s']:.2f} s on {self.device_summary} "
                  f"({self.model.name}, {self.model.dtype})")
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

    def _load_refiner(self) -> None:
        """With ``config.refiner``: load the SDXL refiner onto the same devices (replicated over the mesh), check it
        against the model (loading.check_refiner: RefinerMismatch stops the start), attach it (``model.refiner``)
        and put its text_encoder_2 and UNet in ``params["refiner"]``; its VAE is not kept (the base's decodes)."""
        if not self.config.refiner:
            return
        t0 = self._stage("loading the refiner onto the devices")
        refiner = loading.load_model(self.config.refiner, dtype=self.model.dtype, platform=self.platform,
                                     variant=self.config.variant, cache_dir=self.config.model_cache_dir,
                                     sharding=sharding.replicated(self.mesh), log=self._collect or loading.LOG.info,
                                     model_config=self.config.refiner_config, flag="--refiner")
        loading.check_refiner(self.model, refiner)
        refiner.params = {name: refiner.params[name] for name in ("text_encoder_2", "unet")}  # the VAE's freed
        self.model.refiner = refiner
        self.params = {**self.params, "refiner": refiner.params}
        jax.block_until_ready(self.params)
        self._done("refiner_load_s", t0)

    def _load_controlnets(self) -> None:
        """With ``config.controlnet`` / ``controlnet_dir``: load each ControlNet in the model's dtype onto the
        devices (replicated), check it fits the model (checkpoint/controlnet.check_fits: ModelLoadError stops the
        start) and attach them (``model.controlnets``, by name)."""
        sources = controlnet_mod.controlnet_sources(self.config.controlnet, self.config.controlnet_dir)
        if not sources:
            return
        t0 = self._stage(f"loading {len(sources)} ControlNets onto the devices")
        unet_config = dataclasses.asdict(self.model.unet)  # a single file without a config: from_unet's rule
        nets = {}
        for name, path in sources.items():
            net = controlnet_mod.load_controlnet(name, path, self.model.dtype, unet_config,
                                                 sharding.replicated(self.mesh), log=self._collect or self._log)
            controlnet_mod.check_fits(net, self.model.components["unet"], self.model.vae_scale_factor,
                                      self.model.latent_channels)
            nets[name] = net
        self.model.controlnets = nets
        jax.block_until_ready([n.params for n in nets.values()])
        self._done("controlnet_load_s", t0)

    def _control(self, params: dict, control: ControlArrays | None,
                 inputs: ProgramInputs) -> tuple[dict, ProgramInputs]:
        """``params`` and ``inputs`` for a pass with ControlNet units (``control``, a plan's): each unit's
        ControlNet params in ``params["controlnet"]``, the units' arrays in the inputs; as they are without."""
        if control is None:
            return params, inputs
        nets = self.model.controlnets
        return ({**params, "controlnet": tuple(nets[m].params for m in control.models)},
                inputs.with_control(**control.inputs()))

    def _load_loras(self, sources: dict) -> None:
        """Read and check every LoRA against the model, or, when it does not fit the model and a refiner is
        loaded, against the refiner (a LoRA trained for the refiner: its tags then change the refiner's steps);
        LoraError (the model's) stops the start. Keeps the mergers."""
        t0 = time.perf_counter()
        if sources:  # the banner's stage; the log gets one line, after
            self.stage = f"loading {len(sources)} LoRAs"
        loras, for_refiner = {}, {}
        for name, path in sources.items():
            try:
                loras[name] = lora_mod.read_lora(name, path, self.model.components)
            except lora_mod.LoraError as err:
                refiner = self.model.refiner
                if refiner is None:
                    raise
                try:
                    for_refiner[name] = lora_mod.read_lora(name, path, {
                        k: c for k, c in refiner.components.items() if k in self.params["refiner"]})
                except lora_mod.LoraError:
                    raise err from None
        self.loras = lora_mod.LoraMerger(self.params, loras, sharding.replicated(self.mesh))
        self.refiner_loras = (lora_mod.LoraMerger(self.params["refiner"], for_refiner, sharding.replicated(self.mesh))
                              if for_refiner else None)
        if sources:
            self.startup["lora_s"] = time.perf_counter() - t0
            self._log("[sdxl_engine] LoRAs: " + ", ".join(
                f"{i['name']} ({i['format']}, {i['layers']} layers, hash {i['hash']}"
                f"{', for the refiner' if i['name'] in for_refiner else ''})"
                for i in lora_mod.lora_info([*loras.values(), *for_refiner.values()]))
                + f"; read in {self.startup['lora_s']:.2f} s")

    def _lora_params(self, loras: tuple[tuple[str, float], ...]) -> tuple[dict, dict[str, str]]:
        """The params for a plan's LoRAs (``Plan.loras``: the prompt's tags as (name, weight); merged outside the
        compiled program; the base params without any; a refiner LoRA merges into ``params["refiner"]``) and
        {name: short hash}. The tags were checked by validate (Limits.loras) and the plan (a refiner LoRA needs the
        refiner)."""
        if not loras:
            return self.params, {}
        refiner = self.refiner_loras.loras if self.refiner_loras else {}
        params = self.loras.params([(name, weight) for name, weight in loras if name not in refiner])
        if any(name in refiner for name, _ in loras):
            params = {**params, "refiner": self.refiner_loras.params([(name, weight) for name, weight in loras
                                                                     if name in refiner])}
        return params, {name: (refiner.get(name) or self.loras.loras[name]).short_hash for name, _ in loras}

    def _config_shown(self) -> dict:
        """The config for the start-up line: a field the model's engine_defaults.json may still choose
        (not set explicitly) shows as ``"model default, else 20"``; the next lines say what applied."""
        return {k: f"model default, else {v!r}"
                if k in config_mod.MODEL_DEFAULT_FIELDS and k not in self.config.explicit
                else v for k, v in self.config.as_dict().items()}

    def _model_defaults(self) -> EngineConfig:
        """The config with the model's engine_defaults.json where it set nothing; one log line names what applied."""
        defaults = config_mod.resolve_defaults(self.config, self.model.engine_defaults,
                                               self.config.model)  # the path, for the operator
        if self.model.engine_defaults:
            used = {k: getattr(defaults, k) for k in self.model.engine_defaults if k not in self.config.explicit}
            kept = sorted(self.model.engine_defaults.keys() & self.config.explicit)
            self._log(f"[sdxl_engine] the model's defaults ({loading.ENGINE_DEFAULTS_FILE}): {used}"
                      + (f"; set explicitly, so kept: {', '.join(kept)}" if kept else ""))
        builtin_used = {k: getattr(defaults, k) for k in config_mod.MODEL_DEFAULT_FIELDS
                        if k not in self.config.explicit and k not in self.model.engine_defaults}
        if builtin_used:
            self._log(f"[sdxl_engine] the engine's defaults, which the model does not choose: {builtin_used}")
        return defaults

    def _limits(self, defaults: EngineConfig) -> Limits:
        """What requests may ask for: every field from the resolved ``defaults`` (the engine's
        :attr:`defaults`) and the model's geometry, in this one place.

        Raises ConfigError for a default width/height the model cannot make.
        """
        native, multiple = self.model.native_size, self.model.size_multiple
        default = (defaults.width or native, defaults.height or native)
        if default[0] % multiple or default[1] % multiple:
            raise config_mod.ConfigError(f"width/height {default[0]}x{default[1]}: the model {defaults.model!r} needs "
                                         f"multiples of {multiple} pixels (0 = its native {native}x{native})")
        sizes = self.model.size_buckets()
        if default not in sizes:
            sizes = (default,) + sizes
        max_pixels = defaults.max_pixels or max(4 * native * native, 1024 * 1024)
        return Limits(max_seed=defaults.max_seed, max_steps=defaults.max_inference_steps, sizes=sizes,
                      default_size=default, default_steps=defaults.num_inference_steps,
                      default_guidance=defaults.guidance_scale, multiple=multiple, default_sampler=defaults.sampler,
                      loras=(*(self.loras.loras if self.loras else ()),
                             *(self.refiner_loras.loras if self.refiner_loras else ())),
                      max_pixels=max(max_pixels, *(w * h for w, h in sizes)), batch=self.batch,
                      requires_mask=f"{self.model.name} has an inpainting UNet ({self.model.kind.unet_in_channels} "
                                    "input channels: latents, mask, masked image)" if self._startup_mode else "",
                      refiner=self.model.refiner is not None,
                      controlnets=tuple((name, net.hash) for name, net in self.model.controlnets.items()),
                      max_control_units=self.config.max_control_units)

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
        self.programs.precompile([self.planner.shape(w, h, cfg, **self._startup_mode) for w, h, cfg in todo],
                                 self.precompiled)

    def program(self, width: int, height: int, cfg: bool = True, chunks: int = 1, init_image: bool = False,
                inpaint: bool = False) -> CompiledProgram:
        """The compiled program for a size (pixels), CFG mode, prompt chunk count and image mode, compiled on this
        thread on first use (Programs.get); for start-up and the tools."""
        return self.programs.get(self.planner.shape(width, height, cfg, chunks, init_image, inpaint))

    @property
    def compile_count(self) -> int:
        """Programs made so far (compiled, or loaded from the executable cache); 0 before start."""
        return self.programs.count if self.programs is not None else 0

    def is_compiled(self, width: int, height: int, cfg: bool = True, chunks: int = 1) -> bool:
        """Whether the program for this size bucket (pixels), CFG mode and prompt chunk count is compiled already."""
        return self.programs is not None and self.planner.shape(width, height, cfg, chunks) in self.programs.compiled

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

        ``progress``, if given, is called on this thread with each stage's name as it starts:
        ``"compiling"`` (only for the first request of a size bucket, CFG mode or prompt chunk count),
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
            InvalidRequest: a bad argument (nothing ran), including a bad or unknown ``<lora:...>`` tag.
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
        plan = self.planner.plan(validate(request, self.limits))  # every refusal before anything waits or compiles
        self._admit(plan)  # what it would cost, estimated from the sizes compiled so far: refused before compiling
        # a new size compiles on the compile thread: other requests run on (Programs.for_request)
        program = self.programs.for_request(plan.shape, plan.request.client, progress, should_stop)
        second = None if plan.hires is None else self.programs.for_request(plan.hires.shape, plan.request.client,
                                                                            progress, should_stop)
        self._admit(plan)  # XLA's counts of the compiled programs: refused before running
        prep_s = time.perf_counter() - t0
        waiting = clock()
        self._wait_turn(progress, should_stop)  # one request on the devices at a time; the wait is queue time
        try:
            start = clock()
            result = (self._run(plan, program, progress, on_step=on_step, should_stop=should_stop) if second is None
                      else self._run_hires(plan, program, second, progress, on_step, should_stop))
        except jax.errors.JaxRuntimeError as err:
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            raise self._out_of_memory(plan, err) from None
        finally:
            self._request_lock.release()
        if self.run_times is not None and second is None and self._faults is None:  # faults: simulated time
            self.run_times.observe(*self._runs(plan)[0], result.timings["device"])
        result.timings["queue"] = queue_seconds(arrived, called, called) + (start - waiting)
        result.timings["prep"] += prep_s
        result.timings["latency"] += prep_s
        return result

    def _admit(self, plan: Plan) -> None:
        """Refuse ``plan`` when its programs' memory or device time is over what this server allows (memory.py,
        durations.py), by XLA's counts of those compiled, else by their estimates; nothing is refused while either is
        unknown. The hires fix's second pass names ``hires_scale`` (its size) and ``hires_steps``.

        Raises InvalidRequest."""
        costs = self.programs.costs
        if self.memory is not None:
            for shape, field in [(plan.shape, "width")] + ([] if plan.hires is None else
                                                           [(plan.hires.shape, "hires_scale")]):
                if refused := self.memory.refusal(shape, costs.estimate(shape), costs, field):
                    raise refused
        if self.run_times is not None:
            field = "num_inference_steps" if plan.hires is None else "hires_steps"
            if refused := self.run_times.refusal(self._runs(plan), field):
                raise refused

    def _runs(self, plan: Plan) -> list[tuple]:
        """(width, height, its program's costs.ProgramCost or estimate or None, denoising steps that run) of each
        program call of ``plan``, in order."""
        request, costs = plan.request, self.programs.costs
        steps = request.num_inference_steps if plan.steps is None else plan.steps
        start = (request.start_step if plan.start_step is None else plan.start_step) if plan.image is not None else 0
        runs = [(plan.shape.width, plan.shape.height, costs.estimate(plan.shape), steps - (start or 0))]
        if plan.hires is not None:
            runs.append((plan.hires.shape.width, plan.hires.shape.height, costs.estimate(plan.hires.shape),
                         plan.hires.steps - plan.hires.start_step))
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
             should_stop: Callable[[], bool] | None = None) -> GenerateResult:
        """Run a plan on its compiled program; ``loop_steps`` (the warm-up's 0) overrides how many denoising
        steps run."""
        t0 = time.perf_counter()
        request = plan.request
        progress("preparing")
        params, loras = self._lora_params(plan.loras)  # the tags' LoRAs merged; the plan's tokens are without them
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
            inputs = inputs.with_refiner(plan.refiner_start)
        params, inputs = self._control(params, plan.control, inputs)  # the units' ControlNets and arrays
        # TEST-ONLY fault hooks (faults.py): self._faults is None unless SDXL_FAULT_INJECTION=1.
        params = self._faults.params(request.prompt, params) if self._faults else params
        if should_stop is not None and should_stop():
            raise Stopped("stopped before it started")
        progress("on device")
        t1 = time.perf_counter()
        if self._faults:  # simulated device time, counted as device time
            self._faults.on_device(request.prompt)
        out = self._on_device(program, params, inputs, int(inputs.num_steps), on_step, should_stop)
        return self._result(plan, out, loras, t0, t1, progress)

    def _result(self, plan: Plan, out, loras: dict[str, str], t0: float, t1: float, progress: Callable[[str], None],
                what: str = "") -> GenerateResult:
        """The GenerateResult of a run whose last program call returned ``out`` = (images, finite) on the devices:
        copied to the host, checked finite, timed (``t0`` the run's start, ``t1`` the device's start).

        Raises GenerationError naming the seeds whose images hold NaN/inf (``what``: the mode, for the message)."""
        progress("to host")
        t2 = time.perf_counter()
        images, finite = np.asarray(out[0]), np.asarray(out[1])
        t3 = time.perf_counter()
        if self._faults:
            self._faults.after_run(plan.request.prompt)
        if not finite.all():
            bad = [s for s, ok in zip(plan.seeds, finite) if not ok]
            raise GenerationError(f"the model produced non-finite pixels (NaN/inf) for seeds {bad}{what}; "
                                  f"try another seed or a lower guidance scale ({self.model.dtype} weights)")
        timings = {"prep": t1 - t0, "device": t2 - t1, "post": t3 - t2, "latency": t3 - t0}
        return GenerateResult(images=images, seeds=plan.seeds, request=plan.request, timings=timings,
                              warnings=self.planner.warnings(plan.prompt, plan.negative),
                              device_count=self.mesh.devices.size, device_summary=self.device_summary,
                              model=self.model.name, prompt_chunks=plan.prompt.chunks, loras=loras,
                              refiner=self.model.refiner.name if plan.request.refiner_switch_at is not None
                              and self.model.refiner is not None else "",
                              control_infotext=infotext(plan.request.control_units, {
                                  name: net.title for name, net in self.model.controlnets.items()}))

    def _run_hires(self, plan: Plan, first: CompiledProgram, second: CompiledProgram,
                   progress: Callable[[str], None] = _no_progress, on_step: Callable[[StepEvent], None] | None = None,
                   should_stop: Callable[[], bool] | None = None) -> GenerateResult:
        """Run a hires plan: 1. the first pass (text to image at the request's size, its final latents out; with
        a pixel upscaler its images), 2. the latents upscaled on the devices (the plan's matrices; the images on the
        host, image_upscale.py), 3. the second pass (image to image from those latents or pixels at the large size,
        from the hires start step, the seeds' hires noise, the hires prompts and sampler). Latents stay on the
        devices; the images are the second pass's. Progress counts both passes' steps that run (``_pass_events``).

        Raises GenerationError: the first pass's images hold NaN/inf (a pixel upscaler; latents carry it through)."""
        t0 = time.perf_counter()
        request, hires = plan.request, plan.hires
        progress("preparing")
        params, loras = self._lora_params(plan.loras)  # the tags' LoRAs merged, for both passes
        params = self._faults.params(request.prompt, params) if self._faults else params  # TEST-ONLY (faults.py)
        inputs = ProgramInputs.build(plan.prompt.ids, plan.negative.ids, not plan.negative.words.strip(), plan.seeds,
                                     request.guidance_scale, plan.schedule, request.num_inference_steps,
                                     self.config.max_inference_steps, prompt_weights=plan.prompt.weights,
                                     negative_weights=plan.negative.weights)
        first_params, inputs = self._control(params, plan.control, inputs)
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
                                          should_stop)
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
        params, inputs = self._control(params, hires.control, inputs)
        out = self._on_device(second, params, inputs, hires.steps,
                              _pass_events(on_step, steps, hires.start_step, total), should_stop)
        return self._result(plan, out, loras, t0, t1, progress, " (hires fix)")

    def _on_device(self, program: CompiledProgram, params, inputs: ProgramInputs, steps: int,
                   on_step: Callable[[StepEvent], None] | None, should_stop: Callable[[], bool] | None):
        """One program call, with its per-step receiver (when the program has the step hook) for ``steps`` steps;
        returns its outputs on the devices, ready. Raises what on_step/should_stop raised, or Stopped."""
        receiver = StepReceiver(self.mesh.devices.size, steps, self.config.preview_every, self.latent_rgb, on_step,
                                should_stop) if program.shape.step_hook else None
        with STEP_HOOK.receiving(receiver) if receiver else contextlib.nullcontext():
            out = program.executable(params, inputs)
            jax.block_until_ready(out)  # inside: the devices call the receiver until the loop ends
        if receiver is not None and receiver.error is not None:
            raise receiver.error
        if receiver is not None and receiver.stopped:
            raise Stopped(f"stopped after step {receiver.done} of {steps}")
        return out
