"""A diffusers-format SDXL folder out of configs and parameters (the built-in models, training, conversion).

The folder is what diffusers' PyTorch ``StableDiffusionXLPipeline.save_pretrained`` writes with
``safe_serialization=True``, so both it and :func:`sdxl_engine.checkpoint.loading.load_model` read it:
``model_index.json``, one folder per component with ``config.json`` and one safetensors file
(:func:`.weights.save_params`: PyTorch layout), ``scheduler/scheduler_config.json``, and the
project's optional ``vocabulary.txt``. Tokenizers are written by whoever makes the model
(``builtin.write_tokenizers``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from sdxl_engine.checkpoint.weights import save_params

# config.json headers of each component, as diffusers and transformers write them.
CLASS_HEADERS = {
    "unet": {"_class_name": "UNet2DConditionModel"},
    "vae": {"_class_name": "AutoencoderKL"},
    "text_encoder": {"architectures": ["CLIPTextModel"], "model_type": "clip_text_model"},
    "text_encoder_2": {"architectures": ["CLIPTextModelWithProjection"], "model_type": "clip_text_model"},
}
WEIGHT_FILES = {"unet": "diffusion_pytorch_model.safetensors", "vae": "diffusion_pytorch_model.safetensors",
                 "text_encoder": "model.safetensors", "text_encoder_2": "model.safetensors"}


# Optional: the words a model was trained on, one per line (the engine's warnings name the others). Here, not
# in builtin.py beside the built-in vocabulary: builtin writes its models with save_folder, so it imports this.
VOCABULARY_FILE = "vocabulary.txt"


def save_folder(out: Path, configs: Mapping[str, dict], params: Mapping[str, Mapping[str, np.ndarray]],
                scheduler_config: dict, scheduler_class: str = "EulerDiscreteScheduler",
                vocabulary=None) -> Path:
    """Write a diffusers-format SDXL folder (safetensors, PyTorch layout) that diffusers' PyTorch
    ``StableDiffusionXLPipeline.from_pretrained`` and :func:`sdxl_engine.checkpoint.loading.load_model` both read.

    Args:
        out: the folder; its ``tokenizer/`` and ``tokenizer_2/`` must already be there.
        configs: component name -> config.json dict (without the class header, which is added).
        params: component name -> {checkpoint key: array}.
        scheduler_config: scheduler_config.json fields; scheduler_class: its diffusers class name.
        vocabulary: the words the model knows (written to vocabulary.txt), or None.
    Returns ``out``.
    """
    for name, config in configs.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**CLASS_HEADERS[name], **config}, indent=2, default=list))
        save_params(params[name], folder / WEIGHT_FILES[name])
    (out / "scheduler").mkdir(parents=True, exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": scheduler_class, **scheduler_config}, indent=2))
    index = {"_class_name": "StableDiffusionXLPipeline", "force_zeros_for_empty_prompt": True,
             "scheduler": ["diffusers", scheduler_class],
             "text_encoder": ["transformers", "CLIPTextModel"],
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
             "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
             "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    if vocabulary is not None:
        (out / VOCABULARY_FILE).write_text("\n".join(sorted(set(vocabulary))) + "\n")
    return out
