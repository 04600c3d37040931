"""This package's version: the one place it is written (pyproject.toml reads
it from here). It is part of every cache environment's key."""

__version__ = "0.1.0"
