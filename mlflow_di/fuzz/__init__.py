"""Differential fuzzing of a model against its compressed version (DFlare, its ablations, DiffChaser).

Entry point: :func:`run_campaign`. The pieces, TensorFuzz style: :mod:`.mutations` (operators),
:mod:`.selection` (which operator next), :mod:`.fitness` (objective, fitness, novelty),
:mod:`.dflare` / :mod:`.diffchaser` (per-seed search loops), :mod:`.campaign` (lockstep runner),
:mod:`.results` and :mod:`.store` (records, summary, output directory). Nothing here knows MLflow.
"""
from mlflow_di.fuzz.campaign import run_campaign
from mlflow_di.fuzz.dflare import DFlare
from mlflow_di.fuzz.diffchaser import DiffChaser
from mlflow_di.fuzz.results import (CampaignConfig, CampaignResult, CampaignSummary, OperatorSummary, RunStats,
                                    SeedRecord)
from mlflow_di.fuzz.store import load_campaign
from mlflow_di.fuzz.strategies import STRATEGIES, make_strategy

__all__ = ["run_campaign", "load_campaign", "DFlare", "DiffChaser", "STRATEGIES", "make_strategy",
           "CampaignConfig", "CampaignResult", "CampaignSummary", "OperatorSummary", "RunStats", "SeedRecord"]
