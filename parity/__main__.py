"""``python -m parity``: the same command line as ``parity``."""

from parity.cli import main

if __name__ == "__main__":
    main()
