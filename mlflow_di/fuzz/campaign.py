"""Run a differential fuzzing campaign: many seeds, two black-box models, one strategy.

Lockstep: up to ``batch`` seeds are searched at once. Each iteration asks every active search
for its next inputs, sends all of them through each model in one batched ``predict_proba``
call, and gives every search its own rows back. Each seed has its own generator,
``np.random.default_rng([seed, seed_index])``, so its queries, decisions and result are the
same as when it runs alone (``batch=1``) with the same campaign seed, given a model whose
output for an image does not depend on the rest of the batch.

Budgets: a seed's budget is work, ``max_queries`` queries to the compressed model, so a seeded
campaign writes the same records on any machine under any load. Time is only a safety net,
``timeout`` CPU seconds per seed (:mod:`mlflow_di.fuzz.charge`, never wall-clock): a seed that
reaches it is recorded as stopped at ``timeout`` (the campaign is then INCOMPLETE, and ``resume``
searches it again, with any ``timeout``). A seed is charged its own mutation/bookkeeping time plus
its share of each batched model call, in proportion to the inputs it contributed (when several
campaigns share the original, an input is charged the original's cost per distinct image, what it
would cost alone), so a seed gets the same compute budget whether it runs alone or with 63 others,
and the seeds' times add up to the campaign's time (with overlap to more: a shift's model time runs
beside the other shift's search time).

Speculation: once fewer than ``batch`` seeds are left, each search may propose several inputs
per call (``depth``, up to :data:`MAX_SPECULATION`), so that the last, slowest seeds still fill
a batched call instead of paying a model call's fixed cost per query. A search uses only the
inputs its algorithm would have queried one at a time (see :class:`~mlflow_di.fuzz.dflare.DFlareSearch`);
results and query counts do not change.

Overlap: a GPU computes a batch while the host waits, then the host mutates and scores the next
batch while the GPU waits, so a query costs the host's work *plus* the models'. With ``overlap``
the seeds form two shifts of up to ``batch`` seeds per campaign; while one shift's inputs go
through the models (in a background thread, which PyTorch's and ONNX Runtime's calls let run
beside Python), the other shift's searches observe their last answer and propose their next
inputs, so a query costs about the larger of the two. While fewer than twice ``batch`` seeds are
left, each shift holds half of them. The models' thread computes on CUDA streams
of its own, so the mutations and scoring the searches run on a GPU do not wait behind its
forward passes. The searches never see a model call of another shift, so records stay the same
(as with ``batch``, a model whose output for an image depends on the rest of its batch, such as
ONNX Runtime's int8-dynamic, sees other batches); a seed is charged its shift's model time as before.

Queries: one query is one input through both models; the seed's own check is not counted, nor
are speculative inputs a search dropped unused (they count in ``RunStats.inputs``).
Seeds on which the models already disagree are recorded apart and not searched.
"""
from __future__ import annotations

import contextlib

import numpy as np

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.fuzz.contract import Access, Campaign, SearchStrategy
from mlflow_di.fuzz.distributed import searches_share_the_models_gpu
from mlflow_di.fuzz.fitness import labels_differ
from mlflow_di.fuzz.lockstep import Lane, Lockstep
from mlflow_di.fuzz.results import CampaignConfig, CampaignResult
from mlflow_di.fuzz.seeds import SEED_BATCH, check_arguments, model_name, predict_checked, seed_fingerprint
from mlflow_di.fuzz.session import CampaignSession
from mlflow_di.fuzz.strategies import declaration_of, make_strategy
from mlflow_di.progress import progress_bar as tqdm


def run_campaign(original, compressed, seeds: ImageSet, strategy="dflare", out_dir=None, **settings) -> CampaignResult:
    """Search each seed for an input on which ``original`` and ``compressed`` disagree.

    ``original``/``compressed``: black boxes with ``predict_proba(uint8 NHWC) -> (N, C)``.
    ``strategy``: a name of :data:`~mlflow_di.fuzz.strategies.STRATEGIES` ('dflare', 'dflare-paper', ...,
    'diffchaser') or a strategy object. ``out_dir``: where records and triggers are saved as seeds finish.
    ``settings``: the :class:`~mlflow_di.fuzz.contract.Campaign` fields, declared there once with their
    defaults: ``timeout`` (CPU seconds) and ``max_queries`` limit each seed's search, ``batch`` seeds are
    searched in lockstep (results do not depend on it), ``seed``, ``resume=True`` continues a campaign
    found in ``out_dir``, ``progress``, and ``executor``/``overlap`` (see :func:`run_campaigns`).

    A KeyboardInterrupt stops the campaign early: finished seeds are kept (on disk too) and
    the returned result has ``complete=False``.
    """
    return run_campaigns(original, [compressed], seeds, strategy, out_dirs=None if out_dir is None else [out_dir],
                         **settings)[0]


def run_campaigns(original, compressed: list, seeds: ImageSet, strategy="dflare", **settings) -> list[CampaignResult]:
    """One campaign per model in ``compressed``, all against ``original``, sharing its calls.

    Each campaign is the one :func:`run_campaign` would run for that pair (per-seed records are
    the same), but the campaigns advance together: each lockstep iteration sends the inputs of
    every campaign through ``original`` in one call, each distinct image once (the searches of
    one seed against two exports propose the same mutants until their paths part), and each
    campaign's own inputs through its compressed model. ``settings``: the
    :class:`~mlflow_di.fuzz.contract.Campaign` fields, as for :func:`run_campaign`, with ``out_dirs``
    (one folder per campaign) in place of ``out_dir``.
    The results' ``run_stats.original_inputs`` say how many images the original evaluated for
    that campaign's share; :attr:`RunStats.shared_original_inputs` how many all campaigns needed.

    ``executor``: None searches here; a :class:`~mlflow_di.fuzz.distributed.RayExecutor` spreads
    chunks of seeds over Ray workers (same per-seed records under ``max_queries``). Either way this
    process alone writes the campaign folders.

    ``overlap``: keep two shifts of up to ``batch`` seeds per campaign and run one shift's model calls in
    a background thread while the other shift's searches mutate and score (see the module docstring).
    None (the default): :func:`overlaps_by_default`, decided from the models this process loaded (as
    :func:`~mlflow_di.fuzz.device_mutations.mutation_device` is). Per-seed records do not change, only
    times do (unless a model's output for an image depends on the rest of its batch, as with ``batch``).
    """
    return lockstep(Campaign(original, list(compressed), make_strategy(strategy), seeds, **settings))


def lockstep(campaign: Campaign) -> list[CampaignResult]:
    """The lockstep runner: ``campaign``'s black-box search on every export, the original's calls shared
    (what :func:`run_campaigns` describes); one result per export."""
    original, compressed, strategy, seeds = campaign.original, campaign.compressed, campaign.strategy, campaign.seeds
    declared = declaration_of(strategy)  # its declaration says how it sees the models; undeclared objects run here
    if declared is not None and Access.WHITE_BOX in (declared.original, declared.compressed):
        raise UserError(f"the {declared.name} strategy needs a PyTorch model's gradients, which this lockstep of "
                        f"black boxes does not have; run it with mlflow_di.fuzz.run (fuzz --strategy {declared.name})")
    if not isinstance(strategy, SearchStrategy):
        raise UserError(f"{type(strategy).__name__} has no start(seed_image, p_original, p_compressed, rng); the "
                        "lockstep runs black-box strategies that start one search per seed")
    if not compressed:
        raise UserError("no compressed model given")
    out_dirs = campaign.out_dirs
    if out_dirs is not None and len(out_dirs) != len(compressed):
        raise UserError(f"{len(compressed)} compressed models but {len(out_dirs)} output folders")
    check_arguments(seeds, campaign.timeout, campaign.max_queries, batch=campaign.batch, out_dirs=out_dirs,
                    resume=campaign.resume, strategy=strategy)
    settings = dict(strategy=strategy.name, strategy_options=strategy.options(), timeout=float(campaign.timeout),
                    max_queries=campaign.max_queries, seed=int(campaign.seed), data=seeds.name, seed_count=len(seeds),
                    image_shape=tuple(seeds.image_shape), original=model_name(original, "original"),
                    seeds_sha256=seed_fingerprint(seeds, campaign.progress))
    configs = [CampaignConfig(**settings, compressed=model_name(model, "compressed")) for model in compressed]
    with contextlib.ExitStack() as stack:  # one session (folder, lock, resume) per export
        sessions = [stack.enter_context(CampaignSession(config, folder, campaign.resume))
                    for config, folder in zip(configs, campaign.folders())]
        lanes = [Lane(model, session) for model, session in zip(compressed, sessions)]
        _check_seeds(original, lanes, seeds, progress=campaign.progress)
        for session in sessions:
            session.start()
        overlap = campaign.overlap
        if overlap is None:
            overlap = overlaps_by_default(original, compressed, campaign.executor)
        runner = Lockstep(original, lanes, seeds, strategy, campaign.batch, overlap)
        try:
            runner.run(campaign.progress, campaign.executor)
        finally:
            for session in sessions:
                session.close()
        results = []
        for lane, session in zip(lanes, sessions):
            result = session.result(lane.records, lane.images, lane.stats)
            result.run_stats.shared_original_inputs = runner.shared_original_inputs
            session.save(result)
            results.append(result)
        return results


def _check_seeds(original, lanes: list["Lane"], seeds: ImageSet, progress: bool = False) -> None:
    """Every model's probabilities on the seeds each campaign still has to run (stored on the
    lanes), after checking that each pair fits. The original sees each seed once."""
    union = sorted(set().union(*(lane.todo_indices(len(seeds)) for lane in lanes)))
    todo = np.asarray(union, dtype=np.int64)
    if len(todo) == 0:
        return
    p_original = np.concatenate([predict_checked(original, seeds.images[todo[start:start + SEED_BATCH]], "original")
                                 for start in tqdm(range(0, len(todo), SEED_BATCH), desc="seed predictions",
                                                   unit="batch", disable=not progress, leave=False)])
    row_of = {int(index): row for row, index in enumerate(todo)}
    for lane in lanes:  # in batches: the seeds may be bigger than memory
        indices = np.asarray(sorted(lane.todo_indices(len(seeds))), dtype=np.int64)
        if len(indices) == 0:
            lane.todo = indices
            continue
        p_compressed = np.concatenate([predict_checked(lane.compressed, seeds.images[indices[start:start + SEED_BATCH]],
                                                "compressed") for start in range(0, len(indices), SEED_BATCH)])
        mine = p_original[[row_of[int(i)] for i in indices]]
        if mine.shape[1] != p_compressed.shape[1]:
            raise UserError(f"the models disagree on the number of classes: original '{model_name(original, 'original')}' "
                            f"has {mine.shape[1]}, compressed '{model_name(lane.compressed, 'compressed')}' has "
                            f"{p_compressed.shape[1]}; compare a model with its own compressed version")
        fuzzed_before = any(not r.already_deviating for r in lane.done.values())
        if labels_differ(mine, p_compressed).all() and not fuzzed_before:
            raise UserError(f"the two models already disagree on all {len(indices)} seeds, so there is nothing to "
                            f"fuzz (compressed '{model_name(lane.compressed, 'compressed')}'); check that the compressed "
                            "model belongs to the original and that both use the right preprocessing")
        lane.todo, lane.p_original, lane.p_compressed = indices, mine, p_compressed


def off_host(original, compressed: list) -> bool:
    """Whether any of the models runs on a GPU (its ``provider`` names CUDA). A campaign then overlaps
    by default: otherwise the host waits while the device computes a batch, and the device waits while
    the host mutates and scores the next. On a CPU the two would compete for the same cores."""
    return any("cuda" in str(getattr(model, "provider", "")).lower() for model in [original, *compressed])


def overlaps_by_default(original, compressed: list, executor=None) -> bool:
    """Whether a campaign overlaps when not told: when a model runs on a GPU (:func:`off_host`) where the
    searches run, i.e. here, or on Ray workers given a GPU share (which load the models as this process did)."""
    return off_host(original, compressed) and searches_share_the_models_gpu(executor)
