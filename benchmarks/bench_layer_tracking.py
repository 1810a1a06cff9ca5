"""What following a layer through its activation costs: a coverage pass with and without it.

    python -m benchmarks.bench_layer_tracking [--repeat 5] [--write]

:class:`~mlflow_di.coverage.activations.LayerRecorder` measures a layer after the batch norm and
activation that follow it, whatever form they take, by watching every torch call of the forward
pass (a ``TorchFunctionMode``). This times, in one run and per model, the lower of ``--repeat``
activation passes over the model's hidden layers (:func:`collect_activations`, batches of 64)
and of LRP relevance passes at its default layer (:func:`layer_relevance`), with the tracking on
and with it switched off (the mode not entered: the values are then the layers' own outputs, so
only the time is comparable), and reports the ratio. ``--write`` puts the table in
benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform

import mlflow_di  # noqa: F401  (torchvision guard first)

BATCH = 64
IMAGES = 512


@contextlib.contextmanager
def _tracking(on: bool):
    """The follower tracking as shipped (on), or its mode never entered (off)."""
    from torch.overrides import TorchFunctionMode

    from mlflow_di.coverage import activations

    tracker = activations._FollowerTracker
    if on:
        yield
        return
    tracker.__enter__, tracker.__exit__ = (lambda self: self), (lambda self, *exc: None)
    try:
        yield
    finally:
        tracker.__enter__, tracker.__exit__ = TorchFunctionMode.__enter__, TorchFunctionMode.__exit__


def measure(repeat: int) -> list[dict]:
    import torch

    from benchmarks.bench_white_box import _best, _models  # the same four models, the same timing rule
    from mlflow_di.coverage.activations import collect_activations, default_layer, hidden_layers
    from mlflow_di.coverage.relevance import layer_relevance

    rows = []
    for name, module, (height, width, channels) in _models():
        module.eval()
        inputs = torch.rand(IMAGES, channels, height, width, generator=torch.Generator().manual_seed(0))
        layers, subject = hidden_layers(module), default_layer(module)
        row = {"model": name, "layers": len(layers)}
        for label, task in (("activations", lambda: collect_activations(module, inputs, layers, BATCH)),
                            ("relevance", lambda: layer_relevance(module, inputs[:128], subject, batch_size=BATCH,
                                                                  progress=False))):
            seconds = {}
            for on in (False, True):
                with _tracking(on):
                    seconds[on] = _best(task, repeat)
            row[f"{label} s (off)"] = round(seconds[False], 4)
            row[f"{label} on/off"] = round(seconds[True] / seconds[False], 3)
        rows.append(row)
        print(row, flush=True)
    return rows


def markdown(rows: list[dict], repeat: int) -> str:
    import torch

    head = list(rows[0])
    lines = ["<!-- bench_layer_tracking -->", "## Following layers through their activations (bench_layer_tracking)", "",
             f"Command: `python -m benchmarks.bench_layer_tracking --repeat {repeat}`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} with "
             f"{torch.get_num_threads()} threads; {IMAGES} random inputs for the activation pass over every hidden "
             f"layer, 128 for the LRP pass at the default layer, batches of {BATCH}; the lower of {repeat} timings; "
             "'on/off': the time with the layer tracking (as shipped) over the time without it.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(row[k]) for k in head) + " |" for row in rows]
    lines += ["", "Without the tracking, a functional `torch.relu` after a layer was left out while an `nn.ReLU` "
              "module was not, and one network's NC was 0.61 eager and 0.34 as ONNX "
              "(tests/test_format_invariance.py now holds every criterion equal across formats).",
              "<!-- /bench_layer_tracking -->"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows = measure(args.repeat)
    text = markdown(rows, args.repeat)
    print(text)
    if args.write:
        from benchmarks.results import write_section

        write_section(text, "<!-- bench_layer_tracking -->", "<!-- /bench_layer_tracking -->")


if __name__ == "__main__":
    main()
