"""The Gradio chat UI."""
