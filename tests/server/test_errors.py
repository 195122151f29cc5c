"""forerun's errors as the API answers them: the request's fault is 400,
the engine's failure 500."""

from forerun.errors import ConfigError, ContextLengthError, EngineError
from forerun.server.errors import from_forerun_error


def test_a_request_fault_is_400_and_an_engine_failure_500():
    assert from_forerun_error(ConfigError("bad top_p")).status == 400
    too_long = from_forerun_error(ContextLengthError("4,100 tokens, the context holds 4,096"))
    assert too_long.status == 400 and too_long.body()["error"]["code"] == "context_length_exceeded"
    failed = from_forerun_error(EngineError("the batch's engine thread stopped (RuntimeError)"))
    assert failed.status == 500
    assert failed.body()["error"] == {"message": "the batch's engine thread stopped "
                                                 "(RuntimeError)", "type": "server_error",
                                      "param": None, "code": "engine_error"}
