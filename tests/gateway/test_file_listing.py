"""GET /v1/files through the real `openai` SDK (its auto-pagination follows `after`) against the in-process gateway,
with the batch store in a SQLite state file (`flotilla up`) and in a real Redis (`--redis-url`)."""

from __future__ import annotations

import io
import json

import openai
import pytest

from flotilla.gateway.batch_jobs.settings import BatchSettings

from tests.support.waiting import wait_until

from .in_process_gateway import InProcessGateway


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def gateway(request, checkpoint_dir, tmp_path_factory):
    keys_dir = tmp_path_factory.mktemp(f"file-listing-{request.param}")
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        server.flush()
        gw = InProcessGateway(checkpoint_dir, keys_dir, redis_url=server.url)
    else:
        gw = InProcessGateway(checkpoint_dir, keys_dir, batch=BatchSettings(state_file=keys_dir / "batches.db"))
    yield gw.start()
    gw.stop()


def _client(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)


def _upload(client: openai.OpenAI, custom_id: str) -> str:
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "Hello", "max_tokens": 2}}
    return client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch").id


def test_a_tenant_lists_its_own_files_newest_first_page_by_page(gateway):
    client, other = _client(gateway, gateway.paid_key), _client(gateway, gateway.free_key)
    uploads = [_upload(client, f"r{i}") for i in range(5)]
    theirs = _upload(other, "theirs")

    first = client.files.list(limit=2)
    assert first.object == "list" and [f.id for f in first.data] == uploads[::-1][:2] and first.has_more
    assert first.first_id == uploads[4] and first.last_id == uploads[3]
    assert [f.id for f in client.files.list(limit=2)] == uploads[::-1]  # auto-pagination: after=last_id
    assert [f.id for f in client.files.list(order="asc", limit=3)] == uploads
    everything = client.files.list()  # default limit 10,000: one page
    assert [f.id for f in everything.data] == uploads[::-1] and not everything.has_more
    assert all(f.purpose == "batch" and f.object == "file" and f.bytes > 0 for f in everything.data)
    assert [f.id for f in other.files.list()] == [theirs]

    batch = client.batches.create(input_file_id=uploads[0], endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", 20, "batch completed",
               interval_s=0.05)
    output_id = client.batches.retrieve(batch.id).output_file_id
    assert [f.id for f in client.files.list(purpose="batch_output")] == [output_id]
    assert [f.id for f in client.files.list(purpose="batch")] == uploads[::-1]
    assert [f.id for f in client.files.list()][0] == output_id

    client.files.delete(uploads[2])
    assert [f.id for f in client.files.list(purpose="batch", order="asc")] == [uploads[i] for i in (0, 1, 3, 4)]
    for file_id in (output_id, *uploads):
        if file_id != uploads[2]:
            client.files.delete(file_id)
    empty = client.files.list()
    assert empty.data == [] and empty.first_id is None and empty.last_id is None and empty.has_more is False


@pytest.mark.parametrize("params, param", [({"limit": 0}, "limit"), ({"limit": 10_001}, "limit"),
                                           ({"limit": "ten"}, "limit"), ({"order": "newest"}, "order"),
                                           ({"after": "file-nope"}, "after")])
def test_bad_list_parameters_are_400s_in_openais_shape(gateway, params, param):
    client = _client(gateway, gateway.paid_key)
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.list(extra_query=params)
    assert refused.value.param == param and refused.value.type == "invalid_request_error"


def test_another_tenants_file_is_no_cursor(gateway):
    theirs = _upload(_client(gateway, gateway.free_key), "theirs")
    with pytest.raises(openai.BadRequestError, match="after"):
        _client(gateway, gateway.paid_key).files.list(after=theirs)
