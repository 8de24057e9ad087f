"""The package version, which the compile caches and artifact manifests record (kept equal
to pyproject.toml's)."""

__version__ = "0.1.0"
