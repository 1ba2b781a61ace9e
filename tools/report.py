"""docs/benchmarks.md sections that the benchmark commands rewrite in place."""

from __future__ import annotations

from pathlib import Path


def write_section(md_path: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- bench:NAME:begin/end -->`` in docs/benchmarks.md (appended if absent)."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    text = md_path.read_text() if md_path.exists() else "# Benchmarks\n"
    if begin not in text:
        text = text.rstrip("\n") + f"\n\n{begin}\n{end}\n"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    md_path.write_text(f"{head}{begin}\n{body}\n{end}{tail}")
