"""Errors a user can fix. The command line prints them as one line, without a traceback."""


class UserError(Exception):
    """A mistake in the user's input: the message names the problem and the fix."""


class DataError(UserError):
    """A missing, truncated, garbage or mismatched data file."""


class ConfigError(UserError):
    """A flag or setting with a value polytrain cannot use."""
