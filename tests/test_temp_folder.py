"""Gradio's temp folder stays bounded: the app deletes its oldest files past a size, never young ones."""

import os
import time
from pathlib import Path

import pytest

from conftest import QUICK, RunningApp


class FakeDemo:
    """What TempJanitor reads of a gr.Blocks: its temp folder, its blocks and the file sets Gradio keeps."""

    def __init__(self, root: Path):
        self.GRADIO_CACHE = str(root)
        self.blocks = {}
        self.temp_file_sets = [set(), set()]


def make(root: Path, name: str, size: int) -> str:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return str(path)


def test_sweep_deletes_oldest_first_down_to_the_cap_and_never_young_files(tmp_path):
    from sdxl_engine.serving import server as serving

    demo = FakeDemo(tmp_path)
    old = [make(tmp_path, f"req{i}/seed{i}.png", 1000) for i in range(10)]  # 10 kB, oldest first
    other_app = make(tmp_path, "someone-else/file.png", 50_000)  # not ours: never counted or deleted
    time.sleep(1.0)
    young = [make(tmp_path, f"new{i}/seed{i}.png", 1000) for i in range(3)]  # 3 kB, just written
    demo.temp_file_sets[0].update(old)
    demo.temp_file_sets[1].update(young)
    janitor = serving.TempJanitor(demo, max_bytes=6000, keep_s=0.8)
    assert janitor.sweep() == (7, 6000)
    assert [Path(p).exists() for p in old] == [False] * 7 + [True] * 3  # the oldest went first
    assert all(Path(p).exists() for p in young) and Path(other_app).exists()
    assert not (tmp_path / "req0").exists() and (tmp_path / "req9").exists()  # emptied folders removed
    assert demo.temp_file_sets[0] == set(old[7:])
    # Over a cap of 0 by young files alone: nothing younger than keep_s is deleted, whatever the size.
    janitor = serving.TempJanitor(demo, max_bytes=0, keep_s=0.8)
    assert janitor.sweep() == (3, 3000) and all(Path(p).exists() for p in young)
    assert janitor.sweep(now=time.time() + 1) == (3, 0) and tmp_path.exists()


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_a_few_hundred_requests_keep_the_temp_folder_bounded(tmp_path):
    """200 requests (4 PNGs each, over 3 MB unbounded) with a 0.2 MB cap and a 2 s keep window."""
    temp = tmp_path / "gradio"
    temp.mkdir()
    (temp / "another-app.bin").write_bytes(b"y" * 100_000)  # a shared /tmp/gradio: not ours to delete
    app = RunningApp(env={"GRADIO_TEMP_DIR": str(temp), "SDXL_TEMP_MAX_MB": "0.2", "SDXL_TEMP_KEEP_S": "2"})
    try:
        client = app.client()
        written, peak = 0, 0
        for i in range(200):
            gallery, info = client.predict(api_name="/generate", **{**QUICK, "seed": i})
            written += sum(Path(item["image"]).stat().st_size for item in gallery)  # each download worked
            if i % 20 == 0:
                peak = max(peak, folder_bytes(temp) - 100_000)
        print(f"written {written} bytes, peak {peak} bytes")
        assert written > 3_000_000
        assert peak < 1_000_000, peak  # the cap plus what ~3 s of requests write
        time.sleep(4)  # past the keep window: down to the cap
        assert folder_bytes(temp) - 100_000 <= 200_000
        assert (temp / "another-app.bin").exists()
        assert not [p for p in temp.glob("sdxl-*") if not any(p.iterdir())]  # emptied request folders are gone
    finally:
        app.stop()
