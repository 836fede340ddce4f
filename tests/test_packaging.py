"""The installable package: the wheel's contents, the version (``widedp --version``, every privacy statement),
the optional extras (the core CLI works without them; a feature that needs one names it), docs/api.md up to date.

The real check, ``pip install .`` into a fresh virtual environment, stays a manual one (minutes, downloads)::

    python3 -m venv /tmp/v && /tmp/v/bin/pip install "setuptools>=77" wheel torch==2.13.0   # torch: the CPU build
    /tmp/v/bin/pip install .            # the core; extras: widedp/extras.py
    /tmp/v/bin/widedp --version && /tmp/v/bin/widedp epsilon configs/brown_cbow_sparse_exp.yaml
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import widedp
from widedp.accounting.statement import PrivacyStatement, UnitFacts, for_run
from widedp.cli import main
from widedp.extras import EXTRAS, INSTALL, MissingExtraError, needs, pyplot

ROOT = Path(__file__).resolve().parents[1]
SERVED = {"widedp.models": "models", "widedp.data_prep": "data_prep", "widedp.eval": "eval"}
DATA_ONLY = {"widedp.configs": "configs"}  # a folder of package data (no __init__.py): the example configs


def _listed_packages() -> set[str]:
    body = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    return {p.strip().strip('"') for p in body.split(",") if p.strip()}


def _folder(package: str) -> Path:
    top = ".".join(package.split(".")[:2])
    if top in SERVED:
        return ROOT / SERVED[top] / Path(*package.split(".")[2:])
    return ROOT / Path(*package.split("."))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built (no network: this environment's setuptools) from a copy of the sources."""
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("pip and setuptools are needed to build the wheel")
    src = tmp_path_factory.mktemp("src")
    keep = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("widedp", *SERVED.values(), *DATA_ONLY.values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=keep)
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(out), str(src)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (path,) = out.glob("widedp-*.whl")
    return path


def test_wheel_holds_every_package_and_no_top_level_strays(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"widedp", f"widedp-{widedp.__version__}.dist-info"}, tops  # no models/, eval/, data_prep/
    inits = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert inits == _listed_packages() - set(DATA_ONLY)
    for package in _listed_packages() - set(DATA_ONLY):  # every module of every package, from its folder on disk
        on_disk = {p.name for p in _folder(package).glob("*.py")}
        in_wheel = {n.rsplit("/", 1)[1] for n in names if n.rsplit("/", 1)[0] == package.replace(".", "/")
                    and n.endswith(".py")}
        assert in_wheel == on_disk, package
    assert {"widedp/native/fused.cpp", "widedp/native/svt.cpp"} <= set(names)  # compiled at first use
    assert {n for n in names if n.startswith("widedp/configs/")} == \
        {f"widedp/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}


def test_wheel_metadata_version_entry_point_and_extras(wheel: Path) -> None:
    z = zipfile.ZipFile(wheel)
    info = f"widedp-{widedp.__version__}.dist-info"
    meta = Parser().parsestr(z.read(f"{info}/METADATA").decode())
    assert meta["Version"] == widedp.__version__
    assert set(meta.get_all("Provides-Extra")) >= {"opacus", "eval", "data", "recsys", "recsys-cpu", "dev"}
    core = " ".join(r for r in meta.get_all("Requires-Dist") if "extra ==" not in r)
    for heavy in ("opacus", "torchrec", "matplotlib", "datasets", "fbgemm"):
        assert heavy not in core, heavy
    assert "widedp = widedp.cli:main" in z.read(f"{info}/entry_points.txt").decode()


#: runs the CLI of the copy of widedp installed in sys.argv[1] (not this checkout), prints where it came from
INSTALLED = """
import contextlib, io, json, sys
sys.path.insert(0, sys.argv[1])
import widedp
from widedp.cli import main
outs = []
for argv in json.loads(sys.argv[2]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    outs.append([rc, out.getvalue()])
print(json.dumps({"file": widedp.__file__, "runs": outs}))
"""


def test_installed_wheel_lists_and_runs_its_example_configs(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                        str(target), "--disable-pip-version-check", str(wheel)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    shipped = target / "widedp" / "configs"
    runs = [["configs"], ["configs", "module_example"], ["epsilon", str(shipped / "module_example.yaml")],
            ["configs", "no_such_config"]]
    r = subprocess.run([sys.executable, "-c", INSTALLED, str(target), json.dumps(runs)], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).parent == target / "widedp"
    (rc1, listing), (rc2, text), (rc3, report), (rc4, _) = got["runs"]
    assert (rc1, rc2, rc3, rc4) == (0, 0, 0, 2)
    names = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert listing.splitlines()[0] == f"{len(names)} example configs in {shipped}"
    assert [line.split()[0] for line in listing.splitlines()[2:]] == names
    assert text == (ROOT / "configs" / "module_example.yaml").read_text(encoding="utf-8")
    assert json.loads(report)["epsilon"] > 0
    assert "widedp: error: configs: no shipped config named 'no_such_config' (widedp configs lists them)" in r.stderr


def test_every_package_folder_is_listed() -> None:
    """The setuptools list against the folders on disk (fast; the wheel tests above build it)."""
    found = {"widedp." + p.parent.relative_to(ROOT / "widedp").as_posix().replace("/", ".")
             for p in (ROOT / "widedp").rglob("__init__.py") if p.parent != ROOT / "widedp"}
    for package, folder in SERVED.items():
        found |= {package} | {f"{package}." + p.parent.relative_to(ROOT / folder).as_posix().replace("/", ".")
                              for p in (ROOT / folder).rglob("*/__init__.py")}
    assert found | {"widedp"} | set(DATA_ONLY) == _listed_packages()


def test_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"widedp {widedp.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+([.+-]?\w+)*", widedp.__version__)


def test_statements_record_the_version() -> None:
    private = PrivacyStatement(2.0, 1e-5, "sentence").to_json()
    plain = for_run(UnitFacts("sentence"), epsilon=None, delta=None, accountant="pld", private_rng=True).to_json()
    assert private["widedp_version"] == plain["widedp_version"] == widedp.__version__


def test_needs_names_the_extra_and_lets_other_errors_through() -> None:
    said = re.escape("task: recsys needs torchrec") + ".*widedp\\[recsys-cpu\\]"
    with pytest.raises(MissingExtraError, match=said), needs("recsys", "task: recsys"):
        raise ModuleNotFoundError("No module named 'torchrec'", name="torchrec")
    # not one of the extra's modules: a bug, not a missing extra
    with pytest.raises(ModuleNotFoundError), needs("opacus", "dp.engine: opacus"):
        raise ModuleNotFoundError("No module named 'widedp.nope'", name="widedp.nope")
    assert set(INSTALL) == set(EXTRAS)


def test_pyplot_without_matplotlib_is_a_note(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    pyplot.cache_clear()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    try:
        assert pyplot("the test figure") is None
    finally:
        pyplot.cache_clear()
    assert "the test figure not drawn" in capsys.readouterr().err


#: runs widedp with the extras' modules hidden (as in a core-only install): find_spec answers None for them
HIDDEN = """
import importlib.abc, json, sys
HIDE = {"opacus", "torchrec", "fbgemm_gpu", "matplotlib", "datasets", "pandas", "pyarrow"}
class Hide(importlib.abc.MetaPathFinder):
    def __init__(self, inner): self.inner = inner
    def find_spec(self, name, path=None, target=None):
        return None if name.partition(".")[0] in HIDE else self.inner.find_spec(name, path, target)
sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
from widedp.cli import main
rcs = [main(a) for a in json.loads(sys.argv[1])]
print(json.dumps({"rcs": rcs, "loaded": sorted(m for m in HIDE if m in sys.modules)}))
"""


def test_core_cli_works_without_the_extras(tmp_path: Path) -> None:
    cfg = str(ROOT / "configs" / "module_example.yaml")
    runs = [["train", cfg, "--out", str(tmp_path / "run"), "--no-progress", "--set", "train.max_steps=3"],
            ["epsilon", str(ROOT / "configs" / "recsys_synthetic_sparse_exp.yaml")]]
    r = subprocess.run([sys.executable, "-c", HIDDEN, json.dumps(runs)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"rcs": [0, 2], "loaded": []}
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["privacy"]["widedp_version"] == \
        widedp.__version__
    assert "matplotlib is not installed (pip install 'widedp[eval]')" in r.stderr
    assert "widedp: error: task: recsys needs torchrec, which is not installed: pip install 'widedp[recsys]'" in \
        r.stderr


def test_api_reference_is_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location("api_docs", ROOT / "scripts" / "api_docs.py")
    api_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api_docs)
    assert (ROOT / "docs" / "api.md").read_text(encoding="utf-8") == api_docs.render(), \
        "docs/api.md is out of date: run python scripts/api_docs.py"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_up_to_date() -> None:
    config_docs = _script("config_docs")
    assert (ROOT / "docs" / "configs.md").read_text(encoding="utf-8") == config_docs.render(), \
        "docs/configs.md is out of date: run python scripts/config_docs.py"


def test_config_reference_lists_every_key_with_its_type_default_and_meaning() -> None:
    from widedp.config import TASK_SECTIONS, DPConfig, TrainConfig, VocabDPConfig
    from widedp.config.selection import SELECTIONS, PreselectConfig

    config_docs = _script("config_docs")
    text = (ROOT / "docs" / "configs.md").read_text(encoding="utf-8")  # (its rows: the up-to-date test)
    classes = {c for data, model, _, algo in TASK_SECTIONS.values() for c in (data, model, algo) if c is not None}
    for cls in classes | {VocabDPConfig, TrainConfig, DPConfig, PreselectConfig, *SELECTIONS.values()}:
        rows = config_docs.table(cls).splitlines()[2:]
        assert [r.split(" | ")[0] for r in rows] == [f"| `{f.name}`" for f in dataclasses.fields(cls)]
        assert all(len(r.split(" | ")) >= 4 and r.split(" | ")[3].strip(" |") for r in rows), cls
        assert f"[`{cls.__name__}`](api.md#" in text, cls
    # the parser: an entry per key, several keys in one entry, an entry that starts after a sentence
    train = config_docs.args_entries(TrainConfig)
    assert train["betas"] == train["eps"] == "Adam's." and train["lr"] == "learning rate."
    assert train["checkpoint_every"].startswith("steps between checkpoints")
    assert config_docs.first_sentence("a (b. C) c. D e.") == "a (b. C) c."


def test_config_reference_refuses_an_undocumented_key() -> None:
    @dataclasses.dataclass(frozen=True)
    class Section:
        """A section.

        Args:
            known: documented.
        """

        known: int = 1
        unknown: int = 2

    with pytest.raises(SystemExit, match="the field 'unknown' has no entry"):
        _script("config_docs").table(Section)
