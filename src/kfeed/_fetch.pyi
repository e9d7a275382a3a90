from typing import Any

def scan(
    msgs: list[Any], ends: dict[tuple[str, int], int] | None
) -> tuple[list[Any], list[Any], list[tuple[int, int, tuple[str, int]]], list[tuple[Any, Any]],
           list[tuple[str, int]]]: ...
def value_bytes(vals: list[Any], start: int, stop: int) -> int: ...
