"""The test servers' launcher: ports outside the kernel's ephemeral range, and a relaunch when the port was taken
between the check and the server's bind (a fresh-clone CI run lost a server that way)."""

import socket
import sys

from policy_bundle.loadtest import servers
from policy_bundle.loadtest.servers import Server, free_port, port_range

# binds its port and serves /readyz, or prints the bind error and exits 1, as `bentoml serve` does
TOY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
try:
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
except OSError as exc:
    print(exc); sys.exit(1)
server.serve_forever()
"""


class ToyServer(Server):
    def command(self, target):
        return [sys.executable, "-c", TOY, str(self.port)]


def ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_ports_are_drawn_below_the_ephemeral_range_and_are_free():
    for _ in range(20):
        port = free_port()
        low, high = port_range()
        assert low <= port <= high < ephemeral_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_server_that_lost_its_port_is_relaunched_on_another(tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    draws = iter([taken.getsockname()[1]])
    real = servers.free_port
    monkeypatch.setattr(servers, "free_port", lambda: next(draws, None) or real())
    server = ToyServer({}, tmp_path / "toy.log")
    try:
        assert server.port == taken.getsockname()[1]  # the first draw is the taken port
        server.wait_ready(60)
        assert server.port != taken.getsockname()[1] and "Address already in use" not in server.log.read_text()
    finally:
        server.stop()
        taken.close()


def test_a_server_that_exits_for_another_reason_is_not_relaunched(tmp_path):
    class Broken(Server):
        def command(self, target):
            return [sys.executable, "-c", "import sys; print('bad config'); sys.exit(2)"]

    server = Broken({}, tmp_path / "broken.log")
    try:
        server.wait_ready(30)
    except RuntimeError as exc:
        assert "exited early" in str(exc) and "bad config" in str(exc)
    else:
        raise AssertionError("a server that exits on its own must not be reported ready")
    finally:
        server.stop()
