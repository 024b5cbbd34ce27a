"""One module per on-disk format: torch files, DCP directories, safetensors headers."""
