"""Write the key reference of docs/configs.md from the config dataclasses (``widedp/config/*.py``).

    python scripts/config_docs.py           # (re)write docs/configs.md below its hand-written introduction
    python scripts/config_docs.py --check   # exit 1 when docs/configs.md differs from what the dataclasses give

Every key of every section (the tasks of ``widedp.config.TASK_SECTIONS``, ``train``, ``dp``, ``dp.preselect`` and
each ``dp.selection`` of ``widedp.config.selection.SELECTIONS``) gets its type, its default and a one-line meaning:
the first sentence of the key's entry in its class's ``Args:`` docstring (the whole entry is in docs/api.md). A key
without an entry is an error, so a new field cannot go undocumented. Everything above ``MARKER`` in docs/configs.md
is the hand-written introduction and is kept as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "configs.md"
MARKER = "<!-- Generated below by `python scripts/config_docs.py` from widedp/config/*.py; do not edit by hand. -->"

_NAME = r"[a-z_][a-z0-9_]*"
_NAMES = re.compile(rf"({_NAME}(?:, {_NAME})*): ")


def _code(text: str) -> str:
    """reST literals as Markdown: ``x`` -> `x`."""
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return _code(text).replace("|", "\\|")


def args_entries(cls: type) -> dict[str, str]:
    """Each key's entry in the ``Args:`` part of ``cls``'s docstring, joined into one line. An entry is ``name:`` or
    ``a, b, c:`` at the start of a line of the block or after a sentence's end, where the names are fields."""
    import inspect

    doc = inspect.getdoc(cls) or ""
    head, sep, block = doc.partition("Args:")
    if not sep:
        return {}
    fields = {f.name for f in dataclasses.fields(cls)}
    text = " ".join(line.strip() if line.startswith(("    ", " ")) and not _entry_line(line, fields)
                    else "\n" + line.strip() for line in block.splitlines())
    out: dict[str, str] = {}
    names: list[str] = []
    pos = 0
    for m in _NAMES.finditer(text):
        keys = m.group(1).split(", ")
        starts = m.start() == 0 or text[m.start() - 1] == "\n" or text[max(0, m.start() - 2):m.start()] == ". "
        if not starts or not set(keys) <= fields:
            continue
        for k in names:
            out[k] = " ".join(text[pos:m.start()].split())
        names, pos = keys, m.end()
    for k in names:
        out[k] = " ".join(text[pos:].split())
    return out


def _entry_line(line: str, fields: set[str]) -> bool:
    """A line of the Args block that starts an entry (its first indent level)."""
    if line.startswith("     "):
        return False
    m = _NAMES.match(line.strip())
    return bool(m) and set(m.group(1).split(", ")) <= fields


def first_sentence(text: str) -> str:
    """Up to the first '. ' outside parentheses followed by a capital or a literal (or the whole text)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "." and depth == 0 and text[i + 1:i + 2] == " " and (text[i + 2:i + 3].isupper()
                                                                       or text[i + 2:i + 4] == "``"):
            return text[:i + 1]
    return text


def type_name(annotation: Any) -> str:
    """A field's annotation in config terms: ``null`` for None, one-of lists for Literals, ``list`` for tuples."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    text = re.sub(r"Literal\[([^\]]*)\]", lambda m: " | ".join(x.strip().strip("'\"") for x in m.group(1).split(",")),
                  text)
    text = re.sub(r"tuple\[(\w+), \.\.\.\]", r"list[\1]", text)
    text = re.sub(r"tuple\[([^\]]*)\]", lambda m: f"[{m.group(1)}]", text)
    text = re.sub(r"\b\w+Config\b", "section", text)
    text = text.replace("None", "null").replace("dict[str, Any]", "mapping")
    return text


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml(x) for x in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return repr(value) if value == "" or value != value.strip() else value
    return repr(value)


def default_of(cls: type, f: dataclasses.Field) -> str:
    """The default as YAML; ``required`` when the class refuses to be built without it; a section: see below."""
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
        from widedp.errors import ConfigError

        try:
            f.default_factory()
        except ConfigError:  # (dp.selection: its default, exponential, needs k or gamma)
            return "required"
        return "see below"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if value == "" and _required(cls, f.name):
        return "required"
    return f"`{_yaml(value)}`"


def _required(cls: type, name: str) -> bool:
    """Whether ``cls()`` refuses the field ``name`` at its default (its error names ``SECTION.name:`` first)."""
    from widedp.errors import ConfigError

    try:
        cls()
    except ConfigError as e:
        return str(e).split(" ")[0].endswith(f".{name}:")
    return False


def table(cls: type, *, defaults: dict[str, str] | None = None, skip: tuple[str, ...] = ()) -> str:
    """The key | type | default | meaning table of ``cls``'s fields. ``defaults``: a key's default cell, where the
    field's default is not what the config gets (e.g. the glm algorithm's per-algorithm defaults)."""
    entries = args_entries(cls)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        literal = re.fullmatch(r"Literal\[['\"](\w+)['\"]\]", str(f.type))
        if f.name in entries:
            meaning = first_sentence(entries[f.name])
        elif literal:  # a section's fixed tag
            meaning = ("selects this mechanism." if f.name == "name" else "fixed by the task.")
        else:
            raise SystemExit(f"{cls.__module__}.{cls.__qualname__}: the field {f.name!r} has no entry in the "
                             "docstring's Args: (write one there)")
        default = (defaults or {}).get(f.name) or default_of(cls, f)
        rows.append(f"| `{f.name}` | `{_cell(type_name(f.type))}` | {_cell(default)} | {_cell(meaning)} |")
    return "\n".join(rows)


def _summary(cls: type) -> str:
    import inspect

    doc = inspect.getdoc(cls) or ""
    first = doc.split("\n\n")[0]
    return "" if first.startswith("Args:") else _code(first_sentence(" ".join(first.split())))


def _api_anchor(cls: type) -> str:
    """The anchor of ``cls``'s entry in docs/api.md: GitHub's slug of the heading scripts/api_docs.py gives it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("api_docs", ROOT / "scripts" / "api_docs.py")
    api_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api_docs)
    module = next((mod for _, mod, names in api_docs.SECTIONS if names and cls.__name__ in names), None)
    if module is None:
        raise SystemExit(f"{cls.__name__}: not in scripts/api_docs.py's SECTIONS (add it there)")
    home = cls.__module__
    heading = f"`{module}.{cls.__name__}`" + (f" (defined in `{home}`)" if home != module else "")
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def section(title: str, cls: type, **kw: Any) -> str:
    """One ``### title`` with the class's summary, its table and a link to its whole docstring."""
    summary = _summary(cls)
    link = f"[`{cls.__name__}`](api.md#{_api_anchor(cls)})"
    head = f"### {title}\n\n" + (f"{summary} " if summary else "") + f"Full docstring: {link}.\n"
    return head + "\n" + table(cls, **kw) + "\n"


def _presets(presets: dict[str, dict[str, Any]]) -> str:
    if not presets:
        return ""
    items = [f"`{name}` ({', '.join(f'{k}: {_yaml(v)}' for k, v in keys.items()) or 'nothing'})"
             for name, keys in presets.items()]
    return "`data.preset` fills the keys the config leaves out: " + "; ".join(items) + ".\n"


#: a task's pointer to the page that explains it, under its heading
TASK_NOTES = {"module": "The factories and the loss: [own-model.md](own-model.md#from-the-command-line-task-module).\n"}


def render_reference() -> str:
    """Everything below ``MARKER``: per task its data, model (and algorithm) sections, then train and dp."""
    from widedp.config import TASK_SECTIONS, DPConfig, TrainConfig
    from widedp.config.data import DataConfig
    from widedp.config.glm import ALGORITHM_DEFAULTS
    from widedp.config.selection import SELECTIONS, PreselectConfig

    parts = []
    for task, (data, model, presets, algorithm) in TASK_SECTIONS.items():
        parts.append(f"## The `{task}` task" + (" (default)" if task == "cbow" else "") + "\n")
        if task in TASK_NOTES:
            parts.append(TASK_NOTES[task])
        if presets:
            parts.append(_presets(presets))
        parts.append(section(f"`data` ({task})", data))
        for name, value in vars(data()).items() if data is DataConfig else ():
            if dataclasses.is_dataclass(value):
                parts.append(section(f"`data.{name}` ({task})", type(value)))
        parts.append(section(f"`model` ({task})", model))
        if algorithm is not None:
            per = {k: ", ".join(f"{a}: `{_yaml(d[k])}`" for a, d in ALGORITHM_DEFAULTS.items() if k in d)
                   for k in {k for d in ALGORITHM_DEFAULTS.values() for k in d}}
            parts.append(section(f"`algorithm` ({task})", algorithm, defaults=per))
    parts.append("## The `train` section (every task)\n")
    parts.append(section("`train`", TrainConfig))
    parts.append("## The `dp` section (every task but `glm`)\n")
    parts.append(section("`dp`", DPConfig))
    parts.append(section("`dp.preselect`", PreselectConfig))
    for name, cls in SELECTIONS.items():
        parts.append(section(f"`dp.selection` `{name}`", cls))
    return "\n".join(parts)


def intro(path: Path = OUT) -> str:
    """The hand-written part of ``path``: everything up to and including ``MARKER``."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    head, sep, _ = text.partition(MARKER)
    if not sep:
        raise SystemExit(f"{path.relative_to(ROOT)}: no line {MARKER!r} (put it below the hand-written introduction)")
    return head + MARKER + "\n\n"


def render(path: Path = OUT) -> str:
    """The whole page: the hand-written introduction, then the generated reference."""
    return intro(path) + render_reference()


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="exit 1 when docs/configs.md is out of date")
    check = args.parse_args(argv).check
    text = render()
    if check:
        if OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python scripts/config_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
