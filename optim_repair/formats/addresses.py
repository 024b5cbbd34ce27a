"""Addresses inside a parsed graph (keys and list indices from its root): walked, described and resolved."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def walk(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every container in a graph with its path of keys and indices, outermost first."""
    seen: set[int] = set()

    def visit(node: Any, where: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], Any]]:
        if id(node) in seen:
            return
        if isinstance(node, dict):
            seen.add(id(node))
            yield where, node
            for key, child in node.items():
                yield from visit(child, (*where, key))
        elif isinstance(node, (list, tuple)):
            seen.add(id(node))
            yield where, node
            for index, child in enumerate(node):
                yield from visit(child, (*where, index))

    yield from visit(value, path)


def describe_address(address: tuple[Any, ...]) -> str:
    """``('optimizer_states', 0)`` -> ``optimizer_states[0]``; the root is ``""``."""
    text = ""
    for step in address:
        if isinstance(step, int) and not isinstance(step, bool):
            text += f"[{step}]"
        else:
            text += f".{step}" if text else str(step)
    return text


def resolve(root: Any, address: tuple[Any, ...]) -> Any:
    """The value at ``address`` (keys and list indices) inside ``root``."""
    node = root
    for step in address:
        node = node[step]
    return node
