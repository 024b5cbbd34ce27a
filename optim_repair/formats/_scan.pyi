"""The compiled pickle scan (``_scan.c``): ``pickle_limits``' scan, given its opcode set, refusal class and limits."""

from typing_extensions import Buffer

def scan(
    data: Buffer,
    pos: int,
    table: bytes,
    refusals: tuple[str, ...],
    refused: type[Exception],
    max_depth: int,
    max_weight: int,
    budget_base: int,
    budget_per_op: int,
    live_base: int,
    live_bytes: int,
    live_check: int,
    max_int_bytes: int,
    max_int_digits: int,
    /,
) -> tuple[int, bool]: ...
