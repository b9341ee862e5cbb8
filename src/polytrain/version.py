"""The version of polytrain: read by the package, the command line, run folders and the build (pyproject.toml)."""

__version__ = "0.1.0"
