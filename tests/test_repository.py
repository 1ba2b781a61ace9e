"""The repository's own text: README's first example, no stale hints."""

import re

from sdxl_engine.checkpoint.builtin import TINY_SHAPES_DIR, unknown_words
from tests.helpers import ROOT


def test_no_hint_asks_for_the_old_flax_revision():
    """SDXL base's Flax weights are on its main branch: nothing tells users to pass refs/pr/95."""
    for path in [ROOT / "README.md", ROOT / "app.py", *(ROOT / "sdxl_engine").rglob("*.py")]:
        assert "refs/pr/" not in path.read_text(), path


def test_readme_first_python_example_works_with_the_default_model():
    """The first thing a user tries: an in-vocabulary prompt, no style (styles pull tiny-shapes off the prompt)."""
    readme = (ROOT / "README.md").read_text()
    example = readme[readme.index("```python"):]
    call = example[:example.index("```", 3)]
    prompt = re.search(r'prompt="([^"]+)"', call)[1]
    assert unknown_words(prompt, frozenset((TINY_SHAPES_DIR / "vocabulary.txt").read_text().split())) == []
    assert "style=" not in call
