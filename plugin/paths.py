"""Where the shipped demo pair and prompts live, relative to the repository."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
DEFAULT_TARGET = MODELS_DIR / "target"
DEFAULT_DRAFT = MODELS_DIR / "draft"
PROMPTS_FILE = REPO_ROOT / "loadtest" / "prompts.jsonl"
