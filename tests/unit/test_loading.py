"""Loading without a compile: the built-in tokenizer's vocabulary, a missing model folder."""

import pytest

from sdxl_engine.checkpoint.builtin import build_vocab
from sdxl_engine.checkpoint.loading import ModelLoadError, load_model


def test_tokenizer_vocabulary_is_the_projects():
    vocab, merges = build_vocab()
    assert list(vocab)[-2:] == ["<|startoftext|>", "<|endoftext|>"]  # end token has the largest id
    for word in ("red", "circle", "square", "blue"):
        assert word + "</w>" in vocab


def test_missing_model_directory_gives_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a built-in name, an existing directory nor a hub id"):
        load_model(str(tmp_path / "nope"), dtype="auto", platform="cpu", cache_dir=str(tmp_path))
    with pytest.raises(ModelLoadError, match="no model_index.json"):
        load_model(str(tmp_path), dtype="auto", platform="cpu", cache_dir=str(tmp_path))
