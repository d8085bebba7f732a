# Short synthetic videos made with PyAV for the video tests: moving colour patterns (every frame differs)
# and, optionally, an audio track of a wandering tone.
import base64
import io

import numpy as np

from perf.media_workloads import mux_audio


def make_video(seconds=2.0, fps=10, width=96, height=64, audio=True, seed=0, audio_rate=16000) -> bytes:
    import av

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        v = out.add_stream("mpeg4", rate=fps)
        v.width, v.height, v.pix_fmt = width, height, "yuv420p"
        v.options = {"qscale": "2"}
        a = None
        if audio:
            a = out.add_stream("aac", rate=audio_rate)
            a.layout = "mono"
        for i in range(int(seconds * fps)):
            frame = np.roll(base, shift=(3 * i, 5 * i), axis=(0, 1))
            for packet in v.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in v.encode(None):
            out.mux(packet)
        if a is not None:
            t = np.arange(int(seconds * audio_rate)) / audio_rate
            tone = (0.3 * np.sin(2 * np.pi * (220 + 60 * np.sin(t * 3 + seed)) * t)).astype(np.float32)
            mux_audio(out, a, tone, audio_rate)
    return buf.getvalue()


def video_data_url(raw: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(raw).decode()
