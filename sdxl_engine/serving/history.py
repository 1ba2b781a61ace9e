"""The page's history: each browser keeps its last generations (settings and small thumbnails).

A record is made once per generation, from the request's own values (what the user typed, the
style) and the result's pixels; it lives in the browser's localStorage (Gradio's
``BrowserState``) and survives a reload. Thumbnails are JPEG data URLs there; the history
gallery needs files, so each thumbnail is written once to a small file and remembered by its
URL: a request decodes no thumbnail it has seen before (only a reload on a fresh server does).
"""

from __future__ import annotations

import base64
import hashlib
import io
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
from PIL import Image

LIMIT = 20  # generations kept per browser
THUMB_PX = 96  # longest side of a thumbnail, pixels
_CACHE_MAX = 2000  # thumbnail files remembered by this process (20 browsers' worth of full histories)


def thumbnail_url(image: np.ndarray) -> str:
    """(H, W, 3) uint8 -> a small JPEG data URL, longest side THUMB_PX pixels."""
    thumb = Image.fromarray(image, "RGB")
    thumb.thumbnail((THUMB_PX, THUMB_PX))
    buffer = io.BytesIO()
    thumb.save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def make_record(user: dict, info: dict, images: np.ndarray) -> dict:
    """What the browser keeps of one generation (a few KB).

    Args:
        user: the request as the user gave it: ``prompt``, ``negative_prompt``, ``style``.
        info: the API's info JSON (seeds, settings as the engine used them, model, latency).
        images: (n, H, W, 3) uint8, the generation's pixels.
    """
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "prompt": user["prompt"], "negative_prompt": user["negative_prompt"] or "", "style": user["style"],
        "seeds": info["seeds"], "guidance_scale": info["guidance_scale"], "sampler": info.get("sampler", "Euler"),
        "num_inference_steps": info["num_inference_steps"], "width": info["width"], "height": info["height"],
        "model": info["model"], "latency_s": info["latency_s"],
        "thumbs": [thumbnail_url(image) for image in images],
    }


def remember(history: list | None, record: dict | None) -> list:
    """``record`` first, then at most LIMIT - 1 older records (the browser's history after a generation)."""
    return ([record] if record else []) + list(history or [])[: LIMIT - 1]


class ThumbnailFiles:
    """Thumbnail data URL -> a small file in ``folder``, written once per URL (least recently used forgotten)."""

    def __init__(self, folder_fn):
        self._folder_fn = folder_fn  # where files go; called lazily (Gradio's temp folder exists by then)
        self._paths: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.decoded = 0  # thumbnails decoded and written so far (the tests count them)

    def path(self, url: str) -> str:
        """The file of ``url``; decoded and written only if this process has not seen it (or it was cleaned up)."""
        with self._lock:
            known = self._paths.get(url)
            if known is not None and Path(known).is_file():
                self._paths.move_to_end(url)
                return known
        data = base64.b64decode(url.split(",", 1)[1])
        folder = Path(self._folder_fn())
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"thumb-{hashlib.sha256(data).hexdigest()[:20]}.jpg"
        if not path.is_file():
            path.write_bytes(data)
        with self._lock:
            self.decoded += 1
            self._paths[url] = str(path)
            while len(self._paths) > _CACHE_MAX:
                self._paths.popitem(last=False)
        return str(path)

    def items(self, history: list | None, no_style: str) -> list[tuple[str, str]]:
        """The history (newest first) as gallery items, (thumbnail path, caption), one per image."""
        items = []
        for record in history or []:
            style = "" if record["style"] == no_style else f" · {record['style']}"
            for seed, url in zip(record["seeds"], record["thumbs"]):
                items.append((self.path(url), f"seed {seed}{style} · {record['prompt'][:40]}"))
        return items


class Pending:
    """Records made by /generate, waiting for the page's follow-up event to put them in that
    browser's history: keyed by Gradio session, so the record never travels in the API's output.

    API calls (gradio_client, raw HTTP) run no follow-up event: their records are forgotten once
    ``max_sessions`` newer sessions have left one (memory stays bounded).
    """

    def __init__(self, max_sessions: int = 1000):
        self._records: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_sessions = max_sessions

    def put(self, session: str | None, record: dict) -> None:
        with self._lock:
            self._records.setdefault(session or "", []).append(record)
            self._records.move_to_end(session or "")
            while len(self._records) > self.max_sessions:
                self._records.popitem(last=False)

    def pop(self, session: str | None) -> dict | None:
        """The oldest record of ``session`` not yet taken (None if there is none)."""
        with self._lock:
            records = self._records.get(session or "")
            if not records:
                return None
            record = records.pop(0)
            if not records:
                del self._records[session or ""]
            return record


def entry(history: list | None, index: int) -> tuple[dict, int]:
    """The record and seed behind item ``index`` of :meth:`ThumbnailFiles.items`. Raises IndexError."""
    for record in history or []:
        if index < len(record["seeds"]):
            return record, record["seeds"][index]
        index -= len(record["seeds"])
    raise IndexError("no such history item")
