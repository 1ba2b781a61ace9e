"""The temp-folder janitor's sweep on a fake demo's folder (the folder kept bounded under real requests:
tests/serving/test_janitor_app.py)."""

import os
import time
from pathlib import Path

GAP_NS = 1_000_000  # 1 ms: far above the float rounding of st_ctime (sub-microsecond at today's epoch)


class FakeDemo:
    """What TempJanitor reads of a gr.Blocks: its temp folder, its blocks and the file sets Gradio keeps."""

    def __init__(self, root: Path):
        self.GRADIO_CACHE = str(root)
        self.blocks = {}
        self.temp_file_sets = [set(), set()]
        self.upload_file_set = set()  # Gradio's is temp_file_sets[0]; apart here, so the sets above hold app files


def make(root: Path, name: str, size: int) -> str:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return str(path)


def make_in_order(root: Path, names: list[str], size: int, after_ns: int = 0) -> tuple[list[str], list[float]]:
    """Write ``names`` so that each file's ctime (what TempJanitor orders by; os.utime cannot set it) is at
    least GAP_NS after the previous one's and after ``after_ns``: each file is rewritten until the
    filesystem clock has moved on (a condition, bounded by 30 s), never slept for. Returns (paths, ctimes)."""
    paths, times = [], []
    deadline = time.monotonic() + 30
    for name in names:
        path = make(root, name, size)
        while os.stat(path).st_ctime_ns < after_ns + GAP_NS:
            assert time.monotonic() < deadline, "the filesystem's ctime did not advance in 30 s"
            make(root, name, size)
        after_ns = os.stat(path).st_ctime_ns
        paths.append(path)
        times.append(os.stat(path).st_ctime)
    return paths, times


def test_sweep_deletes_oldest_first_down_to_the_cap_and_never_young_files(tmp_path):
    from sdxl_engine.serving import janitor as serving

    demo = FakeDemo(tmp_path)
    old, old_times = make_in_order(tmp_path, [f"req{i}/seed{i}.png" for i in range(10)], 1000)  # 10 kB, oldest first
    other_app = make(tmp_path, "someone-else/file.png", 50_000)  # not ours: never counted or deleted
    young, young_times = make_in_order(tmp_path, [f"new{i}/seed{i}.png" for i in range(3)], 1000,
                                       os.stat(old[-1]).st_ctime_ns)  # 3 kB, written after every old one
    demo.temp_file_sets[0].update(old)
    demo.temp_file_sets[1].update(young)
    # The sweep's clock is passed in: keep_s from now reaches back to between the old and the young files.
    keep_s = 100.0
    now = (old_times[-1] + young_times[0]) / 2 + keep_s
    janitor = serving.TempJanitor(demo, max_bytes=6000, keep_s=keep_s)
    assert janitor.sweep(now=now) == (7, 6000)
    assert [Path(p).exists() for p in old] == [False] * 7 + [True] * 3  # the oldest went first
    assert all(Path(p).exists() for p in young) and Path(other_app).exists()
    assert not (tmp_path / "req0").exists() and (tmp_path / "req9").exists()  # emptied folders removed
    assert demo.temp_file_sets[0] == set(old[7:])
    # Over a cap of 0: every old file goes, and nothing younger than keep_s, whatever the size.
    janitor = serving.TempJanitor(demo, max_bytes=0, keep_s=keep_s)
    assert janitor.sweep(now=now) == (3, 3000) and all(Path(p).exists() for p in young)
    assert janitor.sweep(now=young_times[-1] + keep_s + 1) == (3, 0) and tmp_path.exists()
    assert not any(Path(p).exists() for p in young)


def test_uploads_no_request_took_go_after_keep_s_whatever_the_size(tmp_path):
    """The image event leaves an upload the editor sent again meanwhile (guard.UploadFiles), and the editor's copies
    sent while a stroke is drawn are named by no request: they go after keep_s even far under the cap, unless
    uploaded again since (the same bytes, the same path) or while an upload is being written."""
    from sdxl_engine.engine.contract import clock
    from sdxl_engine.serving import guard
    from sdxl_engine.serving import janitor as serving

    demo = FakeDemo(tmp_path)
    (old, again, busy), times = make_in_order(tmp_path, ["u1/background.png", "u2/composite.png", "u3/layer_0.png"],
                                              100)
    young, _ = make_in_order(tmp_path, ["u4/background.png"], 100, os.stat(busy).st_ctime_ns)
    demo.upload_file_set.update([old, again, busy, *young])
    keep_s = 100.0
    now = times[-1] + keep_s + 0.5 * GAP_NS / 1e9  # the three first are keep_s old, the young one not yet
    guard.UPLOADS.uploaded([again], now=clock())  # the editor sent the same bytes again just now
    janitor = serving.TempJanitor(demo, max_bytes=1e9, keep_s=keep_s)
    with guard.UPLOADS.writing():  # an upload being written: nothing is taken
        assert janitor.expire_uploads(now) == 0
    assert janitor.expire_uploads(now) == 2
    assert not Path(old).exists() and not Path(busy).exists() and not (tmp_path / "u1").exists()
    assert Path(again).exists() and Path(young[0]).exists()
