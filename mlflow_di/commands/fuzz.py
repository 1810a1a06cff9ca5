"""``mlflow-di fuzz``: DFlare (or a baseline) on a model and its compressed version, logged to MLflow.

The campaign writes every finished seed to ``--out-dir`` as it goes, so Ctrl-C, SIGTERM or a
crash keeps every trigger found; ``--resume`` continues the campaign in that folder (and closes
the run a ``kill -9`` left RUNNING). Whatever was found is logged to the MLflow run before it
ends (KILLED when interrupted).
"""
from __future__ import annotations

import pathlib
import re
import time

import click

from mlflow_di.commands.options import (LazyChoice, WritablePath, device_option, json_out_option, seed_option,
                                        write_json_out)

SUMMARY_METRICS = ("success_rate", "mean_queries", "median_queries", "mean_seconds", "triggers", "seeds",
                   "already_deviating")
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


@click.command("fuzz")
@click.option("--original", required=True, help="The original model (any backend: models:/..., .onnx, .tflite, .pt, keras:...).")
@click.option("--compressed", required=True, help="Its compressed version (any backend).")
@click.option("--seed-data", "seed_data", required=True, help="Data spec of the seed images, e.g. mnist-test:DIR.")
@click.option("--num-seeds", type=click.IntRange(1), default=500, show_default=True, help="Use the first N seed images.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), default=180.0, show_default=True,
              help="Seconds per seed before giving up.")
@click.option("--max-queries", type=click.IntRange(1), default=None, help="Queries per seed before giving up.")
@click.option("--strategy", type=LazyChoice("mlflow_di.fuzz.strategies:STRATEGIES", "strategy"), default="dflare",
              show_default=True, help="dflare (DFlare steering by the original's log-probability margin: far fewer "
                                      "queries), dflare-paper (the paper's fitness), their ablations -d (no novelty) "
                                      "and -r (random operator), or diffchaser.")
@click.option("--batch", type=click.IntRange(1), default=64, show_default=True,
              help="Seeds searched in lockstep (results do not depend on it).")
@click.option("--out-dir", type=WritablePath("dir"), default=None,
              help="Campaign folder, written as seeds finish (default: a new folder under mlflow-di-campaigns/).")
@click.option("--resume", is_flag=True,
              help="Continue the campaign in --out-dir (default: the newest one of the same models, strategy and seed).")
@click.option("--preprocessing-original", default=None, metavar="KEY=VALUE,...", help="Override the original's preprocessing.")
@click.option("--preprocessing-compressed", default=None, metavar="KEY=VALUE,...", help="Override the compressed model's preprocessing.")
@seed_option
@json_out_option
@device_option
def command(original, compressed, seed_data, num_seeds, timeout, max_queries, strategy, batch, out_dir, resume,
            preprocessing_original, preprocessing_compressed, seed, json_out, device) -> None:
    """Search seed images for inputs on which ORIGINAL and COMPRESSED disagree (triggering inputs)."""
    from mlflow_di.data import load_images
    from mlflow_di.errors import UserError
    from mlflow_di.fuzz.campaign import run_campaign
    from mlflow_di.mlflow_edge import registry, runs
    from mlflow_di.models.device import out_of_memory_as_user_error
    from mlflow_di.models.loading import load_classifier
    from mlflow_di.models.reference import ModelRef

    original_ref, compressed_ref = ModelRef.parse(original), ModelRef.parse(compressed)
    original_model = load_classifier(original_ref, preprocessing_original, device)
    compressed_model = load_classifier(compressed_ref, preprocessing_compressed, device)
    seeds = original_model.preprocessing.prepare(load_images(seed_data))  # lazy: resized per batch if the model says so
    seeds = seeds.subset(slice(0, num_seeds), f"{seeds.name} (first {min(num_seeds, len(seeds))})")
    for role, model in (("original", original_model), ("compressed", compressed_model)):
        try:  # fail before any run starts when the seeds do not fit a model
            model.preprocessing.check_images(seeds.images[:1])
        except UserError as exc:
            raise UserError(f"{role} model: {exc}") from None
    folder = pathlib.Path(out_dir) if out_dir else default_out_dir(original, compressed, strategy, seed, resume)
    if folder.exists() and any(folder.iterdir()) and not resume:
        raise UserError(f"'{folder}' already holds a campaign; pass --resume to continue it, or --out-dir for a new one")
    campaign_tag = {"mlflow_di.campaign": str(folder.resolve())}
    if resume:
        closed = runs.close_orphaned_runs(campaign_tag, "a later --resume of the same campaign")
        if closed:
            click.echo(f"closed {len(closed)} run(s) of this campaign left RUNNING by a killed process (now KILLED)")
    tags = {"mlflow_di.command": "fuzz", **campaign_tag, **registry.model_version_tags(original),
            **registry.compressed_model_tags(compressed)}
    run_name = f"fuzz {original_ref.short} vs {compressed_ref.short}"
    with runs.tracked_run(run_name, tags=tags) as log:
        log.params({"original": original, "compressed": compressed, "seed_data": seed_data, "num_seeds": len(seeds),
                    "timeout": timeout, "max_queries": max_queries, "strategy": strategy, "batch": batch,
                    "seed": seed, "out_dir": str(folder), "resume": resume,
                    "original_runs_on": original_model.provider, "compressed_runs_on": compressed_model.provider})
        click.echo(f"fuzzing {_plural(len(seeds), 'seed')} with {strategy}; campaign folder {folder}")
        click.echo(f"original runs on {original_model.provider}, compressed on {compressed_model.provider}")
        with out_of_memory_as_user_error("fuzzing", batch):
            result = run_campaign(original_model, compressed_model, seeds, strategy=strategy, timeout=timeout,
                                  max_queries=max_queries, batch=batch, seed=seed, out_dir=folder, resume=resume)
        summary = _summary(result)
        log.metrics({k: v for k, v in summary.items() if k in SUMMARY_METRICS})
        _log_artifacts(log, result, folder, original, compressed, summary)
        _print_summary(result, summary, folder)
        if not result.complete:  # the run ends KILLED; everything found so far is logged and on disk
            raise KeyboardInterrupt  # the CLI tells Ctrl-C (130) from SIGTERM (143)
    write_json_out(summary, json_out)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _summary(result) -> dict:
    s = result.summary
    return {"success_rate": s.success_rate, "mean_queries": s.mean_queries, "median_queries": s.median_queries,
            "mean_seconds": s.mean_seconds, "triggers": s.triggers, "seeds": s.seeds,
            "already_deviating": s.already_deviating, "fuzzed": s.fuzzed, "strategy": s.strategy,
            "complete": result.complete,
            "operators": {name: {"selected": o.selected, "accepted": o.accepted, "triggered": o.triggered}
                          for name, o in s.operators.items()}}


def _seed_rows(result) -> list[dict]:
    from mlflow_di import reporting as rp

    rows = []
    for r in result.records:
        labels = r.trigger_labels or r.seed_labels
        probabilities = r.trigger_probabilities or r.seed_probabilities
        rows.append({"seed": r.index, "label": r.label, "success": r.success, "stop": getattr(r.stop, "value", r.stop),
                     "queries": r.queries, "seconds": round(r.seconds, 4), "original_label": labels[0],
                     "compressed_label": labels[1], "original_top1": round(float(probabilities[0]), 4),
                     "compressed_top1": round(float(probabilities[1]), 4), "operators": rp.operator_summary(r.operators)})
    return rows


def _log_artifacts(log, result, folder: pathlib.Path, original: str, compressed: str, summary: dict) -> None:
    """Campaign files, per-seed table, trigger grid and the HTML report, for review in the MLflow UI."""
    from mlflow_di import reporting as rp

    log.folder(folder, "fuzz/campaign")
    log.json(summary, "fuzz/summary.json")
    rows = _seed_rows(result)
    log.table(rows, "fuzz/seeds.json")
    html = rp.HtmlReport(f"Differential fuzzing: {original} vs {compressed}",
                         subtitle=f"{summary['strategy']} on {result.config.data}, seed {result.config.seed}")
    html.verdict(None, f"{_plural(summary['triggers'], 'triggering input')} from {_plural(summary['fuzzed'], 'seed')} "
                       f"(success rate {summary['success_rate']:.1%}); "
                       f"{_plural(summary['already_deviating'], 'seed')} already deviated")
    html.section("Summary").metrics({k: summary[k] for k in SUMMARY_METRICS}, percent_keys=["success_rate"])
    if len(result.triggers):
        pages = _trigger_grid_pages(result)
        log.image(pages[0], "fuzz/trigger_grid.png")
        for number, page in enumerate(pages[1:], start=2):
            log.image(page, f"fuzz/trigger_grid_{number}.png")
        html.section("Triggers").gallery(pages, "every trigger: seed | trigger | amplified difference, with both "
                                                "models' labels, the operators applied and the perturbation size")
    operators = [{"operator": name, **counts} for name, counts in summary["operators"].items()]
    if operators:
        html.section("Operators").table(operators)
    html.section("Per-seed results").table(rows)
    log.text(html.render(), "fuzz/report.html")


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
    if summary["mean_queries"] is not None:
        click.echo(f"  queries per trigger: mean {summary['mean_queries']:.1f}, median {summary['median_queries']:.0f}; "
                   f"seconds per trigger: mean {summary['mean_seconds']:.3f}")
    click.echo(f"  triggers and per-seed records: {folder} (and the run's fuzz/campaign artifacts)")
