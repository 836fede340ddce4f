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


def test_statements_disclose_the_positional_split():
    """The corpus/dataset -> training split step is positional with the public data.seed: every CBOW and recommender
    statement says ε is for one unit of the prepared split (docs/privacy.md §8)."""
    from widedp.config import config_from_dict
    from widedp.tasks.cbow import SPLIT_NOT_COVERED, SPLIT_NOT_COVERED_POOL
    from widedp.tasks.recsys import SPLIT_NOT_COVERED as RECSYS_SPLIT

    dp = {"clip1": 1.0, "noise_multiplier": 1.0, "selection": {"name": "all"}}
    cbow = loop_task("cbow")
    assert SPLIT_NOT_COVERED in cbow.privacy(config_from_dict({"dp": dp})).not_covered
    pooled = cbow.privacy(config_from_dict({"data": {"negatives_pool": 100}, "dp": dp})).not_covered
    assert SPLIT_NOT_COVERED_POOL in pooled and SPLIT_NOT_COVERED not in pooled
    rec = loop_task("recsys").privacy(config_from_dict({"task": "recsys", "dp": dp}))
    assert RECSYS_SPLIT in rec.not_covered
