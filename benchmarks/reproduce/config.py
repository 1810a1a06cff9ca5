"""What each reproduction run does: the full configuration, a quick one, and a tiny one for tests.

``full`` follows the papers where this machine allows it (see REPRODUCTION.md for where it does
not); ``quick`` is the same pipeline on smaller sets (under 5 minutes on 2 cores); ``tiny`` runs
every experiment on the demo's 8x8 digits CNN in seconds, so the harness can be tested without
the reference models.

Data (MNIST, full mode): the first ``analysis_size`` images of the 60,000-image training split
are the analysis ("training") set for importance analysis, clustering and the criteria's bounds,
and the last ``test_size`` images of the 10,000-image test split are the test set U_O (all of it
in full mode), as in the paper. DFlare's seeds are the first ``fuzz_seeds`` images of the test
split, as in the paper (500 test images).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
MODES = ("full", "quick", "tiny")
MNIST_SIZE = 10_000  # images in the test split
MNIST_TRAIN_SIZE = 60_000
IDC_MODELS = ("LeNet1", "LeNet4", "LeNet5")
#: The paper's DFlare, its two ablations, the bug-faithful DFlare_D row (benchmarks/reproduce/dflare_variants.py),
#: DiffChaser, and mlflow-di's default DFlare (log-margin fitness) for comparison.
STRATEGIES = ("dflare-paper", "dflare-paper-d", "dflare-paper-r", "dflare-d-bug", "diffchaser", "dflare")
#: Strategies whose budget is ``diffchaser_seeds`` / ``diffchaser_runs``: they need ~40x (and more) DFlare's queries.
EXPENSIVE = ("diffchaser", "dflare-d-bug")
#: DFlare Table 4 pairs: the paper's two TFLite pairs and the package's own two compressions.
PAIRS = ("lenet1-tflite", "lenet5-tflite", "lenet5-int8-static", "lenet5-prune-l1")


def default_shared() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MLFLOW_DI_SHARED", REPO.parent / "shared")).resolve()


@dataclasses.dataclass(frozen=True)
class Config:
    """Every setting that decides the numbers; saved beside each experiment's results."""

    mode: str
    shared: str
    # data
    analysis_size: int = MNIST_TRAIN_SIZE  # first N training images
    test_size: int = MNIST_SIZE  # last N test images
    idc_models: tuple[str, ...] = IDC_MODELS
    # IDC RQ1 (Table 2): flip the top 10% most relevant pixels of each input
    rq1_inputs: int = MNIST_SIZE
    rq1_top_m: int = 6
    rq1_pixel_fraction: float = 0.10
    rq1_random_draws: int = 5
    # IDC RQ2 (Table 3): Gaussian noise (std 0.75 on the 0..1 scale) on 2% of the pixels
    rq2_top_m: tuple[int, ...] = (6, 8, 10, 12)
    rq2_runs: int = 5
    rq2_pixel_fraction: float = 0.02
    rq2_noise_std: float = 0.75 * 255
    rq2_copies: int = 5
    # IDC RQ3 (Table 4): adversarial sets (DeepImportance's hyperparameters, see attacks.py)
    rq3_top_m: tuple[int, ...] = (6, 8)
    rq3_fast_inputs: int = MNIST_SIZE  # FGSM, BIM and Gaussian noise
    rq3_jsma_inputs: int = MNIST_SIZE
    rq3_cw_inputs: int = 100
    rq3_cw_max_iter: int = 100
    rq3_cw_initial_const: float = 1.0
    rq3_gauss_std: float = 0.3 * 255
    # IDC RQ5 (Table 5): every hidden layer
    rq5_top_m: int = 6
    rq5_runs: int = 5
    # DFlare Table 4
    fuzz_seeds: int = 500
    fuzz_runs: int = 5
    fuzz_timeout: float = 180.0
    fuzz_max_queries: int | None = None
    fuzz_strategies: tuple[str, ...] = STRATEGIES
    fuzz_pairs: tuple[str, ...] = PAIRS
    fuzz_batch: int = 64
    #: DiffChaser and the never-accepting DFlare_D need ~40x DFlare's queries here: fewer seeds/runs for
    #: them (:data:`EXPENSIVE`) keep the table affordable
    #: (None: the same as for the other strategies).
    diffchaser_seeds: int | None = None
    diffchaser_runs: int | None = None
    #: a query cap of their own for :data:`EXPENSIVE` strategies (None: ``fuzz_max_queries``); the
    #: quick mode's keeps dflare-d-bug, which never accepts a mutant, from spending its whole timeout
    expensive_max_queries: int | None = None
    calibration_size: int = 500
    prune_amount: float = 0.3
    # DFlare RQ4 (dissemination)
    rq4_percents: tuple[int, ...] = (10, 20, 30, 40, 50)
    rq4_scale: float = 0.10
    rq4_seeds: int = 500
    rq4_runs: int = 5
    rq4_timeout: float = 180.0
    # IDC RQ6 (the project site's RQ6): retrain LeNet-5 on the training split plus K IDC-guided inputs vs K random
    # mutants of the same seeds vs nothing (benchmarks/reproduce/idc_rq6.py)
    rq6_top_m: int = 6
    rq6_idc_fit: int = 60_000  # first N training images the guiding IDC is fitted on
    rq6_seed_sets: int = 500  # disjoint sets of training images, one generation run each
    rq6_seed_set_size: int = 20
    rq6_budget: int = 1000  # mutants per generation run
    rq6_train_seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    rq6_epochs: int = 10
    rq6_severity: int = 3
    rq6_test_inputs: int = 10_000  # first N test images for the clean, corrupted and mutated test sets
    rq6_fuzz_seeds: int = 500
    rq6_fuzz_timeout: float = 30.0
    rq6_pair: str = "lenet5-tflite"
    # machine
    threads: int = 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def analysis_spec(self) -> str:
        return f"mnist-train:{self.mnist_dir}[0:{self.analysis_size}]"

    @property
    def test_spec(self) -> str:
        return f"mnist-test:{self.mnist_dir}[{MNIST_SIZE - self.test_size}:{MNIST_SIZE}]"

    @property
    def mnist_dir(self) -> pathlib.Path:
        return pathlib.Path(self.shared) / "data" / "mnist"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "Config":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        known = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items() if k in fields}
        return cls(**known)


#: The quick mode: every experiment on small sets, the paper's two TFLite pairs only in DFlare's
#: Table 4, and the expensive strategies capped at 20,000 queries on 10 seeds (measured under 300 s on
#: 2 cores, benchmarks/RESULTS.md "Reproduction, quick mode").
QUICK = dict(
    analysis_size=5000, test_size=1000, rq1_inputs=1000, rq2_runs=1, rq2_copies=1,
    rq3_fast_inputs=500, rq3_jsma_inputs=100, rq3_cw_inputs=10, rq3_cw_max_iter=20, rq5_runs=1,
    fuzz_seeds=30, fuzz_runs=1, fuzz_timeout=20.0, fuzz_pairs=("lenet1-tflite", "lenet5-tflite"),
    diffchaser_seeds=10, expensive_max_queries=20_000, rq4_seeds=20, rq4_runs=1, rq4_timeout=20.0,
    rq6_idc_fit=5000, rq6_seed_sets=100, rq6_train_seeds=(0,), rq6_epochs=2, rq6_test_inputs=2000, rq6_fuzz_seeds=30,
    rq6_fuzz_timeout=10.0,
)

#: The tiny mode's data are scikit-learn's 8x8 digits (no MNIST, no reference models).
TINY = dict(
    analysis_size=600, test_size=200, idc_models=("DigitsCNN",),
    rq1_inputs=200, rq1_top_m=4, rq1_random_draws=2,
    rq2_top_m=(4, 6), rq2_runs=2, rq2_copies=1, rq2_pixel_fraction=0.05,
    rq3_top_m=(4, 6), rq3_fast_inputs=100, rq3_jsma_inputs=20, rq3_cw_inputs=5, rq3_cw_max_iter=5,
    rq5_top_m=4, rq5_runs=1,
    fuzz_seeds=12, fuzz_runs=1, fuzz_timeout=5.0, fuzz_max_queries=300,
    fuzz_pairs=("digits-int8-static", "digits-prune-l1"), calibration_size=100,
    rq4_percents=(10, 30, 50), rq4_seeds=12, rq4_runs=1, rq4_timeout=5.0,
    rq6_top_m=4, rq6_idc_fit=600, rq6_seed_sets=6, rq6_seed_set_size=10, rq6_budget=200, rq6_train_seeds=(0, 1),
    rq6_epochs=30, rq6_test_inputs=200, rq6_fuzz_seeds=12, rq6_fuzz_timeout=5.0, rq6_pair="digits-int8-static",
)


def make_config(mode: str = "full", shared: str | os.PathLike | None = None, **overrides) -> Config:
    """The configuration of ``mode`` with ``overrides`` (any :class:`Config` field) applied."""
    values = {"full": {}, "quick": QUICK, "tiny": TINY}.get(mode)
    if values is None:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    values = {**values, **{k: v for k, v in overrides.items() if v is not None}}
    return Config(mode=mode, shared=str(shared or default_shared()), **values)
