"""``python app.py --lora ... --lora-dir ...``: a LoRA the server cannot use stops the start with one line (#21)."""

import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.helpers import FIXTURES, ROOT, free_port

KOHYA = FIXTURES / "tiny-pt-lora" / "kohya.safetensors"


def test_bad_loras_exit_1_with_one_line_before_serving(tmp_path):
    rng = np.random.default_rng(0)
    sd15 = tmp_path / "sd15.safetensors"  # SD 1.x cross-attention reads 768-wide text
    save_file({"lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k.lora_down.weight":
               rng.normal(size=(4, 768)).astype(np.float32),
               "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k.lora_up.weight":
               rng.normal(size=(32, 4)).astype(np.float32)}, str(sd15))
    folder = tmp_path / "loras"
    folder.mkdir()
    (folder / "ink.safetensors").write_bytes(KOHYA.read_bytes())
    (tmp_path / "evil.ckpt").write_bytes(b"never opened")
    cases = {
        "twice": (["--lora", f"ink={KOHYA}", "--lora-dir", str(folder)], "two LoRAs named 'ink'"),
        "pickle": (["--lora", f"evil={tmp_path / 'evil.ckpt'}"], "a pickle (.ckpt); LoRA pickles are never opened"),
        "sd15": (["--lora", f"old={sd15}"], "It looks like an SD 1.x LoRA (cross-attention width 768; SDXL's is 2048)"),
    }
    procs = {name: subprocess.Popen(
        [sys.executable, str(ROOT / "app.py"), "--port", str(free_port()), "--model", str(FIXTURES / "tiny-pt"),
         "--executable-cache", "off", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={"GRADIO_ANALYTICS_ENABLED": "False", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        for name, (args, _) in cases.items()}
    for name, (_, expected) in cases.items():
        out, err = procs[name].communicate(timeout=300)
        assert procs[name].returncode == 1, (name, out[-2000:], err[-2000:])
        errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "the engine failed to start: LoraError" in errors[0] and expected in errors[0], errors
        assert "Traceback" not in out + err


def test_served_app_applies_a_tag_and_records_its_hash(tmp_path):
    """``python app.py --model DIR --lora-dir loras/``: ``<lora:ink:0.7>`` changes the images, the PNGs keep
    the tag and carry ``Lora hashes``, no compile after the first use, and an unknown name is one clear error."""
    from gradio_client.exceptions import AppError
    from PIL import Image

    from sdxl_engine.checkpoint.lora import lora_hash
    from tests.helpers import RunningApp

    folder = tmp_path / "loras"
    folder.mkdir()
    (folder / "ink.safetensors").write_bytes(KOHYA.read_bytes())
    app = RunningApp("--model", str(FIXTURES / "tiny-pt"), "--lora-dir", str(folder), "--executable-cache", "off",
                     "--max-inference-steps", "8", "--num-inference-steps", "2")
    try:
        client = app.client()
        request = dict(seed=1, num_inference_steps=2, guidance_scale=5.0)
        plain, _ = client.predict(api_name="/generate", prompt="a red circle", **request)
        tagged, info = client.predict(api_name="/generate", prompt="a red circle <lora:ink:0.7>", **request)
        client.predict(api_name="/generate", prompt="a red circle <lora:ink:0.3>", **request)
        short = lora_hash(folder / "ink.safetensors")[:12]
        assert info["loras"] == {"ink": short} and info["prompt"] == "a red circle <lora:ink:0.7>"
        with Image.open(tagged[0]["image"]) as image, Image.open(plain[0]["image"]) as base:
            assert image.text["parameters"].startswith("a red circle <lora:ink:0.7>\n")
            assert image.text["parameters"].endswith(f', Lora hashes: "ink: {short}"')
            assert np.abs(np.asarray(image, np.int32) - np.asarray(base, np.int32)).mean() > 1
        # gr.Error's pop-up renders HTML, so the messages carry < > & as HTML entities (handler.shown)
        unknown = "prompt: unknown LoRA 'nope' in &lt;lora:nope:\\.\\.\\.&gt;; available: ink"
        with pytest.raises(AppError, match=unknown):
            client.predict(api_name="/generate", prompt="a cat <lora:nope>", **request)
        log = "".join(app.log)
        assert "LoRAs: ink (kohya, 39 layers, hash " + short + ")" in log
        assert log.count("[sdxl_engine] compiled") == 1, log  # the start's program only
    finally:
        app.stop()
