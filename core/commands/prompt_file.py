"""`weft generate --prompt-file FILE.jsonl`: the prompts decoded together, one JSON object a
line (``{"prompt": "...", "images": [...], "videos": [...]}``, paths relative to the file)."""

from __future__ import annotations

import json
import pathlib

from weft.core.errors import WeftError


def read_prompt_file(path: pathlib.Path) -> list[dict]:
    """The prompts of ``--prompt-file PATH``, each ``{"prompt", "images", "videos"}`` with the
    paths resolved from the file's folder: checked here, each mistake a message naming its line."""
    if not path.is_file():
        raise WeftError(f"no such file: {path}; --prompt-file takes a JSONL file of prompts",
                        where="--prompt-file")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise WeftError(f"not JSON ({error.msg}); each line is one object, e.g. {{\"prompt\": \"...\"}}",
                            where=where) from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
            raise WeftError("each line needs \"prompt\": a string (and may give \"images\", \"videos\": lists of "
                            "paths)", where=where)
        paths = {}
        for key in ("images", "videos"):
            found = [(path.parent / p).resolve() for p in entry.get(key, [])]
            missing = [str(p) for p in found if not p.is_file()]
            if missing:
                raise WeftError(f"{key}: no such file {missing[0]}", where=where)
            paths[key] = [str(p) for p in found]
        prompts.append({"prompt": entry["prompt"], **paths})
    if not prompts:
        raise WeftError(f"{path} holds no prompt", where="--prompt-file")
    return prompts
