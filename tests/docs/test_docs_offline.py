"""The built docs draw their Mermaid diagrams with no network (issue 23).

The site is served from 127.0.0.1 and opened in headless Chromium; every request to
anywhere else is aborted and recorded. Each page with a diagram must end up with the
theme's rendered diagram (an ``<svg>`` in the closed shadow root of ``div.mermaid``,
read through the DevTools protocol, which sees closed shadow roots) and not the
Mermaid source text, and no request may have left loopback. A screenshot of each
diagram is saved under the test's tmp path, and its path printed.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from playwright.sync_api import Browser, Page
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from pgleaderlock import LockState

REPO: Final = Path(__file__).resolve().parents[2]
VENDORED: Final = REPO / "docs" / "assets" / "vendor" / "mermaid"

# Every page of the site with a Mermaid diagram (test_every_diagram_page_is_checked
# keeps this list complete).
DIAGRAM_PAGES: Final = ("state-machine", "fencing", "guarantees")

_RENDER_TIMEOUT_MS: Final = 30_000


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def site_url(site_dir: Path) -> Iterator[str]:
    """The built site, served over HTTP on 127.0.0.1 by a thread of this process."""
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="docs-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _attributes(node: dict[str, Any]) -> dict[str, str]:
    flat = node.get("attributes", [])
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _children(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [*node.get("children", []), *node.get("shadowRoots", [])]


def _find(node: dict[str, Any], tag: str, cls: str | None = None) -> Iterator[dict[str, Any]]:
    if node.get("localName") == tag and (
        cls is None or cls in _attributes(node).get("class", "").split()
    ):
        yield node
    for child in _children(node):
        yield from _find(child, tag, cls)


def _text(node: dict[str, Any]) -> str:
    if node.get("nodeType") == 3:  # a text node
        return str(node.get("nodeValue", ""))
    return " ".join(_text(child) for child in _children(node))


def _rendered_diagrams(page: Page) -> list[dict[str, Any]]:
    """The ``<svg>`` of each ``div.mermaid`` on the page, from its closed shadow root."""
    cdp = page.context.new_cdp_session(page)
    try:
        tree = cdp.send("DOM.getDocument", {"depth": -1, "pierce": True})
    finally:
        cdp.detach()
    svgs = []
    for host in _find(tree["root"], "div", "mermaid"):
        inside = [svg for root in host.get("shadowRoots", []) for svg in _find(root, "svg")]
        assert inside, "a div.mermaid without an <svg> in its shadow root"
        svgs.append(inside[0])
    return svgs


def _open_offline(browser: Browser, url: str, origin: str) -> tuple[Page, list[str]]:
    """A new page at ``url`` whose requests outside ``origin`` are aborted; the second
    item lists every request the page and its workers made."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    requested: list[str] = []
    context.on("request", lambda request: requested.append(request.url))

    def only_local(route: Any) -> None:
        if route.request.url.startswith(origin):
            route.continue_()
        else:
            route.abort("internetdisconnected")

    context.route("**/*", only_local)
    page = context.new_page()
    page.goto(url, wait_until="load")
    return page, requested


def test_the_site_serves_the_pinned_mermaid_with_its_licence(site_dir: Path) -> None:
    readme = (VENDORED / "README.md").read_text()
    pinned = re.search(r"sha256\(mermaid\.min\.js\) = ([0-9a-f]{64})", readme)
    assert pinned is not None, "docs/assets/vendor/mermaid/README.md names no checksum"
    served = site_dir / "assets" / "vendor" / "mermaid"
    assert hashlib.sha256((served / "mermaid.min.js").read_bytes()).hexdigest() == pinned.group(1)
    assert (served / "LICENSE").read_text().startswith("The MIT License")
    page = (site_dir / "state-machine" / "index.html").read_text()
    assert '<script src="../assets/vendor/mermaid/mermaid.min.js">' in page


def test_every_diagram_page_is_checked(site_dir: Path) -> None:
    with_diagrams = {
        str(html.parent.relative_to(site_dir))
        for html in site_dir.rglob("*.html")
        if 'class="mermaid"' in html.read_text()
    }
    assert with_diagrams == set(DIAGRAM_PAGES)


@pytest.mark.parametrize("name", DIAGRAM_PAGES)
def test_diagrams_render_with_no_network(
    name: str,
    site_dir: Path,
    site_url: str,
    chromium: Browser,
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    html = (site_dir / name / "index.html").read_text()
    expected = html.count('<pre class="mermaid">')
    assert expected > 0
    page, requested = _open_offline(chromium, f"{site_url}{name}/", site_url)
    try:
        try:
            # The theme replaces each <pre class="mermaid"> (the source) by a
            # <div class="mermaid"> holding the drawn diagram.
            page.wait_for_function(
                """n => document.querySelectorAll('pre.mermaid').length === 0
                    && document.querySelectorAll('div.mermaid').length === n""",
                arg=expected,
                timeout=_RENDER_TIMEOUT_MS,
            )
        except PlaywrightTimeoutError:
            source = page.evaluate(
                """() => Array.from(document.querySelectorAll('article pre'))
                    .map(pre => pre.innerText)
                    .filter(text => /^(stateDiagram|sequenceDiagram)/.test(text))"""
            )
            pytest.fail(
                f"{name}: the Mermaid diagrams were not drawn; shown as source text: "
                f"{source!r}; requests: {requested!r}"
            )
        svgs = _rendered_diagrams(page)
        shot = tmp_path / f"{name}-diagram.png"
        page.locator("div.mermaid").first.screenshot(path=shot)
        print(f"screenshot of the first diagram on {name}: {shot}")
        record_property("screenshot", str(shot))
        visible = page.locator("article").inner_text()
        page_text = page.content()
    finally:
        page.context.close()

    assert len(svgs) == expected
    for svg in svgs:
        assert _attributes(svg).get("aria-roledescription") in {"stateDiagram", "sequence"}
    assert "stateDiagram" not in visible
    assert "sequenceDiagram" not in visible
    assert '<pre class="mermaid"' not in page_text
    if name == "state-machine":
        drawn = _text(svgs[0])
        missing = [state.name for state in LockState if state.name not in drawn]
        assert not missing, f"states not in the drawn diagram: {missing}"
    assert shot.stat().st_size > 0

    # Nothing left loopback: every request went to the local server.
    assert requested, "the page made no request at all"
    outside = [url for url in requested if not url.startswith(site_url)]
    assert not outside, f"requests that left 127.0.0.1: {outside}"
