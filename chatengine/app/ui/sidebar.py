"""The sidebar's list of chats, grouped as people look for them: Pinned, Today, Yesterday, Previous
7 days, Older (by the last change, in the server's time zone).

The list is one Gradio Radio (one selection, keyboard navigation, the same component for every
event). A group's heading is a choice of its own whose label starts with HEADING_MARK (invisible)
and whose value starts with HEADING_VALUE: the page's CSS finds such labels by their
``data-testid`` and draws them as headings that cannot be picked. No conversation id (a UUID)
starts with HEADING_VALUE.
"""

from __future__ import annotations

import datetime as dt

GROUPS = ("Pinned", "Today", "Yesterday", "Previous 7 days", "Older")
HEADING_MARK = "\u2060"  # WORD JOINER: invisible, and no title a person types starts with it
HEADING_VALUE = "group:"


def date_group(updated_at: float, today: dt.date) -> str:
    """The heading of a chat last changed at ``updated_at`` (Unix seconds), seen on ``today``."""
    days = (today - dt.datetime.fromtimestamp(updated_at).date()).days
    if days <= 0:  # today, or a clock set back: not "Older"
        return "Today"
    if days == 1:
        return "Yesterday"
    return "Previous 7 days" if days <= 7 else "Older"


def grouped_choices(convs: list[dict], today: dt.date | None = None) -> list[tuple[str, str]]:
    """(label, value) choices of the Radio: each non-empty group's heading, then its chats in the
    order given (the store's: newest change first)."""
    today = today or dt.date.today()
    groups: dict[str, list[tuple[str, str]]] = {g: [] for g in GROUPS}
    for c in convs:
        group = "Pinned" if c.get("pinned") else date_group(c["updated_at"], today)
        groups[group].append((c["title"].lstrip(HEADING_MARK) or "Untitled", c["id"]))
    out: list[tuple[str, str]] = []
    for group, items in groups.items():
        if items:
            out += [(HEADING_MARK + group, HEADING_VALUE + group), *items]
    return out


def is_heading(value) -> bool:
    return isinstance(value, str) and value.startswith(HEADING_VALUE)
