"""Calls: issuing and waiting (caller), the call table (the one place a
call's fate changes), assembling results, output routing, and the
shared-memory data plane of big payloads."""
