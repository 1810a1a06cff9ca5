"""``mlflow.models.evaluate(..., evaluators=["mlflow_di"])``: IDC (and DFlare against a compressed model)
as an MLflow model evaluator plugin.

Registered under the ``mlflow.model_evaluator`` entry point as ``mlflow_di``. Usage::

    mlflow.models.evaluate(
        "models:/lenet5/1", data=pixels_df, targets="label", model_type="classifier",
        evaluators=["mlflow_di"],                      # add "default" for MLflow's accuracy metrics
        evaluator_config={"mlflow_di": {"input_shape": (28, 28, 1), "top_m": 6,
                                        "compressed_model_uri": "models:/lenet5-int8/1"}})

The data has one row per image of raw pixel values (0..255, H*W*C columns in HWC order); the
labels come from ``targets``. IDC is fitted on ``train_data`` (a data spec such as
``mnist-train:DIR[0:5000]``) or, without it, on the first ``train_fraction`` of the evaluation rows,
and scored on the rest. With ``compressed_model_uri``, the first ``fuzz_seeds`` scored images seed
a ``fuzz_strategy`` campaign (DFlare by default, ``boundary`` for a search inside a realism budget) of
the evaluated model against the compressed one, ``fuzz_max_queries`` per seed.

The evaluator never runs uninvited: MLflow asks ``can_evaluate`` with only the model type and
this evaluator's config (not whether it was named), so it runs for classifiers whose config
holds at least one of its keys (:data:`CONFIG_KEYS`), e.g. ``input_shape``. Metric keys start
with ``mlflow_di/`` so they never collide with MLflow's own, and each is logged once: when
``evaluate`` knows the model's id it logs every returned metric itself (linked to model and
dataset), so the evaluator only logs them when there is no model id.

The model must be white-box: a ``pytorch``-flavor model, as MLflow logs it by default (pt2) or
pickled (set ``MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true`` so that MLflow itself loads a pickle),
an ``onnx``-flavor model (its white-box view, :mod:`mlflow_di.models.onnx_torch`), or a python
model with a ``torch_model`` attribute (a :class:`TorchModel`). A logged model is
opened by mlflow-di's own loader from its LoggedModel (``models:/<model_id>``), so pt2 models are
white-box and the preprocessing comes from where the CLI finds it (the ``mlflow_di`` block, or
MLflow's signature and input example; ``preprocessing`` in the config overrides it).
"""
from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
from mlflow.models.evaluation.base import EvaluationResult, ModelEvaluator

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.fuzz import strategies
from mlflow_di.fuzz.contract import DEFAULT_TIMEOUT
from mlflow_di.models.metadata import ModelMetadata
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.device import check_device_spec, resolve_device
from mlflow_di.models.torch_model import TorchModel

_logger = logging.getLogger(__name__)
METRIC_PREFIX = "mlflow_di/"


@dataclasses.dataclass
class EvaluatorConfig:
    """The ``evaluator_config`` keys the ``mlflow_di`` evaluator reads (all optional but one to opt in)."""

    input_shape: tuple[int, int, int] | None = None  # (H, W, C); default: the model's stored input shape
    preprocessing: str | None = None  # override of the stored preprocessing, e.g. "scale=1"
    train_data: str | None = None  # data spec IDC is fitted on; default: split the evaluation data
    train_fraction: float = 0.5  # share of the evaluation rows used for fitting when train_data is None
    layer: str | None = None
    top_m: int = 6
    clusters: tuple[int, ...] = (2, 3, 4)
    rule: str = "epsilon"
    seed: int = 0
    compressed_model_uri: str | None = None
    fuzz_seeds: int = 50
    fuzz_strategy: str = strategies.DEFAULT
    fuzz_timeout: float = DEFAULT_TIMEOUT  # CPU seconds per seed: a safety net, the budget is fuzz_max_queries
    fuzz_max_queries: int | None = 1000
    device: str = "auto"  # where the PyTorch model runs: auto (CUDA when available), cpu, cuda, cuda:N
    batch_size: int = 256  # images per forward pass; lower it if the GPU runs out of memory

    @classmethod
    def from_dict(cls, values: dict) -> "EvaluatorConfig":
        ignored = sorted(set(values) - set(CONFIG_KEYS))
        if ignored:  # a flat config is shared by every evaluator, so other evaluators' keys are normal
            _logger.info("mlflow_di evaluator ignores config keys %s", ignored)
        config = cls(**{key: values[key] for key in CONFIG_KEYS if key in values})
        if config.input_shape is not None:
            config.input_shape = tuple(int(v) for v in config.input_shape)
            if len(config.input_shape) != 3:
                raise UserError(f"input_shape must be (H, W, C), got {values['input_shape']!r}")
        if config.layer is not None and (not isinstance(config.layer, str) or config.layer == "all"):
            raise UserError(f"layer must name one layer (the evaluator reports one IDC), got {config.layer!r}; "
                            "use `mlflow-di coverage --layers all` for every layer")
        if not 0 < config.train_fraction < 1:
            raise UserError(f"train_fraction must be between 0 and 1, got {config.train_fraction}")
        config.clusters = tuple(config.clusters)
        config.device = check_device_spec(config.device)
        return config


CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(EvaluatorConfig))


class DeepImportanceEvaluator(ModelEvaluator):
    """Importance-driven coverage and differential fuzzing as MLflow evaluation metrics."""

    @classmethod
    def can_evaluate(cls, *, model_type, evaluator_config, **kwargs) -> bool:
        return model_type == "classifier" and any(key in (evaluator_config or {}) for key in CONFIG_KEYS)

    def evaluate(self, *, model_type, dataset, run_id, evaluator_config, model=None, extra_metrics=None,
                 custom_artifacts=None, predictions=None, **kwargs) -> EvaluationResult:
        from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException

        try:
            metrics, texts = evaluate_images(model, dataset, EvaluatorConfig.from_dict(evaluator_config or {}))
        except UserError as exc:  # MLflow callers expect MlflowException for bad input
            raise MlflowException(f"mlflow_di evaluator: {exc}", error_code=INVALID_PARAMETER_VALUE) from None
        artifacts = _log(run_id, metrics, texts, dataset, log_metrics=kwargs.get("model_id") is None)
        return EvaluationResult(metrics=metrics, artifacts=artifacts, run_id=run_id)


def evaluate_images(model, dataset, config: EvaluatorConfig) -> tuple[dict, dict]:
    """The metrics (``mlflow_di/...``) and JSON artifacts (path -> text) of one evaluation."""
    from mlflow_di.coverage.idc import ImportanceDrivenCoverage

    torch_model = white_box_model(model, config).to(resolve_device(config.device))
    # the model's raw-image step (resize/center_crop) applies to the rows and to train_data alike
    data = torch_model.preprocessing.prepare(image_set(dataset, config.input_shape or
                                                       torch_model.preprocessing.input_shape))
    train, test = _analysis_split(data, config, torch_model.preprocessing)
    coverage = ImportanceDrivenCoverage(layers=config.layer, top_m=config.top_m, clusters=config.clusters,
                                        rule=config.rule, seed=config.seed, batch_size=config.batch_size,
                                        progress=False).fit(torch_model, train)
    report = coverage.score(test)
    metrics = {"idc": report.idc, "idc_covered": report.covered, "idc_total": report.total,
               "idc_fit_images": len(train), "idc_scored_images": len(test)}
    texts = {"coverage_model.json": coverage.to_json()}
    if config.compressed_model_uri:
        fuzz_metrics, summary = _fuzz(torch_model, test, config)
        metrics.update(fuzz_metrics)
        texts["fuzz_summary.json"] = summary
    return {METRIC_PREFIX + key: float(value) for key, value in metrics.items()}, texts


def white_box_model(model, config: EvaluatorConfig) -> TorchModel:
    """The PyTorch module behind an MLflow pyfunc model, with its mlflow-di preprocessing."""
    if model is None:
        raise UserError("needs a model (IDC looks inside it); static predictions cannot be evaluated")
    python_model = _python_model(model)
    model_id = getattr(getattr(model, "metadata", None), "model_id", None)
    if isinstance(getattr(python_model, "torch_model", None), TorchModel):
        torch_model = python_model.torch_model
    elif model_id and {"pytorch", "onnx"} & set(getattr(model.metadata, "flavors", None) or {}):
        from mlflow_di.models.loading import load_torch_model

        return load_torch_model(f"models:/{model_id}", config.preprocessing)
    else:
        try:
            module = model.get_raw_model()
        except (NotImplementedError, AttributeError):
            module = None
        stored = ModelMetadata.from_mlflow(getattr(model.metadata, "metadata", None)).preprocessing
        try:
            torch_model = TorchModel(module, stored or Preprocessing(), name="evaluated model")
        except UserError:
            raise UserError("needs a white-box model: log it with mlflow.pytorch.log_model or mlflow.onnx.log_model, "
                            "or give a python model a `torch_model` attribute") from None
    if config.preprocessing:
        torch_model = dataclasses.replace(torch_model, preprocessing=torch_model.preprocessing.override(config.preprocessing))
    return torch_model


def _python_model(model):
    try:
        return model.unwrap_python_model()
    except Exception:  # any non-python-model flavor refuses in its own way
        return None


def image_set(dataset, input_shape) -> ImageSet:
    """The evaluation rows (raw pixels, HWC order) as uint8 images of ``input_shape``."""
    if input_shape is None:
        raise UserError("set input_shape (H, W, C) in evaluator_config: the model does not record it")
    features = np.asarray(dataset.features_data, dtype=np.float64)
    if dataset.labels_data is None:
        raise UserError("pass the labels with targets=...")
    height, width, channels = input_shape
    if features.ndim != 2 or features.shape[1] != height * width * channels:
        raise UserError(f"expected one row of {height}*{width}*{channels} = {height * width * channels} pixels per "
                        f"image, got data of shape {features.shape}")
    if features.min(initial=0) < 0 or features.max(initial=0) > 255 or not np.all(features == np.round(features)):
        raise UserError("pixel values must be raw integers 0..255 (the model's preprocessing scales them)")
    images = features.astype(np.uint8).reshape(-1, height, width, channels)
    return ImageSet(images, np.asarray(dataset.labels_data).astype(np.int64), getattr(dataset, "name", "evaluation"))


def _analysis_split(data: ImageSet, config: EvaluatorConfig, preprocessing: Preprocessing) -> tuple[ImageSet, ImageSet]:
    if config.train_data:
        from mlflow_di.data import load_images

        return preprocessing.prepare(load_images(config.train_data)), data
    n_fit = int(round(len(data) * config.train_fraction))
    if n_fit < 1 or n_fit >= len(data):
        raise UserError(f"cannot split {len(data)} evaluation images into fit and score parts; "
                        "give more data or set train_data")
    return data.split(n_fit)


def _fuzz(torch_model: TorchModel, test: ImageSet, config: EvaluatorConfig) -> tuple[dict, str]:
    """``fuzz_strategy``'s campaign (DFlare by default) from the first scored images, plus top-1 disagreements on
    all of them. It runs through :func:`mlflow_di.fuzz.run`; the strategy's declaration says how it sees the
    models (the evaluated model white-box for the boundary walk), and one that needs a white-box compressed
    model is refused in one line."""
    from mlflow_di.fuzz import run
    from mlflow_di.fuzz.contract import Access, Campaign
    from mlflow_di.fuzz.strategies import declaration, declarations
    from mlflow_di.models.loading import load_classifier

    declared = declaration(config.fuzz_strategy)
    if declared.compressed is Access.WHITE_BOX:
        raise UserError(f"fuzz_strategy {declared.name} needs a white-box compressed model, and the evaluator "
                        "queries compressed_model_uri as a black box; choose a black-box strategy: "
                        + ", ".join(d.name for d in declarations() if d.compressed is Access.BLACK_BOX))
    original = torch_model.classifier()
    compressed = load_classifier(config.compressed_model_uri, device=config.device)
    disagreements = int(np.sum(original.predict(test.images) != compressed.predict(test.images)))
    seeds = test.subset(slice(0, config.fuzz_seeds), f"{test.name}[:{config.fuzz_seeds}]")
    searched = torch_model if declared.original is Access.WHITE_BOX else original
    result = run(Campaign(searched, [compressed], declared.make(), seeds, timeout=config.fuzz_timeout,
                          max_queries=config.fuzz_max_queries, seed=config.seed, progress=False), declared)[0]
    summary = result.summary
    from mlflow_di.fuzz.realism import DEFAULT_BUDGET, realism_summary

    # the realistic rate after the fact, under the default budget: this search did not look inside it, so it is
    # context (what share of its triggers a person would call the same image), not a bound the gate judges
    realism = realism_summary(result.records, summary.fuzzed, DEFAULT_BUDGET)
    metrics = {"success_rate": summary.success_rate, "triggers": summary.triggers, "seeds": summary.seeds,
               "already_deviating": summary.already_deviating, "disagreements": disagreements,
               "disagreement_rate": disagreements / len(test), "realistic_triggers": realism["realistic_triggers"],
               "realistic_success_rate": realism["realistic_success_rate"]}
    for key in ("mean_queries", "median_queries", "mean_seconds"):
        if getattr(summary, key) is not None:
            metrics[key] = getattr(summary, key)
    context = getattr(compressed, "execution_context", None)  # ONNX models: the runtime and CPU behind the figures
    return metrics, json.dumps({**summary.to_dict(),
                                **({"execution_context": context.to_dict()} if context is not None else {})}, indent=2)


def _log(run_id: str, metrics: dict, texts: dict, dataset, log_metrics: bool) -> dict:
    """Log the JSON artifacts (and, when MLflow will not, the metrics) to the evaluation run."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric
    from mlflow.models.evaluation.artifacts import JsonEvaluationArtifact
    from mlflow.utils.time import get_current_time_millis

    client = MlflowClient()
    if log_metrics:
        now = get_current_time_millis()
        client.log_batch(run_id, metrics=[
            Metric(key, value, now, 0, dataset_name=getattr(dataset, "name", None),
                   dataset_digest=getattr(dataset, "digest", None)) for key, value in metrics.items()])
    artifacts = {}
    for file_name, text in texts.items():
        path = f"mlflow_di/{file_name}"
        client.log_text(run_id, text, path)
        artifacts[f"{METRIC_PREFIX}{file_name.removesuffix('.json')}"] = JsonEvaluationArtifact(
            uri=f"{client.get_run(run_id).info.artifact_uri}/{path}", content=json.loads(text))
    return artifacts
