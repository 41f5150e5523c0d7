"""Consecutive items grouped so each group stays under an element budget (bounded buffers)."""


def bounded_groups(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of consecutive ``sizes`` in groups of at most ``limit`` elements; an item larger
    than ``limit`` forms a group of its own."""
    out, current, total = [], [], 0
    for i, n in enumerate(sizes):
        if current and total + n > limit:
            out.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        out.append(current)
    return out
