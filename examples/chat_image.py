"""Chat about an image through epd's OpenAI-compatible API with the official openai SDK.

Serve a model with a vision tower first, e.g.:
    .venv/bin/epd model create-tiny llava /tmp/llava && .venv/bin/epd launch --model /tmp/llava
then:
    .venv/bin/python examples/chat_image.py [--image photo.jpg] [--base-url http://127.0.0.1:8000/v1]

The image travels inside the request as a base64 data: URL (http(s) URLs are fetched
only for hosts the server allows with --allowed-media-domains).
"""

from __future__ import annotations

import argparse
import base64
import io
import mimetypes
import os
import sys

from openai import BadRequestError, OpenAI


def image_data_url(path: str | None) -> str:
    if path is None:  # a generated picture: a red square on white
        from PIL import Image, ImageDraw

        img = Image.new("RGB", (64, 64), "white")
        ImageDraw.Draw(img).rectangle((16, 16, 48, 48), fill="red")
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        data, mime = buf.getvalue(), "image/png"
    else:
        with open(path, "rb") as f:
            data = f.read()
        mime = mimetypes.guess_type(path)[0] or "image/png"
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--image", default=None, help="image file (default: a generated red square)")
    ap.add_argument("--question", default="What is in this picture?")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, max_tokens=args.max_tokens, temperature=0, stream=True,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_data_url(args.image)}},
            {"type": "text", "text": args.question}]}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


if __name__ == "__main__":
    try:
        main()
    except BadRequestError as e:  # e.g. a model without a vision tower / speech front end
        sys.exit(f"the server refused the request: {e.body.get('message') if isinstance(e.body, dict) else e}")
