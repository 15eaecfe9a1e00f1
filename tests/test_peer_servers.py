"""The comparison's peer launcher (bench/peer_servers.py): a port picked at launch, and a start-up
that lost its port to another process tried again on a new one."""

from __future__ import annotations

import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import peer_servers  # noqa: E402
from peer_servers import PORT, PeerSpec, PortTakenError, start_on_free_port  # noqa: E402

# A peer with /health that, while `fail_file` holds a count above 0, exits at start-up with
# llama-server's words for a taken port (and counts down).
PEER = textwrap.dedent('''
    import http.server, sys
    from pathlib import Path
    port, fail_file = int(sys.argv[1]), Path(sys.argv[2])
    left = int(fail_file.read_text())
    if left > 0:
        fail_file.write_text(str(left - 1))
        print(f"start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {port}", flush=True)
        sys.exit(1)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *args):
            pass
    print(f"serving on {port}", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
''')


def _peer(tmp_path: Path, failures: int) -> PeerSpec:
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    fail_file = tmp_path / "fail"
    fail_file.write_text(str(failures))
    return PeerSpec("toy", "a /health server", [sys.executable, str(script), PORT, str(fail_file)], startup_timeout_s=30)


def test_a_lost_port_is_tried_again_on_a_new_one(tmp_path):
    log = tmp_path / "toy.log"
    with start_on_free_port(_peer(tmp_path, failures=2), log, attempts=3) as server:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=5) as r:
            assert r.status == 200
        assert f"serving on {server.port}" in server.log_tail()
        assert "couldn't bind" not in server.log_tail()  # the tail is this launch's, not the earlier ones'
    assert server.process.poll() is not None  # stopped on leaving the block
    assert log.read_text().count("couldn't bind") == 2


def test_it_gives_up_after_its_attempts_and_says_why(tmp_path):
    with pytest.raises(PortTakenError, match="couldn't bind"):
        start_on_free_port(_peer(tmp_path, failures=5), tmp_path / "toy.log", attempts=2)


def test_another_start_up_failure_is_not_retried(tmp_path):
    spec = PeerSpec("broken", "exits at once", [sys.executable, "-c", "import sys; print('no model'); sys.exit(3)",
                                                PORT], startup_timeout_s=30)
    with pytest.raises(RuntimeError, match="no model") as info:
        start_on_free_port(spec, tmp_path / "broken.log")
    assert not isinstance(info.value, PortTakenError)
    assert (tmp_path / "broken.log").read_text().count("no model") == 1


def test_the_peers_commands_take_the_port_at_launch(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("")
    spec = peer_servers.llama_spec(str(binary), tmp_path / "m.gguf", threads=2, slots=8, ctx_per_slot=512)
    assert spec.command[spec.command.index("--port") + 1] == PORT
    assert spec.on_port(4321)[spec.command.index("--port") + 1] == "4321"
