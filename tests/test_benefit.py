"""An export's speed judged with its spread: both models timed in turns in one process, the speedup the median
of the paired ratios with the distribution-free 95% interval of a median; "slower" (a WARNING) and a failing
``gate --min-speedup`` only when the whole interval is on that side."""
import numpy as np
import pytest
from scipy.stats import binom

from mlflow_di.gate import CHECKS, Measurement, Thresholds, decide
from mlflow_di.models.benefit import RESOLUTION, Benefit, Comparison, Speedup


def test_the_interval_of_the_median_is_the_order_statistics_binomial_coverage_gives():
    ratios = np.arange(1, 21) / 10  # 0.1 .. 2.0
    found = Speedup.of(ratios, batch=64)
    assert found.median == pytest.approx(1.05) and found.pairs == 20
    # n = 20: ranks 6 and 15 (1-based) hold the median with probability 1 - 2 P(X <= 5), X ~ B(20, 1/2)
    assert (found.low, found.high) == (0.6, 1.5)
    assert 1 - 2 * binom.cdf(5, 20, 0.5) >= 0.95 > 1 - 2 * binom.cdf(6, 20, 0.5)
    assert found.verdict == "no measurable difference"
    assert Speedup.of(ratios + 1.0, 64).verdict == "faster" and Speedup.of(ratios / 3, 64).verdict == "slower"
    # however many pairs, the interval is never narrower than what paired timing resolves (RESOLUTION)
    tight = Speedup.of(np.full(200, 0.98), 64)
    assert tight.low == pytest.approx(0.98 / (1 + RESOLUTION)) and tight.high == pytest.approx(0.98 * (1 + RESOLUTION))
    assert tight.verdict == "no measurable difference"


def _comparison(ratios_b1, ratios_batch) -> Comparison:
    model = Benefit(1.0, 10.0, 64, 6400.0, 1000, 50.0, 20, 1)
    return Comparison(model, model, Speedup.of(ratios_b1, 1), Speedup.of(ratios_batch, 64), (2.5, 2.7))


def test_a_spread_that_reaches_one_is_no_warning_and_a_slower_interval_is():
    rng = np.random.default_rng(0)
    noisy = _comparison(rng.normal(0.97, 0.2, 40), rng.normal(1.0, 0.05, 40))  # point estimate below 1
    assert noisy.speedup_b1 < 1 and noisy.warning() == ""
    assert "no measurable difference" in noisy.speed_line() and "load average 2.7" in noisy.speed_line()
    slower = _comparison(rng.normal(0.6, 0.02, 40), rng.normal(1.0, 0.05, 40))
    assert slower.warning().startswith("WARNING: the export is slower than its source on this host: speedup 0.6")
    metrics = slower.metrics()
    assert metrics["speedup_b1_high"] < 1 and metrics["speedup_low"] < 1 < metrics["speedup_high"]
    assert metrics["benefit_load_1min"] == 2.7


def test_min_speedup_passes_or_fails_only_when_the_whole_interval_is_on_one_side():
    thresholds = Thresholds(min_speedup=1.0)

    def verdict(value, low, high):
        return decide("models:/m/1", thresholds, [Measurement("speedup", value, "models:/m-int8/1", "r1",
                                                              interval=(low, high), n=200)])

    straddling = verdict(0.97, 0.92, 1.03)  # no measurable difference: neither proven faster nor slower
    assert straddling.outcome == "INCONCLUSIVE" and not straddling.passed
    assert "its 95% interval 0.92-1.03" in straddling.checks[0].message and "holds the threshold" in straddling.checks[0].message
    assert straddling.checks[0].interval == (0.92, 1.03)
    assert not verdict(0.9, 0.85, 0.95).passed and verdict(0.9, 0.85, 0.95).outcome == "FAIL"
    assert verdict(1.2, 1.1, 1.3).passed and verdict(1.2, 1.1, 1.3).checks[0].message == ""
    assert CHECKS["speedup"].greater_is_better
