// Talk mode: a spoken conversation over the OpenAI Realtime API (/v1/realtime, WebSocket). The microphone
// streams as 24 kHz pcm16 while the server's voice activity detection decides the turns; each answer plays
// as it arrives, and when the user starts speaking over it the playback stops at once and the server is
// told how much was heard (conversation.item.truncate), so the next turn's prompt holds only that.
import { PcmPlayer, bytesToBase64 } from "./audio.js";
import { addMessage } from "./demo.js";

const RATE = 24000; // audio/pcm in both directions
const SEND_MS = 100; // microphone audio per append event
const $ = (id) => document.getElementById(id);

// Everything a test may read (also mirrored on #state as data-talk-*).
const talk = (window.talkState = {
  status: "off", // off | connecting | listening | answering | error
  error: null,
  speechStarted: 0,
  speechStopped: 0,
  responses: 0, // response.done events
  cancelled: 0, // of which cancelled (barge-in)
  audioChunks: 0,
  truncations: [], // {item_id, audio_end_ms} sent after a barge-in
  transcript: "", // the last answer's
  appended: 0, // append events sent
});

// The AudioWorklet that hands microphone samples to the page; the context runs at 24 kHz, so the
// browser resamples the microphone.
const CAPTURE = `registerProcessor("capture", class extends AudioWorkletProcessor {
  process(inputs) { if (inputs[0][0]) this.port.postMessage(inputs[0][0].slice(0)); return true; }
});`;

class TalkSession {
  constructor() {
    this.player = new PcmPlayer();
    this.pending = [];
    this.pendingSamples = 0;
    this.playing = null; // {itemId} of the answer on the speaker
    this.bubble = null; // {el, text} of the answer being written
    this.opened = false;
    this.ended = false; // by stop(): every later event of this session is ignored
    this.lastError = null; // the latest error event's message: a server close comes right after it
  }

  async start() {
    talk.status = "connecting";
    talk.error = null;
    publish();
    this.player.unlock(); // inside the click: the one moment audio output may be enabled
    const key = $("api-key").value.trim();
    const protocols = ["realtime", ...(key ? [`openai-insecure-api-key.${key}`] : [])];
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const model = window.demoState?.model;
    this.ws = new WebSocket(`${scheme}://${location.host}/v1/realtime${model ? `?model=${encodeURIComponent(model)}` : ""}`, protocols);
    this.ws.onmessage = (e) => !this.ended && this.onEvent(JSON.parse(e.data));
    // A close the user did not ask for (End talk sets `ended` first): the server refused the session, hit
    // one of its limits, or went away. A browser learns no HTTP status for a refused WebSocket (a wrong
    // API key, a server that is down), so the message names the likely causes. The socket's own `error`
    // event carries no detail and is always followed by this close, so it has no handler.
    this.ws.onclose = (e) => {
      const detail = ` (WebSocket code ${e.code}${e.reason ? `: ${e.reason}` : ""})`;
      if (this.lastError) this.stop(this.lastError);
      else if (this.opened) this.stop(`the server closed the conversation${detail}`);
      else this.stop(`cannot open /v1/realtime: the server is down or refused the API key${detail}`);
    };
    await new Promise((resolve, reject) => {
      this.ws.addEventListener("open", resolve, { once: true });
      this.ws.addEventListener("close", () => reject(new Error("connection closed")), { once: true });
    });
    this.opened = true;
    this.send({ type: "session.update", session: sessionConfig() });
    // each await below may see the session end (a refusal arrives right after the socket opens): what
    // was acquired by then is released, and the session must not go on to "listening"
    this.stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
    if (this.ended) return this.release();
    this.ctx = new AudioContext({ sampleRate: RATE });
    await this.ctx.audioWorklet.addModule(URL.createObjectURL(new Blob([CAPTURE], { type: "text/javascript" })));
    if (this.ended) return this.release();
    const capture = new AudioWorkletNode(this.ctx, "capture");
    capture.port.onmessage = (e) => this.onSamples(e.data);
    this.ctx.createMediaStreamSource(this.stream).connect(capture);
    talk.status = "listening";
    publish();
  }

  send(event) {
    if (this.ws?.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(event));
  }

  onSamples(samples) {
    this.pending.push(samples);
    this.pendingSamples += samples.length;
    if (this.pendingSamples < (RATE * SEND_MS) / 1000) return;
    const pcm = new Int16Array(this.pendingSamples);
    let at = 0;
    for (const chunk of this.pending) {
      for (let i = 0; i < chunk.length; i++) pcm[at++] = Math.round(Math.max(-1, Math.min(1, chunk[i])) * 32767);
    }
    this.pending = [];
    this.pendingSamples = 0;
    this.send({ type: "input_audio_buffer.append", audio: bytesToBase64(new Uint8Array(pcm.buffer)) });
    talk.appended += 1;
  }

  // how much of the answer on the speaker has been played, in ms of its audio
  heardMs() {
    const p = this.player;
    if (p.firstStart === null || !p.ctx) return 0;
    return Math.max(0, Math.round(1000 * Math.min(p.scheduledSeconds, p.ctx.currentTime - p.firstStart)));
  }

  // an answer still on the speaker (or still arriving): speech now interrupts it
  stillPlaying() {
    const p = this.player;
    return talk.status === "answering" || (p.firstStart !== null && p.ctx && p.ctx.currentTime < p.nextStart);
  }

  onEvent(event) {
    switch (event.type) {
      case "input_audio_buffer.speech_started":
        talk.speechStarted += 1;
        if (this.playing && this.stillPlaying()) this.bargeIn();
        break;
      case "input_audio_buffer.speech_stopped":
        talk.speechStopped += 1;
        addMessage("user", "🎤 (spoken)");
        break;
      case "response.created":
        talk.status = "answering";
        talk.transcript = "";
        talk.error = this.lastError = null; // an earlier failure is over: the session answers again
        this.player.reset();
        this.bubble = addMessage("assistant", "");
        break;
      case "response.output_item.added":
        this.playing = { itemId: event.item.id };
        break;
      case "response.output_audio_transcript.delta":
      case "response.output_text.delta":
        talk.transcript += event.delta;
        if (this.bubble) this.bubble.text.textContent = talk.transcript;
        break;
      case "response.output_audio.delta":
        this.player.push(event.delta);
        talk.audioChunks += 1;
        break;
      case "response.done":
        talk.responses += 1;
        if (event.response.status === "cancelled") talk.cancelled += 1;
        // a failed answer (the backend is down or refused the turn) says why in the response itself
        if (event.response.status === "failed") {
          talk.error = event.response.status_details?.error?.message ?? "the answer failed";
          if (this.bubble) {
            this.bubble.el.classList.add("error");
            this.bubble.text.textContent = talk.transcript ? `${talk.transcript}\n[${talk.error}]` : talk.error;
          }
        }
        talk.status = "listening";
        break;
      case "error":
        talk.error = this.lastError = event.error.message;
        addMessage("assistant error", event.error.message);
        break;
    }
    publish();
  }

  // The user speaks over the answer: silence it now and tell the server what was heard.
  bargeIn() {
    const heard = this.heardMs();
    this.player.reset();
    const truncation = { item_id: this.playing.itemId, audio_end_ms: heard };
    this.send({ type: "conversation.item.truncate", content_index: 0, ...truncation });
    talk.truncations.push(truncation);
    this.playing = null;
  }

  release() {
    this.stream?.getTracks().forEach((t) => t.stop());
    if (this.ctx?.state !== "closed") this.ctx?.close();
  }

  stop(error = null) {
    if (this.ended) return;
    this.ended = true;
    this.release();
    this.player.reset();
    if (this.ws && this.ws.readyState <= WebSocket.OPEN) this.ws.close();
    talk.status = error ? "error" : "off";
    talk.error = error;
    publish();
  }
}

function sessionConfig() {
  const positive = (id) => (Number.parseInt($(id).value, 10) > 0 ? Number.parseInt($(id).value, 10) : undefined);
  const spoken = $("modality").value.includes("audio");
  const config = { type: "realtime", output_modalities: [spoken ? "audio" : "text"], audio: { output: { voice: $("voice").value } } };
  const thinker = positive("max-tokens") ? { max_tokens: positive("max-tokens") } : null;
  const talker = positive("speech-frames") ? { max_tokens: positive("speech-frames") } : null;
  if (thinker || talker) config.sampling_params_list = [thinker, talker];
  return config;
}

let shown = null; // the status line's text as Talk last set it

function publish() {
  const data = $("state").dataset;
  for (const key of ["status", "error", "speechStarted", "responses", "cancelled", "audioChunks"]) {
    data[`talk${key[0].toUpperCase()}${key.slice(1)}`] = talk[key] ?? "";
  }
  const on = !["off", "error"].includes(talk.status);
  $("talk").textContent = on ? "End talk" : "Talk";
  $("talk").classList.toggle("recording", on);
  let line = "";
  if (talk.error) line = `talk: ${talk.error}`;
  else if (on) line = { connecting: "connecting…", answering: "answering… (speak to interrupt)" }[talk.status] ?? "listening…";
  else if ($("status").textContent !== shown) return; // ended: a chat message there since is left alone
  $("status").textContent = shown = line;
  $("status").classList.toggle("error", Boolean(talk.error));
}

let session = null;
$("talk").addEventListener("click", async () => {
  if (session && !session.ended) {
    session.stop();
    return;
  }
  session = new TalkSession();
  try {
    await session.start();
  } catch (err) {
    session.stop(err.message);
  }
});
