"""engine/memory: what a request's run needs (XLA's count of its compiled program, engine/costs.py) against what the
server has; a request that cannot fit is refused, naming the field and the largest size that fits, before it runs
or, once the sizes compiled so far tell, before it compiles. (A 768x768 request on tiny-shapes needs 4 x 10.9 GB of
host memory and was killed by the kernel with the whole server: docs/benchmarks.md, "Memory admission".)"""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from sdxl_engine.engine import memory
from sdxl_engine.engine.costs import CostTable, ProgramCost
from sdxl_engine.engine.memory import MemoryBudget
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest
from sdxl_engine.program.generate import ProgramShape

SHAPE = ProgramShape(4, 64, 64, 50, step_hook=True)


def sized(width: int, height: int, **kw) -> ProgramShape:
    return dataclasses.replace(SHAPE, width=width, height=height, **kw)


def cost(run_bytes: float, counted: bool = True) -> ProgramCost:
    return ProgramCost(run_bytes, 1e9, 1e8, counted)


def budget(capacity: float, pool: int = 4) -> MemoryBudget:
    return MemoryBudget(int(capacity), pool, "host memory", 16, 4)


def test_a_refusal_names_width_the_need_the_capacity_and_a_largest_size_that_fits():
    b, table = budget(4 * 2.0e9), CostTable()  # 2 GB per device
    table.observe(sized(512, 512), cost(2.16e9))  # tiny-shapes at 512x512: 2.16 GB per device
    err = b.refusal(sized(768, 512), cost(4.9e9), table)
    assert isinstance(err, InvalidRequest) and err.field == "width"
    assert err.message.startswith("768x512 x 4 images needs 19.6 GB to run (4.90 GB on each of 4 devices), XLA's "
                                  "count of its compiled program, and this server has 8.0 GB of host memory")
    side = int(err.message.split("at most ")[1].split("x")[0])
    assert side % 16 == 0 and 0 < side < 512
    # With one size known, the size named grows as the pixels' square from it: it fits for sure.
    assert b.need(int(2.16e9 * (side / 512) ** 4)) <= b.capacity
    assert b.refusal(sized(512, 512), cost(1.9e9), table) is None
    assert b.refusal(sized(1024, 512), cost(9e9), table, field="hires_scale").field == "hires_scale"
    # An estimate is refused only when over by more than a tenth (a size near the limit is compiled and counted).
    assert b.refusal(sized(600, 512), cost(2.1e9, counted=False), table) is None
    assert b.refusal(sized(600, 512), cost(2.1e9), table) is not None  # XLA's count has no margin: 8.4 > 8.0 GB
    assert "estimated from the sizes compiled so far" in str(b.refusal(sized(600, 512), cost(2.3e9, False), table))
    assert budget(0).refusal(sized(768, 768), cost(1e12), table) is None  # capacity unknown: no check
    assert b.refusal(sized(768, 768), None, table) is None


def test_the_capacity_is_the_setting_or_what_is_free_less_the_reserve():
    devices = np.array([SimpleNamespace(platform="cpu")] * 4)
    mesh = SimpleNamespace(devices=devices)
    set_ = MemoryBudget.measure(mesh, 16, 4, limit_gb=1.5)
    assert (set_.capacity, set_.pool, set_.where) == (1_500_000_000, 4, "host memory (max_run_memory_gb)")
    auto = MemoryBudget.measure(mesh, 16, 4)
    assert 0 < auto.capacity <= (1 - memory.RESERVE) * memory.host_available_bytes() * 1.05
    gpu = [SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 80e9, "bytes_in_use": 20e9})]
    accel = MemoryBudget.measure(SimpleNamespace(devices=np.array(gpu)), 32, 1)
    assert (accel.capacity, accel.pool) == (int(60e9 * (1 - memory.RESERVE)), 1)


@pytest.mark.engine
def test_a_size_that_cannot_run_is_refused_before_it_runs_then_before_it_compiles(engine, monkeypatch):
    """tiny-random needs (per device, XLA's count) 1.6 MB at 64x64 and about 30 MB at 208x144: with 10 MB per device
    and only 64x64 counted, 208x144 compiles and is refused before it runs; with two sizes counted, 272x176 is
    refused before it compiles; 144x96 runs, and the engine serves on."""
    programs, default = engine.programs, engine.planner.shape(*engine.limits.default_size)
    table = CostTable()
    table.observe(default, programs.costs.estimate(default))
    monkeypatch.setattr(programs, "costs", table)  # only the default size known, whatever ran before
    monkeypatch.setattr(engine, "memory", MemoryBudget(4 * 10_000_000, 4, "host memory", engine.limits.multiple,
                                                       engine.batch))
    monkeypatch.setattr(engine, "run_times", None)
    before = set(programs.compiled)
    try:
        count = engine.compile_count
        with pytest.raises(InvalidRequest) as refused:
            engine.generate(GenerateRequest("a red circle", seed=1, num_inference_steps=1, width=208, height=144))
        assert refused.value.field == "width" and engine.compile_count == count + 1
        assert refused.value.message.startswith("208x144 x 4 images needs ") and "XLA's count" in refused.value.message
        with pytest.raises(InvalidRequest) as estimated:
            engine.generate(GenerateRequest("a red circle", seed=1, num_inference_steps=1, width=272, height=176))
        assert engine.compile_count == count + 1  # refused before compiling
        assert "estimated from the sizes compiled so far" in estimated.value.message
        side = int(estimated.value.message.split("at most ")[1].split("x")[0])
        square = table.estimate(dataclasses.replace(default, width=side, height=side))
        assert 96 <= side < 208 and engine.memory.need(int(square.run_bytes)) <= engine.memory.capacity
        served = engine.generate(GenerateRequest("a red circle", seed=1, num_inference_steps=1, width=144, height=96))
        assert served.images.shape == (4, 96, 144, 3) and engine.compile_count == count + 2
        assert engine.generate(GenerateRequest("a red circle", seed=1, num_inference_steps=1)).images.shape[0] == 4
    finally:
        for shape in set(programs.compiled) - before:
            programs.compiled.pop(shape)


def test_a_default_that_does_not_fit_the_chip_says_so_with_what_to_change():
    """The start's message when XLA refuses the default program for memory (a v5e chip's 4 x 1024² before flash
    attention: 18.66 G of temporaries against 15.75 G): the program asked, XLA's own line, fewer images first."""
    from sdxl_engine.engine.local import out_of_device_memory, start_does_not_fit

    xla = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
                       "(18.66G) exceeds available HBM (15.75G)\nmore lines")
    assert out_of_device_memory(xla) and not out_of_device_memory(ValueError("width must be a multiple of 8"))
    message = start_does_not_fit(1024, 1024, 4, "1 TPU v5 lite", xla)
    assert message.startswith("the default program (1024x1024 x 4 images per request) does not fit the memory of "
                              "1 TPU v5 lite: RESOURCE_EXHAUSTED: Ran out of memory on HBM")
    assert "Start with --images-per-request 2 (images per request: 4)" in message and "more lines" not in message
    assert "Start with a smaller --width/--height" in start_does_not_fit(1024, 1024, 1, "1 TPU v5 lite", xla)
