"""The shipped tiny-shapes model, its data and its independent checker."""

import dataclasses

import numpy as np
import pytest

from tools import shapes

pytestmark = pytest.mark.engine


def test_checker_reads_rendered_images_exactly():
    images, _, attrs = shapes.make_dataset(300, seed=123)
    reads = [shapes.analyse(im) for im in images]
    for key, field in (("colour", "colour"), ("shape", "shape"), ("position", "position")):
        assert [r[key] for r in reads] == [getattr(a, field) for a in attrs], key
    assert all(r["colour_shares"][a.colour] > 0.75 for r, a in zip(reads, attrs))  # edges blend


def test_checker_finds_nothing_on_a_plain_background():
    plain = np.full((64, 64, 3), 128, np.uint8)
    assert shapes.analyse(plain)["colour"] is None and shapes.analyse(plain)["foreground"] == 0.0


def test_training_data_excludes_held_out_combinations():
    _, captions, attrs = shapes.make_dataset(3000, seed=0)
    held = set(shapes.HELD_OUT)
    assert not any((a.colour, a.shape, a.position) in held for a in attrs)
    assert not any(a.colour == a.background for a in attrs)
    assert {a.shape for a in attrs} == set(shapes.SHAPES) and {a.colour for a in attrs} == set(shapes.COLOURS)
    again = shapes.make_dataset(50, seed=7)
    assert again[1] == shapes.make_dataset(50, seed=7)[1] \
        and np.array_equal(again[0], shapes.make_dataset(50, seed=7)[0])


def test_caption_words_are_exactly_what_the_captions_use():
    """The vocabulary behind the out-of-vocabulary warning: every word the training captions use, no other."""
    _, captions, _ = shapes.make_dataset(3000, seed=0)
    used = {word for text in captions for word in text.split()}
    assert used == shapes.caption_words()


def test_every_vocabulary_word_is_one_token(tmp_path):
    from transformers import CLIPTokenizer

    from sdxl_engine.checkpoint.builtin import WORDS, write_tokenizers

    write_tokenizers(tmp_path)
    tok = CLIPTokenizer.from_pretrained(str(tmp_path / "tokenizer"))
    split = [w for w in WORDS if len(tok(w).input_ids) != 3]  # <start> word <end>
    assert split == ["3d"]  # CLIP's pre-tokenizer splits digits from letters
    assert max(tok.get_vocab().values()) == tok.convert_tokens_to_ids("<|endoftext|>")


@pytest.fixture(scope="module")
def shapes_engine(tiny_shapes_engine):
    """The session's tiny-shapes engine (4 CPU devices, the shipped model as a user starts it): no engine of its own."""
    return tiny_shapes_engine


def test_shipped_model_is_the_default_and_small():
    from sdxl_engine.checkpoint.builtin import TINY_SHAPES_DIR
    from sdxl_engine.config import EngineConfig

    assert EngineConfig.load(environ={}).model == "tiny-shapes"
    size = sum(f.stat().st_size for f in TINY_SHAPES_DIR.rglob("*") if f.is_file())
    assert size <= 30e6
    assert not list(TINY_SHAPES_DIR.rglob("*.bin")) and not list(TINY_SHAPES_DIR.rglob("*.msgpack"))
    # PyTorch layout: diffusers' PyTorch pipeline loads it too
    # four components and the shipped canny ControlNet (controlnets.json)
    assert sorted(f.parent.name for f in TINY_SHAPES_DIR.glob("*/*.safetensors")) == [
        "controlnet-canny", "text_encoder", "text_encoder_2", "unet", "vae"]
    assert [f.name for f in TINY_SHAPES_DIR.glob("*.safetensors")] == ["lcm-lora.safetensors"]  # its LCM-LoRA


def test_red_circle_is_red(shapes_engine):
    from sdxl_engine.engine.validation import GenerateRequest

    request = GenerateRequest("a red circle", seed=0, guidance_scale=5.0, num_inference_steps=20, sampler="Euler")
    images = shapes_engine.generate(request).images
    assert images.shape == (4, 64, 64, 3)
    shares = [shapes.analyse(im)["colour_shares"]["red"] for im in images]
    assert sum(s >= 0.5 for s in shares) >= 3, shares
    assert np.array_equal(images, shapes_engine.generate(request).images)  # deterministic


@pytest.mark.parametrize("prompt, position, background", [
    ("a large red circle on the left on a white background", "left", "white"),
    ("a large red circle on the right on a black background", "right", "black"),
    ("a small green star at the top on a blue background", "top", "blue"),
])
def test_position_and_background_words_are_followed(shapes_engine, prompt, position, background):
    """The words the first model ignored (it drew where the initial noise suggested), seeds 0-3."""
    from sdxl_engine.engine.validation import GenerateRequest

    request = GenerateRequest(prompt, seed=0, guidance_scale=5.0, num_inference_steps=20, sampler="Euler")  # the blog's
    images = shapes_engine.generate(request).images
    reads = [shapes.analyse(im) for im in images]
    assert [r["position"] for r in reads].count(position) >= 3, [r["position"] for r in reads]
    borders = [np.median(np.concatenate([im[:3].reshape(-1, 3), im[-3:].reshape(-1, 3)]), axis=0) for im in images]
    assert all(np.abs(b - shapes.BACKGROUNDS[background]).max() < 40 for b in borders), borders


def test_the_shipped_model_loads_by_name(shapes_engine):
    """The load call itself (configs, safetensors, cast, tokenizers) by its built-in name; its time is
    a figure of the bench (startup table), not a test's."""
    from sdxl_engine.checkpoint.loading import load_model

    model = load_model("tiny-shapes", dtype="float32", platform="cpu", cache_dir="unused")
    assert model.native_size == 64 and model.components["text_encoder_2"].config.projection_dim == 32


def test_the_shipped_model_is_a_pytorch_layout_diffusers_folder():
    """PyTorch class names and safetensors: what diffusers' StableDiffusionXLPipeline.from_pretrained reads
    (checked with torch outside CI: the same images to within 0.5/255, README), and one token per word."""
    import json

    from transformers import CLIPTokenizer

    from sdxl_engine.checkpoint.builtin import TINY_SHAPES_DIR

    index = json.loads((TINY_SHAPES_DIR / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"] and index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    tokenizer = CLIPTokenizer.from_pretrained(str(TINY_SHAPES_DIR / "tokenizer"))
    assert tokenizer("a red circle on a blue background").input_ids[1:-1] == [
        tokenizer.convert_tokens_to_ids(w + "</w>") for w in "a red circle on a blue background".split()]


@pytest.mark.slow  # trains (two toy runs) in a subprocess
def test_training_command_saves_a_model_the_engine_recipe_describes(tmp_path):
    """``python -m tools.train`` end to end at toy size (2 steps each): a diffusers folder
    (safetensors) with the shipped model's architecture and scheduler, finite losses, and the
    engine loads it."""
    import json
    import subprocess
    import sys

    from sdxl_engine.checkpoint.builtin import TINY_SHAPES_DIR
    from sdxl_engine.checkpoint.loading import load_folder
    from sdxl_engine.program.schedulers import make_schedule
    from tests.helpers import ROOT

    out = tmp_path / "ts"
    result = subprocess.run([sys.executable, "-m", "tools.train", "--out", str(out), "--images", "64",
                             "--vae-steps", "2", "--unet-steps", "2", "--batch", "8"],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((out / "training.json").read_text())
    assert [step for step, *_ in record["vae_loss"]] == [2] and [step for step, _ in record["unet_loss"]] == [2]
    assert all(np.isfinite(loss) for _, loss in record["unet_loss"])
    trained, shipped = load_folder(out, "trained", "float32"), load_folder(TINY_SHAPES_DIR, "shipped", "float32")
    for name, component in trained.components.items():  # same architecture (VAE: scaling_factor is measured)
        ours, theirs = component.config, shipped.components[name].config
        if name == "vae":
            ours, theirs = (dataclasses.replace(ours, scaling_factor=1.0),
                            dataclasses.replace(theirs, scaling_factor=1.0))
        assert ours == theirs, name
        assert component.shapes == shipped.components[name].shapes, name
    for steps in (1, 7, 20):  # the same noise schedule and prediction type
        ours, theirs = (make_schedule("Euler", c.scheduler_config, steps) for c in (trained, shipped))
        assert np.array_equal(ours.timesteps, theirs.timesteps) and np.array_equal(ours.sigmas, theirs.sigmas)
    assert trained.scheduler_config["prediction_type"] == shipped.scheduler_config["prediction_type"] == "v_prediction"
    assert trained.vocabulary == shipped.vocabulary


def test_shipped_weights_come_from_the_training_command_defaults():
    """The README's ``python -m tools.train`` (its defaults) is the recipe that made
    assets/tiny-shapes: every recorded argument but the output path equals today's default."""
    import json

    from sdxl_engine.checkpoint.builtin import TINY_SHAPES_DIR
    from tools import train

    record = json.loads((TINY_SHAPES_DIR / "training.json").read_text())
    defaults = vars(train.parse_args([]))
    assert {k: v for k, v in record["args"].items() if k != "out"} == {k: v for k, v in defaults.items() if k != "out"}
    assert record["total_s"] <= 3600 and np.isfinite(record["unet_loss"][-1][1])
