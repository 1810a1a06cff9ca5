"""``int8-nncf``: NNCF's post-training int8 quantization, made for OpenVINO (the ``nncf`` extra).

NNCF (OpenVINO's Neural Network Compression Framework) quantizes the same fp32 graph the other methods
start from with its own choices: MinMax ranges on the calibration images, fast bias correction, symmetric
int8 weights and the ``performance`` preset, operations placed where OpenVINO's CPU plugin fuses them
(``target_device=CPU``). Its ONNX backend writes a QDQ ONNX file, registered with lineage like every export
and scored on OpenVINO (the runtime it is made for) beside ONNX Runtime: :attr:`MethodDeclaration.made_for`.
NNCF's accuracy-controlled quantization is not used here: a bound (``--max-*``) is int8-static's bounded
search.
"""
from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

from mlflow_di.errors import UserError

#: how many calibration images NNCF collects statistics on at most (its own default is 300)
BATCH = 32


def nncf_module():
    """``nncf``, imported with its usage telemetry off. NNCF sends usage events to Google Analytics unless
    a consent file says no, and mlflow-di sends nothing anywhere; ``NNCF_CI`` is the switch NNCF's telemetry
    wrapper reads (it changes nothing else in NNCF)."""
    import os

    os.environ.setdefault("NNCF_CI", "1")
    import nncf

    return nncf


def quantize_with_nncf(fp32_path: pathlib.Path, job) -> tuple[dict, dict]:
    """The fp32 graph at ``fp32_path`` quantized by ``nncf.quantize`` on ``job``'s calibration inputs into
    ``job.path`` (a :class:`~mlflow_di.compression.methods.MethodJob`); (its params, no other result field)."""
    if importlib.util.find_spec("nncf") is None:
        raise UserError("int8-nncf needs NNCF: pip install 'mlflow-di[nncf]'")
    import contextlib
    import io
    import logging

    import onnx

    from mlflow_di.compression.quantize import check_calibration_inputs, model_input

    nncf = nncf_module()
    logging.getLogger("nncf").setLevel(logging.ERROR)  # its INFO lines: the command says what ran
    name, shape = model_input(fp32_path)
    inputs = check_calibration_inputs(job.calib, shape)
    batches = [{name: np.ascontiguousarray(inputs[i:i + BATCH], dtype=np.float32)} for i in range(0, len(inputs), BATCH)]
    model = onnx.load(str(fp32_path))
    # NNCF draws its own progress bars (rich, on the console it finds at write time): the command's lines only
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        quantized = nncf.quantize(model, nncf.Dataset(batches), target_device=nncf.TargetDevice.CPU,
                                  subset_size=len(batches))
    onnx.save(quantized, str(job.path))
    return {"tool": "nncf", "nncf_version": nncf.__version__, "calibration_images": len(inputs),
            "target_device": "CPU", "preset": "performance"}, {}
