"""The ``boundary`` strategy: realistic deviations in few queries to the compressed model.

The owner of a registry version also owns the original model, so its gradients are free; only the
compressed export is a black box. A compressed model is a slightly shifted copy of the original's
decision boundaries, so the two part right next to the original's boundary. For each seed (both
models say label c) the search:

1. **Walks to the original's boundary inside the realism budget** (white-box, no query). Targeted
   toward each of the original's ``targets`` most likely other classes j at once (one batched
   forward/backward pass per step), it lowers the margin z_c - z_j of the original's pre-softmax
   outputs:

   - under ``max_linf`` (an L-inf ball around the seed): signed-gradient steps of
     ``max(1, max_linf / 8)`` levels, clipped back into the ball (projected gradient descent);
   - under ``min_ssim``: steps along the gradient weighted by what each pixel costs in SSIM, then
     RMS-normalised. SSIM sits at its maximum at the seed, so its first-order change is zero and a
     change of d levels at pixel p costs about w_p d**2 (:func:`~mlflow_di.fuzz.realism.ssim_pixel_cost`:
     w_p is small inside strokes and edges, where the local variance masks a change, and large on
     flat background). Dividing the gradient by w_p ** ``ssim_weighting`` (1/2 by default) spends
     the budget where SSIM tolerates change. Where SSIM to the seed nears the bound, the part of
     the step that would lower SSIM is removed (SSIM's own gradient, from a differentiable copy of
     the SSIM the budget bounds, :func:`~mlflow_di.fuzz.realism.budget_ssim`) and a step that went below is
     pulled back; the rounded uint8 image is then scaled toward the seed until it meets every
     bound, so every image the search uses is inside the budget. Why weighted: with the plain
     gradient (``ssim_weighting=0``) the walk pressed against the bound without crossing on 11 of
     40 seeds of MNIST test [9700:9740] (LeNet-5 vs its int8 TFLite), leaving them to the DFlare
     fallback (1,100 to 1,900 queries per trigger); weighted, it crossed on all 40, 2.5 queries
     per trigger (benchmarks/RESULTS.md, bench_boundary --slices, on slices nobody tuned on).

2. **Queries the compressed model only where the two can part.** When a step changes the
   original's label, a bisection with the original alone (free) narrows the step to two adjacent
   images inside the budget, one on each side of the original's boundary. The compressed model is
   queried on those two: unless its own boundary falls exactly between them, one of them is a
   trigger (the compressed model flipped earlier or later than the original). Every trigger is
   confirmed with both models' black-box ``predict_proba`` on the uint8 image.

3. Walks again with the next step size in ``step_sizes`` (SSIM; ``linf_step_sizes`` under L-inf
   when set) when a walk ends without one, then ``restarts`` more walks from random points inside
   the budget (1 by default: on the LeNet-5 pair under SSIM >= 0.9 it found one more seed than
   none, at fewer queries per trigger; the benchmark's slow, strong "oracle" uses 8), and finally,
   with the queries left, runs DFlare under the same budget (``fallback``): the walk and DFlare
   find different seeds. Up to :data:`WALK_BATCH` seeds walk together, every step of each in one
   batched pass of the original (:meth:`_Walker.walks`); the fallbacks of the seeds a chunk's walks
   left then run together, one batched call of each model per step, each search seeing only its own
   answers (:meth:`_Walker.fallbacks`; benchmarks/RESULTS.md, bench_boundary_fallback). A trigger's
   ``operators`` name the phase that found it: ``walk``, ``restart`` or ``dflare:<mutation>``.

``queries`` counts images sent to the compressed model; ``original_passes`` (per seed) counts the
original's forward passes plus backward passes (a seed's, whatever it was batched with), always
reported apart. ``timeout`` is CPU seconds per seed (:mod:`mlflow_di.fuzz.charge`): its own steps (all
threads of the process while they run) and its share of each batched call, one row's worth per row it
asked for. Measured on the DFlare LeNet pairs: benchmarks/RESULTS.md, bench_boundary.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.fuzz.charge import process_seconds, search_clock
from mlflow_di.fuzz.contract import DEFAULT_MAX_QUERIES, DEFAULT_TIMEOUT, Campaign
from mlflow_di.fuzz.realism import SSIM_RADIUS, SSIM_WINDOW, Constraint, distances, local_ssim, ssim_pixel_cost
from mlflow_di.fuzz.results import CampaignConfig, CampaignResult, RunStats, SeedRecord, Stop
from mlflow_di.fuzz.seeds import SEED_BATCH, campaign_config, check_arguments, predict_checked, refuse_raw_resize, top1
from mlflow_di.fuzz.session import CampaignSession
from mlflow_di.progress import BudgetProgress, budget_share

#: the margin of the step's SSIM over the bound within which the step keeps off SSIM's downhill side
SSIM_GUARD = 0.02
#: the most seeds whose DFlare fallbacks advance together: one batched call of each model per step, as
#: wide as the lockstep runner's default --batch
FALLBACK_BATCH = 64
#: how much lower than a target's lowest margin so far a new one must be to count as progress, relative to its
#: size: float64 passes differ in the last bits (1e-14 here) with the other rows of their batch
STALL_TOLERANCE = 1e-9
#: the most seeds walked together: each step of each walking seed goes into one batched forward/backward pass
#: of the original (1: one seed at a time, the walk as it was)
WALK_BATCH = 64
#: the most pixel values (rows x H x W x C) one batched pass of the walks holds: large images walk fewer seeds
#: together, down to one (a seed's targets are one pass, as they always were)
WALK_PIXELS = 2 ** 21


@dataclasses.dataclass(frozen=True)
class BoundaryWalk:
    """The boundary strategy's settings (see the module docstring)."""

    constraint: Constraint | None = None
    #: gradient steps per walk
    steps: int = 60
    #: RMS-normalised step sizes in 8-bit levels, one walk each (L-inf walks use max(1, max_linf / 8))
    step_sizes: tuple[float, ...] = (2.0, 6.0, 20.0)
    #: the original's most likely other classes walked toward at once
    targets: int = 9
    #: bisection steps between the images before and after the original's label changes
    bisections: int = 8
    #: DFlare under the same budget with the queries left, after the walks
    fallback: bool = True
    #: walks from random starting points inside the budget, after the walks from the seed
    restarts: int = 1
    #: step sizes in 8-bit levels for walks under max_linf (None: one walk of max(1, max_linf / 8))
    linf_step_sizes: tuple[float, ...] | None = None
    #: a target whose margin (the original's logit of the seed's class minus the target's) has not
    #: fallen for this many steps is walked no further: pressed against the budget, it will not cross
    #: (None: every target walks every step)
    patience: int | None = 10
    #: under min_ssim, the gradient is divided by each pixel's SSIM cost to this power before the
    #: step (0: the plain gradient; see the module docstring)
    ssim_weighting: float = 0.5
    name: str = "boundary"

    def __post_init__(self):
        if not 0 <= self.ssim_weighting <= 2:
            raise UserError(f"the boundary walk's ssim_weighting is an exponent in [0, 2], got {self.ssim_weighting}")
        if self.patience is not None and int(self.patience) < 1:
            raise UserError(f"the boundary walk's patience is at least 1 step (None: off), got {self.patience}")
        if int(self.steps) < 1 or int(self.targets) < 1 or int(self.bisections) < 0 or int(self.restarts) < 0:
            raise UserError("the boundary walk needs at least 1 step and 1 target class, and no negative count")
        if self.linf_step_sizes is not None and (not self.linf_step_sizes or
                                                 any(not size > 0 for size in self.linf_step_sizes)):
            raise UserError(f"the boundary walk's L-inf step sizes must be positive, got {self.linf_step_sizes}")
        if not self.step_sizes or any(not size > 0 for size in self.step_sizes):
            raise UserError(f"the boundary walk's step sizes must be positive, got {self.step_sizes}")

    def options(self) -> dict:
        """The settings as JSON values (what a campaign's config records and ``resume`` compares)."""
        options = {"steps": self.steps, "step_sizes": list(self.step_sizes), "targets": self.targets,
                   "bisections": self.bisections, "fallback": self.fallback}
        if self.restarts:  # recorded unless 0: campaigns saved before restarts existed (0) keep resuming
            options["restarts"] = self.restarts
        if self.linf_step_sizes is not None:
            options["linf_step_sizes"] = list(self.linf_step_sizes)
        if self.patience is not None:
            options["patience"] = self.patience
        if self.ssim_weighting:  # recorded unless 0, the walk of campaigns saved before it existed
            options["ssim_weighting"] = self.ssim_weighting
        if self.constraint is not None:  # nothing without a bound: older campaigns resume
            options.update(self.constraint.options())
        return options


def run_boundary(original, compressed, seeds: ImageSet, strategy: BoundaryWalk | None = None,
                 timeout: float = DEFAULT_TIMEOUT, max_queries: int | None = DEFAULT_MAX_QUERIES, seed: int = 0, out_dir=None,
                 resume: bool = False, progress: bool = True) -> CampaignResult:
    """Search each seed for a trigger inside ``strategy.constraint``, with the original's gradients.

    ``original``: a :class:`~mlflow_di.models.torch_model.TorchModel` (white-box); ``compressed``:
    any classifier with ``predict_proba`` (ONNX, TFLite, PyTorch). Budgets, ``out_dir``/``resume``
    and the result are those of :func:`~mlflow_di.fuzz.campaign.run_campaign`.
    """
    return walk(Campaign(original, [compressed], strategy or BoundaryWalk(), seeds, timeout, max_queries, seed=seed,
                         out_dirs=None if out_dir is None else [out_dir], resume=resume, progress=progress))[0]


def walk(campaign: Campaign) -> list[CampaignResult]:
    """The boundary runner: ``campaign``'s original (white-box) walks each seed against each export, one
    campaign per export (what :func:`run_boundary` describes for one)."""
    if not isinstance(campaign.strategy, BoundaryWalk):
        raise UserError(f"the boundary runner walks with a BoundaryWalk, not {campaign.strategy.name!r}")
    return [_walk_one(campaign, model, folder) for model, folder in zip(campaign.compressed, campaign.folders())]


def _walk_one(campaign: Campaign, compressed, out_dir) -> CampaignResult:
    """One export's campaign: its session, the seeds walked, the result saved."""
    original, seeds, strategy = campaign.original, campaign.seeds, campaign.strategy
    check_arguments(seeds, campaign.timeout, campaign.max_queries, batch=1, out_dirs=None if out_dir is None else [out_dir],
                    resume=campaign.resume, strategy=strategy)
    refuse_raw_resize(original, seeds, "the boundary walk")
    config = campaign_config(strategy, seeds, campaign.timeout, max_queries=campaign.max_queries, seed=campaign.seed,
                             original=original.name, compressed=getattr(compressed, "name", ""),
                             progress=campaign.progress)
    with CampaignSession(config, out_dir, campaign.resume) as session:
        walker = _Walker(original, compressed, strategy, config)
        if len(seeds):
            _answers(walker, np.asarray(seeds.images[:1]))  # models that cannot take the seeds: refused before writing
        session.start()
        records, images = _walk_seeds(walker, session, seeds, campaign.progress)
        result = session.result(records, images, walker.stats)
        session.save(result)
    return result


def _walk_seeds(walker: "_Walker", session: CampaignSession, seeds: ImageSet, progress: bool) -> tuple[dict, dict]:
    """Every seed the session has not finished: walked together (up to :data:`WALK_BATCH` at a time), then the
    fallbacks of those the walks left, together (up to :data:`FALLBACK_BATCH`); ({index: record}, {index: (trigger,
    seed)}) of this run. Ctrl-C ends the walk: the seeds finished so far are kept."""
    config, done = walker.config, session.done
    records: dict[int, SeedRecord] = {}
    images: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    bar = BudgetProgress(len(seeds), len(done), f"fuzz {walker.strategy.name}", disable=not progress, sequential=True)
    bar.triggers = sum(r.success for r in done.values())
    # in a shuffled order (fixed by the campaign's seed; no seed's search depends on it), so that the
    # seeds finished so far are a fair sample for the progress estimate: data sets are often ordered
    # (on MNIST test [9000:9100] the last 50 seeds hold 22 of the 28 fruitless seeds under L-inf 32)
    todo = np.random.default_rng(config.seed).permutation([i for i in range(len(seeds)) if i not in done])

    def finished(record: SeedRecord, trigger, image: np.ndarray, wall: float) -> None:
        records[record.index] = record
        if trigger is not None:
            images[record.index] = (trigger, image)
        session.append(record, trigger, image)
        bar.finish(budget_share(record.queries, record.seconds, config.max_queries, config.timeout),
                   trigger is not None, wall)
        bar.show()

    try:
        for start in range(0, len(todo), SEED_BATCH):
            chunk = todo[start:start + SEED_BATCH].astype(np.int64)
            indices = np.sort(chunk)  # read in index order (a lazy set reads its files in order)
            batch = np.asarray(seeds.images[indices])
            p_original, p_compressed = _answers(walker, batch)
            starts = [_SeedState(int(index), int(seeds.labels[index]), batch[row], p_original[row], p_compressed[row])
                      for index, row in zip(chunk, np.searchsorted(indices, chunk))]
            pending = []
            for seed, outcome in walker.walks(starts):  # started in the shuffled order, finished as they end
                if isinstance(outcome, _Pending):
                    pending.append(outcome)
                else:
                    finished(*outcome, seed.image, seed.wall)
            for first in range(0, len(pending), FALLBACK_BATCH):  # their fallbacks together, in that order
                group = pending[first:first + FALLBACK_BATCH]
                wall = time.perf_counter()
                outcomes = walker.fallbacks(group)
                share = (time.perf_counter() - wall) / len(group)
                for waiting, outcome in zip(group, outcomes):
                    finished(*outcome, waiting.seed.image, waiting.seed.wall + share)
    except KeyboardInterrupt:
        bar.write(f"interrupted: {len(records)} seeds finished in this run are saved; "
                  f"{len(todo) - len(records)} not finished")
    finally:
        bar.close()
    return records, images


def _answers(walker: "_Walker", images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both models' probabilities on ``images``, checked (finite, one row each, as many classes on both sides)."""
    p_original = predict_checked(walker.original_classifier, images, "original")
    p_compressed = predict_checked(walker.compressed, images, "compressed")
    if p_original.shape[1] != p_compressed.shape[1]:
        raise UserError(f"the models disagree on the number of classes ({p_original.shape[1]}, "
                        f"{p_compressed.shape[1]}); compare versions of one model")
    return p_original, p_compressed


class _Budget:
    """Projection of images into the realism budget around one seed (uint8 images in, uint8 out)."""

    def __init__(self, constraint: Constraint | None, seed: np.ndarray):
        self.constraint = constraint if constraint is not None and constraint.active else None
        self.seed = seed
        self.seed_float = seed.astype(np.float64)
        self._weights = {}

    def ssim_weights(self, exponent: float):
        """(1, H, W, C) float64 tensor: each pixel's SSIM cost to the power -``exponent``, computed once."""
        if exponent not in self._weights:
            import torch

            self._weights[exponent] = torch.from_numpy(ssim_pixel_cost(self.seed) ** -exponent)[None]
        return self._weights[exponent]

    def allows(self, image: np.ndarray) -> bool:
        return self.constraint is None or self.constraint.allows(image, self.seed)

    def project(self, images: np.ndarray) -> np.ndarray:
        """Each of the (N, H, W, C) ``images`` (float, any values) as a uint8 image inside the budget:
        clipped to the L-inf ball and 0..255, then scaled toward the seed (bisection on the offset, all
        images at once) until every bound holds."""
        if self.constraint is not None and self.constraint.max_linf is not None:
            bound = self.constraint.max_linf
            images = np.clip(images, self.seed_float - bound, self.seed_float + bound)
        projected = _uint8(images)
        outside = ~self._allows_each(projected)
        if outside.any():
            offset = images[outside] - self.seed_float
            low, high = np.zeros(len(offset)), np.ones(len(offset))
            for _ in range(10):
                middle = (low + high) / 2
                inside = self._allows_each(_uint8(self.seed_float + middle[:, None, None, None] * offset))
                low, high = np.where(inside, middle, low), np.where(inside, high, middle)
            projected[outside] = _uint8(self.seed_float + low[:, None, None, None] * offset)
        return projected

    def _allows_each(self, images: np.ndarray) -> np.ndarray:
        return np.ones(len(images), bool) if self.constraint is None else self.constraint.allows_each(images, self.seed)


def _uint8(image: np.ndarray) -> np.ndarray:
    return np.clip(np.floor(image + 0.5), 0, 255).astype(np.uint8)


class _Walker:
    """The walks and the bisection at each crossing of many seeds together (:meth:`walks`); then the fallbacks of
    the seeds the walks left, together (:meth:`fallbacks`).

    Each seed's walks are a generator (:meth:`_search`) that yields what it asks of the original (a
    :class:`_Gradient` or :class:`_Labels`) and receives the answer; :meth:`walks` sends every waiting seed's
    question through the original in one batched pass. The gradient model is a float64 copy, in which a row's
    answer does not depend on the rest of its batch, so each seed takes the path it takes alone."""

    def __init__(self, original, compressed, strategy: BoundaryWalk, config: CampaignConfig):
        from mlflow_di.fuzz.deepxplore import float64_copy

        self.original, self.compressed, self.strategy, self.config = original, compressed, strategy, config
        self.original_classifier = original.classifier()
        self.gradient_model = float64_copy(original)
        self.stats = RunStats()

    # the original, white-box -------------------------------------------------------------------
    def _logits(self, pixels):
        from mlflow_di.fuzz.deepxplore import forward

        return forward(self.gradient_model, pixels, [])[0]

    def _labels(self, images: np.ndarray, seed):
        """The original's labels of ``images`` (a generator step: the pass is batched with other seeds')."""
        seed.passes += 1
        return (yield _Labels(np.asarray(images)))

    # many seeds together ---------------------------------------------------------------------------
    def walks(self, seeds: list["_SeedState"]):
        """Walk ``seeds``, up to :func:`walk_width` at a time (the next one starts when one ends), each step's
        questions of every walking seed in one batched pass of the original. Yields (seed, outcome) as each
        seed's walks end: its record and trigger (None without), or the seed waiting for :meth:`fallbacks`.
        Each seed is charged the CPU time of its own steps and its share of each pass, one row's worth per
        row it asked for (:mod:`~mlflow_di.fuzz.charge`)."""
        queue = iter(seeds)
        width = walk_width(seeds[0].image.shape, self.strategy.targets) if seeds else 1
        active: list[tuple[_SeedState, object, object]] = []  # (seed, its generator, what to send it: None to start)
        while True:
            while len(active) < width and (seed := next(queue, None)) is not None:
                active.append((seed, self._search(seed), None))
            if not active:
                return
            asking = []
            for seed, walking, answer in active:
                outcome = self._advance(seed, walking, answer)
                if isinstance(outcome, (_Gradient, _Labels)):
                    asking.append((seed, walking, outcome))
                else:
                    yield seed, outcome
            answers = self._answer_all([seed for seed, _, _ in asking], [asked for _, _, asked in asking])
            active = [(seed, walking, answer) for (seed, walking, _), answer in zip(asking, answers)]

    @staticmethod
    def _advance(seed: "_SeedState", walking, answer):
        """One step of a seed's walks: its next question, or its outcome when they end; the step's CPU and wall
        time charged to the seed."""
        started, wall = process_seconds(), time.perf_counter()
        try:
            return walking.send(answer)
        except StopIteration as ended:
            return ended.value
        finally:
            seed.charge(process_seconds() - started, time.perf_counter() - wall)

    def _answer_all(self, seeds: list, questions: list) -> list:
        """Every question through the original: the gradients in one pass, the labels in another."""
        import torch

        answers: list = [None] * len(questions)
        for kind in (_Gradient, _Labels):
            asking = [k for k, question in enumerate(questions) if isinstance(question, kind)]
            if not asking:
                continue
            started, wall = process_seconds(), time.perf_counter()
            sizes = [len(questions[k].pixels) for k in asking]
            pixels = torch.cat([torch.as_tensor(questions[k].pixels, dtype=torch.float64) for k in asking])
            if kind is _Gradient:
                pixels.requires_grad_(True)
                logits = self._logits(pixels)
                classes = torch.as_tensor([questions[k].c for k in asking]).repeat_interleave(torch.as_tensor(sizes))
                targets = torch.as_tensor([t for k in asking for t in questions[k].targets])
                rows = torch.arange(len(pixels))
                margin = logits[rows, classes] - logits[rows, targets]
                gradient, = torch.autograd.grad(margin.sum(), pixels)
                parts = zip(np.split(margin.detach().numpy(), np.cumsum(sizes)[:-1]), gradient.split(sizes))
            else:
                with torch.no_grad():
                    labels = self._logits(pixels).argmax(dim=1).numpy()
                parts = np.split(labels, np.cumsum(sizes)[:-1])
            per_row = (process_seconds() - started) / len(pixels), (time.perf_counter() - wall) / len(pixels)
            for k, size, part in zip(asking, sizes, parts):
                answers[k] = part
                seeds[k].charge(per_row[0] * size, per_row[1] * size)
        return answers

    # one seed ------------------------------------------------------------------------------------
    def _search(self, seed: "_SeedState"):
        """The walks of one seed, as a generator of its questions to the original (see the class): returns its
        record and trigger (None without) when they finish it, else, when the fallback is on and budget is
        left, the seed waiting for :meth:`fallbacks`."""
        c = int(seed.p_original.argmax())
        if int(seed.p_compressed.argmax()) != c:
            return seed.record(Stop.ALREADY_DEVIATING), None
        budget = _Budget(self.strategy.constraint, seed.image)
        sizes = self.strategy.step_sizes if self._ssim_walk(budget) else \
            (self.strategy.linf_step_sizes or (self._linf_step(budget),))
        for size in sizes:
            stop = yield from self._walk(seed, budget, c, size)
            if stop is not None:
                return seed.finish(stop, self)
        rng = np.random.default_rng([self.config.seed, seed.index, 1])
        for restart in range(self.strategy.restarts):
            stop = yield from self._walk(seed, budget, c, sizes[restart % len(sizes)],
                                         start=self._random_start(budget, rng), phase="restart")
            if stop is not None:
                return seed.finish(stop, self)
        if self.strategy.fallback and not self._out_of_queries(seed) and not self._out_of_time(seed):
            return _Pending(seed, budget)
        return self._unfinished(seed)

    def _unfinished(self, seed) -> tuple[SeedRecord, None]:
        """The record of a seed whose searches ended without a trigger: which budget ran out, or none did."""
        return seed.finish(Stop.MAX_QUERIES if self._out_of_queries(seed) else
                           Stop.TIMEOUT if self._out_of_time(seed) else Stop.CONSTRAINED, self)

    def _ssim_walk(self, budget: _Budget) -> bool:
        return budget.constraint is None or budget.constraint.max_linf is None

    def _random_start(self, budget: _Budget, rng: np.random.Generator) -> np.ndarray:
        """A random image inside the budget: uniform noise filling the L-inf ball, or (SSIM) Gaussian
        noise of 16 levels scaled toward the seed until it meets the bound."""
        if not self._ssim_walk(budget):
            bound = budget.constraint.max_linf
            return budget.project((budget.seed_float + rng.uniform(-bound, bound, budget.seed.shape))[None])[0]
        return budget.project((budget.seed_float + rng.normal(0.0, 16.0, budget.seed.shape))[None])[0]

    def _linf_step(self, budget: _Budget) -> float:
        return max(1.0, budget.constraint.max_linf / 8)

    def _out_of_queries(self, seed) -> bool:
        return self.config.max_queries is not None and seed.queries >= self.config.max_queries

    def _out_of_time(self, seed) -> bool:
        return seed.seconds() >= self.config.timeout

    def _walk(self, seed, budget: _Budget, c: int, size: float, start: np.ndarray | None = None,
              phase: str = "walk") -> Stop | None:
        """One targeted walk from the seed (or from ``start``, an image inside the budget), a generator of its
        questions; a Stop when the seed is finished (trigger or budget spent). ``phase`` names the walk in the
        trigger's operators."""
        import torch

        targets = _targets(seed.p_original, c, self.strategy.targets)
        seed_tensor = torch.from_numpy(budget.seed_float)[None]
        current = [(budget.seed if start is None else start).copy() for _ in targets]
        stall = _Stall(len(targets), self.strategy.patience)
        for _ in range(self.strategy.steps):
            if self._out_of_time(seed) or self._out_of_queries(seed):
                return Stop.MAX_QUERIES if self._out_of_queries(seed) else Stop.TIMEOUT
            walking = stall.walking()
            if not walking:
                return None  # every target pressed against the budget: the walk cannot cross
            pixels = torch.from_numpy(np.stack([current[k] for k in walking]).astype(np.float64))
            margin, gradient = yield _Gradient(pixels, c, [targets[k] for k in walking])
            seed.passes += 2
            stall.observe(walking, margin)
            with torch.no_grad():
                moved = self._step(pixels, gradient, seed_tensor, size, budget)
            proposals = budget.project(moved)
            labels = yield from self._labels(proposals, seed)
            for i, k in enumerate(walking):
                if labels[i] != c:
                    stop = yield from self._crossing(seed, budget, c, current[k], proposals[i], phase)
                    if stop is not None:
                        return stop
                current[k] = proposals[i]
        return None

    def _step(self, pixels, gradient, seed_tensor, size: float, budget: _Budget) -> np.ndarray:
        """Every target's next (float) image: a signed step in an L-inf budget, else an RMS-normalised
        step kept off SSIM's downhill side near the bound."""
        import torch

        if not self._ssim_walk(budget):
            return (pixels - size * gradient.sign()).numpy()
        direction = -gradient
        bound = budget.constraint.min_ssim if budget.constraint is not None else None
        if self.strategy.ssim_weighting and bound is not None:  # the weights are SSIM's: only under its bound
            direction = direction * budget.ssim_weights(self.strategy.ssim_weighting)
            # a pixel at 0 or 255 cannot move further that way: its share would be clipped away
            direction = direction.masked_fill(((pixels >= 255) & (direction > 0)) | ((pixels <= 0) & (direction < 0)), 0.0)
        rms = direction.pow(2).mean(dim=(1, 2, 3), keepdim=True).sqrt() + 1e-12
        step = direction / rms * size
        if bound is not None:
            with torch.enable_grad():
                probe = pixels.clone().requires_grad_(True)
                similarity = differentiable_ssim(probe, seed_tensor)
                uphill, = torch.autograd.grad(similarity.sum(), probe)
            similarity = similarity.detach().view(-1, 1, 1, 1)
            norm = (uphill * uphill).sum(dim=(1, 2, 3), keepdim=True) + 1e-20
            along = (step * uphill).sum(dim=(1, 2, 3), keepdim=True)
            near = (similarity < bound + SSIM_GUARD) & (along < 0)
            step = torch.where(near, step - along / norm * uphill, step)
            step = step + (bound + SSIM_GUARD / 4 - similarity).clamp_min(0) / norm * uphill
        return (pixels + step).numpy()

    def _crossing(self, seed, budget: _Budget, c: int, before: np.ndarray, after: np.ndarray,
                  phase: str) -> Stop | None:
        """The original's label changed between ``before`` (c) and ``after``: bisect (original only; a generator
        of its questions) to two close images inside the budget, then query the compressed model on both."""
        for _ in range(self.strategy.bisections):
            middle = _uint8((before.astype(np.float64) + after) / 2)
            if np.array_equal(middle, before) or np.array_equal(middle, after) or not budget.allows(middle):
                break
            if (yield from self._labels(middle[None], seed))[0] == c:
                before = middle
            else:
                after = middle
        for candidate in (before, after):
            if self._out_of_queries(seed):
                return Stop.MAX_QUERIES
            if self._query(seed, candidate, phase):
                return Stop.TRIGGER
        return None

    def _query(self, seed, image: np.ndarray, how: str) -> bool:
        """Both models' black-box answers on ``image`` (one query to the compressed model); a trigger
        when their labels differ."""
        p_compressed = predict_checked(self.compressed, image[None], "compressed")[0]
        p_original = predict_checked(self.original_classifier, image[None], "original")[0]
        seed.queries += 1
        seed.passes += 1
        seed.counts[how][0] += 1
        if int(p_original.argmax()) != int(p_compressed.argmax()):
            seed.trigger, seed.trigger_probabilities = image.copy(), (p_original, p_compressed)
            seed.counts[how][1] += 1
            seed.operators.append(how)
            return True
        return False

    def fallbacks(self, pending: list[_Pending]) -> list[tuple[SeedRecord, np.ndarray | None]]:
        """The last phase of the seeds :meth:`walks` left waiting: DFlare under each seed's budget, from the seed,
        with the queries and time each has left, the seeds' searches advanced together (one batched call of each
        model per step). Each search sees only its own answers and has its own generator, so it queries what it
        would alone, given a model whose answer for an image does not depend on the rest of its batch (ONNX
        Runtime's int8-dynamic sees the other seeds' inputs, as in the lockstep runner). A seed is charged the CPU
        time of its own search steps and its share of each call, one row's worth per input
        (:mod:`~mlflow_di.fuzz.charge`), so its safety net means what it did alone."""
        from mlflow_di.fuzz.dflare import DFlare

        searches = []
        for waiting in pending:
            seed, started = waiting.seed, search_clock()
            searches.append(DFlare(constraint=waiting.budget.constraint).start(
                seed.image, seed.p_original, seed.p_compressed, np.random.default_rng([self.config.seed, seed.index])))
            seed.charged += search_clock() - started
        active = list(range(len(pending)))
        while active:
            asking, proposals = [], []
            for k in active:
                seed, search = pending[k].seed, searches[k]
                if search.found or search.exhausted or self._out_of_time(seed) or self._out_of_queries(seed):
                    continue
                started = search_clock()
                proposed = search.propose(limit=1)
                seed.charged += search_clock() - started
                if len(proposed):
                    asking.append(k)
                    proposals.append(proposed)
            if asking:
                self._observe_all([pending[k].seed for k in asking], [searches[k] for k in asking], proposals)
            active = asking
        return [self._after_fallback(waiting.seed, search) for waiting, search in zip(pending, searches)]

    def _observe_all(self, seeds: list, searches: list, proposals: list) -> None:
        """Every search's proposals through both models in one call each; each search observes its own rows."""
        inputs = np.concatenate(proposals)
        started = process_seconds()
        p_original = predict_checked(self.original_classifier, inputs, "original")
        p_compressed = predict_checked(self.compressed, inputs, "compressed")
        per_input = (process_seconds() - started) / len(inputs)
        row = 0
        for seed, search, proposed in zip(seeds, searches, proposals):
            rows = slice(row, row + len(proposed))
            started, before = search_clock(), search.queries
            search.observe(p_original[rows], p_compressed[rows])
            used = max(search.queries - before, 1)
            seed.charged += search_clock() - started + per_input * len(proposed)
            seed.queries += used
            seed.passes += used
            seed.counts["dflare"][0] += used
            row += len(proposed)

    def _after_fallback(self, seed, search) -> tuple[SeedRecord, np.ndarray | None]:
        if search.found:
            seed.trigger = search.trigger.copy()
            seed.trigger_probabilities = search.trigger_probabilities
            seed.counts["dflare"][1] += 1
            seed.operators.extend(f"dflare:{name}" for name in search.trigger_operators)
            return seed.finish(Stop.TRIGGER, self)
        return self._unfinished(seed)


@dataclasses.dataclass(frozen=True)
class _Gradient:
    """A seed's question: the margin z_c - z_target of the original at each row of ``pixels`` (float64, (k, H, W,
    C)) toward that row's target, and the margin's gradient; answered (margins (k,), gradient (k, H, W, C))."""

    pixels: object
    c: int
    targets: list


@dataclasses.dataclass(frozen=True)
class _Labels:
    """A seed's question: the original's label of each image of ``pixels`` (k, H, W, C); answered (k,) ints."""

    pixels: np.ndarray


def walk_width(shape: tuple, targets: int) -> int:
    """How many seeds of images of ``shape`` (H, W, C) walk together: :data:`WALK_BATCH`, fewer where their
    targets' rows would pass :data:`WALK_PIXELS`, at least one."""
    return max(1, min(WALK_BATCH, WALK_PIXELS // max(1, int(np.prod(shape)) * targets)))


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A seed whose walks ended without a trigger, waiting for the fallback: its state and budget."""

    seed: "_SeedState"
    budget: _Budget


class _Stall:
    """Which targets of a walk still move toward the boundary: a target whose margin has not reached a
    new low for ``patience`` steps is dropped (None: none is). On the LeNet-5 pair under SSIM >= 0.9,
    the seeds whose walk never crosses spent 720 of the original's passes each pressed against the
    budget before the fallback started. A new low must beat the last by more than rounding
    (:data:`STALL_TOLERANCE` of its size): a walk pressed against the budget revisits the same images, whose
    margins then differ only in the last bits, and those move with the batch the pass ran in."""

    def __init__(self, count: int, patience: int | None):
        self.best = np.full(count, np.inf)
        self.since = np.zeros(count, dtype=int)
        self.patience = patience

    def walking(self) -> list[int]:
        return [k for k in range(len(self.best)) if self.patience is None or self.since[k] < self.patience]

    def observe(self, walking: list[int], margins: np.ndarray) -> None:
        for k, value in zip(walking, margins):
            if value < self.best[k] - STALL_TOLERANCE * max(1.0, abs(value)):
                self.best[k], self.since[k] = value, 0
            else:
                self.since[k] += 1


def _targets(p_original: np.ndarray, c: int, count: int) -> list[int]:
    """The original's ``count`` most likely classes other than ``c``, most likely first."""
    order = [int(k) for k in np.argsort(-np.asarray(p_original), kind="stable") if int(k) != c]
    return order[:count]


@dataclasses.dataclass
class _SeedState:
    index: int
    label: int
    image: np.ndarray
    p_original: np.ndarray
    p_compressed: np.ndarray
    queries: int = 0
    passes: int = 0
    trigger: np.ndarray | None = None
    trigger_probabilities: tuple | None = None
    operators: list = dataclasses.field(default_factory=list)
    counts: dict = dataclasses.field(default_factory=lambda: {"walk": [0, 0], "restart": [0, 0], "dflare": [0, 0]})
    #: CPU seconds charged so far: its own steps and its share of each batched call (:mod:`~mlflow_di.fuzz.charge`)
    charged: float = 0.0
    #: wall seconds charged the same way (the progress bar's estimate of the time left)
    wall: float = 0.0

    def charge(self, seconds: float, wall: float) -> None:
        self.charged += seconds
        self.wall += wall

    def seconds(self) -> float:
        """CPU seconds charged to this seed."""
        return self.charged

    def record(self, stop: Stop) -> SeedRecord:
        record = SeedRecord(
            index=self.index, label=self.label, success=stop is Stop.TRIGGER, stop=stop, queries=self.queries,
            seconds=self.seconds(),
            seed_labels=(int(self.p_original.argmax()), int(self.p_compressed.argmax())),
            seed_probabilities=top1(self.p_original, self.p_compressed),
            operators=list(self.operators) if stop is Stop.TRIGGER else [],
            operator_counts={name: list(counts) for name, counts in self.counts.items() if counts[0]},
            original_passes=self.passes)
        if stop is Stop.TRIGGER:
            record.trigger_labels = (int(self.trigger_probabilities[0].argmax()),
                                     int(self.trigger_probabilities[1].argmax()))
            record.trigger_probabilities = top1(*self.trigger_probabilities)
            record.trigger_distances = distances(self.trigger, self.image)
        return record

    def finish(self, stop: Stop, walker: "_Walker") -> tuple[SeedRecord, np.ndarray | None]:
        # the seed's time is in its record; RunStats' model/search split is the lockstep runner's, not measured here
        walker.stats.inputs += self.queries
        return self.record(stop), (self.trigger if stop is Stop.TRIGGER else None)


def differentiable_ssim(images, seed):
    """The SSIM ``--min-ssim`` bounds (:func:`~mlflow_di.fuzz.realism.budget_ssim`: the lower of the
    paper's and the whole-image SSIM) of each float64 (B, H, W, C) image to the (1, H, W, C) seed, as
    a torch tensor (B,) with gradients: the window, constants, mirrored edges and averaging of
    :mod:`~mlflow_di.fuzz.realism`."""
    import torch
    import torch.nn.functional as F

    kernel = torch.from_numpy(SSIM_WINDOW).to(images.dtype)
    batch, height, width, channels = images.shape

    def mirror(size):  # indices of scipy's "reflect" (the edge pixel repeated), SSIM_RADIUS wide
        return torch.cat([torch.arange(SSIM_RADIUS - 1, -1, -1), torch.arange(size),
                          torch.arange(size - 1, size - 1 - SSIM_RADIUS, -1)])

    rows, columns = mirror(height), mirror(width)

    def local_mean(values):  # (B*C, 1, H, W) -> Gaussian-weighted means centred on every pixel
        values = F.conv2d(values.index_select(2, rows), kernel.view(1, 1, -1, 1))
        return F.conv2d(values.index_select(3, columns), kernel.view(1, 1, 1, -1))

    a = images.permute(0, 3, 1, 2).reshape(batch * channels, 1, height, width)
    b = seed.permute(0, 3, 1, 2).expand(batch, channels, height, width).reshape(batch * channels, 1, height, width)
    maps = local_ssim(a, b, local_mean).reshape(batch, channels, height, width)
    paper = maps[:, :, SSIM_RADIUS:-SSIM_RADIUS, SSIM_RADIUS:-SSIM_RADIUS].reshape(batch, -1).mean(dim=1)
    return torch.minimum(paper, maps.reshape(batch, -1).mean(dim=1))
