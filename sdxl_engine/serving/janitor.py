"""Gradio's temp folder kept under a size: this app's files only, oldest first, never one a client may still
be downloading (:class:`TempJanitor`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sdxl_engine.engine.contract import clock
from sdxl_engine.serving import gradio_internals, guard

LOG = logging.getLogger(__name__)


class TempJanitor:
    """Keeps this app's files in Gradio's temp folder under ``max_bytes``, oldest first.

    Only files the app created count and are deleted: Gradio records them per component
    (``demo.temp_file_sets``: each request's gallery PNGs, the history thumbnails), so another
    app's files in a shared ``/tmp/gradio`` are left alone, and so are files Gradio keeps for
    good (``keep_in_cache``: examples). A file younger than ``keep_s`` seconds is never deleted,
    as a client may still be downloading it: a burst can push the folder past ``max_bytes`` by
    what it writes in that time. Folders left empty inside the temp folder are removed too.

    Uploads (files clients sent) go after ``keep_s`` whatever the size: the image event deletes the ones it was
    given when it ends, but not one the editor uploaded again meanwhile, nor the copies it uploads while a stroke
    is drawn that no request names (guard.UploadFiles). Every upload is deleted through guard.UPLOADS, so none
    is taken while an upload of the same bytes is being written.
    """

    def __init__(self, demo, max_bytes: float, keep_s: float):
        self.demo = demo
        self.root = gradio_internals.temp_folder(demo)
        self.max_bytes = max_bytes
        self.keep_s = keep_s

    @classmethod
    def for_config(cls, demo, config) -> TempJanitor:
        return cls(demo, config.temp_max_mb * 1e6, config.temp_keep_s)

    def _tracked(self) -> list[tuple[float, int, str, set]]:
        """(last written, size, path, the set recording it) of every file the app created, oldest first."""
        keep = gradio_internals.kept_files(self.demo)
        entries = []
        for file_set in gradio_internals.file_sets(self.demo):
            for path in list(file_set):
                if path in keep:
                    continue
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    file_set.discard(path)
                    continue
                # ctime: when the file appeared or was last written here (a copy keeps its old mtime)
                entries.append((st.st_ctime, st.st_size, path, file_set))
        return sorted(entries, key=lambda entry: entry[0])

    def sweep(self, now: float | None = None) -> tuple[int, int]:
        """Delete the uploads older than ``keep_s`` (:meth:`expire_uploads`), then the oldest files until the app's
        files take at most ``max_bytes`` (none younger than ``keep_s``). Returns (files deleted by the second step,
        bytes left)."""
        now = time.time() if now is None else now
        self.expire_uploads(now)
        entries = self._tracked()
        total, deleted = sum(size for _, size, _, _ in entries), 0
        for written, size, path, file_set in entries:
            if total <= self.max_bytes or now - written < self.keep_s:
                break
            if file_set is gradio_internals.upload_files(self.demo):
                # With its folder, under the lock of the uploads being written (one may be filling that folder).
                if not guard.UPLOADS.remove([path], clock() - self.keep_s):
                    continue  # being uploaded again: kept
            else:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                self._remove_empty(Path(path).parent)
            file_set.discard(path)
            total -= size
            deleted += 1
        return deleted, total

    def expire_uploads(self, now: float) -> int:
        """Delete the uploads written ``keep_s`` seconds before ``now`` (time.time()) or earlier and not uploaded
        again since (guard.UPLOADS.remove); returns how many were deleted."""
        uploads = gradio_internals.upload_files(self.demo)
        old = []
        for path in list(uploads):
            try:
                if now - os.stat(path).st_ctime >= self.keep_s:
                    old.append(path)
            except FileNotFoundError:
                uploads.discard(path)
        return len(guard.UPLOADS.remove(old, clock() - self.keep_s))

    def _remove_empty(self, folder: Path) -> None:
        """Remove ``folder`` if it is empty and strictly inside the temp folder."""
        try:
            if folder.resolve() != self.root and folder.resolve().is_relative_to(self.root):
                folder.rmdir()
        except OSError:  # not empty, or gone already
            pass

    def run(self, stop: threading.Event, interval_s: float, log: Callable[[str], None] | None = None) -> None:
        """Sweep every ``interval_s`` seconds until ``stop`` is set (a daemon thread's body); a failure logs one
        warning (to ``log``, None: this module's logger)."""
        log = log or LOG.warning
        warned = False
        while not stop.wait(interval_s):
            try:
                self.sweep()
            except Exception as err:  # keep serving; say it once
                if not warned:
                    log(f"[app] warning: cleaning Gradio's temp folder failed ({type(err).__name__}: {err})")
                    warned = True

    def start(self, stop: threading.Event, log: Callable[[str], None] | None = None) -> threading.Thread:
        """Run :meth:`run` in a daemon thread, sweeping at least every 30 s and 4 times per ``keep_s``."""
        interval = max(0.5, min(30.0, self.keep_s / 4))
        thread = threading.Thread(target=self.run, args=(stop, interval, log), name="temp-janitor", daemon=True)
        thread.start()
        return thread
