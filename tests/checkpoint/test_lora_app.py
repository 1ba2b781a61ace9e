"""``python app.py --lora ... --lora-dir ...``: a LoRA the server cannot use stops the start with one line."""

import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.helpers import FIXTURES, ROOT, free_port

pytestmark = pytest.mark.e2e

KOHYA = FIXTURES / "tiny-pt-lora" / "kohya.safetensors"


def test_bad_loras_exit_with_one_line_before_serving(tmp_path):
    """A LoRA setting the command must change (a name twice, a pickle) exits 2 before anything starts; a LoRA
    file that does not fit the model (SD 1.x) exits 1 when the engine reads it, with one line either way."""
    rng = np.random.default_rng(0)
    sd15 = tmp_path / "sd15.safetensors"  # SD 1.x cross-attention reads 768-wide text
    save_file({"lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k.lora_down.weight":
               rng.normal(size=(4, 768)).astype(np.float32),
               "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k.lora_up.weight":
               rng.normal(size=(32, 4)).astype(np.float32)}, str(sd15))
    damaged = load_file(str(KOHYA))
    damaged["lora_unet_input_blocks_0_0.lora_up.weight"][0, 0] = np.nan
    save_file(damaged, str(tmp_path / "nan.safetensors"))
    folder = tmp_path / "loras"
    folder.mkdir()
    (folder / "ink.safetensors").write_bytes(KOHYA.read_bytes())
    (tmp_path / "evil.ckpt").write_bytes(b"never opened")
    cases = {
        "twice": (["--lora", f"ink={KOHYA}", "--lora-dir", str(folder)], 2,
                  "error: bad setting: lora_dir: --lora-dir", "two LoRAs named 'ink'"),
        "pickle": (["--lora", f"evil={tmp_path / 'evil.ckpt'}"], 2, "error: bad setting: lora: --lora 'evil=",
                   "not a .safetensors file (.ckpt); LoRAs are read from .safetensors only, and pickles"),
        "sd15": (["--lora", f"old={sd15}"], 1, "error: the engine failed to start: LoraError",
                 "It looks like an SD 1.x LoRA (cross-attention width 768; SDXL's is 2048)"),
        "nan": (["--lora", f"nan={tmp_path / 'nan.safetensors'}"], 1, "error: the engine failed to start: LoraError",
                "nan.safetensors): tensor lora_unet_input_blocks_0_0.lora_up.weight has 1 NaN and 0 infinite values"),
    }
    procs = {name: subprocess.Popen(
        [sys.executable, str(ROOT / "app.py"), "--port", str(free_port()), "--model", str(FIXTURES / "tiny-pt"),
         "--executable-cache", "off", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={"GRADIO_ANALYTICS_ENABLED": "False", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        for name, (args, *_) in cases.items()}
    for name, (_, status, start, expected) in cases.items():
        out, err = procs[name].communicate(timeout=300)
        assert procs[name].returncode == status, (name, out[-2000:], err[-2000:])
        errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(start) and expected in errors[0], errors
        assert "Traceback" not in out + err
        assert ("Running on local URL" in out + err) == (status == 1), err  # a bad setting: nothing ever listened


def test_a_malformed_lora_setting_exits_2_at_once_and_never_listens(tmp_path):
    """``--lora 'bad name=x.safetensors'``: one line naming the setting, status 2, within seconds (before JAX,
    Gradio or the engine), and the port never takes a connection."""
    import socket
    import time

    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port),
                             "--lora", "bad name=x.safetensors"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={"GRADIO_ANALYTICS_ENABLED": "False", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    listened = False
    while proc.poll() is None and time.monotonic() - started < 60:
        with socket.socket() as probe:
            listened = listened or probe.connect_ex(("127.0.0.1", port)) == 0
        time.sleep(0.02)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - started
    assert proc.returncode == 2 and not listened, (proc.returncode, out, err)
    assert out == "" and err.splitlines() == [
        "error: bad setting: lora: --lora 'bad name=x.safetensors': LoRA name 'bad name' must be letters, digits, "
        "'_', '-' or '.' (it is written in <lora:NAME:WEIGHT> tags)"], err
    assert took < 10, took  # it was 18 s, the server listening meanwhile


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
        unknown = "prompt: unknown LoRA 'nope' in &lt;lora:nope&gt;; available: ink"  # the tag as typed
        with pytest.raises(AppError, match=unknown):
            client.predict(api_name="/generate", prompt="a cat <lora:nope>", **request)
        log = "".join(app.log)
        assert "LoRAs: ink (kohya, 39 layers, hash " + short + ")" in log
        assert log.count("[sdxl_engine] compiled") == 1, log  # the start's program only
    finally:
        app.stop()
