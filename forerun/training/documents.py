"""Prefill distillation over local documents: a chunk of a local file pasted
into a user message and followed by a request about it, rendered by the
target's chat template with the assistant's turn opened: exactly what the
target reads before it answers such a request (``text_layout="chat"`` of
:class:`~forerun.training.magpie.DataSettings`).

Nothing is generated.  A draft head learns from such a record what it
learns from any other: at every position from the document's first token
to the assistant's header, the target's own top-k distribution over the
next token, computed by one prefill when the head is trained
(:class:`~forerun.drafters.eagle.features.FeatureStore`).  So a record
costs the target's prefill (hundreds of tokens a second on a CPU), where
a generated answer costs a decoding step a token.

**Chunks** end where a line ends: a file's tokens are cut at the last
token that ends a line within the second half of the document's budget
(``seq_len`` less what the template and the longest request add), or at
the budget where no line ends there (a minified file).  **The request**
is one of a few plain ones, for code (by the file's suffix) or for prose,
drawn from the run's seed, the file's place in the run's order and the
chunk's index: the same on every run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forerun.errors import ConfigError
from forerun.protocol.token_sequences import common_prefix

#: what separates the document from the request in the user's message
SEPARATOR = "\n\n"
#: files whose chunks get the requests about code
CODE_SUFFIXES = frozenset({".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".js", ".ts", ".java",
                           ".go", ".rs", ".sh", ".css", ".html", ".json", ".toml", ".yaml",
                           ".yml"})
CODE_REQUESTS = (
    "Explain what this code does.",
    "Summarise what this code does in a few sentences.",
    "Are there any bugs or edge cases this code gets wrong?",
    "How could this code be improved?",
    "Write unit tests for the code above.",
    "Add comments that explain the tricky parts of this code.",
)
TEXT_REQUESTS = (
    "Summarise this text.",
    "What are the main points of the text above?",
    "Explain this to someone new to the topic.",
    "Write three questions this text answers, with their answers.",
    "What is this document about, and who is it for?",
    "List the steps or facts in this text as bullet points.",
)
#: tokens kept free for the document's ends merging with the template's
#: text when the whole is tokenised (a record never exceeds ``seq_len``)
MARGIN = 8


@dataclass(frozen=True)
class DocumentTemplate:
    """How a model's chat template wraps a document: ``prefix_ids`` come
    before the document (the system prompt and the user's header),
    ``budget`` is the most tokens a document chunk may have for its record
    to hold ``seq_len``, ``line_ends`` the token ids whose text ends a
    line."""

    prefix_ids: tuple[int, ...]
    budget: int
    line_ends: frozenset[int]


def document_template(model: Any, prefix_ids: Sequence[int], seq_len: int, min_chunk: int
                      ) -> DocumentTemplate:
    """The template of ``model`` (its ``encode_prompt`` and tokenizer) for
    records of at most ``seq_len`` tokens, whose documents begin after
    ``prefix_ids`` (the Magpie prefix: the template up to the user's
    text).  Refused when the budget is under twice ``min_chunk``, the
    fewest tokens a chunk keeps: :func:`line_chunks` cuts no chunk but a
    file's last under half the budget, so none of those is too short."""
    longest = max(len(wrap_ids(model, "", r)) for r in CODE_REQUESTS + TEXT_REQUESTS)
    budget = seq_len - longest - MARGIN
    if budget < 2 * min_chunk:
        raise ConfigError(f"--seq-len {seq_len} leaves {max(budget, 0)} tokens for a document "
                          f"once the chat template and a request take {longest + MARGIN}; "
                          f"give --seq-len {longest + MARGIN + 2 * min_chunk} or more")
    tok = model.tokenizer
    line_ends = frozenset(i for i in range(tok.vocab_size) if tok.decode([i]).endswith("\n"))
    return DocumentTemplate(tuple(prefix_ids), budget, line_ends)


def line_chunks(ids: Sequence[int], budget: int, line_ends: frozenset[int]
                ) -> list[list[int]]:
    """``ids`` cut into chunks of at most ``budget`` tokens, each ending
    where a line ends: at the last line end within the second half of the
    budget, else at the budget."""
    chunks, start = [], 0
    while start < len(ids):
        end = min(start + budget, len(ids))
        if end < len(ids):
            for at in range(end, start + budget // 2, -1):
                if ids[at - 1] in line_ends:
                    end = at
                    break
        chunks.append(list(ids[start:end]))
        start = end
    return chunks


def request_for(path: Path, seed: int, file_index: int, chunk: int) -> str:
    """The request asked after chunk ``chunk`` of the run's file
    ``file_index`` (``path``, whose suffix says code or prose)."""
    requests = CODE_REQUESTS if path.suffix.lower() in CODE_SUFFIXES else TEXT_REQUESTS
    digest = hashlib.sha256(f"forerun-document:{seed}:{file_index}:{chunk}".encode()).digest()
    return requests[int.from_bytes(digest[:4], "little") % len(requests)]


def wrap_ids(model: Any, document: str, request: str) -> list[int]:
    """The tokens of a conversation whose user message is ``document``
    followed by ``request``, the assistant's turn opened."""
    content = f"{document.rstrip()}{SEPARATOR}{request}" if document.strip() else request
    return model.encode_prompt(messages=[{"role": "user", "content": content}])


def document_record(model: Any, template: DocumentTemplate, document: str, request: str
                    ) -> tuple[list[int], int]:
    """The record's tokens, ``document`` and ``request`` as the target
    reads them, and where its loss starts: at the first token that holds
    the document's text, the first after the tokens it shares with the
    template's prefix (the prefix's last token may merge with the
    document's first characters, a newline with the indentation after it:
    the merged token is the document's)."""
    ids = wrap_ids(model, document, request)
    shared = common_prefix(ids, template.prefix_ids)
    if shared == 0:
        raise ConfigError("the chat template's rendering of a document shares no token with "
                          "its user prefix, so where the document begins is unknown; build "
                          "plain text chunks instead (--text-layout plain)")
    return ids, shared
