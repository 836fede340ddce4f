"""Public word vectors for a warm start (``model.init_vectors``), trained without privacy on PUBLIC text only.

No network is assumed: the text is what gensim ships in its test data (``gensim/test/test_data``), public and
unrelated to Brown (the private corpus widedp trains on):

- ``enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``: an excerpt of an English Wikipedia
  dump (CC BY-SA 3.0 / GFDL, Wikipedia's licence), read with ``gensim.corpora.WikiCorpus`` (markup removed, articles
  of fewer than 50 words dropped, lower case, tokens of 2 to 15 characters);
- ``lee_background.cor``: the Lee background corpus (ABC news articles, one per line; gensim ships it with a request
  to cite Lee, Pincombe & Welsh 2005 and states no licence), tokenised as the Wikipedia text
  (``gensim.utils.simple_preprocess``, 2 to 15 characters).

Left out: ``head500.noblanks.cor`` (Wikipedia too, but stemmed and stripped of stop words: "dictionari", "polit";
its tokens would not match an unstemmed vocabulary, and would mix stemmed and whole words in one table).

Trained: gensim ``Word2Vec`` CBOW with negative sampling at the default job's shape (vector_size = ``model.dim`` 100,
window 4 and 8 negatives as the ``paper`` preset, min_count 5, 10 epochs), seeded (``--seed``, one worker thread, so
the same vectors every run), written in word2vec format to ``bench/out/public_vectors/`` (``vectors.txt``, text;
``vectors.bin``, binary) with ``public_vectors.json`` (sources, licences, token and sentence counts, settings, the
files' sha256; two runs gave the same bytes). 511,096 tokens: Wikipedia 452,944 in 106 articles, Lee 58,152 in
300 documents; 9,733 words kept (min_count 5). A small corpus, so the vectors are weak: a public prior, not a claim
about good public vectors.

    nice -n 10 .venv/bin/python bench/public_vectors.py            # ~15-30 s on one core

With ``--score VOCAB.json ...`` (a run's ``vocab.json``) it also writes the "public vectors alone" reference: the
WordSim-353 / SimLex-999 Spearman of the table a warm-started run starts from (found words: their public vector;
the others: the CBOW's default init, ``train.seed`` 0), restricted to that vocabulary (``widedp.eval.similarity``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "out" / "public_vectors"
SOURCES = {
    "enwiki": ("enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
               "English Wikipedia excerpt (gensim test data), CC BY-SA 3.0 / GFDL"),
    "lee_background": ("lee_background.cor",
                       "Lee background corpus, ABC news (gensim test data; cite Lee, Pincombe & Welsh 2005; "
                       "no licence stated)"),
}
SETTINGS = {"vector_size": 100, "window": 4, "negative": 8, "sg": 0, "hs": 0, "min_count": 5, "epochs": 10,
            "sample": 1e-3, "workers": 1}


def _data_path(name: str) -> Path:
    from gensim.test.utils import datapath

    return Path(datapath(name))


def sentences() -> Iterator[list[str]]:
    """Token lists of the sources, in order: the Wikipedia articles, then the Lee documents."""
    from gensim.corpora import WikiCorpus
    from gensim.utils import simple_preprocess

    wiki = WikiCorpus(str(_data_path(SOURCES["enwiki"][0])), dictionary={}, processes=1)
    yield from wiki.get_texts()
    with _data_path(SOURCES["lee_background"][0]).open(encoding="utf-8") as f:
        for line in f:
            tokens = simple_preprocess(line, min_len=2, max_len=15)
            if tokens:
                yield tokens


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def train(out: Path, *, seed: int) -> dict:
    """Train the vectors, write them and their record; returns the record."""
    from gensim.models import Word2Vec

    t0 = time.perf_counter()
    corpus = list(sentences())
    tokens = sum(len(s) for s in corpus)
    model = Word2Vec(corpus, seed=seed, **SETTINGS)
    out.mkdir(parents=True, exist_ok=True)
    model.wv.save_word2vec_format(str(out / "vectors.txt"), binary=False)
    model.wv.save_word2vec_format(str(out / "vectors.bin"), binary=True)
    record = {"sources": {k: {"file": f, "licence": lic} for k, (f, lic) in SOURCES.items()},
              "sentences": len(corpus), "tokens": tokens, "words": len(model.wv), "seed": seed,
              "settings": SETTINGS, "seconds": round(time.perf_counter() - t0, 1),
              "sha256": {name: sha256(out / name) for name in ("vectors.txt", "vectors.bin")}}
    (out / "public_vectors.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def score(vectors: Path, vocab_file: Path, *, dim: int = 100) -> dict:
    """Word similarity of the table a warm-started untied CBOW over ``vocab_file``'s words starts from."""
    import torch

    from widedp.eval import similarity as sim
    from widedp.models.cbow import CBOW
    from widedp.models.init_vectors import apply_, load_init_vectors

    words = json.loads(vocab_file.read_text())
    model = CBOW(len(words), dim, tied=False, generator=torch.Generator().manual_seed(0))
    init = load_init_vectors(str(vectors), words, dim=dim)
    apply_(model, init, output="zeros")
    table = model.input.weight.detach().numpy().astype(np.float64)
    found = np.zeros(len(words), dtype=bool)
    found[init.rows.numpy()] = True
    return {"vocab": str(vocab_file), "V": len(words), "found": int(found.sum()),
            "all_rows": sim.word_similarity(words, table),
            "found_rows_only": sim.word_similarity([w for w, k in zip(words, found) if k], table[found])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--score", type=Path, nargs="*", default=[], help="vocab.json files to score the init table on")
    ap.add_argument("--skip-train", action="store_true", help="score the vectors already in --out")
    args = ap.parse_args()
    if not args.skip_train:
        rec = train(args.out, seed=args.seed)
        print(f"{rec['tokens']:,} tokens, {rec['sentences']:,} articles/documents, {rec['words']:,} words, "
              f"{rec['seconds']} s -> {args.out}")
    if args.score:
        scores = [score(args.out / "vectors.txt", v) for v in args.score]
        (args.out / "scores.json").write_text(json.dumps(scores, indent=2) + "\n")
        for s in scores:
            ws, sl = s["all_rows"]["wordsim353"], s["all_rows"]["simlex999"]
            print(f"V={s['V']:,} ({s['found']:,} found): WS353 {ws['spearman']:.3f} ({ws['in_vocab']} pairs), "
                  f"SimLex {sl['spearman']:.3f} ({sl['in_vocab']} pairs)")


if __name__ == "__main__":
    main()
