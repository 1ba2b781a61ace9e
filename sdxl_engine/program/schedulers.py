"""Samplers as per-step coefficients, so one compiled program runs every sampler.

Each sampler is written in k-diffusion's sigma space (Karras et al. 2022): the latents are
x = x0 + sigma * noise, the UNet sees x / sqrt(sigma^2 + 1) at the scheduler's timestep, and its
output gives the denoised x0 (epsilon: x - sigma * eps; v: x / (sigma^2 + 1) - sigma * v /
sqrt(sigma^2 + 1); sample: the output itself). Every sampler here is then one update of the same
form::

    x_{i+1} = a_i x_i + b_i x0_i + c_i h_{i-1} + c2_i h_{i-2} + c3_i h_{i-3} + d_i z_i + e_i (clip(x0_i) - x0_i)

(z_i ~ N(0, 1), Euler a, DPM2 a, the SDEs, LCM and TCD only; clip to [-clip_range, clip_range], DDIM's and LCM's
``clip_sample`` only) with a..e computed on the host for the step count. h_j = hx_j x_j + hx0_j x0_j is the history
entry step j leaves: x0_j itself (hx 0, hx0 1) for every sampler but LMS, whose entry is its derivative
(x_j - x0_j) / sigma_j (hx 1/s, hx0 -1/s); c2, the entry of two steps back, is DPM++ 3M SDE's third order, UniPC's
corrector and LMS's only, c3 (three back) LMS's fourth order only. The program takes them as arrays, so
changing the sampler, like the step count, compiles nothing. The numbers are diffusers'
PyTorch schedulers' (``from_config`` of the model's scheduler config, diffusers 0.42.1):

================  =====================================================================================
A1111 name        diffusers class and update
================  =====================================================================================
Euler             EulerDiscreteScheduler: a = s'/s, b = 1 - a (Karras et al. 2022, Alg. 2)
Euler a           EulerAncestralDiscreteScheduler: s_up = sqrt(s'^2 (s^2 - s'^2) / s^2),
                  s_down = sqrt(s'^2 - s_up^2); a = s_down/s, b = 1 - a, d = s_up (a request's eta:
                  k-diffusion's get_ancestral_step, s_up = min(s', eta sqrt(...)))
DPM++ 2M          DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2): with
                  h = log s - log s', r = h_prev / h, midpoint: b = (1 - a)(1 + 1/2r), c = -(1 - a)/2r;
                  heun: k = (a - 1)/h + 1, b = 1 - a + k/r, c = -k/r; first step first order, and
                  the last one as lower_order_final / euler_at_final / final_sigmas_type say
                  (Lu et al. 2022, DPM-Solver++ 2M)
DPM++ 2M Karras   the same with use_karras_sigmas=True (Karras et al. 2022, eq. 5, rho 7)
DPM++ 2M SDE      the same class with algorithm_type="sde-dpmsolver++" (Lu et al. 2022, DPM-Solver++'s SDE form;
                  k-diffusion's sample_dpmpp_2m_sde, eta 1): a = (s'/s)^2, b and c as DPM++ 2M's with that a
                  (heun: k = (a - 1)/2h + 1), d = s' sqrt(1 - a): fresh noise every step
DPM++ 3M SDE      the same class with solver_order=3 (k-diffusion's sample_dpmpp_3m_sde, eta 1): DPM++ 2M
                  SDE's first and second order steps, then with r0 = h_{i-1}/h, r1 = h_{i-2}/h,
                  D1_0 = (x0_i - x0_{i-1})/r0, D1_1 = (x0_{i-1} - x0_{i-2})/r1,
                  D1 = D1_0 + r0 (D1_0 - D1_1)/(r0 + r1), D2 = (D1_0 - D1_1)/(r0 + r1):
                  x0 terms (1 - a) x0_i + k D1 + ((1 - a - 2h)/4h^2 + 1/2) D2, k = (a - 1)/2h + 1. The
                  D2 coefficient is k-diffusion's -phi_3 (the exact integral of the quadratic term);
                  diffusers 0.42.1 has - 1/2 there (a sign slip: its coefficient tends to -1, not 0,
                  as h -> 0), the one place the engine leaves diffusers (tests/program)
UniPC             UniPCMultistepScheduler (Zhao et al. 2023; bh2 or bh1, solver_order 2, predict_x0): the
                  predictor UniP-2 from the corrected x_i^c, x_{i+1} = a x_i^c - B(h) ... (module
                  :func:`_unipc_coefficients`), and the corrector UniC that makes x_i^c from x_i with the
                  new x0_i: x_i^c - x_i is a combination of x0_i, x0_{i-1}, x0_{i-2} (both start from
                  the same x_{i-1}^c), so the two fold into one update on the uncorrected x_i, the one
                  the UNet sees, as in diffusers
DDIM              DDIMScheduler, eta 0: deterministic, first order in sigma space (Song et al. 2021; a request's
                  eta: step(eta=...)'s std in sigma space, d = eta sqrt(s_p^2 (s^2 - s_p^2) / s^2) to the
                  previous timestep's s_p, a = sqrt(s_p^2 - d^2)/s, both times ``carry``);
                  its last sigma is the final alpha's; with clip_sample the x0 it moves towards
                  is clipped, the direction to x_t is not: e = 1 (times ``carry``)
LCM               LCMScheduler (Luo et al. 2023): the boundary-condition scalings c_skip, c_out of the
                  timestep (``timestep_scaling``), its ``denoised = c_out x0 + c_skip x / sqrt(s^2 + 1)``
                  then fresh noise to s' (none on the last step): a = c_skip / sqrt(s^2 + 1),
                  b = c_out, d = s' (0 last), with clip_sample e = c_out; timesteps from
                  ``original_inference_steps`` (``timestep_spacing`` unused, as in diffusers)
TCD               TCDScheduler (Zheng et al. 2024, Trajectory Consistency Distillation), gamma (its step's
                  ``eta``) :data:`TCD_GAMMA` or a request's eta: from t, DDIM to s = floor((1 - gamma) t') then
                  fresh noise back to the next timestep t': a = s_s / s_t, b = 1 - a, d = sqrt(s_t'^2 - s_s^2)
                  (:func:`_tcd_schedule`); LCM's timestep grid; ends at timestep 0's sigma
LMS               LMSDiscreteScheduler (``step(order=4)``, k-diffusion's sample_lms): linear multistep on the
                  derivatives d_j = (x_j - x0_j)/s_j, x' = x + sum_k L_k d_{i-k}, k < min(i + 1, 4), L_k the
                  integral over [s, s'] of the Lagrange basis polynomial of sigma_{i-k} on sigma_i ..
                  sigma_{i-order+1} (:func:`_lms_coefficients`): a = 1 + L_0/s, b = -L_0/s, c, c2, c3 = L_1..L_3
================  =====================================================================================

Heun, DPM2, DPM++ SDE and DPM2 a (:data:`TWO_CALLS`: diffusers' HeunDiscreteScheduler, KDPM2DiscreteScheduler,
DPMSolverSDEScheduler, KDPM2AncestralDiscreteScheduler; k-diffusion's sample_heun, sample_dpm_2, sample_dpmpp_sde,
sample_dpm_2_ancestral) call the model twice per step: their
schedules add a :class:`SecondCall` (the second call's input x_mid = mid_a x_i + mid_b x0_i + mid_d z_i at a mid sigma,
and f (x_mid - x0_mid) + g x0_mid + d2 w_i in the update), which the program runs as its own shape
(ProgramShape.two_calls; :func:`_two_call_schedule` has the formulas and DPM++ SDE's noise: per-step normals with a
Brownian tree's law, not a Brownian tree).

Restart (A1111's ``modules/sd_samplers_extra.py`` ``restart_sampler``; Xu et al. 2023, "Restart Sampling for
Improving Generative Processes") has no diffusers class: it is Heun steps on a list of (sigma, sigma') pairs that A1111
builds from the step count (:func:`restart_steps`: from 20 steps, a Karras main list with a stretch near sigma 0.1 run
again from sigma 2, once or, from 36 steps, twice), and before a step that starts above where the last one ended,
fresh noise x += sqrt(s^2 - s_prev'^2) z. The engine runs that flat list as Heun steps (:data:`TWO_CALLS`' program)
with the noise folded into the step before the jump (its ``d``: the noise comes after that step's update), so a step
count of n is n steps (2n - 1 model calls), as in A1111 (:func:`_restart_schedule`).

(s = sigma_i, s' = sigma_{i+1}.) DDIM, DPM++ and LCM work in diffusers on x / sqrt(sigma^2 + 1) (the
"x-space"); the same update in sigma space starts from noise * sqrt(sigma_0^2 + 1) and ends by
dividing by sqrt(sigma_n^2 + 1): :attr:`Schedule.init_scale` and :attr:`Schedule.final_scale`
(LCM's last step returns its ``denoised``, sigma_n = 0: final scale 1).

Each sampler's config is diffusers' ``from_config``: the model's scheduler_config.json, a field
missing there taking the class's own default (:data:`CLASS_DEFAULTS`; DDIM's ``clip_sample`` is
True, ``set_alpha_to_one`` True, ``timestep_spacing`` "leading"), then the fields the A1111 name
fixes (:data:`SAMPLER_CLASSES`). Every field of every class is either honoured as diffusers does
or refused by :func:`check_scheduler_config` (:data:`FIELDS` says which); none is ignored.

Euler a's, DPM2 a's, the DPM++ SDEs', LCM's, TCD's and Restart's (its jumps') step noise for image i of a request is
``jax.random.normal(jax.random.fold_in(jax.random.key(seed_i), step + 1), latents.shape)``: deterministic per seed
(program.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import numpy as np

# The sampler names (A1111's) live in config.py, the lowest layer, which checks the configured one at load.
from sdxl_engine.config import DEFAULT_SAMPLER, SAMPLERS, UnknownSampler, get_sampler  # noqa: F401 (re-exported)

# A1111 name -> (diffusers class, the from_config overrides the name stands for).
SAMPLER_CLASSES = {
    "Euler": ("EulerDiscreteScheduler", {}),
    "Euler a": ("EulerAncestralDiscreteScheduler", {}),
    "DPM++ 2M": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "DPM++ 2M Karras": ("DPMSolverMultistepScheduler",
                        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True}),
    "DPM++ 2M SDE": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}),
    "DPM++ 3M SDE": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "solver_order": 3}),
    "UniPC": ("UniPCMultistepScheduler", {"solver_order": 2, "predict_x0": True}),
    "DDIM": ("DDIMScheduler", {}),
    "LCM": ("LCMScheduler", {}),
    "Heun": ("HeunDiscreteScheduler", {}),
    "DPM2": ("KDPM2DiscreteScheduler", {}),
    "DPM++ SDE": ("DPMSolverSDEScheduler", {}),
    "TCD": ("TCDScheduler", {}),
    "DPM2 a": ("KDPM2AncestralDiscreteScheduler", {}),
    "LMS": ("LMSDiscreteScheduler", {}),
    # No diffusers class: A1111's restart_sampler (k-diffusion's Heun steps). The model's training sigmas come from
    # the config as HeunDiscreteScheduler reads it (its fields, refusals and defaults); its sigmas are A1111's.
    "Restart": ("HeunDiscreteScheduler", {}),
}
# The samplers whose step calls the model twice (k-diffusion's sample_heun, sample_dpm_2, sample_dpmpp_sde,
# sample_dpm_2_ancestral; A1111's restart_sampler, Heun steps): their schedules carry a :class:`SecondCall` and their
# programs ProgramShape.two_calls.
TWO_CALLS = ("Heun", "DPM2", "DPM++ SDE", "DPM2 a", "Restart")
# Restart's rule (A1111's restart_sampler with restart_list None): from RESTART_MIN_STEPS steps, a stretch of
# RESTART_STEPS steps (steps // 4 from RESTART_TWICE_STEPS steps, then run twice) from the main list's sigma nearest
# RESTART_MAX back down to its sigma nearest RESTART_MIN.
RESTART_MIN_STEPS, RESTART_TWICE_STEPS, RESTART_STEPS = 20, 36, 9
RESTART_MIN, RESTART_MAX = 0.1, 2.0

_COMMON = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
               trained_betas=None, prediction_type="epsilon", timestep_spacing="linspace", steps_offset=0,
               rescale_betas_zero_snr=False)
_SIGMA_KINDS = dict(use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False)
# Every __init__ argument of each class with its default, diffusers 0.42.1 (tests/program/test_schedulers.py checks
# this against the signatures the fixture tool recorded).
CLASS_DEFAULTS = {
    "EulerDiscreteScheduler": {**_COMMON, "interpolation_type": "linear", **_SIGMA_KINDS, "sigma_min": None,
                               "sigma_max": None, "timestep_type": "discrete", "final_sigmas_type": "zero"},
    "EulerAncestralDiscreteScheduler": dict(_COMMON),
    "DPMSolverMultistepScheduler": {
        **_COMMON, "solver_order": 2, "thresholding": False, "dynamic_thresholding_ratio": 0.995,
        "sample_max_value": 1.0, "algorithm_type": "dpmsolver++", "solver_type": "midpoint",
        "lower_order_final": True, "euler_at_final": False, **_SIGMA_KINDS, "use_lu_lambdas": False,
        "use_flow_sigmas": False, "flow_shift": 1.0, "final_sigmas_type": "zero", "lambda_min_clipped": -math.inf,
        "variance_type": None, "use_dynamic_shifting": False, "time_shift_type": "exponential"},
    "UniPCMultistepScheduler": {
        **_COMMON, "solver_order": 2, "thresholding": False, "dynamic_thresholding_ratio": 0.995,
        "sample_max_value": 1.0, "predict_x0": True, "solver_type": "bh2", "lower_order_final": True,
        "disable_corrector": [], "solver_p": None, **_SIGMA_KINDS, "use_flow_sigmas": False, "flow_shift": 1.0,
        "final_sigmas_type": "zero", "use_dynamic_shifting": False,
        "time_shift_type": "exponential", "sigma_min": None, "sigma_max": None, "shift_terminal": None},
    "DDIMScheduler": {**_COMMON, "clip_sample": True, "set_alpha_to_one": True, "thresholding": False,
                      "dynamic_thresholding_ratio": 0.995, "clip_sample_range": 1.0, "sample_max_value": 1.0,
                      "timestep_spacing": "leading"},
    "LCMScheduler": {**_COMMON, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
                     "original_inference_steps": 50, "clip_sample": False, "clip_sample_range": 1.0,
                     "set_alpha_to_one": True, "thresholding": False, "dynamic_thresholding_ratio": 0.995,
                     "sample_max_value": 1.0, "timestep_spacing": "leading", "timestep_scaling": 10.0},
    "TCDScheduler": {**_COMMON, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
                     "original_inference_steps": 50, "clip_sample": False, "clip_sample_range": 1.0,
                     "set_alpha_to_one": True, "thresholding": False, "dynamic_thresholding_ratio": 0.995,
                     "sample_max_value": 1.0, "timestep_spacing": "leading", "timestep_scaling": 10.0},
    **{cls: {**{k: v for k, v in _COMMON.items() if k != "rescale_betas_zero_snr"}, "beta_start": 0.00085,
             "beta_end": 0.012, **_SIGMA_KINDS, **extra}
       for cls, extra in (("HeunDiscreteScheduler", {"clip_sample": False, "clip_sample_range": 1.0}),
                          ("KDPM2DiscreteScheduler", {}),
                          ("DPMSolverSDEScheduler", {"noise_sampler_seed": None}),
                          ("KDPM2AncestralDiscreteScheduler", {}))},
    "LMSDiscreteScheduler": {**{k: v for k, v in _COMMON.items() if k != "rescale_betas_zero_snr"}, **_SIGMA_KINDS},
}
# LMS's order (diffusers' pipelines call LMSDiscreteScheduler.step with its default order=4; A1111's LMS is
# k-diffusion's sample_lms, order=4): how many derivatives its step combines once the history holds them.
LMS_ORDER = 4

# What happens to each field (README's samplers table says the same). "honoured": as diffusers uses it;
# "fixed": set by the sampler's name; "refused": values other than the default stop the model at start;
# "unused": diffusers reads it only together with a refused value (thresholding).
FIELDS = {
    "num_train_timesteps": "honoured", "beta_start": "honoured", "beta_end": "honoured",
    "beta_schedule": "honoured: linear, scaled_linear, squaredcos_cap_v2", "trained_betas": "honoured",
    "prediction_type": "honoured: epsilon, v_prediction, sample (not with Euler a, DPM2, DPM++ SDE, DPM2 a, as in "
                       "diffusers)",
    "timestep_spacing": "honoured: linspace, leading, trailing (LCM, TCD: unused, as in diffusers; Restart: its "
                        "automatic sigmas are Karras, A1111's, so only a spacing schedule type reads it)",
    "steps_offset": "honoured (leading; LCM, TCD: unused, as in diffusers)",
    "rescale_betas_zero_snr": "honoured for Euler, Euler a, DPM++; DDIM, LCM and TCD refused per request for such a "
                              "model; unused by Heun, DPM2, DPM++ SDE, DPM2 a, LMS, Restart (their classes have no "
                              "such field: as in diffusers, their sigmas are the unrescaled betas')",
    "interpolation_type": "honoured: linear, log_linear", "use_karras_sigmas": "honoured",
    "use_exponential_sigmas": "honoured", "use_beta_sigmas": "refused", "sigma_min": "honoured",
    "sigma_max": "honoured", "timestep_type": "honoured: discrete, continuous",
    "final_sigmas_type": "honoured: zero, sigma_min (UniPC refused per request with karras or exponential sigmas, "
                         "where diffusers repeats the last sigma: a step of h = 0)",
    "solver_order": "fixed: 2 (DPM++ 3M SDE: 3)",
    "algorithm_type": "fixed: dpmsolver++ (DPM++ 2M), sde-dpmsolver++ (DPM++ 2M SDE, DPM++ 3M SDE)",
    "solver_type": "honoured: midpoint, heun (DPM++); bh1, bh2 (UniPC; midpoint, heun, logrho are bh2 there, as in "
                   "diffusers)",
    "predict_x0": "fixed: True (UniPC)", "disable_corrector": "honoured (UniPC)", "solver_p": "refused (UniPC)",
    "shift_terminal": "unused (use_flow_sigmas)",
    "lower_order_final": "honoured (UniPC refused per request: False with a final sigma of 0)",
    "euler_at_final": "honoured",
    "use_lu_lambdas": "refused", "use_flow_sigmas": "refused", "flow_shift": "unused (use_flow_sigmas)",
    "lambda_min_clipped": "honoured", "variance_type": "refused", "use_dynamic_shifting": "refused",
    "time_shift_type": "unused (use_dynamic_shifting)",
    "thresholding": "refused (TCD: unused, its step reads none; the other samplers refuse it at load)",
    "dynamic_thresholding_ratio": "unused (thresholding)", "sample_max_value": "unused (thresholding)",
    "clip_sample": "honoured (Heun: both calls' x0; TCD: unused, its step clips nothing, as in diffusers; Restart: "
                   "unused, A1111's clips nothing)",
    "clip_sample_range": "honoured",
    "noise_sampler_seed": "unused (DPM++ SDE: the step noise is the engine's, per image seed)",
    "set_alpha_to_one": "honoured (DDIM; LCM, TCD: unused, their previous timestep is never negative)",
    "original_inference_steps": "honoured (LCM, TCD: their timesteps, and the most steps they run)",
    # Not a diffusers field: a few-step model's ``pipe(..., timesteps=[...])`` (checkpoint/recipes.py), kept with its
    # scheduler config because it describes the model (the Hyper-SDXL 1-step UNet's [800]).
    "custom_timesteps": "honoured by LCM and TCD with the automatic schedule type at exactly that many steps, as "
                        "diffusers' set_timesteps(timesteps=...); unused by the other samplers and step counts",
    "timestep_scaling": "honoured (LCM; TCD: unused, as in diffusers: its step has no boundary scalings)",
}


class UnsupportedSchedulerConfig(ValueError):
    """A scheduler config field whose value the engine does not implement (the message names it)."""


class TooManySteps(ValueError):
    """More steps than a sampler can take for the model (LCM: ``original_inference_steps``); the message says
    how many it can."""


# Schedule types (A1111 1.9+'s ``scheduler``, its UI's "Schedule type"): name -> A1111's label, as its
# modules/sd_schedulers.py lists them (the ones this engine implements). "automatic" is each sampler's own spacing
# (diffusers' class from the model's config: what the engine did before schedule types). The others replace the
# sampler's sigmas by A1111's (:func:`schedule_sigmas`); the sampler's update stays its own.
SCHEDULE_TYPES = {"automatic": "Automatic", "uniform": "Uniform", "karras": "Karras", "exponential": "Exponential",
                  "sgm_uniform": "SGM Uniform", "simple": "Simple", "beta": "Beta", "leading": "Leading",
                  "linspace": "Linspace", "trailing": "Trailing"}
# diffusers' ``timestep_spacing`` as a schedule type (not A1111's: it has none of these), per request: the sampler's
# own class with that spacing in place of the model's (what the few-step LoRAs' model cards set with
# ``from_config(..., timestep_spacing="trailing")``). DDIM takes them too (diffusers' DDIMScheduler spaces by it); LCM
# and TCD, which read no spacing, take "trailing" as custom timesteps (diffusers' ``set_timesteps(timesteps=...)``):
# round(arange(T, 0, -T/n)) - 1, DMD2's [999, 749, 499, 249] at 4 steps.
SPACING_TYPES = ("leading", "linspace", "trailing")
SCHEDULE_ALIASES = {"sgmuniform": "sgm_uniform"}  # A1111's aliases (lower-cased)
DEFAULT_SCHEDULE_TYPE = "automatic"
# Samplers whose own timesteps A1111 does not replace (its DDIM is a timesteps sampler, sd_samplers_timesteps.py,
# which reads no scheduler; LCM's and TCD's timesteps are their distillation's, ``original_inference_steps``).
OWN_TIMESTEPS = ("DDIM", "LCM", "TCD")
# TCD's gamma (diffusers' ``TCDScheduler.step(eta=...)``, the paper's gamma; its default there and the TCD card's value;
# note that diffusers' SDXL pipeline passes its own ``eta``, default 0, unless told): TCD's default; a request's eta
# (:data:`ETA_DEFAULTS`) sets another (at one step gamma changes nothing: the last step goes to timestep 0 whatever
# gamma).
TCD_GAMMA = 0.3
# The samplers a request's ``eta`` (A1111's, GenerateRequest.eta) changes, with the value they run without one: A1111's
# eta_ancestral 1 for the k-diffusion functions that take an ``eta`` (sample_euler_ancestral, sample_dpm_2_ancestral,
# sample_dpmpp_sde, sample_dpmpp_2m_sde, sample_dpmpp_3m_sde), its eta_ddim 0 for DDIM (diffusers' DDIMScheduler.step
# default too), TCD's gamma :data:`TCD_GAMMA` (TCDScheduler.step's ``eta``). The other samplers take none (A1111's
# functions have no ``eta``): a request's eta changes nothing for them, as in A1111. 0 <= eta <= 1 (A1111's sliders).
ETA_DEFAULTS = {"Euler a": 1.0, "DPM2 a": 1.0, "DPM++ SDE": 1.0, "DPM++ 2M SDE": 1.0, "DPM++ 3M SDE": 1.0, "DDIM": 0.0,
                "TCD": TCD_GAMMA}
BETA_ALPHA = BETA_BETA = 0.6  # A1111's beta_dist_alpha / beta_dist_beta defaults (shared_options.py)


def split_sampler_name(name) -> tuple[str, str | None]:
    """(sampler, schedule type name or None) of a sampler name that may carry a schedule type after it, as A1111's
    older combined names do ("DPM++ SDE Karras", "Euler a Karras", "DPM2 a Exponential"): ``name`` itself when it
    is a sampler (:func:`get_sampler`; "DPM++ 2M Karras" is one here), else, when it ends in a space and a schedule
    type's label, name or alias (:data:`SCHEDULE_TYPES`, :data:`SCHEDULE_ALIASES`) and what comes before is a
    sampler, the two (A1111's ``sd_samplers.get_sampler_and_scheduler`` splits them so). Case-insensitive.

    Raises UnknownSampler (the message names ``name`` as given) for anything else.
    """
    try:
        return get_sampler(name), None
    except UnknownSampler:
        if not isinstance(name, str):
            raise
        head = " ".join(name.split())
        for key, label in SCHEDULE_TYPES.items():
            for option in dict.fromkeys((label, key, *(a for a, k in SCHEDULE_ALIASES.items() if k == key))):
                if head.lower().endswith(" " + option.lower()):
                    try:
                        return get_sampler(head[: -len(option) - 1]), key
                    except UnknownSampler:
                        pass
        raise


class UnknownScheduleType(ValueError):
    """A schedule type name that is none of :data:`SCHEDULE_TYPES` (names, labels or aliases)."""


class UnsupportedScheduleType(ValueError):
    """A schedule type a sampler does not take (:data:`OWN_TIMESTEPS`, or the Karras sampler with another)."""


def get_schedule_type(name) -> str:
    """The schedule type's name (:data:`SCHEDULE_TYPES` key) for ``name``: a name, an A1111 label ("SGM Uniform")
    or alias ("SGMUniform"), case-insensitive; None or "" = "automatic".

    Raises UnknownScheduleType listing the names.
    """
    if name is None or name == "":
        return DEFAULT_SCHEDULE_TYPE
    if isinstance(name, str):
        wanted = " ".join(name.split()).lower()
        for key, label in SCHEDULE_TYPES.items():
            if wanted in (key, label.lower()):
                return key
        if wanted in SCHEDULE_ALIASES:
            return SCHEDULE_ALIASES[wanted]
    raise UnknownScheduleType(f"unknown schedule type {str(name)[:40]!r}; choose one of {', '.join(SCHEDULE_TYPES)}")


def schedule_sigmas(schedule_type: str, training_sigmas: np.ndarray, steps: int) -> np.ndarray:
    """(steps,) float64 sigmas, largest first, of an A1111 schedule type (without the final 0 A1111 appends).

    Args:
        schedule_type: a :data:`SCHEDULE_TYPES` name other than "automatic" and the :data:`SPACING_TYPES`.
        training_sigmas: (num_train_timesteps,) the model's sigmas, sqrt((1 - alphā_t) / alphā_t), smallest first
            (k-diffusion's ``DiscreteSchedule.sigmas``); A1111's sigma_min / sigma_max are its first and last.
        steps: >= 1.

    The formulas (A1111 modules/sd_schedulers.py, k-diffusion k_diffusion/sampling.py and external.py):
        uniform: ``DiscreteSchedule.get_sigmas(n)``, sigma(t) at t = linspace(T - 1, 0, n), log-linear in t;
        karras: ``get_sigmas_karras`` (Karras et al. 2022, eq. 5, rho 7);
        exponential: ``get_sigmas_exponential``, evenly spaced in log sigma;
        sgm_uniform: ``sgm_uniform``, sigma(t) at t = linspace(T - 1, 0, n + 1)[:-1];
        simple: ``simple_scheduler``, every (T / n)-th training sigma from the top;
        beta: ``beta_scheduler`` (Lee et al. 2024, arXiv:2407.12173): sigma_min + ppf(1 - linspace(0, 1, n)) x
        (sigma_max - sigma_min), ppf the Beta(0.6, 0.6) quantile (A1111's defaults).

    Raises UnknownScheduleType for another name (automatic included: it has no sigmas of its own).
    """
    sigmas = np.asarray(training_sigmas, np.float64)
    lo, hi, top = float(sigmas[0]), float(sigmas[-1]), len(sigmas) - 1
    if schedule_type == "uniform":
        return _t_to_sigma(np.linspace(top, 0, steps), sigmas)
    if schedule_type == "karras":
        return _karras(lo, hi, steps)
    if schedule_type == "exponential":
        return np.exp(np.linspace(math.log(hi), math.log(lo), steps))
    if schedule_type == "sgm_uniform":
        return _t_to_sigma(np.linspace(top, 0, steps + 1)[:-1], sigmas)
    if schedule_type == "simple":
        stride = len(sigmas) / steps
        return np.array([sigmas[-(1 + int(x * stride))] for x in range(steps)])
    if schedule_type == "beta":
        from scipy.special import betaincinv  # scipy.stats.beta.ppf's own function; scipy comes with jax

        quantiles = betaincinv(BETA_ALPHA, BETA_BETA, 1 - np.linspace(0, 1, steps))
        return lo + quantiles * (hi - lo)
    raise UnknownScheduleType(f"schedule type {schedule_type!r} has no sigmas of its own; choose one of "
                              f"{', '.join(k for k in SCHEDULE_TYPES if k != DEFAULT_SCHEDULE_TYPE)}")


def _t_to_sigma(t: np.ndarray, sigmas: np.ndarray) -> np.ndarray:
    """k-diffusion's ``DiscreteSchedule.t_to_sigma``: log sigma interpolated linearly between whole timesteps."""
    low, high, w = np.floor(t).astype(np.int64), np.ceil(t).astype(np.int64), t - np.floor(t)
    log_sigmas = np.log(sigmas)
    return np.exp((1 - w) * log_sigmas[low] + w * log_sigmas[high])


@dataclasses.dataclass(frozen=True)
class SecondCall:
    """The second model call of a two-call sampler's step (:data:`TWO_CALLS`), float32 (n,) each, ``n`` = steps::

        x_mid = mid_a x_i + mid_b x0_i + mid_d z_i          (the second call's input, at mid_sigmas, mid_timesteps)
        x_{i+1} = (the one-call update) + f (x_mid - x0_mid) + g x0_mid + d2 w_i

    x0_mid the model's x0 at x_mid; z_i the step noise (the one-call update's, with its coefficient ``d``), w_i a
    second normal draw of the step (DPM++ SDE alone). ``f`` multiplies the difference (mid sigma times the model's
    noise estimate), not x_mid and x0_mid one by one: from a large sigma (a cosine or zero-SNR schedule's first step)
    f is in the thousands, and two such products would cancel to a few float32 units. Where ``f`` and ``g`` are 0 (a
    step to sigma 0, the last, which k-diffusion and diffusers take as an Euler step) the program skips the call.
    """

    timesteps: np.ndarray
    sigmas: np.ndarray
    a: np.ndarray
    b: np.ndarray
    d: np.ndarray
    f: np.ndarray
    g: np.ndarray
    d2: np.ndarray


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One sampler at one step count: what the program needs, float32, ``n`` = steps.

    Attributes:
        timesteps: (n,) what the UNet is given at each step.
        sigmas: (n + 1,) noise levels in sigma space; sigmas[n] is the last step's target (0, or
            the smallest sigma: final_sigmas_type "sigma_min", DDIM's final alpha).
        a, b, c, c2, d, e: (n,) the update's coefficients (module docstring).
        init_scale: initial latents = unit noise * init_scale (diffusers' init_noise_sigma,
            in sigma space).
        final_scale: the latents handed to the VAE = x_n * final_scale.
        clip_range: x0 is clipped to [-clip_range, clip_range] where ``e`` is non-zero (inf: never).
        restarts: the steps where the multistep history starts afresh (:meth:`restarting_at`); () = step 0 only.
        history: for a multistep sampler (DPM++, UniPC, LMS), ``restarts -> (a, b, c, c2, d)`` (LMS: ``(a, b, c,
            c2, d, c3)``) float64 (n,) each, the coefficients with the history restarting at those steps; None for
            the others, whose update reads no earlier step.
        second: a two-call sampler's second model call per step (:class:`SecondCall`); None for the one-call ones.
        c3: (n,) the update's coefficient of the history entry three steps back (LMS's fourth order); None = 0.
        hx, hx0: (n,) each step's history entry h_i = hx x_i + hx0 x0_i (module docstring); None = x0_i itself
            (hx 0, hx0 1), every sampler but LMS.
    """

    timesteps: np.ndarray
    sigmas: np.ndarray
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    c2: np.ndarray
    d: np.ndarray
    e: np.ndarray
    init_scale: float
    final_scale: float
    clip_range: float = math.inf
    restarts: tuple[int, ...] = ()
    history: Callable[[tuple[int, ...]], tuple[np.ndarray, ...]] | None = dataclasses.field(
        default=None, compare=False, repr=False)
    second: SecondCall | None = dataclasses.field(default=None, compare=False, repr=False)
    c3: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    hx: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    hx0: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def two_calls(self) -> bool:
        """Whether each step calls the model twice (ProgramShape.two_calls: its own program)."""
        return self.second is not None

    def starting_at(self, start: int) -> Schedule:
        """This schedule for a run that begins at step ``start`` (img2img): the steps before it are skipped,
        and step ``start`` has no previous x0, so a multistep sampler starts afresh there (:meth:`restarting_at`),
        as diffusers' ``DPMSolverMultistepScheduler`` and ``UniPCMultistepScheduler`` do after ``set_begin_index``
        (``lower_order_nums`` 0, UniPC no ``last_sample``): DPM++ 2M's step ``start`` first order (``b + c``,
        ``c = 0``), DPM++ 3M SDE's two steps from it first and second order, UniPC's first step without its
        corrector. The other samplers are unchanged. ``start`` 0: this schedule.

        Raises ValueError for ``start`` outside 0 .. steps - 1.
        """
        n = len(self.timesteps)
        if not 0 <= start < n:
            raise ValueError(f"start step must be 0 to {n - 1}, got {start}")
        return self if start == 0 else self.restarting_at(start)

    def restarting_at(self, step: int) -> Schedule:
        """This schedule with its multistep history restarting at ``step`` too (img2img's first step, the refiner's
        switch: diffusers runs a fresh scheduler there), the earlier restarts kept: the steps from ``step`` on take
        the orders a fresh scheduler takes (first order, then the higher ones as x0s accumulate). Samplers without
        a history (Euler, Euler a, DDIM, LCM, TCD, the two-call samplers) and ``step`` 0 return this schedule."""
        if self.history is None or step <= 0 or step in self.restarts:
            return self
        restarts = tuple(sorted({*self.restarts, int(step)}))
        a, b, c, c2, d, *c3 = (np.asarray(x, np.float32) for x in self.history(restarts))
        return dataclasses.replace(self, a=a, b=b, c=c, c2=c2, d=d, restarts=restarts, **({"c3": c3[0]} if c3 else {}))

    def padded(self, max_steps: int) -> dict[str, np.ndarray]:
        """Arrays padded with zeros to ``max_steps`` (sigmas to ``max_steps + 1``), for one program shape; ``c3``,
        ``hx``, ``hx0`` always (0, 0, 1 where None: the history entry is x0)."""
        def pad(x, n):
            out = np.zeros(n, np.float32)
            out[: len(x)] = x
            return out

        n, steps = max_steps, len(self.timesteps)
        out = {"timesteps": pad(self.timesteps, n), "sigmas": pad(self.sigmas, n + 1), "a": pad(self.a, n),
               "b": pad(self.b, n), "c": pad(self.c, n), "c2": pad(self.c2, n), "d": pad(self.d, n),
               "e": pad(self.e, n), "c3": pad(np.zeros(steps) if self.c3 is None else self.c3, n),
               "hx": pad(np.zeros(steps) if self.hx is None else self.hx, n),
               "hx0": pad(np.ones(steps) if self.hx0 is None else self.hx0, n)}
        if self.second is not None:  # ProgramInputs' mid_* fields, and f, g, d2
            mid = ("timesteps", "sigmas", "a", "b", "d")
            out.update({("mid_" + f.name if f.name in mid else f.name): pad(getattr(self.second, f.name), n)
                        for f in dataclasses.fields(SecondCall)})
        return out


def img2img_start(steps: int, strength: float) -> int:
    """The first step an img2img request of ``steps`` steps at ``strength`` (0, 1] runs: diffusers'
    ``StableDiffusionXLImg2ImgPipeline.get_timesteps`` without ``denoising_start``, whose schedule is
    the full ``steps``-step one and whose loop runs its last ``int(steps * strength)`` steps:
    ``steps - min(int(steps * strength), steps)``. Strength 1 starts at 0 (all steps, from the image
    noised to the first sigma); 0.5 of 20 steps at 10.

    Raises ValueError when that runs no step (``int(steps * strength)`` is 0; diffusers fails then too).
    """
    run = min(int(steps * strength), steps)
    if run < 1:
        raise ValueError(f"strength {strength:g} of {steps} steps runs int({steps} x {strength:g}) = 0 steps; "
                         f"use a strength of at least {1 / steps:.3g} or more steps")
    return steps - run


def refiner_start(timesteps, switch_at: float, num_train_timesteps: int = 1000) -> int:
    """The first step the refiner runs (diffusers' ensemble of experts, switch point ``switch_at`` in [0, 1)): the
    base runs the steps whose timestep is at least ``round(T - switch_at x T)`` (T = ``num_train_timesteps``),
    ``StableDiffusionXLPipeline.__call__`` with ``denoising_end``, and the refiner the rest,
    ``StableDiffusionXLImg2ImgPipeline.get_timesteps`` with ``denoising_start`` (timesteps ``< cutoff``). So the
    first step whose timestep is below the cutoff (the count of timesteps ``>= cutoff`` where timesteps fall; Restart's
    jump back up after it, and the refiner runs those steps too, as A1111 switches at a step): 0 = the refiner runs
    every step, ``len(timesteps)`` = none.

    Args:
        timesteps: (steps,) the schedule's timesteps, falling (:attr:`Schedule.timesteps`).
    ``switch_at`` 0: every step (no timestep reaches T), the refiner alone.

    Raises ValueError for ``switch_at`` outside [0, 1).
    """
    if not 0 <= switch_at < 1:
        raise ValueError(f"switch_at must be at least 0 and below 1, got {switch_at!r}")
    cutoff = int(round(num_train_timesteps - (switch_at * num_train_timesteps)))  # diffusers' expression, as written
    below = np.flatnonzero(np.asarray(timesteps, np.float64) < cutoff)
    return int(below[0]) if len(below) else len(timesteps)


def hires_schedule(steps: int, hires_steps: int, strength: float) -> tuple[int, int]:
    """(schedule length, first step that runs) of hires fix's second pass, whose first pass ran ``steps`` steps.

    ``hires_steps`` > 0: AUTOMATIC1111's rule for an explicit step count (``sd_samplers_common.setup_img2img_steps``
    with ``steps`` given, which ``sample_hr_pass`` always gives): a schedule of ``int(hires_steps / min(strength,
    0.999))`` steps of which the last ``hires_steps`` run (k-diffusion's ``sigmas[steps - t_enc - 1:]``, t_enc =
    hires_steps - 1). ``hires_steps`` 0: diffusers' ``get_timesteps`` on the first pass's ``steps``
    (:func:`img2img_start`: the last ``int(steps x strength)`` of ``steps`` run). A1111 itself uses its own rule
    there too, with ``hires_steps = steps`` (``hr_second_pass_steps or steps``): send the step count to get it.

    Raises ValueError when ``strength`` runs no step (:func:`img2img_start`).
    """
    if hires_steps > 0:
        total = int(hires_steps / min(strength, 0.999))
        return total, total - hires_steps
    return steps, img2img_start(steps, strength)


def sampler_config(sampler: str, config: dict) -> dict:
    """``<class>.from_config(config, **overrides)``'s config for an A1111 sampler name, as a dict.

    The model's fields (all of them: diffusers keeps fields its class does not take, and some
    code reads them, such as ``sigma_min`` for Karras sigmas), the class's defaults for its own
    fields the model lacks, then the fields the name fixes.
    """
    cls, overrides = SAMPLER_CLASSES[get_sampler(sampler)]
    defaults = CLASS_DEFAULTS[cls]
    return {**config, **{k: v for k, v in defaults.items() if k not in config}, **overrides}


# Fields whose unsupported value refuses one sampler per request, not the model at start: zero
# terminal SNR (a v-prediction fine-tune's ``ztsnr``) runs with Euler, Euler a and DPM++ as in diffusers;
# original_inference_steps is LCM's alone. A (sampler, field) pair: that sampler's refusal of that field only
# (UniPC's two combinations that diffusers' UniPC divides by zero on, which every other sampler follows; Euler a on a
# sample-predicting model, SDXL-Lightning's 1-step x0 UNet, which the other samplers run).
PER_SAMPLER = frozenset({"rescale_betas_zero_snr", "original_inference_steps", ("UniPC", "final_sigmas_type"),
                         ("UniPC", "lower_order_final"), ("Euler a", "prediction_type"), ("DPM2", "prediction_type"),
                         ("DPM++ SDE", "prediction_type"), ("DPM2 a", "prediction_type")})


def check_scheduler_config(config: dict) -> None:
    """Refuse a scheduler config that any sampler would not follow as diffusers does.

    Fields in :data:`PER_SAMPLER` are the exception: a value one sampler cannot follow makes only
    that sampler unavailable for the model (:func:`make_schedule` refuses it per request), since
    the others follow it as diffusers does.

    Raises UnsupportedSchedulerConfig naming the first such field, its value and the sampler.
    """
    for sampler in SAMPLERS:
        problem = _refusal(sampler, sampler_config(sampler, config))
        if problem and problem[0] not in PER_SAMPLER and (sampler, problem[0]) not in PER_SAMPLER:
            field, why = problem
            value = sampler_config(sampler, config)[field]
            raise UnsupportedSchedulerConfig(
                f"{field}={value!r} is not supported ({SAMPLER_CLASSES[sampler][0]}, sampler {sampler!r}): {why}")


# The classes whose timesteps are LCM's ``original_inference_steps`` grid (their ``timestep_spacing`` unused).
_LCM_GRID = ("LCMScheduler", "TCDScheduler")


def _refusal(sampler: str, cfg: dict) -> tuple[str, str] | None:
    """(field, reason) of the first value ``sampler`` cannot follow, or None."""
    cls = SAMPLER_CLASSES[sampler][0]
    custom = cfg.get("custom_timesteps")
    if custom is not None and not (
            isinstance(custom, (list, tuple)) and custom and all(type(t) is int for t in custom)
            and all(a > b for a, b in zip(custom, custom[1:])) and 0 <= custom[-1] and custom[0] < cfg[
                "num_train_timesteps"]):
        return "custom_timesteps", ("a list of whole timesteps, largest first, each at least 0 and below "
                                    "num_train_timesteps")
    if cfg["trained_betas"] is None and cfg["beta_schedule"] not in ("linear", "scaled_linear", "squaredcos_cap_v2"):
        return "beta_schedule", "choose linear, scaled_linear or squaredcos_cap_v2"
    if cfg["prediction_type"] not in ("epsilon", "v_prediction", "sample"):
        return "prediction_type", "choose epsilon, v_prediction or sample"
    if cls == "EulerAncestralDiscreteScheduler" and cfg["prediction_type"] == "sample":
        return "prediction_type", "diffusers' Euler a does not implement it either"
    if cls in ("KDPM2DiscreteScheduler", "DPMSolverSDEScheduler", "KDPM2AncestralDiscreteScheduler") \
            and cfg["prediction_type"] == "sample":
        return "prediction_type", f"diffusers' {cls} does not implement it either"
    if cls not in _LCM_GRID and cfg["timestep_spacing"] not in ("linspace", "leading", "trailing"):
        return "timestep_spacing", "choose linspace, leading or trailing"
    if cls == "DDIMScheduler" and cfg["rescale_betas_zero_snr"]:
        return "rescale_betas_zero_snr", ("DDIM's terminal alpha 0 is an infinite sigma, which this engine's DDIM "
                                          "cannot step from")
    if cls in _LCM_GRID and cfg["rescale_betas_zero_snr"]:
        return "rescale_betas_zero_snr", (f"its terminal alpha 0 (diffusers' {cls} keeps it 0) is an infinite "
                                          "sigma, which this engine cannot step from")
    if cls in _LCM_GRID and not 1 <= cfg["original_inference_steps"] <= cfg["num_train_timesteps"]:
        return "original_inference_steps", f"choose 1 to num_train_timesteps ({cfg['num_train_timesteps']})"
    if cfg.get("thresholding", False) and cls in ("DPMSolverMultistepScheduler", "UniPCMultistepScheduler",
                                                  "DDIMScheduler", "LCMScheduler"):
        return "thresholding", ("dynamic thresholding is not implemented (it suits pixel-space models, not SDXL's "
                                "latents)")
    final_sigmas = cls in ("EulerDiscreteScheduler", "DPMSolverMultistepScheduler", "UniPCMultistepScheduler")
    if final_sigmas or cls in ("HeunDiscreteScheduler", "KDPM2DiscreteScheduler", "DPMSolverSDEScheduler",
                               "KDPM2AncestralDiscreteScheduler", "LMSDiscreteScheduler"):  # the _SIGMA_KINDS ones
        kinds = [k for k in _SIGMA_KINDS if cfg[k]]
        if len(kinds) > 1:
            return kinds[1], f"only one of {', '.join(_SIGMA_KINDS)} may be set (diffusers refuses it too)"
        if cfg["use_beta_sigmas"]:
            return "use_beta_sigmas", "beta sigmas are not implemented"
        if final_sigmas and cfg["final_sigmas_type"] not in ("zero", "sigma_min"):
            return "final_sigmas_type", "choose zero or sigma_min"
    if cls == "EulerDiscreteScheduler":
        if cfg["interpolation_type"] not in ("linear", "log_linear"):
            return "interpolation_type", "choose linear or log_linear"
        if cfg["timestep_type"] not in ("discrete", "continuous"):
            return "timestep_type", "choose discrete or continuous"
        if (cfg["interpolation_type"] == "log_linear" and cfg["timestep_type"] == "continuous"
                and cfg["prediction_type"] == "v_prediction"):
            return "interpolation_type", ("log_linear with continuous v_prediction timesteps runs one step more in "
                                          "diffusers")
    if cls == "DPMSolverMultistepScheduler":
        if cfg["solver_type"] not in ("midpoint", "heun", "logrho", "bh1", "bh2"):
            return "solver_type", "choose midpoint or heun"
        for field in ("use_lu_lambdas", "use_flow_sigmas", "use_dynamic_shifting"):
            if cfg[field]:
                return field, "not implemented"
        if cfg["variance_type"] is not None:
            return "variance_type", "learned variance is not implemented"
    if cls == "UniPCMultistepScheduler":
        return _unipc_refusal(cfg)
    return None


def _unipc_refusal(cfg: dict) -> tuple[str, str] | None:
    """(field, reason) of the first UniPCMultistepScheduler value the engine does not follow, or None."""
    if cfg["solver_type"] not in ("bh1", "bh2", "midpoint", "heun", "logrho"):
        return "solver_type", "choose bh1 or bh2"
    if cfg["solver_p"] is not None:
        return "solver_p", "another scheduler as UniPC's predictor is not implemented"
    for field in ("use_flow_sigmas", "use_dynamic_shifting"):
        if cfg[field]:
            return field, "not implemented"
    if cfg["final_sigmas_type"] == "sigma_min" and (cfg["use_karras_sigmas"] or cfg["use_exponential_sigmas"]):
        return "final_sigmas_type", ("with karras or exponential sigmas diffusers' UniPC repeats the last sigma as the "
                                     "final one: a step of h = 0, which divides by zero")
    if not cfg["lower_order_final"] and cfg["final_sigmas_type"] == "zero":
        return "lower_order_final", ("diffusers' second-order UniPC step to a final sigma of 0 divides by zero: keep "
                                     "it True, or final_sigmas_type sigma_min")
    return None


def _betas(cfg: dict) -> np.ndarray:
    """(num_train_timesteps,) float32 betas as the class's __init__ makes them (with zero terminal SNR rescaling)."""
    n = cfg["num_train_timesteps"]
    start, end, kind = cfg["beta_start"], cfg["beta_end"], cfg["beta_schedule"]
    if cfg["trained_betas"] is not None:
        betas = np.asarray(cfg["trained_betas"], np.float32)
    elif kind == "scaled_linear":
        betas = np.linspace(start**0.5, end**0.5, n, dtype=np.float32) ** 2
    elif kind == "linear":
        betas = np.linspace(start, end, n, dtype=np.float32)
    elif kind == "squaredcos_cap_v2":  # Glide's cosine schedule (diffusers' betas_for_alpha_bar)
        bar = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
        betas = np.array([min(1 - bar((i + 1) / n) / bar(i / n), 0.999) for i in range(n)], np.float32)
    else:
        raise UnsupportedSchedulerConfig(f"beta_schedule {kind!r} is not supported (linear, scaled_linear, "
                                         "squaredcos_cap_v2)")
    if cfg["rescale_betas_zero_snr"]:  # Lin et al. 2023, Algorithm 1 (diffusers' rescale_zero_terminal_snr)
        root = np.sqrt(np.cumprod(1.0 - betas, dtype=np.float32))
        first, last = root[0], root[-1]
        root = (root - last) * (first / (first - last))
        bar = root**2
        betas = (1 - np.concatenate([bar[:1], bar[1:] / bar[:-1]])).astype(np.float32)
    return betas


def _alphas_cumprod(cfg: dict) -> np.ndarray:
    """(num_train_timesteps,) float32 cumulative product of 1 - beta (DDPM, Ho et al. 2020).

    With zero terminal SNR the last is 2**-24, not 0, as the sigma-space classes set it (not DDIM).
    """
    out = np.cumprod(1.0 - _betas(cfg), dtype=np.float32)
    if cfg["rescale_betas_zero_snr"]:
        out[-1] = 2.0**-24
    return out


def _karras(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> np.ndarray:
    ramp = np.linspace(0, 1, n)
    return (sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho


def _converted(cfg: dict, in_sigmas: np.ndarray, n: int) -> np.ndarray | None:
    """Karras or exponential sigmas from ``in_sigmas`` (largest first), as _convert_to_* do; None for neither.

    ``sigma_min`` / ``sigma_max`` of the config win where set (diffusers reads them from any class's config).
    """
    if not (cfg["use_karras_sigmas"] or cfg["use_exponential_sigmas"]):
        return None
    lo = cfg.get("sigma_min") if cfg.get("sigma_min") is not None else float(in_sigmas[-1])
    hi = cfg.get("sigma_max") if cfg.get("sigma_max") is not None else float(in_sigmas[0])
    if cfg["use_karras_sigmas"]:
        return _karras(lo, hi, n)
    return np.exp(np.linspace(math.log(hi), math.log(lo), n))


def _sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """Fractional timesteps whose interpolated log-sigma is ``log(sigmas)`` (diffusers' ``_sigma_to_t``)."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma - log_sigmas[:, np.newaxis]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1]), 0, 1)
    return (1 - w) * low + w * (low + 1)


def _spaced(cfg: dict, steps: int, extra: int = 0, last: int | None = None) -> np.ndarray:
    """Timesteps by ``timestep_spacing``, as diffusers' Euler (extra=0) and DPM++ (extra=1) space them.

    ``last``: DPM++'s last timestep plus one (lambda_min_clipped); the training length by default.
    """
    n_train = cfg["num_train_timesteps"]
    last = n_train if last is None else last
    spacing = cfg["timestep_spacing"]
    if spacing == "linspace":
        if extra:
            return np.linspace(0, last - 1, steps + 1).round()[::-1][:-1].astype(np.float64)
        return np.linspace(0, n_train - 1, steps, dtype=np.float32)[::-1].astype(np.float64)
    if spacing == "leading":
        ratio = last // (steps + extra)
        t = (np.arange(0, steps + extra) * ratio).round()[::-1]
        return (t[:-1] if extra else t).astype(np.float64) + cfg["steps_offset"]
    if spacing == "trailing":
        return np.arange(last, 0, -n_train / steps).round().astype(np.float64) - 1
    raise UnsupportedSchedulerConfig(f"timestep_spacing {spacing!r} is not supported (linspace, leading, trailing)")


def _final_sigma(cfg: dict, ac: np.ndarray) -> float:
    return float(((1 - ac[0]) / ac[0]) ** 0.5) if cfg["final_sigmas_type"] == "sigma_min" else 0.0


def _euler(cfg: dict, steps: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Euler's timesteps, sigmas (n + 1) and init_noise_sigma (EulerDiscreteScheduler.set_timesteps)."""
    ac = _alphas_cumprod(cfg)
    all_sigmas = ((1 - ac) / ac) ** 0.5
    log_sigmas = np.log(all_sigmas)
    timesteps = _spaced(cfg, steps).astype(np.float32)
    if cfg["interpolation_type"] == "log_linear":  # n + 1 sigmas: the last step ends at the smallest, not at 0
        sigmas = np.exp(np.linspace(np.log(all_sigmas[-1]), np.log(all_sigmas[0]), steps + 1, dtype=np.float32))
    else:
        sigmas = np.interp(timesteps, np.arange(len(all_sigmas)), all_sigmas)
    converted = _converted(cfg, sigmas, steps)
    if converted is not None:
        sigmas = converted
        timesteps = _sigma_to_t(sigmas, log_sigmas).astype(np.float32)
    sigmas = np.concatenate([sigmas, [_final_sigma(cfg, ac)]]).astype(np.float32)
    if cfg["timestep_type"] == "continuous" and cfg["prediction_type"] == "v_prediction":
        timesteps = (0.25 * np.log(sigmas[:-1])).astype(np.float32)
    top = float(sigmas.max())
    init = top if cfg["timestep_spacing"] in ("linspace", "trailing") else (top**2 + 1) ** 0.5
    return timesteps, sigmas[: steps + 1], init


def _euler_ancestral(cfg: dict, steps: int) -> tuple[np.ndarray, np.ndarray, float]:
    """EulerAncestralDiscreteScheduler.set_timesteps: no sigma conversions, final sigma 0."""
    ac = _alphas_cumprod(cfg)
    all_sigmas = ((1 - ac) / ac) ** 0.5
    timesteps = _spaced(cfg, steps).astype(np.float32)
    sigmas = np.concatenate([np.interp(timesteps, np.arange(len(all_sigmas)), all_sigmas), [0.0]]).astype(np.float32)
    top = float(sigmas.max())
    return timesteps, sigmas, top if cfg["timestep_spacing"] in ("linspace", "trailing") else (top**2 + 1) ** 0.5


def _dpm(cfg: dict, steps: int, unipc: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """DPMSolverMultistepScheduler.set_timesteps: integer timesteps, sigmas (n + 1). UniPCMultistepScheduler's are
    the same but for two things: it has no ``lambda_min_clipped`` and rounds its Karras timesteps whatever the
    beta schedule."""
    ac = _alphas_cumprod(cfg)
    all_sigmas = ((1 - ac) / ac) ** 0.5
    log_sigmas = np.log(all_sigmas)
    alpha_t, sigma_t = np.sqrt(ac), np.sqrt(1 - ac)
    lambdas = (np.log(alpha_t) - np.log(sigma_t)).astype(np.float32)
    floor = -math.inf if unipc else cfg["lambda_min_clipped"]
    clipped = int(np.searchsorted(lambdas[::-1], np.float32(floor), side="left"))
    timesteps = _spaced(cfg, steps, extra=1, last=cfg["num_train_timesteps"] - clipped)
    converted = _converted(cfg, all_sigmas[::-1], steps)
    if converted is not None:
        sigmas = converted
        timesteps = _sigma_to_t(sigmas, log_sigmas)
        if cfg["use_karras_sigmas"] and (unipc or cfg["beta_schedule"] != "squaredcos_cap_v2"):
            timesteps = timesteps.round()
        timesteps = np.trunc(timesteps)  # torch's cast to int64
    else:
        sigmas = np.interp(timesteps, np.arange(len(all_sigmas)), all_sigmas)
    sigmas = np.concatenate([sigmas, [_final_sigma(cfg, ac)]]).astype(np.float32)
    return timesteps.astype(np.float32), sigmas


def _ddim(cfg: dict, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """DDIMScheduler.set_timesteps and its step's alphas, in sigma space.

    Returns timesteps (n,), sigmas (n + 1: each step's, then the final one), and per step the
    sigma of its "previous timestep" (t - 1000 // n, or the final alpha's past the start) and
    the factor sqrt(alphā_prev / alphā(next step's t)) that carries x from the one to the other
    (1 where they coincide, as with leading spacing).
    """
    ac = np.cumprod(1.0 - _betas(cfg), dtype=np.float32).astype(np.float64)
    n_train = len(ac)
    spacing = cfg["timestep_spacing"]
    if spacing == "linspace":
        timesteps = np.linspace(0, n_train - 1, steps).round()[::-1]
    elif spacing == "leading":
        timesteps = (np.arange(0, steps) * (n_train // steps)).round()[::-1] + cfg["steps_offset"]
    elif spacing == "trailing":
        timesteps = np.round(np.arange(n_train, 0, -n_train / steps)) - 1
    else:
        raise UnsupportedSchedulerConfig(f"timestep_spacing {spacing!r} is not supported (linspace, leading, trailing)")
    timesteps = timesteps.astype(np.int64)
    final = 1.0 if cfg["set_alpha_to_one"] else ac[0]
    prev = timesteps - n_train // steps
    alpha_prev = np.where(prev >= 0, ac[np.maximum(prev, 0)], final)
    alpha = ac[timesteps]
    to_sigma = lambda x: ((1 - x) / x) ** 0.5  # noqa: E731
    carry = np.ones(steps)
    carry[:-1] = np.sqrt(alpha_prev[:-1] / alpha[1:])
    return (timesteps.astype(np.float32), np.concatenate([to_sigma(alpha), [to_sigma(alpha_prev[-1])]]),
            to_sigma(alpha_prev), carry)


def _lcm(cfg: dict, steps: int, custom: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """LCMScheduler.set_timesteps and its boundary-condition scalings (diffusers 0.42.1).

    Returns timesteps (n,) int64: ``steps`` of the ``original_inference_steps`` timesteps
    k - 1, 2k - 1, ... (k = num_train_timesteps // original_inference_steps), largest first, at
    indices floor(linspace(0, original, n, endpoint=False)); sigmas (n + 1,) float64, the last 0;
    c_skip and c_out (n,) float64 of ``get_scalings_for_boundary_condition_discrete``
    (sigma_data 0.5, the timestep times ``timestep_scaling``). ``custom``: (n,) int64 timesteps, largest first, in
    place of those (diffusers' ``set_timesteps(timesteps=...)``, whose steps are the same functions of them).
    """
    ac = np.cumprod(1.0 - _betas(cfg), dtype=np.float32).astype(np.float64)  # no 2**-24: zero SNR is refused
    original = cfg["original_inference_steps"]
    k = cfg["num_train_timesteps"] // original
    origin = (np.arange(1, original + 1) * k - 1)[::-1]
    timesteps = custom if custom is not None else origin[
        np.floor(np.linspace(0, original, num=steps, endpoint=False)).astype(np.int64)]
    sigmas = np.concatenate([((1 - ac[timesteps]) / ac[timesteps]) ** 0.5, [0.0]])
    scaled = timesteps.astype(np.float64) * cfg["timestep_scaling"]
    c_skip = 0.25 / (scaled**2 + 0.25)
    c_out = scaled / (scaled**2 + 0.25) ** 0.5
    return timesteps, sigmas, c_skip, c_out


def make_schedule(sampler: str, config: dict, steps: int, schedule_type: str | None = None,
                  eta: float | None = None) -> Schedule:
    """The :class:`Schedule` of ``sampler`` (an A1111 name) for ``steps`` steps of a model's scheduler config.

    Args:
        config: the model's scheduler_config.json fields (``from_config`` semantics:
            :func:`sampler_config`); the prediction type is the program's business.
        schedule_type: a :data:`SCHEDULE_TYPES` name (:func:`get_schedule_type`'s spellings; None = "automatic":
            the sampler's own spacing; a :data:`SPACING_TYPES` name: the sampler's class with that
            ``timestep_spacing``, LCM's and TCD's "trailing" their custom timesteps). Another replaces the
            sampler's sigmas by A1111's (:func:`schedule_sigmas`),
            the last one the sampler's own final sigma (0 for SDXL, as A1111), its timesteps k-diffusion's
            ``sigma_to_t`` of them (DPM++: rounded to whole ones, as diffusers' DPMSolverMultistepScheduler rounds
            its Karras sigmas' timesteps); the
            update's coefficients, initial and final scales follow the sampler's rules. "DPM++ 2M" with "karras"
            is "DPM++ 2M Karras" (diffusers' ``use_karras_sigmas``, whose sigmas are A1111's karras ones).
        eta: A1111's ``eta`` in [0, 1] for the samplers of :data:`ETA_DEFAULTS` (None: their default there):
            k-diffusion's ``get_ancestral_step`` eta for Euler a, DPM2 a and DPM++ SDE, the DPM++ 2M / 3M SDEs' eta
            (:func:`_dpm_coefficients`), DDIM's (diffusers' DDIMScheduler.step eta: the step noise's std
            eta sqrt(s_prev^2 (s^2 - s_prev^2) / s^2) in sigma space), TCD's gamma. The other samplers ignore it,
            as A1111 does. Only coefficients change (the arrays the program traces): it compiles nothing.
    Raises:
        UnknownSampler: an unknown sampler name. UnknownScheduleType: an unknown schedule type.
        UnsupportedScheduleType: a schedule type other than automatic for DDIM, LCM or TCD (their own timesteps;
            DDIM takes the spacings, LCM and TCD trailing), or
            other than automatic / karras for "DPM++ 2M Karras".
        UnsupportedSchedulerConfig: a field this sampler does not follow (:func:`check_scheduler_config`).
        TooManySteps: LCM or TCD with more steps than the config's ``original_inference_steps`` (diffusers
            raises too: their steps are a subset of that schedule).
        ValueError: fewer than 1 step; an eta that is not a number in [0, 1].
    """
    sampler, schedule_type = _sampler_and_type(get_sampler(sampler), get_schedule_type(schedule_type))
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if eta is not None and (isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 <= eta <= 1):
        raise ValueError(f"eta must be a number from 0 to 1, got {eta!r}")
    eta = ETA_DEFAULTS.get(sampler) if eta is None or sampler not in ETA_DEFAULTS else float(eta)
    cfg = sampler_config(sampler, config)
    problem = _refusal(sampler, cfg)
    if problem:
        raise UnsupportedSchedulerConfig(f"{problem[0]}={cfg[problem[0]]!r} is not supported (sampler "
                                         f"{sampler!r}): {problem[1]}")
    if sampler == "Restart":
        return _restart_schedule(cfg, steps, schedule_type)
    custom = cfg.get("custom_timesteps")
    if sampler in ("LCM", "TCD") and custom and len(custom) == steps and schedule_type == DEFAULT_SCHEDULE_TYPE:
        if sampler == "LCM":
            return _lcm_schedule(cfg, steps, np.asarray(custom, np.int64))
        return _tcd_schedule(cfg, steps, np.asarray(custom, np.int64), gamma=eta)
    if schedule_type in SPACING_TYPES:  # the class with this spacing: its automatic schedule on that config
        cfg, schedule_type = {**cfg, "timestep_spacing": schedule_type}, DEFAULT_SCHEDULE_TYPE
        if sampler in ("LCM", "TCD"):  # custom timesteps, trailing (_sampler_and_type took no other spacing)
            n_train = cfg["num_train_timesteps"]
            custom = np.round(np.arange(n_train, 0, -n_train / steps)).astype(np.int64) - 1
            return _lcm_schedule(cfg, steps, custom) if sampler == "LCM" else _tcd_schedule(cfg, steps, custom, eta)
    if sampler in TWO_CALLS:
        return _two_call_schedule(sampler, cfg, steps, schedule_type, eta)
    if sampler == "LMS":
        return _lms_schedule(cfg, steps, schedule_type)
    typed = None if schedule_type == DEFAULT_SCHEDULE_TYPE else _typed(cfg, schedule_type, steps)
    zeros = np.zeros(steps, np.float64)
    if sampler == "LCM":
        return _lcm_schedule(cfg, steps)
    if sampler == "TCD":
        return _tcd_schedule(cfg, steps, gamma=eta)
    if sampler in ("Euler", "Euler a"):
        timesteps, sigmas, init = (_euler if sampler == "Euler" else _euler_ancestral)(cfg, steps)
        if typed is not None:  # A1111's sigmas; the initial scale by the class's rule, on the new top sigma
            timesteps, sigmas = typed[0].astype(np.float32), typed[1].astype(np.float32)
            top = float(sigmas.max())
            init = top if cfg["timestep_spacing"] in ("linspace", "trailing") else (top**2 + 1) ** 0.5
            if cfg.get("timestep_type") == "continuous" and cfg["prediction_type"] == "v_prediction":
                timesteps = (0.25 * np.log(sigmas[:-1])).astype(np.float32)
        s, s_next = sigmas[:-1].astype(np.float64), sigmas[1:].astype(np.float64)
        if sampler == "Euler":
            a, d = s_next / s, zeros
        else:  # ancestral: go down to s_down deterministically, add noise of s_up (get_ancestral_step's eta)
            down, d = _ancestral(s, s_next, eta)
            a = down / s
        return _schedule(timesteps, sigmas, a, 1 - a, zeros, zeros, d, zeros, init, 1.0)
    if sampler == "DDIM":
        timesteps, sigmas, s_prev, carry = _ddim(cfg, steps)
        a, d = s_prev / sigmas[:-1], zeros
        if eta:  # diffusers' std_dev_t = eta sqrt(variance), in sigma space: get_ancestral_step's sigma_up at eta
            s = sigmas[:-1]
            d = eta * np.sqrt(s_prev**2 * (s**2 - s_prev**2) / s**2)
            a = np.sqrt(s_prev**2 - d**2) / s  # the direction to x_t: sqrt(1 - alphā_prev - std^2) eps
        clip = float(cfg["clip_sample_range"]) if cfg["clip_sample"] else math.inf
        return _schedule(timesteps, sigmas, a * carry, (1 - a) * carry, zeros, zeros, d * carry,
                         carry if cfg["clip_sample"] else zeros, (sigmas[0] ** 2 + 1) ** 0.5,
                         1 / (sigmas[-1] ** 2 + 1) ** 0.5, clip)
    unipc = sampler == "UniPC"
    timesteps, sigmas = _dpm(cfg, steps, unipc)
    if typed is not None:  # whole timesteps, rounded as DPMSolverMultistepScheduler rounds its Karras sigmas' ones
        timesteps, sigmas = np.round(typed[0]).astype(np.float32), typed[1].astype(np.float32)
    history = functools.partial(_unipc_coefficients, cfg, sigmas.astype(np.float64)) if unipc else functools.partial(
        _dpm_coefficients, cfg, sigmas.astype(np.float64), eta=1.0 if eta is None else eta)
    init = (sigmas[0] ** 2 + 1) ** 0.5  # x-space noise of variance 1
    return _schedule(timesteps, sigmas, *history(()), zeros, init, 1 / (sigmas[-1] ** 2 + 1) ** 0.5, history=history)


def _two_call_schedule(sampler: str, cfg: dict, steps: int, schedule_type: str, eta: float | None = None) -> Schedule:
    """Heun, DPM2, DPM++ SDE or DPM2 a (:data:`TWO_CALLS`) in sigma space: the class's sigmas and timesteps (or A1111's
    ``schedule_type``), the first call's update in (a, b, d), the second's in a :class:`SecondCall`.

    With s = sigma_i, s' = sigma_{i+1} (> 0; a step to s' = 0 is Euler's, x0, with no second call, as k-diffusion's
    samplers and diffusers' classes take it), x0 and x0_mid the two calls' x0, the formulas (eta 1, s_noise 1):

    * Heun (k-diffusion ``sample_heun``, s_churn 0; diffusers ``HeunDiscreteScheduler``): x_mid = Euler's step to s'
      (mid_a = s'/s), called at s' and the next step's timestep; x' = x + (s' - s)/2 ((x - x0)/s + (x_mid -
      x0_mid)/s'): a = 1 + dt/2s, b = -dt/2s, f = dt/2s' (dt = s' - s). ``clip_sample`` clips both x0.
    * DPM2 (``sample_dpm_2``; ``KDPM2DiscreteScheduler``): m = exp((log s + log s')/2); x_mid = Euler's step to m
      (mid_a = m/s), called at m and ``sigma_to_t(m)``; x' = x + (s' - s)(x_mid - x0_mid)/m: a = 1, f = dt/m.
    * DPM++ SDE (``sample_dpmpp_sde``, r 1/2; ``DPMSolverSDEScheduler``): m the same; x_mid = the ancestral step s ->
      m (``get_ancestral_step``: s_down, s_up; mid_a = s_down/s, mid_b = 1 - mid_a, mid_d = s_up), called at m; x' =
      (s_down'/s) x + (1 - s_down'/s) x0_mid + s_up' z' for the ancestral step s -> s'. k-diffusion's two noises are
      a Brownian tree's increments over [m, s] and [s', s] (``BrownianTreeNoiseSampler``, time = sigma), normalised:
      correlated by rho = sqrt((s - m)/(s - s')), independent from step to step. The engine draws them as z (the
      step noise) and z' = rho z + sqrt(1 - rho^2) w: d = s_up' rho, d2 = s_up' sqrt(1 - rho^2). **Noise: per-step
      normals with a Brownian tree's law, not k-diffusion's or diffusers' Brownian tree samples** (the same
      distribution, another draw: an image is not A1111's for the same seed, as with every sampler here).
    * DPM2 a (``sample_dpm_2_ancestral``, eta 1; ``KDPM2AncestralDiscreteScheduler``): DPM2 to the ancestral step's
      s_down (``get_ancestral_step`` s -> s': s_down = s'^2/s, s_up = sqrt(s'^2 - s_down^2)), then the step noise:
      m = exp((log s + log s_down)/2), x_mid = Euler's step to m (mid_a = m/s), called at m and ``sigma_to_t(m)``;
      x' = x + (s_down - s)(x_mid - x0_mid)/m + s_up z: a = 1, f = (s_down - s)/m, d = s_up (one draw, z, the step
      noise of Euler a; d2 = 0). Its last step (s' = 0: s_down = s_up = 0) is Euler's, noise-free, as in both.

    The sigmas: the class's ``set_timesteps`` (spacing; Karras or exponential; Karras timesteps rounded for DPM2
    and DPM2 a alone; DPM++ SDE's Karras ignore ``sigma_min``/``sigma_max`` as its class does), the final sigma 0, no
    zero-SNR rescaling (fields these classes lack). A1111's schedule types replace the sigmas (:func:`_typed`,
    fractional timesteps as k-diffusion's ``sigma_to_t``; the final 0 whatever ``final_sigmas_type``); the mid sigmas
    follow.
    """
    cfg, timesteps, sigmas, init, log_sigmas = _discrete_sigmas(sampler, cfg, steps, schedule_type)
    s, s_next = sigmas[:-1].astype(np.float64), sigmas[1:].astype(np.float64)
    go = s_next > 0  # the steps with a second call; the others are Euler steps to 0
    with np.errstate(divide="ignore", invalid="ignore"):
        # DPM2 a's log-midpoint is between s and its ancestral step's sigma_down (> 0 where s' > 0)
        end = _ancestral(s, s_next, eta)[0] if sampler == "DPM2 a" else s_next
        mid = np.where(go, np.exp((np.log(s) + np.log(end)) / 2), 0.0)
        if sampler == "Heun":
            mid = s_next
        mid_t = np.where(go, _sigma_to_t(np.where(go, mid, 1.0), log_sigmas), 0.0)
        if sampler == "Heun":
            mid_t = np.where(go, np.concatenate([timesteps[1:], [0.0]]), 0.0)
        ancestral = {"DPM++ SDE": _dpmpp_sde, "DPM2 a": _dpm_2_ancestral}
        coefficients = (functools.partial(ancestral[sampler], eta=eta) if sampler in ancestral else
                        {"Heun": _heun, "DPM2": _dpm_2}[sampler])(s, s_next, mid)
    a, b, d, mid_a, mid_b, mid_d, f, g, d2 = (np.where(go, x, 0.0) for x in coefficients)
    b = np.where(go, b, 1.0)  # a step to 0: x0 (Euler's x + (0 - s)(x - x0)/s)
    zeros = np.zeros(steps)
    clip = float(cfg["clip_sample_range"]) if cfg.get("clip_sample") and sampler == "Heun" else math.inf
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    second = SecondCall(*(f32(x) for x in (mid_t, mid, mid_a, mid_b, mid_d, f, g, d2)))
    return dataclasses.replace(_schedule(timesteps, sigmas, a, b, zeros, zeros, d, zeros, init, 1.0, clip),
                               second=second)


def restart_steps(sigmas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A1111's Restart step list (``modules/sd_samplers_extra.py`` ``restart_sampler``, ``restart_list`` None): the
    (sigma, sigma') of each Heun step, (m,) float64 each, for the sampler's ``sigmas`` (n + 1,) float64 (n steps,
    largest first, the last 0).

    Under :data:`RESTART_MIN_STEPS` steps: the sigmas' own steps. From it: R = :data:`RESTART_STEPS` restart steps
    run once (from :data:`RESTART_TWICE_STEPS`: R = n // 4, run twice); the main list becomes Karras over n - R x times
    steps from sigmas[-2] to sigmas[0] (then 0); after the main step that ends at the sigma nearest :data:`RESTART_MIN`
    (index lo, the first of equals), the R + 1 Karras sigmas from the one nearest :data:`RESTART_MAX` (index hi) down to
    sigmas[lo] run as R steps, ``times`` times, then the main list goes on from sigmas[lo]; none where hi >= lo. So m =
    n (the restart steps make up for the main list's fewer). The stretch's ends are the main list's sigmas exactly
    (A1111's float32 Karras may miss them by a rounding step: a jump back of 1e-7 relative, whose noise is nothing).

    Where hi >= lo (no restart: a model whose sigmas never come near 2 and 0.1), A1111 would run n - R x times steps;
    the engine runs the sigmas' own n steps instead (its programs take the request's step count).
    """
    sigmas = np.asarray(sigmas, np.float64)
    steps = len(sigmas) - 1
    if steps < RESTART_MIN_STEPS:
        return sigmas[:-1], sigmas[1:]
    restart, times = (steps // 4, 2) if steps >= RESTART_TWICE_STEPS else (RESTART_STEPS, 1)
    main = np.concatenate([_karras(float(sigmas[-2]), float(sigmas[0]), steps - restart * times), [0.0]])
    lo = int(np.argmin(np.abs(main - RESTART_MIN)))  # A1111's restart_list key: the index of the sigma nearest 0.1
    hi = int(np.argmin(np.abs(main - RESTART_MAX)))
    if not 0 < lo or hi >= lo:
        return sigmas[:-1], sigmas[1:]
    stretch = _karras(float(main[lo]), float(main[hi]), restart + 1)
    stretch[0], stretch[-1] = main[hi], main[lo]
    old = [*main[:lo], *np.tile(stretch[:-1], times), *main[lo:-1]]
    new = [*main[1 : lo + 1], *np.tile(stretch[1:], times), *main[lo + 1 :]]
    return np.asarray(old), np.asarray(new)


def _restart_schedule(cfg: dict, steps: int, schedule_type: str) -> Schedule:
    """Restart (A1111's ``restart_sampler``, s_noise 1) as Heun steps (:func:`_two_call_schedule`'s Heun formulas) on
    :func:`restart_steps`' list, from the sigmas A1111 hands it: ``schedule_type``'s (automatic: Karras, A1111's own
    for Restart, ``'scheduler': 'karras'``; a spacing: HeunDiscreteScheduler's with it), on the config's training
    sigmas as HeunDiscreteScheduler reads them (no zero-SNR rescaling, final sigma 0).

    Step j runs from sigmas[j] (timestep its ``sigma_to_t``, fractional as k-diffusion's) to its own sigma' (the second
    call's sigma, timestep its ``sigma_to_t``): Heun (a = 1 + dt/2s, b = -dt/2s, f = dt/2s', the second call at sigma'
    from Euler's x), or Euler to x0 where sigma' is 0. Where the next step starts above sigma' (a restart), A1111 adds
    ``randn * sqrt(s_next^2 - sigma'^2)`` before it; here that is step j's noise, d = sqrt(sigmas[j + 1]^2 - sigma'^2)
    (the step noise of step j, :mod:`generate`'s seed rule), so sigmas[j + 1] is the level x is at when step j + 1
    starts (img2img's start, inpainting's blend, as for every sampler). Initial scale sigmas[0] (k-diffusion's ``x *
    sigmas[0]``), final scale 1, no clipping, no history.
    """
    cfg = {**cfg, "rescale_betas_zero_snr": False, "final_sigmas_type": "zero"}
    ac = _alphas_cumprod(cfg)
    log_sigmas = np.log(((1 - ac) / ac) ** 0.5)
    if schedule_type in SPACING_TYPES:
        base = _discrete_sigmas("Heun", {**cfg, "timestep_spacing": schedule_type}, steps, DEFAULT_SCHEDULE_TYPE)[2]
    else:
        typed = "karras" if schedule_type == DEFAULT_SCHEDULE_TYPE else schedule_type
        base = _typed(cfg, typed, steps)[1]
    old, new = restart_steps(np.asarray(base, np.float64))
    go = new > 0  # Heun steps; the others (the last) Euler's to x0
    with np.errstate(divide="ignore", invalid="ignore"):
        a, b, d, mid_a, mid_b, mid_d, f, g, d2 = (np.where(go, x, 0.0) for x in _heun(old, new, new))
    b = np.where(go, b, 1.0)
    sigmas = np.concatenate([old, new[-1:]])
    d = np.concatenate([np.sqrt(np.maximum(sigmas[1:-1] ** 2 - new[:-1] ** 2, 0.0)), [0.0]])  # the jumps back up
    mid_t = np.where(go, _sigma_to_t(np.where(go, new, 1.0), log_sigmas), 0.0)
    zeros = np.zeros(len(old))
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    second = SecondCall(*(f32(x) for x in (mid_t, np.where(go, new, 0.0), mid_a, mid_b, mid_d, f, g, d2)))
    return dataclasses.replace(_schedule(_sigma_to_t(old, log_sigmas), sigmas, a, b, zeros, zeros, d, zeros,
                                         float(sigmas[0]), 1.0), second=second)


def _discrete_sigmas(sampler: str, cfg: dict, steps: int, schedule_type: str) -> tuple:
    """(cfg, timesteps (n,), sigmas (n + 1,) float32, init_noise_sigma, log training sigmas) of the classes without
    ``rescale_betas_zero_snr`` or ``final_sigmas_type`` (:data:`TWO_CALLS`' and LMSDiscreteScheduler: their
    ``set_timesteps``, the final sigma 0; ``cfg`` returned with those two fields off). Karras or exponential sigmas
    from the spaced ones; DPM++ SDE's (both) and LMS's Karras ones ignore ``sigma_min``/``sigma_max`` as their
    classes do; DPM2's and DPM2 a's Karras timesteps are rounded. Another ``schedule_type``: A1111's (:func:`_typed`).
    """
    cfg = {**cfg, "rescale_betas_zero_snr": False, "final_sigmas_type": "zero"}
    ac = _alphas_cumprod(cfg)
    training = ((1 - ac) / ac) ** 0.5  # float32 (diffusers' np.array of the torch tensor)
    log_sigmas = np.log(training)
    if schedule_type == DEFAULT_SCHEDULE_TYPE:
        timesteps = _spaced(cfg, steps)
        if sampler == "DPM++ SDE" and cfg["timestep_spacing"] == "linspace":  # its linspace is float64
            timesteps = np.linspace(0, cfg["num_train_timesteps"] - 1, steps)[::-1]
        sigmas = np.interp(timesteps, np.arange(len(training)), training)
        no_range = sampler == "DPM++ SDE" or (sampler == "LMS" and cfg["use_karras_sigmas"])
        converted = _converted({**cfg, "sigma_min": None, "sigma_max": None} if no_range else cfg, sigmas, steps)
        if converted is not None:
            sigmas = converted
            timesteps = _sigma_to_t(sigmas, log_sigmas)
            if sampler in ("DPM2", "DPM2 a") and cfg["use_karras_sigmas"]:
                timesteps = timesteps.round()
        sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
    else:
        timesteps, sigmas = _typed(cfg, schedule_type, steps)
        sigmas = sigmas.astype(np.float32)
    top = float(sigmas.max())
    init = top if cfg["timestep_spacing"] in ("linspace", "trailing") else (top**2 + 1) ** 0.5
    return cfg, timesteps, sigmas, init, log_sigmas


def _lms_schedule(cfg: dict, steps: int, schedule_type: str) -> Schedule:
    """LMSDiscreteScheduler (``step(order=4)``; k-diffusion's ``sample_lms``, order 4) in sigma space: its sigmas
    (:func:`_discrete_sigmas`: Euler's spacing, Karras or exponential, the final sigma 0, or A1111's
    ``schedule_type``), its timesteps fractional where converted, as in diffusers; the update ``x' = x + sum_k L_k
    d_{i-k}`` on the derivatives d_j = (x_j - x0_j)/sigma_j, which the history keeps (hx = 1/s, hx0 = -1/s):
    a = 1 + L_0/s, b = -L_0/s, c, c2, c3 = L_1, L_2, L_3 (:func:`_lms_coefficients`). Deterministic (d = 0), no
    clipping, init and final scales Euler's (diffusers' LMS works in sigma space too)."""
    cfg, timesteps, sigmas, init, _ = _discrete_sigmas("LMS", cfg, steps, schedule_type)
    history = functools.partial(_lms_coefficients, sigmas.astype(np.float64))
    a, b, c, c2, d, c3 = history(())
    s, f32 = sigmas[:-1].astype(np.float64), lambda x: np.asarray(x, np.float32)  # noqa: E731
    return dataclasses.replace(_schedule(timesteps, sigmas, a, b, c, c2, d, np.zeros(steps), init, 1.0,
                                         history=history), c3=f32(c3), hx=f32(1 / s), hx0=f32(-1 / s))


def lms_coefficient(sigmas: np.ndarray, i: int, order: int, j: int) -> float:
    """The linear multistep coefficient L_j of step ``i`` at ``order``: the integral over [sigmas[i], sigmas[i + 1]]
    of the Lagrange basis polynomial that is 1 at sigmas[i - j] and 0 at the other sigmas[i - k], k < ``order``.

    diffusers' ``LMSDiscreteScheduler.get_lms_coefficient(order, t=i, current_order=j)`` and k-diffusion's
    ``linear_multistep_coeff(order, t=sigmas, i, j)`` integrate it with scipy's ``quad``; the polynomial's degree is
    ``order - 1`` <= 3, so here it is integrated exactly (numpy's polynomial antiderivative), in float64.

    Args:
        sigmas: (n + 1,) float64, largest first; the step's ``sigmas[i - order + 1 .. i + 1]`` are read.
        i: the step, ``order - 1 <= i < n``. order: 1 to 4. j: 0 .. order - 1 (0: the step's own derivative).
    Raises ValueError for ``order`` or ``j`` out of range.
    """
    if not 0 <= j < order <= i + 1:
        raise ValueError(f"LMS coefficient needs 0 <= j < order <= i + 1, got i={i}, order={order}, j={j}")
    origin = float(sigmas[i])  # the polynomial in tau - sigma_i: well conditioned whatever the sigmas' scale
    nodes = [float(sigmas[i - k]) - origin for k in range(order) if k != j]
    scale = np.prod([float(sigmas[i - j]) - origin - x for x in nodes])  # 1 for order 1 (no nodes)
    basis = (np.polynomial.Polynomial.fromroots(nodes) if nodes else np.polynomial.Polynomial([1.0])) / scale
    return float(basis.integ()(float(sigmas[i + 1]) - origin))  # the antiderivative is 0 at tau = sigma_i


def _lms_coefficients(sigmas: np.ndarray, restarts: tuple[int, ...] = ()) -> tuple[np.ndarray, ...]:
    """LMSDiscreteScheduler.step(order=4) in sigma space: (a, b, c, c2, d, c3), each (n,) float64, for ``sigmas``
    (n + 1,) float64 (every sigma but the last > 0), the history restarting at ``restarts``.

    Step i's order is min(steps since the restart + 1, :data:`LMS_ORDER`) (diffusers: min(step_index + 1, 4);
    k-diffusion's sample_lms: min(i + 1, 4) on the sigmas it is given, so A1111's img2img, whose sigmas start at its
    first step, restarts there; see docs/samplers.md for diffusers' ``set_begin_index``). With L_j =
    :func:`lms_coefficient`: x' = x + L_0 (x - x0)/s + L_1 d_{i-1} + L_2 d_{i-2} + L_3 d_{i-3}, so a = 1 + L_0/s,
    b = -L_0/s, c = L_1, c2 = L_2, c3 = L_3 (0 beyond the order), d = 0.
    """
    steps = len(sigmas) - 1
    order = np.minimum(_since_restart(steps, restarts) + 1, LMS_ORDER)
    coefficients = np.zeros((steps, LMS_ORDER))
    for i in range(steps):
        for j in range(order[i]):
            coefficients[i, j] = lms_coefficient(sigmas, i, int(order[i]), j)
    s = sigmas[:-1]
    first = coefficients[:, 0] / s
    return 1 + first, -first, coefficients[:, 1], coefficients[:, 2], np.zeros(steps), coefficients[:, 3]


def _heun(s, s_next, mid):
    """Heun's (a, b, d, mid_a, mid_b, mid_d, f, g, d2), (n,) float64 each (:func:`_two_call_schedule`)."""
    dt, zeros = s_next - s, np.zeros_like(s)
    return 1 + dt / (2 * s), -dt / (2 * s), zeros, s_next / s, 1 - s_next / s, zeros, dt / (2 * s_next), zeros, zeros


def _dpm_2(s, s_next, mid):
    """DPM2's (a, b, d, mid_a, mid_b, mid_d, f, g, d2) (:func:`_two_call_schedule`)."""
    dt, zeros = s_next - s, np.zeros_like(s)
    return np.ones_like(s), zeros, zeros, mid / s, 1 - mid / s, zeros, dt / mid, zeros, zeros


def _ancestral(sigma_from, sigma_to, eta=1.0):
    """k-diffusion's ``get_ancestral_step(sigma_from, sigma_to, eta)``: (sigma_down, sigma_up), sigma_up =
    min(sigma_to, eta sqrt(sigma_to^2 (sigma_from^2 - sigma_to^2) / sigma_from^2)), sigma_down = sqrt(sigma_to^2 -
    sigma_up^2). eta 0: (sigma_to, 0), no noise."""
    up = np.minimum(sigma_to, eta * np.sqrt(sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2))
    return np.sqrt(sigma_to**2 - up**2), up


def _dpmpp_sde(s, s_next, mid, eta=1.0):
    """DPM++ SDE's (a, b, d, mid_a, mid_b, mid_d, f, g, d2) (:func:`_two_call_schedule`)."""
    down_mid, up_mid = _ancestral(s, mid, eta)
    down, up = _ancestral(s, s_next, eta)
    rho = np.sqrt((s - mid) / (s - s_next))  # the Brownian increments' correlation over [m, s] and [s', s]
    zeros = np.zeros_like(s)
    return (down / s, zeros, up * rho, down_mid / s, 1 - down_mid / s, up_mid, zeros, 1 - down / s,
            up * np.sqrt(np.maximum(1 - rho**2, 0.0)))


def _dpm_2_ancestral(s, s_next, mid, eta=1.0):
    """DPM2 a's (a, b, d, mid_a, mid_b, mid_d, f, g, d2) (:func:`_two_call_schedule`): DPM2 to sigma_down, then the
    step noise times sigma_up."""
    down, up = _ancestral(s, s_next, eta)
    zeros = np.zeros_like(s)
    return np.ones_like(s), zeros, up, mid / s, 1 - mid / s, zeros, (down - s) / mid, zeros, zeros


def _since_restart(steps: int, restarts: tuple[int, ...]) -> np.ndarray:
    """(steps,) int: how many steps ran since the history last started afresh (step 0 or a restart) before each."""
    since, last = np.zeros(steps, np.int64), 0
    for i in range(steps):
        last = i if i in restarts else last
        since[i] = i - last
    return since


def _dpm_coefficients(cfg: dict, sigmas: np.ndarray, restarts: tuple[int, ...] = (),
                      eta: float = 1.0) -> tuple[np.ndarray, ...]:
    """DPMSolverMultistepScheduler.step (dpmsolver++, sde-dpmsolver++; solver_order 2 or 3) in sigma space: (a, b, c,
    c2, d), each (n,) float64, for ``sigmas`` (n + 1,) float64, the history restarting at ``restarts``.

    Each step's order is diffusers': first order on a fresh history (``lower_order_nums`` 0) and on the last step by
    lower_order_final / euler_at_final / a final sigma of 0; second order with one earlier x0, on the last but one
    step with lower_order_final under 15 steps, and always at solver_order 2; third order otherwise. With h = log s -
    log s' (lambda_t - lambda_s0 of diffusers' VP form) and a = exp(-h) (ODE) or exp(-2h) (SDE), the x-space update
    divided by alpha_t. Third order is implemented for the SDE alone (the one sampler of solver_order 3).

    The SDE's ``eta`` (k-diffusion's sample_dpmpp_2m_sde / sample_dpmpp_3m_sde; diffusers' class is eta 1): with
    H = (1 + eta) h, a = exp(-H) = (s'/s)^(1 + eta), the noise s' sqrt(1 - exp(-2 eta h)), heun's k and the third
    order's phi_2, phi_3 at H; eta 0 is DPM++ 2M's ODE step (k-diffusion's, no noise).
    """
    steps = len(sigmas) - 1
    s, s_next = sigmas[:-1], sigmas[1:]
    sde = cfg["algorithm_type"] == "sde-dpmsolver++"
    # exp(-h) on the sample (the ODE), exp(-(1 + eta) h) for the SDE, whose noise d makes up the variance it takes away
    a = (s_next / s) ** (1 + eta) if sde else s_next / s
    d = s_next * np.sqrt(np.maximum(1 - (s_next / s) ** (2 * eta), 0.0)) if sde else np.zeros(steps)
    idx, short = np.arange(steps), cfg["lower_order_final"] and steps < 15
    final_first = cfg["euler_at_final"] or short or cfg["final_sigmas_type"] == "zero"
    order = np.minimum(cfg["solver_order"], _since_restart(steps, restarts) + 1)
    order = np.where((idx == steps - 2) & short, np.minimum(order, 2), order)
    order = np.where((idx == steps - 1) & final_first, 1, order)
    x0 = np.eye(3)  # the coefficients as vectors over (x0_i, x0_{i-1}, x0_{i-2})
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # h, r only matter where the order uses them
        h = np.log(s) - np.log(s_next)
        r0 = np.concatenate([[np.nan], h[:-1]]) / h  # h_{i-1} / h
        r1 = np.concatenate([[np.nan, np.nan], h[:-2]]) / h  # h_{i-2} / h
        first = (1 - a)[:, None] * x0[0]
        d1_0 = (x0[0] - x0[1]) / r0[:, None]
        big_h = (1 + eta) * h if sde else h  # k-diffusion's h_eta: the exponent of a
        if cfg["solver_type"] == "heun":
            k = (a - 1) / big_h + 1
            second = first + k[:, None] * d1_0
        else:  # midpoint (and what diffusers maps to it: logrho, bh1, bh2)
            second = first + (0.5 * (1 - a))[:, None] * d1_0
        d1_1 = (x0[1] - x0[2]) / r1[:, None]
        d1 = d1_0 + (r0 / (r0 + r1))[:, None] * (d1_0 - d1_1)
        d2 = (d1_0 - d1_1) / (r0 + r1)[:, None]
        k = (a - 1) / big_h + 1  # k-diffusion's phi_2 at h_eta = (1 + eta) h; D2's factor its -phi_3 (diffusers: -1/2)
        third = first + k[:, None] * d1 + ((1 - a - big_h) / big_h**2 + 0.5)[:, None] * d2
    terms = np.where((order == 1)[:, None], first, np.where((order == 2)[:, None], second, third))
    return a, terms[:, 0], terms[:, 1], terms[:, 2], d


def _unipc_coefficients(cfg: dict, sigmas: np.ndarray, restarts: tuple[int, ...] = ()) -> tuple[np.ndarray, ...]:
    """UniPCMultistepScheduler.step (predict_x0, solver_order 2, bh1 or bh2) in sigma space: (a, b, c, c2, d), each
    (n,) float64 (d 0: no noise), for ``sigmas`` (n + 1,) float64, the history restarting at ``restarts``.

    diffusers' step i: (1) unless i starts a history or i - 1 is in ``disable_corrector``, UniC corrects the sample
    x_i (the predictor's, which the UNet saw) into x_i^c with the new x0_i, at the order step i - 1's predictor had;
    (2) UniP predicts x_{i+1} from x_i^c at order min(2, steps since the restart + 1, steps left if
    ``lower_order_final``). Divided by alpha (sigma space), with lambda = -log s, h = log s - log s', B(h) =
    expm1(-h) (bh2) or -h (bh1)::

        UniP: x' = (s'/s) x^c + (1 - s'/s) x0_i - B(h) rho_p D1,  D1 = (x0_{i-1} - x0_i) / r,  r = (lambda_{i-1} -
              lambda_i) / h,  rho_p = 1/2
        UniC: x^c = x + B(h_prev) (rho_p' D1' - rho_c[:-1] D1' - rho_c[-1] (x0_i - x0_{i-1}))

    where the primed D1' and rho_p' are step i - 1's predictor's (its x_t_ is the corrector's too, so the difference
    is all that is left) and rho_c solves diffusers' R rho = b (1/2 at order 1).
    """
    steps = len(sigmas) - 1
    lam = -np.log(np.maximum(sigmas, 1e-300))  # lambda = log alpha - log sigma of the VP form; +inf where sigma is 0
    lam[sigmas == 0] = np.inf
    since = _since_restart(steps, restarts)
    lower_final = cfg["lower_order_final"]
    order = [min(2, int(since[i]) + 1, steps - i if lower_final else 2) for i in range(steps)]
    off = set(cfg["disable_corrector"] or ())
    bh1 = cfg["solver_type"] == "bh1"
    a, b, c, c2 = (np.zeros(steps) for _ in range(4))
    for i in range(steps):
        h = lam[i + 1] - lam[i]
        ratio = math.exp(-h)  # s' / s (0 on a last step to sigma 0)
        pred = np.array([1 - ratio, 0.0, 0.0])  # over (x0_i, x0_{i-1}, x0_{i-2})
        if order[i] == 2:
            r = (lam[i - 1] - lam[i]) / h
            pred += _b_of(h, bh1) * 0.5 * np.array([1.0, -1.0, 0.0]) / r  # - B(h) rho_p (x0_{i-1} - x0_i) / r
        corr = np.zeros(3)
        if since[i] > 0 and (i - 1) not in off:
            corr = _unic(lam, i, order[i - 1], bh1)
        a[i] = ratio
        b[i], c[i], c2[i] = ratio * corr + pred
    return a, b, c, c2, np.zeros(steps)


def _b_of(h: float, bh1: bool) -> float:
    """UniPC's B(h) with predict_x0 (hh = -h): -h (bh1) or expm1(-h) (bh2); -1 (bh2) on a step to sigma 0."""
    return -h if bh1 else math.expm1(-h)


def _unic(lam: np.ndarray, i: int, order: int, bh1: bool) -> np.ndarray:
    """x_i^c - x_i of UniC at step i (order ``order``, step i - 1's predictor's), over (x0_i, x0_{i-1}, x0_{i-2})."""
    h = lam[i] - lam[i - 1]
    hh, bh = -h, _b_of(h, bh1)
    diff = np.array([-1.0, 1.0, 0.0]) * 0.5 if order == 1 else None  # - rho_c (x0_i - x0_{i-1}), rho_c = 1/2
    if order == 1:
        return bh * diff
    r = (lam[i - 2] - lam[i - 1]) / h
    d1 = np.array([0.0, -1.0, 1.0]) / r  # (x0_{i-2} - x0_{i-1}) / r
    # diffusers' R = [rks^0; rks^1], b_k = h_phi_k k! / B(h), with rks = (r, 1), h_phi_1 = expm1(hh)
    h_phi = math.expm1(hh) / hh - 1
    rhs = [h_phi / bh]
    rhs.append((h_phi / hh - 0.5) * 2 / bh)
    rho_c = np.linalg.solve(np.array([[1.0, 1.0], [r, 1.0]]), np.array(rhs))
    return bh * (0.5 * d1 - rho_c[0] * d1 - rho_c[1] * np.array([1.0, -1.0, 0.0]))


def _sampler_and_type(sampler: str, schedule_type: str) -> tuple[str, str]:
    """(sampler, schedule type) that run: "DPM++ 2M" + karras is the "DPM++ 2M Karras" sampler with automatic (so
    both spellings are one schedule); a schedule type a sampler does not take raises UnsupportedScheduleType."""
    if schedule_type == DEFAULT_SCHEDULE_TYPE:
        return sampler, schedule_type
    if schedule_type in SPACING_TYPES and (sampler == "DDIM" or (sampler in ("LCM", "TCD")
                                                                 and schedule_type == "trailing")):
        return sampler, schedule_type
    if sampler in OWN_TIMESTEPS:
        raise UnsupportedScheduleType(f"{sampler} keeps its own timesteps (A1111's DDIM and LCM read no schedule "
                                      f"type; DDIM takes leading, linspace or trailing, LCM and TCD trailing): use "
                                      f"automatic, or another sampler for {schedule_type}")
    if sampler == "DPM++ 2M Karras":
        if schedule_type != "karras":
            raise UnsupportedScheduleType(f"sampler {sampler} is DPM++ 2M with karras: send sampler DPM++ 2M with "
                                          f"{schedule_type}")
        return sampler, DEFAULT_SCHEDULE_TYPE
    if sampler == "DPM++ 2M" and schedule_type == "karras":
        return "DPM++ 2M Karras", DEFAULT_SCHEDULE_TYPE
    return sampler, schedule_type


def _typed(cfg: dict, schedule_type: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(timesteps (n,) float64, sigmas (n + 1,) float64) of a schedule type for the model's ``cfg``: A1111's sigmas
    over the model's training sigmas, then the class's final sigma (``final_sigmas_type``: 0, or the smallest
    training sigma); timesteps by k-diffusion's ``sigma_to_t`` (fractional; diffusers' ``_sigma_to_t``)."""
    ac = _alphas_cumprod(cfg)
    training = ((1 - ac) / ac) ** 0.5
    sigmas = schedule_sigmas(schedule_type, training, steps)
    timesteps = _sigma_to_t(sigmas, np.log(training))
    final = float(training[0]) if cfg.get("final_sigmas_type") == "sigma_min" else 0.0
    return timesteps, np.concatenate([sigmas, [final]])


def _lcm_schedule(cfg: dict, steps: int, custom: np.ndarray | None = None) -> Schedule:
    """LCMScheduler.step in sigma space: x' = c_skip x / sqrt(s^2 + 1) + c_out x0 + s' z, its
    ``prev_sample = sqrt(alphā') denoised + sqrt(1 - alphā') z`` times sqrt(s'^2 + 1) = 1 / sqrt(alphā');
    the last step is ``denoised`` itself (s' = 0, no noise). clip_sample clips x0 before both terms. ``custom``:
    timesteps in place of LCM's own (:func:`_lcm`; no step limit, as diffusers only warns then)."""
    original = cfg["original_inference_steps"]
    if custom is None and steps > original:
        raise TooManySteps(f"LCM runs at most {original} steps for this model (its scheduler's "
                           f"original_inference_steps), got {steps}")
    timesteps, sigmas, c_skip, c_out = _lcm(cfg, steps, custom)
    d = sigmas[1:].copy()  # the noise that brings denoised to the next timestep's level; 0 after the last
    clip = float(cfg["clip_sample_range"]) if cfg["clip_sample"] else math.inf
    zeros = np.zeros(steps)
    return _schedule(timesteps, sigmas, c_skip / (sigmas[:-1] ** 2 + 1) ** 0.5, c_out, zeros, zeros, d,
                     c_out if cfg["clip_sample"] else zeros, (sigmas[0] ** 2 + 1) ** 0.5, 1.0, clip)


def _tcd(cfg: dict, steps: int, custom: np.ndarray | None = None, strength: float = 1.0) -> np.ndarray:
    """TCDScheduler.set_timesteps(steps, strength=strength) (or ``timesteps=custom``) from the config's
    ``original_inference_steps`` (diffusers 0.42.1): (n,) int64, largest first. Its grid is LCM's, k - 1, 2k - 1, ...
    (k = num_train_timesteps // original_inference_steps), cut to the first ``int(original x strength)`` points, then
    ``steps`` of them at indices floor(linspace(0, len, n, endpoint=False)) from the top; ``custom``: its last
    ``int(n x strength)`` (TCD's own strength rule; diffusers' SDXL pipelines call it at strength 1 and cut the steps
    themselves, ``img2img_start``).

    Raises TooManySteps where diffusers raises ValueError (more steps than the grid has points)."""
    original, n_train = cfg["original_inference_steps"], cfg["num_train_timesteps"]
    if custom is not None:
        n = len(custom)
        return np.asarray(custom, np.int64)[n - min(int(n * strength), n):]
    origin = np.arange(1, int(original * strength) + 1) * (n_train // original) - 1
    if steps > original or len(origin) // steps < 1:
        raise TooManySteps(f"TCD runs at most {int(original * strength)} steps for this model (its scheduler's "
                           f"original_inference_steps {original} x strength {strength:g}), got {steps}")
    return origin[::-1][np.floor(np.linspace(0, len(origin), num=steps, endpoint=False)).astype(np.int64)]


def _tcd_schedule(cfg: dict, steps: int, custom: np.ndarray | None = None, gamma: float = TCD_GAMMA) -> Schedule:
    """TCDScheduler.step (eta = ``gamma``) in sigma space. diffusers' step from t to the next timestep t' (0 after the
    last) goes to s = floor((1 - gamma) t') (float32, as torch multiplies the long tensor): ``pred_noised =
    sqrt(alphā_s) x0 + sqrt(1 - alphā_s) eps``, then fresh noise back to t', ``prev = sqrt(alphā_t' / alphā_s)
    pred_noised + sqrt(1 - alphā_t' / alphā_s) z`` (none on the last step, where t' = s = 0 anyway). Divided by
    sqrt(alphā_t') (sigma space, eps = (x - x0) / s_t): x' = x0 + s_s (x - x0) / s_t + sqrt(s_t'^2 - s_s^2) z, so
    a = s_s / s_t, b = 1 - a, d = sqrt(s_t'^2 - s_s^2). No clipping (its step reads neither clip_sample nor
    thresholding); the last step ends at timestep 0's sigma, not 0 (final scale 1 / sqrt(s^2 + 1)). gamma 0 is DDIM
    to t'; at one step gamma changes nothing."""
    if not 0 <= gamma <= 1:
        raise ValueError(f"TCD's gamma must be 0 to 1, got {gamma!r}")
    ac = np.cumprod(1.0 - _betas(cfg), dtype=np.float32).astype(np.float64)  # zero SNR is refused (_refusal)
    timesteps = _tcd(cfg, steps, custom)
    prev = np.concatenate([timesteps[1:], [0]])
    s = np.floor(np.float32(1 - gamma) * prev.astype(np.float32)).astype(np.int64)
    sigma = lambda t: ((1 - ac[t]) / ac[t]) ** 0.5  # noqa: E731
    s_t, s_prev, s_s = sigma(timesteps), sigma(prev), sigma(s)
    a, zeros = s_s / s_t, np.zeros(len(timesteps))
    d = np.sqrt(np.maximum(s_prev**2 - s_s**2, 0.0))
    sigmas = np.concatenate([s_t, [s_prev[-1]]])
    return _schedule(timesteps, sigmas, a, 1 - a, zeros, zeros, d, zeros, (sigmas[0] ** 2 + 1) ** 0.5,
                     1 / (sigmas[-1] ** 2 + 1) ** 0.5)


def _schedule(timesteps, sigmas, a, b, c, c2, d, e, init, final, clip=math.inf, history=None) -> Schedule:
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return Schedule(f32(timesteps), f32(sigmas), f32(a), f32(b), f32(c), f32(c2), f32(d), f32(e), float(init),
                    float(final), float(clip), history=history)
