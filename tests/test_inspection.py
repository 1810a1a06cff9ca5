"""DeepBase-style inspection: measures against scipy/sklearn, hypotheses on drawn digits, the streamed engine."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from sklearn.metrics import mutual_info_score, r2_score
from torch import nn

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.inspection import Hypothesis, Inspection, builtin_hypotheses, load_hypotheses
from mlflow_di.inspection import hypotheses as hyp
from mlflow_di.inspection.measures import MutualInformation, Pearson, Probe, Spearman, digitize
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.torch_model import TorchModel


def _related(n=3000, seed=0):
    """Units x (n, 4) and hypotheses y (n, 3) with known dependencies (linear, monotone, none)."""
    rng = np.random.default_rng(seed)
    y = rng.normal(size=(n, 3))
    x = np.stack([y[:, 0] + 0.5 * rng.normal(size=n), np.exp(y[:, 1]), rng.normal(size=n),
                  -y[:, 0] + rng.normal(size=n)], axis=1)
    return x, y


def _stream(measure, x, y, batch=128):
    for start in range(0, len(x), batch):
        measure.update(x[start:start + batch], y[start:start + batch])
    return measure.estimate()


# ------------------------------------------------------------------------------ measures
def test_pearson_streamed_in_batches_equals_scipy_on_all_data():
    x, y = _related()
    scores, lo, hi = _stream(Pearson(), x, y, batch=97)
    for u in range(x.shape[1]):
        for h in range(y.shape[1]):
            assert scores[u, h] == pytest.approx(stats.pearsonr(x[:, u], y[:, h]).statistic, abs=1e-10)
    assert np.all(lo <= scores) and np.all(scores <= hi)


def test_pearson_interval_is_scipys_fisher_interval():
    x, y = _related(n=400)
    scores, lo, hi = _stream(Pearson(confidence=0.9), x, y)
    expected = stats.pearsonr(x[:, 0], y[:, 0]).confidence_interval(confidence_level=0.9)
    assert (lo[0, 0], hi[0, 0]) == pytest.approx((expected.low, expected.high), abs=1e-9)


def test_spearman_equals_scipy_and_sees_a_monotone_relation_pearson_understates():
    x, y = _related()
    scores, _, _ = _stream(Spearman(), x, y)
    for u in range(x.shape[1]):
        for h in range(y.shape[1]):
            assert scores[u, h] == pytest.approx(stats.spearmanr(x[:, u], y[:, h]).statistic, abs=1e-6)
    pearson, _, _ = _stream(Pearson(), x, y)
    assert scores[1, 1] > 0.99 > pearson[1, 1]  # exp(y) is monotone in y, not linear


def test_mutual_information_equals_sklearn_on_the_same_bins():
    x, y = _related()
    measure = MutualInformation(n_bins=8)
    scores, lo, hi = _stream(measure, x, y)
    bx, by = digitize(x, measure.edges_x), digitize(y, measure.edges_y)
    for u in range(x.shape[1]):
        for h in range(y.shape[1]):
            assert scores[u, h] == pytest.approx(mutual_info_score(bx[:, u], by[:, h]), abs=1e-12)
    assert scores[0, 0] > 0.3 and scores[2, 0] < 0.02  # dependent vs independent
    assert lo[2, 0] == 0.0 and hi[2, 0] > scores[2, 0]


def test_mutual_information_keeps_one_bin_per_value_of_a_binary_hypothesis():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, size=(2000, 1)).astype(float)
    measure = MutualInformation(n_bins=8)
    scores, _, _ = _stream(measure, labels + 0.1 * rng.normal(size=(2000, 1)), labels)
    assert len(measure.edges_y[0]) == 1
    assert scores[0, 0] == pytest.approx(np.log(2), abs=0.02)  # one bit, in nats


def test_probe_r2_equals_sklearn_cross_validated_ridge():
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = _related(n=1000)
    probe = Probe(groups=[[0, 1, 2, 3]], folds=5, seed=3)
    scores, lo, hi = _stream(probe, x, y)
    fold = np.random.default_rng(3).permutation(len(x)) % 5
    predicted = np.empty(len(x))
    for k in range(5):
        model = make_pipeline(StandardScaler(), Ridge(alpha=1.0)).fit(x[fold != k], y[fold != k, 0])
        predicted[fold == k] = model.predict(x[fold == k])
    assert scores[0, 0] == pytest.approx(r2_score(y[:, 0], predicted, force_finite=False) + 0.0, abs=1e-9)
    assert scores[0, 0] > 0.7 and abs(scores[0, 2]) < 0.05 and lo[0, 0] < scores[0, 0] < hi[0, 0]


def test_probe_balanced_accuracy_on_a_categorical_hypothesis():
    rng = np.random.default_rng(2)
    classes = rng.integers(0, 3, size=1500)
    x = np.eye(3)[classes] + 0.3 * rng.normal(size=(1500, 3))
    y = np.stack([classes, rng.integers(0, 3, size=1500)], axis=1).astype(float)
    scores, lo, hi = _stream(Probe(groups=[[0, 1, 2], [0]]), x, y)
    assert scores[0, 0] > 0.95  # all three units: the class is linearly readable
    assert scores[1, 0] < scores[0, 0]  # one unit alone tells one class from the others only
    assert scores[0, 1] == pytest.approx(1 / 3, abs=0.06)  # noise labels: chance
    assert lo[0, 0] <= scores[0, 0] <= hi[0, 0]


def test_a_constant_unit_has_no_score_and_no_interval():
    x, y = _related(n=500)
    x[:, 2] = 1.0
    for measure in (Pearson(), Spearman(), MutualInformation()):
        scores, lo, hi = _stream(measure, x, y)
        assert np.all(np.isnan(scores[2])) and np.all(np.isnan(hi[2]))
        assert np.all(np.isfinite(scores[0]))


# ------------------------------------------------------------------------------ hypotheses
def _draw(shape: str, size: int = 28, thickness: int = 2) -> np.ndarray:
    image = np.zeros((size, size), np.uint8)
    yy, xx = np.mgrid[:size, :size]
    if shape == "ring":  # a zero: one closed loop
        radius = np.hypot(yy - 14, xx - 14)
        image[(radius >= 7) & (radius < 7 + thickness)] = 255
    elif shape == "eight":  # two loops
        for cy in (8, 20):
            radius = np.hypot(yy - cy, xx - 14)
            image[(radius >= 4) & (radius < 4 + thickness)] = 255
    elif shape == "bar":
        image[4:24, 13:13 + thickness] = 255
    elif shape == "two_bars":
        image[4:24, 6:6 + thickness] = 255
        image[4:24, 20:20 + thickness] = 255
    return image[..., None]


def test_builtin_hypotheses_on_drawn_digits():
    images = np.stack([_draw("ring"), _draw("eight"), _draw("bar"), _draw("two_bars"), _draw("bar", thickness=4)])
    labels = np.array([0, 8, 1, 1, 1])
    named = {h.name: h for h in builtin_hypotheses([0, 1])}
    assert named["closed_loops"](images, labels).tolist() == [1, 2, 0, 0, 0]
    assert named["components"](images, labels).tolist() == [1, 2, 1, 2, 1]
    thickness = named["stroke_thickness"](images, labels)
    assert thickness[4] > thickness[2]
    assert thickness[2] == pytest.approx(2.0, abs=1.0)
    assert named["class_1"](images, labels).tolist() == [0, 0, 1, 1, 1]
    assert named["centre_x"](images[2:3], labels[2:3])[0] == pytest.approx(13.5 / 27, abs=1e-9)
    assert named["ink"](images, labels)[4] == pytest.approx(2 * named["ink"](images, labels)[2])
    assert named["ink_mask"](images, labels).shape == (5, 28, 28)


def test_a_user_hypothesis_with_the_wrong_shape_or_a_crash_is_one_line():
    images, labels = np.zeros((4, 8, 8, 1), np.uint8), np.zeros(4)
    with pytest.raises(UserError, match="returned shape"):
        Hypothesis("bad", lambda im, lab: np.zeros(3))(images, labels)
    with pytest.raises(UserError, match="failed on a batch: ZeroDivisionError"):
        Hypothesis("boom", lambda im, lab: 1 / 0)(images, labels)


def test_load_hypotheses_from_a_module(tmp_path, monkeypatch):
    (tmp_path / "my_hyps.py").write_text("import numpy as np\nHYPS = {'bright_top': lambda im, lab: "
                                         "im[:, :4].mean(axis=(1, 2, 3))}\nNOT_A_LIST = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = load_hypotheses("my_hyps:HYPS")
    assert [h.name for h in loaded] == ["bright_top"]
    with pytest.raises(UserError, match="non-empty list"):
        load_hypotheses("my_hyps:NOT_A_LIST")
    with pytest.raises(UserError, match="cannot import"):
        load_hypotheses("no_such_module_here:X")
    with pytest.raises(UserError, match="MODULE:ATTRIBUTE"):
        load_hypotheses("my_hyps")


# ------------------------------------------------------------------------------ engine
class _InkNet(nn.Module):
    """Unit 0 = total ink, unit 1 = ink in the left half, unit 2 = constant; conv channel 0 = ink per 4x4 patch."""

    def __init__(self):
        super().__init__()
        self.features = nn.Conv2d(1, 2, kernel_size=4, stride=4, bias=False)
        with torch.no_grad():
            self.features.weight.zero_()
            self.features.weight[0] = 1.0
        self.hidden = nn.Linear(32, 3)  # 2 channels x 4 x 4 positions
        with torch.no_grad():
            self.hidden.weight.zero_()
            self.hidden.weight[0] = 1.0
            left = torch.zeros(2, 4, 4)
            left[0, :, :2] = 1.0
            self.hidden.weight[1] = left.flatten()
            self.hidden.bias.zero_()
            self.hidden.bias[2] = 1.0
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        maps = self.features(x)
        hidden = self.hidden(maps.flatten(1))
        return self.head(hidden)


def _ink_data(n=1500, seed=0) -> ImageSet:
    rng = np.random.default_rng(seed)
    images = (rng.random((n, 16, 16, 1)) < rng.uniform(0.05, 0.6, size=(n, 1, 1, 1))).astype(np.uint8) * 255
    return ImageSet(images, rng.integers(0, 2, size=n), "generated ink")


def _ink_model() -> TorchModel:
    return TorchModel(_InkNet(), Preprocessing(scale=1 / 255.0, layout="NCHW", input_shape=(16, 16, 1)), name="ink-net")


def test_engine_finds_the_unit_that_counts_ink_and_skips_the_constant_one():
    query = Inspection(builtin_hypotheses([0, 1]), measures=("pearson", "spearman", "mi", "probe"), early_stop=False)
    result = query.run(_ink_model(), _ink_data(), "hidden")
    ink = result.hypotheses.index("ink")
    assert result.top_units("ink", 1)[0][0] == 0
    assert result.scores["pearson"][0, ink] == pytest.approx(1.0, abs=1e-6)
    assert np.all(np.isnan(result.scores["pearson"][2]))
    assert result.strongest_hypotheses(0, 1)[0][0] in ("ink", "ink_mask")
    assert result.n_inputs == result.n_available == 1500 and result.rows_of("probe") == ["group layer"]
    assert result.scores["probe"][0, ink] > 0.99
    top = result.top_inputs[0]
    data = _ink_data()
    assert data.images[top[0]].sum() == max(data.images[i].sum() for i in range(len(data)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inspection_of_a_model_on_the_gpu_equals_the_cpu_s():
    query = Inspection(builtin_hypotheses([0, 1]), measures=("pearson",), early_stop=False)
    on_cpu = query.run(_ink_model(), _ink_data(n=300), "hidden")
    on_gpu = query.run(_ink_model().to("cuda"), _ink_data(n=300), "hidden")
    np.testing.assert_allclose(on_gpu.scores["pearson"], on_cpu.scores["pearson"], atol=1e-4)


def test_conv_channels_are_compared_with_masks_position_by_position():
    result = Inspection(builtin_hypotheses(), measures=("pearson",), early_stop=False).run(
        _ink_model(), _ink_data(), "features")
    mask = result.hypotheses.index("ink_mask")
    assert result.scores["pearson"][0, mask] == pytest.approx(1.0, abs=1e-6)  # channel 0 sums ink per 4x4 patch


def test_early_stopping_returns_scores_within_the_tolerance_of_the_full_data_scores():
    model, data = _ink_model(), _ink_data(n=6000, seed=4)
    hypotheses = builtin_hypotheses([0, 1])
    full = Inspection(hypotheses, measures=("pearson", "mi", "probe"), early_stop=False).run(model, data, "hidden")
    early = Inspection(hypotheses, measures=("pearson", "mi", "probe"), tolerance=0.15, min_inputs=300).run(
        model, data, "hidden")
    assert early.converged and early.n_inputs < 6000
    assert early.history[-1][1] <= 0.15 and full.n_inputs == 6000
    for measure in ("pearson", "mi", "probe"):
        finite = np.isfinite(full.scores[measure])
        assert np.array_equal(finite, np.isfinite(early.scores[measure]))
        assert np.max(np.abs(early.scores[measure][finite] - full.scores[measure][finite])) <= 0.15


def test_important_group_and_unit_selection():
    result = Inspection(builtin_hypotheses(), measures=("pearson", "probe"), early_stop=False).run(
        _ink_model(), _ink_data(n=400), "hidden", units=[1, 0], groups={"important": [1]})
    assert result.units == [1, 0] and list(result.groups) == ["layer", "important"]
    assert result.scores["pearson"].shape[0] == 2 and result.scores["probe"].shape[0] == 2
    assert result.unit_labels([0])[0]["strongest"].startswith("ink")
    with pytest.raises(UserError, match="not in layer 'hidden'"):
        Inspection(builtin_hypotheses()).run(_ink_model(), _ink_data(n=50), "hidden", units=[7])


def test_bad_queries_are_one_line():
    with pytest.raises(UserError, match="unique"):
        Inspection([Hypothesis("a", len), Hypothesis("a", len)]).check()
    with pytest.raises(UserError, match="unknown measure"):
        Inspection(builtin_hypotheses(), measures=("kendall",)).check()
    with pytest.raises(UserError, match="empty"):
        Inspection(builtin_hypotheses()).run(_ink_model(), _ink_data(n=10).subset(slice(0, 0)), "hidden")


def test_grey_and_ink_mask_handle_colour_images():
    colour = np.zeros((1, 4, 4, 3), np.uint8)
    colour[0, 0, 0] = 255
    assert hyp.grey(colour)[0, 0, 0] == pytest.approx(1.0)
    assert hyp.ink_mask(colour).sum() == 1
