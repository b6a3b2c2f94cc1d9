"""The sidebar's chats under date headings: Pinned, Today, Yesterday, Previous 7 days, Older."""

import datetime as dt

from chatengine.app.ui.sidebar import HEADING_MARK, date_group, grouped_choices, is_heading

TODAY = dt.date(2026, 11, 25)


def at(day: dt.date, hour: int = 12) -> float:
    return dt.datetime(day.year, day.month, day.day, hour).timestamp()


def test_date_groups_by_calendar_day():
    days = lambda n: TODAY - dt.timedelta(days=n)  # noqa: E731
    assert date_group(at(TODAY, 0), TODAY) == "Today"
    assert date_group(at(days(1), 23), TODAY) == "Yesterday"
    assert [date_group(at(days(n)), TODAY) for n in (2, 7, 8, 400)] == [
        "Previous 7 days",
        "Previous 7 days",
        "Older",
        "Older",
    ]
    assert date_group(at(TODAY + dt.timedelta(days=1)), TODAY) == "Today"  # a clock set back


def test_choices_are_headed_groups_in_order():
    convs = [
        dict(id="t", title="today's", updated_at=at(TODAY), pinned=False),
        dict(id="p", title="pinned old", updated_at=at(TODAY - dt.timedelta(days=30)), pinned=True),
        dict(id="o", title="old", updated_at=at(TODAY - dt.timedelta(days=30)), pinned=False),
        dict(id="y", title="yesterday's", updated_at=at(TODAY - dt.timedelta(days=1)), pinned=False),
    ]
    choices = grouped_choices(convs, TODAY)
    assert [(label.lstrip(HEADING_MARK), is_heading(value)) for label, value in choices] == [
        ("Pinned", True),
        ("pinned old", False),
        ("Today", True),
        ("today's", False),
        ("Yesterday", True),
        ("yesterday's", False),
        ("Older", True),
        ("old", False),
    ]
    assert grouped_choices([], TODAY) == []


def test_a_title_cannot_pass_for_a_heading():
    [_, (label, value)] = grouped_choices([dict(id="x", title=HEADING_MARK + "Today", updated_at=at(TODAY))], TODAY)
    assert (label, value) == ("Today", "x") and not is_heading(value)
