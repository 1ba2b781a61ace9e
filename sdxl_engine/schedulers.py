"""Samplers as per-step coefficients, so one compiled program runs every sampler.

Each sampler is written in k-diffusion's sigma space (Karras et al. 2022): the latents are
x = x0 + sigma * noise, the UNet sees x / sqrt(sigma^2 + 1) at the scheduler's timestep, and its
output gives the denoised x0 (epsilon: x - sigma * eps; v: x / (sigma^2 + 1) - sigma * v /
sqrt(sigma^2 + 1)). Every sampler here is then one update of the same form::

    x_{i+1} = a_i x_i + b_i x0_i + c_i x0_{i-1} + d_i z_i         (z_i ~ N(0, 1), Euler a only)

with a, b, c, d computed on the host for the step count. The program takes them as arrays, so
changing the sampler, like the step count, compiles nothing. The numbers are diffusers'
PyTorch schedulers' (``from_config`` of the model's scheduler config):

================  =====================================================================================
A1111 name        diffusers class and update
================  =====================================================================================
Euler             EulerDiscreteScheduler: a = s'/s, b = 1 - a (Karras et al. 2022, Alg. 2)
Euler a           EulerAncestralDiscreteScheduler: s_up = sqrt(s'^2 (s^2 - s'^2) / s^2),
                  s_down = sqrt(s'^2 - s_up^2); a = s_down/s, b = 1 - a, d = s_up
DPM++ 2M          DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2): with
                  h = log s - log s', r = h_prev / h: b = (1 - a)(1 + 1/2r), c = -(1 - a)/2r;
                  first and last steps first order (Lu et al. 2022, DPM-Solver++ 2M)
DPM++ 2M Karras   the same with use_karras_sigmas=True (Karras et al. 2022, eq. 5, rho 7)
DDIM              DDIMScheduler, eta 0: deterministic, first order in sigma space (Song et al. 2021);
                  its last sigma is alphas_cumprod[0]'s, not 0
================  =====================================================================================

(s = sigma_i, s' = sigma_{i+1}.) DDIM and DPM++ work in diffusers on x / sqrt(sigma^2 + 1) (the
"x-space"); the same update in sigma space starts from noise * sqrt(sigma_0^2 + 1) and ends by
dividing by sqrt(sigma_n^2 + 1): :attr:`Schedule.init_scale` and :attr:`Schedule.final_scale`.

Euler a's step noise for image i of a request is ``jax.random.normal(jax.random.fold_in(
jax.random.key(seed_i), step + 1), latents.shape)``: deterministic per seed (program.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

SAMPLERS = ("Euler", "Euler a", "DPM++ 2M", "DPM++ 2M Karras", "DDIM")
DEFAULT_SAMPLER = "Euler"  # the blog's


class UnknownSampler(ValueError):
    """A sampler name that is not one of :data:`SAMPLERS`."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One sampler at one step count: what the program needs, float32, ``n`` = steps.

    Attributes:
        timesteps: (n,) what the UNet is given at each step.
        sigmas: (n + 1,) noise levels in sigma space; sigmas[n] is 0 (DDIM: alphas_cumprod[0]'s).
        a, b, c, d: (n,) the update's coefficients (module docstring).
        init_scale: initial latents = unit noise * init_scale (diffusers' init_noise_sigma,
            in sigma space).
        final_scale: the latents handed to the VAE = x_n * final_scale.
    """

    timesteps: np.ndarray
    sigmas: np.ndarray
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    d: np.ndarray
    init_scale: float
    final_scale: float

    def padded(self, max_steps: int) -> dict[str, np.ndarray]:
        """Arrays padded with zeros to ``max_steps`` (sigmas to ``max_steps + 1``), for one program shape."""
        def pad(x, n):
            out = np.zeros(n, np.float32)
            out[: len(x)] = x
            return out

        n = max_steps
        return {"timesteps": pad(self.timesteps, n), "sigmas": pad(self.sigmas, n + 1), "a": pad(self.a, n),
                "b": pad(self.b, n), "c": pad(self.c, n), "d": pad(self.d, n)}


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


def alphas_cumprod(config: dict) -> np.ndarray:
    """(num_train_timesteps,) float32 cumulative product of 1 - beta (DDPM, Ho et al. 2020).

    Raises ValueError for a beta schedule other than ``scaled_linear`` or ``linear``.
    """
    n = config.get("num_train_timesteps", 1000)
    start, end = config.get("beta_start", 0.0001), config.get("beta_end", 0.02)
    kind = config.get("beta_schedule", "linear")
    if kind == "scaled_linear":
        betas = np.linspace(start**0.5, end**0.5, n, dtype=np.float32) ** 2
    elif kind == "linear":
        betas = np.linspace(start, end, n, dtype=np.float32)
    else:
        raise ValueError(f"beta_schedule {kind!r} is not supported (scaled_linear, linear)")
    return np.cumprod(1.0 - betas, dtype=np.float32)


def _karras(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> np.ndarray:
    ramp = np.linspace(0, 1, n)
    return (sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho


def _sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """Fractional timesteps whose interpolated log-sigma is ``log(sigmas)`` (diffusers' ``_sigma_to_t``)."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma - log_sigmas[:, np.newaxis]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1]), 0, 1)
    return (1 - w) * low + w * (low + 1)


def _spaced(config: dict, steps: int, extra: int = 0) -> np.ndarray:
    """Timesteps by ``timestep_spacing``, as diffusers' Euler (extra=0) and DPM++ (extra=1) space them."""
    n_train = config.get("num_train_timesteps", 1000)
    spacing = config.get("timestep_spacing", "linspace")
    if spacing == "linspace":
        if extra:
            return np.linspace(0, n_train - 1, steps + 1).round()[::-1][:-1].astype(np.float64)
        return np.linspace(0, n_train - 1, steps, dtype=np.float32)[::-1].astype(np.float64)
    if spacing == "leading":
        ratio = n_train // (steps + extra)
        t = (np.arange(0, steps + extra) * ratio).round()[::-1]
        return (t[:-1] if extra else t).astype(np.float64) + config.get("steps_offset", 0)
    if spacing == "trailing":
        return np.arange(n_train, 0, -n_train / steps).round().astype(np.float64) - 1
    raise ValueError(f"timestep_spacing {spacing!r} is not supported (linspace, leading, trailing)")


def _euler(config: dict, steps: int, karras: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
    """Euler's timesteps, sigmas (n + 1, last 0) and init_noise_sigma (EulerDiscreteScheduler.set_timesteps)."""
    all_sigmas = ((1 - alphas_cumprod(config)) / alphas_cumprod(config)) ** 0.5
    timesteps = _spaced(config, steps).astype(np.float32)
    sigmas = np.interp(timesteps, np.arange(len(all_sigmas)), all_sigmas)
    if karras or config.get("use_karras_sigmas"):
        sigmas = _karras(sigmas[-1], sigmas[0], steps)
        timesteps = _sigma_to_t(sigmas, np.log(all_sigmas)).astype(np.float32)
    sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
    spacing = config.get("timestep_spacing", "linspace")
    top = float(sigmas.max())
    return timesteps, sigmas, top if spacing in ("linspace", "trailing") else (top**2 + 1) ** 0.5


def _dpm(config: dict, steps: int, karras: bool) -> tuple[np.ndarray, np.ndarray]:
    """DPMSolverMultistepScheduler.set_timesteps: integer timesteps, sigmas (n + 1, last 0)."""
    all_sigmas = ((1 - alphas_cumprod(config)) / alphas_cumprod(config)) ** 0.5
    if karras:
        sigmas = _karras(all_sigmas[0], all_sigmas[-1], steps)
        timesteps = _sigma_to_t(sigmas, np.log(all_sigmas)).round()
    else:
        timesteps = _spaced(config, steps, extra=1)
        sigmas = np.interp(timesteps, np.arange(len(all_sigmas)), all_sigmas)
    return timesteps.astype(np.float32), np.concatenate([sigmas, [0.0]]).astype(np.float32)


def _ddim(config: dict, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """DDIMScheduler.set_timesteps and its step's alphas, in sigma space.

    Returns timesteps (n,), sigmas (n + 1: each step's, then the final one), and per step the
    sigma of its "previous timestep" (t - 1000 // n, or alphas_cumprod[0]'s past the start) and
    the factor sqrt(alphā_prev / alphā(next step's t)) that carries x from the one to the other
    (1 where they coincide, as with leading spacing).
    """
    ac = alphas_cumprod(config).astype(np.float64)
    n_train = len(ac)
    spacing = config.get("timestep_spacing", "leading")
    if spacing == "linspace":
        timesteps = np.linspace(0, n_train - 1, steps).round()[::-1]
    elif spacing == "leading":
        timesteps = (np.arange(0, steps) * (n_train // steps)).round()[::-1] + config.get("steps_offset", 0)
    elif spacing == "trailing":
        timesteps = np.round(np.arange(n_train, 0, -n_train / steps)) - 1
    else:
        raise ValueError(f"timestep_spacing {spacing!r} is not supported (linspace, leading, trailing)")
    timesteps = timesteps.astype(np.int64)
    final = 1.0 if config.get("set_alpha_to_one", True) else ac[0]
    prev = timesteps - n_train // steps
    alpha_prev = np.where(prev >= 0, ac[np.maximum(prev, 0)], final)
    alpha = ac[timesteps]
    to_sigma = lambda x: ((1 - x) / x) ** 0.5  # noqa: E731
    carry = np.ones(steps)
    carry[:-1] = np.sqrt(alpha_prev[:-1] / alpha[1:])
    return (timesteps.astype(np.float32), np.concatenate([to_sigma(alpha), [to_sigma(alpha_prev[-1])]]),
            to_sigma(alpha_prev), carry)


def make_schedule(sampler: str, config: dict, steps: int) -> Schedule:
    """The :class:`Schedule` of ``sampler`` (an A1111 name) for ``steps`` steps of a model's scheduler config.

    Args:
        config: scheduler_config.json fields (betas, timestep_spacing, steps_offset, prediction
            type is the program's business); ``use_karras_sigmas`` there applies to Euler too.
    Raises:
        UnknownSampler, ValueError: an unknown sampler, beta schedule or timestep spacing.
    """
    sampler = get_sampler(sampler)
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    zeros = np.zeros(steps, np.float64)
    if sampler in ("Euler", "Euler a"):
        timesteps, sigmas, init = _euler(config, steps)
        s, s_next = sigmas[:-1].astype(np.float64), sigmas[1:].astype(np.float64)
        if sampler == "Euler":
            a, d = s_next / s, zeros
        else:  # ancestral: go down to s_down deterministically, add noise of s_up (eta 1)
            up = np.sqrt(s_next**2 * (s**2 - s_next**2) / s**2)
            a, d = np.sqrt(s_next**2 - up**2) / s, up
        return _schedule(timesteps, sigmas, a, 1 - a, zeros, d, init, 1.0)
    if sampler == "DDIM":
        timesteps, sigmas, s_prev, carry = _ddim(config, steps)
        a = s_prev / sigmas[:-1]
        return _schedule(timesteps, sigmas, a * carry, (1 - a) * carry, zeros, zeros, (sigmas[0] ** 2 + 1) ** 0.5,
                         1 / (sigmas[-1] ** 2 + 1) ** 0.5)
    timesteps, sigmas = _dpm(config, steps, karras=sampler == "DPM++ 2M Karras")
    s, s_next = sigmas[:-1].astype(np.float64), sigmas[1:].astype(np.float64)
    a = s_next / s
    # Second order except the first step and the last (whose final sigma is 0: diffusers' lower_order_final).
    second = (np.arange(steps) > 0) & (np.arange(steps) < steps - 1)
    with np.errstate(divide="ignore", invalid="ignore"):  # r is only used where ``second`` holds
        r = np.concatenate([[np.nan], np.log(s[:-1]) - np.log(s[1:])]) / (np.log(s) - np.log(s_next))
        b = np.where(second, (1 - a) * (1 + 0.5 / r), 1 - a)
        c = np.where(second, -(1 - a) * 0.5 / r, 0.0)
    return _schedule(timesteps, sigmas, a, b, c, zeros, (sigmas[0] ** 2 + 1) ** 0.5, 1.0)  # x-space noise of variance 1


def _schedule(timesteps, sigmas, a, b, c, d, init, final) -> Schedule:
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return Schedule(f32(timesteps), f32(sigmas), f32(a), f32(b), f32(c), f32(d), float(init), float(final))
