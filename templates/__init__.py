"""Jinja2 templates rendered by ``opsdk new-op`` (installed as the ``opsdk.templates`` package)."""
