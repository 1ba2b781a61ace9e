"""Served overhead of each protocol against ``/generate``, in one run on one app.

``python -m tools.bench_apis [--runs 10] [--steps 8] [--size 64]`` starts ``python app.py`` (tiny-shapes, loopback)
and times, interleaved so a noisy neighbour slows them alike, one request of 4 images at size x size from
each client as a user runs it:

- ``/generate`` through gradio_client (``Client.predict``: the page's API, the baseline), and through Gradio's
  documented call API with httpx (``POST /gradio_api/call/generate``, its result stream read to ``complete``):
  the server's side of the same call, without gradio_client's own work (its threads, its file downloads);
- AUTOMATIC1111's ``POST /sdapi/v1/txt2img`` (raw httpx, and through ``webuiapi``, which also decodes the PNGs);
- OpenAI's ``POST /v1/images/generations`` through the ``openai`` client, ``b64_json``;
- the MCP ``generate`` tool through the ``mcp`` SDK (one session, streamable HTTP);
- the jobs API: ``POST /v1/jobs``, its event stream followed to ``succeeded`` (which carries the images), raw httpx
  (only on an app that has it: a ``--before`` checkout without it skips it).

Prints a Markdown table (median, min, max, the median's difference from ``/generate`` and the median of served
minus engine time: the call's wall time less the engine's ``latency_s`` its answer reports; OpenAI's answer has none,
so its calls are set against the median engine time of the other calls of the same round) and writes ``--json``.
Each protocol runs the same ``/generate`` event (serving/apis/core.py), so the difference
is the protocol's own work: parsing, the base64 of the PNGs, and for MCP Gradio's loopback client.

``--before DIR [--before-python PY]`` also starts the app of another checkout (``git worktree add DIR REV``) and
sends every call to both apps in the same round, in alternating order, so the two revisions see the same load;
the table then gives each client's median on both and the median of the paired differences (after - before).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a red circle"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(port: int, timeout: float = 600, root: Path = ROOT, python: str = sys.executable) -> subprocess.Popen:
    """``python app.py --port PORT`` of the checkout ``root`` until it logs that the engine is ready."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([python, str(root / "app.py"), "--port", str(port)], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if "[sdxl_engine] ready" in line:
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("the app did not become ready")


def clients(url: str, steps: int, session, size: int = 64) -> dict:
    """{name: a call making 4 images of PROMPT} for each protocol (the MCP one a coroutine function, on ``session``);
    each returns the engine's seconds its answer reports (``latency_s``), or None (OpenAI's has none)."""
    import httpx
    import webuiapi
    from gradio_client import Client
    from openai import OpenAI

    gradio = Client(url, verbose=False)
    http = httpx.Client(timeout=300)
    webui = webuiapi.WebUIApi(baseurl=url + "sdapi/v1")
    openai = OpenAI(base_url=url + "v1", api_key="unused")
    body = {"prompt": PROMPT, "seed": 1, "steps": steps, "width": size, "height": size, "batch_size": 4}

    async def mcp_call():
        result = await session.call_tool("generate", {
            "prompt": PROMPT, "seed": 1, "num_inference_steps": steps, "width": size, "height": size})
        assert not result.isError and sum(c.type == "image" for c in result.content) == 4
        texts = [c.text for c in result.content if c.type == "text" and "latency_s" in c.text]
        return json.loads(texts[0])["latency_s"] if texts else None

    def a1111_call():
        response = http.post(url + "sdapi/v1/txt2img", json=body)
        response.raise_for_status()
        return json.loads(response.json()["info"])["latency_s"]

    def openai_call():
        openai.images.generate(prompt=PROMPT, n=4, size=f"{size}x{size}", response_format="b64_json")

    def gradio_call():
        posted = http.post(url + "gradio_api/call/generate", json={"data": [PROMPT, "", 1, 5.0, steps, size, size,
                                                                             "(No style)", "Euler", 1.0]})
        posted.raise_for_status()
        with http.stream("GET", url + f"gradio_api/call/generate/{posted.json()['event_id']}") as stream:
            last = [line for line in stream.iter_lines() if line.startswith("data:")][-1]
        return json.loads(last[len("data:"):])[1]["latency_s"]

    def jobs_call():
        job = http.post(url + "v1/jobs", json={"prompt": PROMPT, "seed": 1, "num_inference_steps": steps,
                                               "width": size, "height": size})
        job.raise_for_status()
        with http.stream("GET", url + f"v1/jobs/{job.json()['id']}/events") as stream:
            last = [line for line in stream.iter_lines() if line.startswith("data: ")][-1]
        done = json.loads(last[len("data: "):])
        assert done["status"] == "succeeded" and len(done["images"]) == 4
        return done["info"]["latency_s"]

    has_jobs = http.get(url + "v1/jobs").status_code == 200
    return {
        "/generate (gradio_client)": lambda: gradio.predict(api_name="/generate", prompt=PROMPT, seed=1,
                                                            num_inference_steps=steps, width=size,
                                                            height=size)[1]["latency_s"],
        "/generate (Gradio's call API, httpx)": gradio_call,
        "A1111 txt2img (httpx)": a1111_call,
        "A1111 txt2img (webuiapi)": lambda: webui.txt2img(**body).info["latency_s"],
        "OpenAI images.generate (openai, b64_json)": openai_call,
        "MCP generate (mcp SDK)": mcp_call,
        **({"jobs API (httpx, events)": jobs_call} if has_jobs else {}),
    }


async def measure(urls: list[str], steps: int, runs: int, size: int = 64) -> list[dict]:
    """Seconds per call on each app of ``urls``: one warm-up each, then ``runs`` rounds with the calls
    interleaved (with two apps each call goes to both in the round, first to one, then the other, alternating);
    with each call's served minus engine seconds (``overhead_s``, see the module docstring)."""
    from contextlib import AsyncExitStack

    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with AsyncExitStack() as stack:
        apps = []
        for url in urls:
            read, write, _ = await stack.enter_async_context(streamable_http_client(url + "gradio_api/mcp/"))
            session = await stack.enter_async_context(ClientSession(read, write))
            await session.initialize()
            apps.append(clients(url, steps, session, size))

        async def timed(call) -> tuple[float, float | None]:
            t0 = time.perf_counter()
            engine_s = await (call() if asyncio.iscoroutinefunction(call) else asyncio.to_thread(call))
            return time.perf_counter() - t0, engine_s

        for calls in apps:
            for name, call in calls.items():
                print(f"warm-up: {name} {(await timed(call))[0]:.2f} s", file=sys.stderr, flush=True)
        samples = [{name: [] for name in calls} for calls in apps]
        overheads = [{name: [] for name in calls} for calls in apps]
        for round_ in range(runs):
            engine_s = [{} for _ in apps]
            for name in apps[-1]:
                order = range(len(apps)) if round_ % 2 == 0 else reversed(range(len(apps)))
                for i in order:
                    if name not in apps[i]:  # a client the other checkout lacks
                        continue
                    wall, engine_s[i][name] = await timed(apps[i][name])
                    samples[i][name].append(wall)
            print(f"round {round_ + 1}/{runs}: " + ", ".join(f"{name.split(' (')[0]} {samples[-1][name][-1]:.2f} s"
                                                       for name in apps[-1]), file=sys.stderr, flush=True)
            for i in range(len(apps)):
                reported = [e for e in engine_s[i].values() if e is not None]
                for name, e in engine_s[i].items():
                    overheads[i][name].append(samples[i][name][-1] - (statistics.median(reported) if e is None
                                                                       else e))
    return [{name: {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s), "runs": len(s),
                    "samples_s": s, "overhead_median_s": statistics.median(overheads[i][name]),
                    "overhead_s": overheads[i][name]}
             for name, s in app_samples.items()} for i, app_samples in enumerate(samples)]


def markdown(results: dict, steps: int, size: int = 64) -> str:
    base = results["/generate (gradio_client)"]["median_s"]
    lines = [f"| client, 4 images {size}x{size}, {steps} steps | median s | min s | max s | vs /generate | "
             "served - engine, median s |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} | "
                     f"{r['median_s'] - base:+.3f} s | {r['overhead_median_s']:.3f} |")
    return "\n".join(lines)


def markdown_compare(before: dict, after: dict, steps: int, size: int = 64) -> str:
    """Each client's median before and after, and the median of the paired (same round) differences."""
    lines = [f"| client, 4 images {size}x{size}, {steps} steps | before median s | after median s | "
             "after - before, paired median s | served - engine before, median s | after |",
             "|---|---|---|---|---|---|"]
    for name in after:
        if name not in before:
            lines.append(f"| {name} | (none) | {after[name]['median_s']:.3f} | | | "
                         f"{after[name]['overhead_median_s']:.3f} |")
            continue
        paired = [a - b for a, b in zip(after[name]["samples_s"], before[name]["samples_s"])]
        lines.append(f"| {name} | {before[name]['median_s']:.3f} | {after[name]['median_s']:.3f} | "
                     f"{statistics.median(paired):+.3f} | {before[name]['overhead_median_s']:.3f} | "
                     f"{after[name]['overhead_median_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=64, help="width and height of the images (tiny-shapes: 64)")
    parser.add_argument("--before", type=Path, help="another checkout, timed side by side with this one")
    parser.add_argument("--before-python", default=sys.executable, help="the interpreter that runs --before")
    parser.add_argument("--json", default=str(ROOT / "docs" / "benchmarks" / "bench_apis.json"))
    args = parser.parse_args(argv)
    apps, urls = [], []
    try:
        for root, python in ([(args.before.resolve(), args.before_python)] if args.before else []) + \
                [(ROOT, sys.executable)]:
            port = _free_port()
            apps.append(start_app(port, root=root, python=python))
            urls.append(f"http://127.0.0.1:{port}/")
        results = asyncio.run(measure(urls, args.steps, args.runs, args.size))
    finally:
        for app in apps:
            app.terminate()
            app.wait(60)
    if args.before:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "size": args.size, "before": str(args.before),
                                               "results_before": results[0], "results": results[1]}, indent=1))
        print(markdown_compare(results[0], results[1], args.steps, args.size))
    else:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "size": args.size, "results": results[0]},
                                              indent=1))
        print(markdown(results[0], args.steps, args.size))


if __name__ == "__main__":
    main()
