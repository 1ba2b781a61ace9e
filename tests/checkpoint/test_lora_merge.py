"""LoRAs on the compiled program: diffusers' images with the same files, and switching without compiling.

Fixture (tests/fixtures/README.md): ``tiny-pt-lora`` holds a kohya LoRA written by hand (sgm names, LoCon
convs, both text encoders, alphas) and a PEFT LoRA saved by diffusers' ``save_lora_weights`` (r 4,
lora_alpha 8 in its metadata), with ``StableDiffusionXLPipeline`` images after ``load_lora_weights`` and
``set_adapters`` at weight 1 and 0.5, and both at once (kohya 0.7, PEFT -0.6), on the same latents.
"""

import json

import jax
import numpy as np
import pytest

from sdxl_engine.checkpoint import lora
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, validate
from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize
from sdxl_engine.program.schedulers import make_schedule
from sdxl_engine.program.sharding import replicated
from tests.helpers import FIXTURES, TINY_PT_MAX_STEPS

pytestmark = pytest.mark.engine

LORA_DIR = FIXTURES / "tiny-pt-lora"
REF = json.loads((LORA_DIR / "reference.json").read_text())
FILES = {"kohya": LORA_DIR / "kohya.safetensors", "peft": LORA_DIR / "peft.safetensors"}


@pytest.fixture(scope="module")
def setup(tiny_pt_programs):
    """tiny-pt on 2 devices, its 64x64 CFG program with given latents (the session's), and a merger of both LoRAs."""
    model, params, mesh = tiny_pt_programs.model, tiny_pt_programs.params, tiny_pt_programs.mesh
    program = tiny_pt_programs[ProgramShape(2, 64, 64, max_steps=TINY_PT_MAX_STEPS, cfg=True, given_latents=True)]
    loras = {name: lora.read_lora(name, path, model.components) for name, path in FILES.items()}
    return model, params, program, lora.LoraMerger(params, loras, replicated(mesh))


def images_for(setup, weights: dict) -> np.ndarray:
    model, _, program, merger = setup
    with np.load(LORA_DIR / "reference.npz") as data:
        latents = data["latents"]
    schedule = make_schedule("Euler", model.scheduler_config, REF["steps"])
    ids, _ = tokenize(model, REF["prompt"])
    negative, _ = tokenize(model, "")
    inputs = ProgramInputs.build(ids, negative, True, np.zeros(2, np.uint32), REF["guidance_scale"], schedule,
                                 REF["steps"], 10, latents=latents)
    images, finite = program.executable(merger.params(list(weights.items())), inputs)
    assert np.asarray(finite).all()
    return np.asarray(images)


@pytest.mark.slow  # compiles tiny-pt's program, as test_models' pipeline comparison does
@pytest.mark.parametrize("case", list(REF["cases"]))
def test_images_match_diffusers_load_lora_weights(setup, case):
    """diffusers' load_lora_weights + set_adapters and the merged params, same latents: max 4/255, mean 0.5/255;
    and each LoRA changes the images ten times the mean tolerance or more (so the comparison would catch a layer
    mapped wrong)."""
    with np.load(LORA_DIR / "reference.npz") as data:
        expected, base = data[f"{case}_images"] * 255, data["base_images"] * 255
    images = images_for(setup, REF["cases"][case]).astype(np.float64)
    diff = np.abs(images - expected)
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    if case != "base":
        assert np.abs(expected - base).mean() > 5  # ten times the mean tolerance


def test_switching_sets_and_weights_compiles_nothing_after_each_sets_first_merge(setup):
    """Once each set's layer merges are compiled (per weight shape and LoRA count), any weights of a seen set,
    and going back to a set, compile nothing: neither the program (an ahead-of-time executable, called with
    same-shaped params) nor the merge."""
    _, params, _, merger = setup
    for weights in ({"kohya": 1.0}, {"peft": 0.5}, {"kohya": 0.7, "peft": -0.6}):
        jax.block_until_ready(merger.params(list(weights.items())))
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if "backend_compile" in event else None)
    for weights in ({"kohya": 0.25}, {"peft": 1.0}, {"kohya": -1.0, "peft": 2.0}, {}, {"kohya": 0.5}):
        merged = merger.params(list(weights.items()))
        jax.block_until_ready(merged)
        assert jax.tree.structure(merged) == jax.tree.structure(params)
    assert events == []
    assert merger.params([]) is params  # no LoRA: the kept base params themselves


def test_weight_zero_is_the_base_and_the_base_is_kept(setup):
    _, params, _, merger = setup
    key = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    before = np.asarray(params["unet"][key]).copy()
    delta = np.asarray(merger.params([("kohya", 1.0)])["unet"][key]) - before
    half = np.asarray(merger.params([("kohya", 0.5)])["unet"][key]) - before
    negative = np.asarray(merger.params([("kohya", -0.5)])["unet"][key]) - before
    # W + weight x (alpha / rank) x up @ down: linear in the weight, a real change at 1
    assert np.abs(delta).max() > 1e-3 and np.allclose(half, 0.5 * delta, atol=1e-6) \
        and np.allclose(negative, -half, atol=1e-6)
    assert merger.params([("kohya", 0.0)]) is params
    assert np.array_equal(np.asarray(params["unet"][key]), before)
    untouched = "up_blocks.2.resnets.1.conv1.weight"
    assert merger.params([("kohya", 1.0)])["unet"][untouched] is params["unet"][untouched]  # shared, not copied


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    folder = tmp_path_factory.mktemp("loras")
    (folder / "ink.safetensors").write_bytes(FILES["kohya"].read_bytes())
    config = EngineConfig.load({"model": str(FIXTURES / "tiny-pt"), "cpu_devices": 4, "executable_cache": False,
                                "lora": f"peft={FILES['peft']}", "lora_dir": str(folder),
                                "max_inference_steps": 8, "num_inference_steps": 3}, environ={})
    return Engine(config, log=lambda *_: None).start()


@pytest.mark.slow  # starts a second engine (tiny-pt, one compile)
def test_engine_tags_pick_loras_without_recompiling(lora_engine):
    engine = lora_engine
    assert sorted(engine.loras.loras) == ["ink", "peft"]

    def gen(prompt, **kw):
        return engine.generate(GenerateRequest(prompt, seed=3, num_inference_steps=3, guidance_scale=5.0, **kw))

    plain = gen("a red circle")
    before = engine.compile_count
    ink = gen("a red circle <lora:ink:0.8>")
    both = gen("<lora:peft:0.5> a red circle <lora:ink>")
    again = gen("a red circle <lora:ink:0.8>")
    assert engine.compile_count == before
    assert not np.array_equal(both.images, ink.images)
    # the images move away from the plain ones as the LoRA's weight grows
    far = np.abs(ink.images.astype(int) - plain.images).mean()
    near = np.abs(gen("a red circle <lora:ink:0.3>").images.astype(int) - plain.images).mean()
    assert 0 < near < far, (near, far)
    assert np.array_equal(again.images, ink.images)
    assert np.array_equal(gen("a red circle <lora:ink:0>").images, plain.images)
    # The tags are removed before tokenizing (A1111): where a tag stands changes nothing.
    assert np.array_equal(gen("<lora:ink:0.8>a red circle").images, ink.images)
    assert ink.loras == {"ink": engine.loras.loras["ink"].short_hash}
    assert list(both.loras) == ["peft", "ink"] and ink.request.prompt == "a red circle <lora:ink:0.8>"
    with pytest.raises(InvalidRequest, match=r"^prompt: unknown LoRA 'nope' in <lora:nope:1>; available: "
                                             r"ink, peft$"):
        gen("a cat <lora:nope:1>")
    # A tag in the negative prompt is text there, as in A1111: not parsed, no error.
    assert gen("a red circle", negative_prompt="<lora:nope:1>").images.shape == (4, 64, 64, 3)


def test_a_tag_is_read_in_the_prompt_and_kept_as_text_in_the_negative_prompt(tiny_shapes_engine):
    """A1111 reads extra networks in the prompt only: the prompt's tag is removed before tokenizing and picks
    the LoRA, the negative prompt's tag stays text (its tokens are those of the whole text, tag included)."""
    from sdxl_engine.engine.prompts import tokenize_prompt

    engine = tiny_shapes_engine
    tokenizers = (engine.model.tokenizer, engine.model.tokenizer_2)
    request = GenerateRequest("a red circle <lora:lcm:0.5>", "<lora:lcm:1> blue square", seed=1)
    prompt, negative = engine.planner.tokens(request.prompt, request.negative_prompt)
    assert prompt.words == "a red circle " and negative.words == "<lora:lcm:1> blue square"
    np.testing.assert_array_equal(prompt.ids, tokenize_prompt(tokenizers, "a red circle", 3).ids)
    as_text = tokenize_prompt(tokenizers, "<lora:lcm:1> blue square", 3, lora_tags=False).ids
    np.testing.assert_array_equal(negative.ids, as_text)
    assert int((as_text[0] != tokenizers[0].pad_token_id).sum()) > len("blue square".split()) + 2  # the tag's tokens
    plan = engine.planner.plan(validate(request, engine.limits))
    assert plan.loras == (("lcm", 0.5),)  # the prompt's tag; the negative prompt's is text
    _, hashes = engine._lora_params(plan.loras)
    assert hashes == {"lcm": engine.loras.loras["lcm"].short_hash}
    assert engine._lora_params(())[1] == {}
