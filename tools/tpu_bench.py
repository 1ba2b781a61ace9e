"""The engine on the chip the blog was written for, and the blog's own pipeline beside it: one command, JSON out.

    python3.11 -m tools.tpu_bench --out DIR [--images 1,4] [--blog] [--size 1024] [--steps 20]

Run on the lent TPU v5e machine as it is (Python 3.11, its jax 0.10.2 + libtpu, flax and transformers from its own
package index; the blog's stack, diffusers 0.39 and transformers 4.57.6, carried as wheels for ``tools.tpu_blog``):
one process holds the chip at a time and nothing opens a socket, so each side runs in a process of its own, one after
the other, the engine in-process (``Engine(...).start()`` then ``generate``, as the service calls it).

For each images-per-request count N (``--images``):

1. **cold**: a new process starts the engine on ``sdxl-base-random`` (SDXL 1.0 base's architecture, random bfloat16
   weights made on the chip) at ``--size``², N images per request, progress on (the server's default: the host runs
   the steps and reports each), Euler, ``--steps`` steps, guidance 5, with an empty executable cache in DIR; then
   ``--requests`` requests with a step receiver (every step's event, previews on their default cadence), a Stop
   after 5 steps (it must raise Stopped and leave the engine serving), and exits.
2. **warm**: a second process starts on the same cache, DIR/cache-N (its programs load, nothing compiles), and
   does the same. A cold side empties that cache first; with ``--add`` a later call's warm side uses it. A warm
   start reads the executables the start before it recorded while its weights load (program/executables.py,
   "preload"); **unread** is a warm side with that record removed first, so its executables are read after the
   weights, as before the preload: ``--sides cold,warm,unread,warm,unread`` compares the two, alternating.

Each side's ``first_image_s`` is the time from its process's spawn to its first request's images (the start, the
interpreter's and the imports' included).

Each process prints one JSON line (start-up stages, per-request device and latency seconds, per-image seconds,
images/s, the step events seen, the Stop's outcome, the HBM peak, JAX's version and the device) and must exit 0:
its exit code is part of the result. With ``--blog``, ``python3.11 -m tools.tpu_blog`` then times the blog's
pipeline on the same settings (its own interpreter path: ``--blog-python``). Everything lands in DIR/tpu_bench.json,
with the ratio "engine per image / blog per image" where both ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

PROMPT = "a photograph of an astronaut riding a horse"  # the blog's
NEGATIVE = ""
GUIDANCE = 5.0
STOP_AFTER = 5  # the Stop check: should_stop answers True once this many steps have been reported


def engine_side(args) -> dict:
    """One engine process (cold or warm, by what the cache holds): start, requests, a Stop, a last request."""
    import jax

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine
    from sdxl_engine.engine.steps import Stopped
    from sdxl_engine.engine.validation import GenerateRequest
    from sdxl_engine.models import unet

    logs: list[str] = []
    t0 = time.perf_counter()
    config = EngineConfig.load({
        "model": args.model, "width": args.size, "height": args.size, "images_per_request": args.images,
        "num_inference_steps": args.steps, "guidance_scale": GUIDANCE, "sampler": "Euler",
        "compile_cache_dir": str(args.cache), "progress": True, "precompile": "off", "max_run_seconds": 0,
        **({"cpu_devices": args.cpu_devices} if args.cpu_devices else {})})
    engine = Engine(config, log=logs.append).start()
    spawned = float(os.environ.get("TPU_BENCH_SPAWNED", "nan"))  # the parent's time.time() at Popen
    out: dict = {"side": "engine", "images": args.images, "size": args.size, "steps": args.steps,
                 "start_s": time.perf_counter() - t0, "ready_s_from_spawn": time.time() - spawned,
                 "startup": dict(engine.startup), "geglu_mode": unet.geglu_mode(),
                 "device": engine.device_summary, "jax": jax.__version__, "python": sys.version.split()[0],
                 "cache": [line for line in logs if "executable cache" in line or "loaded " in line
                           or "stored " in line or "reading the" in line or "read while" in line][:8]}
    requests = []
    for k in range(args.requests):
        events = []
        request = GenerateRequest(PROMPT, negative_prompt=NEGATIVE, seed=k, num_inference_steps=args.steps,
                                  guidance_scale=GUIDANCE)
        result = engine.generate(request, on_step=events.append, should_stop=lambda: False)
        requests.append({"device_s": result.timings["device"], "latency_s": result.timings["latency"],
                         "steps_reported": [e.step for e in events],
                         "previews": sum(e.preview is not None for e in events),
                         "mean_pixel": float(result.images.mean())})
        out.setdefault("first_image_s", time.time() - spawned)
    out["requests"] = requests
    device = [r["device_s"] for r in requests[1:] or requests]  # the first request after the start is not timed
    out["per_request_s"] = statistics.median(device)
    out["per_image_s"] = out["per_request_s"] / args.images
    out["images_per_s"] = args.images / out["per_request_s"]
    seen: list[int] = []

    def stop_after() -> bool:
        return len(seen) >= STOP_AFTER

    try:
        engine.generate(GenerateRequest(PROMPT, seed=99, num_inference_steps=args.steps, guidance_scale=GUIDANCE),
                        on_step=lambda e: seen.append(e.step), should_stop=stop_after)
        out["stop"] = {"stopped": False, "steps_seen": seen}
    except Stopped as err:
        out["stop"] = {"stopped": True, "message": str(err), "steps_seen": seen}
    after = engine.generate(GenerateRequest(PROMPT, seed=7, num_inference_steps=args.steps, guidance_scale=GUIDANCE),
                            on_step=lambda e: None, should_stop=lambda: False)
    out["after_stop_device_s"] = after.timings["device"]
    out["hbm_peak_gb"] = hbm_peak_gb(jax)
    out["loaded_programs"] = sorted(str(shape) for shape, p in engine.programs.compiled.items()
                                    if getattr(p, "loaded", False))
    return out


def hbm_peak_gb(jax) -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def run_child(cmd: list[str], log: Path, timeout: float, path_first: str = "", rss_limit_gb: float = 0.0) -> dict:
    """Run one side's process (``path_first`` ahead of its PYTHONPATH); its last JSON line, its exit code, its wall
    time and its peak resident host memory (``host_rss_peak_gb``, sampled every 0.2 s from /proc). Over
    ``rss_limit_gb`` (0: no limit) the process is killed and the result says so: the lent machine's 40 GiB are
    shared with the bench itself, and a kill there by the system loses the whole command's output."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TPU_BENCH_SPAWNED": repr(time.time())}
    if path_first:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path_first, env.get("PYTHONPATH", "")]))
    peak, code = 0.0, None
    with log.open("w") as handle, tempfile.TemporaryFile("w+") as stdout_file:
        proc = subprocess.Popen(cmd, stdout=stdout_file, stderr=handle, text=True, env=env)
        while code is None:
            try:
                code = proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                peak = max(peak, rss_gb(proc.pid))
                if time.perf_counter() - start > timeout:
                    proc.kill()
                    code = "timeout"
                elif rss_limit_gb and peak > rss_limit_gb:
                    proc.kill()
                    code = f"killed: host memory over {rss_limit_gb} GB"
        proc.wait()
        stdout_file.seek(0)
        stdout = stdout_file.read()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": f"no result; see {log}"}
    result.update(exit_code=code, wall_s=time.perf_counter() - start, host_rss_peak_gb=peak or None)
    if code != 0:
        result["stderr_tail"] = log.read_text()[-1500:]
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}), flush=True)
    return result


def rss_gb(pid: int) -> float:
    """Resident memory of process ``pid`` in GB (10^9 bytes), 0.0 where /proc cannot say (gone, another OS)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON, the logs and the executable cache")
    p.add_argument("--images", default="1,4", help="images per request, comma-separated")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--model", default="sdxl-base-random")
    p.add_argument("--sides", default="cold,warm", help="engine processes per count: cold, warm, unread")
    p.add_argument("--blog", action="store_true", help="also the blog's pipeline (python -m tools.tpu_blog)")
    p.add_argument("--blog-python", default=sys.executable)
    p.add_argument("--blog-images", default="1", help="images per call for the blog's pipeline")
    p.add_argument("--blog-path", default="", help="folder ahead of PYTHONPATH for the blog's process (its diffusers "
                                                   "0.39 and transformers 4.57.6, which the engine does not run on)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--rss-limit", type=float, default=34.0, help="GB of host memory a side's process may hold")
    p.add_argument("--add", action="store_true",
                   help="add to DIR/tpu_bench.json's runs (one benchmark split into calls: the lent chip runs a "
                        "command for at most 10 minutes)")
    p.add_argument("--cpu-devices", type=int, default=0, help=argparse.SUPPRESS)  # CPU runs of this tool (tests)
    p.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)  # one engine process
    p.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine:
        args.images = int(args.images)
        print(json.dumps(engine_side(args)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    written = args.out / "tpu_bench.json"
    report: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "size": args.size,
                    "steps": args.steps, "guidance": GUIDANCE, "runs": []}
    if args.add and written.exists():
        report = json.loads(written.read_text())

    def save() -> None:  # after every run: a command cut short keeps what it finished
        report["ratios"] = ratios(report)
        written.write_text(json.dumps(report, indent=1))
    for n in [int(x) for x in args.images.split(",") if x]:
        cache = args.out / f"cache-{n}"  # a later call's warm side (--add) finds the cold side's executables
        for side in args.sides.split(","):
            if side == "cold":
                shutil.rmtree(cache, ignore_errors=True)
            elif side == "unread":  # no record of the last start: nothing read early (this start records anew)
                (cache / "executables" / "starts.json").unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "tools.tpu_bench", "--engine", "--out", str(args.out), "--cache", str(cache),
                   "--images", str(n), "--size", str(args.size), "--steps", str(args.steps), "--requests",
                   str(args.requests), "--model", args.model, "--cpu-devices", str(args.cpu_devices)]
            run = run_child(cmd, args.out / f"engine-{n}-{side}.log", args.timeout, rss_limit_gb=args.rss_limit)
            report["runs"].append({"start": side, **run})
            save()
    if args.blog:
        cmd = [args.blog_python, "-m", "tools.tpu_blog", "--size", str(args.size), "--steps", str(args.steps),
               "--guidance", str(GUIDANCE), "--images", args.blog_images, "--out", str(args.out / "blog.json")]
        run = run_child(cmd, args.out / "blog.log", args.timeout, args.blog_path, args.rss_limit)
        rows = args.out / "blog.json"  # every count's row (stdout's last line is the last count's)
        report["blog"] = {**run, **(json.loads(rows.read_text()) if rows.exists() else {})}
    save()
    print(json.dumps({"ratios": report["ratios"]}), flush=True)


def ratios(report: dict) -> dict:
    """Engine per-image seconds over the blog's, per images-per-request count both ran (warm runs preferred)."""
    blog = report.get("blog") or {}
    per_blog = {int(r["images_per_call"]): r["per_image_s"] for r in blog.get("results", []) if "per_image_s" in r}
    out = {}
    for run in report["runs"]:
        n = run.get("images")
        if n is None or "per_image_s" not in run:
            continue
        base = per_blog.get(n) or per_blog.get(1)
        if base:
            out[f"{n} images, {run['start']}"] = run["per_image_s"] / base
    return out


if __name__ == "__main__":
    main()
