// Browser audio for the demo page: input (microphone or file -> 16 kHz mono WAV, base64) and output
// (streamed s16le 24 kHz PCM chunks played back to back with the Web Audio API).

export const OUTPUT_RATE = 24000; // what the server streams: s16le, 24 kHz, mono
const INPUT_RATE = 16000; // what the model's audio encoder takes; sending more only costs upload
const LEAD_S = 0.05; // first chunk starts this far ahead so that its start is never in the past

// ---- base64 ---------------------------------------------------------------------------------------------
export function base64ToBytes(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

export function bytesToBase64(bytes) {
  let bin = "";
  const step = 0x8000; // String.fromCharCode takes its bytes as arguments: chunk to stay under the stack limit
  for (let i = 0; i < bytes.length; i += step) bin += String.fromCharCode(...bytes.subarray(i, i + step));
  return btoa(bin);
}

// ---- input: anything the browser can decode -> 16 kHz mono s16le WAV ------------------------------------
export function encodeWav(samples, rate) {
  const view = new DataView(new ArrayBuffer(44 + samples.length * 2));
  const ascii = (at, s) => [...s].forEach((c, i) => view.setUint8(at + i, c.charCodeAt(0)));
  ascii(0, "RIFF");
  view.setUint32(4, 36 + samples.length * 2, true);
  ascii(8, "WAVEfmt ");
  view.setUint32(16, 16, true); // fmt chunk size
  view.setUint16(20, 1, true); // PCM
  view.setUint16(22, 1, true); // mono
  view.setUint32(24, rate, true);
  view.setUint32(28, rate * 2, true); // byte rate
  view.setUint16(32, 2, true); // block align
  view.setUint16(34, 16, true); // bits per sample
  ascii(36, "data");
  view.setUint32(40, samples.length * 2, true);
  samples.forEach((x, i) => view.setInt16(44 + i * 2, Math.round(Math.max(-1, Math.min(1, x)) * 32767), true));
  return new Uint8Array(view.buffer);
}

// decodeAudioData resamples to its context's rate, so an offline context at 16 kHz does the resampling;
// the channels are then averaged into mono.
export async function toWav16k(encoded) {
  const decoded = await new OfflineAudioContext(1, 1, INPUT_RATE).decodeAudioData(encoded);
  const mono = new Float32Array(decoded.length);
  for (let c = 0; c < decoded.numberOfChannels; c++) {
    decoded.getChannelData(c).forEach((x, i) => (mono[i] += x / decoded.numberOfChannels));
  }
  return { base64: bytesToBase64(encodeWav(mono, INPUT_RATE)), seconds: mono.length / INPUT_RATE };
}

// MediaRecorder gives a compressed clip (webm/opus in Chromium); the server wants WAV, so the clip is
// decoded and re-encoded by toWav16k when the recording stops.
export class Recorder {
  async start() {
    this.stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1 } });
    this.parts = [];
    this.recorder = new MediaRecorder(this.stream);
    this.recorder.ondataavailable = (e) => e.data.size && this.parts.push(e.data);
    this.recorder.start();
  }

  get recording() {
    return this.recorder?.state === "recording";
  }

  async stop() {
    const stopped = new Promise((resolve) => (this.recorder.onstop = resolve));
    this.recorder.stop();
    await stopped;
    this.stream.getTracks().forEach((t) => t.stop());
    const blob = new Blob(this.parts, { type: this.recorder.mimeType });
    return toWav16k(await blob.arrayBuffer());
  }
}

// ---- output: streamed PCM chunks, played back to back -----------------------------------------------------
// Each chunk becomes an AudioBufferSourceNode started exactly where the previous one ends on the
// AudioContext clock, so playback begins with the first chunk and has no gaps while chunks arrive faster
// than real time. A chunk that arrives late starts "now" (an audible gap, never an overlap).
//
// Whether sound was really heard cannot be observed from a page (headless Chromium may have no output
// device at all), so the player reports what it can: `scheduled` (sources started on a running context)
// and `played` (sources whose `ended` fired, i.e. the context clock ran past them). Chromium renders to a
// fake sink when there is no device, so its clock still advances and `played` still counts up.
export class PcmPlayer {
  constructor(onChange = () => {}) {
    this.onChange = onChange;
    this.ctx = null;
    this.reset();
  }

  // Call from a user gesture (click, key): browsers keep an AudioContext suspended until one.
  unlock() {
    this.ctx ??= new AudioContext();
    if (this.ctx.state === "suspended") this.ctx.resume();
  }

  reset() {
    for (const source of this.sources ?? []) {
      source.onended = null; // a stopped chunk must not count as played in the next reply
      source.stop();
    }
    this.sources = [];
    this.nextStart = 0;
    this.firstStart = null;
    this.scheduled = 0;
    this.played = 0; // chunks, and their seconds, that the context clock has run through
    this.playedSeconds = 0;
    this.gaps = 0;
  }

  push(base64Pcm) {
    const bytes = base64ToBytes(base64Pcm);
    const view = new DataView(bytes.buffer);
    const n = bytes.length >> 1;
    if (!n) return 0;
    this.unlock();
    const buffer = this.ctx.createBuffer(1, n, OUTPUT_RATE); // the context resamples to its own rate
    const channel = buffer.getChannelData(0);
    for (let i = 0; i < n; i++) channel[i] = view.getInt16(2 * i, true) / 32768;
    const source = this.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.ctx.destination);
    const at = Math.max(this.nextStart, this.ctx.currentTime + LEAD_S);
    if (this.firstStart !== null && at > this.nextStart) this.gaps += 1; // the previous chunk had run out
    source.onended = () => {
      this.played += 1;
      this.playedSeconds += buffer.duration;
      this.onChange();
    };
    source.start(at);
    this.firstStart ??= at;
    this.nextStart = at + buffer.duration;
    this.sources.push(source);
    this.scheduled += 1;
    return n;
  }

  get running() {
    return this.ctx?.state === "running";
  }

  // span from the first chunk's start to the last one's end: the audio's length when they are back to back
  get scheduledSeconds() {
    return this.firstStart === null ? 0 : this.nextStart - this.firstStart;
  }
}
