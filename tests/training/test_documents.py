"""Documents for prefill distillation: chunks that end where lines end, a
request drawn the same every run (for code or prose), and the record: the
conversation the target reads, its loss from the document's first token."""

from __future__ import annotations

from pathlib import Path

import pytest

from forerun.errors import ConfigError
from forerun.training.documents import (
    CODE_REQUESTS,
    SEPARATOR,
    TEXT_REQUESTS,
    document_record,
    document_template,
    line_chunks,
    request_for,
)
from forerun.training.magpie import magpie_prefix

NL = 10          # a token that ends a line, in the chunking tests


def test_chunks_end_where_lines_end_and_hold_every_token_once():
    ids = [1, 2, NL, 3, 4, 5, NL, 6, 7, 8, 9, NL, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, NL]
    chunks = line_chunks(ids, 8, frozenset({NL}))
    assert [t for c in chunks for t in c] == ids
    assert all(len(c) <= 8 for c in chunks)
    # each cut at the last line end in the second half of the budget; the
    # third's budget has none there, so it is cut at the budget
    assert chunks[0] == [1, 2, NL, 3, 4, 5, NL]
    assert chunks[1] == [6, 7, 8, 9, NL]
    assert chunks[2] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert chunks[3] == [9, 1, 2, NL]
    # a line end only in the first half is not used: the chunk would be short
    assert line_chunks([NL, 1, 2, 3, 4, 5, 6, 7, 8], 8, frozenset({NL}))[0] == [
        NL, 1, 2, 3, 4, 5, 6, 7]
    assert line_chunks([], 8, frozenset({NL})) == []


def test_a_request_is_the_same_every_run_and_fits_the_file():
    code, prose = Path("lib/heap.py"), Path("doc/README.md")
    asked = [request_for(code, 0, 3, chunk) for chunk in range(40)]
    assert asked == [request_for(code, 0, 3, chunk) for chunk in range(40)]
    assert set(asked) == set(CODE_REQUESTS)            # every one is drawn
    assert {request_for(prose, 0, 3, c) for c in range(40)} == set(TEXT_REQUESTS)
    assert asked != [request_for(code, 1, 3, chunk) for chunk in range(40)]   # the seed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import forerun
    from tiny_models import hf_folders

    return forerun.load(str(hf_folders(tmp_path_factory, [0], prefix="doc")[0]),
                        progress=False)


def test_a_record_is_the_conversation_the_target_reads_its_loss_from_the_document(tiny):
    prefix = magpie_prefix(tiny.tokenizer).ids
    template = document_template(tiny, prefix, 256, 32)
    tok = tiny.tokenizer
    assert tok.token_to_id("Ċ") in template.line_ends           # "\n"
    assert tok.token_to_id("Ġ") not in template.line_ends
    for document in ("the quick brown fox\njumps over\n", "\n  hello world\n"):
        request = TEXT_REQUESTS[1]
        ids, loss_start = document_record(tiny, template, document, request)
        content = document.rstrip() + SEPARATOR + request
        assert ids == tiny.encode_prompt(messages=[{"role": "user", "content": content}])
        # the tokens before the loss are the prefix's; the first in the loss
        # already holds the document's text
        assert ids[:loss_start] == list(prefix[:loss_start])
        assert magpie_prefix(tok).text.startswith(tok.decode(ids[:loss_start]))
        assert tok.decode(ids[loss_start:]).lstrip().startswith(document.strip())
        assert len(ids) <= 256


def test_a_sequence_too_short_for_the_template_is_refused(tiny):
    prefix = magpie_prefix(tiny.tokenizer).ids
    with pytest.raises(ConfigError, match="--seq-len 40 leaves"):
        document_template(tiny, prefix, 40, 32)
