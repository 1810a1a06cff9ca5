"""How sure a figure measured on a sample is: 95% intervals, the three outcomes of a check, and how much
more evidence would decide it.

Every figure the gate judges was measured on a finite sample (images, seeds, analysis inputs), so it
comes with an :class:`Interval`, its sample size and the method that made it:

- a rate k of n (disagreements, successes, realistic triggers, agreement in a corruption cell):
  :func:`clopper_pearson`, the exact interval, which never covers less than its confidence (the
  Wald interval fails near 0 and at small n; :func:`wilson` is here for the paired difference);
- a difference of two rates on the same images (an accuracy drop: source minus export):
  :func:`paired_difference`, Newcombe's hybrid score interval for paired proportions (method 10 of
  Newcombe 1998, Stat Med 17:2635), which uses only the discordant pairs' information;
- the largest (or smallest) of several such figures (the class hit hardest, the worst corruption cell):
  :func:`extreme`, each figure's interval at confidence 1 - alpha/m (Bonferroni), so the m intervals hold
  together and the extreme's lies between their extremes;
- a mean over seeds (queries per deviation, heavy-tailed): :func:`bootstrap_mean`, a seeded percentile
  bootstrap; replicates of any statistic: :func:`percentile`;
- two independent figures' difference or ratio (a candidate against its baseline): :func:`mover`, the
  "method of variance estimates recovery" (Zou and Donner 2008) that Newcombe's hybrid score is an instance of.

:func:`judge` turns an interval and a limit into PASS (the whole interval on the right side), FAIL (the
whole interval on the wrong side) or INCONCLUSIVE (the limit inside it); :func:`rate_sample_to_decide`
and :func:`sample_to_decide` say about how large a sample, at the same observed value, would decide.

Pure math on counts and arrays: no models, no MLflow.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, Sequence

import numpy as np

from mlflow_di.results_json import JsonRoundTrip

#: Two-sided confidence of every interval the gate judges.
CONFIDENCE = 0.95
PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
#: The method names an interval records (shown beside it, and in the docs' table).
CLOPPER_PEARSON = "Clopper-Pearson"
WILSON = "Wilson"
NEWCOMBE_PAIRED = "Newcombe paired (method 10)"
BOOTSTRAP = "percentile bootstrap"
#: queries per deviation: a mean over the seeds with one (:func:`bootstrap_mean`)
MEAN_BOOTSTRAP = "percentile bootstrap of the mean over seeds"
#: coverage: the figure refitted on resamples of the analysis data (``coverage/idc.py``)
COVERAGE_BOOTSTRAP = "percentile bootstrap over analysis-data resamples"


@dataclasses.dataclass(frozen=True)
class Interval(JsonRoundTrip):
    """A figure's two-sided interval at ``confidence``: ``low``..``high``, measured on ``n`` units (images,
    seeds or analysis inputs, as the figure says) with ``method``."""

    low: float
    high: float
    n: int
    method: str
    confidence: float = CONFIDENCE

    def __post_init__(self):
        if not self.low <= self.high:
            raise ValueError(f"an interval's low end {self.low} is above its high end {self.high}")

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def describe(self) -> str:
        """e.g. ``95% CI 0.0033-0.023, n=497, Clopper-Pearson``."""
        return f"{self.confidence:.0%} CI {self.low:.4g}-{self.high:.4g}, n={self.n}, {self.method}"


def _check_counts(k: int, n: int) -> None:
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"a rate needs 0 <= k <= n, got k={k}, n={n}")


def _z(confidence: float) -> float:
    return statistics.NormalDist().inv_cdf(1 - (1 - confidence) / 2)


def clopper_pearson(k: int, n: int, confidence: float = CONFIDENCE) -> Interval:
    """The exact (Clopper-Pearson) interval of a rate ``k`` of ``n``: beta quantiles, [0, 1] for n = 0.
    0 of n gives an upper end of 1 - (alpha/2)^(1/n) (about 3.7/n at 95%); n of n a lower end of (alpha/2)^(1/n)."""
    from scipy.stats import beta

    _check_counts(k, n)
    alpha = 1 - confidence
    low = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    high = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return Interval(low, high, n, CLOPPER_PEARSON, confidence)


def wilson(k: int, n: int, confidence: float = CONFIDENCE) -> Interval:
    """The Wilson score interval of a rate ``k`` of ``n`` ([0, 1] for n = 0)."""
    _check_counts(k, n)
    if n == 0:
        return Interval(0.0, 1.0, 0, WILSON, confidence)
    z, p = _z(confidence), k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # k = 0 and k = n sit exactly on the ends (rounding could put them a hair inside)
    return Interval(0.0 if k == 0 else max(0.0, centre - half), 1.0 if k == n else min(1.0, centre + half), n, WILSON,
                    confidence)


def paired_difference(both: int, first_only: int, second_only: int, neither: int,
                      confidence: float = CONFIDENCE) -> Interval:
    """Newcombe's hybrid score interval (his method 10) for p1 - p2, two rates on the same n units:
    ``both`` units count for both, ``first_only`` / ``second_only`` for one, ``neither`` for none. For an
    accuracy drop: correct for source and export, source only (a right->wrong flip), export only, neither.

    Each rate's Wilson interval, combined with the correlation of the paired table (phi, with Newcombe's
    correction: ad - bc counts only beyond n/2 when positive)."""
    counts = (both, first_only, second_only, neither)
    if min(counts) < 0:
        raise ValueError(f"counts of a paired table must be >= 0, got {counts}")
    n = sum(counts)
    if n == 0:
        return Interval(-1.0, 1.0, 0, NEWCOMBE_PAIRED, confidence)
    first, second = both + first_only, both + second_only
    p1, p2 = first / n, second / n
    one, two = wilson(first, n, confidence), wilson(second, n, confidence)
    phi = 0.0
    product = first * (n - first) * second * (n - second)
    if product > 0:
        excess = both * neither - first_only * second_only
        corrected = excess - n / 2 if excess > n / 2 else (excess if excess < 0 else 0.0)
        phi = corrected / math.sqrt(product)
    difference = p1 - p2
    down = (p1 - one.low) ** 2 - 2 * phi * (p1 - one.low) * (two.high - p2) + (two.high - p2) ** 2
    up = (two.low - p2) ** 2 - 2 * phi * (p2 - two.low) * (one.high - p1) + (one.high - p1) ** 2
    low, high = difference - math.sqrt(max(down, 0.0)), difference + math.sqrt(max(up, 0.0))
    return Interval(max(-1.0, low), min(1.0, high), n, NEWCOMBE_PAIRED, confidence)


def extreme(figures: Sequence[tuple[float, Callable[[float], Interval]]], largest: bool = True,
            confidence: float = CONFIDENCE) -> tuple[int, Interval]:
    """The largest (``largest``) or smallest of several figures and an interval for it: (its index, interval).

    ``figures``: (value, interval at a given confidence) per figure. Each interval is made at confidence
    1 - alpha/m (Bonferroni over the m figures), so all m hold at once with probability >= ``confidence``;
    then the extreme of the true values lies between the extremes of the lows and of the highs."""
    if not figures:
        raise ValueError("no figures to take the extreme of")
    each = 1 - (1 - confidence) / len(figures)
    intervals = [make(each) for _, make in figures]
    values = [value for value, _ in figures]
    pick = max if largest else min
    index = pick(range(len(values)), key=lambda i: (values[i], -i if largest else i))
    low, high = pick(i.low for i in intervals), pick(i.high for i in intervals)
    method = f"{intervals[index].method}, Bonferroni over {len(figures)}"
    return index, Interval(low, high, intervals[index].n, method, confidence)


def percentile(replicates, n: int, method: str = BOOTSTRAP, confidence: float = CONFIDENCE) -> Interval:
    """The percentile interval of a statistic's replicates (bootstrap resamples), measured on ``n`` units."""
    values = np.asarray(replicates, dtype=np.float64)
    if not len(values) or not np.all(np.isfinite(values)):
        raise ValueError("a percentile interval needs finite replicates")
    alpha = 1 - confidence
    low, high = np.quantile(values, [alpha / 2, 1 - alpha / 2], method="linear")
    return Interval(float(low), float(high), n, method, confidence)


#: Resamples of :func:`bootstrap_mean`: enough for the 2.5% and 97.5% quantiles to move by well under the
#: mean's own spread between seeds of the resampling.
RESAMPLES = 2000


def bootstrap_mean(values, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0) -> Interval | None:
    """A seeded percentile bootstrap interval of the mean of ``values`` (the same numbers on every machine);
    None for fewer than two values: one value says nothing of the spread."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return None
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    return percentile(means, len(values), MEAN_BOOTSTRAP, confidence)


def mover(first: float, first_interval: Interval, second: float, second_interval: Interval,
          kind: str = "difference") -> Interval:
    """An interval for ``first - second`` (``kind`` difference) or ``first / second`` (ratio, on the log scale;
    both positive) of two independently measured figures, from each one's interval: the method of variance
    estimates recovery (Zou and Donner 2008; with Wilson intervals it is Newcombe's hybrid score)."""
    if kind == "ratio":
        if min(first, second, first_interval.low, second_interval.low) <= 0:
            raise ValueError("a ratio's interval needs positive figures and interval ends")
        logs = mover(math.log(first), _log(first_interval), math.log(second), _log(second_interval))
        return Interval(math.exp(logs.low), math.exp(logs.high), logs.n, logs.method, logs.confidence)
    difference = first - second
    low = difference - math.hypot(first - first_interval.low, second_interval.high - second)
    high = difference + math.hypot(first_interval.high - first, second - second_interval.low)
    return Interval(low, high, min(first_interval.n, second_interval.n),
                    f"MOVER of {first_interval.method} and {second_interval.method}",
                    min(first_interval.confidence, second_interval.confidence))


def _log(interval: Interval) -> Interval:
    return Interval(math.log(interval.low), math.log(interval.high), interval.n, interval.method, interval.confidence)


def judge(interval: Interval | None, value: float, limit: float, greater_is_better: bool) -> str:
    """PASS when the whole interval is on the right side of ``limit`` (ends included), FAIL when it is wholly on
    the wrong side, INCONCLUSIVE when the limit is inside it. Without an interval (an exact figure, not a
    sample's) the value alone decides."""
    low, high = (value, value) if interval is None else (interval.low, interval.high)
    if greater_is_better:
        return PASS if low >= limit else FAIL if high < limit else INCONCLUSIVE
    return PASS if high <= limit else FAIL if low > limit else INCONCLUSIVE


#: The largest sample :func:`rate_sample_to_decide` looks at: beyond it the answer is "no practical amount".
LARGEST_SAMPLE = 10**9


def rate_sample_to_decide(k: int, n: int, limit: float, greater_is_better: bool,
                          interval: Callable[[int, int], Interval] = clopper_pearson) -> int | None:
    """The smallest sample at which a rate that stays at k/n would be decided against ``limit`` by ``interval``
    (PASS or FAIL); None when no sample up to :data:`LARGEST_SAMPLE` would (the rate equals the limit)."""
    _check_counts(k, n)
    if n == 0 or k / n == limit:
        return None
    rate = k / n

    def decides(size: int) -> bool:
        return judge(interval(round(rate * size), size), rate, limit, greater_is_better) != INCONCLUSIVE

    if decides(n):
        return n
    low, high = n, 2 * n
    while not decides(high):
        if high >= LARGEST_SAMPLE:
            return None
        low, high = high, min(2 * high, LARGEST_SAMPLE)
    while high - low > 1:  # rounding k makes it not quite monotone: the answer is "about"
        middle = (low + high) // 2
        low, high = (low, middle) if decides(middle) else (middle, high)
    return high


def sample_to_decide(interval: Interval, value: float, limit: float, greater_is_better: bool) -> int | None:
    """About how large a sample would decide a figure whose interval shrinks as 1/sqrt(n) (bootstrap means,
    coverage): the side of the interval facing the limit scaled until it clears it. None when the value is
    the limit."""
    if judge(interval, value, limit, greater_is_better) != INCONCLUSIVE:
        return interval.n
    if value == limit or interval.n <= 0:
        return None
    facing = (interval.high - value) if limit > value else (value - interval.low)
    if facing <= 0:
        return None
    return min(LARGEST_SAMPLE, math.ceil(interval.n * (facing / abs(limit - value)) ** 2))
