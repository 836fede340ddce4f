import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_NLTK = ROOT.parent / "shared" / "nltk_data"
if "NLTK_DATA" not in os.environ and SHARED_NLTK.is_dir():
    os.environ["NLTK_DATA"] = str(SHARED_NLTK)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(1)
if not torch.cuda.is_available():  # Triton kernels (widedp/native/gpu.py) run in Triton's interpreter on CPU tensors;
    os.environ.setdefault("TRITON_INTERPRET", "1")  # it must be set before Triton is first imported


@pytest.fixture(autouse=True)
def _triton_on_for_each_test(monkeypatch):
    """A Triton kernel that fails turns Triton off for the rest of the process (``widedp.native.gpu._broken``): in
    the tests, for the rest of that test only."""
    from widedp.native import gpu

    monkeypatch.setattr(gpu, "_broken", {})


@pytest.fixture(scope="session")
def brown_cache(tmp_path_factory) -> str:
    """One cache directory for every Brown test of the session (Brown loads in ~10 s, once)."""
    return str(tmp_path_factory.mktemp("widedp-cache"))
