"""The engine's NaN guard on the real program (the app-level faults are tests/e2e/test_faults.py)."""

import numpy as np
import pytest

from sdxl_engine.engine.local import GenerationError
from sdxl_engine.engine.validation import GenerateRequest


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
