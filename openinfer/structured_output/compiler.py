"""GrammarCompilerPool: compiles grammars off the engine's critical path, once per (grammar, tokenizer).

`submit(params)` returns at once with a `concurrent.futures.Future` of the compiled grammar; the work runs
in a small thread pool (xgrammar's C++ compiler releases the GIL, so compilation overlaps the engine's
steps). Futures are cached by the hash of (kind, canonical spec, JSON whitespace mode) — the pool holds
one tokenizer, whose hash is the other half of the key — so N concurrent requests with the same schema
share one compilation, and a later one gets the cached result. A grammar that fails to compile keeps its
error in the cache (the same text fails the same way). A compile still running after `timeout_s` fails
the requests waiting on it (`GrammarTimeoutError`); the C++ call itself cannot be interrupted, so it
finishes in its worker in the background and its result is then cached for later requests.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from openinfer.structured_output.params import StructuredOutputsParams


class GrammarError(ValueError):
    """The schema / regex / grammar / choice cannot be compiled; the message says why."""


class GrammarTimeoutError(GrammarError):
    pass


def tokenizer_info(hf_tokenizer, vocab_size: int, stop_token_ids) -> xgr.TokenizerInfo:
    """xgrammar's view of a `tokenizers.Tokenizer`: the vocabulary by id, its encoding (byte-level BPE,
    SentencePiece byte fallback, ...) detected from the tokenizer's JSON, and the stop tokens."""
    encoded = [""] * vocab_size
    for token, idx in hf_tokenizer.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(hf_tokenizer.to_str())
    return xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=sorted(stop_token_ids) or None,
                             add_prefix_space=meta["add_prefix_space"])


def choice_ebnf(choices) -> str:
    # JSON string escapes are also EBNF string-literal escapes in xgrammar's dialect
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompilerPool:
    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids, num_threads: int = 2,
                 timeout_s: float = 30.0, cache_size: int = 1024, any_whitespace: bool = False):
        self.info = tokenizer_info(hf_tokenizer, vocab_size, stop_token_ids)
        self.tokenizer_hash = hashlib.sha256(hf_tokenizer.to_str().encode()).hexdigest()
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.any_whitespace = any_whitespace
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiles = 0          # compilations started (cache misses)
        self.compile_seconds: list[float] = []

    def cache_key(self, params: StructuredOutputsParams) -> str:
        return hashlib.sha256(f"{params.key}\0{int(self.any_whitespace)}\0{self.tokenizer_hash}".encode()).hexdigest()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar, as a future (done at once on a cache hit). Never blocks."""
        key = self.cache_key(params)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            self.num_compiles += 1
            fut = self._pool.submit(self._compile, params)
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        import time

        t0 = time.perf_counter()
        kind, c = params.kind, self._compiler
        try:
            if kind == "json":
                g = c.compile_json_schema(json.dumps(params.json), any_whitespace=self.any_whitespace)
            elif kind == "json_object":
                g = c.compile_json_schema('{"type": "object"}', any_whitespace=self.any_whitespace)
            elif kind == "regex":
                g = c.compile_regex(params.regex)
            elif kind == "grammar":
                g = c.compile_grammar(params.grammar)
            elif kind == "structural_tag":
                g = c.compile_structural_tag(json.dumps(params.structural_tag))
            else:
                g = c.compile_grammar(choice_ebnf(params.choice))
        except Exception as e:   # xgrammar raises RuntimeError / ValueError with the parser's message
            raise GrammarError(f"invalid {kind} for structured output: {_short(e)}") from None
        self.compile_seconds.append(time.perf_counter() - t0)
        return g

    def compile_blocking(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Submit and wait (bounded by the timeout): raises GrammarError naming the problem."""
        fut = self.submit(params)
        try:
            return fut.result(timeout=self.timeout_s)
        except TimeoutError:
            raise GrammarTimeoutError(f"{params.kind} grammar did not compile within {self.timeout_s:g} s") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _short(e: Exception) -> str:
    """xgrammar's messages start with '[time] /path/file.cc:123: '; keep what the user can act on."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    msg = lines[0] if lines else type(e).__name__
    if msg.startswith("[") and ".cc:" in msg:
        msg = msg.split(": ", 1)[-1]
    return msg


async def wait_compiled(pool: GrammarCompilerPool, params: StructuredOutputsParams) -> None:
    """For servers, before a request is queued: wait for its grammar without blocking the event loop (other
    requests go on), so a grammar that fails to compile is a 400 naming the problem (GrammarError is a
    ValueError) instead of an aborted generation. The engine then finds it in the cache."""
    import asyncio

    fut = pool.submit(params)
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), pool.timeout_s)
    except asyncio.TimeoutError:
        raise GrammarTimeoutError(f"{params.kind} grammar did not compile within {pool.timeout_s:g} s") from None
