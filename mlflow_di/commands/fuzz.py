"""``mlflow-di fuzz``: a search for inputs on which a model and its compressed versions disagree,
logged to MLflow. Parse, load, run, log: the strategies' declarations (:mod:`mlflow_di.fuzz.contract`,
:mod:`mlflow_di.fuzz.strategies`) say how each model is loaded, which options apply and how a
campaign runs (:func:`mlflow_di.fuzz.run`); this module names no strategy.

The campaign writes every finished seed to ``--out-dir`` as it goes, so Ctrl-C, SIGTERM or a
crash keeps every trigger found; ``--resume`` continues the campaign in that folder (and closes
the run a ``kill -9`` left RUNNING). Whatever was found is logged to the MLflow run before it
ends (KILLED when interrupted). Several ``--compressed`` exports run as one campaign each (child
runs, the original's calls shared), or as one joint campaign for a strategy that declares so.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import pathlib
import re
import time
from typing import TYPE_CHECKING

import click

from mlflow_di.commands.options import (RAY_OPTIONS, FiniteFloat, LazyChoice, SectionedCommand, WritablePath,
                                        declared_options, device_option, json_out_option, ray_options, runtime_option,
                                        seed_option)
from mlflow_di.commands.output_files import write_json_out
from mlflow_di.fuzz import strategies as declared
from mlflow_di.fuzz.contract import DEFAULT_MAX_QUERIES, DEFAULT_TIMEOUT, Access, Declaration, Strategy

if TYPE_CHECKING:
    from mlflow_di.data import ImageSet
    from mlflow_di.models.reference import ModelRef

CAMPAIGNS = pathlib.Path("mlflow-di-campaigns")


def _campaign_prefix(original: str, compressed: str, strategy: str, seed: int) -> str:
    slug = re.sub(r"[^A-Za-z0-9.@-]+", "_", f"{original}__vs__{compressed}").strip("_")[-120:]
    return f"{slug}__{strategy}__seed{seed}__"


def default_out_dir(original: str, compressed: str, strategy: str, seed: int, resume: bool = False) -> pathlib.Path:
    """A new timestamped folder under mlflow-di-campaigns/; with ``resume``, the newest one of
    the same models, strategy and seed (a :class:`UserError` when there is none)."""
    from mlflow_di.errors import UserError

    prefix = _campaign_prefix(original, compressed, strategy, seed)
    if resume:
        earlier = sorted(CAMPAIGNS.glob(prefix + "*"))
        if not earlier:
            raise UserError(f"nothing to resume: no campaign of these models, strategy and seed under {CAMPAIGNS}/; "
                            "give its folder with --out-dir")
        return earlier[-1]
    return CAMPAIGNS / (prefix + time.strftime("%Y%m%d-%H%M%S"))


def _sections():
    """``--help``'s option groups: each declared strategy's own options, then Ray's."""
    own = [(d.option_title or f"{d.name} options", lambda param, prefix=d.option_prefix: param.name.startswith(prefix + "_"))
           for d in declared.declarations() if d.option_prefix and d.options]
    return (*own, ("Ray options (--workers N)", lambda param: param.name in RAY_OPTIONS))


@click.command("fuzz", cls=SectionedCommand, sections=_sections())
@click.option("--original", required=True, help="The original (any backend: models:/..., .onnx, .pt, keras:...).")
@click.option("--compressed", "compressed", required=True, multiple=True,
              help="Its compressed version (any backend); repeat it to fuzz several exports in one call, the "
                   "original's calls shared.")
@click.option("--seed-data", "seed_data", default=None, help="Data spec of the seed images, e.g. mnist-test:DIR (required).")
@click.option("--seeds", "seeds_old_name", default=None, hidden=True, expose_value=False, callback=lambda ctx, param, value:
              _renamed(ctx, value, "--seeds", "--seed-data"))
@click.option("--num-seeds", type=click.IntRange(1), default=500, show_default=True, help="Use the first N seed images.")
@click.option("--max-queries", type=click.IntRange(1), default=DEFAULT_MAX_QUERIES, show_default=True,
              help="A seed's budget: queries to the compressed model.")
@click.option("--timeout", type=FiniteFloat(0, min_open=True), default=DEFAULT_TIMEOUT, show_default=True,
              help="Safety net, CPU s per seed (a hit: INCOMPLETE).")
@click.option("--strategy", type=LazyChoice("mlflow_di.fuzz.strategies:STRATEGIES", "strategy", in_help=False),
              default=declared.DEFAULT, show_default=True, help=declared.strategy_help())
@click.option("--max-linf", type=click.IntRange(1, 255), default=None,
              help="Keep every queried input within this many 8-bit levels of its seed (L-inf). Realism "
                   "strategies.")
@click.option("--min-ssim", type=FiniteFloat(-1.0, 1.0, min_open=True, max_open=True), default=None,
              help="Least SSIM of each queried input to its seed (paper's and whole-image; >= 11x11 images). "
                   "Realism strategies.")
@declared_options(declared.declarations())
@click.option("--batch", type=click.IntRange(1), default=64, show_default=True,
              help="Seeds searched in lockstep (results do not depend on it, but for int8-dynamic exports).")
@click.option("--overlap/--no-overlap", default=None,
              help="Two shifts of --batch seeds: one at the models while the other searches (default: on when a "
                   "model runs on a GPU). Black-box strategies.")
@click.option("--out-dir", type=WritablePath("dir"), default=None,
              help="Campaign folder, written as seeds finish (default: a new folder under mlflow-di-campaigns/).")
@click.option("--resume", is_flag=True,
              help="Continue the campaign in --out-dir (default: the newest of these models, strategy, seed); a larger "
                   "--num-seeds extends it.")
@click.option("--confidence", type=FiniteFloat(0.5, 1.0, max_open=True), default=0.95, show_default=True,
              help="Of the intervals the gate judges.")
@click.option("--preprocessing-original", default=None, metavar="KEY=VALUE,...", help="Override the original's preprocessing.")
@click.option("--preprocessing-compressed", default=None, metavar="KEY=VALUE,...",
              help="Override the exports' preprocessing.")
@click.option("--semantics", type=click.Choice(["host", "reference"]), default="host", show_default=True,
              help="ONNX exports: this CPU's kernels, or the QDQ graph as written.")
@runtime_option("Run the exports on")
@ray_options("the campaign: each loads the models once and searches chunks of --batch seeds (twice that "
             "with --overlap)")
@seed_option
@json_out_option
@device_option
def command(original, compressed, seed_data, num_seeds, timeout, max_queries, strategy, max_linf, min_ssim, batch,
            overlap, out_dir, resume, preprocessing_original, preprocessing_compressed, workers, ray_address,
            cpus_per_worker, gpus_per_worker, seed, json_out, device, semantics="host", confidence=0.95,
            runtime=None, **own_options) -> None:
    """Search seed images for inputs on which ORIGINAL and COMPRESSED disagree (triggering inputs)."""
    seed_data = seed_data or click.get_current_context().meta.get("--seed-data")  # or its old name, --seeds
    if not seed_data:
        raise click.UsageError("Missing option '--seed-data'.")
    ray = _RaySettings(workers, ray_address, cpus_per_worker, gpus_per_worker)
    asked = _Asked(timeout, max_queries, max_linf, min_ssim=min_ssim, batch=batch, seed=seed, resume=resume,
                   semantics=semantics, runtime=runtime, ray=ray)
    choice = _choose(strategy, tuple(compressed), max_linf, min_ssim=min_ssim, own_options=own_options, overlap=overlap,
                     ray=ray)
    models = _load(choice, original, (preprocessing_original, preprocessing_compressed), device=device,
                   semantics=semantics, overlap=overlap, runtime=runtime)
    plan = _Plan(choice, models, _seeds(choice, models, seed_data, num_seeds),
                 _folders(choice, original, out_dir, seed, resume))
    if resume:
        _extend(plan)
    record = _run_record(plan, original, seed_data, asked)
    from mlflow_di.fuzz.contract import Campaign
    from mlflow_di.fuzz.runners import run
    from mlflow_di.mlflow_edge import runs
    from mlflow_di.models.device import out_of_memory_as_user_error
    from mlflow_di.models.stoppable import call_limit

    run_name = f"fuzz {models.original_ref.short} vs {', '.join(ref.short for ref in models.compressed_refs)}"
    with runs.tracked_run(run_name, tags=record.tags) as log:
        log.params({**record.params, "compressed": ",".join(choice.compressed), "out_dir": str(plan.folders.folder),
                    "compressed_runs_on": ",".join(m.provider for m in models.compressed_classifiers)})
        _announce(plan, batch, ray_address, workers)
        with out_of_memory_as_user_error("fuzzing", batch), call_limit(timeout, f"fuzz --timeout {timeout:g}"):
            results = run(Campaign(models.original, list(models.compressed), models.search, seeds=plan.seeds.seeds,
                                   timeout=timeout, max_queries=max_queries, batch=batch, seed=seed,
                                   out_dirs=list(plan.folders.exports), resume=resume, executor=choice.executor,
                                   overlap=models.overlapping), choice.declaration)
        summaries, comparison = _log_results(log, plan, record, original=original, seed_data=seed_data,
                                             num_seeds=num_seeds, results=results, confidence=confidence)
        _log_ray_stats(log, choice.executor)
        if not all(result.complete for result in results):  # the run ends KILLED; everything found is logged and on disk
            raise KeyboardInterrupt  # the CLI tells Ctrl-C (130) from SIGTERM (143)
    write_json_out(summaries[0] if not choice.several else {"campaigns": dict(zip(choice.compressed, summaries)),
                                                            **comparison["metrics"]}, json_out)


def _log_ray_stats(log, executor) -> None:
    """What the Ray workers did (chunks, workers) and, when a worker was lost (its process or its node), how many
    chunks a restarted one ran: a lost worker costs its chunks' time, never their records."""
    stats = getattr(executor, "stats", None)
    if not stats:
        return
    log.metrics({"ray.chunks": stats["chunks"], "ray.workers": stats["workers"],
                 "ray.chunks_on_restarted_workers": stats["chunks_on_restarted_workers"]})
    if stats["chunks_on_restarted_workers"]:
        click.echo(f"a Ray worker was lost and restarted: {stats['chunks_on_restarted_workers']} of {stats['chunks']} "
                   "chunks ran on a restarted worker (those it held ran again from their start; no record is lost or "
                   "written twice)")


@dataclasses.dataclass(frozen=True)
class _Choice:
    """What the options chose: the declared strategy, configured, the exports and where the searches run."""

    declaration: Declaration
    search: Strategy
    compressed: tuple[str, ...]
    executor: object  # a Ray executor, None: this process

    @property
    def several(self) -> bool:
        """Several exports in separate campaigns (child runs and a comparison)."""
        return len(self.compressed) > 1 and not self.declaration.joint


@dataclasses.dataclass(frozen=True)
class _Models:
    """Every model as the strategy needs it, their black-box views, and where the mutations and calls run."""

    original_ref: ModelRef
    compressed_refs: tuple[ModelRef, ...]
    original: object  # a black-box classifier or a white-box TorchModel, as the declaration says
    compressed: tuple
    original_classifier: object  # black-box views, for logging and the comparison
    compressed_classifiers: tuple
    search: Strategy  # the chosen strategy, its operators on the mutation device
    mutations_on: object  # None: the CPU
    overlapping: bool


@dataclasses.dataclass(frozen=True)
class _Seeds:
    """The seeds as the original prepares them, and as the data spec loads them (the run's dataset)."""

    seeds: ImageSet
    raw: ImageSet


@dataclasses.dataclass(frozen=True)
class _Folders:
    """The campaign folder and each export's campaign folder (the folder itself for one campaign)."""

    folder: pathlib.Path
    exports: tuple[pathlib.Path, ...]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the command decided before the run starts, step by step."""

    choice: _Choice
    models: _Models
    seeds: _Seeds
    folders: _Folders


@dataclasses.dataclass(frozen=True)
class _RaySettings:
    """Where the searches run (``--workers``, ``--ray-address``, ``--cpus-per-worker``, ``--gpus-per-worker``)."""

    workers: int
    address: str
    cpus_per_worker: float
    gpus_per_worker: float


@dataclasses.dataclass(frozen=True)
class _Asked:
    """The budget and the run's settings as the options asked for them (what the run's params record; the seeds
    are counted as the plan holds them)."""

    timeout: float
    max_queries: int
    max_linf: int | None
    min_ssim: float | None
    batch: int
    seed: int
    resume: bool
    semantics: str
    runtime: object  # the --runtime choice, None: each format's own
    ray: _RaySettings


@dataclasses.dataclass(frozen=True)
class _Record:
    """The run's tags and params, and per export the tags and LoggedModel the metrics go to."""

    tags: dict
    params: dict
    compressed_tags: tuple[dict, ...]
    model_ids: tuple


def _choose(strategy: str, compressed: tuple, max_linf, min_ssim, own_options: dict, overlap,
            ray: _RaySettings) -> _Choice:
    """The declared strategy configured with the budget and its own options; what it refuses, in one line."""
    from mlflow_di.errors import UserError

    repeated = sorted({uri for uri in compressed if compressed.count(uri) > 1})
    if repeated:
        raise UserError(f"--compressed {repeated[0]} is given twice; name each compressed model once")
    declaration = declared.declaration(strategy)
    for name, value in own_options.items():  # another strategy's own option
        if value is not None and not name.startswith(f"{declaration.option_prefix}_"):
            owner = next(d.name for d in declared.declarations() if d.option_prefix and name.startswith(d.option_prefix + "_"))
            raise UserError(f"--{name.replace('_', '-')} is a setting of --strategy {owner}, not {strategy}")
    prefix = f"{declaration.option_prefix}_"
    search = declared.configure(declaration, {"max_linf": max_linf, "min_ssim": min_ssim},
                                   {name[len(prefix):]: value for name, value in own_options.items()
                                    if name.startswith(prefix)})
    declaration.refuse(overlap=overlap, workers=ray.workers)
    return _Choice(declaration, search, compressed, _executor(ray))


def _executor(ray: _RaySettings):
    """None (search in this process) for ``--workers 0``, else the Ray executor; Ray missing is one line."""
    if not ray.workers:
        return None
    import importlib.util

    from mlflow_di.errors import UserError
    from mlflow_di.fuzz.distributed import RayExecutor

    if importlib.util.find_spec("ray") is None:
        raise UserError("--workers needs Ray: pip install 'mlflow-di[ray]' (or run with --workers 0)")
    return RayExecutor(workers=ray.workers, address=ray.address, cpus_per_worker=ray.cpus_per_worker,
                       gpus_per_worker=ray.gpus_per_worker)


def _load(choice: _Choice, original: str, preprocessing: tuple, device, semantics: str, overlap,
          runtime=None) -> _Models:
    """Every model as the strategy's declaration needs it, and where its mutations and calls run; ``runtime``
    (None: each format's own) runs the compressed models."""
    from mlflow_di.fuzz.campaign import overlaps_by_default
    from mlflow_di.errors import UserError
    from mlflow_di.fuzz.device_mutations import mutation_device, with_operators_on
    from mlflow_di.models.reference import ModelRef

    declaration = choice.declaration
    original_ref = ModelRef.parse(original)
    compressed_refs = tuple(ModelRef.parse(uri) for uri in choice.compressed)
    original_model = _model(original_ref, preprocessing[0], device, declaration.original, declaration, "--original")
    if runtime is not None and declaration.compressed is not Access.BLACK_BOX:
        raise UserError(f"--runtime runs black-box exports; --strategy {declaration.name} takes the compressed "
                        "model's gradients in PyTorch (drop --runtime)")
    if runtime is not None and semantics == "reference" and runtime.name != "onnxruntime":
        raise UserError(f"--semantics reference is ONNX Runtime's (graph optimizations off), not {runtime.name}'s; "
                        "drop one of them")
    compressed = tuple(_model(ref, preprocessing[1], device, access=declaration.compressed, declaration=declaration,
                              role="--compressed", runtime=runtime) for ref in compressed_refs)
    if semantics == "reference" and declaration.compressed is Access.BLACK_BOX:
        compressed = tuple(_reference_twin(model, choice.executor) for model in compressed)
    original_classifier = _black_box(original_model, declaration.original)
    compressed_classifiers = tuple(_black_box(model, declaration.compressed) for model in compressed)
    search, mutations_on, overlapping = choice.search, None, False
    if declaration.device_mutations:  # the operators (and a step's scoring) on a CUDA original's GPU
        mutations_on = mutation_device(original_classifier, choice.executor)
        search = with_operators_on(search, mutations_on)
    if declaration.overlap:
        overlapping = overlap if overlap is not None else overlaps_by_default(
            original_classifier, compressed_classifiers, choice.executor)
    return _Models(original_ref, compressed_refs, original_model, compressed=compressed,
                   original_classifier=original_classifier, compressed_classifiers=compressed_classifiers,
                   search=search, mutations_on=mutations_on, overlapping=overlapping)


def _black_box(model, access: Access):
    """A model's black-box classifier: a white-box TorchModel's own, or the (black-box) model itself."""
    return model.classifier() if access is Access.WHITE_BOX else model


def _model(ref, preprocessing, device, access, declaration, role: str, runtime=None):
    """One model as ``access`` says: a black-box classifier of any format, or a white-box TorchModel (a
    one-line UserError, with the declaration's advice, for a model that has no PyTorch view)."""
    from mlflow_di.errors import UserError
    from mlflow_di.models.loading import load_classifier, load_torch_model, resolve

    if access is Access.BLACK_BOX:
        return load_classifier(ref, preprocessing, device, runtime)
    source = resolve(ref)
    needs = f"--strategy {declaration.name} needs the gradients of PyTorch models"
    if not source.white_box:
        raise UserError(f"{needs}, but '{ref.uri}' ({role}) is a {source.kind} model; {declaration.white_box_advice}")
    try:
        return load_torch_model(source, preprocessing, device)
    except UserError as exc:
        if not source.format.graph:
            raise
        # an int8 export's QuantizeLinear, or a damaged file: no white-box view to take gradients of
        raise UserError(f"{needs}, and the onnx model '{ref.uri}' ({role}) has no white-box view ({exc}); "
                        f"{declaration.white_box_advice}") from None


def _seeds(choice: _Choice, models: _Models, seed_data: str, num_seeds: int) -> _Seeds:
    """The first ``num_seeds`` seed images, prepared as the original's raw-image step says, checked
    against every model and the strategy before any run starts."""
    from mlflow_di.data import load_images
    from mlflow_di.errors import UserError

    raw_seeds = load_images(seed_data)
    prepared = models.original_classifier.preprocessing.prepare(raw_seeds)  # lazy: resized per batch if the model says so
    seeds = prepared.subset(slice(0, num_seeds), f"{prepared.name} (first {min(num_seeds, len(prepared))})")
    for role, model in [("original", models.original_classifier)] + [
            (f"compressed {uri}", m) for uri, m in zip(choice.compressed, models.compressed_classifiers)]:
        try:  # fail before any run starts when the seeds do not fit a model
            model.preprocessing.check_images(seeds.images[:1])
        except UserError as exc:
            raise UserError(f"{role} model: {exc}") from None
    choice.declaration.check_seeds(choice.search, seeds.images[0], seeds.image_shape)
    return _Seeds(seeds, raw_seeds.subset(slice(0, num_seeds)))


def _folders(choice: _Choice, original: str, out_dir, seed: int, resume: bool) -> _Folders:
    """The campaign folder (and one sub-folder per export in separate campaigns), locked until the command ends."""
    from mlflow_di.errors import UserError
    from mlflow_di.folder_lock import FolderLock

    label = choice.declaration.folder_label(choice.search)
    folder = pathlib.Path(out_dir) if out_dir else default_out_dir(original, ",".join(choice.compressed), label, seed,
                                                                   resume)
    if folder.exists() and any(folder.iterdir()) and not resume:
        raise UserError(f"'{folder}' already holds a campaign; pass --resume to continue it, or --out-dir for a new one")
    # held until the command ends: a second process must not close this one's run as orphaned or append its seeds
    click.get_current_context().call_on_close(FolderLock(
        folder, "the campaign folder", advice="wait for it to finish (or stop it), or pass another --out-dir").acquire().release)
    exports = tuple(export_folder(folder, number, uri, resume) for number, uri in enumerate(choice.compressed)) \
        if choice.several else (folder,)
    return _Folders(folder, exports)


def _extend(plan: _Plan) -> None:
    """A resumed campaign asked for more seeds than it holds grows to them when its seeds are the first of the new
    ones (each seed's search depends on its own index alone, so the records it has stay valid); said in one line."""
    from mlflow_di.fuzz.seeds import seed_fingerprint
    from mlflow_di.fuzz.store import CampaignStore

    seeds = plan.seeds.seeds
    whole = None
    for folder in plan.folders.exports:
        store = CampaignStore(folder)
        if not store.exists or store.read_config().seed_count >= len(seeds):
            continue
        whole = whole or seed_fingerprint(seeds)
        grown_from = store.extend(len(seeds), whole, lambda count: seed_fingerprint(seeds.subset(slice(0, count))))
        click.echo(f"extending the campaign in {folder} from {grown_from} to {len(seeds)} seeds (its own are the first "
                   f"{grown_from})")


def _run_record(plan: _Plan, original: str, seed_data: str, asked: _Asked) -> _Record:
    """The run's tags (the models fuzzed, the campaign folder, the budget searched inside) and params."""
    from mlflow_di.fuzz.realism import SSIM_RADIUS
    from mlflow_di.mlflow_edge import registry, runs

    choice, models, resume = plan.choice, plan.models, asked.resume
    campaign_tag = {"mlflow_di.campaign": str(plan.folders.folder.resolve())}
    if resume:
        closed = runs.close_orphaned_runs(campaign_tag, "a later --resume of the same campaign")
        if closed:
            click.echo(f"closed {len(closed)} run(s) of this campaign left RUNNING by a killed process (now KILLED)")
    tags = {"mlflow_di.command": "fuzz", **campaign_tag, **registry.model_version_tags(original)}
    constraint = choice.declaration.constraint_of(choice.search)
    if constraint:  # the gate's realism check reads such campaigns, its other fuzz checks the others
        tags["mlflow_di.fuzz_constraint"] = json.dumps(constraint, sort_keys=True)
    # where SSIM has no window to measure with, a budget cannot bound it (the gate asks for L-inf alone)
    tags["mlflow_di.fuzz_ssim_measurable"] = str(min(plan.seeds.seeds.image_shape[:2]) > 2 * SSIM_RADIUS).lower()
    # resolved now, before hours of fuzzing: the versions fuzzed, whatever an alias points at later
    compressed_tags = tuple(registry.compressed_model_tags(uri) for uri in choice.compressed)
    if len(choice.compressed) == 1:
        tags.update(compressed_tags[0])
    model_ids = tuple(registry.logged_model_id(uri) for uri in choice.compressed)  # the models the gate judges
    params = {"original": original, "seed_data": seed_data, "num_seeds": len(plan.seeds.seeds), "timeout": asked.timeout,
              "max_queries": asked.max_queries, "strategy": choice.declaration.name, "max_linf": asked.max_linf,
              "min_ssim": asked.min_ssim, "batch": asked.batch, "seed": asked.seed, "resume": resume,
              "original_runs_on": models.original_classifier.provider, "workers": asked.ray.workers,
              **({"ray_address": asked.ray.address} if asked.ray.workers else {}),
              "mutations_on": str(models.mutations_on or "cpu"), "overlap": models.overlapping,
              "semantics": asked.semantics, **choice.declaration.own_options(choice.search),
              **({"runtime": asked.runtime.label} if asked.runtime is not None else {})}
    return _Record(tags, params, compressed_tags, model_ids)


def _announce(plan: _Plan, batch: int, ray_address: str, workers: int) -> None:
    """What is about to run, where."""
    from mlflow_di.fuzz.lockstep import seeds_in_flight
    from mlflow_di.reporting.fuzz_report import plural

    choice, models = plan.choice, plan.models
    click.echo(f"fuzzing {plural(len(plan.seeds.seeds), 'seed')} with {choice.declaration.name}"
               + (f" against {len(choice.compressed)} compressed models" if choice.several else "")
               + f"; campaign folder {plan.folders.folder}")
    click.echo(f"original runs on {models.original_classifier.provider}, compressed on "
               f"{', '.join(sorted({m.provider for m in models.compressed_classifiers}))}")
    if models.mutations_on is not None:
        where = " (each Ray worker's own GPU)" if choice.executor is not None else ""
        click.echo(f"mutations and their scoring run on {models.mutations_on}{where}")
    if models.overlapping:
        click.echo(f"the models' calls overlap the searches: two shifts of up to {batch} seeds"
                   + (" in each Ray worker" if choice.executor is not None else "") + " (--no-overlap: one)")
    if choice.executor is not None:
        click.echo(f"searching on {plural(workers, 'Ray worker')} ({ray_address}), chunks of "
                   f"{seeds_in_flight(batch, models.overlapping)} seeds; this process writes the campaign folder")


def _log_results(log, plan: _Plan, record: _Record, original: str, seed_data: str, num_seeds: int,
                 results: list, confidence: float = 0.95) -> tuple[list[dict], dict]:
    """Every campaign's summary, logged (one child run per export when several) and printed; and, for
    several exports, their comparison (empty otherwise)."""
    from mlflow_di.mlflow_edge import datasets, runs
    from mlflow_di.models.execution import context_tags
    from mlflow_di.reporting.fuzz_report import summarize

    choice, models = plan.choice, plan.models
    summaries = [{**summarize(result, confidence), **_host_only(models.original_classifier, model, result)}
                 for model, result in zip(models.compressed_classifiers, results)]
    # the seeds as the spec loads them; the campaign's fingerprint is theirs unless the original resized them
    known = None if models.original_classifier.preprocessing.has_raw_step else results[0].config.seeds_sha256
    lineage = datasets.spec_dataset(plan.seeds.raw, seed_data, first=num_seeds, sha256=known)
    log.input(lineage, "seeds")
    if not choice.several:
        log.tags(context_tags(models.compressed_classifiers))
        _log_campaign(log, results[0], plan.folders.folder, original=original, compressed=", ".join(choice.compressed),
                      summary=summaries[0], model_id=record.model_ids[0] if len(choice.compressed) == 1 else None,
                      dataset=lineage)
        _print_summary(results[0], summaries[0], plan.folders.folder)
        return summaries, {}
    for uri, ref, model, result, summary, sub, own_tags, model_id in zip(
            choice.compressed, models.compressed_refs, models.compressed_classifiers, results, summaries,
            plan.folders.exports, record.compressed_tags, record.model_ids):
        with runs.tracked_run(f"fuzz {models.original_ref.short} vs {ref.short}", tags={**record.tags, **own_tags},
                              status="FINISHED" if result.complete else "KILLED") as child:  # nested
            child.params({**record.params, "compressed": uri, "out_dir": str(sub), "compressed_runs_on": model.provider})
            child.tags(context_tags([model]))
            child.input(lineage, "seeds")
            _log_campaign(child, result, sub, original=original, compressed=uri, summary=summary, model_id=model_id,
                          dataset=lineage)
        click.echo(f"{uri}:")
        _print_summary(result, summary, sub)
    comparison = _compare_exports(models.original_classifier, list(choice.compressed),
                                  list(models.compressed_classifiers), results, summaries)
    log.metrics(comparison["metrics"])
    _log_comparison(log, original, list(choice.compressed), results, summaries, comparison)
    _print_sharing(comparison)
    return summaries, comparison


def _reference_twin(model, executor):
    """An ONNX compressed model run with reference semantics (other formats have no such choice)."""
    from mlflow_di.errors import UserError
    from mlflow_di.models.classifier import OnnxClassifier

    if not isinstance(model, OnnxClassifier):
        raise UserError(f"--semantics reference applies to ONNX compressed models; {model.name} runs on "
                        f"{model.provider} (drop --semantics)")
    if executor is not None:
        raise UserError("--semantics reference runs the compressed models in this process; drop --workers")
    return model.with_semantics("reference")


def _host_only(original_model, compressed_model, result) -> dict:
    """For an ONNX compressed model fuzzed with host semantics: how many triggers flip only under this host's
    kernels, i.e. the same file run with reference semantics gives the original's label ({} otherwise)."""
    from mlflow_di.models.classifier import OnnxClassifier

    if not isinstance(compressed_model, OnnxClassifier) or compressed_model.semantics != "host":
        return {}
    if not len(result.triggers):
        return {"host_only_triggers": 0, "host_only_trigger_indices": []}
    reference = compressed_model.with_semantics("reference").predict(result.triggers)
    agree = reference == original_model.predict(result.triggers)
    return {"host_only_triggers": int(agree.sum()),
            "host_only_trigger_indices": [int(i) for i in result.trigger_indices[agree]]}


def _renamed(ctx: click.Context, value, old: str, new: str):
    """An option's old name still works for a while: it says so once and hands its value to ``new``."""
    if value is not None:
        click.echo(f"mlflow-di: note: {old} is now {new}; the old name will go in a later release", err=True)
        ctx.meta[new] = value


def export_folder(folder: pathlib.Path, number: int, uri: str, resume: bool = False) -> pathlib.Path:
    """The sub-folder of one export's campaign when several are fuzzed at once: ``NN-<uri slug>``;
    on ``resume``, the existing one of that URI whatever its number (the exports may come in another order)."""
    slug = re.sub(r"[^A-Za-z0-9.@-]+", "_", uri).strip("_")[-60:]
    if resume:
        earlier = sorted(folder.glob(f"[0-9][0-9]-{glob.escape(slug)}"))
        if earlier:
            return earlier[0]
    return folder / f"{number + 1:02d}-{slug}"


#: Triggers logged as the stepped image series ``triggers`` (the grid pages show them all).
TRIGGER_SERIES = 16


def _log_campaign(log, result, folder: pathlib.Path, original: str, compressed: str, summary: dict,
                  model_id: str | None = None, dataset=None) -> None:
    """One campaign's metrics (also on the compressed model's LoggedModel when ``model_id``), files,
    per-seed and per-class tables, trigger grid and series, and HTML report."""
    from mlflow_di.deviation import matrix_rows
    from mlflow_di.fuzz.per_class import class_rows, trigger_matrix
    from mlflow_di.fuzz.realism import distance_rows
    from mlflow_di.reporting import fuzz_report

    by_class = class_rows(result.records)
    log.metrics(fuzz_report.run_metrics(summary, by_class), model_id=model_id, dataset=dataset)
    log.folder(folder, "fuzz/campaign")
    log.json(summary, "fuzz/summary.json")
    rows = fuzz_report.seed_rows(result)
    log.table(rows, "fuzz/seeds.json")
    log.table(by_class, "fuzz/per_class.json")
    pages = fuzz_report.trigger_grid_pages(result) if len(result.triggers) else []
    if pages:
        log.image(pages[0], "fuzz/trigger_grid.png")
        log.image_series(result.triggers[:TRIGGER_SERIES], "triggers")
        for number, page in enumerate(pages[1:], start=2):
            log.image(page, f"fuzz/trigger_grid_{number}.png")
        log.table(distance_rows(result.records), "fuzz/trigger_distances.json")
        log.table(matrix_rows(trigger_matrix(result.records)), "fuzz/trigger_matrix.json")
    log.text(fuzz_report.campaign_report(result, original, compressed, summary=summary, rows=rows, by_class=by_class,
                                         pages=pages),
             "fuzz/report.html")


def _compare_exports(original_model, compressed: list[str], models: list, results: list, summaries: list) -> dict:
    """Side-by-side rows, what sharing the original saved, and which triggers fool every export.

    Every trigger (found against any export) is shown to the original and every export: a trigger
    *fools* an export when the two disagree on it."""
    import numpy as np

    from mlflow_di.fuzz.fitness import labels_differ

    shared = results[0].run_stats.shared_original_inputs
    # a strategy with its own loop (a white-box walk) shares no batched calls of the original: nothing was saved
    separate = sum(result.run_stats.inputs for result in results) if shared else 0
    triggers = [result.triggers for result in results if len(result.triggers)]
    fools = np.zeros((0, len(models)), bool)
    if triggers:
        images = np.concatenate(triggers)
        p_original = original_model.predict_proba(images)
        fools = np.stack([labels_differ(p_original, model.predict_proba(images)) for model in models], axis=1)
    rows, start = [], 0
    for number, (uri, result, summary) in enumerate(zip(compressed, results, summaries), start=1):
        mine = fools[start:start + len(result.triggers)]
        start += len(result.triggers)
        rows.append({"#": number, "compressed": uri, "success_rate": summary["success_rate"],
                     "realistic_success_rate": summary.get("realistic_success_rate"), "triggers": summary["triggers"],
                     "mean_queries": summary["mean_queries"], "median_queries": summary["median_queries"],
                     "already_deviating": summary["already_deviating"],
                     "trigger_linf_median": summary.get("trigger_linf_median"),
                     "trigger_ssim_median": summary.get("trigger_ssim_median"),
                     **{f"fools #{k}": float(mine[:, k - 1].mean()) if len(mine) else None
                        for k in range(1, len(compressed) + 1)}})
    fooling_all = int(fools.all(axis=1).sum()) if len(fools) else 0
    metrics = {"original_inputs_separate": separate, "original_inputs_shared": shared,
               "original_inputs_saved_fraction": 1 - shared / separate if separate else 0.0,
               "triggers_fooling_all": fooling_all, "triggers_total": int(len(fools))}
    return {"rows": rows, "metrics": metrics, "fools_all": fools.all(axis=1) if len(fools) else fools[:, 0]}


def _log_comparison(log, original: str, compressed: list[str], results: list, summaries: list, comparison: dict) -> None:
    """The parent run of several exports: the side-by-side table, the picture of the triggers that fool
    every export, and the parent report."""
    from mlflow_di.reporting import fuzz_report

    log.table(comparison["rows"], "fuzz/comparison.json")
    page = fuzz_report.fooling_all_page(results, comparison)
    if page is not None:
        log.image(page, "fuzz/triggers_fooling_all.png")
    log.text(fuzz_report.comparison_report(original, compressed, results, summaries, comparison, page),
             "fuzz/report.html")


def _print_sharing(comparison: dict) -> None:
    metrics = comparison["metrics"]
    shared = (f"original evaluated {metrics['original_inputs_shared']} images for all campaigns instead of "
              f"{metrics['original_inputs_separate']} ({metrics['original_inputs_saved_fraction']:.1%} saved); "
              if metrics["original_inputs_separate"] else "")
    click.echo(f"{shared}{metrics['triggers_fooling_all']} of {metrics['triggers_total']} triggers fool every "
               "compressed model")


def _spread(summary: dict, name: str, form: str = ".1%") -> str:
    """`` (95% CI 0.5%-10.6%, n=50)`` from the summary's ``NAME_low``/``_high``/``_n``; "" without them."""
    if summary.get(f"{name}_low") is None:
        return ""
    confidence = summary.get("interval_confidence", 0.95)
    return (f" ({confidence * 100:.3g}% CI {summary[f'{name}_low']:{form}}-{summary[f'{name}_high']:{form}}, "
            f"n={summary[f'{name}_n']})")


def _print_summary(result, summary: dict, folder: pathlib.Path) -> None:
    from mlflow_di.reporting.fuzz_report import incomplete_note, plural as _plural, realism_note

    state = "done" if result.complete else f"interrupted after {_plural(len(result.records), 'seed')} (resume with --resume)"
    click.echo(f"{state}: {_plural(summary['triggers'], 'trigger')} from {_plural(summary['fuzzed'], 'seed')}, success "
               f"rate {summary['success_rate']:.1%}{_spread(summary, 'success_rate')}, "
               f"{_plural(summary['already_deviating'], 'seed')} already deviating")
    if summary["timed_out_seeds"]:
        click.echo(f"  INCOMPLETE: {incomplete_note(summary)}")
    constrained = sum(str(r.stop) == "constrained" for r in result.records)
    if constrained:
        click.echo(f"  {_plural(constrained, 'seed')} stopped as constrained: no mutant within --max-linf/--min-ssim "
                   "could be found (loosen them to search further)")
    if summary["mean_queries"] is not None:
        click.echo(f"  queries per trigger: mean {summary['mean_queries']:.1f}{_spread(summary, 'mean_queries', '.1f')}, "
                   f"median {summary['median_queries']:.0f}; seconds per trigger: mean {summary['mean_seconds']:.3f}")
    if summary.get("mean_original_passes") is not None:
        click.echo(f"  queries count images sent to the compressed model; the original (white-box) ran "
                   f"{summary['mean_original_passes']:.0f} forward/backward passes per seed on average")
    if summary["triggers"]:
        from mlflow_di.fuzz.realism import mostly_noise

        median = ", ".join(f"{key} {summary[f'trigger_{key}_median']:.3g}" for key in ("ssim", "ssim_whole", "linf")
                           if summary.get(f"trigger_{key}_median") is not None)
        click.echo(f"  realism: {realism_note(summary)}{_spread(summary, 'realistic_success_rate')}; medians {median}"
                   + ("  <- mostly noise-like" if mostly_noise(summary["realistic_triggers"], summary["triggers"]) else ""))
        if summary.get("realism_min_ssim") is None and summary.get("trigger_ssim_median") is not None:
            click.echo("  the budget above bounds L-inf only (the campaign's own --max-linf): SSIM is not bounded, while the "
                       "gate's default budget also asks SSIM >= 0.9; add --min-ssim 0.9 to search inside it")
    if summary.get("host_only_triggers"):
        click.echo(f"  {_plural(summary['host_only_triggers'], 'trigger')} flip only under this host's ONNX Runtime "
                   "kernels (reference semantics agree with the original on them)")
    if summary.get("neuron_coverage"):
        click.echo("  neuron coverage reached (seeds and triggers): " + ", ".join(
            f"{role} {value:.1%}" for role, value in summary["neuron_coverage"].items()))
    click.echo(f"  triggers and per-seed records: {folder} (and the run's fuzz/campaign artifacts)")
