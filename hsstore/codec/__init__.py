"""Chunk codecs, lossy tiers and fp8: how state bytes are encoded and decoded."""
