"""A validated request in the program's terms: :class:`Planner` turns a GenerateRequest into a :class:`Plan` (the
ProgramShape that keys the compile, the tokenized prompts, the sampler's schedule, the seeds, the image and mask,
the refiner's first step, hires fix's second pass), before anything waits, compiles or runs. Host code only: no
program is traced here (program/ holds those); the one device call is the IP-Adapter units' reference encoder
(program/ip_adapter.py: the image encoder and projection, once per request, compiled by JAX once per image count), as
diffusers' ``prepare_ip_adapter_image_embeds`` runs before the loop. As diffusers' pipelines prepare their inputs
(``encode_prompt``, ``get_timesteps``, ``prepare_latents``) before the denoising loop."""

from __future__ import annotations

import dataclasses

import numpy as np

from sdxl_engine.checkpoint import builtin, loading
from sdxl_engine.checkpoint import lora as lora_mod
from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.control import ControlArrays, control_arrays, unit_images
from sdxl_engine.engine.image_upscale import IMAGE_UPSCALERS, upscale_images
from sdxl_engine.engine.ip_adapter import IPAdapterArrays, ip_arrays
from sdxl_engine.engine.prompts import CHUNK, PromptTokens, parse_lora_tags, tokenize_prompt
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, Limits, hires_size
from sdxl_engine.program.generate import ProgramShape
from sdxl_engine.program.latent_upscale import resize_matrix
from sdxl_engine.program.schedulers import (
    ETA_DEFAULTS,
    Schedule,
    TooManySteps,
    UnsupportedSchedulerConfig,
    UnsupportedScheduleType,
    hires_schedule,
    make_schedule,
    refiner_start,
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One validated request in the program's terms (:meth:`Planner.plan`): the program it runs on and
    what goes into it, all decided before anything waits, compiles or runs.

    Attributes:
        request: the validated request; shape: the ProgramShape (size, CFG mode, prompt chunks): the
            compile key; prompt, negative: the tokenized prompts, padded to the shape's chunk count;
        schedule: the sampler's per-step coefficients for the request's steps (img2img: all of them; the
            program's inputs start it at the request's start_step); seeds: image i's seed; image: img2img's
            (batch, H, W, 3) uint8 pixels, None for text to image; mask: inpainting's (batch, H, W) float32
            (1 = repaint), else None.
        steps, start_step: the schedule's length and first step when they are not the request's
            (hires fix of an input image: its second pass's), else None.
        loras: the prompt's ``<lora:NAME:WEIGHT>`` tags as (name, weight) in their order, parsed once here: the
            engine merges those LoRAs into the params it runs with (validate checked each names a loaded one).
        control: the ControlNet units' arrays for the (first) pass (engine/control.py: images fitted to its size,
            weights, modes, per-step keep; its ``models`` name each unit's ControlNet, whose params the engine passes
            in params["controlnet"]), None without units.
        ip: the IP-Adapter units' arrays for the (first) pass (engine/ip_adapter.py: the reference images' tokens,
            computed here once per request, scales, per-step keep; its ``models`` name each unit's adapter, whose
            params the engine passes in params["ip_adapter"]), None without units.
    """

    request: GenerateRequest
    shape: ProgramShape
    prompt: PromptTokens
    negative: PromptTokens
    schedule: Schedule
    seeds: list[int]
    image: np.ndarray | None = None
    mask: np.ndarray | None = None
    refiner_start: int | None = None  # the refiner's first step (refiner_switch_at), None without the refiner
    hires: HiresPlan | None = None  # hires fix's second pass (then ``shape`` is the first pass's)
    steps: int | None = None
    start_step: int | None = None
    loras: tuple[tuple[str, float], ...] = ()
    control: ControlArrays | None = None
    ip: IPAdapterArrays | None = None


@dataclasses.dataclass(frozen=True)
class HiresPlan:
    """Hires fix's second pass (docs/hires-fix.md): after the first pass (the plan's shape), its latents are
    upscaled on the devices (a latent upscaler; the first pass returns latents), or its images on the host (a pixel
    upscaler, image_upscale.py), and denoised again at the large size.

    Attributes:
        shape: the second pass's ProgramShape: the large size, ``init_latents`` (latent upscalers) or
            ``init_image`` + ``hires_noise`` (pixel upscalers); its own compile per size.
        schedule: the hires sampler's schedule of ``steps`` steps (whole; the program starts at ``start_step``).
        steps, start_step: schedulers.hires_schedule's (schedule length, first step that runs).
        prompt, negative: the second pass's prompts (the hires ones, else the first pass's), tokenized.
        rows, cols: a latent upscaler's (H/f, h/f) and (W/f, w/f) float32 matrices (latent_upscale.resize_matrix);
            None for a pixel upscaler.
        upscaler: the A1111 upscaler's name.
        control: the ControlNet units' arrays for the second pass (the images fitted to its size, its keep over its
            own steps, canny units soft: engine/control.py ``mode_factors``), None without units.
        ip: the IP-Adapter units' arrays for the second pass (the first pass's tokens, its keep over its own steps),
            None without units.
    """

    shape: ProgramShape
    schedule: Schedule
    steps: int
    start_step: int
    prompt: PromptTokens
    negative: PromptTokens
    upscaler: str
    rows: np.ndarray | None = None
    cols: np.ndarray | None = None
    control: ControlArrays | None = None
    ip: IPAdapterArrays | None = None

    @property
    def pixels(self) -> bool:
        """Whether the first pass's images (not latents) are upscaled, on the host."""
        return self.rows is None

    @property
    def runs(self) -> int:
        """Denoising steps the second pass runs."""
        return self.steps - self.start_step


class Planner:
    """Plans the requests of one loaded model on one device set (the engine makes it at start, once the model, its
    refiner's LoRAs and the limits are known): ``model`` (loading.LoadedModel), ``config`` (max_inference_steps,
    max_prompt_chunks, emphasis, progress), ``limits`` (validation.Limits: max_seed, the size multiple), ``batch``
    (images per request), ``refiner_loras`` (the refiner's LoraMerger, or None). The schedules it makes are cached
    by (sampler, steps, schedule type, eta)."""

    def __init__(self, model: loading.LoadedModel, config: EngineConfig, limits: Limits, batch: int,
                 refiner_loras: lora_mod.LoraMerger | None = None):
        self.model, self.config, self.limits, self.batch = model, config, limits, batch
        self.refiner_loras = refiner_loras
        self._schedules: dict[tuple[str, int, str | None, float | None], Schedule] = {}

    def plan(self, request: GenerateRequest) -> Plan:
        """The :class:`Plan` of a validated ``request``: its LoRA tags' weights aside (merged at run time),
        the prompt chunks, the CFG mode (diffusers: guidance <= 1 runs without it), the schedule and the seeds;
        with an image, the img2img program (its own per size) and the schedule from the request's start step; with a
        mask too, the inpainting program (its own per size).

        Raises InvalidRequest: a sampler the model's scheduler config rules out, too many steps for it; an
        image count other than 1 or the batch.
        """
        prompt, negative = self.tokens(request.prompt, request.negative_prompt)  # the chunks choose the program
        loras = tuple((tag.name, tag.weight) for tag in parse_lora_tags(request.prompt)[1])
        self._check_refiner_tags(request, loras)
        schedule = self.schedule(request.sampler, request.num_inference_steps,  # refuses before compiling
                                 request.schedule_type, request.eta)
        image = None
        if request.image is not None:  # img2img: validate set start_step (from strength, or as given)
            image = np.asarray(request.image)
            if image.shape[0] not in (1, self.batch):
                raise InvalidRequest("image", f"{image.shape[0]} images; this server makes {self.batch} per request: "
                                              f"send one for all of them, or {self.batch}")
            image = np.broadcast_to(image, (self.batch, *image.shape[1:]))
        mask = None if request.mask is None else np.broadcast_to(request.mask, (self.batch, *request.mask.shape[1:]))
        units = request.control_units
        # the IP-Adapter units' arrays, keep over the steps that run (from img2img's start); their tokens once
        first = (request.start_step or 0) if image is not None else 0
        ip = None if not request.ip_adapter_units else ip_arrays(
            request.ip_adapter_units, self.model.ip_adapters, first, request.num_inference_steps,
            self.config.max_inference_steps)
        shape = self.shape(request.width, request.height, request.guidance_scale > 1, prompt.chunks,
                            init_image=image is not None, inpaint=mask is not None,
                            controlnets=tuple(self.model.controlnets[u.model].architecture for u in units),
                            ip_adapters=self.ip_shape(ip), control_images=unit_images(units),
                            two_calls=schedule.two_calls)
        # Image i uses seed + i, wrapping past max_seed to 0, so every caption's seed is itself a valid request seed.
        seeds = [(request.seed + i) % (self.limits.max_seed + 1) for i in range(self.batch)]
        hires = None if request.hires_scale is None else self._hires(request, shape, ip)
        if hires is not None and image is not None:  # hires fix of the given image: its second pass alone
            return Plan(request, hires.shape, hires.prompt, hires.negative, hires.schedule, seeds,
                        upscale_images(image, hires.shape.width, hires.shape.height, hires.upscaler),
                        steps=hires.steps, start_step=hires.start_step, loras=loras, control=hires.control,
                        ip=hires.ip)
        control = None
        if units:  # the units' arrays at the request's size, keep over the steps that run (from img2img's start)
            first = request.start_step if image is not None else 0
            control = control_arrays(units, shape.width, shape.height, self.batch, first or 0,
                                     request.num_inference_steps, self.config.max_inference_steps)
        if hires is not None and not hires.pixels:  # a latent upscaler: the first pass's latents, no VAE decode
            shape = dataclasses.replace(shape, latents_out=True)
        if request.refiner_switch_at is not None:  # the refiner's program and its first step (docs/refiner.md)
            return Plan(request, self._refiner_shape(shape), prompt, negative, schedule, seeds, image, mask,
                        refiner_start=refiner_start(schedule.timesteps, request.refiner_switch_at,
                                                    self.model.scheduler_config.get("num_train_timesteps", 1000)),
                        loras=loras, control=control, ip=ip)
        return Plan(request, shape, prompt, negative, schedule, seeds, image, mask, hires=hires, loras=loras,
                    control=control, ip=ip)

    def ip_shape(self, ip: IPAdapterArrays | None) -> tuple[tuple[str, int, int], ...]:
        """ProgramShape.ip_adapters of the units' arrays: (architecture, tokens, width) per unit; () without."""
        if ip is None:
            return ()
        adapters, width = self.model.ip_adapters, ip.tokens.shape[2]
        return tuple((adapters[m].architecture, n, width) for m, n in zip(ip.models, ip.counts, strict=True))

    def _check_refiner_tags(self, request: GenerateRequest, loras: tuple[tuple[str, float], ...]) -> None:
        """Raise InvalidRequest (``prompt``) for a refiner LoRA's tag (``loras``: the prompt's) in a request the
        refiner does not run in."""
        if self.refiner_loras is None or request.refiner_switch_at is not None:
            return
        named = [name for name, _ in loras if name in self.refiner_loras.loras]
        if named:
            raise InvalidRequest("prompt", f"<lora:{named[0]}> is a LoRA for the refiner, which this request does not "
                                           "run: send refiner_switch_at (e.g. 0.8), or leave the tag out")

    def _hires(self, request: GenerateRequest, shape: ProgramShape, ip: IPAdapterArrays | None = None) -> HiresPlan:
        """The second pass of a validated hires ``request`` whose first pass runs on ``shape`` (or, with an
        input image, would: its size, CFG mode and chunks) and takes the IP-Adapter arrays ``ip`` (whose tokens the
        second pass reuses).

        Raises InvalidRequest naming ``hires_steps`` when the sampler cannot take the schedule's step count (LCM),
        or ``hires_sampler`` for one the model's scheduler config rules out.
        """
        width, height = hires_size(request.width, request.height, request.hires_scale, self.limits.multiple)
        steps, start = hires_schedule(request.num_inference_steps, request.hires_steps, request.hires_strength)
        try:
            schedule = self.schedule(request.hires_sampler, steps, request.schedule_type, request.eta)
        except InvalidRequest as err:
            field = {"sampler": "hires_sampler", "schedule_type": "schedule_type"}.get(err.field, "hires_steps")
            raise InvalidRequest(field, f"the second pass's {steps}-step schedule: {err.message}") from None
        prompt, negative = self.tokens(
            request.prompt if request.hires_prompt is None else request.hires_prompt,
            request.negative_prompt if request.hires_negative_prompt is None else request.hires_negative_prompt)
        large = dataclasses.replace(shape, width=width, height=height, chunks=prompt.chunks, init_image=False,
                                    inpaint=False, two_calls=schedule.two_calls)  # the hires sampler's calls
        control = None if not request.control_units else control_arrays(
            request.control_units, width, height, self.batch, start, steps, self.config.max_inference_steps,
            hires_pass=True)
        if ip is not None:  # the same tokens, keep over the second pass's steps
            ip = ip_arrays(request.ip_adapter_units, self.model.ip_adapters, start, steps,
                           self.config.max_inference_steps, tokens=ip.split())
        if request.hires_upscaler in IMAGE_UPSCALERS:  # pixels, upscaled on the host: an img2img pass
            return HiresPlan(dataclasses.replace(large, init_image=True, hires_noise=True), schedule, steps, start,
                             prompt, negative, request.hires_upscaler, control=control, ip=ip)
        f = self.model.vae_scale_factor
        rows = resize_matrix(request.height // f, height // f, request.hires_upscaler)  # (H/f, h/f)
        cols = resize_matrix(request.width // f, width // f, request.hires_upscaler)  # (W/f, w/f)
        return HiresPlan(dataclasses.replace(large, init_latents=True), schedule, steps, start, prompt, negative,
                         request.hires_upscaler, rows, cols, control, ip)

    def _refiner_shape(self, shape: ProgramShape) -> ProgramShape:
        """``shape`` with the refiner. Raises InvalidRequest (``width``) for a size the refiner's UNet cannot halve
        as often as it does (its size multiple may exceed the model's: SDXL's refiner has one block more)."""
        multiple = self.model.refiner.size_multiple
        if shape.width % multiple or shape.height % multiple:
            raise InvalidRequest("width", f"{shape.width}x{shape.height}: the refiner needs multiples of {multiple} "
                                          "pixels; choose such a size, or leave refiner_switch_at out")
        return dataclasses.replace(shape, refiner=True)

    def shape(self, width: int, height: int, cfg: bool = True, chunks: int = 1,
               init_image: bool = False, inpaint: bool = False, controlnets: tuple[str, ...] = (),
               ip_adapters: tuple[tuple[str, int, int], ...] = (),
               control_images: tuple[int, ...] = (), two_calls: bool = False) -> ProgramShape:
        """The ProgramShape (the compile key) of a size bucket in pixels, a CFG mode, a prompt chunk count,
        whether an image comes in (img2img), whether a mask does (inpainting), the ControlNet units'
        architectures (checkpoint/controlnet.architecture, one per unit) and their image counts (``control_images``:
        () = one each; :func:`.control.unit_images`), the IP-Adapter units' (:meth:`ip_shape`) and whether the
        sampler calls the model twice per step (``two_calls``: Schedule.two_calls; schedulers.TWO_CALLS share that
        program)."""
        return ProgramShape(self.batch, height, width, self.config.max_inference_steps, cfg=cfg, chunks=chunks,
                            step_hook=self.config.progress, init_image=init_image, inpaint=inpaint,
                            controlnets=controlnets, ip_adapters=ip_adapters, control_images=control_images,
                            two_calls=two_calls)

    def schedule(self, sampler: str, steps: int, schedule_type: str | None = None, eta: float | None = None):
        """The sampler's schedule for ``steps`` steps of ``schedule_type`` (None: automatic) at ``eta`` (None: the
        sampler's default; schedulers.ETA_DEFAULTS; the others ignore it) (cached). Raises
        InvalidRequest for a sampler this model's scheduler config rules out (schedulers.PER_SAMPLER: DDIM on a
        zero-terminal-SNR model), more steps than it can take (LCM past original_inference_steps), or a schedule type
        the sampler does not take (``schedule_type``: DDIM, LCM, TCD)."""
        key = (sampler, steps, schedule_type, eta if sampler in ETA_DEFAULTS else None)
        if key not in self._schedules:
            try:
                self._schedules[key] = make_schedule(sampler, self.model.scheduler_config, steps, schedule_type, eta)
            except UnsupportedScheduleType as err:
                raise InvalidRequest("schedule_type", str(err)) from None
            except UnsupportedSchedulerConfig as err:
                raise InvalidRequest("sampler", f"{sampler} cannot run {self.model.name}: {err}") from None
            except TooManySteps as err:
                raise InvalidRequest("num_inference_steps", str(err)) from None
        return self._schedules[key]

    def tokens(self, prompt: str, negative: str) -> tuple[PromptTokens, PromptTokens]:
        """A validated prompt and negative prompt as chunks (engine/prompts.py), padded to one chunk count (a
        prompt of syntax only was refused by validate: prompts.check_prompt)."""
        tokenizers, chunks = (self.model.tokenizer, self.model.tokenizer_2), self.config.max_prompt_chunks
        prompt = tokenize_prompt(tokenizers, prompt, chunks, self.config.emphasis, "prompt")
        negative = tokenize_prompt(tokenizers, negative, chunks, self.config.emphasis,
                                   "negative_prompt", lora_tags=False)
        if not negative.words.strip():  # no words: the empty negative prompt (zeros), whatever its syntax
            negative = tokenize_prompt(tokenizers, "", chunks, self.config.emphasis, "negative_prompt")
        count = max(prompt.chunks, negative.chunks)
        return prompt.padded(count), negative.padded(count)

    def warnings(self, prompt: PromptTokens, negative: PromptTokens) -> list[str]:
        warnings = []
        limit = self.config.max_prompt_chunks
        for field, tokens in (("prompt", prompt), ("negative prompt", negative)):
            if tokens.cut:
                warnings.append(f"{field} needs more than {limit} chunks of {CHUNK} tokens (each BREAK starts one) "
                                f"and was cut to {limit} ({limit * CHUNK} tokens, the max_prompt_chunks setting)")
            if tokens.clamped:
                warnings.append(f"{field}: a weight beyond ±10 was clamped to ±10")
            if tokens.scheduled:
                spans = ", ".join(tokens.scheduled[:3]) + (" ..." if len(tokens.scheduled) > 3 else "")
                warnings.append(f"{field}: {spans} is A1111's prompt editing or alternation, which this server does "
                                "not do (one prompt for every step): read as words in brackets")
        if self.model.vocabulary is not None:
            for field, text in (("prompt", prompt.words), ("negative prompt", negative.words)):
                unknown = builtin.unknown_words(text, self.model.vocabulary)
                # What the model does with them: the tokenizer still spells them (as byte tokens, or a
                # token training never used), so they move the text embedding and with it the images.
                if unknown:
                    warnings.append(f"{field}: {self.model.name} was not trained on these words, so they do not "
                                    f"steer its images, but they still change them: {', '.join(unknown)}")
        return warnings
