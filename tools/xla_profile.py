"""Where a compiled program's time goes on XLA:CPU, kernel by kernel, for ``python -m tools.vs_blog --profile``.

Each side of the comparison records a few requests under ``jax.profiler`` (an ``.xplane.pb``) and writes its
optimized HLO text; :func:`kernel_times` reads both back (``jax.profiler.ProfileData``, this interpreter's JAX, which
reads the blog's older JAX's files too) and sums the time of every kernel XLA's CPU runtime ran on its threads
(leaf events only: a while loop's or a conditional's own event holds its kernels' and is not counted again).
The two programs name their kernels differently (``ynn_fusion.19`` on one side is another kernel on the other), so
library kernels (XNNPACK/YNNPACK fusions) are keyed by what they compute: the fusion's result shape and its
convolution, dot or reduce instruction with its shapes and dimension numbers. Other kernels are keyed by name without
the instance number (``copy_bitcast_fusion``). Times are thread time summed over the devices' threads, per request;
the profiler's own overhead is in them (both sides alike), so read them as shares, not latencies.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

from tools.hlo_counts import computations, hlo_opcode

LIBRARY_OPS = ("convolution", "dot", "reduce")


def library_kernels(hlo_text: str) -> dict[str, str]:
    """{fusion name: what it computes} for the library (``kind=kCustom``) fusions of an optimized HLO module."""
    comps = computations(hlo_text)
    out = {}
    for lines in comps.values():
        for line in lines:
            match = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) fusion\(.*kind=kCustom, calls=%([\w.\-]+)", line)
            if not match:
                continue
            inner = [re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=.*", "", body.split(" = ", 1)[1]))
                     for body in comps.get(match[3], ()) if hlo_opcode(body) in LIBRARY_OPS]
            out[match[1]] = f"{match[2]} {inner[0] if inner else '(elementwise)'}"
    return out


def leaf_events(events) -> list[tuple[int, int, str]]:
    """(start_ns, end_ns, name) of a trace line's events that hold no other event (a while loop's or a conditional's
    event holds its body's kernels: only leaves count), the runtime's markers left out."""
    events = sorted(((e.start_ns, e.end_ns, e.name) for e in events
                     if not e.name.startswith(("end: ", "ThreadpoolListener", "ThunkExecutor"))),
                    key=lambda e: (e[0], -e[1]))
    return [e for i, e in enumerate(events) if not (i + 1 < len(events) and events[i + 1][0] < e[1])]


def kernel_times(xplane: Path, hlo_text: str, requests: int) -> dict[str, dict]:
    """{kernel key: {"ms": thread milliseconds per request, "calls": per request}} of one side's profile."""
    from jax.profiler import ProfileData

    names = library_kernels(hlo_text)
    ns, calls = collections.Counter(), collections.Counter()
    for plane in ProfileData.from_file(str(xplane)).planes:
        for line in plane.lines:
            if "XLAEigen" not in line.name and "XLAExecute" not in line.name:  # the runtime's threads
                continue
            for start, end, name in leaf_events(line.events):
                key = names.get(name) or re.sub(r"\.\d+$", "", name)
                ns[key] += end - start
                calls[key] += 1
    return {k: {"ms": v / 1e6 / requests, "calls": calls[k] / requests} for k, v in ns.items()}


def compare(sides: dict[str, dict[str, dict]], top: int = 15) -> dict:
    """The kernels whose time differs most between the first side and the last (the blog), and each side's total."""
    first, last = list(sides)[0], list(sides)[-1]
    keys = set().union(*sides.values())
    rows = sorted(keys, key=lambda k: -abs(sides[first].get(k, {}).get("ms", 0) - sides[last].get(k, {}).get("ms", 0)))
    return {"total_ms": {name: sum(v["ms"] for v in times.values()) for name, times in sides.items()},
            "kernels": [{"kernel": k, **{name: sides[name].get(k, {"ms": 0.0, "calls": 0}) for name in sides}}
                        for k in rows[:top]]}


def markdown(size: int, table: dict) -> str:
    """One row per kernel of :func:`compare`'s table: thread ms per request and calls, each side."""
    names = list(table["total_ms"])
    rows = [f"| {size}², kernel (thread ms per request; calls) | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
            "| **all kernels** | " + " | ".join(f"**{table['total_ms'][n]:.1f}**" for n in names) + " |"]
    for row in table["kernels"]:
        cells = " | ".join(f"{row[n]['ms']:.1f} ({row[n]['calls']:.0f})" for n in names)
        rows.append(f"| `{row['kernel'][:150]}` | {cells} |")
    return "\n".join(rows)
