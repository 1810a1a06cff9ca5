"""Compression engine: PyTorch module -> ONNX files (fp32 export, int8 quantization, pruning).

Pure PyTorch / ONNX / ONNX Runtime; knows nothing of MLflow. Modules, one concept each:
:mod:`.declarations` (every method's declaration and options), :mod:`.export` (fp32 ONNX export +
metadata), :mod:`.export_diagnosis` (naming what failed), :mod:`.quantize` (ONNX Runtime int8),
:mod:`.prune` (torch magnitude pruning), :mod:`.onnx_ops` (which layers are quantized),
:mod:`.quant_debug` (layer-wise int8 error, SQNR), :mod:`.methods` (``compress`` over all methods),
:mod:`.outcome` (one method's export as ``mlflow-di compress`` makes it: diagnosis, blame, sensitivity,
layers kept in float, the bounded search), :mod:`.export_record` (that export's parameters and figures).
The names below are imported when first used, so that reading the methods' declarations (``mlflow-di
compress --help``) does not import torch.
"""
from mlflow_di.lazy_names import lazy_names

_EXPORTS = {
    **{name: "export" for name in ("COMPRESSION_METADATA_KEY", "OnnxExport", "export_onnx", "read_preprocessing")},
    **{name: "declarations" for name in ("METHODS", "check_method")},
    **{name: "methods" for name in ("CompressionResult", "check_keep_float", "compress", "torch_model_size_bytes")},
    **{name: "onnx_ops" for name in ("assert_linear_layers_quantized", "quantized_ops")},
    **{name: "prune" for name in ("PrunedModel", "layer_sparsity", "prune_l1", "prune_structured")},
    **{name: "quant_debug" for name in ("LayerDiagnosis", "diagnose")},
    **{name: "quantize" for name in ("quantize_int8_dynamic", "quantize_int8_static")},
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_names(__name__, _EXPORTS)
