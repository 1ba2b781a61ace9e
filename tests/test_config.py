"""Settings: environment and overrides, refusals at load, JAX's own variables."""

import dataclasses
import os
import subprocess
import sys

import pytest

from sdxl_engine.config import ConfigError, EngineConfig, plan_jax_options
from tests.helpers import ROOT


def test_config_env_and_overrides():
    cfg = EngineConfig.load({"num_inference_steps": "8"},
                            environ={"SDXL_CPU_DEVICES": "2", "SDXL_GUIDANCE_SCALE": "3.5"})
    assert (cfg.num_inference_steps, cfg.cpu_devices, cfg.guidance_scale) == (8, 2, 3.5)
    with pytest.raises(ConfigError, match="unknown config key 'stepz'"):
        EngineConfig.load({"stepz": 3}, environ={})
    with pytest.raises(ConfigError, match="cpu_devices must be a whole number"):
        EngineConfig.load(environ={"SDXL_CPU_DEVICES": "four"})
    with pytest.raises(ConfigError, match="exceeds max_inference_steps"):
        EngineConfig.load({"num_inference_steps": 60}, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = "other"  # frozen


@pytest.mark.parametrize("env, message", [
    ({"SDXL_GUIDANCE_SCALE": "-5"}, "guidance_scale must be between 0 and 50"),
    ({"SDXL_GUIDANCE_SCALE": "nan"}, "guidance_scale must be between 0 and 50"),
    ({"SDXL_MAX_SEED": "-3"}, "max_seed must be between 0"),
    ({"SDXL_WIDTH": "63"}, "width must be 0 .* or a multiple of 8"),
    ({"SDXL_MAX_QUEUE_SIZE": "0"}, "max_queue_size must be at least 1"),
    ({"SDXL_COMPILE_THREADS": "0"}, "compile_threads must be at least 1"),
])
def test_bad_settings_are_refused_at_load(env, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.load(environ=env)


@pytest.mark.parametrize("environ, expected, note", [
    ({}, {"jax_num_cpu_devices": 4, "jax_compilation_cache_dir": "/c"}, None),
    ({"JAX_NUM_CPU_DEVICES": "1"}, {"jax_compilation_cache_dir": "/c"},
     "jax_num_cpu_devices: JAX_NUM_CPU_DEVICES=1 is set, so JAX's own setting wins over the engine's 4"),
    ({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2"},
     {"jax_compilation_cache_dir": "/c"}, "XLA_FLAGS has --xla_force_host_platform_device_count=2, so XLA's setting "
                                          "wins over the engine's cpu_devices=4"),
    ({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}, {"jax_num_cpu_devices": 4}, None),
    ({"JAX_COMPILATION_CACHE_DIR": "/x"}, {"jax_num_cpu_devices": 4},
     "jax_compilation_cache_dir: JAX_COMPILATION_CACHE_DIR=/x is set, so JAX's own setting wins over the "
     "engine's '/c'"),
    ({"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}, {"jax_compilation_cache_dir": "/c"},
     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=2 is set"),
])
def test_jax_own_variables_win_and_say_so(environ, expected, note):
    plan, notes = plan_jax_options(EngineConfig.load({"compile_cache_dir": "/c", "cpu_devices": 4}, environ={}),
                                   environ)
    assert {k: v for k, v in plan.items() if k in expected} == expected
    assert len(notes) == (note is not None) and all(note in line for line in notes)
    decided_by_jax = {line.split("] ")[1].split(":")[0] for line in notes}
    assert decided_by_jax.isdisjoint(plan)  # what JAX's variable decides is never set by the engine


def test_engine_start_honours_jax_variables(tmp_path):
    """In a fresh process: XLA_FLAGS' device count and JAX_COMPILATION_CACHE_DIR are what JAX uses."""
    code = ("import jax; from sdxl_engine.config import EngineConfig, apply_jax_options; "
            "d = apply_jax_options(EngineConfig.load(), log=print); print(len(jax.devices()), d)")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "SDXL_CPU_DEVICES": "4",
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-own"), "SDXL_COMPILE_CACHE_DIR": str(tmp_path / "ours")}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[-1] == f"2 {tmp_path / 'jax-own'}", out
    assert len([line for line in lines if "wins over the engine's" in line]) == 2, lines


def test_the_config_imports_nothing_above_it():
    """config.py is the lowest layer (issue #59: it imported program/schedulers for the sampler names, the one
    arrow that ran back up): importing it loads no other sdxl_engine module and no JAX."""
    import subprocess
    import sys

    code = ("import sys, sdxl_engine.config; print(sorted(m for m in sys.modules if m.startswith('sdxl_engine.') "
            "and m != 'sdxl_engine.config' or m == 'jax'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
