"""``mlflow-di generate``: IDC-guided test generation from seed inputs, logged to MLflow.

The fitted IDC model of a coverage run (``--coverage RUN_ID`` or a folder it saved) says which
combinations of the important neurons' clusters the seeds cover; mild mutations of the seeds
(and of inputs kept earlier) that the model still gives the seed's label and that cover a
combination not yet covered are kept, until ``--budget`` mutants have been tried or every
combination is covered (see :mod:`mlflow_di.coverage.generation`). The same budget spent on
random mutations of the seeds is the baseline. The kept inputs are written as an ``npz:`` data
set (logged, and written locally), with the IDC growth of both searches and a preview grid.
"""
from __future__ import annotations

import pathlib

import click

from mlflow_di.commands.options import WritablePath, device_option, json_out_option, preprocessing_option, seed_option
from mlflow_di.commands.output_files import write_json_out

PREVIEW_ROWS = 16
#: Where the generated set is written when --out is not given (one file per run).
DEFAULT_OUT_DIR = "mlflow-di-generated"
NPZ_ARTIFACT = "generation/generated.npz"


@click.command("generate")
@click.option("--model-uri", required=True, help="PyTorch model the coverage run measured: models:/NAME/VERSION, "
                                                 "runs:/..., a .pt file, keras:ARCH:FILE.")
@click.option("--coverage", required=True, metavar="RUN_ID|FOLDER|latest",
              help="A coverage run that measured idc (or the coverage/model folder it saved); latest: the newest "
                   "coverage run of MODEL-URI, a registered version.")
@click.option("--data", "data_spec", required=True, help="Data spec of the seed inputs, e.g. digits[1300:1400].")
@click.option("--budget", type=click.IntRange(1), default=1000, show_default=True,
              help="Mutants to try (model queries) in the guided search, and again in the random baseline.")
@click.option("--num-seeds", type=click.IntRange(1), default=100, show_default=True,
              help="Seed inputs to use: the first of --data.")
@click.option("--layer", default=None, help="IDC layer whose combinations guide the search (default: the coverage "
                                            "run's first).")
@click.option("--max-depth", type=click.IntRange(1), default=3, show_default=True,
              help="Most mutations between a seed and a generated input.")
@click.option("--batch", type=click.IntRange(1), default=64, show_default=True, help="Mutants per model query.")
@click.option("--out", type=WritablePath("file"), default=None,
              help=f"Write the generated set here (an npz: data set; default {DEFAULT_OUT_DIR}/RUN_ID.npz); "
                   f"it is also logged as the run's {NPZ_ARTIFACT}.")
@seed_option
@json_out_option
@preprocessing_option
@device_option
def command(model_uri, coverage, data_spec, budget, num_seeds, layer, max_depth, batch, out, seed, json_out,
            preprocessing, device) -> None:
    """Generate inputs that cover IDC combinations MODEL-URI's seeds leave uncovered."""
    from mlflow_di.commands.coverage import model_on_data
    from mlflow_di.coverage.generation import generate
    from mlflow_di.data import load_images
    from mlflow_di.errors import UserError
    from mlflow_di.mlflow_edge import datasets, registry, runs
    from mlflow_di.mlflow_edge.run_artifacts import coverage_idc
    from mlflow_di.models.device import describe_device, out_of_memory_as_user_error

    ref, coverage, model, raw, data = model_on_data(model_uri, coverage, data_spec, preprocessing, device)
    seeds = data.subset(slice(0, num_seeds), f"{data.name}[0:{num_seeds}]") if num_seeds < len(data) else data
    idc = coverage_idc(coverage, model)
    layer = layer or None  # MLproject passes an empty string for "not given"
    if layer is not None and layer not in idc.fitted_layers_:
        raise UserError(f"the coverage run measured IDC on layer(s) {', '.join(idc.layers_)}, not '{layer}'; "
                        f"leave out --layer or give one of those")
    tags = {"mlflow_di.command": "generate", **registry.model_version_tags(model_uri)}
    with runs.tracked_run(f"generate {ref.short}", tags=tags) as log:
        log.params({"model_uri": model_uri, "coverage": coverage, "data": data_spec, "budget": budget,
                    "num_seeds": len(seeds), "layer": layer or idc.layers_[0], "max_depth": max_depth,
                    "batch": batch, "seed": seed, "device": describe_device(model.device)})
        click.echo(f"generating from {seeds.name} ({len(seeds)} seeds, budget {budget} mutants) on "
                   f"{describe_device(model.device)} ...")
        with out_of_memory_as_user_error("generate", batch):
            result = generate(idc, model, seeds, budget, layer=layer, batch_size=batch, seed=seed,
                              max_depth=max_depth)
        log.metrics(result.metrics())
        summary = {**result.summary(), "data": seeds.name, "coverage": coverage}
        log.json(summary, "generation/summary.json")
        out = out or f"{DEFAULT_OUT_DIR}/{log.run_id}.npz"
        _write_npz(result, out)
        _log_npz(log, out)
        read = [(datasets.spec_dataset(raw.subset(slice(0, len(seeds)), raw.name), data_spec,
                                       first=len(seeds) if len(seeds) < len(raw) else None), "seeds")]
        if len(result.images):  # the written set, reloadable as its npz: spec
            generated = f"npz:{pathlib.Path(out).resolve()}"
            read.append((datasets.spec_dataset(load_images(generated), generated), "generated"))
        log.inputs(read)
        log.table(_kept_rows(result), "generation/kept.json")
        _log_report(log, result, seeds, model.name)
    write_json_out({**summary, "out": out}, json_out)
    _print_summary(result, out)


def _write_npz(result, path: str) -> None:
    """The kept inputs as an ``npz:`` data set (``x``, ``y``; ``seed_index`` says which seed each came from)."""
    import pathlib

    import numpy as np

    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as handle:  # a file object: np.savez would otherwise append ".npz" to other names
        np.savez(handle, x=result.images, y=result.labels, seed_index=result.seed_index)


def _log_npz(log, path: str) -> None:
    import pathlib
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mlflow-di-generate-") as folder:
        shutil.copyfile(path, pathlib.Path(folder) / pathlib.PurePosixPath(NPZ_ARTIFACT).name)
        log.folder(folder, str(pathlib.PurePosixPath(NPZ_ARTIFACT).parent))


def _kept_rows(result) -> list[dict]:
    return [{"input": i, "seed": int(result.seed_index[i]), "label": int(result.labels[i]),
             "operators": result.operators[i], "combination": int(result.combinations[i])}
            for i in range(result.kept)]


def _headline(result) -> str:
    return (f"IDC {result.idc_seeds:.1%} (seeds) -> {result.idc_guided:.1%} guided ({result.kept} inputs kept) vs "
            f"{result.idc_random:.1%} random ({result.random_preserved} label-preserving mutants), "
            f"{result.budget} mutants each, layer {result.layer}, {result.total} combinations")


def _log_report(log, result, seeds, model_name) -> None:
    import numpy as np

    from mlflow_di import reporting as rp

    html = rp.HtmlReport(f"IDC-guided generation for {model_name}", subtitle=f"seeds: {seeds.name}")
    html.verdict(None, _headline(result))
    html.section("Metrics").metrics(result.metrics(), percent_keys=["idc_seeds", "idc_guided", "idc_random"])
    curves = {"guided": np.asarray(result.guided_growth) / result.total,
              "random": np.asarray(result.random_growth) / result.total}
    growth = rp.coverage_growth_plot({k: v for k, v in curves.items() if len(v)},
                                     title=f"IDC growth over the mutants tried (layer {result.layer})",
                                     xlabel="mutants tried (model queries)")
    log.image(growth, "generation/idc_growth.png")
    html.section("IDC growth").image(growth, "IDC of the seeds plus what each search kept, after each mutant tried; "
                                             "guided keeps only mutants covering a new combination, random keeps "
                                             "every label-preserving mutant of the seeds")
    if result.kept:
        preview = _preview(result, seeds)
        log.image(preview, "generation/preview.png")
        html.section("Generated inputs").image(preview, "each row: the seed, then the generated input")
        html.table(_kept_rows(result))
    else:
        html.section("Generated inputs").paragraph("No mutant covered a new combination within the budget.")
    log.text(html.render(), "generation/report.html")


def _preview(result, seeds):
    import numpy as np

    from mlflow_di import reporting as rp

    shown = range(min(result.kept, PREVIEW_ROWS))
    rows = [np.stack([np.asarray(seeds.images[int(result.seed_index[i])]), result.images[i]]) for i in shown]
    captions = [f"seed {int(result.seed_index[i])}, label {int(result.labels[i])}: {result.operators[i]}"
                for i in shown]
    return rp.labelled_image_rows(rows, captions, max_rows=PREVIEW_ROWS)


def _print_summary(result, out: str) -> None:
    click.echo(_headline(result))
    click.echo(f"  generated set: {out} (use it as --data npz:{out}); logged as {NPZ_ARTIFACT}")
