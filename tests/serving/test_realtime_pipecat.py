"""pipecat 1.14's ``OpenAIRealtimeLLMService`` against epd at its defaults: server VAD,
audio output, nothing configured but the URL and the model.

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


@pytest.fixture(scope="module")
def server():
    with launch(None, "e:1,pd:1,t:1", "--kv-cache-memory-gb", "0.5") as s:
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

        class Recorder(FrameProcessor):
            async def process_frame(self, frame, direction):
                await super().process_frame(frame, direction)
                agent.frames.append(type(frame).__name__)
                if isinstance(frame, TTSAudioRawFrame):
                    agent.audio_bytes += len(frame.audio)
                elif isinstance(frame, LLMFullResponseEndFrame):
                    agent.ends += 1
                    agent.changed.set()
                await self.push_frame(frame, direction)

        self.llm = OpenAIRealtimeLLMService(api_key="none", base_url=server.url.replace("http", "ws") + "/v1/realtime",
                                            settings=OpenAIRealtimeLLMService.Settings(model=server.model))
        for name, fn in (functions or {}).items():
            self.llm.register_function(name, fn)
        self.context = context
        pair = LLMContextAggregatorPair(context)
        self.task = PipelineTask(Pipeline([pair.user(), self.llm, Recorder(), pair.assistant()]),
                                 params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE))
        self.direction = FrameDirection

    async def greet(self) -> None:
        """Run the LLM on the context as it stands, as pipecat's examples do when a client
        connects: the context reaches the service and the bot answers first (response 1)."""
        from pipecat.frames.frames import LLMRunFrame

        await self.task.queue_frame(LLMRunFrame())
        await self.responses(1)

    async def speak(self, pcm: bytes) -> None:
        from pipecat.frames.frames import InputAudioRawFrame

        for i in range(0, len(pcm), FRAME):
            await self.task.queue_frame(InputAudioRawFrame(audio=pcm[i:i + FRAME], sample_rate=RATE, num_channels=1))
            await asyncio.sleep(0)

    async def responses(self, n: int, timeout_s: float = 240) -> None:
        """Wait until ``n`` responses have ended."""
        async def wait():
            while self.ends < n:
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
