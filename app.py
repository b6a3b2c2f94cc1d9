"""Serve the chat UI (and the OpenAI-compatible API) from one process: python app.py --help"""

from chatengine.app.server import main

if __name__ == "__main__":
    main()
