"""Router error codes and gRPC statuses onto HTTP statuses and both dialects' error types."""

from __future__ import annotations

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.gateway.dialects import Dialect, error_body
from flotilla.gateway.errors import error_from_grpc, error_from_router


@pytest.mark.parametrize("code,status,anthropic_type", [
    (common.ERROR_CODE_INVALID_REQUEST, 400, "invalid_request_error"),
    (common.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED, 400, "invalid_request_error"),
    (common.ERROR_CODE_MODEL_NOT_FOUND, 404, "not_found_error"),
    (common.ERROR_CODE_OVERLOADED, 529, "overloaded_error"),
    (common.ERROR_CODE_UNAVAILABLE, 503, "api_error"),
    (common.ERROR_CODE_DEADLINE_EXCEEDED, 504, "api_error"),
    (common.ERROR_CODE_INTERNAL, 500, "api_error"),
    (common.ERROR_CODE_UNSPECIFIED, 500, "api_error"),
])
def test_router_error_codes(code, status, anthropic_type):
    err = error_from_router(common.Error(code=code, message="m", field="temperature"))
    assert err.kind.status == status
    assert error_body(Dialect.ANTHROPIC, err)["error"]["type"] == anthropic_type
    assert error_body(Dialect.OPENAI, err)["error"]["param"] == "temperature"


@pytest.mark.parametrize("code", [common.ERROR_CODE_INTERNAL, common.ERROR_CODE_UNAVAILABLE,
                                  common.ERROR_CODE_MODEL_NOT_FOUND, common.ERROR_CODE_UNSPECIFIED])
def test_fleet_faults_name_no_worker_version_or_grpc_status(code, caplog):
    detail = "worker worker-3 failed: UNAVAILABLE; this worker serves m@sha256:ab12cd, not m"
    err = error_from_router(common.Error(code=code, message=detail), request_id="req_42")
    assert "worker-3" not in err.message and "sha256" not in err.message and "UNAVAILABLE" not in err.message
    assert "req_42" in err.message
    assert detail in caplog.text and "req_42" in caplog.text  # the operator still gets it, by request id


@pytest.mark.parametrize("code", [common.ERROR_CODE_INVALID_REQUEST, common.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED,
                                  common.ERROR_CODE_OVERLOADED, common.ERROR_CODE_DEADLINE_EXCEEDED])
def test_client_facing_errors_keep_their_message(code):
    assert error_from_router(common.Error(code=code, message="prompt: too long")).message == "prompt: too long"


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "details"


@pytest.mark.parametrize("code,status", [(grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.RESOURCE_EXHAUSTED, 529),
                                         (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.UNKNOWN, 500)])
def test_grpc_statuses(code, status):
    assert error_from_grpc(_RpcError(code)).kind.status == status


@pytest.mark.parametrize("code", [grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.NOT_FOUND,
                                  grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE])
def test_grpc_failures_name_no_status_or_details(code, caplog):
    class Leaky(_RpcError):
        def details(self) -> str:
            return "worker worker-3 (m@sha256:ab12cd) raised: StatusCode.INTERNAL"

    err = error_from_grpc(Leaky(code), request_id="req_7")
    for dialect in Dialect:
        text = str(error_body(dialect, err))
        assert "worker-3" not in text and "sha256" not in text and code.name not in text, text
    assert err.kind.status == 503 or "req_7" in err.message
    assert "worker-3" in caplog.text and "req_7" in caplog.text
