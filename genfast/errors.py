"""The one exception type for mistakes a user can fix (bad path, bad flag, prompt too long).

The CLI prints its message and exits non-zero without a traceback; anything else is a bug and
keeps its traceback.
"""


class UserError(Exception):
    """Something the user asked for cannot be done; the message says what and how to fix it."""
