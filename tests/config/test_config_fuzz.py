"""Property-based fuzzing of the config loader: whatever the input, the result is a ``Config`` or a
one-line ``ConfigError`` naming the key, never another exception.

Random nested values mix the real section / field / literal names with junk so that they reach deep into the
validators; files get random bytes and mutated YAML. Deterministic (``derandomize``) and ~10 s in all.
"""

import dataclasses
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from widedp.config import (
    DATA_PRESETS,
    SELECTIONS,
    Config,
    DataConfig,
    DPConfig,
    ModelConfig,
    TrainConfig,
    config_from_dict,
    load_config,
)
from widedp.config import glm as glm_config
from widedp.config import recsys as recsys_config
from widedp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
FAST = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

TASK_CLASSES: dict[str, dict[str, list[type]]] = {
    "cbow": {"data": [DataConfig], "model": [ModelConfig]},
    "recsys": {"data": [recsys_config.RecsysDataConfig], "model": [recsys_config.RecsysModelConfig]},
    "glm": {"data": [glm_config.GLMDataConfig], "model": [glm_config.GLMModelConfig],
            "algorithm": [glm_config.GLMAlgorithmConfig]},
}
ALL_CLASSES = [DataConfig, ModelConfig, TrainConfig, DPConfig, *SELECTIONS.values(),
               *(c for t in TASK_CLASSES.values() for cs in t.values() for c in cs)]


def _literals(tp: Any) -> list[Any]:
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    return [x for a in typing.get_args(tp) for x in _literals(a)]


FIELDS = sorted({f.name for c in ALL_CLASSES for f in dataclasses.fields(c)})
WORDS = sorted({str(x) for c in ALL_CLASSES for tp in typing.get_type_hints(c).values() for x in _literals(tp)}
               | set(DATA_PRESETS) | set(recsys_config.DATA_PRESETS) | set(glm_config.DATA_PRESETS)
               | set(SELECTIONS) | set(glm_config.ALGORITHMS) | set(TASK_CLASSES)
               | {"brown", "synthetic", "text:", "hf:", "hf:x", "ratings:", "cuda:0", "cuda:x", "", "~"})
KEYS = st.one_of(st.sampled_from(FIELDS + ["data", "model", "train", "dp", "selection", "algorithm", "task"]),
                 st.text(max_size=8), st.integers(-2, 2), st.none(), st.booleans())
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from([0, 1, -1, 2**63, -(2**64), 10**400]),
    st.floats(), st.floats(0, 1), st.text(max_size=12), st.sampled_from(WORDS),
)
ANY = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(KEYS, c, max_size=4), max_leaves=12)


def _weighted(*options: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, chosen with the given weights (st.one_of would pick them about equally)."""
    total = sum(w for w, _ in options)

    def pick(i: int) -> st.SearchStrategy:
        for w, strat in options:
            if i < w:
                return strat
            i -= w
        raise AssertionError

    return st.integers(0, total - 1).flatmap(pick)


def _plausible(tp: Any) -> st.SearchStrategy:
    """Values of the field's type, mostly in range: they get past the type checks to the value checks."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        if all(dataclasses.is_dataclass(a) for a in args):
            return _selection()
        return st.one_of(*(_plausible(a) for a in args))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_plausible(args[0]), max_size=4)
        return st.tuples(*(_plausible(a) for a in args)).map(list)
    if tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if tp is int:
        return _weighted((8, st.integers(1, 3000)), (1, st.integers(-1, 0)), (1, st.integers()))
    if tp is float:
        return _weighted((8, st.floats(0.001, 0.999)), (1, st.integers(1, 10**6)), (1, st.floats()))
    if tp is str:
        return st.sampled_from(WORDS)
    return ANY


def _default(f: dataclasses.Field) -> st.SearchStrategy:
    if f.default is not dataclasses.MISSING:
        return st.just(list(f.default) if isinstance(f.default, tuple) else f.default)
    return _selection()  # the one default_factory: DPConfig.selection


def _fields(classes: list[type], only: set[str] | None = None) -> dict[str, st.SearchStrategy]:
    """Per field: mostly a plausible value or the default, sometimes anything."""
    out: dict[str, st.SearchStrategy] = {}
    for c in classes:
        hints = typing.get_type_hints(c)
        for f in dataclasses.fields(c):
            if only is None or f.name in only:
                out[f.name] = _weighted((6, _plausible(hints[f.name])), (3, _default(f)), (1, ANY))
    return out


_ABSENT = object()


def _with_junk(body: st.SearchStrategy) -> st.SearchStrategy:
    """``body``'s mappings with one more random key (a real name in the wrong place, or junk)."""
    return st.builds(lambda b, j: {**j, **b} if isinstance(b, dict) else b, body,
                     st.dictionaries(KEYS, ANY, min_size=1, max_size=1))


def _mapping(fields: dict[str, st.SearchStrategy], fixed: dict[str, st.SearchStrategy] | None = None
             ) -> st.SearchStrategy:
    """Mostly a mapping of some of the fields (sometimes with a junk key), sometimes anything, or null."""
    fixed = fixed or {}
    body = st.fixed_dictionaries(fixed, optional={k: v for k, v in fields.items() if k not in fixed}).map(
        lambda d: {k: v for k, v in d.items() if v is not _ABSENT})
    return _weighted((16, body), (2, _with_junk(body)), (1, ANY), (1, st.none()))


def _section(classes: list[type]) -> st.SearchStrategy:
    return _mapping(_fields(classes))


@functools.cache
def _selection() -> st.SearchStrategy:
    """A named mechanism with its keys (with exactly one of k / gamma where it takes them, mostly)."""
    named = []
    for name, c in SELECTIONS.items():
        fields = _fields([c])
        kg = st.just({})
        if "k" in fields:
            k, gamma = fields.pop("k"), fields.pop("gamma")
            kg = _weighted((8, st.fixed_dictionaries({"k": k}) | st.fixed_dictionaries({"gamma": gamma})),
                           (1, st.fixed_dictionaries({}, optional={"k": k, "gamma": gamma})))
        named.append(st.builds(lambda m, extra: {**extra, **m} if isinstance(m, dict) else m,
                               _mapping(fields, {"name": st.just(name)}), kg))
    return _weighted(*((4, s) for s in named), (1, _section(list(SELECTIONS.values()))))


@functools.cache
def _algorithm() -> st.SearchStrategy:
    """glm's algorithm: a name with its own keys (and epsilon for private ones), sometimes any keys."""
    cls = glm_config.GLMAlgorithmConfig
    named = []
    for name, own in glm_config.ALGORITHM_DEFAULTS.items():
        fixed = {"name": st.just(name)}
        if name != "nonprivate":
            fixed["epsilon"] = _weighted((8, st.floats(0.1, 10)), (1, ANY))
        named.append(_mapping(_fields([cls], set(own) | {"delta", "accountant"}), fixed))
    return _weighted(*((2, s) for s in named), (1, _section([cls])))


def _raw(task: str) -> st.SearchStrategy:
    """A config of ``task``: its sections (the privacy one, dp or algorithm, mostly present), maybe a junk key."""
    sections = {"data": _section(TASK_CLASSES[task]["data"]), "model": _section(TASK_CLASSES[task]["model"]),
                "train": _section([TrainConfig])}
    if task != "cbow":
        sections["task"] = _weighted((20, st.just(task)), (1, ANY))
    fixed = ({"algorithm": _weighted((6, _algorithm()), (1, st.just(_ABSENT)))} if task == "glm" else
             {"dp": _weighted((4, _mapping(_fields([DPConfig]), {"selection": _weighted(
                 (8, _selection()), (1, st.just(_ABSENT)))})), (1, st.just(_ABSENT)))})
    body = _mapping(sections, fixed)
    if task != "cbow":  # task: mostly present
        body = body.map(lambda d: {"task": task, **d} if isinstance(d, dict) and "task" not in d else d)
    return _weighted((8, body), (1, _with_junk(body)))


def _check_error(e: ConfigError) -> None:
    msg = str(e)
    assert msg and "\n" not in msg and len(msg) < 1000, msg
    assert ": " in msg, msg  # "key.path: what is wrong"
    assert "invalid value (" not in msg, msg  # build()'s safety net: a validator crashed; fix the validator


def _check(raw: dict[str, Any]) -> None:
    before = repr(raw)
    try:
        cfg = config_from_dict(raw)
    except ConfigError as e:
        _check_error(e)
    else:
        assert isinstance(cfg, Config)
        assert config_from_dict(cfg.to_dict()) == cfg  # no nan / inf or other value that does not survive
        for x in (cfg.train.lr, getattr(cfg.model, "init_scale", 1.0)):
            assert math.isfinite(x)
    assert repr(raw) == before  # the loader does not modify its input


RAW = {task: _raw(task) for task in TASK_CLASSES}


@FAST
@given(RAW["cbow"])
def test_fuzz_cbow(raw):
    _check(raw)


@FAST
@given(RAW["recsys"])
def test_fuzz_recsys(raw):
    _check(raw)


@FAST
@given(RAW["glm"])
def test_fuzz_glm(raw):
    _check(raw)


@FAST
@given(st.dictionaries(KEYS, ANY, max_size=5))
def test_fuzz_any_mapping(raw):
    _check(raw)


def _load(path: Path, data: bytes, overrides: list[str] = ()) -> None:
    path.write_bytes(data)
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        _check_error(e)
    else:
        assert isinstance(cfg, Config)


@FAST
@given(st.binary(max_size=64))
def test_fuzz_file_bytes(tmp_path, data):
    _load(tmp_path / "c.yaml", data)


@FAST
@given(st.one_of(*RAW.values()), st.integers(0, 10**6),
       st.binary(max_size=6) | st.sampled_from([b"\n", b"  ", b": ", b"- ", b"&a ", b"*a", b"<<: ", b"!!int ", b"{",
                                                 b"[", b"\xff", b"\t", b"#"]))
def test_fuzz_file_mutated_yaml(tmp_path, raw, pos, junk):
    text = yaml.safe_dump(raw, sort_keys=False).encode()
    pos %= len(text) + 1
    _load(tmp_path / "c.yaml", text[:pos] + junk + text[pos:])


@FAST
@given(st.lists(st.one_of(
    st.text(max_size=12),
    st.builds(lambda k, v: f"{k}={v}", st.lists(st.sampled_from(FIELDS + ["data", "model", "train", "dp",
                                                                          "selection", "", " "]), min_size=1,
                                                max_size=3).map(".".join),
              st.one_of(st.text(max_size=8), st.sampled_from(WORDS), ANY.map(lambda v: yaml.safe_dump(v).strip()))),
), max_size=3))
def test_fuzz_overrides(tmp_path, overrides):
    _load(tmp_path / "c.yaml", (ROOT / "configs" / "brown_cbow_sparse_exp.yaml").read_bytes(), overrides)
