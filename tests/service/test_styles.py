"""The ten styles of the reference Space and how a style wraps the prompt."""

import pytest

from sdxl_engine.service.styles import NO_STYLE, STYLE_NAMES, UnknownStyle, apply_style


def test_the_ten_styles_of_the_reference_space():
    assert STYLE_NAMES == ("(No style)", "Cinematic", "Photographic", "Anime", "Manga", "Digital Art", "Pixel art",
                           "Fantasy art", "Neonpunk", "3D Model")


def test_apply_style_wraps_prompt_and_puts_the_users_negative_first():
    assert apply_style(NO_STYLE, "a red circle", "blurry") == ("a red circle", "blurry")
    assert apply_style(None, "a red circle") == ("a red circle", "")
    prompt, negative = apply_style("Pixel art", "a red circle", "green")
    assert prompt == "pixel-art a red circle . low-res, blocky, pixel art style, 8-bit graphics"
    assert negative == "green, sloppy, messy, blurry, noisy, highly detailed, ultra textured, photo, realistic"
    assert apply_style("pixel ART", "a red circle", "")[1].startswith("sloppy")  # case-insensitive name
    assert apply_style("Cinematic", "  ", "") == ("  ", "")  # left for validation to refuse
    assert apply_style("Cinematic", None, None) == (None, "")
    with pytest.raises(UnknownStyle, match="unknown style 'Baroque'; choose one of \\(No style\\), Cinematic"):
        apply_style("Baroque", "a red circle")
