"""LoRA at the front doors, without a server: the Triton request's ``lora_name``, the
``kvflow_lora`` control command, the OpenAI ``model`` field and vLLM's load/unload bodies,
Dynamo's ``lora_name`` and the ``lora_id`` of its KV events. (Served:
tests/test_lora_served.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvflow.dynamo.protocol import lora_name_of
from kvflow.kv_manager.block_pool import BlockStored
from kvflow.openai_api.errors import OpenAIError, error_from_backend
from kvflow.openai_api.lora import load_request, model_not_found, unload_request
from kvflow.openai_api.protocol import parse_completion_request
from kvflow.openai_api.responses_request import parse_responses_request
from kvflow.triton_backend.lora_control import (
    LoraCommand,
    absolute_lora_paths,
    parse_lora_command,
)
from kvflow.triton_backend.params import BadRequestError, parse_request

BASE = "smollm2-135m-instruct"


def _inputs(sampling: dict | None = None) -> dict[str, np.ndarray]:
    inputs = {"text_input": np.array([b"Hello"], dtype=np.object_)}
    if sampling is not None:
        inputs["sampling_parameters"] = np.array([json.dumps(sampling).encode()],
                                                 dtype=np.object_)
    return inputs


# --- Triton: the request's adapter ------------------------------------------------------------

def test_triton_request_names_its_adapter_as_a_parameter_or_a_sampling_key():
    assert parse_request(_inputs(), 1024).lora_name is None
    assert parse_request(_inputs(), 1024, parameters={"lora_name": "sql"}).lora_name == "sql"
    # Triton's vLLM backend clients put it in sampling_parameters.
    parsed = parse_request(_inputs({"lora_name": "sql", "temperature": "0"}), 1024)
    assert parsed.lora_name == "sql" and parsed.params.temperature == 0
    both = parse_request(_inputs({"lora_name": "sql"}), 1024, parameters={"lora_name": "sql"})
    assert both.lora_name == "sql"
    assert parse_request(_inputs({"lora_name": ""}), 1024).lora_name is None


@pytest.mark.parametrize(("sampling", "parameters", "words"), [
    ({"lora_name": "a"}, {"lora_name": "b"}, "name different adapters"),
    ({"lora_name": 5}, None, "sampling_parameters.lora_name must be a string"),
    (None, {"lora_name": True}, "lora_name must be a string"),
    (None, {"lora_name": "x" * 300}, "lora_name is 300 characters; the limit is 256"),
])
def test_a_bad_adapter_name_is_refused_naming_the_field(sampling, parameters, words):
    with pytest.raises(BadRequestError, match=words):
        parse_request(_inputs(sampling), 1024, parameters=parameters)


# --- Triton: the control command --------------------------------------------------------------

def test_lora_commands_parse_from_the_parameters_json():
    assert parse_lora_command('{"op": "list"}') == LoraCommand("list")
    assert parse_lora_command(json.dumps({"op": "load", "lora_name": "sql",
                                          "lora_path": "/a"})) == LoraCommand("load", "sql", "/a")
    assert parse_lora_command({"op": "unload", "lora_name": "sql"}) == LoraCommand("unload",
                                                                                   "sql")


@pytest.mark.parametrize(("value", "words"), [
    ("{", "kvflow_lora is not valid JSON"),
    ("[1]", "kvflow_lora must be a JSON object"),
    ('{"op": "reload"}', "kvflow_lora.op must be one of load, unload, list"),
    ('{"op": "load", "lora_name": "a"}', "lora_path must be a non-empty string"),
    ('{"op": "load", "lora_path": "/p"}', "lora_name must be a non-empty string"),
    ('{"op": "unload", "lora_name": "a", "lora_path": "/p"}', "unknown key.*lora_path"),
    ('{"op": "unload", "lora_name": " a"}', "lora_name must be printable"),
    (json.dumps({"op": "list", "x": "y" * 20000}), "the limit is 16384"),
])
def test_a_bad_lora_command_is_refused_naming_the_key(value, words):
    with pytest.raises(BadRequestError, match=words):
        parse_lora_command(value)


def test_lora_modules_paths_are_made_absolute_and_must_exist(tmp_path, monkeypatch):
    (tmp_path / "sql").mkdir()
    monkeypatch.chdir(tmp_path)
    assert absolute_lora_paths({"sql": "sql"}) == {"sql": str(tmp_path / "sql")}
    with pytest.raises(ValueError, match="--lora-modules gone=missing: no such file"):
        absolute_lora_paths({"gone": "missing"})


# --- OpenAI: the model field and vLLM's bodies ------------------------------------------------

def test_an_adapter_model_goes_to_the_backend_as_lora_name_and_is_echoed():
    parsed = parse_completion_request({"model": "sql", "prompt": "x", "max_tokens": 2}, "sql",
                                      chat=False, lora_name="sql")
    sampling = json.loads(parsed.choices[0].inputs["sampling_parameters"][0])
    assert sampling["lora_name"] == "sql" and parsed.model == "sql"
    base = parse_completion_request({"model": BASE, "prompt": "x"}, BASE, chat=False)
    assert "lora_name" not in json.loads(base.choices[0].inputs["sampling_parameters"][0])
    chat = parse_responses_request({"model": "sql", "input": "hi"}, "sql", None, None, "sql")
    chat_sampling = json.loads(chat.chat.choices[0].inputs["sampling_parameters"][0])
    assert chat_sampling["lora_name"] == "sql" and chat.echo["model"] == "sql"


def test_an_unknown_model_is_404_naming_the_base_and_the_adapters():
    error = model_not_found("gpt-4o", BASE, ["sql", "chat"])
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    assert f"serves `{BASE}`" in error.message and "`chat`, `sql`" in error.message
    assert "adapters" not in model_not_found("gpt-4o", BASE, []).message
    # An adapter unloaded between the frontend's look and the engine's: the engine's words.
    late = error_from_backend("model: no adapter 'sql'; loaded: []", None, "bad_request")
    assert (late.status, late.code, late.param) == (404, "model_not_found", "model")


def test_vllm_load_and_unload_bodies():
    assert load_request({"lora_name": "sql", "lora_path": "/a"}, BASE) == ("sql", "/a")
    assert load_request({"lora_name": "sql", "lora_path": "/a", "load_inplace": False},
                        BASE) == ("sql", "/a")
    assert unload_request({"lora_name": "sql", "lora_int_id": 3}) == "sql"


@pytest.mark.parametrize(("body", "param"), [
    ({"lora_path": "/a"}, "lora_name"),
    ({"lora_name": "sql"}, "lora_path"),
    ({"lora_name": "sql", "lora_path": ""}, "lora_path"),
    ({"lora_name": BASE, "lora_path": "/a"}, "lora_name"),
    ({"lora_name": "sql", "lora_path": "/a", "load_inplace": True}, "load_inplace"),
    ({"lora_name": "sql", "lora_path": "/a", "base_model_name": "x"}, "base_model_name"),
])
def test_a_bad_load_body_is_a_400_naming_the_field(body, param):
    with pytest.raises(OpenAIError) as e:
        load_request(body, BASE)
    assert (e.value.status, e.value.param) == (400, param)


# --- Dynamo -----------------------------------------------------------------------------------

def test_dynamo_request_selects_an_adapter_by_lora_name_or_model():
    loaded = {"sql"}
    assert lora_name_of({"token_ids": [1]}, loaded) is None
    assert lora_name_of({"model": BASE}, loaded) is None
    assert lora_name_of({"model": "sql"}, loaded) == "sql"
    assert lora_name_of({"lora_name": "other"}, loaded) == "other"  # the engine refuses it
    assert lora_name_of({"extra_args": {"nvext": {"lora_name": "sql"}}}, ()) == "sql"
    with pytest.raises(ValueError, match="lora_name must be a string"):
        lora_name_of({"extra_args": {"lora_name": 3}}, loaded)


def test_kv_events_carry_the_adapters_lora_id():
    pytest.importorskip("msgspec")  # the Dynamo extra's (make dynamo)
    from kvflow.dynamo.events import block_id, encode_events

    h = [bytes([i]) * 32 for i in range(1, 5)]
    events = [BlockStored(h[0], None, (1, 2), lora_id=None),
              BlockStored(h[1], h[0], (3, 4), lora_id=None),
              BlockStored(h[2], None, (1, 2), lora_id=2),
              BlockStored(h[3], h[2], (3, 4), lora_id=2)]
    wire = encode_events(events, block_size=2)
    assert [e[5] for e in wire] == [None, 2]
    assert wire[1][1] == [block_id(h[2]), block_id(h[3])] and wire[1][3] == [1, 2, 3, 4]
