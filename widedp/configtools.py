"""Typed mappings to frozen dataclasses, and the validators config dataclasses share.

``build(section, cls, raw)`` checks every key of ``raw`` against ``cls``'s fields and coerces values by the type
hints (Literal, unions with None, tuples, bool/int/float/str): a wrong key, type or value raises ``ConfigError``
naming ``section.key`` in one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from widedp.errors import ConfigError


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


def data_cache_key(cfg: Any, file: str | None = None) -> str:
    """Hash of a data config's fields except ``cache_dir``/``preset`` (and of a local input file's identity)."""
    d = dataclasses.asdict(cfg)
    d.pop("cache_dir", None)
    d.pop("preset", None)
    if file is not None:
        p = Path(file).expanduser()
        st = p.stat()
        d["file_stat"] = [str(p.resolve()), st.st_size, st.st_mtime_ns]
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------- model


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply ``a.b.c=value`` (value parsed as YAML) to a raw config mapping in place."""
    if "=" not in override:
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE")
    key, value = override.split("=", 1)
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError:
        raise ConfigError(f"--set {key}: cannot parse value {value!r}") from None


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
    except TypeError as e:  # pragma: no cover - missing required fields
        raise ConfigError(f"{section}: {e}") from None


def _coerce(key: str, v: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
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
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {v!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if v not in allowed:
            raise ConfigError(f"{key}: expected one of {', '.join(map(str, allowed))}, got {v!r}")
        return v
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(v, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {v!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(key, x, args[0]) for x in v)
        if len(v) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} values, got {len(v)}")
        return tuple(_coerce(key, x, a) for x, a in zip(v, args))
    if tp is bool:
        if not isinstance(v, bool):
            raise ConfigError(f"{key}: expected true/false, got {v!r}")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                return int(v)
            raise ConfigError(f"{key}: expected an integer, got {v!r}")
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {v!r}")
        # keep ints as ints where that carries meaning (split sizes); floats otherwise
        return v
    if tp is str:
        if not isinstance(v, str):
            raise ConfigError(f"{key}: expected a string, got {v!r}")
        return v
    raise ConfigError(f"{key}: unsupported value {v!r}")  # pragma: no cover


def no_unknown(section: str, raw: dict[str, Any], allowed: set[str]) -> None:
    for k in raw:
        if k not in allowed:
            where = f"{section}.{k}" if section else str(k)
            raise ConfigError(f"{where}: unknown key (expected one of {', '.join(sorted(allowed))})")


def expect_mapping(section: str, raw: Any) -> None:
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: expected a mapping, got {raw!r}")


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
