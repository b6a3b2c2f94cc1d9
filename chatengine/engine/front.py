"""EngineFront: what admits a request without running it.

The model's limits and tokenizer, validation and tokenizing of requests, the compiled grammars of
structured outputs and the registered public personas. It holds no tensors and no engine state, so
it is safe from any thread, and it works without the weights: a data-parallel engine's API process
admits requests with one while its replicas (other processes) run them.
"""

import dataclasses
import threading
import uuid

from chatengine.config import EngineConfig
from chatengine.engine.loader import ModelConfig
from chatengine.engine.request import Request
from chatengine.engine.tokenizer import apply_chat_template, encode
from chatengine.sampling_params import SamplingParams


class EngineFront:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_id: str,
        tokenizer,
        max_model_len: int,
        num_blocks: int,
    ):
        self.config, self.model_config, self.model_id = config, model_config, model_id
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.num_blocks = num_blocks  # KV pages of the device pool (the least of every replica's)
        self.eos_token_ids = set(model_config.eos_token_ids)
        self.personas: dict[str, list[int]] = {}  # name -> token ids of its public prefix
        self._personas_lock = threading.Lock()  # app threads register and unregister at once
        self._grammars = None  # chatengine.engine.structured.Grammars, made on the first grammar
        self._grammars_lock = threading.Lock()

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    # ---- requests -------------------------------------------------------------------------------
    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        user: str | None = None,
    ) -> Request:
        """Validate and tokenize (ValueError with what to change); touches no engine state."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate(
            self.config.max_n, self.config.max_tokens_limit or self.max_model_len, self.model_config.vocab_size
        )
        if 0 < params.temperature < 1e-5:  # logits / T would overflow (a denormal T is 0 in fp32): greedy, as vLLM
            params = dataclasses.replace(params, temperature=0.0)
        if params.top_p < 1e-6:  # in fp32 a tinier one rounds to 0, dropping every token; a nucleus of
            # 1e-6 holds the top token alone already (its probability is at least 1 / vocab)
            params = dataclasses.replace(params, top_p=1e-6)
        text, ids = self._prompt_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the context (max_model_len) is "
                f"{self.max_model_len}; shorten it to at most {self.max_model_len - 1} tokens"
            )
        need = self.num_blocks_for(min(len(ids) + params.max_tokens, self.max_model_len))
        if need > self.num_blocks:
            raise ValueError(
                f"this request needs {need} KV blocks but the pool has {self.num_blocks}; "
                "lower max_tokens or give the engine more KV memory"
            )
        if user is not None and (not isinstance(user, str) or not user):
            raise ValueError("user must be a non-empty string or None")
        request_id = str(request_id) if request_id is not None else uuid.uuid4().hex
        req = Request(request_id, text, ids, params, user)
        if params.structured_outputs is not None:
            req.grammar = self.grammars().compile(params.structured_outputs)
        return req

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids), checked."""
        if isinstance(prompt, str):
            text, ids = prompt, encode(self.tokenizer, prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            # plain ints (the common case) are checked at C speed; anything else one by one
            if (
                min(ids, default=0) < 0 or max(ids, default=0) >= vocab
                if set(map(type, ids)) <= {int}
                else any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids)
            ):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        return text, ids

    def check_forget(self, user) -> None:
        """A forget_user call's user, checked before any engine thread sees it: a non-empty string.
        None names the single-tenant pages that callers without a user share, never one user's."""
        if not isinstance(user, str) or not user:
            raise ValueError("forgetting needs a user id: a non-empty string")

    def check_forget_prompts(self, user, prompts) -> list[list[int]]:
        """A forget_prompts call's arguments, checked: the prompts as lists of token ids, empty ones
        left out."""
        self.check_forget(user)
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in prompts):
            raise ValueError("prompts must be a list of token id lists")
        return [self._prompt_ids(list(p))[1] for p in prompts if len(p)]

    def grammars(self):
        """The structured-output compiler of this model's tokenizer (made once, on first use)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer (dummy weights have none)")
                from chatengine.engine.structured import Grammars  # xgrammar loads only when used

                self._grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
            return self._grammars

    # ---- personas -------------------------------------------------------------------------------
    def persona_prefix_ids(self, system_prompt: str) -> list[int]:
        """Token ids that every conversation starting with this system prompt begins with."""
        system = [{"role": "system", "content": system_prompt}]
        a = apply_chat_template(self.tokenizer, system + [{"role": "user", "content": "a"}])
        b = apply_chat_template(self.tokenizer, system + [{"role": "user", "content": "Zz 9"}])
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return a[:n]

    def register_persona(self, name: str, system_prompt: str) -> list[int]:
        """Make conversations that open with this system prompt share its KV pages across users.
        Returns the persona's prefix ids."""
        if not isinstance(name, str) or not name:
            raise ValueError("a persona needs a non-empty name")
        if not isinstance(system_prompt, str) or not system_prompt.strip():
            raise ValueError(f"persona {name!r} needs a non-empty system prompt")
        ids = self.persona_prefix_ids(system_prompt)
        # a new dict, not an insert: the app registers from its threads while the engine thread
        # iterates the personas (public_prefix_len)
        with self._personas_lock:
            self.personas = {**self.personas, name: ids}
        return ids

    def unregister_persona(self, name: str) -> list[int] | None:
        """Stop sharing this persona's prefix (it became private, or was deleted): requests added
        from now on salt it per user like any other text, so they never hit its public pages.
        Returns its prefix ids (None: no such persona)."""
        with self._personas_lock:
            ids = self.personas.get(name)
            if ids is not None:
                self.personas = {k: v for k, v in self.personas.items() if k != name}
        return ids

    def public_prefix_len(self, prompt_ids: list[int]) -> int:
        """Length of the registered persona prefix this prompt starts with (0: none, all private)."""
        return max((len(p) for p in self.personas.values() if prompt_ids[: len(p)] == p), default=0)
