"""The engine against the blog's own JAX pipeline, on the same work, alternating: issue #51.

    python -m tools.vs_blog --blog-python /work/venv-blog/bin/python --rounds 7            # 64² and 256²
    python -m tools.vs_blog --blog-python /work/venv-blog/bin/python --rounds 7 --parts --cost
    python -m tools.vs_blog --blog-python /work/venv-blog/bin/python --rounds 3 --profile             # kernel times
    python -m tools.vs_blog --blog-python /work/venv-blog/bin/python --fullsize            # 1024², lowered only

Two long-lived processes per size, each loaded, compiled and warmed up: the engine (this interpreter: its default
config on 4 CPU devices, so the per-step progress hook is on, with an ``on_step`` and ``should_stop`` as the page
passes them) and diffusers 0.39's ``FlaxStableDiffusionXLPipeline`` doing the blog's ``generate()``
(tools/blog_pipeline.py, in ``--blog-python``: ``jit=True``, pmap over the same 4 devices, params replicated).
Both load the shipped tiny-shapes with one change to its scheduler config, ``timestep_spacing`` "leading" with
``steps_offset`` 1: diffusers' Flax Euler looks each step's sigma up by its int32-cast timestep (``jnp.where(
timesteps == t)``), which finds only whole timesteps, and its "leading" spacing always adds 1; with these two
values both sides run the same 20 Euler steps (the engine honours both fields), so the images can be compared.
Same prompt and negative prompt, guidance 5, 4 images (one per device), float32 (the engine's CPU default).

Each round sends one request to each side, after half a second of idle (``SETTLE_S``), the sides in every order
in turn (each first, and after each other side, equally often over 6 rounds with 3 sides); the figure per side is the
engine's reported latency (``timings["latency"]``: prepare, device, copy to host) and the blog's whole
``generate()`` (tokenize, replicate, pipeline, ``numpy_to_pil``), and per round their ratio; also each side's
process CPU time for the request (all its threads: on 2 shared cores it moves far less with the load than the
wall time does, and says which side does more work). Before the rounds the
images are compared: the engine's for seed S, and the blog pipeline's on the engine's initial noise for S.
``--before DIR`` runs a second engine from another checkout (the revision before a change) as a third side in the
same rounds, so a before/after table comes from one run on one load.

``--parts``: where the time goes on each side (text encoders, one CFG step, VAE decode, host work, the whole
request at 1 and at 20 steps). ``--cost``: XLA's cost analysis (FLOPs, bytes accessed) of each side's compiled
program and the counts of the ops that differ in its optimized HLO. ``--profile``: each side's kernels under
``jax.profiler``, their thread time per request, and the ones that differ most (tools/xla_profile.py).
``--fullsize``: the same count at 1024² for SDXL base's configs with abstract bfloat16 weights, lowered and
compiled, not run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT, NEGATIVE = "a red circle on the left", "a blue square"  # tools/blog_pipeline.py's
STEPS, GUIDANCE, DEVICES = 20, 5.0, 4
# Seconds of idle before each timed request: XLA:CPU's worker threads spin a while after a program ends, so a side
# timed right after another shared the cores with it; with a fixed order that put one side behind the blog in every
# round (at 64² an engine's figure moved by about 4 % with its place: docs/benchmarks.md).
SETTLE_S = 0.5
SDXL_CONFIGS = ROOT / "sdxl_engine" / "checkpoint" / "configs" / "sdxl-base-1.0"


def comparable_model(workdir: Path) -> Path:
    """A copy of the shipped tiny-shapes whose scheduler config both sides run step for step (module docstring)."""
    from sdxl_engine.checkpoint.builtin import TINY_SHAPES_DIR

    copy = workdir / "tiny-shapes"
    shutil.copytree(TINY_SHAPES_DIR, copy)
    path = copy / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "timestep_spacing": "leading", "steps_offset": 1}, indent=1))
    return copy


# ---- the engine's side, in its own process --------------------------------------------------------------------
def engine_worker(model: str, size: int) -> None:
    """The engine as tools/blog_pipeline.py's twin: the same ops on stdin, JSON replies on stdout."""
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    config = EngineConfig.load({"model": model, "width": size, "height": size, "cpu_devices": DEVICES,
                                "num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "sampler": "Euler",
                                "compile_cache_dir": tempfile.mkdtemp(prefix="vs-blog-cache-"),
                                # no run-time refusal: on a loaded machine the start-up's step time can put a 256²
                                # request over the default 30 s, and this compares speed, not admission
                                "max_run_seconds": 0})
    engine = Engine(config, log=lambda *_: None).start()
    for seed in range(2):
        engine_request(engine, seed)
    import jax

    print(json.dumps({"ready": True, "jax": jax.__version__, "devices": engine.mesh.devices.size,
                      "progress": config.progress, "preview_every": config.preview_every}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "time":
            cpu = time.process_time()
            timings = engine_request(engine, int(cmd["seed"])).timings
            reply = {"latency": timings["latency"], "device": timings["device"], "prep": timings["prep"],
                     "post": timings["post"], "cpu": time.process_time() - cpu}
        elif cmd["op"] == "images":
            reply = engine_images(engine, int(cmd["seed"]), cmd["latents"], cmd["out"])
        elif cmd["op"] == "parts":
            reply = engine_parts(engine, int(cmd.get("runs", 5)))
        elif cmd["op"] == "cost":
            reply = engine_cost(engine)
        elif cmd["op"] == "profile":
            reply = engine_profile(engine, Path(cmd["dir"]), int(cmd.get("runs", 2)))
        else:
            reply = {"error": f"unknown op {cmd['op']!r}"}
        print(json.dumps(reply), flush=True)


def engine_request(engine, seed: int, steps: int = STEPS):
    from sdxl_engine.engine.validation import GenerateRequest

    request = GenerateRequest(PROMPT, negative_prompt=NEGATIVE, seed=seed, num_inference_steps=steps,
                              guidance_scale=GUIDANCE)
    return engine.generate(request, on_step=lambda event: None, should_stop=lambda: False)  # as the page's handler


def engine_images(engine, seed: int, latents_path: str, out: str) -> dict:
    """The engine's images for ``seed`` (its served path), and the initial noise they started from (unit normal,
    before the sampler's initial scale), for the blog's pipeline to start from."""
    import numpy as np

    from sdxl_engine.program.generate import initial_noise, latent_shape

    result = engine_request(engine, seed)
    seeds = np.asarray(result.seeds, np.uint32)
    h, w = engine.limits.default_size[1], engine.limits.default_size[0]
    np.savez(latents_path, latents=np.asarray(initial_noise(seeds, latent_shape(engine.model, h, w))))
    np.savez(out, images=result.images)
    return {"seeds": [int(s) for s in seeds]}


def engine_parts(engine, runs: int) -> dict:
    """Medians (seconds) of the engine's parts, each its own sharded jit (tools/bench.py's), its host work (the
    request's prepare and copy-to-host time) and the whole request at 1 and at 20 steps (one program)."""
    from tools.bench import engine_parts as parts_of
    from tools.timing import timed

    fns = parts_of(engine)
    fns["request_1_steps"] = lambda: engine_request(engine, 0, 1)
    fns[f"request_{STEPS}_steps"] = lambda: engine_request(engine, 0)
    medians = {name: s["median"] for name, s in timed(fns, runs).items()}
    host = []
    for seed in range(runs):
        t = engine_request(engine, seed).timings
        host.append(t["prep"] + t["post"])
    medians["host"] = statistics.median(host)
    medians["per_step_from_request"] = (medians[f"request_{STEPS}_steps"] - medians["request_1_steps"]) / (STEPS - 1)
    return medians


def served_program(engine):
    """The engine's compiled program for its default size: the one every timed request runs."""
    w, h = engine.limits.default_size
    return engine.programs.get(engine.planner.shape(w, h))


def engine_cost(engine) -> dict:
    """XLA's cost analysis and op counts of the engine's compiled program for this size (the one it serves)."""
    from tools.hlo_counts import program_counts

    program = served_program(engine)
    return {**program_counts(program.executable),
            "shape": str(program.shape)}


def engine_profile(engine, out: Path, runs: int) -> dict:
    """``runs`` requests under ``jax.profiler`` (the trace under ``out``) and the served program's optimized HLO
    text in ``out``/program.hlo, for tools/xla_profile.py."""
    import jax

    jax.profiler.start_trace(str(out))
    for seed in range(runs):
        engine_request(engine, seed)
    jax.profiler.stop_trace()
    (out / "program.hlo").write_text(served_program(engine).executable.as_text())
    return {"xplane": str(next(out.rglob("*.xplane.pb"))), "hlo": str(out / "program.hlo"), "requests": runs}


def fullsize_engine_cost(size: int, images: int, steps: int) -> dict:
    """The engine's program for SDXL base (abstract bfloat16 weights, tools/fullsize.py's) at ``size``², one image
    per device over DEVICES CPU devices, the progress hook on as served, lowered and compiled, not run."""
    import jax

    from sdxl_engine.program.compiling import jit_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, latent_shape
    from sdxl_engine.program.sharding import make_mesh
    from tools.fullsize import sdxl_base_model
    from tools.hlo_counts import program_counts

    model, mesh = sdxl_base_model("bfloat16"), make_mesh()
    out = {}
    for hook in (True, False):
        shape = ProgramShape(images, size, size, steps, step_hook=hook)
        t0 = time.perf_counter()
        lowered = jit_program(model, shape, mesh).lower(model.params, ProgramInputs.abstract(
            shape, latent_shape(model, size, size), mesh))
        t1 = time.perf_counter()
        compiled = lowered.compile()
        out["progress on" if hook else "progress off"] = {
            **program_counts(compiled), "lower_s": t1 - t0,
            "compile_s": time.perf_counter() - t1}
    return {**out, "size": size, "images": images, "devices": mesh.devices.size, "max_steps": steps,
            "jax": jax.__version__}


# ---- the driver -----------------------------------------------------------------------------------------------
class Worker:
    """One side's long-lived process: JSON lines in and out."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT):
        self.name = name
        self.stderr = log.open("w")
        self.proc = subprocess.Popen(cmd, cwd=cwd, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, env={**os.environ, "PYTHONWARNINGS": "ignore", **env})
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.stderr.flush()
            tail = Path(self.stderr.name).read_text()[-3000:]
            raise RuntimeError(f"the {self.name} worker ended; the end of its log:\n{tail}")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.stderr.close()


def load() -> dict:
    """The machine's load, for the record: 1/5/15-minute load averages and the core count."""
    one, five, fifteen = os.getloadavg()
    return {"load_1m": round(one, 2), "load_5m": round(five, 2), "load_15m": round(fifteen, 2),
            "cores": os.cpu_count(), "at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def spread(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2], "min": min(values), "max": max(values),
            "n": len(values)}


def profile_sides(sides: list, workdir: Path, runs: int) -> dict:
    """Each side's kernels under ``jax.profiler`` (tools/xla_profile.py), one side at a time, and the kernels whose
    thread time differs most between the engine and the blog."""
    from tools import xla_profile

    times = {}
    for side in sides:
        (workdir / side.name).mkdir(parents=True)
        reply = side.ask(op="profile", dir=str(workdir / side.name), runs=runs)
        times[side.name] = xla_profile.kernel_times(Path(reply["xplane"]), Path(reply["hlo"]).read_text(),
                                                    reply["requests"])
    return {"requests": runs, **xla_profile.compare(times)}


def compare_size(size: int, blog_python: str, rounds: int, workdir: Path, parts: bool, cost: bool,
                 before: Path | None = None, profile: bool = False) -> dict:
    """Both sides at ``size``²: image parity, ``rounds`` alternating rounds, and optionally parts and costs.
    ``before``: another checkout whose engine runs as a third side in the same rounds (the revision before a
    change; its own ``tools/vs_blog.py`` serves it, imported from there)."""
    import numpy as np

    model = comparable_model(workdir / f"{size}")
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"}  # the blog's JAX: 4 CPU devices
    started = load()
    engine_cmd = [sys.executable, "-m", "tools.vs_blog", "--engine-worker", "--model", str(model), "--size", str(size)]
    sides = [Worker("engine", engine_cmd, {}, workdir / f"engine-{size}.log")]
    if before is not None:
        sides.append(Worker("before", engine_cmd, {}, workdir / f"before-{size}.log", cwd=before))
    blog_cmd = [blog_python, "-m", "tools.blog_pipeline", "--model", str(model), "--size", str(size),
                "--steps", str(STEPS), "--guidance", str(GUIDANCE)]
    sides.append(Worker("blog", blog_cmd, env, workdir / f"blog-{size}.log"))
    engine, blog = sides[0], sides[-1]
    try:
        latents, ours, theirs = (str(workdir / f"{n}-{size}.npz") for n in ("latents", "engine", "blog"))
        engine.ask(op="images", seed=7, latents=latents, out=ours)
        blog.ask(op="images", latents=latents, out=theirs)
        a, b = np.load(ours)["images"].astype(int), np.load(theirs)["images"].astype(int)
        parity = {"max_abs_diff": int(np.abs(a - b).max()), "mean_abs_diff": float(np.abs(a - b).mean()),
                  "seed": 7, "of": 255}
        seconds = {f"{side.name}{kind}": [] for side in sides for kind in ("", "_device", "_cpu")}
        orders = list(itertools.permutations(sides))
        for i in range(rounds):
            for side in orders[i % len(orders)]:  # every order in turn: each side first, and after each other side
                time.sleep(SETTLE_S)
                reply = side.ask(op="time", seed=100 + i)
                seconds[side.name].append(reply["latency"])
                seconds[f"{side.name}_cpu"].append(reply["cpu"])
                seconds[f"{side.name}_device"].append(reply["pipeline" if side is blog else "device"])
        ratios = {f"{side.name}_over_blog": [x / y for x, y in zip(seconds[side.name], seconds["blog"])]
                  for side in sides[:-1]}
        ratios.update({f"{side.name}_cpu_over_blog": [x / y for x, y in zip(seconds[f"{side.name}_cpu"],
                                                                             seconds["blog_cpu"])]
                       for side in sides[:-1]})
        if before is not None:
            ratios["engine_over_before"] = [x / y for x, y in zip(seconds["engine"], seconds["before"])]
        out = {"size": size, "images": DEVICES, "devices": DEVICES, "steps": STEPS, "guidance": GUIDANCE,
               "rounds": rounds, "parity": parity, "ratio_engine_over_blog": spread(ratios["engine_over_blog"]),
               "ratios": {k: spread(v) for k, v in ratios.items()}, "per_round": seconds,
               "seconds": {k: spread(v) for k, v in seconds.items()},
               "workers": {side.name: side.info for side in sides}, "load_before": started}
        if parts:
            out["parts"] = {side.name: side.ask(op="parts", runs=5) for side in sides}
        if cost:
            out["cost"] = {side.name: side.ask(op="cost") for side in sides}
        if profile:
            out["profile"] = profile_sides(sides, workdir / f"profile-{size}", 3 if size <= 128 else 1)
        out["load_after"] = load()
        return out
    finally:
        for side in sides:
            side.close()


def fullsize(blog_python: str, size: int, workdir: Path) -> dict:
    """Both programs for SDXL base at ``size``², abstract bfloat16 weights, lowered and compiled (each in a fresh
    process: a full-size compile holds gigabytes)."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}", "PYTHONWARNINGS": "ignore"}
    blog = subprocess.run([blog_python, "-m", "tools.blog_pipeline", "--fullsize-config", str(SDXL_CONFIGS),
                           "--size", str(size), "--steps", str(STEPS), "--dtype", "bfloat16"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)
    engine = subprocess.run([sys.executable, "-m", "tools.vs_blog", "--fullsize-engine-worker", "--size", str(size)],
                            cwd=ROOT, capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return {"engine": json.loads(engine.stdout.splitlines()[-1]), "blog": json.loads(blog.stdout.splitlines()[-1]),
            "load": load()}


def markdown(results: list[dict]) -> str:
    """One row per size and engine side: latency medians, the per-round ratios to the blog (wall and CPU time)."""
    rows = ["| size | side | rounds | latency, median (s) | blog generate(), median (s) | "
            "÷ blog, median of per-round ratios (quartiles; min–max) | CPU time ÷ blog's (median) | "
            "images vs blog: max / mean abs diff (of 255) | load (1 min) before / after |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for side in (name for name in ("before", "engine") if name in r["workers"]):
            q, cpu = r["ratios"][f"{side}_over_blog"], r["ratios"][f"{side}_cpu_over_blog"]
            rows.append(f"| {r['size']}² | {side} | {r['rounds']} | {r['seconds'][side]['median']:.4f} | "
                        f"{r['seconds']['blog']['median']:.4f} | **{q['median']:.3f}** ({q['q1']:.3f}–{q['q3']:.3f}; "
                        f"{q['min']:.3f}–{q['max']:.3f}) | {cpu['median']:.3f} | "
                        f"{r['parity']['max_abs_diff'] if side == 'engine' else ''} / "
                        f"{r['parity']['mean_abs_diff'] if side == 'engine' else ''} | "
                        f"{r['load_before']['load_1m']} / {r['load_after']['load_1m']} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blog-python", help="an interpreter with the blog's stack (tools/blog_pipeline.py)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sizes", default="64,256", help="image sizes, comma-separated (4 images, one per device)")
    p.add_argument("--parts", action="store_true", help="also time each side's parts")
    p.add_argument("--cost", action="store_true", help="also XLA's cost analysis and op counts of both programs")
    p.add_argument("--profile", action="store_true", help="also each side's kernels under jax.profiler, the ones "
                   "that differ most (tools/xla_profile.py)")
    p.add_argument("--fullsize", action="store_true", help="only the 1024² cost of both programs (SDXL base)")
    p.add_argument("--before", type=Path, help="another checkout whose engine runs as a third side (e.g. an export "
                   "of the revision before a change; it needs this tools/vs_blog.py)")
    p.add_argument("--out", type=Path, help="write the JSON here too")
    p.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fullsize-engine-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=1024, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine_worker:
        return engine_worker(args.model, args.size)
    if args.fullsize_engine_worker:
        from sdxl_engine.config import EngineConfig, apply_jax_options

        apply_jax_options(EngineConfig.load({"cpu_devices": DEVICES, "compile_cache_dir": ""}))
        print(json.dumps(fullsize_engine_cost(args.size, DEVICES, EngineConfig.load({}).max_inference_steps)))
        return None
    if not args.blog_python:
        p.error("--blog-python is required")
    with tempfile.TemporaryDirectory(prefix="vs-blog-") as work:
        if args.fullsize:
            result = {"fullsize": fullsize(args.blog_python, 1024, Path(work))}
        else:
            result = {"sizes": []}
            for size in (int(s) for s in args.sizes.split(",")):
                result["sizes"].append(compare_size(size, args.blog_python, args.rounds, Path(work), args.parts,
                                                    args.cost, args.before, args.profile))
                if args.out:  # each size as it is done: a later one failing keeps the earlier
                    args.out.write_text(json.dumps(result, indent=1) + "\n")
            print(markdown(result["sizes"]))
            for r in (r for r in result["sizes"] if "profile" in r):
                from tools import xla_profile

                print(xla_profile.markdown(r["size"], r["profile"]))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return None


if __name__ == "__main__":
    main()
