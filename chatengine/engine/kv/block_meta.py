"""What identifies a full KV block in every tier: its hash, its parent's, its tokens and its owner."""

from dataclasses import dataclass

from chatengine.engine.kv.hashing import tokens_digest


@dataclass
class BlockMeta:
    hash: bytes
    parent: bytes
    token_ids: tuple[int, ...] | None  # None when read from disk: block files keep a digest, not the text
    owner: bytes = b""  # a tag of the salting user (b"": public / single-tenant)
    digest: bytes = b""  # tokens_digest of the tokens (set for blocks read from disk; else made on demand)

    def holds(self, tokens) -> bool:
        """Whether this block's page is the KV of exactly these tokens (a hit's last check)."""
        if self.token_ids is not None:
            return self.token_ids == tuple(tokens)
        return self.digest == tokens_digest(self.hash, tokens)

    def tokens_digest(self) -> bytes:
        """What a block file keeps to verify a hit, in place of the token ids."""
        if self.digest:
            return self.digest
        assert self.token_ids is not None
        return tokens_digest(self.hash, self.token_ids)
