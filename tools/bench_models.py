"""Several models in one engine (docs/models.md): what a switch costs, what a load costs, what residency saves.

    python -m tools.bench_models switch          # two resident tiny models: requests alternating A/B against A/A
    python -m tools.bench_models queue           # 40 requests over 3 tiny models, room for 2 against room for 1
    python -m tools.bench_models fullsize DIR    # write a random full-size SDXL base folder (bfloat16, streamed)
    python -m tools.bench_models load DIR        # its load and reload in fresh processes against dd of its files

``switch``: tiny-random and tiny-random with seed 1 (one architecture: they share every program), both resident;
rounds of requests for A, A, A, ... and A, B, A, B, ..., each request timed on the host (Engine.generate's wall
time); the median of A/B over the median of A/A, and the engine's compile counter across all of it.

``queue``: three tiny models (seeds 0, 1, 2) and a queue of 40 requests served in order (one caller), in two
patterns: ``mixed`` (a seeded draw: 60 % the first model, 20 % each other) and ``round-robin`` (A, B, C, A, ...:
least-recently-used's worst case); wall time and loads with room for 2 models and with room for 1 (a load on
every switch).

``load``: the folder loaded by the engine's loader (loading.load_model) onto one CPU device in a fresh process
(seconds, peak RSS growth over the parameters' bytes), its reload (loading.reload_params: the weights alone, the
components known), and ``dd`` of its weight files: with O_DIRECT (the disk, the physical floor) and through the
page cache (what the loader read, warm).

Writes docs/benchmarks/bench_models.json and the ``models`` section of docs/benchmarks.md (``--md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "models"


def _engine(models: list[str], resident: int, log=lambda *_: None):
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    config = EngineConfig.load({"model": models[0], "models": os.pathsep.join(models[1:]), "cpu_devices": 4,
                                "max_run_seconds": 0, "max_resident_models": resident})
    return Engine(config, log=log).start()


def _tiny_models(root: Path, count: int) -> list[str]:
    """tiny-random (seed 0, built in) and ``count - 1`` more of its architecture with seeds 1, 2, ... in ``root``."""
    from sdxl_engine.checkpoint.builtin import create_tiny_random

    return ["tiny-random"] + [str(create_tiny_random(root / f"tiny-random-{seed}", seed=seed))
                              for seed in range(1, count)]


def _request(model: str | None, seed: int = 0):
    from sdxl_engine.engine.validation import GenerateRequest

    return GenerateRequest("a red circle", seed=seed, num_inference_steps=4, model=model)


def bench_switch(rounds: int = 6, per_round: int = 8) -> dict:
    """Median wall seconds per request for A/A and A/B (both resident), their ratio, and compiles meanwhile."""
    with tempfile.TemporaryDirectory() as tmp:
        a, b = (Path(m).name for m in _tiny_models(Path(tmp), 2))
        engine = _engine(["tiny-random", str(Path(tmp) / b)], resident=2)
        for name in (a, b, a, b):  # both loaded and warm
            engine.generate(_request(name))
        compiles, loads = engine.compile_count, engine.residency.loads
        times: dict[str, list[float]] = {"A/A": [], "A/B": []}
        for _ in range(rounds):  # interleaved blocks: a drift of the shared machine hits both
            for pattern, names in (("A/A", [a] * per_round), ("A/B", [a, b] * (per_round // 2))):
                for i, name in enumerate(names):
                    t0 = time.perf_counter()
                    engine.generate(_request(name, seed=i))
                    times[pattern].append(time.perf_counter() - t0)
        same, switched = statistics.median(times["A/A"]), statistics.median(times["A/B"])
        return {"requests_each": rounds * per_round, "median_s": {"A/A": same, "A/B": switched},
                "ratio": switched / same, "compiles": engine.compile_count - compiles,
                "loads": engine.residency.loads - loads, "steps": 4, "images": engine.batch}


def _pattern(kind: str, names: list[str], count: int = 40) -> list[str]:
    import random

    if kind == "round-robin":
        return [names[i % len(names)] for i in range(count)]
    draw = random.Random(49)
    return draw.choices(names, weights=[0.6] + [0.4 / (len(names) - 1)] * (len(names) - 1), k=count)


def bench_queue() -> dict:
    """Wall seconds and loads of 40 queued requests over 3 models, room for 2 against room for 1."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = _tiny_models(Path(tmp), 3)
        names = [Path(m).name if os.sep in m else m for m in models]
        for resident in (2, 1):
            engine = _engine(models, resident)
            for name in names:  # every model's setup made once (its first load reads its configs), outside the clock
                engine.generate(_request(name))
            for kind in ("mixed", "round-robin"):
                queue = _pattern(kind, names)
                loads, t0 = engine.residency.loads, time.perf_counter()
                for i, name in enumerate(queue):
                    engine.generate(_request(name, seed=i))
                out[f"{kind}, room for {resident}"] = {
                    "seconds": time.perf_counter() - t0, "loads": engine.residency.loads - loads,
                    "switches": sum(x != y for x, y in zip(queue, queue[1:])),
                    "requests": {n: queue.count(n) for n in names}}
    return out


# --- a full-size random SDXL base folder, written tensor by tensor (never the whole model in memory) -------------

def write_fullsize(out: Path, chunk: int = 1 << 22, source: Path | None = None) -> Path:
    """SDXL 1.0 base's configs (or ``source``'s: a diffusers folder's, for a check at a small size) with random
    bfloat16 weights (normal, std 0.02), as a diffusers folder: each safetensors file written tensor by tensor in
    slices of ``chunk`` values (memory: one slice)."""
    import numpy as np
    from ml_dtypes import bfloat16

    from sdxl_engine.checkpoint import builtin
    from sdxl_engine.checkpoint.loading import read_model_folder
    from sdxl_engine.checkpoint.weights import to_torch_layout
    from sdxl_engine.checkpoint.writing import WEIGHT_FILES

    source = source or builtin.SDXL_BASE_DIR
    components = read_model_folder(source)
    out.mkdir(parents=True, exist_ok=True)
    for path in source.rglob("*"):  # configs, scheduler, tokenizer configs
        if path.is_file() and path.suffix in (".json", ".txt"):
            (out / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (out / path.relative_to(source)).write_bytes(path.read_bytes())
    builtin.write_tokenizers(out)  # any text tokenizes (the shipped configs carry no vocabulary)
    draw = np.random.default_rng(0)
    for name, component in components.items():
        shapes = {k: to_torch_layout(np.broadcast_to(np.zeros((), bfloat16), s)).shape
                  for k, s in component.shapes.items()}
        header, offset = {}, 0
        for key, shape in shapes.items():
            size = int(np.prod(shape)) * 2
            header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / name / WEIGHT_FILES[name], "wb") as handle:
            handle.write(len(raw).to_bytes(8, "little") + raw)
            for shape in shapes.values():
                left = int(np.prod(shape))
                while left:
                    n = min(left, chunk)
                    handle.write((draw.standard_normal(n, np.float32) * 0.02).astype(bfloat16).tobytes())
                    left -= n
    return out


LOAD_SCRIPT = """
import json, sys, time
from pathlib import Path
open("/proc/self/clear_refs", "w").write("5")
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
import jax
from sdxl_engine.config import EngineConfig, apply_jax_options
apply_jax_options(EngineConfig.load({"cpu_devices": 1, "compile_cache_dir": ""}, environ={}))
from sdxl_engine.checkpoint import loading
folder, what = Path(sys.argv[1]), sys.argv[2]
jax.numpy.zeros(1).block_until_ready()
model, graphs_s = None, None
if what == "reload":  # the components known (what a dropped model's reload has): read here, no weights
    t0 = time.perf_counter()
    model = loading.LoadedModel(folder.name, loading.read_model_folder(folder), {}, None, None, {}, "bfloat16",
                                source=str(folder))
    graphs_s = time.perf_counter() - t0
open("/proc/self/clear_refs", "w").write("5")
before, t0 = rss("VmRSS"), time.perf_counter()
if what == "load":
    params = loading.load_model(str(folder), dtype="bfloat16", platform="cpu", cache_dir="", log=lambda *_: None).params
else:
    params = loading.reload_params(model, log=lambda *_: None)
jax.block_until_ready(params)
seconds = time.perf_counter() - t0
nbytes = sum(a.nbytes for p in params.values() for a in p.values())
print(json.dumps({"seconds": seconds, "params_gb": nbytes / 1e9, "configs_and_graphs_s": graphs_s,
                  "peak_growth_gb": (rss("VmHWM") - before) / 1e9,
                  "peak_over_params": (rss("VmHWM") - before) / nbytes}))
"""


def _dd(files: list[Path], direct: bool) -> float:
    t0 = time.perf_counter()
    for path in files:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"] + (["iflag=direct"] if direct else []),
                       check=True, capture_output=True)
    return time.perf_counter() - t0


def bench_load(folder: Path) -> dict:
    """The folder's load and reload (each in a fresh process, one CPU device) against dd of its weight files."""
    files = sorted(folder.glob("*/*.safetensors"))
    size = sum(p.stat().st_size for p in files)
    out = {"folder": folder.name, "files_gb": size / 1e9, "dd_direct_s": _dd(files, True)}
    for what in ("load", "reload"):
        run = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(folder), what], cwd=ROOT, capture_output=True,
                             text=True, check=True)
        out[what] = json.loads(run.stdout.strip().splitlines()[-1])
    out["dd_cached_s"] = _dd(files, False)  # after the loads: the files in the page cache, as the loads read them
    return out


def markdown(report: dict) -> str:
    lines = []
    if "switch" in report:
        s = report["switch"]
        lines += ["Switch between two resident models of one architecture (tiny-random, seeds 0 and 1; "
                  f"{s['images']} images x {s['steps']} steps per request, 4 CPU devices; {s['requests_each']} "
                  "requests each, interleaved):", "",
                  "| requests | median seconds |", "|---|---|",
                  f"| A, A, A, ... | {s['median_s']['A/A']:.3f} |", f"| A, B, A, B, ... | {s['median_s']['A/B']:.3f} |",
                  "", f"Ratio A/B over A/A: **{s['ratio']:.3f}** (goal ≤ 1.05); compiles meanwhile: "
                  f"**{s['compiles']}**, loads: {s['loads']}.", ""]
    if "queue" in report:
        lines += ["A queue of 40 requests over 3 models (tiny-random, seeds 0, 1, 2), served in order:", "",
                  "| pattern, room | seconds | loads | switches |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['seconds']:.1f} | {v['loads']} | {v['switches']} |" for k, v in report["queue"].items()]
        lines.append("")
    if "load" in report:
        lo = report["load"]
        lines += [f"Load of a non-resident model: `{lo['folder']}` ({lo['files_gb']:.2f} GB of bfloat16 safetensors) "
                  "onto one CPU device, each in a fresh process:", "",
                  "| what | seconds | peak RSS growth / params |", "|---|---|---|",
                  f"| first load (load_model: configs, module graphs, weights) | {lo['load']['seconds']:.1f} | "
                  f"{lo['load']['peak_over_params']:.2f}x of {lo['load']['params_gb']:.2f} GB |",
                  f"| reload (reload_params: the weights alone; the components known) | "
                  f"{lo['reload']['seconds']:.1f} | {lo['reload']['peak_over_params']:.2f}x |",
                  f"| (what a reload skips: configs and module graphs, read_model_folder) | "
                  f"{lo['reload']['configs_and_graphs_s']:.1f} | |",
                  f"| dd of the files, O_DIRECT (the disk) | {lo['dd_direct_s']:.1f} | |",
                  f"| dd of the files, page cache (as the loads read them) | {lo['dd_cached_s']:.1f} | |", ""]
    return "\n".join(lines).rstrip("\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("switch", "queue", "fullsize", "load", "all"))
    parser.add_argument("folder", nargs="?", help="fullsize: where to write; load: the folder to load")
    parser.add_argument("--json", default=str(ROOT / "docs" / "benchmarks" / "bench_models.json"))
    parser.add_argument("--md", default=str(ROOT / "docs" / "benchmarks.md"))
    args = parser.parse_args(argv)
    if args.command == "fullsize":
        print(write_fullsize(Path(args.folder)))
        return
    path = Path(args.json)
    report = json.loads(path.read_text()) if path.exists() else {}
    if args.command in ("switch", "all"):
        report["switch"] = bench_switch()
    if args.command in ("queue", "all"):
        report["queue"] = bench_queue()
    if args.command == "load":
        report["load"] = bench_load(Path(args.folder))
    path.write_text(json.dumps(report, indent=2))
    from tools.report import write_section

    write_section(Path(args.md), SECTION, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
