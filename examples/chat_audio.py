"""Ask a spoken question through epd's OpenAI-compatible API with the official openai SDK.

    .venv/bin/epd launch          # the default SmolLM2 hears audio through a Whisper front end
    .venv/bin/python examples/chat_audio.py [--audio clip.wav] [--base-url http://127.0.0.1:8000/v1]

The clip goes as an ``input_audio`` content part (base64 WAV or MP3). The default
clip is tests/data/speech/capital_of_france.wav ("What is the capital of France?").
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path

from openai import BadRequestError, OpenAI

DEFAULT_CLIP = Path(__file__).resolve().parents[1] / "tests" / "data" / "speech" / "capital_of_france.wav"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--audio", default=str(DEFAULT_CLIP), help="WAV or MP3 file")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    path = Path(args.audio)
    fmt = "mp3" if path.suffix.lower() == ".mp3" else "wav"
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, max_tokens=args.max_tokens, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(path.read_bytes()).decode(),
                                                    "format": fmt}}]}])
    print(reply.choices[0].message.content)
    print(f"[{reply.usage.prompt_tokens} prompt tokens, {reply.usage.completion_tokens} completion tokens]")


if __name__ == "__main__":
    try:
        main()
    except BadRequestError as e:  # e.g. a model without a vision tower / speech front end
        sys.exit(f"the server refused the request: {e.body.get('message') if isinstance(e.body, dict) else e}")
