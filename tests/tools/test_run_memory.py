"""tools/run_memory: each size's compile in a fresh process, with XLA's per-device count that admission uses."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.engine


@pytest.mark.slow  # 16 s: compiles a program per size
def test_each_size_reports_its_compile_and_xlas_count_growing_with_the_pixels():
    out = subprocess.run([sys.executable, "-m", "tools.run_memory", "--model", "tiny-random", "--sizes", "64x64",
                          "128x96"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300)
    small, large = (json.loads(line) for line in out.stdout.strip().splitlines())
    assert (small["width"], small["height"], large["width"], large["height"]) == (64, 64, 128, 96)
    # tiny-random per device: 1.59 MB at 64x64, 5.90 MB at 128x96 (docs/benchmarks.md, "Memory admission")
    assert 1e6 < small["run_bytes_per_device"] < large["run_bytes_per_device"] < 2e7
    assert small["compile_rss_growth_bytes"] > 0 and small["devices"] == 4
