"""`POST /v1/responses` (OpenAI's Responses API) over scripted fake-engine replies: text, reasoning and tool
calls as output items, whole and streamed, every object and event checked against the OpenAI SDK's own
types; the request's translation into a chat request; and the refusals."""

from __future__ import annotations

import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from server.config import ServerConfig  # noqa: E402
from server.conversations import ConversationStore  # noqa: E402
from server.errors import ApiError  # noqa: E402
from server.fake_engine import FakeAsyncEngine, replies_by_last_word  # noqa: E402
from server.openai_responses import responses_api  # noqa: E402
from server.response_store import ResponseStore, StoredResponse  # noqa: E402
from server.responses_input import chat_body, drop_oldest_turns  # noqa: E402
from server.runner import serve_in_thread  # noqa: E402

# Scripted replies, chosen by the last word of the prompt (the fake vocabulary's number words).
REPLIES = {
    "one": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    "two": "It is sunny in Paris today, with a light breeze from the west.",
    "three": "<think>The user counts: one, two, three.</think>Four comes next.",
    "five": '{"city": "Rome"}',
}
TOOLS = [{"type": "function", "name": n, "description": f"{n} tool", "parameters": {"type": "object"}}
         for n in ("get_weather", "get_time")]
TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant{% endif %}"
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server():
    engine = FakeAsyncEngine(step_delay=0.001, scripted_reply=replies_by_last_word(REPLIES))
    config = ServerConfig(port=0, enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3",
                          chat_template=TEMPLATE)
    with serve_in_thread(engine, config) as srv:
        yield srv
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _post(server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "fake-model", **body}, timeout=30)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())  # every field as the SDK's type declares it
    return r.json()


def _stream(server, **body) -> list[dict]:
    """The events of a streamed response, each checked against the SDK's event union."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/responses", json={"model": "fake-model", "stream": True, **body},
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == name
                EVENTS.validate_python(event)
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_text_reply_whole_and_streamed(server, client):
    r = client.responses.create(model="fake-model", input="say two", instructions="Be brief.", max_output_tokens=64)
    assert r.status == "completed" and r.output_text == REPLIES["two"]
    assert [item.type for item in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0 and r.instructions == "Be brief."
    assert r.max_tool_calls is None
    # A cap on built-in tools' calls (none run here): repeated, and the reply is the same.
    capped = client.responses.create(model="fake-model", input="say two", max_tool_calls=1)
    assert capped.max_tool_calls == 1 and capped.output_text == REPLIES["two"]
    events = _stream(server, input="say two")
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == REPLIES["two"]
    assert sum(e["type"] == "response.output_text.delta" for e in events) > 3  # it streams, piece by piece
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == REPLIES["two"] and final["status"] == "completed"
    # The SDK's own stream helper puts the same response back together.
    with client.responses.stream(model="fake-model", input="say two") as s:
        assert s.get_final_response().output_text == REPLIES["two"]


def test_a_reply_cut_by_max_output_tokens_is_incomplete(server):
    r = _post(server, input="say two", max_output_tokens=3)
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete" and r["usage"]["output_tokens"] == 3
    events = _stream(server, input="say two", max_output_tokens=3)
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"


def test_tool_calls_are_function_call_items(server, client):
    r = client.responses.create(model="fake-model", input="say one", tools=TOOLS)
    assert [item.type for item in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == "Checking."
    calls = r.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {"zone": "CET"})]
    assert all(c.call_id.startswith("call_") for c in calls) and calls[0].call_id != calls[1].call_id
    events = _stream(server, input="say one", tools=TOOLS)
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["message", "function_call", "function_call"]
    done = [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in done] == [{"city": "Paris"}, {"zone": "CET"}]
    deltas = [(e["output_index"], e["delta"]) for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 2, "an auto call's arguments stream as they are written"
    assert ["".join(d for i, d in deltas if i == n) for n in (1, 2)] == done
    # A forced function streams its arguments as they come.
    events = _stream(server, input="say five", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == REPLIES["five"]
    final = events[-1]["response"]["output"]
    assert [(i["type"], i["name"], i["arguments"]) for i in final] == [("function_call", "get_weather",
                                                                         REPLIES["five"])]


def test_reasoning_is_a_reasoning_item(server):
    r = _post(server, input="count three")
    assert [item["type"] for item in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"][0]["text"] == "The user counts: one, two, three."
    assert r["output"][1]["content"][0]["text"] == "Four comes next."
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    events = _stream(server, input="count three")
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thought, answer) == ("The user counts: one, two, three.", "Four comes next.")
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]


def _token_logprobs(entries: list[dict]) -> list[tuple]:
    return [(e["token"], e["logprob"], len(e["top_logprobs"])) for e in entries]


@pytest.mark.parametrize("prompt,tools", [("say two", None), ("count three", None), ("say one", TOOLS)])
def test_logprobs_of_every_token_whole_and_streamed(server, prompt, tools):
    extra = {"tools": tools} if tools else {}
    r = _post(server, input=prompt, top_logprobs=2, **extra)
    message = next(item for item in r["output"] if item["type"] == "message")
    whole = message["content"][0]["logprobs"]
    # Every generated token (reasoning and tool calls too), each with its two alternatives (the fake engine's
    # logprob is -0.25 for the token drawn, -0.25 - i for the i-th alternative).
    assert len(whole) == r["usage"]["output_tokens"] > 3
    assert all(e["logprob"] == -0.25 and [t["logprob"] for t in e["top_logprobs"]] == [-0.25, -1.25]
               and e["bytes"] == list(e["token"].encode()) for e in whole)
    events = _stream(server, input=prompt, top_logprobs=2, **extra)
    streamed = [e for ev in events if ev["type"] == "response.output_text.delta" for e in ev["logprobs"]]
    done = next(ev for ev in events if ev["type"] == "response.output_text.done")["logprobs"]
    final = next(item for item in events[-1]["response"]["output"] if item["type"] == "message")
    assert _token_logprobs(final["content"][0]["logprobs"]) == _token_logprobs(whole)
    assert _token_logprobs(streamed) == _token_logprobs(done) == _token_logprobs(whole)[:len(done)]
    if tools is None:  # the text ends the reply: its deltas carry every token
        assert len(done) == len(whole)


def test_logprobs_asked_for_by_include_alone():
    assert chat_body({"input": "hi", "include": ["message.output_text.logprobs"]})["top_logprobs"] == 0
    assert "logprobs" not in chat_body({"input": "hi", "include": ["reasoning.encrypted_content"]})
    assert chat_body({"input": "hi", "top_logprobs": 3})["top_logprobs"] == 3


def test_logprobs_are_empty_unless_asked_for(server):
    r = _post(server, input="say two")
    assert r["output"][0]["content"][0]["logprobs"] == [] and r["top_logprobs"] is None
    r = _post(server, input="say two", include=["message.output_text.logprobs"])
    entries = r["output"][0]["content"][0]["logprobs"]
    assert len(entries) == r["usage"]["output_tokens"] and all(e["top_logprobs"] == [] for e in entries)


def test_truncation_auto_drops_the_oldest_whole_turns(server):
    from server.fake_engine import fake_tokenizer

    turns = [{"role": "user", "content": "one " * 60}, {"role": "assistant", "content": "two " * 60},
             {"role": "user", "content": "three " * 60}, {"role": "assistant", "content": "four " * 60},
             {"role": "user", "content": "say two"}]
    body = dict(input=turns, instructions="Be brief.", max_output_tokens=32)
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "fake-model", **body})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"  # 277 of 256 tokens
    r = _post(server, **body, truncation="auto")
    assert r["status"] == "completed" and r["truncation"] == "auto"
    assert r["output"][0]["content"][0]["text"] == REPLIES["two"]
    tok = fake_tokenizer()
    kept = [{"role": "system", "content": "Be brief."}, *turns[2:]]  # the first turn (user, assistant) went
    assert r["usage"]["input_tokens"] == len(tok.encode(tok.apply_chat_template(kept, chat_template=TEMPLATE)))
    # Streamed alike; the stored conversation keeps every turn.
    events = _stream(server, **body, truncation="auto", store=True)
    assert events[-1]["response"]["usage"]["input_tokens"] == r["usage"]["input_tokens"]
    stored = _post(server, input="say two", previous_response_id=r["id"], truncation="auto")
    kept = [*turns[2:], {"role": "assistant", "content": REPLIES["two"]}, {"role": "user", "content": "say two"}]
    assert stored["usage"]["input_tokens"] == len(tok.encode(tok.apply_chat_template(kept, chat_template=TEMPLATE)))
    # The latest turn alone does not fit: refused as without truncation.
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "fake-model", "input": "one " * 300,
                                                        "truncation": "auto"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_dropping_turns_drops_the_fewest_whole_turns():
    import random

    rng = random.Random(0)
    for _ in range(300):
        roles = ["system"] * rng.randint(0, 2) + [rng.choice(["user", "assistant", "tool"])
                                                  for _ in range(rng.randint(1, 12))]
        messages = [{"role": r, "content": str(i)} for i, r in enumerate(roles)]
        limit = rng.randint(0, len(messages))
        got = drop_oldest_turns(messages, lambda m, limit=limit: len(m) <= limit)
        head = [m for m in messages if m["role"] == "system"]
        # The kept messages: the system messages, then a suffix that starts at a user message (or is all).
        rest = got[len(head):]
        assert got[:len(head)] == head and rest == messages[len(messages) - len(rest):]
        users = [i for i, m in enumerate(messages) if m["role"] == "user" and i > len(head)]
        if rest != messages[len(head):]:
            assert rest[0]["role"] == "user"
            # The fewest: keeping one more turn would not fit, or nothing shorter fits at all.
            start = len(messages) - len(rest)
            longer = [c for c in users if c < start]
            assert len(got) <= limit or start == users[-1]
            if longer and len(got) <= limit:
                assert len(head) + len(messages) - longer[-1] > limit


def test_input_items_become_the_chat_conversation():
    body = chat_body({"model": "m", "instructions": "sys", "max_output_tokens": 7, "input": [
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
    ], "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}})
    assert body["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "system", "content": "dev"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."}]
    assert body["max_completion_tokens"] == 7
    assert body["tools"][0] == {"type": "function", "function": {"name": "get_weather", "description":
                                                                 "get_weather tool", "parameters": {"type": "object"}}}
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}


@pytest.mark.parametrize("extra,param,words", [
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ({"background": True, "stream": True}, "stream", "not streamed"),
    ({"background": True, "store": False}, "store", "must be stored"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input[0].content[0]",
     "text and input_image content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]},
     "input[0].content[0].image_url", "file_id is not supported"),
    ({"truncation": "middle"}, "truncation", "must be 'disabled' or 'auto'"),
    ({"top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    ({"include": "message.output_text.logprobs"}, "include", "list of strings"),
    ({"frobnicate": 1}, "frobnicate", "unknown field"),
    ({"max_tool_calls": 0}, "max_tool_calls", "positive integer"),
    ({"input": []}, "input", "non-empty list"),
])
def test_refusals_name_the_field(server, extra, param, words):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "fake-model", "input": "hi", **extra})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]


def test_stored_responses_continue_and_can_be_fetched_and_deleted(server, client):
    """`store` (the default): the response is kept; `previous_response_id` continues its conversation (the
    prompt grows by its turn and reply), whole or streamed; GET returns it as it was; DELETE forgets it."""
    first = client.responses.create(model="fake-model", input="say two", instructions="Be brief.")
    assert first.store and first.output_text == REPLIES["two"]
    fetched = httpx.get(f"{server.url}/v1/responses/{first.id}", timeout=30)
    assert fetched.status_code == 200 and fetched.json() == first.model_dump(mode="json", exclude_unset=True)
    assert client.responses.retrieve(first.id).output_text == REPLIES["two"]

    alone = _post(server, input="count three")
    after = _post(server, input="count three", previous_response_id=first.id)
    assert after["previous_response_id"] == first.id and after["output"][1]["content"][0]["text"] == "Four comes next."
    # The earlier turn ("say two") and its reply come first; its instructions are not inherited.
    grown = after["usage"]["input_tokens"] - alone["usage"]["input_tokens"]
    turn = _post(server, input=[{"role": "user", "content": "say two"},
                                {"role": "assistant", "content": REPLIES["two"]}, {"role": "user", "content": "count three"}])
    assert grown > 0 and after["usage"]["input_tokens"] == turn["usage"]["input_tokens"]

    # A streamed response is stored too, and a chain goes on from it.
    streamed = _stream(server, input="say two", previous_response_id=after["id"])[-1]["response"]
    assert streamed["store"] and httpx.get(f"{server.url}/v1/responses/{streamed['id']}").json() == streamed
    third = _post(server, input="count three", previous_response_id=streamed["id"])
    assert third["usage"]["input_tokens"] > after["usage"]["input_tokens"]

    deleted = httpx.delete(f"{server.url}/v1/responses/{first.id}", timeout=30)
    assert deleted.json() == {"id": first.id, "object": "response", "deleted": True}
    for r in (httpx.get(f"{server.url}/v1/responses/{first.id}", timeout=30),
              httpx.post(f"{server.url}/v1/responses", json={"input": "hi", "previous_response_id": first.id})):
        assert r.status_code == 404 and first.id in r.json()["error"]["message"]
    assert httpx.post(f"{server.url}/v1/responses", json={"input": "hi", "previous_response_id": first.id}
                      ).json()["error"]["param"] == "previous_response_id"

    unstored = _post(server, input="say two", store=False)
    assert unstored["store"] is False
    assert httpx.get(f"{server.url}/v1/responses/{unstored['id']}", timeout=30).status_code == 404


def test_input_items_are_listed_a_page_at_a_time(server, client):
    """`GET /v1/responses/{id}/input_items`: the request's input items with ids, newest first by default, as the
    SDK's list type declares them; `limit` and `after` page through them; bad parameters name themselves."""
    from openai.types.responses import ResponseItemList

    items = [{"role": "user", "content": "weather?"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}", "id": "fc_given"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"role": "user", "content": [{"type": "input_text", "text": "say two"}]}]
    rid = _post(server, input=items)["id"]
    listed = client.responses.input_items.list(rid)
    ResponseItemList.model_validate(listed.model_dump(mode="json"))
    assert [i.type for i in listed.data] == ["message", "function_call_output", "function_call", "message", "message"]
    assert listed.data[2].id == "fc_given" and listed.data[1].output == "sunny" and not listed.has_more
    assert listed.data[-1].content[0].text == "weather?" and listed.data[-2].role == "assistant"
    ids = [i.id for i in listed.data]
    assert len(set(ids)) == 5 and listed.first_id == ids[0] and listed.last_id == ids[-1]
    page = httpx.get(f"{server.url}/v1/responses/{rid}/input_items", params={"order": "asc", "limit": 2}).json()
    assert [i["id"] for i in page["data"]] == ids[::-1][:2] and page["has_more"]
    rest = httpx.get(f"{server.url}/v1/responses/{rid}/input_items",
                     params={"order": "asc", "limit": 100, "after": page["last_id"]}).json()
    assert [i["id"] for i in rest["data"]] == ids[::-1][2:] and not rest["has_more"]
    one = client.responses.input_items.list(_post(server, input="say two")["id"])
    assert len(one.data) == 1 and one.data[0].role == "user" and one.data[0].content[0].text == "say two"
    for params, param in (({"order": "up"}, "order"), ({"limit": 0}, "limit"), ({"after": "nope"}, "after")):
        r = httpx.get(f"{server.url}/v1/responses/{rid}/input_items", params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_background_responses_complete_cancel_and_refuse_continuation_until_done():
    """`background: true`: the response comes back in progress once generation has started and is read back by
    GET until it is done; a continuation waits for it; cancel stops one in progress (the engine aborts it), and
    DELETE stops one before forgetting it."""
    engine = FakeAsyncEngine(step_delay=0.03, scripted_reply=replies_by_last_word(REPLIES))  # ~0.5 s for the sunny reply
    config = ServerConfig(port=0, reasoning_parser="qwen3", chat_template=TEMPLATE)
    with serve_in_thread(engine, config) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        started = client.responses.create(model="fake-model", input="say two", background=True)
        assert started.background and started.status == "in_progress" and started.output == []
        assert client.responses.retrieve(started.id).status == "in_progress"
        early = httpx.post(f"{srv.url}/v1/responses", json={"input": "hi", "previous_response_id": started.id})
        assert early.status_code == 400 and "still in progress" in early.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while (done := client.responses.retrieve(started.id)).status == "in_progress":
            assert time.monotonic() < deadline, "the background response never finished"
            time.sleep(0.05)
        assert done.status == "completed" and done.output_text == REPLIES["two"] and done.usage.output_tokens > 5
        after = client.responses.create(model="fake-model", input="count three", previous_response_id=started.id)
        assert after.output_text == "Four comes next."
        again = httpx.post(f"{srv.url}/v1/responses/{started.id}/cancel")
        assert again.status_code == 400 and "is completed" in again.json()["error"]["message"]

        running = client.responses.create(model="fake-model", input="say two", background=True)
        cancelled = client.responses.cancel(running.id)
        assert cancelled.status == "cancelled" and cancelled.output == []
        assert 0 < cancelled.usage.output_tokens < done.usage.output_tokens  # stopped part way
        assert client.responses.retrieve(running.id).status == "cancelled"
        gone = client.responses.create(model="fake-model", input="say two", background=True)
        assert httpx.delete(f"{srv.url}/v1/responses/{gone.id}").json()["deleted"] is True
        assert httpx.get(f"{srv.url}/v1/responses/{gone.id}").status_code == 404
        deadline = time.monotonic() + 5
        while engine.stats().num_running or engine.stats().num_waiting:  # the engine let both go
            assert time.monotonic() < deadline, "a stopped background response still runs in the engine"
            time.sleep(0.02)
    engine.shutdown()


def test_continuation_messages_and_the_store_bound():
    """The chat conversation of a continuation: new instructions, then the stored turns (the reply's function
    calls as an assistant turn), then the new input. The store keeps the newest `capacity` responses."""
    store = ResponseStore(2)
    history = ({"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]})
    store.put(StoredResponse({"id": "resp_a", "output": []}, history))
    translate = responses_api(store, ConversationStore(2))["translate"]
    body = translate({"model": "m", "instructions": "sys", "previous_response_id": "resp_a",
                      "input": [{"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    assert body["messages"] == [{"role": "system", "content": "sys"}, *history,
                                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    store.put(StoredResponse({"id": "resp_b", "output": []}, ()))
    store.put(StoredResponse({"id": "resp_c", "output": []}, ()))
    assert store.get("resp_a") is None and store.get("resp_c") is not None and len(store) == 2
    none = ResponseStore(0)
    none.put(StoredResponse({"id": "resp_a", "output": []}, ()))
    assert len(none) == 0 and none.get("resp_a") is None
    with pytest.raises(ApiError, match="stores none") as refused:  # nothing to read a background response from
        responses_api(none, ConversationStore(0))["translate"]({"model": "m", "input": "hi", "background": True})
    assert refused.value.param == "background"
