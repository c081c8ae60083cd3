"""Bytes on disk: atomic outputs, JSON files, the safetensors reader and writer, lazy tensors and block-scaled FP8."""
