"""How an engine computes, emulated by a same-weights reference: llama.cpp's CPU (ggml) and onnxruntime's
quantized operators (ort)."""
