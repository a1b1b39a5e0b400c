"""Prompt sets for `dcache eval` / `dcache generate --prompts`: builtin sets and prompt files, with clear errors.

A prompt set is a list of strings. For the bundled tiny model a "prompt" is a digit label "0".."9".

    load_prompts("builtin", is_tiny=True)      # ["0", "1", ..., "9"]
    load_prompts("builtin", is_tiny=False)     # BUILTIN_PROMPTS (8 short, varied text prompts)
    load_prompts("prompts.txt", ...)           # one prompt per line; blank lines and lines starting with '#' skipped
    load_prompts("prompts.json", ...)          # ["a cat", ...] or [{"prompt": "a cat"}, ...]
    load_prompts("prompts.jsonl", ...)         # one {"prompt": ...} object (or a JSON string) per line
    load_prompts("0,3,7", is_tiny=True)        # inline comma-separated labels (tiny model only)
"""

from __future__ import annotations

import json
from pathlib import Path

DIGIT_LABELS = [str(i) for i in range(10)]

# Small, varied, license-free prompts (objects, scenes, text rendering, people, styles) for text-to-image/video.
BUILTIN_PROMPTS = [
    "a photo of a red fox sitting in fresh snow, morning light",
    "a bowl of ramen on a wooden table, steam rising, close-up",
    "a lighthouse on a rocky coast during a storm, dramatic clouds",
    "a watercolor painting of a small village by a river",
    "a portrait of an elderly woman smiling, soft window light",
    "a neon sign that says 'OPEN' in a rainy city street at night",
    "an astronaut riding a horse on the moon, digital art",
    "a cozy reading nook with a cat asleep on a stack of books",
]

BUILTIN_SETS = {"builtin", "builtin:digits", "builtin:text"}


class PromptError(ValueError):
    """A prompt file or spec that cannot be used; the message says what is wrong and how to fix it."""


def load_prompts(spec: str | None, *, is_tiny: bool, limit: int | None = None) -> list[str]:
    """Prompts from `spec` ("builtin", "builtin:digits", "builtin:text", a file path, or inline labels for the
    tiny model). `limit` keeps the first N. Raises PromptError with the reason and the fix."""
    spec = _spec(spec)
    if spec in BUILTIN_SETS:
        kind = spec.partition(":")[2] or ("digits" if is_tiny else "text")
        prompts = list(DIGIT_LABELS if kind == "digits" else BUILTIN_PROMPTS)
    elif spec.startswith("builtin"):
        raise PromptError(f"unknown builtin prompt set {spec!r}; use one of {sorted(BUILTIN_SETS)} or a file path.")
    else:
        path = Path(spec)
        if path.is_file():
            prompts = _read_file(path)
        elif is_tiny and _labels(spec):
            prompts = [p.strip() for p in spec.split(",")]
        else:
            raise PromptError(f"prompt file {spec!r} does not exist; pass a .txt (one prompt per line), .json (a list "
                              f"of strings or of {{\"prompt\": ...}} objects) or .jsonl file, or 'builtin'.")
    if is_tiny:  # the labels dcache generate --prompt takes: "3" or "three"
        bad = [p for p in prompts if _digit(p) is None]
        if bad:
            raise PromptError(f"the bundled digit model takes class labels 0-9 or digit words ('seven') as prompts, "
                              f"got {bad[:5]} in {spec!r}; write one label per line, or use 'builtin'.")
        prompts = [str(_digit(p)) for p in prompts]
    if limit is not None:
        if limit < 1:
            raise PromptError(f"--num-prompts {limit} must be >= 1.")
        prompts = prompts[:limit]
    return prompts


def precheck_prompts(spec: str | None) -> None:
    """Fail early (before a model loads) on a prompt file that is missing, empty or malformed. Builtin sets and
    inline labels ("0,3,7") pass; whether labels fit the model is checked by load_prompts once the model is known."""
    spec = _spec(spec)
    if spec.startswith("builtin") or _labels(spec):
        if spec.startswith("builtin") and spec not in BUILTIN_SETS:
            raise PromptError(f"unknown builtin prompt set {spec!r}; use one of {sorted(BUILTIN_SETS)} or a file "
                              f"path.")
        return
    load_prompts(spec, is_tiny=False)


def _digit(prompt: str) -> int | None:
    """The digit a prompt names ("3", " 07 ", "seven", "Seven"); None if it names none (e.g. "12")."""
    from dcache.pipelines.tiny_pipeline import DIGIT_WORDS

    text = prompt.strip().lower()
    if text.isdigit():
        return int(text) if int(text) <= 9 else None
    return DIGIT_WORDS.index(text) if text in DIGIT_WORDS else None


def _labels(spec: str) -> bool:
    """Inline labels for the bundled model: "0,3,7", "three,7" (and "12": a label, refused as one once checked)."""
    return all(p.strip().isdigit() or _digit(p) is not None for p in spec.split(","))


def _spec(spec: str | None) -> str:
    """None (not given) is the builtin set; an empty or blank value given on purpose (`--prompts ""`) is an error."""
    if spec is None:
        return "builtin"
    if not str(spec).strip():
        raise PromptError("--prompts is empty; pass a prompt file (.txt one per line, .json, .jsonl), 'builtin', or "
                          "labels like 0,3,7 for the bundled model (leave --prompts out for one --prompt).")
    return str(spec).strip()


def _read_file(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"prompt file {str(path)!r} is not UTF-8 text ({exc}); save it as UTF-8.") from None
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PromptError(f"prompt file {str(path)!r} is not valid JSON (line {exc.lineno}: {exc.msg}); expected "
                              f"a list like [\"a cat\", \"a dog\"] or [{{\"prompt\": \"a cat\"}}].") from None
        if isinstance(data, dict) and "prompts" in data:
            data = data["prompts"]
        if not isinstance(data, list):
            raise PromptError(f"prompt file {str(path)!r} holds a JSON {type(data).__name__}; expected a list of "
                              f"prompts (or {{\"prompts\": [...]}}).")
        prompts = [_entry(item, path, i + 1) for i, item in enumerate(data)]
    elif suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptError(f"{str(path)!r} line {n} is not valid JSON ({exc.msg}); each line of a .jsonl "
                                  f"prompt file is {{\"prompt\": \"...\"}} or a JSON string.") from None
            prompts.append(_entry(item, path, n))
    else:
        prompts = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise PromptError(f"prompt file {str(path)!r} holds no prompts; write one prompt per line (.txt) or a JSON "
                          f"list.")
    return prompts


def _entry(item: object, path: Path, where: int) -> str:
    if isinstance(item, dict):
        item = item.get("prompt", item.get("text", item.get("caption")))
    if isinstance(item, (int, float)) and not isinstance(item, bool):
        item = str(item)
    if not isinstance(item, str) or not item.strip():
        raise PromptError(f"{str(path)!r} entry {where} is not a prompt (a non-empty string or an object with a "
                          f"'prompt' field).")
    return item.strip()


__all__ = ["load_prompts", "precheck_prompts", "PromptError", "BUILTIN_PROMPTS", "DIGIT_LABELS"]
