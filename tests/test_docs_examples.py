"""Every python code block in README.md and docs/*.md runs as written, on its own, from the repository root."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((str(path.relative_to(ROOT)), line, match.group(1)))
    return found


def test_the_docs_have_examples():
    assert len(_blocks()) >= 4      # network, parallel-plan, schedules (2)


def _params() -> list:
    """Blocks that measure with torch (a minute on 2 cores) run with `-m scale`."""
    return [pytest.param(where, line, code, id=f"{where}:{line}",
                         marks=[pytest.mark.scale] if re.search(r"^import torch", code, re.MULTILINE) else [])
            for where, line, code in _blocks()]


@pytest.mark.parametrize("where,line,code", _params())
def test_a_documented_example_runs(where, line, code, monkeypatch):
    monkeypatch.chdir(ROOT)
    exec(compile(code, f"{where}:{line}", "exec"), {"__name__": "__doc_example__"})
