"""widedp's DP trainer on several processes (``widedp.distributed.ranks``): embedding tables row-sharded across the
ranks.

The task's model is cut into row blocks (``SHARDERS``: CBOW -> ``ShardedCBOW``, recsys -> ``ShardedRecsys``);
each step is ``SparseDPTrainer``'s: ``widedp.dp.step.dp_step`` on the layout ``widedp.dp.layout.RowBlocks`` (that
module's docstring says how the work is shared), the update in each rank's own row space. What makes it the
single-process run's DP step:

- ONE Poisson batch: every rank draws it from the same sampling seed (the same q, the same expected size b); each
  rank's share of the work is the (sample, row) pairs of the rows it owns, and each sample's norm is summed over
  the ranks, so the S1 clip, the sensitivity and the accountant's q are the single process's;
- selection: the exponential mechanism's top-k is exact across the shards (every rank's own Gumbel keys); the
  other selectors run on the all_gathered (touched, score) pairs with a generator all ranks share;
- noise: each selected row's noise is drawn once, by its owner, with the owner's own generator;
- the ledger is the single process's (``PrivateTrainer``); rank 0 writes the journal and the run's files.

The task's model is built on the meta device (``widedp.tasks.placement``; rank 0 of a new ``dp.preselect`` run
alone builds it whole, and it is emptied once the blocks are cut): no rank holds a whole table while it trains,
evaluates (collectively), checkpoints or runs the task's final metrics (collectively).

Secrets: rank 0 draws (or, on resume, reads) the run's seeds (``widedp.dp.rng``) and sends them to the other ranks
over the process group; each rank's generator is seeded from a secret derivation of the noise seed and its rank,
the shared one from another; every rank saves its generators' states in RUN/private/ at checkpoints
(``rng-STEP-rankR.pt``). The weights and the row optimizer's state go to a DCP checkpoint (``widedp.distributed.
shards``: RUN/dcp-STEP/, each rank its blocks), so a run resumes on another number of processes, its tables and
optimizer state resharded; its old per-rank random streams cannot carry over, so it then draws fresh secret
randomness (rank 0's fresh seeds) and every step the journal recorded stays charged (``_resumed_ledger``).

Every privacy unit and option of the one-process trainer, equal in law and in ε:

- privacy units (sentence, document, user): one Poisson batch of units from the shared sampling seed; each rank
  merges its own rows of a unit's samples (``widedp.dp.units.group_rows``) and ``RowBlocks`` sums the unit's squared
  norm over the ranks, so each unit is clipped over all its rows;
- ``data.vocabulary: dp``: drawn once, by rank 0's build with the run's secret seed, and sent to the other ranks'
  builds (``widedp.distributed.ranks.share_release``), which load it;
- ``dp.preselect``: drawn (or loaded) once by rank 0 with its secret generator, sent to the others (``_preselect``);
- ``train.keep_best``: the collective evaluation gives every rank the same losses, hence the same best epoch; each
  rank keeps its own blocks of it (``RankModel``), in the DCP checkpoint too (``best.*``), and rank 0's
  checkpoint.pt records which epoch.

Refused (one-line errors naming the key): ``dp.engine: opacus``, tasks without a sharded model (``module``), a run
without a ``dp:`` section (``widedp.run.trainers.make_trainer``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from widedp import accounting
from widedp.config import Config
from widedp.distributed import ranks, shards
from widedp.dp import rng
from widedp.dp.layout import RowBlocks
from widedp.dp.optim import make_row_optimizer
from widedp.errors import ConfigError
from widedp.run import preselect_setup
from widedp.run.trainers.sparse import SparseDPTrainer
from widedp.tasks.protocol import Built, Task

_MODES = ("secure", "reproducible")


def _shard_cbow(model: Any, rank: int, world: int) -> Any:
    """``ShardedCBOW``: rank ``rank`` of ``world``'s row blocks of the input (and output) table."""
    from widedp.models.cbow_sharded import ShardedCBOW, cbow_shard

    try:
        return ShardedCBOW(model, cbow_shard(model, rank, world))
    except ValueError as e:
        raise ConfigError(f"data.vocab_size: {e}") from None


def _shard_recsys(model: Any, rank: int, world: int) -> Any:
    """``ShardedRecsys``: rank ``rank`` of ``world``'s row block of every table, the MLP rows replicated."""
    from widedp.models.recsys_sharded import ShardedRecsys, shard_of

    try:
        return ShardedRecsys(model, shard_of(model, rank, world))
    except ValueError as e:
        raise ConfigError(f"data: {e}") from None


#: The tasks several processes train, and how each one's model is cut into this rank's row blocks: ``shard`` (a
#: ``widedp.dp.layout.RowShard``), ``local_tables()``, ``per_sample_row_grads(batch) -> (loss [B], own rows then the
#: replicated ones)``, a collective forward.
SHARDERS: dict[str, Callable[[Any, int, int], Any]] = {"cbow": _shard_cbow, "recsys": _shard_recsys}


def shard_model(task: str, model: Any, rank: int, world: int) -> Any:
    """Rank ``rank`` of ``world``'s part of ``task``'s ``model``, or a ConfigError naming the tasks it shards."""
    shard = SHARDERS.get(task)
    if shard is None:
        raise ConfigError(f"task: {task} has no sharded model; several processes train tasks {' and '.join(SHARDERS)}")
    return shard(model, rank, world)


def check_shardable(cfg: Config) -> None:
    """ConfigError for what the sharded trainer does not train (module docstring)."""
    dp = cfg.dp
    if dp is None:
        raise ConfigError("dp: training on several processes is for DP runs (widedp's sharded DP step); train a "
                          "non-private config on one process")
    if dp.engine != "widedp":
        raise ConfigError(f"dp.engine: {dp.engine} runs on one process (Opacus' per-layer noise has no row blocks); "
                          "several processes need dp.engine: widedp")


class RankModel(nn.Module):
    """The run's model as the loop sees it on a rank (``Trainer.module``): this rank's blocks (``blocks()``: [(the
    task model's key, this rank's table)]). ``state_dict`` is what ``train.keep_best`` keeps of them; checkpoint.pt
    holds none (``ShardedDPTrainer.state_dict``): the weights are in the DCP checkpoint."""

    def __init__(self, blocks: Callable[[], list[tuple[str, torch.Tensor]]]) -> None:
        super().__init__()
        self.blocks = blocks

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {k: w.detach() for k, w in self.blocks()}

    @torch.no_grad()
    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> None:
        """Copy ``state`` (a ``state_dict()``) into the blocks; {} (a sharded checkpoint.pt's model): nothing."""
        if not state:
            return
        mine = dict(self.blocks())
        if set(state) != set(mine) or any(state[k].shape != w.shape for k, w in mine.items()):
            raise ConfigError("checkpoint.pt holds a whole model (a one-process run's); resume it on one process")
        for k, w in mine.items():
            w.copy_(state[k])


@torch.no_grad()
def _release_tables(model: Any) -> None:
    """Empty ``model``'s row tables in place (their rows now live in the ranks' blocks), whoever still refers to
    it."""
    for _, w in model.row_tables():
        w.data = w.data.new_empty((0, *w.shape[1:]))


def _warn_resharded(was: int, now: int, *, step: int, recharged: int) -> None:
    """One line on stderr: a run resumed on another number of processes draws fresh randomness (``recharged``: the
    steps journaled after the checkpoint, charged again)."""
    what = (f"the {recharged:,} step(s) journaled after it (steps {step + 1:,}-{step + recharged:,}) are charged again "
            "(conservative: the ledger counts them besides the steps the run trains again)" if recharged > 0
            else "no step was journaled after it, so none is charged twice")
    print(f"widedp: warning: trained on {was} processes, resumed on {now}: the tables and optimizer state are "
          f"resharded, but each rank's generator states cannot carry over to the new row blocks, so the randomness "
          f"after the checkpoint at step {step:,} is drawn fresh (new seeds); {what}", file=sys.stderr)


class ShardedDPTrainer(SparseDPTrainer):
    """``SparseDPTrainer`` over row-sharded tables (module docstring). ``module`` is a ``RankModel``; training,
    evaluation and the task's final metrics use ``sharded``, this rank's blocks."""

    def __init__(self, cfg: Config, out: Path, *, device: torch.device, resumed: bool) -> None:
        check_shardable(cfg)
        self.rank, self.world = ranks.rank(), ranks.world()
        self.is_writer = self.rank == 0
        self._named: str | None = None  # the DCP folder checkpoint.pt names
        self._written: str | None = None  # the DCP folder of the checkpoint being written
        self._best: dict[str, Any] = {}  # train.keep_best's epoch and valid loss (the blocks: in the DCP folder)
        super().__init__(cfg, out, device=device, resumed=resumed)

    def _run_seeds(self, *, resumed: bool) -> tuple[rng.RunSeeds, bool]:
        """Rank 0's seeds (drawn, or read from RUN/private/ on resume), broadcast over the process group."""
        return self._from_rank0(super()._run_seeds(resumed=resumed) if self.rank == 0 else None)

    def _fresh_seeds(self, step: int) -> rng.RunSeeds:
        """Rank 0's fresh seeds, broadcast (every rank samples the same batches)."""
        return self._from_rank0((super()._fresh_seeds(step), False) if self.rank == 0 else None)[0]

    def _from_rank0(self, drawn: tuple[rng.RunSeeds, bool] | None) -> tuple[rng.RunSeeds, bool]:
        """Rank 0's (seeds, replayable) (``drawn``; None on the other ranks), broadcast to every rank."""
        mine = None
        if drawn is not None:
            seeds, replayable = drawn
            mine = [seeds.sampling, seeds.noise, _MODES.index(seeds.mode), int(replayable)]
        sampling, noise, mode, replayable = ranks.broadcast_ints(mine, count=4, device=self.device)
        return rng.RunSeeds(sampling=sampling, noise=noise, mode=_MODES[mode]), bool(replayable)

    def setup(self, built: Built, task: Task) -> None:
        full = built.model
        self.sharded = shard_model(self.cfg.task, full, self.rank, self.world)
        self.shared_gen = torch.Generator(device=self.device)
        self.row_layout = RowBlocks(self.sharded.shard, shared=self.shared_gen)
        super().setup(built, task)
        self.module = RankModel(self._tables)
        self._model = self.grad_model = built.model = self.sharded  # this rank's rows (the task's finish included)
        _release_tables(full)
        self._seed_rank_generators()

    def _preselect(self) -> preselect_setup.Preselection | None:
        """``dp.preselect``: drawn (or, on resume, loaded) by rank 0 alone, with its secret generator and the task's
        full model, kept in RUN/private/, then sent to the other ranks: drawn once, charged once (the ledger's
        prefix, the same on every rank)."""
        if self.cfg.dp is None or self.cfg.dp.preselect is None:
            return None
        pre, error = None, None
        if self.rank == 0:
            try:  # a resumed run loads it (its full model may hold no tables: the blocks give the device)
                pre = (preselect_setup.setup(self.cfg, self.out, model=self.sharded, split=self._split,
                                             grouped=self.grouped, noise_seed=self.seeds.noise, resume=True)
                       if self.resumed else super()._preselect())
            except ConfigError as e:
                error = str(e)
        ranks.agree(error)
        head = [pre.rows.numel(), pre.num_rows, pre.always] if pre is not None else None
        k, num_rows, always = ranks.broadcast_ints(head, count=3, device=self.device)
        rows = (pre.rows.to(self.device, torch.long).contiguous() if pre is not None
                else torch.empty(k, dtype=torch.long, device=self.device))
        dist.broadcast(rows, src=0)
        return preselect_setup.Preselection(rows, num_rows, always)

    def _reseed(self) -> None:
        super()._reseed()
        self._seed_rank_generators()

    def _seed_rank_generators(self) -> None:
        rng.seed_generator(self.noise_gen, ranks.derive_seed(self.seeds.noise, f"rank{self.rank}"))  # this rank's
        rng.seed_generator(self.shared_gen, ranks.derive_seed(self.seeds.noise, "shared"))  # the same on every rank

    def _row_optimizer(self, task: Task) -> Any:
        tc = self.cfg.train
        return make_row_optimizer(tc.optimizer, self.sharded.local_tables(), lr=tc.lr, betas=tc.betas, eps=tc.eps)

    def interval_stats(self, steps: int, step: int) -> dict[str, Any]:
        rows, *_, nonfinite = self._stats.tolist()  # (touched_share is this rank's part: not logged)
        self._stats.zero_()
        return {"rows_selected": rows / steps, **self._nonfinite_stats(int(nonfinite), step),
                **self._truncation_stats()}

    def eval_model(self) -> Any:
        return self.sharded  # its forward is a collective: every rank evaluates

    def _tables(self) -> list[tuple[str, torch.Tensor]]:
        """[(the task model's key, this rank's table)], in the row optimizer's order."""
        return [(k, w) for k, (_, w) in zip(self.sharded.table_keys(), self.sharded.local_tables())]

    def _entries(self, best: dict[str, torch.Tensor] | None = None) -> dict[str, shards.Block]:
        """This rank's part of a checkpoint: its table blocks (in place), its row optimizer's state and, with
        ``best``, ``train.keep_best``'s blocks (keys as ``RankModel.state_dict()``)."""
        s = self.sharded
        out = shards.blocks(self._tables(), self.optimizer.state_tensors(), s.shard)  # in place: no copy of the state
        if best:
            out.update(shards.blocks([(k, best[k]) for k, _ in self._tables()], {}, s.shard, prefix="best"))
        return out

    def state_dict(self) -> dict[str, Any]:
        state = {"ledger": self.ledger.to_json(), "world_size": self.world, "dcp": self._written, "model": {},
                 **self._truncated_state()}
        if self._best:  # (its weights are in the DCP checkpoint)
            state["best"] = {**self._best, "model": {}}
        return state

    def load_state_dict(self, ckpt: dict[str, Any]) -> None:
        step, name = ckpt["step"], ckpt.get("dcp")
        self._load_truncated_state(ckpt)
        ranks.agree(shards.check(self.out, name))
        best = ckpt.get("best") or {}
        kept = {k: torch.empty_like(w) for k, w in self._tables()} if "epoch" in best else None
        entries = self._entries(kept)
        ranks.agree(shards.load(self.out, name, entries))
        self.optimizer.load_state_dict({k.removeprefix("optim."): b.local for k, b in entries.items()
                                        if k.startswith("optim.")})
        if kept is not None:
            best["model"] = kept  # this rank's blocks of the best epoch, where the loop reads them (RunState)
        self._named = name
        was = int(ckpt.get("world_size", self.world))
        replay = was == self.world and self._restore_generators(step)
        if not replay and self.replayable:
            self._restart_randomness(step)
        lost = None
        if not replay and was == self.world:
            lost = (self._lost_state(step) if self._seeds_lost
                    else f"{self.out / rng.PRIVATE_DIR}/rng-{step}-rank*.pt (of at least one rank)")
        self.ledger = self._resumed_ledger(ckpt, replayable=replay, lost=lost)
        if was != self.world and self.is_writer:
            recharged = self.ledger.steps - accounting.Ledger.from_json(ckpt["ledger"]).steps
            _warn_resharded(was, self.world, step=step, recharged=recharged)
        dist.barrier()  # every rank has read the journal before rank 0 writes it again

    def _restore_generators(self, step: int) -> bool:
        """Every rank's generators set to their states at ``step`` (a collective); False (nothing restored) when a
        rank has none: the lost steps cannot be replayed."""
        states, error = self._load_states(step)
        ranks.agree(error)  # a damaged file on any rank: every rank stops with its one line
        replay = torch.tensor([int(states is not None)], device=self.device)
        dist.all_reduce(replay, op=dist.ReduceOp.MIN)  # exact replay only when every rank has its states
        if not replay.item():
            return False
        path, error = rng.state_path(self.out, step, rank=self.rank), None
        try:
            rng.restore(self.noise_gen, states["noise"], path)
            rng.restore(self.shared_gen, states["shared"], path)
        except ConfigError as e:
            error = str(e)
        ranks.agree(error)
        return True

    def _load_states(self, step: int) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        """This rank's generator states of ``step`` (None: missing, or the run cannot replay) and the error of a
        damaged file (for ``ranks.agree``)."""
        if not self.replayable:
            return None, None
        try:
            return rng.load_states(self.out, step, rank=self.rank, names=("noise", "shared")), None
        except ConfigError as e:
            return None, str(e)

    def save_private(self, step: int, *, best: dict[str, Any] | None = None) -> None:
        rng.save_states(self.out, step, {"noise": self.noise_gen.get_state(), "shared": self.shared_gen.get_state()},
                        rank=self.rank)
        self._best = {k: v for k, v in (best or {}).items() if k != "model"}
        self._written = shards.folder_name(step, self._named)
        shards.save(self.out, self._written, self._entries((best or {}).get("model")))
        dist.barrier()  # every rank's files of ``step`` are written before checkpoint.pt names them

    def prune_private(self, step: int) -> None:
        dist.barrier()  # checkpoint.pt of ``step`` is written before anyone deletes the files of the last one
        self._named = self._written
        rng.prune_states(self.out, step, rank=self.rank)
        if self.is_writer:
            shards.prune(self.out, keep=str(self._named))
            shards.prune_gone_ranks(self.out / rng.PRIVATE_DIR, self.world)
