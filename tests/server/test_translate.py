"""The drafter a request gets: the server's default drafter and shape, a
request's own ``speculative`` fields, and a 400 that names the field for
every shape its drafter cannot take."""

import pytest

from forerun.server.errors import APIError
from forerun.server.schemas import ChatCompletionRequest, parse
from forerun.server.translate import Translator

DRAFT_MODEL = object()      # what the registry takes for a loaded draft model


def translator(default_draft="small", **default_shape) -> Translator:
    return Translator(None, ["m"], {"small": DRAFT_MODEL}, default_draft, default_shape)


def drafter(t: Translator, speculative: str | None = None) -> dict:
    extra = b"" if speculative is None else b', "speculative": ' + speculative.encode()
    req = parse(ChatCompletionRequest,
                b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]' + extra + b"}")
    return t._drafter(req)


def test_a_request_without_fields_gets_the_servers_drafter_and_shape():
    chain = {"draft": DRAFT_MODEL, "draft_k": None, "draft_tree": False, "tree_nodes": None,
             "draft_lookup": None}       # None: prompt lookup wherever it applies
    assert drafter(translator()) == chain
    assert drafter(translator(draft_lookup=True)) == {**chain, "draft_lookup": True}
    assert drafter(translator(draft_lookup=False)) == {**chain, "draft_lookup": False}
    assert drafter(translator(draft_k=3)) == {**chain, "draft_k": 3}
    assert drafter(translator(draft_tree=True)) == {**chain, "draft_tree": True}
    assert drafter(translator(None)) == {"draft": None}
    assert translator(tree_nodes=5).default_options() == {**chain, "tree_nodes": 5}


def test_a_request_that_shapes_its_drafter_takes_none_of_the_servers_shape():
    t = translator(draft_tree=True)
    assert drafter(t, '{"tree_nodes": 6}')["tree_nodes"] == 6
    assert drafter(t, '{"draft_k": 2}') == {"draft": DRAFT_MODEL, "draft_k": 2,
                                            "draft_tree": False, "tree_nodes": None,
                                            "draft_lookup": None}
    assert drafter(t, '{"draft_lookup": true}')["draft_lookup"] is True
    assert drafter(translator(draft_lookup=True), '{"draft_lookup": false}'
                   )["draft_lookup"] is False
    assert drafter(t, '{"draft_lookup": true}')["draft_tree"] is False
    assert drafter(t, '{"draft_tree": false}')["draft_tree"] is False
    # Naming another drafter drops the server's tree, which n-grams cannot draft.
    assert drafter(t, '{"draft": "ngram"}') == {"draft": "ngram", "draft_k": None,
                                                "draft_tree": False, "tree_nodes": None,
                                                "draft_lookup": None}
    assert drafter(translator(), '{"draft": "small", "draft_tree": true}')["draft_tree"]
    assert drafter(translator(), '{"draft": "medusa", "tree_nodes": 8}')["tree_nodes"] == 8


@pytest.mark.parametrize("speculative,param,words", [
    ('{"draft": "ngram", "draft_tree": true}', "speculative.draft_tree", "draft model"),
    ('{"draft": "ngram", "tree_nodes": 4}', "speculative.tree_nodes", "draft model"),
    ('{"draft_k": 3, "tree_nodes": 4}', "speculative.tree_nodes", "speculative.tree_nodes"),
    ('{"tree_nodes": 65}', "speculative.tree_nodes", "at most 64"),
    ('{"tree_nodes": 0}', "speculative.tree_nodes", "greater than or equal to 1"),
    ('{"draft_tree": 1}', "speculative.draft_tree", "boolean"),
    ('{"draft": "none", "tree_nodes": 3}', "speculative.tree_nodes", "needs a drafter"),
    ('{"draft": "none", "draft_tree": true}', "speculative.draft_tree", "needs a drafter"),
    ('{"draft": "none", "draft_k": 3}', "speculative.draft_k", "needs a drafter"),
    ('{"draft": "qwen-9000"}', "speculative.draft", "'ngram'"),
    ('{"draft": "ngram", "draft_lookup": true}', "speculative.draft_lookup",
     "for prompt lookup alone use draft='ngram'"),
    ('{"draft_k": 3, "draft_lookup": true}', "speculative.draft_lookup", "drop draft_k"),
    ('{"draft_tree": true, "draft_lookup": true}', "speculative.draft_lookup",
     "drop draft_tree"),
    ('{"draft_lookup": 1}', "speculative.draft_lookup", "boolean"),
    ('{"draft": "none", "draft_lookup": true}', "speculative.draft_lookup", "needs a drafter"),
])
def test_shapes_a_drafter_cannot_take_are_400_naming_the_field(speculative, param, words):
    with pytest.raises(APIError) as err:
        drafter(translator(), speculative)
    assert err.value.status == 400 and err.value.param == param
    assert words in err.value.message
