// The demo chat: builds OpenAI chat requests from the composer, streams the reply's text into the log
// and its audio into the speaker, and measures each reply (time to first text / audio, RTF).
import { listModels, streamChat } from "./api.js";
import { OUTPUT_RATE, PcmPlayer, Recorder, toWav16k } from "./audio.js";

const $ = (id) => document.getElementById(id);

// Everything a test (or a curious user in the console) may want to read; mirrored on #state as data-*.
const state = (window.demoState = {
  status: "idle", // idle | recording | sending | streaming | done | stopped | error
  error: null,
  model: null,
  replies: 0, // replies finished
  lastRequest: null, // {modalities, voice, parts, inputAudioSeconds}
  // the current (or last) reply
  textReceived: "",
  audioChunks: 0,
  audioSamples: 0,
  audioSeconds: 0,
  playbackStarted: false, // first chunk scheduled on a running AudioContext
  scheduledSeconds: 0, // first chunk's start to last chunk's end on the AudioContext clock
  playbackGaps: 0, // chunks that arrived after the previous one had finished playing
  chunksPlayed: 0, // chunks whose playback ended on the AudioContext clock
  playedSeconds: 0,
  ttftMs: null,
  ttfaMs: null,
  rtf: null, // seconds from send to the last audio chunk / seconds of audio
  finishReason: null,
  usage: null,
});

const player = new PcmPlayer(() => publish());
const recorder = new Recorder();
const history = []; // the conversation so far, as OpenAI messages
const attachments = { image: null, audio: null, video: null }; // {url, name} / {base64, seconds, name} / {url, name, sound}
// use_audio_in_video of the conversation: the latest video sent says whether its sound is part of the prompt.
// The flag covers every video of a request, so an earlier video is read the same way as the latest.
let videoSound = false;
let abort = null; // AbortController of the reply in flight
let bubble = null; // elements of the reply being written

// ---- settings (kept across reloads; the key only for this tab) --------------------------------------------
const SETTINGS = { voice: localStorage, modality: localStorage, "max-tokens": localStorage, "speech-frames": localStorage, "api-key": sessionStorage };
for (const [id, store] of Object.entries(SETTINGS)) {
  const saved = store.getItem(`omnistage.${id}`);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => store.setItem(`omnistage.${id}`, $(id).value));
}
const apiKey = () => $("api-key").value.trim();
const positiveInt = (id) => (Number.parseInt($(id).value, 10) > 0 ? Number.parseInt($(id).value, 10) : undefined);

// ---- state -> DOM -------------------------------------------------------------------------------------------
function publish(message) {
  state.playbackStarted ||= player.running && player.scheduled > 0;
  state.scheduledSeconds = player.scheduledSeconds;
  state.playbackGaps = player.gaps;
  state.chunksPlayed = player.played;
  state.playedSeconds = player.playedSeconds;
  const data = $("state").dataset;
  for (const key of ["status", "error", "model", "replies", "textReceived", "audioChunks", "playbackStarted", "chunksPlayed", "ttfaMs", "rtf"]) {
    data[key] = state[key] ?? "";
  }
  if (message !== undefined) {
    $("status").textContent = message;
    $("status").classList.toggle("error", state.status === "error");
  }
  if (bubble) bubble.metrics.textContent = metricsLine();
  const busy = ["sending", "streaming"].includes(state.status);
  const focused = document.activeElement;
  $("send").hidden = busy;
  $("send").disabled = state.status === "recording"; // the clip is sent by the mic button
  $("stop").hidden = !busy;
  $("mic").disabled = busy;
  $("mic").classList.toggle("recording", state.status === "recording");
  $("mic").textContent = state.status === "recording" ? "Stop & send" : "Mic";
  // Send and Stop take turns in one place; a focused button that hides would drop the keyboard's focus
  // to the start of the page
  if (busy && focused === $("send")) $("stop").focus();
  if (!busy && focused === $("stop")) $("prompt").focus();
}

function metricsLine() {
  const parts = [];
  if (state.ttftMs !== null) parts.push(`first text ${Math.round(state.ttftMs)} ms`);
  if (state.ttfaMs !== null) parts.push(`first audio ${Math.round(state.ttfaMs)} ms`);
  if (state.rtf !== null) parts.push(`RTF ${state.rtf.toFixed(2)}`);
  if (state.audioSeconds) parts.push(`${state.audioSeconds.toFixed(2)} s audio in ${state.audioChunks} chunks, played ${state.playedSeconds.toFixed(1)} s`);
  if (state.playbackGaps) parts.push(`${state.playbackGaps} playback gap${state.playbackGaps > 1 ? "s" : ""}`);
  if (state.usage) parts.push(`${state.usage.prompt_tokens} prompt + ${state.usage.completion_tokens} reply tokens`);
  if (state.finishReason) parts.push(`finish: ${state.finishReason}`);
  return parts.join(" · ");
}

export function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = `message ${role}`;
  const textEl = document.createElement("div");
  textEl.className = "text";
  textEl.textContent = text;
  el.append(textEl);
  $("log").append(el);
  el.scrollIntoView({ block: "end" });
  return { el, text: textEl };
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  for (const kind of ["image", "audio", "video"]) {
    const item = attachments[kind];
    if (!item) continue;
    const chip = document.createElement("span");
    chip.className = "chip";
    chip.dataset.kind = kind;
    chip.textContent = kind === "audio" ? `${item.name} (${item.seconds.toFixed(1)} s)` : item.name;
    if (kind === "video") chip.append(soundToggle(item));
    const remove = document.createElement("button");
    remove.textContent = "×";
    remove.title = "remove";
    remove.setAttribute("aria-label", `remove ${item.name}`);
    remove.onclick = () => {
      attachments[kind] = null;
      renderAttachments();
    };
    chip.append(remove);
    box.append(chip);
  }
}

function soundToggle(item) {
  const label = Object.assign(document.createElement("label"), { className: "sound", title: "send the clip's sound too (use_audio_in_video)" });
  const box = Object.assign(document.createElement("input"), { type: "checkbox", checked: item.sound });
  box.setAttribute("aria-label", `${item.name}: with its sound`);
  box.onchange = () => (item.sound = box.checked);
  label.append(box, " sound");
  return label;
}

// ---- one turn -----------------------------------------------------------------------------------------------
function userContent(text) {
  if (!attachments.image && !attachments.audio && !attachments.video) return text;
  const parts = [];
  if (attachments.video) parts.push({ type: "video_url", video_url: { url: attachments.video.url } });
  if (attachments.image) parts.push({ type: "image_url", image_url: { url: attachments.image.url } });
  if (attachments.audio) parts.push({ type: "input_audio", input_audio: { data: attachments.audio.base64, format: "wav" } });
  if (text) parts.push({ type: "text", text });
  return parts;
}

function requestBody(userMessage) {
  const modalities = $("modality").value.split(",");
  const body = { messages: [...history, userMessage], modalities, stream_options: { include_usage: true } };
  body.response_style = "openai"; // this server's switch: whatever its default, chunks carry delta.audio as OpenAI's do
  if (state.model) body.model = state.model;
  if (videoSound) body.use_audio_in_video = true;
  if (modalities.includes("audio")) body.audio = { voice: $("voice").value, format: "pcm" }; // pcm: raw chunks to play as they come
  if (positiveInt("max-tokens")) body.max_tokens = positiveInt("max-tokens");
  if (positiveInt("speech-frames")) body.sampling_params_list = [{}, { max_tokens: positiveInt("speech-frames") }];
  return body;
}

function showUserMessage(text) {
  const { el } = addMessage("user", text);
  if (attachments.video) el.prepend(Object.assign(document.createElement("video"), { controls: true, src: attachments.video.url }));
  if (attachments.image) el.prepend(Object.assign(document.createElement("img"), { src: attachments.image.url, alt: attachments.image.name }));
  if (attachments.audio) el.prepend(Object.assign(document.createElement("audio"), { controls: true, src: `data:audio/wav;base64,${attachments.audio.base64}` }));
}

function resetReply() {
  Object.assign(state, { error: null, textReceived: "", audioChunks: 0, audioSamples: 0, audioSeconds: 0, playbackStarted: false, scheduledSeconds: 0, ttftMs: null, ttfaMs: null, rtf: null, finishReason: null, usage: null });
  player.reset();
}

async function send() {
  if (abort) return;
  const text = $("prompt").value.trim();
  if (!text && !attachments.image && !attachments.audio && !attachments.video) return;
  player.unlock(); // we are inside the click / key handler: the one moment audio may be enabled
  if (attachments.video) videoSound = attachments.video.sound;
  const userMessage = { role: "user", content: userContent(text) };
  const body = requestBody(userMessage);
  state.lastRequest = {
    modalities: body.modalities,
    voice: body.audio?.voice ?? null,
    parts: typeof userMessage.content === "string" ? ["text"] : userMessage.content.map((p) => p.type),
    inputAudioSeconds: attachments.audio?.seconds ?? null,
  };
  showUserMessage(text);
  resetReply();
  bubble = addMessage("assistant", "");
  bubble.metrics = Object.assign(document.createElement("div"), { className: "metrics" });
  bubble.el.append(bubble.metrics);
  const sent = { text, ...attachments }; // given back to the composer if the send fails, for a retry
  $("prompt").value = "";
  attachments.image = attachments.audio = attachments.video = null;
  renderAttachments();

  abort = new AbortController();
  const t0 = performance.now();
  let lastAudioAt = t0;
  state.status = "sending";
  publish("waiting for the first token…");
  try {
    for await (const chunk of streamChat(body, { apiKey: apiKey(), signal: abort.signal })) {
      if (chunk.usage) state.usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const delta = choice.delta ?? {};
      const text = (delta.content ?? "") + (delta.audio?.transcript ?? "");
      if (text) {
        state.ttftMs ??= performance.now() - t0;
        state.textReceived += text;
        bubble.text.textContent = state.textReceived;
      }
      if (delta.audio?.data) {
        state.ttfaMs ??= performance.now() - t0;
        state.audioSamples += player.push(delta.audio.data);
        state.audioChunks += 1;
        state.audioSeconds = state.audioSamples / OUTPUT_RATE;
        lastAudioAt = performance.now();
      }
      state.finishReason = choice.finish_reason ?? state.finishReason;
      state.status = "streaming";
      publish("streaming…");
    }
    if (state.audioSeconds) state.rtf = (lastAudioAt - t0) / 1000 / state.audioSeconds;
    history.push(userMessage, { role: "assistant", content: state.textReceived });
    state.replies += 1;
    state.status = "done";
    publish("");
  } catch (err) {
    const stopped = abort.signal.aborted;
    state.status = stopped ? "stopped" : "error";
    state.error = stopped ? null : err.message;
    if (!stopped) {
      bubble.el.classList.add("error");
      bubble.text.textContent = state.textReceived ? `${state.textReceived}\n[${err.message}]` : err.message;
      // the failed message goes back into the composer, unless something new was typed or attached meanwhile
      if (!$("prompt").value) $("prompt").value = sent.text;
      for (const kind of ["image", "audio", "video"]) attachments[kind] ??= sent[kind];
      renderAttachments();
    }
    publish(stopped ? "stopped" : err.message);
  } finally {
    abort = null;
    publish();
  }
}

// ---- inputs ---------------------------------------------------------------------------------------------------
async function toggleMic() {
  player.unlock();
  try {
    if (!recorder.recording) {
      await recorder.start();
      state.status = "recording";
      publish("recording… click “Stop & send” when done");
      return;
    }
    attachments.audio = { ...(await recorder.stop()), name: "microphone" };
    state.status = "idle";
    publish("");
    await send();
  } catch (err) {
    state.status = "error";
    state.error = `microphone: ${err.message}`;
    publish(state.error);
  }
}

async function attach(kind, file) {
  if (!file) return;
  try {
    if (kind === "image" || kind === "video") {
      const url = await new Promise((resolve, reject) => {
        const reader = new FileReader();
        reader.onload = () => resolve(reader.result);
        reader.onerror = () => reject(reader.error);
        reader.readAsDataURL(file);
      });
      attachments[kind] = kind === "video" ? { url, name: file.name, sound: true } : { url, name: file.name };
    } else {
      attachments.audio = { ...(await toWav16k(await file.arrayBuffer())), name: file.name };
    }
    renderAttachments();
  } catch (err) {
    state.status = "error";
    state.error = `${file.name}: cannot read this ${kind} (${err.message})`;
    publish(state.error);
  }
}

async function loadModel() {
  try {
    state.model = (await listModels(apiKey()))[0] ?? null;
    $("model").textContent = state.model ?? "(no model)";
    if (state.status === "error") state.status = "idle";
    publish(state.status === "idle" ? "" : undefined);
  } catch (err) {
    $("model").textContent = "";
    state.status = "error";
    state.error = `models: ${err.message}`;
    publish(err.message.startsWith("401") ? `${err.message} — enter the API key above` : state.error);
  }
}

$("send").addEventListener("click", send);
function stopReply() {
  abort?.abort();
  player.reset();
}
$("stop").addEventListener("click", stopReply);
// Escape stops a reply from wherever the focus is, as the Stop button does (an open file chooser or an
// input method that composes takes its own Escape first)
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && !e.isComposing && abort) stopReply();
});
$("mic").addEventListener("click", toggleMic);
$("prompt").addEventListener("keydown", (e) => {
  // isComposing: an input method (Chinese, Japanese, ...) takes Enter to pick its candidate
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
$("image-input").addEventListener("change", (e) => attach("image", e.target.files[0]).then(() => (e.target.value = "")));
$("video-input").addEventListener("change", (e) => attach("video", e.target.files[0]).then(() => (e.target.value = "")));
$("audio-input").addEventListener("change", (e) => attach("audio", e.target.files[0]).then(() => (e.target.value = "")));
$("api-key").addEventListener("change", loadModel);
$("new-chat").addEventListener("click", () => {
  // a reply still streaming belongs to the old chat: left running it would keep speaking and then add
  // its turn to the new chat's (empty) history
  abort?.abort();
  player.reset();
  history.length = 0;
  videoSound = false;
  $("log").replaceChildren();
  bubble = null;
});
setInterval(() => bubble && player.scheduled && publish(), 250); // playback progress
loadModel();
