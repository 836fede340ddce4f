"""Packaging layout: models/, data_prep/, eval/ are served only as widedp.models, widedp.data_prep, widedp.eval."""

import importlib.util
import re
from pathlib import Path

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
    eval/ served as widedp.models, ...); only this file stays at the top."""
    misplaced = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        rel = path.parent.relative_to(ROOT / "tests")
        if rel == Path("."):
            ok = path.name == "test_layout.py"
        else:
            ok = (ROOT / "widedp" / rel).is_dir() or (ROOT / rel).is_dir() and rel.parts[0] in ("models", "data_prep",
                                                                                                 "eval")
        if not ok:
            misplaced.append(str(path.relative_to(ROOT)))
    assert misplaced == []
