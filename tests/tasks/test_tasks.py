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
