"""Built-in models that need no download: a trained tiny SDXL, and the architecture at two scales.

* ``tiny-shapes`` (the default): the SDXL architecture scaled to 64x64 images, trained here on
  captioned shapes (``python -m tools.train``); shipped as ``assets/tiny-shapes``.

* ``tiny-random``: the SDXL architecture (two CLIP text encoders, the second with projection and
  its pooled output feeding ``text_embeds``; a UNet with ``text_time`` added conditioning and
  cross-attention; a KL VAE; the Euler discrete scheduler) scaled down so a 4-image request
  runs in well under a second on a CPU. Deterministic (fixed PRNG seeds), written once in
  diffusers format under the model cache and loaded from there like any other model.
* ``sdxl-base-random``: the real SDXL 1.0 base configuration (UNet 2.57 B params, configs in
  ``sdxl_engine/checkpoint/configs/sdxl-base-1.0``) with random weights made on the devices, for benchmarks
  on any machine; never written to disk.

The tokenizer vocabulary is the project's own: CLIP's 512 byte-level base symbols, BPE merges
that spell out a fixed English word list, then ``<|startoftext|>`` and ``<|endoftext|>`` last
so that ``input_ids.argmax()`` finds the end token, which CLIP's pooling relies on.
"""

from __future__ import annotations

import json
import shutil
import string
import tempfile
import unicodedata
from pathlib import Path

import numpy as np
from transformers import CLIPTokenizer

from sdxl_engine.checkpoint.writing import save_folder
from sdxl_engine.models import build_component
from sdxl_engine.models.random_weights import random_params

# SDXL 1.0 base's config.json files, byte-identical to the hub's (sdxl_engine/checkpoint/configs/README.md).
SDXL_BASE_DIR = Path(__file__).resolve().parent / "configs" / "sdxl-base-1.0"
_HEADERS = ("_class_name", "_diffusers_version", "_name_or_path", "architectures", "model_type", "torch_dtype",
            "transformers_version")


def _config(path: Path) -> dict:
    """A config.json without its class and version header."""
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in _HEADERS}


# Scheduler of SDXL 1.0 base (Euler, leading spacing, steps_offset 1), shared by every built-in model.
SDXL_SCHEDULER = _config(SDXL_BASE_DIR / "scheduler" / "scheduler_config.json")
# SDXL 1.0 base's components (UNet 2.57 B params), for ``sdxl-base-random`` and the full-size cost report.
SDXL_BASE_CONFIGS = {name: _config(SDXL_BASE_DIR / name / "config.json")
                     for name in ("text_encoder", "text_encoder_2", "unet", "vae")}

# The same architecture scaled down: 64x64 images, 16x16 latents (VAE factor 4).
TINY = dict(
    unet=dict(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        attention_head_dim=(2, 4),
        cross_attention_dim=64,  # text_encoder (32) + text_encoder_2 (32) hidden sizes
        use_linear_projection=True,
        transformer_layers_per_block=(1, 1),
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 32,  # 6 add_time_ids x 8 + text_embeds (32)
    ),
    vae=dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(32, 32, 64),
        layers_per_block=1,
        latent_channels=4,
        sample_size=64,
        norm_num_groups=16,
        scaling_factor=0.13025,
    ),
    text_encoder=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      hidden_act="quick_gelu", projection_dim=32),
    text_encoder_2=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        hidden_act="gelu", projection_dim=32),
)

BUILTIN_NAMES = ("tiny-shapes", "tiny-random", "sdxl-base-random")


def _assets_dir() -> Path:
    """The shipped assets: the installed package's ``sdxl_engine/assets/`` (pyproject.toml maps the repository's
    top-level ``assets/`` there), else, in a checkout (``python app.py``, an editable install), ``assets/`` beside
    the package."""
    package = Path(__file__).resolve().parents[1]
    return package / "assets" if (package / "assets").is_dir() else package.parent / "assets"


# ``tiny-shapes``: the SDXL architecture at 64x64, trained by ``python -m tools.train`` on
# the captioned shapes of tools/shapes.py and shipped in the repository (diffusers format).
TINY_SHAPES_DIR = _assets_dir() / "tiny-shapes"

# Words the project's tokenizer spells as whole tokens: SDXL-style prompt words and the
# vocabulary of the built-in demo data (shapes, colours, positions, sizes, styles).
WORDS = """
a an the of on in at with and or to by for from is no not very small large big tiny huge
circle square triangle star diamond cross heart hexagon pentagon ring ellipse rectangle shape shapes
red orange yellow green cyan blue purple pink magenta white black gray grey brown gold silver
background backdrop left right top bottom centre center middle corner upper lower
photo photograph picture image drawing painting render illustration sketch art style
cinematic photographic anime manga digital pixel fantasy neonpunk model 3d film still
high quality detailed sharp blurry lowres low ugly bad deformed noisy dark bright light
sky sea water tree house cat dog car city mountain sun moon flower person face
""".split()


ZWJ = "\u200d"  # joins emoji into one (👨‍👩‍👧); invisible


def _attaches(char: str) -> bool:
    """Whether ``char`` modifies the character before it: a combining mark (accents, the emoji
    variation selector U+FE0F, the keycap U+20E3) or an emoji skin-tone modifier (U+1F3FB-1F3FF)."""
    return unicodedata.category(char) in ("Mn", "Me") or 0x1F3FB <= ord(char) <= 0x1F3FF


def _flag_half(text: str) -> bool:
    """Whether ``text`` is one regional indicator letter: two of them make a flag (🇫🇷)."""
    return len(text) == 1 and 0x1F1E6 <= ord(text) <= 0x1F1FF


def prompt_words(text: str) -> list[str]:
    """The distinct words of ``text``, NFC-normalised and lower-cased, in order, as a reader sees them.

    A word is a run of letters, digits and ``_``, or one symbol (punctuation, an emoji) with what
    attaches to it: combining marks, skin-tone modifiers, variation selectors, further symbols
    joined by ZWJ, a flag's second letter; so ``👍🏽``, ``❤️`` and ``👨‍👩‍👧`` are one word each.
    Invisible characters are never words: format characters (Unicode Cf: a ZWJ outside an emoji
    sequence, zero-width spaces, soft hyphens) and marks with nothing before them are dropped
    (the engine's prompts have none left: validation.clean_text blanks them).
    """
    words, word, joined = [], "", False

    def flush() -> None:
        nonlocal word
        word = word.rstrip(ZWJ)  # a trailing joiner joins nothing
        if word and word not in words:
            words.append(word)
        word = ""

    for char in unicodedata.normalize("NFC", text.lower()):
        if char.isspace():
            flush()
        elif _attaches(char) or unicodedata.category(char) == "Cf":
            if word and (char == ZWJ or unicodedata.category(char) != "Cf"):
                word += char
        elif char.isalnum() or char == "_":
            if not (word and (joined or word[-1].isalnum() or word[-1] == "_" or _attaches(word[-1]))):
                flush()
            word += char
        else:  # a symbol: a word of its own, unless a ZWJ joins it to the one before (or it ends a flag)
            if not (word and (joined or _flag_half(word) and _flag_half(char))):
                flush()
            word += char
        joined = char == ZWJ and bool(word)
    flush()
    return words


def unknown_words(text: str, known: frozenset[str], limit: int = 12) -> list[str]:
    """The distinct words of ``text`` (:func:`prompt_words`: emoji and other symbols too, never an
    invisible character) that are not in ``known``, in order, at most ``limit``. ASCII
    punctuation is not a word."""
    found = [w for w in prompt_words(text) if w not in known and not all(c in string.punctuation for c in w)]
    return found[:limit]


def bytes_to_unicode() -> dict[int, str]:
    """CLIP's reversible byte -> printable-unicode table (openai/CLIP simple_tokenizer.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """CLIP's BPE on one word: merge the lowest-ranked adjacent pair until none is known."""
    while len(symbols) > 1:
        pairs = [(ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(symbols, symbols[1:]))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        symbols = symbols[:i] + [symbols[i] + symbols[i + 1]] + symbols[i + 2:]
    return symbols


def build_vocab(words=WORDS) -> tuple[dict[str, int], list[str]]:
    """Vocabulary and BPE merges, CLIP layout: base symbols, merged tokens, then the two specials.

    Every listed word becomes one token: the word is first split as the merges so far split it
    (lowest rank first, as the tokenizer will), then new merges join what is left, left to
    right. New merges rank after all earlier ones, so they never change an earlier word's
    tokens. Any other text still tokenizes, symbol by symbol.
    """
    base = list(bytes_to_unicode().values())
    vocab_list = base + [s + "</w>" for s in base]
    ranks: dict[tuple[str, str], int] = {}
    known = set(vocab_list)
    for word in dict.fromkeys(words):
        symbols = _bpe(list(word[:-1]) + [word[-1] + "</w>"], ranks)
        while len(symbols) > 1:
            ranks.setdefault((symbols[0], symbols[1]), len(ranks))
            merged = symbols[0] + symbols[1]
            if merged not in known:
                known.add(merged)
                vocab_list.append(merged)
            symbols = [merged] + symbols[2:]
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab_list)}, [" ".join(pair) for pair in ranks]


def write_tokenizers(out: Path) -> int:
    """Write ``tokenizer/`` and ``tokenizer_2/`` (CLIPTokenizer files) under ``out``; return vocab size."""
    vocab, merges = build_vocab()
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps(vocab))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    for sub, pad in (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")):  # SDXL's two pad tokens
        tok = CLIPTokenizer(str(out / "vocab.json"), str(out / "merges.txt"), pad_token=pad, model_max_length=77)
        tok.save_pretrained(str(out / sub))
    (out / "vocab.json").unlink()
    (out / "merges.txt").unlink()
    return len(vocab)


def clip_config(spec: dict, vocab_size: int) -> dict:
    """A CLIPTextConfig dict (config.json fields) for one text encoder of a spec, over the project's vocabulary."""
    return {"vocab_size": vocab_size, "max_position_embeddings": 77, "bos_token_id": vocab_size - 2,
            "eos_token_id": vocab_size - 1, "pad_token_id": 1, "layer_norm_eps": 1e-5, **spec}


def component_configs(spec: dict, vocab_size: int) -> dict[str, dict]:
    """{component: config.json dict} of an SDXL-architecture spec such as :data:`TINY`."""
    return {"text_encoder": clip_config(spec["text_encoder"], vocab_size),
            "text_encoder_2": clip_config(spec["text_encoder_2"], vocab_size),
            "unet": dict(spec["unet"]), "vae": dict(spec["vae"])}


def create_tiny_random(out: Path, seed: int = 0) -> Path:
    """Create the ``tiny-random`` model in diffusers format at ``out`` (a few MB, safetensors); return ``out``.

    Written to a temporary sibling first and renamed, so a crash never leaves half a model.
    """
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    configs = component_configs(TINY, write_tokenizers(tmp))
    components = {name: build_component(name, config) for name, config in configs.items()}
    # The fill of models/random_weights.py (the modules' initial statistics, one small kernel per
    # shape): seconds, where jitting the modules' own initialisers took minutes to compile.
    params = {k: {n: np.asarray(a) for n, a in v.items()}
              for k, v in random_params(components, np.float32, seed=seed).items()}
    save_folder(tmp, configs, params, SDXL_SCHEDULER, vocabulary=WORDS)
    tmp.rename(out)
    return out


def model_path(name: str, cache_dir: str) -> Path:
    """The folder of a built-in model: the shipped ``tiny-shapes``, or ``tiny-random`` created on first use.

    Creation is atomic (a private temp folder, then rename), so concurrent starts are safe.
    Raises ValueError for ``sdxl-base-random`` (made in memory, see :mod:`sdxl_engine.checkpoint.loading`) or an
    unknown name, FileNotFoundError when the shipped model is missing.
    """
    if name == "tiny-shapes":
        if not (TINY_SHAPES_DIR / "model_index.json").is_file():
            raise FileNotFoundError(f"the shipped model is missing from {TINY_SHAPES_DIR}; "
                                    "recreate it with: python -m tools.train --out assets/tiny-shapes")
        return TINY_SHAPES_DIR
    if name != "tiny-random":
        raise ValueError(f"{name!r} has no folder")
    out = Path(cache_dir) / f"{name}-v3"  # v3: safetensors written by the own modules, weights from the fill
    if (out / "model_index.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        create_tiny_random(staging / out.name).rename(out)
    except OSError:  # another process finished first: use its copy
        pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out

