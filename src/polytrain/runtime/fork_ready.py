"""Imported last by the forkserver (forkserver.py), after what it preloads: what those imports made is moved out of
the garbage collector's scans (`gc.freeze`, as Python's documentation advises before forking), so that the workers
it forks neither scan those objects in their collections nor touch, and so copy, the memory that holds them."""

import gc

gc.collect()
gc.freeze()
