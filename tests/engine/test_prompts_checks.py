"""validate's prompt checks (engine/prompts.check_prompt): LoRA tags against the loaded names, and a prompt
that is only syntax, refused before anything is queued or tokenized."""

import dataclasses

import pytest

from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, Limits, validate

LIMITS = Limits(max_seed=100, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=8,
                default_guidance=5.0, loras=("ink", "oil_paint"))


@pytest.mark.parametrize("prompt, message", [
    ("a cat <lora:pencil:0.5>", "prompt: unknown LoRA 'pencil' in <lora:pencil:0.5>; available: ink, oil_paint"),
    ("a cat <lora:Ink>", "prompt: unknown LoRA 'Ink' in <lora:Ink>; available: ink, oil_paint"),  # names are exact
    ("a cat <lora:ink:x>", "prompt: '<lora:ink:x>': the weight 'x' is not a number"),
    ("(( )) BREAK [ ]", "prompt: is empty: it holds only brackets, weights or BREAK, no words"),
    ("<lora:ink:0.5> ( :1.2)", "prompt: is empty: it holds only brackets, weights or BREAK, no words (besides its "
                                "LoRA tags)"),
])
def test_refused_prompts_name_the_problem(prompt, message):
    with pytest.raises(InvalidRequest) as err:
        validate(GenerateRequest(prompt), LIMITS)
    assert str(err.value) == message and err.value.field == "prompt"


def test_without_loras_the_message_says_how_to_load_them():
    with pytest.raises(InvalidRequest, match=r"^prompt: unknown LoRA 'ink' in <lora:ink>; none are loaded "
                                             r"\(start with --lora NAME=PATH or --lora-dir DIR\)$"):
        validate(GenerateRequest("a <lora:ink>"), dataclasses.replace(LIMITS, loras=()))
    # A model of a server with several: the message names it (the LoRA may be another model's)
    with pytest.raises(InvalidRequest, match=r"^prompt: unknown LoRA 'ink' in <lora:ink>; none are loaded for the "
                                             r"model 'tiny-random' \(start with --lora NAME=PATH or --lora-dir DIR; "
                                             r"a LoRA made for another model is left out for it\)$"):
        validate(GenerateRequest("a <lora:ink>"), dataclasses.replace(LIMITS, loras=(), model="tiny-random"))


def test_accepted_prompts_are_kept_as_typed():
    for prompt in ("a cat <lora:ink:0.5>, <lora:oil_paint:-1>", "(red:1.3) circle BREAK [blue]", "\\(literal\\)"):
        assert validate(GenerateRequest(prompt, seed=1), LIMITS).prompt == prompt
    # the negative prompt's tags are text (A1111 reads extra networks in the prompt only)
    assert validate(GenerateRequest("x", negative_prompt="<lora:nope:1>", seed=1), LIMITS).negative_prompt == (
        "<lora:nope:1>")


def test_break_keeps_the_words_apart():
    """The text without syntax (PromptTokens.words, read by the unknown-word warning): a BREAK is a space."""
    from transformers import CLIPTokenizer

    from sdxl_engine.engine.prompts import tokenize_prompt
    from tests.helpers import FIXTURES

    tokenizers = tuple(CLIPTokenizer.from_pretrained(str(FIXTURES / "tiny-pt" / sub))
                       for sub in ("tokenizer", "tokenizer_2"))
    tokens = tokenize_prompt(tokenizers, "a red circle BREAK on a (blue:1.2) background BREAK", 3)
    assert tokens.words.split() == ["a", "red", "circle", "on", "a", "blue", "background"] and tokens.chunks == 2


def test_messages_shown_on_the_page_keep_their_angle_bracket_text_but_no_markup():
    from sdxl_engine.serving.handler import shown

    # The page's pop-up renders HTML: entities show the real characters and make no element.
    assert shown("prompt: unknown LoRA 'nope' in <lora:nope:...>; available: ink") == (
        "prompt: unknown LoRA 'nope' in &lt;lora:nope:...&gt;; available: ink")
    assert shown("'<lora:x:<img src=x onerror=alert(1)>': a & b \"c\"") == (
        "'&lt;lora:x:&lt;img src=x onerror=alert(1)&gt;': a &amp; b \"c\"")
    assert shown("&lt;b&gt;") == "&amp;lt;b&amp;gt;"  # typed entities stay text too
