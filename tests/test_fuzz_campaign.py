"""Campaigns on a hand-made pair of tiny models that disagree in a known band of brightness.

``Brightness(t)`` says class 1 when an image's mean brightness exceeds t (a steep sigmoid), so
the pair (t=0.30, t=0.32) disagrees exactly on images whose mean brightness lies in
(0.30, 0.32). Seeds are dark (mean ~0.19): a search has to climb into the band.
"""
import os
import signal
import threading
import time

import mlflow_di  # noqa: F401
import numpy as np
import pytest

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.fuzz import DFlare, DiffChaser, load_campaign, run_campaign
from mlflow_di.fuzz.campaign import off_host, overlaps_by_default, run_campaigns
from mlflow_di.fuzz.distributed import RayExecutor
from mlflow_di.fuzz.results import CampaignResult, CampaignSummary, SeedRecord
from mlflow_di.fuzz.store import CampaignStore

LOW, HIGH = 0.30, 0.32


class Brightness:
    """Black box: P(class 1) = sigmoid(slope * (mean brightness - threshold)); rows independent."""

    def __init__(self, threshold: float, slope: float = 40.0, classes: int = 2, shape=(8, 8, 1), name=None):
        self.threshold, self.slope, self.classes, self.shape = threshold, slope, classes, shape
        self.name = name or f"brightness>{threshold}"
        self.calls = 0

    def predict_proba(self, images: np.ndarray) -> np.ndarray:
        if images.shape[1:] != self.shape:
            raise ValueError(f"expected {self.shape} images, got {images.shape[1:]}")
        self.calls += 1
        brightness = images.reshape(len(images), -1).mean(axis=1) / 255.0
        p1 = 1.0 / (1.0 + np.exp(-self.slope * (brightness - self.threshold)))
        p = np.zeros((len(images), self.classes))
        p[:, 0], p[:, 1] = 1.0 - p1, p1
        if self.classes > 2:  # spread a little mass so extra classes exist but never win
            p = 0.9 * p + 0.1 / self.classes
        return p


def mean_brightness(images: np.ndarray) -> np.ndarray:
    return images.reshape(len(images), -1).mean(axis=1) / 255.0


@pytest.fixture()
def pair():
    return Brightness(LOW), Brightness(HIGH)


@pytest.fixture()
def seeds() -> ImageSet:
    rng = np.random.default_rng(3)
    return ImageSet(rng.integers(0, 100, (12, 8, 8, 1), dtype=np.uint8), rng.integers(0, 2, 12), "dark")


def _comparable(result: CampaignResult) -> list[dict]:
    """Records without the (wall-clock) seconds."""
    return [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in result.records]


@pytest.mark.parametrize("strategy", ["dflare", "dflare-d", "dflare-r", "dflare-paper", "dflare-paper-d", "dflare-paper-r",
                                      "diffchaser"])
def test_every_strategy_finds_the_disagreement_band(pair, seeds, strategy):
    # DiffChaser's small pixel steps need thousands of queries to climb into the band
    result = run_campaign(*pair, seeds, strategy=strategy, max_queries=20000, timeout=60, progress=False)
    summary = result.summary
    assert summary.seeds == 12 and summary.already_deviating == 0
    assert summary.success_rate == 1.0 and summary.triggers == 12
    assert result.triggers.shape == (12, 8, 8, 1) and result.triggers.dtype == np.uint8
    brightness = mean_brightness(result.triggers)
    assert np.all((brightness > LOW) & (brightness < HIGH))
    np.testing.assert_array_equal(result.trigger_seeds, seeds.images[result.trigger_indices])
    for record in result.records:
        assert record.success and record.stop == "trigger" and 1 <= record.queries <= 20000
        assert record.trigger_labels == (1, 0) and record.seed_labels == (0, 0)
        assert record.operators, "the trigger's operator sequence is recorded"
    assert summary.mean_queries == pytest.approx(np.mean([r.queries for r in result.records]))
    assert summary.median_queries == pytest.approx(np.median([r.queries for r in result.records]))


def test_dflare_needs_far_fewer_queries_than_diffchaser(pair, seeds):
    dflare = run_campaign(*pair, seeds, strategy="dflare", max_queries=20000, progress=False).summary
    diffchaser = run_campaign(*pair, seeds, strategy="diffchaser", max_queries=20000, progress=False).summary
    assert dflare.success_rate == diffchaser.success_rate == 1.0
    # DiffChaser moves pixels by at most 11 levels per mutation (measured here: ~5,700 vs ~36 queries)
    assert diffchaser.mean_queries > 10 * dflare.mean_queries


@pytest.mark.parametrize("strategy", ["dflare", DFlare(reference_bug=True), "diffchaser",
                                      DiffChaser(population_size=10)],
                         ids=["dflare", "dflare-reference-bug", "diffchaser", "diffchaser-10"])
def test_lockstep_equals_one_seed_at_a_time(pair, seeds, strategy):
    # identical models never disagree, so budgets end the searches; a band pair ends them by triggers
    for models in (pair, (Brightness(LOW), Brightness(LOW))):
        alone = run_campaign(*models, seeds, strategy=strategy, max_queries=150, timeout=1e6, batch=1,
                             seed=5, progress=False)
        lockstep = run_campaign(*models, seeds, strategy=strategy, max_queries=150, timeout=1e6, batch=5,
                                seed=5, progress=False)
        assert _comparable(alone) == _comparable(lockstep)
        np.testing.assert_array_equal(alone.triggers, lockstep.triggers)


def test_campaign_seed_changes_the_search(pair, seeds):
    first = run_campaign(*pair, seeds, max_queries=500, seed=0, progress=False)
    second = run_campaign(*pair, seeds, max_queries=500, seed=1, progress=False)
    assert [r.queries for r in first.records] != [r.queries for r in second.records]


def test_budgets_stop_the_search():
    same = (Brightness(LOW), Brightness(LOW))
    images = ImageSet(np.zeros((3, 8, 8, 1), np.uint8), np.zeros(3), "black")
    capped = run_campaign(*same, images, max_queries=7, progress=False)
    assert [(r.stop, r.queries, r.success) for r in capped.records] == [("max_queries", 7, False)] * 3
    assert capped.summary.success_rate == 0.0 and capped.summary.mean_queries is None
    genetic = run_campaign(*same, images, strategy="diffchaser", max_queries=150, progress=False)
    assert [r.queries for r in genetic.records] == [150] * 3  # 100 + 50 of the second generation
    timed = run_campaign(*same, images, timeout=0.01, progress=False)
    assert all(r.stop == "timeout" and r.seconds >= 0.01 for r in timed.records)


def test_seeds_already_deviating_are_reported_apart(pair, seeds):
    images = seeds.images.copy()
    images[[2, 5]] = round(0.31 * 255)  # inside the band: the models disagree on the seed itself
    result = run_campaign(*pair, ImageSet(images, seeds.labels, "mixed"), max_queries=3000, progress=False)
    summary = result.summary
    assert summary.already_deviating == 2 and summary.fuzzed == 10 and summary.triggers == 10
    assert summary.success_rate == 1.0
    deviating = [r for r in result.records if r.already_deviating]
    assert [r.index for r in deviating] == [2, 5]
    assert all(r.queries == 0 and not r.success and r.seed_labels == (1, 0) for r in deviating)
    assert 2 not in result.trigger_indices


def test_results_round_trip_through_json(pair, seeds, tmp_path):
    result = run_campaign(*pair, seeds, max_queries=3000, out_dir=tmp_path / "c", progress=False)
    again = CampaignResult.from_json(result.to_json())
    assert again.to_json() == result.to_json() and again.records == result.records
    assert CampaignSummary.from_json(result.summary.to_json()) == result.summary
    assert SeedRecord.from_json(result.records[0].to_json()) == result.records[0]
    loaded = load_campaign(tmp_path / "c")
    assert loaded.records == result.records and loaded.complete
    np.testing.assert_array_equal(loaded.triggers, result.triggers)
    with np.load(tmp_path / "c" / "triggers.npz") as archive:
        np.testing.assert_array_equal(archive["triggers"], result.triggers)
        np.testing.assert_array_equal(archive["indices"], result.trigger_indices)
    operators = result.summary.operators
    assert sum(o.triggered for o in operators.values()) == 12
    assert sum(o.selected for o in operators.values()) == result.summary.total_queries


class Interrupting(Brightness):
    """Raises KeyboardInterrupt on its ``after``-th call, as Ctrl-C would mid-campaign."""

    def __init__(self, threshold, after):
        super().__init__(threshold)
        self.after = after

    def predict_proba(self, images):
        if self.calls + 1 == self.after:
            self.calls += 1
            raise KeyboardInterrupt
        return super().predict_proba(images)


@pytest.mark.parametrize("overlap", [False, True])
def test_interrupted_campaign_keeps_its_triggers_and_resumes_to_the_same_result(pair, seeds, tmp_path, overlap):
    reference = run_campaign(*pair, seeds, max_queries=3000, batch=4, progress=False)
    out = tmp_path / "campaign"
    # with overlap the interrupt comes from the models' thread, as a Ctrl-C during a call reaches the campaign
    partial = run_campaign(Interrupting(LOW, after=60), Brightness(HIGH), seeds, max_queries=3000, batch=4,
                           out_dir=out, progress=False, overlap=overlap)
    assert not partial.complete and 0 < len(partial.records) < 12
    finished = {r.index for r in partial.records}
    on_disk = CampaignStore(out).read_records()
    assert set(on_disk) == finished
    for index in finished:
        trigger, seed_image = CampaignStore(out).read_trigger(index)
        assert LOW < mean_brightness(trigger[None])[0] < HIGH
        np.testing.assert_array_equal(seed_image, seeds.images[index])

    counting = Brightness(LOW)
    resumed = run_campaign(counting, Brightness(HIGH), seeds, max_queries=3000, batch=4, out_dir=out,
                           resume=True, progress=False)
    assert resumed.complete and _comparable(resumed) == _comparable(reference)
    np.testing.assert_array_equal(resumed.triggers, reference.triggers)
    # finished seeds were not searched again: the seed check covered only the rest
    unfinished_queries = sum(r.queries for r in reference.records if r.index not in finished)
    assert counting.calls <= 1 + unfinished_queries
    assert load_campaign(out).records == resumed.records
    assert not _model_threads(), "the models' thread ends with the campaign"


def test_resume_refuses_different_settings_and_new_runs_refuse_a_used_directory(pair, seeds, tmp_path):
    run_campaign(*pair, seeds, max_queries=3000, out_dir=tmp_path, progress=False)
    with pytest.raises(UserError, match="already holds a fuzzing campaign"):
        run_campaign(*pair, seeds, max_queries=3000, out_dir=tmp_path, progress=False)
    with pytest.raises(UserError, match="strategy"):
        run_campaign(*pair, seeds, strategy="diffchaser", max_queries=3000, out_dir=tmp_path, resume=True,
                     progress=False)
    with pytest.raises(UserError, match="nothing to resume"):
        run_campaign(*pair, seeds, out_dir=tmp_path / "empty", resume=True, progress=False)


def test_class_count_mismatch_is_a_user_error(seeds):
    with pytest.raises(UserError, match="number of classes.* 2.* 3"):
        run_campaign(Brightness(LOW), Brightness(HIGH, classes=3), seeds, progress=False)


def test_seeds_of_the_wrong_shape_are_a_user_error(pair):
    big = ImageSet(np.zeros((2, 28, 28, 1), np.uint8), np.zeros(2), "mnist-like")
    with pytest.raises(UserError, match="cannot classify the seeds .*28x28x1"):
        run_campaign(*pair, big, progress=False)


def test_a_classifiers_own_shape_check_reaches_the_user(pair):
    import torch

    from mlflow_di.models.classifier import TorchClassifier
    from mlflow_di.models.preprocessing import Preprocessing

    tiny = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 2))
    classifier = TorchClassifier(tiny, Preprocessing(input_shape=(8, 8, 1)), name="tiny")
    big = ImageSet(np.zeros((2, 28, 28, 1), np.uint8), np.zeros(2), "mnist-like")
    with pytest.raises(UserError, match="28x28x1.*expects 8x8x1"):
        run_campaign(classifier, classifier, big, progress=False)


def test_models_that_disagree_on_every_seed_are_a_user_error(pair):
    band = ImageSet(np.full((4, 8, 8, 1), round(0.31 * 255), np.uint8), np.zeros(4), "band")
    with pytest.raises(UserError, match="disagree on all 4 seeds"):
        run_campaign(*pair, band, progress=False)


def test_bad_arguments_are_user_errors(pair, seeds):
    with pytest.raises(UserError, match="unknown fuzzing strategy"):
        run_campaign(*pair, seeds, strategy="tensorfuzz", progress=False)
    with pytest.raises(UserError, match="timeout"):
        run_campaign(*pair, seeds, timeout=0, progress=False)
    with pytest.raises(UserError, match="max_queries"):
        run_campaign(*pair, seeds, max_queries=0, progress=False)
    with pytest.raises(UserError, match="resume needs"):
        run_campaign(*pair, seeds, resume=True, progress=False)


def _model_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("mlflow-di-models")]


@pytest.mark.parametrize("strategy", ["dflare", DFlare(escalate=4, restart=30), "diffchaser"],
                         ids=["dflare", "dflare-escalate-restart", "diffchaser"])
def test_overlap_gives_the_same_records(seeds, strategy):
    # two campaigns sharing the original, batches smaller than the seeds: both shifts start, refill,
    # speculate as they drain, and budgets (identical models) or triggers (the band pair) end the searches
    compressed = [Brightness(HIGH), Brightness(LOW, name="same")]
    plain, overlapped = (run_campaigns(Brightness(LOW), compressed, seeds, strategy=strategy, max_queries=150,
                                       timeout=1e6, batch=3, seed=2, progress=False, overlap=overlap)
                         for overlap in (False, True))
    for one, other in zip(plain, overlapped):
        assert _comparable(one) == _comparable(other)
        np.testing.assert_array_equal(one.triggers, other.triggers)
    assert plain[1].summary.triggers == 0
    assert plain[0].summary.triggers > 0 or strategy == "diffchaser"  # its small steps need more than 150 queries


class Slow(Brightness):
    """Its calls take 20 ms off the host (a sleep releases the GIL, as a GPU's work does) and are logged."""

    def __init__(self, threshold):
        super().__init__(threshold)
        self.spans: list[tuple[float, float]] = []

    def predict_proba(self, images):
        began = time.perf_counter()
        time.sleep(0.02)
        probabilities = super().predict_proba(images)
        self.spans.append((began, time.perf_counter()))
        return probabilities


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_runs_the_models_while_the_searches_of_the_other_shift_work(pair, seeds, monkeypatch, overlap):
    from mlflow_di.fuzz.dflare import DFlareSearch

    proposed: list[float] = []

    def timed(method):
        def timed_method(self, *args, **kwargs):
            proposed.append(time.perf_counter())
            return method(self, *args, **kwargs)
        return timed_method

    # a search drawing its next mutation (plan) or making its inputs itself (propose, while few seeds are left)
    for name in ("propose", "plan"):
        monkeypatch.setattr(DFlareSearch, name, timed(getattr(DFlareSearch, name)))
    original = Slow(LOW)
    run_campaign(original, Brightness(LOW), seeds, max_queries=6, timeout=1e6, batch=4, progress=False,
                 overlap=overlap)
    during_a_call = sum(any(began < moment < ended for began, ended in original.spans) for moment in proposed)
    if overlap:  # while one shift's 20 ms call runs, the other shift observes and proposes (~1 ms)
        assert during_a_call >= 4
    else:
        assert during_a_call == 0


class Ending(Brightness):
    """Each call takes 30 ms and logs when it ended; call number ``fail_at`` (0-based) raises ``error``,
    or sends this process a SIGINT, as Ctrl-C would, when ``error`` is None."""

    def __init__(self, threshold, fail_at, error=None):
        super().__init__(threshold)
        self.fail_at, self.error, self.started, self.ended = fail_at, error, 0, []

    def predict_proba(self, images):
        number, self.started = self.started, self.started + 1
        try:
            time.sleep(0.03)
            if number == self.fail_at:
                if self.error is None:
                    os.kill(os.getpid(), signal.SIGINT)  # Python raises it in the main thread
                    time.sleep(0.03)  # this call is still running when the campaign hears of it
                else:
                    raise self.error
            return super().predict_proba(images)
        finally:
            self.ended.append(time.perf_counter())


def test_a_model_error_in_the_background_reaches_the_caller_after_the_call_in_flight(pair, seeds):
    failing = Ending(LOW, fail_at=3, error=RuntimeError("CUDA error: device-side assert triggered"))
    with pytest.raises(RuntimeError, match="device-side assert"):
        run_campaign(failing, Brightness(HIGH), seeds, max_queries=3000, batch=4, progress=False, overlap=True)
    returned = time.perf_counter()
    assert failing.started > 4, "the other shift's call was in flight when the error came"
    assert len(failing.ended) == failing.started and max(failing.ended) <= returned
    assert not _model_threads()


def test_ctrl_c_during_an_overlapped_call_keeps_the_finished_seeds_and_waits_for_the_call(pair, seeds, tmp_path,
                                                                                       python_ctrl_c):
    interrupted = Ending(LOW, fail_at=40)
    partial = run_campaign(interrupted, Brightness(HIGH), seeds, max_queries=3000, batch=4, progress=False,
                           out_dir=tmp_path, overlap=True)
    returned = time.perf_counter()
    assert not partial.complete and 0 < len(partial.records) < 12
    assert set(CampaignStore(tmp_path).read_records()) == {r.index for r in partial.records}
    assert len(interrupted.ended) == interrupted.started and max(interrupted.ended) <= returned
    assert not _model_threads()


def test_overlap_is_on_by_default_when_a_model_runs_on_a_gpu():
    class On:
        def __init__(self, provider):
            self.provider = provider

    assert off_host(On("pytorch (cuda:0)"), [On("onnxruntime (CPUExecutionProvider)")])
    assert off_host(On("pytorch (cpu)"), [On("onnxruntime (CUDAExecutionProvider)")])
    assert not off_host(On("pytorch (cpu)"), [On("tflite (cpu)"), object()])
    gpu, cpu = On("pytorch (cuda:0)"), On("pytorch (cpu)")
    assert overlaps_by_default(gpu, [cpu]) and not overlaps_by_default(cpu, [cpu])
    # Ray workers overlap when they get a GPU share (they load the models on it as this process did)
    assert overlaps_by_default(gpu, [cpu], RayExecutor(gpus_per_worker=0.5))
    assert not overlaps_by_default(gpu, [cpu], RayExecutor(gpus_per_worker=0))


def test_two_shifts_share_fewer_than_twice_batch_seeds_evenly(pair, seeds, monkeypatch):
    from mlflow_di.fuzz.dflare import DFlareSearch

    depths: list[int] = []
    propose = DFlareSearch.propose

    def recorded(self, limit=None, depth=1, out=None):
        depths.append(depth)
        return propose(self, limit, depth, out)

    monkeypatch.setattr(DFlareSearch, "propose", recorded)
    six = ImageSet(seeds.images[:6], seeds.labels[:6], "six")
    run_campaign(*pair, six, max_queries=50, batch=4, progress=False, overlap=True)
    # 3 + 3 seeds (not 4 + 2): each search speculates ceil(4 / 3) = 2 inputs to fill its shift's call
    assert depths[:6] == [2] * 6


@pytest.mark.parametrize("strategy", ["dflare", DFlare(escalate=2, restart=25), DFlare(acceptance="strict")],
                         ids=["dflare", "escalate-restart", "strict"])
def test_mutants_written_into_the_batch_give_the_records_of_mutants_copied_into_it(pair, seeds, monkeypatch, strategy):
    # DFlare writes its mutants into the runner's rows and copies only what it keeps (x_max, a trigger);
    # a search that ignores ``out`` has each of its own arrays copied in: the same campaign either way
    from mlflow_di.fuzz.dflare import DFlareSearch

    written = run_campaign(*pair, seeds, strategy=strategy, max_queries=400, batch=5, seed=3, progress=False)
    propose = DFlareSearch.propose
    monkeypatch.setattr(DFlareSearch, "propose", lambda self, limit=None, depth=1, out=None: propose(self, limit, depth))
    copied = run_campaign(*pair, seeds, strategy=strategy, max_queries=400, batch=5, seed=3, progress=False)
    assert _comparable(written) == _comparable(copied)
    np.testing.assert_array_equal(written.triggers, copied.triggers)
    assert written.summary.triggers > 0


class _Echo:
    """Black box whose class-0 probability is an image's first value / 1000 (class 1 always wins)."""

    name = "echo"

    def predict_proba(self, images):
        first = images.reshape(len(images), -1)[:, 0].astype(float) / 1000
        return np.stack([first, 1 - first], axis=1)


class _RowChecking:
    """A strategy whose searches propose 1-7 inputs a turn (more than ``depth``), some written into the
    runner's rows and some as arrays of their own, each input one value all over; every search checks
    that the models saw exactly its own inputs."""

    name = "row-checking"

    def options(self):
        return {}

    def start(self, seed_image, p_original, p_compressed, rng):
        from mlflow_di.fuzz.search import Search

        class RowSearch(Search):
            def propose(self, limit=None, depth=1, out=None):
                count = min(int(rng.integers(1, 8)), limit or 7)
                self.values = rng.integers(1, 250, count)
                own = np.repeat(self.values.astype(np.uint8), seed_image.size).reshape(count, *seed_image.shape)
                if out is not None and count <= len(out) and rng.random() < 0.5:
                    out[:count] = own
                    return out[:count]
                return own

            def observe(self, p_original, p_compressed):
                np.testing.assert_allclose(p_original[:, 0] * 1000, self.values)
                np.testing.assert_allclose(p_compressed[:, 0] * 1000, self.values)
                self.queries += len(self.values)

        return RowSearch(["row"])


@pytest.mark.parametrize("overlap", [False, True])
def test_every_search_gets_the_answers_to_its_own_inputs_as_the_batch_grows(seeds, overlap):
    # searches proposing more than depth make the runner grow its buffer mid-lane, keeping the rows before
    results = run_campaigns(_Echo(), [_Echo(), _Echo()], seeds, strategy=_RowChecking(), max_queries=60, batch=5,
                            progress=False, overlap=overlap)
    assert all(r.stop == "max_queries" and r.queries >= 60 for result in results for r in result.records)
