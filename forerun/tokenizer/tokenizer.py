"""The tokenizer forerun uses: a ``tokenizers.Tokenizer`` plus the few facts
about it that live outside ``tokenizer.json`` (BOS/EOS ids, whether to prepend
BOS, the chat template).

It is built from a GGUF file's metadata (:mod:`.gguf_tokenizer`) or from a
Hugging Face folder (:mod:`.hf_tokenizer`), and saved to / loaded from the
model cache with :meth:`Tokenizer.save` / :meth:`Tokenizer.load`.
"""

from __future__ import annotations

import hashlib
import json
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers

from forerun.errors import InvalidTokenError, ModelNotFoundError, TokenizerError

TOKENIZER_FILE = "tokenizer.json"
FORERUN_FILE = "forerun_tokenizer.json"
_FORMAT_VERSION = 1
# The tokenizers Tokenizer.load made, by the digest of their files, while
# something holds them.
_LOADED: weakref.WeakValueDictionary[str, Tokenizer] = weakref.WeakValueDictionary()
_LOADED_LOCK = threading.Lock()


class Tokenizer:
    """A text <-> token-id codec for one model.

    ``encode`` never adds special tokens unless asked, and then only BOS (when
    the model says so).  Special tokens written in the text, such as
    ``<|im_start|>``, are recognised as single tokens, as Hugging Face does.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        if not isinstance(backend, tokenizers.Tokenizer):
            raise TypeError(f"backend must be a tokenizers.Tokenizer, not {type(backend).__name__}")
        # forerun adds special tokens itself; a tokenizer.json may carry
        # truncation/padding settings that would silently change encode().
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if value is not None and not (0 <= int(value) < self._vocab_size):
                raise TokenizerError(
                    f"{name} {value} is outside the vocabulary (size {self._vocab_size})")
        self._bos = None if bos_token_id is None else int(bos_token_id)
        self._eos = None if eos_token_id is None else int(eos_token_id)
        self._add_bos = bool(add_bos_token)
        if chat_template is not None and not isinstance(chat_template, str):
            raise TokenizerError(
                f"chat template must be a string, not {type(chat_template).__name__}")
        self._chat_template = chat_template or None
        self._compiled_template: Any = None
        self._fingerprint: str | None = None
        self._special_ids = frozenset(
            int(i) for i, tok in backend.get_added_tokens_decoder().items() if tok.special)

    # ------------------------------------------------------------------ basics

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """How many tokens the tokenizer knows (model vocabulary plus added
        tokens); valid ids are ``0 .. vocab_size - 1``."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(..., add_special_tokens=True)`` prepends BOS."""
        return self._add_bos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special (control) tokens, the ones
        ``decode(..., skip_special_tokens=True)`` drops."""
        return self._special_ids

    def token_to_id(self, token: str) -> int | None:
        """The id of a token as the vocabulary spells it, or None."""
        i = self._backend.token_to_id(token)
        return None if i is None else int(i)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary spelling of a token (byte-level alphabet for BPE
        models, e.g. ``'Ġhello'``); InvalidTokenError if out of range."""
        token_id = self._check_id(token_id)
        tok = self._backend.id_to_token(token_id)
        if tok is None:
            raise InvalidTokenError(f"token id {token_id} has no entry in the vocabulary")
        return tok

    def _check_id(self, token_id: Any) -> int:
        try:
            i = operator.index(token_id)
        except TypeError:
            raise InvalidTokenError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= i < self._vocab_size:
            raise InvalidTokenError(
                f"token id {i} is outside the vocabulary (valid ids are 0..{self._vocab_size - 1})")
        return i

    # -------------------------------------------------------- encode / decode

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``.  With ``add_special_tokens=True`` BOS is
        prepended when the model's metadata asks for it (``add_bos_token``)."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, not {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos and self._bos is not None:
            ids = [self._bos, *ids]
        return list(ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        if hasattr(ids, "tolist"):  # numpy arrays, torch tensors
            ids = ids.tolist()
        if isinstance(ids, int):
            raise TokenizerError("decode() takes a sequence of token ids, not a single int")
        try:
            id_list = list(map(operator.index, ids))
        except TypeError:
            raise InvalidTokenError(f"token ids must be integers, got {ids!r}") from None
        if id_list and (min(id_list) < 0 or max(id_list) >= self._vocab_size):
            bad = next(i for i in id_list if not 0 <= i < self._vocab_size)
            raise InvalidTokenError(
                f"token id {bad} is outside the vocabulary "
                f"(valid ids are 0..{self._vocab_size - 1})")
        return self._backend.decode(id_list, skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------- chat template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's Jinja chat template, as
        ``transformers``' ``apply_chat_template(..., tokenize=False)`` does."""
        if self._chat_template is None:
            raise TokenizerError(
                "this model has no chat template, so chat messages cannot be formatted; "
                "use raw mode (pass the prompt text directly) instead")
        msgs = _validate_messages(messages)
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self._chat_template)
        import jinja2

        variables: dict[str, Any] = {}
        if self._bos is not None:
            variables["bos_token"] = self._backend.id_to_token(self._bos)
        if self._eos is not None:
            variables["eos_token"] = self._backend.id_to_token(self._eos)
        variables.update(kwargs)  # caller's kwargs win, as in transformers
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        variables["messages"] = msgs
        variables["add_generation_prompt"] = bool(add_generation_prompt)
        try:
            return self._compiled_template.render(**variables)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"the chat template failed: {exc}") from exc

    # ------------------------------------------------------------ persistence

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` and ``forerun_tokenizer.json`` into
        ``directory`` (created if needed)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / TOKENIZER_FILE).write_text(_quick_json(self._backend), encoding="utf-8")
        extra = {
            "format_version": _FORMAT_VERSION,
            "bos_token_id": self._bos,
            "eos_token_id": self._eos,
            "add_bos_token": self._add_bos,
            "chat_template": self._chat_template,
        }
        (d / FORERUN_FILE).write_text(json.dumps(extra, ensure_ascii=False, indent=1),
                                      encoding="utf-8")

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """The tokenizer :meth:`save` wrote into ``directory``.  Loads of the
        same files (a target and its draft model share their tokenizer)
        return one object while it lives: a parsed vocabulary of 150k tokens
        takes 30 to 70 MB."""
        d = Path(directory)
        tok_path, extra_path = d / TOKENIZER_FILE, d / FORERUN_FILE
        for p in (tok_path, extra_path):
            if not p.is_file():
                raise ModelNotFoundError(
                    f"{p} does not exist; {d} is not a saved forerun tokenizer")
        try:
            text, extra_text = tok_path.read_bytes(), extra_path.read_bytes()
        except OSError as exc:
            raise TokenizerError(f"{d} cannot be read: {exc}") from exc
        key = hashlib.sha256(len(text).to_bytes(8, "little") + text + extra_text).hexdigest()
        with _LOADED_LOCK:
            loaded = _LOADED.get(key)
            if loaded is None:
                loaded = _LOADED[key] = cls._parse(text, extra_text, tok_path, extra_path)
        return loaded

    @classmethod
    def _parse(cls, text: bytes, extra_text: bytes, tok_path: Path, extra_path: Path
               ) -> Tokenizer:
        try:
            backend = tokenizers.Tokenizer.from_str(text.decode("utf-8"))
        except Exception as exc:
            raise TokenizerError(f"{tok_path} cannot be read: {exc}") from exc
        try:
            extra = json.loads(extra_text.decode("utf-8"))
        except ValueError as exc:
            raise TokenizerError(f"{extra_path} cannot be read: {exc}") from exc
        if not isinstance(extra, dict) or extra.get("format_version") != _FORMAT_VERSION:
            raise TokenizerError(
                f"{extra_path} has an unknown format; delete the cached model and load it again")
        return cls(backend,
                   bos_token_id=extra.get("bos_token_id"),
                   eos_token_id=extra.get("eos_token_id"),
                   add_bos_token=bool(extra.get("add_bos_token", False)),
                   chat_template=extra.get("chat_template"))

    def fingerprint(self) -> str:
        """A short stable hash of the vocabulary (every id and its spelling,
        added tokens included) and the BPE merges.  Two tokenizers with the same
        fingerprint map ids to the same tokens."""
        if self._fingerprint is None:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            by_id = sorted((int(i), t) for t, i in vocab.items())
            model = json.loads(self._backend.to_str()).get("model", {})
            merges = [m.split(" ", 1) if isinstance(m, str) else list(m)
                      for m in model.get("merges") or ()]
            h = hashlib.sha256()
            h.update(model.get("type", "").encode())
            h.update(b"\0")
            h.update(json.dumps(by_id, ensure_ascii=False).encode("utf-8"))
            h.update(b"\0")
            h.update(json.dumps(merges, ensure_ascii=False).encode("utf-8"))
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self._vocab_size}, bos={self._bos}, eos={self._eos}, "
                f"add_bos={self._add_bos}, chat_template={'yes' if self._chat_template else 'no'})")


# ---------------------------------------------------------------- helpers


def _quick_json(backend: tokenizers.Tokenizer) -> str:
    """``backend``'s ``tokenizer.json`` in the form ``tokenizers`` reads
    fastest, where it reads back as the very same tokenizer (its whole
    serialization compared), else in ``tokenizers``' own form.

    The quick form is compact, with a BPE vocabulary in the byte order of
    its tokens (``tokenizers`` parses it into a sorted map first) and the
    merges as ``"a b"`` strings rather than pairs: Qwen2.5's 151k tokens
    load in 0.42 s instead of 0.52 on a 2-core EPYC, at every start from a
    cache.  Merges whose tokens hold a space, or that ``tokenizers`` would
    skip as a ``#version`` line, keep the pairs.  ``tokenizers`` reads
    both forms (the strings are its older one): an older forerun reads the
    quick one too."""
    text = backend.to_str()
    try:
        data = json.loads(text)
        model = data.get("model")
        if not (isinstance(model, dict) and model.get("type") == "BPE"
                and isinstance(model.get("vocab"), dict) and isinstance(model.get("merges"), list)):
            return text
        merges = []
        for pair in model["merges"]:
            if not (isinstance(pair, list) and len(pair) == 2
                    and all(isinstance(t, str) and " " not in t for t in pair)):
                return text
            merge = f"{pair[0]} {pair[1]}"
            if merge.startswith("#version"):
                return text
            merges.append(merge)
        model["vocab"] = dict(sorted(model["vocab"].items(), key=lambda item: item[0].encode()))
        model["merges"] = merges
        quick = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        if tokenizers.Tokenizer.from_str(quick).to_str() == text:
            return quick
    except Exception:   # (whatever fails to convert or to read back: the plain form)
        pass
    return text


#: The roles a chat message may have; the server's request schema takes the same.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)):
        raise TokenizerError(
            f"chat messages must be a list of dicts, not {type(messages).__name__}")
    if not messages:
        raise TokenizerError("chat messages are empty; give at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TokenizerError(
                f"chat message {i} must be a dict with 'role' and 'content', "
                f"not {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise TokenizerError(f"chat message {i} has no {key!r} key")
            if not isinstance(m[key], str):
                raise TokenizerError(
                    f"chat message {i}: {key!r} must be a string, not {type(m[key]).__name__}")
        if m["role"] not in CHAT_ROLES:
            raise TokenizerError(f"chat message {i}: role {m['role']!r} is not one of "
                                 f"{', '.join(map(repr, CHAT_ROLES))}")
        out.append(dict(m))
    return out


def _compile_template(source: str) -> Any:
    """Compile a chat template the way transformers does (sandboxed, same
    whitespace handling, same globals and ``tojson``)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.parser
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        # transformers' ``{% generation %}`` marks assistant text for masks; for
        # rendering it just outputs its body.
        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body)
            return call.set_lineno(lineno)

        def _render(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class _TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class _Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature)
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "chat templates cannot set underscore-prefixed namespace attributes "
                    f"({name!r})")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"the model's chat template is not valid Jinja: {exc}") from exc
