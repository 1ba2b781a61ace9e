"""Reference sigmas of A1111's schedule types, written to tests/fixtures/schedule-types.json.

``python -m tools.schedule_reference`` (seconds, CPU, no model). The functions below are faithful numpy ports of
AUTOMATIC1111/stable-diffusion-webui ``modules/sd_schedulers.py`` (``uniform``, ``sgm_uniform``,
``simple_scheduler``, ``beta_scheduler``; AGPL-3.0) and crowsonkb/k-diffusion ``k_diffusion/sampling.py``
(``get_sigmas_karras``, ``get_sigmas_exponential``, ``append_zero``) and ``k_diffusion/external.py``
(``DiscreteSchedule.get_sigmas``, ``sigma_to_t``, ``t_to_sigma``; MIT), which use torch: torch is not installed
here or in CI, so each torch call is its numpy equivalent, line by line, float32 where torch's tensors are
(the model's sigmas, linspace) and Python floats where A1111 uses them. ``beta_scheduler`` calls
``scipy.stats.beta.ppf`` as A1111 does. The model's sigmas come from SDXL base's scheduler config
(scaled_linear, 0.00085 to 0.012, 1000 steps), computed here from the config, not by the engine.

The runtime never imports this module; tests/program/test_schedulers_types.py compares the engine's
``schedulers.schedule_sigmas`` and ``make_schedule`` against the fixture.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "sdxl_engine/checkpoint/configs/sdxl-base-1.0/scheduler/scheduler_config.json"
OUT = ROOT / "tests/fixtures/schedule-types.json"
STEPS = (20, 7)
BETA_ALPHA = BETA_BETA = 0.6  # A1111 shared_options: beta_dist_alpha, beta_dist_beta defaults


def model_sigmas(config: dict) -> np.ndarray:
    """k-diffusion's ``DiscreteEpsDDPMDenoiser.sigmas``: ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5, float32,
    from the LDM's scaled_linear betas (ldm make_beta_schedule: linspace of square roots, squared)."""
    assert config["beta_schedule"] == "scaled_linear", config["beta_schedule"]
    n = config["num_train_timesteps"]
    betas = np.linspace(config["beta_start"] ** 0.5, config["beta_end"] ** 0.5, n, dtype=np.float64) ** 2
    alphas_cumprod = np.cumprod(1.0 - betas).astype(np.float32)  # A1111 holds them as a float32 tensor
    return (((1 - alphas_cumprod) / alphas_cumprod) ** 0.5).astype(np.float32)


def append_zero(x):
    return np.concatenate([x, np.zeros(1, x.dtype)])


def sigma_to_t(sigma: float, sigmas: np.ndarray) -> float:
    log_sigmas = np.log(sigmas)
    log_sigma = np.float32(math.log(sigma))
    dists = log_sigma - log_sigmas[:, None]
    low_idx = min(int(np.cumsum(dists >= 0, axis=0).argmax(axis=0)[0]), log_sigmas.shape[0] - 2)
    high_idx = low_idx + 1
    low, high = log_sigmas[low_idx], log_sigmas[high_idx]
    w = min(max((low - log_sigma) / (low - high), 0.0), 1.0)
    return float((1 - w) * low_idx + w * high_idx)


def t_to_sigma(t: np.ndarray, sigmas: np.ndarray) -> np.ndarray:
    t = np.asarray(t, np.float32)
    log_sigmas = np.log(sigmas)
    low_idx, high_idx, w = np.floor(t).astype(np.int64), np.ceil(t).astype(np.int64), t - np.floor(t)
    return np.exp((1 - w) * log_sigmas[low_idx] + w * log_sigmas[high_idx])


def get_sigmas(n: int, sigmas: np.ndarray) -> np.ndarray:  # DiscreteSchedule.get_sigmas: A1111's ``uniform``
    t = np.linspace(len(sigmas) - 1, 0, n, dtype=np.float32)
    return append_zero(t_to_sigma(t, sigmas))


def get_sigmas_karras(n, sigma_min, sigma_max, rho=7.0):
    ramp = np.linspace(0, 1, n, dtype=np.float32)
    min_inv_rho = sigma_min ** (1 / rho)
    max_inv_rho = sigma_max ** (1 / rho)
    return append_zero((max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho)


def get_sigmas_exponential(n, sigma_min, sigma_max):
    return append_zero(np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), n, dtype=np.float32)))


def sgm_uniform(n, sigma_min, sigma_max, sigmas):
    start = sigma_to_t(sigma_max, sigmas)
    end = sigma_to_t(sigma_min, sigmas)
    sigs = [float(t_to_sigma(ts, sigmas)) for ts in np.linspace(start, end, n + 1, dtype=np.float32)[:-1]]
    sigs += [0.0]
    return np.array(sigs, np.float32)


def simple_scheduler(n, sigmas):
    sigs = []
    ss = len(sigmas) / n
    for x in range(n):
        sigs += [float(sigmas[-(1 + int(x * ss))])]
    sigs += [0.0]
    return np.array(sigs, np.float32)


def beta_scheduler(n, sigma_min, sigma_max):
    timesteps = 1 - np.linspace(0, 1, n)
    timesteps = [stats.beta.ppf(x, BETA_ALPHA, BETA_BETA) for x in timesteps]
    sigmas = [sigma_min + (x * (sigma_max - sigma_min)) for x in timesteps]
    sigmas += [0.0]
    return np.array(sigmas, np.float32)


def reference(n: int, sigmas: np.ndarray) -> dict[str, list[float]]:
    """{schedule type: (n + 1) sigmas} as A1111's KDiffusionSampler.get_sigmas makes them (sigma_min, sigma_max:
    the model's first and last sigmas)."""
    sigma_min, sigma_max = float(sigmas[0]), float(sigmas[-1])
    out = {"uniform": get_sigmas(n, sigmas), "karras": get_sigmas_karras(n, sigma_min, sigma_max),
           "exponential": get_sigmas_exponential(n, sigma_min, sigma_max),
           "sgm_uniform": sgm_uniform(n, sigma_min, sigma_max, sigmas), "simple": simple_scheduler(n, sigmas),
           "beta": beta_scheduler(n, sigma_min, sigma_max)}
    return {name: [float(v) for v in values] for name, values in out.items()}


def main() -> None:
    config = json.loads(CONFIG.read_text())
    sigmas = model_sigmas(config)
    fixture = {"source": "tools/schedule_reference.py: numpy ports of A1111 modules/sd_schedulers.py and "
                         "k-diffusion sampling.py / external.py, SDXL base's scheduler config",
               "sigmas": {str(n): reference(n, sigmas) for n in STEPS}}
    OUT.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
