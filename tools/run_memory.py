"""What a request's program needs of memory, per size: the host memory its compile takes and XLA's count of what one
device needs to run it (engine/memory.py admits requests on that count). Each size in a fresh process, so one
compile's memory does not hide the next's. docs/benchmarks.md, "Memory admission".

    python -m tools.run_memory --model tiny-shapes --sizes 64x64 256x256 512x512 768x768
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time


def _rss() -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmRSS:"))


def one(model_name: str, width: int, height: int, devices: int) -> dict:
    """Lower and compile ``model_name``'s request program (4 images, CFG, step hook, 50 steps max) at one size with
    abstract inputs; return the compile's peak RSS growth (sampled every 50 ms) and XLA's per-device count, bytes."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    from sdxl_engine.checkpoint.loading import load_model
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.costs import program_cost
    from sdxl_engine.program.compiling import jit_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, latent_shape
    from sdxl_engine.program.sharding import default_batch, make_mesh

    model = load_model(model_name, dtype="auto", platform=jax.devices()[0].platform,
                       cache_dir=EngineConfig.model_cache_dir)
    mesh = make_mesh()
    shape = ProgramShape(default_batch(mesh.devices.size), height, width, EngineConfig.max_inference_steps,
                         step_hook=True)
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    abstract = ProgramInputs.abstract(shape, latent_shape(model, height, width), mesh)
    executable = jit_program(model, shape, mesh).lower(model.params, abstract).compile()
    seconds = time.perf_counter() - start
    done.set()
    return {"model": model_name, "width": width, "height": height, "devices": mesh.devices.size,
            "compile_s": round(seconds, 2), "compile_rss_growth_bytes": max(peak[0], _rss()) - base,
            "run_bytes_per_device": int(program_cost(executable).run_bytes)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-shapes")
    parser.add_argument("--sizes", nargs="+", default=["64x64", "256x256", "512x512"], help="WxH in pixels")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices (ignored on accelerators)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process's size
    args = parser.parse_args(argv)
    if args.one:
        width, height = map(int, args.one.split("x"))
        print(json.dumps(one(args.model, width, height, args.devices)))
        return
    for size in args.sizes:
        out = subprocess.run([sys.executable, "-m", "tools.run_memory", "--model", args.model, "--devices",
                              str(args.devices), "--one", size], capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
