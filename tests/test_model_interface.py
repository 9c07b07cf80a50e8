"""The model interface and registry (models/interface.py, models/registry.py): models declare what they can do and
the engine reads that, a family is one package plus one registry line, config.json is read once per start."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from openinfer import LLM
from openinfer.kv_cache.spec import PagedCacheSpec, RequestStateSpec
from openinfer.models import registry
from openinfer.models.interface import CausalLM, ModelFamily, ModelTraits

ROOT = Path(__file__).resolve().parent.parent / "openinfer"


@pytest.fixture(scope="module")
def engines(smollm_dir):
    """One engine per kind of model: a plain decoder, DeepSeek-V4, DeepSeek-V4.1 (random weights, tiny pools)."""
    built = {name: LLM(model, device="cpu", num_kv_blocks=16, max_num_seqs=4, load_format="dummy")
             for name, model in (("smollm2", smollm_dir), ("v4", "deepseek-v4-tiny"), ("v41", "deepseek-v41-tiny"))}
    yield built
    for llm in built.values():
        llm.shutdown()


@pytest.mark.parametrize("name, expected", [
    ("smollm2", dict(per_request_state=False, context_bucketed_graphs=False, drafters={"draft_head"},
                     batch_invariant=True, fp8_kv_cache=True)),
    ("v4", dict(per_request_state=True, context_bucketed_graphs=True, drafters={"mtp"}, batch_invariant=False,
                fp8_kv_cache=False)),
    ("v41", dict(per_request_state=True, context_bucketed_graphs=True, drafters={"dspark"}, batch_invariant=False,
                 fp8_kv_cache=False)),
])
def test_traits_say_what_the_model_is(engines, name, expected):
    """Each model states its traits, and they agree with what it declares elsewhere: per-request state iff it
    declares state kinds, a sliding-window layout iff it declares window kinds."""
    runner = engines[name].engine.runner
    model, traits = runner.model, runner.model.traits
    assert isinstance(traits, ModelTraits) and isinstance(model, CausalLM)
    assert {k: (set(v) if k == "drafters" else v) for k, v in
            ((k, getattr(traits, k)) for k in expected)} == expected
    specs = model.cache_specs(runner.dtype)
    assert traits.per_request_state == any(isinstance(s, RequestStateSpec) for s in specs)
    windowed = any(isinstance(s, PagedCacheSpec) and s.window for s in specs)
    assert (traits.sliding_window is not None) == windowed
    assert traits.prefill_modes == (("exact", "yoco") if name == "v41" else ("exact",))


def test_every_tiny_model_belongs_to_the_family_that_matches_its_config():
    for name, (family, tiny) in registry.tiny_models().items():
        assert [f for f in registry.families() if f.matches(tiny.config)][0] is family, name


def test_an_unknown_model_type_is_refused_naming_the_families():
    with pytest.raises(ValueError, match=r"model_type 'mamba' is not supported \(families: .*Llama-family"):
        registry.family_for({"model_type": "mamba"})


def _mentions(needle: str) -> list[str]:
    """file:line of every line of openinfer/ that mentions `needle` (its code and docstrings)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if needle in line.lower():
                found.append(f"{path.relative_to(ROOT)}:{i}")
    return found


def test_a_family_is_one_package_and_one_registry_line():
    """OLMo-2 was added as docs/architecture.md's walk-through says (tests/test_models_tiny.py checks it against
    transformers): outside its own package the code names it on one line, the registry's."""
    outside = [m for m in _mentions("olmo") if not m.startswith("models/olmo2/")]
    assert outside == [f"models/registry.py:{_registry_line('openinfer.models.olmo2')}"]
    assert "openinfer.models.olmo2" in registry.FAMILY_MODULES


def _registry_line(module: str) -> int:
    source = (ROOT / "models" / "registry.py").read_text()
    return next(i for i, line in enumerate(source.splitlines(), 1) if f'"{module}"' in line)


def test_every_family_package_exposes_its_family():
    for module in registry.FAMILY_MODULES:
        family = __import__(module, fromlist=["FAMILY"]).FAMILY
        assert isinstance(family, ModelFamily) and family.name


def test_the_engine_never_probes_a_model():
    """No getattr/hasattr on a model (or anything) in engine/, spec_decode/ and executor/ beyond the named
    exceptions: a capability is a trait the code reads."""
    allowed = {("executor/worker.py", "engine"),            # call_ranks: a method of the engine, by name
               ("executor/engine_core.py", "engine"),       # a call into the engine core, likewise
               ("spec_decode/draft_head.py", "cfg")}         # an HF config or dict while training a head
    probes = []
    for folder in ("engine", "spec_decode", "executor"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
                    target = ast.unparse(node.args[0])
                    if (str(path.relative_to(ROOT)), target) not in allowed:
                        probes.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not probes, probes


def test_config_json_is_read_once_per_start(smollm_dir, monkeypatch):
    """The registry reads a model's config.json and picks its family once; the tokenizer and the build take
    what it read."""
    reads = []
    real = Path.read_text

    def counting(self, *args, **kwargs):
        if self.name == "config.json":
            reads.append(str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting)
    monkeypatch.setattr(json, "load", lambda *a, **k: pytest.fail("config.json read through json.load"))
    llm = LLM(smollm_dir, device="cpu", num_kv_blocks=8, load_format="dummy")
    llm.shutdown()
    assert reads == [str(Path(smollm_dir) / "config.json")]
