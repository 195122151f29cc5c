"""The drafter a request gets: the server's default drafter and shape, a
request's own ``speculative`` fields, and a 400 that names the field for
every shape its drafter cannot take."""

import pytest

from forerun.drafters.draft_window import DEFAULT_DRAFT_WINDOW
from forerun.server.errors import APIError
from forerun.server.schemas import ChatCompletionRequest, parse
from forerun.server.translate import Translator
from forerun.speculation import PLAIN, SpeculativeConfig, resolve

DRAFT = "small.gguf"      # the draft model the server loaded, as its command line named it
W = DEFAULT_DRAFT_WINDOW  # what a draft model reads of a prompt by default


def drafted(method: str, **shape) -> SpeculativeConfig:
    """The config of the server's draft model drafting as ``method``."""
    if method.endswith("-lookup"):
        shape.setdefault("draft_lookup", "ngram")
    return SpeculativeConfig(method, DRAFT, draft_window=W, **shape)


def translator(default_draft=DRAFT, **default_shape) -> Translator:
    default = resolve(default_draft, **default_shape)
    return Translator(None, ["m"], {"small": DRAFT, DRAFT: DRAFT}, default)


def drafter(t: Translator, speculative: str | None = None) -> SpeculativeConfig:
    extra = b"" if speculative is None else b', "speculative": ' + speculative.encode()
    req = parse(ChatCompletionRequest,
                b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]' + extra + b"}")
    return t._drafter(req)["speculative"]


def test_a_request_without_fields_gets_the_servers_drafter_and_shape():
    assert drafter(translator()) == drafted("draft-lookup")
    assert drafter(translator(draft_lookup=True)) == drafted("draft-lookup")
    assert drafter(translator(draft_lookup=False)) == drafted("draft")
    assert drafter(translator(draft_k=3)) == drafted("draft", draft_k=3)
    assert drafter(translator(draft_tree=True)) == drafted("draft-tree")
    assert drafter(translator(tree_nodes=5)) == drafted("draft-tree", tree_nodes=5)
    assert drafter(translator(None)) == PLAIN


def test_a_request_that_shapes_its_drafter_takes_none_of_the_servers_shape():
    t = translator(draft_tree=True)
    assert drafter(t, '{"tree_nodes": 6}') == drafted("draft-tree", tree_nodes=6)
    assert drafter(t, '{"draft_k": 2}') == drafted("draft", draft_k=2)
    assert drafter(t, '{"draft_lookup": true}') == drafted("draft-lookup")
    assert drafter(translator(draft_lookup=True), '{"draft_lookup": false}') \
        == drafted("draft")
    assert drafter(t, '{"draft_tree": false}') == drafted("draft-lookup")
    # Naming another drafter drops the server's tree, which n-grams cannot draft.
    assert drafter(t, '{"draft": "ngram"}') == SpeculativeConfig("ngram", "ngram")
    assert drafter(translator(), '{"draft": "small", "draft_tree": true}') \
        == drafted("draft-tree")
    assert drafter(translator(), '{"draft": "medusa", "tree_nodes": 8}') \
        == SpeculativeConfig("medusa", "medusa", tree_nodes=8)


@pytest.mark.parametrize("speculative,param,words", [
    ('{"draft": "ngram", "draft_tree": true}', "speculative.draft_tree", "draft model"),
    ('{"draft": "ngram", "tree_nodes": 4}', "speculative.tree_nodes", "draft model"),
    ('{"draft_k": 3, "tree_nodes": 4}', "speculative.draft_k", "drop speculative.draft_k"),
    ('{"tree_nodes": 65}', "speculative.tree_nodes", "at most 64"),
    ('{"tree_nodes": 0}', "speculative.tree_nodes", "greater than or equal to 1"),
    ('{"draft_tree": 1}', "speculative.draft_tree", "boolean"),
    ('{"draft": "none", "tree_nodes": 3}', "speculative.tree_nodes", "needs a drafter"),
    ('{"draft": "none", "draft_tree": true}', "speculative.draft_tree", "needs a drafter"),
    ('{"draft": "none", "draft_k": 3}', "speculative.draft_k", "needs a drafter"),
    ('{"draft": "qwen-9000"}', "speculative.draft", "'ngram'"),
    ('{"draft": "ngram", "draft_lookup": true}', "speculative.draft_lookup",
     "for prompt lookup alone draft with 'ngram'"),
    ('{"draft_k": 3, "draft_lookup": true}', "speculative.draft_k",
     "drop speculative.draft_k"),
    ('{"draft_tree": true, "draft_lookup": true}', "speculative.draft_lookup",
     "ask for two shapes"),
    ('{"draft_lookup": 1}', "speculative.draft_lookup", "boolean"),
    ('{"draft": "none", "draft_lookup": true}', "speculative.draft_lookup", "needs a drafter"),
])
def test_shapes_a_drafter_cannot_take_are_400_naming_the_field(speculative, param, words):
    with pytest.raises(APIError) as err:
        drafter(translator(), speculative)
    assert err.value.status == 400 and err.value.param == param
    assert words in err.value.message
