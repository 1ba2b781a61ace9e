"""Where a request's device time goes on the chip, by op class, and what the chip's matrix unit sustains: one command.

    python3.11 -m tools.tpu_profile --out DIR [--images 4] [--size 1024] [--steps 20] [--matmul] [--convs]
    python -m tools.tpu_profile --out DIR --from DIR      # the tables again from a saved trace, on any machine

Run on the lent TPU v5e machine as it is (Python 3.11, its jax 0.10.2 + libtpu), in-process, no sockets:

1. ``--matmul``: the chip's sustained bfloat16 rate on the shapes SDXL's UNet runs at 1024² with 4 images (8 CFG
   rows): a square 8192³ product, the projections and feed-forward of the 4096- and 1024-token levels, and the 3 × 3
   convolutions of the three latent levels; each a chain of ``--chain`` products inside one ``fori_loop`` (one
   dispatch), median of 5 rounds, TFLOP/s = 2·M·N·K per product over device seconds (convolutions: 2·H·W·Cin·Cout·9
   per image). This is the rate a UNet step could reach at best, the figure its floor is computed from.
   ``--convs``: the UNet's 3 × 3 convolutions (with the GroupNorm and SiLU before them) at ``2 × --images`` rows in
   each of models/layers.CONV_MODE's ways side by side (:func:`conv_rates`); ``--conv MODE`` traces the engine's
   programs below in that mode.
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
import gzip
import json
import math
import re
import shutil
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from tools.xla_profile import leaf_events

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


def ff_rates(rows: int = 8, chain: int = 10, scale: int = 1) -> list[dict]:
    """The UNet's feed-forward (GEGLU then Linear, models/unet.FeedForward) at the 4096- and 1024-token levels, in
    each of models/unet.GEGLU_MODE's ways, side by side in alternating rounds: device ms per block and TFLOP/s.

    Each call is a ``fori_loop`` of ``chain`` blocks (ff(x) rescaled to unit RMS) on random bfloat16 weights; the
    result of each mode is compared with "fused"'s (largest absolute difference: the modes compute the same
    values)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sdxl_engine.models import unet

    out, shipped = [], unet.GEGLU_MODE
    for tokens, width in ((4096 // scale, 640), (1024 // scale, 1280)):
        ff = unet.FeedForward(width, rngs=nnx.Rngs(0))
        ff = jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(ff))
        graph = nnx.graphdef(unet.FeedForward(width, rngs=nnx.Rngs(0)))
        x = jax.random.normal(jax.random.PRNGKey(1), (rows, tokens, width), jnp.float32).astype(jnp.bfloat16)

        def make(mode, run, graph=graph):
            """``run(module, x)`` jitted with the feed-forward traced in GEGLU_MODE ``mode``."""
            def fn(state, inputs):
                unet.GEGLU_MODE = mode  # read while tracing
                return run(nnx.merge(graph, state), inputs)
            return jax.jit(fn)

        def chained(module, inputs):
            def block(_, y):  # rescaled to unit RMS so that a chain neither overflows nor vanishes
                z = module(y).astype(jnp.float32)
                return (z * jax.lax.rsqrt(jnp.mean(z * z, -1, keepdims=True) + 1e-6)).astype(y.dtype)
            return jax.lax.fori_loop(0, chain, block, inputs)

        modes = unet.GEGLU_MODES
        fns = {m: make(m, chained) for m in modes}
        results = {m: jax.block_until_ready(fns[m](ff, x)) for m in modes}  # compiles
        once = {m: make(m, lambda module, inputs: module(inputs))(ff, x) for m in modes}  # one block, not rescaled
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(5):  # alternating rounds
            for m in modes:
                start = time.perf_counter()
                jax.block_until_ready(fns[m](ff, x))
                times[m].append(time.perf_counter() - start)
        flop = 2 * rows * tokens * width * width * 4 * 3 * chain  # (C -> 8C) + (4C -> C) per block
        for m in modes:
            seconds = statistics.median(times[m])
            out.append({"tokens": tokens, "width": width, "mode": m, "ms_per_block": seconds / chain * 1e3,
                        "tflop_s": flop / seconds / 1e12,
                        "max_abs_diff_vs_fused": float(jnp.max(jnp.abs(results[m].astype(jnp.float32)
                                                                       - results["fused"].astype(jnp.float32)))),
                        # one block, not the chain: how far the formula is from "split"'s exact GELU
                        "one_block_max_abs_diff_vs_split": float(jnp.max(jnp.abs(
                            once[m].astype(jnp.float32) - once["split"].astype(jnp.float32)))),
                        "one_block_max_abs": float(jnp.max(jnp.abs(once["split"].astype(jnp.float32))))})
            print(json.dumps(out[-1]), flush=True)
    unet.GEGLU_MODE = shipped
    return out


# SDXL UNet's 3 x 3 convolutions with stride 1 at 1024² (latent side, in, out): ResNet convolutions and upsamplers
UNET_CONVS = ((128, 320, 320), (128, 640, 320), (128, 960, 320), (128, 640, 640),
              (64, 320, 640), (64, 640, 640), (64, 960, 640), (64, 1280, 640), (64, 1920, 640), (64, 1280, 1280),
              (32, 640, 1280), (32, 1280, 1280), (32, 1920, 1280), (32, 2560, 1280))


def conv_rates(rows: int = 2, strips: tuple[int, ...] = (4, 8), scale: int = 1, rounds: int = 5,
               shapes: tuple[tuple[int, int, int], ...] = UNET_CONVS) -> list[dict]:
    """Each of ``shapes`` (:data:`UNET_CONVS`) as the UNet runs it (models/layers' GroupNorm of 32 groups, SiLU, then
    its ``Conv2d``) in each of models/layers.CONV_MODE's ways, "xla" and "strips" with each count of ``strips``, side
    by side in alternating rounds of 10 calls each: device ms per call, the time against "xla"'s, TFLOP/s.

    Args:
        rows: the batch (2: one image and its CFG twin; 8: four images). scale: divides the latent side (CPU tests).
    Returns: [{"side", "in", "out", "mode", "ms", "vs_xla", "tflop_s", "max_abs_diff_vs_xla"}], bfloat16 weights.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sdxl_engine.models import layers

    shipped = (layers.CONV_MODE, layers.CONV_STRIPS)
    modes = [("xla", 0)] + [("strips", n) for n in strips]
    out: list[dict] = []

    def make(graph, mode, n):
        def fn(params, inputs):
            layers.CONV_MODE, layers.CONV_STRIPS = mode, n or layers.CONV_STRIPS  # read while tracing
            norm, conv = nnx.merge(graph, params)
            return conv(jax.nn.silu(norm(inputs)))
        return jax.jit(fn)

    try:
        for side, cin, cout in shapes:
            side //= scale
            modules = (layers.GroupNorm(32, cin), layers.Conv2d(cin, cout, 3, padding=1, rngs=nnx.Rngs(0)))
            state = jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(modules))
            graph = nnx.graphdef(modules)
            x = jax.random.normal(jax.random.PRNGKey(1), (rows, side, side, cin), jnp.float32).astype(jnp.bfloat16)
            fns = {m: make(graph, *m) for m in modes}
            results = {m: jax.block_until_ready(fns[m](state, x)) for m in modes}  # compiles
            times: dict = {m: [] for m in modes}
            for _ in range(rounds):  # alternating rounds
                for m in modes:
                    start = time.perf_counter()
                    for _ in range(10):
                        y = fns[m](state, x)
                    jax.block_until_ready(y)
                    times[m].append((time.perf_counter() - start) / 10)
            flop = 2 * rows * side * side * cin * cout * 9
            base = statistics.median(times[modes[0]])
            for m in modes:
                seconds = statistics.median(times[m])
                out.append({"side": side, "in": cin, "out": cout, "mode": m[0] + (str(m[1]) if m[1] else ""),
                            "ms": seconds * 1e3, "vs_xla": seconds / base, "tflop_s": flop / seconds / 1e12,
                            "max_abs_diff_vs_xla": float(jnp.max(jnp.abs(results[m].astype(jnp.float32)
                                                                         - results[modes[0]].astype(jnp.float32))))})
                print(json.dumps(out[-1]), flush=True)
    finally:
        layers.CONV_MODE, layers.CONV_STRIPS = shipped
    return out


CONV3 = re.compile(r"\[3,3,(\d+),(\d+)\]")
CONTAINERS = ("while", "conditional", "call")  # hold other ops' events: their own time is counted in those
MOVES = ("copy", "copy-start", "copy-done", "transpose", "bitcast", "dynamic-update-slice", "dynamic-slice",
         "slice", "concatenate", "pad", "broadcast", "reshape", "all-gather", "collective-permute")


def op_class(text: str) -> str:
    """The class of one device op from its HLO instruction text, as a TPU trace names its ops (``%convolution_add_
    fusion.444 = bf16[8,64,64,1280]{...} fusion(... bf16[3,3,1280,1280] %custom-call.187, ...), kind=kOutput,
    calls=...``).

    Returns one of: "attention kernel (Pallas)" (a ``tpu_custom_call``: layers.softmax_attention_tpu and the
    flash kernel), "3x3 convolution (+ what XLA fused in)" (an operand of shape [3, 3, Cin, Cout]: the ResNets'
    and the samplers' convolutions, with the GroupNorm statistics XLA often fuses into their output),
    "matrix product (+ fused)" (any other output fusion: the projections, feed-forwards, 1 × 1 convolutions, the
    cross-attentions' products), "reduction (+ fused)" (input fusions: normalisation statistics, softmax of the
    XLA-path attentions), "elementwise" (loop fusions: GroupNorm's and LayerNorm's application, SiLU, GEGLU,
    residual adds), "data movement" (copies, transposes, slices), "container" (while, conditional: not a leaf)
    or "other (<opcode>)"."""
    head = text.split(" = ", 1)
    body = head[1] if len(head) == 2 else text
    match = re.search(r"(?:^| )([a-z][a-z\-]*)\(", body)  # the type's own parentheses follow no space
    opcode = match[1] if match else re.sub(r"\.\d+$", "", body.strip())  # XLA:CPU names its kernels only
    if opcode in CONTAINERS:
        return "container"
    if opcode == "custom-call":
        return "attention kernel (Pallas)" if "tpu_custom_call" in body else "other (custom-call)"
    if opcode == "fusion":
        if CONV3.search(body):
            return "3x3 convolution (+ what XLA fused in)"
        if "kind=kOutput" in body:
            return "matrix product (+ fused)"
        if "kind=kInput" in body:
            return "reduction (+ fused)"
        if "kind=kLoop" in body:
            return "elementwise"
        return "other (fusion)"
    if opcode in ("convolution", "dot"):
        return "matrix product (+ fused)"
    if opcode in ("reduce", "reduce-window"):
        return "reduction (+ fused)"
    if opcode in MOVES:
        return "data movement"
    return f"other ({opcode})"


def op_flops(text: str) -> float:
    """FLOPs of one op where its instruction text says them, else 0.0: a 3 × 3 convolution fusion's 2·N·H·W·Cin·Cout·9
    (the output's [N, H, W, Cout] as written in its type, the weight's [3, 3, Cin, Cout] as an operand), a
    self-attention kernel's 4·B·T²·C (q·kᵀ and p·v over its [B, T, C] output, keys as many as queries)."""
    body = text.split(" = ", 1)[-1]
    out_type = body.split(" fusion(")[0].split(" custom-call(")[0]
    if (conv := CONV3.search(body)) and " fusion(" in body:
        cin, cout = int(conv[1]), int(conv[2])
        for dims in re.findall(r"bf16\[(\d+),(\d+),(\d+),(\d+)\]", out_type):
            n, h, w, c = map(int, dims)
            if c == cout:
                return 2.0 * n * h * w * cin * cout * 9
        return 0.0
    if "tpu_custom_call" in body and (shape := re.match(r"bf16\[(\d+),(\d+),(\d+)\]", out_type)):
        b, t, c = map(int, shape.groups())
        return 4.0 * b * t * t * c
    return 0.0


def hlo_products(hlo_text: str) -> dict[str, tuple[float, str]]:
    """{fused computation's name: (FLOPs, "output shape x contraction (window)")} of an optimized HLO module's
    computations that hold convolutions (XLA on a TPU writes every matrix product as one): 2 · output elements ·
    input features · window size per convolution, from its ``dim_labels`` and its operands' declared shapes."""
    comps: dict[str, dict[str, str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if not line.startswith(" ") and (head := re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{\s*$", line)):
            current = comps.setdefault(head[1], {})
        elif line.startswith("}"):
            current = None
        elif current is not None and (inst := re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)$", line)):
            current[inst[1]] = inst[2]

    def dims(text: str) -> list[int] | None:
        m = re.match(r"\s*\w+\[([\d,]*)\]", text)
        return [int(d) for d in m[1].split(",") if d] if m else None

    out = {}
    for name, table in comps.items():
        flops, what = 0.0, []
        for body in table.values():
            if " convolution(" not in body:
                continue
            operands = re.search(r"convolution\(%([\w.\-]+), %([\w.\-]+)\)", body)
            labels = re.search(r"dim_labels=\w+_(\w+)->", body)
            window = re.search(r"window=\{size=([\dx]+)", body)
            shape, kernel = dims(body), dims(table.get(operands[2], "")) if operands else None
            if not (shape and kernel and labels):
                continue
            # a batched product is written with its batch as a "window" the lhs is dilated (or the rhs reversed)
            # over, one tap per output: only a real window (a 3 x 3 convolution's) multiplies the work
            batched = "lhs_dilate" in body or "rhs_reversal" in body
            taps = math.prod(int(w) for w in window[1].split("x")) if window and not batched else 1
            features = kernel[labels[1].index("i")]
            flops += 2.0 * math.prod(shape) * features * taps
            what.append(f"{shape} x {features}" + (f" ({window[1]})" if taps > 1 else ""))
        if flops:
            out[name] = (flops, "; ".join(what))
    return out


def trace_tables(trace_dir: Path, requests: int = 1, products: dict | None = None) -> dict:
    """Read the newest ``*.xplane.pb`` under ``trace_dir`` and sum the device's leaf ops' time per op, per class
    (:func:`op_class`) and per stage (the "XLA Modules" line: prepare, advance, finish).

    On a TPU the ops are the device plane's "XLA Ops" line (its "Async XLA Ops", the copies that overlap the
    compute, are not counted); on XLA:CPU the runtime's threads (tools/xla_profile.py reads them the same way).
    Returns {"plane", "lines" (event counts), "busy_ms" (leaf ops' time per request), "classes": {class: {"ms",
    "calls", "share", "tflop_s"}}, "stages": {module: ms}, "top_ops": the 60 costliest ops with their class,
    "products": the matrix products by shape (ms, calls, TFLOP/s)} where ``products`` (:func:`hlo_products` of the
    stages' HLO) gives their FLOPs.
    Raises FileNotFoundError when no trace is there."""
    from jax.profiler import ProfileData

    files = sorted([*trace_dir.rglob("*.xplane.pb"), *trace_dir.rglob("*.xplane.pb.gz")],
                   key=lambda f: f.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    raw = files[-1].read_bytes()
    planes = list(ProfileData.from_serialized_xspace(gzip.decompress(raw) if files[-1].suffix == ".gz" else raw).planes)
    device = [p for p in planes if p.name.startswith(("/device:TPU:", "/device:GPU:"))]
    plane = device[0] if device else next(p for p in planes if p.name.startswith("/host:CPU"))
    ops: dict[str, list[int]] = {}  # name: [ns, calls]
    stages: collections.Counter = collections.Counter()
    for line in plane.lines:
        if line.name == "XLA Modules":
            for e in line.events:
                stages[re.sub(r"\(\d+\)$", "", e.name)] += e.end_ns - e.start_ns
        elif line.name == "XLA Ops" or (not device and ("XLAEigen" in line.name or "XLAExecute" in line.name)):
            for start, end, name in leaf_events(line.events):
                row = ops.setdefault(name, [0, 0])
                row[0] += end - start
                row[1] += 1
    classes: dict[str, dict] = {}
    shapes: dict[str, list[float]] = {}  # "output x contraction": [ns, flops, calls]
    products = products or {}
    for name, (ns, calls) in ops.items():
        c = classes.setdefault(op_class(name), {"ms": 0.0, "calls": 0, "tflop": 0.0, "counted_ms": 0.0})
        c["ms"] += ns / 1e6 / requests
        c["calls"] += calls // requests
        fused = re.search(r"calls=%([\w.\-]+)", name)
        if op_class(name) == "matrix product (+ fused)" and fused and fused[1] in products:
            flops, what = products[fused[1]]
            row = shapes.setdefault(what, [0.0, 0.0, 0])
            row[0] += ns
            row[1] += flops * calls
            row[2] += calls
            c["tflop"] += flops * calls / 1e12 / requests
            c["counted_ms"] += ns / 1e6 / requests
        elif flops := op_flops(name):
            c["tflop"] += flops * calls / 1e12 / requests
            c["counted_ms"] += ns / 1e6 / requests
    busy = sum(c["ms"] for c in classes.values())
    for c in classes.values():
        c["share"] = c["ms"] / busy if busy else 0.0
        # the rate of the ops whose FLOPs the text gives (convolutions, self-attention kernels)
        tflop = c.pop("tflop")
        c["tflop_s"] = tflop / c["counted_ms"] * 1e3 if c["counted_ms"] else None
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:60]
    return {"plane": plane.name, "lines": {line.name: len(list(line.events)) for line in plane.lines},
            "busy_ms": busy, "classes": dict(sorted(classes.items(), key=lambda kv: -kv[1]["ms"])),
            "stages": {k: v / 1e6 / requests for k, v in stages.most_common()},
            "top_ops": [{"ms": ns / 1e6 / requests, "calls": calls // requests, "class": op_class(name),
                         "tflop_s": op_flops(name) * calls / ns / 1e3 if op_flops(name) else None,
                         "op": name[:400]} for name, (ns, calls) in top],
            "products": [{"shape": what, "ms": ns / 1e6 / requests, "calls": int(calls) // requests,
                          "tflop_s": flops / ns / 1e3} for what, (ns, flops, calls)
                         in sorted(shapes.items(), key=lambda kv: -kv[1][0])[:30]]}


def stage_products(folder: Path) -> dict:
    """:func:`hlo_products` of every ``hlo-*.txt.gz`` :func:`profile_engine` wrote in ``folder``."""
    out: dict = {}
    for file in sorted(folder.glob("hlo-*.txt.gz")):
        out.update(hlo_products(gzip.decompress(file.read_bytes()).decode()))
    return out


def profile_engine(args, out: Path) -> dict:
    """Start the engine in-process, one warm-up request, one request under ``jax.profiler``; the trace into
    ``out``/trace. Returns the start's figures and both requests' device seconds."""
    import jax
    import numpy as np

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine
    from sdxl_engine.engine.validation import GenerateRequest

    t0 = time.perf_counter()
    config = EngineConfig.load({
        "model": args.model, "width": args.size, "height": args.size, "images_per_request": args.images,
        "num_inference_steps": args.steps, "guidance_scale": GUIDANCE, "sampler": "Euler",
        "compile_cache_dir": str(args.cache or out / "cache"), "progress": True, "precompile": "off",
        "max_run_seconds": 0,
        **({"cpu_devices": args.cpu_devices} if args.cpu_devices else {})})
    engine = Engine(config, log=lambda line: None).start()
    result = {"start_s": time.perf_counter() - t0, "startup": dict(engine.startup), "device": engine.device_summary,
              "jax": jax.__version__, "python": sys.version.split()[0]}

    def request(seed: int) -> float:
        r = engine.generate(GenerateRequest(PROMPT, seed=seed, num_inference_steps=args.steps,
                                            guidance_scale=GUIDANCE), on_step=lambda e: None,
                            should_stop=lambda: False)
        if seed == 0:  # the images, to compare GEGLU modes' runs (tools.tpu_profile --compare)
            np.save(out / "images-seed0.npy", r.images)
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
    # The trace flat and compressed (the lent machine returns files a few folders deep at most), and each stage's
    # optimized HLO, to read the ops' fused computations where the trace's instruction text does not say enough.
    newest = max(trace.rglob("*.xplane.pb"), key=lambda f: f.stat().st_mtime)
    (trace / "request.xplane.pb.gz").write_bytes(gzip.compress(newest.read_bytes()))
    shutil.rmtree(trace / "plugins", ignore_errors=True)
    for k, program in enumerate(engine.programs.compiled.values()):
        for name, stage in getattr(program.executable, "stages", {}).items():
            try:
                (out / f"hlo-{k}-{name}.txt.gz").write_bytes(gzip.compress(stage.as_text().encode()))
            except Exception as err:  # noqa: BLE001 — a loaded executable may not keep its text: say so
                result.setdefault("hlo_missing", []).append(f"{k}/{name}: {type(err).__name__}")
    return result


def compare_images(a: Path, b: Path) -> dict:
    """Two runs' ``images-seed0.npy`` (the same request, seed 0; e.g. two GEGLU modes): uint8 pixel differences,
    largest and mean over every channel of the images both hold, and the share of values that differ by more than 8."""
    import numpy as np

    x, y = (np.load(d / "images-seed0.npy").astype(np.int16) for d in (a, b))
    x, y = x[:len(y)], y[:len(x)]  # the images both runs made (a run's first images are the same seeds)
    diff = np.abs(x - y)
    return {"a": str(a), "b": str(b), "shape": list(x.shape), "max_abs": int(diff.max()),
            "mean_abs": float(diff.mean()), "share_over_8": float((diff > 8).mean())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--from", dest="source", type=Path, help="only the tables, from DIR/trace of an earlier run")
    p.add_argument("--compare", type=Path, help="only the images of this earlier run's against --out's (seed 0)")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", default="sdxl-base-random")
    p.add_argument("--matmul", action="store_true", help="also the chip's sustained rate on the UNet's shapes")
    p.add_argument("--chain", type=int, default=20)
    p.add_argument("--ff", action="store_true", help="also the feed-forward's GEGLU modes side by side")
    p.add_argument("--geglu", default="", help="models/unet.GEGLU_MODE for the engine's run ('' = as shipped)")
    p.add_argument("--convs", action="store_true", help="also the UNet's convolutions in each CONV_MODE, side by side")
    p.add_argument("--conv", default="", help="models/layers.CONV_MODE for the engine's run ('' = as shipped)")
    p.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)  # CPU tests: shapes / scale
    p.add_argument("--cache", type=Path, help="the executable cache (default DIR/cache)")
    p.add_argument("--no-engine", action="store_true", help="only --matmul, --ff, --convs")
    p.add_argument("--cpu-devices", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written = args.out / "tpu_profile.json"
    if args.compare:
        print(json.dumps(compare_images(args.compare, args.out)), flush=True)
        return 0
    if args.source:
        report = json.loads((args.source / "tpu_profile.json").read_text()) if (
            args.source / "tpu_profile.json").exists() else {}
        report["trace"] = trace_tables(args.source / "trace", products=stage_products(args.source))
        written.write_text(json.dumps(report, indent=1))
        print(json.dumps({k: report["trace"][k] for k in ("busy_ms", "classes", "stages")}, indent=1))
        return 0
    import jax

    from sdxl_engine.models import layers, unet

    if args.geglu and args.geglu not in unet.GEGLU_MODES:  # before any chip time is spent
        p.error(f"--geglu: one of {', '.join(unet.GEGLU_MODES)}")
    if args.conv and args.conv not in layers.CONV_MODES:
        p.error(f"--conv: one of {', '.join(layers.CONV_MODES)}")
    report: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "jax": jax.__version__,
                    "device": str(jax.devices()[0].device_kind), "size": args.size, "images": args.images,
                    "steps": args.steps}
    if args.matmul:
        report["matmul"] = matmul_rates(rows=2 * args.images, chain=args.chain, scale=args.scale)
        written.write_text(json.dumps(report, indent=1))
    if args.ff:
        report["ff"] = ff_rates(rows=2 * args.images, scale=args.scale)
        written.write_text(json.dumps(report, indent=1))
    if args.convs:
        report["convs"] = conv_rates(rows=2 * args.images, scale=args.scale)
        written.write_text(json.dumps(report, indent=1))
    if args.geglu:
        unet.GEGLU_MODE = args.geglu  # read while the engine's programs trace
    report["geglu_mode"] = unet.geglu_mode()
    if args.conv:
        layers.CONV_MODE = args.conv  # read while the engine's programs trace
    report["conv_mode"] = layers.CONV_MODE
    if not args.no_engine:
        report["engine"] = profile_engine(args, args.out)
        written.write_text(json.dumps(report, indent=1))
        report["trace"] = trace_tables(args.out / "trace", products=stage_products(args.out))
        written.write_text(json.dumps(report, indent=1))
        print(json.dumps({k: report["trace"][k] for k in ("busy_ms", "classes", "stages")}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
