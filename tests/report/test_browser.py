"""The HTML report in a real headless Chromium: it renders, the findings are visible, nothing is
fetched from the network, and user strings (model names, messages) are inert text.

Chromium is Debian's `chromium`; `.ci/run` installs it when absent. Without it this test
skips with the reason (a developer machine that has not installed it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import torch

import onnxmedic

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                "(.ci/run installs it: apt-get install chromium)")

PAYLOAD = "<img src=x onerror=\"document.title='PWNED'\"><script>document.title='PWNED'</script>"


# Chromium's own background requests (component updater, clock, accounts) go through the proxy
# too, whatever the flags; only requests for other hosts can come from the page.
_BROWSER_HOSTS = (".google.com", ".googleapis.com", ".gstatic.com", ".gvt1.com")


class _Trap:
    """A proxy that answers nothing and records the host of every request Chromium sends."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.hosts: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(5)
            try:
                head = conn.recv(1024).decode("latin-1")
            except OSError:
                head = ""
            conn.close()
            if not head:  # a connection opened ahead (preconnect) that never asked for anything
                continue
            target = head.split(" ")[1] if head.count(" ") >= 2 else "?"
            host = target.split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0]
            self.hosts.append(host)

    @property
    def hits(self) -> list[str]:
        """Hosts requested other than the browser's own services."""
        return [h for h in self.hosts if not h.endswith(_BROWSER_HOSTS)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


def _dump_dom(page: Path, tmp_path: Path, proxy_port: int) -> str:
    profile = tmp_path / "profile"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--disable-extensions", f"--user-data-dir={profile}",
           f"--proxy-server=http://127.0.0.1:{proxy_port}", "--proxy-bypass-list=<-loopback>",
           "--virtual-time-budget=3000", "--dump-dom", page.as_uri()]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def _hostile_model() -> torch.nn.Module:
    def forward(self, x):
        if x.sum() > 0:  # data-dependent: a failing export with findings and a snippet
            return x * 2
        return x - 1

    cls = type(PAYLOAD, (torch.nn.Module,), {"forward": forward})
    return cls()


def test_report_renders_offline_and_user_strings_are_inert(tmp_path):
    report = tmp_path / "report.html"
    r = onnxmedic.export(_hostile_model(), (torch.ones(3),), report=report,
                         model_spec=PAYLOAD)
    assert not r.ok
    trap = _Trap()
    try:
        dom = _dump_dom(report, tmp_path, trap.port)
        assert trap.hits == [], f"the report fetched from the network: {trap.hits}"
    finally:
        trap.close()
    # rendered: the stage table and the findings are in the DOM Chromium built
    assert 'id="findings"' in dom and "OM114" in dom and "OM601" in dom
    assert "x.sum() &gt; 0" in dom  # the user's line, as text
    # inert: the payload is text, never markup; nothing it carries ran
    assert "<title>PWNED" not in dom and "document.title='PWNED'\"><script>" not in dom
    assert "&lt;script&gt;document.title='PWNED'&lt;/script&gt;" in dom
    assert "<img src=\"x\"" not in dom


def test_the_network_trap_sees_a_page_that_fetches(tmp_path):
    """The check above is only worth something if a fetching page is caught."""
    page = tmp_path / "fetches.html"
    page.write_text('<html><body><img src="http://onnxmedic.invalid/x.png"></body></html>')
    trap = _Trap()
    try:
        _dump_dom(page, tmp_path, trap.port)
        assert "onnxmedic.invalid" in trap.hits
    finally:
        trap.close()
