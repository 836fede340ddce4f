"""widedp configs: the shipped example configs listed (one line each, sweeps marked) and printed; a name that is
not one of them is one error line (the installed wheel's copy: tests/test_packaging.py)."""

from pathlib import Path

from widedp.cli import main
from widedp.commands import configs

ROOT = Path(__file__).resolve().parents[2]


def test_lists_every_shipped_config_with_its_first_comment_line(capsys):
    assert configs.shipped_dir() == ROOT / "configs"
    assert main(["configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert lines[0] == f"{len(paths)} example configs in {ROOT / 'configs'}"
    assert f"widedp train {ROOT / 'configs' / 'NAME.yaml'}" in lines[1]
    rows = {line.split()[0]: line.split(None, 1)[1] for line in lines[2:]}
    assert list(rows) == [p.stem for p in paths]
    assert rows["smoke_sweep"].startswith("[sweep: widedp compare] A tiny sweep")
    assert rows["module_example"].startswith("Your own model from the CLI")


def test_prints_one_config_and_refuses_another_name(capsys, tmp_path):
    text = (ROOT / "configs" / "module_example.yaml").read_text(encoding="utf-8")
    for name in ("module_example", "module_example.yaml"):
        assert main(["configs", name]) == 0
        assert capsys.readouterr().out == text
    for bad in ("nope", "../configs/module_example", str(ROOT / "configs" / "module_example.yaml")):
        assert main(["configs", bad]) == 2
        assert capsys.readouterr().err == (f"widedp: error: configs: no shipped config named {bad!r} "
                                           "(widedp configs lists them)\n")


def test_describe_without_comments(tmp_path):
    (tmp_path / "bare.yaml").write_text("runs: []\n")
    assert configs.describe(tmp_path / "bare.yaml") == "[sweep: widedp compare]"
