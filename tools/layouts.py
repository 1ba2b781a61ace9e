"""The same seeds on different device layouts: how far apart are the images?

    python -m tools.layouts --devices 4,2,1,4

Each layout runs in a fresh process (JAX fixes its CPU device count at start): tiny-shapes on
N CPU devices, 4 images per request, the same requests (2 prompts x 2 seeds x Euler and
DPM++ 2M, the model's default steps). Every layout's images are compared with the first's:
the largest and the mean difference in 1/255 units, and the share of pixel values that differ.
A repeated layout (4 again) shows whether one layout reproduces itself exactly. Prints one
Markdown table (docs/python.md, "The seed rule"; docs/benchmarks.md holds the run).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

PROMPTS = ("a red circle on a blue background", "a large green square at the top")
SEEDS = (9, 1234)
SAMPLERS = ("Euler", "DPM++ 2M")


def run_layout(devices: int, out: Path, cache: Path) -> None:
    """In this process: start the engine on ``devices`` CPU devices, save every request's images
    ((requests, 4, 64, 64, 3) uint8) to ``out``."""
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine
    from sdxl_engine.engine.validation import GenerateRequest

    config = EngineConfig.load({"cpu_devices": devices, "images_per_request": 4, "compile_cache_dir": str(cache)},
                               environ={})
    engine = Engine(config, log=lambda *_: None).start()
    images = [engine.generate(GenerateRequest(p, seed=s, sampler=m)).images
              for p in PROMPTS for s in SEEDS for m in SAMPLERS]
    np.save(out, np.stack(images))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="4,2,1,4", help="CPU device counts, the first is the reference")
    parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # a child: run this layout only
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        run_layout(args.one, Path(args.out), Path(args.cache))
        return 0
    layouts = [int(n) for n in args.devices.split(",")]
    with tempfile.TemporaryDirectory(prefix="sdxl-layouts-") as tmp:
        images = []
        for i, n in enumerate(layouts):
            out = Path(tmp) / f"{i}.npy"
            subprocess.run([sys.executable, "-m", "tools.layouts", "--one", str(n), "--out", str(out),
                            "--cache", str(Path(tmp) / "cache")], check=True)
            images.append(np.load(out).astype(np.int16))
    print(f"| devices | vs {layouts[0]} devices: max diff (/255) | mean diff (/255) | pixel values that differ |")
    print("|---|---|---|---|")
    for n, got in zip(layouts[1:], images[1:]):
        diff = np.abs(got - images[0])
        print(f"| {n} | {diff.max()} | {diff.mean():.5f} | {(diff > 0).mean():.4%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
