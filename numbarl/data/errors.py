"""The one exception type of numbarl.data: bad input that a person must fix.

Every reader, builder and loader raises :class:`DataError` with a message that names the file,
the field and the value that were wrong and, where there is one, what to do about it. The
``numbarl-data`` command turns it into one line on stderr and exit code 2.
"""


class DataError(Exception):
    """Bad market data or a data configuration that cannot be satisfied."""
