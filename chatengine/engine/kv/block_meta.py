"""What identifies a full KV block in every tier: its hash, its parent's, its tokens and its owner."""

from dataclasses import dataclass


@dataclass
class BlockMeta:
    hash: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    owner: bytes = b""  # a tag of the salting user (b"": public / single-tenant)
