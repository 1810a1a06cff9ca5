"""Run any declared fuzz strategy (:func:`run`): the built-in runners a declaration names, or its own.

``lockstep``: a black-box search on every export in one lockstep, the original's calls shared (on
Ray workers with an executor); ``boundary``: the original's gradients walk each seed, one campaign
per export; ``deepxplore``: one campaign over every model's gradients. A declaration whose ``run`` is
a function runs that instead (:func:`mlflow_di.fuzz.strategies.register`).
"""
from __future__ import annotations

from mlflow_di.errors import UserError
from mlflow_di.fuzz.contract import Campaign, Declaration
from mlflow_di.fuzz.strategies import declaration, declaration_of


def run(campaign: Campaign, strategy: Declaration | str | None = None) -> list:
    """Run any strategy's campaign: the one ``strategy`` names (default: the declaration of
    ``campaign.strategy``, by its name; an undeclared object with ``start`` runs in lockstep).
    Returns one CampaignResult per export, one for a joint campaign."""
    declared = declaration(strategy) if strategy is not None else declaration_of(campaign.strategy)
    if declared is None:
        if not hasattr(campaign.strategy, "start"):
            raise UserError(f"{type(campaign.strategy).__name__} is no declared strategy and has no start(); "
                            "declare it with mlflow_di.fuzz.strategies.register")
        return lockstep(campaign)
    if callable(declared.run):
        return declared.run(campaign)
    if declared.run not in RUNNERS:
        raise UserError(f"strategy {declared.name} names the runner '{declared.run}'; built-in ones: {', '.join(RUNNERS)}")
    return RUNNERS[declared.run](campaign)


def lockstep(campaign: Campaign) -> list:
    """A black-box search (``start`` -> :class:`~mlflow_di.fuzz.search.Search`) on every export in one
    lockstep, the original's calls shared; on Ray workers with an executor."""
    from mlflow_di.fuzz.campaign import run_campaigns

    return run_campaigns(campaign.original, campaign.compressed, campaign.seeds, strategy=campaign.strategy,
                         timeout=campaign.timeout, max_queries=campaign.max_queries, batch=campaign.batch,
                         seed=campaign.seed, out_dirs=campaign.out_dirs, resume=campaign.resume,
                         executor=campaign.executor, overlap=campaign.overlap, progress=campaign.progress)


def boundary(campaign: Campaign) -> list:
    """The boundary walk, one campaign per export (the original white-box)."""
    from mlflow_di.fuzz.boundary import run_boundary

    return [run_boundary(campaign.original, model, campaign.seeds, campaign.strategy, timeout=campaign.timeout,
                         max_queries=campaign.max_queries, seed=campaign.seed, out_dir=folder, resume=campaign.resume,
                         progress=campaign.progress)
            for model, folder in zip(campaign.compressed, campaign.out_dirs or [None] * len(campaign.compressed))]


def deepxplore(campaign: Campaign) -> list:
    """DeepXplore: one campaign over every model (all white-box)."""
    from mlflow_di.fuzz.deepxplore import run_deepxplore

    return [run_deepxplore([campaign.original, *campaign.compressed], campaign.seeds, campaign.strategy,
                           timeout=campaign.timeout, max_queries=campaign.max_queries, batch=campaign.batch,
                           seed=campaign.seed, out_dir=(campaign.out_dirs or [None])[0], resume=campaign.resume,
                           progress=campaign.progress)]


#: the built-in runners a declaration may name
RUNNERS = {"lockstep": lockstep, "boundary": boundary, "deepxplore": deepxplore}
