"""The engine's NaN guard on the real program (the app-level faults are tests/serving/test_server_faults_app.py)."""

import numpy as np
import pytest

from sdxl_engine.engine.errors import GenerationError
from sdxl_engine.engine.validation import GenerateRequest

pytestmark = pytest.mark.engine


def test_nan_guard_in_the_engine(engine, monkeypatch):
    """Poisoned VAE weights make the real program return NaN; the engine raises, never returns it."""
    import jax

    poisoned = {**engine.params, "vae": jax.tree.map(lambda x: x * np.nan, engine.params["vae"])}
    monkeypatch.setattr(engine, "params", poisoned)
    with pytest.raises(GenerationError, match=r"non-finite pixels \(NaN/inf\) for seeds \[5, 6, 7, 8\]"):
        engine.generate(GenerateRequest("a red circle", seed=5, num_inference_steps=2))
    monkeypatch.undo()
    result = engine.generate(GenerateRequest("a red circle", seed=5, num_inference_steps=2))
    assert result.images.shape == (4, 64, 64, 3) and result.images.std() > 5


def test_out_of_device_memory_is_a_refusal_naming_the_size(engine, monkeypatch, capsys):
    """XLA's RESOURCE_EXHAUSTED while a request runs is InvalidRequest naming ``width`` and the size (the client
    can change it; a retry of the same request fails again, which a 500 would invite), with one log line; the
    engine takes the next request. Another runtime error goes on as it is."""
    import jax

    from sdxl_engine.engine.validation import InvalidRequest

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 34399093232 bytes.")

    monkeypatch.setattr(engine, "_on_device", exhausted)
    with pytest.raises(InvalidRequest, match=r"64x64 x 4 images needs more memory than this server's devices have"
                                              r" \(.+\); choose a smaller size") as err:
        engine.generate(GenerateRequest("a red circle", seed=5, num_inference_steps=2))
    assert err.value.field == "width"

    def broken(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(engine, "_on_device", broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        engine.generate(GenerateRequest("a red circle", seed=5, num_inference_steps=2))
    monkeypatch.undo()
    assert engine.generate(GenerateRequest("a red circle", seed=5, num_inference_steps=2)).images.std() > 5
