"""Several models in one engine (docs/models.md): each model's images are its own engine's, an unknown name is refused
by name, a switch compiles nothing, a dropped model reloads to the same images, requests for a resident model never
wait for another's load, memory stays flat over many switches.

Two models of one architecture: the built-in tiny-random (seed 0) and tiny-random made with seed 1
(builtin.create_tiny_random), so they share every program and differ in every weight.
"""

import gc
import os
import threading
import time

import numpy as np
import pytest

from sdxl_engine.checkpoint.builtin import create_tiny_random
from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.errors import ModelUnavailable
from sdxl_engine.engine.local import Engine
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest

pytestmark = pytest.mark.engine

CACHES = ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")


def start(**settings) -> Engine:
    config = EngineConfig.load({"cpu_devices": 4, "max_run_seconds": 0, **settings},
                               environ={k: v for k, v in os.environ.items() if k in CACHES})
    return Engine(config, log=lambda *_: None).start()


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """tiny-random's architecture with other weights (seed 1), as a diffusers folder named tiny-random-b."""
    return str(create_tiny_random(tmp_path_factory.mktemp("models") / "tiny-random-b", seed=1))


@pytest.fixture(scope="module")
def single_b(other):
    return start(model=other)


@pytest.fixture(scope="module")
def two(other):
    """Both models, room for one on the devices: every switch drops one and loads the other."""
    return start(model="tiny-random", models=other, max_resident_models=1)


def request(model=None, seed=3, steps=2, **kwargs) -> GenerateRequest:
    return GenerateRequest("a red circle", seed=seed, num_inference_steps=steps, model=model, **kwargs)


def test_each_models_images_are_its_own_engines(two, engine, single_b):
    assert two.model_names() == ["tiny-random", "tiny-random-b"] and two.default_model == "tiny-random"
    a, b = two.generate(request()), two.generate(request("tiny-random-b"))
    assert (a.model, b.model) == ("tiny-random", "tiny-random-b")
    np.testing.assert_array_equal(a.images, engine.generate(request()).images)
    np.testing.assert_array_equal(b.images, single_b.generate(request()).images)
    assert np.abs(a.images.astype(int) - b.images).mean() > 10  # two models, two sets of images
    np.testing.assert_array_equal(two.generate(request("tiny-random")).images, a.images)  # by name as by default
    resident = two.residency.peek("tiny-random")
    assert resident.state.loras.base is resident.params  # its own LoRA merger, over its own weights


def test_an_unknown_model_is_refused_by_name_listing_the_loaded_ones(two):
    for name in ("sdxl-turbo", "", 3):
        with pytest.raises(InvalidRequest) as err:
            two.generate(request(name))
        assert err.value.field == "model"
    with pytest.raises(InvalidRequest, match=r"unknown model 'sdxl-turbo'; this server offers: tiny-random, "
                                             r"tiny-random-b"):
        two.generate(request("sdxl-turbo"))
    assert two.limits_for(None) is two.limits
    assert two.generate(request(" tiny-random-b ", steps=1)).model == "tiny-random-b"  # spaces around a name


def test_the_catalogue_the_fronts_list(two, other):
    """What /sdapi/v1/sd-models and a dropdown read: every model, the default first, titles with A1111's hash once
    the background hashing reached it; a client's title or bare name found."""
    import hashlib
    from pathlib import Path

    infos = two.models_info()
    assert [(i.name, i.default) for i in infos] == [("tiny-random", True), ("tiny-random-b", False)]
    two.catalogue.wait_hashes(60)
    b = two.models_info()[1]
    files = sorted(Path(other).rglob("*.safetensors"), key=lambda p: p.relative_to(other).as_posix())
    assert b.sha256 == hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()
    assert b.title == f"tiny-random-b [{b.sha256[:10]}]" and b.filename == str(Path(other).resolve())
    assert two.find_model(b.title) == two.find_model("tiny-random-b") == "tiny-random-b"
    assert two.find_model("tiny-random-b [0123456789]") is None and two.find_model("sdxl-turbo") is None
    assert two.default_model == "tiny-random" and two.rescan_models() == ([], [])
    with pytest.raises(InvalidRequest, match="unknown model 'nope'"):
        two.limits_for("nope")


def test_a_switch_compiles_nothing(other):
    """From the start on: the default model's program compiled at start serves the other model's first request and
    every switch after it (the engine's compile counter, over every family; the executable cache's loads count)."""
    fresh = start(model="tiny-random", models=other, max_resident_models=1)
    compiles = fresh.compile_count
    assert compiles >= 1 and "tiny-random-b" not in fresh.setups
    for name in ["tiny-random-b", "tiny-random"] * 3:
        assert fresh.generate(request(name, steps=1)).model == name
    assert fresh.compile_count == compiles
    assert len(fresh.families) == 1 and fresh.setups["tiny-random"].programs is fresh.setups["tiny-random-b"].programs
    assert fresh.residency.loads == 1 + 6  # room for one: every switch loaded, and compiled nothing


def test_a_dropped_model_reloads_to_the_same_images(two):
    first = two.generate(request(seed=11))
    first_b = two.generate(request("tiny-random-b", seed=11))
    assert two.resident_models() == ["tiny-random-b"]  # tiny-random dropped
    progress: list[str] = []
    again = two.generate(request(seed=11), progress=progress.append)
    assert progress[0] == "loading model" and two.resident_models() == ["tiny-random"]
    np.testing.assert_array_equal(again.images, first.images)
    assert two.params is not None  # the default's weights, as the single-model engine showed them
    np.testing.assert_array_equal(two.generate(request("tiny-random-b", seed=11)).images, first_b.images)
    assert two.params is None  # the default dropped: Engine.params is a resident's, never kept aside


def test_a_request_for_a_resident_model_never_waits_for_another_models_load(other):
    both = start(model="tiny-random", models=other, max_resident_models=2)
    release, real = threading.Event(), both.residency._load

    def held_load(name, host):  # tiny-random-b's load takes until released
        release.wait(60)
        return real(name, host)

    both.residency._load = held_load
    loading: list[str] = []
    waiting = threading.Thread(target=both.generate, args=(request("tiny-random-b"),),
                               kwargs={"progress": loading.append})
    waiting.start()
    try:
        while "loading model" not in loading:
            time.sleep(0.01)
        for _ in range(3):  # the default model, resident, while the other loads
            assert both.generate(request(steps=1)).model == "tiny-random"
        assert waiting.is_alive()
    finally:
        release.set()
        waiting.join(60)
    assert both.resident_models() == ["tiny-random", "tiny-random-b"]
    loads = both.residency.loads
    for name in ["tiny-random", "tiny-random-b"] * 5:  # room for both: alternating does not thrash
        both.generate(request(name, steps=1))
    assert both.residency.loads == loads and both.residency.evictions == 0


@pytest.mark.slow  # 28 s: 100 model switches, each loading weights
def test_memory_is_flat_over_many_switches(two):
    """100 switches with room for one model: 100 loads and 100 drops; the process's memory grows by less than one
    model's weights (a dropped model whose weights stayed would add them at every switch)."""
    import psutil

    process = psutil.Process()

    def switches(count: int) -> None:
        for i in range(count):
            two.generate(request("tiny-random-b" if i % 2 else "tiny-random", steps=1))

    switches(10)
    gc.collect()
    before, loads = process.memory_info().rss, two.residency.loads
    switches(100)
    gc.collect()
    grown = process.memory_info().rss - before
    one_model = two.residency.sizes["tiny-random"]
    assert two.residency.loads == loads + 100
    assert grown < one_model, f"grew {grown / 1e6:.0f} MB over 100 switches (one model: {one_model / 1e6:.0f} MB)"


def test_a_model_whose_files_broke_is_unavailable_and_the_others_serve_on(tmp_path):
    broken = create_tiny_random(tmp_path / "broken", seed=2)
    engine = start(model="tiny-random", models=str(broken), precompile="off")
    (broken / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelUnavailable, match="model 'broken' could not be loaded: .*truncated"):
        engine.generate(request("broken", steps=1))
    assert engine.generate(request(steps=1)).model == "tiny-random"


@pytest.mark.slow  # 40 s: starts an engine and compiles the base + refiner programs
def test_a_refiner_chosen_per_request_runs_on_the_same_program(tmp_path):
    """--refiner A --refiner B: a request names B (A1111's refiner_checkpoint); its images are those of a server whose
    only refiner is B, and B runs on A's program (0 compiles)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from tests.helpers import FIXTURES

    other = tmp_path / "refiner-b"
    shutil.copytree(FIXTURES / "tiny-pt-refiner", other, ignore=shutil.ignore_patterns("*.npz"))
    unet = other / "unet" / "diffusion_pytorch_model.safetensors"
    save_file({k: v * np.asarray(3.0, v.dtype) for k, v in load_file(unet).items()}, str(unet), {"format": "pt"})
    base = dict(model=str(FIXTURES / "tiny-pt"), precompile="off")
    both = start(**base, refiner=str(FIXTURES / "tiny-pt-refiner"), refiners=str(other))
    assert both.refiner_names() == ["tiny-pt-refiner", "refiner-b"]
    first = both.generate(request(refiner_switch_at=0.2, steps=6))
    compiles = both.compile_count
    loading: list[str] = []
    chosen = both.generate(request(refiner="refiner-b", refiner_switch_at=0.2, steps=6), progress=loading.append)
    assert both.compile_count == compiles and loading[0] == "loading model"
    assert (first.refiner, chosen.refiner) == ("tiny-pt-refiner", "refiner-b")
    assert np.abs(first.images.astype(int) - chosen.images).mean() > 1
    only_b = start(**base, refiner=str(other))
    np.testing.assert_array_equal(chosen.images, only_b.generate(request(refiner_switch_at=0.2, steps=6)).images)
    again = both.generate(request(refiner="tiny-pt-refiner", refiner_switch_at=0.2, steps=6))
    np.testing.assert_array_equal(again.images, first.images)
    with pytest.raises(InvalidRequest, match=r"unknown refiner 'nope'; this server offers: tiny-pt-refiner, refiner-b"):
        both.generate(request(refiner="nope", refiner_switch_at=0.2, steps=6))
    with pytest.raises(InvalidRequest, match="refiner: applies with refiner_switch_at only"):
        both.generate(request(refiner="refiner-b"))


def test_a_models_defaults_are_its_own_before_and_after_it_loads(tmp_path):
    """Engine.defaults_for: another model's engine_defaults.json read from its folder before it is loaded (the page's
    Model dropdown and Model default button show them), the same once loaded, and what its request that sets no
    sampler, steps or guidance runs with; the default model keeps the config's."""
    import json

    folder = create_tiny_random(tmp_path / "tiny-random-c", seed=2)
    (folder / "engine_defaults.json").write_text(json.dumps({"sampler": "DPM++ 2M", "num_inference_steps": 3,
                                                             "guidance_scale": 2.5}))
    engine = start(model="tiny-random", models=str(folder), precompile="off")
    own = lambda d: (d.sampler, d.num_inference_steps, d.guidance_scale)  # noqa: E731
    assert engine.limits_for("tiny-random-c") is None  # not loaded: read from the folder
    assert own(engine.defaults_for("tiny-random-c")) == ("DPM++ 2M", 3, 2.5)
    assert own(engine.defaults_for(None)) == own(engine.defaults_for("tiny-random")) == ("Euler", 20, 5.0)
    result = engine.generate(GenerateRequest("a red circle", seed=1, model="tiny-random-c"))
    assert (result.request.sampler, result.request.num_inference_steps, result.request.guidance_scale) == \
        ("DPM++ 2M", 3, 2.5)
    assert engine.limits_for("tiny-random-c") is not None
    assert own(engine.defaults_for("tiny-random-c")) == ("DPM++ 2M", 3, 2.5)
    with pytest.raises(InvalidRequest, match="unknown model 'nope'; this server offers: tiny-random, tiny-random-c"):
        engine.defaults_for("nope")


def test_a_models_loras_are_its_own_before_and_after_it_loads(tmp_path):
    """Engine.lora_names_for (the page's few-steps preset shows for a model with the LoRA it tags): tiny-shapes'
    shipped LCM-LoRA is tiny-shapes' only; another model has none, before and after its load; a request for it that
    tags the LoRA is refused naming the model."""
    engine = start(model="tiny-shapes", models="tiny-random", precompile="off")
    assert engine.lora_names_for(None) == engine.lora_names_for("tiny-shapes") == ("lcm",)
    assert engine.lora_names_for("tiny-random") == ()  # not loaded: what it will try
    engine.generate(GenerateRequest("a red circle", seed=1, num_inference_steps=1, model="tiny-random"))
    assert engine.lora_names_for("tiny-random") == ()  # loaded
    with pytest.raises(InvalidRequest, match="none are loaded for the model 'tiny-random'"):
        engine.generate(GenerateRequest("a red circle <lora:lcm:1>", num_inference_steps=1, model="tiny-random"))
