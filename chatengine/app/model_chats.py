"""ModelChats: the chats of every served model, each conversation routed to the model it belongs to.

There is one ChatService per served model (its engine, tokenizer, chat template and limits), all over
the one store. A conversation remembers its model (conversations.model) and its turns always go to
that model's ChatService: its stored token ids are that model's, and no other model could read them.
A conversation of a model this server no longer serves stays readable and deletable; its new turns
are refused with the served models named. The UI talks to this as it would to one ChatService.

    chats = ModelChats.build(models, store, personas)   # models: ServedModels; or ModelChats.of(service)
    chats.ids; chats.default_id; chats.for_model(model_id); chats.model_of(user, cid)
    cid = chats.new_conversation(user, persona, model="b")   # None: the default (first) model
    chats.send(user, cid, text, settings)                     # to cid's model, as every turn
"""

from __future__ import annotations

from chatengine.app.chat import ChatService
from chatengine.app.generation import Generation
from chatengine.app.models import ServedModels
from chatengine.app.store import ChatStore, NotFound

__all__ = ["ModelChats", "ModelNotServed"]


class ModelNotServed(ValueError):
    """A conversation's model is not among the models this server serves now."""


class ModelChats:
    def __init__(self, services: dict[str, ChatService]):
        """services: model id -> its ChatService, in order; the first is the default."""
        self.models = ServedModels(services)  # the same exact-match lookup as the API's
        self.default = self.models.default
        self.store = self.default.store
        self.personas, self.default_persona = self.default.personas, self.default.default_persona

    @classmethod
    def build(cls, models: ServedModels, store: ChatStore, personas: dict | None = None, *, catalog=None) -> ModelChats:
        """catalog: a PersonaCatalog that every model's chats share (personas_for, live personas)."""
        return cls(
            {model_id: ChatService(engine, store, personas, catalog=catalog) for model_id, engine in models.items()}
        )

    @classmethod
    def of(cls, service: ChatService | ModelChats) -> ModelChats:
        """As given, or the chats of one ChatService (a server of one model)."""
        return service if isinstance(service, ModelChats) else cls({service.model_id: service})

    @property
    def ids(self) -> list[str]:
        return self.models.ids

    @property
    def default_id(self) -> str:
        return self.models.default_id

    @property
    def engine(self):
        """The default model's engine (what a server of one model has as its only one)."""
        return self.default.engine

    def for_model(self, model_id: str | None) -> ChatService:
        """The ChatService of a served model (None or "": the default); UnknownModel (a ValueError)
        names the served ones. A name from a page is only looked up here, never loaded."""
        return self.models.engine(model_id)

    def model_of(self, user: str, cid: str) -> str:
        """The id of the model ``cid`` talks to (NotFound as the store's); a conversation from before
        models were remembered talks to the default."""
        return self.store.get_conversation(user, cid)["model"] or self.default_id

    def for_conversation(self, user: str, cid: str) -> ChatService:
        """The ChatService of ``cid``'s model, or ModelNotServed: its history is another model's ids."""
        model_id = self.model_of(user, cid)
        if model_id not in self.models:
            raise ModelNotServed(
                f"this chat talks to the model {model_id!r}, which this server does not serve now "
                f"(it serves {', '.join(self.ids)}): start a new chat, or serve that model again"
            )
        return self.models[model_id]

    def _reading(self, user: str, cid: str) -> ChatService:
        """For what only reads or stops (view, attach, stop, delete): the conversation's own service,
        the default when its model is not served (nothing of it runs then)."""
        model_id = self.model_of(user, cid)
        return self.models[model_id] if model_id in self.models else self.default

    # ---- conversations: the store is one, any service lists them ----------------------------------
    def new_conversation(self, user: str, persona: str | None = None, model: str | None = None, **kw) -> str:
        return self.for_model(model).new_conversation(user, persona, **kw)

    def list_conversations(self, user: str, query: str | None = None) -> list[dict]:
        return self.default.list_conversations(user, query)

    def get_conversation(self, user: str, cid: str) -> dict:
        return self.default.get_conversation(user, cid)

    def rename_conversation(self, user: str, cid: str, title: str) -> None:
        self.default.rename_conversation(user, cid, title)

    def delete_conversation(self, user: str, cid: str) -> None:
        self._reading(user, cid).delete_conversation(user, cid)

    def set_pinned(self, user: str, cid: str, pinned: bool) -> None:
        self.default.set_pinned(user, cid, pinned)

    def remember_settings(self, user: str, cid: str, settings, *, touch: bool = True) -> None:
        """Checked against the limits of the chat's own model (a chat whose model is not served
        keeps them as they were: ModelNotServed, a ValueError)."""
        self.for_conversation(user, cid).remember_settings(user, cid, settings, touch=touch)

    def view(self, user: str, cid: str) -> list[dict]:
        return self._reading(user, cid).view(user, cid)

    def switch(self, user: str, cid: str, msg_id: str, step: int = 0, *, to: int | None = None) -> str:
        return self._reading(user, cid).switch(user, cid, msg_id, step, to=to)

    # ---- turns: always on the conversation's model -----------------------------------------------
    def send(self, user: str, cid: str, text: str, settings=None) -> Generation:
        return self.for_conversation(user, cid).send(user, cid, text, settings)

    def edit(self, user: str, cid: str, user_msg_id: str, text: str, settings=None) -> Generation:
        return self.for_conversation(user, cid).edit(user, cid, user_msg_id, text, settings)

    def regenerate(self, user: str, cid: str, msg_id: str | None = None, settings=None) -> Generation:
        return self.for_conversation(user, cid).regenerate(user, cid, msg_id, settings)

    def continue_reply(self, user: str, cid: str, msg_id: str, settings=None) -> Generation:
        return self.for_conversation(user, cid).continue_reply(user, cid, msg_id, settings)

    async def stop(self, user: str, cid: str, timeout: float = 10.0) -> bool:
        return await self._reading(user, cid).stop(user, cid, timeout)

    def attach(self, user: str, cid: str) -> Generation | None:
        return self._reading(user, cid).attach(user, cid)

    def is_generating(self, user: str, cid: str) -> bool:
        try:
            return self._reading(user, cid).is_generating(user, cid)
        except NotFound:  # deleted meanwhile (or never this user's): nothing is written there
            return False
