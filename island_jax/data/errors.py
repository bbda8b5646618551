"""`DataError`, the error of data that cannot be used as configured, in a module of its own: whoever only
names the error (a tokenizer, a command line) imports neither grain nor NumPy."""


class DataError(ValueError):
    """The corpus cannot be used as configured."""
