"""serving/gradio_internals against the installed Gradio, on a small Blocks with no server: each private name the
module relies on still exists and still behaves as its function says, so a Gradio upgrade that changes one fails
here, in seconds, rather than only in the e2e tests."""

import re
from pathlib import Path

import gradio as gr
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sdxl_engine.serving import gradio_internals as gi


def small_demo():
    with gr.Blocks() as demo:
        text = gr.Textbox()
        out = gr.Textbox()
        button = gr.Button()

        def generate(prompt):
            yield prompt

        button.click(generate, text, out, api_name="generate")
        button.click(lambda x: x, text, out, api_visibility="private", queue=False)
        button.click(None, None, None, js="() => 1")  # a page script only: no server function
    return demo


def test_the_event_table_names_fn_index_api_name_visibility_and_queueing():
    demo = small_demo()
    fns = gi.event_fns(demo)
    assert [(f.public, f.queued) for f in fns] == [(True, True), (False, False)] and fns[0].api_name == "generate"
    generate = next(f for f in fns if f.api_name == "generate")
    assert gi.api_name_of(demo, generate.fn_index) == "generate" and gi.api_name_of(demo, 10_000) is None
    assert gi.fn_indices(demo, ("generate",)) == [generate.fn_index]
    assert len(fns) == 2  # the script-only event has no server function


def test_the_queue_and_its_tables():
    demo = small_demo()
    demo.queue(max_size=3)
    queue = gi.queue_of(demo)
    assert queue is not None and queue.max_size == 3
    assert gi.waiting(demo) == 0 and gi.queue_idle(demo)
    assert not gi.session_stream_known(demo, "nobody") and not gi.event_pending(demo, "no-event")
    queue.event_ids_to_events["e1"] = object()  # what Queue.push does for a queued call
    assert gi.event_pending(demo, "e1")
    queue.pending_messages_per_session["s1"] = object()
    queue.pending_event_ids_session["s1"] = {"e2"}
    assert gi.session_stream_known(demo, "s1") and gi.event_pending(demo, "e2")


def test_an_events_result_is_undelivered_until_its_stream_sends_it_or_its_client_leaves():
    """server.serve's drain waits for the accepted calls' results to reach their clients: Gradio's own Event, its
    tables as Queue.push fills them, and its clean_events (what a closed result stream runs)."""
    import asyncio

    from gradio.queueing import Event

    demo = small_demo()
    demo.queue()
    queue = gi.queue_of(demo)
    fn = demo.fns[gi.fn_indices(demo, ("generate",))[0]]
    events = [Event(session, fn, None, None) for session in ("s1", "s2")]
    for event in events:  # queued, as Queue.push leaves them
        queue.event_ids_to_events[event._id] = event
        queue.pending_event_ids_session.setdefault(event.session_hash, set()).add(event._id)
    accepted = gi.live_events(demo)
    assert accepted == events
    queue.active_jobs.append(accepted)  # running, then finished (their completions still in their streams' queues)
    queue.event_ids_to_events.clear()
    assert gi.undelivered(demo, accepted) == events
    queue.pending_event_ids_session["s1"].discard(events[0]._id)  # s1's stream wrote the completion
    assert gi.undelivered(demo, accepted) == [events[1]]
    assert gi.event_alive(demo, events[1]._id) and gi.event_alive(demo, "not-queued")
    asyncio.run(queue.clean_events(session_hash="s2"))  # s2's client left: its stream closed
    assert events[1].alive is False and gi.undelivered(demo, accepted) == []
    assert not gi.event_alive(demo, events[1]._id) and gi.event_alive(demo, events[0]._id)  # what the page watches


def test_temp_files_and_the_files_gradio_keeps():
    demo = small_demo()
    assert gi.temp_folder(demo) == Path(demo.GRADIO_CACHE).resolve()
    sets = gi.file_sets(demo)
    assert isinstance(sets, list) and all(isinstance(s, set) for s in sets)
    assert isinstance(gi.kept_files(demo), set)
    # The upload route records what it wrote in one live set, which is also one of the file sets: the guard
    # takes those paths out of what it serves (guard.app_files).
    uploads = gi.upload_files(demo)
    assert isinstance(uploads, set) and any(s is uploads for s in sets)


def test_a_session_copy_of_a_gallery_records_its_files_in_one_of_the_file_sets(tmp_path):
    """An event that returns an update for the gallery (the page's failure event: gr.update()) makes Gradio keep a
    copy of the gallery for that session, and the session's later images are recorded in the copy's set:
    file_sets lists it (the guard serves those images, the janitor sweeps them), and not another session's view of
    the gallery, which is the demo's own."""
    import asyncio

    from PIL import Image

    with gr.Blocks() as demo:
        gallery = gr.Gallery()
        text = gr.Textbox()
        button = gr.Button()
        button.click(lambda: gr.update(), None, gallery)
        button.click(lambda: [], None, gallery)
        button.click(lambda: gr.update(value="x"), None, text)  # a copy of a component without files: no set
    demo.state_holder.set_blocks(demo)
    png = tmp_path / "seed1.png"
    Image.new("RGB", (8, 6)).save(png)
    mine, other = demo.state_holder["mine"], demo.state_holder["other"]
    failed, shown, typed = demo.fns.values()
    asyncio.run(demo.postprocess_data(failed, gr.update(), mine))
    asyncio.run(demo.postprocess_data(typed, gr.update(value="x"), mine))
    before = len(gi.file_sets(demo))
    [value] = asyncio.run(demo.postprocess_data(shown, [(str(png), "seed 1")], mine))
    served = value[0]["image"]["path"]  # Gradio's copy of the PNG in its cache folder
    assert not any(served in s for s in demo.temp_file_sets)  # recorded in the session's copy only
    assert any(served in s for s in gi.file_sets(demo)) and len(gi.file_sets(demo)) == before == \
        len(demo.temp_file_sets) + 1
    assert other[gallery._id] is gallery and mine[gallery._id] is not gallery


def test_a_middleware_added_after_the_first_request_is_outermost():
    app = FastAPI()
    seen = []

    @app.get("/x")
    def x():
        seen.append("route")
        return {}

    class Outer:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        async def __call__(self, scope, receive, send):
            seen.append(self.name)
            await self.inner(scope, receive, send)

    client = TestClient(app)
    client.get("/x")  # builds Starlette's middleware stack, after which add_middleware alone is refused
    gi.add_outermost_middleware(app, Outer, name="outer")
    seen.clear()
    client.get("/x")
    assert seen == ["outer", "route"]


def test_outside_an_event_there_is_no_event_id():
    assert gi.current_event_id() is None


def _gradio_routes(demo) -> set[tuple[str, str]]:
    """(method, path template) of every route Gradio's own app serves for ``demo`` (included routers walked)."""
    from gradio.routes import App

    found = set()

    def walk(routes, prefix=""):
        for route in routes:
            inner = getattr(route, "original_router", None)  # FastAPI's included router
            if inner is not None:
                walk(inner.routes, prefix + route.include_context.prefix)
            elif hasattr(route, "path"):
                found.update((method, prefix + route.path) for method in (getattr(route, "methods", None) or ()))

    walk(App.create_app(demo).routes)
    return found


def test_the_routes_the_guard_reads_are_gradios_own():
    """Each pattern and path the guard reads matches a route Gradio serves (a template filled in), with and without
    /gradio_api; the unused routes it refuses still exist (a route Gradio renames would go unguarded)."""
    routes = _gradio_routes(small_demo())
    paths = {path for _, path in routes}

    def served(pattern, template, method):
        assert (method, template) in routes, (method, template)
        concrete = template.replace("{api_name}", "generate").replace("{event_id}", "e1")
        concrete = re.sub(r"\{[^}]*:path\}", "/tmp/x.png", concrete)
        assert pattern.match(concrete) and pattern.match(concrete.removeprefix("/gradio_api")), concrete

    served(gi.FILE_ROUTE, "/gradio_api/file={path_or_url:path}", "GET")
    served(gi.FILE_ROUTE, "/gradio_api/proxy={url_path:path}", "GET")
    served(gi.RESULT_STREAM, "/gradio_api/call/{api_name}/{event_id}", "GET")
    served(gi.RESULT_STREAM, "/gradio_api/call/v2/{api_name}/{event_id}", "GET")
    served(gi.QUEUE_DATA, "/gradio_api/queue/data", "GET")
    served(gi.QUEUE_JOIN, "/gradio_api/queue/join", "POST")
    for kind in ("call", "run", "api"):
        served(gi.API_CALL, f"/gradio_api/{kind}/{{api_name}}", "POST")
        served(gi.DIRECT_CALL, f"/gradio_api/{kind}/{{api_name}}", "POST")
    served(gi.DIRECT_CALL, "/gradio_api/call/v2/{api_name}", "POST")
    assert ("POST", gi.UPLOAD_PATH) in routes
    assert {p for p in paths if p.startswith(gi.UPLOAD_ROUTES)} == {"/gradio_api/upload", "/gradio_api/upload_progress"}
    for unused in (r for r in gi.UNUSED_ROUTES if r.startswith("/gradio_api")):
        assert any(path.startswith(unused) for path in paths), unused


def test_a_calls_body_and_a_streams_query_name_the_event_and_session_as_gradio_reads_them():
    from gradio.data_classes import PredictBody

    assert {"fn_index", "session_hash", "data", "event_data"} <= set(PredictBody.model_fields)
    body = PredictBody(data=["x"], fn_index=3, session_hash="s1").model_dump()
    assert gi.join_fields(body) == (3, "s1") and gi.join_fields({}) == (None, None)
    assert gi.stream_session("session_hash=s1&x=2") == "s1" and gi.stream_session("") == ""


def test_the_api_description_gives_each_endpoints_inputs_and_defaults_in_order():
    with gr.Blocks() as demo:
        prompt, steps, out = gr.Textbox(label="prompt"), gr.Slider(1, 50, value=8, label="steps"), gr.Textbox()
        def generate(prompt_text, num_steps):  # the parameters' names: the function's
            return prompt_text

        gr.Button().click(generate, [prompt, steps], out, api_name="generate")
        gr.Button().click(lambda p: p, prompt, out, api_visibility="private")
    assert gi.api_endpoints(demo) == {"generate": (("prompt_text", None), ("num_steps", 8))}


def test_the_upload_folder_and_the_share_server(tmp_path):
    import os

    assert Path(gi.upload_folder()).resolve() == Path(os.environ["GRADIO_TEMP_DIR"]).resolve()  # tests/conftest.py
    assert gi.share_server().startswith("https://")


def test_a_file_value_is_what_gradios_file_check_takes():
    """is_file_data accepts what Gradio's FileData check of a file input accepts (its meta required), nothing else."""
    from gradio.data_classes import FileData

    for value in (FileData(path="/tmp/x.png").model_dump(), {"path": "/tmp/x.png"}, {"junk": [1, 2]},
                  {"path": 3, "meta": {"_type": "gradio.FileData"}}, None, ["/tmp/x.png"]):
        try:
            FileData.model_validate(value, context={"validate_meta": True})
            taken = True
        except Exception:
            taken = False
        assert gi.is_file_data(value) == taken, value
