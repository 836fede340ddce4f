"""The ``PrivacyEngine``'s checkpoints: what may be shared (``state_dict``) and the secrets (``save_private``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from widedp import accounting
from widedp.api.sharded import agree
from widedp.dp import rng
from widedp.errors import ConfigError

STATE_FORMAT = "widedp.engine/1"


class EngineState:
    """Checkpoint methods of ``widedp.api.engine.PrivacyEngine`` (see its module docstring)."""

    def _settings(self) -> dict[str, Any]:
        dp = self._dp
        return {"n": self.n, "batch_size": self.batch_size, "epochs": self.epochs, "num_rows": self.layout.num_rows,
                "noise_multiplier": dp.noise_multiplier, "clip1": dp.clip1, "clip2": dp.clip2, "delta": dp.delta,
                "accountant": dp.accountant, "selection": dataclasses.asdict(dp.selection),
                "sampling_rate": dp.sampling_rate, **({"noise": dp.noise} if dp.noise != "gaussian" else {}),
                **({} if self._dmp is None else {"rank": self._dmp.rank, "processes": self._dmp.world})}

    def state_dict(self) -> dict[str, Any]:
        """Step, ledger (JSON), table optimizer state and the settings they belong to; no seed, no generator state
        (``save_private``). Loads with ``torch.load(weights_only=True)``."""
        self._ready()
        return {"format": STATE_FORMAT, "steps": self.steps, "ledger": self.ledger.to_json(),
                "tables": self._updater.state_dict(), "settings": self._settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ready()
        if state.get("format") != STATE_FORMAT:
            raise ConfigError(f"engine state: expected format {STATE_FORMAT!r}, got {state.get('format')!r}")
        mine = self._settings()
        diff = [k for k in mine if state["settings"].get(k) != mine[k]]
        if diff:
            raise ConfigError(f"engine state: written with other settings: {', '.join(diff)} "
                              f"({[state['settings'].get(k) for k in diff]} vs {[mine[k] for k in diff]})")
        self._updater.load_state_dict(state["tables"])
        self.ledger = accounting.Ledger.from_json(state["ledger"])
        self.steps = int(state["steps"])

    def save_private(self, run_dir: str | Path) -> None:
        """Write the secret seeds and the noise generator's state at this step to ``run_dir/private/`` (0700);
        the previous save's state is kept until this one is written. Never share that folder."""
        self._ready()
        d = Path(run_dir)
        rank = None if self._dmp is None else self._dmp.rank  # a DMP model: every rank its own generators' states
        if rank in (None, 0):
            rng.save_seeds(d, self._seeds)
        rng.prune_states(d, self._last_private, rank=rank)
        rng.save_states(d, self.steps, self._generator_states(), rank=rank)
        self._last_private = self.steps

    def _read_seeds(self, d: Path) -> tuple[rng.RunSeeds | None, str | None]:
        """(the seeds in ``d``'s private folder, the error that stops a load); on a DMP model rank 0's only."""
        if self._dmp is not None and self._dmp.rank != 0:
            return None, None
        try:
            seeds = rng.load_seeds(d)
        except ConfigError as e:
            return None, str(e)
        if seeds is None:
            return None, f"{d}: no private state in {d / rng.PRIVATE_DIR}"
        if seeds.mode != self._dp.rng:
            return None, f"{d}: private state is {seeds.mode!r}, this engine is {self._dp.rng!r}"
        return seeds, None

    def _generator_states(self) -> dict[str, Any]:
        states = {"noise": self._noise.get_state()}
        if self._dmp is not None:
            states["shared"] = self._shared.get_state()
        return states

    def load_private(self, run_dir: str | Path) -> None:
        """Restore what ``save_private`` wrote at this step (call after ``load_state_dict``): exact replay."""
        self._ready()
        d = Path(run_dir)
        seeds, error = self._read_seeds(d)
        if self._dmp is not None:  # rank 0 reads them (no shared file system needed), every rank stops on an error
            agree(error, self._dmp.group, kind=ConfigError)
            seeds = self._dmp.seeds_from_rank0(seeds if seeds is not None else self._seeds)
        elif error is not None:
            raise ConfigError(error)
        assert seeds is not None
        rank = None if self._dmp is None else self._dmp.rank
        names = ("noise",) if self._dmp is None else ("noise", "shared")
        try:
            states, error = rng.load_states(d, self.steps, rank=rank, names=names), None
        except ConfigError as e:
            states, error = None, str(e)
        if states is None and error is None:
            error = (f"{d}: no generator state for step {self.steps}{'' if rank is None else f' of rank {rank}'}; "
                     "save_private and state_dict must come from the same step (load_state_dict first)")
        if self._dmp is not None:
            agree(error, self._dmp.group, kind=ConfigError)
        elif error is not None:
            raise ConfigError(error)
        assert states is not None
        self._start_randomness(seeds)
        self._noise.set_state(states["noise"])
        if self._dmp is not None:
            self._shared.set_state(states["shared"])
        self._last_private = self.steps
