"""Differential fuzzing of a model against its compressed version (DFlare, its ablations, DiffChaser,
the boundary walk, DeepXplore).

Entry points: :func:`run` (any declared strategy, see :mod:`.contract` and :mod:`.strategies`) and
:func:`run_campaign` (one lockstep search). The pieces, TensorFuzz style: :mod:`.mutations`
(operators), :mod:`.selection` (which operator next), :mod:`.fitness` (objective, fitness,
novelty), :mod:`.dflare` / :mod:`.diffchaser` (per-seed search loops), :mod:`.campaign` (lockstep
runner), :mod:`.results` and :mod:`.store` (records, summary, output directory). Nothing here knows
MLflow. The names below are imported when first used, so that reading the strategy declarations
(``mlflow-di fuzz --help``) does not import the engines.
"""
from mlflow_di.lazy_names import lazy_names

_EXPORTS = {
    "run_campaign": "campaign", "DFlare": "dflare", "DiffChaser": "diffchaser", "load_campaign": "store",
    **{name: "results" for name in ("CampaignConfig", "CampaignResult", "CampaignSummary", "OperatorSummary",
                                    "RunStats", "SeedRecord")},
    **{name: "contract" for name in ("Access", "Campaign", "Declaration", "OptionSpec")},
    **{name: "strategies" for name in ("STRATEGIES", "declaration", "make_strategy", "register", "configure")},
    "run": "runners",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_names(__name__, _EXPORTS)
