"""Errors that end a command with exit code 2 ("no verdict could be reached")."""


class ParityError(Exception):
    """Bad input: the message is one line that names the file and says how to fix it."""
