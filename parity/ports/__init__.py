"""The formats engines read: parity's exporters (GGUF, ONNX), readers of engine files and graphs (OpenVINO),
the same-weights writer they share, and what engine kinds share (engines.py)."""
