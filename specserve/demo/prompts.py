"""Held-out code-completion prompts, cut from the held-out stdlib files, for tests, benchmarks and
load tests. Each prompt is the text before a point where a programmer would want a completion,
ending at a line break; its category says what comes next."""

import ast
import json
import re
from pathlib import Path

from specserve.demo.corpus import read_source, split_files

CATEGORIES = {
    "function_body": "a function's signature (and docstring); the body comes next",
    "docstring": "a definition and the opening quotes of its docstring; the docstring text comes next",
    "class_methods": "a class and its first method; more methods come next",
    "imports": "the top of a module partway through its imports; more imports come next",
    "comments": "the first line of a comment block; the rest of the comment comes next",
    "boilerplate": "a dunder method signature or `if __name__ == '__main__':`; stock code comes next",
}
MAX_CONTEXT_CHARS = 1200
MIN_PROMPT_CHARS = 200
PER_FILE_PER_CATEGORY = 4


def _line_offsets(text: str) -> list[int]:
    offsets, pos = [0], 0
    for line in text.splitlines(keepends=True):
        pos += len(line)
        offsets.append(pos)
    return offsets


def _prompt_ending_at(text: str, end: int) -> str | None:
    """The text before end, at most MAX_CONTEXT_CHARS, starting at a line boundary."""
    start = max(0, end - MAX_CONTEXT_CHARS)
    if start > 0:
        start = text.find("\n", start) + 1
    prompt = text[start:end]
    return prompt if len(prompt) >= MIN_PROMPT_CHARS else None


def _cut_points(text: str) -> dict[str, list[int]]:
    """Character offsets where each category's prompt ends."""
    tree = ast.parse(text)
    lines = _line_offsets(text)
    cuts: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            body_start = node.body[0].lineno - 1
            doc = ast.get_docstring(node, clean=False)
            header_end = lines[body_start]
            if node.name.startswith("__") and node.name.endswith("__"):
                cuts["boilerplate"].append(header_end)
            elif doc is not None and len(node.body) > 1:
                cuts["function_body"].append(lines[node.body[0].end_lineno])
                quote = text.find('"""', header_end, lines[body_start + 1])
                if quote >= 0 and len(doc.strip()) > 20:
                    cuts["docstring"].append(quote + 3)
            elif doc is None:
                cuts["function_body"].append(header_end)
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if len(methods) >= 2:
                cuts["class_methods"].append(lines[methods[0].end_lineno])
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    for a, b in zip(imports, imports[1:]):
        if b.lineno == a.end_lineno + 1:
            cuts["imports"].append(lines[a.end_lineno])
    stripped = [line.strip() for line in text.splitlines()]
    for i in range(1, len(stripped) - 1):
        # The first line of a comment block of two or more lines.
        starts_block = stripped[i].startswith("#") and not stripped[i - 1].startswith("#")
        if starts_block and stripped[i + 1].startswith("#") and len(stripped[i]) > 10:
            cuts["comments"].append(lines[i + 1])
    for m in re.finditer(r"^if __name__ == ['\"]__main__['\"]:\n", text, re.M):
        cuts["boilerplate"].append(m.end())
    return cuts


def build_prompts(min_total: int = 200) -> list[dict]:
    train_files, held_out = split_files()
    training_text = "\n".join(read_source(f) for f in train_files)
    prompts, seen = [], set()
    for rel in held_out:
        text = read_source(rel)
        try:
            cuts = _cut_points(text)
        except SyntaxError:
            continue
        for category, ends in cuts.items():
            taken = 0
            for end in sorted(set(ends)):
                prompt = _prompt_ending_at(text, end)
                if prompt is None or prompt in seen or prompt in training_text:
                    continue
                seen.add(prompt)
                prompts.append({"id": f"{rel}:{text.count(chr(10), 0, end) + 1}:{category}",
                                "category": category, "prompt": prompt, "source": rel})
                taken += 1
                if taken >= PER_FILE_PER_CATEGORY:
                    break
    if len(prompts) < min_total:
        raise RuntimeError(f"only {len(prompts)} held-out prompts; wanted {min_total}")
    return prompts


def write_prompts(path: Path) -> list[dict]:
    prompts = build_prompts()
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    return prompts
