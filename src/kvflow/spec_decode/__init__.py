"""Speculative decoding: proposers guess the next tokens, the target verifies them in one pass and
the rejection sampler keeps exactly the target's distribution."""
