"""OpenAI's Conversations API over the fake engine's scripted replies: conversations created, read, updated and
deleted; their items listed, added, read and removed; responses that read a conversation and extend it; every
object checked against the OpenAI SDK's own types; the refusals."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")
from openai.types.conversations import Conversation, ConversationItem, ConversationItemList  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from server.config import ServerConfig  # noqa: E402
from server.fake_engine import FakeAsyncEngine, replies_by_last_word  # noqa: E402
from server.runner import serve_in_thread  # noqa: E402

REPLIES = {"two": "four five six", "three": "seven eight"}  # words of the fake vocabulary, so prompts show them
TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant{% endif %}"
ITEM = TypeAdapter(ConversationItem)


@pytest.fixture(scope="module")
def engine():
    eng = FakeAsyncEngine(step_delay=0.001, scripted_reply=replies_by_last_word(REPLIES))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with serve_in_thread(engine, ServerConfig(port=0, chat_template=TEMPLATE)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _prompt(engine) -> str:
    """The text of the prompt the engine was last given."""
    return engine.tokenizer.decode(engine.submitted[-1][1])


def test_a_conversation_is_created_read_updated_and_deleted(server, client):
    conv = client.conversations.create(metadata={"topic": "weather"},
                                       items=[{"type": "message", "role": "user", "content": "hello"}])
    Conversation.model_validate(conv.model_dump(mode="json"))
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "weather"} and conv.object == "conversation"
    assert client.conversations.retrieve(conv.id).created_at == conv.created_at
    assert client.conversations.update(conv.id, metadata={"topic": "time"}).metadata == {"topic": "time"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "time"}
    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    r = httpx.get(f"{server.url}/v1/conversations/{conv.id}")
    assert r.status_code == 404 and r.json()["error"]["param"] == "conversation_id"


def test_items_are_listed_added_read_and_removed(server, client):
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "one"},
                                              {"type": "message", "role": "assistant", "content": "two"}])
    added = client.conversations.items.create(conv.id, items=[
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert [i.type for i in added.data] == ["function_call", "function_call_output"]
    listed = client.conversations.items.list(conv.id)  # newest first
    ConversationItemList.model_validate(listed.model_dump(mode="json"))
    assert [i.type for i in listed.data] == ["function_call_output", "function_call", "message", "message"]
    assert listed.data[-1].content[0].text == "one" and listed.data[-2].role == "assistant"
    ids = [i.id for i in listed.data]
    assert len(set(ids)) == 4 and not listed.has_more
    page = httpx.get(f"{server.url}/v1/conversations/{conv.id}/items", params={"order": "asc", "limit": 3}).json()
    assert [i["id"] for i in page["data"]] == ids[::-1][:3] and page["has_more"]
    one = client.conversations.items.retrieve(ids[1], conversation_id=conv.id)
    ITEM.validate_python(one.model_dump(mode="json"))
    assert one.type == "function_call" and one.name == "get_weather"
    after = client.conversations.items.delete(ids[1], conversation_id=conv.id)
    assert after.id == conv.id
    assert [i.id for i in client.conversations.items.list(conv.id).data] == [ids[0], *ids[2:]]
    r = httpx.get(f"{server.url}/v1/conversations/{conv.id}/items/{ids[1]}")
    assert r.status_code == 404 and r.json()["error"]["param"] == "item_id"


def test_responses_read_the_conversation_and_add_their_turn(server, client, engine):
    """A response in a conversation: its prompt is the conversation's items, then its input; once finished,
    its input and output items are the conversation's newest; the next response sees them. Streamed alike."""
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "hello"}])
    first = client.responses.create(model="fake-model", input="world two", conversation=conv.id)
    assert first.output_text == REPLIES["two"] and first.conversation.id == conv.id
    assert _prompt(engine).split() == ["hello", "world", "two", "assistant"]
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", "user")] * 2 + [("message", "assistant")]
    assert items[1].content[0].text == "world two" and items[2].content[0].text == REPLIES["two"]
    assert items[2].id == first.output[0].id

    events = list(client.responses.create(model="fake-model", input="world three", conversation={"id": conv.id},
                                          stream=True))
    assert events[-1].response.output_text == REPLIES["three"]
    assert _prompt(engine).split() == ["hello", "world", "two", *REPLIES["two"].split(), "world", "three", "assistant"]
    assert len(client.conversations.items.list(conv.id).data) == 5
    unstored = client.responses.create(model="fake-model", input="world two", conversation=conv.id, store=False)
    assert unstored.output_text == REPLIES["two"] and len(client.conversations.items.list(conv.id).data) == 7


@pytest.mark.parametrize("path,body,param", [
    ("/v1/conversations", {"metadata": {"k": 1}}, "metadata"),
    ("/v1/conversations", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("/v1/conversations", {"items": "hello"}, "items"),
    ("/v1/conversations", {"items": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
     "items"),
    ("/v1/responses", {"input": "hi", "conversation": "conv_nope"}, "conversation"),
    ("/v1/responses", {"input": "hi", "conversation": 5}, "conversation"),
])
def test_refusals_name_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_a_conversation_and_a_previous_response_are_not_combined(server, client):
    conv = client.conversations.create()
    previous = client.responses.create(model="fake-model", input="world two")
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "hi", "conversation": conv.id,
                                                       "previous_response_id": previous.id}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "conversation"
    for path in (f"/v1/conversations/{conv.id}/items", f"/v1/conversations/{conv.id}"):
        r = httpx.post(server.url + path, json={}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("items", "metadata")
