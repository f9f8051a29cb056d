"""A Piper voice built in the test run: Piper's ONNX interface (``input`` [1, n] int64
phoneme ids, ``input_lengths`` [1], ``scales`` [3], ``sid`` [1] for several speakers ->
``output`` [1, 1, n * hop] float32) around a tone instead of a trained VITS. Its audio
says what reached it: ``hop`` samples per phoneme id, at ``base_hz + 100 * speaker`` Hz."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

HOP = 256
BASE_HZ = 220.0
SAMPLE_RATE = 22050


class _Tone(torch.nn.Module):
    def __init__(self, speakers: int) -> None:
        super().__init__()
        self.speakers = speakers

    def forward(self, input, input_lengths, scales, sid=None):  # Piper's input names
        n = input.shape[1]
        t = torch.arange(n * HOP, dtype=torch.float32) / SAMPLE_RATE
        hz = torch.tensor(BASE_HZ) if sid is None else BASE_HZ + 100.0 * sid.to(torch.float32)[0]
        unused = 0.0 * (scales.sum() + input_lengths.sum().to(torch.float32))  # kept as graph inputs
        return (0.5 * torch.sin(2 * torch.pi * hz * t) + unused).reshape(1, 1, -1)


def build(directory: Path, speakers: int = 1, name: str = "en_US-test-tone") -> Path:
    """Write ``name.onnx`` and ``name.onnx.json`` into ``directory``; returns it."""
    from piper.phoneme_ids import DEFAULT_PHONEME_ID_MAP

    directory.mkdir(parents=True, exist_ok=True)
    x = torch.ones(1, 12, dtype=torch.int64)
    args = (x, torch.tensor([12]), torch.tensor([0.667, 1.0, 0.8]))
    names = ["input", "input_lengths", "scales"]
    if speakers > 1:
        args += (torch.tensor([0]),)
        names.append("sid")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Tone(speakers), args, str(directory / f"{name}.onnx"), input_names=names,
                          output_names=["output"], dynamic_axes={"input": {1: "phonemes"}, "output": {2: "time"}},
                          dynamo=False, opset_version=17)
    config = {"audio": {"sample_rate": SAMPLE_RATE}, "espeak": {"voice": "en-us"}, "phoneme_type": "espeak",
              "num_symbols": 256, "num_speakers": speakers, "phoneme_id_map": DEFAULT_PHONEME_ID_MAP,
              "speaker_id_map": {f"speaker_{i}": i for i in range(speakers)} if speakers > 1 else {},
              "inference": {"noise_scale": 0.667, "length_scale": 1.0, "noise_w": 0.8}}
    (directory / f"{name}.onnx.json").write_text(json.dumps(config))
    return directory
