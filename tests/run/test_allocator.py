"""glibc malloc tuning: accepted by glibc, a no-op (never an exception) elsewhere or when opted out, and the first
thing the CLI does. Its effect (page faults, step time) is measured by bench/bench_allocator.py, not here."""

import ctypes
import json
import platform
import subprocess
import sys

import pytest

from widedp import allocator, cli
from widedp.allocator import SETTINGS, tune_malloc
from widedp.errors import ConfigError

GLIBC_LINUX = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.fixture(autouse=True)
def _no_malloc_env(monkeypatch):
    for name in ["WIDEDP_MALLOC", "GLIBC_TUNABLES", *(env for _, _, env in SETTINGS.values())]:
        monkeypatch.delenv(name, raising=False)


def test_tune_malloc_sets_every_parameter_on_glibc_and_can_repeat():
    first, again = tune_malloc(), tune_malloc()
    assert first == again
    if GLIBC_LINUX:  # mallopt returned 1 for each value (it rejects e.g. an mmap threshold over 32 MiB)
        assert first == {"status": "tuned", "set": {name: value for name, (_, value, _) in SETTINGS.items()}}
    else:
        assert first["status"] == "unsupported"


def test_opt_out_touches_nothing(monkeypatch):
    monkeypatch.setenv("WIDEDP_MALLOC", "system")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: pytest.fail("libc loaded despite WIDEDP_MALLOC=system"))
    assert tune_malloc() == {"status": "system"}


def test_a_glibc_setting_the_user_made_is_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    out = tune_malloc()
    if GLIBC_LINUX:
        assert out == {"status": "tuned", "set": {"M_TOP_PAD": SETTINGS["M_TOP_PAD"][1]}}


def test_bad_opt_out_value_is_a_config_error(monkeypatch):
    monkeypatch.setenv("WIDEDP_MALLOC", "sytem")
    with pytest.raises(ConfigError, match="WIDEDP_MALLOC='sytem'"):
        tune_malloc()


class _LibcWithoutMallopt:
    def __getattr__(self, name):
        raise AttributeError(name)


def _no_libc(*args, **kwargs):
    raise OSError("libc.so.6: cannot open shared object file")


@pytest.mark.parametrize("case", ["musl", "macos", "no_mallopt", "no_libc"])
def test_no_op_where_mallopt_is_missing(monkeypatch, case):
    if case == "musl":
        monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("", ""))
    elif case == "macos":
        monkeypatch.setattr(allocator.sys, "platform", "darwin")
    else:
        monkeypatch.setattr(allocator.sys, "platform", "linux")
        monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("glibc", "2.36"))
        monkeypatch.setattr(ctypes, "CDLL", (lambda *a, **k: _LibcWithoutMallopt()) if case == "no_mallopt"
                            else _no_libc)
    assert tune_malloc()["status"] == "unsupported"


def test_cli_tunes_first(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(cli, "tune_malloc", lambda: calls.append(1))
    assert cli.main(["export", str(tmp_path / "missing")]) == 2  # a command that fails fast on its input
    assert calls == [1]


def test_cli_tunes_before_torch_is_imported():
    code = ("import json, sys\nimport widedp.cli as c\nseen = []\n"
            "c.tune_malloc = lambda: seen.append('torch' in sys.modules)\n"
            "rc = c.main(['epsilon', 'configs/brown_cbow_sparse_exp.yaml', '--set', 'no.such=1'])\n"
            "print(json.dumps([seen, rc]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [[False], 2], r.stderr


def test_cli_bad_opt_out_value_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("WIDEDP_MALLOC", "bogus")
    assert cli.main(["export", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "WIDEDP_MALLOC" in err[0]
