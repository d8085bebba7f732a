# The OpenAI Realtime API (GA event protocol) over a WebSocket at /v1/realtime: events and session state,
# audio in and out, voice activity detection, and the connection that runs one session.
