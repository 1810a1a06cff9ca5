"""``mlflow-di describe URI``: what a model is, as mlflow-di sees it."""
from __future__ import annotations

import click

from mlflow_di.commands.options import device_option, preprocessing_option, runtime_option


@click.command("describe")
@click.argument("uri")
@preprocessing_option
@click.option("--set-preprocessing", "set_preprocessing", default=None, metavar="KEY=VALUE,...",
              help="Record this preprocessing (the model's own, with these fields changed) on the registry version, "
                   "once: every later command, the pipeline and the service use it (an option still wins).")
@runtime_option("Show what this runtime computes for an ONNX model")
@device_option
def command(uri: str, preprocessing: str | None, set_preprocessing: str | None, device: str = "auto",
            runtime=None) -> None:
    """Show a model's backend, preprocessing, classes and (for PyTorch) its layers.

    URI is an MLflow model URI (models:/NAME/VERSION, models:/NAME@ALIAS, runs:/...),
    a .onnx/.tflite/.lite/.pt file, or keras:ARCH:FILE.h5.
    """
    from mlflow_di.models import loading

    if preprocessing and set_preprocessing:
        raise click.UsageError("give --preprocessing or --set-preprocessing, not both")
    source = loading.resolve(uri)
    white_box = source.white_box and not source.format.graph and runtime is None  # a graph is listed as its nodes
    override = preprocessing or set_preprocessing
    model = loading.load_torch_model(source, override, device) if white_box else None
    classifier = model.classifier() if white_box else loading.load_classifier(source, override, device, runtime)
    prep = classifier.preprocessing
    if set_preprocessing:
        import numpy as np

        from mlflow_di.mlflow_edge.models import record_preprocessing

        if prep.input_shape:  # the model must run on what is recorded
            classifier.predict_proba(np.zeros((1, *prep.input_shape), np.uint8))
        recorded = record_preprocessing(uri, prep)
        click.echo(f"recorded the preprocessing below on {recorded}; later commands use it")
    origin = "recorded" if set_preprocessing else (
        "the --preprocessing option" if preprocessing else _ORIGINS.get(source.preprocessing_from, _ORIGINS[None]))
    click.echo(f"model:          {uri}")
    click.echo(f"format:         {source.format.title}")
    note = "" if white_box else " (black box)"
    if source.format.graph:  # runs on its runtime; coverage and the other white-box work use its torch view
        note = " (nodes listed below; white-box commands use its view as torch layers)"
    click.echo(f"backend:        {classifier.backend}{note}")
    click.echo(f"runs on:        {classifier.provider}")
    context = getattr(classifier, "execution_context", None)
    if context is not None:  # what the runtime will compute: its version, precision (never silent), the CPU
        click.echo(f"runtime:        {context.describe()}")
    compiled_as = getattr(classifier, "kernels", None)  # a runtime that lists its compiled layers (OpenVINO)
    kernels = compiled_as() if compiled_as is not None else ""
    if kernels:  # fused int8 or float, as the runtime compiled it
        click.echo(f"kernels:        {kernels}")
    click.echo(f"input (HxWxC):  {'x'.join(map(str, prep.input_shape)) if prep.input_shape else 'unknown'}")
    click.echo(f"preprocessing:  x = (raw * {prep.scale:g} - mean {list(prep.mean)}) / std {list(prep.std)}, "
               f"layout {prep.layout}, model outputs {prep.output}")
    click.echo(f"  found in:     {origin}" + (f" ({source.assumed})" if source.assumed and not override else ""))
    if prep.input_shape:
        click.echo(f"classes:        {classifier.num_classes}")
    click.echo("")
    onnx_nodes = source.format.graph  # each row's ONNX node beside the layer name every command uses
    click.echo(f"{'layer':<36} {'type':<22} {'output shape':<16} {'neurons':>8}" + ("  onnx node" if onnx_nodes else ""))
    for name, kind, shape, neurons, node in _layers(source, model, classifier):
        click.echo((f"{name:<36} {kind:<22} {'x'.join(map(str, shape)) or '?':<16} {neurons or '?':>8}"
                    + (f"  {node}" if onnx_nodes else "")).rstrip())


_ORIGINS = {"recorded": "the registry version (recorded with --set-preprocessing)",
            "metadata": "the model's mlflow_di metadata", "signature": "the MLflow signature and input example",
            None: "nowhere: the format's default (an ONNX model's input shape, or pixels / 255)"}


def _layers(source, model, classifier) -> list[tuple[str, str, tuple, int, str]]:
    """(name, type, per-input output shape, neurons, ONNX node) of each layer/op; conv neurons are channels."""
    if model is not None:
        return [(layer.name, layer.type, layer.output_shape, layer.neurons, "") for layer in model.describe_layers()]
    if source.format.graph:
        return _onnx_nodes(source)
    if source.format.lists_operators:
        return [(*row, "") for row in _tflite_ops(classifier)]
    return []


def _onnx_nodes(source) -> list[tuple[str, str, tuple, int, str]]:
    """Every node of an ONNX graph, named by the layer its white-box view makes of it (what coverage, compress and
    the reports call it), else by its own name."""
    import onnx

    from mlflow_di.errors import UserError
    from mlflow_di.models import loading
    from mlflow_di.models.onnx_torch import onnx_layer_names

    try:
        names = onnx_layer_names(loading.load_torch_model(source).module)
    except UserError:  # an operator without a white-box view: the nodes' own names
        names = {}
    graph = onnx.shape_inference.infer_shapes(onnx.load(str(source.path))).graph
    shapes = {
        info.name: tuple(d.dim_value if d.HasField("dim_value") else 0 for d in info.type.tensor_type.shape.dim[1:])
        for info in list(graph.value_info) + list(graph.output)
    }
    rows = []
    for node in graph.node:
        shape = shapes.get(node.output[0], ())
        own = node.name or node.output[0]
        rows.append((names.get(node.name, own), node.op_type, shape, shape[0] if shape else 0, own))  # NCHW
    return rows


def _tflite_ops(classifier) -> list[tuple[str, str, tuple, int]]:
    interpreter = classifier.interpreter
    tensors = {t["index"]: tuple(int(v) for v in t["shape"][1:]) for t in interpreter.get_tensor_details()}
    rows = []
    for op in interpreter._get_ops_details():
        if op["op_name"] == "DELEGATE" or not len(op["outputs"]):
            continue  # delegate nodes are runtime stand-ins for the ops listed above them
        shape = tensors.get(op["outputs"][0], ())
        rows.append((f"op{op['index']}", op["op_name"], shape, shape[-1] if shape else 0))  # NHWC
    return rows
