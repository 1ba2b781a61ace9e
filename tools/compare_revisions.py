"""Engine latency of two checkouts side by side: alternating requests, one run, one machine.

    git worktree add /tmp/oldmain 6080b49         # the revision to compare with, and a venv that runs it
    python -m tools.compare_revisions --a /tmp/oldmain --a-python /tmp/vold/bin/python --rounds 40

Each checkout's engine runs in its own process (its own interpreter and packages: a revision on an
older stack keeps it) with a fresh compile cache; after two warm-up rounds, every round sends one
request to each, in alternating order, so both see the same load on a shared machine. Reports
the median engine latency and device time (seconds) of each and their ratio (b / a). The request:
tiny-shapes, "a red circle on the left", 20 steps, guidance 5, seed = the round (the engine's
``EngineConfig``/``GenerateRequest`` as both revisions define them). Extra environment for both
processes can be given as ``NAME=VALUE`` with ``--env``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Runs inside each checkout's interpreter, with that checkout first on sys.path.
WORKER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from sdxl_engine.config import EngineConfig
try:  # the layout with sdxl_engine/ in folders
    from sdxl_engine.engine.local import Engine
    from sdxl_engine.engine.validation import GenerateRequest
except ImportError:  # an older checkout
    from sdxl_engine.engine import Engine
    from sdxl_engine.validation import GenerateRequest
engine = Engine(EngineConfig.load({"model": "tiny-shapes"}), log=lambda *a: None).start()
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    r = engine.generate(GenerateRequest("a red circle on the left", seed=int(line), num_inference_steps=20,
                                        guidance_scale=5.0))
    print(json.dumps({"latency": r.timings["latency"], "device": r.timings["device"]}), flush=True)
"""


def start(python: str, checkout: Path, env: dict[str, str]) -> subprocess.Popen:
    """One checkout's engine process, started and ready (raises RuntimeError if it dies first)."""
    cache = tempfile.mkdtemp(prefix="sdxl-compare-")
    proc = subprocess.Popen([python, "-c", WORKER, str(checkout)], cwd=checkout, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "SDXL_COMPILE_CACHE_DIR": cache, "PYTHONWARNINGS": "ignore", **env})
    if not proc.stdout.readline():
        raise RuntimeError(f"the engine of {checkout} ({python}) did not start")
    return proc


def compare(a: tuple[str, Path], b: tuple[str, Path], rounds: int, env: dict[str, str]) -> dict:
    """Alternating rounds against both engines; medians and ratios (b / a)."""
    procs = {"a": start(*a, env), "b": start(*b, env)}
    seconds = {name: {"latency": [], "device": []} for name in procs}
    try:
        for i in range(rounds + 2):
            for name in ("a", "b") if i % 2 == 0 else ("b", "a"):
                procs[name].stdin.write(f"{i}\n")
                procs[name].stdin.flush()
                reply = json.loads(procs[name].stdout.readline())
                if i >= 2:  # two warm-up rounds
                    for key in seconds[name]:
                        seconds[name][key].append(reply[key])
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    med = {name: {k: statistics.median(v) for k, v in s.items()} for name, s in seconds.items()}
    return {"a": str(a[1]), "b": str(b[1]), "rounds": rounds, "median_s": med,
            "ratio_b_over_a": {k: med["b"][k] / med["a"][k] for k in ("latency", "device")}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="the other checkout (e.g. a worktree of the previous main)")
    p.add_argument("--a-python", default=sys.executable, help="an interpreter that runs it")
    p.add_argument("--b", default=str(ROOT), help="default: this checkout")
    p.add_argument("--b-python", default=sys.executable)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for both engines (SDXL_CPU_DEVICES=1)")
    args = p.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    print(json.dumps(compare((args.a_python, Path(args.a)), (args.b_python, Path(args.b)), args.rounds, env), indent=1))


if __name__ == "__main__":
    main()
