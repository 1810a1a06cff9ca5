"""DeepXplore (Pei et al., SOSP 2017): gradient ascent that makes white-box PyTorch models disagree.

For a seed x on which every model says label c, one model j is picked at random (from the seed's
own generator) and x climbs

    obj(x) = sum_{k != j} F_k(x)[c] - lambda1 * F_j(x)[c]  +  lambda2 * sum_k f_{n_k}(x)

where F_k(x)[c] is model k's pre-softmax output for c (as the reference code, which reads the
``before_softmax`` layer; a model whose output is probabilities contributes their logarithm) and
f_{n_k} is the mean activation of one neuron of model k that the seed does not cover (NC with
threshold t: a neuron is covered when its layer-min-max-scaled mean exceeds t). Each step:
gradient of obj with respect to the pixels, divided by its root mean square (the reference's
``normalize``), shaped by one domain constraint, times the step size:

- ``lighting``: every pixel moves by the same amount, the mean of the gradient (the image gets
  uniformly brighter or darker);
- ``occlusion``: only the pixels of one fixed rectangle (``occlusion_at``, ``occlusion_size``) move;
- ``blackout``: per step, ``blackout_count`` rectangles of ``blackout_size`` at random positions;
  one whose mean gradient is negative is darkened by the step size, the others are left alone
  (pixels only ever get darker, in small rectangles).

Units (mlflow-di works on raw uint8 pixels, so do these settings): the step is in 8-bit levels
per unit of the normalised gradient. The paper's step s = 10 is that in the reference's ImageNet
and driving code, whose pixels are 0..255; its MNIST script scales pixels to [0, 1], so its 10 is
2550 levels here (every blackout rectangle turns black at once). The default is that effective
step, 2550. The other defaults are the paper's: lambda1 = 1, lambda2 = 0.1, t = 0, 20 gradient
steps per climb (``iterations``), the MNIST script's 10x10 occlusion at (0, 0) and 6x6 blackout
rectangles.

Climbs: the reference climbs once per seed toward one target model. Here pixels are clipped to
0..255 (a lit image saturates, where the reference's unclipped floats go on), and one climb
stalls in a local optimum on about half the seeds of two independently trained digits CNNs
(48%), although a brightness offset that makes them disagree exists on every one of them. So a
seed whose climb ends without a deviation climbs again from the seed with each other model as
the target (``retarget``), then the whole round again with each of ``finer_steps`` (255): 95%
of those seeds (benchmarks/RESULTS.md, bench_deepxplore_defaults). ``retarget=False,
finer_steps=()`` is the reference's one climb.

Where this departs from the reference, on purpose:

- the image is kept as a float offset from the seed, and the image the models see is the seed
  plus the offset rounded to whole levels, clipped to 0..255, so every input is a real uint8 image
  (the reference steps on floats and never clips while searching); occlusion and blackout offsets
  are clipped to the pixel range, lighting's is not, so a lit image is exactly
  ``clip(seed + k)`` for one integer k;
- "not yet covered" is judged on the seed's own activations, and the neuron is picked once per
  seed (as the reference does) from the seed's generator: a table shared by all seeds would make
  a seed's search depend on which seeds finished before it, and so on ``batch`` and ``resume``;
- neurons are the model's hidden layers as the coverage criteria count them
  (:func:`~mlflow_di.coverage.activations.hidden_layers`; a conv channel is one neuron, its
  spatial mean its value); the reference takes every Keras layer but the input and flatten ones;
- the gradient is normalised per seed (the reference normalises over its batch of one), and the
  gradient pass runs on float64 copies of the models (see :func:`float64_copy`);
- a disagreement seen in the batched gradient pass is checked again with every model's black-box
  ``predict_proba`` on the uint8 image before it is recorded, so every trigger is a real one.

Queries: one query is one generated input evaluated by every model (one forward and backward
pass of each, batched with the other seeds' inputs). The seed's own evaluation is not counted, so
``queries`` is the number of gradient steps whose result was looked at (the seed, where each climb
starts, is not counted); ``iterations`` times the climbs and ``max_queries`` (the smaller wins) cap
it, and the stop is then ``max_queries``.

The search runs seeds in lockstep (``batch`` at a time, one batched forward/backward per model
and iteration), writes each finished seed through a :class:`~mlflow_di.fuzz.session.CampaignSession`
(crash-safe, resumable) and returns the same :class:`~mlflow_di.fuzz.results.CampaignResult` as
:func:`~mlflow_di.fuzz.campaign.run_campaign`, with ``neuron_coverage``: NC (threshold t) of every
model over the seeds and the triggers, as the reference counts coverage. A seed's records do not
depend on ``batch`` (the seed's generator is ``np.random.default_rng([seed, index])``), given
models whose output for an image does not depend on the rest of the batch.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.fuzz._random import draw_index
from mlflow_di.fuzz.charge import process_seconds
from mlflow_di.fuzz.contract import DEFAULT_MAX_QUERIES, DEFAULT_TIMEOUT, Campaign
from mlflow_di.fuzz.deepxplore_options import DEEPXPLORE_OPTIONS
from mlflow_di.fuzz.seeds import SEED_BATCH, campaign_config, check_arguments, predict_checked, refuse_raw_resize, top1
from mlflow_di.fuzz.realism import distances
from mlflow_di.fuzz.results import CampaignConfig, CampaignResult, RunStats, SeedRecord, Stop
from mlflow_di.fuzz.session import CampaignSession
from mlflow_di.progress import BudgetProgress, budget_share, progress_bar as tqdm

#: the reference's ``normalize``: gradient / (root mean square + this)
NORMALIZE_EPSILON = 1e-5


@dataclasses.dataclass(frozen=True)
class DeepXplore:
    """DeepXplore's settings (see the module docstring for units and defaults)."""

    step: float = 2550.0
    lambda1: float = 1.0
    lambda2: float = 0.1
    threshold: float = 0.0
    iterations: int = 20
    #: climb again from the seed with each other model as the target when a climb finds nothing
    retarget: bool = True
    #: then climb again (each target in turn) with each of these steps
    finer_steps: tuple[float, ...] = (255.0,)
    constraint: str = "lighting"
    occlusion_at: tuple[int, int] = (0, 0)
    occlusion_size: tuple[int, int] = (10, 10)
    blackout_size: tuple[int, int] = (6, 6)
    blackout_count: int = 1
    name: str = "deepxplore"

    def __post_init__(self):
        for spec in DEEPXPLORE_OPTIONS:  # the declared ranges, the same the command line's --dx-* options take
            object.__setattr__(self, spec.field, spec.check(getattr(self, spec.field), "DeepXplore"))

    def climbs(self, first_target: int, models: int) -> list[tuple[float, int]]:
        """(step, target model) of each climb from the seed, in order: ``first_target`` (drawn per seed),
        then (``retarget``) every other model in index order; the whole round again with each of
        ``finer_steps``."""
        targets = [first_target] + ([k for k in range(models) if k != first_target] if self.retarget else [])
        return [(step, target) for step in (self.step, *self.finer_steps) for target in targets]

    def options(self) -> dict:
        """The settings as JSON values (what a campaign's config records and ``resume`` compares)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}
        return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}

    def check_image_shape(self, shape: tuple[int, ...]) -> None:
        """A one-line UserError when the occlusion rectangle starts outside ``shape`` (H, W, C) images."""
        height, width = shape[:2]
        row, column = self.occlusion_at
        if self.constraint == "occlusion" and (row >= height or column >= width):
            raise UserError(f"the occlusion rectangle starts at {row},{column}, outside the {height}x{width} seeds; "
                            "give a position inside the image (--dx-occlusion-at ROW,COL)")

    def constrain(self, gradient: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, list[str]]:
        """The direction the constraint allows for one seed's normalised (H, W, C) gradient, and the
        step's operators (``lighting``, ``occlusion``, ``blackout@ROW,COL`` per darkened rectangle,
        ``blackout-none`` when no rectangle had a negative mean gradient)."""
        height, width = gradient.shape[:2]
        if self.constraint == "lighting":
            return np.full_like(gradient, gradient.mean()), ["lighting"]
        allowed = np.zeros_like(gradient)
        if self.constraint == "occlusion":
            (row, column), (rows, columns) = self.occlusion_at, self.occlusion_size
            allowed[row:row + rows, column:column + columns] = gradient[row:row + rows, column:column + columns]
            return allowed, ["occlusion"]
        rows, columns = min(self.blackout_size[0], height), min(self.blackout_size[1], width)
        names = []
        for _ in range(int(self.blackout_count)):
            row, column = int(rng.integers(0, height - rows + 1)), int(rng.integers(0, width - columns + 1))
            if gradient[row:row + rows, column:column + columns].mean() < 0:
                allowed[row:row + rows, column:column + columns] = -1.0
                names.append(f"blackout@{row},{column}")
        return allowed, names or ["blackout-none"]


# ---------------------------------------------------------------------------------- white-box pass
def model_input(model, pixels):
    """Raw pixels (B, H, W, C) float tensor (0..255, may need gradients) -> the model's input on its
    device: the operations of :meth:`~mlflow_di.models.preprocessing.Preprocessing.apply_on`, in the
    pixels' float type, so gradients flow through the preprocessing."""
    import torch

    pre, device = model.preprocessing, model.device
    x = pixels.to(device) * pre.scale
    x = (x - torch.tensor(pre.mean, dtype=pixels.dtype, device=device)) / torch.tensor(
        pre.std, dtype=pixels.dtype, device=device)
    return x.permute(0, 3, 1, 2) if pre.layout == "NCHW" else x


def forward(model, pixels, layers: list[str]):
    """(pre-softmax outputs (B, classes), [output of each of ``layers``]) of one model, on the CPU, in
    the pixels' float type, keeping the autograd graph. A model that outputs probabilities gives their
    logarithm."""
    import torch

    from mlflow_di.coverage.activations import LayerRecorder

    with LayerRecorder(model.module, layers) as recorder:  # each layer after its activation, as coverage takes it
        outputs = model.module(model_input(model, pixels)).to(pixels.dtype)
    if model.preprocessing.output == "probabilities":
        outputs = torch.log(outputs.clamp_min(1e-12))
    return outputs.cpu(), [recorder.outputs[name] for name in layers]


def objective(logits: list, activations: list[list], labels, targets, neurons, lambda1: float, lambda2: float):
    """Per-seed DeepXplore objective (B,): sum of the other models' outputs for the seed's label minus
    ``lambda1`` times the target model's, plus ``lambda2`` times the chosen neurons' activations.

    ``logits[k]`` (B, classes) and ``activations[k]`` (layer outputs) of model k from :func:`forward`;
    ``labels``/``targets`` (B,) ints; ``neurons[b][k]`` = (layer position, neuron) of seed b in model k.
    """
    import torch

    from mlflow_di.coverage.activations import neuron_values

    rows = torch.arange(len(labels))
    labels, targets = torch.as_tensor(np.asarray(labels)), torch.as_tensor(np.asarray(targets))
    confidence = torch.stack([output[rows, labels] for output in logits], dim=1)  # (B, models)
    weights = torch.ones_like(confidence)
    weights[rows, targets] = -float(lambda1)
    differential = (confidence * weights).sum(dim=1)
    values = [[neuron_values(output) for output in per_model] for per_model in activations]
    coverage = torch.stack([sum(values[k][layer][b, neuron].cpu() for k, (layer, neuron) in enumerate(chosen))
                            for b, chosen in enumerate(neurons)])
    return differential + float(lambda2) * coverage


def float64_copy(model):
    """A float64 copy of a white-box model for the gradient pass: float32 batched convolutions differ
    in the last bits with the batch size, and rounding each step to whole 8-bit levels would turn
    that into different images; in float64 a seed's path does not depend on its batch."""
    import copy

    from mlflow_di.models.torch_model import TorchModel

    return TorchModel(copy.deepcopy(model.module).double(), model.preprocessing, model.name, model.metadata)


def covered_neurons(activations: list, threshold: float) -> np.ndarray:
    """NC cells (B, neurons) of one model's layer outputs: scaled mean above ``threshold``."""
    from mlflow_di.coverage.criteria_neuron import nc_scaled_means

    return np.concatenate([(nc_scaled_means(output).cpu().numpy() > threshold) for output in activations], axis=1)


def neuron_layers(model) -> list[str]:
    """The layers whose neurons DeepXplore tries to cover: the model's hidden layers."""
    from mlflow_di.coverage.activations import hidden_layers

    return hidden_layers(model.module)


def neuron_coverage(models: list, image_batches, threshold: float) -> list[tuple[int, int]]:
    """(covered, neurons) of every model over the uint8 image batches (NC with ``threshold``)."""
    import torch

    layers = [neuron_layers(model) for model in models]
    cells: list[np.ndarray | None] = [None] * len(models)
    for images in image_batches:
        if not len(images):
            continue
        pixels = torch.from_numpy(np.ascontiguousarray(images).astype(np.float32))
        with torch.no_grad():
            for k, model in enumerate(models):
                covered = covered_neurons(forward(model, pixels, layers[k])[1], threshold).any(axis=0)
                cells[k] = covered if cells[k] is None else cells[k] | covered
    return [(int(c.sum()), int(c.size)) if c is not None else (0, 0) for c in cells]


# ---------------------------------------------------------------------------------- campaign
@dataclasses.dataclass
class _Seed:
    """One seed being searched."""

    index: int
    image: np.ndarray
    rng: np.random.Generator
    label: int
    seed_probabilities: list[np.ndarray]
    offset: np.ndarray
    current: np.ndarray
    #: (step, target model) of each climb (:meth:`DeepXplore.climbs`); ``climb`` the current one's position
    climbs: list[tuple[float, int]]
    neurons: list[tuple[int, int]] | None = None
    steps: int = 0
    climb: int = 0
    climb_steps: int = 0
    queries: int = 0
    seconds: float = 0.0
    operators: list[str] = dataclasses.field(default_factory=list)
    changed_steps: int = 0

    @property
    def step(self) -> float:
        """The current climb's step size."""
        return self.climbs[self.climb][0]

    @property
    def target(self) -> int:
        """The current climb's target model."""
        return self.climbs[self.climb][1]


_TWO_MODELS = "DeepXplore needs at least two models (an original and one or more others)"


def run_deepxplore(models: list, seeds: ImageSet, strategy: DeepXplore | None = None, timeout: float = DEFAULT_TIMEOUT,
                   max_queries: int | None = DEFAULT_MAX_QUERIES, batch: int = 64, seed: int = 0, out_dir=None,
                   resume: bool = False, progress: bool = True) -> CampaignResult:
    """Search each seed for an input on which the white-box PyTorch ``models`` disagree.

    ``models``: two or more :class:`~mlflow_di.models.torch_model.TorchModel`; the first is the
    original (records compare it with the first model that deviates from it). Budgets, ``batch``,
    ``out_dir``/``resume`` and the result are those of :func:`~mlflow_di.fuzz.campaign.run_campaign`;
    the result also has ``neuron_coverage`` (see the module docstring).
    """
    if len(models) < 2:
        raise UserError(_TWO_MODELS)
    return explore(Campaign(models[0], list(models[1:]), strategy or DeepXplore(), seeds=seeds, timeout=timeout,
                            max_queries=max_queries, batch=batch, seed=seed,
                            out_dirs=None if out_dir is None else [out_dir], resume=resume, progress=progress))[0]


def explore(campaign: Campaign) -> list[CampaignResult]:
    """The DeepXplore runner: one joint campaign over ``campaign``'s original and every other model (all
    white-box), in its one folder (what :func:`run_deepxplore` describes)."""
    from mlflow_di.models.torch_model import TorchModel

    strategy, seeds = campaign.strategy, campaign.seeds
    models = [campaign.original, *campaign.compressed]
    if not isinstance(strategy, DeepXplore):
        raise UserError(f"the deepxplore runner runs the DeepXplore strategy, not {getattr(strategy, 'name', strategy)!r}")
    if not campaign.compressed:
        raise UserError(_TWO_MODELS)
    not_torch = [getattr(m, "name", type(m).__name__) for m in models if not isinstance(m, TorchModel)]
    if not_torch:
        raise UserError(f"DeepXplore needs white-box PyTorch models; '{not_torch[0]}' is not one")
    out_dir = (campaign.out_dirs or [None])[0]
    check_arguments(seeds, campaign.timeout, campaign.max_queries, campaign.batch,
                    None if out_dir is None else [out_dir], campaign.resume)
    strategy.check_image_shape(seeds.image_shape)
    for model in models:
        model.preprocessing.check_images(seeds.images[:1])
        refuse_raw_resize(model, seeds, "DeepXplore")
    config = campaign_config(strategy, seeds, campaign.timeout, max_queries=campaign.max_queries, seed=campaign.seed,
                             original=models[0].name, compressed=",".join(model.name for model in models[1:]),
                             progress=campaign.progress)
    with CampaignSession(config, out_dir, campaign.resume) as session:
        runner = _Runner(models, seeds, strategy, config, session, campaign.batch)
        runner.check_seeds(campaign.progress)
        session.start()
        try:
            runner.run(campaign.progress)
        finally:
            session.close()
        result = session.result(runner.records, runner.images, runner.stats)
        batches = [seeds.images[start:start + SEED_BATCH] for start in range(0, len(seeds), SEED_BATCH)]
        batches += [result.triggers[start:start + SEED_BATCH] for start in range(0, len(result.triggers), SEED_BATCH)]
        result.neuron_coverage = coverage_by_role(models, neuron_coverage(models, batches, strategy.threshold))
        session.save(result)
    return [result]


def roles(count: int) -> list[str]:
    """What the models are called in metrics: original, compressed (or compressed_1, compressed_2, ...)."""
    return ["original"] + (["compressed"] if count == 2 else [f"compressed_{k}" for k in range(1, count)])


def coverage_by_role(models: list, counts: list[tuple[int, int]]) -> dict[str, float]:
    """NC per model (``original``, ``compressed``...) and ``all``: covered over all models' neurons together."""
    values = {role: covered / total if total else 0.0 for role, (covered, total) in zip(roles(len(models)), counts)}
    total = sum(t for _, t in counts)
    values["all"] = sum(c for c, _ in counts) / total if total else 0.0
    return values


class _Runner:
    """The lockstep loop: ``batch`` seeds at a time, one batched forward/backward per model and iteration."""

    def __init__(self, models, seeds: ImageSet, strategy: DeepXplore, config: CampaignConfig,
                 session: CampaignSession, batch: int):
        self.models, self.seeds, self.strategy, self.config = models, seeds, strategy, config
        self.session, self.done, self.batch = session, session.done, batch
        self.classifiers = [model.classifier() for model in models]
        self.gradient_models = [float64_copy(model) for model in models]
        self.layers = [neuron_layers(model) for model in models]
        climbs = len(strategy.climbs(0, len(models)))
        self.budget = int(strategy.iterations) * climbs if config.max_queries is None \
            else min(int(strategy.iterations) * climbs, config.max_queries)
        self.records: dict[int, SeedRecord] = {}
        self.images: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.stats = RunStats()
        self.pending: list[tuple[int, list[np.ndarray]]] = []
        self._bar = None

    def _predict(self, images: np.ndarray) -> list[np.ndarray]:
        return [predict_checked(c, images, "original" if k == 0 else "compressed")
                for k, c in enumerate(self.classifiers)]

    def check_seeds(self, progress: bool) -> None:
        """Every model's probabilities on the seeds still to run; the agreeing ones wait to be searched."""
        todo = np.asarray([i for i in range(len(self.seeds)) if i not in self.done], np.int64)
        self.todo: list[tuple[int, list[np.ndarray]]] = []
        agreeing = 0
        for start in tqdm(range(0, len(todo), SEED_BATCH), desc="seed predictions", unit="batch",
                          disable=not progress, leave=False):
            indices = todo[start:start + SEED_BATCH]
            probabilities = self._predict(self.seeds.images[indices])
            classes = {p.shape[1] for p in probabilities}
            if len(classes) > 1:
                counts = ", ".join(str(p.shape[1]) for p in probabilities)
                raise UserError(f"the models disagree on the number of classes ({counts}); "
                                "compare versions of one model")
            for row, index in enumerate(indices):
                mine = [p[row] for p in probabilities]
                agreeing += len({int(p.argmax()) for p in mine}) == 1
                self.todo.append((int(index), mine))
        fuzzed_before = any(not r.already_deviating for r in self.done.values())
        if self.todo and not agreeing and not fuzzed_before:
            raise UserError(f"the models already disagree on all {len(self.todo)} seeds, so there is nothing to fuzz; "
                            "check that they are versions of one model and use the right preprocessing")

    def run(self, progress: bool) -> None:
        self._bar = BudgetProgress(len(self.seeds), len(self.done), f"fuzz {self.strategy.name}", disable=not progress)
        self._bar.triggers = sum(r.success for r in self.done.values())
        for index, probabilities in self.todo:
            labels = [int(p.argmax()) for p in probabilities]
            if len(set(labels)) > 1:
                self._save(self._record_deviating(index, probabilities), None)
            else:
                self.pending.append((index, probabilities))
        self.pending.reverse()  # popped from the end: seeds start in index order
        active: list[_Seed] = []
        try:
            while self.pending or active:
                while self.pending and len(active) < self.batch:
                    active.append(self._start(*self.pending.pop()))
                active = self._step(active)
                self._bar.show(sum(budget_share(s.queries, s.seconds, self.budget, self.config.timeout) for s in active))
        except KeyboardInterrupt:
            self._bar.write(f"interrupted: {len(self.records)} seeds finished in this run are saved; "
                            f"{len(active) + len(self.pending)} not finished")
        finally:
            self._bar.close()

    def _start(self, index: int, probabilities: list[np.ndarray]) -> _Seed:
        rng = np.random.default_rng([self.config.seed, index])
        image = np.asarray(self.seeds.images[index])
        return _Seed(index=index, image=image, rng=rng, label=int(probabilities[0].argmax()),
                     seed_probabilities=probabilities, offset=np.zeros(image.shape, np.float64), current=image.copy(),
                     climbs=self.strategy.climbs(draw_index(rng, len(self.models)), len(self.models)))

    def _step(self, active: list[_Seed]) -> list[_Seed]:
        """One iteration: evaluate every active seed's current image (and its gradient), record the
        triggers and spent budgets, step the others. Returns the seeds still searching."""
        import torch

        began = process_seconds()
        pixels = torch.from_numpy(np.stack([s.current for s in active]).astype(np.float64)).requires_grad_(True)
        passes = [forward(model, pixels, layers) for model, layers in zip(self.gradient_models, self.layers)]
        labels = np.stack([output.detach().argmax(dim=1).numpy() for output, _ in passes], axis=1)  # (B, models)
        finished: dict[int, tuple[Stop, list[np.ndarray] | None]] = {}
        for b, s in enumerate(active):
            if s.climb_steps:  # the seed itself (at the start of each climb) is not a query
                s.queries += 1
        candidates = [b for b, s in enumerate(active) if s.climb_steps and len(set(labels[b].tolist())) > 1]
        for b in candidates:  # confirmed by the black boxes on the uint8 image: every recorded trigger is real
            # (one image per call: the recorded probabilities are then the same whatever the batch)
            mine = [p[0] for p in self._predict(active[b].current[None])]
            if len({int(p.argmax()) for p in mine}) > 1:
                finished[b] = (Stop.TRIGGER, mine)
        for b, s in enumerate(active):
            if b not in finished and s.queries >= self.budget:
                finished[b] = (Stop.MAX_QUERIES, None)
        restarted = set()
        for b, s in enumerate(active):
            if b not in finished and s.climb_steps >= self.strategy.iterations:
                # budget left (checked above): back to the seed for the next (step, target), whose
                # gradient the next iteration takes
                self._next_climb(s)
                restarted.add(b)
        going = [b for b in range(len(active)) if b not in finished and b not in restarted]
        for b in going:
            s = active[b]
            if s.neurons is None:  # the seed's first pass: pick a neuron the seed does not cover, per model
                s.neurons = [self._pick_neuron(s.rng, [out[b:b + 1].detach() for out in activations])
                             for _, activations in passes]
        if going:
            value = objective([output[going] for output, _ in passes],
                              [[out[going] for out in activations] for _, activations in passes],
                              [active[b].label for b in going], targets=[active[b].target for b in going],
                              neurons=[active[b].neurons for b in going], lambda1=self.strategy.lambda1,
                              lambda2=self.strategy.lambda2)
            value.sum().backward()
            gradients = pixels.grad.numpy()
            for b in going:
                self._move(active[b], gradients[b])
        share = (process_seconds() - began) / len(active)
        self.stats.calls += 1
        self.stats.inputs += len(active)
        self.stats.model_seconds += share * len(active)
        still = []
        for b, s in enumerate(active):
            s.seconds += share
            if b not in finished and s.seconds >= self.config.timeout:
                finished[b] = (Stop.TIMEOUT, None)
            if b in finished:
                self._save(self._record(s, *finished[b]), s.current if finished[b][0] is Stop.TRIGGER else None,
                           s.image)
            else:
                still.append(s)
        return still

    def _pick_neuron(self, rng: np.random.Generator, activations: list) -> tuple[int, int]:
        """(layer position, neuron) of a neuron the seed leaves uncovered, at random (any one if all are covered)."""
        covered = covered_neurons(activations, self.strategy.threshold)[0]
        sizes = [int(out.shape[1]) for out in activations]
        candidates = np.flatnonzero(~covered)
        flat = int(candidates[draw_index(rng, len(candidates))]) if len(candidates) else draw_index(rng, covered.size)
        layer = int(np.searchsorted(np.cumsum(sizes), flat, side="right"))
        return layer, flat - int(sum(sizes[:layer]))

    @staticmethod
    def _next_climb(s: _Seed) -> None:
        """Start the seed's next climb from the seed itself (its neurons stay those picked at the start)."""
        s.climb += 1
        s.offset = np.zeros(s.image.shape, np.float64)
        s.current = s.image.copy()
        s.climb_steps = 0
        s.operators = []  # a trigger's operators are those of the climb that found it

    def _move(self, s: _Seed, gradient: np.ndarray) -> None:
        """One constrained gradient step of the seed's image, with the current climb's step size."""
        gradient = gradient / (np.sqrt(np.mean(np.square(gradient))) + NORMALIZE_EPSILON)
        direction, names = self.strategy.constrain(gradient, s.rng)
        s.offset = s.offset + float(s.step) * direction
        seed = s.image.astype(np.float64)
        if self.strategy.constraint != "lighting":  # lighting keeps one uniform offset (see the module docstring)
            s.offset = np.clip(seed + s.offset, 0, 255) - seed
        image = np.clip(seed + np.floor(s.offset + 0.5), 0, 255).astype(np.uint8)
        s.changed_steps += bool((image != s.current).any())
        s.current = image
        s.operators.extend(names)
        s.steps += 1
        s.climb_steps += 1

    def _record(self, s: _Seed, stop: Stop, probabilities: list[np.ndarray] | None) -> SeedRecord:
        seed_labels = [int(p.argmax()) for p in s.seed_probabilities]
        record = SeedRecord(
            index=s.index, label=int(self.seeds.labels[s.index]), success=stop is Stop.TRIGGER, stop=stop,
            queries=s.queries, seconds=s.seconds, seed_labels=(seed_labels[0], seed_labels[1]),
            seed_probabilities=top1(s.seed_probabilities[0], s.seed_probabilities[1]),
            operators=list(s.operators) if stop is Stop.TRIGGER else [],
            operator_counts={self.strategy.constraint: [s.steps, s.changed_steps]},
            model_labels=seed_labels, target_model=s.target)
        if probabilities is not None:
            labels = [int(p.argmax()) for p in probabilities]
            other = _first_deviating(labels)
            record.trigger_labels = (labels[0], labels[other])
            record.trigger_probabilities = top1(probabilities[0], probabilities[other])
            record.trigger_distances = distances(s.current, s.image)
            record.model_labels = labels
        return record

    def _record_deviating(self, index: int, probabilities: list[np.ndarray]) -> SeedRecord:
        labels = [int(p.argmax()) for p in probabilities]
        other = _first_deviating(labels)
        return SeedRecord(index=index, label=int(self.seeds.labels[index]), success=False,
                          stop=Stop.ALREADY_DEVIATING, queries=0, seconds=0.0,
                          seed_labels=(labels[0], labels[other]),
                          seed_probabilities=top1(probabilities[0], probabilities[other]), model_labels=labels)

    def _save(self, record: SeedRecord, trigger: np.ndarray | None, seed_image: np.ndarray | None = None) -> None:
        self.records[record.index] = record
        if seed_image is None:
            seed_image = np.asarray(self.seeds.images[record.index])
        if trigger is not None:
            self.images[record.index] = (trigger, seed_image)
        self.session.append(record, trigger, seed_image)
        self._bar.finish(budget_share(record.queries, record.seconds, self.budget, self.config.timeout),
                         trigger is not None)


def _first_deviating(labels: list[int]) -> int:
    """The first model whose label differs from the original's (model 1 when all agree)."""
    return next((k for k in range(1, len(labels)) if labels[k] != labels[0]), 1)
