"""Context-parallel attention algorithms (ring, all-gather K/V) over hdp rank groups."""

__all__: list[str] = []
