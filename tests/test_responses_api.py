"""The Responses API (``/v1/responses``) through the real tritonserver and the real OpenAI
frontend, with the default model, driven by the ``openai`` SDK and the OpenAI Agents SDK's
default model class (``OpenAIResponsesModel``)."""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import pytest

openai = pytest.importorskip("openai")

from tests.helpers import kvflow_samples, metric, run_weather_agent  # noqa: E402

pytestmark = pytest.mark.slow  # tritonserver and the frontend

MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0, "max_output_tokens": 12}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 40}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in
                                                 ("name", "description", "parameters")}}


def tokens(frontend, body: dict) -> int:
    """How many tokens the engine makes of a chat (``/tokenize``)."""
    request = urllib.request.Request(frontend.url + "/tokenize", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return int(json.loads(answer.read())["count"])


def test_create_whole_and_streamed_say_what_chat_says(client):
    question = "Name a planet."
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": question}])
    whole = client.responses.create(model=MODEL, input=question, **GREEDY)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                            else "completed")
    events = list(client.responses.create(model=MODEL, input=question, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        whole.output_text == events[-1].response.output_text
    # The SDK's stream helper (it checks the events' order as it assembles them; it wants a
    # response.completed, not an incomplete one, so the answer is given room to finish).
    room = {"temperature": 0, "max_output_tokens": 200}
    with client.responses.stream(model=MODEL, input=question, **room) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == client.responses.create(model=MODEL, input=question,
                                                        **room).output_text


def test_previous_response_id_continues_over_three_turns_from_the_prefix_cache(
        client, openai_frontend):
    turns = ["My name is Ada and I like cats.", "What is my name?", "What do I like?"]
    responses, messages = [], []
    for text in turns:
        previous = responses[-1].id if responses else None
        responses.append(client.responses.create(model=MODEL, input=text,
                                                 previous_response_id=previous,
                                                 instructions="Answer briefly.", **GREEDY))
        messages.append({"role": "user", "content": text})
        # What the engine was given: the whole conversation, under this turn's instructions.
        want = tokens(openai_frontend, {"messages": [
            {"role": "system", "content": "Answer briefly."}, *messages]})
        assert responses[-1].usage.input_tokens == want
        assert responses[-1].previous_response_id == previous
        messages.append({"role": "assistant", "content": responses[-1].output_text})
    # Each turn's prompt begins with the last one's: its full blocks come from the cache.
    for before, after in zip(responses, responses[1:], strict=False):
        block = 16
        assert after.usage.input_tokens_details.cached_tokens >= \
            before.usage.input_tokens // block * block > 0


def test_a_function_tool_round_trip(client, openai_frontend):
    ask = "What's the weather like in Paris today?"
    first = client.responses.create(model=MODEL, input=ask, tools=[WEATHER],
                                    tool_choice="required", temperature=0,
                                    max_output_tokens=40)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and first.status == "completed"
    arguments = json.loads(calls[0].arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": calls[0].call_id,
              "output": "Sunny, 21 C."}
    answer = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input=[result], tools=[WEATHER], tool_choice="none",
                                     temperature=0, max_output_tokens=20)
    assert answer.output[0].type == "message" and answer.output_text.strip()
    # The engine saw the call and its result: the chat with them has as many tokens.
    chat = [{"role": "user", "content": ask},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": calls[0].call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 21 C."}]
    assert answer.usage.input_tokens == tokens(openai_frontend, {"messages": chat})
    # Stateless, the items sent back whole: the same prompt.
    again = client.responses.create(model=MODEL, store=False, tool_choice="none",
                                    input=[{"role": "user", "content": ask},
                                           calls[0].model_dump(exclude_none=True), result],
                                    tools=[WEATHER], temperature=0, max_output_tokens=20)
    assert again.usage.input_tokens == answer.usage.input_tokens
    # Streamed, the call's arguments come as deltas that add up to the call.
    events = list(client.responses.create(model=MODEL, input=ask, tools=[WEATHER],
                                          tool_choice="required", temperature=0,
                                          max_output_tokens=40, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == deltas == calls[0].arguments


def test_text_format_json_schema_gives_valid_json(client):
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"], "additionalProperties": False}
    got = client.responses.create(model=MODEL, input="Name a big city and its population.",
                                  text={"format": {"type": "json_schema", "name": "city",
                                                   "schema": schema, "strict": True}},
                                  temperature=0, max_output_tokens=60)
    assert got.status == "completed"
    jsonschema.validate(json.loads(got.output_text), schema)


def test_retrieve_and_delete_and_keys_apart(client, openai_frontend):
    made = client.responses.create(model=MODEL, input="Say hi.", metadata={"case": "r"},
                                   **GREEDY)
    got = client.responses.retrieve(made.id)
    assert got.output_text == made.output_text and got.metadata == {"case": "r"}
    other = openai.OpenAI(base_url=openai_frontend.url + "/v1", api_key="another-key",
                          max_retries=0, timeout=300)
    for call in (lambda: other.responses.retrieve(made.id),
                 lambda: other.responses.create(model=MODEL, input="And?",
                                                previous_response_id=made.id, **GREEDY),
                 lambda: client.responses.create(model=MODEL, input="And?",
                                                 previous_response_id="resp_unknown",
                                                 **GREEDY)):
        with pytest.raises(openai.NotFoundError):
            call()
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(made.id)
    assert info.value.body["param"] == "response_id"
    unstored = client.responses.create(model=MODEL, input="Say hi.", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_built_in_tools_and_truncation_auto_are_400s_naming_them(client):
    for tool in ({"type": "web_search_preview"}, {"type": "file_search",
                                                   "vector_store_ids": ["vs_1"]}):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, input="x", tools=[WEATHER, tool])
        assert info.value.body["param"] == "tools" and tool["type"] in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", truncation="auto")
    assert info.value.body["param"] == "truncation"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", max_output_tokens=10**9)
    assert info.value.body["param"] == "max_output_tokens"


@pytest.fixture(scope="module")
def small_store(triton_server, tmp_path_factory):
    """A frontend whose store keeps two responses, in a SQLite file."""
    from kvflow.openai_api import FrontendConfig
    from kvflow.utils.procs import free_port

    folder = tmp_path_factory.mktemp("responses-store")
    cfg = FrontendConfig((triton_server.grpc_url,), port=free_port(),
                         responses_store=str(folder / "responses.db"),
                         responses_store_max_count=2)
    return cfg, folder


def test_the_store_bound_evicts_says_so_and_survives_a_restart(small_store):
    from kvflow.openai_api import FrontendProcess

    cfg, folder = small_store
    with FrontendProcess(cfg, log_path=folder / "first.log").start() as frontend:
        client = openai.OpenAI(base_url=frontend.url + "/v1", api_key="k", max_retries=0,
                               timeout=300)
        made = [client.responses.create(model=MODEL, input=f"Count to {i}.", **GREEDY)
                for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made[0].id)
        samples = kvflow_samples(urllib.request.urlopen(frontend.url + "/metrics",
                                                        timeout=60).read().decode())
        assert metric(samples, "kvflow_openai_responses_evicted_total") == 1
        assert metric(samples, "kvflow_openai_responses_stored") == 2
    with FrontendProcess(cfg, log_path=folder / "second.log").start() as frontend:
        client = openai.OpenAI(base_url=frontend.url + "/v1", api_key="k", max_retries=0,
                               timeout=300)
        assert client.responses.retrieve(made[2].id).output_text == made[2].output_text
        follow = client.responses.create(model=MODEL, input="Again.",
                                         previous_response_id=made[1].id, **GREEDY)
        assert follow.usage.input_tokens > made[1].usage.input_tokens


@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_sdk_default_model_runs_a_function_tool(openai_frontend, streamed):
    output, cities = run_weather_agent(openai_frontend.url, MODEL, "OpenAIResponsesModel",
                                       streamed)
    assert len(cities) == 1 and output == f"Sunny and 21C in {cities[0]}."
