"""The page's pieces without a browser: styles, the /generate event over a real service, history, banner, --share."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.service.styles import NO_STYLE, apply_style
from tests.helpers import ROOT, page_generate

pytestmark = pytest.mark.engine


@pytest.mark.slow  # compiles another size bucket's program
def test_engine_reports_stages_in_order(engine):
    from sdxl_engine.engine.validation import GenerateRequest

    stages = []
    engine.generate(GenerateRequest("a red circle", seed=1, num_inference_steps=2), progress=stages.append)
    assert stages == ["preparing", "on device", "to host"]
    new_size = next(size for size in engine.limits.sizes if not engine.is_compiled(*size))
    stages.clear()
    engine.generate(GenerateRequest("a red circle", seed=1, num_inference_steps=2, width=new_size[0],
                                    height=new_size[1]), progress=stages.append)
    assert stages == ["compiling", "preparing", "on device", "to host"] and engine.is_compiled(*new_size)


def test_handler_applies_style_reports_progress_and_saves_pngs(engine, monkeypatch, tmp_path):
    """The handler's PNGs hold the engine's pixels for the styled request and A1111's infotext, checked as
    the whole text: the prompt line, ``Negative prompt: ...`` only when there is one, then
    ``Steps: n, Sampler: s, CFG scale: g, Seed: s, Size: WxH, Model hash: h, Model: m[, Style: name]``
    (AUTOMATIC1111's ``parameters`` chunk, modules/processing.py create_infotext: the fields it shares with A1111,
    in its order; the hash once the engine's background thread has it: waited for here)."""
    from sdxl_engine.engine.validation import GenerateRequest

    engine.catalogue.wait_hashes(60)
    model = f"Model hash: {engine.models_info()[0].hash}, Model: tiny-random"

    reports = []
    gallery, info, record = page_generate(
        engine, "a red circle", "green", 7, 5.0, 3, 0, 0, "Pixel art", outputs_dir=str(tmp_path / "out"),
        progress=lambda fraction, desc, unit=None: reports.append((fraction, desc)))
    # the place in line, when the event hears it before the job starts: not always, so not asserted
    reports = [(f, d) for f, d in reports if not d.startswith("Waiting for the request ahead")]
    steps = [(f, d.split(",")[0]) for f, d in reports if isinstance(f, tuple)]  # each denoising step
    assert steps == [((k, 3), f"Denoising: step {k}/3") for k in (1, 2, 3)]
    assert [d for f, d in reports if not isinstance(f, tuple)] == [
        "Preparing: tokenizing the prompts, scheduling 3 Euler steps",
        "On 4 × cpu: encoding the prompts, denoising 3 steps, decoding with the VAE",
        "Copying 4 images to the host", "Encoding PNGs"]
    assert [d for _, d in reports].index("Copying 4 images to the host") == 5  # the steps came while on device
    fractions = [f for f, _ in reports if not isinstance(f, tuple)]
    assert fractions == sorted(fractions)
    styled, styled_negative = apply_style("Pixel art", "a red circle", "green")
    assert info["prompt"] == styled == "pixel-art a red circle . low-res, blocky, pixel art style, 8-bit graphics"
    assert info["negative_prompt"] == styled_negative and styled_negative.startswith("green, sloppy")
    assert info["style"] == "Pixel art" and "user_prompt" not in info  # what the user typed goes to the history only
    assert (record["prompt"], record["negative_prompt"], record["style"]) == ("a red circle", "green", "Pixel art")
    assert [caption.split(" · ")[:2] for _, caption in gallery] == [[f"seed {s}", "Pixel art"] for s in (7, 8, 9, 10)]
    expected_pixels = engine.generate(GenerateRequest(styled, styled_negative, 7, 5.0, 3)).images
    assert len(info["saved"]) == 4
    for i, (name, seed, (shown, _)) in enumerate(zip(info["saved"], info["seeds"], gallery)):
        with Image.open(tmp_path / "out" / name) as saved, Image.open(shown) as image:
            np.testing.assert_array_equal(np.asarray(image.convert("RGB")), expected_pixels[i])
            np.testing.assert_array_equal(np.asarray(saved.convert("RGB")), expected_pixels[i])
            assert image.text["parameters"] == saved.text["parameters"] == (
                f"{styled}\nNegative prompt: {styled_negative}\n"
                f"Steps: 3, Sampler: Euler, CFG scale: 5, Seed: {seed}, Size: 64x64, {model}, Style: Pixel art")
    # No style, a negative prompt, another sampler: the user's own words, no Style field (a size other than
    # square: test_delivery_png_parameters.py, without compiling one here).
    gallery, info, _ = page_generate(engine, "a red circle", "blue", 7, 7.5, 2, 0, 0, sampler="DPM++ 2M")
    assert info["style"] == NO_STYLE and info["prompt"] == "a red circle" and info["negative_prompt"] == "blue"
    assert gallery[0][1].startswith("seed 7 · ") and gallery[0][1].count("·") == 1
    with Image.open(gallery[0][0]) as image:
        assert image.text["parameters"] == ("a red circle\nNegative prompt: blue\n"
                                            f"Steps: 2, Sampler: DPM++ 2M, CFG scale: 7.5, Seed: 7, Size: 64x64, "
                                            f"{model}")
    assert info["sampler"] == "DPM++ 2M"
    # No negative prompt: no "Negative prompt:" line at all (A1111 omits it).
    gallery, info, _ = page_generate(engine, "a red circle", "", 9, 0.0, 2, 0, 0)
    with Image.open(gallery[1][0]) as image:
        assert image.text["parameters"] == ("a red circle\n"
                                            f"Steps: 2, Sampler: Euler, CFG scale: 0, Seed: 10, Size: 64x64, {model}")


def test_gallery_files_are_named_after_seed_and_prompt(engine, tmp_path):
    """The name a download gets: the seed and the prompt's first words, not image.png."""

    gallery, info, _ = page_generate(engine, "A Red Circle, on a blue background!", "", 7, 5.0, 2, 0, 0, "Anime",
                                     files_dir=str(tmp_path))
    names = [Path(path).name for path, _ in gallery]
    assert names == [f"seed{s}-a-red-circle-on-a-blue.png" for s in (7, 8, 9, 10)]
    assert all(Path(path).is_relative_to(tmp_path) for path, _ in gallery)
    assert len({Path(path).parent for path, _ in gallery}) == 1  # one new folder per request
    gallery2, _, _ = page_generate(engine, "A Red Circle, on a blue background!", "", 7, 5.0, 2, 0, 0,
                                   files_dir=str(tmp_path))
    assert Path(gallery2[0][0]).parent != Path(gallery[0][0]).parent and Path(gallery[0][0]).exists()


def test_saved_pngs_never_overwrite_each_other(engine, monkeypatch, tmp_path):
    """Two requests, same seed, same instant (the clock and the random id frozen), different prompts:
    eight files, each still holding its own image."""
    import secrets
    import time


    out = tmp_path / "out"
    frozen = time.time_ns()
    monkeypatch.setattr(time, "time_ns", lambda: frozen)
    monkeypatch.setattr(time, "strftime", lambda fmt, t=None: "20250101-120000")
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: "abcdef")
    results = [page_generate(engine, prompt, "", 7, 5.0, 2, 0, 0, outputs_dir=str(out))
               for prompt in ("a red circle", "a blue square")]
    saved = [path for _, info, _ in results for path in info["saved"]]
    assert len(set(saved)) == 8 and sorted(saved) == sorted(p.name for p in out.iterdir())  # names, not paths
    for gallery, info, _ in results:
        for (shown, _), name, seed in zip(gallery, info["saved"], info["seeds"]):
            assert f"seed{seed}-" in name
            with Image.open(out / name) as a, Image.open(shown) as b:
                assert np.array_equal(np.asarray(a.convert("RGB")), np.asarray(b.convert("RGB")))
                assert a.text["parameters"].startswith(info["prompt"])
    assert "a-red-circle" in saved[0] and "a-blue-square" in saved[4]


def test_handler_turns_bad_input_into_gradio_errors(engine):
    import gradio as gr


    with pytest.raises(gr.Error, match="unknown style 'Baroque'"):
        page_generate(engine, "a red circle", "", 1, 7.0, 2, 0, 0, "Baroque")
    with pytest.raises(gr.Error, match="prompt: is empty"):
        page_generate(engine, "   ", "", 1, 7.0, 2, 0, 0, "Anime")


def test_history_keeps_small_records_newest_first_and_bounded(engine, tmp_path):
    from sdxl_engine.serving import history

    _, info, record = page_generate(engine, "a blue square", "", 100, 7.0, 2, 0, 0, "Anime")
    past = []
    for _ in range(history.LIMIT + 2):
        past = history.remember(past, record)
    assert len(past) == history.LIMIT
    assert (record["prompt"], record["style"], record["seeds"], record["width"]) == ("a blue square", "Anime",
                                                                                      [100, 101, 102, 103], 64)
    assert all(url.startswith("data:image/jpeg;base64,") and len(url) < 6000 for url in record["thumbs"])
    import base64
    import io

    with Image.open(io.BytesIO(base64.b64decode(record["thumbs"][2].split(",", 1)[1]))) as thumb:
        assert thumb.format == "JPEG" and thumb.size == (64, 64)  # the 64 px image itself (THUMB_PX is larger)
    assert history.entry(past, 6) == (past[1], 102)
    with pytest.raises(IndexError):
        history.entry(past, 4 * history.LIMIT)


def test_banner_and_sizes_while_starting_and_when_ready(engine):

    from sdxl_engine.engine.local import Engine
    from sdxl_engine.serving import page

    starting = Engine(engine.config, log=lambda *_: None)  # constructed, not started
    text, done = page.engine_banner(starting)
    assert not done and text.startswith("**Starting the engine: starting** — 0 s so far")
    assert page.size_choices(starting) == ([("model default", "0x0")], "0x0")
    starting.error = RuntimeError("no such model")  # what Engine.start records when a stage raises
    starting.ready.set()
    assert page.engine_banner(starting) == ("**The engine failed to start:** no such model", True)
    text, done = page.engine_banner(engine)
    assert done and text.startswith("Ready on **4 × cpu** — model `tiny-random` (float32), started in")

    class Refined:  # the same engine, started with a refiner (a folder: named by its own name)
        config = dataclasses.replace(engine.config, refiner=str(ROOT / "tests" / "fixtures" / "tiny-pt-refiner"))

        def __getattr__(self, name):
            return getattr(engine, name)

    text, done = page.engine_banner(Refined())
    assert text.startswith("Ready on **4 × cpu** — model `tiny-random` (float32) + refiner `tiny-pt-refiner`, started")
    choices, value = page.size_choices(engine)
    assert value == "64x64" and choices[0] == ("64 × 64 (square, default)", "64x64")
    assert [tuple(map(int, v.split("x"))) for _, v in choices] == list(engine.limits.sizes)  # as PARSE_SIZE_JS


def test_share_without_internet_logs_one_line(monkeypatch, runtime_log):
    from gradio.networking import GRADIO_API_SERVER

    from sdxl_engine.serving import cli

    monkeypatch.delenv("GRADIO_SHARE_SERVER_ADDRESS", raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # a closed port: no way out
    assert cli.share_possible("http://127.0.0.1:7860/", GRADIO_API_SERVER, timeout=5) is False
    lines = runtime_log
    assert len(lines) == 1 and lines[0].startswith("[app] --share: no public link (cannot reach api.gradio.app")
    assert lines[0].endswith("serving locally only at http://127.0.0.1:7860/")


def test_history_key_is_made_once_and_kept_across_processes(tmp_path, monkeypatch):
    """Without a setting the key is made once, 0600, in the cache folder, and every later process
    reads the same one (so a restart keeps the browsers' history); a setting wins."""
    import os
    import subprocess
    import sys

    from sdxl_engine.serving import history

    monkeypatch.delenv(history.SECRET_ENV, raising=False)
    code = "import sys; from sdxl_engine.serving import history; print(history.browser_secret(cache_dir=sys.argv[1]))"
    env = {k: v for k, v in os.environ.items() if k != history.SECRET_ENV}
    keys = [subprocess.run([sys.executable, "-c", code, str(tmp_path / "cache")], cwd=ROOT,
                           env=env, capture_output=True, text=True, check=True).stdout.strip() for _ in range(2)]
    kept = tmp_path / "cache" / history.SECRET_FILE
    assert keys[0] == keys[1] == kept.read_text().strip() and len(keys[0]) >= 32
    assert kept.stat().st_mode & 0o777 == 0o600
    assert history.browser_secret("from-the-flag", tmp_path / "cache") == "from-the-flag"
    monkeypatch.setenv(history.SECRET_ENV, "from-the-env")
    assert history.browser_secret(None, tmp_path / "cache") == "from-the-env"
    assert history.browser_secret("from-the-flag", tmp_path / "cache") == "from-the-flag"


def test_unusable_history_key_file_is_one_warning(tmp_path, monkeypatch):
    from sdxl_engine.serving import history

    monkeypatch.delenv(history.SECRET_ENV, raising=False)
    (tmp_path / "a-file").write_text("")
    lines = []
    first = history.browser_secret(None, tmp_path / "a-file", log=lines.append)  # the cache folder is a file
    assert len(lines) == 1 and "will not survive a restart" in lines[0] and len(first) >= 32
    assert history.browser_secret(None, tmp_path / "a-file", log=lines.append) != first  # this process only


def test_page_encrypts_the_history_with_the_kept_key(engine, monkeypatch):
    import app
    from sdxl_engine.serving import history

    monkeypatch.delenv(history.SECRET_ENV, raising=False)
    kept = history.browser_secret()  # the cache folder's key (XDG_CACHE_HOME: the tests' own folder)
    for secret, expected in ((None, kept), ("set-by-flag", "set-by-flag")):
        demo = app.build_demo(lambda *a, **k: None, engine.config, engine, history_secret=secret)
        states = [c for c in demo.config["components"] if c["type"] == "browserstate"]
        assert [(c["props"]["storage_key"], c["props"]["secret"]) for c in states] == [(app.HISTORY_KEY, expected)]


def test_pending_records_are_bounded_per_session_too():
    """An API client's session never runs the page's follow-up event: it keeps only its newest
    records (the browser's history limit), not one per call for as long as it lives."""
    from sdxl_engine.serving import history

    pending = history.Pending(max_sessions=10)
    for i in range(history.LIMIT + 5):
        pending.put("api-client", {"n": i})
    pending.put("browser", {"n": "mine"})
    taken = [pending.pop("api-client") for _ in range(history.LIMIT + 1)]
    assert [r["n"] for r in taken[:-1]] == list(range(5, history.LIMIT + 5)) and taken[-1] is None
    assert pending.pop("browser") == {"n": "mine"}
