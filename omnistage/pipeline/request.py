# One omni request flowing through the stages (Triton-agnostic: the stages are reached through a
# StageClient). Three threads (the caller's, and two of a DaemonPool), because reading a stage stream blocks:
#   caller thread : thinker stream -> text deltas out; reply-token rows -> talker (start, then appends)
#   talker thread : codec frames -> chunk windows -> code2wav queue
#   code2wav thread: windows decoded in order -> audio chunks out
# The talker starts on the thinker's first reply token (async chunk); frames are cut into chunks on the
# schedule, and each chunk's frames go to the request's code2wav session, which keeps the stream's state
# (exact streaming): only frames go out and samples come back, however long the utterance.
from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from ..core.chunking import ChunkCutter, ChunkSchedule
from ..core.daemon_pool import DaemonPool
from ..core.errors import EngineError, OmniError
from .detokenizer import IncrementalDetokenizer
from .options import OmniOptions
from .prompt_tokens import PromptTokens

log = logging.getLogger(__name__)

FRAME_SECONDS = 0.08  # 12.5 Hz codec frames
THREADS = DaemonPool("omni-request")  # the talker and code2wav threads of requests given no pool of their own


_THINKER_INPUTS = {  # processor output -> thinker input, with the wire dtype
    "pixel_values": torch.uint8,
    "image_grid_thw": torch.int64,
    "input_features": torch.float32,
    "feature_attention_mask": torch.int64,
    "pixel_values_videos": torch.uint8,
    "video_grid_thw": torch.int64,
    "video_second_per_grid": torch.float32,
}


def thinker_inputs(prepared: dict) -> dict:
    """prepare_inputs() output (batch of one) -> the thinker's request tensors."""
    inputs = {"input_ids": prepared["input_ids"].reshape(-1).long()}
    for name, dtype in _THINKER_INPUTS.items():
        if prepared.get(name) is not None:
            inputs[name] = prepared[name].to(dtype)
    return inputs


class StageClient(Protocol):
    def thinker(self, session: str, inputs: dict, parameters: dict) -> Iterator[dict]: ...
    def talker(self, session: str, inputs: dict, parameters: dict) -> Iterator[dict]: ...
    def talker_append(self, session: str, rows: torch.Tensor | None, end: bool) -> None: ...
    def abort(self, stage: str, session: str) -> None: ...
    # one chunk of the session's stream, after the previous one's audio came back: its new frames (None: the
    # end, with no frames left); start opens the session, end closes it. Returns the chunk's final samples.
    def code2wav(self, session: str, codes: torch.Tensor | None, start: bool, end: bool) -> torch.Tensor: ...


@dataclass
class OmniOutput:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    audio: torch.Tensor | None = None  # [samples] float32
    usage: dict | None = None

    def merge(self, later: "OmniOutput") -> "OmniOutput":
        audio = [a for a in (self.audio, later.audio) if a is not None]
        return OmniOutput(
            self.text + later.text,
            self.token_ids + later.token_ids,
            torch.cat(audio) if audio else None,
            later.usage or self.usage,
        )


class HopTimer:
    """Count and mean duration of one kind of stage round trip (reported in usage["hops"]); each duration
    also goes to `on_done` (the orchestrator's latency histogram)."""

    def __init__(self, on_done: Callable[[float], None] | None = None):
        self.count, self.seconds, self.on_done = 0, 0.0, on_done

    def __enter__(self):
        self._t0 = time.perf_counter()

    def __exit__(self, *exc):
        seconds = time.perf_counter() - self._t0
        self.count += 1
        self.seconds += seconds
        if self.on_done is not None:
            self.on_done(seconds)

    def summary(self) -> dict:
        return {"count": self.count, "mean_ms": round(self.seconds / self.count * 1e3, 3)}


# emit(output, finish_reason, error): finish_reason or error ends the response stream
Emit = Callable[[OmniOutput | None, "str | None", "OmniError | None"], None]


class OmniRequest:
    def __init__(self, session: str, inputs: dict, options: OmniOptions, stages: StageClient, tokenizer,
                 schedule: ChunkSchedule, emit: Emit, on_hop: Callable[[str, float], None] | None = None,
                 arrival: float | None = None, threads: DaemonPool = THREADS,
                 prompt_tokens: PromptTokens | None = None):  # fmt: skip
        self.session, self.inputs, self.options, self.stages = session, inputs, options, stages
        self.schedule, self.emit = schedule, emit
        self.detok = IncrementalDetokenizer(tokenizer)
        self.cancelled = threading.Event()
        self.error: OmniError | None = None
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of prompt_tokens, those whose K/V the thinker's prefix cache gave
        self.prompt_tokens_of = prompt_tokens  # the checkpoint's placeholder ids: usage per modality
        self.completion_tokens = 0
        self.audio_frames = 0
        self._cond: dict | None = None  # the thinker's talker conditioning (first response)
        self._pending_rows: list[torch.Tensor] = []
        # A tool call is returned as text (the frontend makes it OpenAI tool_calls), never spoken: the
        # utterance ends where the thinker opens one
        self._tool_call_id = tokenizer.convert_tokens_to_ids("<tool_call>")
        self._speech_ended = False
        self.threads = threads
        self._talker_job: Future | None = None  # _run_talker on a thread of `threads`, once the talker started
        self._talker_open = False  # its start is sent (or being sent): an abort goes to the talker too
        self._code2wav_job: Future | None = None
        self._windows: queue.SimpleQueue = queue.SimpleQueue()
        self._frames: list[torch.Tensor] = []  # [16] long each, frames not yet sent to code2wav
        self._frames_sent = 0  # frames before self._frames[0]
        self._code2wav_open = False  # the session's code2wav stream was started
        # handoff round trips, for usage and, through on_hop(name, seconds), for metrics
        self.hops = {name: HopTimer(functools.partial(on_hop, name) if on_hop else None)
                     for name in ("talker_append", "code2wav")}  # fmt: skip
        # when each milestone was first reached, ms after the request arrived (`arrival`, perf_counter; else
        # now) (usage["timeline_ms"]): says where a slow first audio packet spent its time, on any deployment
        self._t0 = time.perf_counter() if arrival is None else arrival
        self.timeline: dict[str, float] = {}
        self._mark("preprocessed")  # the turn (admission) and the messages' preprocessing are behind it

    # ---- public -------------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run_thinker()
            for job in (self._talker_job, self._code2wav_job):
                if job is not None:
                    job.result()
        except OmniError as e:
            self._fail(e)
        except Exception as e:  # unexpected: still end the stream
            log.exception("[omni] request %s failed", self.session)
            self._fail(EngineError(str(e)))
        if self.error is not None:
            self.emit(None, None, self.error)
            return
        usage = {
            **self._prompt_usage(),
            "completion_tokens": self.completion_tokens,
            "audio_frames": self.audio_frames,
            "audio_seconds": round(self.audio_frames * FRAME_SECONDS, 3),
            "hops": {name: hop.summary() for name, hop in self.hops.items() if hop.count},
            "timeline_ms": dict(self.timeline, end=self._ms()),
        }
        reason = "abort" if self.cancelled.is_set() else (self.finish_reason or "stop")
        self.emit(OmniOutput(text=self.detok.flush(), usage=usage), reason, None)

    def _prompt_usage(self) -> dict:
        """The prompt's part of usage, known once the thinker started: its tokens and those the prefix cache
        gave, each also by modality (the cached ones are the prompt's first `cached_tokens`)."""
        usage = {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens}
        if self.prompt_tokens_of is not None:
            ids = self.inputs["input_ids"]
            usage["prompt_by_modality"] = self.prompt_tokens_of.by_modality(ids)
            usage["cached_by_modality"] = self.prompt_tokens_of.by_modality(ids[: self.cached_tokens])
        return usage

    def cancel(self) -> None:
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        self._abort_stages()

    # ---- thinker (caller thread) ------------------------------------------------------------------------
    def _run_thinker(self) -> None:
        parameters = dict(self.options.thinker_parameters, export_talker=self.options.want_audio)
        for out in self.stages.thinker(self.session, self.inputs, parameters):
            # A failure while handling a response (a talker call that failed) does not leave the loop: the
            # stream is read to its end (the failure aborted the thinker, so that is soon), as a Triton 2.51
            # BLS stream must be (the Triton StageClient drains one that is left early, triton/bls.py).
            if self.error is None:
                self._guarded("thinker output", self._on_thinker_output, out)

    def _on_thinker_output(self, out: dict) -> None:
        self._mark("thinker_first_output")
        ids = out["token_ids"].tolist() if "token_ids" in out else []
        self.completion_tokens += len(ids)
        usage = None  # the prompt's usage goes out with the thinker's first output: a client that leaves has it
        if "prompt_tokens" in out:
            self.prompt_tokens = int(out["prompt_tokens"].reshape(-1)[0])
            if "cached_tokens" in out:
                self.cached_tokens = int(out["cached_tokens"].reshape(-1)[0])
            usage = self._prompt_usage()
        if "finish_reason" in out:
            self.finish_reason = out["finish_reason"]
            self._mark("thinker_done")
        text = self.detok.push(ids) if ids else ""
        if text or ids or usage:
            self.emit(OmniOutput(text=text, token_ids=ids, usage=usage), None, None)
        # after the text is out: the talker's start returns with its first frames (a Triton BLS call
        # returns with its first response), so feeding it first would hold the first token back that long
        if self.options.want_audio and not self.cancelled.is_set() and not self._speech_ended:
            self._feed_talker(out, ids)

    def _feed_talker(self, out: dict, ids: list[int]) -> None:
        if "talker_user_ids" in out:
            self._cond = {k: out[k] for k in ("talker_media_rows", "talker_user_is_mm", "talker_user_ids",
                                              "talker_special_rows") if k in out}  # fmt: skip
        rows = out.get("text_rows")  # [n, D]: a row per token of `ids` (a final EOS has none)
        end = "finish_reason" in out
        if self._tool_call_id in ids:
            rows = None if rows is None else rows[: ids.index(self._tool_call_id)]
            end = self._speech_ended = True
        if self._talker_job is None:
            if rows is not None and rows.shape[0]:
                self._pending_rows.append(rows)
            if self._pending_rows:
                self._start_talker(torch.cat(self._pending_rows), end)
        elif (rows is not None and rows.shape[0]) or end:
            with self.hops["talker_append"]:
                self.stages.talker_append(self.session, rows, end)

    def _start_talker(self, rows: torch.Tensor, end: bool) -> None:
        inputs = dict(self._cond, text_rows=rows)
        for name in ("image_grid_thw", "video_grid_thw", "video_second_per_grid"):
            if self.inputs.get(name) is not None:
                inputs[name] = self.inputs[name]
        if self.inputs.get("feature_attention_mask") is not None:
            inputs["audio_feature_lengths"] = self.inputs["feature_attention_mask"].sum(-1).long()
        parameters = dict(self.options.talker_parameters, speaker=self.options.speaker, text_end=end)
        self._talker_open = True
        stream = self.stages.talker(self.session, inputs, parameters)  # returns with the talker's first frames
        self._mark("talker_started")
        # the stream is read to its end whatever happens next: a 2.51 BLS stream left unread is never freed
        self._talker_job = self.threads.submit(self._run_talker, stream)
        self._code2wav_job = self.threads.submit(self._run_code2wav)
        if self.cancelled.is_set() or self.error is not None:
            # cancelled while the start was on its way: that abort may have reached the talker first, this
            # one comes after the start (the talker ignores an abort of a stream it does not hold)
            self._abort("talker")

    # ---- talker thread ----------------------------------------------------------------------------------
    def _run_talker(self, stream: Iterator[dict]) -> None:
        cutter = ChunkCutter(self.schedule)
        try:
            for out in stream:
                codes = out.get("codes")
                if codes is not None and codes.shape[0]:
                    self._mark("talker_first_frames")
                    self._frames.extend(codes.long().cpu().unbind(0))
                    self.audio_frames += codes.shape[0]
                    for window in cutter.push(codes.shape[0]):
                        self._mark("first_chunk_cut")
                        self._windows.put((window, False))
            if not self.cancelled.is_set():
                # the code2wav thread takes (window, whether it is the stream's last); a window of None is the
                # end alone, when the frames ended on a chunk's boundary
                last = cutter.finish()
                for i, window in enumerate(last):
                    self._windows.put((window, i == len(last) - 1))
                if not last and cutter.emitted:
                    self._windows.put((None, True))
        except OmniError as e:
            self._fail(e)
        except Exception as e:
            log.exception("[omni] talker stream of %s failed", self.session)
            self._fail(EngineError(str(e)))
        finally:
            self._windows.put(None)

    # ---- code2wav thread --------------------------------------------------------------------------------
    def _run_code2wav(self) -> None:
        while (item := self._windows.get()) is not None:
            if self.cancelled.is_set() or self.error is not None:
                continue  # drain
            self._guarded("code2wav", self._decode_window, *item)

    def _decode_window(self, window, last: bool) -> None:
        codes = None
        if window is not None:
            first = window.start - self._frames_sent
            codes = torch.stack(self._frames[first : first + window.frames])
            del self._frames[: first + window.frames]
            self._frames_sent = window.end
        start, self._code2wav_open = not self._code2wav_open, True
        with self.hops["code2wav"]:
            audio = self.stages.code2wav(self.session, codes, start, last)
        if (self.cancelled.is_set() or self.error is not None) and not last:
            self.stages.abort("code2wav", self.session)  # ended while this chunk was out: its abort may be older
            return
        if audio.numel():
            self.emit(OmniOutput(audio=audio.float().reshape(-1)), None, None)
            self._mark("first_audio_sent")

    # ---- timeline ---------------------------------------------------------------------------------------
    def _ms(self) -> float:
        return round((time.perf_counter() - self._t0) * 1e3, 1)

    def _mark(self, milestone: str) -> None:
        if milestone not in self.timeline:  # the first time only; set from three threads, one key each
            self.timeline[milestone] = self._ms()

    # ---- failure ----------------------------------------------------------------------------------------
    def _guarded(self, what: str, step: Callable, *args) -> None:
        """Runs one step of a loop; a failure fails the request (and aborts its stages) instead of leaving
        the loop, which goes on reading what it reads to its end."""
        try:
            step(*args)
        except OmniError as e:
            self._fail(e)
        except Exception as e:
            log.exception("[omni] %s of %s failed", what, self.session)
            self._fail(EngineError(str(e)))

    def _fail(self, error: OmniError) -> None:
        if self.error is None and not self.cancelled.is_set():
            self.error = error
            self._abort_stages()

    def _abort_stages(self) -> None:
        opened = {"thinker": True, "talker": self._talker_open, "code2wav": self._code2wav_open}
        for stage, started in opened.items():
            if started:
                self._abort(stage)

    def _abort(self, stage: str) -> None:
        try:
            self.stages.abort(stage, self.session)
        except Exception as e:  # the stage may already be done with it; anything else is worth seeing
            log.warning("abort of %s/%s failed: %s", stage, self.session, e)
