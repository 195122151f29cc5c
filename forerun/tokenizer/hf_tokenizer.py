"""Loading the tokenizer of a Hugging Face model folder.

Only the fast-tokenizer format is read: ``tokenizer.json`` is required.  The
chat template comes from ``chat_template.jinja`` or ``tokenizer_config.json``;
BOS/EOS and ``add_bos_token`` from ``tokenizer_config.json`` (falling back to
``special_tokens_map.json`` for the tokens, and to what ``tokenizer.json``'s
post-processor does for ``add_bos_token``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers

from forerun.errors import ModelNotFoundError, TokenizerError
from forerun.machine.json_files import read_json_object
from forerun.tokenizer.tokenizer import Tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, TokenizerError, missing_ok=True)


def _token_content(value: Any, where: str) -> str | None:
    """A special token given as a string or as an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{where} is neither a string nor a token dict: {value!r}")


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    tpl = config.get("chat_template")
    if tpl is None:
        tpl = _read_json(folder / "chat_template.json").get("chat_template")
    if tpl is None or isinstance(tpl, str):
        return tpl
    if isinstance(tpl, list):
        named = {}
        for entry in tpl:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError(
                    f"{folder / 'tokenizer_config.json'}: chat_template list entries must be "
                    f"{{'name': str, 'template': str}}, got {entry!r}")
            named[entry["name"]] = entry["template"]
        if "default" in named:
            return named["default"]
        raise TokenizerError(
            f"{folder / 'tokenizer_config.json'} has named chat templates "
            f"({', '.join(sorted(named))}) but none called 'default'")
    raise TokenizerError(
        f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list, "
        f"not {type(tpl).__name__}")


def tokenizer_from_hf_folder(path: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face model folder (with ``tokenizer.json``)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {folder} does not exist")
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        hint = ""
        if (folder / "tokenizer.model").is_file() or (folder / "vocab.json").is_file():
            hint = (" (it has a slow-tokenizer file; re-save the tokenizer with transformers' "
                    "AutoTokenizer.from_pretrained(...).save_pretrained(...) to create "
                    "tokenizer.json)")
        raise ModelNotFoundError(
            f"{folder} has no tokenizer.json; forerun needs the fast-tokenizer file{hint}")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as exc:
        raise TokenizerError(f"{tok_file} cannot be read: {exc}") from exc

    config = _read_json(folder / "tokenizer_config.json")
    special_map = _read_json(folder / "special_tokens_map.json")

    def special_id(name: str) -> int | None:
        content = _token_content(config.get(name), f"tokenizer_config.json {name}")
        if content is None:
            content = _token_content(special_map.get(name), f"special_tokens_map.json {name}")
        if content is None:
            return None
        i = backend.token_to_id(content)
        if i is None:
            raise TokenizerError(
                f"{folder}: {name} {content!r} is not in tokenizer.json's vocabulary")
        return int(i)

    bos, eos = special_id("bos_token"), special_id("eos_token")
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        # No explicit flag: do what tokenizer.json's post-processor does.
        add_bos = False
        if bos is not None:
            with_special = backend.encode("a", add_special_tokens=True).ids
            add_bos = bool(with_special) and with_special[0] == bos \
                and backend.encode("a", add_special_tokens=False).ids[:1] != [bos]
    return Tokenizer(backend, bos_token_id=bos, eos_token_id=eos, add_bos_token=bool(add_bos),
                     chat_template=_chat_template(folder, config))
