"""The two-call samplers' cost against Euler's, alternating rounds, one engine (docs/benchmarks.md).

    python -m tools.bench_two_calls [--model tiny-shapes] [--steps 20] [--runs 7]

The first request of each leg compiles (or loads) its program: the compile counts and the seconds of each such
first request (compile included) are reported; then per round one request of each leg in turn, Euler, Heun, DPM2
and DPM++ SDE at ``--steps``, and Heun at 1 step (one UNet call: its last step's second call is skipped). Reports
each leg's median ``timings["device"]`` (the compiled program, until ready), the per-round ratios' median to Euler,
and the compiles the measured rounds made (0: the three share one program, and a step count is a traced input).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.local import Engine
from sdxl_engine.engine.validation import GenerateRequest

LEGS = {"Euler": ("Euler", None), "Heun": ("Heun", None), "DPM2": ("DPM2", None), "DPM++ SDE": ("DPM++ SDE", None),
        "Euler 1 step": ("Euler", 1), "Heun 1 step": ("Heun", 1)}


def measure(engine: Engine, steps: int, runs: int) -> dict:
    """{leg: median device seconds}, the median per-round ratios to Euler, the first requests' seconds and
    compiles, and the compiles while measuring."""
    def run(leg, seed):
        sampler, fixed = LEGS[leg]
        request = GenerateRequest("a red circle", seed=seed, num_inference_steps=fixed or steps, sampler=sampler)
        return engine.generate(request).timings["device"]

    first = {}
    for leg in LEGS:  # compile (or load) and warm up each program
        before, t0 = engine.compile_count, time.perf_counter()
        run(leg, 0)
        first[leg] = {"seconds": time.perf_counter() - t0, "compiles": engine.compile_count - before}
    before = engine.compile_count
    rounds = [{leg: run(leg, seed) for leg in LEGS} for seed in range(1, runs + 1)]
    return {"model": engine.model.name, "devices": engine.device_summary, "batch": engine.batch,
            "size": list(engine.limits.default_size), "steps": steps, "runs": runs, "first_request": first,
            "device_s": {leg: statistics.median(r[leg] for r in rounds) for leg in LEGS},
            "ratio_to_euler": {leg: statistics.median(r[leg] / r["Euler"] for r in rounds) for leg in LEGS},
            "compiles_while_measuring": engine.compile_count - before, "rounds": rounds}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_two_calls", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-shapes")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    engine = Engine(EngineConfig.load({"model": args.model}), log=lambda *a: None).start()
    print(json.dumps(measure(engine, args.steps, args.runs), indent=1))


if __name__ == "__main__":
    main()
