"""The classic criteria on U_O: our defaults, Kim et al.'s bucket rule, DeepImportance's layer set.

NC, KMNC, NBC, SNAC, TKNC, LSC and DSC of U_O, with bounds, SA traces and buckets from the
analysis set, in three settings:

1. ``defaults``: the product's defaults (the hidden layers with parameters; LSC/DSC buckets over
   the fixed ranges [0, 2000] and [0, 2], values outside them counted in the end buckets);
2. ``sadl buckets``: the same layers with SADL's bucket rule (buckets from the test minimum, the
   rule of Kim et al.'s code, which the reference's SA criteria follow);
3. ``reference layers``: DeepImportance's layer set as well: every Keras layer but the input and
   flatten layers (pooling layers and the softmax output too; LeNet-5 also its separate logits
   layer) and its SA layer (``model.layers[-3]``, LeNet-4 ``[-2]``).

The paper's Table 4 row for LeNet-5 (as quoted in ../shared/notes/deepimportance.md) is shown
beside them.
"""
from __future__ import annotations

import collections
import dataclasses

from torch import nn

from mlflow_di.coverage.criteria import ClassicCoverage
from mlflow_di.models.torch_model import TorchModel

from benchmarks.reproduce.config import Config
from benchmarks.reproduce.results import ExperimentResult, Log

SOFTMAX = "predictions"
#: DeepImportance's counted layers (our block names) and SA layer per LeNet. LeNet-1 and LeNet-4
#: end in one Keras Dense layer with a softmax activation, LeNet-5 in a Dense and a Softmax layer.
REFERENCE_LAYERS = {
    "LeNet1": (("conv1", "pool1", "conv2", "pool2", SOFTMAX), "pool2"),
    "LeNet4": (("conv1", "pool1", "conv2", "pool2", "fc1", SOFTMAX), "fc1"),
    "LeNet5": (("conv1", "pool1", "conv2", "pool2", "fc1", "fc2", "before_softmax", SOFTMAX), "fc2"),
}
SETTINGS = ("defaults", "sadl buckets", "reference layers")


def with_softmax(model: TorchModel) -> TorchModel:
    """The same network with its softmax as a named layer (outputs probabilities)."""
    blocks = collections.OrderedDict(model.module.named_children())
    blocks[SOFTMAX] = nn.Softmax(dim=1)
    return TorchModel(nn.Sequential(blocks).eval(), dataclasses.replace(model.preprocessing, output="probabilities"),
                      name=model.name)


def estimator(setting: str, name: str) -> ClassicCoverage:
    if setting == "defaults":
        return ClassicCoverage(progress=False)
    if setting == "sadl buckets":
        return ClassicCoverage(progress=False, criterion_settings={"surprise_bucket_rule": "sadl"})
    layers, sa_layer = REFERENCE_LAYERS[name]
    return ClassicCoverage(layers=list(layers), sa_layers=[sa_layer], progress=False,
                           criterion_settings={"surprise_bucket_rule": "sadl"})


def run(config: Config, subjects, log: Log) -> ExperimentResult:
    rows = []
    for name, model in subjects.idc_models.items():
        for setting in SETTINGS:
            if setting == "reference layers" and name not in REFERENCE_LAYERS:
                continue
            log(f"idc_classic: {name} {setting}")
            subject = with_softmax(model) if setting == "reference layers" else model
            fitted = estimator(setting, name).fit(subject, subjects.analysis)
            report = fitted.score(subjects.test)
            rows.append({"model": name, "setting": setting, "layers": list(fitted.layers_),
                         "sa_layers": list(fitted.sa_layers_), "coverage": dict(report.coverage)})
    meta = {"analysis": subjects.analysis.name, "test": subjects.test.name}
    return ExperimentResult("idc_classic", rows, meta, config.to_dict())
