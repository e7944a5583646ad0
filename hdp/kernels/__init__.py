"""Local attention kernels returning (out, lse): pure-torch reference and adapters."""

__all__: list[str] = []
