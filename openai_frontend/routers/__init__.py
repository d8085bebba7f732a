# Thin HTTP routers, one per OpenAI resource; each reads `app.state.client` / `app.state.settings`.
