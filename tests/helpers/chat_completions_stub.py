"""An OpenAI-compatible chat-completions server on 127.0.0.1, run in a thread of the test process (no network).

The real ``openai`` client talks to it over HTTP; each request's JSON body is recorded, and the reply is a fixed
text (the assistant message's content), an HTTP error, or a delayed answer (for timeouts)::

    with ChatCompletionsStub(reply='{"global_layer": {}, "dynamic_layer": {}}') as server:
        enhancer = Magi2PromptEnhancer.from_endpoint(server.base_url, model="stub", max_retries=0)
        enhancer("a fox")
        server.requests[0]["messages"]
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ChatCompletionsStub:
    """Serves ``POST <base_url>/chat/completions``.

    Args:
        reply (`str`): The assistant message's content in every answer.
        status (`int`): The HTTP status; other than 200, an OpenAI-style error body is sent.
        delay_s (`float`): Seconds to wait before answering (a client timeout shorter than this times out).
    """

    def __init__(self, reply: str = "", status: int = 200, delay_s: float = 0.0):
        self.reply = reply
        self.status = status
        self.delay_s = delay_s
        self.requests: list[dict] = []
        self.paths: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> "ChatCompletionsStub":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _answer(self, body: dict) -> tuple[int, dict]:
        if self.status != 200:
            return self.status, {"error": {"message": f"stub error {self.status}", "type": "stub", "code": None}}
        return 200, {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", ""),
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": self.reply}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    def _handler_class(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                stub.paths.append(self.path)
                stub.requests.append(body)
                if stub.delay_s:
                    time.sleep(stub.delay_s)
                status, answer = stub._answer(body)
                data = json.dumps(answer).encode("utf-8")
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

            def log_message(self, format, *args):
                pass

        return Handler
