"""A real checkpoint calling tools: SmolLM2-135M-Instruct (the embedded default) through the
official ``openai`` SDK and through pipecat's ``OpenAILLMService``.

SmolLM2's chat template ignores ``tools``, so epd describes them in a system message in the
hermes format (``epd.api.tools.fallback_messages``); ``tool_choice: "required"`` constrains
the answer to a call whose arguments follow the function's schema.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.serving.conftest import launch

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city name"}},
                   "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(default_model_dir):
    with launch(default_model_dir, "pd:1", "--kv-cache-memory-gb", "0.2") as s:
        yield s


def test_a_tool_round_trip_through_the_openai_sdk(server):
    client = server.client()
    first = client.chat.completions.create(model=server.model, messages=QUESTION, tools=[WEATHER],
                                           tool_choice="required", temperature=0, max_tokens=100)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    for call in calls:  # the model may call it more than once (parallel_tool_calls defaults to true)
        assert call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, {**WEATHER["function"]["parameters"], "additionalProperties": False})
    assert "paris" in json.loads(calls[0].function.arguments)["city"].lower()
    messages = QUESTION + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}
        for c in calls]
    final = client.chat.completions.create(model=server.model, messages=messages, tools=[WEATHER],
                                           temperature=0, max_tokens=60)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


def test_pipecat_openai_llm_service_calls_the_registered_function(server):
    """pipecat 1.14's ``OpenAILLMService`` streams the call and runs the handler registered
    for it, with the parsed arguments."""
    from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
    from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
    from pipecat.frames.frames import LLMContextFrame
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.services.openai.llm import OpenAILLMService
    from pipecat.tests.utils import run_test

    calls = []

    async def get_weather(params):
        calls.append((params.function_name, dict(params.arguments)))
        await params.result_callback({"temperature_c": 21})

    llm = OpenAILLMService(api_key="none", base_url=server.url + "/v1",
                           settings=OpenAILLMService.Settings(model=server.model, temperature=0))
    llm.register_function("get_weather", get_weather)
    tools = ToolsSchema(standard_tools=[FunctionSchema(name="get_weather", description="Get the current weather",
                                                       properties={"city": {"type": "string"}},
                                                       required=["city"])])
    context = LLMContext(QUESTION, tools=tools, tool_choice="required")
    asyncio.run(run_test(llm, frames_to_send=[LLMContextFrame(context)], expected_down_frames=None))
    assert calls and calls[0][0] == "get_weather" and "paris" in calls[0][1]["city"].lower()
