"""A transformers-free executor of the neutral layout (the reference an engine author reads).

model.py runs the model sublayer by sublayer; rope.py, moe.py and mla.py hold the pieces that
need more than a few lines.
"""
