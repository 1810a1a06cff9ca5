"""Compression engine: PyTorch module -> ONNX files (fp32 export, int8 quantization, pruning).

Pure PyTorch / ONNX / ONNX Runtime; knows nothing of MLflow. Modules, one concept each:
:mod:`.export` (fp32 ONNX export + metadata), :mod:`.export_diagnosis` (naming what failed),
:mod:`.quantize` (ONNX Runtime int8), :mod:`.prune` (torch magnitude pruning),
:mod:`.onnx_ops` (which layers are quantized), :mod:`.quant_debug` (layer-wise int8 error, SQNR),
:mod:`.methods` (``compress`` over all methods), :mod:`.outcome` (one method's export as ``mlflow-di
compress`` makes it: diagnosis, blame, sensitivity, layers kept in float, the bounded search),
:mod:`.export_record` (that export's parameters and figures).
"""
from mlflow_di.compression.export import (
    COMPRESSION_METADATA_KEY,
    OnnxExport,
    export_onnx,
    read_preprocessing,
)
from mlflow_di.compression.methods import (
    METHODS,
    CompressionResult,
    check_keep_float,
    check_method,
    compress,
    torch_model_size_bytes,
)
from mlflow_di.compression.onnx_ops import assert_linear_layers_quantized, quantized_ops
from mlflow_di.compression.prune import PrunedModel, layer_sparsity, prune_l1, prune_structured
from mlflow_di.compression.quant_debug import LayerDiagnosis, diagnose
from mlflow_di.compression.quantize import quantize_int8_dynamic, quantize_int8_static

__all__ = [
    "COMPRESSION_METADATA_KEY", "METHODS",
    "CompressionResult", "LayerDiagnosis", "OnnxExport", "PrunedModel",
    "assert_linear_layers_quantized", "check_keep_float", "check_method", "diagnose", "compress", "export_onnx",
    "layer_sparsity", "prune_l1",
    "prune_structured", "quantize_int8_dynamic", "quantize_int8_static", "quantized_ops",
    "read_preprocessing", "torch_model_size_bytes",
]
