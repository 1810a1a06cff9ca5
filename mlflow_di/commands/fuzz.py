"""``mlflow-di fuzz``: DFlare (or a baseline) on a model and its compressed version, logged to MLflow.

``--strategy deepxplore`` (white-box, every model PyTorch) runs one campaign over all the models
given (``--compressed`` repeated adds models to the same campaign instead of one campaign per
export) with :func:`mlflow_di.fuzz.deepxplore.run_deepxplore`, and logs the neuron coverage it reached.

The campaign writes every finished seed to ``--out-dir`` as it goes, so Ctrl-C, SIGTERM or a
crash keeps every trigger found; ``--resume`` continues the campaign in that folder (and closes
the run a ``kill -9`` left RUNNING). Whatever was found is logged to the MLflow run before it
ends (KILLED when interrupted).
"""
from __future__ import annotations

import glob
import json
import pathlib
import re
import time

import click

from mlflow_di.commands.options import (RAY_OPTIONS, FiniteFloat, IntPair, LazyChoice, SectionedCommand, StepList,
                                        WritablePath, device_option, json_out_option, ray_options, seed_option, write_json_out)

SUMMARY_METRICS = ("success_rate", "mean_queries", "median_queries", "mean_seconds", "triggers", "seeds",
                   "already_deviating", "fuzzed", "timed_out_seeds")
CAMPAIGNS = pathlib.Path("mlflow-di-campaigns")
#: summary keys logged as metrics besides SUMMARY_METRICS: the triggers' distances and the realism budget's counts
REALISM_PREFIXES = ("trigger_", "realistic_", "realism_", "mean_original_passes")


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


@click.command("fuzz", cls=SectionedCommand, sections=(
    ("DeepXplore options (only with --strategy deepxplore)", lambda param: param.name.startswith("dx_")),
    ("Ray options (--workers N)", lambda param: param.name in RAY_OPTIONS)))
@click.option("--original", required=True, help="The original model (any backend: models:/..., .onnx, .tflite, .pt, keras:...).")
@click.option("--compressed", "compressed", required=True, multiple=True,
              help="Its compressed version (any backend); repeat it to fuzz several exports in one call, the "
                   "original's calls shared.")
@click.option("--seed-data", "seed_data", default=None, help="Data spec of the seed images, e.g. mnist-test:DIR (required).")
@click.option("--seeds", "seeds_old_name", default=None, hidden=True, expose_value=False, callback=lambda ctx, param, value:
              _renamed(ctx, value, "--seeds", "--seed-data"))
@click.option("--num-seeds", type=click.IntRange(1), default=500, show_default=True, help="Use the first N seed images.")
@click.option("--timeout", type=FiniteFloat(0, min_open=True), default=180.0, show_default=True,
              help="CPU seconds a seed may use (its search and its share of the model calls; never wall-clock). "
                   "Seeds stopped here make the campaign INCOMPLETE.")
@click.option("--max-queries", type=click.IntRange(1), default=None, help="Queries per seed before giving up.")
@click.option("--strategy", type=LazyChoice("mlflow_di.fuzz.strategies:STRATEGIES", "strategy", in_help=False),
              default="dflare", show_default=True,
              help="dflare (steered by the original's log-probability margin), dflare-paper (the paper's fitness), "
                   "ablations dflare[-paper]-d (no novelty) and -r (random operator), diffchaser, boundary "
                   "(realistic triggers in few queries: walks a PyTorch original to its decision boundary inside "
                   "--max-linf/--min-ssim), or deepxplore (white-box, PyTorch models; its options below).")
@click.option("--max-linf", type=click.IntRange(1, 255), default=None,
              help="Keep every queried input within this many 8-bit levels of its seed (L-inf). dflare strategies "
                   "and boundary.")
@click.option("--min-ssim", type=FiniteFloat(-1.0, 1.0, min_open=True, max_open=True), default=None,
              help="Keep every queried input at least this similar (SSIM, images >= 11x11) to its seed. dflare "
                   "strategies and boundary.")
@click.option("--dx-constraint", type=click.Choice(["lighting", "occlusion", "blackout"]), default=None,
              help="lighting (default: every pixel alike), occlusion (one rectangle) or blackout (small "
                   "rectangles, only darker).")
@click.option("--dx-step", type=FiniteFloat(0, min_open=True), default=None,
              help="8-bit levels per unit of normalised gradient (default 2550: the reference MNIST script's "
                   "s = 10 on 0..1 pixels).")
@click.option("--dx-lambda1", type=FiniteFloat(0), default=None,
              help="Weight of the target model's confidence (default 1).")
@click.option("--dx-lambda2", type=FiniteFloat(0), default=None,
              help="Weight of the not-yet-covered neuron's activation (default 0.1).")
@click.option("--dx-threshold", type=FiniteFloat(0, 1, max_open=True), default=None,
              help="NC threshold on the layer-scaled activation (default 0).")
@click.option("--dx-iterations", type=click.IntRange(1), default=None,
              help="Gradient steps per climb (default 20, the reference's).")
@click.option("--dx-retarget/--dx-no-retarget", default=None,
              help="Climb again toward each other model when a climb fails (default on).")
@click.option("--dx-finer-steps", type=StepList("step", "255"), default=None,
              help="Then climb again with each of these steps (default 255).")
@click.option("--dx-occlusion-at", type=IntPair("occlusion position", "0,0", 0, "ROW,COL"), default=None,
              help="Occlusion: top-left corner (default 0,0).")
@click.option("--dx-occlusion-size", type=IntPair("occlusion size", "10,10", 1), default=None,
              help="Occlusion: the rectangle's size (default 10,10, the reference's).")
@click.option("--dx-blackout-size", type=IntPair("blackout size", "6,6", 1), default=None,
              help="Blackout: each rectangle's size (default 6,6, the reference's).")
@click.option("--dx-blackout-count", type=click.IntRange(1), default=None, metavar="N",
              help="Blackout: rectangles a step (default 1).")
@click.option("--batch", type=click.IntRange(1), default=64, show_default=True,
              help="Seeds searched in lockstep (results do not depend on it, but for int8-dynamic exports).")
@click.option("--overlap/--no-overlap", default=None,
              help="Two shifts of --batch seeds: one at the models while the other searches (default: on when a "
                   "model runs on a GPU). Black-box strategies.")
@click.option("--out-dir", type=WritablePath("dir"), default=None,
              help="Campaign folder, written as seeds finish (default: a new folder under mlflow-di-campaigns/).")
@click.option("--resume", is_flag=True,
              help="Continue the campaign in --out-dir (default: the newest one of the same models, strategy and seed).")
@click.option("--preprocessing-original", default=None, metavar="KEY=VALUE,...", help="Override the original's preprocessing.")
@click.option("--preprocessing-compressed", default=None, metavar="KEY=VALUE,...",
              help="Override the compressed models' preprocessing.")
@click.option("--semantics", type=click.Choice(["host", "reference"]), default="host", show_default=True,
              help="ONNX exports: this CPU's kernels, or the QDQ graph as written.")
@ray_options("the campaign: each loads the models once and searches chunks of --batch seeds (twice that "
             "with --overlap)")
@seed_option
@json_out_option
@device_option
def command(original, compressed, seed_data, num_seeds, timeout, max_queries, strategy, max_linf, min_ssim, batch,
            overlap, out_dir, resume, preprocessing_original, preprocessing_compressed, workers, ray_address,
            cpus_per_worker, gpus_per_worker, seed, json_out, device, semantics="host", **deepxplore) -> None:
    """Search seed images for inputs on which ORIGINAL and COMPRESSED disagree (triggering inputs)."""
    seed_data = seed_data or click.get_current_context().meta.get("--seed-data")
    if not seed_data:
        raise click.UsageError("Missing option '--seed-data'.")
    from mlflow_di.data import load_images
    from mlflow_di.errors import UserError
    from mlflow_di.folder_lock import FolderLock
    from mlflow_di.fuzz.campaign import overlaps_by_default, run_campaigns
    from mlflow_di.fuzz.lockstep import seeds_in_flight
    from mlflow_di.fuzz.device_mutations import mutation_device, with_operators_on
    from mlflow_di.mlflow_edge import datasets, registry, runs
    from mlflow_di.models.device import out_of_memory_as_user_error
    from mlflow_di.models.execution import context_tags
    from mlflow_di.models.loading import load_classifier
    from mlflow_di.models.reference import ModelRef

    compressed = list(compressed)
    repeated = sorted({uri for uri in compressed if compressed.count(uri) > 1})
    if repeated:
        raise UserError(f"--compressed {repeated[0]} is given twice; name each compressed model once")
    search = _strategy(strategy, max_linf, min_ssim, deepxplore)
    white_box = strategy == "deepxplore"
    walk = strategy == "boundary"  # the original white-box, the compressed model black-box
    if (white_box or walk) and overlap:
        raise UserError(f"--overlap applies to the black-box strategies; {strategy} runs its models in its own loop "
                        "(drop --overlap)")
    executor = _executor(workers, ray_address, cpus_per_worker, gpus_per_worker, white_box or walk, strategy)
    original_ref = ModelRef.parse(original)
    compressed_refs = [ModelRef.parse(uri) for uri in compressed]
    if white_box:  # one campaign over every model, with their gradients
        torch_models = [_white_box_model(ref, pre, device) for ref, pre in
                        [(original_ref, preprocessing_original)] + [(r, preprocessing_compressed) for r in compressed_refs]]
        original_model, *compressed_models = [model.classifier() for model in torch_models]
    else:  # boundary: the original white-box (its gradients), the compressed models black-box as for dflare
        if walk:
            torch_original = _white_box_model(original_ref, preprocessing_original, device, "boundary")
            original_model = torch_original.classifier()
        else:
            original_model = load_classifier(original_ref, preprocessing_original, device)
        compressed_models = [load_classifier(ref, preprocessing_compressed, device) for ref in compressed_refs]
        if semantics == "reference":
            compressed_models = [_reference_twin(model, executor) for model in compressed_models]
    mutations_on = None if white_box or walk else mutation_device(original_model, executor)  # a CUDA original's GPU
    overlapping = not (white_box or walk) and (overlap if overlap is not None
                                     else overlaps_by_default(original_model, compressed_models, executor))
    if not walk:
        search = with_operators_on(search, mutations_on)
    raw_seeds = load_images(seed_data)
    seeds = original_model.preprocessing.prepare(raw_seeds)  # lazy: resized per batch if the model says so
    seeds = seeds.subset(slice(0, num_seeds), f"{seeds.name} (first {min(num_seeds, len(seeds))})")
    raw_seeds = raw_seeds.subset(slice(0, num_seeds))
    for role, model in [("original", original_model)] + [(f"compressed {uri}", m) for uri, m in
                                                          zip(compressed, compressed_models)]:
        try:  # fail before any run starts when the seeds do not fit a model
            model.preprocessing.check_images(seeds.images[:1])
        except UserError as exc:
            raise UserError(f"{role} model: {exc}") from None
    constraint = None if white_box else search.options().get("constraint")
    if constraint:
        search.constraint.check_seed(seeds.images[0])
    if white_box:
        search.check_image_shape(seeds.image_shape)
    several = len(compressed) > 1 and not white_box
    label = (f"{strategy}-{search.constraint}" if white_box else strategy) + "".join(f"-{key.replace('_', '')}{value}" for key, value in (constraint or {}).items()
                               if value is not None)
    folder = pathlib.Path(out_dir) if out_dir else default_out_dir(original, ",".join(compressed), label, seed, resume)
    if folder.exists() and any(folder.iterdir()) and not resume:
        raise UserError(f"'{folder}' already holds a campaign; pass --resume to continue it, or --out-dir for a new one")
    # held until the command ends: a second process must not close this one's run as orphaned or append its seeds
    click.get_current_context().call_on_close(FolderLock(
        folder, "the campaign folder", advice="wait for it to finish (or stop it), or pass another --out-dir").acquire().release)
    folders = [export_folder(folder, number, uri, resume) for number, uri in enumerate(compressed)] if several \
        else [folder]
    campaign_tag = {"mlflow_di.campaign": str(folder.resolve())}
    if resume:
        closed = runs.close_orphaned_runs(campaign_tag, "a later --resume of the same campaign")
        if closed:
            click.echo(f"closed {len(closed)} run(s) of this campaign left RUNNING by a killed process (now KILLED)")
    model_tags = registry.model_version_tags(original)
    tags = {"mlflow_di.command": "fuzz", **campaign_tag, **model_tags}
    if constraint:  # the gate reads unconstrained campaigns only (see mlflow_edge.recorded)
        tags["mlflow_di.fuzz_constraint"] = json.dumps(constraint, sort_keys=True)
    # resolved now, before hours of fuzzing: the versions fuzzed, whatever an alias points at later
    compressed_tags = [registry.compressed_model_tags(uri) for uri in compressed]
    if len(compressed) == 1:
        tags.update(compressed_tags[0])
    model_ids = [registry.logged_model_id(uri) for uri in compressed]  # the models the gate judges
    run_name = f"fuzz {original_ref.short} vs {', '.join(ref.short for ref in compressed_refs)}"
    params = {"original": original, "seed_data": seed_data, "num_seeds": len(seeds), "timeout": timeout,
              "max_queries": max_queries, "strategy": strategy, "max_linf": max_linf, "min_ssim": min_ssim,
              "batch": batch, "seed": seed, "resume": resume, "original_runs_on": original_model.provider,
              "workers": workers, **({"ray_address": ray_address} if workers else {}),
              "mutations_on": str(mutations_on or "cpu"), "overlap": overlapping, "semantics": semantics,
              **({f"dx_{key}": value for key, value in search.options().items()} if white_box else {})}
    with runs.tracked_run(run_name, tags=tags) as log:
        log.params({**params, "compressed": ",".join(compressed), "out_dir": str(folder),
                    "compressed_runs_on": ",".join(m.provider for m in compressed_models)})
        click.echo(f"fuzzing {_plural(len(seeds), 'seed')} with {strategy}"
                   + (f" against {len(compressed)} compressed models" if several else "") + f"; campaign folder {folder}")
        click.echo(f"original runs on {original_model.provider}, compressed on "
                   f"{', '.join(sorted({m.provider for m in compressed_models}))}")
        if mutations_on is not None:
            where = " (each Ray worker's own GPU)" if executor is not None else ""
            click.echo(f"noise and median-blur mutations run on {mutations_on}{where}")
        if overlapping:
            click.echo(f"the models' calls overlap the searches: two shifts of up to {batch} seeds"
                       + (" in each Ray worker" if executor is not None else "") + " (--no-overlap: one)")
        if executor is not None:
            click.echo(f"searching on {_plural(workers, 'Ray worker')} ({ray_address}), chunks of "
                       f"{seeds_in_flight(batch, overlapping)} seeds; "
                       "this process writes the campaign folder")
        with out_of_memory_as_user_error("fuzzing", batch):
            if white_box:
                from mlflow_di.fuzz.deepxplore import run_deepxplore

                results = [run_deepxplore(torch_models, seeds, search, timeout=timeout, max_queries=max_queries,
                                          batch=batch, seed=seed, out_dir=folders[0], resume=resume)]
            elif walk:
                from mlflow_di.fuzz.boundary import run_boundary

                results = [run_boundary(torch_original, model, seeds, search, timeout=timeout, max_queries=max_queries,
                                        seed=seed, out_dir=sub, resume=resume)  # one campaign per export
                           for model, sub in zip(compressed_models, folders)]
            else:
                results = run_campaigns(original_model, compressed_models, seeds, strategy=search, timeout=timeout,
                                        max_queries=max_queries, batch=batch, seed=seed, out_dirs=folders,
                                        resume=resume, executor=executor, overlap=overlapping)
        summaries = [{**_summary(result), **_host_only(original_model, model, result)}
                     for model, result in zip(compressed_models, results)]
        # the seeds as the spec loads them; the campaign's fingerprint is theirs unless the original resized them
        known = None if original_model.preprocessing.has_raw_step else results[0].config.seeds_sha256
        lineage = datasets.spec_dataset(raw_seeds, seed_data, first=num_seeds, sha256=known)
        log.input(lineage, "seeds")
        if several:
            for uri, ref, model, result, summary, sub, own_tags, model_id in zip(
                    compressed, compressed_refs, compressed_models, results, summaries, folders, compressed_tags,
                    model_ids):
                with runs.tracked_run(f"fuzz {original_ref.short} vs {ref.short}", tags={**tags, **own_tags},
                                      status="FINISHED" if result.complete else "KILLED") as child:  # nested
                    child.params({**params, "compressed": uri, "out_dir": str(sub), "compressed_runs_on": model.provider})
                    child.tags(context_tags([model]))
                    child.input(lineage, "seeds")
                    _log_campaign(child, result, sub, original, uri, summary, model_id, lineage)
                click.echo(f"{uri}:")
                _print_summary(result, summary, sub)
            comparison = _compare_exports(original_model, compressed, compressed_models, results, summaries)
            log.metrics(comparison["metrics"])
            _log_comparison(log, original, compressed, results, summaries, comparison)
            _print_sharing(comparison)
        else:
            log.tags(context_tags(compressed_models))
            _log_campaign(log, results[0], folder, original, ", ".join(compressed), summaries[0],
                          model_ids[0] if len(compressed) == 1 else None, lineage)
            _print_summary(results[0], summaries[0], folder)
        if not all(result.complete for result in results):  # the run ends KILLED; everything found is logged and on disk
            raise KeyboardInterrupt  # the CLI tells Ctrl-C (130) from SIGTERM (143)
    write_json_out(summaries[0] if not several else {"campaigns": dict(zip(compressed, summaries)),
                                                     **comparison["metrics"]}, json_out)


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


def _executor(workers: int, address: str, cpus: float, gpus: float, white_box: bool = False,
              strategy: str = "deepxplore"):
    """None (search in this process) for ``--workers 0``, else the Ray executor; Ray missing is one line."""
    if not workers:
        return None
    import importlib.util

    from mlflow_di.errors import UserError
    from mlflow_di.fuzz.distributed import RayExecutor

    if white_box:
        raise UserError(f"--workers runs the black-box strategies on Ray; {strategy} runs in this process "
                        "(drop --workers, or use --device cuda for speed)")
    if importlib.util.find_spec("ray") is None:
        raise UserError("--workers needs Ray: pip install 'mlflow-di[ray]' (or run with --workers 0)")
    return RayExecutor(workers=workers, address=address, cpus_per_worker=cpus, gpus_per_worker=gpus)


def _strategy(name: str, max_linf, min_ssim, deepxplore: dict | None = None):
    """The strategy object, with the realism constraint when one is asked for, or DeepXplore's ``--dx-*`` settings."""
    import dataclasses

    from mlflow_di.errors import UserError
    from mlflow_di.fuzz import DFlare
    from mlflow_di.fuzz.realism import Constraint
    from mlflow_di.fuzz.strategies import make_strategy

    strategy = make_strategy(name)
    given = {key[3:]: value for key, value in (deepxplore or {}).items() if value is not None}
    if given and name != "deepxplore":
        raise UserError(f"--dx-{next(iter(given)).replace('_', '-')} is a setting of --strategy deepxplore, not {name}")
    if name == "boundary":
        if max_linf is None and min_ssim is None:
            return strategy
        return dataclasses.replace(strategy, constraint=Constraint(max_linf=max_linf, min_ssim=min_ssim))
    if name == "deepxplore":
        if max_linf is not None or min_ssim is not None:
            raise UserError("--max-linf and --min-ssim work with the dflare strategies; deepxplore keeps its inputs "
                            "realistic with --dx-constraint lighting|occlusion|blackout")
        return dataclasses.replace(strategy, **given)
    if max_linf is None and min_ssim is None:
        return strategy
    if not isinstance(strategy, DFlare):
        raise UserError(f"--max-linf and --min-ssim work with the dflare strategies, not {name}; "
                        "pick --strategy dflare (or a dflare variant)")
    return dataclasses.replace(strategy, constraint=Constraint(max_linf=max_linf, min_ssim=min_ssim))


def _white_box_model(ref, preprocessing, device, strategy: str = "deepxplore"):
    """The white-box PyTorch model of ``ref`` for deepxplore (every model) or boundary (the original);
    a one-line UserError for any other kind."""
    from mlflow_di.errors import UserError
    from mlflow_di.models.loading import load_torch_model, resolve

    advice = ("fuzz the PyTorch model it was made from (a pruned copy: mlflow_di.compression.prune; an int8 one: "
              "mlflow_di.compression.fake_quant.fake_quantize) or pick a black-box strategy such as dflare")
    if strategy == "boundary":
        advice = "give the PyTorch model the export was made from as --original, or pick a black-box strategy such as dflare"
    source = resolve(ref)
    if not source.white_box:
        raise UserError(f"--strategy {strategy} needs the gradients of PyTorch models, but '{ref.uri}' is a "
                        f"{source.kind} model; {advice}")
    try:
        return load_torch_model(source, preprocessing, device)
    except UserError as exc:
        if source.kind != "onnx":
            raise
        # an int8 export's QuantizeLinear, or a damaged file: no white-box view to take gradients of
        raise UserError(f"--strategy {strategy} needs the gradients of PyTorch models, and the onnx model "
                        f"'{ref.uri}' has no white-box view ({exc}); {advice}") from None


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


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def incomplete_note(summary: dict) -> str:
    """What a campaign cut short by its time limit means, in one sentence."""
    return (f"{_plural(summary['timed_out_seeds'], 'seed')} of {summary['fuzzed']} stopped at --timeout (CPU "
            "seconds) before their query budget; no trigger on them is not evidence that none exists (raise "
            "--timeout, or let --max-queries bind)")


def _summary(result) -> dict:
    from mlflow_di.fuzz.realism import Constraint, campaign_budget, distance_summary, realism_summary

    s = result.summary
    own = (result.config.strategy_options or {}).get("constraint")  # DeepXplore's is a name, not a budget
    budget = campaign_budget(Constraint(**own) if isinstance(own, dict) else None)
    return {"success_rate": s.success_rate, "mean_queries": s.mean_queries, "median_queries": s.median_queries,
            "mean_seconds": s.mean_seconds, "triggers": s.triggers, "seeds": s.seeds,
            "already_deviating": s.already_deviating, "fuzzed": s.fuzzed, "strategy": s.strategy,
            # seeds stopped by --timeout (CPU seconds) before their query budget: their "no trigger" is no evidence
            "timed_out_seeds": sum(str(r.stop) == "timeout" for r in result.records),
            "complete": result.complete, **distance_summary(result.records), **_passes(result.records),
            **realism_summary(result.records, s.fuzzed, budget),
            **({"neuron_coverage": result.neuron_coverage} if result.neuron_coverage is not None else {}),
            "operators": {name: {"selected": o.selected, "accepted": o.accepted, "triggered": o.triggered}
                          for name, o in s.operators.items()}}


def _passes(records) -> dict:
    """``mean_original_passes``: the original's forward plus backward passes per fuzzed seed, for the
    strategies that use its gradients (boundary); their ``queries`` count the compressed model only."""
    counted = [r.original_passes for r in records if r.original_passes is not None and not r.already_deviating]
    return {"mean_original_passes": float(sum(counted) / len(counted))} if counted else {}


def _metrics(summary: dict, class_rows: list[dict]) -> dict:
    """What a campaign's run records as metrics: the summary, trigger realism, and success by class."""
    metrics = {k: v for k, v in summary.items() if (k in SUMMARY_METRICS or k.startswith(REALISM_PREFIXES))
               and v is not None}
    if "host_only_triggers" in summary:
        metrics["host_only_triggers"] = summary["host_only_triggers"]
    for row in class_rows:
        metrics[f"class_success_rate.{row['class']}"] = row["success_rate"]
    for role, value in (summary.get("neuron_coverage") or {}).items():  # deepxplore: NC reached per model
        metrics[f"neuron_coverage.{role}"] = value
    return metrics


def _seed_rows(result) -> list[dict]:
    from mlflow_di import reporting as rp

    rows = []
    for r in result.records:
        labels = r.trigger_labels or r.seed_labels
        probabilities = r.trigger_probabilities or r.seed_probabilities
        distances = r.trigger_distances or {}
        rows.append({"seed": r.index, "label": r.label, "success": r.success, "stop": getattr(r.stop, "value", r.stop),
                     "queries": r.queries, "seconds": round(r.seconds, 4), "original_label": labels[0],
                     "compressed_label": labels[1], "original_top1": round(float(probabilities[0]), 4),
                     "compressed_top1": round(float(probabilities[1]), 4),
                     **{key: distances.get(key) for key in ("l0", "l2", "linf", "ssim")},
                     "operators": rp.operator_summary(r.operators),
                     **({"model_labels": ",".join(map(str, r.model_labels)), "target_model": r.target_model}
                        if r.model_labels is not None else {})})
    return rows


#: Triggers logged as the stepped image series ``triggers`` (the grid pages show them all).
TRIGGER_SERIES = 16


def _log_campaign(log, result, folder: pathlib.Path, original: str, compressed: str, summary: dict,
                  model_id: str | None = None, dataset=None) -> None:
    """One campaign's metrics (also on the compressed model's LoggedModel when ``model_id``), files,
    per-seed and per-class tables, trigger grid and series, and HTML report."""
    from mlflow_di import reporting as rp
    from mlflow_di.deviation import matrix_rows
    from mlflow_di.fuzz.per_class import class_rows, trigger_matrix
    from mlflow_di.fuzz.realism import distance_rows

    by_class = class_rows(result.records)
    log.metrics(_metrics(summary, by_class), model_id=model_id, dataset=dataset)
    log.folder(folder, "fuzz/campaign")
    log.json(summary, "fuzz/summary.json")
    rows = _seed_rows(result)
    log.table(rows, "fuzz/seeds.json")
    log.table(by_class, "fuzz/per_class.json")
    html = rp.HtmlReport(f"Differential fuzzing: {original} vs {compressed}",
                         subtitle=f"{summary['strategy']} on {result.config.data}, seed {result.config.seed}")
    html.verdict(None, f"{_plural(summary['triggers'], 'triggering input')} from {_plural(summary['fuzzed'], 'seed')} "
                       f"(success rate {summary['success_rate']:.1%}); "
                       f"{_plural(summary['already_deviating'], 'seed')} already deviated"
                       + (f". INCOMPLETE: {incomplete_note(summary)}" if summary["timed_out_seeds"] else ""))
    html.section("Summary").metrics({k: summary[k] for k in SUMMARY_METRICS}, percent_keys=["success_rate"])
    if summary.get("host_only_triggers"):
        html.paragraph(f"{_plural(summary['host_only_triggers'], 'trigger')} of {summary['triggers']} flip only under "
                       "this host's ONNX Runtime kernels: the same export run with reference semantics (the QDQ graph "
                       "as written) gives the original's label on them (seed indices: "
                       f"{', '.join(map(str, summary['host_only_trigger_indices'][:50]))}). See the run's "
                       "mlflow_di.runtime.* tags for the CPU.")
    if summary["triggers"]:
        _realism_section(html, result, summary)
    if summary.get("neuron_coverage"):
        coverage = {f"neuron_coverage.{role}": value for role, value in summary["neuron_coverage"].items()}
        html.section("Neuron coverage reached").metrics(coverage, percent_keys=list(coverage), caption=(
            f"NC (threshold {result.config.strategy_options.get('threshold')}) of each model over the seeds and the "
            "triggers; one query is one generated input through every model (a forward and backward pass each)"))
    if len(result.triggers):
        pages = _trigger_grid_pages(result)
        log.image(pages[0], "fuzz/trigger_grid.png")
        log.image_series(result.triggers[:TRIGGER_SERIES], "triggers")
        for number, page in enumerate(pages[1:], start=2):
            log.image(page, f"fuzz/trigger_grid_{number}.png")
        html.section("Triggers").gallery(pages, "every trigger: seed | trigger | amplified difference, with both "
                                                "models' labels, the operators applied and the perturbation size")
        log.table(distance_rows(result.records), "fuzz/trigger_distances.json")
        matrix = trigger_matrix(result.records)
        log.table(matrix_rows(matrix), "fuzz/trigger_matrix.json")
        html.section("Triggers by label pair").image(rp.heatmap(
            matrix, [f"original {i}" for i in range(len(matrix))], [f"compressed {j}" for j in range(len(matrix))],
            "labels of the triggering inputs", symmetric=False, colorbar_label="triggers"),
            "row: the original's label on the trigger; column: the compressed model's")
    html.section("By class").table(by_class, caption="seeds by their true label: how often and how quickly a "
                                                     "deviation was found")
    operators = [{"operator": name, **counts} for name, counts in summary["operators"].items()]
    if operators:
        html.section("Operators").table(operators)
    html.section("Per-seed results").table(rows)
    log.text(html.render(), "fuzz/report.html")


def _compare_exports(original_model, compressed: list[str], models: list, results: list, summaries: list) -> dict:
    """Side-by-side rows, what sharing the original saved, and which triggers fool every export.

    Every trigger (found against any export) is shown to the original and every export: a trigger
    *fools* an export when the two disagree on it."""
    import numpy as np

    from mlflow_di.fuzz.fitness import labels_differ

    separate = sum(result.run_stats.inputs for result in results)
    shared = results[0].run_stats.shared_original_inputs
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
    from mlflow_di import reporting as rp

    log.table(comparison["rows"], "fuzz/comparison.json")
    metrics = comparison["metrics"]
    html = rp.HtmlReport(f"Differential fuzzing: {original} vs {len(compressed)} compressed models",
                         subtitle=f"{summaries[0]['strategy']} on {results[0].config.data}, seed {results[0].config.seed}")
    html.verdict(None, f"{metrics['triggers_fooling_all']} of {metrics['triggers_total']} triggers fool every "
                       f"compressed model; the original evaluated {metrics['original_inputs_shared']} images instead "
                       f"of {metrics['original_inputs_separate']} "
                       f"({metrics['original_inputs_saved_fraction']:.1%} saved by sharing its calls)")
    _parent_realism_section(html, compressed, summaries)
    html.section("Side by side").table(comparison["rows"], percent_columns=["success_rate", "realistic_success_rate"],
                                       caption=(
        "one campaign per compressed model (each in its own child run, numbered # here); 'fools #k': the share of "
        "this campaign's triggers on which export #k also disagrees with the original"))
    html.section("Sharing the original's calls").metrics(metrics, percent_keys=["original_inputs_saved_fraction"])
    if comparison["fools_all"].any():  # each row: the seed, then the trigger, from the campaign that found it
        import numpy as np

        seeds = np.concatenate([result.trigger_seeds for result in results])[comparison["fools_all"]]
        triggers = np.concatenate([result.triggers for result in results])[comparison["fools_all"]]
        sources = [number for number, result in enumerate(results, start=1) for _ in range(len(result.triggers))]
        sources = [number for number, fools in zip(sources, comparison["fools_all"]) if fools]
        page = rp.labelled_image_rows([np.stack(pair) for pair in zip(seeds, triggers)],
                                      [f"found against #{number}" for number in sources])
        log.image(page, "fuzz/triggers_fooling_all.png")
        legend = "; ".join(f"#{number} = {uri}" for number, uri in enumerate(compressed, start=1))
        html.section("Triggers that fool every compressed model").image(
            page, f"seed | trigger (at most 24 rows); {legend}")
    log.text(html.render(), "fuzz/report.html")


def _parent_realism_section(html, compressed: list[str], summaries: list[dict]) -> None:
    """The realism of every campaign's triggers, first thing a reviewer sees in the parent report, with
    the same NOISE box as a campaign's own report when most of all the triggers are noise-like."""
    from mlflow_di.fuzz.realism import mostly_noise

    triggers = sum(summary["triggers"] for summary in summaries)
    realistic = sum(summary.get("realistic_triggers", 0) for summary in summaries)
    html.section("How realistic the triggers are")
    if triggers and mostly_noise(realistic, triggers):
        html.verdict(False, f"{realistic} of {_plural(triggers, 'trigger')} over all {len(summaries)} campaigns are "
                            "within the realism budget. Most triggers are noise-like: a reviewer would not call them "
                            "the same image. Rerun with --min-ssim / --max-linf to search inside a budget.",
                     word="NOISE")
    for number, (uri, summary) in enumerate(zip(compressed, summaries), start=1):
        html.paragraph(f"#{number} {uri}: " + (realism_note(summary) if summary["triggers"] else "no trigger") + ".")


def _print_sharing(comparison: dict) -> None:
    metrics = comparison["metrics"]
    click.echo(f"original evaluated {metrics['original_inputs_shared']} images for all campaigns instead of "
               f"{metrics['original_inputs_separate']} ({metrics['original_inputs_saved_fraction']:.1%} saved); "
               f"{metrics['triggers_fooling_all']} of {metrics['triggers_total']} triggers fool every compressed model")


def realism_note(summary: dict) -> str:
    """One sentence: how many triggers are within the realism budget (the report's flag, the printed summary)."""
    from mlflow_di.fuzz.realism import Constraint

    budget = Constraint(max_linf=summary["realism_max_linf"], min_ssim=summary["realism_min_ssim"])
    return (f"{summary['realistic_triggers']} of {_plural(summary['triggers'], 'trigger')} within the realism budget "
            f"({budget.describe()}): realistic success rate {summary['realistic_success_rate']:.1%}")


def _realism_section(html, result, summary: dict) -> None:
    """The triggers' distances to their seeds as distributions, right under the summary, with a
    warning when most triggers are outside the realism budget (noise, not a finding to act on)."""
    from mlflow_di.fuzz.realism import distribution_rows, mostly_noise

    html.section("How realistic the triggers are")
    if mostly_noise(summary["realistic_triggers"], summary["triggers"]):
        html.verdict(False, f"{realism_note(summary)}. Most triggers are noise-like: a reviewer would not call them "
                            "the same image. Rerun with --min-ssim / --max-linf to search inside a budget.",
                     word="NOISE")
    else:
        html.paragraph(realism_note(summary) + ".")
    html.table(distribution_rows(result.records), caption=(
        "over the triggers: ssim = structural similarity to the seed (1 = identical; needs 11x11 images), linf = "
        "largest change in 8-bit levels, l2 = Euclidean distance of pixel/255, l0 = pixels changed"))


def _trigger_grid_pages(result) -> list:
    from mlflow_di import reporting as rp

    by_index = {r.index: r for r in result.records}
    records = [by_index[int(i)] for i in result.trigger_indices]
    return rp.trigger_grid_pages(result.trigger_seeds, result.triggers,
                                 original_labels=[r.trigger_labels[0] for r in records],
                                 compressed_labels=[r.trigger_labels[1] for r in records],
                                 true_labels=[r.label for r in records],
                                 notes=[f"{r.queries} queries" for r in records],
                                 operators=[rp.operator_summary(r.operators) for r in records])


def _print_summary(result, summary: dict, folder: pathlib.Path) -> None:
    state = "done" if result.complete else f"interrupted after {_plural(len(result.records), 'seed')} (resume with --resume)"
    click.echo(f"{state}: {_plural(summary['triggers'], 'trigger')} from {_plural(summary['fuzzed'], 'seed')}, success "
               f"rate {summary['success_rate']:.1%}, {_plural(summary['already_deviating'], 'seed')} already deviating")
    if summary["timed_out_seeds"]:
        click.echo(f"  INCOMPLETE: {incomplete_note(summary)}")
    constrained = sum(str(r.stop) == "constrained" for r in result.records)
    if constrained:
        click.echo(f"  {_plural(constrained, 'seed')} stopped as constrained: no mutant within --max-linf/--min-ssim "
                   "could be found (loosen them to search further)")
    if summary["mean_queries"] is not None:
        click.echo(f"  queries per trigger: mean {summary['mean_queries']:.1f}, median {summary['median_queries']:.0f}; "
                   f"seconds per trigger: mean {summary['mean_seconds']:.3f}")
    if summary.get("mean_original_passes") is not None:
        click.echo(f"  queries count images sent to the compressed model; the original (white-box) ran "
                   f"{summary['mean_original_passes']:.0f} forward/backward passes per seed on average")
    if summary["triggers"]:
        from mlflow_di.fuzz.realism import mostly_noise

        median = ", ".join(f"{key} {summary[f'trigger_{key}_median']:.3g}" for key in ("ssim", "linf")
                           if summary.get(f"trigger_{key}_median") is not None)
        click.echo(f"  realism: {realism_note(summary)}; medians {median}"
                   + ("  <- mostly noise-like" if mostly_noise(summary["realistic_triggers"], summary["triggers"]) else ""))
    if summary.get("host_only_triggers"):
        click.echo(f"  {_plural(summary['host_only_triggers'], 'trigger')} flip only under this host's ONNX Runtime "
                   "kernels (reference semantics agree with the original on them)")
    if summary.get("neuron_coverage"):
        click.echo("  neuron coverage reached (seeds and triggers): " + ", ".join(
            f"{role} {value:.1%}" for role, value in summary["neuron_coverage"].items()))
    click.echo(f"  triggers and per-seed records: {folder} (and the run's fuzz/campaign artifacts)")
