"""The declared fuzz strategies (:class:`~mlflow_di.fuzz.contract.Declaration`): DFlare, the paper's
DFlare, their ablations, DiffChaser, the boundary walk and DeepXplore.

``dflare`` (the default) is DFlare's Algorithm 1 with a fitness that keeps a signal where the
paper's has none: minus the original model's log-probability margin between its two most likely
classes (``fitness='margin'``, see :mod:`mlflow_di.fuzz.dflare`). ``dflare-paper`` is the paper's
algorithm as written (fitness D / delta + O). ``-d`` drops the novelty term, ``-r`` picks
operators uniformly at random, for both. Measurements: benchmarks/RESULTS.md (bench_fuzz_search).
These and DiffChaser are black-box searches run by the lockstep runner
(:func:`~mlflow_di.fuzz.campaign.run_campaigns`); :mod:`mlflow_di.fuzz.runners` runs every declared strategy.
``boundary`` needs the original's gradients
(PyTorch) and queries the compressed model as a black box, inside a realism budget
(:func:`~mlflow_di.fuzz.boundary.run_boundary`). ``deepxplore`` (Pei et al.) is white-box: one
campaign over every model's gradients (:func:`~mlflow_di.fuzz.deepxplore.run_deepxplore`).

A lockstep strategy is any :class:`~mlflow_di.fuzz.contract.SearchStrategy` (``name``, ``options() -> dict``
and ``start(seed_image, p_original, p_compressed, rng) -> Search``); pass one directly to
:func:`~mlflow_di.fuzz.campaign.run_campaign` for non-default settings, e.g.
``DFlare(fitness='gap', acceptance='reference')``, or :func:`register` a declaration for it to be
a ``--strategy`` of the command line.
"""
from __future__ import annotations

from mlflow_di.errors import UserError
from mlflow_di.fuzz.contract import BUDGETS, Access, Declaration, Strategy
from mlflow_di.fuzz.deepxplore_options import DEEPXPLORE_OPTIONS
from mlflow_di.registry import Registry

#: the strategy ``mlflow-di fuzz`` runs when none is named
DEFAULT = "dflare"
#: the strategy a realism campaign runs when none is named (the pipeline's realism step, the demo, the
#: gate's advice): it searches inside the realism budget, where DFlare's mutants rarely stay
REALISM = "boundary"


def _dflare(**settings):
    """A factory of DFlare with ``settings`` (its module imported when a strategy object is made)."""
    def make():
        from mlflow_di.fuzz.dflare import DFlare

        return DFlare(**settings)
    return make


def _diffchaser():
    from mlflow_di.fuzz.diffchaser import DiffChaser

    return DiffChaser()


def _boundary():
    from mlflow_di.fuzz.boundary import BoundaryWalk

    return BoundaryWalk()


def _deepxplore():
    from mlflow_di.fuzz.deepxplore import DeepXplore

    return DeepXplore()


def _lockstep(name: str, summary: str, make) -> Declaration:
    return Declaration(name, summary, make, "lockstep", distributed=True, overlap=True, device_mutations=True)


#: name -> :class:`~mlflow_di.fuzz.contract.Declaration` of every declared strategy (the registry the other kinds'
#: readers and the contract suite share; register with :func:`register`)
DECLARATIONS = Registry("fuzzing strategy", Declaration, builtins=(
    _lockstep("dflare", "the original's log-probability margin", _dflare()),
    _lockstep("dflare-d", "no novelty", _dflare(name="dflare-d", novelty=False)),
    _lockstep("dflare-r", "random operator", _dflare(name="dflare-r", selection="uniform")),
    _lockstep("dflare-paper", "the paper's fitness", _dflare(name="dflare-paper", fitness="gap")),
    _lockstep("dflare-paper-d", "no novelty", _dflare(name="dflare-paper-d", fitness="gap", novelty=False)),
    _lockstep("dflare-paper-r", "random operator", _dflare(name="dflare-paper-r", fitness="gap", selection="uniform")),
    Declaration("diffchaser", "genetic", _diffchaser, "lockstep", budgets=(), distributed=True, overlap=True,
                budget_advice="pick --strategy dflare (or a dflare variant)"),
    Declaration("boundary", "realistic triggers in few queries: a PyTorch original's gradients, inside the budget",
                _boundary, "boundary", original=Access.WHITE_BOX,
                white_box_advice="give the PyTorch model the export was made from as --original, or pick a black-box "
                                 "strategy such as dflare"),
    Declaration("deepxplore", "white-box PyTorch models, options below", _deepxplore, "deepxplore",
                original=Access.WHITE_BOX, compressed=Access.WHITE_BOX, budgets=(), joint=True, option_prefix="dx",
                options=DEEPXPLORE_OPTIONS, option_title="DeepXplore options (only with --strategy deepxplore)",
                white_box_advice="fuzz the PyTorch model it was made from (a pruned copy: mlflow_di.compression.prune; "
                                 "an int8 one: mlflow_di.compression.fake_quant.fake_quantize) or pick a black-box "
                                 "strategy such as dflare",
                budget_advice="deepxplore keeps its inputs realistic with --dx-constraint lighting|occlusion|blackout",
                label=lambda strategy: f"deepxplore-{strategy.constraint}",
                seed_check=lambda strategy, shape: strategy.check_image_shape(shape)),
))


#: name -> factory of a strategy object with its defaults, for every declared strategy (the names
#: ``--strategy`` accepts: registering a declaration adds its name here)
STRATEGIES = DECLARATIONS.view(lambda declared: declared.make)


def register(declaration: Declaration) -> Declaration:
    """Declare a strategy: ``run``, ``mlflow-di fuzz --strategy NAME`` and its help know it from now on."""
    return DECLARATIONS.register(declaration)


def unregister(name: str) -> None:
    """Forget a declared strategy (tests declare toy ones); the built-ins stay."""
    DECLARATIONS.unregister(name)


def declarations() -> list[Declaration]:
    """Every declared strategy, in declaration order."""
    return list(DECLARATIONS.values())


def declaration(name) -> Declaration:
    """The declaration of a strategy name; a one-line UserError listing the known ones otherwise."""
    if isinstance(name, Declaration):
        return name
    return DECLARATIONS.require(name)


def declaration_of(strategy: Strategy) -> Declaration | None:
    """The declaration a strategy object was made from (by its name), None for an undeclared object."""
    return DECLARATIONS.get(strategy.name) if isinstance(strategy, Strategy) else None


def make_strategy(strategy: Strategy | str) -> Strategy:
    """A strategy object from a declared name (objects are passed through)."""
    if not isinstance(strategy, str):
        return strategy
    return declaration(strategy).make()


def configure(declared: Declaration, constraint: dict | None = None, options: dict | None = None) -> Strategy:
    """The strategy object of ``declared`` with a realism ``constraint`` ({max_linf, min_ssim}, None
    values unset) and its own ``options`` ({field: value}, None values unset); a one-line UserError
    for a budget it does not search inside."""
    import dataclasses

    strategy = declared.make()
    given = {key: value for key, value in (constraint or {}).items() if value is not None}
    if given:
        if not declared.budgets:
            raise UserError(f"--max-linf and --min-ssim work with the strategies that search inside a realism "
                            f"budget ({', '.join(budgeted_names())}), not {declared.name}"
                            + (f"; {declared.budget_advice}" if declared.budget_advice else ""))
        from mlflow_di.fuzz.realism import Constraint

        strategy = dataclasses.replace(strategy, constraint=Constraint(**{key: given.get(key) for key in BUDGETS}))
    chosen = {key: value for key, value in (options or {}).items() if value is not None}
    return dataclasses.replace(strategy, **chosen) if chosen else strategy


def budgeted_names() -> list[str]:
    """The strategies that search inside a realism budget, a family of variants named once
    (``the dflare strategies``)."""
    families: dict[str, list[str]] = {}
    for declared in declarations():
        if declared.budgets:
            families.setdefault(declared.name.split("-")[0], []).append(declared.name)
    return [f"the {family} strategies" if len(names) > 1 else names[0] for family, names in families.items()]


def strategy_help() -> str:
    """``--strategy``'s help, from the declarations: each name with its phrase."""
    return "; ".join(f"{d.name} ({d.summary})" for d in declarations()) + "."
