"""The prompt syntax (engine/prompts.py) against AUTOMATIC1111's rules: parse_prompt_attention's
documented examples and more cases (modules/prompt_parser.py), and the chunking of
modules/sd_hijack_clip.py (tokenize_line) as token tables for both of tiny-shapes' tokenizers."""

import numpy as np
import pytest
from transformers import CLIPTokenizer

from sdxl_engine.engine.prompts import (
    CHUNK,
    TOKENS,
    Segment,
    chunk_tokens,
    parse_lora_tags,
    parse_prompt_attention,
    scheduled_spans,
    tokenize_prompt,
)
from sdxl_engine.engine.validation import InvalidRequest


def parsed(text):
    return [[s.text, s.weight] for s in parse_prompt_attention(text)]


# A1111's parse_prompt_attention docstring, every example, with its expected output as printed there.
A1111_EXAMPLES = [
    ("normal text", [["normal text", 1.0]]),
    ("an (important) word", [["an ", 1.0], ["important", 1.1], [" word", 1.0]]),
    ("(unbalanced", [["unbalanced", 1.1]]),
    ("\\(literal\\]", [["(literal]", 1.0]]),
    ("(unnecessary)(parens)", [["unnecessaryparens", 1.1]]),
    ("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
     [["a ", 1.0], ["house", 1.5730000000000004], [" ", 1.1], ["on", 1.0], [" a ", 1.1], ["hill", 0.55],
      [", sun, ", 1.1], ["sky", 1.4641000000000006], [".", 1.1]]),
]


@pytest.mark.parametrize("text, expected", A1111_EXAMPLES)
def test_a1111_documented_examples_exactly(text, expected):
    assert parsed(text) == expected  # float equality: the products are A1111's, in its order


@pytest.mark.parametrize("text, expected", [
    ("((red))", [["red", 1.1 * 1.1]]),
    ("[[red]]", [["red", 1 / 1.1 / 1.1]]),
    ("(red:1.3)", [["red", 1.3]]),
    ("((red:1.3) circle)", [["red", 1.3 * 1.1], [" circle", 1.1]]),
    ("[(red:1.5)]", [["red", 1.5 / 1.1]]),
    ("( :1.2)", [[" ", 1.2]]),  # empty weight text: a space with the weight
    ("(red:0)", [["red", 0.0]]),
    ("(red:-1.5) circle", [["red", -1.5], [" circle", 1.0]]),
    ("(red:+2)", [["red", 2.0]]),
    ("(red:.5)", [["red", 0.5]]),
    ("(red:abc)", [["red:abc", 1.1]]),  # not a number: literal text, the bracket still x1.1
    ("(red: 1.3)", [["red: 1.3", 1.1]]),  # A1111's weight has no space after the colon
    ("(red:1.2.3)", [["red:1.2.3", 1.1]]),  # A1111 raises on float("1.2.3"); here it is text
    ("[red:1.2]", [["red:1.2", 1 / 1.1]]),  # square brackets take no weight
    ("red:1.2)", [["red:1.2)", 1.0]]),  # a closer with no opener is text
    ("a ] b ) c", [["a ] b ) c", 1.0]]),
    ("\\(a\\) \\[b\\] \\\\", [["(a) [b] \\", 1.0]]),
    ("a\\b", [["ab", 1.0]]),  # a lone backslash escapes nothing and is dropped, as in A1111
    ("(a [b", [["a ", 1.1], ["b", 1.1 / 1.1]]),  # closed at the end: round first, then square
    ("([a)]", [["a", 1.1 / 1.1]]),
    ("(красный:1.2) 円 🔴", [["красный", 1.2], [" 円 🔴", 1.0]]),
    ("", [["", 1.0]]),
    ("()", [["", 1.0]]),
])
def test_weights_nesting_escapes_and_bad_weights(text, expected):
    got = parsed(text)
    assert [t for t, _ in got] == [t for t, _ in expected]
    np.testing.assert_allclose([w for _, w in got], [w for _, w in expected], rtol=1e-15)


def test_break_splits_and_is_a_marker():
    segments = parse_prompt_attention("a red circle BREAK (blue:1.2) square")
    assert segments == [Segment("a red circle", 1.0), Segment("BREAK", -1.0, True), Segment("", 1.0),
                        Segment("blue", 1.2), Segment(" square", 1.0)]
    # Inside brackets it still breaks, and two in a row are two (A1111 merges them into text).
    assert [s.is_break for s in parse_prompt_attention("(a BREAK b)")] == [False, True, False]
    assert sum(s.is_break for s in parse_prompt_attention("a BREAK BREAK b")) == 2
    assert not any(s.is_break for s in parse_prompt_attention("BREAKFAST, break, aBREAK"))


def test_ten_thousand_nested_brackets_parse_without_recursion():
    assert parsed("(" * 10_000 + "red" + ")" * 10_000) == [["red", float("inf")]]  # clamped when tokenized
    assert parsed("[" * 10_000 + "red")[0][0] == "red"
    many = parse_prompt_attention("(a" * 10_000)  # 10,000 open brackets, each around more text
    assert "".join(s.text for s in many) == "a" * 10_000 and many[0].weight == pytest.approx(1.1)


def test_lora_tags_are_removed_before_emphasis(tokenizers):
    tagged = tokenize_prompt(tokenizers, "<lora:ink:0.7>(red:1.2) circle<lora:x>", 3)
    plain = tokenize_prompt(tokenizers, "(red:1.2) circle", 3)
    np.testing.assert_array_equal(tagged.ids, plain.ids)
    np.testing.assert_array_equal(tagged.weights, plain.weights)
    assert tagged.words == "red circle"
    assert parse_lora_tags("a (cat:1.2) <lora:ink:0.7>") == ("a (cat:1.2) ", (parse_lora_tags("<lora:ink:0.7>")[1]))
    with pytest.raises(InvalidRequest, match="is not a number"):
        tokenize_prompt(tokenizers, "(red) <lora:ink:abc>", 3)


# ---- chunking ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizers():
    from sdxl_engine.checkpoint.builtin import TINY_SHAPES_DIR as folder

    return tuple(CLIPTokenizer.from_pretrained(str(folder / sub)) for sub in ("tokenizer", "tokenizer_2"))


@pytest.fixture(scope="module")
def ids(tokenizers):
    """Single-token words of tiny-shapes' vocabulary, and its special ids."""
    tok = tokenizers[0]
    words = {w: tok(w, add_special_tokens=False).input_ids for w in ("red", "circle", ",", "a")}
    assert all(len(v) == 1 for v in words.values())
    return {**{w: v[0] for w, v in words.items()}, "bos": tok.bos_token_id, "eos": tok.eos_token_id}


def layout(chunks):
    """The chunks' ids, without their weights."""
    return [chunk for chunk, _ in chunks]


def inner(chunk):
    return chunk[1:]  # after BOS: the tokens, EOS, the pads


@pytest.mark.parametrize("row", [0, 1])
def test_chunks_of_75_bos_eos_and_each_tokenizers_pad(tokenizers, ids, row):
    tok, pad = tokenizers[row], tokenizers[row].pad_token_id
    assert pad == (ids["eos"] if row == 0 else 0)  # SDXL's two pads: <|endoftext|> and "!"
    for n, expected_chunks in ((1, 1), (75, 1), (76, 2), (150, 2), (151, 3)):
        chunks = chunk_tokens(parse_prompt_attention(" ".join(["red"] * n)), tok)
        assert len(chunks) == expected_chunks, n
        assert all(len(c) == TOKENS and len(w) == TOKENS for c, w in chunks)
        flat = [t for c, _ in chunks for t in c[1:] if t == ids["red"]]
        assert len(flat) == n
        last = chunks[-1][0]
        filled = n - CHUNK * (expected_chunks - 1)
        assert last[:filled + 2] == [ids["bos"]] + [ids["red"]] * filled + [ids["eos"]]
        assert last[filled + 2:] == [pad] * (CHUNK - filled)
        for c, _ in chunks[:-1]:  # full chunks: BOS, 75 tokens, EOS
            assert c == [ids["bos"]] + [ids["red"]] * CHUNK + [ids["eos"]]


@pytest.mark.parametrize("reds, circles, first_chunk_tokens", [
    (70, 10, 71),  # the comma 5 back: its phrase moves on, chunk 1 ends at the comma
    (55, 30, 56),  # exactly 20 back (75 - 55): still moved
    (54, 30, 75),  # 21 back: too far, cut at 75 as usual
    (74, 10, 75),  # the comma is the 75th token: nothing after it to move
])
def test_comma_backtrack_within_the_last_20_tokens(tokenizers, ids, reds, circles, first_chunk_tokens):
    text = " ".join(["red"] * reds) + ", " + " ".join(["circle"] * circles)
    for tok in tokenizers:
        chunks = layout(chunk_tokens(parse_prompt_attention(text), tok))
        body = inner(chunks[0])
        assert body[:first_chunk_tokens] == ([ids["red"]] * reds + [ids[","]] + [ids["circle"]] * circles)[
            :first_chunk_tokens]
        assert body[first_chunk_tokens] == ids["eos"]  # chunk 1 ends where the table says
        rest = [t for c in chunks[1:] for t in inner(c) if t not in (ids["eos"], tok.pad_token_id)]
        assert rest == ([ids["red"]] * reds + [ids[","]] + [ids["circle"]] * circles)[first_chunk_tokens:]
    off = chunk_tokens(parse_prompt_attention(" ".join(["red"] * 70) + ", " + " ".join(["circle"] * 10)),
                       tokenizers[0], comma_backtrack=0)  # 0: off, so the phrase is split at 75
    assert inner(off[0][0]).count(ids["circle"]) == 4 and inner(off[1][0]).count(ids["circle"]) == 6


@pytest.mark.parametrize("text, chunk_words", [
    ("red BREAK circle", [["red"], ["circle"]]),
    ("red, circle BREAK", [["red", ",", "circle"]]),  # a BREAK at the end adds no chunk
    ("BREAK red", [[], ["red"]]),  # ...one at the start closes an empty chunk, as A1111 does
    ("red BREAK BREAK circle", [["red"], [], ["circle"]]),
    ("(red BREAK circle)", [["red"], ["circle"]]),
])
def test_break_starts_a_new_chunk(tokenizers, ids, text, chunk_words):
    for tok in tokenizers:
        chunks = layout(chunk_tokens(parse_prompt_attention(text), tok))
        assert [[t for t in inner(c) if t not in (ids["eos"], tok.pad_token_id)] for c in chunks] == [
            [ids[w] for w in words] for words in chunk_words]


def test_break_after_70_tokens_and_then_more_than_a_chunk(tokenizers, ids):
    text = " ".join(["red"] * 70) + " BREAK " + " ".join(["circle"] * 80)
    chunks = layout(chunk_tokens(parse_prompt_attention(text), tokenizers[1]))
    assert [sum(t == ids["red"] for t in c) for c in chunks] == [70, 0, 0]
    assert [sum(t == ids["circle"] for t in c) for c in chunks] == [0, 75, 5]


def test_weights_follow_their_tokens_and_specials_weigh_1(tokenizers, ids):
    p = tokenize_prompt(tokenizers, "a (red:1.5) [circle] BREAK ((red))", 3)
    assert p.ids.shape == p.weights.shape == (2, 2 * TOKENS) and p.weights.dtype == np.float32 and p.chunks == 2
    for row in range(2):
        assert p.ids[row, :5].tolist() == [ids["bos"], ids["a"], ids["red"], ids["circle"], ids["eos"]]
        np.testing.assert_allclose(p.weights[row, :5], [1, 1, 1.5, 1 / 1.1, 1], rtol=1e-7)
        assert p.ids[row, TOKENS:TOKENS + 3].tolist() == [ids["bos"], ids["red"], ids["eos"]]
        np.testing.assert_allclose(p.weights[row, TOKENS:TOKENS + 3], [1, 1.21, 1], rtol=1e-7)
        assert (p.weights[row, 5:TOKENS] == 1).all() and (p.weights[row, TOKENS + 3:] == 1).all()
    none = tokenize_prompt(tokenizers, "a (red:1.5) [circle] BREAK ((red))", 3, emphasis="none")
    np.testing.assert_array_equal(none.ids, p.ids)
    assert (none.weights == 1).all()


def test_a1111_prompt_editing_and_alternation_are_found_for_a_warning(tokenizers):
    """A1111's [from:to:when], [to:when], [from::when] and [a|b] (modules/prompt_parser.py) change the prompt during
    the steps there; this engine reads them as words, so the spans are kept for the plan's warning."""
    assert scheduled_spans("[red:blue:0.5] circle, [cat:10], [dog::0.3], [x:.5], [a: b : 5 ]") == (
        "[red:blue:0.5]", "[cat:10]", "[dog::0.3]", "[x:.5]", "[a: b : 5 ]")
    assert scheduled_spans("[red|blue] circle [[a|b|c]]") == ("[red|blue]", "[a|b|c]")
    # emphasis, a word and a colon that is no step, escaped brackets: none
    assert scheduled_spans("(word:1.3) [word] [a:b:c] \\[red:blue:0.5\\] (x|y)") == ()
    assert tokenize_prompt(tokenizers, "a [red|blue] circle", 3).scheduled == ("[red|blue]",)
    assert tokenize_prompt(tokenizers, "a [red] circle", 3).scheduled == ()


def test_weights_beyond_10_are_clamped_and_flagged(tokenizers):
    p = tokenize_prompt(tokenizers, "(red:50) [circle:3] (a:-12) " + "(" * 10_000 + "red", 3)
    assert p.clamped and float(p.weights.max()) == 10.0 and float(p.weights.min()) == -10.0
    ok = tokenize_prompt(tokenizers, "(red:10) (circle:-10) (a:0)", 3)
    assert not ok.clamped and sorted(set(ok.weights[0].tolist())) == [-10.0, 0.0, 1.0, 10.0]


def test_past_max_chunks_is_cut_and_short_prompts_are_todays_ids(tokenizers):
    from sdxl_engine.program.generate import tokenize

    class Model:  # what generate.tokenize reads: the two tokenizers
        tokenizer, tokenizer_2 = tokenizers

    long = tokenize_prompt(tokenizers, "red " * 250, 3)
    assert (long.chunks, long.cut, long.ids.shape) == (3, True, (2, 3 * TOKENS))
    assert not tokenize_prompt(tokenizers, "red " * 225, 3).cut
    for text in ("a red circle", "", "a large blue square on the left, small, red: star", "red " * 75):
        short = tokenize_prompt(tokenizers, text, 3)
        assert short.chunks == 1 and (short.weights == 1).all()
        np.testing.assert_array_equal(short.ids, tokenize(Model, text)[0])  # diffusers' padded ids


def test_negative_padded_with_the_empty_prompts_chunk(tokenizers):
    empty = tokenize_prompt(tokenizers, "", 3)
    short = tokenize_prompt(tokenizers, "red", 3).padded(3)
    assert short.chunks == 3 and short.ids.shape == (2, 3 * TOKENS)
    for c in (1, 2):
        np.testing.assert_array_equal(short.ids[:, c * TOKENS:(c + 1) * TOKENS], empty.ids)
    assert (short.weights[:, TOKENS:] == 1).all()
    assert tokenize_prompt(tokenizers, "red", 3).padded(1).chunks == 1
