"""Realistic size: torchvision CNNs at 224x224, each cost as a ratio to the model's own work, in one run.

For each family (random weights, generated images labelled by the model itself):
- IDC fitting (LRP + clustering) per image vs one plain forward+backward pass per image;
- scoring every criterion per image vs one plain forward pass per image;
- DFlare's campaign seconds per query vs the two models' own batched inference per input (the
  original against a copy of itself on the same device, so every seed runs its full query budget
  and the ratio is the search's overhead: mutations, fitness, novelty, bookkeeping), with the
  searches' share of a query and each mutation operator's milliseconds per call at this size;
  and the same campaign with overlap (``fuzz --overlap``: two shifts of half the seeds, the models'
  calls beside the searches) over the models' inference on calls of half as many inputs;
- the campaign's floor: the same campaign with a near-free stand-in for both models (ImageNet's
  1,000 classes), i.e. what a query costs besides the models, and the same without the three
  operators a GPU can take over (noise, median blur): the host's own share of a query;
- with ``--floor-only``, those floors and the coverage passes' floor: IDC fitting and scoring every
  criterion with a near-free CNN as the model, ms per image (what a GPU leaves of the passes);
- peak memory (process RSS, and the GPU's allocator peak on CUDA).

    .venv/bin/python -m benchmarks.bench_scale [--families resnet18,mobilenet_v3_small] [--device auto]
        [--images 64] [--seeds 16] [--queries 30] [--write]
    .venv/bin/python -m benchmarks.bench_scale --floor-only --seeds 64 --queries 30 --images 256 --batch-size 64

``--write`` replaces this benchmark's section of benchmarks/RESULTS.md (one section per device
type, so the CPU and GPU figures live side by side).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import platform
import resource
import time
from typing import NamedTuple

import numpy as np

import mlflow_di  # noqa: F401  (torchvision guard first)

IMAGENET = dict(scale=1.0, mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375), layout="NCHW",
                output="logits")


def random_torchvision_model(family: str):
    """torchvision's ``family`` with 10 classes, seeded, its last layer re-initialised wider so the
    random logits do not tie (tied logits flip their top-1 label with the batch size)."""
    import torch
    import torchvision

    torch.manual_seed(0)
    module = getattr(torchvision.models, family)(num_classes=10).eval()
    head = [m for m in module.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))][-1]
    torch.nn.init.normal_(head.weight, std=10.0 / head.weight[0].numel() ** 0.5)
    return module


class StandIn:
    """A near-free black box for the campaign's floor: a softmax over ``classes`` outputs of the mean of
    1,024 fixed pixel values, so margins still move with mutants while the model costs next to nothing
    (both sides of the campaign use it, so every seed runs its whole budget). Until 2026-11-28 it took the
    mean of every 8th value, 18,816 strided reads at 224 px, which cost 0.05 ms an image, a third of the
    floor it was meant to leave out."""

    name = "stand-in"
    SAMPLED = 1024

    def __init__(self, classes: int = 1000):
        self.weights = np.random.default_rng(0).standard_normal(classes)
        self._sampled: dict[int, np.ndarray] = {}
        self.seconds = 0.0

    def predict_proba(self, images: np.ndarray) -> np.ndarray:
        started = time.perf_counter()
        try:
            return self._probabilities(images)
        finally:
            self.seconds += time.perf_counter() - started  # its own share of the floor, reported beside it

    def _probabilities(self, images: np.ndarray) -> np.ndarray:
        flat = images.reshape(len(images), -1)
        values = flat.shape[1]
        if values not in self._sampled:
            self._sampled[values] = np.sort(np.random.default_rng(1).choice(values, min(self.SAMPLED, values),
                                                                              replace=False))
        level = flat[:, self._sampled[values]].mean(axis=1) / 255.0
        logits = np.outer(level - 0.5, self.weights) * 20
        logits[:, 0] += 5
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (p / p.sum(axis=1, keepdims=True)).astype(np.float32)


def _timed(fn, device, repeat: int = 1) -> float:
    """Seconds per call of ``fn`` (synchronising CUDA so GPU work is counted)."""
    import torch

    fn()  # warm-up: kernels, allocator, lazy initialisation
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeat


class FloorRun(NamedTuple):
    """One stand-in campaign: seconds per query, the stand-in models' seconds per query, and the queries."""

    per_query: float
    stand_in_per_query: float
    queries: int


def _stand_in_campaign(strategy, seeds, queries: int) -> FloorRun:
    """``strategy``'s campaign on ``seeds`` with :class:`StandIn` as both models (what is left besides the
    stand-in's own calls is the search's work)."""
    from mlflow_di.fuzz.campaign import run_campaign

    stand_in = StandIn()
    started = time.perf_counter()
    result = run_campaign(stand_in, stand_in, seeds, strategy=strategy, max_queries=queries, timeout=1e9,
                          batch=len(seeds), progress=False)
    count = max(sum(r.queries for r in result.records), 1)
    return FloorRun((time.perf_counter() - started) / count, stand_in.seconds / count, count)


def host_operators(strategy):
    """``strategy`` without the operators that cost most on the CPU (noise, median blur): the host floor's
    definition until the population moved every operator to the device (``campaign_cpu_operators_floor``)."""
    from mlflow_di.fuzz.mutations import GaussianNoise, MedianBlur, MultiplicativeNoise

    return dataclasses.replace(strategy, operators=tuple(
        op for op in strategy.operators if not isinstance(op, (GaussianNoise, MultiplicativeNoise, MedianBlur))))


class DeviceClock(contextlib.AbstractContextManager):
    """Seconds a campaign spends in its population's device sections: making a step's mutants
    (``DeviceOperator.make_many``) and bringing them back (``population._bring_back``), keeping an
    accepted mutant as x_max (``Mutation.kept``) and scoring a step (``step_facts``). On a GPU that is the
    device's work (each section ends by bringing its answer back, so the wait is inside); on ``--device cpu``
    torch's CPU operations stand in for it. Each section's own few Python calls are inside too; handing
    each mutation its row and flag is not (host work)."""

    def __init__(self):
        from mlflow_di.fuzz import dflare, population
        from mlflow_di.fuzz.device_mutations import DeviceOperator
        from mlflow_di.fuzz.population import Mutation

        self.seconds = 0.0
        self._sections = [(DeviceOperator, "make_many"), (population, "_bring_back"), (Mutation, "kept"),
                          (dflare, "step_facts")]
        self._originals = [getattr(owner, name) for owner, name in self._sections]

    def __enter__(self):
        for (owner, name), original in zip(self._sections, self._originals):
            setattr(owner, name, self._timed(original))
        return self

    def __exit__(self, *exc):
        for (owner, name), original in zip(self._sections, self._originals):
            setattr(owner, name, original)

    def _timed(self, original):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


@dataclasses.dataclass(frozen=True)
class OneValue:
    """The cheapest operator that still makes a new image: a copy with one value's lowest bit flipped."""

    name: str = "one_value"

    def __call__(self, image: np.ndarray, rng: np.random.Generator, out: np.ndarray | None = None) -> np.ndarray:
        from mlflow_di.fuzz.mutations import copied

        out = copied(image, out)
        out.reshape(-1)[int(rng.integers(out.size))] ^= 1
        return out


def bookkeeping_operators(strategy):
    """``strategy`` with two :class:`OneValue` operators: what is left is the search's own per-query work."""
    return dataclasses.replace(strategy, operators=(OneValue(), OneValue(name="one_value_2")))


class FreeDeviceWork(contextlib.AbstractContextManager):
    """The device operators' per-value work replaced by a near-free stand-in (each mutant is its source with
    one value's lowest bit flipped), as :class:`StandIn` replaces the models: what remains of a campaign is
    the host's work and the device sections' own calls. On ``--device cpu`` the real operators' work (torch
    on the same cores) also evicts the host's data from the CPU's caches, which a GPU's work does not."""

    def __enter__(self):
        from mlflow_di.fuzz.device_mutations import DeviceOperator

        self._originals = {kind: kind.mutants for kind in DeviceOperator.__subclasses__()}
        for kind in self._originals:
            kind.mutants = _one_value_flipped
        return self

    def __exit__(self, *exc):
        for kind, original in self._originals.items():
            kind.mutants = original


def _one_value_flipped(operator, images, drawn):
    made = images.clone()
    made.view(len(images), -1)[:, 0] ^= 1
    return made


#: Host-floor campaigns per measurement; the median is reported.
HOST_FLOOR_RUNS = 5


def floors(strategy, seeds, queries: int, device) -> dict:
    """The campaign's floors with :class:`StandIn` models, in ms per query:

    - ``campaign_floor``: with ``strategy``'s operators as the campaign runs them;
    - ``campaign_host_floor``: the host's own work per query when the population runs on ``device`` (every
      operator moved there) and the device's per-value work costs next to nothing (:class:`FreeDeviceWork`):
      the wall time less the stand-in models' calls and the device sections (:class:`DeviceClock`), reported
      beside it (``..._device``, ``..._stand_in``); the median of :data:`HOST_FLOOR_RUNS` campaigns;
    - ``campaign_host_floor_real_device``: the same with the operators' real work on ``device``;
    - ``campaign_cpu_operators_floor``: the host floor's earlier definition, the campaign on the CPU without
      the noise and median operators (comparable with figures before 2026-11-28);
    - ``campaign_bookkeeping_floor``: with operators that cost a copy (:class:`OneValue`)."""
    from mlflow_di.fuzz.device_mutations import with_operators_on

    floor = _stand_in_campaign(strategy, seeds, queries).per_query
    on_device = with_operators_on(strategy, device)
    _stand_in_campaign(on_device, seeds, 2)  # warm-up: torch's first calls, the device modules' imports
    runs = []
    for _ in range(HOST_FLOOR_RUNS):  # the median run: one campaign is ~0.5 s, within a machine's load swings
        with FreeDeviceWork(), DeviceClock() as clock:
            population = _stand_in_campaign(on_device, seeds, queries)
        device_share = clock.seconds / population.queries
        runs.append((population.per_query - population.stand_in_per_query - device_share, device_share,
                     population.stand_in_per_query))
    host, device_share, stand_in = sorted(runs)[len(runs) // 2]
    with DeviceClock() as real_clock:
        real = _stand_in_campaign(on_device, seeds, queries)
    real_host = real.per_query - real.stand_in_per_query - real_clock.seconds / real.queries
    cpu_operators = _stand_in_campaign(host_operators(strategy), seeds, queries).per_query
    bookkeeping = _stand_in_campaign(bookkeeping_operators(strategy), seeds, queries).per_query
    return {"campaign_floor_ms_per_query": round(floor * 1e3, 3),
            "campaign_host_floor_ms_per_query": round(host * 1e3, 3),
            "campaign_host_floor_device_ms_per_query": round(device_share * 1e3, 3),
            "campaign_host_floor_stand_in_ms_per_query": round(stand_in * 1e3, 3),
            "campaign_host_floor_real_device_ms_per_query": round(real_host * 1e3, 3),
            "campaign_real_device_ms_per_query": round(real_clock.seconds / real.queries * 1e3, 3),
            "campaign_cpu_operators_floor_ms_per_query": round(cpu_operators * 1e3, 3),
            "campaign_bookkeeping_floor_ms_per_query": round(bookkeeping * 1e3, 3)}


def tiny_cnn():
    """A near-free CNN for any input size (two strided convolutions: 2.8M multiply-adds at 224 px, 0.2% of ResNet-18)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("conv1", nn.Sequential(nn.Conv2d(3, 16, 8, stride=8), nn.ReLU()))
    net.add_module("conv2", nn.Sequential(nn.Conv2d(16, 32, 4, stride=4), nn.ReLU()))
    net.add_module("pool", nn.AdaptiveAvgPool2d(1))
    net.add_module("flatten", nn.Flatten())
    net.add_module("fc", nn.Linear(32, 10))
    return net.eval()


def labelled_images(model, size: int, n_images: int, batch_size: int, seed: int):
    """Generated ``size`` x ``size`` RGB images labelled by ``model`` itself (an ImageSet)."""
    from mlflow_di.data import ImageSet

    images = np.random.default_rng(seed).integers(0, 256, (n_images, size, size, 3), dtype=np.uint8)
    return ImageSet(images, model.classifier().predict(images, batch_size), f"generated {n_images}x{size}x{size}")


def coverage_seconds(model, data, batch_size: int, device) -> tuple[float, float]:
    """Seconds per image of one IDC fit (top 6 neurons) and of scoring every criterion, on ``data``."""
    from mlflow_di.coverage.idc import ImportanceDrivenCoverage
    from mlflow_di.coverage.suite import CoverageSuite

    started = time.perf_counter()
    ImportanceDrivenCoverage(top_m=6, only_correct=False, batch_size=batch_size, progress=False).fit(model, data)
    idc_fit = (time.perf_counter() - started) / len(data)
    suite = CoverageSuite(only_correct=False, batch_size=batch_size, progress=False).fit(model, data)
    return idc_fit, _timed(lambda: suite.score(data), device) / len(data)


def coverage_floor(device, size: int, n_images: int, batch_size: int) -> dict:
    """IDC fitting and scoring every criterion with :func:`tiny_cnn` as the model: what the coverage
    passes cost besides the model (preprocessing, hooks, copies, clustering), ms per image."""
    from mlflow_di.models.preprocessing import Preprocessing
    from mlflow_di.models.torch_model import TorchModel

    model = TorchModel(tiny_cnn(), Preprocessing(input_shape=(size, size, 3), **IMAGENET), "tiny-cnn").to(device)
    data = labelled_images(model, size, n_images, batch_size, seed=1)
    coverage_seconds(model, data, batch_size, device)  # warm-up: a first LRP pass costs ~1.5x a later one here
    idc_fit, score_all = coverage_seconds(model, data, batch_size, device)
    return {"coverage_floor_idc_fit_ms_per_image": round(idc_fit * 1e3, 3),
            "coverage_floor_score_all_ms_per_image": round(score_all * 1e3, 3)}


def measure_floors(device_spec: str, size: int, seeds: int, queries: int, n_images: int, batch_size: int) -> dict:
    """:func:`floors` and :func:`coverage_floor` alone (no torchvision model), with the noise and median
    on ``device_spec`` when it is CUDA."""
    from mlflow_di.data import ImageSet
    from mlflow_di.fuzz.dflare import DFlare
    from mlflow_di.models.device import describe_device, resolve_device

    device = resolve_device(device_spec)
    mutations_on = device if device.type == "cuda" else None
    images = np.random.default_rng(0).integers(0, 256, (seeds, size, size, 3), dtype=np.uint8)
    seed_set = ImageSet(images, np.zeros(seeds, np.int64), f"generated {seeds}x{size}x{size}")
    return {"device": describe_device(device), "size": size, "seeds": seeds, "queries": queries,
            "images": n_images, "batch": batch_size, "mutations_on": str(mutations_on or "cpu"),
            **floors(DFlare(), seed_set, queries, device),
            **coverage_floor(device, size, n_images, batch_size)}


def measure(family: str, device_spec: str, size: int, n_images: int, seeds: int, queries: int,
            batch_size: int) -> dict:
    import torch

    from mlflow_di.fuzz.campaign import run_campaign
    from mlflow_di.fuzz.device_mutations import mutation_device, on_device, with_operators_on
    from mlflow_di.fuzz.dflare import DFlare
    from mlflow_di.fuzz.mutations import MedianBlur
    from mlflow_di.models.classifier import TorchClassifier
    from mlflow_di.models.device import describe_device, resolve_device
    from mlflow_di.models.preprocessing import Preprocessing
    from mlflow_di.models.torch_model import TorchModel

    device = resolve_device(device_spec)
    preprocessing = Preprocessing(input_shape=(size, size, 3), **IMAGENET)
    model = TorchModel(random_torchvision_model(family), preprocessing, family).to(device)
    data = labelled_images(model, size, n_images, batch_size, seed=0)
    images, classifier = data.images, model.classifier()
    batch = model.to_tensor(images[:batch_size]).to(device)

    def forward_backward():
        model.module.zero_grad(set_to_none=True)
        model.module(batch.clone().requires_grad_(True)).max(dim=1).values.sum().backward()

    def forward():
        with torch.inference_mode():
            model.module(batch)

    per_image = len(batch)
    fwd_bwd = _timed(forward_backward, device, 3) / per_image
    fwd = _timed(forward, device, 3) / per_image
    idc_fit, score_all = coverage_seconds(model, data, batch_size, device)

    # an identical copy: random-init logits are near ties, so any real compression disagrees on every
    # seed; with a copy every seed runs its whole query budget, which is what the timing needs
    pruned = TorchClassifier(copy.deepcopy(model.module), preprocessing, f"{family}-copy")
    seed_set = data.subset(slice(0, seeds))
    started = time.perf_counter()
    mutations_on = mutation_device(classifier)  # as the fuzz command does: the GPU of a CUDA original
    strategy = with_operators_on(DFlare(), mutations_on)
    result = run_campaign(classifier, pruned, seed_set, strategy=strategy, max_queries=queries, timeout=1e9,
                          batch=seeds, progress=False, overlap=False)
    campaign = time.perf_counter() - started
    total_queries = sum(r.queries for r in result.records)
    both_models = _both_models_seconds_per_input(classifier, pruned, images[:seeds], device)
    per_query = campaign / max(total_queries, 1)
    # the same seeds in two overlapping shifts (fuzz --overlap), each call of half as many inputs
    half = max(seeds // 2, 1)
    started = time.perf_counter()
    overlapped = run_campaign(classifier, pruned, seed_set, strategy=strategy, max_queries=queries, timeout=1e9,
                              batch=half, progress=False, overlap=True)
    overlap_per_query = (time.perf_counter() - started) / max(sum(r.queries for r in overlapped.records), 1)
    both_models_half = _both_models_seconds_per_input(classifier, pruned, images[:half], device)
    stats = result.run_stats
    rng = np.random.default_rng(0)
    operators = [(op.name, op) for op in strategy.operators]
    operators += [(f"median_blur_k{k}", op) for k in (3, 5, 7)  # its cost varies with k
                  for op in on_device([MedianBlur(kernels=(k,))], mutations_on)]
    mutation = {name: _timed(lambda op=op: op(images[0], rng), torch.device("cpu"), 20) for name, op in operators}
    peak = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    if device.type == "cuda":
        peak["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    return {"family": family, "device": describe_device(device), "size": size, "images": n_images,
            "batch": batch_size,
            "forward_backward_ms_per_image": round(fwd_bwd * 1e3, 3), "forward_ms_per_image": round(fwd * 1e3, 3),
            "idc_fit_ms_per_image": round(idc_fit * 1e3, 3), "idc_fit_ratio": round(idc_fit / fwd_bwd, 2),
            "score_all_ms_per_image": round(score_all * 1e3, 3), "score_all_ratio": round(score_all / fwd, 2),
            "campaign_queries": total_queries, "campaign_ms_per_query": round(per_query * 1e3, 3),
            "models_ms_per_input": round(both_models * 1e3, 3), "campaign_overhead_ratio": round(per_query / both_models, 2),
            "campaign_overlap_ms_per_query": round(overlap_per_query * 1e3, 3),
            "models_ms_per_input_half_batch": round(both_models_half * 1e3, 3),
            "campaign_overlap_ratio": round(overlap_per_query / both_models_half, 2),
            # where a query's time went: the searches (mutations, fitness, selection) vs the models' calls
            "campaign_search_ms_per_query": round(stats.search_seconds / max(total_queries, 1) * 1e3, 3),
            "campaign_model_ms_per_input": round(stats.model_seconds / max(stats.inputs, 1) * 1e3, 3),
            **floors(DFlare(), seed_set, queries, device),
            "mutations_on": str(mutations_on or "cpu"),
            "mutation_ms_per_call": {name: round(seconds * 1e3, 3) for name, seconds in mutation.items()},
            **peak}


def _both_models_seconds_per_input(original, copy, images: np.ndarray, device) -> float:
    """The two models' own batched inference on ``images``, seconds per input."""
    return _timed(lambda: (original.predict_proba(images), copy.predict_proba(images)), device, 3) / len(images)


def section(rows: list[dict], device_type: str, command: str) -> str:
    begin, end = f"<!-- bench_scale {device_type} -->", f"<!-- /bench_scale {device_type} -->"
    device = rows[0]["device"] if rows else device_type
    lines = [begin, f"### Realistic size on {device}", "",
             f"Command: `{command}`  ", f"Machine: {platform.machine()}, {device}; random-init torchvision models, "
             f"generated {rows[0]['size']}x{rows[0]['size']} RGB images labelled by the model itself.", "",
             "| family | IDC fit / (fwd+bwd) | score all criteria / fwd | campaign s per query / models' inference per input "
             "| the same with overlap (two shifts of half the seeds) | fwd+bwd ms/img | fwd ms/img | campaign ms/query "
             "| of which searches | floor ms/query (stand-in models) "
             "| host floor ms/query (no noise, no median) | peak RSS MiB | peak GPU MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['idc_fit_ratio']} | {r['score_all_ratio']} | {r['campaign_overhead_ratio']} | "
                     f"{r.get('campaign_overlap_ratio', '-')} | "
                     f"{r['forward_backward_ms_per_image']} | {r['forward_ms_per_image']} | {r['campaign_ms_per_query']} | "
                     f"{r.get('campaign_search_ms_per_query', '-')} | {r.get('campaign_floor_ms_per_query', '-')} | "
                     f"{r.get('campaign_host_floor_ms_per_query', '-')} | "
                     f"{r['peak_rss_mib']} | {r.get('peak_gpu_mib', '-')} |")
    lines += ["", "```", *(json.dumps(r) for r in rows), "```", end]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="resnet18,mobilenet_v3_small")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    parser.add_argument("--floor-only", action="store_true",
                        help="only the floors: the campaign with stand-in models, the coverage passes with a "
                             "near-free CNN (no torchvision model); prints JSON")
    args = parser.parse_args()
    if args.floor_only:
        print(json.dumps(measure_floors(args.device, args.size, args.seeds, args.queries, args.images,
                                        args.batch_size)), flush=True)
        return
    rows = []
    for family in args.families.split(","):
        row = measure(family, args.device, args.size, args.images, args.seeds, args.queries, args.batch_size)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.write:
        from benchmarks.results import write_section

        device_type = "cuda" if rows and rows[0]["device"].startswith("cuda") else "cpu"
        text = section(rows, device_type, "python -m benchmarks.bench_scale " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("write", "floor_only")))
        write_section(text, f"<!-- bench_scale {device_type} -->", f"<!-- /bench_scale {device_type} -->")


if __name__ == "__main__":
    main()
