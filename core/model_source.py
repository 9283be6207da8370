"""Where a model comes from: ``model.path`` (and ``--model-dir``) as users hold models.

- a local Hugging Face directory (config.json, safetensors, tokenizer): used as it is;
- a Hub id, ``org/name`` (``model.revision``: a branch, tag or commit, default ``main``): the
  snapshot in the local Hugging Face cache, found by huggingface_hub's own cache lookup
  (``try_to_load_from_cache``), which reads the cache's folders and never the network: weft
  downloads nothing, and an id that is not in the cache is a message naming where it looked;
- a GGUF file: converted once, by transformers' own GGUF reader (the ``gguf`` package),
  into a safetensors directory (config, float32 weights, tokenizer, chat template, generation
  config) in weft's cache, keyed by the file's SHA-256, and read from there after. The family
  then treats it as any directory. The weights are the GGUF's, dequantised: a 4-bit file gives
  its 4-bit rounding of the released model, exactly.

A local path wins over a Hub id of the same spelling, as in transformers' ``from_pretrained``.
"""

from __future__ import annotations

import os
import pathlib
import re

from weft.core.errors import WeftError

#: ``org/name`` as the Hub spells repository ids (no "..", no leading dot or dash).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


def is_hub_id(given: str) -> bool:
    return bool(_HUB_ID.match(given)) and ".." not in given


def hub_cache() -> pathlib.Path:
    """The Hugging Face hub cache, by its documented variables, read now (huggingface_hub's
    own constants are fixed when it is imported): HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return pathlib.Path(home).expanduser() / "hub"


def local_model_dir(given: str, *, base: pathlib.Path, revision: str | None, where: str) -> pathlib.Path:
    """The local directory ``given`` names: a folder (absolute, or relative to ``base``), the
    cached snapshot of a Hub id, or the converted folder of a GGUF file (converted on first
    use). A WeftError naming ``where`` when it is none of these."""
    path = pathlib.Path(given).expanduser()
    path = path if path.is_absolute() else base / path
    if path.is_file() and path.suffix.lower() == ".gguf":
        from weft.core.gguf_convert import converted_dir

        return converted_dir(path, where=where)
    if path.exists() or not is_hub_id(given):
        if revision is not None:
            raise WeftError(f"model.revision {revision!r} is for a Hub id in the local cache; {given!r} is a local "
                            "path", where=where)
        return path
    return hub_snapshot(given, revision=revision or "main", where=where, local=path)


def hub_snapshot(repo_id: str, *, revision: str, where: str, local: pathlib.Path) -> pathlib.Path:
    """The snapshot folder of ``repo_id`` at ``revision`` in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    cache = hub_cache()
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=revision)
    if isinstance(found, str):
        return pathlib.Path(found).parent
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    if not repo.is_dir():
        raise WeftError(
            f"{repo_id!r} is neither a folder ({local} does not exist) nor a model in the local Hugging Face cache "
            f"({repo} does not exist). weft reads the Hub's cache and never downloads: fill it where the Hub can be "
            f"reached (`hf download {repo_id}`) and copy the cache here, or point HF_HUB_CACHE (or HF_HOME) at a "
            "cache that has it, or give a local model directory", where=where)
    have = sorted({p.name for p in (repo / "refs").glob("*")} | {p.name for p in (repo / "snapshots").glob("*")})
    raise WeftError(
        f"{repo_id!r} is in the local Hugging Face cache ({repo}) but not at revision {revision!r} with a "
        f"config.json; the cache holds {', '.join(have) or 'no revision'}: set model.revision to one of them, or "
        f"fill the cache with `hf download {repo_id} --revision {revision}` where the Hub can be reached",
        where=where)
