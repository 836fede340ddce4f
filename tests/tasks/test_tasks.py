"""widedp.tasks: the tasks in a plain dict behind one protocol, imported only when asked for."""

import inspect
import subprocess
import sys

import pytest

from widedp.errors import ConfigError
from widedp.tasks import TASKS, AlgorithmTask, Task, get_task, loop_task
from widedp.tasks.base import LoopTask


def test_tasks_are_a_plain_dict_of_functions():
    assert set(TASKS) == {"cbow", "recsys", "glm", "module"}
    assert all(inspect.isfunction(f) for f in TASKS.values())
    for name in TASKS:
        task = get_task(name)
        assert task.name == name and get_task(name) is task
        assert isinstance(task, AlgorithmTask) == (name == "glm")
    with pytest.raises(ConfigError, match=r"^task: expected one of cbow, recsys, glm, module, got 'nope'"):
        get_task("nope")
    with pytest.raises(ConfigError, match="task: glm runs its own algorithms"):
        loop_task("glm")


def test_loop_tasks_implement_the_protocol():
    members = {n for n, _ in inspect.getmembers(Task) if not n.startswith("_")} | {"name", "summary_keys"}
    for name in ("cbow", "recsys", "module"):
        task = loop_task(name)
        assert isinstance(task, LoopTask)
        missing = [m for m in members if not hasattr(task, m)]
        assert not missing, (name, missing)
        assert type(task).build is not LoopTask.build, name  # every task builds its own data and model


def test_importing_the_tasks_imports_no_task():
    """No import-time registration: `import widedp.tasks` (and asking for cbow) does not load torchrec."""
    code = ("import sys, widedp.tasks as t; t.get_task('cbow'); "
            "print(any(m == 'torchrec' or m.startswith('torchrec.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_statements_list_what_the_record_local_split_leaves_out():
    """The split is record-local (``widedp.data_prep.splits``), so it is covered; what is not: the data's size
    (q = b/N), split sizes given as counts (rates n/N) and positional cuts (max_sentences / max_interactions)."""
    from widedp.accounting.statement import SIZE_NOT_COVERED, for_config, for_run
    from widedp.config import config_from_dict
    from widedp.tasks.cbow import COUNTED_SPLITS_NOT_COVERED, VOCAB_NOT_COVERED
    from widedp.tasks.recsys import COUNTED_SPLITS_NOT_COVERED as RECSYS_COUNTED

    dp = {"clip1": 1.0, "noise_multiplier": 1.0, "selection": {"name": "all"}}
    cbow = loop_task("cbow")
    assert cbow.privacy(config_from_dict({"dp": dp})).not_covered == (VOCAB_NOT_COVERED,)  # paper: fractions
    counts = cbow.privacy(config_from_dict({"data": {"splits": [1000, 100, 100]}, "dp": dp}))
    assert counts.not_covered == (VOCAB_NOT_COVERED, COUNTED_SPLITS_NOT_COVERED)
    cfg = config_from_dict({"data": {"splits": [0.5, 0.2, 0.2], "max_sentences": 50}, "dp": dp})
    fractions = cbow.privacy(cfg)
    assert COUNTED_SPLITS_NOT_COVERED not in fractions.not_covered
    assert any("first 50 sentences by position" in g for g in fractions.not_covered)
    stmt = for_run(for_config(fractions, cfg), epsilon=1.0, delta=1e-5, accountant="pld", private_rng=True)
    assert stmt.not_covered[-1] == SIZE_NOT_COVERED and "q = b/N" in stmt.text
    fixed_q = config_from_dict({"data": {"splits": [0.5, 0.2, 0.2]}, "dp": {**dp, "sampling_rate": 0.01}})
    assert for_config(cbow.privacy(fixed_q), fixed_q).not_covered == (VOCAB_NOT_COVERED,)
    rec = loop_task("recsys").privacy(config_from_dict({"task": "recsys", "dp": dp}))
    assert rec.not_covered == ()  # synthetic, fractions: only the size, added by for_config
    counted = loop_task("recsys").privacy(config_from_dict({"task": "recsys", "data": {"splits": [100, 10, 10]},
                                                            "dp": dp}))
    assert counted.not_covered == (RECSYS_COUNTED,)
