"""The HTTP server's configuration: one frozen dataclass, checked when built."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxserve.chat_template import compile_chat_template
from jaxserve.json_options import json_object
from server.reasoning import REASONING_PARSERS
from server.tool_parsers import PARSERS


@dataclass(frozen=True)
class ServerConfig:
    """How the OpenAI-compatible frontend listens, admits and shuts down.

    Attributes:
      host, port: where Hypercorn listens (port 0 picks a free one).
      api_key: when set, every route except /health, /ready, /metrics and /version needs
        `Authorization: Bearer <api_key>`.
      served_model_names: names clients may put in `model`; the first is reported. Empty means the
        engine's own model name.
      shutdown_timeout: seconds in-flight requests get to finish after SIGTERM before they are aborted.
      max_waiting_requests: past this many requests waiting for the engine, new ones get 429.
      max_request_body_bytes: larger request bodies get 413.
      max_request_id_length: longest `X-Request-Id` accepted.
      log_level: level of the server's loggers (access log included).
      retry_after_s: the `Retry-After` sent with 429 and 503.
      chat_template: a Jinja chat template used instead of the model's (its text).
      trust_request_chat_template: requests may give their own `chat_template` (vLLM's flag; refused without).
      enable_auto_tool_choice, tool_call_parser: `tool_choice: "auto"` is served when both are set;
        the parser (server/tool_parsers.py) finds the calls in the model's replies.
      reasoning_parser: splits a thinking model's reasoning from its answer (server/reasoning.py).
      responses_store_capacity: `/v1/responses` answers kept in memory for `previous_response_id` and
        `GET /v1/responses/{id}` (the newest ones; with 0 none is, and responses say `store: false`).
      allowed_origins, allow_credentials, allowed_methods, allowed_headers: CORS, as vLLM's flags (and its
        defaults: any origin, method and header, no credentials), so browser clients may call the API.
      ssl_keyfile, ssl_certfile, ssl_ca_certs: HTTPS with this key and certificate (and client certificates
        checked against these CAs); root_path: the path prefix a proxy serves the API under.
      default_chat_template_kwargs: what every chat's template gets (`{"enable_thinking": false}`), under a
        request's own `chat_template_kwargs` (vLLM's `--default-chat-template-kwargs`).
      return_tokens_as_token_ids: logprobs' tokens as "token_id:N" unless a request says otherwise (vLLM's flag).
      enable_log_requests, enable_log_outputs: log each engine request's prompt (text and token ids) and sampling
        parameters as it is submitted, and its outputs as it finishes (`jaxserve.server.requests`, INFO; vLLM's
        flags); max_log_len: at most this many characters of text and token ids in each (None: all).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    shutdown_timeout: float = 30.0
    max_waiting_requests: int = 256
    max_request_body_bytes: int = 16 * 1024 * 1024
    max_request_id_length: int = 256
    log_level: str = "info"
    retry_after_s: int = 1
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    responses_store_capacity: int = 1000
    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    root_path: str = ""
    default_chat_template_kwargs: str | Mapping[str, Any] = dataclasses.field(default_factory=dict)
    return_tokens_as_token_ids: bool = False
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    max_log_len: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to turn auth off)")
        object.__setattr__(self, "served_model_names", tuple(self.served_model_names))
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both ssl_keyfile and ssl_certfile")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs checks clients' certificates over HTTPS: give ssl_keyfile and ssl_certfile")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            if getattr(self, name) is not None and not os.path.isfile(getattr(self, name)):
                raise ValueError(f"{name} {getattr(self, name)!r} is not a file")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"root_path must start with '/' and not end with one, got {self.root_path!r}")
        if any(not n for n in self.served_model_names):
            raise ValueError("served_model_names must not contain an empty name")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        for name in ("max_waiting_requests", "max_request_body_bytes", "max_request_id_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.responses_store_capacity, int) or self.responses_store_capacity < 0:
            raise ValueError(f"responses_store_capacity must be >= 0, got {self.responses_store_capacity!r}")
        if self.log_level.lower() not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"log_level must be critical, error, warning, info or debug, got {self.log_level!r}")

        if self.chat_template is not None:
            compile_chat_template(self.chat_template)  # a template that does not compile fails here, named
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(PARSERS))}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}, "
                             f"got {self.reasoning_parser!r}")
        object.__setattr__(self, "default_chat_template_kwargs", dict(json_object(
            self.default_chat_template_kwargs, "default_chat_template_kwargs", '{"enable_thinking": false}')))
        if "chat_template" in self.default_chat_template_kwargs:
            raise ValueError("default_chat_template_kwargs may not hold a chat_template: give it as --chat-template")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser)")

    def replace(self, **changes) -> ServerConfig:
        """A copy with `changes` applied (and checked)."""
        return dataclasses.replace(self, **changes)
