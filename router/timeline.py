"""A request's trace as a terminal timeline: one line per record, time since the first record."""

from __future__ import annotations

import json
from typing import Any

_SKIP_KEYS = frozenset({"candidates"})


def _short(data: dict[str, Any], width: int) -> str:
    parts = []
    for key, value in data.items():
        if key in _SKIP_KEYS:
            continue
        text = json.dumps(value, separators=(",", ":")) if not isinstance(value, str) else value
        parts.append(f"{key}={text}")
    line = " ".join(parts)
    return line if len(line) <= width else line[: width - 3] + "..."


def format_timeline(request_id: str, records: list[dict[str, Any]], width: int = 110) -> str:
    """Lines `+ms  layer  where  event  details`; an L2 pick also lists each candidate's score."""
    if not records:
        return f"request {request_id}: no records"
    t0 = records[0]["t"]
    lines = [f"request {request_id}: {len(records)} records over {1000 * (records[-1]['t'] - t0):.1f} ms"]
    for rec in records:
        where = rec.get("where", "")
        where = where.replace("http://", "")
        lines.append(f"{1000 * (rec['t'] - t0):9.2f} ms  {rec['layer']:<3} {where:<22} {rec['event']:<14} "
                     f"{_short(rec.get('data', {}), width - 56)}")
        for c in rec.get("data", {}).get("candidates", ()):
            lines.append(f"{'':15}{'':27}  candidate {c.get('url', '?').replace('http://', '')} "
                         + _short({k: v for k, v in c.items() if k != "url"}, width - 60))
    return "\n".join(lines)
