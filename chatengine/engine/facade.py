"""What LLM and AsyncLLM both offer besides generating: the model's limits, its tokenizer, checks.

This is the door the app comes through: everything here is safe to call from any thread (it reads
settings fixed at start, or validates without touching engine state).
"""

from chatengine.config import EngineConfig
from chatengine.engine.front import EngineFront
from chatengine.engine.llm_engine import LLMEngine
from chatengine.engine.tokenizer import apply_chat_template, encode, encode_parts, template_supports_tools
from chatengine.sampling_params import SamplingParams

# A token spells ~4 characters of prose or code; text longer than 8 per token of context cannot fit,
# and is refused before the tokenizer spends seconds on it.
MAX_CHARS_PER_TOKEN = 8


class EngineFacade:
    front: EngineFront  # the model's limits, tokenizer, validation and personas

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self.front = self.engine.front

    # ---- the model and its limits ---------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self.front.model_id

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens of one sequence."""
        return self.front.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        """Characters of prompt text worth tokenizing: a longer prompt cannot fit the context, and
        callers refuse it before tokenizing (a 4 MB message would hold a thread for seconds)."""
        return self.front.max_model_len * MAX_CHARS_PER_TOKEN

    @property
    def max_n(self) -> int:
        return self.front.config.max_n

    @property
    def max_tokens_limit(self) -> int:
        """The largest max_tokens a request may ask for."""
        return self.front.config.max_tokens_limit or self.front.max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the device KV pool holds at once: no single sequence can grow past it."""
        return self.front.num_blocks * self.front.config.block_size

    @property
    def vocab_size(self) -> int:
        return self.front.model_config.vocab_size

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.front.eos_token_ids)

    @property
    def generation_defaults(self) -> dict:
        """The model's own sampling defaults, by SamplingParams field name (temperature, top_p, top_k,
        repetition_penalty, max_tokens), from its generation_config.json; {} when it sets none."""
        return dict(self.front.model_config.generation_defaults)

    # ---- text -----------------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.front.tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of a raw prompt (no special tokens added; control-token text in it is read as
        control tokens, as a caller rendering its own template means them)."""
        return encode(self.front.tokenizer, text)

    def encode_turn(self, before: str, content: str, after: str) -> list[int]:
        """Token ids of one chat turn: template text (`before`, `after`) with its control tokens
        around `content`, which is always text (control-token text in it stays plain characters)."""
        return encode_parts(self.front.tokenizer, [(before, False), (content, True), (after, False)])

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of one conversation rendered with the model's chat template; `tools` (OpenAI
        function definitions), assistant `tool_calls` and "tool" messages go to the template as is."""
        return apply_chat_template(self.front.tokenizer, messages, add_generation_prompt, tools)

    @property
    def chat_template(self) -> str | None:
        """The model's chat template source (None without a tokenizer or template)."""
        template = getattr(self.front.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("tool_use") or template.get("default")
        return template if isinstance(template, str) else None

    @property
    def supports_tools(self) -> bool:
        """Whether the model's chat template renders tool definitions."""
        return template_supports_tools(self.front.tokenizer)

    def check_request(self, prompt, sampling_params: SamplingParams | None = None, *, user: str | None = None) -> None:
        """Raise the ValueError that generate() would raise for this request, without running it."""
        self.front.make_request(prompt, sampling_params, user=user)

    # ---- personas and figures -------------------------------------------------------------------
    def register_persona(self, name: str, system_prompt: str) -> None:
        """Share the KV pages of conversations opening with this system prompt across users."""
        self.front.register_persona(name, system_prompt)

    def unregister_persona(self, name: str) -> None:
        """Stop sharing a registered persona's prefix (a no-op for an unknown name): requests made
        after this call never hit its shared pages, and those pages leave every tier of the cache."""
        ids = self.front.unregister_persona(name)
        if ids is not None:
            self._drop_public_prefix(ids)

    def _drop_public_prefix(self, prefix_ids: list[int]) -> None:
        self.engine.drop_public_prefix(prefix_ids)

    def stats(self) -> dict:
        return self.engine.stats()
