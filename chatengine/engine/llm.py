"""LLM: the synchronous facade; generate / chat block until every request has finished."""

from chatengine.engine.facade import EngineFacade
from chatengine.engine.request import Request
from chatengine.outputs import RequestOutput


def _normalize_prompts(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if (
        isinstance(prompts, (list, tuple))
        and prompts
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
    ):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise ValueError(f"prompts must be a string, a list of strings or token-id lists, got {type(prompts).__name__}")


class LLM(EngineFacade):
    """Synchronous facade: generate / chat block until every request has finished."""

    def generate(self, prompts, sampling_params=None, *, user: str | None = None) -> list[RequestOutput]:
        prompts = _normalize_prompts(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # validate everything before adding anything: a bad prompt leaves nothing half-done
        reqs = [self.engine.make_request(p, sp, user=user) for p, sp in zip(prompts, params)]
        return self._run(reqs)

    def chat(self, messages, sampling_params=None, *, user: str | None = None) -> list[RequestOutput]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or of such lists)")
        conversations = [messages] if not isinstance(messages[0], list) else messages
        tok = self.engine.tokenizer
        ids = [self.apply_chat_template(conv) for conv in conversations]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids)
        reqs = [self.engine.make_request(p, sp, user=user) for p, sp in zip(ids, params)]
        for req in reqs:
            req.prompt = tok.decode(req.prompt_token_ids)  # type: ignore[attr-defined]
        return self._run(reqs)

    def _run(self, reqs: list[Request]) -> list[RequestOutput]:
        engine = self.engine
        for req in reqs:
            req.stream = False  # only final outputs are kept: the engine builds no others
            engine.add(req)
        final = {}
        try:
            while any(req.request_id not in final for req in reqs):
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:  # e.g. KeyboardInterrupt: free every block we hold
            for req in reqs:
                engine.abort(req.request_id)
            raise
        return [final[req.request_id] for req in reqs]

    def forget_user(self, user: str) -> int:
        return self.engine.forget_user(user)

    def forget_prompts(self, user: str, prompts: list[list[int]]) -> int:
        """Drop the user's private KV pages of these token sequences from every tier (see LLMEngine)."""
        return self.engine.forget_prompts(user, prompts)

    def shutdown(self) -> None:
        """Abort what runs and flush the KV cache to the disk store (if any)."""
        self.engine.close()
