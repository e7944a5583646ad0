"""verl plugin for hdp (see issue: verl integration)."""

__all__: list[str] = []
