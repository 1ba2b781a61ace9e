"""Settings that misled a new user.

An outputs folder that cannot take the images stops the start; one that fails later says so in
the reply. Limits that make a request's images equal, or that a default the user never set
exceeds, are refused at start naming where the value came from. The saved files' names, the
unknown-word warning, the start log and ``--help`` say what actually happens.
"""

import logging
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.config import ConfigError, EngineConfig
from sdxl_engine.engine.validation import GenerateRequest

# ---- fault 2: an outputs folder that cannot take the images -----------------------------------


def test_a_missing_outputs_dir_is_created_at_start(tmp_path):
    from sdxl_engine.serving.cli import check_outputs_dir

    check_outputs_dir(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []  # no probe left
    check_outputs_dir("")  # off: nothing to check
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def fake_result(n: int = 4, warnings=()) -> SimpleNamespace:
    """What engine.generate returns, for deliver: n 16x16 images, each a different grey."""
    images = np.stack([np.full((16, 16, 3), 40 * i, np.uint8) for i in range(n)])
    request = GenerateRequest("a red circle", "", 7, 5.0, 3, 16, 16, "Euler")
    return SimpleNamespace(images=images, seeds=[7 + i for i in range(n)], request=request, model="tiny-shapes",
                           timings={"queue": 0.0, "prep": 0.01, "device": 0.1, "post": 0.01, "latency": 0.12},
                           warnings=list(warnings), device_count=4, device_summary="4 × cpu")


def test_saved_names_are_relative_to_the_outputs_folder(tmp_path):
    """info["saved"] names the files inside the outputs folder; the server's path shows nowhere."""
    from sdxl_engine.service.delivery import deliver
    from sdxl_engine.serving import page

    out = tmp_path / "server-secret" / "outputs"
    delivered = deliver(fake_result(), "a red circle", "(No style)", tmp_path / "served", str(out))
    assert delivered.save_error is None and delivered.info["warnings"] == []
    assert sorted(delivered.info["saved"]) == sorted(p.name for p in out.iterdir())
    for name, seed, shown in zip(delivered.info["saved"], delivered.info["seeds"], delivered.paths):
        assert "/" not in name and re.fullmatch(rf"\d{{8}}-\d{{6}}\.\d{{6}}-[0-9a-f]+-seed{seed}-a-red-circle\.png",
                                                name), name
        with Image.open(out / name) as saved, Image.open(shown) as image:
            assert np.array_equal(np.asarray(saved), np.asarray(image))
    line = page.status_line(delivered.info)
    assert line.endswith(" · saved to the server's outputs folder") and "server-secret" not in line


@pytest.mark.parametrize("break_it, reason", [
    ("replace the folder with a file", "FileExistsError: File exists"),
    ("put the folder under a file", "NotADirectoryError: Not a directory"),
])
def test_saving_that_fails_after_the_start_is_a_warning_in_the_reply(tmp_path, break_it, reason):
    """The outputs folder passed the start-up check, then went bad: the images are still served,
    the reply's warnings say they were not saved (API clients read info["warnings"]), and no path
    of the server's is in it."""
    from sdxl_engine.service.delivery import deliver
    from sdxl_engine.serving.cli import check_outputs_dir

    out = tmp_path / "outputs"
    check_outputs_dir(str(out))
    if break_it == "replace the folder with a file":
        out.rmdir()
        out.write_text("")
        folder = out
    else:
        (tmp_path / "disk").write_text("")
        folder = tmp_path / "disk" / "outputs"
    delivered = deliver(fake_result(warnings=["a model warning"]), "a red circle", "(No style)", tmp_path / "served",
                        str(folder))
    assert isinstance(delivered.save_error, OSError) and "saved" not in delivered.info
    expected = f"images not saved to the server's outputs folder ({reason}); download them instead"
    assert delivered.info["warnings"] == ["a model warning", expected] and delivered.save_warning == expected
    assert all(os.path.isfile(path) for path in delivered.paths) and len(delivered.paths) == 4


def test_a_save_that_stops_halfway_says_how_many_were_not_saved(tmp_path, monkeypatch):
    """The disk fills after two of four files: the two saved are listed, the warning counts the rest."""
    import errno

    from sdxl_engine.service import delivery

    real, calls, out = delivery.write_new, [], tmp_path / "outputs"

    def fills_up(data, folder, stem):  # the outputs disk only; Gradio's temp folder still takes the served copies
        if folder == out:
            calls.append(stem)
            if len(calls) > 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
        return real(data, folder, stem)

    monkeypatch.setattr(delivery, "write_new", fills_up)
    delivered = delivery.deliver(fake_result(), "a red circle", "(No style)", tmp_path / "served", str(out))
    assert sorted(delivered.info["saved"]) == sorted(p.name for p in out.iterdir()) \
        and len(delivered.info["saved"]) == 2
    assert delivered.info["warnings"] == ["2 of 4 images not saved to the server's outputs folder (OSError: No space "
                                          "left on device); download them instead"]


def test_the_page_handler_reply_carries_the_save_warning(tmp_path):
    """The page's event with a service whose outputs folder went bad: gallery served, warning in info."""
    from tests.helpers import StepEngine, page_generate

    (tmp_path / "disk").write_text("")
    engine = StepEngine()
    engine.batch = 4
    engine.go(1000)
    with pytest.warns(UserWarning, match="not saved to the server's outputs folder"):  # gr.Warning outside a request
        gallery, info, _ = page_generate(engine, "a red circle", "", 7, 5.0, 3, 48, 32,
                                         outputs_dir=str(tmp_path / "disk" / "outputs"),
                                         files_dir=str(tmp_path / "served"))
    assert len(gallery) == 4 and "saved" not in info
    assert info["warnings"] == ["images not saved to the server's outputs folder (NotADirectoryError: Not a "
                                "directory); download them instead"]


# ---- 10b: a seed range too small for one request's images ------------------------------------
def test_a_max_seed_that_would_repeat_images_is_refused():
    from sdxl_engine.config import check_seed_range

    with pytest.raises(ConfigError, match=re.escape("max_seed (0) leaves 1 distinct seed for the 4 images of a "
                                                    "request, so some would be identical: set max_seed to 3 or more")):
        EngineConfig.load({"max_seed": 0, "images_per_request": 4}, environ={})
    with pytest.raises(ConfigError, match=re.escape("max_seed (6) leaves 7 distinct seeds for the 8 images")):
        check_seed_range(6, 8)
    check_seed_range(3, 4)  # seeds 3, 0, 1, 2: all distinct
    assert EngineConfig.load({"max_seed": 3, "images_per_request": 4}, environ={}).max_seed == 3


def test_seeds_of_one_request_are_distinct_whenever_the_range_allows():
    """The engine's rule, image i uses (seed + i) % (max_seed + 1), against check_seed_range, for
    every small range and batch: a refused setting is exactly one that repeats a seed."""
    from sdxl_engine.config import check_seed_range

    for max_seed in range(0, 9):
        for images in range(1, 12):
            repeats = any(len({(seed + i) % (max_seed + 1) for i in range(images)}) < images
                          for seed in range(max_seed + 1))
            try:
                check_seed_range(max_seed, images)
                refused = False
            except ConfigError:
                refused = True
            assert refused == repeats, (max_seed, images)


# ---- 10c: a step limit checked against the steps actually used -------------------------------
def test_the_step_limit_is_checked_against_the_model_default():
    from sdxl_engine.checkpoint.loading import engine_defaults
    from sdxl_engine.config import resolve_defaults

    shipped = engine_defaults("tiny-shapes")
    assert shipped["num_inference_steps"] == 8

    def resolved(**settings) -> EngineConfig:
        return resolve_defaults(EngineConfig.load(settings, environ={}), shipped, "tiny-shapes")

    assert resolved(max_inference_steps=10).num_inference_steps == 8  # 20 (the class default) is not what runs
    assert resolved(max_inference_steps=5, num_inference_steps=4).num_inference_steps == 4  # 8 is hidden: not compared
    with pytest.raises(ConfigError, match=re.escape(
            "num_inference_steps (8, not set, so the default of model 'tiny-shapes', from its engine_defaults.json) "
            "exceeds max_inference_steps (5): set num_inference_steps to 5 or less, or raise max_inference_steps")):
        resolved(max_inference_steps=5)
    with pytest.raises(ConfigError, match=re.escape(
            "num_inference_steps (20, not set, so the engine's default, as model 'tiny-random' chooses none) exceeds "
            "max_inference_steps (5)")):
        resolve_defaults(EngineConfig.load({"max_inference_steps": 5}, environ={}), {}, "tiny-random")
    with pytest.raises(ConfigError, match=re.escape("num_inference_steps (20) exceeds max_inference_steps (5)")):
        EngineConfig.load({"num_inference_steps": 20, "max_inference_steps": 5}, environ={})  # set: refused at once


def test_help_shows_the_defaults_the_default_model_runs(capsys):
    from sdxl_engine.serving.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("engine setting num_inference_steps (env SDXL_NUM_INFERENCE_STEPS, default: the model's own, else 20; "
            "tiny-shapes runs 8)") in text
    assert "(env SDXL_GUIDANCE_SCALE, default: the model's own, else 5.0; tiny-shapes runs 5.0)" in text
    assert "(env SDXL_MAX_INFERENCE_STEPS, default 50)" in text
    assert "(env SDXL_WIDTH, default: the model's own, else 0; tiny-shapes runs its native size)" in text  # not "0"


# ---- 10a: what the unknown-word warning says ------------------------------------------------
def test_unknown_words_are_whole_visible_words():
    from sdxl_engine.checkpoint.builtin import TINY_SHAPES_DIR, unknown_words
    from sdxl_engine.engine.validation import clean_text

    known = frozenset((TINY_SHAPES_DIR / "vocabulary.txt").read_text().split())
    cases = {"a 👍🏽\u200d dog": ["👍🏽", "dog"],  # skin tone kept on its emoji; the trailing joiner is no word
             "a red circle 👨\u200d👩\u200d👧 ❤️ 🇫🇷": ["👨\u200d👩\u200d👧", "❤️", "🇫🇷"],
             "a \u200d red \ufe0f circle \u0301": [],  # invisible alone: nothing to name
             "a Cafe\u0301, DOG!": ["café", "dog"]}
    for text, expected in cases.items():
        assert unknown_words(clean_text("prompt", text, required=True), known) == expected, text
        assert unknown_words(text, known) == expected, text  # the same before validation's cleaning


def test_unknown_words_are_spelled_as_tokens_so_they_change_the_embedding():
    """Why the warning says they change the images: the tokenizer does not drop them, it adds
    tokens between the known words' (byte tokens for the emoji)."""
    from transformers import CLIPTokenizer

    from sdxl_engine.checkpoint.builtin import TINY_SHAPES_DIR, bytes_to_unicode

    tok = CLIPTokenizer.from_pretrained(str(TINY_SHAPES_DIR / "tokenizer"))
    emoji = [bytes_to_unicode()[b] for b in "👍🏽".encode()]  # CLIP's printable stand-in of each UTF-8 byte
    assert tok.convert_ids_to_tokens(tok("a red dog circle 👍🏽").input_ids) == [
        "<|startoftext|>", "a</w>", "red</w>", "dog</w>", "circle</w>", *emoji[:-1], emoji[-1] + "</w>",
        "<|endoftext|>"]
    assert tok.convert_ids_to_tokens(tok("a red circle").input_ids) == [
        "<|startoftext|>", "a</w>", "red</w>", "circle</w>", "<|endoftext|>"]




# ---- 10g: Ray mode's log ---------------------------------------------------------------------
def test_ray_environment_asks_for_a_plain_quiet_log():
    """No colour codes in replica lines, no WARNING for the token mode the app chose, no
    "taken more than 30s to initialize" for a replica that is compiling."""
    from sdxl_engine.serving.scaleout import REQUEST_TIMEOUT_S, ray_environment

    private: dict = {}
    ray_environment(private=True, environ=private)
    assert (private["RAY_COLOR_PREFIX"], private["RAY_AUTH_MODE"]) == ("0", "token")
    assert len(private["RAY_AUTH_TOKEN"]) == 64
    assert private["RAY_SERVE_SLOW_STARTUP_WARNING_S"] == str(int(REQUEST_TIMEOUT_S))
    joined: dict = {}
    ray_environment(private=False, environ=joined)  # a cluster of someone else's: its auth is theirs
    assert joined == {"RAY_DEDUP_LOGS": "0", "RAY_COLOR_PREFIX": "0",
                      "RAY_SERVE_SLOW_STARTUP_WARNING_S": str(int(REQUEST_TIMEOUT_S))}
    own = {"RAY_AUTH_TOKEN_PATH": "/etc/ray-token", "RAY_COLOR_PREFIX": "1"}
    ray_environment(private=True, environ=own)  # what the operator set stays
    assert "RAY_AUTH_MODE" not in own and own["RAY_COLOR_PREFIX"] == "1"


def test_a_lost_replica_is_logged_as_a_failed_request_not_a_refused_one(caplog):
    from sdxl_engine.engine.errors import GenerationError
    from sdxl_engine.engine.validation import InvalidRequest
    from sdxl_engine.serving import handler

    caplog.set_level(logging.INFO, logger="sdxl_engine")
    handler.refuse(GenerationError("the replica running this request stopped (ActorDiedError); nothing came back"))
    handler.refuse(InvalidRequest("seed", "must be between -1 and 5"))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [  # a failure is an error, a refusal is not
        ("ERROR", "[app] request failed: the replica running this request stopped (ActorDiedError); nothing came back"),
        ("INFO", "[app] request refused: seed: must be between -1 and 5")]
