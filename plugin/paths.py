"""Where the shipped demo pair and prompts live, relative to the repository.

SPECSERVE_TARGET / SPECSERVE_DRAFT point the tests and benchmarks at another pair (a path or a hub id).
"""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
DEFAULT_TARGET = os.environ.get("SPECSERVE_TARGET", str(MODELS_DIR / "target"))
DEFAULT_DRAFT = os.environ.get("SPECSERVE_DRAFT", str(MODELS_DIR / "draft"))
PROMPTS_FILE = REPO_ROOT / "loadtest" / "prompts.jsonl"
