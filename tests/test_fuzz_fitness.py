"""Objective, DFlare fitness, novelty memory and DiffChaser's k-uncertainty."""
import mlflow_di  # noqa: F401
import numpy as np
import pytest

from mlflow_di.fuzz.diffchaser import k_uncertainties
from mlflow_di.fuzz.fitness import (NoveltyMemory, dflare_fitness, k_uncertainty, labels_differ, probability_pair,
                                    top1_gap, top1_labels)


def test_labels_differ_and_top1_gap():
    f, g = np.array([0.7, 0.2, 0.1]), np.array([0.55, 0.4, 0.05])
    assert not labels_differ(f, g)
    assert top1_gap(f, g) == pytest.approx(0.15)
    assert labels_differ(f, np.array([0.3, 0.6, 0.1]))


def test_labels_differ_is_one_definition_for_single_inputs_and_batches():
    rng = np.random.default_rng(0)
    p_original, p_compressed = rng.dirichlet(np.ones(4), 200), rng.dirichlet(np.ones(4), 200)
    p_compressed[:5] = p_original[:5]
    batch = labels_differ(p_original, p_compressed)
    assert batch.shape == (200,) and batch.dtype == bool and not batch[:5].any() and batch.any()
    single = [labels_differ(a, b) for a, b in zip(p_original, p_compressed)]
    assert all(type(d) is bool for d in single) and single == batch.tolist()
    assert single == [a.tolist().index(max(a)) != b.tolist().index(max(b)) for a, b in zip(p_original, p_compressed)]
    tie = np.array([0.5, 0.5])
    assert not labels_differ(tie, np.array([0.6, 0.4])) and top1_labels(tie, np.array([0.4, 0.6])) == (0, 1)


def test_dflare_fitness_weighs_novelty_as_one_delta():
    assert dflare_fitness(0.002, False) == pytest.approx(2.0)
    assert dflare_fitness(0.002, True) == pytest.approx(3.0)
    # a novel state beats a gap larger by less than delta, not one larger by more
    assert dflare_fitness(0.0100, True) > dflare_fitness(0.0105, False)
    assert dflare_fitness(0.0100, True) < dflare_fitness(0.0115, False)


def test_novelty_memory_threshold_is_on_squared_distance():
    memory = NoveltyMemory(threshold=0.5)
    origin = np.zeros(4)
    assert memory.observe(origin) and len(memory) == 1
    assert not memory.observe(origin)
    assert not memory.observe(np.array([0.7, 0.0, 0.0, 0.0]))  # squared 0.49
    assert len(memory) == 1                                       # not novel: not remembered
    assert memory.observe(np.array([0.72, 0.0, 0.0, 0.0]))       # squared 0.5184
    assert len(memory) == 2
    # now close to the second point, far from the first
    assert not memory.observe(np.array([1.1, 0.0, 0.0, 0.0]))
    assert memory.nearest_squared_distance(np.array([1.1, 0, 0, 0])) == pytest.approx(0.38 ** 2)


def test_novelty_memory_grows_past_its_initial_capacity():
    memory = NoveltyMemory(threshold=0.5, capacity=2)
    points = np.eye(10) * 3
    assert all(memory.observe(p) for p in points)
    assert len(memory) == 10
    assert not any(memory.observe(p + 0.1) for p in points)


def test_probability_pair_concatenates():
    np.testing.assert_array_equal(probability_pair(np.array([0.1, 0.9]), np.array([0.2, 0.8])), [0.1, 0.9, 0.2, 0.8])


def test_k_uncertainty_across_the_pair():
    f = np.array([0.6, 0.3, 0.1])
    g = np.array([0.5, 0.35, 0.15])
    assert k_uncertainty(f, g, k=2) == pytest.approx(0.6 - 0.35)
    assert k_uncertainty(f, g, k=3) == pytest.approx(0.6 - 0.15)
    assert k_uncertainty(f, g, k=9) == pytest.approx(0.6 - 0.15)   # k capped at the class count
    rows = k_uncertainties(np.stack([f, g]), np.stack([g, f]), 2)
    np.testing.assert_allclose(rows, [k_uncertainty(f, g), k_uncertainty(g, f)])


@pytest.mark.parametrize("classes", [3, 64, 65, 1000])
def test_a_step_s_row_facts_are_the_per_row_figures(classes):
    # scoring a step's rows at once (row_facts, and on a device step_facts) reads the numbers scoring
    # one row reads: labels, NaN, and the two largest values of each row
    import torch

    from mlflow_di.fuzz.device_fitness import step_facts
    from mlflow_di.fuzz.fitness import log_margin, margin_of, row_facts

    rng = np.random.default_rng(classes)
    p_original = rng.dirichlet(np.full(classes, 0.3), 40).astype(np.float32)
    p_compressed = rng.dirichlet(np.full(classes, 0.3), 40).astype(np.float32)
    p_compressed[:5] = p_original[:5]  # agreeing rows
    p_original[5, 1] = np.nan
    p_compressed[6, 0] = np.inf
    p_original[7] = 1.0 / classes  # a tie everywhere: the first class wins, as argmax
    for facts in (row_facts(p_original, p_compressed), step_facts(p_original, p_compressed, torch.device("cpu"),
                                                                  [None] * 40)):
        for row, fact in enumerate(facts):
            assert fact.differ == labels_differ(p_original[row], p_compressed[row])
            if classes <= 64:
                assert fact.original_top2 is None
                continue
            assert fact.has_nan == bool(np.isnan(p_original[row].sum() + p_compressed[row].sum()))
            if not fact.has_nan:
                assert margin_of(fact.original_top2) == log_margin(p_original[row])
                assert margin_of(fact.compressed_top2) == log_margin(p_compressed[row])
                assert fact.original_top2[1] == p_original[row].max()


def test_the_device_memory_finds_the_novel_points_the_host_memory_finds():
    import torch

    from mlflow_di.fuzz.device_fitness import DeviceNoveltyMemory, step_facts

    rng = np.random.default_rng(0)
    host, device = NoveltyMemory(threshold=0.3), DeviceNoveltyMemory(threshold=0.3, device="cpu")
    assert host.observe(np.full(8, 0.25)) and device.observe(np.full(8, 0.25)) and len(device) == 1
    for step in range(60):
        p_original, p_compressed = (rng.dirichlet(np.ones(4), 1).astype(np.float32) for _ in range(2))
        if step % 2:  # close to a remembered point: not novel
            p_original, p_compressed = np.full((1, 4), 0.25, np.float32), np.full((1, 4), 0.26, np.float32)
        fact = step_facts(p_original, p_compressed, torch.device("cpu"), [device])[0]
        novel = host.observe(probability_pair(p_original[0], p_compressed[0]))
        assert fact.novel == novel
        if fact.novel:
            device.remember(fact.pair)
        assert len(device) == len(host)
    assert 3 < len(host) < 60


def test_the_device_memory_grows_past_its_capacity_and_keeps_every_point():
    import torch

    from mlflow_di.fuzz.device_fitness import DeviceNoveltyMemory

    memory = DeviceNoveltyMemory(threshold=0.0, device="cpu", capacity=2)
    points = np.random.default_rng(1).random((7, 6))
    assert memory.observe(points[0]) and memory.points.shape == (1, 6)  # the seed's pair, sent with the first use
    for point in points[1:]:
        memory.remember(torch.from_numpy(point))
    assert len(memory) == 7 and np.array_equal(memory.points.numpy(), points)
    assert not memory.observe(points[3]) and memory.observe(points[3] + 1.0) and len(memory) == 8
