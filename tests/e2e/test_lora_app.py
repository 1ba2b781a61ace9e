"""``python app.py --lora ... --lora-dir ...``: a LoRA the server cannot use stops the start with one line (#21)."""

import subprocess
import sys

import numpy as np
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
