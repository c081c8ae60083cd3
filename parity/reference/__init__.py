"""The reference side: transformers models run as streams of capture points, tiny checkpoints, goldens, the
decode path (the arithmetics a reference can emulate are each engine's: parity.engines.arithmetic)."""
