"""KV pages: the device pool (block manager), block hashes, and the host and disk tiers behind it."""
