"""A pytest helper for engine test suites: fail the test, with the verdict sentence, when parity breaks.

    from parity.testing import assert_parity

    def test_my_engine_port(tmp_path):
        export_my_engine_weights(tmp_path)   # an HF or neutral directory the engine runs from
        assert_parity("ref/gemma-2-2b", tmp_path, layerwise=True, calibrate=True)
"""

from __future__ import annotations

from parity import check
from parity.render import verdict
from parity.report import Report


def assert_parity(reference, candidate, **options) -> Report:
    """Run ``parity.check`` and raise AssertionError naming the first divergence when it fails."""
    report = check(reference, candidate, **options)
    if not report:
        raise AssertionError(verdict(report))
    return report
