"""Prompt cleaning (sdxl_engine.engine.validation.clean_text): what counts as empty, what is kept."""

import unicodedata

import pytest

from sdxl_engine.engine.validation import BLANKS, InvalidRequest, clean_text

# Prompts that show nothing: each must be refused as empty.
INVISIBLE = [
    ("ZWJ", "\u200d"),
    ("ZWJ space ZWNJ", "\u200d \u200c"),
    ("Hangul filler", "\u3164"),
    ("Hangul choseong/jungseong fillers", "\u115f\u1160"),
    ("halfwidth Hangul filler", "\uffa0"),
    ("blank braille pattern", "\u2800\u2800"),
    ("zero-width space, word joiner, BOM", "\u200b\u2060\ufeff"),
    ("soft hyphen", "\u00ad"),
    ("direction marks and overrides", "\u200e\u200f\u202a\u202e\u2066\u2069"),
    ("invisible maths operators", "\u2061\u2062\u2063\u2064"),
    ("Mongolian vowel separator", "\u180e"),
    ("combining grapheme joiner", "\u034f"),
    ("Khmer inherent vowels", "\u17b4\u17b5"),
    ("variation selector alone", "\ufe0f"),
    ("tag characters alone", "\U000e0067\U000e0062\U000e007f"),
    ("musical format characters", "\U0001d173\U0001d17a"),
    ("unicode spaces", "\u00a0\u2002\u2003\u2009\u200a\u202f\u205f\u3000"),
    ("line and paragraph separators", "\u2028\u2029\x85"),
    ("controls", "\x00\x01\x1b\x7f\x9f"),
    ("private use", "\ue000"),
    ("a mix", " \u200d\u3164\t\u2800\u200b\n\u115f "),
]


@pytest.mark.parametrize("text", [pytest.param(t, id=i) for i, t in INVISIBLE])
def test_invisible_prompts_are_empty(text):
    with pytest.raises(InvalidRequest, match=r"^prompt: is empty"):
        clean_text("prompt", text, required=True)
    assert clean_text("negative_prompt", text, required=False) == ""


def test_every_format_character_is_blank():
    """The whole kind, not a list: every assigned Unicode Cf character alone is refused."""
    import sys

    cf = [chr(o) for o in range(sys.maxunicode + 1) if unicodedata.category(chr(o)) == "Cf"]
    assert len(cf) > 150
    for c in cf:
        with pytest.raises(InvalidRequest):
            clean_text("prompt", c, required=True)
    for c in BLANKS:
        with pytest.raises(InvalidRequest):
            clean_text("prompt", f" {c} {c}", required=True)


@pytest.mark.parametrize("text, cleaned", [
    ("a red 🔴 circle 👩\u200d👩\u200d👧", "a red 🔴 circle 👩\u200d👩\u200d👧"),  # ZWJ inside an emoji sequence
    ("❤\ufe0f\u200d🔥 a red heart", "❤\ufe0f\u200d🔥 a red heart"),  # variation selector, then ZWJ
    ("🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f flag", None),  # tag sequence kept
    ("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", None),  # Persian: ZWNJ between letters kept
    ("a\x00red\x07circle\u202e", "a red circle"),
    ("a\u3164red\u2800circle", "a red circle"),  # fillers between words are spaces
    ("\u200da red circle\u200d", "a red circle"),  # a joiner at either end binds nothing
    ("a \u200d red", "a red"),
    ("دائرة حمراء red circle", None),
])
def test_visible_text_is_kept(text, cleaned):
    assert clean_text("prompt", text, required=True) == (text if cleaned is None else cleaned)
