"""Brown category classification data: documents -> token chunks -> sparse bag-of-words rows + labels, cached.

Pipeline: each document's tokens are filtered like the CBOW corpus (lowercase, alphabetic, NLTK stop words out);
the documents are split train/valid/test (record-local, ``widedp.data_prep.splits``: by a key of each document
alone — Brown's file id, a text line's label and tokens — so that no document has chunks on both sides, or by a key
of each chunk's label and words with ``split_by: chunk``); each filtered token stream is cut into ``chunk_tokens``-token
chunks (a trailing chunk shorter than ``min_chunk_tokens`` is dropped); the vocabulary is the ``vocab_size`` most
frequent words of the TRAINING chunks only; a chunk's row is weighted counts over the vocabulary (``tf``, ``log``
= log(1+tf), ``binary``) plus a constant ``bias_feature`` column (the last column), normalised to unit ``l2`` (default)
or ``l1`` norm — which fixes the GLM's Lipschitz constants (``widedp.models.glm``). Rows with no in-vocabulary word
keep only the bias feature (or are all zero without one).

Privacy unit (what the GLM task's epsilon protects, add/remove): one row = one chunk with its document's label
(``chunk_tokens: 0``: one whole document). Each row is weighted and normalised by its OWN counts and norm, so no
training-set statistic enters the features; the vocabulary (train-chunk counts) and the label set are computed from
the data outside the privacy ledger (``widedp.tasks.glm.not_covered``). The split is 1-stable: adding or removing a
chunk moves no other chunk between the splits — except a text corpus split by document, whose document key is its
whole text (the statement says so).

Cache: ``<cache_dir>/brown-glm-v2-<key>.npz`` (the CSR arrays of the three splits) + ``.json`` (vocabulary, labels).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from widedp.config.glm import GLMDataConfig
from widedp.data_prep import corpus as corpus_mod
from widedp.data_prep import splits as splits_mod
from widedp.errors import ConfigError

_FORMAT = 2  # 2: record-local splits

#: Brown's 15 categories in 4 groups (``labels: group``).
BROWN_GROUPS: dict[str, str] = {
    "news": "press", "editorial": "press", "reviews": "press",
    "religion": "general", "hobbies": "general", "lore": "general", "belles_lettres": "general",
    "government": "learned", "learned": "learned",
    "fiction": "fiction", "mystery": "fiction", "science_fiction": "fiction", "adventure": "fiction",
    "romance": "fiction", "humor": "fiction",
}


@dataclass(frozen=True)
class CSRSplit:
    """One split: rows as CSR (indptr [n+1], indices [nnz] int64 feature ids, values [nnz] float64), labels [n]."""

    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class GLMData:
    """Prepared data. vocab: the V words (feature id = index; feature V is the bias when ``has_bias``)."""

    vocab: list[str]
    classes: list[str]
    has_bias: bool
    train: CSRSplit
    valid: CSRSplit
    test: CSRSplit

    @property
    def num_features(self) -> int:
        return len(self.vocab) + int(self.has_bias)


# ------------------------------------------------------------------------------------------------------ reading


def read_documents(cfg: GLMDataConfig) -> tuple[list[list[str]], list[str], list[str] | None]:
    """Raw token lists, labels and names (Brown: the file ids, one file = one document; a text corpus: None) of the
    corpus's documents."""
    if cfg.corpus == "brown":
        brown = corpus_mod._nltk_corpus("brown")
        fids = brown.fileids()
        if cfg.max_docs:
            fids = fids[: cfg.max_docs]
        docs = [list(brown.words(f)) for f in fids]
        labels = [brown.categories(f)[0] for f in fids]
        if cfg.labels == "group":
            labels = [BROWN_GROUPS[c] for c in labels]
        return docs, labels, list(fids)
    path = Path(cfg.corpus[5:]).expanduser()
    docs, labels = [], []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.corpus: {path} is not UTF-8 text ({e.reason})") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        if "\t" not in line:
            raise ConfigError(f"data.corpus: {path} line {i + 1}: expected LABEL<TAB>TEXT")
        label, text = line.split("\t", 1)
        labels.append(label.strip())
        docs.append(corpus_mod.TOKEN_RE.findall(text))
        if cfg.max_docs and len(docs) >= cfg.max_docs:
            break
    return docs, labels, None


# ------------------------------------------------------------------------------------------------------ building


def document_keys(docs: Sequence[Sequence[str]], labels: Sequence[str], names: Sequence[str] | None, *,
                  seed: int) -> np.ndarray:
    """[N] uint64 record-local split key of each document (``widedp.data_prep.splits``): its name when it has one
    (Brown's file id: adding or removing one of its chunks keeps the key), else its label and raw tokens (and the
    number of identical documents before it)."""
    blobs = ([n.encode() for n in names] if names is not None else
             ["\x1f".join([lab, *d]).encode() for d, lab in zip(docs, labels)])
    return splits_mod.blob_keys(blobs, seed=seed, purpose="glm-document")


def chunk_keys(chunks: Sequence[Sequence[str]], labels: Sequence[str], *, seed: int) -> np.ndarray:
    """[M] uint64 record-local split key of each chunk (``split_by: chunk``): its label and words."""
    return splits_mod.blob_keys(["\x1f".join([lab, *c]).encode() for c, lab in zip(chunks, labels)], seed=seed,
                                purpose="glm-chunk")


def chunk(ids: np.ndarray, size: int, min_size: int) -> list[np.ndarray]:
    """Cut a token-id stream into ``size``-token chunks (0 = whole); drop a trailing chunk < ``min_size``."""
    if size == 0:
        return [ids] if len(ids) >= max(min_size, 1) else []
    out = [ids[i:i + size] for i in range(0, len(ids), size)]
    return [c for c in out if len(c) >= max(min_size, 1)]


def featurize(chunks: Sequence[np.ndarray], remap: np.ndarray, cfg: GLMDataConfig, *, vocab_size: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR (indptr, indices, values) of the weighted, normalised rows of ``chunks`` (corpus word ids)."""
    indptr, indices, values = [0], [], []
    for c in chunks:
        v = remap[c]
        v = v[v >= 0]
        feat, cnt = np.unique(v, return_counts=True)
        w = cnt.astype(np.float64)
        if cfg.weighting == "log":
            w = np.log1p(w)
        elif cfg.weighting == "binary":
            w = np.ones_like(w)
        if cfg.bias_feature > 0:
            feat = np.append(feat, vocab_size)
            w = np.append(w, cfg.bias_feature)
        norm = np.linalg.norm(w, 2 if cfg.norm == "l2" else 1) if len(w) else 0.0
        if norm > 0:
            w = w / norm
        indices.append(feat.astype(np.int64))
        values.append(w)
        indptr.append(indptr[-1] + len(feat))

    def cat(xs: list[np.ndarray], dt: type) -> np.ndarray:
        return np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)

    return np.asarray(indptr, np.int64), cat(indices, np.int64), cat(values, np.float64)


def build_glm_data(docs: Sequence[Sequence[str]], labels: Sequence[str], cfg: GLMDataConfig,
                   names: Sequence[str] | None = None) -> GLMData:
    """Everything after reading: filter, split, chunk, vocabulary (train only), features."""
    if not docs:
        raise ConfigError(f"data.corpus: no documents in {cfg.corpus}")
    corp = corpus_mod.apply_filters(docs, cfg)
    classes = sorted(set(labels))
    y_doc = np.array([classes.index(c) for c in labels], dtype=np.int64)
    doc_chunks = [chunk(corp.ids[corp.offsets[i]:corp.offsets[i + 1]], cfg.chunk_tokens, cfg.min_chunk_tokens)
                  for i in range(len(docs))]
    items = [(d, c) for d, cs in enumerate(doc_chunks) for c in cs]
    if not items:
        raise ConfigError(f"data.chunk_tokens: no chunk of >= {cfg.min_chunk_tokens} tokens in {cfg.corpus}")
    if cfg.split_by == "document":
        keys = document_keys(docs, labels, names, seed=cfg.seed)[[d for d, _ in items]]
    else:
        keys = chunk_keys([[str(corp.words[i]) for i in c] for _, c in items], [labels[d] for d, _ in items],
                          seed=cfg.seed)
    which = splits_mod.assign(keys, splits_mod.split_rates(cfg.splits, len(items), what="chunks"))
    train_chunks = [c for (_, c), s in zip(items, which) if s == 0]
    if not train_chunks:
        raise ConfigError("data.splits: the train split is empty")
    counts = np.bincount(np.concatenate(train_chunks), minlength=len(corp.words))
    distinct = int(np.count_nonzero(counts))
    if cfg.vocab_size > distinct:
        raise ConfigError(f"data.vocab_size: {cfg.vocab_size} is more than the {distinct} distinct words of the "
                          "training split")
    order = np.argsort(-counts, kind="stable")[: cfg.vocab_size]
    remap = np.full(len(corp.words), -1, dtype=np.int64)
    remap[order] = np.arange(cfg.vocab_size)
    splits = []
    for s in range(3):
        sel = splits_mod.members(which, keys, s).tolist()  # in key order (chunks of a document: in its order)
        ip, ix, vals = featurize([items[i][1] for i in sel], remap, cfg, vocab_size=cfg.vocab_size)
        splits.append(CSRSplit(ip, ix, vals, y_doc[[items[i][0] for i in sel]].astype(np.int64)))
    return GLMData([str(corp.words[i]) for i in order], classes, cfg.bias_feature > 0, *splits)


# -------------------------------------------------------------------------------------------------------- cache


def prepare_glm(cfg: GLMDataConfig) -> GLMData:
    """Build (or load from ``cfg.cache_dir``) the splits of ``cfg``."""
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else None
    stem = root / f"brown-glm-v{_FORMAT}-{cfg.cache_key()}" if root is not None else None
    if stem is not None and (cached := _load(stem)) is not None:
        return cached
    docs, labels, names = read_documents(cfg)
    data = build_glm_data(docs, labels, cfg, names)
    if stem is not None:
        _save(stem, data)
    return data


def _save(stem: Path, data: GLMData) -> None:
    arrays = {}
    for name in ("train", "valid", "test"):
        sp = getattr(data, name)
        for k in ("indptr", "indices", "values", "labels"):
            arrays[f"{name}_{k}"] = getattr(sp, k)
    meta = json.dumps({"vocab": data.vocab, "classes": data.classes, "has_bias": data.has_bias}).encode()
    corpus_mod.write_atomic(stem.with_suffix(".json"), lambda f: f.write(meta))
    corpus_mod.atomic_savez(stem.with_suffix(".npz"), **arrays)


def _load(stem: Path) -> GLMData | None:
    npz, js = stem.with_suffix(".npz"), stem.with_suffix(".json")
    if not (npz.is_file() and js.is_file()):
        return None
    try:
        meta = json.loads(js.read_text())
        with np.load(npz, allow_pickle=False) as z:
            splits = [CSRSplit(*(z[f"{n}_{k}"] for k in ("indptr", "indices", "values", "labels")))
                      for n in ("train", "valid", "test")]
        return GLMData(meta["vocab"], meta["classes"], bool(meta["has_bias"]), *splits)
    except corpus_mod.DAMAGED:  # damaged entry: rebuild
        return None
