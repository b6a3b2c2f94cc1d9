"""What the UI shows as text (render.py): pure functions, no Gradio, no engine."""

import re

from chatengine.app.ui.render import kv_picture


def test_the_engine_legend_and_card_count_the_same_pages():
    """Shared pages are pages in use: the legend's "in use" and the Device pages card agree."""
    stats = dict(kv_blocks_total=40, kv_blocks_used=13, kv_blocks_shared=3, kv_blocks_cached=5, kv_blocks_free=27)
    page = kv_picture(stats)
    legend = dict(re.findall(r"</span>([^<:]+): <b>(\d+)</b>", page))
    assert legend == {"in use": "13", "of them shared": "3", "cached (reusable)": "5", "free": "22"}
    assert "13 in use (3 shared) · 5 cached · 22 free" in page
    cells = re.findall(r"kv-cell (kv-\w+)'></div>", page)
    assert cells.count("kv-used") + cells.count("kv-shared") == 13 and len(cells) == 40


def test_version_nav_carries_the_id_and_the_possible_steps_in_class_names():
    from chatengine.app.ui.render import parse_version_step, version_nav

    assert version_nav({"id": "m1", "k": 1, "n": 1}) == ""
    first = version_nav({"id": "m-1", "k": 1, "n": 3})
    assert "ver-nav vm-m-1" in first and "ver-prev ver-on" not in first and "ver-next ver-on" in first
    last = version_nav({"id": "m-1", "k": 3, "n": 3})
    assert "ver-prev ver-on" in last and "ver-next ver-on" not in last and ">3/3<" in last
    assert version_nav({"id": "x' onclick='y", "k": 1, "n": 2}) == ""  # an id is never markup
    assert parse_version_step("m-1:-1:1712") == ("m-1", -1)
    assert parse_version_step("m-1:1") == ("m-1", 1)
    for bad in (None, "", "m1", "m1:2", "m 1:1", "a" * 65 + ":1", "<b>:1"):
        assert parse_version_step(bad) is None


def test_an_edited_message_loses_its_inline_versions_when_edited_again():
    from chatengine.app.ui.render import to_chat, unescape_html

    view = [{"id": "u1", "role": "user", "content": "a < b", "k": 2, "n": 2}]
    shown = to_chat(view)[0]["content"]
    assert "2/2" in shown
    assert unescape_html(shown) == "a < b"


def test_html_after_a_backtick_and_a_blank_line_is_escaped():
    """A code span cannot cross a paragraph: a stray backtick must not leave the HTML behind a blank
    line unescaped (the markdown renderer would render it as HTML)."""
    from chatengine.app.ui.render import escape_html, unescape_html

    text = "`a\n\n<img src=x onerror=alert(1)>\n\n`"
    assert "<img" not in escape_html(text) and "&lt;img" in escape_html(text)
    assert unescape_html(escape_html(text)) == text
    assert escape_html("`a <b>\ncode` and <i>") == "`a <b>\ncode` and &lt;i>"  # one paragraph: a span


def test_a_markdown_image_is_shown_as_a_link_not_fetched():
    from chatengine.app.ui.render import escape_html, unescape_html

    text = "Done. ![status](https://elsewhere.example/?q=the+secret) and `![kept](in code)`"
    shown = escape_html(text)
    assert "![status]" not in shown and "&#33;[status](https://elsewhere.example/?q=the+secret)" in shown
    assert "`![kept](in code)`" in shown
    assert unescape_html(shown) == text
