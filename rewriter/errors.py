class OrtleanError(Exception):
    """A user-facing error: the CLI prints its message (naming the file/node/flag/value at fault)
    and exits with status 2, leaving no partial output behind."""
