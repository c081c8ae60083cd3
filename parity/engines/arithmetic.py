"""How an engine computes, emulated by a same-weights reference: each engine that computes otherwise than float32
transformers has its own (``parity.engines.<engine>.arithmetic``), saved beside the reference it wrote and loaded
back by its kind, with ``rounds``, ``to_json`` and ``emulate(model)`` (a context inside which the reference's model
computes as the engine does)."""

FILE = "parity-arithmetic.json"      # written beside a same-weights reference, whichever engine's
