"""Structured output: decoding constrained by a JSON schema, a regex, a list of choices or a
grammar, so that every output parses, or ends with an error that says why it could not.

`params.StructuredOutputsParams` says what a request wants (it has no dependencies, so
`sampling_params` can import it); `compiler.GrammarCompiler` turns it into a compiled grammar
and its first mask off the engine thread, with a time limit and a cache;
`manager.StructuredOutputManager` keeps one matcher per request on the engine side, computes each
request's next masks on mask threads, and hands the engine the step's masks, which travel in the
step to the sampler. The grammar engines themselves are libraries behind one small interface
(`backend.py`): llguidance by default, xgrammar optionally.
"""
