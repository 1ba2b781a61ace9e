"""Where a request's device time goes on the chip, by op class, and what the chip's matrix unit sustains: one command.

    python3.11 -m tools.tpu_profile --out DIR [--images 4] [--size 1024] [--steps 20] [--matmul]
    python -m tools.tpu_profile --out DIR --from DIR      # the tables again from a saved trace, on any machine

Run on the lent TPU v5e machine as it is (Python 3.11, its jax 0.10.2 + libtpu), in-process, no sockets:

1. ``--matmul``: the chip's sustained bfloat16 rate on the shapes SDXL's UNet runs at 1024² with 4 images (8 CFG
   rows): a square 8192³ product, the projections and feed-forward of the 4096- and 1024-token levels, and the 3 × 3
   convolutions of the three latent levels; each a chain of ``--chain`` products inside one ``fori_loop`` (one
   dispatch), median of 5 rounds, TFLOP/s = 2·M·N·K per product over device seconds (convolutions: 2·H·W·Cin·Cout·9
   per image). This is the rate a UNet step could reach at best, the figure its floor is computed from.
2. The engine on ``sdxl-base-random`` (``--images`` per request, ``--size``², Euler, ``--steps`` steps, guidance 5,
   progress on, as ``tools.tpu_bench`` runs it): one request to warm up, then one under ``jax.profiler``; the trace
   (``*.xplane.pb``) is copied to DIR/trace/.
3. The trace's device ops (the TPU plane's "XLA Ops" line; on CPU, the XLA runtime's threads) summed per op and per
   class (:func:`op_class`): attention kernels (Pallas custom calls), matrix products and convolutions (XLA's
   ``convolution`` fusions, split by the module they belong to: the JAX name stack's ``op_name``), normalisation
   (GroupNorm, LayerNorm), the rest; and per stage (prepare, advance, finish: the XLA module line). Written to
   DIR/tpu_profile.json with the environment.

``--from DIR`` reads DIR/trace/ back (``jax.profiler.ProfileData``) and writes the tables again: the classes can be
refined off the chip without another run.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

PROMPT = "a photograph of an astronaut riding a horse"  # the blog's
GUIDANCE = 5.0


def _timed(fn, args, rounds: int = 5) -> float:
    """Median device seconds of ``fn(*args)`` over ``rounds`` calls after one warm-up (compile) call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_rates(rows: int = 8, chain: int = 20, scale: int = 1) -> list[dict]:
    """Sustained bfloat16 TFLOP/s of the UNet's product and convolution shapes, one ``fori_loop`` chain each.

    Args:
        rows: batch rows (8 = 4 images × CFG's two); token counts are those of a 1024² image (4096, 1024) / ``scale``.
        chain: products per call (the carry feeds the next one, so none is folded away).
        scale: divides the token counts and the square side (a CPU test runs them small).
    Returns: [{"name", "shape", "tflop", "seconds", "tflop_s"}] per shape; tflop is one call's (the chain's).
    """
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)

    def chained(step):
        def fn(x, *ws):
            return jax.lax.fori_loop(0, chain, lambda _, y: step(y, *ws), x)
        return jax.jit(fn)

    def dense(y, w):  # (M, K) @ (K, K): bfloat16 out, float32 accumulation (XLA's default on TPU)
        return jnp.dot(y, w, preferred_element_type=jnp.float32).astype(y.dtype)

    def ff(y, w1, w2):  # (M, C) @ (C, 4C) @ (4C, C): the feed-forward's two products (GEGLU's gate aside)
        return dense(dense(y, w1), w2)

    def conv(y, w):  # NHWC 3 × 3, same padding, C → C
        return jax.lax.conv_general_dilated(y, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            preferred_element_type=jnp.float32).astype(y.dtype)

    def normal(shape, fan_in):
        return (jax.random.normal(key, shape, jnp.float32) / fan_in ** 0.5).astype(jnp.bfloat16)

    side = 8192 // scale
    cases = [("square", dense, (side, side), [(side, side)], 2 * side ** 3)]
    for tokens, width in ((4096 // scale, 640), (1024 // scale, 1280)):
        m = rows * tokens
        cases.append((f"projection {tokens} tokens", dense, (m, width), [(width, width)], 2 * m * width * width))
        cases.append((f"feed-forward {tokens} tokens", ff, (m, width), [(width, 4 * width), (4 * width, width)],
                      2 * 2 * m * width * 4 * width))
    for hw, ch in ((128 // scale, 320), (64 // scale, 640), (32 // scale, 1280)):
        cases.append((f"conv3x3 {hw}x{hw}x{ch}", conv, (rows, hw, hw, ch), [(3, 3, ch, ch)],
                      2 * rows * hw * hw * ch * ch * 9))
    out = []
    for name, step, x_shape, w_shapes, flop in cases:
        x = normal(x_shape, 1.0)
        ws = [normal(s, s[-2] * (9 if len(s) == 4 else 1)) for s in w_shapes]
        seconds = _timed(chained(step), (x, *ws))
        out.append({"name": name, "shape": [list(x_shape), *map(list, w_shapes)], "tflop": flop * chain / 1e12,
                    "seconds": seconds, "tflop_s": flop * chain / 1e12 / seconds})
        print(json.dumps(out[-1]), flush=True)
    return out


# The classes, in the order they are tried: (class, a pattern of the op's name, category or JAX name stack).
NORM = re.compile(r"group_?norm|layer_?norm|norm\d?\b|/norm|\.norm|norm_out|norm1|norm2|norm3", re.I)


def op_class(name: str, category: str, op_name: str) -> str:
    """The class of one device op: ``name`` its HLO instruction's name, ``category`` XLA's ``hlo_category``
    (TPU traces: "convolution fusion", "custom-call", "loop fusion", "data formatting", ...; '' where absent),
    ``op_name`` the JAX name stack of its root (``jit(advance)/.../up_blocks_1/attentions_0/.../to_q/dot_general``).

    Returns "attention kernel" (a Pallas custom call), "matmul/conv: <part>" (a convolution fusion; the part from the
    name stack: resnet conv, attention projection, feed-forward, proj_in/out, other), "normalisation", "data
    formatting" (copies, transposes), or "other (<category>)"."""
    text = f"{name} {category}".lower()
    stack = op_name.lower()
    if "custom" in text or "pallas" in stack or "tpu_custom_call" in text:
        return "attention kernel" if "attention" in stack or "softmax" in stack or "flash" in stack else (
            "custom call")
    if "convolution" in text or "dot" in text.split(" ")[0] or re.search(r"(^|/)(conv_general|dot_general)", stack):
        if re.search(r"/(to_q|to_k|to_v|to_out|to_k_ip|to_v_ip)\b", stack):
            part = "attention projections"
        elif "/ff/" in stack or "/ff_" in stack or "geglu" in stack or "/net" in stack:
            part = "feed-forward"
        elif "proj_in" in stack or "proj_out" in stack:
            part = "proj_in/out"
        elif "conv" in stack or "conv_general" in stack:
            part = "convolutions"
        elif "dot_general" in stack and ("attn" in stack or "attention" in stack):
            part = "attention (XLA)"
        else:
            part = "other"
        return f"matmul/conv: {part}"
    if NORM.search(stack):
        return "normalisation"
    if "data formatting" in text or name.startswith(("copy", "transpose", "bitcast")):
        return "data formatting"
    return f"other ({category or 'no category'})"


def _stats(event) -> dict:
    try:
        return {str(k): v for k, v in event.stats}
    except Exception:  # noqa: BLE001 — an older JAX's event without stats: classes come from names alone
        return {}


def trace_tables(trace_dir: Path, requests: int = 1) -> dict:
    """Read the ``*.xplane.pb`` under ``trace_dir`` and sum the device ops' time per op, per class and per stage.

    Returns {"plane", "busy_ms" (the ops' time summed, per request), "classes": {class: {"ms", "calls", "share"}},
    "stages": {XLA module: ms}, "top_ops": the 40 costliest ops with their class, category and name stack}.
    Raises FileNotFoundError when no trace is there."""
    from jax.profiler import ProfileData

    files = sorted(trace_dir.rglob("*.xplane.pb"))
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    data = ProfileData.from_file(str(files[-1]))
    planes = list(data.planes)
    device = [p for p in planes if p.name.startswith("/device:TPU:") or "GPU" in p.name]
    ops: dict[str, dict] = {}
    stages: collections.Counter = collections.Counter()
    if device:
        plane = device[0]
        for line in plane.lines:
            if line.name == "XLA Ops":
                for e in line.events:
                    s = _stats(e)
                    row = ops.setdefault(e.name, {"ns": 0, "calls": 0, "category": str(s.get("hlo_category", "")),
                                                  "op_name": str(s.get("tf_op", s.get("name", ""))),
                                                  "stats": {k: str(v)[:200] for k, v in s.items()}})
                    row["ns"] += e.duration_ns
                    row["calls"] += 1
            elif line.name == "XLA Modules":
                for e in line.events:
                    stages[re.sub(r"\(\d+\)$", "", e.name)] += e.duration_ns
    else:  # XLA:CPU: its runtime's threads, leaf events only (tools/xla_profile.py reads them the same way)
        plane = next(p for p in planes if p.name.startswith("/host:CPU"))
        for line in plane.lines:
            if "XLAEigen" not in line.name and "XLAExecute" not in line.name:
                continue
            events = sorted(((e.start_ns, e.end_ns, e.name, e) for e in line.events
                             if not e.name.startswith(("end: ", "ThreadpoolListener", "ThunkExecutor"))),
                            key=lambda e: (e[0], -e[1]))
            for i, (start, end, name, e) in enumerate(events):
                if i + 1 < len(events) and events[i + 1][0] < end:
                    continue
                s = _stats(e)
                row = ops.setdefault(name, {"ns": 0, "calls": 0, "category": str(s.get("hlo_category", "")),
                                            "op_name": str(s.get("tf_op", "")), "stats": {}})
                row["ns"] += end - start
                row["calls"] += 1
    classes: dict[str, dict] = {}
    for name, row in ops.items():
        row["class"] = op_class(name, row["category"], row["op_name"])
        c = classes.setdefault(row["class"], {"ms": 0.0, "calls": 0})
        c["ms"] += row["ns"] / 1e6 / requests
        c["calls"] += row["calls"] // requests
    busy = sum(c["ms"] for c in classes.values())
    for c in classes.values():
        c["share"] = c["ms"] / busy if busy else 0.0
    top = sorted(ops.items(), key=lambda kv: -kv[1]["ns"])[:40]
    return {"plane": plane.name, "busy_ms": busy, "lines": {line.name: len(list(line.events)) for line in plane.lines},
            "classes": dict(sorted(classes.items(), key=lambda kv: -kv[1]["ms"])),
            "stages": {k: v / 1e6 / requests for k, v in stages.most_common()},
            "top_ops": [{"name": n, "ms": r["ns"] / 1e6 / requests, "calls": r["calls"] // requests,
                         "class": r["class"], "category": r["category"], "op_name": r["op_name"][:300],
                         "stats": r["stats"]} for n, r in top]}


def profile_engine(args, out: Path) -> dict:
    """Start the engine in-process, one warm-up request, one request under ``jax.profiler``; the trace into
    ``out``/trace. Returns the start's figures and both requests' device seconds."""
    import jax

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine
    from sdxl_engine.engine.validation import GenerateRequest

    t0 = time.perf_counter()
    config = EngineConfig.load({
        "model": args.model, "width": args.size, "height": args.size, "images_per_request": args.images,
        "num_inference_steps": args.steps, "guidance_scale": GUIDANCE, "sampler": "Euler",
        "compile_cache_dir": str(args.cache or out / "cache"), "progress": True, "precompile": "off", "max_run_seconds": 0,
        **({"cpu_devices": args.cpu_devices} if args.cpu_devices else {})})
    engine = Engine(config, log=lambda line: None).start()
    result = {"start_s": time.perf_counter() - t0, "startup": dict(engine.startup), "device": engine.device_summary,
              "jax": jax.__version__, "python": sys.version.split()[0]}

    def request(seed: int) -> float:
        r = engine.generate(GenerateRequest(PROMPT, seed=seed, num_inference_steps=args.steps,
                                            guidance_scale=GUIDANCE), on_step=lambda e: None,
                            should_stop=lambda: False)
        return r.timings["device"]

    result["warmup_device_s"] = request(0)
    trace = out / "trace"
    shutil.rmtree(trace, ignore_errors=True)
    jax.profiler.start_trace(str(trace))
    try:
        result["profiled_device_s"] = request(1)
    finally:
        jax.profiler.stop_trace()
    result["after_device_s"] = request(2)  # the profiler's own cost: profiled against this one
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--from", dest="source", type=Path, help="only the tables, from DIR/trace of an earlier run")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", default="sdxl-base-random")
    p.add_argument("--matmul", action="store_true", help="also the chip's sustained rate on the UNet's shapes")
    p.add_argument("--chain", type=int, default=20)
    p.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)  # CPU tests: shapes / scale
    p.add_argument("--cache", type=Path, help="the executable cache (default DIR/cache)")
    p.add_argument("--no-engine", action="store_true", help="only --matmul")
    p.add_argument("--cpu-devices", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written = args.out / "tpu_profile.json"
    if args.source:
        report = json.loads((args.source / "tpu_profile.json").read_text()) if (
            args.source / "tpu_profile.json").exists() else {}
        report["trace"] = trace_tables(args.source / "trace")
        written.write_text(json.dumps(report, indent=1))
        print(json.dumps({k: report["trace"][k] for k in ("busy_ms", "classes", "stages")}, indent=1))
        return 0
    import jax

    report: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "jax": jax.__version__,
                    "device": str(jax.devices()[0].device_kind), "size": args.size, "images": args.images,
                    "steps": args.steps}
    if args.matmul:
        report["matmul"] = matmul_rates(rows=2 * args.images, chain=args.chain, scale=args.scale)
        written.write_text(json.dumps(report, indent=1))
    if not args.no_engine:
        report["engine"] = profile_engine(args, args.out)
        written.write_text(json.dumps(report, indent=1))
        report["trace"] = trace_tables(args.out / "trace")
        written.write_text(json.dumps(report, indent=1))
        print(json.dumps({k: report["trace"][k] for k in ("busy_ms", "classes", "stages")}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
