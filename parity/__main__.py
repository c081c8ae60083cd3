"""``parity`` and ``python -m parity``: the command line, with its signal handlers installed before the CLI's imports
(seconds of torch and transformers), so that SIGTERM or Ctrl-C at any moment ends the run (parity.signals)."""

import sys

from parity import signals


def main() -> None:
    signals.install()
    try:
        from parity import cli  # after signals.install(): an interrupt during the CLI's imports ends cleanly
    except KeyboardInterrupt:
        sys.stderr.write("parity: interrupted; nothing was written\n")
        if signals.received is None:
            raise SystemExit(signals.exit_code()) from None
        signals.leave()
    except SystemExit:  # the CLI's imports were interrupted, and it said so
        if signals.received is None:
            raise
        signals.leave()
    cli.main()


if __name__ == "__main__":
    main()
