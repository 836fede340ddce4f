"""Packaging layout: models/, data_prep/, eval/ are served only as widedp.models, widedp.data_prep, widedp.eval."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BARE = re.compile(r"^\s*(import|from)\s+(models|eval|data_prep)(\.|\s|$)", re.M)


def test_no_bare_imports_of_served_packages():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if ".venv" in path.parts or "build" in path.parts:
            continue
        if BARE.search(path.read_text(encoding="utf-8")):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_served_packages_resolve_inside_widedp():
    for name, folder in (("widedp.models", "models"), ("widedp.data_prep", "data_prep"), ("widedp.eval", "eval")):
        spec = importlib.util.find_spec(name)
        assert spec is not None and Path(spec.origin).parent == ROOT / folder


def test_pyproject_lists_every_package():
    text = (ROOT / "pyproject.toml").read_text()
    body = re.search(r"^packages = \[(.*?)\]", text, re.M | re.S).group(1)
    listed = {p.strip().strip('"') for p in body.split(",") if p.strip()}
    found = {"widedp." + p.parent.relative_to(ROOT / "widedp").as_posix().replace("/", ".")
             for p in (ROOT / "widedp").rglob("__init__.py") if p.parent != ROOT / "widedp"}
    found |= {"widedp", "widedp.models", "widedp.data_prep", "widedp.eval"}
    assert found <= listed, found - listed


def test_tests_mirror_the_package():
    """tests/<folder>/test_*.py tests the package folder of the same name (widedp/<folder>, or models/, data_prep/,
    eval/ served as widedp.models, ...); only this file and test_packaging.py stay at the top."""
    misplaced = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        rel = path.parent.relative_to(ROOT / "tests")
        if rel == Path("."):
            ok = path.name in ("test_layout.py", "test_packaging.py")
        else:
            ok = (ROOT / "widedp" / rel).is_dir() or (ROOT / rel).is_dir() and rel.parts[0] in ("models", "data_prep",
                                                                                                 "eval")
        if not ok:
            misplaced.append(str(path.relative_to(ROOT)))
    assert misplaced == []


# ---------------------------------------------------------------------------------------------- the documentation

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
FIRST_SCREEN_LINES = 60


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lowercased, punctuation dropped, spaces as hyphens)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6} (.*)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page):
    """README.md's and docs/*.md's relative links (and images) name a file of the repository, and their #anchor a
    heading of it."""
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        inside = dest.exists() and ROOT.resolve() in (dest, *dest.parents)
        if not inside or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert broken == []


def test_readme_first_screen_fits_sixty_lines():
    """What and why, the two commands, the library and where to go next: up to the end of "## Where to go next"."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## Where to go next"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    assert end <= FIRST_SCREEN_LINES, f"README's first screen is {end} lines"
    assert "make train" in "\n".join(lines[:end]) and "make test" in "\n".join(lines[:end])


def test_topic_pages_have_no_work_log_headings():
    """Headings name topics; 'issue N' / 'session N' belong in docs/history.md (the work log) only."""
    offenders = []
    for page in DOCS:
        if page.name == "history.md":
            continue
        for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
            if re.match(r"^#{1,6} .*\b(issue|session)s? \d", line, re.I):
                offenders.append(f"{page.name}: {line}")
    assert offenders == []
