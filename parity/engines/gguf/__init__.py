"""GGUF and llama.cpp: the candidate kind (kind.py), llama.cpp's CPU arithmetic emulated (arithmetic.py), the
adapter's [gguf] section (adapter.py), the exporter (export.py), llama.cpp's quantizer (quantize.py), a file's header
checks (file.py), its weights read back (weights.py), its graph's ops (ops.py)."""
