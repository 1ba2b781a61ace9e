"""The short load test (CI): a few clients for ~15 s against the shared running app.

The long one is a command (README): ``python -m tools.loadtest --clients 8 --seconds 120``.
Speed is not asserted here (that is the benchmark's job); what must hold is that every call
succeeds, latencies are reported, and the server's memory does not run away.
"""

import json

import pytest

from tools import loadtest


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


@pytest.mark.parametrize("url, clients, seconds, message", [
    ("http://example.com:7860/", 1, 1, "only loopback URLs"),
    ("http://10.0.0.1:7860/", 1, 1, "only loopback URLs"),
    ("http://127.0.0.1.evil.example/", 1, 1, "only loopback URLs"),
    ("http://127.0.0.1:7860/", 0, 1, "clients must be between 1 and 64"),
    ("http://127.0.0.1:7860/", 65, 1, "clients must be between 1 and 64"),
    ("http://127.0.0.1:7860/", 1, 0, "seconds must be in"),
    ("http://127.0.0.1:7860/", 1, 601, "seconds must be in"),
])
def test_load_test_is_bounded_and_loopback_only(url, clients, seconds, message):
    with pytest.raises(loadtest.LoadTestError, match=message):
        loadtest.run(url, clients=clients, seconds=seconds)


def test_percentile_matches_numpy():
    import numpy as np

    values = [0.3, 0.1, 0.9, 0.5, 0.2, 0.7, 0.4]
    for q in (50, 95, 100):
        assert loadtest.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert loadtest.percentile([], 50) is None


def test_error_kinds():
    from gradio_client.exceptions import AppError
    from gradio_client.utils import QueueError

    assert loadtest.error_kind(QueueError("Queue is full! Please try again.")) == "busy"
    assert loadtest.error_kind(AppError("seed: must be between -1 and 5")) == "app_error: seed: must be between -1 and 5"
    assert loadtest.error_kind(TimeoutError()) == "timeout"
    assert loadtest.error_kind(ConnectionRefusedError()) == "connection"
