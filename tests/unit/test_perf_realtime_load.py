# perf/realtime_load.py's microphone: an audio position maps to the send of the chunk that holds it, the
# earliest moment the server could have heard it.
import asyncio
import json

from perf.realtime_load import CHUNK_MS, RATE, Mic


class Socket:
    def __init__(self):
        self.sent = []

    async def send(self, text):
        self.sent.append(json.loads(text))


def test_audio_positions_map_to_their_chunks_send():
    ws = Socket()
    mic = Mic(ws)
    samples = RATE * (2 * CHUNK_MS + CHUNK_MS // 2) // 1000  # two whole chunks and a half one
    asyncio.run(mic.play(bytes(2 * samples)))
    assert len(ws.sent) == 3 and mic.chunk_ends == [CHUNK_MS, 2 * CHUNK_MS, 2.5 * CHUNK_MS]
    first, second, third = mic.chunk_walls
    assert first < second < third
    assert [mic.wall_at(ms) for ms in (0, CHUNK_MS - 20)] == [first, first]
    assert [mic.wall_at(ms) for ms in (CHUNK_MS, 2 * CHUNK_MS - 1)] == [second, second]
    assert [mic.wall_at(ms) for ms in (2 * CHUNK_MS, 10_000)] == [third, third]  # past the end: the last send
