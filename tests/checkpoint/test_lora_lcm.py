"""The shipped LCM-LoRA of tiny-shapes: diffusers reads it and agrees with the engine's images,
and it changes nothing when a prompt does not ask for it.

References: tests/fixtures/tiny-shapes-lcm/ (``python -m tools.make_fixtures lcm-lora``: tiny-shapes in
diffusers' StableDiffusionXLPipeline, ``load_lora_weights`` of assets/tiny-shapes/lcm-lora.safetensors,
LCMScheduler, guidance 1, on given latents, the step noise the engine's: tests/fixtures/lcm-noise.npz).
Tolerance as every image parity test here: max 4/255, mean 0.5/255 (uint8 units).
"""

import hashlib
import json
import os

import numpy as np
import pytest

from sdxl_engine.checkpoint import builtin
from sdxl_engine.engine.validation import GenerateRequest
from tests.helpers import FIXTURES

pytestmark = pytest.mark.engine

REF_DIR = FIXTURES / "tiny-shapes-lcm"
META = json.loads((REF_DIR / "reference.json").read_text())
LORA = builtin.TINY_SHAPES_DIR / "lcm-lora.safetensors"


@pytest.fixture(scope="module")
def reference():
    with np.load(REF_DIR / "reference.npz") as data:
        return dict(data)


def test_the_reference_was_made_from_the_shipped_file():
    assert META["lora"]["sha256"] == hashlib.sha256(LORA.read_bytes()).hexdigest()
    assert META["lora"]["layers"] > 100  # every adapted layer of the UNet: the file's all, in diffusers too


@pytest.mark.slow  # compiles tiny-shapes' no-CFG program at 2 images and the fixture's shape
def test_images_with_the_lcm_lora_match_diffusers_load_lora_weights(reference):
    """Engine (the LoRA merged by LoraMerger from the file as read_lora reads it) and diffusers agree with the LoRA
    at 4 and 2 LCM steps and without it at 4; the LoRA itself moves the images far more than that."""
    import jax

    from sdxl_engine.checkpoint import lora as lora_mod
    from sdxl_engine.checkpoint.loading import load_folder
    from sdxl_engine.program.compiling import compile_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize
    from sdxl_engine.program.schedulers import make_schedule
    from sdxl_engine.program.sharding import make_mesh, replicated

    model = load_folder(builtin.TINY_SHAPES_DIR, "tiny-shapes", "float32")
    mesh = make_mesh(jax.devices()[:2])
    base = jax.device_put(model.params, replicated(mesh))
    merger = lora_mod.LoraMerger(base, {"lcm": lora_mod.read_lora("lcm", LORA, model.components)}, replicated(mesh))
    with_lora = merger.params([("lcm", 1.0)])
    with np.load(FIXTURES / "lcm-noise.npz") as data:
        seeds = data["seeds"]
    assert seeds.tolist() == META["seeds"]
    shape = ProgramShape(2, 64, 64, max_steps=4, cfg=False, given_latents=True)
    program = compile_program(model, base, shape, mesh)
    negative, _ = tokenize(model, "")

    def images(params, prompt, steps):
        ids, _ = tokenize(model, prompt)
        schedule = make_schedule("LCM", model.scheduler_config, steps)
        inputs = ProgramInputs.build(ids, negative, True, seeds, 1.0, schedule, steps, shape.max_steps,
                                     latents=reference["latents"])
        return np.asarray(program.executable(params, inputs)[0]).astype(int)

    cases = [(with_lora, "lcm4"), (with_lora, "lcm2"), (base, "base4")]
    for params, key in cases:
        case = META["lcm4" if key == "base4" else key]
        got = images(params, case["prompt"], case["num_inference_steps"])
        diff = np.abs(got - reference[f"{key}_images"].astype(int))
        print(f"{key}: max {diff.max()}/255, mean {diff.mean():.4f}/255")
        assert diff.max() <= 4 and diff.mean() <= 0.5, (key, diff.max(), diff.mean())
    moved = np.abs(reference["lcm4_images"].astype(int) - reference["base4_images"].astype(int)).mean()
    assert moved > 2, moved  # four times the parity tolerance on the mean


@pytest.mark.slow  # starts a second tiny-shapes engine and compiles the no-CFG program on both (30 s here)
def test_without_its_tag_the_lcm_lora_changes_no_byte(tiny_shapes_engine, tmp_path):
    """tiny-shapes loads its LCM-LoRA (loras.json); a request without the tag gives the same bytes as the same
    model without the LoRA at all (a copy of the folder less loras.json); with the tag, other images."""
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    assert "lcm" in tiny_shapes_engine.limits.loras
    copy = tmp_path / "tiny-shapes"
    copy.mkdir()
    for entry in builtin.TINY_SHAPES_DIR.iterdir():
        if entry.name not in ("loras.json", "lcm-lora.safetensors", "lcm-lora.json"):
            (copy / entry.name).symlink_to(entry)
    plain = Engine(EngineConfig.load({"model": str(copy)}, environ={
        k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")}),
        log=lambda *_: None).start()
    assert not plain.limits.loras
    for request in (GenerateRequest("a red star on the left", seed=5), GenerateRequest(
            "a small blue circle", seed=9, sampler="LCM", num_inference_steps=4, guidance_scale=1.0)):
        assert np.array_equal(tiny_shapes_engine.generate(request).images, plain.generate(request).images)
    tagged = GenerateRequest("a small blue circle <lora:lcm:1>", seed=9, sampler="LCM", num_inference_steps=4,
                             guidance_scale=1.0)
    untagged = GenerateRequest("a small blue circle", seed=9, sampler="LCM", num_inference_steps=4, guidance_scale=1.0)
    diff = np.abs(tiny_shapes_engine.generate(tagged).images.astype(int)
                  - tiny_shapes_engine.generate(untagged).images.astype(int)).mean()
    assert diff > 2, diff


@pytest.mark.slow  # compiles the distillation step once (about a minute here)
def test_the_trainer_writes_a_lora_the_loader_reads_as_it_trained_it(tmp_path):
    """``python -m tools.train lcm-lora`` for 2 steps: the file is PEFT (its LoraConfig's scale alpha / r), every
    adapted weight read back by read_lora and merged by LoraMerger is the trainer's own merge of its factors,
    the first step moved the zero-initialised up factors, and the record says what ran."""
    import jax
    from safetensors.numpy import load_file

    from sdxl_engine.checkpoint import lora as lora_mod
    from sdxl_engine.checkpoint.loading import load_folder
    from tools import train, train_lcm

    out = tmp_path / "lcm.safetensors"
    train.main(["lcm-lora", "--images", "16", "--batch", "2", "--steps", "2", "--rank", "4", "--alpha", "8",
                "--out", str(out)])
    model = load_folder(builtin.TINY_SHAPES_DIR, "tiny-shapes", "float32")
    read = lora_mod.read_lora("x", out, model.components)
    targets = train_lcm.lora_targets(model.components["unet"].shapes)
    assert read.format == "diffusers" and {layer.key for layer in read.layers} == set(targets)
    tensors = load_file(str(out))
    factors = {}
    for key, (o, n_in, k, conv) in targets.items():
        down = tensors[f"unet.{key[:-len('.weight')]}.lora_A.weight"]
        up = tensors[f"unet.{key[:-len('.weight')]}.lora_B.weight"]
        assert down.shape == ((4, n_in, k, k) if conv else (4, n_in)) and up.shape == ((o, 4, 1, 1) if conv else (o, 4))
        factors[key] = (down.reshape(4, -1), up.reshape(o, 4))
    assert max(float(np.abs(up).max()) for _, up in factors.values()) > 0  # trained: B left zero
    for layer in read.layers:  # the saved LoraConfig's scale, lora_alpha / r = 2, as PEFT reads it
        np.testing.assert_allclose(layer.up, factors[layer.key][1] * 2, rtol=1e-6)
    mine = train_lcm.merged(model.params["unet"], factors, 8 / 4)
    merger = lora_mod.LoraMerger(model.params, {"x": read}, None)
    theirs = merger.params([("x", 1.0)])["unet"]
    worst = max(float(np.abs(np.asarray(mine[k]) - np.asarray(theirs[k])).max()) for k in targets)
    assert worst < 1e-6, worst
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["steps_done"] == 2 and record["lora"]["rank"] == 4 and len(record["loss"]) == 1
    assert record["args"]["target_ema"] == 0.95 and record["device"] == str(jax.devices()[0])
