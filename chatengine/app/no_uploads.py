"""Gradio's file-upload routes accept files from any signed-in user into a shared temp directory.
The app has no upload component, so those routes answer 404 before Gradio sees the request."""

UPLOAD_PATHS = ("/gradio_api/upload", "/gradio_api/upload_progress", "/upload", "/upload_progress")


class NoUploadsMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].rstrip("/") in UPLOAD_PATHS:
            await send(
                {"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": b'{"detail": "this server takes no file uploads"}'})
            return
        await self.app(scope, receive, send)
