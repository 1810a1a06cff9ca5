"""Run any declared fuzz strategy (:func:`run`): the built-in runner a declaration names, or its own.

Every runner takes the :class:`~mlflow_di.fuzz.contract.Campaign` record and returns one
CampaignResult per export (one for a joint campaign). ``lockstep``
(:func:`mlflow_di.fuzz.campaign.lockstep`): a black-box search on every export in one lockstep, the
original's calls shared (on Ray workers with an executor); ``boundary``
(:func:`mlflow_di.fuzz.boundary.walk`): the original's gradients walk each seed, one campaign per
export; ``deepxplore`` (:func:`mlflow_di.fuzz.deepxplore.explore`): one campaign over every model's
gradients. A declaration whose ``run`` is a function runs that instead
(:func:`mlflow_di.fuzz.strategies.register`).
"""
from __future__ import annotations

import pkgutil
from typing import Callable

from mlflow_di.errors import UserError
from mlflow_di.fuzz.contract import Campaign, Declaration
from mlflow_di.fuzz.strategies import declaration, declaration_of

#: the built-in runners a declaration may name: ``module:function``, imported when a campaign runs
#: (the engines import torch and their searches; declaring a strategy must not)
RUNNERS = {"lockstep": "mlflow_di.fuzz.campaign:lockstep", "boundary": "mlflow_di.fuzz.boundary:walk",
           "deepxplore": "mlflow_di.fuzz.deepxplore:explore"}


def run(campaign: Campaign, strategy: Declaration | str | None = None) -> list:
    """Run any strategy's campaign: the one ``strategy`` names (default: the declaration of
    ``campaign.strategy``, by its name; an undeclared strategy runs in lockstep, which refuses one that
    does not start searches). Returns one CampaignResult per export, one for a joint campaign."""
    declared = declaration(strategy) if strategy is not None else declaration_of(campaign.strategy)
    return runner(declared)(campaign)


def runner(declared: Declaration | None) -> Callable[[Campaign], list]:
    """The function that runs a declaration's campaigns (the lockstep for an undeclared strategy)."""
    if declared is not None and callable(declared.run):
        return declared.run
    name = "lockstep" if declared is None else declared.run
    if name not in RUNNERS:
        raise UserError(f"strategy {declared.name} names the runner '{name}'; built-in ones: {', '.join(RUNNERS)}")
    return pkgutil.resolve_name(RUNNERS[name])
