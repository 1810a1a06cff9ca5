"""DFlare (Tian et al., TOSEM): Algorithm 1 for one seed, its fitness, and its ablations.

    x_max <- x_s; op <- random operator
    repeat until the seed's time or query budget is spent:
        x <- op(x_max)                              one query: x through both models
        if top1(f(x)) != top1(g(x)): return x      a triggering input
        if H(x) >= H(x_max): x_max <- x; op's success count += 1
        op <- select(op)                            Metropolis-Hastings over ranked operators

The paper's fitness (``fitness='gap'``, strategy ``dflare-paper``): H(x) = D(x) / delta + O(x).
D is the gap between the two models' top-1 probabilities, O is 1 when the pair of probability
vectors is unlike every pair seen for this seed so far. The seed's pair is the first one
remembered, and every accepted x_max's pair is in the memory by the time a mutant is compared
with it, so O(x_max) = 0 and the test reads D(x) / delta + O(x) >= D(x_max) / delta (as in the
reference, whose comparison never uses the incumbent's novelty).

mlflow-di's default fitness (``fitness='margin'``, strategy ``dflare``): H(x) = -m_f(x) + O(x),
m_f = log p_f(top-1) - log p_f(top-2), the original model's logit gap between its two most
likely classes (:func:`~mlflow_di.fuzz.fitness.log_margin`). Why: on LeNet-5 vs its 8-bit
TFLite version both models are near-certain on most seeds, the quantized output moves in steps
of 1/256, and D sits at ~0 with no slope to climb; three quarters of the paper-rule acceptances
are ties, and the search drifts until a mutation happens to cross the boundary. The log margin
keeps shrinking as x approaches the original's decision boundary even while both top-1
probabilities read 1.0 (the runner-up's probability still rises from 1e-12 to 1e-8), and the
compressed model, a slightly shifted copy of that boundary, disagrees right next to it. It
needs about a ninth of the paper fitness's queries per trigger (a fifth of the
released reference code's) there, with 100% success
(benchmarks/RESULTS.md, bench_fuzz_search; tuned on MNIST test seeds [0:500], held out on
[5000:5500]). ``fitness='margin-both'`` uses the smaller of both models' margins.

Switches (each an ablation; off in the default unless said): ``novelty=False`` drops O
(``dflare-d``, ``dflare-paper-d``); ``selection='uniform'`` picks operators at random
(``dflare-r``, ``dflare-paper-r``); ``acceptance='strict'`` keeps x only when H(x) > H(x_max)
(ties and unchanged images are rejected); ``restart=N`` puts x_max back to the seed after N
rejections in a row; ``escalate=K`` applies the chosen operator 1 + s // K times in a row
(at most :data:`MAX_STRENGTH`), s = rejections since the last acceptance (plateau-aware
strength). On the LeNet-5 pair none of the last three changed the queries measurably (the
margin search has almost no plateaus), so the default leaves them off.

Differences from the reference code are deliberate and follow the paper: acceptance is
H(x) >= H(x_max) (``acceptance='reference'`` accepts a mutant when | |D(x)| - |D(x_max)| | > 1e-3,
a *drop* included, or when it is novel, and starts from D(x_max) = 0), the selector uses the true
rank of the previous operator (``reference_bug=True`` gives the reference's k_prev = -1), and the
noise operators saturate instead of wrapping around (see :mod:`.mutations`). The novelty memory
matches the reference: every queried, non-triggering mutant is tested and the novel ones are
remembered (TensorFuzz's corpus), starting from the seed's pair. The paper's DFlare_D row does
not come from dropping O: the reference code's ``attack_mode c`` never accepts a mutant (its
best fitness starts at -1 and only |D| > 1 would beat it); that variant lives in the
reproduction harness only (benchmarks/reproduce/dflare_variants.py, ``dflare-d-bug``).

Why ``dflare-paper-d`` behaves like ``dflare-paper`` on the LeNet-5 / 8-bit TFLite pair: with
H = D / delta + O and delta = 1e-3, a novel state is worth only a 1e-3 gap, and a squared
distance of 0.5 between 20-value probability pairs is rarely reached. An instrumented run on the
first 200 MNIST test seeds saw 248 novel states in 51,090 queries; novelty decided 16 of the
8,812 acceptances, and three quarters of all acceptances were ties (D unchanged at 1e-6). The
reference code instead keeps every novel mutant, whatever its D.

So that a seed's search does not depend on which other seeds share its batched model call
(float results differ in the last bits between batch compositions), gaps are compared at
1e-6 resolution, log margins at 1e-4, and an unchanged mutant is accepted (``paper``) or
rejected (``strict``) without consulting its re-computed floats.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Sequence

import numpy as np

from mlflow_di.errors import UserError
from mlflow_di.fuzz.fitness import (DEFAULT_DELTA, DEFAULT_NOVELTY_THRESHOLD, LIST_SCORING_MAX_CLASSES, NoveltyMemory,
                                    RowFacts, dflare_fitness, gap_of, labels_differ, log_margin_list, margin_of,
                                    probability_pair, row_facts, top2_row)
from mlflow_di.fuzz.device_fitness import DeviceNoveltyMemory, step_facts
from mlflow_di.fuzz.mutations import (Operator, default_operators, mutate_into, operator_names, operators_device,
                                      same_image, two_step)
from mlflow_di.fuzz.population import Mutation, on_host
from mlflow_di.fuzz.realism import Constraint
from mlflow_di.fuzz.search import Search
from mlflow_di.fuzz.selection import shared_selector

SELECTIONS = ("metropolis-hastings", "uniform")
#: ``paper``: x replaces x_max when H(x) >= H(x_max). ``reference``: as yqtianust/DFlare's code, when
#: |D(x) - D(x_max)| > delta (a drop counts too) or when x is novel, starting from D(x_max) = 0.
#: ``strict``: x replaces x_max only when H(x) > H(x_max) (an unchanged image never does), so ties
#: neither move the search nor count as an operator's success.
ACCEPTANCES = ("paper", "reference", "strict")
#: ``gap``: the paper's D(x) = |p_f(top) - p_g(top)|. ``margin``: how close x is to the original model's
#: decision boundary, minus its log-probability margin (see :func:`~mlflow_di.fuzz.fitness.log_margin`),
#: which keeps a signal when both top-1 probabilities round to 1.
#: ``margin-both``: the smaller of both models' log margins (the compressed model's probabilities
#: floored at 1/512, below an 8-bit output's resolution).
FITNESSES = ("gap", "margin", "margin-both")
#: Most times one mutation operator is applied in a row under ``escalate`` (plateau-aware strength).
MAX_STRENGTH = 8
#: Floor of the compressed model's probabilities under ``fitness='margin-both'``.
COMPRESSED_FLOOR = 1.0 / 512
#: Mutants of x_max drawn in a row outside the constraint before the search gives up on the seed
#: (it then stops with ``Stop.CONSTRAINED``: no mutant within the constraint could be found). Small
#: enough that one proposal stays short (an SSIM on a 224x224 RGB image is costly, so it is checked
#: after the cheap L-inf test), since the per-seed timeout is only checked between proposals.
MAX_REDRAWS = 100


class Outcome(enum.Enum):
    """What one query of Algorithm 1 did with the current candidate."""

    TRIGGER = "trigger"
    ACCEPTED = "accepted"
    REJECTED = "rejected"


@dataclasses.dataclass(frozen=True)
class DFlare:
    """The DFlare strategy and its ablations, as settings of the same loop.

    The defaults are mlflow-di's ``dflare`` (log-margin fitness); ``fitness='gap'`` is the paper's
    DFlare. ``novelty=False`` drops the novelty term (a working DFlare_D), ``selection='uniform'``
    is DFlare_R; ``reference_bug=True`` makes Metropolis-Hastings ignore the previous operator as
    the reference code does, ``acceptance='reference'`` keeps mutants by the reference code's rule
    (see :data:`ACCEPTANCES`); ``restart`` and ``escalate`` handle plateaus (module docstring).
    """

    name: str = "dflare"
    novelty: bool = True
    selection: str = "metropolis-hastings"
    reference_bug: bool = False
    acceptance: str = "paper"
    delta: float = DEFAULT_DELTA
    novelty_threshold: float = DEFAULT_NOVELTY_THRESHOLD
    operators: tuple[Operator, ...] = dataclasses.field(default_factory=default_operators)
    #: what H scores besides novelty (see :data:`FITNESSES`)
    fitness: str = "margin"
    #: after this many queries in a row without an accepted mutant, x_max goes back to the seed (0: never)
    restart: int = 0
    #: plateau-aware strength: the operator is applied 1 + s // escalate times in a row (at most
    #: :data:`MAX_STRENGTH`), s = queries since the last accepted mutant (0: always once)
    escalate: int = 0
    #: a mutant outside it (``--max-linf``, ``--min-ssim``) is rejected before it is queried
    constraint: Constraint | None = None

    def __post_init__(self):
        if self.selection not in SELECTIONS:
            raise UserError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.acceptance not in ACCEPTANCES:
            raise UserError(f"acceptance must be one of {ACCEPTANCES}, got {self.acceptance!r}")
        if self.fitness not in FITNESSES:
            raise UserError(f"fitness must be one of {FITNESSES}, got {self.fitness!r}")
        if self.restart < 0 or self.escalate < 0:
            raise UserError(f"restart and escalate must be >= 0, got {self.restart} and {self.escalate}")
        operator_names(self.operators)

    def options(self) -> dict:
        """The settings that change results, for the campaign's config record."""
        options = {"novelty": self.novelty, "selection": self.selection, "reference_bug": self.reference_bug,
                   "acceptance": self.acceptance, "delta": self.delta, "novelty_threshold": self.novelty_threshold,
                   "operators": [repr(op) for op in self.operators], "fitness": self.fitness,
                   "restart": self.restart, "escalate": self.escalate}
        if self.constraint is not None:  # nothing without a bound: older campaigns resume
            options.update(self.constraint.options())
        return options

    def start(self, seed_image: np.ndarray, p_original: np.ndarray, p_compressed: np.ndarray,
              rng: np.random.Generator) -> "DFlareSearch":
        return DFlareSearch(self, seed_image, p_original, p_compressed, rng)


@dataclasses.dataclass
class _Pending:
    """A proposed input awaiting its result. ``state``: the generator's state before the
    speculative operator choice that followed it (None: no choice made yet, it is the last);
    ``unchanged``: it equals x_max, so proposing it already counted its (certain) acceptance."""

    candidate: np.ndarray | None
    operator: int
    state: dict | None = None
    unchanged: bool = False
    #: the runner's mutation when the search only drew it (see plan): its row and whether it is x_max unchanged
    mutation: Mutation | None = None


class DFlareSearch(Search):
    """One seed's DFlare loop.

    Algorithm 1 takes one input per iteration. When the campaign asks for more (``depth`` > 1,
    so that a seed searched nearly alone still fills a batched model call), the search
    *speculates*: it proposes the next inputs as if each earlier one will be rejected (the
    common case: x_max, and hence the next mutation, then stay the same). :meth:`observe`
    replays the results in order; at the first accepted or triggering input the rest are
    dropped unseen, their operator selections are undone and the generator is rewound to where
    the one-at-a-time loop would be. Queries, decisions and results are therefore identical
    for every ``depth``; only the dropped model evaluations are extra work. Under the paper's
    acceptance an unchanged mutant is known to be accepted (``_accepts_unchanged``), so
    speculation assumes that for it.

    Under a :class:`~mlflow_di.fuzz.realism.Constraint`, a mutant outside it is rejected before
    it is queried: its operator counts as selected and not accepted, the next operator is chosen,
    and x_max is mutated again (``constraint_rejections`` counts these). After
    :data:`MAX_REDRAWS` such rejections in a row the search is ``exhausted``. The search then
    proposes one input per call (no speculation), which keeps every decision exact.

    Given the runner's rows (``propose(out=)``), an unconstrained search writes its mutants there:
    its pending candidates are views of the runner's batch until :meth:`observe`, and what it keeps
    past that (x_max, a trigger) it copies. Under a constraint it returns its own arrays.

    In a population (the lockstep, one input per search and step), the search only draws its next
    mutation (:meth:`plan`); the runner makes the step's mutants one operator at a time
    (:mod:`~mlflow_di.fuzz.population`) and hands the step's rows to :meth:`observe_all`, which scores
    them together and lets the searches that go on choose their next operators together. Each decision
    is the one :meth:`observe` would make, with the same draws, so records do not depend on the path;
    a subclass that changes how one result is observed must change :meth:`observe_all` alike (a
    subclass that changes ``_keeps``, like the reproduction harness's, changes both).
    """

    def __init__(self, strategy: DFlare, seed_image: np.ndarray, p_original: np.ndarray,
                 p_compressed: np.ndarray, rng: np.random.Generator):
        super().__init__(operator_names(strategy.operators))
        self._operators: Sequence[Operator] = strategy.operators
        self._delta = strategy.delta
        self._reference_acceptance = strategy.acceptance == "reference"
        self._margin = strategy.fitness != "gap"
        self._both = strategy.fitness == "margin-both"
        #: whether the score reads the compressed model's probabilities beyond its top-1 label
        self._reads_compressed = not self._margin or self._both
        self._strict = strategy.acceptance == "strict"
        self._restart = strategy.restart
        self._escalate = strategy.escalate
        self._stall = 0  # queries since the last accepted mutant
        self._seed = seed_image
        # Whether a mutant equal to x_max is accepted without looking at the models' outputs: true
        # for H(x) >= H(x_max); under the reference rule it changes |D| by ~0, is not novel, is rejected.
        self._accepts_unchanged = strategy.acceptance == "paper"
        self._rejects_unchanged = self._strict
        self._rng = rng
        count = len(self._operators)
        self._selector = shared_selector(strategy.selection == "uniform", count, strategy.reference_bug)
        #: where the operators make their mutants (a torch device), when they all run on the same one
        self._device = operators_device(self._operators)
        memory_type = NoveltyMemory if self._device is None else functools.partial(DeviceNoveltyMemory, device=self._device)
        self._memory = memory_type(strategy.novelty_threshold) if strategy.novelty else None
        self.best = seed_image
        seed_score = self._score(p_original, p_compressed)[0]  # also remembers the seed's own pair
        # the reference code starts from StateFitnessValue(False, 0); the paper from the seed's own D
        self._seed_score = 0.0 if self._reference_acceptance and not self._margin else seed_score
        self.best_gap = self._seed_score
        self._snapshot: tuple | None = None  # the state before a speculative proposal (see propose)
        self._borrowed = False  # whether the pending candidates are rows of the runner's batch (see propose)
        self._accepted_chain: list[int] = []
        self._operator = self._selector.first(rng)
        self._candidate: np.ndarray | None = None
        self._pending: list[_Pending] = []  # proposed inputs awaiting their results
        self._mutation: Mutation | None = None  # the candidate's, when the runner made it (see plan)
        self._constraint = strategy.constraint if strategy.constraint is not None and strategy.constraint.active else None
        #: per operator, whether plan may draw its mutation for the runner to make (never under a constraint)
        self._drawn_first = [self._constraint is None and two_step(op) for op in self._operators]

    def _score(self, p_original: np.ndarray, p_compressed: np.ndarray,
               facts: RowFacts | None = None) -> tuple[float, bool]:
        """The score (D(x), or minus the original's log margin), and O(x) (remembering the pair when it is novel).

        The same numbers as :func:`top1_gap`, :func:`log_margin` and :func:`probability_pair`: on plain
        Python floats for short rows, where numpy's per-call cost dominates, and for rows holding a NaN;
        for long ones (see :data:`~mlflow_di.fuzz.fitness.LIST_SCORING_MAX_CLASSES`) from their two
        largest values: the step's :class:`~mlflow_di.fuzz.fitness.RowFacts` when given, else a partition
        of the row. Flooring the compressed model's values (``margin-both``) keeps its two largest the
        largest, so they are floored after the partition.
        """
        if facts is None:
            p_original, p_compressed = np.asarray(p_original).ravel(), np.asarray(p_compressed).ravel()
            if p_original.size > LIST_SCORING_MAX_CLASSES and not np.isnan(p_original.sum() + p_compressed.sum()):
                facts = RowFacts(False, False, top2_row(p_original),
                                 top2_row(p_compressed) if self._reads_compressed else None)
        if facts is None or facts.original_top2 is None or facts.has_nan:
            return self._score_lists(p_original.tolist(), p_compressed.tolist())
        novel = self._novel(p_original, p_compressed, facts)
        if self._margin:
            margin = margin_of(facts.original_top2)
            if self._both:
                margin = min(margin, margin_of([max(v, COMPRESSED_FLOOR) for v in facts.compressed_top2]))
            return -margin, novel
        return gap_of(facts.original_top2[1], facts.compressed_top2[1]), novel

    def _novel(self, p_original: np.ndarray, p_compressed: np.ndarray, facts: RowFacts) -> bool:
        """O(x): whether the pair is novel (then remembered), from the step's facts when they hold it."""
        if self._memory is None:
            return False
        if facts.novel is None:
            return self._memory.observe(probability_pair(p_original, p_compressed))
        if facts.novel:
            self._memory.remember(facts.pair)
        return facts.novel

    def _score_lists(self, original: list[float], compressed: list[float]) -> tuple[float, bool]:
        """:meth:`_score` on plain Python floats (short rows, and any row holding a NaN)."""
        novel = self._memory.observe(np.array(original + compressed)) if self._memory is not None else False
        if self._margin:
            margin = log_margin_list(original)
            if self._both:
                margin = min(margin, log_margin_list([max(v, COMPRESSED_FLOOR) for v in compressed]))
            return -margin, novel
        return gap_of(max(original), max(compressed)), novel

    @property
    def best_score(self) -> float:
        """The incumbent's score: D(x_max) under ``fitness='gap'``, minus its log margin under ``'margin'``."""
        return self.best_gap

    def _mutate(self, operator: int, into: np.ndarray | None = None) -> np.ndarray:
        """x_max mutated by one operator, applied 1 + stall // escalate times in a row under ``escalate``;
        the last application writes into ``into`` when given (a row of the campaign's batch)."""
        strength = 1 if not self._escalate else min(MAX_STRENGTH, 1 + self._stall // self._escalate)
        op = self._operators[operator]
        candidate = self.best
        for _ in range(strength - 1):
            candidate = op(candidate, self._rng)
        return op(candidate, self._rng) if into is None else mutate_into(op, candidate, self._rng, into)

    def _owned(self, candidate: np.ndarray) -> np.ndarray:
        """``candidate`` as the search may hold it past :meth:`observe`: a copy when it is a row of the
        runner's batch, which the runner reuses."""
        return candidate.copy() if self._borrowed else candidate

    def _after(self, accepted: bool) -> None:
        """Plateau bookkeeping after a non-triggering query: the stall count, and a restart from
        the seed after ``restart`` rejections in a row. Uses no randomness, so speculative
        proposals can apply it and :meth:`observe` can replay it."""
        if accepted:
            self._stall = 0
            return
        self._stall += 1
        if self._restart and self._stall >= self._restart:
            self.best, self.best_gap = self._seed, self._seed_score
            self._stall = 0

    def _constrained_mutant(self) -> np.ndarray | None:
        """A mutant of x_max within the constraint, choosing the next operator after each one
        outside it (not queried); None after :data:`MAX_REDRAWS` in a row (the search is exhausted)."""
        for _ in range(MAX_REDRAWS):
            candidate = self._mutate(self._operator)
            self.stats.selected[self._operator] += 1
            if self._constraint.allows(candidate, self._seed):
                return candidate
            self.constraint_rejections += 1
            self._operator = self._selector.next(self._operator, self.stats, self._rng)
        self.exhausted = True
        return None

    def plan(self) -> Mutation | None:
        """Algorithm 1's next input drawn but not made (the runner makes it into a row of its batch, with
        the other searches' mutations of the same operator), or None where :meth:`propose` must make it:
        under a constraint (checked on the mutant), an operator applied more than once in a row
        (``escalate``), or an operator that is not :func:`~mlflow_di.fuzz.mutations.two_step`."""
        if not self._drawn_first[self._operator] or (self._escalate and self._stall >= self._escalate):
            return None
        op = self._operators[self._operator]
        self._borrowed = True
        self.stats.selected[self._operator] += 1
        mutation = Mutation(op, self.best, op.draw(self._seed.shape, self._rng))
        self._pending = [_Pending(None, self._operator, mutation=mutation)]
        return mutation

    def propose(self, limit: int | None = None, depth: int = 1, out: np.ndarray | None = None) -> np.ndarray:
        depth = max(1, depth if limit is None else min(depth, limit))
        self.best, self._mutation = on_host(self.best), None  # after population steps x_max may be on the device
        # Unconstrained mutants are written into the runner's rows (``out``): they are views of its batch
        # until observe, and whatever outlives it (x_max, a trigger) is copied there (_owned).
        self._borrowed = out is not None and self._constraint is None
        if self._constraint is not None:  # one input per call: see the class docstring
            candidate = self._constrained_mutant()
            if candidate is None:
                self._pending = []
                return self._seed[None][:0]
            self._pending = [_Pending(candidate, self._operator)]
            return candidate[None]
        if depth == 1:  # Algorithm 1 as written: one input, the choice after it waits for its result
            candidate = self._mutate(self._operator, out[0] if self._borrowed else None)
            self.stats.selected[self._operator] += 1
            self._pending = [_Pending(candidate, self._operator)]
            return out[:1] if self._borrowed else candidate[None]
        self._pending = []
        self._snapshot = (self.best, self.best_gap, self._stall)
        for row in range(depth):
            operator = self._operator
            candidate = self._mutate(operator, out[row] if self._borrowed else None)
            self.stats.selected[operator] += 1
            entry = _Pending(candidate, operator)
            self._pending.append(entry)
            if len(self._pending) == depth:
                break
            # Assume the outcome the search can foresee: an unchanged image is accepted whatever the
            # models say (see _decide), anything else is assumed rejected.
            entry.unchanged = self._accepts_unchanged and same_image(candidate, self.best)
            if entry.unchanged:
                self.stats.accepted[operator] += 1
            self._after(accepted=entry.unchanged)  # undone by observe, which replays the real outcomes
            entry.state = self._rng.bit_generator.state
            self._operator = self._selector.next(operator, self.stats, self._rng)
        if self._borrowed:
            return out[:len(self._pending)]
        return np.stack([entry.candidate for entry in self._pending])

    def observe(self, p_original: np.ndarray, p_compressed: np.ndarray) -> None:
        pending, self._pending = self._pending, []
        if not pending:  # exhausted under the constraint: nothing was proposed
            return
        if len(pending) == 1:  # Algorithm 1 as written (the common case): one result, then the next choice
            if self._observe_one(pending[0], p_original[0], p_compressed[0]) is not Outcome.TRIGGER:
                self._operator = self._selector.next(self._operator, self.stats, self._rng)
            return
        # back to the state before the speculation: the replay below redoes what each real outcome does
        self.best, self.best_gap, self._stall = self._snapshot
        for row, entry in enumerate(pending):
            self._candidate, self._operator = entry.candidate, entry.operator
            if entry.unchanged:  # accepted when proposed (its counter too); the choice after it is made
                self.queries += 1
                self._accepted_chain.append(entry.operator)
                self._after(accepted=True)
                continue
            outcome = self._decide(p_original[row], p_compressed[row])
            if outcome is Outcome.REJECTED and entry.state is not None:
                continue  # the speculative choice after it was made from exactly this state
            for dropped in pending[row + 1:]:  # unseen: undo what proposing them assumed
                self.stats.selected[dropped.operator] -= 1
                if dropped.unchanged:
                    self.stats.accepted[dropped.operator] -= 1
            if outcome is not Outcome.TRIGGER:
                if entry.state is not None:
                    self._rng.bit_generator.state = entry.state
                self._operator = self._selector.next(entry.operator, self.stats, self._rng)
            return

    @classmethod
    def observe_all(cls, searches: list["DFlareSearch"], spans: list[tuple[int, int]], p_original: np.ndarray,
                    p_compressed: np.ndarray) -> None:
        """:meth:`observe` for a step's searches, the one-input ones scored together: their rows' facts
        (:func:`~mlflow_di.fuzz.fitness.row_facts`) in one pass, each decision as one at a time, and the
        next operators of those that go on chosen together (:meth:`~.selection.MetropolisHastingsSelector.next_many`).
        Each search draws from its own generator in the same order as alone, so records do not change."""
        one_row = [count == 1 and len(search._pending) == 1 for search, (_, count) in zip(searches, spans)]
        if searches[0]._device is None:
            facts = row_facts(p_original, p_compressed, searches[0]._reads_compressed)
        else:  # where the mutants were made, with each row's novelty to its search's memory
            memories = [None] * len(p_original)
            for search, (first, _), single in zip(searches, spans, one_row):
                memories[first] = search._memory if single else None
            facts = step_facts(p_original, p_compressed, searches[0]._device, memories)
        going_on: dict[int, list[DFlareSearch]] = {}  # by selector: the searches of one strategy share its kind
        for search, (first, count), single in zip(searches, spans, one_row):
            if not single:  # speculation's replay, or nothing proposed
                search.observe(p_original[first:first + count], p_compressed[first:first + count])
                continue
            pending, search._pending = search._pending[0], []
            if search._observe_one(pending, p_original[first], p_compressed[first], facts[first]) is not Outcome.TRIGGER:
                going_on.setdefault(id(search._selector), []).append(search)
        for group in going_on.values():
            chosen = group[0]._selector.next_many([s._operator for s in group], [s.stats for s in group],
                                                  [s._rng for s in group])
            for search, operator in zip(group, chosen):
                search._operator = operator

    def _observe_one(self, entry: _Pending, p_original: np.ndarray, p_compressed: np.ndarray,
                     facts: RowFacts | None = None) -> Outcome:
        """Algorithm 1's query of one pending input, without the choice of the next operator."""
        self._operator, self._mutation = entry.operator, entry.mutation
        if entry.mutation is None:
            self._candidate, unchanged = entry.candidate, None
        else:
            self._candidate, unchanged = entry.mutation.row, entry.mutation.unchanged
        return self._decide(p_original, p_compressed, unchanged, facts)

    def _decide(self, p_original: np.ndarray, p_compressed: np.ndarray, unchanged: bool | None = None,
                facts: RowFacts | None = None) -> Outcome:
        """One query of Algorithm 1 for the current candidate (``unchanged``: whether it is x_max, when known;
        ``facts``: its rows' facts, when computed with the step's)."""
        self.queries += 1
        if (self._accepts_unchanged or self._rejects_unchanged) and (
                same_image(self._candidate, self.best) if unchanged is None else unchanged):
            if self._accepts_unchanged:
                # An unchanged image (e.g. a 1x1 blur) behaves exactly like x_max: no trigger, H(x) = H(x_max),
                # so it is accepted. Deciding this from the image rather than from re-computed floats keeps
                # the decision independent of the batch the input was computed in (floats can differ in
                # the last bits between batch compositions, which would flip this tie).
                self._accept(self.best_gap, unchanged=True)
                self._after(accepted=True)
                return Outcome.ACCEPTED
            self._after(accepted=False)  # strict: as x_max, no trigger, H(x) = H(x_max), so not strictly better
            return Outcome.REJECTED
        if labels_differ(p_original, p_compressed) if facts is None else facts.differ:
            chain = [self.operator_names[i] for i in self._accepted_chain + [self._operator]]
            # a mutant left on the device (the models took the batch there) has no host row: brought back
            candidate = self._mutation.image() if self._candidate is None else self._owned(self._candidate)
            self._record_trigger(candidate, p_original, p_compressed, chain)
            return Outcome.TRIGGER
        gap, novel = self._score(p_original, p_compressed, facts)
        if self._keeps(gap, novel):
            self._accept(gap)
            self._after(accepted=True)
            return Outcome.ACCEPTED
        self._after(accepted=False)
        return Outcome.REJECTED

    def _keeps(self, gap: float, novel: bool) -> bool:
        """Whether a non-triggering mutant with top-1 gap ``gap`` replaces x_max (see :data:`ACCEPTANCES`)."""
        if self._reference_acceptance:
            return abs(gap - self.best_gap) > self._delta or novel
        if self._strict:
            scale = 1.0 if self._margin else 1.0 / self._delta
            return gap * scale + novel > self.best_gap * scale
        if self._margin:  # H = -margin + O: a novel state is worth one nat
            return gap + novel >= self.best_gap
        return dflare_fitness(gap, novel, self._delta) >= dflare_fitness(self.best_gap, False, self._delta)

    def _accept(self, gap: float, unchanged: bool = False) -> None:
        """The candidate becomes x_max (an ``unchanged`` one equals it already); its operator scores a success."""
        if not unchanged:
            self.best = self._owned(self._candidate) if self._mutation is None else self._mutation.kept()
        self.best_gap = gap
        self.stats.accepted[self._operator] += 1
        self._accepted_chain.append(self._operator)
