"""Config files and ``--set`` overrides: bad input is a one-line ConfigError naming the key."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from widedp.cli import main
from widedp.config import SELECTIONS, UniformSelectionConfig, config_from_dict, load_config
from widedp.config.tools import read_config_file
from widedp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXP = str(ROOT / "configs" / "brown_cbow_sparse_exp.yaml")


def _error(tmp_path: Path, content: str | bytes, overrides: tuple[str, ...] = ()) -> str:
    p = tmp_path / "c.yaml"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as e:
        load_config(p, overrides)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("data: [1, 2]\n", "data: expected a mapping, got list [1, 2]"),
        ("data: brown\n", "data: expected a mapping, got str 'brown'"),
        ("task: [cbow]\n", "task: expected one of cbow, recsys, glm, module, got ['cbow']"),
        ("dp:\n  selection:\n    name: [exponential]\n", "dp.selection.name: expected one of"),
        ("train: 5\n", "train: expected a mapping, got int 5"),
        ("train: 0\n", "train: expected a mapping, got int 0"),  # falsy is not "use the defaults"
        ("model: []\n", "model: expected a mapping, got list []"),
        ("data: {preset: [paper]}\n", "data.preset: unknown preset ['paper']"),
        ("", "the file is empty"),
        ("# train:\n#   epochs: 2\n", "the file is empty"),
        ("- train\n- dp\n", "expected a mapping of sections at top level, got list"),
        ("42\n", "expected a mapping of sections at top level, got int"),
        ("train: [1, 2\n", "invalid YAML (line 2"),
        ("train: {epochs: !!int abc}\n", "invalid YAML (ValueError"),
        ("train: {epochs: !!bool maybe}\n", "invalid YAML (KeyError"),
        ("train: " + "[" * 3000 + "]" * 3000 + "\n", "invalid YAML (nested too deeply)"),
        ("train: {epochs: 2}\n\x01\n", "invalid YAML (character '\\x01'"),
        ("model: {init_scale: .nan}\n", "model.init_scale: expected a finite number, got nan"),
        ("train: {lr: .inf}\n", "train.lr: expected a finite number, got inf"),
        ("train: {lr: " + "9" * 400 + "}\n", "train.lr: expected a finite number"),
        ("train: {device: 2020-01-01}\n", "train.device: expected a string, got datetime.date(2020, 1, 1)"),
        ('"a\\nb": 1\n', "'a\\nb': unknown key"),
        # a present-but-empty dp: (keys all commented out) used to train NON-privately
        ("dp:\n  # noise_multiplier: 1.0\n", "dp: is present but empty; give its keys"),
        ("dp:\n", "remove it for non-private training (or write dp: null)"),
        ("{dp}\n", "dp: is present but empty"),
        ("dp:\n  noise_multiplier: 1.0\n  selection:\n  #  name: all\n", "dp.selection: is present but empty"),
        # a repeated key used to keep the last value silently
        ("dp:\n  noise_multiplier: 1.0\n  noise_multiplier: 0.01\n  selection: {name: all}\n",
         "dp.noise_multiplier: duplicate key (line 3; first at line 2)"),
        ("train: {epochs: 2}\ntrain: {epochs: 3}\n", "train: duplicate key (line 2; first at line 1)"),
        ("dp: {selection: {name: all, name: uniform}}\n", "dp.selection.name: duplicate key (line 1; first at line 1)"),
        ("data:\n  splits: [1, {a: 1, a: 2}, 3]\n", "data.splits[1].a: duplicate key (line 2"),
        ("train: {1: a, 0x1: b}\n", "train.1: duplicate key"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, content, needle):
    assert needle in _error(tmp_path, content)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"\x00\x01\x02\xff\xfe", "not a UTF-8 text file (a NUL byte at offset 0)"),
        (b"train:\n  device: caf\xe9\n", "not UTF-8 text (byte 0xe9 at offset 20)"),
        ("train: {epochs: 2}\n".encode("utf-16"), "not a UTF-8 text file"),
    ],
)
def test_binary_and_non_utf8_files(tmp_path, content, needle):
    assert needle in _error(tmp_path, content)


def test_good_files(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"\xef\xbb\xbftrain: {epochs: 2}\n")  # a UTF-8 BOM is fine
    assert load_config(p).train.epochs == 2
    # keys merged in with << may be overridden (that is what merge keys are for); absent dp = non-private
    p.write_text("train:\n  <<: {epochs: 3, lr: 0.1}\n  epochs: 4\n")
    cfg = load_config(p)
    assert (cfg.train.epochs, cfg.train.lr, cfg.dp) == (4, 0.1, None)
    # aliases may be shared (and recursive) without tripping the duplicate check
    p.write_text("train: &t {epochs: 2}\nmodel: {dim: 8}\ndata: {splits: &s [1, 1, 1]}\n")
    assert load_config(p).data.splits == (1, 1, 1)
    p.write_text("data: {splits: &s [*s, 1, 1]}\n")
    assert "data.splits: expected a number, got [[[" in _error(tmp_path, p.read_text())
    with pytest.raises(ConfigError, match="config file not found"):
        read_config_file(tmp_path)
    # an explicit dp: null is non-private, as the resolved config.yaml of a non-private run writes it
    p.write_text(yaml.safe_dump(load_config(ROOT / "configs" / "brown_cbow_nonprivate.yaml").to_dict()))
    assert "dp: null" in p.read_text()
    assert load_config(p) == load_config(ROOT / "configs" / "brown_cbow_nonprivate.yaml")
    assert load_config(EXP, ["dp=null"]).dp is None


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("foo", "--set 'foo': expected KEY=VALUE"),
        ("=1", "--set '=1': the key before '=' is empty"),
        (" =1", "the key before '=' is empty"),
        ("dp..x=1", "--set dp..x: empty part in the key path"),
        ("train.=1", "--set train.: empty part in the key path"),
        (".train=1", "--set .train: empty part"),
        ("data.vocab_size=abc", "data.vocab_size: expected an integer, got 'abc'"),
        ("train.epochs=1.5", "train.epochs: expected an integer, got 1.5"),
        ("train.epochs=[1", "--set train.epochs: cannot parse value '[1' (invalid YAML"),
        ("train.epochs=!!int x", "--set train.epochs: cannot parse value"),
        ("dp.selection={name: all, name: all}", "--set dp.selection: cannot parse value"),
        ("train.epochs.x=1", "--set train.epochs.x: train.epochs is not a section (it is 20)"),
        ("trian.epochs=3", "trian: unknown key"),
        ("dp.noise_multiplier=.nan", "dp.noise_multiplier: expected a finite number, got nan"),
        ("dp=", "--set dp: no value; give dp=null for non-private training"),
        ("dp.selection.name=magic", "dp.selection.name: expected one of"),
        ("dp.selection.name=uniform", "dp.selection.epsilon, score_clip, method of 'exponential' are not keys of "
                                      "uniform"),  # k is kept; the keys uniform has not are refused, not dropped
        ("dp.selection.nmae=uniform", "dp.selection.nmae: unknown key"),
    ],
)
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(EXP, [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_mechanism_swap_keeps_shared_keys_and_refuses_the_others(tmp_path):
    base = load_config(EXP)
    # the keys the new mechanism has stay (k: 500 for uniform); the others are refused by name, never dropped
    msg = _error(tmp_path, Path(EXP).read_text(), ("dp.selection.name=uniform",))
    assert msg == ("--set dp.selection.name=uniform: dp.selection.epsilon, score_clip, method of 'exponential' are "
                   "not keys of uniform (never dropped silently); set the whole section instead: --set "
                   "'dp.selection={name: uniform, k: 500}'")
    assert load_config(EXP, ["dp.selection={name: uniform, k: 500}"]).dp.selection == UniformSelectionConfig(k=500)
    assert load_config(EXP, ["dp.selection.name=exponential"]).dp.selection == base.dp.selection  # no swap
    cfg = load_config(EXP, ["dp.selection={name: uniform, k: 3}"])
    assert cfg.dp.selection == UniformSelectionConfig(k=3) and cfg.dp.noise_multiplier == base.dp.noise_multiplier
    # from a section of shared keys only: the swap keeps them
    small = tmp_path / "s.yaml"
    small.write_text("dp: {selection: {name: uniform, k: 7}}\n")
    cfg = load_config(small, ["dp.selection.name=exponential", "dp.selection.epsilon=0.1"])
    assert (cfg.dp.selection.name, cfg.dp.selection.k, cfg.dp.selection.epsilon) == ("exponential", 7, 0.1)


@pytest.mark.parametrize(
    ("section", "overrides", "needle"),
    [  # a switch never picks the new mechanism's privacy parameter silently
        ("{name: all}", ["dp.selection.name=gaussian_threshold"], "dp.selection.sigma: not given; switching "
         "dp.selection to gaussian_threshold picks no default for its privacy parameter: add --set "
         "dp.selection.sigma=VALUE"),
        ("{name: uniform, k: 5}", ["dp.selection.name=exponential"], "dp.selection.epsilon: not given"),
        ("{name: all}", ["dp.selection={name: sparse_vector}"], "dp.selection.epsilon: not given"),
        ("{name: exponential, k: 5}", ["dp.selection.name=gaussian_threshold"],
         "dp.selection.k of 'exponential' is not a key of gaussian_threshold (never dropped silently); set the whole "
         "section instead: --set 'dp.selection={name: gaussian_threshold, sigma: ...}'"),
    ],
)
def test_mechanism_swap_needs_the_privacy_parameters(tmp_path, section, overrides, needle):
    assert needle in _error(tmp_path, f"dp: {{selection: {section}}}\n", tuple(overrides))


def test_mechanism_swap_with_its_privacy_parameters_loads(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("dp: {selection: {name: all}}\n")
    cfg = load_config(p, ["dp.selection.name=gaussian_threshold", "dp.selection.sigma=3"])
    assert (cfg.dp.selection.name, cfg.dp.selection.sigma) == ("gaussian_threshold", 3.0)
    cfg = load_config(p, ["dp.selection.name=exponential", "dp.selection.k=2", "dp.selection.epsilon=0.2"])
    assert (cfg.dp.selection.k, cfg.dp.selection.epsilon) == (2, 0.2)
    # calibration solves the knob: nothing to give
    cfg = load_config(p, ["dp.selection.name=gaussian_threshold", "dp.target_epsilon=5",
                          "dp.calibrate=selection_epsilon"])
    assert cfg.dp.selection.name == "gaussian_threshold"
    cfg = load_config(p, ["dp.selection.name=uniform", "dp.selection.gamma=0.5"])
    assert cfg.dp.selection == UniformSelectionConfig(gamma=0.5)


def test_overrides_fill_null_sections_and_leave_aliases(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\ndp: ~\n")
    cfg = load_config(p, ["train.epochs=3", "dp.selection.name=all"])
    assert cfg.train.epochs == 3 and cfg.dp.selection.name == "all"
    raw = {"train": (shared := {"epochs": 2}), "model": {"dim": 4}}
    from widedp.config.tools import apply_override

    apply_override(raw, "train.epochs=5")
    assert raw["train"] == {"epochs": 5} and shared == {"epochs": 2}


def _dp_configs() -> list[Path]:
    out = []
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        raw = read_config_file(p)
        if "dp" in raw and "runs" not in raw:
            out.append(p)
    return out


#: what a whole dp.selection section needs besides its name: k or gamma, and its privacy parameters
_NEEDS = {"exponential": {"k": 1, "epsilon": 0.1}, "uniform": {"k": 1}, "sparse_vector": {"epsilon": 0.1},
          "gaussian_threshold": {"sigma": 3.0}}


@pytest.mark.parametrize("path", _dp_configs(), ids=lambda p: p.stem)
@pytest.mark.parametrize("name", sorted(SELECTIONS))
def test_every_mechanism_swap_of_every_shipped_dp_config_loads(path, name, tmp_path, monkeypatch):
    """``--set dp.selection.name=NAME`` loads (keeping the shared keys) or is one line naming what it cannot keep;
    the whole-section override always loads."""
    monkeypatch.chdir(tmp_path)  # movielens' ratings file is not shipped: a stand-in where its config looks
    (tmp_path / "data" / "ml-1m").mkdir(parents=True)
    (tmp_path / "data" / "ml-1m" / "ratings.dat").write_text("1::1::5::0\n")
    engine = [] if name == "all" else ["dp.engine=widedp"]  # opacus runs DP-SGD only
    base = load_config(path)
    old = {k: v for k, v in dataclasses.asdict(base.dp.selection).items() if k != "name"}
    extra = [f"dp.selection.{k}={v}" for k, v in _NEEDS.get(name, {}).items() if k not in old]
    try:
        cfg = load_config(path, [f"dp.selection.name={name}", *extra, *engine])
    except ConfigError as e:
        assert "\n" not in str(e) and base.dp.selection.name != name
        assert str(e).startswith((f"--set dp.selection.name={name}: dp.selection.", "dp.selection.")), str(e)
    else:
        assert cfg.dp.selection.name == name and cfg.dp.noise_multiplier == base.dp.noise_multiplier
        kept = dataclasses.asdict(cfg.dp.selection)
        assert all(kept[k] == v for k, v in old.items() if k in kept and f"dp.selection.{k}" not in " ".join(extra))
    whole = ", ".join([f"name: {name}", *(f"{k}: {v}" for k, v in _NEEDS.get(name, {}).items())])
    cfg = load_config(path, [f"dp.selection={{{whole}}}", *engine])
    assert cfg.dp.selection.name == name and cfg.train == base.train
    assert config_from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("content", "overrides", "needle"),
    [
        (b"data: [1, 2]\n", [], "data: expected a mapping, got list"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", [], "not a UTF-8 text file"),
        (b"dp:\n  selection: {name: all}\n  delta: 1.0e-5\n  delta: 1.0e-3\n", [], "dp.delta: duplicate key"),
        (b"train: {epochs: 1}\n", ["dp..x=1"], "--set dp..x: empty part"),
    ],
)
def test_cli_reports_one_line_exit_2(tmp_path, capsys, content, overrides, needle):
    from widedp.cli import main

    p = tmp_path / "c.yaml"
    p.write_bytes(content)
    assert main(["epsilon", str(p), *(x for ov in overrides for x in ("--set", ov))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("widedp: error: ") and needle in err and len(err.strip().splitlines()) == 1


def test_exponent_numbers_that_yaml_reads_as_strings_are_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads 1e-6 as the string '1e-6'; a float field accepts it, and only that form."""
    from widedp.config import config_from_dict

    assert config_from_dict({"dp": {"delta": "1e-6", "selection": {"name": "all"}}}).dp.delta == 1e-6
    with pytest.raises(ConfigError, match="dp.delta: expected a number"):
        config_from_dict({"dp": {"delta": "1e-6x", "selection": {"name": "all"}}})


def test_a_sweep_file_given_as_a_config_says_so(capsys):
    assert main(["epsilon", str(ROOT / "configs" / "honest_eps.yaml")]) == 2
    err = capsys.readouterr().err
    assert "a sweep file (it has runs:)" in err and "widedp compare" in err and err.count("\n") == 1
