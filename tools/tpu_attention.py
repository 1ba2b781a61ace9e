"""SDXL's attention kernels side by side on a TPU, then one CFG UNet call with each: one command, JSON out.

    python3.11 -m tools.tpu_attention --out DIR [--unet] [--rows 2,8]

Kernels (``layers``), each a jitted (batch, len, heads * 64) -> same function in bfloat16, timed as the median of 5
rounds of 20 calls queued back to back (device time per call, dispatch hidden), with the largest absolute error
against a float32 XLA computation on unit-normal inputs: the XLA path with float32 scores, JAX's Pallas flash kernel
at several tilings (and with q pre-scaled, so the kernel skips its scale multiply), and the whole-row kernel
(``softmax_attention_tpu``) in both layouts and several query blocks, and packed with its row sum on the matrix
unit (``_mxu``) and 4 heads a grid step (``_h4``); ``--only`` keeps the names that contain it. Shapes: SDXL's
self-attentions at 1024² (4096 tokens x 10 heads, 1024 x 20) for ``--rows`` CFG rows (2 rows = 1 image).

With ``--unet``: SDXL base's full-size UNet (random bfloat16 weights) called once per CFG step at 1024² for each
``--rows``, with the attention of every 1024- and 4096-token self-attention routed to each of ``--unet-kernels`` in
turn (the rounds alternate between kernels, so drift hits all alike); compile seconds and device ms per call.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np


def timed(fn, args, calls: int = 20, rounds: int = 5) -> float:
    """Median over ``rounds`` of the device ms per call of ``calls`` calls queued back to back."""
    import jax

    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t0) / calls * 1e3)
    return float(np.median(out))


def kernels(t: int) -> dict:
    """{name: f(q, k, v, heads)} of every variant that takes a ``t``-token self-attention."""
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

    from sdxl_engine.models import layers

    def flash(bq, bk, prescale):
        def f(q, k, v, heads):
            b, n, d = q.shape
            hd = d // heads
            first = lambda x: x.reshape(b, n, heads, hd).transpose(0, 2, 1, 3)  # noqa: E731
            scale = 1.0 / math.sqrt(hd)
            if prescale:
                q = q * np.asarray(scale, q.dtype)
            out = pallas_flash.flash_attention(first(q), first(k), first(v), sm_scale=1.0 if prescale else scale,
                                               block_sizes=pallas_flash.BlockSizes(block_q=bq, block_k_major=bk,
                                                                                   block_k=bk, block_b=1))
            return out.transpose(0, 2, 1, 3).reshape(b, n, d)
        return f

    out = {"xla_f32_scores": functools.partial(layers.attention, implementation="xla"),
           "flash_512 (engine now)": functools.partial(layers.attention, implementation="pallas_tpu")}
    for bq, bk in ((512, 512), (1024, 512), (1024, 1024), (2048, 512)):
        if t % bq == 0 and t % bk == 0:
            out[f"flash_q{bq}_k{bk}_prescaled"] = flash(bq, bk, True)
    for layout in ("packed", "heads_first"):
        for bq in (256, 512, 1024):
            if t % bq == 0:
                out[f"whole_{layout}_q{bq}"] = whole_kernel(f"whole_{layout}_q{bq}")
    for bq in (512, 1024):  # the packed kernel's row sum on the matrix unit, and 4 heads a grid step
        for suffix in ("_mxu", "_h4", "_mxu_h4"):
            if t % bq == 0 and ("_h4" not in suffix or t == 1024):  # 4096 tokens have 10 heads: 4 do not divide
                out[f"whole_packed_q{bq}{suffix}"] = whole_kernel(f"whole_packed_q{bq}{suffix}")
    return out


def whole_kernel(name: str):
    """The whole-row kernel a name says: ``whole_<layout>_q<block_q>[_mxu][_h<heads_per_step>]`` (row sum "mxu"
    where it says so, else "vpu"; 2 heads a step unless it says). Raises ValueError for another name."""
    from sdxl_engine.models import layers

    m = re.fullmatch(r"whole_(packed|heads_first)_q(\d+)(_mxu)?(?:_h(\d+))?", name)
    if not m:
        raise ValueError(f"not a whole-row kernel's name: {name!r}")
    return functools.partial(layers.softmax_attention_tpu, block_q=int(m[2]), layout=m[1],
                             row_sum="mxu" if m[3] else "vpu", heads_per_step=int(m[4] or 2))


def kernel_table(rows_list: list[int], only: str = "") -> list[dict]:
    """Each variant of :func:`kernels` (those whose name contains ``only``, when given) at each ``rows``, 4096 and
    1024 tokens: device ms per call, TFLOP/s, and the largest difference from a float32 XLA computation."""
    import jax
    import jax.numpy as jnp

    from sdxl_engine.models import layers

    results = []
    for rows in rows_list:
        for t, heads in ((4096, 10), (1024, 20)):
            rng = np.random.default_rng(0)
            q32, k32, v32 = (rng.standard_normal((rows, t, heads * 64)).astype(np.float32) for _ in range(3))
            q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q32, k32, v32))
            ref = jax.jit(functools.partial(layers.attention, implementation="xla"), static_argnums=3)(
                *(jnp.asarray(np.asarray(x, np.float32)) for x in (q, k, v)), heads)
            for name, fn in kernels(t).items():
                if only and only not in name:
                    continue
                row = dict(rows=rows, tokens=t, heads=heads, kernel=name)
                try:
                    f = jax.jit(fn, static_argnums=3)
                    row["ms"] = round(timed(f, (q, k, v, heads)), 3)
                    row["err"] = float(jnp.abs(f(q, k, v, heads).astype(jnp.float32) - ref).max())
                    flop = 4 * rows * heads * t * t * 64
                    row["tflops"] = round(flop / row["ms"] / 1e9, 1)
                except Exception as err:  # a tiling Mosaic refuses: say so, go on
                    row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                print(json.dumps(row), flush=True)
                results.append(row)
    return results


def unet_table(rows_list: list[int], names: list[str], rounds: int) -> list[dict]:
    """One CFG UNet call at 1024² per ``rows``, with each kernel of ``names`` on the 1024/4096-token attentions."""
    import jax
    import jax.numpy as jnp

    from sdxl_engine.checkpoint import builtin
    from sdxl_engine.models import build_component, layers
    from sdxl_engine.models.random_weights import random_params

    unet = build_component("unet", builtin.SDXL_BASE_CONFIGS["unet"])
    t0 = time.perf_counter()
    params = random_params({"unet": unet}, jnp.bfloat16)["unet"]
    jax.block_until_ready(params)
    print(json.dumps({"weights_s": round(time.perf_counter() - t0, 1)}), flush=True)
    chosen = {"flash_512": None, **{n: n for n in names if n != "flash_512"}}
    plain = layers.flash_attention_tpu

    def routed(name):
        def f(q, k, v, heads, *, is_causal=False):
            if name is None:
                return plain(q, k, v, heads, is_causal=is_causal)
            return whole_kernel(name)(q, k, v, heads)
        return f

    results = []
    for rows in rows_list:
        rng = np.random.default_rng(0)
        sample = jnp.asarray(rng.standard_normal((rows, 4, 128, 128)), jnp.bfloat16)
        context = jnp.asarray(rng.standard_normal((rows, 77, 2048)), jnp.bfloat16)
        embeds = jnp.asarray(rng.standard_normal((rows, 1280)), jnp.bfloat16)
        ids = jnp.tile(jnp.asarray([[1024, 1024, 0, 0, 1024, 1024]], jnp.bfloat16), (rows, 1))
        steps = jnp.full((rows,), 500.0, jnp.float32)
        compiled, outs = {}, {}
        for name, route in chosen.items():
            layers.flash_attention_tpu = routed(route)
            try:
                fn = jax.jit(lambda p, *a: unet.bind(p)(*a))
                t0 = time.perf_counter()
                compiled[name] = fn.lower(params, sample, steps, context, embeds, ids).compile()
                outs[name] = np.asarray(compiled[name](params, sample, steps, context, embeds, ids), np.float32)
                print(json.dumps({"rows": rows, "kernel": name, "compile_s": round(time.perf_counter() - t0, 1)}),
                      flush=True)
            finally:
                layers.flash_attention_tpu = plain
        times = {n: [] for n in compiled}
        for _ in range(rounds):
            for name, exe in compiled.items():
                times[name].append(timed(exe, (params, sample, steps, context, embeds, ids), calls=5, rounds=1))
        base = times.get("flash_512")
        for name, ms in times.items():
            row = dict(rows=rows, kernel=name, ms=round(float(np.median(ms)), 2),
                       ms_runs=[round(m, 2) for m in ms],
                       max_abs_diff_vs_flash_512=float(np.abs(outs[name] - outs["flash_512"]).max()))
            if base:
                row["ratio_vs_flash_512"] = round(float(np.median(ms) / np.median(base)), 4)
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", default="2,8", help="CFG rows per call (2 = one image), comma-separated")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--only", default="", help="time only the kernels whose name contains this (e.g. whole_packed)")
    p.add_argument("--unet", action="store_true", help="also one CFG UNet call with each of --unet-kernels")
    p.add_argument("--unet-rows", default="8")
    p.add_argument("--unet-kernels", default="whole_packed_q512",
                   help="whole-row kernels (whole_<layout>_q<block>) beside flash_512")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    import jax

    args.out.mkdir(parents=True, exist_ok=True)
    record = dict(when=datetime.now(UTC).isoformat(timespec="seconds"), jax=jax.__version__,
                  device=str(jax.devices()[0].device_kind), python=sys.version.split()[0])
    path = args.out / "tpu_attention.json"
    if not args.skip_kernels:
        record["kernels"] = kernel_table([int(r) for r in args.rows.split(",")], args.only)
        path.write_text(json.dumps(record, indent=1))
    if args.unet:
        record["unet"] = unet_table([int(r) for r in args.unet_rows.split(",")],
                                    [n for n in args.unet_kernels.split(",") if n], args.rounds)
        path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
