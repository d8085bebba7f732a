// The page's only contact with the server: the public OpenAI-compatible endpoints, called as any client
// would (Bearer key, JSON body, server-sent events). Nothing here is specific to this server.

function headers(apiKey) {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

// An HTTP error as "401: <OpenAI error message>".
async function httpError(response) {
  let message = response.statusText;
  try {
    message = (await response.json()).error?.message ?? message;
  } catch {
    // not JSON: keep the status text
  }
  return new Error(`${response.status}: ${message}`);
}

// fetch, with its bare "Failed to fetch" (server down, connection refused, no network) put in words
async function request(url, init) {
  try {
    return await fetch(url, init);
  } catch (err) {
    if (init.signal?.aborted) throw err; // the user's Stop, not a failure
    throw new Error(`cannot reach the server at ${location.host}: is it running? (${err.message})`);
  }
}

export async function listModels(apiKey) {
  const response = await request("/v1/models", { headers: headers(apiKey) });
  if (!response.ok) throw await httpError(response);
  return (await response.json()).data.map((m) => m.id);
}

// POST /v1/chat/completions with stream=true; yields each chat.completion.chunk object until [DONE].
// An error event inside the stream (`{"error": ...}`) is thrown like an HTTP error, and so is a stream
// that breaks off or ends without [DONE] (the server died or a proxy cut it): the reply is incomplete.
export async function* streamChat(body, { apiKey, signal }) {
  const response = await request("/v1/chat/completions", {
    method: "POST",
    headers: headers(apiKey),
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  if (!response.ok) throw await httpError(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    let value, done;
    try {
      ({ value, done } = await reader.read());
    } catch (err) {
      if (signal?.aborted) throw err;
      throw new Error(`the connection to the server broke off mid-reply (${err.message})`);
    }
    if (done) throw new Error("the reply stopped before its end: the server closed the stream without [DONE]");
    pending += value;
    const events = pending.split(/\r?\n\r?\n/);
    pending = events.pop(); // an incomplete event waits for the next read
    for (const event of events) {
      const data = event
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message ?? JSON.stringify(chunk.error));
      signal?.throwIfAborted(); // events already read belong to a reply the user cancelled
      yield chunk;
    }
  }
}
