"""The product around the engine: server, API, UI, chats, store, auth. Uses only chatengine's public API."""
