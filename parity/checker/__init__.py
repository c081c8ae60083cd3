"""A check: two sides run on the same inputs, each capture point judged as it arrives.

    plan.py      the options, checked and fixed before any model loads (every refusal is made there)
    sides.py     one protocol for every side: transformers, a golden, any candidate kind
    noise.py     where a point's noise comes from: a live twin, an isolated twin, a golden, a quantized file
    judge.py     one judge: a point's tolerance from its noise, its result; several prompts merged
    prefill.py   one prompt through both sides, judged point by point
    decoding.py  --decode N: the candidate's own cache, step by step, judged against the reference's steps
    run.py       the run loop: inputs, prefill, merge, decode, diagnosis, generation (parity.check is run.check)
    record.py    `parity golden record`: the reference and its noise twins, stored as a golden

This package's __init__ imports nothing: importing one of its modules loads only what that module needs.
"""
