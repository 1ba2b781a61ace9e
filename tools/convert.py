"""Rewrite a diffusers-format SDXL folder as safetensors in PyTorch layout.

    python -m tools.convert SRC DST [--dtype float16]

SRC may hold Flax msgpack weights (what diffusers' and transformers' deleted Flax classes saved),
safetensors of any variant, or shards. DST gets one ``*.safetensors`` per component, configs and
model_index.json with the PyTorch class names (so diffusers' and transformers' PyTorch classes
load it too), and SRC's tokenizers, scheduler config and other files copied unchanged. The
weights go through the engine's own loader, so what DST holds is exactly what the engine reads.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from sdxl_engine.checkpoint.loading import read_model_folder
from sdxl_engine.checkpoint.weights import find_weight_files, load_params, save_params
from sdxl_engine.checkpoint.writing import WEIGHT_FILES
from sdxl_engine.models import COMPONENTS

# Flax-only config fields, and the class name each component has in PyTorch.
FLAX_ONLY = ("dtype", "split_head_dim", "use_memory_efficient_attention")
PYTORCH_CLASSES = {"unet": ("diffusers", "UNet2DConditionModel"), "vae": ("diffusers", "AutoencoderKL"),
                   "text_encoder": ("transformers", "CLIPTextModel"),
                   "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"),
                   "scheduler": ("diffusers", "EulerDiscreteScheduler")}


def convert(src: Path, dst: Path, dtype: str = "float32") -> Path:
    """Write ``src`` to ``dst`` as described in the module docstring; returns ``dst``.

    Raises ModelLoadError for a folder the engine cannot load, FileExistsError if ``dst`` exists.
    """
    components = read_model_folder(src)
    dst.mkdir(parents=True)
    for item in src.iterdir():
        if item.name not in COMPONENTS and item.name != "model_index.json":
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, dst / item.name)
    for name, component in components.items():
        params = load_params(component, find_weight_files(src / name), jnp.dtype(dtype), np.asarray)
        save_params(params, dst / name / WEIGHT_FILES[name])
        config = json.loads((src / name / "config.json").read_text())
        config = {k: v for k, v in config.items() if k not in FLAX_ONLY}
        if "_class_name" in config:
            config["_class_name"] = PYTORCH_CLASSES[name][1]
        else:
            config["architectures"] = [PYTORCH_CLASSES[name][1]]
        (dst / name / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = json.loads((src / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionXLPipeline"
    for name, entry in PYTORCH_CLASSES.items():
        if name == "scheduler":
            entry = ("diffusers", index["scheduler"][1].removeprefix("Flax"))
        index[name] = list(entry)
    (dst / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    scheduler = dst / "scheduler" / "scheduler_config.json"
    config = json.loads(scheduler.read_text())
    config["_class_name"] = config["_class_name"].removeprefix("Flax")
    scheduler.write_text(json.dumps(config, indent=2) + "\n")
    return dst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    args = parser.parse_args(argv)
    print(convert(args.src, args.dst, args.dtype))


if __name__ == "__main__":
    main()
