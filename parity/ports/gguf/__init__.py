"""GGUF: the exporter, llama.cpp's quantizer, a file's header checks, its weights read back, its graph's ops."""
