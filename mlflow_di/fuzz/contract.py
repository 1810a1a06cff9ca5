"""The contract every fuzz strategy declares: what it needs, what it offers, how it runs a campaign.

A :class:`Declaration` is to a strategy what scikit-learn's estimator tags are to an estimator
(and zennit's registered composites to an attribution): a record the rest of the house reads
instead of branching on the strategy's name.

* **needs**: how each model must be loaded (:class:`Access`: ``black-box`` predictions on raw
  images from any format, or ``white-box`` PyTorch models with layers and gradients), and, for a
  white-box model that cannot be had, the advice the refusal gives;
* **offers**: the realism budgets it searches inside (``max_linf``, ``min_ssim``; none for
  DeepXplore, which keeps its inputs realistic with its own constraint), whether its searches run
  on Ray workers (``distributed``), overlap the model calls (``overlap``) and run their noise
  operators on a CUDA original's GPU (``device_mutations``), whether it runs one campaign per export
  or one over every model (``joint``), and its own options (``option_prefix``: the CLI's
  ``--PREFIX-*`` options are fields of its strategy object);
* **how it runs**: ``run(campaign) -> [CampaignResult, ...]``, one per export (one for a joint
  campaign), given a :class:`Campaign` holding the models loaded as it needs them.

:func:`mlflow_di.fuzz.run` (:mod:`mlflow_di.fuzz.runners`) runs any declared strategy; ``mlflow-di
fuzz`` builds its ``--strategy`` help, its option groups and its refusals from the declarations
(:mod:`mlflow_di.fuzz.strategies` holds them and configures a strategy object from the options given). A new strategy
is one declaration (:func:`~mlflow_di.fuzz.strategies.register`) and its
search or runner; nothing in ``commands/`` names a strategy.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from mlflow_di.errors import UserError
from mlflow_di.settings import OptionSpec

if TYPE_CHECKING:
    import numpy as np

    from mlflow_di.data import ImageSet
    from mlflow_di.fuzz.search import Search

#: The realism budgets a strategy may search inside (fields of :class:`~mlflow_di.fuzz.realism.Constraint`).
BUDGETS = ("max_linf", "min_ssim")

#: A seed's budget is work: at most this many queries to the compressed model (the white-box walks
#: also bound their own gradient passes), so a seeded campaign's records are the same on any machine
#: under any load.
DEFAULT_MAX_QUERIES = 2000

#: The safety net, in CPU seconds per seed (:mod:`mlflow_di.fuzz.charge`): a seed that reaches it is
#: recorded as stopped at ``timeout``, the campaign is INCOMPLETE, and ``resume`` searches it again.
#: Sized so that the work budget binds first: a default budget of queries on two 224-pixel ResNet-18s stays
#: well inside it even on a busy runner, which charges a seed more than its idle CPU time
#: (benchmarks/RESULTS.md, bench_load).
DEFAULT_TIMEOUT = 600.0

#: Seeds a realism campaign fuzzes when its caller names no number (a pipeline's realism step, the demo): enough for
#: a success-rate bound such as 0.15 to be decided when the realistic deviations are few (2 in 50 seeds reach an
#: upper end of 13.7%, 4 in 100 seeds 9.9%), at a fifth of a fuzz campaign's default.
REALISM_SEEDS = 100


class Access(enum.Enum):
    """How a strategy must see a model."""

    BLACK_BOX = "black-box"  # predict_proba on raw images: PyTorch, ONNX, TFLite, Keras
    WHITE_BOX = "white-box"  # a TorchModel: named layers and gradients (PyTorch pt2/pickle, ONNX views, Keras)


@runtime_checkable
class Strategy(Protocol):
    """What every strategy object offers the house: the ``name`` its declaration is registered under,
    and ``options()``, the settings that change its results as JSON values (what a campaign's config
    records and ``resume`` compares). A strategy is a frozen dataclass: :func:`~mlflow_di.fuzz.strategies.configure`
    sets its budget and own options with :func:`dataclasses.replace`."""

    name: str

    def options(self) -> dict: ...


@runtime_checkable
class SearchStrategy(Strategy, Protocol):
    """A black-box strategy the lockstep runner drives: one :class:`~mlflow_di.fuzz.search.Search` per
    seed, given the seed, both models' probabilities on it and the seed's own generator."""

    def start(self, seed_image: "np.ndarray", p_original: "np.ndarray", p_compressed: "np.ndarray",
              rng: "np.random.Generator") -> "Search": ...


@dataclasses.dataclass(frozen=True)
class Campaign:
    """What one call asks a strategy to run: the models loaded as its declaration needs them (a
    black-box classifier, or a white-box ``TorchModel``), the configured strategy object, the seeds,
    the budgets per seed, and one campaign folder per export (one for a joint campaign). Every runner
    takes this record (:mod:`mlflow_di.fuzz.runners`)."""

    original: object
    compressed: list
    strategy: Strategy
    seeds: "ImageSet"
    timeout: float = DEFAULT_TIMEOUT
    max_queries: int | None = DEFAULT_MAX_QUERIES
    batch: int = 64
    seed: int = 0
    out_dirs: list | None = None  # None: no campaign folder (nothing written, nothing to resume)
    resume: bool = False
    executor: object = None  # a Ray executor (distributed strategies), None: this process
    #: run one shift's model calls beside the other's searches; None: decided from where the models run
    overlap: bool | None = None
    progress: bool = True

    def folders(self) -> list:
        """One campaign folder (or None: nothing written) per export."""
        return list(self.out_dirs) if self.out_dirs is not None else [None] * len(self.compressed)


@dataclasses.dataclass(frozen=True)
class Declaration:
    """One strategy's contract (see the module docstring)."""

    name: str
    #: a phrase for ``--strategy``'s help, e.g. "walks a PyTorch original to its decision boundary"
    summary: str
    #: a fresh strategy object with its defaults
    make: Callable[[], Strategy]
    #: ``run(campaign) -> [CampaignResult, ...]``, or the name of a built-in runner (``lockstep``,
    #: ``boundary``, ``deepxplore``: :mod:`mlflow_di.fuzz.runners`)
    run: Callable[[Campaign], list] | str
    original: Access = Access.BLACK_BOX
    compressed: Access = Access.BLACK_BOX
    budgets: tuple[str, ...] = BUDGETS
    distributed: bool = False
    overlap: bool = False
    device_mutations: bool = False
    joint: bool = False
    #: its own options: ``--PREFIX-FIELD`` on the command line, ``FIELD`` of the strategy object
    option_prefix: str | None = None
    options: tuple[OptionSpec, ...] = ()
    #: the title of its options' group in ``--help``
    option_title: str | None = None
    #: what to do instead when a white-box model it needs is not PyTorch (the end of the refusal)
    white_box_advice: str = "pick a black-box strategy such as dflare"
    #: what to do instead of --max-linf/--min-ssim when it has no realism budget
    budget_advice: str = ""
    #: the campaign folder's label for a configured strategy object (default: name and budget)
    label: Callable[[Strategy], str] | None = None
    #: ``check(strategy, image_shape)``: a one-line UserError for seeds its settings cannot search
    #: (besides the realism budget's own check), e.g. DeepXplore's occlusion outside the image
    seed_check: Callable[[Strategy, tuple], None] | None = None

    def refuse(self, overlap: bool | None = None, workers: int = 0) -> None:
        """One-line UserErrors for what this strategy does not offer: ``--overlap``, ``--workers``."""
        if overlap and not self.overlap:
            raise UserError(f"--overlap applies to the black-box strategies; {self.name} runs its models in its own "
                            "loop (drop --overlap)")
        if workers and not self.distributed:
            raise UserError(f"--workers runs the black-box strategies on Ray; {self.name} runs in this process "
                            "(drop --workers, or use --device cuda for speed)")

    def check_seeds(self, strategy: Strategy, first_seed: "np.ndarray", image_shape: tuple) -> None:
        """One-line UserErrors, before any run starts, for seeds the configured ``strategy`` cannot
        search: a first seed outside its realism budget's reach, or its own ``seed_check``."""
        if self.constraint_of(strategy):
            strategy.constraint.check_seed(first_seed)
        if self.seed_check is not None:
            self.seed_check(strategy, tuple(image_shape))

    def folder_label(self, strategy: Strategy) -> str:
        """The campaign folder's label: the name and the budget searched inside (or the declared ``label``)."""
        if self.label is not None:
            return self.label(strategy)
        constraint = options_of(strategy).get("constraint") or {}
        return self.name + "".join(f"-{key.replace('_', '')}{value}" for key, value in constraint.items()
                                   if value is not None)

    def constraint_of(self, strategy: Strategy) -> dict | None:
        """The realism budget a configured strategy searches inside ({max_linf, min_ssim}), None without one."""
        return options_of(strategy).get("constraint") if self.budgets else None

    def own_options(self, strategy: Strategy) -> dict:
        """{``PREFIX_FIELD``: value} of its own options, as a run records them (empty without a prefix)."""
        if not self.option_prefix:
            return {}
        return {f"{self.option_prefix}_{key}": value for key, value in options_of(strategy).items()}


def options_of(strategy: Strategy) -> dict:
    """A strategy object's ``options()`` (what its campaign records)."""
    return strategy.options()
