"""ONNX: the exporter (traces the executor), onnxruntime's quantizers, a graph's values and weights read back."""
