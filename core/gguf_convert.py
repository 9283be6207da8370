"""A GGUF file as a Hugging Face directory: converted once by transformers' own GGUF reader
(``from_pretrained(folder, gguf_file=...)``, which needs the ``gguf`` package), saved as
safetensors with its config, tokenizer, chat template and generation config into
``<weft cache>/gguf/<stem>-<sha256 prefix>/``, and read from there after.

The folder is keyed by the file's content, so a file replaced under the same name converts
again; the SHA-256 of a file is remembered by (path, size, modification time) in
``hashes.json`` beside the folders, so a second run does not read 100 MB to find its folder.
A conversion happens under an exclusive lock of its folder's name and is renamed into place
whole, ``weft-source.json`` written last: ranks that start together convert once, and an
interrupted conversion is never taken for a finished one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import shutil

from weft.core.errors import WeftError
from weft.core.whole_files import write_json_whole

#: Written last into a converted folder: a folder without it is an interrupted conversion.
CONVERTED = "weft-source.json"


def weft_cache() -> pathlib.Path:
    """weft's own cache (converted GGUF files): XDG_CACHE_HOME/weft, else ~/.cache/weft."""
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "weft"


def converted_dir(file: pathlib.Path, *, where: str) -> pathlib.Path:
    """The converted folder of GGUF ``file``, converting it first if no finished one exists."""
    file = file.resolve()
    digest = file_sha256(file)
    root = weft_cache() / "gguf"
    folder = root / f"{file.stem}-{digest[:16]}"
    if (folder / CONVERTED).is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{folder.name}.lock"):
        if not (folder / CONVERTED).is_file():  # another process may have converted it while this one waited
            _convert(file, folder=folder, digest=digest, where=where)
    return folder


def file_sha256(file: pathlib.Path) -> str:
    stat = file.stat()
    index = weft_cache() / "gguf" / "hashes.json"
    key = f"{file}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return known[key]
    sha = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(16 << 20):
            sha.update(chunk)
    digest = sha.hexdigest()
    known = {k: v for k, v in known.items() if not k.startswith(f"{file}|")} if isinstance(known, dict) else {}
    index.parent.mkdir(parents=True, exist_ok=True)
    write_json_whole(index, {**known, key: digest}, indent=1)
    return digest


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(file: pathlib.Path, *, folder: pathlib.Path, digest: str, where: str) -> None:
    try:
        import gguf  # noqa: F401 - transformers' GGUF reader needs it; said here rather than deep inside
    except ImportError:
        raise WeftError(f"{file} is a GGUF file, which transformers reads with the `gguf` package: "
                        "pip install 'weft[gguf]' (or gguf)", where=where) from None
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    temporary = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file fails anywhere in the reader
        first = (str(error).splitlines() or [type(error).__name__])[0][:300]
        raise WeftError(f"{file} is not a GGUF model transformers can read ({type(error).__name__}: {first}); "
                        "a truncated download, or an architecture transformers' GGUF reader does not know",
                        where=where) from None
    # The weights are dequantised float32 now: nothing of the GGUF's quantisation is left to save,
    # but the model still carries its quantizer, which save_pretrained refuses to serialise.
    model.hf_quantizer, model.is_quantized, model.quantization_method = None, False, None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(temporary)
    tokenizer.save_pretrained(temporary)
    write_json_whole(temporary / CONVERTED, {"gguf": str(file), "sha256": digest,
                                            "transformers": transformers.__version__}, indent=1)
    shutil.rmtree(folder, ignore_errors=True)  # an unfinished folder of another weft (no CONVERTED): made again
    os.replace(temporary, folder)
