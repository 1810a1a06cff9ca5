"""Strategy names -> strategy objects: DFlare, the paper's DFlare, their ablations and DiffChaser.

``deepxplore`` (Pei et al.) is white-box: it needs PyTorch models and is run by
:func:`~mlflow_di.fuzz.deepxplore.run_deepxplore`, not by the black-box campaign runner.
``boundary`` needs the original's gradients (PyTorch) and queries the compressed model as a black
box, inside a realism budget: :func:`~mlflow_di.fuzz.boundary.run_boundary`.

``dflare`` (the default) is DFlare's Algorithm 1 with a fitness that keeps a signal where the
paper's has none: minus the original model's log-probability margin between its two most likely
classes (``fitness='margin'``, see :mod:`mlflow_di.fuzz.dflare`). ``dflare-paper`` is the paper's
algorithm as written (fitness D / delta + O). ``-d`` drops the novelty term, ``-r`` picks
operators uniformly at random, for both. Measurements: benchmarks/RESULTS.md (bench_fuzz_search).

A strategy is any object with ``name``, ``options() -> dict`` and
``start(seed_image, p_original, p_compressed, rng) -> Search``; pass one directly to
:func:`~mlflow_di.fuzz.campaign.run_campaign` for non-default settings, e.g.
``DFlare(fitness='gap', acceptance='reference')``.
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
    "dflare-paper": lambda: DFlare(name="dflare-paper", fitness="gap"),
    "dflare-paper-d": lambda: DFlare(name="dflare-paper-d", fitness="gap", novelty=False),
    "dflare-paper-r": lambda: DFlare(name="dflare-paper-r", fitness="gap", selection="uniform"),
    "diffchaser": lambda: DiffChaser(),
    # white-box: gradients of PyTorch models, run by fuzz.deepxplore.run_deepxplore (imported when
    # asked for: that module uses the campaign runner's helpers, which import this registry)
    "deepxplore": lambda: _deepxplore(),
    # white-box original, black-box compressed: run by fuzz.boundary.run_boundary
    "boundary": lambda: _boundary(),
}


def _boundary():
    from mlflow_di.fuzz.boundary import BoundaryWalk

    return BoundaryWalk()


def _deepxplore():
    from mlflow_di.fuzz.deepxplore import DeepXplore

    return DeepXplore()


def make_strategy(strategy) -> object:
    """A strategy object from a name in :data:`STRATEGIES` (objects are passed through)."""
    if not isinstance(strategy, str):
        return strategy
    if strategy not in STRATEGIES:
        raise UserError(f"unknown fuzzing strategy '{strategy}'; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[strategy]()
