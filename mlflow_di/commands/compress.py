"""``mlflow-di compress``: compressed ONNX exports of a model, registered with their lineage.

One MLflow run and one registered version per method. Each run logs the accuracy of source
and export on the evaluation data, their top-1 disagreements there, and both sizes; the
version and the logged model carry lineage tags (source URI/version, method, parameters).
"""
from __future__ import annotations

import gzip
import json
import pathlib
import tempfile

import click

from mlflow_di.commands.options import CommaList, device_option, preprocessing_option


@click.command("compress")
@click.option("--model-uri", required=True, help="Source PyTorch model (models:/NAME/VERSION, a .pt file, keras:ARCH:FILE).")
@click.option("--method", "methods", required=True, type=CommaList("mlflow_di.compression.methods:METHODS", "compression method", "METHOD"),
              help="One or more compression methods, comma-separated.")
@click.option("--calib-data", default=None, help="Data spec to calibrate int8-static on (e.g. mnist-train:DIR[0:500]).")
@click.option("--eval-data", default=None, help="Data spec to compare accuracies on (default: --calib-data).")
@click.option("--amount", type=click.FloatRange(0.0, 1.0, max_open=True), default=0.3, show_default=True,
              help="Pruning fraction (prune-l1: of all weights; prune-structured: of each layer's channels).")
@click.option("--register-as", default=None, help="Registered model name (default: <source>-<method>).")
@preprocessing_option
@device_option
def command(model_uri, methods, calib_data, eval_data, amount, register_as, preprocessing, device="cpu") -> list[str]:
    """Export MODEL-URI as compressed ONNX models, register each, and record lineage.

    Export, quantization and pruning run on the CPU; --device is where the source and the exports
    are evaluated. Returns the registered versions' URIs (for callers such as the demo)."""
    from mlflow_di.data import load_images
    from mlflow_di.errors import UserError
    from mlflow_di.mlflow_edge import registry
    from mlflow_di.models.loading import load_torch_model
    from mlflow_di.models.reference import ModelRef

    if "int8-static" in methods and not calib_data:
        raise UserError("int8-static needs calibration data: pass --calib-data SPEC (e.g. mnist-train:DIR[0:500])")
    if register_as and len(methods) > 1:
        raise UserError("--register-as names one model; with several methods leave it out (names are <source>-<method>)")
    ref = ModelRef.parse(model_uri)
    source = load_torch_model(ref, preprocessing)
    prepare = source.preprocessing.prepare  # lazy: resized per batch if the model says so
    calib = prepare(load_images(calib_data)) if calib_data else None
    evaluation = prepare(load_images(eval_data)) if eval_data else calib
    source_tags = registry.model_version_tags(model_uri)
    lineage_base = {"mlflow_di.source_uri": model_uri,
                    "mlflow_di.source_name": source_tags.get("mlflow_di.model_name", ref.base_name),
                    "mlflow_di.source_version": source_tags.get("mlflow_di.model_version", "")}
    registered = []
    for method in methods:
        name = register_as or f"{ref.base_name}-{method}"
        registered.append(_compress_one(source, ref, method, calib, evaluation, amount, name, lineage_base, source_tags,
                                        device))
    return registered


def _compress_one(source, ref, method, calib, evaluation, amount, name, lineage_base, source_tags, device) -> str:
    import mlflow_di
    from mlflow_di.compression import compress
    from mlflow_di.mlflow_edge import models, registry, runs
    from mlflow_di.models.classifier import OnnxClassifier

    with tempfile.TemporaryDirectory(prefix="mlflow-di-compress-") as scratch:
        tags = {"mlflow_di.command": "compress", "mlflow_di.method": method, **source_tags}
        with runs.tracked_run(f"compress {ref.short} {method}", tags=tags) as log:
            result = compress(source.module, source.preprocessing, method, scratch,
                              calib_inputs=calib.images if calib is not None else None, amount=amount)
            params = {"amount": amount} if method.startswith("prune") else {}
            if method == "int8-static":
                params["calib_data"] = calib.name
            log.params({"model_uri": ref.uri, "method": method, **params,
                        "eval_data": evaluation.name if evaluation is not None else "none"})
            compressed = OnnxClassifier(result.path, name=f"{name} ({method})", device=device)
            metrics = _compare(source, compressed, evaluation, device)
            metrics.update(source_size_bytes=result.source_size_bytes, compressed_size_bytes=result.size_bytes,
                           compressed_gzip_bytes=gzip_size(result.path))
            if result.sparsity is not None:
                metrics["sparsity"] = result.sparsity
            log.metrics(metrics)
            log.json(result.to_dict(), "compress/result.json")
            log.text(_report(ref.uri, name, result, metrics), "compress/report.html")
            lineage = {**lineage_base, "mlflow_di.method": method,
                       "mlflow_di.params": json.dumps(result.params, sort_keys=True),
                       "mlflow_di.version": mlflow_di.__version__}
            info = models.log_onnx_model(result.path, compressed.preprocessing, name, lineage)
            version = registry.resolve_version(f"models:/{name}/{info.registered_model_version}")
            registry.write_version_tags(version, lineage)
        _print_summary(method, name, info.registered_model_version, metrics, result)
    return f"models:/{name}/{info.registered_model_version}"


def gzip_size(path) -> int:
    """Bytes of the file gzipped: where pruning's zeros pay off (ONNX stores tensors dense)."""
    return len(gzip.compress(pathlib.Path(path).read_bytes(), compresslevel=6))


def _compare(source, compressed, evaluation, device) -> dict:
    """Accuracy of source and export on ``evaluation`` and how often their top-1 labels differ."""
    import numpy as np

    from mlflow_di.models.device import resolve_device

    if evaluation is None:
        return {}
    try:  # the source goes back to the CPU afterwards: the next method exports and prunes it there
        original = source.to(resolve_device(device)).classifier().predict(evaluation.images)
    finally:
        source.to("cpu")
    exported = compressed.predict(evaluation.images)
    source_accuracy = float(np.mean(original == evaluation.labels))
    compressed_accuracy = float(np.mean(exported == evaluation.labels))
    return {"source_accuracy": source_accuracy, "compressed_accuracy": compressed_accuracy,
            "accuracy_drop": source_accuracy - compressed_accuracy,
            "disagreements": int(np.sum(original != exported)), "eval_images": len(evaluation)}


def _report(model_uri: str, name: str, result, metrics: dict) -> str:
    """Accuracy, agreement, size and what was quantized or pruned, as one self-contained page."""
    from mlflow_di.reporting import HtmlReport

    html = HtmlReport(f"{result.method} export of {model_uri}", subtitle=f"registered as {name}")
    html.section("Metrics").metrics(metrics, percent_keys=[k for k in ("source_accuracy", "compressed_accuracy",
                                                                       "accuracy_drop", "sparsity") if k in metrics])
    html.section("Parameters").code(json.dumps(result.params, indent=2, sort_keys=True))
    if result.quantized_ops:
        html.section("Quantized layers").table([{"layer": layer, "how": how} for layer, how in
                                                result.quantized_ops["quantized_layers"].items()])
    return html.render()


def size_notes(method: str, result, metrics: dict) -> list[str]:
    """Why a compressed file can be no smaller than its source, said where it happens."""
    notes = []
    if method.startswith("prune"):
        notes.append(f"gzipped {metrics['compressed_gzip_bytes'] / 1024:.1f} KiB: ONNX stores pruned weights dense, "
                     "so pruning saves space once the file is compressed (or with a sparse runtime), not on disk")
    elif method.startswith("int8") and result.size_bytes >= result.source_size_bytes:
        notes.append("the int8 file is not smaller: in a model this small, the added Quantize/DequantizeLinear "
                     "nodes and their scales outweigh the 4x smaller weights")
    return notes


def _print_summary(method: str, name: str, version, metrics: dict, result) -> None:
    click.echo(f"{method:<17} -> models:/{name}/{version}")
    if "source_accuracy" in metrics:
        click.echo(f"  accuracy {metrics['source_accuracy']:.2%} -> {metrics['compressed_accuracy']:.2%} "
                   f"({-metrics['accuracy_drop'] * 100 + 0.0:+.2f} points), top-1 differs on {metrics['disagreements']} "
                   f"of {metrics['eval_images']} images")
    click.echo(f"  size {result.source_size_bytes / 1024:.1f} KiB -> {result.size_bytes / 1024:.1f} KiB"
               + (f", sparsity {result.sparsity:.1%}" if result.sparsity is not None else ""))
    for line in size_notes(method, result, metrics):
        click.echo(f"  {line}")
    if result.quantized_ops:
        quantized = result.quantized_ops["quantized_layers"]
        click.echo(f"  quantized layers: " + "; ".join(f"{name.removesuffix('.weight')} ({how})" for name, how in quantized.items()))
        if result.quantized_ops["float_layers"]:
            click.echo(f"  left in float: {', '.join(result.quantized_ops['float_layers'])}")
