"""ONNX and onnxruntime: the candidate kind (kind.py), onnxruntime's quantized operators emulated (arithmetic.py),
the exporter tracing the executor (export.py), onnxruntime's quantizers (quantize.py), a graph's values (graph.py)
and weights (weights.py) read back."""
