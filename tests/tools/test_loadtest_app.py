"""The short load test (CI): a few clients for ~15 s against the shared running app.

The long one is a command (README): ``python -m tools.loadtest --clients 8 --seconds 120``.
Speed is not asserted here (that is the benchmark's job); what must hold is that every call
succeeds, latencies are reported, and the server's memory does not run away.
"""

import json

import pytest

from tools import loadtest

pytestmark = pytest.mark.e2e


def test_short_load_test(app_server):
    report = loadtest.run(app_server.url, clients=4, seconds=15, pid=app_server.proc.pid, timeout=60)
    print("\nload test:", json.dumps(report))
    assert report["errors"] == {} and report["calls_failed"] == 0
    assert report["calls_ok"] >= 4 and report["throughput_calls_per_s"] > 0
    assert report["throughput_images_per_s"] == pytest.approx(4 * report["throughput_calls_per_s"], rel=0.01)
    assert 0 < report["latency_p50_s"] <= report["latency_p95_s"] <= report["latency_max_s"] < 60
    assert report["server_rss_mb_before"] > 50 and report["server_rss_mb_after"] > 50
    assert report["server_rss_growth_mb"] < 300, report  # 4 x 64x64 PNGs a call; a leak of arrays would show


def test_server_pid_found_from_the_port(app_server):
    pytest.importorskip("psutil")
    assert loadtest.find_server_pid(app_server.url) == app_server.proc.pid


