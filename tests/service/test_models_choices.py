"""service/models.py: the models a client may name, read one way by every front, over an engine with the models calls
(the local engine's API, docs/models.md) and over one without them (the Ray front: its one model)."""

import dataclasses
import types

import pytest

from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.engine.validation import GenerateRequest, Limits, validate
from sdxl_engine.service import models

DEFAULT_LIMITS = Limits(max_seed=2**31 - 1, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=20,
                        default_guidance=5.0)
B_LIMITS = object()


class Catalogued:
    """The local engine's models calls (engine/local.Engine), two models, b's limits once loaded."""

    model = types.SimpleNamespace(name="a")
    limits = DEFAULT_LIMITS
    default_model = "a"

    def __init__(self):
        self.loaded = {"a": DEFAULT_LIMITS}

    def model_names(self):
        return ["a", "b"]

    def find_model(self, text):
        name = text.split(" [")[0].strip()
        return name if name in self.model_names() and text in (name, f"{name} [0123456789]") else None

    def limits_for(self, name):
        if name not in self.model_names():
            raise InvalidRequest("model", f"unknown model {name!r}; this server offers: a, b")
        return self.loaded.get(name)

    def defaults_for(self, name):  # read without loading: b's engine_defaults.json sets its own
        from sdxl_engine.config import EngineConfig

        return EngineConfig(sampler="DPM++ 2M", num_inference_steps=6, guidance_scale=2.0) if name == "b" \
            else EngineConfig()

    def models_info(self):
        return [types.SimpleNamespace(name="a", title="a [0123456789]", hash="0123456789"),
                types.SimpleNamespace(name="b", title="b", hash=None)]

    def refiner_names(self):
        return ["r1", "r2"]

    def rescan_models(self):
        return ["c"], []


def single():
    return types.SimpleNamespace(model=types.SimpleNamespace(name="tiny-shapes"), limits=DEFAULT_LIMITS,
                                 config=types.SimpleNamespace(model="tiny-shapes"))


def test_names_and_choices_over_the_engines_catalogue():
    engine = Catalogued()
    assert models.names(engine) == ["a", "b"] and models.default(engine) == "a"
    assert models.choose(engine, "b") == "b" and models.choose(engine, "a [0123456789]") == "a"
    assert models.choose(engine, None) is None and models.choose(engine, "  ") is None
    for text in ("c", "a [ffffffffff]"):  # (a number: a wrong type, below)
        with pytest.raises(InvalidRequest) as err:
            models.choose(engine, text, "override_settings.sd_model_checkpoint")
        assert err.value.field == "override_settings.sd_model_checkpoint"
        assert err.value.message == f"unknown model {str(text)!r}; this server offers: a, b"
    assert models.refiners(engine) == ["r1", "r2"] and models.rescan(engine) == (["c"], [])
    assert models.hash_of(engine, "a") == "0123456789" and models.hash_of(engine, "b") is None


def test_a_models_limits_once_loaded_else_the_defaults_and_an_unknown_one_refused():
    engine = Catalogued()
    assert models.limits_for(engine, None) is DEFAULT_LIMITS
    # Not loaded yet: the default's sizes (the engine validates it once it is) with b's own sampler, steps and
    # guidance, which fill in what a request leaves out (the first request for b ran a's before).
    before = models.limits_for(engine, "b")
    assert before == dataclasses.replace(DEFAULT_LIMITS, default_sampler="DPM++ 2M", default_steps=6,
                                         default_guidance=2.0)
    assert validate(GenerateRequest(prompt="x", model="b"), before).num_inference_steps == 6
    engine.loaded["b"] = B_LIMITS
    assert models.limits_for(engine, "b") is B_LIMITS
    with pytest.raises(InvalidRequest, match="unknown model 'c'; this server offers: a, b"):
        models.limits_for(engine, "c")


def test_an_engine_without_the_models_calls_is_its_one_model():
    engine = single()
    assert models.names(engine) == ["tiny-shapes"] and models.default(engine) == "tiny-shapes"
    assert models.choose(engine, "tiny-shapes [0123456789]") == "tiny-shapes"
    with pytest.raises(InvalidRequest, match="unknown model 'other'; this server offers: tiny-shapes"):
        models.choose(engine, "other")
    assert [(i.name, i.title, i.hash) for i in models.infos(engine)] == [("tiny-shapes", "tiny-shapes", None)]
    assert models.limits_for(engine, "anything") is DEFAULT_LIMITS and models.hash_of(engine, "tiny-shapes") is None
    assert models.refiners(engine, "ref") == ["ref"] and models.rescan(engine) == ([], [])


def test_a_models_default_steps_are_its_own_loaded_or_not():
    """models.default_steps (A1111's img2img start step and hires pass read it): the loaded Limits', else the model's
    engine_defaults.json's (Engine.defaults_for), else, for a file the engine refuses, the default model's."""
    from sdxl_engine.config import ConfigError

    engine = Catalogued()
    engine.limits = types.SimpleNamespace(default_steps=20)
    engine.loaded = {"a": engine.limits}
    read = {"b": 8}

    def defaults_for(name):
        if name not in read:
            raise ConfigError("b/engine_defaults.json: num_inference_steps: must be 1 to 50")
        return types.SimpleNamespace(num_inference_steps=read[name])

    engine.defaults_for = defaults_for
    assert models.default_steps(engine, None) == models.default_steps(engine, "a") == 20
    assert models.default_steps(engine, "b") == 8  # not loaded: its file's
    engine.loaded["b"] = types.SimpleNamespace(default_steps=6)
    assert models.default_steps(engine, "b") == 6  # loaded: what the engine resolved
    del engine.loaded["b"], read["b"]
    assert models.default_steps(engine, "b") == 20


def test_a_model_of_the_wrong_type_is_named_as_such_on_every_front():
    """service/models.choose (every front's reading of a model, before the request queues): a value that is not
    text is a wrong type, not an unknown name."""
    for engine in (Catalogued(), single()):
        with pytest.raises(InvalidRequest, match=r"^model: expected a model's name \(text\), got int 5$"):
            models.choose(engine, 5)
        with pytest.raises(InvalidRequest, match=r"^sd_model_checkpoint: expected a model's name \(text\), got list"):
            models.choose(engine, ["a"], "sd_model_checkpoint")
