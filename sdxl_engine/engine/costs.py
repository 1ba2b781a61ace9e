"""What a compiled program costs, by XLA's own counts, and estimates for a size not compiled yet: what the engine's
admission (memory.py: memory; durations.py: device time) weighs a request by, before it compiles and before it runs.

XLA counts, per compiled executable: ``memory_analysis()`` (the temporaries and outputs one device needs beyond its
arguments) and ``cost_analysis()`` (FLOPs and bytes accessed, the denoising loop's body once). A program of another
size of the same kind grows with its pixels (convolutions' activations) and their square (attention's scores over
the latent tokens): with two sizes of a kind counted, each figure of a new size is the least-squares a*p + b*p^2
through them (docs/benchmarks.md, "Memory admission").
"""

from __future__ import annotations

import dataclasses

from sdxl_engine.program.generate import ProgramShape


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """XLA's counts of one compiled program (or their estimate for a size not compiled yet).

    Attributes:
        run_bytes: bytes one device needs to run it beyond its arguments (temporaries + outputs).
        flops: floating-point operations of the whole program (all devices; the loop's body once).
        accessed: bytes the whole program reads and writes (the same count).
        counted: True for XLA's counts of a compiled program, False for an estimate.
    """

    run_bytes: float
    flops: float
    accessed: float
    counted: bool = True


def program_cost(executable) -> ProgramCost | None:
    """XLA's counts of ``executable``, or None where the backend does not report them."""
    try:
        memory = executable.memory_analysis()
        cost = executable.cost_analysis()
    except Exception:  # not implemented on some backends or for some executables: no figures, no checks
        return None
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if memory is None or not cost or cost.get("flops") is None or cost.get("bytes accessed") is None:
        return None
    return ProgramCost(float(memory.temp_size_in_bytes + memory.output_size_in_bytes), float(cost["flops"]),
                       float(cost["bytes accessed"]))


def _kind(shape: ProgramShape) -> ProgramShape:
    """``shape`` without its size: programs of one kind differ by their size only."""
    return dataclasses.replace(shape, width=0, height=0)


def fit(points: dict[int, float]) -> tuple[float, float]:
    """(a, b) >= 0 of value = a * pixels + b * pixels^2 through ``points`` ({pixels: value}), least squares; with one
    point, the line through it (b = 0)."""
    if len(points) == 1:
        [(p, v)] = points.items()
        return v / p, 0.0
    # Normal equations of the two-term least squares, in pixels scaled to millions (well conditioned).
    xs = [(p / 1e6, v) for p, v in points.items()]
    s2 = sum(x ** 2 for x, _ in xs)
    s3 = sum(x ** 3 for x, _ in xs)
    s4 = sum(x ** 4 for x, _ in xs)
    t1 = sum(x * v for x, v in xs)
    t2 = sum(x * x * v for x, v in xs)
    det = s2 * s4 - s3 * s3
    a, b = ((t1 * s4 - t2 * s3) / det, (s2 * t2 - s3 * t1) / det) if det else (t1 / s2, 0.0)
    if a < 0:  # the best fit with b alone
        a, b = 0.0, t2 / s4
    elif b < 0:  # the best fit with a alone
        a, b = t1 / s2, 0.0
    return a / 1e6, b / 1e12


class CostTable:
    """The counts of every program compiled so far, by kind and size; estimates for the others."""

    def __init__(self):
        self.seen: dict[ProgramShape, dict[tuple[int, int], ProgramCost]] = {}  # kind -> {(width, height): counts}

    def observe(self, shape: ProgramShape, cost: ProgramCost | None) -> None:
        """Record a compiled program's counts."""
        if cost is not None:
            self.seen.setdefault(_kind(shape), {})[(shape.width, shape.height)] = cost

    def points(self, shape: ProgramShape, field: str) -> dict[int, float]:
        """{pixels: the ``field`` of ProgramCost} to estimate ``shape`` from, the largest per pixel count: its kind's
        sizes when they are two pixel counts or more; else every kind's with its CFG mode (a kind's extra stages, a
        VAE encode or a mask, weigh little beside what grows with the size; it is an estimate)."""
        own = self.seen.get(_kind(shape), {})
        kinds = [own] if len({w * h for w, h in own}) >= 2 else \
            [costs for kind, costs in self.seen.items() if kind.cfg == shape.cfg]
        merged: dict[int, float] = {}
        for costs in kinds:
            for (width, height), cost in costs.items():
                merged[width * height] = max(merged.get(width * height, 0.0), getattr(cost, field))
        return merged

    def estimate(self, shape: ProgramShape) -> ProgramCost | None:
        """``shape``'s counts when a program of its kind and size was compiled, else each figure fitted through
        :meth:`points` (two sizes at least: one alone cannot tell its constant part, the text encoders, from what
        grows); None when too little is known."""
        own = self.seen.get(_kind(shape), {}).get((shape.width, shape.height))
        if own is not None:
            return own
        figures = []
        for field in ("run_bytes", "flops", "accessed"):
            points = self.points(shape, field)
            if len(points) < 2:
                return None
            a, b = fit(points)
            pixels = shape.width * shape.height
            figures.append(a * pixels + b * pixels * pixels)
        return ProgramCost(*figures, counted=False)
