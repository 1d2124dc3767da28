"""A minimal OpenAI-compatible chat server for one local target: ``dflash-pipeline serve --target DIR --port N``.

For tests, and for users without vLLM or SGLang: ``POST /v1/chat/completions`` (``messages``, ``max_tokens`` or
``max_completion_tokens``, ``temperature`` 0 or absent, ``chat_template_kwargs``) and ``GET /v1/models``.
Greedy decoding only, one request at a time (a lock around generation), through the same code as the
regenerate rule's in-process backend (``render_prompt`` + ``generate_batch`` on one prompt), so its text is
what that backend gives for the same prompt. Like vLLM, the text is not stripped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .regenerate import generate_batch, render_prompt

log = logging.getLogger(__name__)


class ChatModel:
    """The target, its tokenizer and the lock that serialises generation."""

    def __init__(self, model, tokenizer, name: str):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.lock = threading.Lock()

    def complete(self, body: dict) -> dict:
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise ValueError("messages: a non-empty list of {role, content} with text content")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 256
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError("max_tokens: a positive integer")
        if body.get("temperature") not in (None, 0, 0.0):
            raise ValueError("this server decodes greedily only: temperature must be 0 or absent")
        kwargs = body.get("chat_template_kwargs") or {}
        ids = render_prompt(self.tokenizer, messages, **kwargs)
        with self.lock:
            [(tokens, hit_max)] = generate_batch(self.model, [ids], max_tokens)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "length" if hit_max else "stop"}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                      "total_tokens": len(ids) + len(tokens)},
        }


def make_handler(chat: ChatModel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload, ensure_ascii=False).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._send(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

        def do_GET(self):  # noqa: N802 (the http.server API)
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": chat.name, "object": "model",
                                                              "owned_by": "dflash-pipeline"}]})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self):  # noqa: N802
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._error(404, f"no route {self.path}")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                if not isinstance(body, dict):
                    raise ValueError("the request body must be a JSON object")
                result = chat.complete(body)
            except ValueError as error:
                self._error(400, str(error))
            except Exception as error:  # noqa: BLE001 (reported to the client, logged here)
                log.exception("request failed")
                self._error(500, f"{type(error).__name__}: {error}")
            else:
                self._send(200, result)

        def log_message(self, format, *args):  # noqa: A002 (the http.server API)
            log.info("%s %s", self.address_string(), format % args)

    return Handler


def serve(target: str, *, host: str = "127.0.0.1", port: int = 8000, dtype: str = "float32",
          device: str | None = None, name: str | None = None) -> None:
    """Load ``target`` and serve it until interrupted."""
    from pathlib import Path

    import torch

    from .target import load_target, load_tokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    chat = ChatModel(load_target(target, dtype=dtype, device=device), load_tokenizer(target),
                     name or Path(target).name)
    server = ThreadingHTTPServer((host, port), make_handler(chat))
    log.info("serving %s (%s on %s) on http://%s:%d/v1", chat.name, dtype, device, host, server.server_address[1])
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
