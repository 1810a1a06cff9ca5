"""Which device a PyTorch model runs on: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

The device is a property of the module's parameters, as in PyTorch itself: a command resolves
``--device`` once, moves the model there (:meth:`TorchModel.to`), and every engine (relevance,
activations, training, the black-box classifier) sends each batch to :func:`module_device` and
brings results back to the CPU as NumPy arrays. Nothing else carries a device argument.

ONNX Runtime picks its execution provider from the same choice (:func:`onnx_providers`): the CUDA
provider when the resolved device is a GPU and the installed onnxruntime build has it, the CPU
provider otherwise; the classifier reports the provider it really got.
"""
from __future__ import annotations

import contextlib
import re

from mlflow_di.errors import UserError

DEVICE_HELP = "auto (CUDA when available), cpu, cuda or cuda:N"
_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_spec(spec: str) -> str:
    """``spec`` normalised (lower case, stripped), or a :class:`UserError` naming the accepted forms."""
    normalised = str(spec).strip().lower()
    if not _SPEC.fullmatch(normalised):
        raise UserError(f"unknown device '{spec}'; give {DEVICE_HELP}")
    return normalised


def resolve_device(spec: str = "auto"):
    """The ``torch.device`` that ``spec`` names; CUDA asked for but absent is a :class:`UserError`.

    A ``torch.device`` is returned as it is.
    """
    import torch

    if isinstance(spec, torch.device):
        return spec
    spec = check_device_spec(spec)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"--device {spec} asks for a CUDA GPU, but this torch build sees none "
                        f"(torch {torch.__version__}); use --device cpu or auto")
    device = torch.device(spec)
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise UserError(f"--device {spec}: there {'is' if count == 1 else 'are'} only {count} CUDA "
                        f"device{'' if count == 1 else 's'} (cuda:0..cuda:{count - 1})")
    return device


def module_device(module):
    """The device of a module's first parameter or buffer (CPU for a module that has neither)."""
    import torch

    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def use_own_cuda_streams(devices) -> None:
    """Make a new CUDA stream the calling thread's current stream on each of ``devices`` (CUDA
    ``torch.device`` objects; none: nothing happens, and torch is not imported).

    PyTorch's current stream is per thread, and work on different streams may run at once. A
    thread that runs the models' calls beside other GPU work (a campaign's overlap: the searches'
    mutations and scoring run on the device in the main thread) calls this first, so that
    the other work does not queue behind each forward pass on the default stream.
    """
    if not devices:
        return
    import torch

    for device in devices:
        torch.cuda.set_stream(torch.cuda.Stream(device=device))


def with_index(device):
    """``device`` as a torch device naming its index: plain ``cuda`` is the current CUDA device (so that
    ``cuda`` and ``cuda:0`` compare equal when 0 is current); other devices as they are."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def describe_device(device) -> str:
    """``cpu`` or ``cuda:0 (NVIDIA H100 80GB HBM3)``: what to print and log."""
    import torch

    device = with_index(device)
    if device.type != "cuda":
        return str(device)
    return f"cuda:{device.index} ({torch.cuda.get_device_name(device.index)})"


def onnx_providers(device=None) -> list:
    """ONNX Runtime execution providers for ``device`` (a spec, a ``torch.device`` or None = auto)."""
    import onnxruntime as ort

    wanted = "auto" if device is None else str(device)
    if wanted == "cpu" or "CUDAExecutionProvider" not in ort.get_available_providers():
        return ["CPUExecutionProvider"]
    if wanted == "auto" and not _cuda_visible():
        return ["CPUExecutionProvider"]
    index = int(wanted.partition(":")[2] or 0)
    return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError:  # onnxruntime-gpu without torch: trust the provider list
        return True
    return torch.cuda.is_available()


@contextlib.contextmanager
def out_of_memory_as_user_error(what: str, batch_size: int | None = None):
    """Turn CUDA's out-of-memory error inside the block into one line that says how to fix it."""
    import torch

    try:
        yield
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        smaller = f" (e.g. --batch-size {max(1, batch_size // 4)})" if batch_size else ""
        raise UserError(f"the GPU ran out of memory during {what}; lower --batch-size{smaller} "
                        "or run on the CPU with --device cpu") from None
