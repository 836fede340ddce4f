"""``widedp canary``: train CBOW runs with canaries inserted, evaluate them, and report (paper Sec. 6.5).

    widedp canary configs/canary_nonprivate.yaml configs/canary_dpsgd.yaml configs/canary_sparse_exp.yaml \\
        --nc 3 9 15 --out runs/canary          # trains OUT/<config name>/nc<N> for every config and n_c
    widedp canary --runs runs/canary/nonprivate/nc3 runs/canary/dpsgd/nc3 --out runs/canary_eval

Each run directory gets ``canaries.json``: the canary and control phrases (words), n_c, the insertion positions and
the split sizes. The OUT directory gets ``canary.json`` (everything below) and ``canary_ranks.png``.

Training data with canaries: every phrase is inserted n_c times into the in-vocabulary token stream
(``prepare_cbow(phrases=..., repeats=n_c)``) — with ``data.privacy_unit: pair`` at random positions inside
sentences; with sentence or document units each insertion is a sentence and a document OF ITS OWN (one unit, n_c
insertions = n_c units) at a random sentence boundary — and every sample that touches an inserted token goes to the
train split ON TOP of the config's clean train samples (train size = clean size + canary samples; valid/test as
configured, clean). So the clean training data matches the config's Fig. 1 runs, as in "inserting the canaries into
the dataset". With ``data.vocabulary: dp`` the run's vocabulary is drawn first (on the clean corpus, into
``RUN/vocab_release.json``, charged to the run's ledger) and the canaries' words are drawn from it. Such a run is
resumed by re-running ``widedp canary`` with the same arguments (``widedp train
--resume`` would rebuild the data without canaries).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from widedp.config import Config, DataConfig
from widedp.dp import vocab as vocab_dp
from widedp.errors import ConfigError
from widedp.eval.canary import check_vocab, phrase_ranks, sample_phrases, summarize
from widedp.run import rundir
from widedp.run.checkpoint import CHECKPOINT, load_checkpoint, read_json, write_json

CANARIES_FILE = "canaries.json"
REPORT_FILE = "canary.json"
PLOT_FILE = "canary_ranks.png"
_FORMAT = 1

DEFINITIONS = {
    "log_perplexity": "P(c) = -log Pr(c1 | {c0}) - log Pr(c2 | {c0, c1}), full softmax of the CBOW over the vocabulary",
    "candidates": "|R| phrases (c0, c1', c2') per phrase, (c1', c2') uniform over ordered pairs of distinct words",
    "rank": "#{r in R : P(r) >= P(c)} in [0, |R|]; high = memorised (the paper's); a candidate equal to c ties "
            "exactly and counts",
    "position": "1 + #{r in R : P(r) < P(c)} = |R| + 1 - rank (1 = lowest perplexity among R and c; ties: c first)",
    "exposure": "log2 |R| - log2 position, in [log2(|R|/(|R|+1)), log2 |R|]; about 1.44 for unseen phrases",
    "chi2": "Pearson chi-square of the rank histogram (bins over 0..|R|) against the exact uniform expectation; "
            "chi2_distance = chi2 / N",
}


@dataclasses.dataclass(frozen=True)
class CanaryRun:
    """A run directory trained with canaries: its model, vocabulary and canaries.json."""

    run_dir: Path
    model: Any
    vocab: list[str]
    info: dict[str, Any]

    @property
    def label(self) -> str:
        return str(self.info.get("label") or self.run_dir.name)

    def ids(self, key: str, limit: int | None = None) -> torch.Tensor:
        """[N, 3] vocabulary ids of ``info[key]`` (``canaries`` or ``controls``), the first ``limit`` only."""
        index = {w: i for i, w in enumerate(self.vocab)}
        phrases = self.info[key][:limit]
        for p in phrases:
            for w in p:
                if w not in index:
                    raise ConfigError(f"{self.run_dir / CANARIES_FILE}: {w!r} is not in the run's vocabulary")
        return torch.tensor([[index[w] for w in p] for p in phrases], dtype=torch.long).view(-1, 3)


# ------------------------------------------------------------------------------------------------------- training


def check_args(*, ncs: Sequence[int] = (), num_canaries: int = 1, num_candidates: int = 1, bins: int = 2) -> None:
    for nc in ncs:
        if nc <= 0:
            raise ConfigError(f"--nc: every n_c must be > 0, got {nc}")
    if num_canaries < 1:
        raise ConfigError(f"--num-canaries: must be >= 1, got {num_canaries}")
    if num_candidates < 1:
        raise ConfigError(f"--num-candidates: must be >= 1, got {num_candidates}")
    if not 2 <= bins <= num_candidates + 1:
        raise ConfigError(f"--bins: need 2 <= bins <= num_candidates + 1 = {num_candidates + 1}, got {bins}")


def make_phrases(vocab: list[str], *, num: int, seed: int) -> tuple[list[list[str]], list[list[str]]]:
    """``num`` canaries and ``num`` control phrases (disjoint, distinct), words uniform (c1 != c2), seeded."""
    check_vocab(len(vocab))
    gen = torch.Generator().manual_seed(seed)
    canaries = sample_phrases(len(vocab), num, generator=gen)
    controls = sample_phrases(len(vocab), num, generator=gen, exclude=canaries)
    return ([[vocab[i] for i in p] for p in canaries.tolist()], [[vocab[i] for i in p] for p in controls.tolist()])


def clean_stream(cfg: DataConfig, vocab: Any = None) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(vocabulary words, in-vocabulary token stream [N], sentence of each token [N]) as ``prepare_cbow`` builds
    them before inserting canaries; ``vocab``: a given ``Vocab`` (the run's DP one)."""
    return _stream(cfg, vocab)[:3]


def _stream(cfg: DataConfig, vocab: Any = None) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """``clean_stream`` and the document [N] of each token."""
    from widedp.data_prep import corpus as corpus_mod
    from widedp.data_prep.cbow import corpus_vocab

    check_vocab(cfg.vocab_size)
    corp = corpus_mod.load_corpus(cfg)
    vocab = vocab if vocab is not None else corpus_vocab(corp, cfg)
    tok = vocab.remap[corp.ids]
    sent = corp.sentence_of_token()
    keep = tok >= 0
    sent = sent[keep]
    return vocab.words, tok[keep], sent, corp.document_of_sentence()[sent]


def canary_sample_count(cfg: DataConfig, phrase_ids: list[np.ndarray], repeats: int, insert_seed: int,
                        vocab: Any = None) -> tuple[int, int, np.ndarray]:
    """(samples on an inserted token, all samples, ``inserted``) of ``prepare_cbow(cfg, phrases, repeats,
    insert_seed, vocab=vocab)``, by the same steps (the caller checks ``inserted`` against ``CBOWData.inserted``)."""
    from widedp.data_prep.cbow import sample_positions
    from widedp.data_prep.samples import insert_phrase_units, insert_phrases

    _, tokens, sent, doc = _stream(cfg, vocab)
    rng = np.random.default_rng([insert_seed, 3])
    if cfg.privacy_unit == "pair":
        _, sent, is_canary, inserted = insert_phrases(tokens, sent, phrase_ids, repeats, rng)
    else:
        _, sent, _, is_canary, inserted = insert_phrase_units(tokens, sent, doc, phrase_ids, repeats, rng)
    t_pos, c_pos = sample_positions(sent, cfg)
    m = int((is_canary[t_pos] | (is_canary[c_pos] & (c_pos >= 0)).any(axis=1)).sum())
    return m, len(t_pos), inserted


def canary_training_data(cfg: Config, canaries: list[list[str]], *, n_c: int, insert_seed: int, vocab: Any = None
                         ) -> tuple[Config, Any, dict[str, Any]]:
    """(config, CBOWData with the canaries inserted, facts for canaries.json).

    Clean samples keep the record-local split they have without canaries (``data.splits`` rates: counts are rates
    over the clean samples); the train split gets every canary sample on top. ``vocab``: the run's DP ``Vocab``
    (else the config's).
    """
    from widedp.data_prep.cbow import prepare_cbow

    words = clean_stream(cfg.data, vocab)[0]
    index = {w: i for i, w in enumerate(words)}
    phrase_ids = [np.array([index[w] for w in p], dtype=np.int64) for p in canaries]
    m, _, inserted = canary_sample_count(cfg.data, phrase_ids, n_c, insert_seed, vocab)
    data = prepare_cbow(cfg.data, phrases=canaries, repeats=n_c, insert_seed=insert_seed, vocab=vocab)
    if data.inserted is None or not np.array_equal(data.inserted, inserted):  # pragma: no cover - guards drift
        raise RuntimeError("canary positions differ from prepare_cbow's: update canary_sample_count")
    sizes = [len(data.train), len(data.valid), len(data.test)]
    facts = {"canary_samples": m, "clean_train_samples": sizes[0] - m, "splits": sizes,
             "inserted": data.inserted.tolist(),
             "canary_units": "own" if cfg.data.privacy_unit != "pair" else "inside sentences"}
    return cfg, data, facts


def train_canary_run(cfg: Config, run_dir: Path, *, label: str, n_c: int, num_canaries: int, seed: int,
                     progress: bool | str = False, overwrite: bool = False) -> Path:
    """Train ``cfg`` with ``num_canaries`` canaries inserted ``n_c`` times each into ``run_dir``.

    A run directory that already holds the same canaries and a checkpoint of the same config is resumed (a finished
    one returns at once after its final evaluation); one that holds another run is replaced only with ``overwrite``.
    """
    from widedp.run.train import train

    check_args(ncs=[n_c], num_canaries=num_canaries)
    kw = {"label": label, "n_c": n_c, "num_canaries": num_canaries, "seed": seed}
    if cfg.data.vocabulary == "dp":  # the vocabulary belongs to the run: reused only to resume that run
        release = vocab_dp.load_release(run_dir) if (run_dir / CHECKPOINT).is_file() else None
        resume = False
        if release is not None:
            run_cfg, data, info = _canary_setup(cfg, vocab=release.vocab(_corpus(cfg)), **kw)
            resume = _can_resume(run_dir, info)
        if not resume:
            _replace(run_dir, overwrite)  # a new run draws its own vocabulary now
            release = _draw_run_vocabulary(cfg, run_dir)
            run_cfg, data, info = _canary_setup(cfg, vocab=release.vocab(_corpus(cfg)), **kw)
    else:
        run_cfg, data, info = _canary_setup(cfg, vocab=None, **kw)
        resume = _can_resume(run_dir, info)
        if not resume:
            _replace(run_dir, overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / CANARIES_FILE, info)
    train(run_cfg, run_dir, resume=resume, progress=progress, data=data)
    return run_dir


def _replace(run_dir: Path, overwrite: bool) -> None:
    """Start ``run_dir`` afresh: refused when it holds a run (other canaries or config), unless ``overwrite``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if rundir.holds_run(run_dir) and not overwrite:
        raise ConfigError(f"{run_dir}: holds a canary run with other canaries or another config; rerun with "
                          "--overwrite to replace it (its checkpoint and spent-budget journal are then deleted)")
    rundir.prepare(run_dir, resume=False, overwrite=True)


def _corpus(cfg: Config) -> Any:
    from widedp.data_prep import corpus as corpus_mod

    return corpus_mod.load_corpus(cfg.data)


def _draw_run_vocabulary(cfg: Config, run_dir: Path) -> vocab_dp.VocabRelease:
    """A new canary run's DP vocabulary, from fresh seeds (secure: the OS CSPRNG, never stored; reproducible:
    train.seed's, as ``widedp train`` would derive them)."""
    from widedp.dp import rng

    if cfg.dp is None:
        raise ConfigError("data.vocabulary: dp is charged to the run's privacy ledger; it needs a dp: section")
    seeds = rng.new_seeds(mode=cfg.dp.rng, seed=cfg.train.seed)
    return vocab_dp.run_release(cfg.data, run_dir, noise_seed=seeds.noise)


def _canary_setup(cfg: Config, *, label: str, n_c: int, num_canaries: int, seed: int, vocab: Any
                  ) -> tuple[Config, Any, dict[str, Any]]:
    words = vocab.words if vocab is not None else clean_stream(cfg.data)[0]
    canaries, controls = make_phrases(words, num=num_canaries, seed=seed)
    insert_seed = seed * 1000 + n_c
    run_cfg, data, facts = canary_training_data(cfg, canaries, n_c=n_c, insert_seed=insert_seed, vocab=vocab)
    info = {"format": _FORMAT, "label": label, "n_c": n_c, "seed": seed, "insert_seed": insert_seed,
            "num_canaries": num_canaries, "config_hash": run_cfg.hash(), "canaries": canaries, "controls": controls,
            **facts}
    return run_cfg, data, info


def _can_resume(run_dir: Path, info: dict[str, Any]) -> bool:
    path = run_dir / CANARIES_FILE
    if not ((run_dir / CHECKPOINT).is_file() and path.is_file()):
        return False
    try:
        old = read_json(path)
    except ConfigError:
        old = {}
    keys = ("config_hash", "canaries", "controls", "n_c", "inserted")
    return isinstance(old, dict) and all(old.get(k) == info[k] for k in keys)


# ----------------------------------------------------------------------------------------------------- evaluation


def load_canary_run(run_dir: Path, *, device: str | None = None) -> CanaryRun:
    """Load a run directory's model (checkpoint.pt), vocab.json and canaries.json; ConfigError when one is missing."""
    from widedp.distributed.ranks import resolve_device
    from widedp.models.cbow import CBOW
    from widedp.run.train import load_run_config

    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    if not (run_dir / CHECKPOINT).is_file():
        raise ConfigError(f"{run_dir}: no {CHECKPOINT} (no trained model in this run directory)")
    if not (run_dir / CANARIES_FILE).is_file():
        raise ConfigError(f"{run_dir}: no {CANARIES_FILE} (not trained with canaries; use widedp canary CONFIG)")
    cfg = load_run_config(run_dir)
    info = read_json(run_dir / CANARIES_FILE)
    if not isinstance(info, dict) or not all(k in info for k in ("canaries", "controls", "n_c")):
        raise ConfigError(f"{run_dir / CANARIES_FILE}: missing canaries, controls or n_c")
    vocab = read_json(run_dir / "vocab.json")
    check_vocab(len(vocab))
    dev = resolve_device(device or cfg.train.device)
    mc = cfg.model
    model = CBOW(len(vocab), mc.dim, tied=mc.tied, sparse=mc.sparse, init_scale=mc.init_scale)
    try:
        model.load_state_dict(load_checkpoint(run_dir, map_location="cpu")["model"])
    except (KeyError, RuntimeError) as e:
        raise ConfigError(f"{run_dir / CHECKPOINT}: does not hold a CBOW of the run's config ({type(e).__name__})"
                          ) from None
    return CanaryRun(run_dir, model.to(dev), vocab, info)


def evaluate_run(run: CanaryRun, *, num_candidates: int, bins: int, seed: int, num_canaries: int | None = None,
                 method: str = "auto") -> dict[str, Any]:
    """Ranks, χ² and exposure of the run's canaries and controls (the first ``num_canaries`` of each)."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {"run_dir": str(run.run_dir), "label": run.label, "n_c": int(run.info["n_c"]),
                           "num_candidates": num_candidates, "bins": bins}
    for i, key in enumerate(("canaries", "controls")):
        gen = torch.Generator().manual_seed(seed * 10 + 1 + i)
        ranks = phrase_ranks(run.model, run.ids(key, num_canaries), num_candidates=num_candidates, generator=gen,
                             method=method)  # type: ignore[arg-type]
        out[key] = summarize(ranks, bins=bins)
    summary = run.run_dir / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        out["private"] = bool(s.get("private"))
        out["epsilon"] = (s.get("dp") or {}).get("epsilon")
        out["privacy"] = (s.get("privacy") or {}).get("text")  # ε with its unit, δ and what it does not cover
        out["valid_loss"] = s.get("valid_loss")
    out["seconds"] = time.perf_counter() - t0
    return out


def write_report(results: list[dict[str, Any]], out_dir: Path, *, num_candidates: int, bins: int, seed: int,
                 plot: bool = True) -> dict[str, Any]:
    """Write ``out_dir/canary.json`` (and the rank-histogram grid PNG); returns the report."""
    seen: dict[tuple[str, int], int] = {}
    for r in results:  # two runs with one label and n_c (e.g. two seeds via --runs) get distinct labels
        key = (r["label"], r["n_c"])
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            r["label"] = f"{r['label']}#{seen[key]}"
    report = {"format": _FORMAT, "num_candidates": num_candidates, "bins": bins, "seed": seed,
              "definitions": DEFINITIONS, "table": [_row(r) for r in results], "runs": results}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / REPORT_FILE, report)
    if plot:
        from widedp.eval.canary_plots import plot_rank_grid

        plot_rank_grid(results, out_dir / PLOT_FILE, num_candidates=num_candidates, bins=bins)
    return report


def _row(r: dict[str, Any]) -> dict[str, Any]:
    row = {"label": r["label"], "n_c": r["n_c"], "epsilon": r.get("epsilon"), "privacy": r.get("privacy")}
    for key in ("canaries", "controls"):
        s = r[key]
        row[key] = {"chi2": s["chi2"], "chi2_distance": s["chi2_distance"], "p_value": s["p_value"],
                    "exposure_mean": s["exposure"].get("mean"), "exposure_median": s["exposure"].get("median"),
                    "exposure_max": s["exposure"].get("max")}
    return row


def format_table(report: dict[str, Any]) -> str:
    """The model x n_c table: χ² distance, p-value and mean/max exposure of canaries, and of controls."""
    head = (f"{'model':<16} {'n_c':>4} | {'chi2/N':>8} {'p':>9} {'exp mean':>8} {'exp max':>7} | "
            f"{'ctl chi2/N':>10} {'ctl p':>9} {'ctl exp':>7}")
    lines = [f"secret sharer: |R| = {report['num_candidates']} candidates, {report['bins']} bins "
             f"(max exposure {np.log2(report['num_candidates']):.2f} bits)", head, "-" * len(head)]
    for row in sorted(report["table"], key=lambda r: (r["n_c"], r["label"])):
        c, k = row["canaries"], row["controls"]
        lines.append(f"{row['label']:<16} {row['n_c']:>4} | {c['chi2_distance']:>8.4f} {c['p_value']:>9.2e} "
                     f"{c['exposure_mean']:>8.2f} {c['exposure_max']:>7.2f} | {k['chi2_distance']:>10.4f} "
                     f"{k['p_value']:>9.2e} {k['exposure_mean']:>7.2f}")
    return "\n".join(lines)
