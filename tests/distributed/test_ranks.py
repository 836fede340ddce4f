"""widedp.distributed.ranks: leaving the process group ends its threads (a rank's clean exit)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CLOSE_THEN_LIST_THREADS = textwrap.dedent("""
    import os
    from widedp.distributed import ranks
    ranks.init_process_group(0, 1, port=ranks.free_port(), backend="gloo")
    import torchrec  # as a rank's task does after joining: it imports torch.distributed.nn.functional
    ranks.close()
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:
            pass
    print(" ".join(names))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
def test_close_ends_gloo_threads_even_after_a_late_import():
    """torch.distributed.nn.functional takes ``group.WORLD`` as a default argument when imported: imported after
    the group exists, it kept gloo's threads alive past ``destroy_process_group`` until interpreter exit, where
    a rank that had finished its run could abort (SIGABRT, "terminate called without an active exception")."""
    r = subprocess.run([sys.executable, "-c", CLOSE_THEN_LIST_THREADS], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    threads = r.stdout.split()
    assert threads, r.stdout
    assert not [t for t in threads if "gloo" in t], threads
