"""parity: checkpoint porting and layer-by-layer numerical parity for transformer models."""

__version__ = "0.1.0"
