"""Audio in and out, with the standard library only.

- `tone` streams a WAV file while it synthesises it: the first item is an `ember.File`
  naming the media type, the rest are bytes, sent as they are made.
- `analyse` takes an uploaded WAV (`curl -F audio=@file.wav`, or the raw body with
  `Content-Type: audio/wav`) and measures it.
- `round_trip` makes a tone with one endpoint and measures it with the other.

    ember deploy examples/audio/app.py
    curl ... "https://127.0.0.1:8443/audio--tone/?frequency=440&seconds=3" -o tone.wav
    curl ... -F audio=@tone.wav https://127.0.0.1:8443/audio--analyse/
"""

import io
import math
import struct
import sys
import wave
from array import array
from itertools import pairwise

import ember

RATE = 16_000  # samples per second, mono, 16-bit
MAX_SECONDS = 600.0


def wav_header(frames: int) -> bytes:
    """The 44-byte header of a 16-bit mono PCM WAV file of `frames` samples."""
    data = frames * 2
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        *(b"RIFF", 36 + data, b"WAVE", b"fmt ", 16, 1, 1, RATE, RATE * 2, 2, 16, b"data", data),
    )


@ember.endpoint(concurrency=4, cpu=0.5)
def tone(frequency: float = 440.0, seconds: float = 2.0, chunk_ms: int = 250):
    """A sine tone as a WAV file, streamed a chunk at a time as it is made."""
    if not 20.0 <= frequency <= RATE / 2:
        raise ember.InputError(f"frequency must be 20 to {RATE // 2} Hz, not {frequency:g}")
    if not 0.0 < seconds <= MAX_SECONDS:
        raise ember.InputError(f"seconds must be above 0 and at most {MAX_SECONDS:g}")
    if not 10 <= chunk_ms <= 10_000:
        raise ember.InputError("chunk_ms must be 10 to 10000")
    frames = int(RATE * seconds)
    yield ember.File(wav_header(frames), "audio/wav", f"tone-{frequency:g}hz.wav")
    step = RATE * chunk_ms // 1000
    for start in range(0, frames, step):
        if ember.cancelled():
            return  # the caller has gone: stop making what nobody will hear
        chunk = array(
            "h",
            (
                int(16_000 * math.sin(2 * math.pi * frequency * n / RATE))
                for n in range(start, min(start + step, frames))
            ),
        )
        if sys.byteorder == "big":
            chunk.byteswap()  # WAV samples are little-endian
        yield chunk.tobytes()


@ember.endpoint(concurrency=4, cpu=0.5)
def analyse(audio: bytes) -> dict:
    """Duration, loudness and pitch (from zero crossings) of a 16-bit PCM WAV file."""
    try:
        with wave.open(io.BytesIO(audio)) as reader:
            channels, width, rate = (
                reader.getnchannels(),
                reader.getsampwidth(),
                reader.getframerate(),
            )
            frames = reader.readframes(reader.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ember.InputError(f"audio is not a WAV file: {exc}") from None
    if width != 2:
        raise ember.InputError(f"audio must be 16-bit PCM, not {width * 8}-bit")
    samples = array("h", frames[: len(frames) - len(frames) % 2])
    if sys.byteorder == "big":
        samples.byteswap()
    mono = samples[::channels]  # the first channel
    if not mono:
        raise ember.InputError("audio has no samples")
    crossings = sum(1 for a, b in pairwise(mono) if (a < 0) != (b < 0))
    seconds = len(mono) / rate
    return {
        "seconds": round(seconds, 3),
        "rate": rate,
        "channels": channels,
        "rms": round(math.sqrt(sum(s * s for s in mono) / len(mono)) / 32768, 4),
        "pitch_hz": round(crossings / 2 / seconds, 1),
    }


@ember.endpoint(cpu=0.25)
def round_trip(frequency: float = 440.0) -> dict:
    """One endpoint calling two others: make a second of tone, then measure it."""
    audio = tone.deployed().call(frequency=frequency, seconds=1.0)
    return {"bytes": len(audio), **analyse.deployed().call(audio=audio)}
