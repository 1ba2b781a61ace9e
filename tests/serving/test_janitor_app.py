"""Gradio's temp folder stays bounded: the app deletes its oldest files past a size, never young ones."""

import time
from pathlib import Path

import pytest

from tests.helpers import QUICK, RunningApp

pytestmark = pytest.mark.e2e


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_many_requests_keep_the_temp_folder_bounded(tmp_path):
    """30 requests (4 PNGs each, over 0.4 MB unbounded: four times the cap) with a 0.1 MB cap and a 2 s keep
    window."""
    temp = tmp_path / "gradio"
    temp.mkdir()
    (temp / "another-app.bin").write_bytes(b"y" * 100_000)  # a shared /tmp/gradio: not ours to delete
    app = RunningApp(env={"GRADIO_TEMP_DIR": str(temp), "SDXL_TEMP_MAX_MB": "0.1", "SDXL_TEMP_KEEP_S": "2"})
    try:
        client = app.client()
        done = []  # (time.time() when a request came back, its bytes)
        for i in range(30):
            gallery, info = client.predict(api_name="/generate", **{**QUICK, "seed": i})
            done.append((time.time(), sum(Path(item["image"]).stat().st_size for item in gallery)))  # downloads worked
            if i % 5 == 0:
                # Over the cap by at most what is too young to delete: what came back within the keep
                # window plus a sweep interval (0.5 s) and a generous 5 s for a loaded machine.
                young = sum(size for at, size in done if at >= time.time() - (2 + 0.5 + 5))
                assert folder_bytes(temp) - 100_000 <= 100_000 + young + 50_000, (i, young)
        assert sum(size for _, size in done) > 400_000
        # Past the keep window: down to the cap (waited for, with a generous bound).
        deadline = time.monotonic() + 60
        while folder_bytes(temp) - 100_000 > 100_000:
            assert time.monotonic() < deadline, folder_bytes(temp)
            time.sleep(0.1)
        assert (temp / "another-app.bin").exists()
        assert not [p for p in temp.glob("sdxl-*") if not any(p.iterdir())]  # emptied request folders are gone
    finally:
        app.stop()
