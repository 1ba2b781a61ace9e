"""tools/loadtest.py's own pieces, without an app: its bounds, percentiles, error kinds."""

import pytest

from tools import loadtest


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
    assert loadtest.error_kind(AppError("the server cannot take this request now: 16 requests wait already "
                                        "(max_queue_size = 16); retry later")) == "busy"  # the service's line full
    assert loadtest.error_kind(AppError("seed: must be between -1 and 5")) \
        == "app_error: seed: must be between -1 and 5"
    assert loadtest.error_kind(TimeoutError()) == "timeout"
    assert loadtest.error_kind(ConnectionRefusedError()) == "connection"
