"""Every program in examples/ runs and exits 0, and the examples and the README's Python blocks
pass mypy --strict (what users copy must type-check); every link in the docs resolves in the repo."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(example: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(example)], cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, f"{example.name} exited {out.returncode}\n{out.stdout}\n{out.stderr}"


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_examples_and_readme_type_check(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    blocks = _readme_blocks()
    assert blocks, "the README has a Python example"
    files = [str(p) for p in EXAMPLES]
    for i, block in enumerate(blocks):
        path = tmp_path / f"readme_{i}.py"
        path.write_text(block)
        files.append(str(path))
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", *files],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr


LINK = re.compile(
    r"\]\(([^)#\s]+)(?:#[^)]*)?\)|`((?:docs|examples|scripts|benchmarks|tests|python|fabric-lib)/[^`\s]*)`"
)


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_doc_links_resolve_inside_the_repo(doc: Path) -> None:
    text = doc.read_text()
    assert "../shared" not in text and "$OUT" not in text
    missing = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        base = doc.parent if match.group(1) else REPO
        path = target.split("::")[0].rstrip(".,:;")
        if not (base / path).exists() and not any(ch in path for ch in "*<>{}"):
            missing.append(target)
    assert missing == [], f"{doc.relative_to(REPO)} points at missing files: {missing}"


def test_readme_example_runs(tmp_path: Path) -> None:
    for i, block in enumerate(_readme_blocks()):
        path = tmp_path / f"readme_{i}.py"
        path.write_text(block)
        out = subprocess.run(
            [sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, f"README block {i}:\n{block}\n{out.stderr}"


# Words about the project's own working environment, which mean nothing to a user of a clone
# (the project's issue tracker included).
INTERNAL = re.compile(
    r"these hosts|carry it|\$OUT\b|\.\./shared|REFERENCE\.md|our (GPU )?(machines|hosts)|\bissue #?\d+",
    re.I,
)
PUBLIC_TEXT = [
    "README.md",
    "docs",
    "examples",
    "python",
    "scripts",
    "benchmarks",
    "pyproject.toml",
    "python-ext",
    "fabric-lib",
    "p2p-all-to-all",
    "rust",
]


def test_public_text_does_not_speak_of_internal_context() -> None:
    hits = []
    for entry in PUBLIC_TEXT:
        root = REPO / entry
        for path in [root] if root.is_file() else sorted(root.rglob("*")):
            if path.is_file() and path.suffix in {".md", ".py", ".pyi", ".sh", ".rs", ".toml", ".txt"}:
                for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if INTERNAL.search(line):
                        hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert hits == [], "\n".join(hits)
