"""``forerun serve`` fuzzed from its own OpenAPI document with Schemathesis:
every request the document allows, and requests it does not (wrong types,
missing fields, values out of range), gets one of the statuses the document
names, never a server error; the document served is the module's."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import negative_data_rejection, status_code_conformance

from conftest import LiveServer
from forerun.server.openapi import openapi_document
from quick import draws

pytestmark = pytest.mark.xdist_group("openapi_fuzz")

schema = schemathesis.openapi.from_dict(openapi_document())


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path_factory.mktemp("fuzz") / "tiny.gguf")
    srv = LiveServer("-m", str(path), "--weights", "q8", "--context-length", "256",
                     "--parallel", "1", "--max-queue", "4")
    yield srv
    assert srv.stop() == 143, srv.read_stderr()[-3000:]
    assert "Traceback" not in srv.read_stderr()


def test_the_served_document_is_the_modules(fuzzed):
    status, body = fuzzed.request("GET", "/openapi.json")
    assert status == 200 and body == openapi_document()
    assert set(body["paths"]) == {"/health", "/metrics", "/v1/models", "/v1/models/{model_id}",
                                  "/v1/chat/completions", "/v1/completions"}


@schema.parametrize()
@settings(max_examples=draws(80, 12), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_request_is_a_server_error(case, fuzzed):
    case.call_and_validate(base_url=f"http://{fuzzed.host}:{fuzzed.port}", timeout=120,
                           checks=[not_a_server_error, status_code_conformance,
                                   negative_data_rejection])
