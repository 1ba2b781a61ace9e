"""The compiled program: text encoders, CFG denoising loop and VAE decode in one jitted function.

Static (bound before compiling; changing any of them compiles a new program): the model's
modules (their graph definitions), and :class:`ProgramShape`: the batch size, the image height
and width, the largest step count, whether classifier-free guidance runs (guidance > 1, as
diffusers decides), whether the initial latents are given, whether an image comes in (img2img),
the prompt's chunk count (77 tokens each) and whether the sampler calls the UNet twice per step (``two_calls``:
Heun, DPM2, DPM++ SDE, DPM2 a, Restart share that program). Everything that changes per
request is a traced array in :class:`ProgramInputs`, so a new prompt, negative prompt, seed,
guidance scale (within one CFG mode), step count (up to ``max_steps``), sampler (within its kind, one or two
model calls per step; schedulers.py: every sampler is per-step coefficients), schedule type, input image or img2img
start step reuses the same executable.

The initial noise of image i is ``jax.random.normal(jax.random.key(seed_i), (C, H/f, W/f),
float32)`` (channels-first; f the VAE factor, 8 for SDXL), with ``seed_i = seed + i`` for the
request's seed, times the sampler's initial scale (diffusers' ``init_noise_sigma``); the step
noise (Euler a's, LCM's, Restart's jumps: wherever a step's ``d`` is not 0) is
``jax.random.normal(jax.random.fold_in(jax.random.key(seed_i), step + 1), ...)`` (DPM++ SDE's second draw of a step:
that key folded with 1 again): any implementation can reproduce an image from its seed with JAX's threefry generator.

Outputs: ``images`` (batch, height, width, 3) uint8, channels-last, 0..255; ``finite`` (batch,)
bool, False where the decoded image held NaN or inf (the caller reports an error instead of
showing a black square). With ``latents_out`` (hires fix's first pass): the final latents (batch, C, h, w)
float32 in place of the images, and their ``finite``.

The batch is split over the mesh's ``data`` axis with ``jax.shard_map``: every device runs the
whole program on its own images, params replicated, with no cross-device communication.

How the program is put together (the extension seam): :class:`ProgramShape` holds the static options (one field
each, all of it in the executable cache's key); :class:`ProgramInputs` the per-request arrays, each field declared
once with :func:`per_image` or :func:`replicated`, its shape, dtype and the ProgramShape flag that turns it on
(``when``), from which its specs and abstract inputs derive; :class:`Static` what the traced code reads besides its
arguments (:func:`static_options`). The program is four stages, in order: :func:`encode_text`,
:func:`initial_latents`, :func:`denoise` (:func:`denoise_step`, the one body every step runs) and :func:`decode`;
:func:`build_generate` only chains them in one function, :func:`build_stages` splits them into prepare (stages 1-2),
advance (a traced range of steps) and finish (stage 4) for a host that reports each step (``step_hook``). A mode is a
ProgramShape flag, the inputs it turns on and one branch in a stage: img2img (``init_image``), inpainting
(``inpaint``), the refiner (``refiner``), hires fix's two passes (``latents_out``, ``init_latents``), ControlNet units
(``controlnets``: the ``control_*`` inputs, stage 1c :func:`control_conditioning` and :func:`control_residuals` in the
base UNet's call; docs/controlnet.md), IP-Adapter units (``ip_adapters``: the ``ip_*`` inputs, stage 1d
:func:`ip_conditioning` and :func:`ip_layers` into the base UNet's cross-attentions; docs/ip-adapter.md); README,
"Architecture", says where each goes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sdxl_engine.checkpoint.loading import LoadedModel
from sdxl_engine.models.controlnet import soft_scales
from sdxl_engine.models.ip_adapter import cross_attention_layers, forward_order
from sdxl_engine.program.schedulers import Schedule
from sdxl_engine.program.sharding import DATA_AXIS

TOKENS = 77  # CLIP context length of both SDXL tokenizers


@dataclasses.dataclass(frozen=True)
class ProgramShape:
    """The static options of one compiled program; each distinct value is one compile.

    A new static option is one field here (with a default that keeps today's program): the
    executable cache's key holds the whole dataclass, and a flag may switch an optional
    :class:`ProgramInputs` field on (its ``when``).
    """

    batch: int  # images per request (global, over all devices)
    height: int  # pixels
    width: int  # pixels
    max_steps: int  # longest denoising loop the padded schedule allows
    cfg: bool = True  # classifier-free guidance (UNet on 2 x batch); False: guidance <= 1, conditional only
    given_latents: bool = False  # True: initial latents come in ProgramInputs.latents (tests, tools)
    # Prompt chunks of 77 tokens (engine/prompts.py): the ids and weights are (2, chunks * 77) and the
    # UNet cross-attends over chunks * 77 tokens. 1 is the program of a prompt of up to 75 tokens.
    chunks: int = 1
    # The per-step hook (progress, previews, stop): the program is three executables (:func:`build_stages`:
    # prepare, advance, finish) and the host runs the steps in chunks of ``advance``, reporting each chunk's last
    # step, fetching x0 for a preview and hearing "stop" between them (compiling.SteppedExecutable). No host
    # callback is compiled in, so the executables serialize and load on every backend (a TPU's deserialized
    # host callbacks have no handler). False: one executable, the whole loop on the devices.
    step_hook: bool = False
    # Image to image: the request's pixels come in ProgramInputs.image, are encoded by the VAE inside the program
    # and noised to the start step's sigma; the loop runs from ProgramInputs.start_step. False: text to image.
    init_image: bool = False
    # Inpainting (with init_image): a mask comes in ProgramInputs.mask (1 = repaint). A 4-channel UNet's known
    # region is put back after every step (the image latents re-noised to the next sigma with the same noise); a
    # 9-channel inpainting UNet takes [latents, mask, masked-image latents] instead. False: no mask.
    inpaint: bool = False
    # The SDXL refiner (diffusers' ensemble of experts): the model's refiner (LoadedModel.refiner, its params in
    # params["refiner"]) denoises the steps from ProgramInputs.refiner_start on, a traced switch. False: base only.
    refiner: bool = False
    # Hires fix, first pass: the program returns its final latents, (batch, C, h, w) float32, and whether each is
    # finite, in place of the images: no VAE decode. False: images.
    latents_out: bool = False
    # Hires fix, second pass: image to image whose image comes as latents at this program's size (ProgramInputs.
    # init_latents, upscaled by the engine: no VAE encode), noised to the start step's sigma as img2img; its noise,
    # initial and per step, is the seed's hires stream (:data:`HIRES_NOISE`). False: no latents come in.
    init_latents: bool = False
    # Hires fix's second pass from pixels (with init_image): the first pass's images upscaled as pixels on the host
    # (engine/image_upscale.py) come in ProgramInputs.image; the noise, initial and per step, is the seed's hires
    # stream as with init_latents. False: the seed's own stream.
    hires_noise: bool = False
    # ControlNet units (docs/controlnet.md): one architecture id per unit (checkpoint/controlnet.architecture, in
    # the units' order); each unit's conditioning image, weight, soft/CFG injection and per-step keep come in
    # ProgramInputs.control_*, its ControlNet's params in params["controlnet"][k]. So another ControlNet of the same
    # architecture, image, weight, mode or start/end is the same executable. (): no ControlNet.
    controlnets: tuple[str, ...] = ()
    # How many control images each unit has (a ControlNet-Union unit may have several, each with its control type in
    # ProgramInputs.control_type: models/controlnet_union.py); () = one each. A new type or image is the same
    # executable; another count is another.
    control_images: tuple[int, ...] = ()
    # IP-Adapter units (docs/ip-adapter.md): per unit (architecture id: checkpoint/ip_adapter.architecture, its image
    # tokens, their width); the units' tokens (computed before the program: program/ip_adapter.py), scales and per-step
    # keep come in ProgramInputs.ip_*, each unit's adapter layers' params in params["ip_adapter"][k]. So another
    # reference image, scale, start/end or adapter of the architecture (plain or Plus) is the same executable.
    # (): no IP-Adapter.
    ip_adapters: tuple[tuple[str, int, int], ...] = ()
    # Two model calls per step (schedulers.TWO_CALLS: Heun, DPM2, DPM++ SDE, DPM2 a, Restart): the loop body calls the
    # UNet a second time at the step's mid point (ProgramInputs.mid_*; skipped by lax.cond where the schedule's f and
    # g are 0, an Euler step to sigma 0). So these samplers share one program per shape, and their steps, guidance and
    # schedule types are its inputs; a one-call sampler's program is unchanged. False: one call per step.
    two_calls: bool = False

    @property
    def control(self) -> bool:
        """Whether ControlNet units run (the ``when`` of the control_* inputs)."""
        return bool(self.controlnets)

    @property
    def unit_images(self) -> tuple[int, ...]:
        """The control images of each ControlNet unit (``control_images``, or one each)."""
        return self.control_images or (1,) * len(self.controlnets)

    @property
    def ip_adapter(self) -> bool:
        """Whether IP-Adapter units run (the ``when`` of the ip_* inputs)."""
        return bool(self.ip_adapters)

    @property
    def from_image(self) -> bool:
        """Whether the loop starts from an image (pixels or latents) at ProgramInputs.start_step (its ``when``)."""
        return self.init_image or self.init_latents


# Partitions of a ProgramInputs field: split along its first (batch) axis over ``data``, or whole on every device.
PER_IMAGE, REPLICATED = "per-image", "replicated"
# A field's dims: a tuple, or a function of the ProgramShape and the latents' (C, h, w).
Dims = tuple[int, ...] | Callable[["ProgramShape", tuple[int, int, int]], tuple[int, ...]]


def per_step(shape: ProgramShape, latent) -> tuple[int]:
    """Dims of a schedule array with one value per loop step, padded: (max_steps,)."""
    return (shape.max_steps,)


def per_sigma(shape: ProgramShape, latent) -> tuple[int]:
    """Dims of the noise levels, one per step and the final one: (max_steps + 1,)."""
    return (shape.max_steps + 1,)


def prompt_dims(shape: ProgramShape, latent) -> tuple[int, int]:
    """Dims of one image's token ids or weights: (2 tokenizers, chunks * 77)."""
    return (2, shape.chunks * TOKENS)


def image_dims(shape: ProgramShape, latent) -> tuple[int, int, int]:
    """Dims of one input image: (height, width, 3) pixels, channels-last."""
    return (shape.height, shape.width, 3)


def mask_dims(shape: ProgramShape, latent) -> tuple[int, int]:
    """Dims of one inpainting mask: (height, width), pixel size, 1 = repaint."""
    return (shape.height, shape.width)


def control_image_dims(shape: ProgramShape, latent) -> tuple[int, int, int, int]:
    """Dims of one image's control images: (the units' images, height, width, 3) pixels, channels-last, each unit's
    images in turn."""
    return (sum(shape.unit_images), shape.height, shape.width, 3)


def per_control_image(shape: ProgramShape, latent) -> tuple[int]:
    """Dims of a control image's scalar: (the units' images,)."""
    return (sum(shape.unit_images),)


def per_unit(shape: ProgramShape, latent) -> tuple[int]:
    """Dims of a ControlNet unit scalar: (units,)."""
    return (len(shape.controlnets),)


def per_unit_step(shape: ProgramShape, latent) -> tuple[int, int]:
    """Dims of a unit's per-step value, padded: (units, max_steps)."""
    return (len(shape.controlnets), shape.max_steps)


def ip_token_dims(shape: ProgramShape, latent) -> tuple[int, int, int]:
    """Dims of the IP-Adapter units' image tokens: (2 (negative, images'), all units' tokens, width)."""
    return (2, sum(tokens for _, tokens, _ in shape.ip_adapters), shape.ip_adapters[0][2])


def per_ip_unit(shape: ProgramShape, latent) -> tuple[int]:
    """Dims of an IP-Adapter unit scalar: (units,)."""
    return (len(shape.ip_adapters),)


def per_ip_unit_step(shape: ProgramShape, latent) -> tuple[int, int]:
    """Dims of an IP-Adapter unit's per-step value, padded: (units, max_steps)."""
    return (len(shape.ip_adapters), shape.max_steps)


def latent_dims(shape: ProgramShape, latent) -> tuple[int, int, int]:
    """Dims of one image's latents: (C, h, w)."""
    return tuple(latent)


def _input(partition: str, dims: Dims, dtype, when: str | None):
    metadata = {"partition": partition, "dims": dims, "dtype": jnp.dtype(dtype), "when": when}
    return dataclasses.field(metadata=metadata, **({"default": None} if when else {}))


def per_image(dims: Dims, dtype, when: str | None = None):
    """Declare a :class:`ProgramInputs` field with one row per image, split over the ``data`` axis.

    Args:
        dims: the shape after the batch axis: a tuple, or ``f(shape, latent)`` of the
            ProgramShape and the latents' (C, h, w).
        dtype: its dtype.
        when: the name of a bool ProgramShape field; the input exists only when it is True and
            is None otherwise (it then has no spec, no abstract input and no argument).
    """
    return _input(PER_IMAGE, dims, dtype, when)


def replicated(dims: Dims, dtype, when: str | None = None):
    """Declare a :class:`ProgramInputs` field every device holds whole (the schedule, scalars);
    ``dims`` is its whole shape (see :func:`per_image` for the arguments)."""
    return _input(REPLICATED, dims, dtype, when)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProgramInputs:
    """Everything that changes per request, as arrays: one pytree, each field declared once.

    Each field's declaration gives its partition (:func:`per_image`: shape (batch, *dims), split
    over ``data``; :func:`replicated`: shape dims), its dtype, and for an optional one the
    ProgramShape flag it needs (absent: None).
    """

    prompt_ids: jax.Array = per_image(prompt_dims, jnp.int32)  # token ids for tokenizer and tokenizer_2
    negative_ids: jax.Array = per_image(prompt_dims, jnp.int32)  # the same for the negative prompt
    prompt_weights: jax.Array = per_image(prompt_dims, jnp.float32)  # each id's emphasis weight (1 = none)
    negative_weights: jax.Array = per_image(prompt_dims, jnp.float32)  # the same for the negative prompt
    negative_zero: jax.Array = per_image((), jnp.float32)  # 1 = empty negative prompt: chunk 1 and pooled zero
    seeds: jax.Array = per_image((), jnp.uint32)  # image i's initial noise comes from seed i
    guidance_scale: jax.Array = per_image((), jnp.float32)  # classifier-free guidance scale (cfg only)
    timesteps: jax.Array = replicated(per_step, jnp.float32)  # the UNet's timestep per step, padded
    sigmas: jax.Array = replicated(per_sigma, jnp.float32)  # sigma-space noise level per step
    a: jax.Array = replicated(per_step, jnp.float32)  # a..e: the sampler's update (schedulers.py)
    b: jax.Array = replicated(per_step, jnp.float32)
    c: jax.Array = replicated(per_step, jnp.float32)
    c2: jax.Array = replicated(per_step, jnp.float32)
    d: jax.Array = replicated(per_step, jnp.float32)
    e: jax.Array = replicated(per_step, jnp.float32)
    c3: jax.Array = replicated(per_step, jnp.float32)  # the history entry of three steps back (LMS)
    hx: jax.Array = replicated(per_step, jnp.float32)  # each step's history entry hx x + hx0 x0 (x0: 0, 1)
    hx0: jax.Array = replicated(per_step, jnp.float32)
    clip_range: jax.Array = replicated((), jnp.float32)  # x0 clipped to +-clip_range where e != 0 (inf)
    num_steps: jax.Array = replicated((), jnp.int32)  # denoising steps to run (1..max_steps)
    init_scale: jax.Array = replicated((), jnp.float32)  # initial latents = noise x init_scale
    final_scale: jax.Array = replicated((), jnp.float32)  # VAE input = final latents x final_scale
    # A two-call sampler's second call per step (schedulers.SecondCall; ProgramShape.two_calls): its timestep and
    # sigma, its input x_mid = mid_a x + mid_b x0 + mid_d z, and the update's f (x_mid - x0_mid) + g x0_mid + d2 w
    mid_timesteps: jax.Array | None = replicated(per_step, jnp.float32, when="two_calls")
    mid_sigmas: jax.Array | None = replicated(per_step, jnp.float32, when="two_calls")
    mid_a: jax.Array | None = replicated(per_step, jnp.float32, when="two_calls")
    mid_b: jax.Array | None = replicated(per_step, jnp.float32, when="two_calls")
    mid_d: jax.Array | None = replicated(per_step, jnp.float32, when="two_calls")
    f: jax.Array | None = replicated(per_step, jnp.float32, when="two_calls")
    g: jax.Array | None = replicated(per_step, jnp.float32, when="two_calls")
    d2: jax.Array | None = replicated(per_step, jnp.float32, when="two_calls")
    latents: jax.Array | None = per_image(latent_dims, jnp.float32, when="given_latents")  # initial noise
    image: jax.Array | None = per_image(image_dims, jnp.uint8, when="init_image")  # img2img: (H, W, 3) pixels
    start_step: jax.Array | None = replicated((), jnp.int32, when="from_image")  # img2img, hires: the first step
    mask: jax.Array | None = per_image(mask_dims, jnp.float32, when="inpaint")  # (H, W) in [0, 1], 1 = repaint
    from_noise: jax.Array | None = replicated((), jnp.bool_, when="inpaint")  # start from noise, not the image
    refiner_start: jax.Array | None = replicated((), jnp.int32, when="refiner")  # the refiner's first step
    aesthetic_score: jax.Array | None = replicated((2,), jnp.float32, when="refiner")  # (negative, prompt) rows'
    init_latents: jax.Array | None = per_image(latent_dims, jnp.float32, when="init_latents")  # hires: the image
    # ControlNet units (ProgramShape.controlnets; :meth:`with_control`): each unit's conditioning image at the
    # program's size, its weight, 1 = soft injection (A1111's per-residual 0.825 ** (12 - k) factors), the factor of
    # its residuals on the negative rows (1: both CFG halves, A1111's "Balanced"; 0: the prompt's rows only, "ControlNet
    # is more important") and per step 1 = run, 0 = skipped (A1111's guidance start/end, computed on the host).
    control_image: jax.Array | None = per_image(control_image_dims, jnp.uint8, when="control")
    control_weight: jax.Array | None = replicated(per_unit, jnp.float32, when="control")
    control_soft: jax.Array | None = replicated(per_unit, jnp.float32, when="control")
    control_uncond: jax.Array | None = replicated(per_unit, jnp.float32, when="control")
    control_keep: jax.Array | None = replicated(per_unit_step, jnp.float32, when="control")
    # each control image's control type (a ControlNet-Union unit's: diffusers' control_mode index; 0 for the others)
    control_type: jax.Array | None = replicated(per_control_image, jnp.int32, when="control")
    # IP-Adapter units (ProgramShape.ip_adapters; :meth:`with_ip_adapter`): the units' image tokens one after another
    # (row 0: the negative rows', the projection of zero embeddings; row 1: the reference images'), each unit's scale
    # and per step 1 = acts, 0 = not (A1111's start/end rule, on the host).
    ip_tokens: jax.Array | None = replicated(ip_token_dims, jnp.float32, when="ip_adapter")
    ip_scale: jax.Array | None = replicated(per_ip_unit, jnp.float32, when="ip_adapter")
    ip_keep: jax.Array | None = replicated(per_ip_unit_step, jnp.float32, when="ip_adapter")

    @staticmethod
    def specs(shape: ProgramShape) -> ProgramInputs:
        """PartitionSpecs from the declarations: per-image fields ``P("data")``, the others ``P()``,
        an optional field None unless its flag is on in ``shape``."""
        return ProgramInputs(**{f.name: _spec(f) if _present(f, shape) else None
                                for f in dataclasses.fields(ProgramInputs)})

    @staticmethod
    def build(prompt_ids: np.ndarray, negative_ids: np.ndarray, negative_empty: bool, seeds, guidance_scale: float,
              schedule: Schedule, steps: int, max_steps: int, latents: np.ndarray | None = None,
              prompt_weights: np.ndarray | None = None, negative_weights: np.ndarray | None = None,
              image: np.ndarray | None = None, start_step: int | None = None, mask: np.ndarray | None = None,
              from_noise: bool = False, init_latents=None) -> ProgramInputs:
        """One request's inputs: (2, chunks * 77) ids broadcast to every image, a seed per image, a padded schedule.

        ``prompt_ids`` and ``negative_ids`` have the same chunk count (engine/prompts.py pads the
        shorter). ``negative_empty``: no negative prompt, so its first chunk's embeddings and its pooled
        embedding are zeros (:func:`encode_text`, as A1111 does for SDXL). ``latents``: (batch, C, h, w) float32
        initial noise for a program with ``given_latents``, else None. ``prompt_weights``, ``negative_weights``:
        (2, chunks * 77) float32 emphasis weights of the ids; None = all 1 (no emphasis). ``image``:
        (batch, height, width, 3) uint8 pixels and ``start_step`` (0 .. steps - 1, the first step that
        runs) for a program with ``init_image`` (img2img), else None; ``schedule`` is the whole
        ``steps``-step one, made to start there here (:meth:`Schedule.starting_at`: a multistep sampler's history
        starts afresh there).
        ``mask``: (batch, height, width) float32 in [0, 1] (1 = repaint) for a program with ``inpaint``, and
        ``from_noise``: start from the seed's noise x ``init_scale`` instead of the noised image (diffusers'
        inpainting at strength 1, ``is_strength_max``).
        """
        n, dims = len(seeds), np.shape(prompt_ids)
        if np.shape(negative_ids) != dims:
            raise ValueError(f"prompt_ids {dims} and negative_ids {np.shape(negative_ids)} must have one shape")
        ones = np.ones(dims, np.float32)
        schedule = schedule if start_step is None else schedule.starting_at(start_step)
        return ProgramInputs(
            prompt_ids=np.broadcast_to(prompt_ids, (n, *dims)),
            negative_ids=np.broadcast_to(negative_ids, (n, *dims)),
            prompt_weights=np.broadcast_to(ones if prompt_weights is None else prompt_weights, (n, *dims)),
            negative_weights=np.broadcast_to(ones if negative_weights is None else negative_weights, (n, *dims)),
            negative_zero=np.full((n,), float(negative_empty), np.float32),
            seeds=np.asarray(seeds, np.uint32), guidance_scale=np.full((n,), guidance_scale, np.float32),
            **schedule.padded(max_steps), clip_range=np.float32(schedule.clip_range), num_steps=np.int32(steps),
            init_scale=np.float32(schedule.init_scale),
            final_scale=np.float32(schedule.final_scale), latents=latents,
            image=None if image is None else np.asarray(image, np.uint8),
            start_step=None if start_step is None else np.int32(start_step),
            mask=None if mask is None else np.asarray(mask, np.float32),
            from_noise=None if mask is None else np.bool_(from_noise),
            init_latents=init_latents)  # hires' second pass: (n, C, h, w) float32, kept where it is (on the devices)

    def with_refiner(self, refiner_start: int, schedule: Schedule, aesthetic_score: float = 6.0,
                     negative_aesthetic_score: float = 2.5) -> ProgramInputs:
        """These inputs for a program with ``refiner``: the refiner runs from step ``refiner_start``
        (schedulers.refiner_start: 0 .. steps), the prompt rows' time ids carry ``aesthetic_score`` and the negative
        rows' ``negative_aesthetic_score`` (diffusers' img2img defaults 6.0 and 2.5). ``schedule``: the one these
        inputs were built from; a multistep sampler's history restarts at the switch step (as at ``start_step``:
        :meth:`Schedule.restarting_at`), since diffusers' refiner pipeline restarts its scheduler there (DPM++ 2M's
        switch step first order, ``b + c`` and ``c = 0``); Euler, Euler a, DDIM, LCM and TCD are unchanged.
        """
        if self.start_step is not None:
            schedule = schedule.starting_at(int(self.start_step))
        if 0 < refiner_start < int(self.num_steps):
            schedule = schedule.restarting_at(refiner_start)
        padded = schedule.padded(len(self.a))
        return dataclasses.replace(self, **{k: padded[k] for k in ("a", "b", "c", "c2", "d", "c3")},
                                   refiner_start=np.int32(refiner_start),
                                   aesthetic_score=np.asarray([negative_aesthetic_score, aesthetic_score], np.float32))

    def with_control(self, images: np.ndarray, weight, soft, uncond, keep: np.ndarray,
                     types=None) -> ProgramInputs:
        """These inputs for a program with ``controlnets`` (engine/control.py makes the arrays): ``images`` (batch,
        the units' images, height, width, 3) uint8 at the program's size; ``weight``, ``soft``, ``uncond`` (units,)
        float32; ``keep`` (units, max_steps) float32, 1 where the unit runs at that step (the loop's step index, the
        skipped steps of an img2img start included); ``types`` (the units' images,) int32, each image's control
        type (None: 0 each)."""
        types = np.zeros((np.shape(images)[1],), np.int32) if types is None else types
        return dataclasses.replace(self, control_type=np.asarray(types, np.int32),
                                   control_image=np.asarray(images, np.uint8),
                                   control_weight=np.asarray(weight, np.float32),
                                   control_soft=np.asarray(soft, np.float32),
                                   control_uncond=np.asarray(uncond, np.float32),
                                   control_keep=np.asarray(keep, np.float32))

    def with_ip_adapter(self, tokens: np.ndarray, scale, keep: np.ndarray) -> ProgramInputs:
        """These inputs for a program with ``ip_adapters`` (engine/ip_adapter.py makes the arrays): ``tokens`` (2,
        all units' tokens, width) float32; ``scale`` (units,) float32; ``keep`` (units, max_steps) float32, 1 where
        the unit acts at that step (the loop's step index)."""
        return dataclasses.replace(self, ip_tokens=np.asarray(tokens, np.float32),
                                   ip_scale=np.asarray(scale, np.float32), ip_keep=np.asarray(keep, np.float32))

    @staticmethod
    def abstract(shape: ProgramShape, latent_shape: tuple[int, int, int], mesh: Mesh) -> ProgramInputs:
        """ShapeDtypeStructs with their shardings, from the declarations, for lowering ahead of time.

        ``latent_shape``: the (C, h, w) of one image's latents (:func:`latent_shape`)."""
        def struct(f: dataclasses.Field) -> jax.ShapeDtypeStruct:
            dims = f.metadata["dims"]
            dims = tuple(dims(shape, latent_shape) if callable(dims) else dims)
            whole = (shape.batch, *dims) if f.metadata["partition"] == PER_IMAGE else dims
            return jax.ShapeDtypeStruct(whole, f.metadata["dtype"], sharding=NamedSharding(mesh, _spec(f)))

        return ProgramInputs(**{f.name: struct(f) if _present(f, shape) else None
                                for f in dataclasses.fields(ProgramInputs)})


def _spec(f: dataclasses.Field) -> P:
    return P(DATA_AXIS) if f.metadata["partition"] == PER_IMAGE else P()


def _present(f: dataclasses.Field, shape: ProgramShape) -> bool:
    """Whether a ProgramInputs field is an argument of the program for ``shape``: the one rule for
    optional inputs (declared with ``when``: present only while that ProgramShape flag is on)."""
    return f.metadata["when"] is None or bool(getattr(shape, f.metadata["when"]))


def emphasize(z: jax.Array, weights: jax.Array) -> jax.Array:
    """AUTOMATIC1111's "Original" emphasis on one encoder's chunks (``modules/sd_emphasis.py``,
    ``EmphasisOriginal.after_transformers``): z' = z w (each token's hidden state times its
    weight), then z' mean(z) / mean(z'), which restores the chunk's original mean (means over
    the chunk's 77 tokens and all channels, in float32).

    Args:
        z: (m, 77, hidden) one encoder's hidden states of m chunks, any float dtype.
        weights: (m, 77) float32, one per token.
    Returns:
        (m, 77, hidden) in z's dtype. A chunk whose weights are all 1 is z itself, bit for bit (so a
        prompt without emphasis gives the same images as before weights existed), as is one whose
        weighted mean is 0 (where the formula divides by zero).
    """
    zf = z.astype(jnp.float32)
    weighted = zf * weights[..., None]  # (m, 77, hidden)
    original, new = zf.mean(axis=(1, 2)), weighted.mean(axis=(1, 2))  # (m,)
    scaled = weighted * (original / jnp.where(new == 0, 1.0, new))[:, None, None]
    keep = jnp.all(weights == 1, axis=1) | (new == 0)  # (m,)
    return jnp.where(keep[:, None, None], z, scaled.astype(z.dtype))


def encode_prompts(components: dict, params: dict, ids: jax.Array,
                   weights: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Both CLIP text encoders, SDXL style (penultimate hidden states, pooled projection), chunk by chunk.

    Each 77-token chunk goes through both encoders on its own; the chunks' hidden states are
    concatenated along the tokens and the pooled embedding is the first chunk's, as A1111 does for
    SDXL (``modules/sd_hijack_clip.py``, ``FrozenCLIPEmbedderWithCustomWordsBase.forward``: hstack
    of the chunks, ``zs[0].pooled``). Weights apply to each encoder's hidden states, per chunk
    (:func:`emphasize`); the pooled embedding takes none, as in A1111.

    Args:
        components, params: a model's Components and parameters, by component name.
        ids: (n, 2, chunks * 77) int32 token ids; [:, 0] for text_encoder, [:, 1] for text_encoder_2.
        weights: (n, 2, chunks * 77) float32 emphasis weights, or None (no emphasis).
    Returns:
        encoder_hidden_states (n, chunks * 77, hidden_1 + hidden_2) and text_embeds (n, projection_2),
        in the parameters' dtype (diffusers' ``StableDiffusionXLPipeline.encode_prompt`` for one chunk).
    """
    n, chunks = ids.shape[0], ids.shape[-1] // TOKENS
    te1 = components["text_encoder"].bind(params["text_encoder"])
    te2 = components["text_encoder_2"].bind(params["text_encoder_2"])
    per_chunk = ids.reshape(n, 2, chunks, TOKENS)
    out_1 = te1(per_chunk[:, 0].reshape(n * chunks, TOKENS), penultimate_only=True)
    out_2 = te2(per_chunk[:, 1].reshape(n * chunks, TOKENS))
    hidden_1, hidden_2 = out_1.penultimate, out_2.penultimate  # (n * chunks, 77, h1), (n * chunks, 77, h2)
    if weights is not None:
        w = weights.reshape(n, 2, chunks, TOKENS)
        hidden_1 = emphasize(hidden_1, w[:, 0].reshape(n * chunks, TOKENS))
        hidden_2 = emphasize(hidden_2, w[:, 1].reshape(n * chunks, TOKENS))
    hidden = jnp.concatenate([hidden_1, hidden_2], axis=-1)  # (n * chunks, 77, h1 + h2)
    hidden = hidden.reshape(n, chunks * TOKENS, hidden.shape[-1])  # (n, chunks * 77, h1 + h2): chunks in order
    text_embeds = out_2.text_embeds.reshape(n, chunks, -1)[:, 0]  # (n, projection_dim): the first chunk's
    return hidden, text_embeds


def tokenize(model: LoadedModel, text: str) -> tuple[np.ndarray, bool]:
    """(2, 77) int32 ids of ``text`` for tokenizer and tokenizer_2 (each padded with its own pad
    token, as diffusers' SDXL pipeline does), and whether the text was cut to 77 tokens.

    diffusers' plain reading (no emphasis syntax, one chunk), for tools and tests; the engine reads
    prompts with engine/prompts.py ``tokenize_prompt``, whose one-chunk ids for plain text are these."""
    rows, truncated = [], False
    for tok in (model.tokenizer, model.tokenizer_2):
        ids = tok(text, padding="max_length", max_length=TOKENS, truncation=True).input_ids
        # One token past the limit tells: untruncated encoding (or tokenize()) would log transformers'
        # "sequence length is longer than the specified maximum" warning for every long prompt.
        truncated |= len(tok(text, truncation=True, max_length=TOKENS + 1).input_ids) > TOKENS
        rows.append(ids)
    return np.asarray(rows, np.int32), truncated


def cfg_combine(noise_uncond: jax.Array, noise_text: jax.Array, guidance_scale: jax.Array) -> jax.Array:
    """Classifier-free guidance (Ho & Salimans 2022): uncond + g (text - uncond).

    Shapes (b, c, h, w) float32 for the predictions, (b,) for ``guidance_scale``; diffusers'
    ``StableDiffusionXLPipeline`` denoising loop.
    """
    return noise_uncond + guidance_scale[:, None, None, None] * (noise_text - noise_uncond)


def denoised(latents: jax.Array, model_output: jax.Array, sigma, prediction_type: str) -> jax.Array:
    """The UNet's estimate of the clean latents x0 from sigma-space latents (Karras et al. 2022).

    epsilon: x - sigma eps; v_prediction: x / (sigma^2 + 1) - sigma v / sqrt(sigma^2 + 1)
    (Salimans & Ho 2022); sample: the output itself (x0 is the same in sigma and x-space), as
    diffusers' ``EulerDiscreteScheduler.step`` computes ``pred_original_sample``. Float32, (b, c, h, w).
    """
    if prediction_type == "epsilon":
        return latents - sigma * model_output
    if prediction_type == "v_prediction":
        return model_output * (-sigma / (sigma**2 + 1) ** 0.5) + latents / (sigma**2 + 1)
    if prediction_type == "sample":
        return model_output
    raise ValueError(f"prediction_type {prediction_type!r} is not supported (epsilon, v_prediction, sample)")


def sampler_update(latents, x0, x0_prev, noise, a, b, c, d, e=0.0, clip_range=jnp.inf, x0_prev2=0.0, c2=0.0,
                   x0_prev3=0.0, c3=0.0):
    """x_{i+1} = a x_i + b x0_i + c h_{i-1} + c2 h_{i-2} + c3 h_{i-3} + d z_i + e (clip(x0_i) - x0_i): every
    sampler of schedulers.py; (b, C, h, w) float32 arrays, scalar coefficients.

    ``x0_prev``, ``x0_prev2``, ``x0_prev3``: the history entries h of the last three steps (x0 for every sampler but
    LMS, whose entries are its derivatives (x - x0) / sigma: :func:`history_entry`). The clip term is DDIM's
    ``clip_sample`` (x0 clipped elementwise to [-clip_range, clip_range]); with e = 0 or clip_range = inf it adds
    exactly 0, so the other samplers are unchanged. ``c2`` (DPM++ 3M SDE's third order, UniPC's corrector, LMS) and
    ``c3`` (LMS's fourth order) are 0 for every other sampler.
    """
    clipped = jnp.clip(x0, -clip_range, clip_range) - x0
    return a * latents + b * x0 + c * x0_prev + c2 * x0_prev2 + c3 * x0_prev3 + d * noise + e * clipped


def history_entry(latents, x0, hx, hx0):
    """What a step leaves in the sampler's history: hx x_i + hx0 x0_i, (b, C, h, w) float32 (x_i, x0_i the step's
    sample and x0; hx, hx0 its traced scalars). x0_i itself for every sampler but LMS (0 x + 1 x0 is x0 to the bit);
    LMS's derivative (x_i - x0_i) / sigma_i (diffusers' ``LMSDiscreteScheduler.step``'s ``derivative``) with
    hx = 1/sigma_i, hx0 = -1/sigma_i."""
    return hx * latents + hx0 * x0


def step_noise(seeds: jax.Array, step, latent_shape: tuple[int, int, int], stream: int | None = None,
               draw: int = 0) -> jax.Array:
    """The step noise at ``step`` for each image (Euler a, LCM): normal(fold_in(key(seed), step + 1)); (b, C, h, w)
    float32. ``stream``: the seed's key is :func:`seed_key`'s for it (hires fix's second pass). ``draw`` 1: the
    step's second draw (DPM++ SDE's w_i), normal(fold_in(fold_in(key(seed), step + 1), 1))."""
    def one(s):
        key = jax.random.fold_in(seed_key(s, stream), step + 1)
        return jax.random.normal(jax.random.fold_in(key, draw) if draw else key, latent_shape, jnp.float32)

    return jax.vmap(one)(seeds)


def noise_if_used(seeds: jax.Array, step, d, latents: jax.Array, stream: int | None = None,
                  draw: int = 0) -> jax.Array:
    """Step ``step``'s noise (:func:`step_noise`) where the sampler adds it (``d``, its traced coefficient, not 0: Euler
    a, LCM), else zeros like ``latents``; (b, C, h, w) float32. The sampler is a per-request input, so the choice is a
    ``lax.cond`` in the loop, not a new program: a step of Euler, DPM++ or DDIM skips the draw (two threefry loops per
    step, which XLA:CPU runs as nested while loops: docs/benchmarks.md, "Against the blog's own pipeline"), and its
    update is the same (``d`` times either is 0)."""
    return jax.lax.cond(d != 0, lambda: step_noise(seeds, step, latents.shape[1:], stream, draw),
                        lambda: jnp.zeros_like(latents))


def initial_noise(seeds: jax.Array, latent_shape: tuple[int, int, int], stream: int | None = None) -> jax.Array:
    """(b,) uint32 seeds -> (b, C, h, w) float32 standard normal noise, image i from its own seed (its ``stream``:
    :func:`seed_key`)."""
    return jax.vmap(lambda s: jax.random.normal(seed_key(s, stream), latent_shape, jnp.float32))(seeds)


# Hires fix's second pass draws its noise from each seed's own stream: key(seed_i) folded with this constant
# ("HIRE" in ASCII), so its initial noise is normal(fold_in(key(seed_i), HIRES_NOISE), (C, H/f, W/f)) and its step
# noise normal(fold_in(fold_in(key(seed_i), HIRES_NOISE), step + 1)). Not key(seed_i) itself: threefry's counter
# mode makes normal(key, larger shape) repeat normal(key, smaller shape) in its first elements (flat order), so the
# second pass would re-add the first pass's noise, spread over other pixels.
HIRES_NOISE = 0x48495245


def seed_key(seed: jax.Array, stream: int | None = None) -> jax.Array:
    """A seed's PRNG key: ``jax.random.key(seed)``, or with ``stream`` ``fold_in(key(seed), stream)``."""
    key = jax.random.key(seed)
    return key if stream is None else jax.random.fold_in(key, stream)


def latent_shape(model: LoadedModel, height: int, width: int) -> tuple[int, int, int]:
    """(C, h, w) of the latents of a height x width image."""
    f = model.vae_scale_factor
    return (model.latent_channels, height // f, width // f)


@dataclasses.dataclass(frozen=True)
class Static:
    """What the traced program reads besides its arguments: bound before compiling, so changing any of
    it compiles a new program (and compiling.program_key covers each: the shape whole, the components'
    configs, the prediction type)."""

    shape: ProgramShape
    components: Mapping[str, Any]  # component name -> Component (static module graph, bound to params inside)
    latent: tuple[int, int, int]  # (C, h, w) of the latents
    prediction_type: str  # epsilon, v_prediction or sample (the scheduler config's)
    vae: Any  # VAEConfig: scaling and shift factors
    inpainting_unet: bool = False  # the UNet takes [latents, mask, masked-image latents] (9 channels for SDXL)
    refiner: Any = None  # with shape.refiner: the model's refiner (LoadedModel: components, kind), else None
    controlnets: tuple = ()  # with shape.control: each unit's ControlNet Component (its architecture's), in order
    ip_adapters: tuple = ()  # with shape.ip_adapter: each unit's adapter layers' Component (its architecture's)
    ip_order: tuple = ()  # with shape.ip_adapter: the UNet's cross-attentions in call order (ip_adapter.forward_order)
    noise_stream: int | None = None  # the seeds' noise stream (seed_key): HIRES_NOISE for hires' second pass


def static_options(model: LoadedModel, shape: ProgramShape) -> Static:
    """The one place the program reads the model and the ProgramShape's static options.

    Raises ValueError: a mask without an image (``inpaint`` needs ``init_image``); an inpainting UNet
    without a mask, which has nothing to put in its mask channels."""
    if shape.inpaint and not shape.init_image:
        raise ValueError("ProgramShape.inpaint needs init_image: a mask applies to an input image")
    if shape.init_latents and (shape.init_image or shape.latents_out):
        raise ValueError("ProgramShape.init_latents (hires fix's second pass) takes no image and returns images")
    if shape.hires_noise and not shape.init_image:
        raise ValueError("ProgramShape.hires_noise (hires fix's second pass from pixels) needs init_image")
    if model.kind.inpainting_unet and not shape.inpaint:
        raise ValueError(f"{model.name}'s UNet takes a mask and a masked image ({model.kind.unet_in_channels} "
                         "input channels): it runs inpainting programs only (ProgramShape.inpaint)")
    return Static(shape=shape, components=model.components, latent=latent_shape(model, shape.height, shape.width),
                  prediction_type=model.scheduler_config.get("prediction_type", "epsilon"), vae=model.vae,
                  inpainting_unet=model.kind.inpainting_unet,
                  refiner=_refiner_of(model, shape), controlnets=_controlnets_of(model, shape),
                  ip_adapters=_ip_adapters_of(model, shape),
                  ip_order=forward_order(model.unet) if shape.ip_adapter else (),
                  noise_stream=HIRES_NOISE if shape.init_latents or shape.hires_noise else None)


def _controlnets_of(model: LoadedModel, shape: ProgramShape) -> tuple:
    """The Component of each unit's architecture id (a loaded ControlNet of it: ``model.controlnets``). Raises
    ValueError for an id no loaded ControlNet has."""
    by_id = {net.architecture: net.component for net in model.controlnets.values()}
    missing = [a for a in shape.controlnets if a not in by_id]
    if missing:
        raise ValueError(f"a program with ControlNet architectures {missing} needs a loaded ControlNet of each; "
                         f"{model.name} has {sorted(by_id) or 'none'} (--controlnet)")
    return tuple(by_id[a] for a in shape.controlnets)


def _ip_adapters_of(model: LoadedModel, shape: ProgramShape) -> tuple:
    """The layers' Component ("ip_adapter_layers") of each IP-Adapter unit's architecture id (a loaded IP-Adapter of
    it: ``model.ip_adapters``).
    Raises ValueError for an id no loaded IP-Adapter has, or units whose tokens differ in width."""
    by_id = {a.architecture: a.layers for a in model.ip_adapters.values()}
    missing = [a for a, _, _ in shape.ip_adapters if a not in by_id]
    if missing:
        raise ValueError(f"a program with IP-Adapter architectures {missing} needs a loaded IP-Adapter of each; "
                         f"{model.name} has {sorted(by_id) or 'none'} (--ip-adapter)")
    if len({width for _, _, width in shape.ip_adapters}) > 1:
        raise ValueError(f"IP-Adapter units of one program have one token width; got {shape.ip_adapters}")
    return tuple(by_id[a] for a, _, _ in shape.ip_adapters)


def _refiner_of(model: LoadedModel, shape: ProgramShape):
    """The model's refiner for a program with ``refiner`` (else None). Raises ValueError when it has none."""
    if not shape.refiner:
        return None
    if model.refiner is None:
        raise ValueError(f"a program with the refiner needs a model with one; {model.name} has none (--refiner)")
    return model.refiner


class Conditioning(NamedTuple):
    """The UNet's conditioning for the whole run, in the parameters' dtype (add_time_ids float32);
    ``rows`` = 2 x batch with CFG (negatives first), else batch."""

    hidden: jax.Array  # (rows, chunks * 77, hidden_1 + hidden_2) encoder hidden states
    text_embeds: jax.Array  # (rows, projection_2) pooled text embeddings
    add_time_ids: jax.Array  # (rows, 6): original size, crop top-left, target size
    refiner: Any = None  # with ProgramShape.refiner: the refiner expert (:class:`RefinerExpert`), else None
    control: Any = None  # with ProgramShape.control: :class:`ControlConditioning`, else None
    ip: Any = None  # with ProgramShape.ip_adapter: :class:`IPConditioning`, else None
    # the base UNet's cross-attention keys and values of ``hidden``, one (k, v) per cross-attention, each (rows, chunks
    # * 77, inner) (models/unet.text_kv): projected once per request, not at every step; None: at every step
    kv: Any = None


def encode_text(st: Static, params, inputs: ProgramInputs) -> Conditioning:
    """Stage 1: both text encoders, each prompt chunk by chunk with its emphasis weights; with CFG the
    negative and positive prompts in one encoder batch, negatives first.

    An empty negative prompt (``negative_zero``; its ids are the empty prompt's chunk, repeated to the
    prompt's chunk count by engine/prompts.py) is conditioned as AUTOMATIC1111 conditions it for SDXL:

    * chunk 1 (tokens 0..76): zeros. A1111 encodes the empty negative as one chunk and zeros it
      (``modules/sd_models_xl.py`` ``get_learned_conditioning``: ``force_zero_embeddings=['txt']`` when
      every negative is ``''``, so sgm's conditioner zeros both text embedders' outputs), as diffusers'
      ``force_zeros_for_empty_prompt`` does for a one-chunk prompt.
    * chunks 2..chunks: the encoders' own output for the empty prompt's chunk, not zeros. A1111 pads
      the shorter conditioning with ``cond_stage_model_empty_prompt``, the empty prompt encoded without
      force-zero (``modules/sd_samplers_cfg_denoiser.py`` ``pad_cond_uncond``, with its "Pad
      prompt/negative prompt" option on, the rule this engine follows for every negative shorter than
      the prompt).
    * pooled embedding: zeros (A1111's pooled is the first chunk's, zeroed with it; padding appends
      to the cross-attention tokens only).

    One chunk is therefore all zeros, as before, to the byte.
    """
    b = inputs.prompt_ids.shape[0]
    ids, weights = inputs.prompt_ids, inputs.prompt_weights
    if st.shape.cfg:
        ids = jnp.concatenate([inputs.negative_ids, ids])  # (2b, 2, chunks * 77)
        weights = jnp.concatenate([inputs.negative_weights, weights])
    hidden, text_embeds = encode_prompts(st.components, params, ids, weights)  # (n, chunks * 77, D), (n, P)
    if st.shape.cfg:
        zero = jnp.concatenate([inputs.negative_zero, jnp.zeros((b,), jnp.float32)])  # (2b,) 1 = empty negative
        first = (jnp.arange(hidden.shape[1]) < TOKENS).astype(jnp.float32)  # (chunks * 77,) 1 in chunk 1
        keep = 1.0 - zero[:, None] * first[None, :]  # (2b, chunks * 77): 0 on an empty negative's chunk 1
        hidden = hidden * keep.astype(hidden.dtype)[:, :, None]
        text_embeds = text_embeds * (1.0 - zero).astype(text_embeds.dtype)[:, None]
    rows = hidden.shape[0]
    size = jnp.array([st.shape.height, st.shape.width, 0, 0, st.shape.height, st.shape.width], jnp.float32)
    return Conditioning(hidden, text_embeds, jnp.broadcast_to(size, (rows, 6)))


class ImageConditioning(NamedTuple):
    """What an input image gives the denoising loop (:func:`image_conditioning`), float32.

    latents: (b, C, h, w) the image latents (:func:`encode_image`); noise: (b, C, h, w) the seed's initial noise,
    the one draw every re-noising uses; mask: (b, 1, h, w) the mask at latent size (1 = repaint), None without
    ``inpaint``; masked: (b, C, h, w) the masked image's latents, for an inpainting UNet only (else None).
    """

    latents: jax.Array
    noise: jax.Array
    mask: jax.Array | None = None
    masked: jax.Array | None = None


def image_conditioning(st: Static, params, inputs: ProgramInputs) -> ImageConditioning | None:
    """Stage 2a (``init_image``): the image latents, the noise and, with ``inpaint``, the mask; None for text to image.

    The mask goes to latent size as diffusers' ``StableDiffusionXLInpaintPipeline.prepare_mask_latents`` does
    (``interpolate``, nearest: pixel (f i, f j) for latent (i, j), f the VAE factor). An inpainting UNet's masked
    image is the image in [-1, 1] times (mask < 0.5), encoded (the pipeline's ``init_image * (mask < 0.5)``).
    """
    if not st.shape.from_image:
        return None
    noise = inputs.latents if st.shape.given_latents else initial_noise(inputs.seeds, st.latent, st.noise_stream)
    if st.shape.init_latents:  # hires fix's second pass: the image is latents already
        return ImageConditioning(inputs.init_latents, noise)
    latents = encode_image(st, params, inputs.image)
    if not st.shape.inpaint:
        return ImageConditioning(latents, noise)
    f = st.shape.height // st.latent[1]
    mask = inputs.mask[:, None, ::f, ::f]  # (b, 1, h, w)
    masked = None
    if st.inpainting_unet:
        keep = (inputs.mask < 0.5)[:, None].astype(jnp.float32)  # (b, 1, H, W): 1 where the image is kept
        masked = encode_pixels(st, params, to_unit_range(inputs.image) * keep)
    return ImageConditioning(latents, noise, mask, masked)


def initial_latents(st: Static, params, inputs: ProgramInputs, image: ImageConditioning | None = None) -> jax.Array:
    """Stage 2: (b, C, h, w) float32 sigma-space latents: each image's noise from its own seed (whatever
    device it lands on), or the given latents, times the sampler's initial scale.

    With ``init_image`` (img2img; ``image`` from :func:`image_conditioning`, computed here when None): the image
    latents plus the same noise times the start step's sigma, ``x = image_latents + sigmas[start_step] * noise``.
    That is every scheduler's ``add_noise`` in this sigma space (diffusers'
    ``StableDiffusionXLImg2ImgPipeline.prepare_latents``): Euler's ``x0 + sigma noise`` as it is; DPM++'s and
    DDIM's x-space ``alpha_t x0 + sigma_t noise``, with alpha_t = 1 / sqrt(sigma^2 + 1), times
    sqrt(sigma^2 + 1). No ``init_noise_sigma``, as diffusers. With ``inpaint`` and ``from_noise``: the noise times
    the initial scale instead, as the inpainting pipeline does at strength 1 (``is_strength_max``).
    """
    if st.shape.from_image:  # img2img, or hires fix's second pass (init_latents)
        image = image_conditioning(st, params, inputs) if image is None else image
        noised = image.latents + inputs.sigmas[inputs.start_step] * image.noise
        if st.shape.inpaint:
            return jnp.where(inputs.from_noise, image.noise * inputs.init_scale, noised)
        return noised
    noise = inputs.latents if st.shape.given_latents else initial_noise(inputs.seeds, st.latent)
    return noise * inputs.init_scale


def to_unit_range(pixels: jax.Array) -> jax.Array:
    """(b, H, W, 3) uint8 -> (b, 3, H, W) float32 in [-1, 1], as diffusers' ``VaeImageProcessor`` (x / 255, 2x - 1)."""
    return (pixels.astype(jnp.float32) / 255.0 * 2.0 - 1.0).transpose(0, 3, 1, 2)


def encode_image(st: Static, params, pixels: jax.Array) -> jax.Array:
    """Image to latents: (b, H, W, 3) uint8 -> (b, C, h, w) float32, the VAE posterior's MEAN times
    ``scaling_factor`` (minus ``shift_factor`` first, the inverse of :func:`unscale_latents`).

    Pixels go to [-1, 1] as diffusers' ``VaeImageProcessor`` does (:func:`to_unit_range`), channels-last
    becomes channels-first. The mean, not a sample of the posterior: deterministic, as diffusers'
    ``retrieve_latents(..., sample_mode="argmax")`` and ComfyUI (the pipeline's default samples).
    """
    return encode_pixels(st, params, to_unit_range(pixels))


def encode_pixels(st: Static, params, x: jax.Array) -> jax.Array:
    """(b, 3, H, W) float32 in [-1, 1] -> (b, C, h, w) float32 latents: the posterior's mean, scaled
    (:func:`encode_image`)."""
    vae = st.components["vae"].bind(params["vae"])
    mean, _ = vae.encode(x)
    mean = mean.astype(jnp.float32)
    if st.vae.shift_factor:
        mean = mean - st.vae.shift_factor
    return mean * st.vae.scaling_factor


def denoise_step(st: Static, unet, cond: Conditioning, inputs: ProgramInputs, i, carry,
                 image: ImageConditioning | None = None):
    """Stage 3's body, step ``i``: :func:`sampler_step` with the UNet as its model (:func:`model_x0`) and the
    seeds' step noise. ``carry`` = (latents, the last step's x0, the last three history entries), each (b, C, h, w)
    float32 (:func:`sampler_step`); returns the next carry.

    With ``inpaint`` (``image`` holds the mask): an inpainting UNet's input is [scaled latents, mask, masked-image
    latents] along channels; a plain UNet's result is blended with the known region after the update
    (:func:`keep_known`), as diffusers' ``StableDiffusionXLInpaintPipeline`` denoising loop does (and a two-call
    sampler's second input at its mid sigma, as that loop blends after each scheduler call)."""
    latents = carry[0]

    def x0_of(x, sigma, timestep):
        return model_x0(st, unet, cond, inputs, i, x, sigma, timestep, image)

    def noise(draw, coefficient):
        return noise_if_used(inputs.seeds, i, coefficient, latents, st.noise_stream, draw)

    plain_inpaint = st.shape.inpaint and not st.inpainting_unet
    known = (lambda x, sigma: blend_known(x, image, sigma)) if plain_inpaint else None
    update, *rest = sampler_step(x0_of, noise, inputs, i, carry, st.shape.two_calls, known)
    if plain_inpaint:
        update = keep_known(update, image, inputs, i)
    return update, *rest


def model_x0(st: Static, unet, cond: Conditioning, inputs: ProgramInputs, i, latents: jax.Array, sigma, timestep,
             image: ImageConditioning | None = None) -> jax.Array:
    """The model's x0 of step ``i``'s call at sigma-space ``latents`` (b, C, h, w) float32, noise level ``sigma`` and
    UNet timestep ``timestep`` (traced scalars): the UNet on ``latents / sqrt(sigma^2 + 1)`` (diffusers'
    ``scale_model_input``), with CFG over a doubled batch, then :func:`denoised`. (b, C, h, w) float32."""
    x = latents / jnp.sqrt(sigma**2 + 1)  # the UNet's input scaling
    if st.inpainting_unet:  # after the scaling, as the pipeline concatenates after scale_model_input
        x = jnp.concatenate([x, image.mask, image.masked], axis=1)  # (b, 2C + 1, h, w)
    x = jnp.concatenate([x, x]) if st.shape.cfg else x  # (rows, c, h, w)
    t = jnp.broadcast_to(timestep, (cond.hidden.shape[0],))
    out = unet_prediction(st, unet, cond, inputs, i, x, t)
    if st.shape.cfg:
        out = cfg_combine(*jnp.split(out, 2), inputs.guidance_scale)  # (b, c, h, w)
    return denoised(latents, out, sigma, st.prediction_type)


def sampler_step(x0_of: Callable, noise: Callable, inputs: ProgramInputs, i, carry, two_calls: bool = False,
                 known: Callable | None = None):
    """One step of any sampler of schedulers.py on ``carry`` = (x_i, x0_{i-1}, h_{i-1}, h_{i-2}, h_{i-3}), each
    (b, C, h, w) float32; returns (x_{i+1}, x0_i, h_i, h_{i-1}, h_{i-2}). x0 is the last step's (a preview's); h the
    history entries (:func:`history_entry`: x0 itself for every sampler but LMS) the update reads.

    Args:
        x0_of: ``(x, sigma, timestep) -> x0``, the model (:func:`model_x0`; tests pass a fake).
        noise: ``(draw, coefficient) -> (b, C, h, w)``: the step's normal draw 0 (z_i) or 1 (w_i), zeros where its
            traced coefficient is 0 (:func:`noise_if_used`).
        inputs: the schedule's arrays (ProgramInputs' a..e, and with ``two_calls`` the ``mid_*``, f, g, d2).
        two_calls: ProgramShape.two_calls: the second model call (:func:`second_call`); x0 is clipped to
            ``clip_range`` (Heun's clip_sample; inf otherwise) on both calls.
        known: inpainting with a plain UNet: ``(x, sigma) -> x`` with the known region at ``sigma``, for the second
            call's input (None: none; the update's own blend is :func:`denoise_step`'s).
    """
    latents, _, h1, h2, h3 = carry
    x0 = x0_of(latents, inputs.sigmas[i], inputs.timesteps[i])
    drawn = inputs.d[i]
    if two_calls:
        x0 = jnp.clip(x0, -inputs.clip_range, inputs.clip_range)
        drawn = jnp.abs(inputs.d[i]) + jnp.abs(inputs.mid_d[i])  # z_i feeds the second call's input too
    z = noise(0, drawn)
    update = sampler_update(latents, x0, h1, z, inputs.a[i], inputs.b[i], inputs.c[i], inputs.d[i],
                            inputs.e[i], inputs.clip_range, h2, inputs.c2[i], h3, inputs.c3[i])
    if two_calls:
        update = update + second_call(x0_of, noise, inputs, i, latents, x0, z, known)
    return update, x0, history_entry(latents, x0, inputs.hx[i], inputs.hx0[i]), h1, h2


def second_call(x0_of: Callable, noise: Callable, inputs: ProgramInputs, i, latents: jax.Array, x0: jax.Array,
                z: jax.Array, known: Callable | None = None) -> jax.Array:
    """A two-call sampler's part of step ``i``'s update (schedulers.SecondCall), (b, C, h, w) float32::

        x_mid = mid_a x_i + mid_b x0_i + mid_d z_i;   f (x_mid - x0_mid) + g x0_mid + d2 w_i

    x0_mid the model's at x_mid, ``mid_sigmas[i]``, ``mid_timesteps[i]`` (clipped as x0_i); the call runs under
    ``lax.cond`` where ``f`` or ``g`` is not 0, so a last step to sigma 0 (an Euler step in k-diffusion and diffusers)
    calls the model once. ``known``: see :func:`sampler_step` (applied to x_mid at its sigma)."""
    x_mid = inputs.mid_a[i] * latents + inputs.mid_b[i] * x0 + inputs.mid_d[i] * z
    if known is not None:
        x_mid = known(x_mid, inputs.mid_sigmas[i])

    def call():
        x0_mid = jnp.clip(x0_of(x_mid, inputs.mid_sigmas[i], inputs.mid_timesteps[i]), -inputs.clip_range,
                          inputs.clip_range)
        return inputs.f[i] * (x_mid - x0_mid) + inputs.g[i] * x0_mid

    part = jax.lax.cond((inputs.f[i] != 0) | (inputs.g[i] != 0), call, lambda: jnp.zeros_like(latents))
    return part + inputs.d2[i] * noise(1, inputs.d2[i])


def blend_known(latents: jax.Array, image: ImageConditioning, sigma) -> jax.Array:
    """(1 - mask) known + mask latents, the known region the image latents noised to ``sigma`` with the request's
    one noise draw: ``image.latents + sigma noise`` (b, C, h, w) float32."""
    known = image.latents + sigma * image.noise
    return (1.0 - image.mask) * known + image.mask * latents


def keep_known(latents: jax.Array, image: ImageConditioning, inputs: ProgramInputs, i) -> jax.Array:
    """Inpainting with a plain UNet, after step ``i``: :func:`blend_known` at the next step's sigma (clean after the
    last step). (b, C, h, w) float32.

    diffusers' ``StableDiffusionXLInpaintPipeline`` (``num_channels_unet == 4``): ``scheduler.add_noise(
    image_latents, noise, timesteps[i + 1])`` while ``i < len(timesteps) - 1``, else the image latents; in this
    sigma space every scheduler's add_noise is ``x0 + sigma noise`` (:func:`initial_latents`).
    """
    return blend_known(latents, image, jnp.where(i + 1 < inputs.num_steps, inputs.sigmas[i + 1], 0.0))


def denoise(st: Static, params, cond: Conditioning, inputs: ProgramInputs, latents: jax.Array,
            python_loop: bool = False, image: ImageConditioning | None = None) -> jax.Array:
    """Stage 3: ``num_steps`` of :func:`denoise_step` in ``lax.fori_loop`` (or a Python loop, for
    debugging: needs a concrete ``num_steps``) from the first step (``start_step`` from an image); returns the
    final latents (b, C, h, w) float32, before ``final_scale`` (:func:`finish_latents`). ``image``: the input
    image's :class:`ImageConditioning`, which inpainting's steps read."""
    first = inputs.start_step if st.shape.from_image else 0  # img2img, hires: the skipped steps are not run
    if python_loop:
        carry = fresh_carry(latents)
        step = denoise_range_body(st, params, cond, inputs, image)
        for i in range(int(first), int(inputs.num_steps)):
            carry = step(i, carry)
        return carry[0]
    return denoise_range(st, params, cond, inputs, fresh_carry(latents), first, inputs.num_steps, image)[0]


def fresh_carry(latents: jax.Array) -> tuple[jax.Array, ...]:
    """The loop's carry before its first step: (latents, the last x0, three history entries), the others zeros (the
    first step's coefficients on them are 0), each (b, C, h, w) float32 (:func:`sampler_step`)."""
    return latents, *(jnp.zeros_like(latents) for _ in range(4))


def denoise_range_body(st: Static, params, cond: Conditioning, inputs: ProgramInputs,
                       image: ImageConditioning | None = None) -> Callable:
    """The loop body ``(i, carry) -> carry`` of :func:`denoise_step` with the UNet bound to ``params``."""
    unet = st.components["unet"].bind(params["unet"])
    return lambda i, carry: denoise_step(st, unet, cond, inputs, i, carry, image)


def denoise_range(st: Static, params, cond: Conditioning, inputs: ProgramInputs, carry, first, end,
                  image: ImageConditioning | None = None):
    """Steps ``first`` to ``end - 1`` (traced () int32 or ints) of :func:`denoise_step` in ``lax.fori_loop`` on
    ``carry`` = (latents, the last x0, three history entries), each (b, C, h, w) float32; returns the carry after step
    ``end - 1``. The
    whole loop (:func:`denoise`) and a host's chunk of it (:func:`build_stages`' advance) run this one loop, so
    the steps' arithmetic is the same however the host splits them."""
    return jax.lax.fori_loop(first, end, denoise_range_body(st, params, cond, inputs, image), carry)


def finish_latents(latents: jax.Array, inputs: ProgramInputs) -> jax.Array:
    """The loop's final latents times the sampler's ``final_scale`` (b, C, h, w) float32: what the VAE decodes."""
    return latents * inputs.final_scale


def decode(st: Static, params, latents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stage 4: VAE decode, image by image, then channels-first [-1, 1] -> channels-last uint8 [0, 255].

    Returns images (b, H, W, 3) uint8 and finite (b,) bool (False: the decoded image held NaN/inf).
    """
    vae = st.components["vae"].bind(params["vae"])

    def one(z):  # (1, C, h, w) -> (1, H, W, 3) uint8, (1,) bool
        decoded = vae.decode(unscale_latents(z, st.vae)).astype(jnp.float32)  # (1, 3, H, W)
        finite = jnp.isfinite(decoded).all(axis=(1, 2, 3))
        pixels = jnp.clip(decoded / 2 + 0.5, 0.0, 1.0).transpose(0, 2, 3, 1)  # (1, H, W, 3)
        return jnp.round(pixels * 255).astype(jnp.uint8), finite

    if latents.shape[0] == 1:
        return one(latents)
    # Image by image: the decoder's full-resolution activations (128 to 512 channels at H x W) of one image at a
    # time, a quarter of four images' (what let four 1024² images per request fit in a v5e chip's HBM).
    images, finite = jax.lax.map(lambda z: one(z[None]), latents)  # (b, 1, H, W, 3), (b, 1)
    return images[:, 0], finite[:, 0]


def conditioning(st: Static, params, inputs: ProgramInputs) -> Conditioning:
    """Stages 1, 1b, 1c and 1d: the text conditioning, the refiner's (``refiner``), the ControlNets' (``control``) and
    the IP-Adapters' (``ip_adapter``)."""
    cond = encode_text(st, params, inputs)  # 1.
    cond = cond._replace(kv=st.components["unet"].bind(params["unet"]).text_kv(cond.hidden))
    if st.shape.refiner:  # 1b. the refiner's own conditioning and UNet
        cond = cond._replace(refiner=refiner_expert(st, params, inputs))
    if st.shape.control:  # 1c. the ControlNets, bound, and their conditioning images
        cond = cond._replace(control=control_conditioning(st, params, inputs))
    if st.shape.ip_adapter:  # 1d. the IP-Adapters, bound, and their image tokens per row
        cond = cond._replace(ip=ip_conditioning(st, params, inputs))
    return cond


def build_generate(model: LoadedModel, shape: ProgramShape, python_loop: bool = False) -> Callable:
    """The per-device generate function ``(params, inputs: ProgramInputs) -> (images, finite)`` (``latents_out``:
    (latents, finite)): every stage in one function, the whole loop on the devices.

    Args:
        model: a LoadedModel (module graphs and configs; params come as an argument).
        python_loop: run the denoising steps in a Python loop instead of ``lax.fori_loop``
            (debugging only: needs a concrete ``num_steps``, i.e. no jit).
    """
    st = static_options(model, shape)

    def generate(params, inputs: ProgramInputs):
        cond = conditioning(st, params, inputs)  # 1.
        image = image_conditioning(st, params, inputs)  # 2a. (an input image: its latents, noise, mask)
        latents = initial_latents(st, params, inputs, image)  # 2.
        latents = denoise(st, params, cond, inputs, latents, python_loop, image)  # 3.
        return finish(st, params, finish_latents(latents, inputs))  # 4.

    return generate


def finish(st: Static, params, latents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stage 4: (images, finite) from the final latents (:func:`decode`); with ``latents_out`` (hires fix's first
    pass) the latents themselves and whether each is finite, no VAE."""
    if st.shape.latents_out:
        return latents, jnp.isfinite(latents).all(axis=(1, 2, 3))
    return decode(st, params, latents)


class LoopFixed(NamedTuple):
    """What every step reads and no step changes, as :func:`build_stages`' prepare returns it: the conditioning
    (arrays only: the refiner's UNet and the ControlNets are bound again from the params by each advance) and the
    input image's :class:`ImageConditioning` (None for text to image). Every leaf has the device's images (or its
    CFG rows) first, so one ``P("data")`` shards the whole tuple."""

    cond: Conditioning
    image: ImageConditioning | None


def _unbound(cond: Conditioning) -> Conditioning:
    """``cond`` without its bound modules (a program's outputs are arrays)."""
    if cond.refiner is not None:
        cond = cond._replace(refiner=cond.refiner._replace(unet=None))
    if cond.control is not None:
        cond = cond._replace(control=cond.control._replace(nets=()))
    if cond.ip is not None:
        cond = cond._replace(ip=cond.ip._replace(adapters=()))
    return cond


def _bound(st: Static, params, cond: Conditioning) -> Conditioning:
    """``cond`` with the refiner's UNet and the ControlNets bound to ``params`` again (as :func:`refiner_expert`
    and :func:`control_conditioning` bind them)."""
    if cond.refiner is not None:
        cond = cond._replace(refiner=cond.refiner._replace(
            unet=st.refiner.components["unet"].bind(params["refiner"]["unet"])))
    if cond.control is not None:
        cond = cond._replace(control=cond.control._replace(
            nets=tuple(c.bind(params["controlnet"][k]) for k, c in enumerate(st.controlnets))))
    if cond.ip is not None:
        cond = cond._replace(ip=cond.ip._replace(
            adapters=tuple(c.bind(params["ip_adapter"][k]) for k, c in enumerate(st.ip_adapters))))
    return cond


class Stages(NamedTuple):
    """The per-device functions of a program whose host runs the steps (ProgramShape.step_hook):

    * ``prepare(params, inputs) -> (fixed, carry)``: stages 1-2; ``fixed`` a :class:`LoopFixed`, ``carry`` =
      (latents, the last x0, three history entries: :func:`sampler_step`), each (b, C, h, w) float32 (zeros but the
      latents).
    * ``advance(params, inputs, fixed, carry, bounds) -> carry``: steps ``bounds[0]`` to ``bounds[1] - 1``
      (``bounds`` (2,) int32, traced: any chunk is the same executable) of :func:`denoise_range`; the carry's x0
      is the estimate of the chunk's last step (a preview's).
    * ``finish(params, inputs, carry) -> (images, finite)``: stage 4 on the latents times ``final_scale``.

    Run in order over the steps, they compute what :func:`build_generate`'s function does, to the byte on the
    backends measured (tests/program).
    """

    prepare: Callable
    advance: Callable
    finish: Callable


def build_stages(model: LoadedModel, shape: ProgramShape) -> Stages:
    """:class:`Stages` of ``shape``'s program (see there), per device as :func:`build_generate`'s function."""
    st = static_options(model, shape)

    def prepare(params, inputs: ProgramInputs):
        cond = conditioning(st, params, inputs)  # 1.
        image = image_conditioning(st, params, inputs)  # 2a.
        latents = initial_latents(st, params, inputs, image)  # 2.
        return LoopFixed(_unbound(cond), image), fresh_carry(latents)

    def advance(params, inputs: ProgramInputs, fixed: LoopFixed, carry, bounds):
        cond = _bound(st, params, fixed.cond)
        return denoise_range(st, params, cond, inputs, carry, bounds[0], bounds[1], fixed.image)  # 3.

    def finish_stage(params, inputs: ProgramInputs, carry):
        return finish(st, params, finish_latents(carry[0], inputs))  # 4.

    return Stages(prepare, advance, finish_stage)


def loop_structure(model: LoadedModel, shape: ProgramShape):
    """(fixed, carry) as :func:`build_stages`' prepare returns them, with 0 for every array: their pytree
    structure from the shape alone, without tracing (what the executable cache's loader needs)."""
    st = static_options(model, shape)
    refiner = RefinerExpert(0, 0, 0, None, tuple((0, 0) for _ in cross_attention_layers(st.refiner.unet))) \
        if st.shape.refiner else None
    control = ControlConditioning((), tuple(0 for _ in st.controlnets)) if st.shape.control else None
    ip = IPConditioning((), tuple(0 for _ in st.ip_adapters)) if st.shape.ip_adapter else None
    image = None
    if st.shape.from_image:
        image = ImageConditioning(0, 0)
        if st.shape.inpaint:
            image = ImageConditioning(0, 0, 0, 0 if st.inpainting_unet else None)
    kv = tuple((0, 0) for _ in cross_attention_layers(model.unet))
    return LoopFixed(Conditioning(0, 0, 0, refiner, control, ip, kv), image), (0, 0, 0, 0, 0)


class ControlConditioning(NamedTuple):
    """What the ControlNet units read at every step (ProgramShape.control): each unit's ControlNet bound to its params
    (``params["controlnet"][k]``) and its conditioning images, (images, rows, 3, H, W) in [0, 1] in the parameters'
    dtype, repeated for the negative rows with CFG (negatives first, as :class:`Conditioning`)."""

    nets: tuple
    images: tuple


def control_conditioning(st: Static, params, inputs: ProgramInputs) -> ControlConditioning:
    """Stage 1c: the units' ControlNets and images. Pixels (b, units, H, W, 3) uint8 become x / 255 channels-first
    (diffusers' control image processor: no normalisation; A1111's hint likewise)."""
    nets, images = [], []
    for k, (component, first) in enumerate(zip(st.controlnets, _unit_starts(st.shape), strict=True)):
        net = component.bind(params["controlnet"][k])
        dtype = net.conv_in.weight[...].dtype
        pixels = inputs.control_image[:, first:first + st.shape.unit_images[k]]  # (b, n, H, W, 3)
        image = (pixels.astype(jnp.float32) / 255.0).transpose(1, 0, 4, 2, 3).astype(dtype)  # (n, b, 3, H, W)
        nets.append(net)
        images.append(jnp.concatenate([image, image], axis=1) if st.shape.cfg else image)  # (n, rows, 3, H, W)
    return ControlConditioning(tuple(nets), tuple(images))


def _unit_starts(shape: ProgramShape) -> tuple[int, ...]:
    """Where each unit's images start among ProgramInputs.control_image's (its axis 1)."""
    counts = shape.unit_images
    return tuple(sum(counts[:k]) for k in range(len(counts)))


def _rows_axis() -> str | None:
    """The mesh axis the rows are split over, inside the program's ``shard_map``; None outside it (the debug
    loop's plain call), where every row is here."""
    try:
        jax.lax.axis_index(DATA_AXIS)
    except NameError:
        return None
    return DATA_AXIS


def control_residuals(st: Static, cond: Conditioning, inputs: ProgramInputs, i, x: jax.Array,
                      t: jax.Array) -> tuple[list[jax.Array], jax.Array]:
    """The UNet's additional residuals at step ``i``: the sum over units of each ControlNet's residuals (its own
    ``x`` (rows, C, h, w) latent input and ``t``), times the unit's weight, times A1111's soft-injection factor of
    the residual (``control_soft``: 0.825 ** (12 - k) for residual k), times ``control_uncond`` on the negative rows
    with CFG (0: the prompt's rows only); a unit whose ``control_keep[k, i]`` is 0 adds zeros without running
    (``lax.cond``). sd-webui-controlnet's hook.py: ``control_scales``, ``cond_mark``, ``guidance_stopped``.

    Returns (down residuals (one per UNet skip, channels-first), the mid residual), in the parameters' dtype.
    """
    control, total = cond.control, None
    rows = x.shape[0]
    for k, net in enumerate(control.nets):
        n = st.controlnets[k].config.residuals
        soft = jnp.asarray(soft_scales(n), jnp.float32)  # (n,)
        weight = 1.0 if _is_union(st, k) else inputs.control_weight[k]  # a union's call takes its weight itself
        layer = weight * jnp.where(inputs.control_soft[k] > 0, soft, 1.0)  # (n,)
        row = jnp.ones((rows,), jnp.float32)
        if st.shape.cfg:  # negatives first: (rows,) = [uncond factor] * b + [1] * b
            row = jnp.concatenate([jnp.full((rows // 2,), inputs.control_uncond[k]), jnp.ones((rows // 2,))])

        def run(net=net, k=k, layer=layer, row=row):
            down, mid = _unit_call(st, net, k, cond, inputs, x, t, control.images[k])
            out = [*down, mid]
            return [r * (layer[j] * row).astype(r.dtype)[:, None, None, None] for j, r in enumerate(out)]

        shapes = jax.eval_shape(run)
        res = jax.lax.cond(inputs.control_keep[k, i] > 0, run, lambda shapes=shapes: [_like(s) for s in shapes])
        total = res if total is None else [a + b for a, b in zip(total, res, strict=True)]
    return total[:-1], total[-1]


def _is_union(st: Static, k: int) -> bool:
    return st.controlnets[k].name == "controlnet_union"


def _unit_call(st: Static, net, k: int, cond: Conditioning, inputs: ProgramInputs, x: jax.Array, t: jax.Array,
               images: jax.Array):
    """Unit ``k``'s ControlNet on ``x``: a plain one on its image; a ControlNet-Union on its images with their
    control types and the unit's weight (diffusers' rule: one image, every residual times it; several, each image's
    share), its token attention over every device's rows."""
    if not _is_union(st, k):
        return net(x, t, cond.hidden, cond.text_embeds, cond.add_time_ids, images[0])
    first = _unit_starts(st.shape)[k]
    types = inputs.control_type[first:first + st.shape.unit_images[k]]  # (n,)
    return net(x, t, cond.hidden, cond.text_embeds, cond.add_time_ids, images, inputs.control_weight[k], types,
               rows_axis=_rows_axis())


class IPConditioning(NamedTuple):
    """What the IP-Adapter units read at every step (ProgramShape.ip_adapter): each unit's adapter layers
    (models/ip_adapter.IPAdapterLayers) bound to its params (``params["ip_adapter"][k]``: its ``layer_params``) and its
    image tokens per row, (rows, tokens, width) in the parameters' dtype
    (negatives first with CFG, as :class:`Conditioning`)."""

    adapters: tuple
    tokens: tuple


def ip_conditioning(st: Static, params, inputs: ProgramInputs) -> IPConditioning:
    """Stage 1d: the units' adapters and tokens. ``ip_tokens`` (2, all tokens, width) is split per unit and its
    rows repeated for the device's images: with CFG the negative row for the negative rows, then the images' row
    (diffusers' ``prepare_ip_adapter_image_embeds``: ``cat([negative, positive])``, repeated per image); without CFG
    the images' row only."""
    b = inputs.prompt_ids.shape[0]
    adapters, tokens, first = [], [], 0
    for k, component in enumerate(st.ip_adapters):
        adapter = component.bind(params["ip_adapter"][k])
        dtype = adapter.layer(0).to_k_ip.weight[...].dtype
        count = st.shape.ip_adapters[k][1]
        unit = inputs.ip_tokens[:, first:first + count].astype(dtype)  # (2, tokens, width)
        first += count
        rows = jnp.repeat(unit, b, axis=0) if st.shape.cfg else jnp.repeat(unit[1:], b, axis=0)  # (rows, tokens, w)
        adapters.append(adapter)
        tokens.append(rows)
    return IPConditioning(tuple(adapters), tuple(tokens))


def ip_layers(st: Static, cond: Conditioning, inputs: ProgramInputs, i) -> list[list[tuple]]:
    """The UNet's ``ip_adapter`` argument at step ``i``: per cross-attention in call order, ``(layer, tokens,
    scale)`` of each unit, the scale ``ip_scale[k] x ip_keep[k, i]`` (0 outside the unit's start/end)."""
    ip = cond.ip
    scales = [inputs.ip_scale[k] * inputs.ip_keep[k, i] for k in range(len(ip.adapters))]
    return [[(adapter.layer(j), ip.tokens[k], scales[k]) for k, adapter in enumerate(ip.adapters)]
            for j in st.ip_order]


def _like(struct) -> jax.Array:
    """Zeros of ``struct``'s shape and dtype (an ``eval_shape`` result), varying over the mesh axes it varies over:
    inside ``shard_map`` a ``lax.cond``'s branches must agree on them."""
    zeros = jnp.zeros(struct.shape, struct.dtype)
    manual = getattr(struct, "manual_axis_type", None)
    axes = tuple(sorted(manual.varying)) if manual is not None else ()
    return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


class RefinerExpert(NamedTuple):
    """What the refiner's steps read (ProgramShape.refiner): its conditioning, in the parameters' dtype (time ids
    float32), ``rows`` as :class:`Conditioning`'s (negatives first with CFG), and its UNet bound to its params."""

    hidden: jax.Array  # (rows, chunks * 77, hidden_2): text_encoder_2's penultimate hidden states
    text_embeds: jax.Array  # (rows, projection_2) text_encoder_2's pooled projection (the first chunk's)
    add_time_ids: jax.Array  # (rows, 5): original size, crop top-left, aesthetic score (6 without the score)
    unet: Any  # the refiner's UNet module, bound to params["refiner"]["unet"]
    kv: Any = None  # its cross-attentions' keys and values of ``hidden`` (models/unet.text_kv), as Conditioning.kv


def refiner_expert(st: Static, params, inputs: ProgramInputs) -> RefinerExpert:
    """Stage 1b: the refiner's conditioning, diffusers' ``StableDiffusionXLImg2ImgPipeline.encode_prompt`` and
    ``_get_add_time_ids`` for a refiner, with this engine's chunks and emphasis.

    * text: its one text encoder (text_encoder_2) on the base's tokenizer_2 ids (row 1 of ``prompt_ids`` /
      ``negative_ids``; loading.check_refiner made sure the refiner's tokenizer_2 is the same), chunk by chunk with
      the emphasis weights, penultimate hidden states concatenated, the first chunk's pooled projection: as
      :func:`encode_prompts` does for the base's second encoder.
    * an empty negative prompt (``negative_zero``) is zeros (chunk 1 and pooled, as :func:`encode_text`) only when
      the refiner's model_index.json says ``force_zeros_for_empty_prompt``; SDXL's refiner says false, so its empty
      negative is the empty text encoded.
    * time ids, with ``requires_aesthetics_score`` (5 ids): (height, width, 0, 0, score), score
      ``aesthetic_score[1]`` on the prompt rows and ``aesthetic_score[0]`` on the negative rows; a refiner UNet with
      6 time ids gets the base's (height, width, 0, 0, height, width).
    """
    refiner = st.refiner
    b, chunks = inputs.prompt_ids.shape[0], inputs.prompt_ids.shape[-1] // TOKENS
    ids, weights = inputs.prompt_ids[:, 1], inputs.prompt_weights[:, 1]  # (b, chunks * 77): tokenizer_2's
    if st.shape.cfg:
        ids = jnp.concatenate([inputs.negative_ids[:, 1], ids])  # (2b, chunks * 77), negatives first
        weights = jnp.concatenate([inputs.negative_weights[:, 1], weights])
    n = ids.shape[0]
    te2 = refiner.components["text_encoder_2"].bind(params["refiner"]["text_encoder_2"])
    out = te2(ids.reshape(n * chunks, TOKENS))
    hidden = emphasize(out.penultimate, weights.reshape(n * chunks, TOKENS))  # (n * chunks, 77, h2)
    hidden = hidden.reshape(n, chunks * TOKENS, hidden.shape[-1])  # (n, chunks * 77, h2): chunks in order
    text_embeds = out.text_embeds.reshape(n, chunks, -1)[:, 0]  # (n, projection_2): the first chunk's
    if st.shape.cfg and refiner.kind.force_zeros_for_empty_prompt:
        zero = jnp.concatenate([inputs.negative_zero, jnp.zeros((b,), jnp.float32)])  # (2b,) 1 = empty negative
        first = (jnp.arange(hidden.shape[1]) < TOKENS).astype(jnp.float32)  # (chunks * 77,) 1 in chunk 1
        hidden = hidden * (1.0 - zero[:, None] * first[None, :]).astype(hidden.dtype)[:, :, None]
        text_embeds = text_embeds * (1.0 - zero).astype(text_embeds.dtype)[:, None]
    h, w = st.shape.height, st.shape.width
    if refiner.kind.time_ids == 5:
        score = inputs.aesthetic_score[1] if not st.shape.cfg else jnp.repeat(inputs.aesthetic_score, b)  # (n,)
        size = jnp.broadcast_to(jnp.array([h, w, 0, 0], jnp.float32), (n, 4))
        time_ids = jnp.concatenate([size, jnp.broadcast_to(score, (n,))[:, None]], axis=1)  # (n, 5)
    else:
        time_ids = jnp.broadcast_to(jnp.array([h, w, 0, 0, h, w], jnp.float32), (n, 6))
    unet = refiner.components["unet"].bind(params["refiner"]["unet"])
    return RefinerExpert(hidden, text_embeds, time_ids, unet, unet.text_kv(hidden))


def unet_prediction(st: Static, unet, cond: Conditioning, inputs: ProgramInputs, i, x: jax.Array,
                    t: jax.Array) -> jax.Array:
    """The model output of step ``i``, (rows, C, h, w) float32, for the UNet input ``x`` (rows, C, h, w) at
    timesteps ``t`` (rows,): the base UNet's; with ``refiner``, the refiner's from step ``refiner_start`` on.

    The switch is diffusers' ensemble of experts (schedulers.refiner_start): a traced scalar, so another switch
    point is the same executable; ``lax.cond`` runs one of the two UNets per step, not both. ControlNet residuals
    (``control``) go to the base UNet only, as diffusers' refiner takes none.
    """
    def base():
        down, mid = control_residuals(st, cond, inputs, i, x[:, :st.latent[0]], t) if st.shape.control else (None,
                                                                                                               None)
        ip = ip_layers(st, cond, inputs, i) if st.shape.ip_adapter else None
        return unet(x, t, cond.hidden, cond.text_embeds, cond.add_time_ids, down, mid, ip,
                    cond.kv).astype(jnp.float32)

    if not st.shape.refiner:
        return base()
    expert = cond.refiner

    def refine():
        return expert.unet(x, t, expert.hidden, expert.text_embeds, expert.add_time_ids,
                           text_kv=expert.kv).astype(jnp.float32)

    return jax.lax.cond(i < inputs.refiner_start, base, refine)


def unscale_latents(latents: jax.Array, vae_cfg) -> jax.Array:
    """Latents the UNet works on -> what the VAE decodes: / scaling_factor (+ shift_factor),
    as diffusers' SDXL pipeline does before ``vae.decode``. (b, c, h, w) float32."""
    out = latents / vae_cfg.scaling_factor
    return out + vae_cfg.shift_factor if vae_cfg.shift_factor else out
