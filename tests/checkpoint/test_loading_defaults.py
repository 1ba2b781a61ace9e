"""A model folder's engine_defaults.json: its sampler, steps and guidance for whatever the deployment did not set."""

import json
import os
import shutil

import pytest
from PIL import Image

from sdxl_engine.checkpoint.loading import ENGINE_DEFAULTS_FILE, ModelLoadError, engine_defaults, read_engine_defaults
from sdxl_engine.config import ConfigError, EngineConfig

pytestmark = pytest.mark.engine

CACHES = {k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")}
CHOSEN = {"sampler": "DPM++ 2M", "num_inference_steps": 7}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """tiny-random as a local folder, with an engine_defaults.json choosing DPM++ 2M, 7 steps."""
    from sdxl_engine.checkpoint.builtin import model_path

    folder = tmp_path_factory.mktemp("chooser") / "model"
    shutil.copytree(model_path("tiny-random", os.environ["SDXL_MODEL_CACHE_DIR"]), folder)
    (folder / ENGINE_DEFAULTS_FILE).write_text(json.dumps({"_why": "a test", **CHOSEN}))
    return folder


def start(model, environ=None, **overrides):
    from sdxl_engine.engine.local import Engine

    config = EngineConfig.load({"model": str(model), "cpu_devices": 4, **overrides},
                               environ={**CACHES, **(environ or {})})
    lines = []
    return Engine(config, log=lines.append).start(), lines


# ---- the config ---------------------------------------------------------------------------
def test_load_records_what_was_set_explicitly():
    config = EngineConfig.load({"num_inference_steps": 9, "sampler": None}, environ={"SDXL_SAMPLER": "euler"})
    assert config.explicit == {"num_inference_steps", "sampler"}
    assert EngineConfig.load({"sampler": "Euler"}, environ={}).explicit == {"sampler"}  # the default's value, set
    assert EngineConfig.load(environ={}).explicit == frozenset()
    assert EngineConfig(num_inference_steps=9).explicit == {"num_inference_steps"}  # built directly: what differs


def test_model_defaults_fill_only_what_was_not_set():
    chosen = {"sampler": "dpm++ 2m", "num_inference_steps": "7", "guidance_scale": 3}
    config = EngineConfig.load(environ={}).with_model_defaults(chosen)
    assert (config.sampler, config.num_inference_steps, config.guidance_scale) == ("DPM++ 2M", 7, 3.0)
    assert config.explicit == frozenset()
    mine = EngineConfig.load({"num_inference_steps": 20}, environ={"SDXL_SAMPLER": "Euler"}).with_model_defaults(chosen)
    assert (mine.sampler, mine.num_inference_steps, mine.guidance_scale) == ("Euler", 20, 3.0)
    assert EngineConfig.load(environ={}).with_model_defaults({}) == EngineConfig.load(environ={})


@pytest.mark.parametrize("chosen, message", [
    ({"max_seed": 7}, "a model may choose only sampler, num_inference_steps, guidance_scale, width, height, "
                      "not 'max_seed'"),
    ({"sampler": "DPM adaptive"}, "unknown sampler 'DPM adaptive'"),
    ({"num_inference_steps": "many"}, "num_inference_steps must be a whole number"),
    ({"guidance_scale": -1}, "guidance_scale must be between 0 and 50"),
])
def test_a_bad_model_default_is_refused_even_when_overridden(chosen, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.load({"sampler": "Euler", "num_inference_steps": 20}, environ={}).with_model_defaults(chosen)


# ---- the file -----------------------------------------------------------------------------
def test_the_file_is_read_without_its_notes(tmp_path, model_dir):
    assert read_engine_defaults(tmp_path) == {}
    assert read_engine_defaults(model_dir) == CHOSEN == engine_defaults(str(model_dir))
    assert engine_defaults("tiny-random") == {} and engine_defaults("stabilityai/stable-diffusion-xl-base-1.0") == {}
    (tmp_path / ENGINE_DEFAULTS_FILE).write_text('["DPM++ 2M", 8]')
    with pytest.raises(ModelLoadError, match="expected a JSON object"):
        read_engine_defaults(tmp_path)


def test_shipped_model_chooses_its_fastest_setting_that_keeps_euler_20s_accuracy():
    """tiny-shapes' file holds the sweep's choice (bench_quality.json, docs/default-model.md)."""
    from tests.helpers import ROOT

    choice = json.loads((ROOT / "docs" / "benchmarks" / "bench_quality.json").read_text())["choice"]
    assert engine_defaults("tiny-shapes") == {"sampler": choice["sampler"], "num_inference_steps": choice["steps"]}


# ---- the engine ---------------------------------------------------------------------------
def test_engine_uses_the_model_defaults_for_requests_that_set_nothing(model_dir):
    from sdxl_engine.engine.validation import GenerateRequest

    engine, log = start(model_dir)
    assert (engine.limits.default_sampler, engine.limits.default_steps, engine.limits.default_guidance) == (
        "DPM++ 2M", 7, 5.0)
    assert engine.config.sampler == "Euler"  # the config stays what was asked for; engine.defaults has the model's
    assert (engine.defaults.sampler, engine.defaults.num_inference_steps) == ("DPM++ 2M", 7)
    assert any("the model's defaults (engine_defaults.json): {'sampler': 'DPM++ 2M', 'num_inference_steps': 7}" in line
               for line in log)
    result = engine.generate(GenerateRequest("a red circle", seed=1))
    assert (result.request.sampler, result.request.num_inference_steps) == ("DPM++ 2M", 7)
    asked = engine.generate(GenerateRequest("a red circle", seed=1, sampler="Euler", num_inference_steps=3)).request
    assert (asked.sampler, asked.num_inference_steps) == ("Euler", 3)  # a request's own values win


def test_an_explicit_setting_wins_over_the_model(model_dir):
    engine, log = start(model_dir, environ={"SDXL_SAMPLER": "Euler"}, num_inference_steps=20)
    assert (engine.limits.default_sampler, engine.limits.default_steps) == ("Euler", 20)
    assert any("{}; set explicitly, so kept: num_inference_steps, sampler" in line for line in log)


def test_engine_refuses_to_start_on_a_bad_file(tmp_path, model_dir):
    from sdxl_engine.engine.local import Engine

    bad = tmp_path / "model"
    shutil.copytree(model_dir, bad)
    (bad / ENGINE_DEFAULTS_FILE).write_text(json.dumps({"sampler": "DPM adaptive"}))
    config = EngineConfig.load({"model": str(bad), "cpu_devices": 4}, environ=CACHES)
    with pytest.raises(ConfigError,
                       match=f"engine_defaults.json of model '{bad}': sampler: unknown sampler 'DPM adaptive'"):
        Engine(config, log=lambda *_: None).start()


# ---- the page and the API -----------------------------------------------------------------
def api_defaults(demo) -> dict:
    api = demo.get_api_info()["named_endpoints"]["/generate"]
    return {p["parameter_name"]: p["parameter_default"] for p in api["parameters"]}


def test_page_and_api_show_the_model_defaults_unless_set(model_dir):
    import app
    from sdxl_engine.serving import handler

    fake = lambda *values, **kw: ([], {}, None)  # noqa: E731
    page = app.build_demo(fake, handler.page_defaults(EngineConfig.load({"model": str(model_dir)}, environ={})))
    defaults = api_defaults(page)
    assert (defaults["sampler"], defaults["num_inference_steps"], defaults["guidance_scale"]) == ("DPM++ 2M", 7, 5.0)
    mine = handler.page_defaults(EngineConfig.load({"model": str(model_dir), "sampler": "DDIM"}, environ={}))
    defaults = api_defaults(app.build_demo(fake, mine))
    assert (defaults["sampler"], defaults["num_inference_steps"]) == ("DDIM", 7)
    shipped = api_defaults(app.build_demo(fake, handler.page_defaults(EngineConfig.load(environ={}))))
    assert {"sampler": shipped["sampler"], "num_inference_steps": shipped["num_inference_steps"]} == engine_defaults(
        "tiny-shapes")


def test_blog_default_button_sets_euler_20():
    import app
    from sdxl_engine.serving import handler

    demo = app.build_demo(lambda *values, **kw: ([], {}, None), handler.page_defaults(EngineConfig.load(environ={})))
    button = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "blog-default")
    assert button.value == "Blog default (Euler, 20 steps)"
    event = next(fn for fn in demo.fns.values() if any(t[0] == button._id for t in fn.targets))
    assert [getattr(block, "elem_id", None) for block in event.outputs] == ["sampler", "steps", "schedule-type"]
    assert event.fn() == ("Euler", 20, "Automatic") and app.BLOG_DEFAULT == ("Euler", 20)


def test_png_and_info_record_the_model_default_sampler(model_dir, tmp_path):
    from sdxl_engine.serving import page
    from tests.helpers import page_generate

    engine, _ = start(model_dir)
    stages = []
    gallery, info, record = page_generate(engine, "a red circle", "", 7, None, None, 0, 0, files_dir=str(tmp_path),
                                          progress=lambda fraction, desc, **_: stages.append(desc))
    assert "Preparing: tokenizing the prompts, scheduling 7 DPM++ 2M steps" in stages
    assert (info["sampler"], info["num_inference_steps"]) == ("DPM++ 2M", 7) == (record["sampler"],
                                                                                  record["num_inference_steps"])
    with Image.open(gallery[0][0]) as image:
        assert "Steps: 7, Sampler: DPM++ 2M," in image.text["parameters"]
    assert "7 DPM++ 2M steps" in page.status_line(info)
