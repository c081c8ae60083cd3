"""Every engine parity knows, one folder each (``parity/engines/<engine>/``), its files named by their role:
``kind.py`` the candidate kind (registered by one line in parity.candidates), ``arithmetic.py`` how the engine
computes, emulated by a same-weights reference, ``export.py`` parity's exporter, ``file.py`` / ``graph.py`` a file
or graph read, ``ops.py`` its operation-level points, ``quantize.py`` the engine's quantizer, ``weights.py`` its
weights read back, ``adapter.py`` its section of an adapter file. What engines share sits beside them:
``common.py`` (importing an engine, the cache of its conversions), ``same_weights.py`` (the same-weights reference
every engine writes), ``graph_ops.py`` (operation-level points read from a graph) and ``arithmetic.py`` (the file an
engine's arithmetic is saved to)."""
