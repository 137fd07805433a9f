"""The grammar compiler's contract, with a stand-in backend whose compiles we control: each spec
compiles once (concurrent askers share it), errors are cached and name what failed, a compile
past the time limit is refused while it finishes in the background for the next asker, and no
spec's compile waits behind another's: slow ones hold their own threads, and a compile that
never got a thread is refused as busy (a retry-later), never blamed, and taken off the queue."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvflow.structured_output.backend import GrammarBackend
from kvflow.structured_output.compiler import GrammarCompiler, GrammarCompilerBusyError
from kvflow.structured_output.params import StructuredOutputsParams


class StandIn(GrammarBackend):
    name = "stand-in"

    def __init__(self) -> None:
        self.compiles: list[str] = []
        self.release = threading.Event()  # every spec without a gate of its own waits for this
        self.release.set()
        self.gates: dict[str, threading.Event] = {}

    def compile(self, spec):
        raise NotImplementedError

    def prepare(self, spec):
        self.compiles.append(spec.text)
        self.gates.get(spec.text, self.release).wait(30)
        if "bad" in spec.text:
            raise ValueError("no such thing")
        return ("compiled", spec.text)

    def matcher(self, compiled):
        raise NotImplementedError


def spec(regex: str):
    return StructuredOutputsParams(regex=regex).spec


@pytest.fixture
def backend():
    return StandIn()


def make(backend, timeout_s=30.0, max_entries=256, **kwargs) -> GrammarCompiler:
    return GrammarCompiler(lambda: backend, timeout_s, max_entries, **kwargs)


def test_one_compile_per_spec(backend):
    compiler = make(backend)
    first = compiler.compile(spec("a+"))
    assert compiler.compile(spec("a+")) is first and backend.compiles == ["a+"]
    assert compiler.compile(spec("b+")) == ("compiled", "b+") and backend.compiles == ["a+", "b+"]


def test_concurrent_askers_share_one_compile(backend):
    compiler = make(backend)
    backend.release.clear()
    results = []
    askers = [threading.Thread(target=lambda: results.append(compiler.compile(spec("x")))) for _ in range(4)]
    for t in askers:
        t.start()
    backend.release.set()
    for t in askers:
        t.join(30)
    assert len(results) == 4 and all(r is results[0] for r in results) and backend.compiles == ["x"]


def test_errors_name_the_constraint_and_are_cached(backend):
    compiler = make(backend)
    for _ in range(2):
        with pytest.raises(ValueError, match="^the regex is invalid or unsupported: no such thing$"):
            compiler.compile(spec("bad"))
    assert backend.compiles == ["bad"]


def test_too_slow_is_refused_then_served_from_the_cache(backend):
    compiler = make(backend, timeout_s=0.05)
    backend.release.clear()
    with pytest.raises(ValueError, match=r"the regex did not compile within 0.05 s .*structured_outputs_compile_timeout"):
        compiler.compile(spec("slow"))
    backend.release.set()  # the compile goes on and lands in the cache
    compiler.submit(spec("slow")).result(30)
    assert compiler.compile(spec("slow")) == ("compiled", "slow") and backend.compiles == ["slow"]


def test_async_waits_without_blocking_the_loop_and_times_out_alike(backend):
    compiler = make(backend, timeout_s=0.2)

    async def main():
        backend.release.clear()
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        with pytest.raises(ValueError, match="did not compile within"):
            await compiler.compile_async(spec("slow"))
        ticker.cancel()
        backend.release.set()
        assert ticks >= 5  # the loop ran while we waited
        # giving up on the wait did not cancel the shared compile
        assert await compiler.compile_async(spec("slow")) == ("compiled", "slow")

    asyncio.run(main())
    assert backend.compiles == ["slow"]


def test_slow_compiles_do_not_hold_up_another_spec(backend):
    compiler = make(backend, timeout_s=5.0)
    for name in ("slow 1", "slow 2", "slow 3"):  # more than the threads a fixed pair would have
        backend.gates[name] = threading.Event()
        compiler.submit(spec(name))
    assert compiler.compile(spec("quick")) == ("compiled", "quick")
    for gate in backend.gates.values():
        gate.set()


def test_a_compile_that_never_got_a_thread_is_busy_not_blamed_and_leaves_the_queue(backend):
    compiler = make(backend, timeout_s=0.2, max_threads=1)
    backend.gates["slow"] = threading.Event()
    hog = threading.Thread(target=lambda: pytest.raises(ValueError, compiler.compile, spec("slow")))
    hog.start()
    while "slow" not in backend.compiles:  # it holds the only thread
        threading.Event().wait(0.01)
    with pytest.raises(GrammarCompilerBusyError, match="the regex was not compiled: every grammar compiler thread "
                                                       "stayed busy .* try again later") as refused:
        compiler.compile(spec("victim"))
    assert "simplify" not in str(refused.value)
    hog.join(30)
    backend.gates["slow"].set()
    compiler.submit(spec("slow")).result(30)
    assert backend.compiles == ["slow"]  # the victim's abandoned compile never ran
    assert compiler.compile(spec("victim")) == ("compiled", "victim")  # and is compiled when asked again


def test_the_cache_is_bounded(backend):
    compiler = make(backend, max_entries=2)
    for regex in ("a", "b", "c", "a"):
        compiler.compile(spec(regex))
    assert backend.compiles == ["a", "b", "c", "a"]  # "a" was the oldest when "c" came
    assert compiler.cached(spec("c")) and not compiler.cached(spec("b"))


def test_the_time_limit_must_be_positive(backend):
    with pytest.raises(ValueError, match="structured_outputs_compile_timeout"):
        make(backend, timeout_s=0)


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of json, regex, choice, grammar or json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": [1]}, "structured_outputs.json must be a JSON schema"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "structured_outputs.choice must be a non-empty list"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true"),
])
def test_params_refuse_bad_shapes_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_params_canonical_text_keeps_property_order():
    a = StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}}).spec
    b = StructuredOutputsParams(json='{"properties": {"b": {}, "a": {}}}').spec
    c = StructuredOutputsParams(json={"properties": {"a": {}, "b": {}}}).spec
    assert a == b and a != c and StructuredOutputsParams(json_object=False, regex="x").spec.kind == "regex"


def test_a_tokenizer_the_library_cannot_read_is_named_as_such_not_blamed_on_the_spec(tmp_path):
    # The tiny models' character tokenizer has a lone Fuse decoder, which llguidance cannot read.
    import tokenizers
    from tiny_models import write_tiny_tokenizer

    from kvflow.structured_output.backends import make_backend

    write_tiny_tokenizer(tmp_path)
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    built = []
    compiler = GrammarCompiler(lambda: built.append(1) or make_backend("guidance", tokenizer, 97, [96]), 30.0)
    for regex in ("a+", "b+"):
        with pytest.raises(ValueError, match="unavailable with this model: the guidance backend cannot read") as error:
            compiler.compile(spec(regex))
        assert "invalid" not in str(error.value)
    assert built == [1]  # the failure is remembered, not rebuilt per request
