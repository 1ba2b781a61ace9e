"""Random weights for sdxl-base-random: the modules' statistics, made in place, host peak near the params' size."""

import copy
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdxl_engine.checkpoint import builtin
from sdxl_engine.models import build_component
from sdxl_engine.models.random_weights import init_spec, random_params
from tests.helpers import ROOT

pytestmark = pytest.mark.engine


def tiny_components():
    configs = builtin.component_configs(builtin.TINY, len(builtin.build_vocab()[0]))
    return {name: build_component(name, cfg) for name, cfg in configs.items()}


@pytest.mark.slow  # runs every tiny component's own initialisers, one op at a time
def test_every_tensor_has_the_mean_and_spread_of_the_modules_own_initialiser():
    """init_spec's rules against Component.init (the modules' initialisers) on every tensor of the tiny model."""
    components = tiny_components()
    ours = random_params(components, jnp.float32, seed=3)
    for name, component in components.items():
        reference = component.init(jax.random.key(0))
        for key, shape in component.shapes.items():
            mine, theirs = np.asarray(ours[name][key]), np.asarray(reference[key])
            assert mine.shape == theirs.shape == tuple(shape), key
            mean, std = init_spec(key, shape)
            if std == 0:  # constants: norms' weights, biases
                assert np.all(theirs == mean) and np.all(mine == mean), key
            elif theirs.size >= 256:  # enough samples for the spread to be ±20 %
                assert theirs.std() == pytest.approx(std, rel=0.2), key
                assert mine.std() == pytest.approx(std, rel=0.2), key
                assert abs(mine.mean()) < 4 * std / math.sqrt(mine.size), key


def test_tensors_differ_and_the_seed_decides():
    components = tiny_components()
    a, b = random_params(components, jnp.bfloat16, seed=0), random_params(components, jnp.bfloat16, seed=1)
    unet = components["unet"]
    keys = [k for k, s in unet.shapes.items() if init_spec(k, s)[1] > 0]
    assert all(str(a["unet"][k].dtype) == "bfloat16" for k in unet.shapes)
    assert not np.array_equal(np.asarray(a["unet"][keys[0]]), np.asarray(b["unet"][keys[0]]))
    same_shape = [k for k in keys if unet.shapes[k] == unet.shapes[keys[1]]]
    if len(same_shape) > 1:  # two tensors of one shape are not copies of each other
        assert not np.array_equal(np.asarray(a["unet"][same_shape[0]]), np.asarray(a["unet"][same_shape[1]]))
    again = random_params(components, jnp.bfloat16, seed=0)
    assert np.array_equal(np.asarray(again["unet"][keys[0]]), np.asarray(a["unet"][keys[0]]))


def test_a_parameter_no_rule_covers_is_an_error():
    with pytest.raises(ValueError, match="no initialiser rule for parameter 'x.scale' of shape"):
        init_spec("x.scale", (3, 3, 3))


# SDXL base's architecture at reduced width (UNet 2/5: 128-256-512 channels, full depth; text
# encoders and VAE narrower still): ~380 M parameters, 0.77 GB in bfloat16, made in a fresh process.
PEAK_SCRIPT = """
import copy, json, sys
import jax, jax.numpy as jnp, numpy as np
from sdxl_engine.checkpoint import builtin
from sdxl_engine.models import build_component
from sdxl_engine.models.random_weights import random_params

def rss(field):  # bytes, from /proc/self/status
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field + ":"))

configs = json.loads(sys.argv[1])
components = {n: build_component(n, c) for n, c in configs.items()}
jax.device_put(np.zeros(4, np.float32)).block_until_ready()
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
base = rss("VmRSS")
params = random_params(components, jnp.bfloat16)
jax.block_until_ready(params)
print(json.dumps({"base": base, "peak": rss("VmHWM"),
                  "params_bytes": sum(v.nbytes for c in params.values() for v in c.values())}))
"""


def reduced_width_configs() -> dict:
    configs = copy.deepcopy(builtin.SDXL_BASE_CONFIGS)
    configs["unet"].update(block_out_channels=[128, 256, 512], attention_head_dim=[2, 4, 8], cross_attention_dim=160,
                           projection_class_embeddings_input_dim=6 * 256 + 80)
    for name in ("text_encoder", "text_encoder_2"):
        configs[name].update(hidden_size=80, intermediate_size=320, num_attention_heads=2)
    configs["text_encoder_2"]["projection_dim"] = 80
    configs["vae"].update(block_out_channels=[32, 64, 128, 128])
    return configs


@pytest.mark.slow  # a fresh process fills over 600 MB of params
def test_random_init_peak_memory_stays_near_the_params_size():
    """Made in bfloat16 in place: the process's peak grows by at most 1.3x the params' bytes
    (the real-checkpoint loader's rule; compiling the fill kernels is the rest)."""
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, json.dumps(reduced_width_configs())], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["params_bytes"] > 600e6
    assert r["peak"] - r["base"] <= 1.3 * r["params_bytes"], r
