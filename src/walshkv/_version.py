"""The package version, at the bottom layer so that every module can record it."""

__version__ = "0.1.0"
