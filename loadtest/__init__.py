"""Locust load tests of the specserve application (`locust -f loadtest/`), the report arithmetic, and the
held-out prompts they send. Talks HTTP only. Helper modules start with `_`, so Locust does not load them
as locustfiles."""

import json
import os
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.jsonl"


def load_prompts(path: Path | None = None, category: str | None = None) -> list[dict]:
    """The held-out prompts: dicts with id, category, prompt and source (see models/README.md)."""
    with open(path or PROMPTS_FILE) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if category is None or r["category"] == category]


def auth_headers() -> dict:
    """`Authorization: Bearer $SPECSERVE_API_KEY` when the variable is set (an application started with an
    API key), else nothing."""
    key = os.environ.get("SPECSERVE_API_KEY", "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}
