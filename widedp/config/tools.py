"""Typed mappings to frozen dataclasses, the validators config dataclasses share, and strict YAML reading.

``build(section, cls, raw)`` checks every key of ``raw`` against ``cls``'s fields and coerces values by the type
hints (Literal, unions with None, tuples, bool/int/float/str, keyword-argument mappings): a wrong key, type or
value raises ``ConfigError`` naming ``section.key`` in one line. ``read_config_file`` / ``apply_override`` read a
YAML file (UTF-8, no repeated keys) and ``--set KEY=VALUE`` overrides into the raw mapping
``widedp.config.config_from_dict`` validates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import reprlib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml

from widedp.errors import ConfigError

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlong = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4
_REPR.maxlevel = 3


def show(v: Any) -> str:
    """A short one-line repr of a (possibly huge or recursive) value, for error messages."""
    return _REPR.repr(v)


def key_name(k: Any) -> str:
    """A mapping key as it appears in a message: plain if a short printable string, else its short repr."""
    return k if isinstance(k, str) and k and k.isprintable() and len(k) <= 60 else show(k)


def check_splits(splits: tuple[float, ...]) -> None:
    """``data.splits``: 3 sizes (integers = samples, floats <= 1 = fractions), a non-empty train split."""
    if len(splits) != 3:
        raise ConfigError(f"data.splits: need 3 sizes (train, valid, test), got {list(splits)}")
    if any(s < 0 for s in splits):
        raise ConfigError(f"data.splits: sizes must be >= 0, got {list(splits)}")
    if all(isinstance(s, float) and s <= 1 for s in splits) and sum(splits) > 1 + 1e-9:
        raise ConfigError(f"data.splits: fractions sum to {sum(splits):.3f} > 1")
    if splits[0] == 0:
        raise ConfigError("data.splits: the train split is empty")


def check_input_file(key: str, path: str, hint: str = "") -> None:
    """``path`` (a config's input file, ``~`` expanded) is a regular file: a missing path, a directory, a device
    (/dev/zero) or a FIFO is a ``ConfigError`` naming ``key`` and what the path is."""
    p = Path(path).expanduser()
    if p.is_file():
        return
    if not p.exists():
        raise ConfigError(f"{key}: file not found: {path}{hint}")
    what = ("a directory" if p.is_dir() else "a FIFO (named pipe)" if p.is_fifo() else
            "a device" if p.is_char_device() or p.is_block_device() else "not a regular file")
    raise ConfigError(f"{key}: {path} is {what}, not a regular file")


def data_cache_key(cfg: Any, file: str | None = None, *, drop: tuple[str, ...] = ()) -> str:
    """Hash of a data config's fields except ``cache_dir``/``preset`` and ``drop`` (keys that do not change the
    prepared arrays), and of a local input file's identity."""
    d = dataclasses.asdict(cfg)
    for k in ("cache_dir", "preset", *drop):
        d.pop(k, None)
    if file is not None:
        p = Path(file).expanduser()
        st = p.stat()
        d["file_stat"] = [str(p.resolve()), st.st_size, st.st_mtime_ns]
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def build(section: str, cls: type, raw: Any, **extra: Any) -> Any:
    """Construct dataclass ``cls`` from a mapping, checking keys and types (ints accepted for floats)."""
    expect_mapping(section, raw)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    no_unknown(section, raw, names - set(extra))
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        kwargs[k] = _coerce(f"{section}.{k}" if section else k, v, hints[k])
    kwargs.update(extra)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError, ArithmeticError, RuntimeError, OSError) as e:
        # a validator tripped on an odd value (e.g. a "~nosuchuser/..." path): still one line naming the section
        detail = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"{section or 'config'}: invalid value ({type(e).__name__}: {detail})") from None


#: decimal numbers with an exponent that YAML 1.1 (PyYAML) leaves as strings, e.g. 1e-6, 5E+3
_YAML11_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _coerce(key: str, v: Any, tp: Any) -> Any:
    """``v`` (a YAML value at ``key``) checked against and converted to the annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(key, v, typing.get_args(tp))
    if origin is Literal:
        allowed = typing.get_args(tp)
        if v not in allowed:
            raise ConfigError(f"{key}: expected one of {', '.join(map(str, allowed))}, got {show(v)}")
        return v
    if origin is tuple:
        return _coerce_tuple(key, v, typing.get_args(tp))
    if tp is dict or origin is dict:  # keyword arguments (model.kwargs): names -> plain YAML values
        expect_mapping(key, v)
        for k in v:
            if not (isinstance(k, str) and k.isidentifier()):
                raise ConfigError(f"{key}: keys are keyword-argument names, got {show(k)}")
        return dict(v)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a nested section, e.g. data.vocab_dp
        return build(key, tp, v)
    if tp in _SCALARS:
        return _SCALARS[tp](key, v)
    raise ConfigError(f"{key}: unsupported value {show(v)}")  # pragma: no cover


def _coerce_union(key: str, v: Any, args: tuple[Any, ...]) -> Any:
    """``v`` as the first member of a union that accepts it (None where the union allows it)."""
    if v is None and type(None) in args:
        return None
    errors = []
    for a in args:
        if a is type(None):
            continue
        try:
            return _coerce(key, v, a)
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(errors[0] if errors else f"{key}: invalid value {show(v)}")


def _coerce_tuple(key: str, v: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``v`` (a list) as ``tuple[T, ...]`` or a fixed-length ``tuple[A, B, ...]``."""
    if not isinstance(v, (list, tuple)):
        raise ConfigError(f"{key}: expected a list, got {show(v)}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce(key, x, args[0]) for x in v)
    if len(v) != len(args):
        raise ConfigError(f"{key}: expected {len(args)} values, got {len(v)}")
    return tuple(_coerce(key, x, a) for x, a in zip(v, args))


def _coerce_bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key}: expected true/false, got {show(v)}")
    return v


def _coerce_int(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise ConfigError(f"{key}: expected an integer, got {show(v)}")
    return v


def _coerce_float(key: str, v: Any) -> float:
    if isinstance(v, str) and _YAML11_FLOAT.match(v.strip()):  # PyYAML reads 1e-6 (no dot) as a string
        v = float(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {show(v)}")
    try:
        finite = math.isfinite(v)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise ConfigError(f"{key}: expected a finite number, got {show(v)}")
    # keep ints as ints where that carries meaning (split sizes); floats otherwise
    return v


def _coerce_str(key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{key}: expected a string, got {show(v)}")
    return v


#: the scalar annotations a config field may have, and their checks
_SCALARS: dict[Any, Callable[[str, Any], Any]] = {bool: _coerce_bool, int: _coerce_int, float: _coerce_float,
                                                  str: _coerce_str}


def no_unknown(section: str, raw: dict[str, Any], allowed: set[str]) -> None:
    for k in raw:
        if k not in allowed:
            where = f"{section}.{key_name(k)}" if section else key_name(k)
            raise ConfigError(f"{where}: unknown key (expected one of {', '.join(sorted(allowed))})")


def expect_mapping(section: str, raw: Any) -> None:
    if not isinstance(raw, dict):
        got = "null" if raw is None else f"{type(raw).__name__} {show(raw)}"
        raise ConfigError(f"{section or 'config'}: expected a mapping, got {got}")


def section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    """A copy of the mapping ``raw[key]``; absent or null (every key commented out) = ``{}``."""
    v = raw.get(key)
    if v is None:
        return {}
    expect_mapping(key, v)
    return dict(v)


def positive(key: str, v: float) -> None:
    if not v > 0:
        raise ConfigError(f"{key}: must be > 0, got {v}")


def nonneg(key: str, v: float) -> None:
    if v < 0:
        raise ConfigError(f"{key}: must be >= 0, got {v}")


def k_or_gamma(section: str, k: int | None, gamma: float | None) -> None:
    if (k is None) == (gamma is None):
        raise ConfigError(f"{section}: give exactly one of k or gamma")
    if k is not None and k <= 0:
        raise ConfigError(f"{section}.k: must be > 0, got {k}")
    if gamma is not None and not 0 < gamma <= 1:
        raise ConfigError(f"{section}.gamma: must be in (0, 1], got {gamma}")


# ------------------------------------------------------------------------------------------- YAML files and --set


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping key given twice, at any depth (PyYAML keeps the last silently):
    ``ConfigError("dp.noise_multiplier: duplicate key (line 9; first at line 5)")``. Keys merged in by ``<<:`` may
    be overridden, as YAML intends. ``empty_keys``: the dotted keys given no value at all (``dp:`` with its keys
    commented out), as opposed to an explicit ``null``."""

    empty_keys: set[str]

    def construct_document(self, node: yaml.Node) -> Any:
        self._check_keys(node)
        return super().construct_document(node)

    def _check_keys(self, root: yaml.Node) -> None:
        self.empty_keys = set()
        todo: list[tuple[yaml.Node, str]] = [(root, "")]
        seen_nodes: set[int] = set()
        while todo:  # iterative, and each node once: anchors/aliases may share or nest nodes
            node, path = todo.pop()
            if id(node) in seen_nodes:
                continue
            seen_nodes.add(id(node))
            if isinstance(node, yaml.SequenceNode):
                todo.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))
                continue
            if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null" and node.value == "":
                self.empty_keys.add(path)
            if not isinstance(node, yaml.MappingNode):
                continue
            first: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    todo.append((value_node, path))
                    continue
                name = "?"
                if isinstance(key_node, yaml.ScalarNode):
                    key = self.construct_object(key_node)
                    name = key_name(key)
                    try:
                        line = first.get(key)
                    except TypeError:  # unhashable: SafeLoader reports it
                        line = None
                    else:
                        first.setdefault(key, key_node.start_mark.line)
                    if line is not None:
                        raise ConfigError(f"{path + '.' if path else ''}{name}: duplicate key "
                                          f"(line {key_node.start_mark.line + 1}; first at line {line + 1})")
                todo.append((value_node, f"{path}.{name}" if path else name))


def parse_yaml(text: str, empty_keys: set[str] | None = None) -> Any:
    """``text`` as YAML with ``StrictLoader`` (adding its ``empty_keys`` to ``empty_keys``); any failure is a one-line
    ``ConfigError`` (PyYAML's constructors also raise ValueError, KeyError, AttributeError, RecursionError, ...)."""
    loader = None
    try:
        loader = StrictLoader(text)  # (its reader already checks the characters)
        data = loader.get_single_data()
        if empty_keys is not None:
            empty_keys.update(getattr(loader, "empty_keys", ()))
        return data
    except ConfigError:
        raise
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"invalid YAML ({where}{' '.join(str(e.problem or e.context).split())})") from None
    except yaml.reader.ReaderError as e:
        ch = chr(e.character) if isinstance(e.character, int) else e.character
        raise ConfigError(f"invalid YAML (character {ch!r} at offset {e.position} is not allowed)") from None
    except RecursionError:
        raise ConfigError("invalid YAML (nested too deeply)") from None
    except Exception as e:  # see the docstring
        raise ConfigError(f"invalid YAML ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml_file(path: str | Path, *, what: str) -> tuple[Any, set[str]]:
    """A YAML file's value and the dotted keys given no value; a missing, unreadable, binary or non-UTF-8 file,
    invalid YAML or a repeated key is a ``ConfigError`` starting with the path (``what``: "config file", ...)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} not found: {path}" + (" (it is a directory)" if p.is_dir() else ""))
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the file ({e.strerror or e})") from None
    if b"\0" in data:
        raise ConfigError(f"{path}: not a UTF-8 text file (a NUL byte at offset {data.index(0)})")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None
    empty: set[str] = set()
    try:
        return parse_yaml(text, empty), empty
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML config file; a missing, unreadable, binary, non-UTF-8, empty or non-mapping
    file, invalid YAML, a repeated key or a ``dp:`` given no value is a ``ConfigError`` starting with the path."""
    raw, empty = read_yaml_file(path, what="config file")
    if raw is None:
        raise ConfigError(f"{path}: the file is empty (expected a mapping of sections: task, data, model, train, "
                          "dp, ...)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at top level, got {type(raw).__name__} "
                          f"{show(raw)}")
    if "dp" in empty:  # its keys commented out: null, which config_from_dict (and to_dict) take for non-private
        raise ConfigError(f"{path}: dp: is present but empty; give its keys (at least selection: {{name: ...}}) or "
                          "remove it for non-private training (or write dp: null)")
    return raw


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply ``--set a.b.c=value`` (value parsed as YAML) to a raw config mapping in place.

    Missing or null sections on the path are created; the mappings on the path are copied first (so YAML aliases
    elsewhere in the file are untouched). Setting ``dp.selection.name`` to a different mechanism keeps the section's
    keys the new mechanism has (``k: 500`` stays for ``uniform``) and refuses, naming them, those it has not (they
    would be dropped silently); overrides after it fill it in: ``--set dp.selection.name=uniform --set
    dp.selection.k=1``. ``apply_overrides`` then checks that the new mechanism's privacy parameters were given.
    """
    if not isinstance(override, str) or "=" not in override:
        raise ConfigError(f"--set {show(override)}: expected KEY=VALUE (e.g. train.epochs=5)")
    key, text = override.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {show(override)}: the key before '=' is empty (expected KEY=VALUE)")
    shown = key_name(key)
    parts = [part.strip() for part in key.split(".")]
    if not all(parts):
        raise ConfigError(f"--set {shown}: empty part in the key path (expected a.b.c=VALUE)")
    if parts == ["dp"] and not text.strip():  # as a file's bare dp: (write dp=null for non-private training)
        raise ConfigError("--set dp: no value; give dp=null for non-private training, or set dp.KEY=VALUE")
    try:
        value = parse_yaml(text)
    except ConfigError as e:
        raise ConfigError(f"--set {shown}: cannot parse value {show(text)} ({e})") from None
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"--set {shown}: {'.'.join(parts[:i + 1])} is not a section (it is {show(child)})")
        if parts[: i + 2] == ["dp", "selection", "name"] and child.get("name", value) != value:
            child = _switched_selection(child, value)  # a different mechanism: the keys it shares stay
        node[part] = node = dict(child)
    node[parts[-1]] = value


def _switched_selection(old: dict[str, Any], name: Any) -> dict[str, Any]:
    """The ``dp.selection`` section ``old`` switched to mechanism ``name`` by ``--set dp.selection.name=``: the keys
    the new mechanism has (``k``, ``gamma``, ``epsilon``, ...) stay; a key it has not is refused by name, with the
    whole-section override that says what to keep."""
    from widedp.config.selection import SELECTIONS

    cls = SELECTIONS.get(name) if isinstance(name, str) else None
    if cls is None:
        return {}  # an unknown name: the section's validation names it
    fields = {f.name for f in dataclasses.fields(cls)}
    dropped = [key_name(k) for k in old if k not in fields]
    if dropped:
        kept = {k: v for k, v in old.items() if k in fields and k != "name"}
        example = ", ".join([f"name: {name}", *(f"{k}: {show(v)}" for k, v in kept.items()),
                             *(f"{k}: ..." for k in getattr(cls, "privacy_keys", ()) if k not in kept)])
        was = show(old.get("name"))
        raise ConfigError(f"--set dp.selection.name={name}: dp.selection.{', '.join(dropped)} of {was} "
                          f"{'is not a key' if len(dropped) == 1 else 'are not keys'} of {name} (never dropped "
                          f"silently); set the whole section instead: --set 'dp.selection={{{example}}}'")
    return dict(old)


def _selection_name(raw: dict[str, Any]) -> Any:
    """``dp.selection.name`` of a raw config (None where there is none)."""
    dp = raw.get("dp")
    sel = dp.get("selection") if isinstance(dp, dict) else None
    return sel.get("name") if isinstance(sel, dict) else None


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> None:
    """``apply_override`` of each of ``overrides`` in turn; when they switch ``dp.selection`` to another mechanism,
    its privacy parameters (the class's ``privacy_keys``: ``sigma`` of ``gaussian_threshold``, ``epsilon`` of
    ``exponential``) must be given, by the overrides or kept from the old section: none is defaulted silently
    (``dp.calibrate: selection_epsilon`` solves it instead)."""
    from widedp.config.selection import SELECTIONS

    before = _selection_name(raw)
    for ov in overrides:
        apply_override(raw, ov)
    name = _selection_name(raw)
    if name == before or not isinstance(name, str) or name not in SELECTIONS:
        return
    if raw["dp"].get("calibrate") == "selection_epsilon":
        return
    missing = [k for k in getattr(SELECTIONS[name], "privacy_keys", ()) if k not in raw["dp"]["selection"]]
    if missing:
        raise ConfigError(f"dp.selection.{missing[0]}: not given; switching dp.selection to {name} picks no default "
                          f"for its privacy parameter: add --set dp.selection.{missing[0]}=VALUE (or calibrate it: "
                          "dp.target_epsilon with dp.calibrate: selection_epsilon)")
