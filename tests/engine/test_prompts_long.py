"""Long prompts and emphasis on the engine (engine/prompts.py, program/generate.py encode_prompts/emphasize):
A1111's Original emphasis against a NumPy transcription, its direction on tiny-shapes' images, a prompt
past 77 tokens whose last words decide the colour, and one compile per new chunk count."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdxl_engine.engine.prompts import TOKENS, tokenize_prompt
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest
from sdxl_engine.program.generate import (
    ProgramInputs,
    ProgramShape,
    emphasize,
    encode_prompts,
    encode_text,
    static_options,
)
from sdxl_engine.program.schedulers import make_schedule

pytestmark = pytest.mark.engine

# Seeds not used when the prompts and margins below were chosen (those were 1000-6000).
SEEDS = (7000, 8000, 9000)
# Twenty 7-token phrases (140 tokens: 2 chunks after the comma backtrack), a colour only at the end.
FILLER = "a large circle on the left, " * 20


def numpy_original_emphasis(z, weights):
    """A1111 modules/sd_emphasis.py EmphasisOriginal.after_transformers, written out in NumPy per chunk:
    z * multipliers, then * (original_mean / new_mean)."""
    z = z.astype(np.float64)
    original_mean = z.mean(axis=(1, 2), keepdims=True)
    z = z * weights[..., None]
    new_mean = z.mean(axis=(1, 2), keepdims=True)
    return z * (original_mean / new_mean)


def colour(images, channel: int) -> float:
    """How much a channel (0 red, 2 blue) stands out: its mean minus the other two's, in /255."""
    x = images.astype(np.float64)
    return float((x[..., channel] - (x.sum(-1) - x[..., channel]) / 2).mean())


def images(engine, prompt, seeds=SEEDS, **kw):
    return np.concatenate([engine.generate(GenerateRequest(prompt, seed=s, num_inference_steps=20, **kw)).images
                           for s in seeds])


def test_emphasis_is_a1111s_original_on_fixed_arrays():
    rng = np.random.default_rng(0)
    z = rng.normal(0.3, 1.0, size=(3, TOKENS, 16)).astype(np.float32)
    weights = np.ones((3, TOKENS), np.float32)
    weights[0, 2], weights[0, 5:9] = 1.5, 1 / 1.1
    weights[1, 1:4] = (0.0, -1.0, 10.0)
    got = np.asarray(jax.jit(emphasize)(z, weights))
    np.testing.assert_allclose(got[:2], numpy_original_emphasis(z[:2], weights[:2]), rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(got[2], z[2])  # all weights 1: the hidden states bit for bit
    np.testing.assert_allclose(got[:2].mean(axis=(1, 2)), z[:2].mean(axis=(1, 2)), rtol=1e-4)  # mean restored
    half = np.asarray(emphasize(jnp.asarray(z, jnp.bfloat16), weights))
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(half[:2].astype(np.float32), got[:2], rtol=2e-2, atol=2e-2)


def test_the_engines_conditioning_is_the_numpy_formula_per_encoder_and_chunk(tiny_shapes_engine):
    model = tiny_shapes_engine.model
    prompt = tokenize_prompt((model.tokenizer, model.tokenizer_2), "a (red:1.5) [circle] BREAK ((blue)) square", 3)
    ids, weights = jnp.asarray(prompt.ids[None]), jnp.asarray(prompt.weights[None])
    encode = jax.jit(functools.partial(encode_prompts, model.components))
    plain, pooled_plain = encode(tiny_shapes_engine.params, ids)
    weighted, pooled = encode(tiny_shapes_engine.params, ids, weights)
    assert plain.shape == (1, 2 * TOKENS, 64) and pooled.shape == (1, 32)
    np.testing.assert_array_equal(np.asarray(pooled), np.asarray(pooled_plain))  # the pooled embedding takes no weight
    plain, weighted = np.asarray(plain)[0], np.asarray(weighted)[0]
    h1 = model.components["text_encoder"].config.hidden_size
    for row, channels in ((0, slice(0, h1)), (1, slice(h1, None))):  # each encoder's own mean
        for c in range(2):
            tokens = slice(c * TOKENS, (c + 1) * TOKENS)
            expected = numpy_original_emphasis(plain[None, tokens, channels], prompt.weights[row, None, tokens])[0]
            np.testing.assert_allclose(weighted[tokens, channels], expected, rtol=1e-4, atol=1e-5)
    # The chunks are encoded on their own: chunk 2 is the encoders' output for "((blue)) square" alone.
    alone = tokenize_prompt((model.tokenizer, model.tokenizer_2), "blue square", 3)
    second, _ = encode_prompts(model.components, tiny_shapes_engine.params, jnp.asarray(alone.ids[None]))
    np.testing.assert_allclose(plain[TOKENS:], np.asarray(second)[0], rtol=1e-5, atol=1e-5)


def test_emphasis_moves_the_colour_its_way(tiny_shapes_engine):
    """"a red blue circle" leaves the model to choose between two colours: (red:1.5) makes the images
    redder, [red] less red, by margins measured on other seeds (+25 and -8 in /255 over seeds 1000-6000).

    With one colour ("(red:1.5) circle" against "red circle") tiny-shapes already paints the whole
    shape red (colour share 0.95, evaluation.json) and a red token scaled past what it was trained on
    reads as less red, so that comparison measures the tiny model, not the emphasis."""
    plain = colour(images(tiny_shapes_engine, "a red blue circle"), 0)
    more = colour(images(tiny_shapes_engine, "a (red:1.5) blue circle"), 0)
    less = colour(images(tiny_shapes_engine, "a [red] blue circle"), 0)
    assert more > plain + 10 and less < plain - 2, (plain, more, less)


def test_a_new_chunk_count_compiles_once_and_says_so(tiny_shapes_engine, monkeypatch):
    """0 compiles across 1-chunk requests, one at the first 2-chunk request (the "compiling" stage), then 0."""
    engine = tiny_shapes_engine
    monkeypatch.setattr(engine.programs, "compiled",
                        {s: p for s, p in engine.programs.compiled.items() if s.chunks == 1})
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if "backend_compile" in event else None)

    def run(prompt, seed=1, negative=""):
        stages = []
        result = engine.generate(GenerateRequest(prompt, negative, seed, 5.0, 2), progress=stages.append)
        return result, stages

    run("a red circle")  # the default program exists from start-up
    before = engine.compile_count
    events.clear()
    for prompt, seed in (("a blue square", 2), ("a (red:1.3) circle, [small]", 3), ("a green star BREAK", 4)):
        result, stages = run(prompt, seed)
        assert result.prompt_chunks == 1 and "compiling" not in stages
    assert engine.compile_count == before and events == []
    result, stages = run(FILLER + "blue square", 5)
    assert result.prompt_chunks == 2 and stages[0] == "compiling" and engine.compile_count == before + 1
    assert engine.is_compiled(64, 64, True, chunks=2) and result.warnings == []
    events.clear()
    for prompt, negative in (("a red BREAK circle", ""), ("a red circle", FILLER), (FILLER + "(red:1.2)", "blue")):
        result, stages = run(prompt, 6, negative)
        assert result.prompt_chunks == 2 and "compiling" not in stages  # the negative's chunks count too
    run("a red circle")
    assert engine.compile_count == before + 1 and events == []


def test_the_last_words_of_a_long_prompt_decide_the_colour(tiny_shapes_engine):
    """140 tokens that name no colour, then "blue square": chunk 2 carries the colour, and the images are
    blue (measured +32 over seeds 1000-6000); without those words, or cut to the first chunk, they are not."""
    engine = tiny_shapes_engine
    blue = colour(images(engine, FILLER + "blue square"), 2)
    none = colour(images(engine, FILLER.rstrip(", ")), 2)
    assert blue > 15 and blue > none + 20, (blue, none)


def test_prompts_of_only_syntax_are_empty_and_weights_are_clamped_with_a_warning(tiny_shapes_engine):
    # With tags: tests/engine/test_prompts_checks.py.
    for text in ("()", "[ ] BREAK (:1.2)", "BREAK", "(( )) BREAK [ ]"):
        with pytest.raises(InvalidRequest, match=r"^prompt: is empty: it holds only brackets, weights or BREAK"):
            tiny_shapes_engine.generate(GenerateRequest(text, seed=1, num_inference_steps=1))
    result = tiny_shapes_engine.generate(GenerateRequest("a (red:50) circle", "(blue:-20)", seed=1,
                                                         num_inference_steps=1))
    assert result.warnings == ["prompt: a weight beyond ±10 was clamped to ±10",
                               "negative prompt: a weight beyond ±10 was clamped to ±10"]
    result = tiny_shapes_engine.generate(GenerateRequest("(" * 10_000 + "red circle", seed=1, num_inference_steps=1))
    assert result.warnings == ["prompt: a weight beyond ±10 was clamped to ±10"] and result.prompt_chunks == 1


def test_a_bracketless_short_prompt_runs_the_one_chunk_program(tiny_shapes_engine):
    result = tiny_shapes_engine.generate(GenerateRequest("a red circle", seed=0, num_inference_steps=1))
    assert result.prompt_chunks == 1
    assert ProgramShape(4, 64, 64, tiny_shapes_engine.config.max_inference_steps,
                        step_hook=tiny_shapes_engine.config.progress) in tiny_shapes_engine.programs.compiled


def conditioning(engine, prompt: str, negative: str):
    """encode_text's (hidden, pooled) for one image with CFG, as the engine tokenizes and pads the request."""
    tokens, negative_tokens = engine.planner.tokens(prompt, negative)
    shape = ProgramShape(1, 64, 64, 2, chunks=tokens.chunks)
    inputs = ProgramInputs.build(tokens.ids, negative_tokens.ids, not negative_tokens.words.strip(), [0], 5.0,
                                 make_schedule("Euler", engine.model.scheduler_config, 2), 2, 2,
                                 prompt_weights=tokens.weights, negative_weights=negative_tokens.weights)
    cond = jax.jit(functools.partial(encode_text, static_options(engine.model, shape)))(engine.params, inputs)
    return tokens, np.asarray(cond.hidden), np.asarray(cond.text_embeds)


def test_an_empty_negative_with_a_long_prompt_is_zeros_then_the_empty_prompt(tiny_shapes_engine):
    """A1111's SDXL rule: the empty negative's chunk 1 is zeros (force-zero), each later chunk is the empty
    prompt's own encoding (pad_cond_uncond pads with the empty prompt's cond), its pooled embedding zeros;
    the prompt's rows are its own encoding. The expected chunks come from the program's text encoders."""
    model = tiny_shapes_engine.model
    tokens, hidden, pooled = conditioning(tiny_shapes_engine, FILLER + "blue square", "")
    assert tokens.chunks == 2 and hidden.shape == (2, 2 * TOKENS, 64) and pooled.shape == (2, 32)
    empty = tokenize_prompt((model.tokenizer, model.tokenizer_2), "", 3)
    empty_hidden, empty_pooled = (np.asarray(x)[0] for x in encode_prompts(model.components, tiny_shapes_engine.params,
                                                                             jnp.asarray(empty.ids[None])))
    assert np.abs(empty_hidden).max() > 1 and np.abs(empty_pooled).max() > 0.1  # not zeros themselves
    np.testing.assert_array_equal(hidden[0, :TOKENS], 0.0)  # negative, chunk 1: zeros
    np.testing.assert_allclose(hidden[0, TOKENS:], empty_hidden, rtol=1e-5, atol=1e-5)  # chunk 2: ""'s chunk
    np.testing.assert_array_equal(pooled[0], 0.0)  # the pooled embedding is chunk 1's: zeros
    prompt_hidden, prompt_pooled = encode_prompts(model.components, tiny_shapes_engine.params,
                                                  jnp.asarray(tokens.ids[None]), jnp.asarray(tokens.weights[None]))
    np.testing.assert_allclose(hidden[1], np.asarray(prompt_hidden)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pooled[1], np.asarray(prompt_pooled)[0], rtol=1e-5, atol=1e-5)


def test_an_empty_negative_with_a_one_chunk_prompt_is_all_zeros_to_the_byte(tiny_shapes_engine):
    """One chunk: the rule above is SDXL's force-zero alone, the program's conditioning before the
    multi-chunk rule, to the byte: negative hidden states and pooled embedding exactly 0, the prompt's rows
    exactly what the same program computed before (x 1.0). A negative with words is never zeroed."""
    tokens, hidden, pooled = conditioning(tiny_shapes_engine, "a red circle", "")
    assert tokens.chunks == 1
    assert not hidden[0].any() and not pooled[0].any()  # 0 or -0: the encoders' output x 0, as before
    _, with_words, pooled_words = conditioning(tiny_shapes_engine, "a red circle", "blue")
    np.testing.assert_array_equal(with_words[1], hidden[1])
    np.testing.assert_array_equal(pooled_words[1], pooled[1])
    assert np.abs(with_words[0, :TOKENS]).max() > 1 and np.abs(pooled_words[0]).max() > 0.1
