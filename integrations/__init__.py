"""Integrations of hdp with other frameworks."""

__all__: list[str] = []
