"""Errors a user can fix. The command line prints them as one line, without a traceback."""


class UserError(Exception):
    """A mistake in the user's input: the message names the problem and the fix."""


class DataError(UserError):
    """A missing, truncated, garbage or mismatched data file."""


class ConfigError(UserError):
    """A flag or setting with a value polytrain cannot use."""


class CheckpointError(UserError):
    """A checkpoint that is missing, damaged, or from another model."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an error's message (its class name when it has none), for one-line reports."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]
