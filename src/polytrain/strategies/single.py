from .base import Strategy


class SingleDevice(Strategy):
    """Everything on one device in one process."""

    name = "single"
