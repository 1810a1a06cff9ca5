"""``mlflow-di compress``: compressed ONNX exports of a model, registered with their lineage.

One MLflow run and one registered version per method. Each run logs the accuracy of source
and export on the evaluation data, their top-1 disagreements there, and both sizes; the
version and the logged model carry lineage tags (source URI/version, method, parameters).
"""
from __future__ import annotations

import json
import pathlib
import tempfile

import click
import mlflow
import numpy as np

import mlflow_di
from mlflow_di import tracking
from mlflow_di.data import ImageSet, load_images
from mlflow_di.errors import UserError
from mlflow_di.models.classifier import OnnxClassifier
from mlflow_di.models.loading import load_torch_model
from mlflow_di.registry import model_version_tags

METHOD_HELP = "fp32, int8-static, int8-dynamic, prune-l1, prune-structured"


def parse_methods(text: str) -> list[str]:
    """``"int8-static,prune-l1"`` -> a checked list of methods."""
    from mlflow_di.compress import check_method

    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise UserError(f"--method is empty; give one or more of {METHOD_HELP}, comma-separated")
    return [check_method(m) for m in methods]


@click.command("compress")
@click.option("--model-uri", required=True, help="Source PyTorch model (models:/NAME/VERSION, a .pt file, keras:ARCH:FILE).")
@click.option("--method", "methods", required=True, metavar="METHOD[,METHOD...]", help=f"One or more of {METHOD_HELP}.")
@click.option("--calib-data", default=None, help="Data spec to calibrate int8-static on (e.g. mnist:DIR[0:500]).")
@click.option("--eval-data", default=None, help="Data spec to compare accuracies on (default: --calib-data).")
@click.option("--amount", type=click.FloatRange(0.0, 1.0, max_open=True), default=0.3, show_default=True,
              help="Pruning fraction (prune-l1: of all weights; prune-structured: of each layer's channels).")
@click.option("--register-as", default=None, help="Registered model name (default: <source>-<method>).")
@click.option("--preprocessing", default=None, metavar="KEY=VALUE,...", help="Override the source's preprocessing.")
def command(model_uri, methods, calib_data, eval_data, amount, register_as, preprocessing) -> list[str]:
    """Export MODEL-URI as compressed ONNX models, register each, and record lineage.

    Returns the registered versions' URIs (for callers such as the demo)."""
    methods = parse_methods(methods)
    if "int8-static" in methods and not calib_data:
        raise UserError("int8-static needs calibration data: pass --calib-data SPEC (e.g. mnist:DIR[0:500])")
    if register_as and len(methods) > 1:
        raise UserError("--register-as names one model; with several methods leave it out (names are <source>-<method>)")
    source = load_torch_model(model_uri, preprocessing)
    calib = load_images(calib_data) if calib_data else None
    evaluation = load_images(eval_data) if eval_data else calib
    lineage_base = {"mlflow_di.source_uri": model_uri, **_source_tags(model_uri)}
    registered = []
    for method in methods:
        name = register_as or f"{source_model_name(model_uri)}-{method}"
        registered.append(_compress_one(source, model_uri, method, calib, evaluation, amount, name, lineage_base))
    return registered


def source_model_name(uri: str) -> str:
    """A readable base name for exports: the registered name, the Keras arch or the file stem."""
    if uri.startswith("models:/"):
        return uri[len("models:/"):].split("/")[0].split("@")[0]
    if uri.startswith("keras:"):
        return uri.split(":")[1]
    return pathlib.Path(uri).stem


def _source_tags(uri: str) -> dict:
    tags = model_version_tags(uri)
    return {"mlflow_di.source_name": tags.get("mlflow_di.model_name", source_model_name(uri)),
            "mlflow_di.source_version": tags.get("mlflow_di.model_version", "")}


def _compress_one(source, model_uri, method, calib: ImageSet | None, evaluation: ImageSet | None,
                  amount, name, lineage_base) -> str:
    from mlflow_di.compress import compress

    with tempfile.TemporaryDirectory(prefix="mlflow-di-compress-") as scratch:
        tags = {"mlflow_di.command": "compress", "mlflow_di.method": method, **model_version_tags(model_uri)}
        with tracking.tracked_run(f"compress-{method}", tags=tags):
            result = compress(source.module, source.preprocessing, method, scratch,
                              calib_inputs=calib.images if calib is not None else None, amount=amount)
            params = {"amount": amount} if method.startswith("prune") else {}
            if method == "int8-static":
                params["calib_data"] = calib.name
            tracking.log_params({"model_uri": model_uri, "method": method, **params,
                               "eval_data": evaluation.name if evaluation is not None else "none"})
            compressed = OnnxClassifier(result.path, name=f"{name} ({method})")
            metrics = _compare(source, compressed, evaluation)
            metrics.update(source_size_bytes=result.source_size_bytes, compressed_size_bytes=result.size_bytes)
            if result.sparsity is not None:
                metrics["sparsity"] = result.sparsity
            mlflow.log_metrics(metrics)
            mlflow.log_dict(result.to_dict(), "compress/result.json")
            mlflow.log_text(_report(model_uri, name, result, metrics), "compress/report.html")
            lineage = {**lineage_base, "mlflow_di.method": method, "mlflow_di.params": json.dumps(result.params, sort_keys=True),
                       "mlflow_di.version": mlflow_di.__version__}
            info = _log_onnx(result.path, compressed, name, lineage)
            for key, value in lineage.items():
                mlflow.MlflowClient().set_model_version_tag(name, info.registered_model_version, key, value)
        _print_summary(method, name, info.registered_model_version, metrics, result)
    return f"models:/{name}/{info.registered_model_version}"


def _compare(source, compressed: OnnxClassifier, evaluation: ImageSet | None) -> dict:
    """Accuracy of source and export on ``evaluation`` and how often their top-1 labels differ."""
    if evaluation is None:
        return {}
    original = source.classifier().predict(evaluation.images)
    exported = compressed.predict(evaluation.images)
    source_accuracy = float(np.mean(original == evaluation.labels))
    compressed_accuracy = float(np.mean(exported == evaluation.labels))
    return {"source_accuracy": source_accuracy, "compressed_accuracy": compressed_accuracy,
            "accuracy_drop": source_accuracy - compressed_accuracy,
            "disagreements": int(np.sum(original != exported)), "eval_images": len(evaluation)}


def _report(model_uri: str, name: str, result, metrics: dict) -> str:
    """Accuracy, agreement, size and what was quantized or pruned, as one self-contained page."""
    from mlflow_di.report import HtmlReport

    html = HtmlReport(f"{result.method} export of {model_uri}", subtitle=f"registered as {name}")
    html.section("Metrics").metrics(metrics, percent_keys=[k for k in ("source_accuracy", "compressed_accuracy",
                                                                       "accuracy_drop", "sparsity") if k in metrics])
    html.section("Parameters").code(json.dumps(result.params, indent=2, sort_keys=True))
    if result.quantized_ops:
        html.section("Quantized layers").table([{"layer": layer, "how": how} for layer, how in
                                                result.quantized_ops["quantized_layers"].items()])
    return html.render()


def _log_onnx(path: str, compressed: OnnxClassifier, name: str, lineage: dict):
    import onnx

    metadata = {"mlflow_di": {"preprocessing": compressed.preprocessing.to_dict(), **{
        key.removeprefix("mlflow_di."): value for key, value in lineage.items()}}}
    try:
        return mlflow.onnx.log_model(onnx.load(path), name="model", registered_model_name=name, metadata=metadata,
                                     tags=lineage, pip_requirements=["onnx", "onnxruntime"],
                                     save_as_external_data=False)
    except mlflow.exceptions.MlflowException as exc:
        raise UserError(f"cannot log/register '{name}' at {mlflow.get_tracking_uri()}: {exc.message.splitlines()[0]}") from None


def _print_summary(method: str, name: str, version, metrics: dict, result) -> None:
    click.echo(f"{method:<17} -> models:/{name}/{version}")
    if "source_accuracy" in metrics:
        click.echo(f"  accuracy {metrics['source_accuracy']:.2%} -> {metrics['compressed_accuracy']:.2%} "
                   f"({-metrics['accuracy_drop'] * 100 + 0.0:+.2f} points), top-1 differs on {metrics['disagreements']} "
                   f"of {metrics['eval_images']} images")
    click.echo(f"  size {result.source_size_bytes / 1024:.1f} KiB -> {result.size_bytes / 1024:.1f} KiB"
               + (f", sparsity {result.sparsity:.1%}" if result.sparsity is not None else ""))
    if result.quantized_ops:
        quantized = result.quantized_ops["quantized_layers"]
        click.echo(f"  quantized layers: " + "; ".join(f"{name.removesuffix('.weight')} ({how})" for name, how in quantized.items()))
        if result.quantized_ops["float_layers"]:
            click.echo(f"  left in float: {', '.join(result.quantized_ops['float_layers'])}")
