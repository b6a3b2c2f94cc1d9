"""The serving engine: requests in, tokens out. Knows nothing of users' chats, HTTP or Gradio."""
