"""The version of this build of traintape (the package metadata reads it from here)."""

__version__ = "0.1.0"
