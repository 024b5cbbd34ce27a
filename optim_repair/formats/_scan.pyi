"""The compiled pickle scan (``_scan.c``): ``pickle_limits``' scan, with its table, refusal class and limits given."""

from typing_extensions import Buffer

def scan(
    data: Buffer,
    pos: int,
    table: bytes,
    refused: type[Exception],
    max_depth: int,
    max_weight: int,
    budget_base: int,
    budget_per_op: int,
    /,
) -> tuple[int, bool]: ...
