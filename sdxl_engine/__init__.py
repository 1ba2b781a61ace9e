"""SDXL on JAX: the serving runtime (config, models, weights, program, engine, sharding, validation, images).

Commands that use the runtime (benchmark, training, evaluation, load test, fixtures) live in
:mod:`sdxl_engine.tools`; the runtime never imports them.
"""

import os

# Only transformers' tokenizers are used; without PyTorch it would print advice about loading models.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
