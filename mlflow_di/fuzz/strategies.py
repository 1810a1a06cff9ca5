"""Strategy names -> strategy objects: DFlare, its ablations and DiffChaser.

A strategy is any object with ``name``, ``options() -> dict`` and
``start(seed_image, p_original, p_compressed, rng) -> Search``; pass one directly to
:func:`~mlflow_di.fuzz.campaign.run_campaign` for non-default settings, e.g.
``DFlare(reference_bug=True)``.
"""
from __future__ import annotations

from typing import Callable

from mlflow_di.errors import UserError
from mlflow_di.fuzz.dflare import DFlare
from mlflow_di.fuzz.diffchaser import DiffChaser

STRATEGIES: dict[str, Callable[[], object]] = {
    "dflare": lambda: DFlare(),
    "dflare-d": lambda: DFlare(name="dflare-d", novelty=False),
    "dflare-r": lambda: DFlare(name="dflare-r", selection="uniform"),
    "diffchaser": lambda: DiffChaser(),
}


def make_strategy(strategy) -> object:
    """A strategy object from a name in :data:`STRATEGIES` (objects are passed through)."""
    if not isinstance(strategy, str):
        return strategy
    if strategy not in STRATEGIES:
        raise UserError(f"unknown fuzzing strategy '{strategy}'; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[strategy]()
