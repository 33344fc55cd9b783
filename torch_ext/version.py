"""torch_ext's version, in one place: setuptools reads it (pyproject.toml) without importing the package."""
__version__ = "0.2.0"
