"""A tiny text corpus for end-to-end CBOW runs in tests (the words w0 .. w{V-1}, five a line)."""

from __future__ import annotations

from pathlib import Path


def text(*, lines: int = 300, words: int = 11) -> str:
    return "".join(f"w{i % words} w{(i * 3) % words} w{(i * 5) % words} w{(i + 1) % words} w{(i * 7) % words}\n"
                   for i in range(lines))


def data_section(tmp_path: Path, *, lines: int = 300, words: int = 11, splits: str = "[1000, 100, 100]",
                 extra: str = "") -> str:
    """Write the corpus to ``tmp_path/corpus.txt``; return the config's ``data:`` line that reads it (vocab_size =
    ``words``, no filters, cache in ``tmp_path/cache``; ``extra``: more keys, starting with ", ")."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text(lines=lines, words=words))
    return (f'data: {{preset: custom, corpus: "text:{corpus}", vocab_size: {words}, remove_stopwords: false, '
            f'alpha_only: false,\n       splits: {splits}, cache_dir: "{tmp_path / "cache"}"{extra}}}')


#: a small DP CBOW config over ``text()`` (format with ``corpus=`` and ``cache=`` paths), for CLI error tests
GOOD_CONFIG = """data: {{preset: custom, corpus: "text:{corpus}", vocab_size: 11, remove_stopwords: false,
       alpha_only: false, splits: [1000, 100, 100], cache_dir: "{cache}"}}
model: {{dim: 8, tied: false}}
train: {{epochs: 1, batch_size: 10, optimizer: lazy_adam, lr: 0.01, log_every: 25, eval_max_samples: 50}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, selection: {{name: uniform, k: 4}}}}
"""

