"""``GET /metrics``: Prometheus text that counts what the server did."""

import http.client

import pytest

from conftest import MODEL, greedy

pytestmark = pytest.mark.real_model

NAMES = ("forerun_requests_total", "forerun_generations_total",
         "forerun_generated_tokens_total", "forerun_prompt_tokens_total",
         "forerun_tokens_per_second", "forerun_acceptance_rate", "forerun_queue_depth",
         "forerun_requests_in_flight", "forerun_prefix_cache_hits_total",
         "forerun_prefix_cache_bytes", "forerun_time_to_first_token_seconds_count")


def test_metrics_count_requests_and_tokens(server):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type").startswith("text/plain")
    resp.read()
    conn.close()

    before = server.metrics()
    r = greedy(server.client(), [{"role": "user", "content": "Repeat: a b c a b c a b c"}],
               max_tokens=9, extra_body={"ignore_eos": True})
    server.request("POST", "/v1/chat/completions", {"model": MODEL})          # a 400
    after = server.metrics()
    for name in NAMES:
        assert any(key.split("{")[0] == name for key in after), name

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    assert delta('forerun_requests_total{endpoint="chat",status="200"}') == 1
    assert delta('forerun_requests_total{endpoint="chat",status="400"}') == 1
    assert delta('forerun_generations_total{finish_reason="length"}') == 1
    assert delta("forerun_generated_tokens_total") == r.usage.completion_tokens == 9
    assert delta("forerun_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("forerun_time_to_first_token_seconds_count") == 1
    assert after["forerun_tokens_per_second"] > 0
    stats = r.model_extra["forerun"]
    assert delta("forerun_drafted_tokens_total") == stats["drafted"]
    assert delta("forerun_accepted_tokens_total") == stats["accepted"]
    assert 0 <= after["forerun_acceptance_rate"] <= 1
    assert after["forerun_queue_depth"] == 0 and after["forerun_requests_in_flight"] == 0
