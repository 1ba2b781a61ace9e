"""SDXL on JAX: the serving runtime.

Layers, each a folder (docs/architecture.md): ``config`` (settings and their precedence),
``checkpoint`` (files -> a LoadedModel), ``models`` (the Flax NNX modules), ``program`` (everything
traced), ``engine`` (the contract, requests, the engine), ``serving`` (the request handler, the HTTP
server, the process, scale-out). Commands that use the runtime (benchmark, training, evaluation,
load test, fixtures) live outside it, in the repository's ``tools/``; the runtime never imports them.
"""

import os

# Only transformers' tokenizers are used; without PyTorch it would print advice about loading models.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
