"""validate's prompt checks (engine/prompts.check_prompt): LoRA tags against the loaded names, and a prompt
that is only syntax, refused before anything is queued or tokenized."""

import dataclasses

import pytest

from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, Limits, validate

LIMITS = Limits(max_seed=100, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=8,
                default_guidance=5.0, loras=("ink", "oil_paint"))


@pytest.mark.parametrize("prompt, message", [
    ("a cat <lora:pencil:0.5>", "prompt: unknown LoRA 'pencil' in <lora:pencil:...>; available: ink, oil_paint"),
    ("a cat <lora:Ink>", "prompt: unknown LoRA 'Ink' in <lora:Ink:...>; available: ink, oil_paint"),  # names are exact
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
    with pytest.raises(InvalidRequest, match=r"^prompt: unknown LoRA 'ink' in <lora:ink:\.\.\.>; none are loaded "
                                             r"\(start with --lora NAME=PATH or --lora-dir DIR\)$"):
        validate(GenerateRequest("a <lora:ink>"), dataclasses.replace(LIMITS, loras=()))


def test_accepted_prompts_are_kept_as_typed():
    for prompt in ("a cat <lora:ink:0.5>, <lora:oil_paint:-1>", "(red:1.3) circle BREAK [blue]", "\\(literal\\)"):
        assert validate(GenerateRequest(prompt, seed=1), LIMITS).prompt == prompt
    # the negative prompt's tags are text (A1111 reads extra networks in the prompt only)
    assert validate(GenerateRequest("x", negative_prompt="<lora:nope:1>", seed=1), LIMITS).negative_prompt == (
        "<lora:nope:1>")
