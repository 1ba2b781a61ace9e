"""What every fixture command shares (tools/make_fixtures.py): the repository's paths, SDXL 1.0 base's configs
(checked against the hub's sha256), PyTorch components built and seeded from configs and checked as saved, the
engine's LCM step noise handed to diffusers, LoRA loading checked for diffusers' warnings, and the writers of
reference arrays and their version records. Needs torch; never run in CI.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import hashlib
import io
import json
import re
import resource
import time
import zipfile
from pathlib import Path

import diffusers
import diffusers.schedulers.scheduling_lcm
import numpy as np
import psutil
import torch
import transformers
from diffusers import AutoencoderKL, StableDiffusionXLPipeline, UNet2DConditionModel
from safetensors import safe_open
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
SDXL_BASE_DIR = ROOT / "sdxl_engine" / "checkpoint" / "configs" / "sdxl-base-1.0"

# sha256 of stabilityai/stable-diffusion-xl-base-1.0's files at hub revision
# 462165984030d82259a11f4367a4eed129e94a7b; SDXL_BASE_DIR holds byte-identical copies.
SDXL_BASE_SHA256 = {
    "model_index.json": "6d7b93508390ab91ac5bfbe4aeb4dc2d83f7bb1b05fb069d714b5b0c75f70d44",
    "scheduler/scheduler_config.json": "af3e45a949aff8b8341ab8b811429ec03fee857a700a1d9477363e4fff9666e2",
    "text_encoder/config.json": "39b8b2e4b1949e36969caa425b6c81c68bace99198dd9078ce05d16ad401fe7f",
    "text_encoder_2/config.json": "a892d1c3a69a7e9247a24de2bc1d5891e3109a54696e53be20093af671072c34",
    "tokenizer/special_tokens_map.json": "c4864a9376a8401918425bed71fc14fc0e81f9b59ec45c1cf96cccb2df508eac",
    "tokenizer/tokenizer_config.json": "19d7b034cb0cc3ce9766c2231373ab8aa8991fc72e2c8f76558bfaae3de0d563",
    "tokenizer_2/special_tokens_map.json": "f118ab3a983206e4f32583448de6bd6aae4ee21869135cef1f5848a753cdaab6",
    "tokenizer_2/tokenizer_config.json": "c9d23941f76a41cbd50eda9290f57be7828f0a7a677939e9ef181f7e12bd1bdf",
    "unet/config.json": "30ebc70750223e59006f7f2b4e1e6c102570aa19a9c4ae3e1fbe7591332dbae6",
    "vae/config.json": "0b331c8ac22ded5f9997a144a575c1d113d6169aff262c353f39015bd24a6264",
}

COMPONENTS = ("text_encoder", "text_encoder_2", "vae", "unet")


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def sdxl_base_configs(root: Path = SDXL_BASE_DIR) -> dict:
    """SDXL 1.0 base's configs, after checking every file's sha256 against the hub's.

    Returns {"unet": dict, "vae": dict, "scheduler": dict, "text_encoder": CLIPTextConfig,
    "text_encoder_2": CLIPTextConfig}.
    """
    for rel, digest in SDXL_BASE_SHA256.items():
        if hashlib.sha256((root / rel).read_bytes()).hexdigest() != digest:
            raise ValueError(f"{root / rel}: differs from the hub's file (expected sha256 {digest})")
    return {
        "unet": _json(root / "unet" / "config.json"),
        "vae": _json(root / "vae" / "config.json"),
        "scheduler": _json(root / "scheduler" / "scheduler_config.json"),
        "text_encoder": CLIPTextConfig.from_json_file(root / "text_encoder" / "config.json"),
        "text_encoder_2": CLIPTextConfig.from_json_file(root / "text_encoder_2" / "config.json"),
    }


def plain_config(config) -> dict:
    """A scheduler's resolved config as a plain dict, less ``_use_default_values`` (a set, in no fixed order)."""
    return {k: v for k, v in config.items() if k != "_use_default_values"}


def build_component(name: str, configs: dict) -> torch.nn.Module:
    """An untrained ``name`` ("unet", "vae", "text_encoder", "text_encoder_2") on torch's default device."""
    if name == "unet":
        return UNet2DConditionModel.from_config(configs["unet"])
    if name == "vae":
        return AutoencoderKL.from_config(configs["vae"])
    cls = CLIPTextModel if name == "text_encoder" else CLIPTextModelWithProjection
    return cls(configs[name])


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with every 1-D parameter (norm scales and shifts, biases) moved by N(0, 0.1^2); eval mode.

    Default initialisation leaves norm scales at 1 and many biases at 0, so a loader that dropped
    them would still match the reference; after this every parameter shows in the outputs.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model.eval()


def seeded_component(name: str, configs: dict, seed: int) -> torch.nn.Module:
    """build_component() under torch seed ``seed``, then randomized(): the same weights on every run."""
    torch.manual_seed(seed)
    return randomized(build_component(name, configs), seed)


def saved_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """{name: shape} of the tensors save_pretrained writes for ``model``: its state_dict.

    transformers' CLIP ``position_ids`` is a non-persistent buffer, so it is not in the state_dict
    and not in the files (``tiny`` checks this rule against the files it writes).
    """
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def file_shapes(folder: Path) -> dict[str, list[int]]:
    """{name: shape} of every tensor in the *.safetensors files of ``folder`` (one model, maybe sharded)."""
    shapes = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            shapes.update({k: list(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


def check_saved(model: torch.nn.Module, folder: Path) -> None:
    """Raise RuntimeError unless the safetensors in ``folder`` hold exactly saved_shapes(model)."""
    expected, found = saved_shapes(model), file_shapes(folder)
    if expected != found:
        diff = sorted(k for k in set(expected) | set(found) if expected.get(k) != found.get(k))
        raise RuntimeError(f"{folder}: saved tensors differ from the state_dict rule: {diff[:10]}")


class EngineNoise:
    """Replaces a scheduler module's randn_tensor (``module``: scheduling_lcm, scheduling_tcd) with the given noises,
    in order; counts the calls."""

    def __init__(self, noise: np.ndarray, module: str = "scheduling_lcm"):
        self.noise, self.calls, self.module = noise, 0, getattr(diffusers.schedulers, module)

    def __call__(self, shape, generator=None, device=None, dtype=None, **kwargs):
        assert tuple(shape) == self.noise.shape[1:] and dtype == torch.float32, (shape, dtype)
        self.calls += 1
        return torch.from_numpy(self.noise[self.calls - 1].copy())

    def __enter__(self):
        self.saved = self.module.randn_tensor
        self.module.randn_tensor = self
        return self

    def __exit__(self, *exc):
        self.module.randn_tensor = self.saved


def as_numpy(arrays: dict) -> dict[str, np.ndarray]:
    """Tensors and arrays as numpy; floating point as float32, integers unchanged."""
    out = {}
    for key, value in arrays.items():
        value = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        out[key] = value.astype(np.float32) if value.dtype.kind == "f" else value
    return out


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez_compressed's format with fixed zip timestamps, so the same arrays give the same bytes."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for key, value in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(value), allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, buf.getvalue())


def versions() -> dict:
    """Versions of the libraries that made the reference."""
    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__}


class StageLog:
    """Seconds, resident memory and peak resident memory (ru_maxrss, whole process) after each stage."""

    def __init__(self):
        self.rows = []
        self.start = time.perf_counter()

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        row = dict(stage=stage, seconds=round(now - self.start, 1),
                   rss_gb=round(psutil.Process().memory_info().rss / 2**30, 2),
                   peak_rss_gb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2))
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.start = now


def free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc keeps them otherwise: GBs here)."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


class _LoggedWarnings(list):
    """Collects log records of WARNING and above from diffusers, transformers and peft."""

    def __enter__(self):
        import logging

        self._handler = logging.Handler(logging.WARNING)
        self._handler.emit = lambda record: self.append(record.getMessage())
        self._loggers = [logging.getLogger(n) for n in ("diffusers", "transformers", "peft", "")]
        for logger in self._loggers:
            logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        for logger in self._loggers:
            logger.removeHandler(self._handler)


def load_checked(pipe: StableDiffusionXLPipeline, path: Path, adapter: str, expected_layers: int) -> None:
    """load_lora_weights with no warning (unused or unexpected keys) and every layer of the file adapted."""
    import warnings as py_warnings

    diffusers.utils.logging.set_verbosity_warning()
    transformers.logging.set_verbosity_warning()
    with _LoggedWarnings() as logged, py_warnings.catch_warnings(record=True) as caught:
        py_warnings.simplefilter("always")
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=adapter)
    diffusers.utils.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    # transformers' load report lists the base weights an adapter does not hold as MISSING (they are kept:
    # cmd_lora checks the base images after loading); an UNEXPECTED or unused key is a LoRA layer dropped.
    # "No LoRA keys associated to CLIPTextModel..." is a UNet-only LoRA's (lcm-lora-sdxl's too): nothing dropped.
    messages = [m for m in logged + [str(w.message) for w in caught]
                if re.search(r"unexpected|unused|not used|not been|not found", m, re.IGNORECASE)
                and not m.startswith("No LoRA keys associated to CLIPTextModel")]
    if messages:
        raise SystemExit(f"{path.name}: diffusers warned while loading: {messages}")
    adapted = sum(1 for model in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2)
                  for name, module in model.named_modules() if hasattr(module, "lora_A") and adapter in module.lora_A)
    if adapted != expected_layers:
        raise SystemExit(f"{path.name}: diffusers adapted {adapted} layers, the file has {expected_layers}")
