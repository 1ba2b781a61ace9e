"""The prompt's syntax, AUTOMATIC1111's, parsed in one place for every feature that reads it.

Extra networks (this file's first part): ``<lora:NAME>`` and ``<lora:NAME:WEIGHT>`` tags, found
and removed as AUTOMATIC1111's ``modules/extra_networks.py`` (``parse_prompt``, its pattern
``<(\\w+):([^>]+)>``) does, before the text is tokenized. ``lyco`` is an alias of ``lora`` there
(the built-in Lora extension registers both), so it is here too.

Emphasis and long prompts (this file's second part): ``(word:1.2)``, ``[word]``, ``BREAK``
parsed as A1111's ``modules/prompt_parser.py`` (``parse_prompt_attention``) does, after the extra
network tags are removed; then each tokenizer's tokens cut into chunks of 75 as A1111's
``modules/sd_hijack_clip.py`` (``tokenize_line``) does, each chunk BOS + 75 + EOS/pad = 77 ids
with a weight per id. One syntax for the page, the engine and every API.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import NamedTuple

import numpy as np

from sdxl_engine.config import EMPHASIS_MODES
from sdxl_engine.engine.errors import InvalidRequest

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


# ---- Emphasis and BREAK: AUTOMATIC1111 modules/prompt_parser.py, parse_prompt_attention --------------------------

# The tokens of A1111's re_attention, in its order: escapes, a lone backslash, openers, a weighted
# closer ":1.3)", closers, plain text, a lone colon.
ATTENTION = re.compile(r"""
\\\(|\\\)|\\\[|\\]|\\\\|\\|
\(|\[|
:([+-]?[.\d]+)\)|
\)|]|
[^\\()\[\]:]+|
:
""", re.X)
# A1111's re_break: BREAK as a word, with the spaces around it.
BREAK_WORD = re.compile(r"\s*\bBREAK\b\s*", re.S)
ROUND, SQUARE = 1.1, 1 / 1.1  # A1111's round_bracket_multiplier and square_bracket_multiplier
MAX_WEIGHT = 10.0  # |weight| limit: a token's weight past it is clamped (with a warning)


class Segment(NamedTuple):
    """A run of prompt text with one weight; ``is_break`` marks a BREAK (its text "BREAK", weight -1)."""

    text: str
    weight: float
    is_break: bool = False


def parse_prompt_attention(text: str) -> list[Segment]:
    """Split prompt text into runs of text with their emphasis weights, as AUTOMATIC1111 does.

    Rules (A1111 ``modules/prompt_parser.py``, ``parse_prompt_attention``; its documented examples
    hold exactly, tests/engine/test_prompts.py): ``(x)`` multiplies x's weight by 1.1,
    ``(x:1.3)`` by 1.3, ``[x]`` divides it by 1.1; brackets nest (weights multiply, innermost
    first); ``\\(`` ``\\)`` ``\\[`` ``\\]`` ``\\\\`` are the literal characters; a closer with no
    opener is literal text; brackets still open at the end are closed there (round ones first);
    ``(x:abc)`` is literal ``x:abc`` at 1.1 (a weight that is not a number is text); ``BREAK``
    (the word, upper case) ends the chunk. Runs of equal weight are merged.

    Two differences from A1111, both where A1111 misbehaves: a BREAK inside brackets still
    breaks (A1111 multiplies its -1 marker, and then tokenizes the word "BREAK"), two BREAKs in a
    row are two breaks (A1111 merges them into the text "BREAKBREAK"); and a weight such as
    ``1.2.3`` that ``float()`` refuses is read as text (A1111 raises).

    Without recursion, in O(segments x brackets) time with NumPy slices (10,000 nested brackets
    are fine). Weights are float64 products in A1111's order, so they equal its to the last bit.

    Returns:
        Segments in order; ``[Segment("", 1.0)]`` for text with no segment at all.
    """
    texts: list[str] = []  # the segments' texts; a BREAK's is "BREAK"
    breaks: list[int] = []  # indices of BREAK segments
    ops: list[tuple[int, int, float]] = []  # (start, end, multiplier) in A1111's order of application
    round_open: list[int] = []
    square_open: list[int] = []

    def plain(part: str) -> None:
        for i, piece in enumerate(BREAK_WORD.split(part)):
            if i > 0:
                breaks.append(len(texts))
                texts.append("BREAK")
            texts.append(piece)

    for match in ATTENTION.finditer(text):
        token, weight = match.group(0), match.group(1)
        if token.startswith("\\"):
            texts.append(token[1:])
        elif token == "(":
            round_open.append(len(texts))
        elif token == "[":
            square_open.append(len(texts))
        elif weight is not None and round_open:
            try:
                multiplier = float(weight)
            except ValueError:  # "1.2.3": text, then its ")" closes the bracket as a plain one
                plain(token[:-1])
                multiplier = ROUND
            ops.append((round_open.pop(), len(texts), multiplier))
        elif token == ")" and round_open:
            ops.append((round_open.pop(), len(texts), ROUND))
        elif token == "]" and square_open:
            ops.append((square_open.pop(), len(texts), SQUARE))
        else:
            plain(token)
    ops += [(start, len(texts), ROUND) for start in round_open]
    ops += [(start, len(texts), SQUARE) for start in square_open]

    weights = np.ones(len(texts), np.float64)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # 1.1 ** 10000 is inf: clamped later
        for start, end, multiplier in ops:
            weights[start:end] *= multiplier
    is_break = np.zeros(len(texts), bool)
    is_break[breaks] = True
    segments: list[Segment] = []
    for piece, weight, brk in zip(texts, weights.tolist(), is_break.tolist()):
        if brk:
            segments.append(Segment("BREAK", -1.0, True))
        elif segments and not segments[-1].is_break and segments[-1].weight == weight:
            segments[-1] = Segment(segments[-1].text + piece, weight)
        else:
            segments.append(Segment(piece, weight))
    return segments or [Segment("", 1.0)]


# ---- Long prompts: AUTOMATIC1111 modules/sd_hijack_clip.py, tokenize_line ------------------------------------------

CHUNK = 75  # prompt tokens per chunk (A1111's chunk_length); with BOS and EOS each chunk is TOKENS ids
TOKENS = CHUNK + 2  # CLIP's context length: one chunk through a text encoder
COMMA_BACKTRACK = 20  # A1111's comma_padding_backtrack default: move a phrase cut this close to its comma
_UNTRUNCATED = 1 << 30  # a max_length no prompt reaches: no truncation, and no "sequence too long" log line


@dataclasses.dataclass(frozen=True)
class PromptTokens:
    """One prompt (or negative prompt) as chunks of 77 token ids for both tokenizers.

    Attributes:
        ids: (2, chunks * 77) int32; row 0 for ``tokenizer``, row 1 for ``tokenizer_2``; chunk c
            is ``[:, 77 c : 77 (c + 1)]``: BOS, up to 75 tokens, EOS, then the tokenizer's own pad
            token (diffusers' layout of one chunk, so a prompt of 75 tokens or fewer is today's ids).
        weights: (2, chunks * 77) float32 emphasis weight of each id (1.0 for BOS, EOS and pad),
            within [-MAX_WEIGHT, MAX_WEIGHT].
        chunks: the chunk count (the program's static ``chunks``).
        cut: chunks past ``max_chunks`` were dropped.
        clamped: a weight past +-MAX_WEIGHT was clamped.
        words: the text without its syntax (brackets, weights, BREAK, extra-network tags).
        empty_chunk: (2, 77) int32 ids of the empty prompt's chunk, what :meth:`padded` appends.
        scheduled: the spans of A1111's prompt editing (``[from:to:when]``) and alternation (``[a|b]``) in the
            text (:func:`scheduled_spans`): not done here, read as words (the engine warns).
    """

    ids: np.ndarray
    weights: np.ndarray
    chunks: int
    cut: bool
    clamped: bool
    words: str
    empty_chunk: np.ndarray
    scheduled: tuple[str, ...] = ()

    def padded(self, chunks: int) -> PromptTokens:
        """This prompt with the empty prompt's chunk appended up to ``chunks`` chunks (weights 1), as
        A1111 pads the shorter of the prompt and negative prompt ("pad prompt/negative prompt to be
        same length"), so both have one shape."""
        extra = chunks - self.chunks
        if extra <= 0:
            return self
        ids = np.concatenate([self.ids] + [self.empty_chunk] * extra, axis=1)  # (2, chunks * 77)
        weights = np.concatenate([self.weights, np.ones((2, extra * TOKENS), np.float32)], axis=1)
        return dataclasses.replace(self, ids=ids, weights=weights, chunks=chunks)


@functools.lru_cache(maxsize=16)
def _comma_id(tokenizer) -> int | None:
    """The id of the word-final comma ``,</w>`` (A1111's ``comma_token``), None if the vocabulary has none."""
    return tokenizer.get_vocab().get(",</w>")


def _chunk(tokenizer, tokens: list[int], multipliers: list[float]) -> tuple[list[int], list[float]]:
    """BOS + tokens + EOS + pad to 77 ids, and their weights (1.0 outside the tokens)."""
    pad = CHUNK - len(tokens)
    ids = [tokenizer.bos_token_id, *tokens, tokenizer.eos_token_id] + [tokenizer.pad_token_id] * pad
    return ids, [1.0, *multipliers] + [1.0] * (pad + 1)


def chunk_tokens(segments: list[Segment], tokenizer,
                 comma_backtrack: int = COMMA_BACKTRACK) -> list[tuple[list[int], list[float]]]:
    """One tokenizer's chunks of a parsed prompt: A1111's ``tokenize_line`` (sd_hijack_clip.py).

    Each segment's text is tokenized on its own (no BOS/EOS); tokens fill chunks of 75 with the
    segment's weight; when a chunk is full and its last comma is at most ``comma_backtrack``
    tokens back, the tokens after that comma move to the next chunk (A1111's
    ``comma_padding_backtrack``; 0 turns it off); a BREAK closes the chunk (even an empty one,
    as A1111 does); a last, partly filled chunk is kept, and an empty prompt is one empty chunk.

    Returns:
        chunks, each (ids, weights) of 77: see :func:`_chunk` for the layout.
    """
    comma = _comma_id(tokenizer)
    texts = [s.text for s in segments if not s.is_break]
    tokenized = iter(tokenizer(texts, add_special_tokens=False, truncation=True,
                               max_length=_UNTRUNCATED).input_ids if texts else [])
    chunks: list[tuple[list[int], list[float]]] = []
    tokens: list[int] = []
    multipliers: list[float] = []
    last_comma = -1
    for segment in segments:
        if segment.is_break:
            chunks.append(_chunk(tokenizer, tokens, multipliers))
            tokens, multipliers, last_comma = [], [], -1
            continue
        for token in next(tokenized):
            if token == comma:
                last_comma = len(tokens)
            elif (comma_backtrack and len(tokens) == CHUNK and last_comma != -1
                  and CHUNK - last_comma <= comma_backtrack):
                cut = last_comma + 1  # the phrase after the comma starts the next chunk
                chunks.append(_chunk(tokenizer, tokens[:cut], multipliers[:cut]))
                tokens, multipliers, last_comma = tokens[cut:], multipliers[cut:], -1
            if len(tokens) == CHUNK:
                chunks.append(_chunk(tokenizer, tokens, multipliers))
                tokens, multipliers, last_comma = [], [], -1
            tokens.append(token)
            multipliers.append(segment.weight)
    if tokens or not chunks:
        chunks.append(_chunk(tokenizer, tokens, multipliers))
    return chunks


# A1111's prompt editing, [from:to:when], [to:when], [from::when] (when: a fraction of the steps or a step), and
# alternation, [a|b|...] (modules/prompt_parser.py's grammar), innermost brackets, not escaped (\[ is a bracket).
_SCHEDULED = re.compile(r"(?<!\\)\[(?:[^\[\]\\]|\\.)*?(?::\s*-?(?:\d+\.?\d*|\.\d+)\s*|\|(?:[^\[\]\\]|\\.)*?)(?<!\\)\]")


def scheduled_spans(text: str) -> tuple[str, ...]:
    """The spans of ``text`` in A1111's prompt editing or alternation syntax (``[red:blue:0.5]``, ``[cat:10]``,
    ``[red|blue]``), which change the prompt during the steps there; this engine encodes one prompt for every step,
    so they are read as words (brackets as ÷1.1 emphasis). Escaped brackets (a backslash before them) are text."""
    return tuple(m.group(0) for m in _SCHEDULED.finditer(text))


def check_prompt(text: str, loras: tuple[str, ...] | frozenset[str] = (), field: str = "prompt",
                 model: str = "") -> None:
    """Refuse a prompt the engine could not read, before it is queued or tokenized (validation.validate).

    Args:
        text: the prompt as typed (cleaned by validation.clean_text).
        loras: the names of the loaded LoRAs its tags may pick.
        field: the request field it came in (``hires_prompt`` for hires fix's second pass).
        model: the name of the model the request is for ("": not named in the message), whose LoRAs ``loras`` are
            (a server with several models loads each LoRA for the models it fits).
    Raises:
        InvalidRequest (``field``): a malformed tag (:func:`parse_lora_tags`); a tag naming a LoRA
            not in ``loras`` (the message lists the loaded ones); a prompt with no words once tags,
            brackets, weights and BREAK are read (A1111 would encode an empty prompt).
    """
    stripped, tags = parse_lora_tags(text, field)
    for tag in tags:
        if tag.name not in loras:
            available = (f"available: {', '.join(sorted(loras))}" if loras else
                         f"none are loaded{f' for the model {model!r}' if model else ''} (start with --lora "
                         "NAME=PATH or --lora-dir DIR" + ("; a LoRA made for another model is left out for it)"
                                                          if model else ")"))
            typed = re.search(r"<(?:lora|lyco):" + re.escape(tag.name) + r"(?::[^<>]*)?>", text)  # as the user wrote it
            shown = typed.group(0) if typed else f"<lora:{tag.name}>"
            raise InvalidRequest(field, f"unknown LoRA {tag.name!r} in {shown}; {available}")
    if not "".join(" " if s.is_break else s.text for s in parse_prompt_attention(stripped)).strip():
        raise InvalidRequest(field, "is empty: it holds only brackets, weights or BREAK, no words"
                             + (" (besides its LoRA tags)" if tags else ""))


def tokenize_prompt(tokenizers, text: str, max_chunks: int, emphasis: str = "original",
                    field: str = "prompt", lora_tags: bool = True) -> PromptTokens:
    """A prompt as A1111 reads it, for SDXL's two tokenizers: tags removed, syntax parsed, chunks of 75.

    Args:
        tokenizers: (tokenizer, tokenizer_2), transformers CLIPTokenizers.
        text: the prompt as typed; with ``lora_tags``, its ``<lora:...>`` tags are removed first
            (:func:`parse_lora_tags`). The negative prompt passes False: A1111 reads extra networks in
            the prompt only, so there a tag is text.
        max_chunks: chunks kept (``max_prompt_chunks``); past it the prompt is cut (``cut``).
        emphasis: "original" (weights as parsed) or "none" (the syntax is read, every weight is 1).
        field: names the field in errors.
    Returns:
        :class:`PromptTokens`; when the tokenizers chunk differently, the one with fewer chunks is
        padded with the empty prompt's chunk (SDXL's two tokenizers share a vocabulary, so they agree).
    Raises:
        InvalidRequest: a bad extra-network tag (:func:`parse_lora_tags`).
        ValueError: ``emphasis`` not one of :data:`EMPHASIS_MODES`.
    """
    if emphasis not in EMPHASIS_MODES:
        raise ValueError(f"emphasis must be one of {', '.join(EMPHASIS_MODES)}, got {emphasis!r}")
    if lora_tags:
        text, _ = parse_lora_tags(text, field)
    segments = parse_prompt_attention(text)
    rows = [chunk_tokens(segments, tok) for tok in tokenizers]
    empty = [_chunk(tok, [], []) for tok in tokenizers]
    count = max(len(row) for row in rows)
    rows = [row + [blank] * (count - len(row)) for row, blank in zip(rows, empty)]
    kept = min(count, max_chunks)
    ids = np.asarray([[i for chunk, _ in row[:kept] for i in chunk] for row in rows], np.int32)  # (2, kept * 77)
    weights = np.asarray([[w for _, ws in row[:kept] for w in ws] for row in rows], np.float64)
    clamped = False
    if emphasis == "none":
        weights = np.ones_like(weights)
    else:
        clamped = bool(np.any(~(np.abs(weights) <= MAX_WEIGHT)))  # NaN (0 x inf) counts as out of range
        weights = np.clip(np.nan_to_num(weights, nan=0.0), -MAX_WEIGHT, MAX_WEIGHT)
    return PromptTokens(ids=ids, weights=weights.astype(np.float32), chunks=kept, cut=count > max_chunks,
                        clamped=clamped, words="".join(" " if s.is_break else s.text for s in segments),
                        empty_chunk=np.asarray([chunk for chunk, _ in empty], np.int32),
                        scheduled=scheduled_spans(text))
