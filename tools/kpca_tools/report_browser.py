"""What a reader sees of a built Snakemake report in a browser: headless Chromium at a window size.

``chromium --headless --dump-dom`` loads a copy of the page with a probe script appended; the
probe runs after the page's own scripts (the report is a React app that renders on load),
scrolls every scrollable box to its top, as a reader does, and writes the position of what it
looks for into the DOM, which ``--dump-dom`` prints. No browser driver or CDP client is needed.

* :func:`landing_view`: the report's first view, the landing page (the workflow description
  beside the rule graph): its first heading and the "What this run built" paragraph;
* :func:`table_view`: a table's page (``results/html/<table>.html``): the first row's cell of a column.

Each returns the viewport (``innerWidth``, ``innerHeight``) and per item its text and its box in
viewport coordinates (``top``, ``bottom``, ``left``, ``right``), or None when absent;
:func:`in_viewport` says whether a box is wholly visible. Needs Chromium (Debian: ``apt-get
install chromium``); :func:`chromium` finds it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["chromium", "landing_view", "table_view", "in_viewport", "screenshot"]

_RECT = """
const rect = el => { if (!el) return null; const r = el.getBoundingClientRect();
  return {text: el.textContent.trim().slice(0, 300), top: r.top, bottom: r.bottom, left: r.left, right: r.right}; };
const topAll = () => { for (const el of document.querySelectorAll('*')) { if (el.scrollTop) el.scrollTop = 0; } window.scrollTo(0, 0); };
const done = out => { const pre = document.createElement('pre'); pre.id = 'kpca-probe';
  pre.textContent = JSON.stringify({innerWidth: innerWidth, innerHeight: innerHeight, ...out}); document.documentElement.appendChild(pre); };
"""

_LANDING = """
window.addEventListener('load', () => setTimeout(() => { topAll();
  const heading = document.querySelector('.prose h1, .prose h2, .prose h3');
  const built = [...document.querySelectorAll('.prose strong')].find(e => e.textContent.includes('What this run built'));
  done({heading: rect(heading), built: rect(built)}); }, 3000));
"""

_TABLE = """
window.addEventListener('load', () => setTimeout(() => { topAll();
  const table = document.querySelector('table'); const heads = [...table.querySelectorAll('thead th')].map(th => th.textContent.trim());
  const i = heads.indexOf(%s); const row = table.querySelector('tbody tr');
  done({columns: heads.length, cell: i < 0 || !row ? null : rect(row.children[i])}); }, 500));
"""


def chromium() -> str | None:
    """The path of a Chromium (``chromium``, ``chromium-browser``, ``google-chrome``) on PATH, or None."""
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def _flags(width: int, height: int) -> list[str]:
    return [chromium() or "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={width},{height}", "--virtual-time-budget=15000"]


def _probe(page: str, script: str, width: int, height: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "page.html"
        copy.write_text(page + f"<script>{_RECT}{script}</script>\n", encoding="utf-8")
        proc = subprocess.run([*_flags(width, height), "--dump-dom", copy.as_uri()], capture_output=True, text=True, timeout=timeout)
    m = re.search(r'<pre id="kpca-probe">(.*?)</pre>', proc.stdout, re.S)
    if m is None:
        raise RuntimeError(f"chromium printed no probe (exit status {proc.returncode}): {proc.stderr[-2000:]}")
    import html

    return json.loads(html.unescape(m.group(1)))


def landing_view(report: str | Path, width: int = 1600, height: int = 1000, timeout: float = 120) -> dict:
    """The landing page of ``report`` (a built ``report.html``) at ``width`` x ``height`` after scrolling
    to the top: ``heading`` (the description's first heading) and ``built`` ("What this run built")."""
    return _probe(Path(report).read_text(encoding="utf-8"), _LANDING, width, height, timeout)


def table_view(page: str, column: str, width: int = 1600, height: int = 1000, timeout: float = 120) -> dict:
    """A table's page (its HTML text) at ``width`` x ``height``: ``columns`` (the first table's
    header cells) and ``cell``, its first row's cell under the header ``column``."""
    return _probe(page, _TABLE % json.dumps(column), width, height, timeout)


def in_viewport(box: dict | None, view: dict) -> bool:
    """Whether ``box`` (an item of a view) lies wholly inside the viewport of ``view``."""
    return box is not None and box["top"] >= 0 and box["left"] >= 0 and box["bottom"] <= view["innerHeight"] and box["right"] <= view["innerWidth"]


def screenshot(page: str | Path, png: str | Path, width: int = 1600, height: int = 1000, timeout: float = 120) -> None:
    """A PNG of the page ``page`` (a file) at ``width`` x ``height``, to look at."""
    subprocess.run([*_flags(width, height), f"--screenshot={Path(png).resolve()}", Path(page).resolve().as_uri()], capture_output=True, timeout=timeout, check=True)
