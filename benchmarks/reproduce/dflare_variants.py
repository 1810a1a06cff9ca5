"""DFlare variants that exist only to reproduce the paper's rows, never as product strategies.

``dflare-d-bug``: the paper's DFlare_D row (83% success on average, ~55x DFlare's queries) comes
from a bug in the released reference code, not from dropping the novelty term. Its
``attack_mode c`` starts the incumbent's fitness at -1 and keeps a mutant only when |D| > 1,
which never happens for a gap between two probabilities, so no mutant is ever accepted and every
query is one random mutation of the seed itself (notes/dflare.md: 42.5% success and a mean of
6,277 queries on 40 LeNet-5 seeds, paper 39.4% and 7,422). This variant reproduces that: the
reference code's rule and operator-selection bug, no novelty, and an acceptance test that never
passes. The working no-novelty ablations are the engine's ``dflare-d`` and ``dflare-paper-d``.
"""
from __future__ import annotations

import dataclasses

from mlflow_di.fuzz.dflare import DFlare, DFlareSearch


class _NeverAccepting(DFlareSearch):
    """DFlare's loop whose acceptance test never passes: x_max stays the seed."""

    def _keeps(self, gap: float, novel: bool) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class DFlareDBug(DFlare):
    """The reference code's ``attack_mode c`` (see the module docstring)."""

    name: str = "dflare-d-bug"
    novelty: bool = False
    fitness: str = "gap"
    acceptance: str = "reference"  # an unchanged mutant is judged like any other: rejected
    reference_bug: bool = True

    def options(self) -> dict:
        return {**super().options(), "never_accepts": True}

    def start(self, seed_image, p_original, p_compressed, rng) -> DFlareSearch:
        return _NeverAccepting(self, seed_image, p_original, p_compressed, rng)


#: Strategies of the reproduction harness that :data:`mlflow_di.fuzz.strategies.STRATEGIES` does not offer.
HARNESS_STRATEGIES = {"dflare-d-bug": DFlareDBug}


def harness_strategy(name: str):
    """The strategy to run for a name of the harness config (a registry name is passed through)."""
    return HARNESS_STRATEGIES[name]() if name in HARNESS_STRATEGIES else name
