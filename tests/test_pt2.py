"""Models in MLflow's default pt2 (torch.export) format, white-box: the module tree rebuilt from the
exported graph has the original layer names and types, computes the same outputs, activations and
LRP relevance as the eager model, and runs on any batch size."""
import numpy as np
import pytest
import torch
from torch import nn

import mlflow_di._compat  # noqa: F401  (torchvision on the CPU build of torch)

from benchmarks.check_lrp_conservation import family_model
from mlflow_di.coverage.relevance import input_relevance, layer_relevance
from mlflow_di.errors import UserError
from mlflow_di.models import zoo
from mlflow_di.models.pt2 import RebuiltModule, rebuild


def exported(module: nn.Module, example: torch.Tensor, dynamic: bool = True):
    """``module`` exported as MLflow's log_model does (a dynamic batch axis where the example allows it)."""
    shapes = [{0: torch.export.Dim.AUTO}] if dynamic else None
    return torch.export.export(module.eval(), (example,), dynamic_shapes=shapes)


#: Layers that run no operator (the identity in eval mode) leave no trace in an exported graph.
NO_OPERATOR = ("Identity", "StochasticDepth")


def leaves(module: nn.Module) -> dict[str, str]:
    return {name: type(leaf).__name__ for name, leaf in module.named_modules()
            if name and not any(True for _ in leaf.children()) and type(leaf).__name__ not in NO_OPERATOR}


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))


MODELS = {
    "digits_cnn": lambda: (zoo.build("digits-cnn"), torch.rand(4, 1, 8, 8)),
    "lenet5": lambda: (zoo.build("lenet5"), torch.rand(4, 1, 28, 28)),
    "resnet20": lambda: (zoo.build("resnet20"), torch.rand(4, 3, 32, 32)),
    "resnet18": lambda: (family_model("resnet18"), torch.rand(4, 3, 32, 32)),
    "mobilenet_v3_small": lambda: (family_model("mobilenet_v3_small"), torch.rand(4, 3, 32, 32)),
}


@pytest.mark.parametrize("name", MODELS)
def test_the_rebuilt_model_is_the_eager_model_white_box(name):
    """Same layer names and types, same outputs, activations and relevance (input and per layer),
    residual sums and squeeze-and-excitation gates included. (Modules come in the order they are
    called, which is not always the order they were defined in.)"""
    model, inputs = MODELS[name]()
    rebuilt = rebuild(exported(model, inputs), name)
    assert leaves(rebuilt) == leaves(model)
    assert {n for n, _ in rebuilt.named_modules()} == {n for n, m in model.named_modules()
                                                       if type(m).__name__ not in NO_OPERATOR}
    with torch.no_grad():
        np.testing.assert_array_equal(rebuilt(inputs).numpy(), model(inputs).numpy())
    np.testing.assert_allclose(input_relevance(rebuilt, inputs, progress=False),
                               input_relevance(model, inputs, progress=False), rtol=0, atol=1e-6)
    layers = [n for n, _ in model.named_children()][-3:]
    eager, white = layer_relevance(model, inputs, layers, progress=False), layer_relevance(rebuilt, inputs, layers,
                                                                                           progress=False)
    for layer in layers:
        assert relative(white.relevance[layer], eager.relevance[layer]) <= 1e-5, layer
        np.testing.assert_array_equal(white.activations[layer], eager.activations[layer])


class _FlattenByView(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).view(x.size(0), -1))


def test_a_model_exported_with_one_example_runs_on_any_batch():
    """MLflow exports a batch-1 example with a static batch axis, which writes the 1 into every
    ``view(x.size(0), -1)``; the rebuilt model takes the batch size from its input."""
    torch.manual_seed(0)
    model = _FlattenByView()
    rebuilt = rebuild(exported(model, torch.rand(1, 1, 8, 8), dynamic=False))
    batch = torch.rand(5, 1, 8, 8)
    with torch.no_grad():
        np.testing.assert_allclose(rebuilt(batch).numpy(), model(batch).numpy(), atol=1e-6)


def test_a_model_exported_in_training_mode_is_rebuilt_in_eval_mode():
    """Batch statistics and live dropout in the graph: the rebuilt model is the eager model's eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Dropout(0.5),
                          nn.Linear(3 * 6 * 6, 2))
    model.train()
    with torch.no_grad():
        model(torch.rand(8, 1, 8, 8))  # running statistics of their own
    program = torch.export.export(model, (torch.rand(4, 1, 8, 8),))
    rebuilt = rebuild(program)
    batch = torch.rand(3, 1, 8, 8)
    with torch.no_grad():
        np.testing.assert_allclose(rebuilt(batch).numpy(), model.eval()(batch).numpy(), atol=1e-6)
    assert leaves(rebuilt) == leaves(model)


class _Scale(nn.Module):
    """A leaf of a type mlflow-di does not rebuild."""

    def __init__(self):
        super().__init__()
        self.factor = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return x * self.factor


def test_a_leaf_of_an_unknown_type_keeps_its_graph_and_its_type_name():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), _Scale(), nn.Linear(16, 2))
    rebuilt = rebuild(exported(model, torch.rand(2, 1, 4, 4)))
    assert isinstance(rebuilt.get_submodule("1"), RebuiltModule)
    assert rebuilt.get_submodule("1").original_type.endswith("_Scale")
    with pytest.raises(UserError, match=r"layer '1' of type _Scale is not supported by relevance propagation"):
        input_relevance(rebuilt, torch.rand(2, 1, 4, 4), progress=False)


class _Difference(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.a(x) - self.b(x)


class _Product(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.a(x) * self.b(x)


def test_a_difference_conserves_relevance_and_a_product_of_two_signals_is_refused_by_module_and_node():
    """``a - b`` is the Sum of ``a`` and ``-b`` (relevance a/(a-b) and -b/(a-b)): the input relevance of a bias-free
    difference sums to its output; a product of two signals (neither a sigmoid gate) has no rule and is refused."""
    torch.manual_seed(0)
    difference = _Difference()
    for layer in (difference.a, difference.b):
        torch.nn.init.zeros_(layer.bias)
    x = torch.rand(3, 4)
    rebuilt = rebuild(exported(nn.Sequential(difference), x))
    out = rebuilt(x)
    relevance = input_relevance(rebuilt, x, targets=np.zeros(3, dtype=np.int64), epsilon=1e-20, progress=False)
    np.testing.assert_allclose(relevance.sum(axis=1), out[:, 0].detach().numpy(), rtol=1e-4)
    product = rebuild(exported(nn.Sequential(_Product()), x))
    with pytest.raises(UserError, match=r"module '0' \(_Product\) multiplies two tensors \(node 'mul\w*'\), neither a "
                                        "sigmoid-like gate"):
        input_relevance(product, x, progress=False)


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x), x


def test_a_model_with_two_outputs_is_one_line():
    with pytest.raises(UserError, match="returns 2 outputs") as caught:
        rebuild(exported(_TwoHeads(), torch.rand(2, 4)), "two-heads")
    assert "\n" not in str(caught.value)
