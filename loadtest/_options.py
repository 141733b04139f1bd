"""The load test's own options, declared once. Locust's parser gets them from the locustfile's
`init_command_line_parser` listener; `specserve loadtest` adds the same ones to its parser and forwards
every one of them to Locust (`to_argv`)."""

from dataclasses import dataclass
from typing import Any, Callable

from deployment.defaults import BASELINE_MODEL_ID, SPECULATIVE_MODEL_ID


def _truthy(text: str) -> bool:
    return str(text).lower() in ("1", "true", "yes", "on")


def _optional_int(text: str) -> int | None:
    return None if str(text).lower() in ("", "none") else int(text)


@dataclass(frozen=True)
class Option:
    flag: str
    type: Callable[[str], Any]
    default: Any
    help: str

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


OPTIONS = (
    Option("--max-tokens", int, 128, "output tokens per request"),
    Option("--temperature", float, 0.0, "sampling temperature (0: greedy)"),
    Option("--ignore-eos", _truthy, True, "generate past end-of-text, so that every request has --max-tokens"),
    Option("--speculative-model", str, SPECULATIVE_MODEL_ID, "model id that SpeculativeUser requests"),
    Option("--baseline-model", str, BASELINE_MODEL_ID, "model id that BaselineUser requests"),
    Option("--prompt-seed", _optional_int, None, "seed of the users' prompt sequences (the i-th user started "
           "draws the same prompts in every run given the same seed); none: unseeded. `specserve loadtest` gives "
           "every target of a round the same one (this value, 0 if none, plus the round's number)"),
)


def add_to(parser) -> None:
    for option in OPTIONS:
        parser.add_argument(option.flag, type=option.type, default=option.default, help=option.help)


def to_argv(namespace) -> list[str]:
    """The options' values in `namespace` as command-line arguments for Locust."""
    return [arg for option in OPTIONS for arg in (option.flag, str(getattr(namespace, option.dest)))]
