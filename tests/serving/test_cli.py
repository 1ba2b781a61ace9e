"""The command line and the settings' checks at start (serving/cli.py, serving/main.prepare): a malformed
setting ends the start with one line and status 2 before anything heavy is imported or listens."""

import subprocess
import sys

import pytest

from sdxl_engine.config import ConfigError, EngineConfig
from sdxl_engine.serving.cli import check_lora_settings, parse_args
from tests.helpers import ROOT


def config(**values) -> EngineConfig:
    return EngineConfig.load(values, environ={})


@pytest.mark.parametrize("entries, message", [
    ("bad name=x.safetensors", r"^lora: --lora 'bad name=x.safetensors': LoRA name 'bad name' must be letters, "
                               r"digits, '_', '-' or '\.' \(it is written in <lora:NAME:WEIGHT> tags\)$"),
    ("x.safetensors", r"^lora: --lora 'x.safetensors': expected NAME=PATH \(e\.g\. ink=loras/ink\.safetensors\)$"),
    ("=x.safetensors", r"^lora: --lora '=x.safetensors': expected NAME=PATH"),
    ("a=", r"^lora: --lora 'a=': expected NAME=PATH"),
    ("a=/x/1.safetensors:a=/x/2.safetensors", r"^lora: --lora 'a=/x/2.safetensors': two LoRAs named 'a' "
                                              r"\(/x/1.safetensors and /x/2.safetensors\); each name once$"),
])
def test_a_malformed_lora_entry_is_refused_when_the_config_loads(entries, message):
    with pytest.raises(ConfigError, match=message):
        config(lora=entries)


def test_lora_files_are_checked_before_the_engine_starts(tmp_path):
    good = tmp_path / "ink.safetensors"
    good.write_bytes(b"not read here")
    (tmp_path / "evil.ckpt").write_bytes(b"never opened")
    check_lora_settings(config(lora=f"ink={good}"))  # the contents are the engine's to read
    cases = {
        f"evil={tmp_path / 'evil.ckpt'}": "not a .safetensors file (.ckpt); LoRAs are read from .safetensors only, "
                                          "and pickles (.ckpt, .pt, .bin) are never opened",
        f"gone={tmp_path / 'gone.safetensors'}": "no such file",
        f"dir={tmp_path}": "not a .safetensors file (no suffix); LoRAs are read from .safetensors only, and pickles "
                           "(.ckpt, .pt, .bin) are never opened",
    }
    for entry, reason in cases.items():
        with pytest.raises(ConfigError) as err:
            check_lora_settings(config(lora=entry))
        assert str(err.value) == f"lora: --lora '{entry}': {reason}"
    folder = tmp_path / "loras"
    with pytest.raises(ConfigError, match=r"^lora_dir: --lora-dir '.*loras': not a folder$"):
        check_lora_settings(config(lora_dir=str(folder)))
    folder.mkdir()
    (folder / "ink.safetensors").write_bytes(b"")
    (folder / "notes.txt").write_text("not a LoRA: left alone")
    check_lora_settings(config(lora_dir=str(folder)))
    with pytest.raises(ConfigError, match=r"^lora_dir: --lora-dir '.*loras': two LoRAs named 'ink' \("):
        check_lora_settings(config(lora=f"ink={good}", lora_dir=str(folder)))
    (folder / "my ink.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"^lora_dir: .*: LoRA name 'my ink' \(its file's name\) must be letters"):
        check_lora_settings(config(lora_dir=str(folder)))


def test_help_shows_the_default_models_own_defaults():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        parse_args(["--help"], "title")
    text = " ".join(out.getvalue().split())
    assert done.value.code == 0 and "else 20; tiny-shapes runs 8)" in text and "{shipped:" not in text


def test_prepare_checks_every_setting_before_any_heavy_import():
    """serving.main.prepare, app.py's first step: the signals are handled, the settings checked (exit 2, one
    line), and neither JAX, Flax, Gradio nor the engine has been imported by then."""
    code = ("import sys, signal\n"
            "from sdxl_engine.serving import main\n"
            "start = main.prepare('title', ['--num-inference-steps', '4'])\n"
            "print(signal.getsignal(signal.SIGTERM) == start.signals._handle, start.config.num_inference_steps)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules}"
            " & {'jax', 'flax', 'gradio', 'transformers', 'torch'}))\n"
            "main.prepare('title', ['--trusted-proxies', 'proxy.local'])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == ["True 4", "[]"], out.stderr[-2000:]
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "error: bad setting: trusted_proxies: 'proxy.local' is not an IP address or network (e.g. 10.0.0.2 or "
        "10.0.0.0/8); separate several with commas"]


def test_controlnet_is_repeated_with_its_own_metavar_and_joined_like_lora(capsys):
    """--controlnet PATH (repeatable, joined with os.pathsep as SDXL_CONTROLNET is) and --controlnet-dir DIR
    reach the engine settings; --help names each repeated flag's own value (PATH, not --lora's NAME=PATH)."""
    import os

    from sdxl_engine.serving.cli import engine_overrides

    args = parse_args(["--controlnet", "a/cn-one", "--controlnet", "b/cn-two.safetensors", "--controlnet-dir", "cns",
                       "--lora", "ink=ink.safetensors"])
    overrides = engine_overrides(args)
    assert overrides["controlnet"] == os.pathsep.join(["a/cn-one", "b/cn-two.safetensors"])
    assert overrides["controlnet_dir"] == "cns" and overrides["lora"] == "ink=ink.safetensors"
    with pytest.raises(SystemExit):
        parse_args(["--help"], "title")
    text = " ".join(capsys.readouterr().out.split())
    assert "--controlnet PATH" in text and "--lora NAME=PATH" in text and "--controlnet NAME=PATH" not in text


def test_ip_adapter_is_repeated_and_joined_like_controlnet(capsys):
    """--ip-adapter PATH (repeatable, joined with os.pathsep as SDXL_IP_ADAPTER is) reaches the engine setting;
    --help names its value PATH."""
    import os

    from sdxl_engine.serving.cli import engine_overrides

    args = parse_args(["--ip-adapter", "h94/sdxl_models/ip-adapter_sdxl.safetensors", "--ip-adapter", "b.safetensors"])
    assert engine_overrides(args)["ip_adapter"] == os.pathsep.join(["h94/sdxl_models/ip-adapter_sdxl.safetensors",
                                                                     "b.safetensors"])
    with pytest.raises(SystemExit):
        parse_args(["--help"], "title")
    assert "--ip-adapter PATH" in " ".join(capsys.readouterr().out.split())
