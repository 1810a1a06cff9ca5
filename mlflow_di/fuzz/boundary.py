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
   find different seeds. The seeds are walked one at a time; the fallbacks of the seeds a chunk's
   walks left then run together, one batched call of each model per step, each search seeing only
   its own answers (:meth:`_Walker.fallbacks`; benchmarks/RESULTS.md, bench_boundary_fallback). A
   trigger's ``operators`` name the phase that found it: ``walk``, ``restart`` or ``dflare:<mutation>``.

``queries`` counts images sent to the compressed model; ``original_passes`` (per seed) counts the
original's forward passes plus backward passes, always reported apart. ``timeout`` is CPU
seconds per seed (:mod:`mlflow_di.fuzz.charge`): during its walks, all threads of the process (seeds walk one
after another, in an order shuffled by the campaign's seed); during the fallback, its own search steps and its
share of each batched call. Measured on the DFlare LeNet pairs: benchmarks/RESULTS.md, bench_boundary.
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
    """One export's campaign: its session, the seeds walked one at a time, the result saved."""
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
    """Every seed the session has not finished: walked one at a time, then the fallbacks of those the walks left,
    together (up to :data:`FALLBACK_BATCH`); ({index: record}, {index: (trigger, seed)}) of this run. Ctrl-C ends
    the walk: the seeds finished so far are kept."""
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
            pending = []
            for index in chunk:  # walked in the shuffled order
                row = int(np.searchsorted(indices, index))
                wall = time.perf_counter()  # the estimate of the time left is wall-clock; the budget is not
                outcome = walker.search(int(index), int(seeds.labels[index]), batch[row], p_original[row],
                                        p_compressed[row])
                wall = time.perf_counter() - wall
                if isinstance(outcome, _Pending):
                    pending.append((outcome, batch[row], wall))
                else:
                    finished(*outcome, batch[row], wall)
            for first in range(0, len(pending), FALLBACK_BATCH):  # their fallbacks together, in that order
                group = pending[first:first + FALLBACK_BATCH]
                wall = time.perf_counter()
                outcomes = walker.fallbacks([waiting for waiting, _, _ in group])
                share = (time.perf_counter() - wall) / len(group)
                for (_, image, walked), outcome in zip(group, outcomes):
                    finished(*outcome, image, walked + share)
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
    """The walks and the bisection at each crossing, one seed at a time (:meth:`search`); then the fallbacks of
    the seeds the walks left, together (:meth:`fallbacks`)."""

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

    def _labels(self, images: np.ndarray, seed) -> np.ndarray:
        import torch

        with torch.no_grad():
            seed.passes += 1
            return self._logits(torch.from_numpy(np.asarray(images, np.float64))).argmax(dim=1).numpy()

    # one seed ------------------------------------------------------------------------------------
    def search(self, index: int, label: int, image: np.ndarray, p_original: np.ndarray,
               p_compressed: np.ndarray) -> tuple[SeedRecord, np.ndarray | None] | _Pending:
        """The walks of one seed: its record and trigger (None without) when they finish it, else, when the
        fallback is on and budget is left, the seed paused for :meth:`fallbacks`."""
        seed = _SeedState(index, label, image, p_original, p_compressed, process_seconds())
        c = int(p_original.argmax())
        if int(p_compressed.argmax()) != c:
            return seed.record(Stop.ALREADY_DEVIATING), None
        budget = _Budget(self.strategy.constraint, image)
        sizes = self.strategy.step_sizes if self._ssim_walk(budget) else \
            (self.strategy.linf_step_sizes or (self._linf_step(budget),))
        for size in sizes:
            stop = self._walk(seed, budget, c, size)
            if stop is not None:
                return seed.finish(stop, self)
        rng = np.random.default_rng([self.config.seed, index, 1])
        for restart in range(self.strategy.restarts):
            stop = self._walk(seed, budget, c, sizes[restart % len(sizes)], start=self._random_start(budget, rng),
                              phase="restart")
            if stop is not None:
                return seed.finish(stop, self)
        if self.strategy.fallback and not self._out_of_queries(seed) and not self._out_of_time(seed):
            seed.pause()  # its clock stops here: the fallback charges it its own work
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
        """One targeted walk from the seed (or from ``start``, an image inside the budget); a Stop when the
        seed is finished (trigger or budget spent). ``phase`` names the walk in the trigger's operators."""
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
            pixels = torch.from_numpy(np.stack([current[k] for k in walking]).astype(np.float64)).requires_grad_(True)
            logits = self._logits(pixels)
            margin = logits[:, c] - logits[torch.arange(len(walking)), torch.as_tensor([targets[k] for k in walking])]
            gradient, = torch.autograd.grad(margin.sum(), pixels)
            seed.passes += 2
            stall.observe(walking, margin.detach().numpy())
            with torch.no_grad():
                moved = self._step(pixels.detach(), gradient, seed_tensor, size, budget)
            proposals = budget.project(moved)
            labels = self._labels(proposals, seed)
            for i, k in enumerate(walking):
                if labels[i] != c:
                    stop = self._crossing(seed, budget, c, current[k], proposals[i], phase)
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
        """The original's label changed between ``before`` (c) and ``after``: bisect (original only) to
        two close images inside the budget, then query the compressed model on both."""
        for _ in range(self.strategy.bisections):
            middle = _uint8((before.astype(np.float64) + after) / 2)
            if np.array_equal(middle, before) or np.array_equal(middle, after) or not budget.allows(middle):
                break
            if self._labels(middle[None], seed)[0] == c:
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
        """The last phase of the seeds :meth:`search` left paused: DFlare under each seed's budget, from the seed,
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
class _Pending:
    """A seed whose walks ended without a trigger, waiting for the fallback: its state and budget."""

    seed: "_SeedState"
    budget: _Budget


class _Stall:
    """Which targets of a walk still move toward the boundary: a target whose margin has not reached a
    new low for ``patience`` steps is dropped (None: none is). On the LeNet-5 pair under SSIM >= 0.9,
    the seeds whose walk never crosses spent 720 of the original's passes each pressed against the
    budget before the fallback started."""

    def __init__(self, count: int, patience: int | None):
        self.best = np.full(count, np.inf)
        self.since = np.zeros(count, dtype=int)
        self.patience = patience

    def walking(self) -> list[int]:
        return [k for k in range(len(self.best)) if self.patience is None or self.since[k] < self.patience]

    def observe(self, walking: list[int], margins: np.ndarray) -> None:
        for k, value in zip(walking, margins):
            if value < self.best[k]:
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
    started: float
    queries: int = 0
    passes: int = 0
    trigger: np.ndarray | None = None
    trigger_probabilities: tuple | None = None
    operators: list = dataclasses.field(default_factory=list)
    counts: dict = dataclasses.field(default_factory=lambda: {"walk": [0, 0], "restart": [0, 0], "dflare": [0, 0]})
    #: the seconds charged so far once paused (the fallback charges each seed its own work), None while it runs alone
    charged: float | None = None

    def pause(self) -> None:
        """Stop the seed's clock: from here on it is charged explicitly (``charged``)."""
        self.charged = process_seconds() - self.started

    def seconds(self) -> float:
        """CPU seconds charged to this seed: the process's since it started while it runs alone, then what the
        fallback charges it."""
        return self.charged if self.charged is not None else process_seconds() - self.started

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
