"""The prompt's syntax, AUTOMATIC1111's, parsed in one place for every feature that reads it.

Extra networks (this file's first part): ``<lora:NAME>`` and ``<lora:NAME:WEIGHT>`` tags, found
and removed as AUTOMATIC1111's ``modules/extra_networks.py`` (``parse_prompt``, its pattern
``<(\\w+):([^>]+)>``) does, before the text is tokenized. ``lyco`` is an alias of ``lora`` there
(the built-in Lora extension registers both), so it is here too.

Emphasis and long prompts (``(word:1.2)``, ``[word]``, ``BREAK``) are parsed here as well (the
long-prompt issue), so the page, the engine and every API read one syntax.
"""

from __future__ import annotations

import dataclasses
import math
import re

from sdxl_engine.engine.validation import InvalidRequest

# AUTOMATIC1111 modules/extra_networks.py: re_extra_net.
EXTRA_NETWORK = re.compile(r"<(\w+):([^>]+)>")
LORA_TYPES = ("lora", "lyco")
MAX_LORA_TAGS = 8  # distinct LoRAs in one prompt; each set is merged once (checkpoint/lora.py)
MAX_LORA_WEIGHT = 4.0  # |weight| limit: past it the deltas dominate the base weights


@dataclasses.dataclass(frozen=True)
class LoraTag:
    """One ``<lora:NAME:WEIGHT>`` tag: the name as written and its weight (default 1.0)."""

    name: str
    weight: float = 1.0


def parse_lora_tags(text: str, field: str = "prompt") -> tuple[str, tuple[LoraTag, ...]]:
    """Split a prompt into its text without extra-network tags and its LoRA tags, in order.

    Each tag is removed where it stands (AUTOMATIC1111 replaces it with ""), so
    ``"a cat <lora:ink:0.7>, sketch"`` -> ``("a cat , sketch", (LoraTag("ink", 0.7),))``. Only
    the name is checked against what is loaded, later (the engine knows the available LoRAs).

    Raises:
        InvalidRequest: (naming ``field``) a weight that is not a finite number or is outside
            [-MAX_LORA_WEIGHT, MAX_LORA_WEIGHT]; more than one weight (A1111's separate
            text-encoder/UNet multipliers are not supported); an empty name; the same name twice;
            more than MAX_LORA_TAGS tags; an extra network of another type (``<hypernet:...>``),
            which this server does not have.
    """
    tags: list[LoraTag] = []
    problems: list[str] = []

    def found(match: re.Match) -> str:
        kind, args = match.group(1), match.group(2).split(":")
        if kind.lower() not in LORA_TYPES:
            problems.append(f"{match.group(0)!r}: extra networks of type {kind!r} are not supported here "
                            f"(only <lora:NAME:WEIGHT>)")
            return ""
        name = args[0].strip()
        if not name:
            problems.append(f"{match.group(0)!r}: the tag names no LoRA")
            return ""
        if len(args) > 2:
            problems.append(f"{match.group(0)!r}: one weight only (<lora:NAME:WEIGHT>); separate text-encoder "
                            f"and UNet weights are not supported")
            return ""
        weight = 1.0
        if len(args) == 2:
            try:
                weight = float(args[1].strip())
            except ValueError:
                problems.append(f"{match.group(0)!r}: the weight {args[1].strip()!r} is not a number")
                return ""
            if not math.isfinite(weight) or abs(weight) > MAX_LORA_WEIGHT:
                problems.append(f"{match.group(0)!r}: the weight must be between {-MAX_LORA_WEIGHT:g} and "
                                f"{MAX_LORA_WEIGHT:g}")
                return ""
        if any(t.name == name for t in tags):
            problems.append(f"{match.group(0)!r}: LoRA {name!r} is named twice")
            return ""
        tags.append(LoraTag(name, weight))
        return ""

    stripped = EXTRA_NETWORK.sub(found, text)
    if problems:
        raise InvalidRequest(field, problems[0])
    if len(tags) > MAX_LORA_TAGS:
        raise InvalidRequest(field, f"{len(tags)} LoRA tags; at most {MAX_LORA_TAGS} in one prompt")
    return stripped, tuple(tags)
