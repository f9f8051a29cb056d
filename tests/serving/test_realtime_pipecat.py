"""pipecat 1.14's ``OpenAIRealtimeLLMService`` against epd at its defaults: server VAD,
audio output, nothing configured but the URL (the server answers to pipecat's default
model name through ``--served-model-name``).

Served: the embedded default SmolLM2-135M-Instruct with Whisper tiny.en in the encode
pool, a pd pool and a tts pool (``e:1,pd:1,t:1``). The pipeline is the one pipecat's
examples build, minus the transport: the user context aggregator, the realtime service,
a recorder (what a transport's output would play), the assistant aggregator. Spoken
questions (tests/data/speech) go in as ``InputAudioRawFrame`` at 24 kHz, then silence.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.serving.conftest import launch
from tests.serving.test_realtime import pcm16

pytestmark = pytest.mark.slow
RATE = 24000
FRAME = RATE * 2 * 20 // 1000  # 20 ms of PCM16, as a transport delivers it
PIPECAT_DEFAULT_MODEL = "gpt-realtime-2.1"  # OpenAIRealtimeLLMService.Settings' default in pipecat 1.14


@pytest.fixture(scope="module")
def server():
    # pipecat asks for its default model by name (``?model=gpt-realtime-2.1``); the server
    # maps that name to its model, as an operator would (``--served-model-name``)
    with launch(None, "e:1,pd:1,t:1", "--kv-cache-memory-gb", "0.5",
                "--served-model-name", "SmolLM2-135M-Instruct", PIPECAT_DEFAULT_MODEL) as s:
        yield s


class Agent:
    """A pipecat pipeline around ``OpenAIRealtimeLLMService`` pointed at ``server``."""

    def __init__(self, server, context, functions=None) -> None:
        from pipecat.frames.frames import LLMFullResponseEndFrame, TTSAudioRawFrame
        from pipecat.pipeline.pipeline import Pipeline
        from pipecat.pipeline.task import PipelineParams, PipelineTask
        from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
        from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
        from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

        agent = self
        self.audio_bytes, self.ends, self.frames = 0, 0, []
        self.changed = asyncio.Event()
        self.speaking = asyncio.Event()  # set by the first audio out

        class Recorder(FrameProcessor):
            async def process_frame(self, frame, direction):
                await super().process_frame(frame, direction)
                agent.frames.append(type(frame).__name__)
                if isinstance(frame, TTSAudioRawFrame):
                    agent.audio_bytes += len(frame.audio)
                    agent.speaking.set()
                elif isinstance(frame, LLMFullResponseEndFrame):
                    agent.ends += 1
                    agent.changed.set()
                await self.push_frame(frame, direction)

        class Service(OpenAIRealtimeLLMService):
            """The service as is; it also notes each ``response.done``'s status (and reason)."""

            async def _handle_evt_response_done(self, evt):
                details = evt.response.status_details or {}
                agent.done.append((evt.response.status, details.get("reason")))
                agent.log.append(("done", evt.response.status))
                agent.changed.set()
                await super()._handle_evt_response_done(evt)

            async def send_client_event(self, event):
                item = getattr(event, "item", None)
                if getattr(item, "type", None) == "function_call_output":
                    agent.log.append(("result", item.call_id))
                await super().send_client_event(event)

        self.done: list[tuple[str, str | None]] = []  # each response.done: (status, reason)
        self.log: list[tuple[str, str]] = []  # ("result", call id) sent and ("done", status) heard, in order
        # nothing but the key and the URL: pipecat's default model, session and audio settings
        self.llm = Service(api_key="none", base_url=server.url.replace("http", "ws") + "/v1/realtime")
        for name, fn in (functions or {}).items():
            self.llm.register_function(name, fn)
        self.context = context
        pair = LLMContextAggregatorPair(context)
        self.task = PipelineTask(Pipeline([pair.user(), self.llm, Recorder(), pair.assistant()]),
                                 params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE))
        self.direction = FrameDirection

    async def greet(self, wait: bool = True) -> None:
        """Run the LLM on the context as it stands, as pipecat's examples do when a client
        connects: the context reaches the service and the bot answers first (response 1)."""
        from pipecat.frames.frames import LLMRunFrame

        await self.task.queue_frame(LLMRunFrame())
        if wait:
            await self.responses(1)

    async def set_tool_choice(self, choice: str) -> None:
        """Change the session's ``tool_choice`` the way a pipecat app does (a settings
        frame; the service sends ``session.update``)."""
        from pipecat.frames.frames import LLMUpdateSettingsFrame
        from pipecat.services.openai.realtime.events import SessionProperties
        from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

        await self.task.queue_frame(LLMUpdateSettingsFrame(delta=OpenAIRealtimeLLMService.Settings(
            session_properties=SessionProperties(tool_choice=choice))))

    async def speak(self, pcm: bytes) -> None:
        from pipecat.frames.frames import InputAudioRawFrame

        for i in range(0, len(pcm), FRAME):
            await self.task.queue_frame(InputAudioRawFrame(audio=pcm[i:i + FRAME], sample_rate=RATE, num_channels=1))
            await asyncio.sleep(0)

    async def responses(self, n: int, timeout_s: float = 240) -> None:
        """Wait until ``n`` responses have ended."""
        await self.until(lambda: self.ends >= n, timeout_s)

    async def until(self, done, timeout_s: float = 240) -> None:
        """Wait until ``done()`` holds; it is checked after each response end or item update."""
        async def wait():
            while not done():
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(wait(), timeout_s)


async def run(agent: Agent, script) -> None:
    from pipecat.frames.frames import EndFrame
    from pipecat.pipeline.runner import PipelineRunner

    async def drive():
        try:
            await script(agent)
        finally:
            await agent.task.queue_frame(EndFrame())

    runner = PipelineRunner(handle_sigint=False)
    await asyncio.gather(runner.run(agent.task), drive())


def silence(ms: int) -> bytes:
    return bytes(RATE * 2 * ms // 1000)


def roles(context) -> list[tuple[str, str]]:
    out = []
    for m in context.get_messages():
        if isinstance(m, dict) and m.get("role") in ("user", "assistant"):
            content = m.get("content")
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            out.append((m["role"], content or ""))
    return out


def test_pipecats_default_model_name_is_what_it_asks_for():
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

    llm = OpenAIRealtimeLLMService(api_key="none", base_url="ws://127.0.0.1:1/v1/realtime")
    assert llm._settings.model == PIPECAT_DEFAULT_MODEL  # else the fixture's alias misses it


def test_two_spoken_turns_are_answered_in_speech_and_kept_in_the_context(server):
    from pipecat.processors.aggregators.llm_context import LLMContext

    context = LLMContext([{"role": "system", "content": "You are a helpful assistant. Answer in one sentence."}])
    agent = Agent(server, context)

    async def script(a: Agent):
        await a.greet()
        await a.speak(silence(500) + pcm16("capital_of_france.wav", RATE) + silence(1500))
        await a.responses(2)
        assert a.audio_bytes > 0, a.frames
        await a.speak(pcm16("primary_colors.wav", RATE) + silence(1500))
        await a.responses(3)
        await asyncio.sleep(1.0)  # the context aggregators take the last frames

    asyncio.run(run(agent, script))
    said = roles(context)
    users = [t for r, t in said if r == "user"]
    assistants = [t for r, t in said if r == "assistant"]
    assert len(users) == 2 and "capital of france" in users[0].lower(), said
    assert "primary colors" in users[1].lower(), said
    assert len(assistants) == 3 and all(assistants), said
    assert [r for r, _ in said] == ["assistant", "user", "assistant", "user", "assistant"], said
    assert agent.audio_bytes > 2 * RATE  # more than a second of speech out, at 24 kHz PCM16


def _pd_slots_free(server) -> bool:
    stats = [v for k, v in server.workers().items() if k.startswith("pd")]
    assert stats, server.workers()
    return all(s["num_running"] == 0 and s["num_reserved"] == 0 and s["num_free_blocks"] == s["num_blocks"]
               for s in stats)


def test_speech_over_the_answer_interrupts_it_and_frees_its_slot(server):
    """Barge-in at pipecat's defaults: the user speaks while the greeting still streams;
    epd's server VAD cancels that response (``interrupt_response``), pipecat truncates
    the item it was playing, and the user's turn is answered next."""
    from pipecat.processors.aggregators.llm_context import LLMContext

    context = LLMContext([{"role": "system", "content": "You are a storyteller. Greet the user with a very "
                                                        "long story about a dragon, with many chapters."}])
    agent = Agent(server, context)
    busy = []

    async def script(a: Agent):
        await a.greet(wait=False)
        await asyncio.wait_for(a.speaking.wait(), 240)
        busy.append(not await asyncio.to_thread(_pd_slots_free, server))  # the story holds the slot
        await a.speak(pcm16("primary_colors.wav", RATE) + silence(1500))
        # pipecat ends the story itself at the interruption; the user's answer comes after
        await a.until(lambda: len(a.done) >= 2)
        await asyncio.sleep(1.0)

    asyncio.run(run(agent, script))
    assert busy == [True]
    # the greeting's story is cut by the turn; the answer is not (it may run to its token cap)
    assert agent.done[0] == ("cancelled", "turn_detected"), agent.done
    assert agent.done[1][0] in ("completed", "incomplete") and agent.done[1][1] != "turn_detected", agent.done
    said = roles(context)
    assert [r for r, _ in said] == ["assistant", "user", "assistant"], said
    assert "primary colors" in said[1][1].lower(), said
    assert said[2][1], said
    assert _pd_slots_free(server)  # nothing still decodes the cancelled story


def test_a_spoken_question_runs_a_registered_function_and_its_result_is_answered(server):
    """The tool loop through pipecat: the session's tools come from the context; the
    spoken question gets a function call, pipecat runs the registered handler and sends
    its result, and epd answers with it. SmolLM2-135M does not choose a tool by itself,
    so the app asks for one (``tool_choice: "required"``) for that turn, and for words
    (``"none"``; at ``"auto"`` it copies the call in its history) before it returns the result."""
    from pipecat.adapters.schemas.function_schema import FunctionSchema
    from pipecat.adapters.schemas.tools_schema import ToolsSchema
    from pipecat.processors.aggregators.llm_context import LLMContext

    tools = ToolsSchema(standard_tools=[FunctionSchema(
        name="get_capital", description="The capital city of a country.",
        properties={"country": {"type": "string"}}, required=["country"])])
    context = LLMContext([{"role": "system", "content": "You are a helpful assistant. Answer in one sentence."}],
                         tools=tools)
    calls = []

    async def get_capital(params):
        calls.append(dict(params.arguments))
        await agent.set_tool_choice("none")
        await asyncio.sleep(0.5)  # the session.update goes out before the result's response.create
        await params.result_callback({"capital": "Paris"})

    agent = Agent(server, context, functions={"get_capital": get_capital})

    async def script(a: Agent):
        await a.greet()
        await a.set_tool_choice("required")
        await a.speak(silence(500) + pcm16("capital_of_france.wav", RATE) + silence(1500))
        # the model may call it more than once in that response (parallel calls); pipecat
        # sends each result and asks for a response; wait for one after the last result
        await a.until(lambda: calls and len([k for k, _ in a.log if k == "result"]) == len(calls)
                      and a.log[-1][0] == "done")
        await asyncio.sleep(1.0)

    asyncio.run(run(agent, script))
    assert calls and all(isinstance(c.get("country"), str) for c in calls), calls
    messages = [m for m in context.get_messages() if isinstance(m, dict)]
    call = next(m for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))
    assert call["tool_calls"][0]["function"]["name"] == "get_capital", messages
    result = next(m for m in messages if m.get("role") == "tool")
    assert result["tool_call_id"] == call["tool_calls"][0]["id"] and "Paris" in result["content"], messages
    after = messages[messages.index(result) + 1:]
    assert any(m.get("role") == "assistant" and m.get("content") for m in after), messages
