"""One package or module per on-disk format: torch files, DCP directories, safetensors headers.

Readers turn bytes into a format-free inventory; writers apply a repair plan to a copy. Nothing here
decides what to repair: formats import only ``errors``, ``dtypes``, ``inventory`` and ``repair_plan``.
"""
