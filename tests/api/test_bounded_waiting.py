# Waiting has a bound on the frontend's side: a streamed reply whose first event is late (its request
# queued) gets its headers and keep-alive comments at once, a late error after that is an error event;
# invalid Unicode is a 400; a client that trickles its request head, pauses inside its body or stops reading
# what is sent to it is cut off.
import asyncio
import base64
import contextlib
import json
import os
import select
import socket
import struct
import threading
import time
from http.client import HTTPConnection

import httpx
import uvicorn

from omnistage.core.errors import OverloadedError
from openai_frontend import middleware, sse
from openai_frontend.app import create_app
from omnistage.launch.process import free_port

from .fake_omni import Script, Step, tone

USER = [{"role": "user", "content": "hi"}]


def test_a_late_first_event_gets_headers_and_keep_alives_at_once(server, fake, monkeypatch):
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.3)
    fake.script = Script(steps=[Step("Hello", delay_s=2.0), Step(" world")])
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={"messages": USER, "stream": True},
                      timeout=30) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line]
    # the comments came while the backend had not answered: the headers had gone out before its first event
    assert r.status_code == 200 and lines[:2] == [": keep-alive"] * 2, lines
    assert lines[-1] == "data: [DONE]" and any('"Hello"' in line for line in lines), lines


def test_an_error_after_the_headers_is_an_error_event(server, fake):
    fake.script = Script(steps=[Step("", delay_s=1.5)], error=OverloadedError("no turn within 60s in its queue"))
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={"messages": USER, "stream": True},
                      timeout=30) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[0] == ": keep-alive", lines
    error = json.loads(next(line for line in lines if line.startswith('data: {"error"'))[6:])["error"]
    assert error["type"] == "service_unavailable_error" and "no turn" in error["message"], error
    assert lines[-1] == "data: [DONE]"


def test_a_lone_surrogate_is_a_400_naming_the_message(http):
    for message in ('{"role":"user","content":"a\\ud800b"}', '{"role":"user","name":"\\udfff","content":"hi"}',
                    '{"role":"user","content":[{"type":"text","text":"\\udc00"}]}'):  # fmt: skip
        r = http.post("/v1/chat/completions", content=f'{{"messages":[{message}],"max_tokens":2}}',
                      headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[0]" and "surrogate" in r.json()["error"]["message"]
    ok = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "\U0001F600"}]})
    assert ok.status_code == 200  # a proper pair (escaped by json as \ud83d\ude00) is fine


def test_a_lone_surrogate_outside_the_messages_is_a_400_naming_the_field(http, fake):
    # tools reach the chat template and the JSON sent to Triton as they are, where a surrogate cannot be
    # encoded: it must be refused while the request is validated
    hi = '{"role":"user","content":"hi"}'
    for field, value in (("tools", '[{"type":"function","function":{"name":"f","description":"\\ud800"}}]'),
                         ("tools", '[{"type":"function","function":{"name":"f","parameters":{"\\udc00":{}}}}]'),
                         ("stop", '["\\ud800"]')):  # fmt: skip
        r = http.post("/v1/chat/completions", content=f'{{"messages":[{hi}],"max_tokens":2,"{field}":{value}}}',
                      headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and "surrogate" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", content=f'{{"messages":[{{"role":"user","content":"hi","\\ud800":1}}]}}',
                  headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0]", r.text  # a key of a message
    assert fake.calls == []


def test_a_body_that_stops_half_way_is_a_408(server, monkeypatch):
    monkeypatch.setattr(middleware, "BODY_READ_TIMEOUT_S", 0.5)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"messages\":")  # fmt: skip
        answer = s.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 408"), answer[:200]


def _closed_while_trickling(s: socket.socket, data: bytes, every_s: float) -> bool:
    """Send `data` a byte at a time; True once the server has closed the connection."""
    for byte in data:
        try:
            s.sendall(bytes([byte]))
            if select.select([s], [], [], every_s)[0] and s.recv(4096) == b"":
                return True
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


@contextlib.contextmanager
def _bounded_server(fake, **config):
    """The frontend on uvicorn with the HTTP protocol `python -m openai_frontend` runs (BoundedH11Protocol)."""
    port = free_port()
    config = uvicorn.Config(create_app(fake, default_voice="ethan"), port=port, log_level="warning",
                            http=middleware.BoundedH11Protocol, **config)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_connection_that_trickles_its_request_head_is_closed(fake, monkeypatch):
    monkeypatch.setattr(middleware, "HEAD_TIMEOUT_S", 0.5)
    with _bounded_server(fake) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
            assert s.recv(4096) == b""  # closed by the server, with no answer (not the 10 s socket timeout)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200  # others are served


def test_a_kept_alive_connection_that_trickles_its_next_head_is_closed(fake, monkeypatch):
    # any byte stops uvicorn's keep-alive timer (a long one here, as behind a load balancer): the head
    # deadline must hold for the second request of a connection as for its first
    monkeypatch.setattr(middleware, "HEAD_TIMEOUT_S", 0.5)
    with _bounded_server(fake, timeout_keep_alive=60) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            time.sleep(1.0)  # idle past the head deadline: an idle kept-alive connection stays open
            start = time.monotonic()
            assert _closed_while_trickling(s, b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 200, every_s=0.05)
            assert time.monotonic() - start < 5  # the deadline, not the 60 s keep-alive timeout
        conn = HTTPConnection("127.0.0.1", port, timeout=10)
        for _ in range(2):  # a complete later head is served on the same connection, however late it comes
            conn.request("GET", "/health")
            assert conn.getresponse().read() == b'{"status":"ok"}'
            time.sleep(1.0)
        conn.close()


def _lots_of_audio_then_hang() -> Script:
    # 200 s of audio (~13 MB of events) at once, more than the kernel's socket buffers hold, and no end
    return Script(steps=[Step("a", audio=tone(24000))] * 200, hang=True)


def _non_reading_socket(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the client's side of the buffers stays small
    s.connect(("127.0.0.1", port))
    return s


def test_a_streamed_reply_nobody_reads_is_cut_off_and_cancelled(fake, monkeypatch):
    # a client that stops reading (and keeps its connection open) would hold the connection, its backend
    # request and everything buffered for it for as long as it likes
    monkeypatch.setattr(middleware, "WRITE_STALL_TIMEOUT_S", 0.5)
    fake.script = _lots_of_audio_then_hang()
    body = json.dumps({"messages": USER, "stream": True, "modalities": ["text", "audio"],
                       "audio": {"format": "pcm16"}}).encode()  # fmt: skip
    with _bounded_server(fake) as port, _non_reading_socket(port) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
        assert fake.cancelled.wait(20), "the backend stream of a reply nobody reads was never cancelled"
        assert _drained_until_closed(s)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200


def test_a_realtime_session_that_stops_reading_is_cut_off_and_its_response_cancelled(fake, monkeypatch):
    monkeypatch.setattr(middleware, "WRITE_STALL_TIMEOUT_S", 0.5)
    fake.script = _lots_of_audio_then_hang()
    with _bounded_server(fake, ws=middleware.BoundedWebSocketProtocol) as port, _non_reading_socket(port) as s:
        key = base64.b64encode(os.urandom(16))
        s.sendall(b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  b"Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n\r\n" % key)  # fmt: skip
        head = b""
        while b"\r\n\r\n" not in head:  # a client sends no frame before the handshake's answer
            head += s.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head
        event = json.dumps({"type": "response.create", "response": {"instructions": "speak"}}).encode()
        mask = os.urandom(4)
        s.sendall(bytes([0x81, 0x80 | 126]) + struct.pack(">H", len(event)) + mask
                  + bytes(b ^ mask[i % 4] for i, b in enumerate(event)))  # fmt: skip
        assert fake.cancelled.wait(20), "the response of a session that stopped reading was never cancelled"
        assert _drained_until_closed(s)


def _drained_until_closed(s: socket.socket) -> bool:
    """Read what the server had sent before it cut the connection off; True once it is closed."""
    s.settimeout(10)
    try:
        while s.recv(1 << 20):
            pass
    except ConnectionResetError:  # an aborted connection
        pass
    except TimeoutError:
        return False
    return True
