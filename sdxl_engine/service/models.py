"""The models a client may name (issue #49, docs/models.md), read the same way by every front: the names offered
(:func:`names`), a client's text mapped to one (:func:`choose`: a name or an A1111 title ``"name [hash]"``; an unknown
one refused naming it and the models offered), the limits a request for one is validated with (:func:`limits_for`)
and a model's A1111 hash for the PNG infotext (:func:`hash_of`). No Gradio, no HTTP.

The local engine (engine/local.Engine) has the calls these read (model_names, default_model, models_info,
find_model, limits_for). The Ray front (serving/remote.RemoteEngine) does not have them yet (docs/models.md, "The
engine API"): it is served as one model, its default, and a request's ``model`` crosses to its replicas as any field
(their engines refuse an unknown name). :func:`_catalogue` is the one place that tells the two apart.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sdxl_engine.config import ConfigError
from sdxl_engine.engine.errors import InvalidRequest


def _catalogue(engine):
    """``engine`` when it offers several models by name (the local engine), else None (one model: the Ray front,
    whose contract has no listing calls yet; the tests' stand-in engines)."""
    return engine if callable(getattr(engine, "model_names", None)) else None


def default(engine) -> str:
    """The default model's name (a request's ``model=None``), as the page shows it."""
    if _catalogue(engine) is not None:
        return engine.default_model
    if engine.model is not None:
        return engine.model.name
    setting = engine.config.model
    return Path(setting).name if Path(setting).is_dir() else setting


def names(engine) -> list[str]:
    """The names a request may send, the default first (a dropdown's choices, MCP's argument description)."""
    return list(engine.model_names()) if _catalogue(engine) is not None else [default(engine)]


def configured(config) -> list[str]:
    """The model names ``config``'s flags and models folder give (checkpoint/catalogue.entries), the default first,
    known before the engine has started (the page's first Model list, so the API description lists them too); []
    when they do not resolve (the engine's start then says why)."""
    from sdxl_engine.checkpoint import catalogue  # here: only the page's build needs it

    try:
        return list(catalogue.entries([config.model, *catalogue.split_specs(config.models)], config.models_dir,
                                      log=lambda line: None))
    except (ConfigError, OSError):
        return []


def choose(engine, text, field: str = "model") -> str | None:
    """The model ``text`` names (a client's: a name, or A1111's title ``"name [hash]"``), for GenerateRequest.model;
    None for None or "" (the default).

    Raises InvalidRequest (``field``, the front's name of it) naming ``text`` and the models offered."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if not isinstance(text, str):  # names no model at all: its type is the mistake
        raise InvalidRequest(field, f"expected a model's name (text), got {type(text).__name__} {str(text)[:60]}")
    found = engine.find_model(text) if _catalogue(engine) is not None else (
        default(engine) if text.split(" [")[0].strip() == default(engine) else None)
    if found is not None:
        return found
    raise InvalidRequest(field, f"unknown model {str(text)[:120]!r}; this server offers: {', '.join(names(engine))}")


def loaded_limits(engine, model: str | None):
    """``model``'s Limits (None: the default's) once the engine has loaded it, else None (its sizes, defaults and the
    ControlNets that fit it are known then). Raises InvalidRequest (``model``) for a name the engine does not offer."""
    if model is None or _catalogue(engine) is None:
        return engine.limits
    return engine.limits_for(model)


def limits_for(engine, model: str | None):
    """The Limits a request for ``model`` (None: the default) is validated with: that model's once the engine has
    loaded it, else the default's with that model's own sampler, steps and guidance (:func:`defaults_for`, read
    without loading it: validation fills a value left out from them, so the first request for a model not loaded
    yet runs its defaults too); the engine validates the request again against the model's own once loaded.

    Raises InvalidRequest (``model``) for a name the engine does not offer."""
    loaded = loaded_limits(engine, model)
    if loaded is not None or model is None or _catalogue(engine) is None or engine.limits is None:
        return loaded or engine.limits
    from sdxl_engine.checkpoint.weights import ModelLoadError  # here: the flags' check imports this module, no JAX

    try:
        own = defaults_for(engine, model)
    except (ConfigError, ModelLoadError):  # the engine refuses it at its load, with the reason
        return engine.limits
    return dataclasses.replace(engine.limits, default_steps=own.num_inference_steps,
                               default_guidance=own.guidance_scale, default_sampler=own.sampler)


def defaults_for(engine, model: str | None):
    """The EngineConfig a request for ``model`` (None: the default) that sets nothing runs with: its sampler, steps
    and guidance (the model's engine_defaults.json over the config: engine/local.Engine.defaults_for), read without
    loading it; an engine without the models calls: its ``defaults``.

    Raises InvalidRequest (``model``) for a name the engine does not offer, ConfigError or ModelLoadError for a
    model's engine_defaults.json the engine would refuse."""
    if _catalogue(engine) is None:
        return engine.defaults
    return engine.defaults_for(model)


def lora_names_for(engine, model: str | None) -> tuple[str, ...]:
    """The LoRA names a request for ``model`` (None: the default) may tag (engine/local.Engine.lora_names_for: its
    checked ones once loaded, else those it will try); an engine without the models calls: its Limits'.

    Raises InvalidRequest (``model``) for a name the engine does not offer."""
    if _catalogue(engine) is None:
        return tuple(engine.limits.loras) if engine.limits is not None else ()
    return tuple(engine.lora_names_for(model))


def default_steps(engine, model: str | None) -> int:
    """The steps a request for ``model`` (None: the default) that sets none runs: its loaded Limits', else its
    engine_defaults.json's (:func:`defaults_for`, read without loading it), for a front that derives other values
    from them (A1111's img2img start step, its hires fix's second pass). A model whose file the engine refuses: the
    default model's (its request is refused with the reason)."""
    from sdxl_engine.checkpoint.weights import ModelLoadError  # here: a listing needs no checkpoint code

    loaded = loaded_limits(engine, model)
    if loaded is not None:
        return loaded.default_steps
    try:
        return defaults_for(engine, model).num_inference_steps
    except (ConfigError, ModelLoadError):
        return engine.limits.default_steps


def hash_of(engine, name: str) -> str | None:
    """``name``'s A1111 short hash (10 hex digits) when the engine knows it (hashes are computed on a background
    thread: None until then), for the PNG infotext's ``Model hash``."""
    if _catalogue(engine) is None:
        return None
    return next((info.hash for info in engine.models_info() if info.name == name), None)


def refiners(engine, loaded: str = "") -> list[str]:
    """The refiners a request may name (GenerateRequest.refiner; A1111's ``refiner_checkpoint``), the first (the
    default) first; for an engine without the models calls, ``loaded`` (the one refiner's name; "" for none)."""
    if _catalogue(engine) is not None:
        return list(engine.refiner_names())
    return [loaded] if loaded else []


@dataclasses.dataclass(frozen=True)
class Listed:
    """A model's listing entry (checkpoint/catalogue.ModelInfo's fields) for an engine without the models calls."""

    name: str
    title: str
    hash: str | None = None
    sha256: str | None = None
    filename: str = ""
    default: bool = True


def infos(engine) -> list:
    """Every model's listing entry (``name``, ``title`` ``"name [hash10]"``, ``hash``, ``sha256``, ``filename``,
    ``default``), the default first; never waits (a hash not computed yet is None)."""
    if _catalogue(engine) is not None:
        return list(engine.models_info())
    return [Listed(default(engine), default(engine))]


def start_hashes(engine) -> None:
    """Start computing the models' A1111 hashes (once, on the engine's background thread: listing them does), for
    the PNGs' ``Model hash``; nothing for an engine without the models calls."""
    if _catalogue(engine) is not None:
        engine.models_info()


def rescan(engine) -> tuple[list[str], list[str]]:
    """Read the models folders again (A1111's refresh-checkpoints): the (added, removed) names; ((), ()) for an
    engine without the models calls."""
    return engine.rescan_models() if _catalogue(engine) is not None else ([], [])
