"""A request's life on the page, for each of its request events (/generate, Generate from image, Upscale): the
gallery brought into view, the Stop button shown while one of this page's requests runs, the status line under
the gallery after it, and Stop: the request cancelled, the page saying where it stopped with the last finished
result shown again. All private events; the functions behind them are page.py's (status_line, stopped_view), the
scripts page_assets.py's."""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from sdxl_engine.serving.page import page_event, status_line, stopped_view
from sdxl_engine.serving.page_assets import (
    NEW_REQUEST_JS,
    REQUEST_ENDS_JS,
    REQUEST_STARTS_JS,
    SCROLL_TO_GALLERY_JS,
    STOP_STEP_JS,
)


def wire_starts(starts: list, status: gr.Markdown, heard: gr.Textbox) -> None:
    """In the browser, as a request starts (``starts``: the triggers of the request events, e.g. ``run.click``):
    on a narrow screen the gallery scrolled into view for the progress, the Stop button shown, and a Stop's line
    (``status``; ``heard``: where the Stop found its request, STOP_STEP_JS) taken away: it described the stopped
    request (a finished one's line stays)."""
    gr.on(starts, None, None, None, js=SCROLL_TO_GALLERY_JS, queue=False, api_visibility="private")
    gr.on(starts, None, None, None, js=REQUEST_STARTS_JS, queue=False, api_visibility="private")
    gr.on(starts, None, status, [status, heard], js=NEW_REQUEST_JS, queue=False, api_visibility="private")


def wire_outcomes(events: tuple, stop: gr.Button, gallery: gr.Gallery, info: gr.JSON, status: gr.Markdown,
                  heard: gr.Textbox, last_result: gr.State, stop_left: Callable[[str, gr.Request], None]) -> None:
    """After each of ``events``: on success the ``status`` line (page.status_line of ``info``) and the gallery in
    view again; ``stop`` cancels them all. Stop cancels this browser's request: Gradio cancels the event's task,
    which stops its job in the service (handler.follow: out of the line if it waits, after the running step if it
    runs). Nothing else: another browser's request runs on.

    The page then says where it stopped and shows the last finished result (``last_result``) again in ``gallery``
    and ``info``, not the half-made preview (page.stopped_view). The step is read in the browser as the Stop is
    clicked (into ``heard``); the rest runs as the cancelled event's failure, which Gradio's page sends once the
    cancel is through: previews still on their way before that would otherwise land on the restored gallery.
    Then too ``stop_left`` (handler.PageJobs.stop_left, given ``heard``) stops this session's job should it still
    run: the Stop reaches the engine whether or not Gradio's cancel reached the event's function."""
    for done in events:
        done.success(page_event(status_line), info, status, api_visibility="private")
    stop.click(None, None, heard, js=STOP_STEP_JS, cancels=list(events), api_visibility="private", queue=False)
    for done in events:
        done.failure(page_event(stopped_view), [last_result, heard], [gallery, info, status],
                     api_visibility="private", queue=False, show_progress="hidden")
        done.failure(stop_left, heard, None, api_visibility="private", queue=False, show_progress="hidden")
        done.success(None, None, None, js=SCROLL_TO_GALLERY_JS, queue=False, api_visibility="private")
        # After success, error or Stop alike: Stop hides once none of this page's requests is left. One of
        # success and failure runs per request (Gradio's page runs no .then() after an error).
        for outcome in (done.success, done.failure):
            outcome(None, None, None, js=REQUEST_ENDS_JS, queue=False, api_visibility="private")
