"""The accountants by name: one instance of each ``widedp.accounting.base.Accountant`` subclass. A new accountant is
its file and one line in ``ACCOUNTANTS``."""

from __future__ import annotations

from widedp.accounting import paper as paper_mod
from widedp.accounting.base import Accountant
from widedp.accounting.opacus_prv import OpacusPRVAccountant
from widedp.accounting.pld import PLDAccountant
from widedp.accounting.rdp import RDPAccountant
from widedp.errors import ConfigError

ACCOUNTANTS: dict[str, Accountant] = {a.name: a for a in (PLDAccountant(), RDPAccountant(), OpacusPRVAccountant())}


def headline() -> tuple[str, ...]:
    """The accountants a run may be planned, stopped and reported by (valid upper bounds on every widedp step)."""
    return tuple(name for name, a in ACCOUNTANTS.items() if a.headline)

#: the cross-check every run reports beside its headline (``epsilon_rdp``)
CROSS_CHECK = "rdp"


def accountant(name: str, *, baselines: bool = False) -> Accountant:
    """The accountant called ``name``; a ConfigError naming ``dp.accountant`` for ``paper`` (not a bound), an unknown
    name, or a baseline that may not drive a run (unless ``baselines``)."""
    if name == "paper":
        raise ConfigError(f"dp.accountant: {paper_mod.REFUSED}")
    known = tuple(ACCOUNTANTS) if baselines else headline()
    if name not in known:
        raise ConfigError(f"dp.accountant: expected one of {', '.join(known)}, got {name!r}")
    return ACCOUNTANTS[name]
