"""Per-step progress, live previews and Stop, on the shipped tiny-shapes model over 4 CPU devices.

The engines here share one compiled program (the executable cache serves the second: the config's preview_every
is not part of the program, and the previews-off tests take the session's tiny-shapes engine with it set to 0), so
only the tests marked slow compile another.
"""

import json
import os
import threading
import time

import numpy as np
import pytest

from sdxl_engine.checkpoint import builtin
from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.local import Engine
from sdxl_engine.engine.previews import FACTORS_FILE, SDXL_BIAS, SDXL_FACTORS, fit_latent_rgb, latent_rgb_for
from sdxl_engine.engine.steps import Stopped
from sdxl_engine.engine.validation import GenerateRequest

pytestmark = pytest.mark.engine

CACHE_ENV = ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")


def shapes_engine(**settings) -> Engine:
    config = EngineConfig.load({"model": "tiny-shapes", **settings},
                               environ={k: v for k, v in os.environ.items() if k in CACHE_ENV})
    return Engine(config, log=lambda *_: None).start()


@pytest.fixture(scope="module")
def every_step():
    """tiny-shapes with a preview at every step the program can send one."""
    return shapes_engine(preview_every=1)


@pytest.fixture
def no_previews(tiny_shapes_engine, monkeypatch):
    """The session's tiny-shapes engine with previews off for the test's length: preview_every is read per request
    (engine/local.py), so this is what an engine started with it does, without a start of its own."""
    import dataclasses

    monkeypatch.setattr(tiny_shapes_engine, "config", dataclasses.replace(tiny_shapes_engine.config, preview_every=0))
    return tiny_shapes_engine


def request(steps=8, seed=3, prompt="a red circle on a blue background"):
    return GenerateRequest(prompt, seed=seed, num_inference_steps=steps)


def pooled(images: np.ndarray, f: int) -> np.ndarray:
    n, height, width, _ = images.shape
    return images.astype(np.float64).reshape(n, height // f, f, width // f, f, 3).mean(axis=(2, 4))


def test_steps_arrive_in_order_with_previews_and_the_same_images(every_step, no_previews):
    events = []
    result = every_step.generate(request(), on_step=events.append)
    assert [(e.step, e.steps) for e in events] == [(k, 8) for k in range(1, 9)]
    assert all(a.elapsed_s <= b.elapsed_s for a, b in zip(events, events[1:]))
    # x0 goes to the host for steps 2..7: step 1 is asked for by no earlier call, step 8's images follow
    assert [e.step for e in events if e.preview is not None] == list(range(2, 8))
    previews = [e.preview for e in events if e.preview is not None]
    assert all(p.shape == (4, 16, 16, 3) and p.dtype == np.uint8 for p in previews)
    # the estimate sharpens towards the image: the last preview is closer to it than the first
    target = pooled(result.images, 4)
    errors = [float(np.abs(p.astype(np.float64) - target).mean()) for p in previews]
    assert errors[-1] < errors[0] and errors[-1] < 40, errors  # bound: the fit's own error (latent_rgb.json's note)
    plain = no_previews.generate(request(), on_step=events.append)
    assert np.array_equal(plain.images, result.images)  # previews on and off: the same bytes


def test_no_preview_setting_sends_no_latents(no_previews):
    events = []
    no_previews.generate(request(steps=12), on_step=events.append)
    steps = [e.step for e in events]
    # the first two steps call (the second measures the pace), then about every steps.REPORT_INTERVAL_S, and
    # the last: in order, ending at 12, never a latent
    assert steps[:2] == [1, 2] and steps[-1] == 12 and steps == sorted(set(steps))
    assert all(e.preview is None for e in events)


def test_stop_after_step_5_of_50_ends_within_a_step_and_frees_the_engine(every_step):
    events, stop_at = [], []

    def should_stop():
        if len(events) >= 5 and not stop_at:
            stop_at.append(time.perf_counter())
        return len(events) >= 5

    started = time.perf_counter()
    with pytest.raises(Stopped, match=r"^stopped after step [56] of 50$"):
        every_step.generate(request(steps=50), on_step=events.append, should_stop=should_stop)
    ended = time.perf_counter()
    assert 5 <= len(events) <= 6  # the step running when the flag rose, no more
    step_s = events[-1].elapsed_s / events[-1].step
    assert ended - stop_at[0] < 3 * step_s + 0.5  # the rest of one step, no VAE decode of discarded latents
    assert ended - started < 20 * step_s + 5  # nowhere near the 50 steps
    after = every_step.generate(request(steps=4))  # the engine is free: no wait, and a whole request
    assert after.timings["queue"] < 3 * step_s and after.images.shape == (4, 64, 64, 3)


def test_a_stop_before_the_program_runs_nothing(every_step):
    events = []
    with pytest.raises(Stopped, match="^stopped before it started$"):
        every_step.generate(request(), on_step=events.append, should_stop=lambda: True)
    assert events == []


def test_sdxl_factors_are_comfyuis_and_tiny_shapes_ships_its_own():
    sdxl = latent_rgb_for("", 4)
    assert sdxl.factors.tolist() == np.float32(SDXL_FACTORS).tolist()
    assert sdxl.bias.tolist() == np.float32(SDXL_BIAS).tolist()
    assert SDXL_FACTORS[0] == (0.3651, 0.4232, 0.4341) and SDXL_BIAS == (0.1084, -0.0175, -0.0011)
    # a zero latent is the bias: (0.1084 / 2 + 0.5) * 255 = 141.3 -> 141 for red
    assert sdxl(np.zeros((1, 4, 2, 2), np.float32))[0, 0, 0].tolist() == [141, 125, 127]
    assert latent_rgb_for("", 16) is None
    shipped = latent_rgb_for(str(builtin.TINY_SHAPES_DIR), 4)
    assert shipped.source.endswith(FACTORS_FILE) and shipped.factors.shape == (4, 3)
    assert json.loads((builtin.TINY_SHAPES_DIR / FACTORS_FILE).read_text())["_note"].startswith("latents -> RGB")


def test_bad_factors_file_is_refused_with_its_path(tmp_path):
    (tmp_path / FACTORS_FILE).write_text(json.dumps({"factors": [[1, 2, 3]], "bias": [0, 0, 0]}))
    with pytest.raises(ValueError, match=r"latent_rgb.json: expected factors \(4, 3\) and bias \(3,\), got \(1, 3\)"):
        latent_rgb_for(str(tmp_path), 4)


def test_least_squares_fit_recovers_a_known_map():
    rng = np.random.default_rng(0)
    factors, bias = rng.normal(0, 0.2, (4, 3)), np.array([0.1, -0.2, 0.05])
    latents = rng.normal(0, 1, (6, 4, 8, 8)).astype(np.float32)
    rgb = np.einsum("bchw,cr->bhwr", latents, factors) + bias  # (6, 8, 8, 3) in about [-1, 1]
    images = np.repeat(np.repeat(rgb, 4, axis=1), 4, axis=2)  # each latent pixel a 4x4 block
    images = (images + 1) * 127.5  # the fit pools and rescales uint8-range values; floats keep it exact
    fitted, fitted_bias = fit_latent_rgb(latents, images)
    assert np.allclose(fitted, factors, atol=1e-4) and np.allclose(fitted_bias, bias, atol=1e-4)


@pytest.mark.slow  # compiles the program without the hook
def test_images_are_the_same_bytes_with_the_hook_off(every_step):
    off = shapes_engine(progress=False)
    assert off.programs.compiled and not any(shape.step_hook for shape in off.programs.compiled)
    events = []
    with_hook = every_step.generate(request(seed=11), on_step=events.append)
    without = off.generate(request(seed=11), on_step=events.append, should_stop=lambda: False)
    assert np.array_equal(with_hook.images, without.images)
    assert len(events) == 8  # only the hooked run reported steps


@pytest.mark.slow  # compiles a second size bucket
def test_precompiled_bucket_needs_no_compile_later(every_step):
    width, height = next(size for size in every_step.limits.sizes if size != every_step.limits.default_size)
    assert not every_step.is_compiled(width, height)
    done = threading.Event()
    every_step.programs.precompile([every_step.planner.shape(width, height)], done)  # what start-up runs after ready
    assert done.wait(300)
    count = every_step.compile_count
    stages = []
    result = every_step.generate(GenerateRequest("a red circle", seed=1, num_inference_steps=2, width=width,
                                                 height=height), progress=stages.append)
    assert every_step.compile_count == count and "compiling" not in stages
    assert result.images.shape == (4, height, width, 3)
