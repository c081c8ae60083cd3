"""The reference side: transformers models run as streams of capture points, tiny checkpoints, goldens, the
decode path, and the arithmetics a reference can emulate (arithmetic/)."""
