"""Style presets: prompt and negative-prompt templates that wrap the user's text.

The ten presets and their wording are those of the reference Space (google/sdxl, "Fast Stable
Diffusion XL on TPU v5e", ``style_list`` in its app.py), which took them from the SDXL styles
used by Stability AI's Clipdrop. A positive template holds ``{prompt}`` where the user's text
goes. One difference: the Space appended the user's negative prompt *after* the style's; here it
comes first, so that the user's own words are the ones that survive CLIP's 77-token cut.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

from sdxl_engine.checkpoint import recipes
from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.program.schedulers import SCHEDULE_TYPES as SCHEDULE_LABELS


@dataclasses.dataclass(frozen=True)
class Style:
    """One preset: ``prompt`` contains ``{prompt}``; ``negative_prompt`` is added to the user's."""

    name: str
    prompt: str
    negative_prompt: str


NO_STYLE = "(No style)"

STYLES: tuple[Style, ...] = (
    Style(NO_STYLE, "{prompt}", ""),
    Style("Cinematic",
          "cinematic still {prompt} . emotional, harmonious, vignette, highly detailed, high budget, bokeh, "
          "cinemascope, moody, epic, gorgeous, film grain, grainy",
          "anime, cartoon, graphic, text, painting, crayon, graphite, abstract, glitch, deformed, mutated, ugly, "
          "disfigured"),
    Style("Photographic",
          "cinematic photo {prompt} . 35mm photograph, film, bokeh, professional, 4k, highly detailed",
          "drawing, painting, crayon, sketch, graphite, impressionist, noisy, blurry, soft, deformed, ugly"),
    Style("Anime",
          "anime artwork {prompt} . anime style, key visual, vibrant, studio anime, highly detailed",
          "photo, deformed, black and white, realism, disfigured, low contrast"),
    Style("Manga",
          "manga style {prompt} . vibrant, high-energy, detailed, iconic, Japanese comic style",
          "ugly, deformed, noisy, blurry, low contrast, realism, photorealistic, Western comic style"),
    Style("Digital Art",
          "concept art {prompt} . digital artwork, illustrative, painterly, matte painting, highly detailed",
          "photo, photorealistic, realism, ugly"),
    Style("Pixel art",
          "pixel-art {prompt} . low-res, blocky, pixel art style, 8-bit graphics",
          "sloppy, messy, blurry, noisy, highly detailed, ultra textured, photo, realistic"),
    Style("Fantasy art",
          "ethereal fantasy concept art of {prompt} . magnificent, celestial, ethereal, painterly, epic, majestic, "
          "magical, fantasy art, cover art, dreamy",
          "photographic, realistic, realism, 35mm film, dslr, cropped, frame, text, deformed, glitch, noise, noisy, "
          "off-center, deformed, cross-eyed, closed eyes, bad anatomy, ugly, disfigured, sloppy, duplicate, mutated, "
          "black and white"),
    Style("Neonpunk",
          "neonpunk style {prompt} . cyberpunk, vaporwave, neon, vibes, vibrant, stunningly beautiful, crisp, "
          "detailed, sleek, ultramodern, magenta highlights, dark purple shadows, high contrast, cinematic, "
          "ultra detailed, intricate, professional",
          "painting, drawing, illustration, glitch, deformed, mutated, cross-eyed, ugly, disfigured"),
    Style("3D Model",
          "professional 3d model {prompt} . octane render, highly detailed, volumetric, dramatic lighting",
          "ugly, deformed, noisy, low poly, blurry, painting"),
)

STYLE_NAMES: tuple[str, ...] = tuple(s.name for s in STYLES)
_BY_KEY = {s.name.casefold(): s for s in STYLES}


class UnknownStyle(InvalidRequest):
    """A style name that is not one of :data:`STYLE_NAMES` (an InvalidRequest of the field ``style``)."""

    def __init__(self, message: str):
        super().__init__("style", message)

    def __reduce__(self):
        return type(self), (self.message,)


def get_style(name: str | None) -> Style:
    """The preset called ``name`` (case-insensitive; None or "" = no style).

    Raises:
        UnknownStyle: any other name; the message lists the known ones.
    """
    if name is None or not str(name).strip():
        return STYLES[0]
    style = _BY_KEY.get(str(name).strip().casefold())
    if style is None:
        raise UnknownStyle(f"unknown style {name!r}; choose one of {', '.join(STYLE_NAMES)}")
    return style


def apply_style(name: str | None, prompt: str, negative_prompt: str = "") -> tuple[str, str]:
    """Wrap ``prompt`` and extend ``negative_prompt`` with the preset ``name``.

    Returns ``(prompt, negative_prompt)`` as the engine should receive them. The user's prompt is
    inserted verbatim at ``{prompt}``; the style's negative text follows the user's, joined by
    ", " (either may be empty). An empty (or non-text) prompt is returned unchanged, so the
    engine's validation still refuses it instead of generating the template's words alone.

    Raises:
        UnknownStyle: see :func:`get_style`.
    """
    style = get_style(name)
    negative_prompt = "" if negative_prompt is None else negative_prompt
    if not isinstance(prompt, str) or not isinstance(negative_prompt, str) or not prompt.strip():
        return prompt, negative_prompt  # left as they are for validation to name the problem
    styled = style.prompt.replace("{prompt}", prompt)
    negative = ", ".join(part for part in (negative_prompt.strip(), style.negative_prompt) if part)
    return styled, negative


# The few-step preset, offered when a LoRA named "lcm" is loaded (tiny-shapes ships one; for SDXL,
# --lora lcm=lcm-lora-sdxl.safetensors): its tag in the prompt, the LCM sampler, 4 steps, guidance 1 (no CFG).
FAST_PRESET = ("LCM", 4, 1.0)
FAST_LORA = "lcm"
FAST_LABEL = "Fast (LCM, 4 steps)"


@dataclasses.dataclass(frozen=True)
class FastPreset:
    """The page's few-step preset: a LoRA's tag and the settings it runs with (its sampler, steps, guidance and
    schedule type's label), named on the button (``label``)."""

    lora: str
    sampler: str
    steps: int
    guidance: float
    schedule_type: str = "Automatic"
    label: str = FAST_LABEL

    @property
    def settings(self) -> tuple:
        """(sampler, steps, guidance, schedule type's label), the widgets' values."""
        return self.sampler, self.steps, self.guidance, self.schedule_type


LCM_PRESET = FastPreset(FAST_LORA, *FAST_PRESET)


def fast_preset(sources: Mapping[str, Path | str]) -> FastPreset:
    """The preset for the loaded LoRAs ``sources`` ({name: file}): the first whose file a few-step recipe names
    (checkpoint/recipes.py: SDXL-Lightning's, Hyper-SD's, DMD2's LoRAs) with that recipe's settings, else the LCM
    one (:data:`LCM_PRESET`, shown when a LoRA named "lcm" is loaded)."""
    for name, path in sources.items():
        recipe = recipes.find(str(path), lora=True)
        if recipe is not None:
            d = recipe.defaults
            label = SCHEDULE_LABELS.get(d.get("schedule_type", "automatic"), "Automatic")
            return FastPreset(name, d["sampler"], d["num_inference_steps"], d["guidance_scale"], label,
                              f"Fast ({recipe.name}: {d['sampler']}, {d['num_inference_steps']} steps)")
    return LCM_PRESET


def _fast_tag(lora: str) -> re.Pattern:
    return re.compile(rf"\s*<lora:{re.escape(lora)}(:[^<>]*)?>", re.IGNORECASE)


def with_fast_tag(text, lora: str = FAST_LORA) -> str:
    """``text`` with one ``<lora:LORA:1>`` at its end (any tag of that LoRA it had removed first)."""
    rest = _fast_tag(lora).sub("", text if isinstance(text, str) else "").strip()
    return f"{rest} <lora:{lora}:1>" if rest else f"<lora:{lora}:1>"


def has_fast_tag(text, lora: str = FAST_LORA) -> bool:
    """Whether ``text`` holds a ``<lora:LORA...>`` tag."""
    return isinstance(text, str) and _fast_tag(lora).search(text) is not None


def without_fast_tag(text, lora: str = FAST_LORA) -> str:
    """``text`` without its ``<lora:LORA...>`` tags (the other presets run without the few-step LoRA)."""
    return _fast_tag(lora).sub("", text if isinstance(text, str) else "").strip()
