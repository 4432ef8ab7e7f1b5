"""The library's version: recorded in every checkpoint index (its own module so that writing a
checkpoint does not import the package that imports the checkpoint code)."""

__version__ = "0.1.0"
