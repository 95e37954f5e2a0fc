"""/openapi.json describes the whole HTTP API: valid OpenAPI 3.1, every route of the app with its methods, request
schemas with their bounds, the auth schemes, and error responses in the shape each dialect really answers."""

from __future__ import annotations

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate
from starlette.requests import Request
from starlette.routing import Route

from flotilla.gateway.openapi import MIDDLEWARE_PATHS, build
from flotilla.gateway.schema_base import MAX_MESSAGES


@pytest.fixture(scope="module")
def document(gateway) -> dict:
    response = httpx.get(gateway.base_url + "/openapi.json")
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    return response.json()


def _resolve(document: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def test_it_is_valid_openapi_3_1(document):
    assert document["openapi"].startswith("3.1")
    validate(document)


def test_every_route_of_the_app_is_described_with_its_methods(gateway, document):
    routes = {(method, route.path.replace(":path", "")) for route in gateway.app.routes if isinstance(route, Route)
              for method in route.methods - {"HEAD"}}
    assert {("GET", "/openapi.json"), ("POST", "/v1/messages"), ("GET", "/v1/models/{model_id}")} <= routes
    described = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    assert routes | set(MIDDLEWARE_PATHS) == described


def test_a_route_added_later_appears_with_auth_and_its_dialects_errors(gateway):
    from fastapi import FastAPI

    app = FastAPI()
    app.router.routes.extend(gateway.app.routes)

    async def list_files(request: Request):
        raise AssertionError("never called")

    app.add_api_route("/v1/files/{file_id}", list_files, methods=["GET"])
    operation = build(app)["paths"]["/v1/files/{file_id}"]["get"]
    assert operation["security"] and operation["parameters"][0]["name"] == "file_id"
    assert operation["responses"]["401"]["content"]["application/json"]["schema"]["$ref"].endswith("OpenAIError")


# POST routes whose handlers read no body (the batch id is in the path).
BODILESS_POSTS = {"/v1/batches/{batch_id}/cancel", "/v1/messages/batches/{batch_id}/cancel"}


def test_requests_have_their_schemas_with_bounds_and_field_support(document):
    for path, item in document["paths"].items():
        if "post" in item and path not in BODILESS_POSTS:
            assert item["post"]["requestBody"]["required"], path
    assert not any("requestBody" in document["paths"][path]["post"] for path in BODILESS_POSTS)
    upload = document["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert upload["required"] == ["purpose", "file"] and upload["properties"]["file"]["format"] == "binary"
    batch = _resolve(document, document["paths"]["/v1/messages/batches"]["post"]["requestBody"]["content"]
                     ["application/json"]["schema"])
    assert batch["properties"]["requests"]["minItems"] == 1 and batch["properties"]["requests"]["maxItems"] > 1
    chat = _resolve(document, document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
                    ["application/json"]["schema"])
    assert chat["properties"]["messages"]["maxItems"] == MAX_MESSAGES
    assert chat["additionalProperties"] is False  # unknown fields are refused
    assert {"type": "integer", "minimum": 0, "maximum": 20} in chat["properties"]["top_logprobs"]["anyOf"]
    assert chat["properties"]["logit_bias"]["description"] == "partly: empty only; other values 400"  # field_support
    messages = _resolve(document, document["paths"]["/v1/messages"]["post"]["requestBody"]["content"]
                        ["application/json"]["schema"])
    assert messages["properties"]["max_tokens"]["minimum"] == 1 and "max_tokens" in messages["required"]
    stop = {member["type"]: member for member in chat["properties"]["stop"]["anyOf"]}  # the engine's bounds
    assert stop["array"]["maxItems"] == 16 and stop["string"]["maxLength"] == stop["array"]["items"]["maxLength"] == 512


def test_both_auth_schemes_are_declared(document):
    schemes = document["components"]["securitySchemes"]
    assert schemes["bearerAuth"] == {**schemes["bearerAuth"], "type": "http", "scheme": "bearer"}
    assert schemes["apiKeyAuth"]["in"] == "header" and schemes["apiKeyAuth"]["name"] == "x-api-key"
    assert document["paths"]["/v1/messages"]["post"]["security"] == [{"bearerAuth": []}, {"apiKeyAuth": []}]
    assert "security" not in document["paths"]["/healthz"]["get"]


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"model": "tiny", "max_tokens": 0, "messages": []}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [], "bogus": 1}),
    ("/v1/messages/count_tokens", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
])
def test_documented_error_schemas_match_real_error_bodies(gateway, document, path, body):
    for key in (gateway.paid_key, "wrong-key"):
        response = httpx.post(gateway.base_url + path, json=body, headers={"x-api-key": key})
        documented = document["paths"][path]["post"]["responses"][str(response.status_code)]
        schema = documented["content"]["application/json"]["schema"]
        jsonschema.validate(response.json(), {**_resolve(document, schema), "components": document["components"]})


def test_success_bodies_match_their_documented_schemas(gateway, document):
    headers = {"x-api-key": gateway.paid_key}
    calls = [("post", "/v1/chat/completions", {"model": "tiny", "max_tokens": 3,
                                               "messages": [{"role": "user", "content": "hi"}]}),
             ("post", "/v1/completions", {"model": "tiny", "max_tokens": 3, "prompt": "hi", "logprobs": 2}),
             ("post", "/v1/messages", {"model": "tiny", "max_tokens": 3,
                                       "messages": [{"role": "user", "content": "hi"}]}),
             ("post", "/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
             ("get", "/v1/models", None), ("get", "/v1/models/{model_id}", None), ("get", "/readyz", None)]
    for method, path, body in calls:
        url = gateway.base_url + path.replace("{model_id}", "tiny")
        response = httpx.request(method, url, json=body, headers=headers)
        assert response.status_code == 200, response.text
        schema = document["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]
        jsonschema.validate(response.json(), schema)


def test_batch_job_bodies_match_their_documented_schemas(gateway, document):
    """Each batch route's success body (JSON, or JSONL as the media type documented) and a 404 in its dialect."""
    headers = {"x-api-key": gateway.paid_key}
    line = document["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["example"]["file"]

    def call(method: str, path: str, ids: dict, **kwargs) -> httpx.Response:
        response = httpx.request(method, gateway.base_url + path.format(**ids), headers=headers, **kwargs)
        documented = document["paths"][path][method.lower()]["responses"][str(response.status_code)]
        (media_type, spec), = documented["content"].items()
        assert response.headers["content-type"].startswith(media_type), (path, response.headers)
        if media_type == "application/json":
            jsonschema.validate(response.json(), {**_resolve(document, spec["schema"]),
                                                  "components": document["components"]})
        return response

    file = call("POST", "/v1/files", {}, files={"file": ("in.jsonl", line.encode())},
                data={"purpose": "batch"}).json()
    ids = {"file_id": file["id"]}
    assert call("GET", "/v1/files/{file_id}/content", ids).text == line
    call("GET", "/v1/files/{file_id}", ids)
    assert file["id"] in [f["id"] for f in call("GET", "/v1/files", {}, params={"purpose": "batch"}).json()["data"]]
    assert call("GET", "/v1/files", {}, params={"order": "up"}).status_code == 400
    batch = call("POST", "/v1/batches", {}, json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h"}).json()
    ids["batch_id"] = batch["id"]
    call("GET", "/v1/batches", {}, params={"limit": 2})
    call("GET", "/v1/batches/{batch_id}", ids)
    call("POST", "/v1/batches/{batch_id}/cancel", ids)
    message_batch = call("POST", "/v1/messages/batches", {}, json={"requests": [
        {"custom_id": "a", "params": {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user",
                                                                                      "content": "hi"}]}}]}).json()
    ids["batch_id"] = message_batch["id"]
    call("GET", "/v1/messages/batches", {}, params={"limit": 2})
    call("GET", "/v1/messages/batches/{batch_id}", ids)
    call("POST", "/v1/messages/batches/{batch_id}/cancel", ids)
    assert call("GET", "/v1/messages/batches/{batch_id}", ids).status_code == 200
    call("DELETE", "/v1/files/{file_id}", ids)
    assert call("GET", "/v1/files/{file_id}", ids).status_code == 404
    assert call("GET", "/v1/messages/batches/{batch_id}/results", {"batch_id": "msgbatch_nope"}).status_code == 404
