"""Warm start at full size: process start -> ready, cold (empty caches) vs warm (the same caches).

    python -m tools.bench --warm-start        # or: python -m tools.warmstart

Starts the engine twice, each time in a fresh process, on one new cache folder: first empty
(cold), then as the first start left it (warm: the executable cache and XLA's cache filled).
The setting: ``sdxl-base-random`` in bfloat16 (SDXL base's architecture, 3.47 B
parameters), 256², 1 image, 1 CPU device, 1 step. Each start reports:

* process start -> ready (wall clock from ``Popen`` to the engine's ready), and the part before
  the engine starts (interpreter, imports);
* each stage: load (modules built, random weights made on the device, tokenizers), compile (or
  the executable cache's load), warm-up (zero denoising steps, engine.py);
* the first and second 1-step requests after ready (the UNet step the warm-up no longer pays);
* traces, lowerings and XLA compiles per stage (JAX's monitoring events);
* host memory: the peak while loading (VmHWM, reset before the engine starts) against the
  params' bytes, the whole start's peak, and RSS when ready.

Results go to docs/benchmarks.md (section ``warm-start``) and ``bench_warmstart.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.local import Engine
from sdxl_engine.engine.validation import GenerateRequest
from tools.report import write_section

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"SDXL_MODEL": "sdxl-base-random", "SDXL_DTYPE": "bfloat16", "SDXL_CPU_DEVICES": "1",
            "SDXL_IMAGES_PER_REQUEST": "1", "SDXL_WIDTH": "256", "SDXL_HEIGHT": "256",
            "SDXL_NUM_INFERENCE_STEPS": "1", "SDXL_MAX_INFERENCE_STEPS": "1"}
GOALS = {"ready": 0.3, "compile": 0.1}  # warm / cold: the goals set for the warm start
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "traces",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowerings",
          "/jax/core/compile/backend_compile_duration": "xla_compiles"}


def _status(field: str) -> int:
    """Bytes of ``field`` (VmRSS, VmHWM) in /proc/self/status."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def child() -> None:
    """One start, in this process: prints one JSON line (see the module docstring)."""
    imported = time.time()
    engine = None
    events: dict[str, dict[str, int]] = {}
    memory: dict[str, int] = {}

    def on_event(event: str, *args, **kwargs) -> None:
        if event in EVENTS:
            stage = events.setdefault(engine.stage.split(" ")[0] if engine else "imports", {})
            stage[EVENTS[event]] = stage.get(EVENTS[event], 0) + 1

    def log(line: str) -> None:
        if "] load_s:" in line:  # the end of the load stage, logged from the engine's thread
            memory.update(load_peak=_status("VmHWM"), after_load=_status("VmRSS"))
        lines.append(line)

    lines: list[str] = []
    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    engine = Engine(EngineConfig.load(), log=log)
    with open("/proc/self/clear_refs", "w") as f:  # Linux: VmHWM := VmRSS, so the peaks below are this start's
        f.write("5")
    memory["base"] = _status("VmRSS")
    engine.start()
    ready = time.time()
    memory.update(peak=_status("VmHWM"), ready=_status("VmRSS"))
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params))
    requests = []
    for seed in (1, 2):
        t0 = time.perf_counter()
        engine.generate(GenerateRequest("a red circle", seed=seed, num_inference_steps=1))
        requests.append(time.perf_counter() - t0)
    print(json.dumps({"imported": imported, "ready": ready, "startup": engine.startup, "events": events,
                      "memory": memory, "params_bytes": params_bytes, "requests_1_step": requests,
                      "device": engine.device_summary,
                      "program_line": next((x for x in lines if "] compiled " in x or "] loaded " in x), ""),
                      "log": lines}))


def start(cache: Path, timeout: float) -> dict:
    """Run :func:`child` in a fresh process on ``cache``; its JSON plus ``process_to_ready_s``."""
    env = {**os.environ, **SETTINGS, "SDXL_COMPILE_CACHE_DIR": str(cache / "jax"),
           "SDXL_MODEL_CACHE_DIR": str(cache / "models"), "PYTHONPATH": str(ROOT)}
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_NUM_CPU_DEVICES", "SDXL_EXECUTABLE_CACHE"):
        env.pop(name, None)  # each would change what is measured
    spawned = time.time()
    out = subprocess.run([sys.executable, "-m", "tools.warmstart", "--child"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the engine's start failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_to_ready_s"] = result["ready"] - spawned
    result["process_to_engine_s"] = result["imported"] - spawned
    return result


def run(timeout: float) -> dict:
    """Cold, then warm, on one new cache folder (removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="sdxl-warmstart-") as folder:
        cold = start(Path(folder), timeout)
        warm = start(Path(folder), timeout)
    return {"machine": f"{platform.machine()} {os.cpu_count()} cores, {cold['device']}",
            "settings": SETTINGS, "cold": cold, "warm": warm,
            "ratios": {"ready": warm["process_to_ready_s"] / cold["process_to_ready_s"],
                       "compile": warm["startup"]["compile_s"] / cold["startup"]["compile_s"]}}


def _events(r: dict, after_load: bool) -> str:
    stages = [s for s in r["events"] if s != "loading"] if after_load else list(r["events"])
    total = {k: sum(r["events"][s].get(k, 0) for s in stages) for k in EVENTS.values()}
    return " / ".join(str(total[k]) for k in EVENTS.values())


def markdown(r: dict) -> str:
    """The docs/benchmarks.md table for one run."""
    cold, warm, gb = r["cold"], r["warm"], 1e9

    def row(name: str, c: float, w: float, unit: str = "s", goal: str = "") -> str:
        return f"| {name} | {c:.1f} {unit} | {w:.1f} {unit} | {w / c:.3f} | {goal} |"

    def peak(x: dict, key: str) -> float:
        return (x["memory"][key] - x["memory"]["base"]) / gb

    met = {k: "met" if r["ratios"][k] <= v else "**missed**" for k, v in GOALS.items()}
    params = cold["params_bytes"] / gb
    load_met = "met" if max(peak(cold, "load_peak"), peak(warm, "load_peak")) <= 1.3 * params else "**missed**"
    s = r["settings"]
    lines = [
        f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {r['machine']} · `{s['SDXL_MODEL']}` "
        f"{s['SDXL_DTYPE']} ({params:.2f} GB of params) · {s['SDXL_IMAGES_PER_REQUEST']} image of "
        f"{s['SDXL_WIDTH']}x{s['SDXL_HEIGHT']} · {s['SDXL_NUM_INFERENCE_STEPS']} step · each start a fresh process; "
        "cold: an empty cache folder, warm: the same folder after it", "",
        "| start | cold | warm | warm / cold | goal |", "|---|---|---|---|---|",
        row("process start → ready", cold["process_to_ready_s"], warm["process_to_ready_s"],
            goal=f"≤ {GOALS['ready']} ({met['ready']})"),
        row("… of which interpreter and imports", cold["process_to_engine_s"], warm["process_to_engine_s"]),
        row("load: build modules, random weights on the device, tokenizers", cold["startup"]["load_s"],
            warm["startup"]["load_s"]),
        row("compile stage (warm: executable cache load)", cold["startup"]["compile_s"], warm["startup"]["compile_s"],
            goal=f"≤ {GOALS['compile']} ({met['compile']})"),
        row("warm-up request (zero denoising steps)", cold["startup"]["warmup_s"], warm["startup"]["warmup_s"]),
        row("first 1-step request after ready", cold["requests_1_step"][0], warm["requests_1_step"][0]),
        row("second 1-step request", cold["requests_1_step"][1], warm["requests_1_step"][1]),
        f"| traces / lowerings / XLA compiles, whole start | {_events(cold, False)} | {_events(warm, False)} | | |",
        f"| … after loading the model | {_events(cold, True)} | {_events(warm, True)} | | warm: 0 / 0 / 0 |",
        row("host peak growth while loading (VmHWM)", peak(cold, "load_peak"), peak(warm, "load_peak"), "GB"),
        f"| … ÷ params' bytes | {peak(cold, 'load_peak') / params:.2f}x | {peak(warm, 'load_peak') / params:.2f}x | "
        f"| ≤ 1.3x ({load_met}) |",
        row("host peak growth, whole start (VmHWM)", peak(cold, "peak"), peak(warm, "peak"), "GB"),
        f"| process RSS when ready | {cold['memory']['ready'] / gb:.1f} GB | {warm['memory']['ready'] / gb:.1f} GB "
        "| | |",
        "", "The program's log line, cold then warm:", "",
        f"    {cold['program_line']}", f"    {warm['program_line']}",
    ]
    return "\n".join(lines)


def main(args=None) -> None:
    """``bench --warm-start`` calls this with its args; ``python -m ...warmstart`` parses its own."""
    if args is None:
        parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
        parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per start")
        parser.add_argument("--md", default=str(ROOT / "docs/benchmarks.md"))
        parser.add_argument("--json", default=str(ROOT / "docs" / "benchmarks" / "bench.json"))
        args = parser.parse_args()
        if args.child:
            return child()
    result = run(getattr(args, "timeout", 3600.0))
    Path(args.json).with_name("bench_warmstart.json").write_text(json.dumps(result, indent=2))
    write_section(Path(args.md), "warm-start", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
