"""Fast checks of the pieces that need no compiled program."""

import numpy as np
import pytest

from sdxl_engine.config import ConfigError, EngineConfig


def test_config_env_and_overrides():
    cfg = EngineConfig.load({"num_inference_steps": "8"}, environ={"SDXL_CPU_DEVICES": "2", "SDXL_GUIDANCE_SCALE": "3.5"})
    assert (cfg.num_inference_steps, cfg.cpu_devices, cfg.guidance_scale) == (8, 2, 3.5)
    with pytest.raises(ConfigError, match="unknown config key 'stepz'"):
        EngineConfig.load({"stepz": 3}, environ={})
    with pytest.raises(ConfigError, match="cpu_devices must be a whole number"):
        EngineConfig.load(environ={"SDXL_CPU_DEVICES": "four"})
    with pytest.raises(ConfigError, match="exceeds max_inference_steps"):
        EngineConfig.load({"num_inference_steps": 60}, environ={})
    with pytest.raises(Exception):
        cfg.model = "other"  # frozen


def test_tokenizer_vocabulary_is_the_projects():
    from sdxl_engine.checkpoint.builtin import build_vocab

    vocab, merges = build_vocab()
    assert list(vocab)[-2:] == ["<|startoftext|>", "<|endoftext|>"]  # end token has the largest id
    for word in ("red", "circle", "square", "blue"):
        assert word + "</w>" in vocab


def test_size_buckets_scaled_to_native():
    from sdxl_engine.engine.validation import size_buckets

    assert size_buckets(1024, 64)[:3] == ((1024, 1024), (1152, 896), (896, 1152))
    assert all(w % 8 == 0 and h % 8 == 0 for w, h in size_buckets(64, 8))


def test_a1111_parameters_roundtrip():
    from sdxl_engine.serving.images import a1111_parameters, parse_a1111_parameters

    text = a1111_parameters("a red circle", "blurry", 20, 7.0, 42, 64, 64, "tiny-random")
    assert text == "a red circle\nNegative prompt: blurry\nSteps: 20, Sampler: Euler, CFG scale: 7, Seed: 42, Size: 64x64, Model: tiny-random"
    parsed = parse_a1111_parameters(text)
    assert parsed["Seed"] == "42" and parsed["negative_prompt"] == "blurry" and parsed["Size"] == "64x64"
    text = a1111_parameters("a red circle", "", 8, 1.0, 7, 64, 64, "tiny-shapes", {"Style": "Anime"}, "DPM++ 2M Karras")
    assert text == "a red circle\nSteps: 8, Sampler: DPM++ 2M Karras, CFG scale: 1, Seed: 7, Size: 64x64, Model: tiny-shapes, Style: Anime"
    assert parse_a1111_parameters(text)["Sampler"] == "DPM++ 2M Karras"


@pytest.mark.parametrize("shape", [(1, 1, 3), (37, 53, 3), (64, 64, 3)])
def test_png_bytes_is_lossless_and_carries_its_parameters(shape):
    import io

    from PIL import Image

    from sdxl_engine.serving.images import encode_pngs, png_bytes

    image = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    for text in ("a red circle\nSteps: 20, Sampler: Euler", "café 🔴 ünïcödé"):  # Latin-1 (tEXt) and UTF-8 (iTXt)
        decoded = Image.open(io.BytesIO(png_bytes(image, text)))
        assert np.array_equal(np.asarray(decoded), image) and decoded.text["parameters"] == text
    pngs = encode_pngs(np.stack([image, 255 - image]), ["one", "two"])
    assert [Image.open(io.BytesIO(p)).text["parameters"] for p in pngs] == ["one", "two"]
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(pngs[1]))), 255 - image)


def test_missing_model_directory_gives_clear_error(tmp_path):
    from sdxl_engine.checkpoint.loading import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match="neither a built-in name, an existing directory nor a hub id"):
        load_model(str(tmp_path / "nope"), dtype="auto", platform="cpu", cache_dir=str(tmp_path))
    with pytest.raises(ModelLoadError, match="no model_index.json"):
        load_model(str(tmp_path), dtype="auto", platform="cpu", cache_dir=str(tmp_path))


def test_batch_must_divide_over_devices():
    import jax

    from sdxl_engine.program.sharding import ShardingError, check_batch, make_mesh

    mesh = make_mesh(jax.devices()[:1] * 1)
    check_batch(4, mesh)
    if len(jax.devices()) >= 4:
        with pytest.raises(ShardingError, match=r"images_per_request \(3\) must be a positive multiple of the device count \(4\)"):
            check_batch(3, make_mesh(jax.devices()[:4]))


@pytest.mark.parametrize("env, message", [
    ({"SDXL_GUIDANCE_SCALE": "-5"}, "guidance_scale must be between 0 and 50"),
    ({"SDXL_GUIDANCE_SCALE": "nan"}, "guidance_scale must be between 0 and 50"),
    ({"SDXL_MAX_SEED": "-3"}, "max_seed must be between 0"),
    ({"SDXL_WIDTH": "63"}, "width must be 0 .* or a multiple of 8"),
    ({"SDXL_MAX_QUEUE_SIZE": "0"}, "max_queue_size must be at least 1"),
])
def test_bad_settings_are_refused_at_load(env, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.load(environ=env)


def test_write_new_never_replaces_a_file(tmp_path):
    import threading

    from sdxl_engine.serving.images import write_new

    (tmp_path / "seed1-a-red-circle.png").write_bytes(b"first")
    assert write_new(b"second", tmp_path, "seed1-a-red-circle").name == "seed1-a-red-circle-2.png"
    assert (tmp_path / "seed1-a-red-circle.png").read_bytes() == b"first"
    paths = []
    threads = [threading.Thread(target=lambda i=i: paths.append(write_new(bytes([i]) * 1000, tmp_path, "same")))
               for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 16 and sorted(p.read_bytes()[0] for p in paths) == list(range(16))
    assert not list(tmp_path.glob(".*"))  # no temporary file left


@pytest.mark.parametrize("text, expected", [
    ("a red circle", "a-red-circle"), ("A Red Circle, on a blue background!", "a-red-circle-on-a-blue"),
    ("Café crème", "cafe-creme"), ("🔴🔵", "image"), ("", "image"), ("../../etc/passwd", "etc-passwd"),
])
def test_slug_is_a_safe_file_name_part(text, expected):
    from sdxl_engine.serving.images import slug

    assert slug(text) == expected


@pytest.mark.parametrize("environ, expected, note", [
    ({}, {"jax_num_cpu_devices": 4, "jax_compilation_cache_dir": "/c"}, None),
    ({"JAX_NUM_CPU_DEVICES": "1"}, {"jax_compilation_cache_dir": "/c"},
     "jax_num_cpu_devices: JAX_NUM_CPU_DEVICES=1 is set, so JAX's own setting wins over the engine's 4"),
    ({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2"},
     {"jax_compilation_cache_dir": "/c"}, "XLA_FLAGS has --xla_force_host_platform_device_count=2, so XLA's setting "
                                          "wins over the engine's cpu_devices=4"),
    ({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}, {"jax_num_cpu_devices": 4}, None),
    ({"JAX_COMPILATION_CACHE_DIR": "/x"}, {"jax_num_cpu_devices": 4},
     "jax_compilation_cache_dir: JAX_COMPILATION_CACHE_DIR=/x is set, so JAX's own setting wins over the engine's '/c'"),
    ({"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}, {"jax_compilation_cache_dir": "/c"},
     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=2 is set"),
])
def test_jax_own_variables_win_and_say_so(environ, expected, note):
    from sdxl_engine.config import plan_jax_options

    plan, notes = plan_jax_options(EngineConfig.load({"compile_cache_dir": "/c", "cpu_devices": 4}, environ={}), environ)
    assert {k: v for k, v in plan.items() if k in expected} == expected
    assert len(notes) == (note is not None) and all(note in line for line in notes)
    decided_by_jax = {line.split("] ")[1].split(":")[0] for line in notes}
    assert decided_by_jax.isdisjoint(plan)  # what JAX's variable decides is never set by the engine


def test_engine_start_honours_jax_variables(tmp_path):
    """In a fresh process: XLA_FLAGS' device count and JAX_COMPILATION_CACHE_DIR are what JAX uses."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    code = ("import jax; from sdxl_engine.config import EngineConfig, apply_jax_options; "
            "d = apply_jax_options(EngineConfig.load()); print(len(jax.devices()), d)")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "SDXL_CPU_DEVICES": "4",
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-own"), "SDXL_COMPILE_CACHE_DIR": str(tmp_path / "ours")}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[-1] == f"2 {tmp_path / 'jax-own'}", out
    assert len([line for line in lines if "wins over the engine's" in line]) == 2, lines


def test_no_hint_asks_for_the_old_flax_revision():
    """SDXL base's Flax weights are on its main branch: nothing tells users to pass refs/pr/95."""
    from tests.helpers import ROOT

    for path in [ROOT / "README.md", ROOT / "app.py", *(ROOT / "sdxl_engine").rglob("*.py")]:
        assert "refs/pr/" not in path.read_text(), path


def test_readme_first_python_example_works_with_the_default_model():
    """The first thing a user tries: an in-vocabulary prompt, no style (styles pull tiny-shapes off the prompt)."""
    import re

    from tests.helpers import ROOT
    from sdxl_engine.checkpoint.builtin import TINY_SHAPES_DIR, unknown_words

    readme = (ROOT / "README.md").read_text()
    example = readme[readme.index("```python"):]
    call = example[:example.index("```", 3)]
    prompt = re.search(r'prompt="([^"]+)"', call)[1]
    assert unknown_words(prompt, frozenset((TINY_SHAPES_DIR / "vocabulary.txt").read_text().split())) == []
    assert "style=" not in call


def test_waiting_for_the_engine_names_its_stage_or_its_error():
    import threading
    from types import SimpleNamespace

    from sdxl_engine.engine.local import EngineNotReady, wait_for_start

    starting = SimpleNamespace(ready=threading.Event(), stage="compiling 64x64", error=None)
    with pytest.raises(EngineNotReady, match=r"^the engine is still compiling 64x64 after 0.01 s$"):
        wait_for_start(starting, 0.01)
    starting.ready.set()
    wait_for_start(starting, 0.01)  # ready: returns
    failed = SimpleNamespace(ready=threading.Event(), stage="failed", error=ValueError("no such model"))
    failed.ready.set()
    with pytest.raises(EngineNotReady, match=r"^the engine failed to start: no such model$"):
        wait_for_start(failed, None)
