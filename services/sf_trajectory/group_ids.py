"""Group ids: the name of the group at each dispatch index, and back.

The dispatcher names the groups it hands out by their dispatch index; the data filters,
the replay and the service read that index back from a group's id. Groups opened by
someone else (an ad-hoc session's own group id) have no index.
"""

from __future__ import annotations


def group_id(index: int) -> str:
    """The id of the group handed out at dispatch index ``index``."""
    return f"g{index:07d}"


def group_index(group_id_: str) -> int:
    """The dispatch index of a group id we made; -1 for groups made elsewhere (ad hoc)."""
    if len(group_id_) == 8 and group_id_[0] == "g" and group_id_[1:].isdigit():
        return int(group_id_[1:])
    return -1
