"""How much of a pytest run is JAX compiling: XLA's compile, tracing and lowering seconds, per test file and per test,
from JAX's own monitoring events in every Python process the run starts (its xdist workers and the ``python app.py``
processes the tests start, each counted under the test that started it). Figures: docs/benchmarks.md, "Test time: how
much is compiling", and docs/testing.md's 2026-12-08 paragraph.

    python -m tools.compile_share --json share.json -- -q tests

Everything after ``--`` goes to ``python -m pytest``. Each process gets a ``sitecustomize`` (through PYTHONPATH) that
registers listeners on JAX's monitoring events once ``jax._src.monitoring`` is imported, so a process that never
imports JAX stays as it was (the tests that check what the app imports still pass), and writes one JSON line per
event to a folder of its own; the summary reads them after the run. The seconds are wall seconds of each call on its
thread, so on a busy machine they include waiting for a core.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# JAX's event names (jax/_src/dispatch.py, compiler.py, compilation_cache.py in jax 0.10 to 0.12).
EVENTS = {"/jax/core/compile/backend_compile_duration": "compile_s",
          "/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/compilation_cache/cache_hits": "cache_hits",
          "/jax/compilation_cache/cache_misses": "cache_misses"}

SITECUSTOMIZE = '''\
import importlib.abc, importlib.machinery, json, os, sys
_DIR = os.environ.get("COMPILE_SHARE_DIR")
_EVENTS = %(events)r
# Set at a process's start only in a process a test started (pytest's own processes set it later, per test).
_STARTED = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def _listen(monitoring):
    out = open(os.path.join(_DIR, "%%d.jsonl" %% os.getpid()), "a", buffering=1)
    out.write(json.dumps({"process": " ".join(sys.argv[:2]), "test": _STARTED}) + "\\n")

    def write(event, seconds):
        if event in _EVENTS:
            test = _STARTED or os.environ.get("PYTEST_CURRENT_TEST", "")
            out.write(json.dumps({"event": _EVENTS[event], "s": seconds, "test": test.rsplit(" (", 1)[0]}) + "\\n")

    monitoring.register_event_duration_secs_listener(lambda event, seconds, **_: write(event, seconds))
    monitoring.register_event_listener(lambda event, **_: write(event, 1.0))


class _After(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of jax._src.monitoring to register the listeners once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "jax._src.monitoring":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _listen(module)

            spec.loader.exec_module = exec_module
        return spec


if _DIR:
    sys.meta_path.insert(0, _After())
'''


def summarize(folder: Path, top: int = 30) -> dict:
    """The events written under ``folder``: totals, and seconds and counts per test file and per test (the ``top``
    tests by compile seconds), each split by where they ran ("tests": the pytest processes, "apps": the processes
    a test started)."""
    totals = {where: collections.Counter() for where in ("tests", "apps")}
    files, tests = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    processes = collections.Counter()
    for path in sorted(folder.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not lines:
            continue
        where = "apps" if lines[0]["test"] else "tests"
        processes[where] += 1
        for line in lines[1:]:
            name, key = line["test"] or "(outside a test)", line["event"]
            value = line["s"] if key.endswith("_s") else 1
            for row in (totals[where], files[name.split("::")[0]], tests[name]):
                row[key] += value
                row["compiles"] += key == "compile_s"
    ranked = sorted(tests.items(), key=lambda item: -item[1]["compile_s"])[:top]
    return {"processes": dict(processes), "totals": {k: dict(v) for k, v in totals.items()},
            "files": {k: dict(v) for k, v in sorted(files.items(), key=lambda item: -item[1]["compile_s"])},
            "tests": {k: dict(v) for k, v in ranked}}


def _table(rows: dict, limit: int) -> list[str]:
    lines = [f"{'compile s':>10} {'compiles':>8} {'trace s':>8} {'lower s':>8} {'misses':>7}  name"]
    for name, row in list(rows.items())[:limit]:
        lines.append(f"{row.get('compile_s', 0):10.1f} {row.get('compiles', 0):8d} {row.get('trace_s', 0):8.1f} "
                     f"{row.get('lower_s', 0):8.1f} {row.get('cache_misses', 0):7d}  {name}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the summary here as JSON")
    parser.add_argument("--top", type=int, default=30, help="tests and files listed (default 30)")
    args = parser.parse_args(ours)
    with tempfile.TemporaryDirectory(prefix="compile-share-") as scratch:
        hook, events = Path(scratch) / "hook", Path(scratch) / "events"
        hook.mkdir()
        events.mkdir()
        (hook / "sitecustomize.py").write_text(SITECUSTOMIZE % {"events": EVENTS})
        # PYTEST_CURRENT_TEST marks a process a test started: not the run's own (this tool may run inside a test).
        env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}, "COMPILE_SHARE_DIR": str(events),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
        status = subprocess.call([sys.executable, "-m", "pytest", *pytest_args], env=env)
        summary = {"pytest_exit_status": status, **summarize(events, args.top)}
    for where, row in summary["totals"].items():
        said = (f"{k} {v:.1f}" if k.endswith("_s") else f"{k} {v}" for k, v in sorted(row.items()))
        print(f"{where}: {', '.join(said)} ({summary['processes'].get(where, 0)} processes)")
    print("\n".join(["", "by file:", *_table(summary["files"], args.top), "", "by test:",
                     *_table(summary["tests"], args.top)]))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
