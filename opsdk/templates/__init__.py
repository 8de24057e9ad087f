"""Jinja2 templates rendered by ``opsdk new-op`` (the ``opsdk.templates`` package)."""
