"""OpenVINO: the candidate kind (kind.py), a model's ops seen as an ONNX graph (graph.py), OpenVINO's converter on
transformers' model (export.py), an IR's weights read back (weights.py)."""
