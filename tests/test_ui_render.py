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
