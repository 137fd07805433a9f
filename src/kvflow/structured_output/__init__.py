"""Structured output: decoding constrained by a JSON schema, a regex, a list of choices or a
grammar, so that every output parses.

`params.StructuredOutputsParams` says what a request wants (it has no dependencies, so
`sampling_params` can import it); `compiler.GrammarCompiler` turns it into a compiled grammar
off the engine thread, with a time limit and a cache; `manager.StructuredOutputManager` keeps one
matcher per request and fills the token bitmask the sampler applies. The grammar engines
themselves are libraries behind one small interface (`backend.py`): llguidance by default,
xgrammar optionally.
"""
