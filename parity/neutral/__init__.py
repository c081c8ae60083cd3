"""The neutral layout: its converter, its manifest, and the executor that runs it."""
