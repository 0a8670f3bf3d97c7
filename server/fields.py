"""Reading one field of a request's JSON body: present or not, of its type and range, or a 400 naming it."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from server.errors import bad_field

UNSET = object()
"""What `field` gives for a field the body does not have."""


def field(body: Mapping[str, Any], name: str) -> Any:
    """The field's value as given (null included), or `UNSET`."""
    return body.get(name, UNSET)


def get_int(body: Mapping[str, Any], name: str, default: Any, lo: int | None = None,
            hi: int | None = None) -> Any:
    """An optional integer field (integral floats accepted), range-checked; null gives `default`."""
    v = field(body, name)
    if v is UNSET or v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise bad_field(name, f"'{name}' must be an integer, got {v!r}", "invalid_type")
    if lo is not None and v < lo:
        raise bad_field(name, f"'{name}' must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise bad_field(name, f"'{name}' must be <= {hi}, got {v}")
    return int(v)


def get_number(body: Mapping[str, Any], name: str, default: Any) -> Any:
    """An optional finite number field; null gives `default`."""
    v = field(body, name)
    if v is UNSET or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise bad_field(name, f"'{name}' must be a finite number, got {v!r}", "invalid_type")
    return float(v)


def get_bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """An optional boolean field; null gives `default`."""
    v = field(body, name)
    if v is UNSET or v is None:
        return default
    if not isinstance(v, bool):
        raise bad_field(name, f"'{name}' must be a boolean, got {v!r}", "invalid_type")
    return v


def get_str(body: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """An optional string field; null gives `default`."""
    v = field(body, name)
    if v is UNSET or v is None:
        return default
    if not isinstance(v, str):
        raise bad_field(name, f"'{name}' must be a string, got {type(v).__name__}", "invalid_type")
    return v


def stop(body: Mapping[str, Any]) -> list[str]:
    """`stop`: a string or a list of non-empty strings, as a list."""
    v = field(body, "stop")
    if v is UNSET or v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_field("stop", "'stop' must be a string or a list of strings", "invalid_type")
    if any(not s for s in v):
        raise bad_field("stop", "'stop' must not contain an empty string")
    return v


def str_list(body: Mapping[str, Any], name: str) -> list[str] | None:
    """An optional list of strings; null gives None."""
    v = field(body, name)
    if v is UNSET or v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(w, str) for w in v):
        raise bad_field(name, f"'{name}' must be a list of strings", "invalid_type")
    return v


def int_list(body: Mapping[str, Any], name: str) -> list[int]:
    """An optional list of non-negative integers (token ids); null gives []."""
    v = field(body, name)
    if v is UNSET or v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise bad_field(name, f"'{name}' must be a list of non-negative integers", "invalid_type")
    return v


def logit_bias(body: Mapping[str, Any]) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: an object from token ids (JSON keys are strings) to biases in [-100, 100]."""
    value = field(body, "logit_bias")
    if value is UNSET or value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad_field("logit_bias", "'logit_bias' must be an object mapping token ids to biases", "invalid_type")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise bad_field("logit_bias", f"'logit_bias' keys must be token ids (non-negative integers), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or not math.isfinite(bias):
            raise bad_field("logit_bias", f"'logit_bias' values must be finite numbers, got {bias!r} for {key}",
                            "invalid_type")
        out[int(key)] = bias
    return out


def with_sampling_defaults(body: Any, defaults: Mapping[str, Any]) -> Any:
    """`body` with the model's sampling defaults (`jaxserve.generation_config`; not its `max_tokens` cap) in the
    fields it leaves out or sets to null; a beam search's ranking takes none of them."""
    if not defaults or not isinstance(body, Mapping) or body.get("use_beam_search"):
        return body
    fill = {k: v for k, v in defaults.items() if k != "max_tokens" and body.get(k) is None}
    return {**body, **fill} if fill else body


def with_server_defaults(body: Any, config: Any, sampling: Mapping[str, Any] | None = None) -> Any:
    """`body` with the server's request defaults (`ServerConfig`): a chat's `chat_template_kwargs` over
    `default_chat_template_kwargs` (the request's keys win), `return_tokens_as_token_ids` where it leaves it out; and
    the model's `sampling` defaults (`with_sampling_defaults`)."""
    body = with_sampling_defaults(body, sampling or {})
    if not isinstance(body, Mapping):
        return body
    given = body.get("chat_template_kwargs")
    if "messages" in body and config.default_chat_template_kwargs and (given is None or isinstance(given, Mapping)):
        body = {**body, "chat_template_kwargs": {**config.default_chat_template_kwargs, **(given or {})}}
    if config.return_tokens_as_token_ids and body.get("return_tokens_as_token_ids") is None:
        body = {**body, "return_tokens_as_token_ids": True}
    return body
