"""The <lora:NAME:WEIGHT> tags of AUTOMATIC1111's prompt syntax (engine/prompts.parse_lora_tags)."""

import pytest

from sdxl_engine.engine.prompts import MAX_LORA_TAGS, LoraTag, parse_lora_tags
from sdxl_engine.engine.validation import InvalidRequest


@pytest.mark.parametrize("text, stripped, tags", [
    ("a red circle", "a red circle", ()),
    ("a cat <lora:ink:0.7>, sketch", "a cat , sketch", (LoraTag("ink", 0.7),)),
    ("<lora:ink>a cat", "a cat", (LoraTag("ink", 1.0),)),  # weight optional, default 1
    ("<lora:a:1><lyco:b:-0.5> x", " x", (LoraTag("a", 1.0), LoraTag("b", -0.5))),  # lyco: A1111's alias
    ("x <lora:a: 0.25 >", "x ", (LoraTag("a", 0.25),)),
    ("x <LoRA:a:2>", "x ", (LoraTag("a", 2.0),)),
    ("x <lora:a:-4>", "x ", (LoraTag("a", -4.0),)),  # the limit itself is allowed
    ("a <b> c", "a <b> c", ()),  # no colon: not an extra network, stays text (A1111's pattern)
    ("(red:1.2) <lora:ink:.5>", "(red:1.2) ", (LoraTag("ink", 0.5),)),
])
def test_tags_are_found_and_removed_in_order(text, stripped, tags):
    assert parse_lora_tags(text) == (stripped, tags)


@pytest.mark.parametrize("text, message", [
    ("<lora:x:abc>", "prompt: '<lora:x:abc>': the weight 'abc' is not a number"),
    ("<lora:x:4.5>", "prompt: '<lora:x:4.5>': the weight must be between -4 and 4"),
    ("<lora:x:nan>", "prompt: '<lora:x:nan>': the weight must be between -4 and 4"),
    ("<lora:x:inf>", "prompt: '<lora:x:inf>': the weight must be between -4 and 4"),
    ("<lora: :1>", "prompt: '<lora: :1>': the tag names no LoRA"),
    ("<lora:a:1:0.5>", "prompt: '<lora:a:1:0.5>': one weight only (<lora:NAME:WEIGHT>); separate text-encoder "
                       "and UNet weights are not supported"),
    ("<lora:a><lora:a:0.5>", "prompt: '<lora:a:0.5>': LoRA 'a' is named twice"),
    ("<hypernet:z:1>", "prompt: '<hypernet:z:1>': extra networks of type 'hypernet' are not supported here "
                       "(only <lora:NAME:WEIGHT>)"),
])
def test_malformed_tags_are_refused_with_the_tag_named(text, message):
    with pytest.raises(InvalidRequest) as err:
        parse_lora_tags(text)
    assert str(err.value) == message and err.value.field == "prompt"


def test_the_tag_limit_is_stated():
    ok = " ".join(f"<lora:n{i}:0.1>" for i in range(MAX_LORA_TAGS))
    assert len(parse_lora_tags(ok)[1]) == MAX_LORA_TAGS
    with pytest.raises(InvalidRequest, match=f"20 LoRA tags; at most {MAX_LORA_TAGS} in one prompt"):
        parse_lora_tags(" ".join(f"<lora:n{i}>" for i in range(20)))


def test_field_is_named():
    with pytest.raises(InvalidRequest, match="^negative_prompt: "):
        parse_lora_tags("<lora:x:y>", field="negative_prompt")
