"""parity: checkpoint porting and layer-by-layer numerical parity for transformer models."""

__version__ = "0.1.0"

from parity.errors import ParityError  # noqa: E402 - raised for every input that gets no verdict (exit code 2)

__all__ = ["ParityError", "check"]


def check(reference, candidate, options=None, **given):
    """Compare a candidate against a reference checkpoint; returns a Report (truthy when parity holds).

    Example::

        report = parity.check("gemma-2-9b", "gemma-2-9b.neutral", layerwise=True, calibrate=True)
        assert report, report.first_divergence

    Options are those of ``parity check`` (``dtype``, ``layerwise``, ``isolate``, ``calibrate``,
    ``tolerance``, ``prompt``, ``ids``, ``length``, ``inputs_file``, ...), as keyword arguments or as one
    ``parity.checker.options.CheckOptions``; an unknown name is refused. See ``parity.checker.run.check``.
    """
    from parity.checker.run import check as run  # torch: `import parity` (and so parity --help) must not load it

    return run(reference, candidate, options, **given)
