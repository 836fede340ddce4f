"""``widedp configs [NAME]``: the example configs that ship with widedp, for a user who installed it with pip.

The repository's ``configs/*.yaml`` are package data of the wheel (``widedp/configs/``, pyproject's package-data);
in a source checkout they are the repository's ``configs/``. Without NAME: where they are and one line on each (its
first comment line); with NAME: the file itself, to copy and edit. A sweep refers to its sibling configs by name, so
run a shipped file from where it is (``widedp train DIR/NAME.yaml``, ``widedp compare DIR/NAME.yaml``).
"""

from __future__ import annotations

from pathlib import Path

from widedp.errors import ConfigError

_PACKAGE = Path(__file__).resolve().parents[1]


def shipped_dir() -> Path:
    """The folder of the shipped configs: ``widedp/configs`` of an installed wheel, else the checkout's ``configs``."""
    for d in (_PACKAGE / "configs", _PACKAGE.parent / "configs"):
        if any(d.glob("*.yaml")):
            return d
    raise ConfigError(f"configs: no shipped configs found (looked in {_PACKAGE / 'configs'} and "
                      f"{_PACKAGE.parent / 'configs'})")


def describe(path: Path) -> str:
    """The file's first comment line (without ``# ``), and whether it is a sweep (``runs:``) for widedp compare."""
    lines = path.read_text(encoding="utf-8").splitlines()
    first = next((x.lstrip("#").strip() for x in lines if x.startswith("#") and x.lstrip("#").strip()), "")
    sweep = any(x.startswith("runs:") for x in lines)
    return " ".join(x for x in ("[sweep: widedp compare]" if sweep else "", first) if x)


def listing() -> str:
    """Where the shipped configs are, how to run one, and one line on each."""
    d = shipped_dir()
    paths = sorted(d.glob("*.yaml"))
    width = max(len(p.stem) for p in paths)
    head = (f"{len(paths)} example configs in {d}\n(print one: widedp configs NAME; run one: widedp train "
            f"{d / 'NAME.yaml'}; a sweep: widedp compare {d / 'NAME.yaml'})")
    return "\n".join([head, *(f"  {p.stem:<{width}}  {describe(p)}" for p in paths)])


def show(name: str) -> str:
    """The text of the shipped config ``name`` (with or without ``.yaml``)."""
    d = shipped_dir()
    path = d / f"{name.removesuffix('.yaml')}.yaml"
    if "/" in name or not path.is_file():
        raise ConfigError(f"configs: no shipped config named {name!r} (widedp configs lists them)")
    return path.read_text(encoding="utf-8")
