"""engine/costs: XLA's counts of a compiled program, and a new size's estimate fitted through the sizes counted."""

import dataclasses

import pytest

from sdxl_engine.engine.costs import CostTable, ProgramCost, fit, program_cost
from sdxl_engine.program.generate import ProgramShape

SHAPE = ProgramShape(4, 64, 64, 50, step_hook=True)


def sized(width: int, height: int, **kw) -> ProgramShape:
    return dataclasses.replace(SHAPE, width=width, height=height, **kw)


def test_the_fit_recovers_linear_and_quadratic_growth_in_pixels():
    a, b = 300.0, 0.004  # per pixel, per pixel squared
    points = {p: a * p + b * p * p for p in (64 * 64, 256 * 128, 512 * 384)}
    fa, fb = fit(points)
    assert fa == pytest.approx(a, rel=1e-6) and fb == pytest.approx(b, rel=1e-6)
    assert fit({4096: 8192}) == (2.0, 0.0)
    assert fit({4096: 4096 ** 2, 8192: 8192 ** 2}) == (0.0, pytest.approx(1.0))  # quadratic alone: a clamped at 0


def test_an_estimate_needs_two_sizes_and_falls_back_on_the_other_kinds_of_the_same_cfg_mode():
    table = CostTable()
    table.observe(sized(64, 64), ProgramCost(4e3, 1e9, 1e8))
    assert table.estimate(sized(64, 64)) == ProgramCost(4e3, 1e9, 1e8)  # counted: XLA's own
    assert table.estimate(sized(128, 96)) is None  # one size: its constant part cannot be told from what scales
    table.observe(sized(128, 64), ProgramCost(16e3, 3e9, 3e8))
    guess = table.estimate(sized(256, 64))
    assert not guess.counted and guess.run_bytes > 16e3 and guess.flops > 3e9 and guess.accessed > 3e8
    # a kind with one size of its own: estimated from every kind of its CFG mode (the largest figure per size)
    table.observe(sized(64, 64, init_image=True), ProgramCost(5e3, 1.2e9, 1.1e8))
    image = table.estimate(sized(256, 64, init_image=True))
    a, b = fit({64 * 64: 5e3, 128 * 64: 16e3})
    assert image.run_bytes == pytest.approx(a * 256 * 64 + b * (256 * 64) ** 2)
    assert table.estimate(sized(256, 64, cfg=False)) is None  # no program without CFG counted yet
    table.observe(sized(64, 64), None)  # a backend that reports nothing records nothing
    assert table.estimate(sized(64, 64)).run_bytes == 4e3


def test_program_cost_is_none_without_xlas_analyses():
    assert program_cost(object()) is None
