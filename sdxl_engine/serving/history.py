"""The page's history: each browser keeps its last generations (settings and small thumbnails).

A record is made once per generation, from the request's own values (what the user typed, the
style) and the result's pixels; it lives in the browser's localStorage (Gradio's
``BrowserState``, encrypted there with a key from :func:`browser_secret`). Thumbnails are JPEG
data URLs in the record and stay in the browser: the page draws the history gallery from them
itself (app.py, ``HISTORY_JS``), so the server never writes a byte a client sent.

The key is stable across restarts (a setting, else a random one made once and kept in the
cache folder): a history survives a reload and a restart. With another key (the setting or the
file changed, another machine) the browser cannot decrypt what it kept; its history starts
empty and the page says so.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
from PIL import Image

LOG = logging.getLogger(__name__)

LIMIT = 20  # generations kept per browser
THUMB_PX = 96  # longest side of a thumbnail, pixels
SECRET_ENV = "SDXL_HISTORY_SECRET"
SECRET_FILE = "history-secret"  # in the cache folder (sdxl_engine.config.DEFAULT_CACHE)

# The page's settings a made image brings back, in the order of the widgets they set (app.py), each as (the name
# the PNG restore's note gives it, its key in a PNG's parameters text: A1111's infotext, service/images.py): a past
# image's (page_history.restore, from its record: make_record) and a PNG's (page.png_settings). A setting listed
# here is kept and restored by the history, and read back from a PNG, without another line (under its name in the
# info record; from a PNG as its /generate input's kind); these the history keeps its own way:
TYPED_FIELDS = ("prompt", "negative_prompt", "style")  # as the user typed them (the info record holds them styled)
OWN_WAY = TYPED_FIELDS + ("seed", "resolution")  # the request's seeds (the image picks one), its width and height
RESTORED_FIELDS = {"prompt": ("prompt", "Prompt"), "negative_prompt": ("negative prompt", "Negative prompt"),
                   "style": ("style", "Style"), "seed": ("seed", "Seed"), "guidance_scale": ("CFG", "CFG scale"),
                   "num_inference_steps": ("steps", "Steps"), "sampler": ("sampler", "Sampler"),
                   "schedule_type": ("schedule type", "Schedule type"), "resolution": ("size", "Size"),
                   "refiner_switch_at": ("refiner switch", "Refiner switch at"), "model": ("model", "Model")}


def thumbnail_url(image: np.ndarray) -> str:
    """(H, W, 3) uint8 -> a small JPEG data URL, longest side THUMB_PX pixels."""
    thumb = Image.fromarray(image, "RGB")
    thumb.thumbnail((THUMB_PX, THUMB_PX))
    buffer = io.BytesIO()
    thumb.save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def make_record(user: dict, info: dict, images: np.ndarray) -> dict:
    """What the browser keeps of one generation (a few KB): each of :data:`RESTORED_FIELDS` under its name (the
    info's value, None where it has none), except those kept their own way (:data:`OWN_WAY`): the typed texts, the
    seeds, the width and height; then the time, the latency, the thumbnails and whether it was made from a picture.

    Args:
        user: the request as the user gave it: ``prompt``, ``negative_prompt``, ``style``.
        info: the API's info JSON (seeds, settings as the engine used them, model, latency).
        images: (n, H, W, 3) uint8, the generation's pixels.

    Raises KeyError for an ``info`` without ``seeds``, ``width``, ``height`` or ``latency_s``.
    """
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        **{name: info.get(name) for name in RESTORED_FIELDS if name not in OWN_WAY},
        "prompt": user["prompt"], "negative_prompt": user["negative_prompt"] or "", "style": user["style"],
        "seeds": info["seeds"], "width": info["width"], "height": info["height"], "latency_s": info["latency_s"],
        "thumbs": [thumbnail_url(image) for image in images],
        # made from a picture (image to image, inpainting, upscale): its size is the picture's, not one to restore
        **({"from_image": True} if "strength" in info or "hires" in info else {}),
    }


def remember(history: list | None, record: dict | None) -> list:
    """``record`` first, then at most LIMIT - 1 older records (the browser's history after a generation)."""
    return ([record] if record else []) + list(history or [])[: LIMIT - 1]


class Pending:
    """Records made by /generate, waiting for the page's follow-up event to put them in that
    browser's history: keyed by Gradio session, so the record never travels in the API's output.

    API calls (gradio_client, raw HTTP) run no follow-up event: their records are forgotten once
    ``max_sessions`` newer sessions have left one, and a session keeps only its newest
    ``max_per_session`` (a browser's history holds no more), so memory stays bounded also for one
    long-lived API client.
    """

    def __init__(self, max_sessions: int = 1000, max_per_session: int = LIMIT):
        self._records: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_sessions = max_sessions
        self.max_per_session = max_per_session

    def put(self, session: str | None, record: dict) -> None:
        with self._lock:
            records = self._records.setdefault(session or "", [])
            records.append(record)
            del records[:-self.max_per_session]  # the oldest beyond the cap
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
    """The record and seed behind item ``index`` of the history gallery (each record's images in
    order, newest record first: app.py's ``HISTORY_JS``). Raises IndexError."""
    for record in history or []:
        if index < len(record["seeds"]):
            return record, record["seeds"][index]
        index -= len(record["seeds"])
    raise IndexError("no such history item")


def browser_secret(setting: str | None = None, cache_dir: str | Path | None = None, log=LOG.warning) -> str:
    """The key the browsers' history is encrypted with: ``setting`` (``--history-secret``), else
    the environment's SDXL_HISTORY_SECRET, else the one kept in ``<cache_dir>/history-secret``
    (default: sdxl_engine's cache folder, which honours XDG_CACHE_HOME), made once (random, mode
    0600) by the first process that needs it. The same key in every process: a history survives
    restarts. Gradio sends the key to the page (the browser decrypts with it), so it names this
    deployment's history rather than hiding it from the browser's user.

    If the file cannot be read or made, logs one warning and returns a key for this process
    only (the history then lasts until the next restart).
    """
    for value in (setting, os.environ.get(SECRET_ENV)):
        if value:
            return value
    if cache_dir is None:
        from sdxl_engine.config import DEFAULT_CACHE

        cache_dir = DEFAULT_CACHE
    path = Path(cache_dir) / SECRET_FILE
    try:
        return _kept_secret(path)
    except OSError as err:
        log(f"[app] warning: cannot keep the history key in {str(path)!r} ({type(err).__name__}: {err}); "
            "browsers' history will not survive a restart (set --history-secret)")
        return secrets.token_urlsafe(24)


def _kept_secret(path: Path) -> str:
    """The key in ``path``; made atomically (a complete file, or none) if there is none yet."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(24) + "\n")
            try:
                os.link(scratch, path)  # fails if another process made it first: then its key is the key
            except FileExistsError:
                pass
        finally:
            scratch.unlink(missing_ok=True)
        text = path.read_text().strip()
    if not text:
        raise OSError(f"{path} is empty")
    return text
